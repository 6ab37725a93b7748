from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from policy_factories import CFG, apply_move, inst

from policy import (
    DomainSummary,
    InstanceLoad,
    MigrationDecision,
    PolicyConfig,
    RequestLoad,
    instance_virtual_usage,
    pair_domains,
    plan_migrations,
    potential,
    summarize_domain,
)
from policy.migration import source_slack_blocks
from policy.usage import freeness


def plan(*loads: InstanceLoad, cfg: PolicyConfig = CFG, seed: int = 0, **kw: int) -> list[MigrationDecision]:
    return plan_migrations(list(loads), cfg, random.Random(seed), **kw)


def moves(decisions: list[MigrationDecision]) -> list[tuple[str, str, str, int]]:
    return [(d.src_id, d.dst_id, d.request_id, d.blocks) for d in decisions]


def test_load_balancing_moves_the_shortest_from_lowest_to_highest_freeness() -> None:
    # a: V 90, F (100 − 90)/5 = 2 < 3: source. b: V 10, F 90: destination. c: F 40/3 = 13.3: neither
    # is chosen (b is freer). Shortest request of a (all 18, tie by id): a-r0. 90 − 10 = 80 > 18.
    a = inst("a", 100, [18, 18, 18, 18, 18])
    b = inst("b", 100, [10])
    c = inst("c", 100, [20, 20, 20])
    decisions = plan(a, b, c)
    assert moves(decisions) == [("a", "b", "a-r0", 18)]
    assert "source F=2.00 < 3.0; destination F=90.00; V_src 90 − V_dst 10 > v_r 18" in decisions[0].reason


def test_balanced_cluster_plans_nothing() -> None:
    assert plan(inst("a", 100, [20, 20]), inst("b", 100, [30])) == []


def test_defragmentation_queued_request_makes_its_instance_look_full() -> None:
    # a: 60 used, 40 free, a queued request needs 50 -> V = 110, F = (100 − 110)/2 = −5: source.
    # Moving a-r0 (30) to b (V 20) frees room: a then has 70 free >= 50.
    a = inst("a", 100, [30, 30], num_waiting=1, head_demand_blocks=50)
    b = inst("b", 100, [20])
    decisions = plan(a, b)
    assert moves(decisions) == [("a", "b", "a-r0", 30)]
    after = apply_move([a, b], decisions[0])
    assert after[0].free_blocks == 70 >= a.head_demand_blocks
    # Without the queue a (F 20) is not a source.
    assert plan(inst("a", 100, [30, 30]), b) == []


def test_priority_normal_requests_move_off_the_high_priority_instance() -> None:
    cfg = PolicyConfig(priority_headroom_blocks={1: 60})
    # a: h (10, high), 15, 20 -> V = 45 + 60 = 105, F = −1.67. b: V 45, F 55. Same real usage.
    # Normal before high, then shortest: a-r1 (15). 105 − 45 = 60 > 15.
    a = inst("a", 100, [10, 15, 20], priorities=[1])
    b = inst("b", 100, [45])
    assert moves(plan(a, b, cfg=cfg)) == [("a", "b", "a-r1", 15)]
    no_priority = PolicyConfig(priority_headroom_blocks={})
    assert plan(a, b, cfg=no_priority) == []


def test_scale_out_warming_instance_attracts_migrations() -> None:
    # a: F 1 (source). b: F 13.3. c warming up: V −50, F 150 -> freest destination.
    a = inst("a", 100, [19, 19, 19, 19, 19])
    b = inst("b", 100, [20, 20, 20])
    c = inst("c", 100, warming_up=True)
    assert moves(plan(a, b, c)) == [("a", "c", "a-r0", 19)]


def test_drain_everything_leaves_even_to_a_fuller_instance() -> None:
    # a drains holding 30 blocks. b holds 70: fuller in real blocks, still takes both.
    a = inst("a", 100, [10, 20], draining=True)
    b = inst("b", 100, [14] * 5)
    loads = [a, b]
    planned = []
    for _ in range(3):
        decisions = plan(*loads)
        planned += moves(decisions)
        for d in decisions:
            loads = apply_move(loads, d)
    assert planned == [("a", "b", "a-r0", 10), ("a", "b", "a-r1", 20)]
    assert loads[0].running == ()
    assert loads[1].free_blocks == 0


