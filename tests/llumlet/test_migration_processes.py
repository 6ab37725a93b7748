"""Process deaths during live migration, with real llumlet processes (sim backend, ``python -m llumlet``).

- the source dies during pre-copy: the client gets a clear error for that request, and the destination's
  reservation is released by expiry;
- the destination dies during pre-copy: the migration aborts and the request finishes on the source;
- the destination dies after the commit: the request is lost with a clear error, the source holds nothing.

No token is lost or repeated before the end (the sim streams are 0, 1, 2, ...).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.client import LlumletClient
from llumlet.engine.types import SamplingParams
from llumlet.procs import LlumletProcess
from llumlet.sink import TokenCollector

# 8 MiB blocks (Llama-2-7B fp16, 16 tokens): 300 prompt tokens = 19 blocks = 160 MiB; at 80 MB/s stage 0 lasts ~2 s.
SLOW_CAP_BYTES_PER_S = 80e6
ARGS = ["--num-blocks", "512", "--time-scale", "1.0", "--reservation-expiry-s", "1.0"]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[LlumletProcess, LlumletProcess]]:
    a = LlumletProcess("a", ARGS, tmp_path / "a.log")
    b = LlumletProcess("b", ARGS, tmp_path / "b.log")
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


def run(body: Callable[[TokenCollector, LlumletClient, LlumletClient], Awaitable[None]], a: str, b: str) -> None:
    async def main() -> None:
        col = TokenCollector()
        await col.start()
        ca, cb = LlumletClient(a), LlumletClient(b)
        col.watch(a)
        col.watch(b)
        try:
            await asyncio.wait_for(body(col, ca, cb), 30)
        finally:
            await ca.close()
            await cb.close()
            await col.stop()

    asyncio.run(main())


async def submit_and_decode(col: TokenCollector, client: LlumletClient, rid: str, max_tokens: int) -> None:
    col.expect(rid, client.address)
    reply = await client.submit(rid, col.address, SamplingParams(max_tokens=max_tokens), prompt_tokens=300)
    assert reply.accepted, reply.reason
    while len(col.get(rid).token_ids) < 2:
        await asyncio.sleep(0.01)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return False


def test_source_dies_during_pre_copy(pair: tuple[LlumletProcess, LlumletProcess]) -> None:
    a, b = pair

    async def body(col: TokenCollector, ca: LlumletClient, cb: LlumletClient) -> None:
        await submit_and_decode(col, ca, "r", max_tokens=3000)
        move = asyncio.ensure_future(ca.migrate_out("r", b.address, 1, rate_cap_bytes_per_s=SLOW_CAP_BYTES_PER_S))

        async def reserved() -> bool:
            return (await cb.get_load()).reserved_blocks > 0

        assert await until(reserved, 5)
        a.kill()  # mid stage 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await move
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        got = await col.wait("r", 5)
        assert got.finish_reason == "error" and f"instance a at {a.address} stopped" in got.error
        assert "the request is lost" in got.error
        assert got.token_ids == tuple(range(len(got.token_ids)))  # nothing lost or repeated before the end

        async def released() -> bool:
            load = await cb.get_load()
            return (load.reserved_blocks, load.num_reservations, load.used_blocks) == (0, 0, 0)

        assert await until(released, 4), "the destination did not release the orphaned reservation"

    run(body, a.address, b.address)


def test_destination_dies_during_pre_copy(pair: tuple[LlumletProcess, LlumletProcess]) -> None:
    a, b = pair

    async def body(col: TokenCollector, ca: LlumletClient, cb: LlumletClient) -> None:
        await submit_and_decode(col, ca, "r", max_tokens=150)
        move = asyncio.ensure_future(ca.migrate_out("r", b.address, 1, rate_cap_bytes_per_s=SLOW_CAP_BYTES_PER_S))

        async def reserved() -> bool:
            return (await cb.get_load()).reserved_blocks > 0

        assert await until(reserved, 5)
        b.kill()
        rep = await move
        assert rep.outcome == pb.MIGRATION_ABORTED and "broke" in rep.reason
        got = await col.wait("r", 15)
        assert got.error == "" and got.token_ids == tuple(range(150)) and got.epoch == 0

        async def idle() -> bool:
            load = await ca.get_load()
            return (load.used_blocks, load.num_requests, load.num_migrations_out) == (0, 0, 0)

        assert await until(idle, 3)

    run(body, a.address, b.address)


def test_destination_dies_after_the_commit(pair: tuple[LlumletProcess, LlumletProcess]) -> None:
    a, b = pair

    async def body(col: TokenCollector, ca: LlumletClient, cb: LlumletClient) -> None:
        await submit_and_decode(col, ca, "r", max_tokens=3000)
        rep = await ca.migrate_out("r", b.address, 1)
        assert rep.outcome == pb.MIGRATION_COMMITTED, rep.reason
        b.kill()
        got = await col.wait("r", 5)
        assert got.finish_reason == "error" and f"instance b at {b.address} stopped" in got.error
        assert got.token_ids == tuple(range(len(got.token_ids)))
        load = await ca.get_load()
        assert (load.used_blocks, load.num_requests) == (0, 0)
        reply = await ca.abort("r")  # forwarded to the dead destination: a clear RPC error, not a hang
        assert not reply.found or reply.forwarded_to == b.address

    run(body, a.address, b.address)
