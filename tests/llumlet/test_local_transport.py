"""The local transport between two torch llumlets (in-process servers on real gRPC): peer copies from the
source's exported KV pool, and bytes inline when the destination cannot open that pool.

Each migrated stream must equal the stream of the same greedy request run unmigrated on the destination.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest
import torch

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.backends import BackendConfig
from llumlet.engine.types import SamplingParams
from llumlet.sink import TokenCollector
from llumlet.testing import RunningLlumlet, start_llumlet
from llumlet.transport import PeerPools, TransportError

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


async def torch_pair(
    body: Callable[[TokenCollector, RunningLlumlet, RunningLlumlet], Awaitable[None]],
) -> None:
    """Run ``body`` with a token collector and torch llumlets ``a``, ``b`` (in-process, real gRPC), stopped after."""
    torch.set_num_threads(1)
    col = TokenCollector()
    await col.start()

    def backend(name: str) -> BackendConfig:
        return BackendConfig(instance_id=name, num_blocks=64, block_size_tokens=16, min_step_s=0.005)

    a = await start_llumlet("a", engine="torch", backend=backend("a"))
    b = await start_llumlet("b", engine="torch", backend=backend("b"))
    try:
        await body(col, a, b)
    finally:
        await a.stop()
        await b.stop()
        await col.stop()


async def _move(col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet, rid: str) -> pb.MigrateOutReply:
    prompt = [random.Random(rid).randrange(3, 512) for _ in range(70)]
    col.expect(f"ref-{rid}", b.address)
    assert (await b.client.submit(f"ref-{rid}", col.address, PARAMS, prompt_token_ids=prompt)).accepted
    reference = await col.wait(f"ref-{rid}", 30)
    col.expect(rid, a.address)
    assert (await a.client.submit(rid, col.address, PARAMS, prompt_token_ids=prompt)).accepted
    while len(col.get(rid).token_ids) < 3:
        await asyncio.sleep(0.002)
    rep = await a.client.migrate_out(rid, b.address, 1, transport=pb.TRANSPORT_LOCAL)
    got = await col.wait(rid, 30)
    assert rep.outcome == pb.MIGRATION_COMMITTED, rep.reason
    assert got.token_ids == reference.token_ids and got.epoch == 1
    return rep


def test_blocks_move_by_peer_copy_from_the_sources_pool() -> None:
    async def body(col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet) -> None:
        rep = await _move(col, a, b, "r1")
        assert rep.transport == "local" and rep.blocks >= 5  # 70 + tokens: 5 blocks, no byte went inline
        assert rep.precopy_bandwidth_bytes_per_s > 0
        assert rep.cached_blocks == 0  # the torch engine matches no content: every block is sent

    asyncio.run(torch_pair(body))


def test_a_pool_the_destination_cannot_open_falls_back_to_inline_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: PeerPools, handle: bytes) -> object:
        raise TransportError("cannot open the source's KV pool: GPU 3 is not visible here (injected)")

    monkeypatch.setattr(PeerPools, "open", refuse)

    async def body(col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet) -> None:
        rep = await _move(col, a, b, "r2")
        assert rep.transport == "local-inline"

    asyncio.run(torch_pair(body))