def test_drain_uses_a_low_freeness_instance_but_never_a_preempting_or_full_one() -> None:
    a = inst("a", 100, [10], draining=True)
    low = inst("low", 100, [18, 18, 18, 18, 18])  # F = 2: a source itself, but has 10 free
    preempting = inst("p", 100, preempting=True)
    full = inst("full", 100, [95])
    assert moves(plan(a, low, preempting, full)) == [("a", "low", "a-r0", 10)]
    assert plan(a, preempting, full) == []


def test_draining_source_moves_high_priority_first() -> None:
    a = inst("a", 100, [5, 30], priorities=[0, 1], draining=True)
    assert moves(plan(a, inst("b", 100))) == [("a", "b", "a-r1", 30)]


def test_preempting_instance_is_a_source_even_when_free() -> None:
    a = inst("a", 100, [30, 20], preempting=True)  # F = 25, but preempting
    b = inst("b", 100)
    assert moves(plan(a, b)) == [("a", "b", "a-r1", 20)]


def test_move_must_lower_potential_and_fit_real_free_blocks() -> None:
    # a: V 98 (F 1). b: F 6 but only 12 free -> a-r0 (49) does not fit. No move.
    a = inst("a", 100, [49, 49])
    b = inst("b", 100, [11, 11, 11, 11, 11, 11, 11, 11])
    assert plan(a, b) == []
    # c: V 60, F 40: 98 − 60 = 38 < 49 -> would raise Φ. No move either.
    c = inst("c", 100, [60])
    assert plan(a, c) == []
    assert potential([98, 60]) < potential([49, 109])


def test_unmigratable_requests_stay() -> None:
    pinned = RequestLoad("a-r0", 18, migratable=False)
    a = InstanceLoad("a", 100, 90, (pinned, *inst("a", 100, [18] * 5).running[1:]))
    assert moves(plan(a, inst("b", 100))) == [("a", "b", "a-r1", 18)]


def test_pairing_lowest_source_with_highest_destination_and_max_moves() -> None:
    s1 = inst("s1", 100, [24, 24, 24, 24])  # F = 1
    s2 = inst("s2", 100, [49, 49])  # F = 1, tie with s1: broken by the seeded draw
    s3 = inst("s3", 100, [33, 33, 33])  # F = 0.33: lowest
    d1 = inst("d1", 100)  # F 100
    d2 = inst("d2", 100, [10])  # F 90
    d3 = inst("d3", 100, [30])  # F 70
    decisions = plan(s1, s2, s3, d1, d2, d3)
    pairs = [(d.src_id, d.dst_id) for d in decisions]
    assert pairs[0] == ("s3", "d1")
    assert {p[1] for p in pairs[1:]} == {"d2", "d3"}
    assert {p[0] for p in pairs} == {"s1", "s2", "s3"}
    assert len(plan(s1, s2, s3, d1, d2, d3, max_moves=1)) == 1
    assert plan(s1, s2, s3, d1, d2, d3, max_moves=0) == []
    capped = PolicyConfig(max_migrations_per_round=2)
    assert len(plan(s1, s2, s3, d1, d2, d3, cfg=capped)) == 2


def test_candidate_policy_longest() -> None:
    a = inst("a", 100, [10, 30, 56])  # V 96, F 4/3
    cfg = PolicyConfig(priority_headroom_blocks={}, candidate_policy="longest")
    # longest 56: 96 − 0 > 56 -> moves the longest.
    assert moves(plan(a, inst("b", 100), cfg=cfg)) == [("a", "b", "a-r2", 56)]


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="instance 'a' appears twice"):
        plan(inst("a", 10), inst("a", 10))
    with pytest.raises(ValueError, match="max_moves must be >= 0, got -1"):
        plan(inst("a", 10), max_moves=-1)


def test_potential() -> None:
    assert potential([3.0, 4.0]) == 25.0
    assert potential([]) == 0
    assert potential([1.0, math.inf]) == math.inf
    a, b = inst("a", 100, [50, 45]), inst("b", 100, [10])  # a: F 2.5, moves its 45
    before = potential(instance_virtual_usage(x, CFG) for x in (a, b))
    after = potential(instance_virtual_usage(x, CFG) for x in apply_move([a, b], plan(a, b)[0]))
    assert (before, after) == (95**2 + 10**2, 50**2 + 55**2)


