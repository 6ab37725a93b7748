"""End to end through ``hilum up --engine torch`` (four CPU reference engines in two NVLink domains):
requests of the Azure conversation trace through the HTTP API, streamed and not, with migrations forced
inside and across domains while they decode; every response is complete and identical to the same request
served without migration; the gateway's metrics count the migrations; a client that disconnects has its
blocks freed; no process is left after Ctrl-C.

Size (2 shared CPU cores): the first :data:`NUM_REQUESTS` requests of ``azure-conv`` at the trace's
arrival times compressed :data:`RATE_SCALE` times, prompts clipped to :data:`MAX_PROMPT_TOKENS` tokens and
outputs to :data:`MAX_OUTPUT_TOKENS` (the tiny model computes every token for real), each sent twice: once
while the test migrates it (phase A: every request once inside its domain, then once across), once
untouched (phase B, the reference: its responses must say 0 migrations). Instances hold 1024 KV blocks so
that the domain schedulers see no reason to rebalance the reference run by themselves.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from up_harness import UpProcess, idle_load, running_up, wait_load

from hilum_proto.v1 import llumlet_pb2 as lpb
from llumlet.client import LlumletClient
from sim.traces import load_trace

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

NUM_REQUESTS = 200
RATE_SCALE = 10.0  # 200 requests over 61 s of the trace -> 6 s
MAX_PROMPT_TOKENS = 128
MAX_OUTPUT_TOKENS = 32
MODEL = "llama-2-7b"  # the topology's name; the engine is the tiny seeded Llama
ATTEMPT_BASE = 1_000_000  # above any attempt a domain scheduler uses (they start at the etcd revision)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("up-torch")
    with running_up(tmp, "torch", ["--min-step-s", "0.01"], timeout_s=300, kv_blocks=1024) as cluster:
        yield cluster


def requests_of_trace() -> list[tuple[float, dict[str, Any]]]:
    """(arrival s, request body) of the trace's first requests."""
    trace = load_trace("azure-conv", max_requests=NUM_REQUESTS, rate_scale=RATE_SCALE)
    rng = random.Random(7)
    out = []
    for i, r in enumerate(trace.requests):
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": [rng.randrange(3, 512) for _ in range(min(r.prompt_tokens, MAX_PROMPT_TOKENS))],
            "max_tokens": min(r.output_tokens, MAX_OUTPUT_TOKENS),
            "return_token_ids": True,
            "stream": i % 2 == 0,
        }
        if i % 3 == 0:  # seeded sampling: the random generator's state migrates too
            body.update(temperature=0.8, top_p=0.9, seed=100 + i)
        else:
            body.update(temperature=0.0, ignore_eos=True)
        out.append((r.arrival_s, body))
    return out


