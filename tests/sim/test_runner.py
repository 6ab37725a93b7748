"""run_simulation end to end: determinism, every policy, refusals, drain, scale-out, priorities, lag."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
from pathlib import Path
from typing import Any

import pytest
from sim_factories import make_trace, tiny_topology

from hilum_config import HilumConfig, load_config, parse_config
from sim.events import EventKind, EventQueue
from sim.results import SimRun, load_results, summarize, write_results
from sim.runner import SimOptions, SimSpec, fit_to_context, run_simulation
from sim.schedulers import POLICY_NAMES
from sim.traces import load_trace


def _run(policy: str, seed: int = 0, **options: object) -> SimRun:
    trace = load_trace("sharegpt", max_requests=150, seed=seed, rate_per_s=30.0)
    spec = SimSpec(topology="tiny", trace="sharegpt", policy=policy, seed=seed, options=options)
    return run_simulation(spec, trace=trace, topology=tiny_topology(kv_capacity_blocks=400))


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_serves_every_request_completely(policy: str) -> None:
    run = _run(policy)
    assert len(run.requests) == 150
    for r in run.requests:
        assert r.refused is None
        assert r.finish_s is not None and r.first_token_s is not None
        assert r.generated_tokens == r.output_tokens
        assert len(r.token_gaps_s) == r.output_tokens - 1
        assert r.arrival_s <= r.first_token_s <= r.finish_s
    assert run.engine_steps > 0
    for m in run.migrations:
        assert m.outcome in {"committed", "aborted"}
        assert m.start_s <= m.end_s
    if policy in ("round-robin", "least-loaded"):
        assert run.migrations == ()


def test_a_memory_tight_cluster_preempts_without_migration_and_less_with_it() -> None:
    # Below saturation, with the Llumnix paper's long-tailed lengths: migration de-fragments memory.
    trace = load_trace("llumnix-synthetic", max_requests=200, seed=0, rate_per_s=4.0)
    summaries = {
        policy: summarize(
            run_simulation(
                SimSpec(topology="tiny", trace="synthetic", policy=policy),
                trace=trace,
                topology=tiny_topology(kv_capacity_blocks=400),
            )
        )
        for policy in ("least-loaded", "llumnix", "hilum")
    }
    baseline = summaries["least-loaded"]
    assert baseline.preemptions > 0
    for policy in ("llumnix", "hilum"):
        moved = summaries[policy]
        assert moved.migrations_intra_domain + moved.migrations_cross_domain > 0, policy
        assert moved.preemptions < baseline.preemptions, policy


def test_hilum_keeps_moves_inside_domains_when_it_can() -> None:
    hilum, llumnix = summarize(_run("hilum")), summarize(_run("llumnix"))
    assert hilum.migrations_intra_domain > 0
    assert hilum.cross_domain_bytes < llumnix.cross_domain_bytes


def test_same_seed_same_result_and_no_state_between_runs() -> None:
    first = _run("hilum", seed=3)
    _run("llumnix", seed=4)  # another simulation in between must not disturb the next one
    again = _run("hilum", seed=3)
    assert first.requests == again.requests
    assert first.migrations == again.migrations
    assert first.engine_steps == again.engine_steps
    other = _run("hilum", seed=5)
    assert other.requests != first.requests


def test_the_collector_settings_are_restored_after_a_run() -> None:
    """The event loop freezes what was built before it and collects young objects less often; after the run the
    process's collector is as it was (a caller's frozen objects stay frozen)."""
    before = gc.get_threshold()
    gc.set_threshold(900, 11, 12)
    try:
        _run("hilum")
        assert gc.get_threshold() == (900, 11, 12) and gc.get_freeze_count() == 0
        gc.freeze()  # the caller's own frozen objects stay frozen
        frozen = gc.get_freeze_count()
        _run("round-robin")
        assert frozen > 0 and gc.get_freeze_count() > frozen // 2  # (a frozen object freed meanwhile leaves it)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_large_fleet_is_built_without_a_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines of a run are built under the run's collector settings: 512 instances at the default thresholds
    (700, 10, 10) ran collections of every generation while they were built, full ones going over every object in
    the process."""
    import sim.runner
    from topology.load import parse_topology
    from topology.synthetic import synthetic_topology_data

    topo = parse_topology(synthetic_topology_data(64), source="synthetic-512")
    trace = load_trace("sharegpt", num_requests=20, rate_per_s=200.0, seed=0)
    building: list[bool] = []
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and building:
            collections.append(info["generation"])

    def built(*args: Any, **kwargs: Any) -> Any:
        building.append(True)
        try:
            return cluster_class(*args, **kwargs)
        finally:
            building.clear()

    cluster_class = sim.runner.Cluster
    monkeypatch.setattr(sim.runner, "Cluster", built)
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    gc.callbacks.append(seen)
    try:
        run = run_simulation(SimSpec(topo.name, "sharegpt", "hilum"), trace=trace, topology=topo)
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*before)
    assert len(run.requests) == 20 and len(run.kv.usage_fraction) == 512
    assert collections == []


