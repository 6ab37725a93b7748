"""The coordinator's judge over a real topology: cost model + approval rule (2x8-a100 example)."""

from __future__ import annotations

import dataclasses

import pytest

from clusterstate.records import MigrationRecord, MigrationState
from global_coord.approver import Judgement, MoveProposal, decide, measured_rates
from global_coord.wiring import load_cluster_model
from policy.domain import DomainSummary, InstanceBrief
from topology.bandwidth import MeasuredBandwidthConfig
from topology.cost import CostConfig, MigrationCostInput, plan_migration

pytest.importorskip("topology.cost")  # merged from the topology branch
pytest.importorskip("global_coord.approval")  # written by the lead


def _move(num_tokens: int, remaining_tokens: int) -> MoveProposal:
    return MoveProposal("node-0", "r", 0, "node-0-i0", "", num_tokens // 16, num_tokens, remaining_tokens, 0.02)


def test_cost_model_judge_on_the_two_node_example() -> None:
    model = load_cluster_model("2x8-a100")
    path = model.path_of("node-0-i0", "node-1-i0")
    assert path.links == ("nvlink:node-0-i0", "nic:node-0", "nic:node-1", "nvlink:node-1-i0")
    # Llama-2-7B, 1600 tokens = 1600 x 0.5 MiB = 839 MB over 20% of 25 GB/s = 5 GB/s: ~0.17 s of transfer,
    # KV grows 0.5 MiB per 20 ms step (26 MB/s) so pre-copy converges; 500 tokens left = 10 s of decoding.
    ok = model.judge(_move(1600, 500), "node-1-i0", path, 0)
    assert ok.approved, ok.reason
    assert 0.16 < ok.transfer_s < 0.19
    assert 0 < ok.downtime_s < 0.025
    # 5 tokens left = 0.1 s of decoding < 2 x transfer: not worth the bytes
    late = model.judge(_move(1600, 5), "node-1-i0", path, 0)
    assert not late.approved and late.reason.startswith("not worth it")
    full = model.judge(_move(1600, 500), "node-1-i0", path, 2)
    assert not full.approved and full.reason.startswith("link budget full: 2")
    assert model.topology.name == "2x8-a100"


def _record(rid: str, rate: float, at_s: float, state: MigrationState = MigrationState.COMMITTED) -> MigrationRecord:
    return MigrationRecord(
        migration_id=MigrationRecord.make_id(rid, 1), request_id=rid, attempt=1, src_instance_id="node-0-i3",
        dst_instance_id="node-1-i5", src_domain_id="node-0", dst_domain_id="node-1", blocks=10, state=state,
        fencing_token=7, links=("nvlink:node-0-i3", "nic:node-0", "nic:node-1", "nvlink:node-1-i5"),
        transport="grpc", measured_bandwidth_bytes_per_s=rate, measured_at_s=at_s,
    )  # fmt: skip


def test_a_slow_measured_link_makes_the_coordinator_refuse_what_it_approved_at_nominal_bandwidth() -> None:
    model = load_cluster_model("2x8-a100")
    move = _move(1600, 500)
    brief = InstanceBrief("node-1-i0", 1000, 900, 100.0, 1, 0, False)
    summaries = [DomainSummary("node-1", 1, 1000, 100.0, 900.0, 900, 1000, 1, 0, False, instances=(brief,))]
    cfg = MeasuredBandwidthConfig(ewma_weight=0.5, max_age_s=60.0)

    def decide_at(records: list[tuple[MigrationRecord, int]], now_s: float) -> tuple[str | None, str]:
        """(the destination approved or None, the judgement's reason) with the records' rates at ``now_s``."""
        measured = measured_rates(records, cfg, now_s)
        choice = decide(move, "node-0", summaries, model.path_of, model.judge, {}, measured=measured)
        return choice.dst_instance_id, choice.judgement.reason

    # unmeasured: priced at the topology's 5 GB/s (20% of the 25 GB/s NICs), 839 MB in ~0.17 s: approved
    nominal = ("node-1-i0", "approved: 169.4 ms transfer, 2.68 ms downtime at 5000.0 MB/s (topology)")
    assert decide_at([], 100.0) == nominal
    # moves between node-0 and node-1 (other GPUs: the same NICs) measured 8 then 12 MB/s: EWMA 10 MB/s, below
    # the 26 MB/s the request's KV grows at (0.5 MiB per 20 ms step): the same move is refused
    slow = [(_record("a", 8e6, 90.0), 11), (_record("b", 12e6, 95.0, MigrationState.ABORTED), 12)]
    assert measured_rates(slow, cfg, 100.0) == {("grpc", ("nic:node-0", "nic:node-1")): 10e6}
    refused = "node-1-i0: pre-copy does not converge: KV grows faster than the path carries it at 10.0 MB/s (measured)"
    assert decide_at(slow, 100.0) == (None, refused)
    # a fast measurement on the path (EWMA 0.5 x 2 GB/s + 0.5 x 10 MB/s) approves it again, priced at the
    # measured 1005 MB/s since that is below the topology's share
    fast = [*slow, (_record("c", 2e9, 99.0), 13)]
    repriced = ("node-1-i0", "approved: 859.7 ms transfer, 9.35 ms downtime at 1005.0 MB/s (measured)")
    assert decide_at(fast, 100.0) == repriced
    assert decide_at(fast[::-1], 100.0) == repriced  # samples are folded in revision order, not list order
    # a measurement above the share does not raise B: priced at the topology's 5 GB/s
    faster = [(_record("d", 20e9, 99.0), 14)]
    assert decide_at(faster, 100.0) == nominal
    # the 8 MB/s sample counts up to 60 s old (at 150 s), then only the 12 MB/s one: still refused; once both
    # are older than max_age_s the path is priced at the topology's bandwidth again
    assert decide_at(slow, 150.0) == (None, refused)
    assert decide_at(slow, 150.5) == (None, refused.replace("at 10.0 MB/s", "at 12.0 MB/s"))
    assert decide_at(slow, 155.5) == nominal
    # records without a measurement (not carried out, or stop-and-copy) are not samples
    unmeasured = [(dataclasses.replace(r, measured_bandwidth_bytes_per_s=0.0), rev) for r, rev in slow]
    assert measured_rates(unmeasured, cfg, 100.0) == {}
    assert decide_at(unmeasured, 100.0) == nominal


def test_the_coordinator_judges_a_move_by_its_calibrated_fixed_overheads() -> None:
    # 1600 tokens with 20 left (0.4 s of decoding) over 5 GB/s: 169.4 ms of transfer, worth it at defaults
    move = _move(1600, 20)
    default = load_cluster_model("2x8-a100")
    path = default.path_of("node-0-i0", "node-1-i0")
    ok = default.judge(move, "node-1-i0", path, 0)
    assert ok.approved and ok.transfer_s == pytest.approx(0.1694498816)
    # a 40 ms round trip per live stage (one stage sends blocks: the 9 tokens decoded meanwhile fill none):
    # 209.4 ms of transfer, 0.4 s < 2 x 0.209 s: not worth it
    slow_stages = load_cluster_model("2x8-a100", CostConfig(stage_overhead_s=0.04))
    late = slow_stages.judge(move, "node-1-i0", path, 0)
    assert not late.approved and late.transfer_s == pytest.approx(0.2094498816)
    assert late.reason.startswith("not worth it: 0.400 s of decoding left < 2 x 0.209 s of transfer")
    # 30 ms of suspend / Commit / resume: 31.7 ms of downtime, over the 25 ms budget
    slow_commit = load_cluster_model("2x8-a100", CostConfig(suspend_resume_overhead_s=0.03))
    paused = slow_commit.judge(move, "node-1-i0", path, 0)
    assert not paused.approved and paused.downtime_s == pytest.approx(ok.downtime_s + 0.029)
    assert paused.reason.startswith("downtime 31.7 ms exceeds the budget of 25.0 ms")


def test_a_destination_holding_the_prefix_is_priced_with_fewer_blocks_to_copy() -> None:
    # 1600 tokens of Llama-2-7B: 100 blocks; the prompt's 3 hash blocks of 512 tokens are 96 of them. The
    # destination caches the first two (64 blocks): the copy is 36 blocks, not 100.
    model = load_cluster_model("2x8-a100")
    path = model.path_of("node-0-i0", "node-1-i0")
    move = dataclasses.replace(_move(1600, 500), prefix_hashes=(7, 8, 9), prefix_block_tokens=512)
    cold = model.judge(move, "node-1-i0", path, 0)
    warm = model.judge(move, "node-1-i0", path, 0, None, 2)
    assert cold.transfer_s == pytest.approx(model.judge(_move(1600, 500), "node-1-i0", path, 0).transfer_s)
    assert warm.transfer_s < cold.transfer_s * 0.45
    # decide tells the judge how many leading hashes each candidate's brief holds (a gap ends the run).
    held = InstanceBrief(
        "node-1-i0", 1000, 900, 100.0, 1, 0, False, prefix_hashes=frozenset({7, 8, 42}), prefill_s_per_token=1e-4
    )
    gap = InstanceBrief("node-1-i1", 1000, 900, 100.0, 1, 0, False, prefix_hashes=frozenset({8, 9}))
    summary = DomainSummary("node-1", 2, 2000, 200.0, 900.0, 900, 1000, 2, 0, False, instances=(held, gap))
    told: dict[str, tuple[int, float]] = {}

    def judge(
        m: MoveProposal,
        dst: str,
        p: object,
        flows: int,
        rate: float | None = None,
        on_dst: int = 0,
        prefill_s_per_token: float = 0.0,
    ) -> Judgement:
        told[dst] = (on_dst, prefill_s_per_token)
        return Judgement(False, "just looking")

    decide(move, "node-0", [summary], model.path_of, judge, {})
    # each candidate's own brief: its leading hashes held and its prefill estimate (none offered: 0)
    assert told == {"node-1-i0": (2, 1e-4), "node-1-i1": (0, 0.0)}
    with pytest.raises(ValueError, match="prefix_block_tokens is 0"):
        dataclasses.replace(move, prefix_block_tokens=0)


def test_a_destination_offering_a_prefill_estimate_is_priced_with_re_prefilling_the_prefix() -> None:
    # 1600 tokens, 96 of its 100 blocks the prompt's 3 hash blocks, none cached on the destination. Over a path
    # measured at 500 MB/s an 8 MiB block takes 16.8 ms: copying everything takes 1.7 s, not worth 2 s of
    # decoding left by the 2x rule. Re-prefilling the prefix's 1536 tokens at 20 us a token takes 31 ms, less
    # than the 4 other blocks' copy (67 ms) it runs beside: 84 ms of transfer, approved.
    model = load_cluster_model("2x8-a100")
    path = model.path_of("node-0-i0", "node-1-i0")
    move = dataclasses.replace(_move(1600, 100), prefix_hashes=(7, 8, 9), prefix_block_tokens=512)
    copy = model.judge(move, "node-1-i0", path, 0, 500e6)
    recompute = model.judge(move, "node-1-i0", path, 0, 500e6, 0, 2e-5)
    assert not copy.approved and copy.reason.startswith("not worth it"), copy.reason
    assert recompute.approved, recompute.reason
    plan = plan_migration(
        MigrationCostInput(
            kv_tokens=1600,
            kv_bytes_per_token=524288,  # Llama-2-7B fp16: 2 x 32 layers x 32 heads x 128 x 2 bytes
            block_size_tokens=16,
            decode_step_s=0.02,
            path_bandwidth_bytes_per_s=path.bandwidth_bytes_per_s,
            measured_bandwidth_bytes_per_s=500e6,
            prefix_blocks=96,
            prefix_reprefill_s=1536 * 2e-5,
        )
    )
    assert plan.mode == "pre-copy+recompute-prefix" and plan.recomputed_prefix_blocks == 96
    assert recompute.transfer_s == pytest.approx(plan.transfer_s)
    assert recompute.downtime_s == pytest.approx(plan.downtime_s)
    assert recompute.transfer_s == pytest.approx(5 * 8388608 / 500e6)  # the 4 blocks after the prefix, then 1
    # a destination whose report offers no estimate (vLLM: 0) is priced with the copy only
    assert model.judge(move, "node-1-i0", path, 0, 500e6, 0, 0.0) == copy
