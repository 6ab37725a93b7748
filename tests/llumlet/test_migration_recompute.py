"""Copy versus recompute, live: two torch llumlets (in-process servers on real gRPC), the gRPC transport at a rate
cap the test chooses. The source prices the move with the cost model (``topology.cost.plan_migration``) and the
destination's prefill estimate from its Reserve reply; on a slow path the destination re-prefills the prompt's
blocks instead of receiving them, on a fast one they are copied. Either way the migrated stream must equal the
stream of the same greedy request run unmigrated on the destination.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.backends import BackendConfig
from llumlet.client import LlumletClient
from llumlet.engine.types import MigrationState, SamplingParams
from llumlet.migration_types import CommitCall, DestStatus, PromptPrefix
from llumlet.sink import TokenCollector
from llumlet.testing import RunningLlumlet, start_llumlet
from tests.llumlet.test_local_transport import torch_pair

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
PROMPT_TOKENS = 70  # 4 full blocks of 16 tokens hold prompt tokens only: the prefix the plan may recompute


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
    # 200 kB/s: the 4 prompt blocks (8 KiB each) take 164 ms to copy; re-prefilling 64 tokens of the tiny
    # Llama takes a few ms on this CPU (b measured its rate on the reference), so the plan recomputes them.
    async def body(col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet) -> None:
        rep = await _move(col, a, b, "slow", 200e3)
        assert rep.plan == "pre-copy+recompute-prefix" and rep.recomputed_blocks == 4
        assert 0 < rep.recompute_s < 4 * 8192 / 200e3
        assert rep.stage_reports[0].blocks == 0  # stage 0 had no full block left to send: the prefix was it
        # only the blocks after the prompt's went over the wire: the 5th (73+ tokens), maybe a 6th
        assert 1 <= rep.blocks <= 2 and rep.bytes == rep.blocks * 8192

    asyncio.run(torch_pair(body))


def test_a_fast_path_copies_the_prompt_blocks() -> None:
    # 1 GB/s: 4 blocks in ~33 us, far below any re-prefill: the plan copies.
    async def body(col: TokenCollector, a: RunningLlumlet, b: RunningLlumlet) -> None:
        rep = await _move(col, a, b, "fast", 1e9)
        assert rep.plan == "pre-copy" and rep.recomputed_blocks == 0 and rep.recompute_s == 0.0
        assert rep.stage_reports[0].blocks >= 4  # the prompt blocks were sent in stage 0

    asyncio.run(torch_pair(body))


# ---- the model engine (sim backend) on a real clock: the destination waits out its modelled re-prefill --------
# one hash block of 256 tokens (16 blocks of 16) and 5 more blocks: copying those 5 (42 ms at 1 GB/s) outlasts the
# re-prefill of the 16 (24 ms on the A100 latency model), so recompute completes sooner without a longer downtime
SIM_PROMPT_TOKENS = 336


async def _sim_move(rate_cap_bytes_per_s: float) -> tuple[pb.MigrateOutReply, float]:
    """A 336-token prompt (hash block 5 of 256 tokens) on sim llumlet a, moved to b over gRPC at the rate cap.
    Returns the reply and b's latency-model estimate of prefilling those 256 tokens alone."""
    col = TokenCollector()
    await col.start()

    def backend(name: str) -> BackendConfig:
        return BackendConfig(instance_id=name, num_blocks=2000, block_size_tokens=16)

    a = await start_llumlet("a", backend=backend("a"))
    b = await start_llumlet("b", backend=backend("b"))
    try:
        col.expect("r", a.address)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        reply = await a.client.submit(
            "r", col.address, params, prompt_tokens=SIM_PROMPT_TOKENS, prefix_block_hashes=(5,),
            prefix_hash_block_tokens=256,
        )  # fmt: skip
        assert reply.accepted, reply.reason
        deadline = asyncio.get_running_loop().time() + 30
        while len(col.get("r").token_ids) < 3:
            assert asyncio.get_running_loop().time() < deadline, "the request never started decoding"
            await asyncio.sleep(0.002)
        rep = await a.client.migrate_out(
            "r", b.address, 1, transport=pb.TRANSPORT_GRPC, rate_cap_bytes_per_s=rate_cap_bytes_per_s
        )
        got = await col.wait("r", 30)
        assert rep.outcome == pb.MIGRATION_COMMITTED, rep.reason
        assert len(got.token_ids) == 40 and got.error == "" and got.epoch == 1
        load = await b.client.get_load()
        assert (load.used_blocks, load.reserved_blocks, load.num_requests) == (0, 0, 0)
        engine = b.llumlet.driver.engine
        return rep, engine.prefill_time_s(256, 0) or 0.0
    finally:
        await a.stop()
        await b.stop()
        await col.stop()