async def replay(session: aiohttp.ClientSession, url: str, timed: list[tuple[float, dict[str, Any]]]) -> list[Any]:
    """Send each body at its arrival time; the responses in order."""

    async def one(at_s: float, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(at_s)
        return await send(session, url, body)

    return list(await asyncio.gather(*(one(t, b) for t, b in timed)))


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request; returns {token_ids, text, finish_reason, hilum} from either response form."""
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not body["stream"]:
            out = await resp.json()
            choice = out["choices"][0]
            return {
                "token_ids": choice["token_ids"],
                "text": choice["text"],
                "finish_reason": choice["finish_reason"],
                "hilum": out["hilum"],
            }
        ids: list[int] = []
        text, finish, ext = "", None, {}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            ids += choice.get("token_ids", [])
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            ext = event.get("hilum", ext)
        return {"token_ids": ids, "text": text, "finish_reason": finish, "hilum": ext}


class Migrator:
    """Moves every running request twice: once inside its domain and once across domains, in either order."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.domains = info["instance_domains"]
        self.clients = {i: LlumletClient(a) for i, a in info["llumlets"].items()}
        self.seen: set[str] = set()
        self.tasks: list[asyncio.Task[None]] = []
        self.committed = {"intra": 0, "cross": 0}
        self.attempt = ATTEMPT_BASE
        self.rng = random.Random(11)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for iid, client in self.clients.items():
                load = await client.get_load()
                for r in load.running:
                    if r.in_decode and r.request_id not in self.seen:
                        self.seen.add(r.request_id)
                        self.tasks.append(asyncio.create_task(self.drive(r.request_id, iid, len(self.seen) % 2 == 0)))
            await asyncio.sleep(0.03)
        await asyncio.gather(*self.tasks)

    async def move(self, rid: str, src: str, dst: str) -> bool:
        self.attempt += 1
        rep = await self.clients[src].migrate_out(rid, self.clients[dst].address, self.attempt, dst_instance_id=dst)
        if rep.outcome == lpb.MIGRATION_COMMITTED:
            self.committed["cross" if self.domains[src] != self.domains[dst] else "intra"] += 1
            return True
        return False

    async def drive(self, rid: str, here: str, cross_first: bool) -> None:
        """Two moves of one request: every other request crosses domains first, the rest move inside first
        (a request may finish before its second move; alternating keeps both kinds common on a loaded machine)."""
        kinds = ("cross", "intra") if cross_first else ("intra", "cross")
        for n, kind in enumerate(kinds):
            if n:
                await asyncio.sleep(self.rng.uniform(0.05, 0.3))
            same = kind == "intra"
            there = self.rng.choice(
                [i for i in self.domains if i != here and (self.domains[i] == self.domains[here]) == same]
            )
            if await self.move(rid, here, there):
                here = there

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


def metric(page: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", page, re.M)
    assert m is not None, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_migrated_responses_equal_unmigrated_ones(up: UpProcess) -> None:
    timed = requests_of_trace()
    bodies = [b for _, b in timed]

    async def main() -> None:
        migrator = Migrator(up.info)
        async with aiohttp.ClientSession() as session:
            stop = asyncio.Event()
            driving = asyncio.create_task(migrator.run(stop))
            moved = await replay(session, up.url, timed)  # phase A
            stop.set()
            await driving
            await migrator.close()
            assert await wait_load(up.info, idle_load(up.info)) == idle_load(up.info)
            reference = await replay(session, up.url, timed)  # phase B
            async with session.get(up.url + "/metrics") as resp:
                page = await resp.text()

        for body, a, b in zip(bodies, moved, reference, strict=True):
            assert b["hilum"]["migrations"] == 0  # served without migration
            assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
            assert a["finish_reason"] == b["finish_reason"]
            if body.get("ignore_eos"):
                assert len(a["token_ids"]) == body["max_tokens"] and a["finish_reason"] == "length"
        moves = [m for a in moved for m in a["hilum"]["moves"]]
        intra = sum(1 for m in moves if not m["cross_domain"])
        cross = sum(1 for m in moves if m["cross_domain"])
        assert migrator.committed["intra"] >= NUM_REQUESTS // 4, migrator.committed
        # half the requests cross first, half 50-300 ms after an intra-domain move (on a loaded machine many end
        # before their second move: 19 of 200 crossed in one CI run when every request moved inside first)
        assert migrator.committed["cross"] >= NUM_REQUESTS // 4, migrator.committed
        assert intra >= migrator.committed["intra"] and cross >= migrator.committed["cross"]
        assert sum(1 for a in moved if a["hilum"]["migrations"] > 0) >= NUM_REQUESTS // 2
        # the gateway counted each migration it saw in a token stream, and nothing else
        assert metric(page, "hilum_gateway_migrations_total", '{scope="intra_domain"}') == intra
        assert metric(page, "hilum_gateway_migrations_total", '{scope="cross_domain"}') == cross
        assert metric(page, "hilum_gateway_migration_downtime_seconds_count", '{scope="cross_domain"}') >= 1
        assert metric(page, "hilum_gateway_requests_total", '{endpoint="completions",outcome="ok"}') == 2 * len(bodies)

    asyncio.run(main())


def test_disconnect_mid_stream_frees_the_blocks(up: UpProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            body = {
                "model": MODEL,
                "prompt": "z" * 200,
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0.0,
            }
            resp = await session.post(up.url + "/v1/completions", json=body)
            first = json.loads((await resp.content.readuntil(b"\n\n"))[6:])
            await resp.content.readuntil(b"\n\n")
            holder = first["hilum"]["instance_id"]
            async with LlumletClient(up.info["llumlets"][holder]) as client:
                load = await client.get_load()
            assert [r.request_id for r in load.running] == [first["hilum"]["request_id"]]
            assert load.used_blocks >= 13  # ceil(201 / 16) blocks for the prompt and the first token
            resp.close()  # the client goes away mid-stream
        assert await wait_load(up.info, idle_load(up.info), timeout_s=15) == idle_load(up.info)

    asyncio.run(main())
