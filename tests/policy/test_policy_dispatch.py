from __future__ import annotations

import copy
import pickle
import random
from collections import Counter

import pytest
from policy_factories import CFG, inst

from policy import DispatchDecision, DispatchView, DomainDispatchView, DomainSummary, PolicyConfig, summarize_domain
from policy.dispatch import _below, _sample_positions


def view(*loads, cfg: PolicyConfig = CFG, seed: int = 0) -> DispatchView:  # type: ignore[no-untyped-def]
    return DispatchView(loads, cfg, random.Random(seed))


def test_load_balancing_picks_the_freest() -> None:
    # F: a (100−60)/3 = 13.3, b (100−30)/1 = 70, c (100−80)/2 = 10
    v = view(inst("a", 100, [20, 20, 20]), inst("b", 100, [30]), inst("c", 100, [40, 40]))
    d = v.pick(10)
    assert d.target_id == "b"
    # b after reserving 10 + headroom: (100 − 30 − 10 − h) / (1 + 1)
    f_after = (100 - 30 - 10 - CFG.headroom_blocks(0)) / 2
    reason = f"freest instance (F={f_after:.2f} after reserving, 1 near-tied) with room for 10 blocks"
    assert d.reason == reason  # written when read, from the figures of the pick
    assert d.reason == reason  # and the same text when read again
    assert d == DispatchDecision("b", reason) and d != DispatchDecision("b", reason, full=True)
    assert repr(d) == f"DispatchDecision(target_id='b', reason={reason!r}, full=False)"
    again = v.pick(10)  # unread: pickled and copied with its reason written
    assert pickle.loads(pickle.dumps(again)) == copy.copy(again) == again
    assert "after reserving" in pickle.loads(pickle.dumps(again)).reason


def test_priority_instance_looks_heavier_and_new_work_avoids_it() -> None:
    cfg = PolicyConfig(priority_headroom_blocks={1: 60}, tie_tolerance=0.0)
    # Same real usage (45 blocks each). a runs a high-priority request: V = 45 + 60 = 105, F = −1.67;
    # b: V = 45, F = 55.
    a = inst("a", 100, [10, 15, 20], priorities=[1])
    b = inst("b", 100, [45])
    assert [view(a, b, cfg=cfg, seed=s).pick(5).target_id for s in range(5)] == ["b"] * 5


def test_warming_up_instance_attracts_dispatch_until_it_looks_like_the_others() -> None:
    # a, b: F = 40/3 = 13.33. c warming up, empty: V = −50, F = 150. Each pick of 10 blocks adds 10 to
    # c's usage and 1 to its batch: after k picks F_c = (150 − 10k)/k = 140, 65, 40, 27.5, 20, 15, 11.4.
    v = view(inst("a", 100, [20, 20, 20]), inst("b", 100, [20, 20, 20]), inst("c", 100, warming_up=True))
    picks = [v.pick(10).target_id for _ in range(8)]
    assert picks[:7] == ["c"] * 7
    assert picks[7] in {"a", "b"}
    assert v.freeness("c") == pytest.approx(80 / 7)


def test_of_two_overloaded_instances_the_longer_queue_does_not_look_freer() -> None:
    # Dispatch's ΣV counts every queued request's demand: a is 120 blocks short behind 20 queued requests, b 40
    # short behind 2; both run 2. Below zero F is the share of capacity short: a −1.2, b −0.4. Llumnix's quotient
    # divided by running + waiting, −120/22 against −40/4, and picked a: the longer the queue, the more it got
    # (docs/policy.md, "Freeness").
    a = inst("a", 100, [50, 50], num_waiting=20, head_demand_blocks=20, queued_demand_blocks=120)
    b = inst("b", 100, [50, 50], num_waiting=2, head_demand_blocks=20, queued_demand_blocks=40)
    v = view(a, b)
    assert (v.freeness("a"), v.freeness("b")) == (-1.2, -0.4)
    assert [view(a, b, seed=s).pick(10).target_id for s in range(5)] == ["b"] * 5