def test_a_sim_llumlet_destination_re_prefills_on_a_slow_path_and_waits_its_modelled_time() -> None:
    # Llama-2-7B: 8 MiB a block; at 1 GB/s the 16 prefix blocks take 134 ms to copy, the A100 latency model
    # prefills their 256 tokens in far less: recompute, priced with the estimate the simulator's executor uses.
    rep, estimate_s = asyncio.run(_sim_move(1e9))
    assert rep.plan == "pre-copy+recompute-prefix" and rep.recomputed_blocks == 16
    assert rep.recompute_s == pytest.approx(estimate_s) and 0 < estimate_s < 0.134
    # stage 0 sent the prompt's 5 blocks after the hash block only: what a destination may re-prefill is what the
    # prompt's hash ids cover (PromptPrefix.prompt_blocks)
    assert rep.stage_reports[0].blocks == 5
    assert rep.total_s >= estimate_s  # the Commit waited for the destination's modelled re-prefill


def test_a_sim_llumlet_move_over_a_fast_path_copies_the_prefix() -> None:
    rep, estimate_s = asyncio.run(_sim_move(100e9))  # 16 blocks in 1.3 ms: copy
    assert rep.plan == "pre-copy" and rep.recomputed_blocks == 0 and estimate_s > 0.0013
    assert rep.stage_reports[0].blocks >= 16


def test_a_failed_re_prefill_fails_the_commit_and_a_second_ask_is_refused() -> None:
    async def main() -> None:
        b = await start_llumlet(
            "b", engine="torch", backend=BackendConfig(instance_id="b", num_blocks=64, block_size_tokens=16)
        )
        try:
            peer = LlumletClient(b.address)
            try:
                got = await peer.reserve("r", 1, 4, prefix=PromptPrefix(token_ids=(5, 6, 7)), prefix_blocks=3)
                assert got.status is DestStatus.OK and got.prefix_reprefill_s is None  # no prefill measured yet
                assert (await peer.reserve("r", 1, 4, recompute_blocks=2)).status is DestStatus.OK
                again = await peer.reserve("r", 1, 4, recompute_blocks=2)
                assert again.status is DestStatus.REFUSED and "already recomputes" in again.reason
                state = MigrationState("r", 3, 1, 3, 10, 0, 0.0, prompt_token_ids=(5, 6, 7))
                reply = await peer.commit(CommitCall("r", 1, state, origin="127.0.0.1:1", next_seq=1, epoch=1))
                assert reply.status is DestStatus.FAILED
                assert "re-prefilling 2 blocks from 0 failed" in reply.reason
                assert "need 32 prompt tokens" in reply.reason
                load = await b.client.get_load()
                assert (load.reserved_blocks, load.num_requests) == (0, 0)  # the failed attempt left nothing
            finally:
                await peer.close()
        finally:
            await b.stop()

    asyncio.run(main())


def test_the_re_prefillable_prefix_is_what_the_hash_ids_cover_as_the_simulator_and_the_judge_count_it() -> None:
    ids = tuple(range(3, 3 + SIM_PROMPT_TOKENS))  # 336 prompt tokens: 21 full blocks of 16
    hashed = PromptPrefix(token_ids=ids, block_hashes=(5,), hash_block_tokens=256)
    assert hashed.prompt_blocks(400, 16) == 16  # the hash block's 256 tokens, not all 336 (sim and judge alike)
    assert PromptPrefix(token_ids=ids).prompt_blocks(400, 16) == 21  # no hash ids: the prompt's known tokens
    assert PromptPrefix(token_ids=ids).prompt_blocks(100, 16) == 6  # never beyond the KV held
    assert PromptPrefix().prompt_blocks(400, 16) == 0
