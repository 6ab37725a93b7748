"""``hilum up`` as a supervisor (a real process, ``--engine sim``, two coordinators): a child killed with
SIGKILL is restarted on its ports and counted, the streams of a crashed llumlet end with an error event
(not a hang; resuming is off here: ``resume.max_replays: 0``, test_up_resume.py has it on), a killed leader is
followed by a leader again, a killed domain scheduler serves again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from up_harness import TOPOLOGY, UpProcess, running_up

from hilum_cli.ctl import main as hilumctl
from llumlet.client import LlumletClient

pytestmark = pytest.mark.slow

MODEL = "llama-2-7b"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hilum.yaml"
# the example configuration with resuming off: a crashed llumlet's streams end with an error event
CONFIG_TEXT = EXAMPLE.read_text().replace("  max_replays: 3 ", "  max_replays: 0 ")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    run_dir = tmp_path_factory.mktemp("up-supervisor")
    config = run_dir / "resume-off.yaml"
    config.write_text(CONFIG_TEXT)
    extra = ["--coordinators", "2", "--config", str(config)]
    with running_up(run_dir, "sim", extra) as cluster:
        yield cluster


def _kill(up: UpProcess, name: str) -> int:
    pid = int(up.read_info()["processes"][name]["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


async def _events(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """The JSON events of an SSE response until [DONE] or the end of the body."""
    out = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))
    return out


def test_the_run_dir_holds_the_topology_and_configuration_it_serves(up: UpProcess) -> None:
    info = up.read_info()
    assert info["topology_file"] == str(up.run_dir / "topology.yaml")
    assert (up.run_dir / "topology.yaml").read_text() == TOPOLOGY  # the --topology file, copied
    assert info["config_file"] == str(up.run_dir / "hilum.yaml")
    assert (up.run_dir / "hilum.yaml").read_text() == CONFIG_TEXT != EXAMPLE.read_text()
    for name, process in info["processes"].items():  # every hilum process reads both
        if name != "etcd":
            argv = Path(f"/proc/{process['pid']}/cmdline").read_bytes().split(b"\0")
            assert [b"--topology", str(up.run_dir / "topology.yaml").encode()] == argv[argv.index(b"--topology") :][:2]
            assert [b"--config", str(up.run_dir / "hilum.yaml").encode()] == argv[argv.index(b"--config") :][:2]
    assert len(info["coordinators"]) == 2 and set(info["processes"]) >= {"coordinator-coord-0", "coordinator-coord-1"}


def test_a_crashed_llumlet_is_restarted_and_its_streams_end_with_an_error(up: UpProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            body = {"model": MODEL, "prompt": "z" * 300, "max_tokens": 1500, "stream": True}
            resp = await session.post(up.url + "/v1/completions", json=body)
            first = json.loads((await resp.content.readuntil(b"\n\n"))[6:])
            instance = first["hilum"]["instance_id"]
            name = f"llumlet-{instance}"
            old_pid = _kill(up, name)
            t0 = time.monotonic()
            events = await _events(resp)  # ends: an error event, then [DONE]
            took = time.monotonic() - t0
            resp.close()
            assert "error" in events[-1], events[-1]
            message = events[-1]["error"]["message"]
            assert f"at {up.info['llumlets'][instance]} stopped (UNAVAILABLE" in message, message
            assert "the request is lost; not resumed: resuming is off" in message, message
            assert message.count(first["hilum"]["request_id"]) == 1, message  # it named the request twice
            assert took < 30
            err = await asyncio.to_thread(up.wait_stderr, f"{name} serves again", 60)
            assert (
                f"{name} (pid {old_pid}) was killed by SIGKILL; restarting it in 0.5 s (restart 1 of at most 5" in err
            )
            process = up.read_info()["processes"][name]
            assert process["restarts"] == 1 and process["pid"] != old_pid
            async with LlumletClient(up.info["llumlets"][instance]) as client:  # on its old address
                assert (await client.get_load()).num_requests == 0  # the lost request is gone with the old one
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8}
            async with session.post(up.url + "/v1/completions", json=body) as after:
                assert after.status == 200 and (await after.json())["choices"][0]["finish_reason"] == "length"

    asyncio.run(main())


def _leader(up: UpProcess) -> tuple[str, int] | None:
    """(leader id, fencing token) as a replica says, or None while nobody leads."""
    argv = ["--coordinator", ",".join(up.info["coordinators"].values()), "--json", "status"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = hilumctl(argv, env={})
    if rc != 0:
        return None
    st = json.loads(buf.getvalue())
    return (st["leader_id"], st["fencing_token"]) if st["leader_id"] else None


def _until(read: Any, ok: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not ok(value := read()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_a_killed_leader_is_followed_by_a_leader(up: UpProcess) -> None:
    leader = _until(lambda: _leader(up), lambda v: v is not None, 30)
    assert leader is not None
    leader_id, token = leader
    _kill(up, f"coordinator-{leader_id}")
    up.wait_stderr(f"coordinator-{leader_id} serves again", 60)
    after = _until(lambda: _leader(up), lambda v: v is not None and v[1] > token, 30)
    assert after is not None and after[1] > token, after  # a new term, with a larger fencing token


def test_a_killed_domain_scheduler_serves_again_at_once(up: UpProcess) -> None:
    t0 = time.monotonic()
    _kill(up, "rack-dom-a")
    up.wait_stderr("rack-dom-a serves again", 60)
    # it takes over its own registration instead of waiting for the old lease (10 s TTL) to expire
    assert time.monotonic() - t0 < 8
    assert up.read_info()["processes"]["rack-dom-a"]["restarts"] == 1