def test_a_larger_overloaded_instance_is_not_held_back_by_its_longer_batch() -> None:
    # big: 400 blocks, 40 short (10 %) with 16 running; small: 100 blocks, 20 short (20 %) with 4 running. The
    # big one gets the request; a deficit times the requests (−640 against −80) would have sent it to the small one.
    big = inst("big", 400, [25] * 16, num_waiting=1, head_demand_blocks=40, queued_demand_blocks=40)
    small = inst("small", 100, [25] * 4, num_waiting=1, head_demand_blocks=20, queued_demand_blocks=20)
    v = view(big, small)
    assert (v.freeness("big"), v.freeness("small")) == (-0.1, -0.2)
    assert [view(big, small, seed=s).pick(5).target_id for s in range(5)] == ["big"] * 5


def test_draining_instance_gets_nothing() -> None:
    v = view(inst("a", 100, draining=True), inst("b", 100, [90, 5]))
    assert {v.pick(5).target_id for _ in range(5)} == {"b"}


def test_burst_of_8_spreads_over_8_equal_instances() -> None:
    # Each pick reserves 10 blocks on its target: its F drops from 100 to 90, out of the 5 % near-tie band.
    v = DispatchView([inst(f"i{k}", 100) for k in range(8)], PolicyConfig(), random.Random(7))
    picks = {v.pick(10).target_id for _ in range(8)}
    assert picks == {f"i{k}" for k in range(8)}


def test_update_replaces_state_and_drops_reservations() -> None:
    a, b = inst("a", 100), inst("b", 100, [5])  # F 100 and 95
    v = view(a, b)
    assert v.pick(10).target_id == "a"
    assert v.freeness("a") == 90.0
    assert v.pick(10).target_id == "b"  # a's reservation counts: 90 < 95
    v.update(a)  # a fresh report of a (it did not count the request yet): reservation dropped
    assert v.freeness("a") == 100.0
    assert v.freeness("b") == pytest.approx((100 - 15) / 2)
    v.update(inst("c", 100))  # a new instance joins
    v.remove("a")
    v.remove("a")  # idempotent
    assert v.pick(10).target_id == "c"


def test_priority_pick_reserves_headroom_too() -> None:
    v = view(inst("a", 100))
    v.pick(10, priority=1)
    assert v.freeness("a") == 70.0  # (100 − (10 + 20)) / 1


def test_room_now_beats_higher_freeness() -> None:
    # a: F = 50 but only 50 free; b: F = 25 with 100 free. An 80-block request fits only b now.
    v = view(inst("a", 200, [150]), inst("b", 200, [25, 25, 25, 25]))
    assert v.pick(80).target_id == "b"


def test_queued_head_of_line_demand_takes_room_first() -> None:
    # a: 60 free but a queued request needs 50 of them, so a 20-block request has no room there.
    # F_a = (100 − 40 − 50)/2 = 5; b: 30 free, F = 30.
    a = inst("a", 100, [20, 20], num_waiting=1, head_demand_blocks=50)
    assert view(a, inst("b", 100, [70])).pick(20).target_id == "b"


def test_no_room_anywhere_picks_freest_capable_and_says_it_will_queue() -> None:
    # 'small' is freest (F = 64) but can never hold 100 blocks; b (F = 40) and c (F = 20) could,
    # but neither has 100 free now.
    v = view(inst("small", 64), inst("b", 200, [160]), inst("c", 200, [90, 90]))
    d = v.pick(100)
    assert d.target_id == "b"
    assert "no instance has 100 free blocks now; the request will queue" in d.reason


@pytest.mark.parametrize(
    ("loads", "reason"),
    [
        ((), "no instances to dispatch to"),
        ((inst("a", 500, draining=True), inst("b", 500, draining=True)), "all 2 instances are draining"),
        (
            (inst("a", 100), inst("b", 120), inst("c", 500, draining=True)),
            "request needs 150 blocks but the largest non-draining instance can hold 120 blocks",
        ),
    ],
)
def test_refusal_names_demand_and_largest_capacity(loads: tuple, reason: str) -> None:  # type: ignore[type-arg]
    d = view(*loads).pick(150)
    assert d.target_id is None
    assert reason in d.reason


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="demand_blocks must be >= 0, got -1"):
        view(inst("a", 10)).pick(-1)
    with pytest.raises(ValueError, match="need_blocks must be >= 0, got -2"):
        view(inst("a", 10)).pick(1, need_blocks=-2)
    with pytest.raises(ValueError, match="instance 'a' appears twice"):
        view(inst("a", 10), inst("a", 20))


