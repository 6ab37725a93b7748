"""The gateway's decision core: domains per model, stamped reservations, expiry. No I/O, no clock."""

from __future__ import annotations

import random

import pytest

from gateway.core import GatewayCore
from policy.dispatch import DomainDispatchView
from policy.domain import DomainSummary
from policy.types import PolicyConfig


def summary(domain: str, used: int, model: str = "m", taken_s: float = 0.0, capacity: int = 100) -> DomainSummary:
    free = capacity - used
    return DomainSummary(
        domain, 1, capacity, float(used), float(free), free, capacity, 1, 0, False, model=model, taken_s=taken_s
    )


def gw(ttl_s: float = 1.0) -> GatewayCore:
    return GatewayCore(PolicyConfig(tie_tolerance=0.0), random.Random(0), reservation_ttl_s=ttl_s)


def test_with_no_domain_a_refusal_says_none_has_a_summary_now() -> None:
    g = gw()
    assert g.pick("y", 5, now_s=1.0).reason == "model 'y' is not served: no domain scheduler has a summary now"
    g.update("a", [summary("a", 0, model="y")])
    assert g.pick("y", 5, now_s=1.0).target_id == "a"
    g.remove("a")  # every domain gone: it said "served: nothing yet", as before any had a summary
    assert g.pick("y", 5, now_s=2.0).reason == "model 'y' is not served: no domain scheduler has a summary now"


def test_per_model_views_and_refusal_naming_what_is_served() -> None:
    g = gw()
    g.update("a", [summary("a", 0, model="x"), summary("a", 50, model="y")])
    g.update("b", [summary("b", 10, model="y")])
    assert (g.models(), g.domains("y"), g.domains("x")) == (["x", "y"], ["a", "b"], ["a"])
    assert g.pick("y", 5, now_s=1.0).target_id == "b"
    assert g.pick("x", 5, now_s=1.0).target_id == "a"
    refused = g.pick("z", 5, now_s=1.0)
    assert refused.target_id is None and refused.reason == "model 'z' is not served (served: x, y)"
    assert g.pick("", 5, now_s=1.0).target_id is None  # two models: a request must name one
    g.update("a", [summary("a", 50, model="y")])  # a stopped serving x
    assert g.models() == ["y"] and g.pick("", 5, now_s=1.0).target_id in ("a", "b")
    g.remove("b")
    assert g.domains() == ["a"]
    g.remove("b")  # idempotent
    g.update("b", [summary("b", 10, model="x")])  # back, serving another model
    assert (g.domains("x"), g.domains("y"), g.models()) == (["b"], ["a"], ["x", "y"])
    g.update("a", [])  # a serves nothing now: every model of it dropped
    assert (g.domains(), g.models()) == (["b"], ["x"])
    with pytest.raises(ValueError, match="a summary names domain 'b'"):
        g.update("a", [summary("b", 0)])


def test_a_summary_taken_before_a_pick_keeps_it_one_taken_after_replaces_it() -> None:
    g = gw(ttl_s=10.0)
    g.update("a", [summary("a", 0)])
    g.update("b", [summary("b", 20)])
    assert g.pick("m", 30, now_s=1.0).target_id == "a"  # freer; now a carries 30 reserved blocks
    g.update("a", [summary("a", 1, taken_s=0.5)])  # taken before the pick: the pick stays reserved
    assert g.pick("m", 30, now_s=1.1).target_id == "b"
    g.update("a", [summary("a", 1, taken_s=1.05)])  # counts the first pick, not the one to b
    g.update("b", [summary("b", 20, taken_s=1.05)])  # does not count the pick at 1.1: kept
    assert g.pick("m", 1, now_s=1.2).target_id == "a"


def test_a_summary_delivered_again_keeps_the_reservations_a_new_one_drops_them() -> None:
    g = gw(ttl_s=10.0)
    first = summary("a", 0, taken_s=1.0)
    g.update("a", [first])
    g.update("b", [summary("b", 20, taken_s=1.0)])
    assert g.pick("m", 30, now_s=2.0).target_id == "a"  # a carries 30 reserved blocks now
    g.update("a", [first])  # the same summary again (a delivery repeated)
    g.update("a", [summary("a", 0, taken_s=1.0)])  # an equal one: nothing new either
    assert g.pick("m", 30, now_s=2.1).target_id == "b"  # a's reservation kept
    g.update("a", [summary("a", 0, taken_s=2.05)])  # the same figures taken later: it counts the first pick
    g.update("b", [summary("b", 20, taken_s=2.05)])  # and b's does not count the pick at 2.1
    assert g.pick("m", 30, now_s=2.2).target_id == "a"


