"""Drain an instance, then a whole domain, of a real ``hilum up --engine sim`` cluster while streamed requests
run: each empties by migration, ``hilumctl drain --wait`` returns, ``hilumctl requests`` (a real process)
shows nothing left on the target, and every request still ends with all its tokens, in order.

Eight requests of 200 prompt tokens and 1200 output tokens; every engine step lasts at least 20 ms
(``--min-step-s 0.02``), so each request runs >= 24 s, longer than both drains (a few seconds each). KV per
request: ceil((200 + 1200) / 16) = 88 blocks; 8 x 88 = 704 blocks fit on the two instances of the domain
that stays (512 blocks each).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from up_harness import REPO, start_up

pytestmark = pytest.mark.slow

MODEL = "llama-2-7b"
N_REQUESTS = 8
PROMPT_TOKENS = 200  # the sim engine's tokenizer: one token per character
MAX_TOKENS = 1200


async def hilumctl(coordinator: str, *argv: str) -> tuple[int, str, str]:
    """``python -m hilum_cli.ctl --coordinator C ARGV...`` as a process: (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hilum_cli.ctl", "--coordinator", coordinator, *argv,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def running_on(coordinator: str) -> dict[str, str]:
    """request id -> instance id, from ``hilumctl requests --json``."""
    rc, out, err = await hilumctl(coordinator, "requests", "--json")
    assert rc == 0, err
    return {r["request_id"]: r["instance_id"] for r in json.loads(out)["requests"]}


async def stream(session: aiohttp.ClientSession, url: str, k: int, started: asyncio.Queue[str]) -> dict[str, Any]:
    """One streamed completion: its request id goes to ``started`` at the first chunk; returns the token ids
    and the last chunk's ``hilum`` extension."""
    body = {
        "model": MODEL, "prompt": chr(ord("a") + k) * PROMPT_TOKENS, "max_tokens": MAX_TOKENS, "stream": True,
        "return_token_ids": True,
    }  # fmt: skip
    ids: list[int] = []
    last: dict[str, Any] = {}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        while True:
            event = (await resp.content.readuntil(b"\n\n")).decode().strip()
            assert event.startswith("data: "), event
            if event == "data: [DONE]":
                break
            chunk = json.loads(event[6:])
            if not last:
                await started.put(chunk["hilum"]["request_id"])
            last = chunk
            ids.extend(chunk["choices"][0].get("token_ids", []))
    return {"ids": ids, "finish_reason": last["choices"][0]["finish_reason"], "hilum": last["hilum"]}


def test_drain_an_instance_then_its_domain_loses_no_request(tmp_path: Path) -> None:
    up = start_up(tmp_path, "sim", ["--min-step-s", "0.02"], kv_blocks=512)
    coord, domain_of = up.info["coordinator"], up.info["instance_domains"]
    try:

        async def main() -> None:
            started: asyncio.Queue[str] = asyncio.Queue()
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                tasks = [asyncio.create_task(stream(session, up.url, k, started)) for k in range(N_REQUESTS)]
                rids = {await asyncio.wait_for(started.get(), 30) for _ in range(N_REQUESTS)}
                where = await running_on(coord)
                assert set(where) == rids  # all running (none queued: 704 of 2048 blocks)
                first = dict(where)

                # 1. the instance holding the most requests
                instance = Counter(where.values()).most_common(1)[0][0]
                domain = domain_of[instance]
                t0 = time.monotonic()
                rc, out, err = await hilumctl(
                    coord, "drain", instance, "--wait", "--timeout", "60", "--interval", "0.2"
                )
                assert rc == 0, err
                assert f"instance {instance} is empty" in out and "safe to stop it" in out
                instance_drain_s = time.monotonic() - t0
                where = await running_on(coord)
                assert set(where) == rids, "a request finished (or was lost) during the instance drain"
                assert instance not in where.values()

                # 2. its whole domain: everything moves to the other domain
                t0 = time.monotonic()
                rc, out, err = await hilumctl(
                    coord, "drain", domain, "--wait", "--timeout", "60", "--interval", "0.2", "--json"
                )
                assert rc == 0, err
                wait = json.loads(out)["wait"]
                assert (wait["empty"], wait["num_running"], wait["num_waiting"]) == (True, 0, 0)
                domain_drain_s = time.monotonic() - t0
                where = await running_on(coord)
                assert set(where) == rids, "a request finished (or was lost) during the domain drain"
                assert {domain_of[i] for i in where.values()} == set(domain_of.values()) - {domain}

                results = await asyncio.gather(*tasks)
                print(f"instance drain {instance_drain_s:.1f} s, domain drain {domain_drain_s:.1f} s")

            for r in results:  # no request lost: all tokens, in order (the sim emits 0, 1, 2, ...)
                assert r["ids"] == list(range(MAX_TOKENS)), r["hilum"]
                assert r["finish_reason"] == "length"
                assert domain_of[r["hilum"]["instance_id"]] != domain
            for r in results:  # each request that started in the drained domain moved out of it by migration
                rid, moves = r["hilum"]["request_id"], r["hilum"]["moves"]
                if domain_of[first[rid]] == domain:
                    assert r["hilum"]["migrations"] == len(moves) >= 1
                    assert moves[0]["src_instance_id"] == first[rid]
                if first[rid] == instance:
                    assert not moves[0]["cross_domain"]  # an instance drain moves inside the domain first
            assert {r["hilum"]["request_id"] for r in results} == rids
            assert await running_on(coord) == {}

            for target in (instance, domain):
                rc, out, err = await hilumctl(coord, "undrain", target)
                assert (rc, out.strip()) == (0, f"{'instance' if target == instance else 'domain'} {target} is "
                                                "no longer draining"), err  # fmt: skip
            rc, out, err = await hilumctl(coord, "requests", "--json")
            assert rc == 0, err
            assert [i["draining"] for i in json.loads(out)["instances"]] == [False] * 4

        asyncio.run(main())
    finally:
        up.stop()
