"""``hilum sim --autoscale``: the autoscaler's rule (policy.autoscale) on the virtual clock, and GPU-hours.

The tiny topology has four instances (n0-i0, n0-i1 in domain n0; n1-i0, n1-i1 in n1), 1 GPU each. The rule's
timing comes from a configuration file (rounds every second, short holds), as ``hilum sim --config`` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_factories import tiny_topology

from policy.autoscale import PoolInstance
from sim.autoscale import initial_fleet
from sim.results import SimRun, load_results, summarize, write_results
from sim.runner import SimSpec, run_simulation
from sim.traces import load_trace

RULE = """\
autoscale:
  interval_s: 1.0
  scale_out_hold_s: 1.0
  scale_in_hold_s: 2.0
  cool_down_s: 2.0
  start_timeout_s: 100.0
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "hilum.yaml"
    path.write_text(RULE)
    return str(path)


def _run(config: str, policy: str = "hilum", rate: float = 30.0, n: int = 150, **options: object) -> SimRun:
    """150 ShareGPT requests at ``rate`` req/s on the tiny topology, the autoscaler on unless ``autoscale=False``."""
    options = {"autoscale": True, **options}
    trace = load_trace("sharegpt", max_requests=n, seed=0, rate_per_s=rate)
    spec = SimSpec(topology="tiny", trace="sharegpt", policy=policy, options=options, config=config)
    return run_simulation(spec, trace=trace, topology=tiny_topology(kv_capacity_blocks=400))


def _events(run: SimRun) -> list[tuple[str, str]]:
    return [(e.action, e.instance_id) for e in run.scale_events]


def test_the_initial_fleet_takes_instances_in_turn_from_each_domain() -> None:
    pool = [PoolInstance(i, i[:2], 100) for i in ("n0-i0", "n0-i1", "n0-i2", "n1-i0", "n1-i1")]
    assert initial_fleet(pool, 3) == ["n0-i0", "n1-i0", "n0-i1"]
    assert initial_fleet(pool, 5) == ["n0-i0", "n1-i0", "n0-i1", "n1-i1", "n0-i2"]
    with pytest.raises(ValueError, match=r"initial_instances must be within 1\.\.5"):
        initial_fleet(pool, 6)


def _gpu_hours_by_hand(run: SimRun, initial: set[str]) -> float:
    """Each instance holds its one GPU from 0 (initial) or its scale-out decision to its stop or the run's end."""
    since = dict.fromkeys(initial, 0.0)
    held = 0.0
    for e in run.scale_events:
        if e.action == "scale-out":
            since[e.instance_id] = e.at_s
        elif e.action == "scale-in" and e.ok:
            held += e.at_s - since.pop(e.instance_id)
    return (held + sum(run.sim_duration_s - t for t in since.values())) / 3600


@pytest.mark.parametrize("policy", ["hilum", "llumnix", "round-robin"])
def test_a_loaded_small_fleet_scales_out_and_new_instances_serve_after_their_cold_start(
    config: str, policy: str
) -> None:
    run = _run(config, policy, rate=10.0, n=300, initial_instances=1, cold_start_s=3.0)
    assert all(r.finish_s is not None for r in run.requests)
    starts = [e for e in run.scale_events if e.action == "scale-out"]
    # n0-i0 alone is overloaded at once: after the 1 s hold the rule starts all three others, n0-i1 first (the
    # domain holding the load), in one round.
    assert [e.instance_id for e in starts] == ["n0-i1", "n1-i0", "n1-i1"]
    assert {e.at_s for e in starts} == {2.0}
    assert all(e.ok and "below 10 for 1 s" in e.reason for e in starts)
    for e in starts:
        # Nothing is dispatched or migrated to a started instance before its cold start ends; then it serves.
        on_it = [r for r in run.requests if r.instance_id == e.instance_id and r.migrations == 0]
        assert on_it, f"{e.instance_id} served nothing"
        assert all(r.arrival_s >= e.at_s + 3.0 for r in on_it)
        assert all(m.start_s >= e.at_s + 3.0 for m in run.migrations if m.dst_instance_id == e.instance_id)
    assert run.gpu_hours == pytest.approx(_gpu_hours_by_hand(run, {"n0-i0"}), rel=1e-9)
    assert run.gpu_hours < 4 * run.sim_duration_s / 3600
    summary = summarize(run)
    assert summary.scale_outs == 3 and summary.gpu_hours == run.gpu_hours