def test_a_request_goes_where_it_can_grow_not_where_it_starts_freest() -> None:
    # issue 11: a 1,000-block and a 100-block instance; the small one is freer but the request may grow to
    # 300 blocks (prompt + max_tokens): only the large one can hold it.
    v = view(inst("big", 1000, [950]), inst("small", 100))  # F: big 50, small 100
    assert v.pick(10).target_id == "small"  # demand alone: the freer one
    assert v.pick(10, need_blocks=300).target_id == "big"
    refused = v.pick(10, need_blocks=1001)
    assert refused.target_id is None and "can hold 1000 blocks" in refused.reason


def test_excluded_targets_keep_their_reservations() -> None:
    v = view(inst("a", 100), inst("b", 100))
    first = v.pick(40).target_id
    assert first is not None
    other = "b" if first == "a" else "a"
    assert v.pick(40, exclude={other}).target_id == first  # the tried one is skipped, its state kept
    assert v.freeness(first) == pytest.approx((100 - 80) / 2)  # both reservations still counted there
    assert v.pick(1, exclude={"a", "b"}).reason == "every instance that is not draining was tried"


def test_near_ties_are_drawn_with_the_seeded_rng() -> None:
    # F = 100, 98, 96, 80. Tolerance 5 %: floor 95, so a, b, c are near-tied and d never picked.
    loads = [inst("a", 100), inst("b", 100, [2]), inst("c", 100, [4]), inst("d", 100, [20])]
    cfg = PolicyConfig(tie_tolerance=0.05)
    counts: Counter[str | None] = Counter()
    for seed in range(300):
        counts[DispatchView(loads, cfg, random.Random(seed)).pick(1).target_id] += 1
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) > 60
    first = [DispatchView(loads, cfg, random.Random(3)).pick(1).target_id for _ in range(2)]
    assert first[0] == first[1]


def summary(domain_id: str, free: int, max_cap: int, **kw: object) -> DomainSummary:
    fields: dict[str, object] = {
        "num_instances": 2,
        "capacity_blocks": 2 * max_cap,
        "virtual_usage": float(2 * max_cap - free),
        "freeness": float(free),
        "largest_free_blocks": min(free, max_cap),
        "max_instance_capacity_blocks": max_cap,
        "num_running": 1,
        "num_waiting": 0,
        "draining": False,
    } | kw
    return DomainSummary(domain_id, **fields)  # type: ignore[arg-type]


def test_domain_view_uses_largest_instance_capacity_and_spreads_a_burst() -> None:
    # d1 is freest (F = 300) but its instances hold at most 100 blocks; d2 and d3 hold 400.
    doms = [summary("d1", 300, 100), summary("d2", 200, 400), summary("d3", 200, 400)]
    v = DomainDispatchView(doms, CFG, random.Random(0))
    assert {v.pick(150).target_id, v.pick(150).target_id} == {"d2", "d3"}
    assert v.pick(10).target_id == "d1"
    d = v.pick(500)
    assert d.target_id is None
    assert "request needs 500 blocks but the largest non-draining domain can hold 400 blocks" in d.reason


def test_domain_view_from_summaries_skips_draining_domain() -> None:
    busy = summarize_domain("busy", [inst("a", 100, [50, 40])], CFG)  # F = 5
    gone = summarize_domain("gone", [inst("b", 100, draining=True)], CFG)
    v = DomainDispatchView([busy, gone], CFG, random.Random(0))
    assert v.pick(5).target_id == "busy"
    v.remove("busy")
    assert v.pick(5).reason == "the only domain is draining"


class _Scanning(DomainDispatchView):
    """The same view finding every pick's pool by going over all its domains (the reference of the index)."""

    def __init__(self, cfg: PolicyConfig, rng: random.Random, choices: int) -> None:
        super().__init__((), cfg, rng, choices)
        self._index = None


