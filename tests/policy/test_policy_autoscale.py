"""The autoscaler's rule (policy/autoscale.py), number by number on hand-built fleets.

Every fleet is four instances of 100 KV blocks in two domains (a0, a1 in A; b0, b1 in B); summaries are made by
``policy.summarize_domain`` from load reports, as a domain scheduler makes them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from policy_factories import CFG, inst

from policy import DomainSummary, InstanceLoad, RequestLoad, summarize_domain
from policy.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Phase,
    PoolInstance,
    StepResult,
    fleet_load,
    safe_to_stop,
)

POOL = [
    PoolInstance("a0", "A", 100),
    PoolInstance("a1", "A", 100),
    PoolInstance("b0", "B", 100),
    PoolInstance("b1", "B", 100),
]
RULE = AutoscaleConfig(
    enabled=True,
    interval_s=10.0,
    scale_out_freeness_below=10.0,
    scale_in_freeness_above=60.0,
    scale_out_hold_s=10.0,
    scale_in_hold_s=60.0,
    cool_down_s=30.0,
    start_timeout_s=100.0,
)


def fleet(*loads: InstanceLoad) -> list[DomainSummary]:
    """The summaries of domains A and B (model "m") from the loads given (each in the domain of its first letter)."""
    out = []
    for domain in ("A", "B"):
        members = [load for load in loads if load.instance_id[0].upper() == domain]
        if members:
            out.append(summarize_domain(domain, members, CFG, model="m"))
    return out


def actions(result: StepResult) -> list[tuple[str, str]]:
    return [(d.action.value, d.instance_id) for d in result.decisions]


def run(scaler: Autoscaler, summaries: Sequence[DomainSummary], times: Sequence[float], **kw: object) -> StepResult:
    """Step at each time of ``times`` with the same summaries; the decisions of every step but the last must be none."""
    result = None
    for t in times:
        if result is not None:
            assert result.decisions == (), (t, actions(result))
        result = scaler.step(summaries, t, **kw)  # type: ignore[arg-type]
    assert result is not None
    return result


def test_fleet_freeness_by_hand() -> None:
    a0 = InstanceLoad(
        "a0", 100, 30, (RequestLoad("r1", 10), RequestLoad("r2", 20, priority=1)),
        num_waiting=2, head_demand_blocks=5, queued_demand_blocks=12,
    )  # fmt: skip
    b0 = inst("b0", 100, [40], draining=True)
    summaries = fleet(a0, inst("a1", 100), b0, inst("b1", 100, [10]))
    load = fleet_load(summaries, "m")
    # ΣM: a0, a1, b1 (b0 drains). ΣV: a0 30 + headroom 20 + head demand 5 = 55; a1 0; b1 10; queued behind the
    # head 12 - 5 = 7; b0's real 40 blocks. Requests: a0 2 running + 2 queued, b0 1, b1 1.
    assert (load.capacity_blocks, load.usage_blocks, load.requests) == (300, 112.0, 6)
    assert load.freeness() == pytest.approx(188 / 6)
    assert [b.instance_id for b in load.live] == ["a0", "a1", "b1"]
    assert [b.instance_id for b in load.draining] == ["b0"]
    a1 = next(b for b in load.live if b.instance_id == "a1")
    assert load.freeness_without(a1) == pytest.approx((200 - 112) / 6)  # a1's capacity gone
    b1 = next(b for b in load.live if b.instance_id == "b1")
    assert load.freeness_without(b1) == pytest.approx((200 - 112) / 6)  # its 10 blocks still to place
    assert load.freeness(extra_capacity_blocks=100) == pytest.approx(288 / 6)
    assert fleet_load(summaries, "other").requests == 0
    # An instance drained by the autoscaler whose domain scheduler has not applied the drain yet: leaving.
    assert fleet_load(summaries, "m", leaving={"a1"}).capacity_blocks == 200


def heavy() -> list[DomainSummary]:
    """a0 and b0 nearly full, B fuller: F = (200 - 185) / 18 = 0.83."""
    return fleet(inst("a0", 100, [10] * 9), inst("b0", 100, [15] + [10] * 8))


def test_scale_out_after_the_hold_with_the_count_that_restores_the_threshold() -> None:
    scaler = Autoscaler("m", RULE, POOL)
    result = run(scaler, heavy(), [0.0, 5.0, 10.0])
    # +b1: (300 - 185) / 18 = 6.4 < 10; +a1: (400 - 185) / 18 = 11.9 >= 10. The fuller domain (B) first, then A.
    assert actions(result) == [("scale-out", "b1"), ("scale-out", "a1")]
    assert "fleet freeness 0.8 below 10 for 10 s" in result.decisions[0].reason
    assert scaler.phase("b1") is Phase.STARTING
    assert result.evaluation.freeness == pytest.approx(15 / 18)
    assert result.evaluation.live == 2
    # Both count as coming capacity: F with them is 11.9, no more scale-out after the cool-down.
    later = run(scaler, heavy(), [20.0, 40.0, 60.0])
    assert later.decisions == ()
    assert later.evaluation.coming == 2 and later.evaluation.freeness == pytest.approx(215 / 18)
    # b1 reports: live. a1 never does: given up after start_timeout_s, and it failed once.
    with_b1 = fleet(inst("a0", 100, [10] * 9), inst("b0", 100, [15] + [10] * 8), inst("b1", 100))
    assert scaler.step(with_b1, 70.0).evaluation.coming == 1
    assert scaler.phase("b1") is None
    gave_up = scaler.step(with_b1, 110.0)
    assert gave_up.abandoned == ("a1",)
    assert [(f.instance_id, f.count) for f in scaler.state().failures] == [("a1", 1)]


def test_a_short_dip_does_nothing_the_cool_down_holds_and_failed_starts_come_last() -> None:
    scaler = Autoscaler("m", RULE, [*POOL, PoolInstance("b2", "B", 100)])
    light = fleet(inst("a0", 100, [10]), inst("b0", 100, [10]))
    assert scaler.step(heavy(), 0.0).decisions == ()
    assert scaler.step(light, 5.0).decisions == ()  # the condition broke: the hold starts over
    assert scaler.step(heavy(), 10.0).decisions == ()
    first = scaler.step(heavy(), 20.0)
    assert actions(first) == [("scale-out", "b1"), ("scale-out", "b2")]  # the fuller domain, in topology order
    scaler.done(first.decisions[0], False, 21.0)  # b1's hook failed: back in the pool, one failure
    assert scaler.phase("b1") is None and scaler.phase("b2") is Phase.STARTING
    # Still short (b2 coming: (300 - 185) / 18 = 6.4), but within the cool-down (until 50): nothing.
    assert run(scaler, heavy(), [30.0, 40.0]).decisions == ()
    # Then one more, and the one that never failed (a1) goes before b1 although B is fuller.
    assert actions(scaler.step(heavy(), 50.0)) == [("scale-out", "a1")]


def test_a_domain_with_no_instance_of_the_model_comes_last_for_a_start() -> None:
    # B's domain scheduler runs but serves no instance of m yet: its summary is empty (capacity 0, freeness 0,
    # not "draining"), which must not make it look like the fullest domain. A holds the load: a1 starts first.
    scaler = Autoscaler("m", RULE, POOL)
    summaries = [
        summarize_domain("A", [inst("a0", 100, [10] * 9)], CFG, model="m"),
        summarize_domain("B", [], CFG, model="m"),
    ]
    # F = (100 - 90) / 9 = 1.1 < 10; +a1: (200 - 90) / 9 = 12.2 >= 10: one start.
    result = run(scaler, summaries, [0.0, 10.0])
    assert actions(result) == [("scale-out", "a1")]
    assert result.evaluation.freeness == pytest.approx(10 / 9)


def light4(b1_draining: bool = False, b1_blocks: Sequence[int] = ()) -> list[DomainSummary]:
    """Four instances, three requests: F = (400 - 16) / 3 = 128; without b1 (300 - 16) / 3 = 94.7."""
    return fleet(
        inst("a0", 100, [5]),
        inst("a1", 100, [3]),
        inst("b0", 100, [8]),
        inst("b1", 100, list(b1_blocks), draining=b1_draining),
    )


def test_scale_in_drains_the_cheapest_waits_until_empty_stops_then_releases() -> None:
    scaler = Autoscaler("m", RULE, POOL)
    result = run(scaler, light4(), [0.0, 30.0, 60.0], registered={"a0", "a1", "b0", "b1"})
    assert actions(result) == [("drain", "b1")]  # no block held: the cheapest to empty
    assert result.evaluation.freeness_without_candidate == pytest.approx(284 / 3)
    assert "without it 94.7 above 60 for 60 s" in result.decisions[0].reason
    everyone = {"a0", "a1", "b0", "b1"}
    # The drain not applied yet: b1 no longer counts as live, and nothing else is drained meanwhile.
    step = scaler.step(light4(), 70.0, registered=everyone)
    assert step.decisions == () and step.evaluation.live == 3 and step.evaluation.draining == 1
    # Applied, but a request still runs there (it would migrate away): not yet safe.
    assert scaler.step(light4(True, [4]), 80.0, registered=everyone).decisions == ()
    # Empty, but a cross-domain migration still touches it: not yet.
    assert scaler.step(light4(True), 85.0, registered=everyone, migrating={"b1"}).decisions == ()
    stop = scaler.step(light4(True), 90.0, registered=everyone)
    assert actions(stop) == [("scale-in", "b1")] and stop.decisions[0].reason.startswith("safe to stop: drained")
    assert scaler.phase("b1") is Phase.STOPPING
    scaler.done(stop.decisions[0], True, 91.0)
    assert scaler.phase("b1") is Phase.STOPPED
    assert scaler.step(light4(True), 100.0, registered=everyone).decisions == ()  # still registered
    gone = fleet(inst("a0", 100, [5]), inst("a1", 100, [3]), inst("b0", 100, [8]))
    released = scaler.step(gone, 110.0, registered={"a0", "a1", "b0"})
    assert actions(released) == [("release", "b1")] and scaler.phase("b1") is None


def test_a_failed_stop_is_decided_again_after_the_cool_down() -> None:
    scaler = Autoscaler("m", RULE, POOL)
    run(scaler, light4(), [0.0, 60.0])
    stop = scaler.step(light4(True), 70.0)
    scaler.done(stop.decisions[0], False, 71.0)
    assert scaler.phase("b1") is Phase.DRAINING
    assert scaler.step(light4(True), 80.0).decisions == ()
    assert actions(scaler.step(light4(True), 101.0)) == [("scale-in", "b1")]


def test_the_last_instance_of_a_domain_is_drained_last() -> None:
    scaler = Autoscaler("m", RULE, POOL)
    # b0 holds nothing but is alone in B; a1 (3 blocks) is cheaper to empty than a0 (5).
    three = fleet(inst("a0", 100, [5]), inst("a1", 100, [3]), inst("b0", 100))
    # without a1: (200 - 8) / 2 = 96 > 60
    assert actions(run(scaler, three, [0.0, 60.0])) == [("drain", "a1")]


def test_a_rise_while_draining_cancels_the_scale_in_before_starting_anything() -> None:
    scaler = Autoscaler("m", RULE, POOL)
    run(scaler, light4(), [0.0, 60.0])
    assert scaler.phase("b1") is Phase.DRAINING
    busy = fleet(
        inst("a0", 100, [10] * 9), inst("a1", 100, [10] * 9), inst("b0", 100, [10] * 9),
        inst("b1", 100, [10], draining=True),
    )  # fmt: skip
    # F = (300 - 280) / 28 = 0.7 from t = 70; the cool-down ends at 90 and the hold is met by then.
    result = run(scaler, busy, [70.0, 80.0, 90.0])
    assert actions(result) == [("undrain", "b1")]
    assert scaler.phase("b1") is None


def test_min_and_max_bound_the_count_whatever_the_freeness() -> None:
    # Above the maximum: drain at once (no hold), one at a time.
    capped = Autoscaler("m", AutoscaleConfig(max_instances=3, min_instances=1), POOL)
    full = fleet(inst("a0", 100, [90]), inst("a1", 100, [90]), inst("b0", 100, [90]), inst("b1", 100, [80]))
    result = capped.step(full, 0.0)
    assert actions(result) == [("drain", "b1")]
    assert "4 instances serving, above max_instances 3" in result.decisions[0].reason
    # Below the minimum: start one at once, even with an idle fleet, in the domain that has a summary.
    floor = Autoscaler("m", AutoscaleConfig(min_instances=2), POOL)
    result = floor.step(fleet(inst("a0", 100)), 0.0)
    assert actions(result) == [("scale-out", "a1")]
    assert "1 instances serving or starting, below min_instances 2" in result.decisions[0].reason
    # At the minimum nothing is drained however free the fleet is.
    kept = Autoscaler("m", AutoscaleConfig(min_instances=4, scale_in_hold_s=0.0), POOL)
    assert kept.step(light4(), 0.0).decisions == () and kept.step(light4(), 100.0).decisions == ()
    # Unavailable pool instances (an operator's drain) are never started.
    picky = Autoscaler("m", AutoscaleConfig(min_instances=2), POOL)
    assert actions(picky.step(fleet(inst("a0", 100)), 0.0, unavailable={"a1"})) == [("scale-out", "b0")]


def test_the_state_is_one_value_a_new_leader_resumes_from() -> None:
    scaler = Autoscaler("m", RULE, POOL)
    run(scaler, light4(), [0.0, 60.0])
    stop = scaler.step(light4(True), 70.0)
    assert actions(stop) == [("scale-in", "b1")]
    state = scaler.state()
    assert [(t.instance_id, t.phase) for t in state.tracked] == [("b1", Phase.STOPPING)]
    assert state.last_action_s == 60.0
    resumed = Autoscaler("m", RULE, POOL, state)
    # The stop's outcome was never reported to the old leader: the new one decides it again.
    assert resumed.phase("b1") is Phase.DRAINING
    assert actions(resumed.step(light4(True), 80.0)) == [("scale-in", "b1")]
    with pytest.raises(ValueError, match="cannot resume the state of model 'm'"):
        Autoscaler("other", RULE, POOL, state)


def test_no_report_no_decision() -> None:
    scaler = Autoscaler("m", RULE, POOL)
    result = scaler.step([], 0.0)
    assert result.decisions == () and result.evaluation.freeness is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scale_out_freeness_below": 60.0, "scale_in_freeness_above": 60.0}, "must be below scale_in_freeness_above"),
        ({"min_instances": 0}, "min_instances must be >= 1"),
        ({"min_instances": 3, "max_instances": 2}, r"max_instances \(2\) must be 0"),
        ({"interval_s": 0.0}, "interval_s must be a finite number of seconds, at least 0.001"),
        (
            {"interval_s": 1e-7},
            r"at least 0.001 \(no decision loop runs more often than every millisecond\), got 1e-07",
        ),
        ({"interval_s": -1.0}, "interval_s must be a finite number of seconds, at least 0.001"),
        ({"cool_down_s": -1.0}, "cool_down_s must be a finite number >= 0"),
        ({"scale_in_freeness_above": math.inf}, "scale_in_freeness_above must be finite"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoscaleConfig(**kwargs)  # type: ignore[arg-type]


def test_pool_must_be_usable() -> None:
    with pytest.raises(ValueError, match="pool of instances is empty"):
        Autoscaler("m", RULE, [])
    with pytest.raises(ValueError, match="ids repeat"):
        Autoscaler("m", RULE, [POOL[0], POOL[0]])


@pytest.mark.parametrize(
    ("load", "migrations", "safe"),
    [
        (inst("x", 100, draining=True), 0, True),
        (inst("x", 100), 0, False),  # not drained: new work may arrive
        (inst("x", 100, [3], draining=True), 0, False),  # a request runs
        (InstanceLoad("x", 100, 0, num_waiting=1, draining=True), 0, False),  # one queued
        (InstanceLoad("x", 100, 7, draining=True), 0, False),  # blocks reserved for an incoming migration
        (inst("x", 100, draining=True), 1, False),  # a cross-domain migration touches it
    ],
)
def test_safe_to_stop(load: InstanceLoad, migrations: int, safe: bool) -> None:
    brief = summarize_domain("X", [load], CFG).instances[0]
    assert safe_to_stop(brief, migrations) is safe
