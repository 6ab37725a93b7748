"""Copy versus recompute, live: two torch llumlets (in-process servers on real gRPC), the gRPC transport at a rate
cap the test chooses. The source prices the move with the cost model (``topology.cost.plan_migration``) and the
destination's prefill estimate from its Reserve reply; on a slow path the destination re-prefills the prompt's
blocks instead of receiving them, on a fast one they are copied. Either way the migrated stream must equal the
stream of the same greedy request run unmigrated on the destination.
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

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
PROMPT_TOKENS = 70  # 4 full blocks of 16 tokens hold prompt tokens only: the prefix the plan may recompute


async def _pair(body: Callable[[TokenCollector, RunningLlumlet, RunningLlumlet], Awaitable[None]]) -> None:
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


async def _move(
    col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet, rid: str, rate_cap_bytes_per_s: float
) -> pb.MigrateOutReply:
    """Run ``rid`` unmigrated on b (which measures b's prefill rate), then on a, moved to b after 3 tokens."""
    prompt = [random.Random(rid).randrange(3, 512) for _ in range(PROMPT_TOKENS)]
    col.expect(f"ref-{rid}", b.address)
    assert (await b.client.submit(f"ref-{rid}", col.address, PARAMS, prompt_token_ids=prompt)).accepted
    reference = await col.wait(f"ref-{rid}", 30)
    col.expect(rid, a.address)
    assert (await a.client.submit(rid, col.address, PARAMS, prompt_token_ids=prompt)).accepted
    deadline = asyncio.get_running_loop().time() + 30
    while len(col.get(rid).token_ids) < 3:
        assert asyncio.get_running_loop().time() < deadline, "the request never started decoding"
        await asyncio.sleep(0.002)
    rep = await a.client.migrate_out(
        rid, b.address, 1, transport=pb.TRANSPORT_GRPC, rate_cap_bytes_per_s=rate_cap_bytes_per_s
    )
    got = await col.wait(rid, 30)
    assert rep.outcome == pb.MIGRATION_COMMITTED, rep.reason
    assert got.token_ids == reference.token_ids and got.epoch == 1  # token for token, recomputed or copied
    load = await b.client.get_load()
    assert (load.used_blocks, load.reserved_blocks, load.num_requests) == (0, 0, 0)
    return rep


def test_a_slow_path_has_the_destination_re_prefill_the_prompt_blocks() -> None:
    # 400 kB/s: the 4 prompt blocks (8 KiB each) take ~80 ms to copy; re-prefilling 64 tokens of the tiny
    # Llama takes a few ms on this CPU (b measured its rate on the reference), so the plan recomputes them.
    async def body(col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet) -> None:
        rep = await _move(col, a, b, "slow", 400e3)
        assert rep.plan == "pre-copy+recompute-prefix" and rep.recomputed_blocks == 4
        assert 0 < rep.recompute_s < 0.08
        held = sum(s.blocks for s in rep.stage_reports)
        assert held == rep.blocks and rep.blocks >= 1  # only the blocks after the prompt's went over the wire
        assert rep.stage_reports[0].blocks == 0  # stage 0 had no full block left to send: the prefix was it

    asyncio.run(_pair(body))


def test_a_fast_path_copies_the_prompt_blocks() -> None:
    # 1 GB/s: 4 blocks in ~33 us, far below any re-prefill: the plan copies.
    async def body(col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet) -> None:
        rep = await _move(col, a, b, "fast", 1e9)
        assert rep.plan == "pre-copy" and rep.recomputed_blocks == 0 and rep.recompute_s == 0.0
        assert rep.stage_reports[0].blocks >= 4  # the prompt blocks were sent in stage 0

    asyncio.run(_pair(body))