def test_a_sampling_view_finds_its_pools_by_index_as_by_going_over_every_domain() -> None:
    """A long seeded mix of summaries (full domains, draining ones, small ones, some holding a prefix), removals
    and picks (with exclusions, demands that only some domains have room for, requests too large for some, prefix
    hashes) on pools of 2 to 60 domains (``random.sample`` copies a pool of at most 21 and indexes a larger one):
    the indexed view and the scanning one make every pick alike and see every domain alike after it."""
    cfg = PolicyConfig(domain_choices=2, prefix_aware_dispatch=True)
    events = random.Random(5)
    compared, sizes, kinds = 0, set(), Counter()
    for domains_n in (2, 7, 21, 22, 60):
        views = [DomainDispatchView((), cfg, random.Random(11), 2), _Scanning(cfg, random.Random(11), 2)]
        domains = [f"d{i:02d}" for i in range(domains_n)]
        for _ in range(1500):
            roll = events.random()
            if roll < 0.3:
                d = events.choice(domains)
                capacity = events.choice((100, 100, 100, 40))
                free = events.choice((0, 3, 20, 60, capacity, capacity, capacity))
                s = DomainSummary(
                    d, 1, capacity, float(capacity - free), float(free), free, capacity, 1, 0,
                    draining=events.random() < 0.1,
                    prefix_hashes=frozenset({7, 8}) if events.random() < 0.3 else frozenset(),
                )  # fmt: skip
                as_of = events.choice((None, 0.5))
                for v in views:
                    v.update(s, as_of=as_of)
            elif roll < 0.33:
                d = events.choice(domains)
                for v in views:
                    v.remove(d)
            else:
                demand = events.randrange(1, 70)
                need = events.choice((0, demand, 90))
                exclude = set(events.sample(domains, events.randrange(0, min(4, domains_n))))
                hashes = (7, 8) if events.random() < 0.2 else ()
                only_if_room = events.random() < 0.3
                got = [
                    v.pick(
                        demand, need_blocks=need, stamp=1.0, exclude=exclude,
                        only_if_room=only_if_room, prefix_hashes=hashes,
                        prefix_block_tokens=32 if hashes else 0, block_size_tokens=16 if hashes else 0,
                    )
                    for v in views
                ]  # fmt: skip
                assert got[0] == got[1]
                compared += 1
                kinds[
                    ("picked" if got[0].target_id else "full" if got[0].full else "refused", "hit" in got[0].reason)
                ] += 1
                capable, roomy = views[0]._pools(max(demand, need), demand, exclude)
                sizes.add(len(roomy or capable))
            for d in domains:
                if d in views[1]._targets:
                    assert views[0].freeness(d) == views[1].freeness(d)
                    assert views[0].reservations(d) == views[1].reservations(d)
    assert compared > 4500
    assert {k for k, _ in kinds} == {"picked", "full", "refused"} and kinds[("picked", True)] > 0
    assert min(sizes) == 0 and max(sizes) > 21


@pytest.mark.parametrize("n", [1, 2, 5, 21, 22, 37, 38, 60, 512, 4096])
def test_a_view_draws_as_random_sample_and_random_choice(n: int) -> None:
    """A sampling view draws its ``choices`` domains with ``_sample_positions``, a compiled copy of CPython's
    ``Random.sample`` (a pool of positions up to its small-set size, else redraws until a new one): the same
    positions in the same order, and the generator left in the same state, for every size around the two methods'
    boundary (21 for up to 5 draws, 21 + 4**ceil(log4(3k)) beyond) and both sides of it. Near-ties are drawn with
    ``_below`` as ``Random.choice`` draws."""
    for k in sorted({1, 2, 3, 5, 6, 7, 12, n} & set(range(1, n + 1))):
        for seed in range(40):
            reference, ours = random.Random(seed), random.Random(seed)
            assert _sample_positions(ours, n, k) == reference.sample(range(n), k), (n, k, seed)
            assert ours.getstate() == reference.getstate(), (n, k, seed)
    for seed in range(40):  # a near-tie's draw, as Random.choice
        reference, ours = random.Random(seed), random.Random(seed)
        assert [_below(ours, n) for _ in range(5)] == [reference.choice(range(n)) for _ in range(5)], (n, seed)
        assert ours.getstate() == reference.getstate(), (n, seed)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "blocks"),
    [
        (2048, 1, (128, 128)),  # no decode step: the one token is never stored
        (2048, 2, (129, 129)),
        (2047, 2, (128, 128)),
        (100, 500, (7, 38)),  # ceil(101 / 16) to start, ceil(599 / 16) at most
        (1, 1, (1, 1)),
    ],
)
def test_request_kv_blocks(prompt: int, max_tokens: int, blocks: tuple[int, int]) -> None:
    from policy.dispatch import request_kv_blocks

    assert request_kv_blocks(prompt, max_tokens, 16) == blocks
