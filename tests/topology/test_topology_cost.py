"""Migration cost model: hand-computed plans and invariants (hypothesis)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topology.cost import (
    CostConfig,
    MigrationCostInput,
    PrecopyRule,
    bytes_per_link,
    effective_bandwidth_bytes_per_s,
    plan_migration,
    prefix_kv_blocks,
)
from topology.graph import PathInfo

LLAMA13_KV_PER_TOKEN = 2 * 40 * 40 * 128 * 2  # 819,200 B
FULL = CostConfig(cap_fraction=1.0, max_stages=8, stop_remaining_blocks=1, suspend_resume_overhead_s=0.0)


def test_effective_bandwidth_is_capped_and_shared() -> None:
    assert effective_bandwidth_bytes_per_s(25e9, 0.2, 0) == 5e9
    assert effective_bandwidth_bytes_per_s(25e9, 0.2, 3) == 1.25e9  # 5 GB/s shared by 4 flows
    with pytest.raises(ValueError, match="cap_fraction must be in"):
        effective_bandwidth_bytes_per_s(25e9, 1.5, 0)
    with pytest.raises(ValueError, match="existing_flows must be an int >= 0"):
        effective_bandwidth_bytes_per_s(25e9, 0.2, -1)


def test_llama13b_4096_tokens_over_nvlink() -> None:
    # 4096 tokens x 819,200 B = 3,355,443,200 B (3.36 GB) = 256 full blocks; 600 GB/s -> 5.592 ms.
    # 5.6 ms is less than one 30 ms decode step: nothing new to copy, the last stage is empty.
    plan = plan_migration(MigrationCostInput(4096, LLAMA13_KV_PER_TOKEN, 16, 0.030, 600e9), FULL)
    assert plan.converges and plan.mode == "pre-copy"
    assert plan.stage_bytes == (3_355_443_200, 0)
    assert plan.transfer_s == pytest.approx(3_355_443_200 / 600e9) == pytest.approx(0.0055924)
    assert plan.downtime_s == 0.0
    assert plan.total_bytes == 3_355_443_200


def test_llama13b_4096_tokens_over_pcie() -> None:
    # stage 0: 3,355,443,200 B / 32 GB/s = 104.8576 ms; 3 decode steps of 30 ms -> 4099 tokens, 257 blocks,
    # 1 left (the partial block) <= stop_remaining_blocks -> last stage 13,107,200 B = 0.4096 ms.
    plan = plan_migration(MigrationCostInput(4096, LLAMA13_KV_PER_TOKEN, 16, 0.030, 32e9), FULL)
    assert plan.stage_bytes == (3_355_443_200, 13_107_200)
    assert plan.stage_s == pytest.approx((0.1048576, 0.0004096))
    assert plan.transfer_s == pytest.approx(0.1052672)
    assert plan.downtime_s == pytest.approx(0.0004096)
    # 20% cap and 1 flow already on the link: 32 GB/s x 0.2 / 2 = 3.2 GB/s, 10x slower stage 0
    slow = plan_migration(
        MigrationCostInput(4096, LLAMA13_KV_PER_TOKEN, 16, 0.030, 32e9, existing_flows=1),
        CostConfig(suspend_resume_overhead_s=0.0),
    )
    assert slow.effective_bandwidth_bytes_per_s == 3.2e9
    assert slow.stage_s[0] == pytest.approx(1.048576)


def test_three_live_stages_by_hand() -> None:
    # 1000 B/token, 16-token blocks (16,000 B), 160 tokens = 10 full blocks, 160,000 B/s = 0.1 s per block,
    # one token per 20 ms. Stage 0: 10 blocks, 1.0 s, 50 tokens -> 210 tokens = 13 full + 1 partial,
    # 4 left > 1. Stage 1: 3 blocks, 0.3 s (T=1.3), 65 tokens -> 225 = 14 full + partial, 2 left.
    # Stage 2: 1 block, 0.1 s (T=1.4), 70 tokens -> 230 = 14 full + partial, 1 left -> suspend.
    # Last stage: 1 block, 0.1 s; plus the 5 ms overhead.
    cfg = CostConfig(cap_fraction=1.0, stop_remaining_blocks=1, suspend_resume_overhead_s=0.005)
    plan = plan_migration(MigrationCostInput(160, 1000, 16, 0.02, 160_000), cfg)
    assert plan.converges and plan.mode == "pre-copy"
    assert plan.stage_bytes == (160_000, 48_000, 16_000, 16_000)
    assert plan.stage_s == pytest.approx((1.0, 0.3, 0.1, 0.1))
    assert plan.num_stages == 4
    assert plan.transfer_s == pytest.approx(1.5)
    assert plan.downtime_s == pytest.approx(0.105)
    assert plan.completion_s == pytest.approx(1.505)
    assert plan.total_bytes == 240_000
    # max_stages=2 suspends after stage 1 with 2 blocks left
    capped = plan_migration(MigrationCostInput(160, 1000, 16, 0.02, 160_000), CostConfig(1.0, 2, 1, 0.0))
    assert capped.stage_bytes == (160_000, 48_000, 32_000)
    assert capped.downtime_s == pytest.approx(0.2)


def test_each_live_stage_that_sends_blocks_costs_the_stage_overhead() -> None:
    # The three-stage case above with a 0.1 s round trip per live stage: stage 0, 10 blocks, 1.0 + 0.1 s ->
    # 160 + 55 = 215 tokens (13 full + 1 partial, 4 left). Stage 1: 3 blocks, 0.4 s (T=1.5) -> 235 tokens,
    # 2 left. Stage 2: 1 block, 0.2 s (T=1.7) -> 245 tokens (15 full), 2 left. Stage 3: 1 block, 0.2 s
    # (T=1.9) -> 255 tokens, 1 left -> suspend. Last stage: 1 block, 0.1 s, plus the 5 ms overhead (the
    # stage overhead is not charged there: suspend_resume_overhead_s is that stage's fixed time).
    cfg = CostConfig(cap_fraction=1.0, stop_remaining_blocks=1, suspend_resume_overhead_s=0.005, stage_overhead_s=0.1)
    plan = plan_migration(MigrationCostInput(160, 1000, 16, 0.02, 160_000), cfg)
    assert plan.stage_bytes == (160_000, 48_000, 16_000, 16_000, 16_000)
    assert plan.stage_s == pytest.approx((1.1, 0.4, 0.2, 0.2, 0.1))
    assert plan.transfer_s == pytest.approx(2.0)
    assert plan.downtime_s == pytest.approx(0.105)
    assert plan.completion_s == pytest.approx(2.005)
    # a live stage with nothing to send (fewer tokens than a block) makes no round trip
    short = plan_migration(MigrationCostInput(10, 1000, 16, 0.02, 160_000), cfg)
    assert short.stage_bytes == (0, 16_000)
    assert short.stage_s == pytest.approx((0.0, 0.1))
    assert short.downtime_s == pytest.approx(0.105)
    assert cfg.live_stage_overhead_s(0) == 0.0 and cfg.live_stage_overhead_s(3) == 0.1
    with pytest.raises(ValueError, match=r"stage_overhead_s must be a finite number >= 0, got -0\.001"):
        CostConfig(stage_overhead_s=-0.001)
    with pytest.raises(ValueError, match="stage_overhead_s must be a finite number >= 0, got inf"):
        CostConfig(stage_overhead_s=math.inf)


def test_the_setup_overhead_comes_before_stage_0_while_the_request_decodes() -> None:
    # The three-stage case with 50 ms of setup: stage 0 starts at T=0.05 with 162 tokens (still 10 full
    # blocks), 1.0 s (T=1.05, 212 tokens, 4 left); stage 1: 3 blocks (T=1.35, 227 tokens, 2 left); stage 2:
    # 1 block (T=1.45, 232 tokens, 1 left) -> suspend. The transfer is the stages alone; the completion adds
    # the setup; the downtime is unchanged.
    cfg = CostConfig(cap_fraction=1.0, stop_remaining_blocks=1, suspend_resume_overhead_s=0.005, setup_overhead_s=0.05)
    plan = plan_migration(MigrationCostInput(160, 1000, 16, 0.02, 160_000), cfg)
    assert plan.stage_bytes == (160_000, 48_000, 16_000, 16_000)
    assert plan.transfer_s == pytest.approx(1.5)
    assert plan.downtime_s == pytest.approx(0.105)
    assert plan.completion_s == pytest.approx(1.555)
    # a blocking copy copies what the request decoded during the setup too: 160 + 50 tokens = 14 blocks,
    # 224,000 B at 0.5 MB/s = 0.448 s + 5 ms (no live stage: no stage overhead)
    blocking = plan_migration(MigrationCostInput(160, 1000, 16, 0.001, 500_000), replace(cfg, stage_overhead_s=9.0))
    assert blocking.mode == "blocking" and blocking.stage_bytes == (224_000,)
    assert blocking.downtime_s == pytest.approx(0.453)
    assert blocking.completion_s == pytest.approx(0.503)
    with pytest.raises(ValueError, match=r"setup_overhead_s must be a finite number >= 0, got -1\.0"):
        CostConfig(setup_overhead_s=-1.0)


def test_no_convergence_prices_a_blocking_copy() -> None:
    # growth 1000 B / 1 ms = 1 MB/s >= 0.5 MB/s: blocking copy of 10 blocks = 160,000 B in 0.32 s + 5 ms.
    cfg = CostConfig(cap_fraction=1.0, suspend_resume_overhead_s=0.005)
    plan = plan_migration(MigrationCostInput(160, 1000, 16, 0.001, 500_000), cfg)
    assert not plan.converges and plan.mode == "blocking"
    assert plan.stage_bytes == (160_000,)
    assert plan.downtime_s == pytest.approx(0.325)
    assert plan.completion_s == pytest.approx(0.325)
    # exactly equal growth and bandwidth does not converge either (the remainder would never shrink)
    assert not plan_migration(MigrationCostInput(160, 1000, 16, 0.001, 1_000_000), cfg).converges
    assert plan_migration(MigrationCostInput(160, 1000, 16, 0.001, 1_000_001), cfg).converges


PREFIX: dict[str, Any] = {
    "kv_tokens": 160,
    "kv_bytes_per_token": 1000,
    "block_size_tokens": 16,
    "decode_step_s": 0.02,
}


def test_prefix_blocks_on_destination_are_not_copied() -> None:
    # 6 prefix blocks, 2 already on the destination: stage 0 copies 8 blocks (0.8 s, 40 tokens -> 200 tokens,
    # 3 left); stage 1: 2 blocks (T=1.0, 210 tokens, 2 left); stage 2: 1 block (T=1.1, 215 tokens, 1 left);
    # last: 1 block. Without recompute time given, that is the plan.
    inp = MigrationCostInput(**PREFIX, path_bandwidth_bytes_per_s=160_000, prefix_blocks=6, prefix_blocks_on_dst=2)
    plan = plan_migration(inp, FULL)
    assert plan.mode == "pre-copy"
    assert plan.stage_bytes == (128_000, 32_000, 16_000, 16_000)
    assert plan.transfer_s == pytest.approx(1.2)
    assert plan.skipped_prefix_blocks == 2 and plan.recomputed_prefix_blocks == 0


@pytest.mark.parametrize(
    ("reprefill_s", "mode", "completion_s", "downtime_s"),
    [
        # recompute plan: copy 4 blocks (0.4 s, 180 tokens, 2 left), 1 block (T=0.5, 185 tokens, 1 left),
        # last 1 block: copies done at 0.6 s. Resume at max(0.6, re-prefill).
        (0.3, "pre-copy+recompute-prefix", 0.6, 0.1),
        (0.6, "pre-copy+recompute-prefix", 0.6, 0.1),  # the re-prefill ends with the copy: no wait
        # 0.9 s: it would complete at 0.9 s but wait 0.3 s for the re-prefill while suspended (downtime 0.4 s
        # against the copy's 0.1 s): never traded, the plain pre-copy
        (0.9, "pre-copy", 1.2, 0.1),
        (2.0, "pre-copy", 1.2, 0.1),  # the plain pre-copy (1.2 s) completes first
    ],
)
def test_recompute_prefix_plan_wins_when_it_completes_first_without_a_longer_downtime(
    reprefill_s: float, mode: str, completion_s: float, downtime_s: float
) -> None:
    inp = MigrationCostInput(
        **PREFIX,
        path_bandwidth_bytes_per_s=160_000,
        prefix_blocks=6,
        prefix_blocks_on_dst=2,
        prefix_reprefill_s=reprefill_s,
    )
    plan = plan_migration(inp, FULL)
    assert plan.mode == mode
    assert plan.completion_s == pytest.approx(completion_s)
    assert plan.downtime_s == pytest.approx(downtime_s)
    if mode == "pre-copy+recompute-prefix":
        assert plan.stage_bytes == (64_000, 16_000, 16_000)
        assert plan.recomputed_prefix_blocks == 4 and plan.recompute_s == reprefill_s


def test_more_bandwidth_can_mean_one_more_stage() -> None:
    """Documented non-monotonicity: stages are whole blocks and the stop test is a threshold."""
    cfg = CostConfig(cap_fraction=1.0, max_stages=3, stop_remaining_blocks=3, suspend_resume_overhead_s=0.0)
    slow = plan_migration(MigrationCostInput(259, 1000, 16, 0.03, 78_149), cfg)
    fast = plan_migration(MigrationCostInput(259, 1000, 16, 0.03, 79_149), cfg)
    assert [b // 16_000 for b in slow.stage_bytes] == [16, 7, 3]
    assert [b // 16_000 for b in fast.stage_bytes] == [16, 6, 3, 2]
    assert fast.transfer_s > slow.transfer_s and fast.downtime_s < slow.downtime_s


def test_bytes_per_link() -> None:
    plan = plan_migration(MigrationCostInput(160, 1000, 16, 0.02, 160_000), FULL)
    path = PathInfo(25e9, ("nvlink:a", "nic:n0", "nic:n1", "nvlink:b"), False, "nic:n0")
    assert bytes_per_link(plan, path) == dict.fromkeys(path.links, 240_000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_tokens": -1}, "kv_tokens must be an int >= 0, got -1"),
        ({"block_size_tokens": 0}, "block_size_tokens must be an int > 0, got 0"),
        ({"decode_step_s": math.inf}, "decode_step_s must be a finite number > 0, got inf"),
        (
            {"path_bandwidth_bytes_per_s": 0.0},
            "path_bandwidth_bytes_per_s must be a finite number > 0, got 0.0",
        ),
        ({"prefix_blocks": 11}, "prefix_blocks must be <= the 10 full blocks held, got 11"),
        (
            {"prefix_blocks": 2, "prefix_blocks_on_dst": 3},
            r"prefix_blocks_on_dst must be <= prefix_blocks \(2\)",
        ),
    ],
)
def test_bad_input_names_the_field(kwargs: dict[str, float], message: str) -> None:
    args = {**PREFIX, "path_bandwidth_bytes_per_s": 1e9, **kwargs}
    with pytest.raises(ValueError, match=message):
        MigrationCostInput(**args)


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="max_stages must be an int >= 1, got 0"):
        CostConfig(max_stages=0)
    with pytest.raises(ValueError, match="suspend_resume_overhead_s must be a finite number >= 0"):
        CostConfig(suspend_resume_overhead_s=-1.0)


# ------------------------------------------------------------------------------------------ properties

inputs = st.builds(
    lambda n, bt, bs, d, bw, prefix_frac, on_dst_frac: (n, bt, bs, d, bw, prefix_frac, on_dst_frac),
    st.integers(0, 5000),
    st.sampled_from([1000, 327_680, 524_288, 819_200]),
    st.sampled_from([1, 8, 16, 32]),
    st.floats(0.005, 0.2),
    st.floats(1e5, 1e12),
    st.floats(0, 1),
    st.floats(0, 1),
)
configs = st.builds(
    lambda stages, stop, over: CostConfig(
        cap_fraction=1.0, max_stages=stages, stop_remaining_blocks=stop, suspend_resume_overhead_s=over
    ),
    st.integers(1, 10),
    st.integers(0, 4),
    st.sampled_from([0.0, 0.001]),
)


def _make(raw: tuple[int, int, int, float, float, float, float], bw: float | None = None) -> MigrationCostInput:
    n, bt, bs, d, path_bw, prefix_frac, on_dst_frac = raw
    prefix = int((n // bs) * prefix_frac)
    return MigrationCostInput(
        n, bt, bs, d, bw or path_bw, prefix_blocks=prefix, prefix_blocks_on_dst=int(prefix * on_dst_frac)
    )


def _blocking_downtime_s(inp: MigrationCostInput, cfg: CostConfig) -> float:
    blocks = -(-inp.kv_tokens // inp.block_size_tokens) - inp.prefix_blocks_on_dst
    bw = effective_bandwidth_bytes_per_s(inp.path_bandwidth_bytes_per_s, cfg.cap_fraction, inp.existing_flows)
    return blocks * inp.kv_bytes_per_token * inp.block_size_tokens / bw + cfg.suspend_resume_overhead_s


@given(inputs, configs)
def test_downtime_at_most_blocking_downtime_when_it_converges(
    raw: tuple[int, int, int, float, float, float, float], cfg: CostConfig
) -> None:
    inp = _make(raw)
    plan = plan_migration(inp, cfg)
    assert plan.total_bytes == sum(plan.stage_bytes)
    assert plan.transfer_s == pytest.approx(sum(plan.stage_s))
    if plan.converges:
        assert plan.downtime_s <= _blocking_downtime_s(inp, cfg) * (1 + 1e-9)
        assert plan.num_stages <= cfg.max_stages + 1
    else:
        assert plan.downtime_s == pytest.approx(_blocking_downtime_s(inp, cfg))


@given(inputs, configs, st.floats(1.0, 10.0))
def test_monotone_in_bandwidth(
    raw: tuple[int, int, int, float, float, float, float], cfg: CostConfig, k: float
) -> None:
    """More bandwidth: convergence is kept, the blocking downtime and the transfer-time bound do not grow,
    and with a single live stage the transfer time and downtime do not grow either."""
    slow, fast = _make(raw), _make(raw, raw[4] * k)
    p_slow, p_fast = plan_migration(slow, cfg), plan_migration(fast, cfg)
    assert p_fast.converges or not p_slow.converges
    assert _blocking_downtime_s(fast, cfg) <= _blocking_downtime_s(slow, cfg)
    for inp, plan in ((slow, p_slow), (fast, p_fast)):
        if plan.converges:  # geometric bound: T <= (n0/bs + 1 - skip) * Bb / (B - Bt/d)
            bound = (
                (inp.kv_tokens / inp.block_size_tokens + 1 - inp.prefix_blocks_on_dst)
                * (inp.kv_bytes_per_token * inp.block_size_tokens)
                / (plan.effective_bandwidth_bytes_per_s - inp.kv_bytes_per_token / inp.decode_step_s)
            )
            assert plan.transfer_s <= bound * (1 + 1e-9)
    one = CostConfig(1.0, 1, cfg.stop_remaining_blocks, cfg.suspend_resume_overhead_s)
    q_slow, q_fast = plan_migration(slow, one), plan_migration(fast, one)
    if q_slow.converges:
        assert q_fast.transfer_s <= q_slow.transfer_s * (1 + 1e-9)
        assert q_fast.downtime_s <= q_slow.downtime_s * (1 + 1e-9)


@pytest.mark.parametrize(
    ("tokens", "copied", "stages_done", "expected"),
    [
        (100, 0, 0, 6),  # stage 0: every full block (100 // 16)
        (8, 0, 0, 0),  # stage 0 with no full block: a live stage that copies nothing
        (100, 6, 1, None),  # 7 blocks - 6 copied = 1 left (the partial one) <= 1: suspend
        (113, 6, 1, 1),  # 8 - 6 = 2 left > 1 and block 7 filled: copy it
        (112, 6, 1, None),  # exactly 7 full blocks and no partial one: 7 - 6 = 1 left <= 1: suspend
        (129, 6, 3, None),  # max_stages 3 reached
        (96, 6, 1, None),  # no block filled since the last stage
    ],
)
def test_precopy_rule_is_table_driven(tokens: int, copied: int, stages_done: int, expected: int | None) -> None:
    rule = PrecopyRule(max_stages=3, stop_remaining_blocks=1)
    assert rule.next_live_stage(tokens, copied, stages_done, 16) == expected


def test_one_precopy_rule_for_the_cost_model_the_simulator_and_the_llumlet() -> None:
    from llumlet.migration_types import MigrationConfig

    assert CostConfig().precopy == MigrationConfig().precopy == PrecopyRule()
    assert PrecopyRule(max_stages=0).next_live_stage(1000, 0, 0, 16) is None  # stop-and-copy
    with pytest.raises(ValueError, match="stop_remaining_blocks must be an int >= 0, got -1"):
        PrecopyRule(stop_remaining_blocks=-1)


def test_prefix_kv_blocks_counts_the_full_blocks_the_hash_blocks_cover() -> None:
    assert prefix_kv_blocks(2, 512, 2000, 16) == 64  # 2 hash blocks of 32 KV blocks each
    assert prefix_kv_blocks(2, 512, 700, 16) == 43  # never beyond the KV held: 700 // 16
    assert prefix_kv_blocks(0, 512, 700, 16) == 0
    with pytest.raises(ValueError, match="block_size_tokens >= 1"):
        prefix_kv_blocks(1, 512, 700, 0)