def test_the_queue_holds_one_arrival_at_a_time_in_trace_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrivals are fed one at a time (the next scheduled as one arrives), and requests arriving at the same
    instant are still dispatched in trace order: round-robin gives them the instances it gives requests
    arriving a nanosecond apart."""
    arrivals_queued: list[int] = []
    schedule = EventQueue.schedule

    def counting(self: EventQueue, time_s: float, kind: EventKind, action: Any, *, scheduled_s: Any = None) -> None:
        schedule(self, time_s, kind, action, scheduled_s=scheduled_s)
        arrivals_queued.append(sum(1 for entry in self._heap if entry.kind == EventKind.ARRIVAL))

    monkeypatch.setattr(EventQueue, "schedule", counting)
    rows = [(0.0, 100, 10), (0.0, 50, 5), (0.0, 60, 5), (0.0, 70, 3), (0.5, 80, 4)]
    apart = [(a + i * 1e-9, p, o) for i, (a, p, o) in enumerate(rows)]
    placed = []
    for trace_rows in (rows, apart):
        spec = SimSpec(topology="tiny", trace="hand", policy="round-robin")
        run = run_simulation(spec, trace=make_trace(trace_rows), topology=tiny_topology())
        assert [r.request_id for r in run.requests] == ["r0", "r1", "r2", "r3", "r4"]
        placed.append([r.dispatched_instance_id for r in run.requests])
    assert max(arrivals_queued) == 1
    assert placed[0] == placed[1] and len(set(placed[0][:4])) == 4


def test_a_request_no_instance_can_ever_hold_is_refused_with_a_reason() -> None:
    trace = make_trace([(0.0, 100, 10), (0.1, 3000, 10), (0.2, 50, 5)])
    for policy in POLICY_NAMES:
        spec = SimSpec(topology="tiny", trace="hand", policy=policy)
        run = run_simulation(spec, trace=trace, topology=tiny_topology(kv_capacity_blocks=100))
        refused = {r.request_id: r.refused for r in run.requests if r.refused}
        assert list(refused) == ["r1"], policy
        assert "1601" in (refused["r1"] or "") or "hold" in (refused["r1"] or ""), refused
        assert all(r.finish_s is not None for r in run.requests if r.request_id != "r1")


def test_a_drained_instance_gets_nothing_new_and_is_emptied_by_migration() -> None:
    run = _run("hilum", drain=("n0-i0@1.0",))
    late = [r for r in run.requests if r.arrival_s > 1.2]
    assert late and all(r.instance_id != "n0-i0" for r in late)
    drained = [m for m in run.migrations if m.src_instance_id == "n0-i0" and "source draining" in m.reason]
    assert drained and all(m.start_s >= 1.0 and m.outcome == "committed" for m in drained)
    assert all(m.dst_instance_id != "n0-i0" for m in run.migrations if m.start_s >= 1.0)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_dispatches_nothing_to_an_instance_from_the_moment_it_drains(policy: str) -> None:
    # Drains at 1.01 s, between two of the single-tier policies' 50 ms report loops: a drain is the scheduler's
    # own intent (Cluster.set_draining), held at once, not a load learnt at the next report.
    drained = ("n0-i0", "n0-i1", "n1-i0")
    run = _run(policy, drain=tuple(f"{i}@1.01" for i in drained))
    late = [r for r in run.requests if r.arrival_s >= 1.01]
    assert len(late) > 100
    assert {r.instance_id for r in late} == {"n1-i1"}, policy
    assert all(r.refused is None for r in run.requests)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_refuses_everything_when_every_instance_drains_at_the_start(policy: str) -> None:
    run = _run(policy, drain=tuple(f"{i}@0" for i in ("n0-i0", "n0-i1", "n1-i0", "n1-i1")))
    assert len(run.requests) == 150
    reasons = {r.refused for r in run.requests}
    assert all(reason and reason.endswith("are draining") for reason in reasons), (policy, reasons)
    if policy != "hilum":  # hilum's gateway says it of the domains (or, summaries lagging, a domain of its instances)
        assert reasons == {"all 4 instances are draining"}, policy
    assert all(r.instance_id == "" for r in run.requests)
    assert run.engine_steps == 0
    # the run lasts until its last refusal, and its four instances held their GPUs until then
    last_s = max(r.arrival_s for r in run.requests)
    assert run.sim_duration_s == last_s > 1.0
    assert run.gpu_hours == pytest.approx(4 * last_s / 3600)


def test_no_migration_starts_towards_an_instance_that_drains() -> None:
    # Domain n0 drains at 1.01 s and its requests move to n1; n1-i0 drains at 1.45 s, after the summary the
    # gateway and coordinator hold (taken at 1.25 s) and before the next cross-domain round (1.5 s). The
    # coordinator holds the drain intents (as the live one reads them from etcd), so it sends nothing to n1-i0.
    run = _run("hilum", drain=("n0-i0@1.01", "n0-i1@1.01", "n1-i0@1.45"))
    later = [(m.src_instance_id, m.dst_instance_id) for m in run.migrations if m.start_s >= 1.45]
    assert ("n0-i1", "n1-i1") in later or ("n0-i0", "n1-i1") in later  # the drained domain is emptied into n1-i1
    assert all(dst == "n1-i1" for _, dst in later), later


def test_a_scaled_out_instance_is_idle_until_it_joins_then_fills() -> None:
    run = _run("llumnix", scale_out=("n1-i1@2.0",))
    on_new = [r for r in run.requests if r.instance_id == "n1-i1"]
    assert on_new, "the new instance served nothing"
    assert all(r.arrival_s >= 2.0 for r in on_new if r.migrations == 0)
    assert all(m.start_s >= 2.0 for m in run.migrations if m.dst_instance_id == "n1-i1")


def test_priorities_are_marked_and_reported() -> None:
    run = _run("hilum", priority_fraction=0.2)
    high = [r for r in run.requests if r.priority >= 1]
    assert len(high) == 30
    assert summarize(run).high_priority_ttft_p99_s is not None


def test_information_lag_changes_the_gateways_choices() -> None:
    fresh = _run("hilum", summary_lag_s=0.0, summary_interval_s=0.01)
    stale = _run("hilum", summary_lag_s=2.0, summary_interval_s=2.0)
    assert [r.instance_id for r in fresh.requests] != [r.instance_id for r in stale.requests]


def test_bad_options_and_unknown_instances_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        _run("fifo")
    with pytest.raises(ValueError, match="priority_fraction"):
        _run("hilum", priority_fraction=2.0)
    with pytest.raises(ValueError, match="expected INSTANCE@SECONDS"):
        _run("hilum", drain=("n0-i0",))
    with pytest.raises(ValueError, match="unknown instance 'nope'"):
        _run("hilum", drain=("nope@1",))
    with pytest.raises(
        ValueError,
        match=r"drain \(--drain\) names NVLink domain 'n0'; it takes instances, one per --drain: n0-i0, n0-i1$",
    ):
        _run("hilum", drain=("n0@1",))
    with pytest.raises(
        ValueError,
        match=r"drain \(--drain\) takes one INSTANCE@S an entry, got 'n0-i0@1,n0-i1@2': give each instance its own",
    ):
        _run("hilum", drain=("n0-i0@1,n0-i1@2",))
    with pytest.raises(ValueError, match="colour"):
        _run("hilum", colour="blue")


def test_requests_beyond_the_context_window_are_truncated_and_counted() -> None:
    trace = make_trace([(0.0, 4000, 200), (0.1, 100, 5000), (0.2, 100, 100)])
    fitted, changed = fit_to_context(trace, 4096)
    assert changed == 2
    assert [(r.prompt_tokens, r.output_tokens) for r in fitted.requests] == [(3896, 200), (1, 4095), (100, 100)]
    spec = SimSpec(topology="tiny", trace="hand", policy="least-loaded")
    run = run_simulation(spec, trace=trace, topology=tiny_topology(kv_capacity_blocks=400))
    assert run.config["truncated_requests"] == 2
    assert dataclasses.replace(fitted.requests[2]) == trace.requests[2]


def test_mixed_model_topology_serves_one_model_and_derives_uncalibrated_gpus() -> None:
    from topology.load import load_topology

    topo = load_topology("nvl72-gb200")
    trace = make_trace([(0.01 * i, 200, 20) for i in range(30)])
    spec = SimSpec(topology="nvl72-gb200", trace="hand", policy="hilum", options={"model": "llama-2-70b"})
    run = run_simulation(spec, trace=trace, topology=topo)
    seventy = {i.instance_id for i in topo.instances if i.model == "llama-2-70b"}
    assert {r.instance_id for r in run.requests} <= seventy
    assert run.config["model"] == "llama-2-70b"
    derived = run.config["derived_latency_models"]
    assert isinstance(derived, list) and derived and "scaled from h100" in derived[0]
    assert set(run.kv.usage_fraction) == seventy
    with pytest.raises(ValueError, match=r"model \(--model\) 'gpt': no instance of it in nvl72-gb200"):
        run_simulation(dataclasses.replace(spec, options={"model": "gpt"}), trace=trace, topology=topo)


def test_engine_priority_and_migration_for_slots_in_the_simulator() -> None:
    # 150 ShareGPT requests at 30/s on four 400-block instances with 2 batch slots each, 20 % high priority,
    # the hilum policy. The simulator composes the engine's priority admission and the rule book's slot rule
    # (moves whose reason is "source slots full"); "fcfs" is the engine as it was before (priorities ignored
    # in the engine, the rule book's headroom still counts). Measured: mean high-priority TTFT 9.2 s with
    # priority, 60.4 s with fcfs; normal requests pay for it (75.4 s against 59.8 s). 6 moves name the slot
    # rule, 5 inside a domain; the coordinator sends a move only to an instance with a free slot, so no
    # report ever shows more running requests than slots
    def mean_ttft(run: SimRun, high: bool) -> float:
        ttfts = [r.first_token_s - r.arrival_s for r in run.requests if (r.priority >= 1) == high]
        assert all(r.first_token_s is not None for r in run.requests)
        return sum(ttfts) / len(ttfts)  # type: ignore[operator]

    with_priority = _run("hilum", priority_fraction=0.2, max_num_seqs=2)
    fcfs = _run("hilum", priority_fraction=0.2, max_num_seqs=2, scheduling="fcfs")
    assert mean_ttft(with_priority, True) == pytest.approx(9.19, abs=0.01)
    assert mean_ttft(fcfs, True) == pytest.approx(60.37, abs=0.01)
    assert mean_ttft(with_priority, False) == pytest.approx(75.42, abs=0.01)
    assert mean_ttft(fcfs, False) == pytest.approx(59.75, abs=0.01)
    slot_moves = [m for m in with_priority.migrations if "source slots full" in m.reason]
    assert (len(slot_moves), sum(m.src_domain_id == m.dst_domain_id for m in slot_moves)) == (6, 5)
    overfull = [m.reason for m in with_priority.migrations if re.search(r"\(([3-9]|\d\d+) of 2 running", m.reason)]
    assert overfull == []


def test_a_run_records_every_setting_it_used_and_the_file(tmp_path: Path) -> None:
    """``spec.config.settings``: the configuration file's settings with the run's overrides, in the file's layout, and
    ``config_file``; ``results.json`` did not say which thresholds or cost model a run had."""
    config = tmp_path / "h.yaml"
    config.write_text("policy: {tie_tolerance: 0.3}\ncost: {cap_fraction: 0.5, max_stages: 3}\n")
    spec = SimSpec("tiny", "sharegpt", "hilum", options={"cap_fraction": 0.25}, config=str(config))
    trace = load_trace("sharegpt", max_requests=10, seed=0, rate_per_s=5.0)
    run = run_simulation(spec, trace=trace, topology=tiny_topology())
    settings = run.config["settings"]
    assert run.config["config_file"] == str(config)
    assert settings["policy"]["tie_tolerance"] == 0.3 and settings["cost"]["max_stages"] == 3  # the file's
    assert settings["cost"]["cap_fraction"] == 0.25  # the option's override, not the file's 0.5
    assert settings["intervals"]["rebalance_interval_s"] == 0.05  # a default, recorded too
    wanted = load_config(config)
    wanted = dataclasses.replace(wanted, cost=dataclasses.replace(wanted.cost, cap_fraction=0.25))
    assert parse_config(settings, str(config)) == wanted  # every setting, in the file's layout
    (stored,) = load_results(write_results([run], tmp_path))
    assert stored.config["settings"]["cost"] == {**settings["cost"]}
    assert stored.config["settings"]["policy"]["priority_headroom_blocks"] == {"1": 128}  # JSON keys are strings
    default = run_simulation(dataclasses.replace(spec, config=None, options={}), trace=trace, topology=tiny_topology())
    assert default.config["config_file"] is None
    assert parse_config(default.config["settings"], HilumConfig().source) == HilumConfig()
    # the switches the options set are recorded as the run had them (the file's prefix caching off, the autoscaler on)
    config.write_text("prefix_cache: {enabled: false}\n")
    switched = dataclasses.replace(spec, options={"prefix_caching": True, "autoscale": True, "initial_instances": 1})
    settings = run_simulation(switched, trace=trace, topology=tiny_topology()).config["settings"]
    assert (settings["prefix_cache"]["enabled"], settings["autoscale"]["enabled"]) == (True, True)
    off = dataclasses.replace(spec, options={"prefix_caching": False})
    settings = run_simulation(off, trace=trace, topology=tiny_topology()).config["settings"]
    assert (settings["prefix_cache"]["enabled"], settings["autoscale"]["enabled"]) == (False, False)


def test_every_run_option_is_documented_with_its_default() -> None:
    """docs/sim-results.md's run-options table lists every ``SimOptions`` key with its default (a sweep's options
    were documented nowhere but in an error message)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "sim-results.md").read_text()
    for name, info in SimOptions.model_fields.items():
        row = re.search(rf"^\| `{name}` \| `([^`]*)` \|", doc, flags=re.MULTILINE)
        assert row is not None, f"docs/sim-results.md lacks the run option {name}"
        default = info.default
        shown = json.dumps(list(default) if isinstance(default, tuple) else default)
        assert row.group(1) in (shown, str(default)), (name, row.group(1), shown)
