"""Prefix-aware dispatch (policy/dispatch.py, docs/policy.md "Prefix-aware dispatch") and migration pairing
(policy/migration.py): every expected value by hand.

Units throughout: KV blocks of 16 tokens, hash blocks of 32 tokens, so one hash stands for 2 KV blocks.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from policy_factories import CFG, inst

from policy import (
    DispatchView,
    DomainDispatchView,
    InstanceLoad,
    PolicyConfig,
    RequestLoad,
    move_lowers_potential,
    plan_migrations,
    potential,
    reusable_prefix_hashes,
    summarize_domain,
)
from policy.migration import prefix_blocks_on

H = 32  # tokens per hash block
BS = 16  # tokens per KV block
PREFIX: dict[str, Any] = {"prefix_block_tokens": H, "block_size_tokens": BS}


def holding(load: InstanceLoad, *hashes: int) -> InstanceLoad:
    """``load`` reporting these prefix hash blocks held."""
    return replace(load, prefix_hashes=frozenset(hashes), prefix_block_tokens=H)


def view(*loads: InstanceLoad, cfg: PolicyConfig = CFG, seed: int = 0) -> DispatchView:
    return DispatchView(loads, cfg, random.Random(seed))


def test_affinity_wins_within_the_margin() -> None:
    # a holds hashes 1, 2, 3 (6 blocks) and runs 2 requests; b runs 1. Demand 10, hit min(3·2, 10 − 1) = 6.
    # After reserving: F'_a = (100 − 40 − 4) / 3 = 18.67, F'_b = (100 − 30 − 10) / 2 = 30; floor 30 − 0.5·30 = 15.
    a, b = holding(inst("a", 100, [20, 20]), 1, 2, 3), inst("b", 100, [30])
    v = view(a, b)
    d = v.pick(10, prefix_hashes=(1, 2, 3), **PREFIX)
    assert d.target_id == "a"
    assert "prefix hit 6 blocks" in d.reason
    assert v.freeness("a") == pytest.approx(56 / 3)  # the reservation is the effective demand, 4 blocks
    assert view(a, b).pick(10).target_id == "b"  # the same request without its prefix: F_a 30 < F_b 70


def test_load_wins_beyond_the_margin() -> None:
    # a runs 3 requests: F'_a = (100 − 60 − 4) / 4 = 9 < the floor 15 (b as above): load wins.
    a, b = holding(inst("a", 100, [20, 20, 20]), 1, 2, 3), inst("b", 100, [30])
    d = view(a, b).pick(10, prefix_hashes=(1, 2, 3), **PREFIX)
    assert d.target_id == "b"
    assert "prefix hit" not in d.reason
    # A margin of 0.75 lowers the floor to 30 − 22.5 = 7.5 <= 9: a again.
    wide = replace(CFG, prefix_affinity_margin=0.75)
    assert view(a, b, cfg=wide).pick(10, prefix_hashes=(1, 2, 3), **PREFIX).target_id == "a"


def test_the_longest_leading_run_counts_and_a_gap_ends_it() -> None:
    # a holds 1 and 3 (not 2): run 1, hit 2. b holds 1, 2, 3: run 3, hit 6. Both idle, equally free: b.
    a, b = holding(inst("a", 100), 1, 3), holding(inst("b", 100), 1, 2, 3)
    v = view(a, b)
    assert v.pick(10, prefix_hashes=(1, 2, 3), **PREFIX).target_id == "b"
    assert v.freeness("b") == pytest.approx(96)  # 100 − (10 − 6)


def test_effective_demand_gives_room_where_the_prefix_is() -> None:
    # a: 30 free, holds hashes 1..5 (10 blocks); b: 20 free. Demand 35: only a has room, and only with the hit
    # (35 − 10 = 25 <= 30).
    a, b = holding(inst("a", 100, [70]), 1, 2, 3, 4, 5), inst("b", 100, [80])
    hashes = (1, 2, 3, 4, 5)
    refused = view(a, b).pick(35, only_if_room=True)
    assert refused.target_id is None and refused.full
    v = view(a, b)
    d = v.pick(35, only_if_room=True, prefix_hashes=hashes, **PREFIX)
    assert d.target_id == "a" and "with room for 35 blocks" in d.reason
    assert v.freeness("a") == pytest.approx((100 - 70 - 25) / 2)
    # The view reserved the 25 new blocks: a has 5 left, room for a 5-block request and then none.
    assert v.pick(5, only_if_room=True, exclude={"b"}).target_id == "a"
    assert v.pick(1, only_if_room=True, exclude={"b"}).full


def test_hits_are_capped_below_the_demand_and_reusable_prefix_stops_before_the_last_token() -> None:
    # The prompt's last token is always computed: a 64-token prompt reuses one 32-token hash block, not two.
    assert reusable_prefix_hashes((7, 8), H, 64) == (7,)
    assert reusable_prefix_hashes((7, 8), H, 65) == (7, 8)
    hashes = (7, 8, 9)
    assert reusable_prefix_hashes(hashes, H, 1000) is hashes  # nothing to cut: no copy
    assert reusable_prefix_hashes((), 0, 10) == ()
    with pytest.raises(ValueError, match="prefix_block_tokens is 0"):
        reusable_prefix_hashes((1,), 0, 10)
    # The view caps a hit at demand − 1 blocks even when a longer prefix is held.
    v = view(holding(inst("a", 100), 1, 2, 3))
    v.pick(3, prefix_hashes=(1, 2, 3), **PREFIX)
    assert v.freeness("a") == pytest.approx(99)  # reserved 3 − 2 = 1 block


def test_a_burst_with_one_prefix_lands_together_until_the_margin() -> None:
    # a and b run 4 requests of 5 blocks each (F = 20). Demand 10, hashes 7..11: hit min(10, 9) = 9 once the
    # view counts the hashes on the first request's target X (drawn from the exact tie). Both report a prefix
    # cache (an unrelated hash 99 held), so what the view sends them counts.
    # F'_X after k requests there: (100 − 20 − 10 − (k − 1)·1 − 1) / (4 + k + 1): 11.5, 9.71, 8.38, 7.33, 6.5;
    # F'_Y stays (100 − 30) / 5 = 14, floor 7: the 2nd to 5th requests join X, the 6th goes to Y.
    loads = [holding(inst("a", 100, [5, 5, 5, 5]), 99), holding(inst("b", 100, [5, 5, 5, 5]), 99)]
    v = view(*loads)
    hashes = (7, 8, 9, 10, 11)
    picks = [str(v.pick(10, prefix_hashes=hashes, **PREFIX).target_id) for _ in range(6)]
    x, y = picks[0], {"a": "b", "b": "a"}[picks[0]]
    assert picks == [x] * 5 + [y]
    assert v.freeness(x) == pytest.approx(66 / 9)
    # Without prefix awareness the same burst spreads: 2 and 2.
    blind = view(*loads, cfg=replace(CFG, prefix_aware_dispatch=False))
    blind_picks = [blind.pick(10, prefix_hashes=hashes, **PREFIX).target_id for _ in range(4)]
    assert Counter(blind_picks) == {"a": 2, "b": 2}


def test_a_target_that_holds_no_prefix_gets_no_hit_from_what_it_was_sent() -> None:
    # Prefix caching off (or an engine without a cache): reports never hold a prefix, so the burst must spread
    # exactly as without prefix awareness; the view's own record of what it sent is no evidence of a cache.
    loads = [inst("a", 100, [5, 5, 5, 5]), inst("b", 100, [5, 5, 5, 5])]
    v = view(*loads)
    picks = [v.pick(10, prefix_hashes=(7, 8, 9, 10, 11), **PREFIX).target_id for _ in range(4)]
    assert Counter(picks) == {"a": 2, "b": 2}
    assert v.freeness("a") == pytest.approx((100 - 20 - 20) / 6)  # every block of demand reserved: no hit


def test_a_fresh_report_replaces_the_hashes_the_view_added() -> None:
    a, b = inst("a", 100), inst("b", 100, [1])
    v = view(a, b)
    assert v.pick(10, prefix_hashes=(5,), **PREFIX).target_id == "a"
    v.update(a)  # a's engine has not cached hash 5 (still prefilling): the report drops the view's guess
    assert v.pick(4, prefix_hashes=(5,), **PREFIX).target_id == "a"  # by load alone: F_a 100 > F_b 99
    assert v.freeness("a") == pytest.approx(96)  # no hit counted: reserved all 4 blocks


def test_no_instance_piles_up_under_one_popular_prefix() -> None:
    # 400 requests of one prefix, dispatched onto 4 equal instances with no report in between: the rule keeps
    # every instance's batch within 1/(1 − margin) = 2x the least loaded one's (+1 for the last pick).
    loads = [inst(f"i{k}", 100_000) for k in range(4)]
    v = view(*loads)
    counts = Counter(v.pick(10, prefix_hashes=(1, 2, 3, 4), **PREFIX).target_id for _ in range(400))
    assert len(counts) == 4
    assert max(counts.values()) <= 2 * min(counts.values()) + 1, counts
    assert max(counts.values()) <= 2 * 400 / 4, counts  # at most twice the fair share


@pytest.mark.parametrize("seed", range(40))
def test_a_prefix_choice_is_never_beyond_the_margin_of_the_freest(seed: int) -> None:
    # Random states and prefixes: the chosen target's freeness after the reservation is never below the floor.
    rng = random.Random(seed)
    cfg = replace(CFG, prefix_affinity_margin=rng.choice([0.0, 0.25, 0.5, 0.9]))
    loads = []
    for k in range(5):
        blocks = [rng.randint(1, 30) for _ in range(rng.randint(0, 6))]
        held = {h for h in range(1, 6) if rng.random() < 0.5}
        loads.append(holding(inst(f"i{k}", 300, blocks), *held))
    hashes = tuple(range(1, rng.randint(2, 6)))
    demand = rng.randint(2, 20)
    v = view(*loads, cfg=cfg, seed=seed)

    def after(load: InstanceLoad) -> float:
        run = next((j for j, h in enumerate(hashes) if h not in load.prefix_hashes), len(hashes))
        hit = min(2 * run, demand - 1)
        return (300 - load.used_blocks - demand + hit) / (load.num_running + 1)

    best = max(after(x) for x in loads)
    chosen = v.pick(demand, prefix_hashes=hashes, **PREFIX).target_id
    assert after(next(x for x in loads if x.instance_id == chosen)) >= best - cfg.prefix_affinity_margin * abs(best)


def test_hashes_of_another_granularity_never_match_and_bad_sizes_are_refused() -> None:
    a = replace(inst("a", 100, [10]), prefix_hashes=frozenset({1}), prefix_block_tokens=64)
    b = inst("b", 100)
    assert view(a, b).pick(10, prefix_hashes=(1,), **PREFIX).target_id == "b"  # a's hash 1 covers 64 tokens
    with pytest.raises(ValueError, match="prefix_block_tokens 24 must be a positive multiple of block_size_tokens 16"):
        view(a).pick(10, prefix_hashes=(1,), prefix_block_tokens=24, block_size_tokens=16)
    with pytest.raises(ValueError, match="prefix_hashes lists 1 hash blocks but prefix_block_tokens is 0"):
        InstanceLoad("x", 10, 0, prefix_hashes=frozenset({1}))
    with pytest.raises(ValueError, match=r"prefix_affinity_margin: must be in \[0, 1\)"):
        PolicyConfig(prefix_affinity_margin=1.0)


def test_domain_view_prefers_the_domain_holding_the_prefix_and_keeps_it_across_a_lagged_summary() -> None:
    # d1: two instances, one holds hashes 1, 2; d2 is freer. Domain F: d1 (200 − 40)/2 = 80, d2 (200 − 20)/1 = 180.
    d1 = summarize_domain("d1", [holding(inst("x", 100, [20]), 1, 2), inst("y", 100, [20])], CFG, taken_s=1.0)
    d2 = summarize_domain("d2", [holding(inst("z", 100, [20]), 50), inst("w", 100)], CFG, taken_s=1.0)
    assert d1.prefix_hashes == frozenset({1, 2}) and d2.prefix_hashes == frozenset({50})  # both cache prefixes
    v = DomainDispatchView([d1, d2], CFG, random.Random(0))
    # Demand 10, hit 4: F'_d1 = (200 − 40 − 6) / 3 = 51.3; F'_d2 = (200 − 30) / 2 = 85, floor 42.5: d1.
    assert v.pick(10, stamp=2.0, prefix_hashes=(1, 2), **PREFIX).target_id == "d1"
    # A new request with hash 9 goes to d2 by load; a summary of d2 taken before it keeps that reservation and
    # the hash it added, so the next request with hash 9 finds it in d2.
    assert v.pick(10, stamp=3.0, prefix_hashes=(9,), **PREFIX).target_id == "d2"
    v.update(d2, as_of=2.5)
    d = v.pick(10, stamp=4.0, prefix_hashes=(9,), **PREFIX)
    assert d.target_id == "d2" and "prefix hit 2 blocks" in d.reason
    # A draining instance's prefix is not the domain's.
    drained = summarize_domain("d3", [holding(inst("u", 100, draining=True), 1), inst("t", 100)], CFG)
    assert drained.prefix_hashes == frozenset()


# Migration pairing (policy/migration.py, docstring 3): the destination's cached prefix blocks count as present.


def _src_and_dst(held: tuple[int, ...]) -> tuple[InstanceLoad, InstanceLoad]:
    """src: 3 requests of 32 blocks (used 96 of 100, F = 4/3 < 3: a source), each prompt hashed 1..8 (16 blocks);
    dst: 70 of 100 used by 2 requests (F = 15 > 3), its cache holding ``held``."""
    prompt = tuple(range(1, 9))
    running = tuple(RequestLoad(f"s-r{i}", 32, prefix_hashes=prompt) for i in range(3))
    src = InstanceLoad("s", 100, 96, running, prefix_hashes=frozenset(prompt), prefix_block_tokens=H)
    return src, holding(inst("d", 100, [40, 30]), *held)


def test_a_destination_holding_the_prefix_takes_a_move_that_would_otherwise_raise_the_potential() -> None:
    src, dst = _src_and_dst(held=tuple(range(1, 9)))  # all 8 hashes: 16 of the request's 32 blocks
    # Without the prefix: V_s − V_d = 26 < v_r = 32, and Φ would rise: 64² + 102² = 14,500 > 96² + 70² = 14,116.
    assert plan_migrations([src, dst], CFG, random.Random(0)) == []
    (move,) = plan_migrations([src, dst], CFG, random.Random(0), block_size_tokens=BS)
    assert (move.src_id, move.dst_id, move.blocks) == ("s", "d", 32)
    assert "16 of its blocks cached there" in move.reason
    # With it the destination grows by 16 blocks only: 64² + 86² = 11,492 < 14,116.
    assert potential([64, 86]) < potential([96, 70]) < potential([64, 102])
    request = src.running[0]
    assert prefix_blocks_on(dst, request, H, BS) == 16
    assert move_lowers_potential(src, dst, request, CFG, dst_held_blocks=16)
    assert not move_lowers_potential(src, dst, request, CFG)
    # switched off with prefix-aware dispatch: the load alone decides, as before
    off = replace(CFG, prefix_aware_dispatch=False)
    assert plan_migrations([src, dst], off, random.Random(0), block_size_tokens=BS) == []


def test_a_gap_in_the_cached_prefix_ends_what_counts() -> None:
    src, dst = _src_and_dst(held=(1, 2, 4, 5, 6, 7, 8))  # hash 3 missing: only 1, 2 (4 blocks) count
    assert prefix_blocks_on(dst, src.running[0], H, BS) == 4
    # 2·32·96 − 2·28·70 = 2,224 > 32² + 28² = 1,808: Φ still lowers (96² + 70² = 14,116 > 64² + 98² = 13,700)
    (move,) = plan_migrations([src, dst], CFG, random.Random(0), block_size_tokens=BS)
    assert "4 of its blocks cached there" in move.reason
    src, dst = _src_and_dst(held=(2, 3, 4, 5, 6, 7, 8))  # the first hash missing: nothing counts
    assert prefix_blocks_on(dst, src.running[0], H, BS) == 0
    assert plan_migrations([src, dst], CFG, random.Random(0), block_size_tokens=BS) == []


def test_cached_blocks_need_no_free_space_on_the_destination() -> None:
    # A draining source's only request, 20 blocks, 12 of them cached on dst (6 hashes); dst has 10 free blocks.
    request = RequestLoad("s-r0", 20, prefix_hashes=(1, 2, 3, 4, 5, 6))
    src = InstanceLoad("s", 20, 20, (request,), prefix_block_tokens=H, draining=True)
    dst = holding(inst("d", 100, [90]), 1, 2, 3, 4, 5, 6)
    assert plan_migrations([src, dst], CFG, random.Random(0)) == []  # 20 > 10 free
    (move,) = plan_migrations([src, dst], CFG, random.Random(0), block_size_tokens=BS)  # 8 new blocks fit
    assert (move.request_id, move.dst_id) == ("s-r0", "d")


def test_prefix_blocks_on_needs_the_same_granularity_and_refuses_bad_sizes() -> None:
    src, dst = _src_and_dst(held=tuple(range(1, 9)))
    request = src.running[0]
    assert prefix_blocks_on(dst, request, 2 * H, BS) == 0  # hashed at another granularity: no match
    assert prefix_blocks_on(dst, request, H, 0) == 0  # no block size: no prefix information
    assert prefix_blocks_on(replace(dst, prefix_hashes=frozenset(), prefix_block_tokens=0), request, H, BS) == 0
    with pytest.raises(ValueError, match="prefix_block_tokens 32 is not a multiple of block_size_tokens 12"):
        prefix_blocks_on(dst, request, H, 12)
    with pytest.raises(ValueError, match="dst_held_blocks 33 not in"):
        move_lowers_potential(src, dst, request, CFG, dst_held_blocks=33)