def test_reservations_expire_after_the_ttl() -> None:
    g = gw(ttl_s=1.0)
    g.update("a", [summary("a", 0)])
    g.update("b", [summary("b", 10)])
    assert [g.pick("m", 20, now_s=t).target_id for t in (1.0, 1.1)] == ["a", "b"]
    assert g.pick("m", 20, now_s=5.0).target_id == "a"  # both picks expired


@pytest.mark.parametrize("ttl_s", [-1.0, float("nan")])
def test_a_negative_or_nan_ttl_is_refused(ttl_s: float) -> None:
    with pytest.raises(ValueError, match=f"reservation_ttl_s must be >= 0, got {ttl_s}"):
        gw(ttl_s=ttl_s)


def test_tried_domains_are_excluded_without_losing_their_reservations() -> None:
    g = gw(ttl_s=10.0)
    g.update("a", [summary("a", 0)])
    g.update("b", [summary("b", 0)])
    first = g.pick("m", 40, now_s=1.0).target_id
    second = g.pick("m", 40, now_s=1.0, exclude={"a", "b"} - {first}).target_id
    assert first == second  # the other one was excluded
    third = g.pick("m", 40, now_s=1.0).target_id
    assert third != first  # both reservations still count on the first


class _RebuildingEveryDomain(GatewayCore):
    """The reference: every pick rebuilds every domain of the model from its summary (no bookkeeping of which
    domains hold reservations)."""

    def _expire(self, model: str, view: DomainDispatchView, horizon_s: float) -> None:
        for held in self._summaries.values():
            if model in held:
                view.update(held[model], as_of=max(held[model].taken_s, horizon_s))


@pytest.mark.parametrize("clock_steps_back", [False, True])
def test_expiring_only_the_domains_holding_reservations_picks_as_rebuilding_every_domain(
    clock_steps_back: bool,
) -> None:
    """A long seeded mix of summaries (some taken exactly at a pick's instant, some on a clock ahead of the
    gateway's), picks with exclusions, removals and picks past the TTL: both cores make every pick alike and see
    every domain alike after it. ``clock_steps_back``: the gateway's clock now and then steps back (a wall clock
    set back), so that the stamps are pushed out of order too."""
    cfg = PolicyConfig(domain_choices=2)
    cores = [GatewayCore(cfg, random.Random(7), reservation_ttl_s=0.3), _RebuildingEveryDomain(cfg, random.Random(7),
             reservation_ttl_s=0.3)]  # fmt: skip
    events = random.Random(3)
    domains = [f"d{i}" for i in range(12)]
    now, picks, held_after = 0.0, [], 0
    for _ in range(3000):
        now += events.choice((0.0, 0.01, 0.05, 0.4))
        if clock_steps_back and events.random() < 0.03:
            now -= events.choice((0.02, 0.5))
        roll = events.random()
        if roll < 0.3:
            d = events.choice(domains)
            s = summary(d, events.randrange(0, 90), taken_s=now - events.choice((0.0, 0.0, 0.05, 0.2, -0.02)))
            for core in cores:
                core.update(d, [s])
        elif roll < 0.32:
            d = events.choice(domains)
            for core in cores:
                core.remove(d)
        else:
            demand = events.randrange(1, 40)
            exclude = set(events.sample(domains, events.randrange(0, 3)))
            got = [core.pick("m", demand, now, exclude=exclude) for core in cores]
            assert got[0] == got[1]
            picks.append(got[0].target_id)
            view = cores[0]._view("m")
            held_after += sum(view.reservations(d) > 0 for d in domains)
        views = [core._view("m") for core in cores]
        for d in cores[1].domains("m"):
            assert views[0].freeness(d) == views[1].freeness(d), d
            assert views[0].reservations(d) == views[1].reservations(d), d
    assert len({p for p in picks if p is not None}) == len(domains) and held_after > 0