def test_pair_domains() -> None:
    def dom(domain_id: str, blocks: list[int], draining: bool = False) -> DomainSummary:
        return summarize_domain(domain_id, [inst(domain_id + "-i", 100, blocks, draining=draining)], CFG)

    d1 = dom("d1", [33, 33, 33])  # F 0.33: source
    d2 = dom("d2", [50])  # F 50
    d3 = dom("d3", [80])  # F 20
    d4 = dom("d4", [10], draining=True)  # F −inf: first source
    d5 = dom("d5", [2] * 40)  # F 0.5: source, not a destination
    assert pair_domains([d1, d2, d3, d4, d5], CFG) == [("d4", "d2"), ("d1", "d3")]
    assert pair_domains([d2, d3], CFG) == []
    full = summarize_domain("full", [inst("f", 100, [100])], CFG)
    assert pair_domains([d4, full, d5], CFG) == [("d4", "d5")]
    with pytest.raises(ValueError, match="repeated domain ids"):
        pair_domains([d1, d1], CFG)


def test_a_request_never_moves_where_it_could_not_grow() -> None:
    # issue 11: a request that may grow to 238 blocks (3,799 tokens) must not go to a 100-block instance
    # (1,600 tokens), which would preempt it and freeze; it goes to the large one even though that is less free.
    big_request = RequestLoad("a-r0", 18, max_blocks=238)
    a = InstanceLoad("a", 300, 290, running=(big_request, *[RequestLoad(f"a-r{i}", 68) for i in range(1, 5)]))
    small = inst("small", 100)
    large = inst("large", 300, [100])
    assert moves(plan(a, small, large)) == [("a", "large", "a-r0", 18)]
    assert moves(plan(a, small)) == [("a", "small", "a-r1", 68)]  # the next candidate that can grow there


# ---- batch slots (issue 15: the rule saw memory, not slots) ------------------------------------------------
def test_an_instance_with_every_slot_taken_and_a_queue_is_a_source_even_with_free_memory() -> None:
    # a: 4 of 4 slots, 40 of 1000 blocks used (F (1000 − 40)/4 = 240), one request waits for a slot (its
    # prompt needs 2 blocks: V 42, the head demand). b: 10 blocks used (F 990), 1 slot of 4 taken. Φ alone plans
    # nothing (V_a − V_b = 32 > v_r 10 holds, but a is no source: F 240 > 3, not preempting); with the
    # slot limits known a-r0 (the shortest normal) moves to b
    a = inst("a", 1000, [10, 10, 10, 10], num_waiting=1, head_demand_blocks=2, max_num_seqs=4)
    b = inst("b", 1000, [10], max_num_seqs=4)
    assert a.slots_starved and not b.slots_starved and b.takes_one_more
    decisions = plan(a, b)
    assert moves(decisions) == [("a", "b", "a-r0", 10)]
    assert decisions[0].reason == (
        "source slots full (4 of 4 running, 1 waiting); destination F=990.00; V_src 42 − V_dst 10 > v_r 10 "
        "(priority-then-size)"
    )
    unknown = [replace(x, max_num_seqs=0) for x in (a, b)]  # what every report said before
    assert plan(*unknown) == []


def test_a_move_for_slots_needs_no_drop_in_the_potential() -> None:
    # a: 4 slots full of 10-block requests (V 40 + 2), b holds one 300-block request (V 300): the move raises
    # Φ (V_a − V_b < 0), and is still planned: a's waiting request gets a slot
    a = inst("a", 1000, [10, 10, 10, 10], num_waiting=1, head_demand_blocks=2, max_num_seqs=4)
    b = inst("b", 1000, [300], max_num_seqs=4)
    assert instance_virtual_usage(a, CFG) < instance_virtual_usage(b, CFG)
    assert moves(plan(a, b)) == [("a", "b", "a-r0", 10)]


def test_normal_requests_leave_a_slot_starved_instance_before_high_priority_ones() -> None:
    # a's slots: a high-priority request (the smallest) and three normal ones; a normal one moves
    a = inst("a", 1000, [5, 10, 20, 30], priorities=[1], num_waiting=1, head_demand_blocks=2, max_num_seqs=4)
    b = inst("b", 1000, [], max_num_seqs=4)
    assert moves(plan(a, b)) == [("a", "b", "a-r1", 10)]