def test_a_light_load_drains_the_cheapest_stops_each_once_empty_and_releases_it(config: str) -> None:
    run = _run(config, "hilum", rate=0.5, n=30)  # 30 requests over 49 s on four instances
    events = run.scale_events
    # Three scale-ins in a row, each: drain (hold 2 s), stop once empty, release once deregistered; one instance
    # is left (min_instances 1). The holds and the cool-down (2 s) space them: drains at 2, 5 and 8 s.
    assert [e.action for e in events[:9]] == ["drain", "scale-in", "release"] * 3
    assert [e.at_s for e in events[:9]] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    stopped = [e.instance_id for e in events[:9:3]]
    assert len(set(stopped)) == 3 and all(e.instance_id == stopped[k // 3] for k, e in enumerate(events[:9]))
    assert all(e.ok for e in events)
    assert all("above 60 for 2 s; cheapest to empty" in e.reason for e in events[:9:3])
    assert all(e.reason.startswith("safe to stop: drained and empty") for e in events[1:9:3])
    emptied_by_migration = 0
    for k in range(0, 9, 3):
        iid, drain_s, stop_s = stopped[k // 3], events[k].at_s, events[k + 1].at_s
        moved = [m for m in run.migrations if m.src_instance_id == iid and drain_s <= m.start_s <= stop_s]
        assert all(m.outcome == "committed" and m.end_s <= stop_s for m in moved)
        emptied_by_migration += bool(moved)
        # From its drain until it is started again, nothing is dispatched or migrated to it.
        restart = min((e.at_s for e in events[k:] if e.action == "scale-out" and e.instance_id == iid), default=1e9)
        placed = [r for r in run.requests if r.instance_id == iid and r.migrations == 0]
        assert not [r for r in placed if drain_s < r.arrival_s < restart]
        assert not [m for m in run.migrations if m.dst_instance_id == iid and drain_s <= m.start_s < restart]
    assert emptied_by_migration >= 1  # one held a request: it was migrated away, then the instance stopped
    assert all(r.finish_s is not None for r in run.requests)
    # GPU-hours follow the decisions exactly (whether they pay off depends on the rule's settings: these, made to
    # act within seconds, start instances again and stretch the run).
    assert run.gpu_hours == pytest.approx(_gpu_hours_by_hand(run, {"n0-i0", "n0-i1", "n1-i0", "n1-i1"}), rel=1e-9)
    static = _run(config, "hilum", rate=0.5, n=30, autoscale=False)
    assert static.scale_events == ()
    assert static.gpu_hours == pytest.approx(4 * static.sim_duration_s / 3600, rel=1e-9)
    again = _run(config, "hilum", rate=0.5, n=30)  # same spec: same decisions (deterministic)
    assert _events(again) == _events(run) and again.gpu_hours == run.gpu_hours


def test_a_static_fleet_is_charged_for_its_whole_run(config: str) -> None:
    run = _run(config, "least-loaded", autoscale=False, initial_instances=2)
    assert run.scale_events == ()
    assert {r.instance_id for r in run.requests} == {"n0-i0", "n1-i0"}  # one per domain, the others stay off
    assert run.gpu_hours == pytest.approx(2 * run.sim_duration_s / 3600, rel=1e-9)
    assert run.config["initial_instances"] == 2
    scaled = _run(config, "llumnix", autoscale=False, scale_out=("n1-i1@2.0",))
    assert scaled.gpu_hours == pytest.approx((3 * scaled.sim_duration_s + scaled.sim_duration_s - 2.0) / 3600)


def test_results_json_holds_gpu_hours_and_every_decision(config: str, tmp_path: Path) -> None:
    run = _run(config, "hilum", rate=0.5, n=30)
    path = write_results([run], tmp_path / "out")
    doc = json.loads(path.read_text())
    (stored,) = doc["runs"]
    assert stored["summary"]["gpu_hours"] == pytest.approx(run.gpu_hours)
    assert stored["summary"]["scale_ins"] == summarize(run).scale_ins == 3
    assert stored["summary"]["scale_outs"] == summarize(run).scale_outs
    assert [(e["action"], e["instance_id"], e["ok"]) for e in stored["scale_events"]] == [
        (e.action, e.instance_id, True) for e in run.scale_events
    ]
    assert stored["spec"]["config"]["autoscale"]["interval_s"] == 1.0
    assert load_results(path)[0].summary.gpu_hours == pytest.approx(run.gpu_hours)
    # A results.json written before GPU-hours were reported still loads (the new fields read as their default).
    for key in ("gpu_hours", "scale_outs", "scale_ins"):
        del stored["summary"][key]
    path.write_text(json.dumps(doc))
    assert load_results(path)[0].summary.gpu_hours is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"autoscale": False, "cold_start_s": 5.0}, r"cold_start_s \(--cold-start-s\) applies only with autoscale"),
        ({"autoscale": True, "scale_out": ("n0-i1@3",)}, "cannot be combined with autoscale"),
        ({"initial_instances": 5}, "tiny has only 4 llama-2-7b instances"),
        ({"initial_instances": 0}, "initial_instances"),
        (
            {"autoscale": False, "initial_instances": 2, "scale_out": ("n0-i1@3",)},
            r"initial_instances \(--initial-instances\) cannot be combined with scale_out \(--scale-out\)",
        ),
        ({"autoscale": True, "cold_start_s": 100.0}, r"below autoscale.start_timeout_s \(100\)"),
    ],
)
def test_options_that_cannot_be_honoured_are_refused_by_name(
    config: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _run(config, "hilum", n=5, **options)
