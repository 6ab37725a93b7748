"""``hilum up --engine sim`` as a real process: the cluster serves OpenAI requests (streamed and not),
every bad input is a 400 that leaves the cluster's load unchanged, a client that disconnects mid-stream
has its request's blocks freed, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from up_harness import TOPOLOGY, UpProcess, alive, cluster_load, idle_load, start_up, wait_load

from hilum_cli.bench import run_bench
from hilum_cli.main import build_parser

pytestmark = pytest.mark.slow

MODEL = "llama-2-7b"  # context 4096 tokens; each instance holds 128 blocks x 16 = 2048 KV tokens


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    cluster = start_up(tmp_path_factory.mktemp("up-sim"), "sim")
    try:
        yield cluster
    finally:
        cluster.stop()


BAD: list[tuple[str, Any, str]] = [
    ("/v1/completions", b'{"model": "llama-2-7b", "prompt": ', "not valid JSON"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt is empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}]}, "prompt is empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, "max_tokens must be >= 1, got -5"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 7.5}, "max_tokens must be an integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, "larger than the whole context"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 4000, "max_tokens": 200}, "exceeds the context"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 3000, "max_tokens": 10}, "larger than any instance"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 2000, "max_tokens": 100}, "needs 2099 KV tokens"),
]


def test_bad_inputs_are_400_and_leave_the_load_unchanged(up: UpProcess) -> None:
    async def main() -> None:
        assert await wait_load(up.info, idle_load(up.info)) == idle_load(up.info)
        async with aiohttp.ClientSession() as session:
            for path, body, words in BAD:
                kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
                async with session.post(up.url + path, **kwargs) as resp:
                    assert resp.status == 400, body
                    assert words in (await resp.json())["error"]["message"]
            unknown = {"model": "llama-3-405b", "prompt": "hi"}  # OpenAI's answer: 404 model_not_found
            async with session.post(up.url + "/v1/completions", json=unknown) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
            async with session.get(up.url + "/metrics") as resp:
                page = await resp.text()
        assert await cluster_load(up.info) == idle_load(up.info)
        assert 'outcome="bad_request"} 10.0' in page  # completions; the chat one is counted apart

    asyncio.run(main())


def test_completions_streamed_and_not(up: UpProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "return_token_ids": True}
            async with session.post(up.url + "/v1/completions", json=body) as resp:
                whole = await resp.json()
            assert whole["choices"][0]["finish_reason"] == "length"
            # the sim engine has no model: it emits its sequence numbers as token ids
            assert whole["choices"][0]["token_ids"] == list(range(12))
            assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
            assert whole["hilum"]["domain_id"] in ("dom-a", "dom-b")
            async with session.post(up.url + "/v1/completions", json={**body, "stream": True}) as resp:
                events = [line for line in (await resp.text()).split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            ids = [t for e in events[:-1] for t in json.loads(e[6:])["choices"][0].get("token_ids", [])]
            assert ids == list(range(12))
        assert await wait_load(up.info, idle_load(up.info)) == idle_load(up.info)

    asyncio.run(main())


def test_client_disconnect_mid_stream_frees_the_blocks(up: UpProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "y" * 600, "max_tokens": 1400, "stream": True}
            resp = await session.post(up.url + "/v1/completions", json=body)
            first = json.loads((await resp.content.readuntil(b"\n\n"))[6:])
            rid = first["hilum"]["request_id"]
            await resp.content.readuntil(b"\n\n")
            load = await cluster_load(up.info)
            holder = next(i for i in up.info["llumlets"] if load[i][0] == 1)
            assert load[holder][1] >= 38  # 600 prompt tokens: ceil(601 / 16) = 38 blocks at least
            assert rid in load[up.info["instance_domains"][holder]]
            resp.close()  # the client goes away mid-stream
        # the gateway notices at its next write to the closed connection (30 s: on a loaded machine 10 s passed)
        assert await wait_load(up.info, idle_load(up.info), timeout_s=30.0) == idle_load(up.info)

    asyncio.run(main())


def test_client_gone_while_waiting_for_a_whole_response_frees_the_blocks(up: UpProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "w" * 300, "max_tokens": 1500}
            with pytest.raises(TimeoutError):  # the client gives up and closes the connection
                await session.post(up.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1.0))
            aborted = 'hilum_gateway_requests_total{endpoint="completions",outcome="aborted"}'
            deadline = time.monotonic() + 30.0  # the gateway notices the closed connection on its own time
            while True:
                async with session.get(up.url + "/metrics") as resp:
                    page = await resp.text()
                if aborted in page or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        assert aborted in page
        assert await wait_load(up.info, idle_load(up.info)) == idle_load(up.info)

    asyncio.run(main())


def test_bench_replays_a_trace_against_the_cluster(up: UpProcess, tmp_path: Path) -> None:
    topo = up.run_dir / "topology.yaml"  # the run dir's, as hilum up prints it: its cluster.json is beside it
    assert topo.read_text() == TOPOLOGY and up.info["engine"] == "sim" and up.info["time_scale"] == 1.0
    argv = ["bench", "--url", up.url, "--rate-scale", "8", "--max-requests", "12", "--compare-sim", str(topo)]
    ns = build_parser().parse_args([*argv, "--timeout", "60", "--out", str(tmp_path / "out")])  # the real options
    out, err = io.StringIO(), io.StringIO()
    assert run_bench(ns, out=out, err=err) == 0, err.getvalue()
    latency, rest = out.getvalue().split("migrations and cost")  # two tables, as hilum sim prints
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in latency.splitlines()]
    rows = {c[0]: c for c in cells if len(c) > 4}
    assert rows["live"][1:4] == ["12", "12", "0"]  # requests, done, refused
    assert "12 requests of azure-conv" in err.getvalue() and "0 clipped" in err.getvalue()
    assert "warning" not in err.getvalue()  # a time scale of 1: the latencies compare
    assert rows["sim: hilum"][1:4] == ["12", "12", "0"]
    assert "mig" in rest and "live" in rest and "sim: hilum" in rest
    assert (tmp_path / "out" / "results.json").exists()


def _ignore_sigint() -> None:  # as a non-interactive shell starts a background job (`hilum up &`)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_ends_open_streams_removes_the_run_dir_and_leaves_no_process(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cluster = start_up(tmp_path, "sim", own_run_dir=False, env={"TMPDIR": str(tmp)}, preexec_fn=_ignore_sigint)
    pids = cluster.info["pids"]
    assert len(pids) == 1 + 1 + 4 + 2 + 1  # etcd, coordinator, llumlets, domain schedulers, gateway
    assert all(alive(p) for p in pids)
    run_dir = cluster.run_dir
    assert run_dir.parent == tmp and run_dir.name.startswith("hilum-up-")
    assert (run_dir / "topology.yaml").read_text() == TOPOLOGY

    async def stream_across_ctrl_c() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            body = {"model": MODEL, "prompt": "s" * 300, "max_tokens": 1500, "stream": True}
            async with session.post(cluster.url + "/v1/completions", json=body) as resp:
                await resp.content.readuntil(b"\n\n")  # it runs
                cluster.proc.send_signal(signal.SIGINT)  # Ctrl-C, although SIGINT was inherited as ignored
                events = []
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                return events

    events = asyncio.run(stream_across_ctrl_c())
    assert "error" in events[-1] and "the gateway is shutting down" in events[-1]["error"]["message"], events[-1]
    err = cluster.stop()
    assert cluster.proc.returncode == 0, err
    said = [line.removeprefix("hilum up: ") for line in err.splitlines() if line.startswith("hilum up: ")]
    starts = [line.split(";")[0] for line in said if line.startswith("starting ")]
    assert starts == [
        f"starting etcd on {cluster.info['etcd']}",
        "starting the coordinator",
        "starting 4 llumlets (sim engine: simulated GPUs)",
        "starting 2 domain schedulers",
        f"starting the gateway on {cluster.url}",
    ]
    assert said[-3:] == ["stopping ...", "stopped; no process left", f"removed the run directory {run_dir}"]
    assert [p for p in pids if alive(p)] == []
    assert list(tmp.iterdir()) == []  # no hilum-up-* directory left behind


def test_keep_run_dir_keeps_the_temporary_run_dir_and_says_so(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cluster = start_up(tmp_path, "sim", ["--keep-run-dir"], own_run_dir=False, env={"TMPDIR": str(tmp)})
    run_dir = cluster.run_dir
    assert run_dir.parent == tmp and run_dir.name.startswith("hilum-up-")
    said = next(line for line in cluster.printed.splitlines() if line.startswith("  run dir "))
    assert said == f"  run dir       {run_dir}   (logs, topology.yaml, cluster.json; kept)"  # not "removed at exit"
    err = cluster.stop()
    assert cluster.proc.returncode == 0, err
    assert (run_dir / "topology.yaml").read_text() == TOPOLOGY and (run_dir / "cluster.json").exists()