def test_no_destination_without_a_slot_for_one_more_beside_its_queue() -> None:
    # a: memory source (F (100 − 90)/5 = 2). b: freest (F 99), but its 1 of 2 slots + a waiting request
    # leave no slot for one more; c (F 40, 2 of 4 slots, nothing waiting) takes the move instead
    a = inst("a", 100, [18, 18, 18, 18, 18], max_num_seqs=8)
    b = inst("b", 100, [1], num_waiting=1, max_num_seqs=2)
    c = inst("c", 100, [10, 10], max_num_seqs=4)
    assert not b.takes_one_more and c.takes_one_more
    assert moves(plan(a, b, c)) == [("a", "c", "a-r0", 18)]
    assert moves(plan(a, replace(b, max_num_seqs=0), c)) == [("a", "b", "a-r0", 18)]  # before: b


def test_a_move_for_slots_is_not_reversed() -> None:
    a = inst("a", 1000, [10, 10, 10, 10], num_waiting=1, head_demand_blocks=2, max_num_seqs=4)
    b = inst("b", 1000, [300], max_num_seqs=4)
    (move,) = plan(a, b)
    a2, b2 = apply_move([a, b], move)
    # a's queue takes the slot at its next step: 4 running again, nothing waiting
    head = RequestLoad("a-new", 2)
    a3 = replace(a2, running=(*a2.running, head), used_blocks=a2.used_blocks + 2, num_waiting=0, head_demand_blocks=0)
    assert not a3.slots_starved and not a3.takes_one_more and not b2.slots_starved
    assert plan(a3, b2) == []


def test_a_slot_starved_destination_slot_full_everywhere_plans_nothing() -> None:
    a = inst("a", 1000, [10, 10], num_waiting=3, head_demand_blocks=2, max_num_seqs=2)
    b = inst("b", 1000, [10, 10], num_waiting=1, head_demand_blocks=2, max_num_seqs=2)
    assert plan(a, b) == []


def test_max_num_seqs_is_checked() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be >= 0, got -1"):
        InstanceLoad("a", 10, 0, max_num_seqs=-1)


@pytest.mark.parametrize(
    ("load", "slack"),
    [
        (inst("a", 100, [10, 10]), 100 - 20 - 3 * 2),  # M − ΣV − thr·B = 74
        (inst("a", 100, [10], priorities=[1]), 100 - 30 - 3),  # headroom 20 counts
        (inst("a", 100, [], num_waiting=1, head_demand_blocks=30, queued_demand_blocks=30), 100 - 30 - 3),
        (inst("a", 100, [], warming_up=True), 100 + 50 - 3),
        (inst("a", 100, [40, 40]), 100 - 80 - 6),  # F = 10 >= 3: still 14 blocks to go
        (inst("a", 100, [50, 49]), 100 - 99 - 6),  # a source now: negative
        (inst("a", 100, [10], draining=True), -math.inf),
        (inst("a", 100, [10], preempting=True), -math.inf),
        (inst("a", 100, [9, 9], max_num_seqs=2, num_waiting=1, head_demand_blocks=1), -math.inf),  # slots
    ],
)
def test_source_slack_is_the_blocks_an_instance_takes_before_it_is_a_source(load: InstanceLoad, slack: float) -> None:
    assert source_slack_blocks(load, CFG) == slack
    _check_slack(load, slack, CFG)


def _check_slack(load: InstanceLoad, slack: float, cfg: PolicyConfig) -> None:
    if math.isfinite(slack):  # u <= slack more blocks: no source; one more: a source (plan_migrations' own rule)
        for u, is_source in ((math.floor(slack), False), (math.floor(slack) + 1, True)):
            if 0 <= load.used_blocks + u <= load.capacity_blocks:
                grown = replace(load, used_blocks=load.used_blocks + u)
                assert (freeness(grown, cfg) < cfg.migrate_out_freeness_below) is is_source, u


@pytest.mark.parametrize(
    ("load", "slack"),
    [
        # ΣV = 20 + 2 · headroom 20 = 60: F = (40 − u) / 2 >= −6 while u <= 52
        (inst("a", 100, [10, 10], priorities=[1, 1]), 100 - 60 + 6 * 2),
        (inst("a", 100, [40, 40], priorities=[1, 1]), 100 - 120 + 6 * 2),  # 20 short: F = −10, a source now
        (inst("a", 100, []), 100 + 6 * 1),
    ],
)
def test_source_slack_below_a_negative_threshold(load: InstanceLoad, slack: float) -> None:
    cfg = replace(CFG, migrate_out_freeness_below=-6)  # CFG: headroom 20 a high-priority request
    assert source_slack_blocks(load, cfg) == pytest.approx(slack)
    _check_slack(load, slack, cfg)
