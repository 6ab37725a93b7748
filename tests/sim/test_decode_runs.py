"""The simulator with decode runs (one event per run of pure decode steps) equals the step-by-step one.

Every run here is simulated twice, ``decode_runs=True`` and the reference ``decode_runs=False``, and every
request record (TTFT, every TBT gap, preemptions and the time they cost, migrations, where it finished),
every migration record, the KV usage timeline and the engine step count must be equal: not close, equal.
The workloads are chosen to exercise what can cut or interrupt a run: preemption (a memory-tight cluster
at a high rate), live migration inside and across domains (``llumnix``, ``hilum``), prefix sharing
(Mooncake's hash ids with prefix caching on and prefix-aware dispatch; moves that adopt the destination's
cached prefix or recompute it), whole-prompt admission, priorities, a drain and a scale-out.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import random
from fractions import Fraction
from typing import Any

import pytest
from sim_factories import make_trace, tiny_topology

from llumlet.engine.core import DecodeRun
from llumlet.engine.latency import VECTOR_MIN_STEPS, DecodeStepTimes, load_latency_model, steps_ended_guess
from rack_sched.core import DomainCore
from sim.cluster import Cluster, EngineLimits, _Run
from sim.events import EventKind, EventQueue
from sim.results import SimRun, summarize
from sim.runner import SimSpec, run_simulation

AZURE = SimSpec("2x8-a100-40gb", "azure-conv", "llumnix", rate_scale=6.0, max_requests=400)
MOONCAKE = SimSpec(
    "2x8-a100-40gb", "mooncake-conv", "hilum", rate_scale=3.0, max_requests=300, options={"prefix_caching": True}
)


def both_ways(spec: SimSpec) -> tuple[SimRun, SimRun]:
    runs = [run_simulation(dataclasses.replace(spec, options={**spec.options, "decode_runs": f})) for f in (1, 0)]
    return runs[0], runs[1]


def assert_same(fast: SimRun, ref: SimRun) -> None:
    assert len(fast.requests) == len(ref.requests)
    for a, b in zip(fast.requests, ref.requests, strict=True):
        assert a == b, a.request_id
    assert fast.migrations == ref.migrations
    assert fast.kv == ref.kv
    assert (fast.engine_steps, fast.sim_duration_s) == (ref.engine_steps, ref.sim_duration_s)


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (AZURE, "preempts, migrates across domains"),
        (dataclasses.replace(AZURE, policy="hilum", options={"priority_fraction": 0.2}), "preempts, migrates"),
        (dataclasses.replace(AZURE, policy="round-robin", options={"admission": "whole-prompt"}), "preempts"),
        (
            dataclasses.replace(
                MOONCAKE,
                policy="llumnix",
                options={**MOONCAKE.options, "drain": ("node-0-i3@10",), "scale_out": ("node-1-i7@5",)},
            ),
            "preempts, migrates across domains, shares prefixes, adopts and recomputes prefixes",
        ),
        (MOONCAKE, "preempts, migrates, shares prefixes, adopts prefixes"),  # prefix-aware in both tiers
    ],
    ids=[
        "llumnix-azure",
        "hilum-azure-priorities",
        "round-robin-whole-prompt",
        "llumnix-mooncake-prefix-drain",
        "hilum-mooncake-prefix",
    ],
)
def test_decode_runs_reproduce_the_step_by_step_simulation(spec: SimSpec, want: str) -> None:
    fast, ref = both_ways(spec)
    assert_same(fast, ref)
    s = summarize(fast)
    assert s.finished == s.requests  # every request ran to its end, both ways
    assert s.preemptions > 0
    if "migrates" in want:
        assert s.migrations_intra_domain + s.migrations_cross_domain > 0
    if "across domains" in want:
        assert s.migrations_cross_domain > 0
    if "shares prefixes" in want:  # prompt tokens reused from a prefix cache
        assert sum(r.prefix_hit_tokens for r in fast.requests) > 0
    if "adopts" in want:  # a destination held some of a moved request's prefix: those blocks were not copied
        assert any(m.skipped_prefix_blocks > 0 for m in fast.migrations)
    if "recomputes" in want:  # the cost model chose to recompute a missing prefix on a cross-domain move
        assert any(m.recomputed_prefix_blocks > 0 for m in fast.migrations)


def probed_run(decode_runs: bool) -> list[object]:
    """24 requests on the tiny topology; a probe every 3 ms records every load, step time and account."""
    trace = make_trace([(0.01 * i, 50 + 37 * i % 300, 20 + 53 * i % 200) for i in range(24)])
    queue = EventQueue()
    latency = load_latency_model("llama-2-7b", "a100", 1)
    topo = tiny_topology(kv_capacity_blocks=120)
    cluster = Cluster(queue, topo, lambda _spec: latency, EngineLimits(), decode_runs=decode_runs)
    ids = list(cluster.instances)

    def arrive(i: int) -> None:
        req = trace.requests[i]
        cluster.admit(req)
        cluster.submit(req, ids[i % len(ids)])

    for i, req in enumerate(trace.requests):
        queue.schedule(req.arrival_s, EventKind.ARRIVAL, functools.partial(arrive, i))
    out: list[object] = []
    last: dict[str, tuple[int, object]] = {}

    def probe() -> None:
        for inst in cluster.instances.values():
            version, load = cluster.load_version(inst), cluster.load(inst)
            before = last.get(inst.instance_id)
            if before is not None:  # an unchanged version means the very same report, else a new one
                assert (before[0] == version) == (before[1] is load) == (before[1] == load)
            last[inst.instance_id] = (version, load)
            out.append((queue.now_s, load, inst.last_step_s))
        cluster.take_kv_sample()  # written by each instance before its next change, compared at the end
        for rid in cluster.requests:
            st = cluster.requests[rid]
            out.append((st.generated_tokens, st.last_token_s, len(st.token_gaps_s), st.preempted_s))
        if len(queue):
            queue.schedule_in(0.003, EventKind.SAMPLE, probe)

    queue.schedule(0.0, EventKind.SAMPLE, probe)
    while queue.run_next():
        pass
    assert all(st.finish_s is not None for st in cluster.requests.values())
    out.append({i: list(v) for i, v in cluster.kv_usage_series().items()})
    return out


def sampled_kv(decode_runs: bool, read_eagerly: bool) -> tuple[list[float], dict[str, list[float]]]:
    """The KV usage timeline of 24 requests on the tiny topology, sampled every 2 ms: as the cluster keeps it
    (each instance writes its samples before it changes), and, with ``read_eagerly``, as read from every engine
    at each sample (``SimInstance.engine`` brings it to the sample's instant, as the timeline once did)."""
    trace = make_trace([(0.01 * i, 50 + 37 * i % 300, 20 + 53 * i % 200) for i in range(24)])
    queue = EventQueue()
    latency = load_latency_model("llama-2-7b", "a100", 1)
    cluster = Cluster(queue, tiny_topology(kv_capacity_blocks=120), lambda _spec: latency, EngineLimits(),
                      decode_runs=decode_runs)  # fmt: skip
    ids = list(cluster.instances)

    def arrive(i: int) -> None:
        cluster.admit(trace.requests[i])
        cluster.submit(trace.requests[i], ids[i % len(ids)])

    for i, req in enumerate(trace.requests):
        queue.schedule(req.arrival_s, EventKind.ARRIVAL, functools.partial(arrive, i))
    eager: dict[str, list[float]] = {i: [] for i in ids}

    def sample() -> None:
        cluster.take_kv_sample()
        if read_eagerly:
            for inst in cluster.instances.values():
                blocks = inst.engine.blocks
                eager[inst.instance_id].append(blocks.used_blocks / blocks.num_blocks)
        if len(queue):
            queue.schedule_in(0.002, EventKind.SAMPLE, sample)

    queue.schedule(0.0, EventKind.SAMPLE, sample)
    while queue.run_next():
        pass
    kept = {i: list(v) for i, v in cluster.kv_usage_series().items()}
    assert all(len(v) == len(cluster.kv_times_s) for v in kept.values())
    return cluster.kv_times_s, kept if not read_eagerly else eager


@pytest.mark.parametrize("decode_runs", [True, False])
def test_the_kv_timeline_each_instance_writes_is_what_reading_every_engine_gives(decode_runs: bool) -> None:
    """Samples cost O(1): each instance writes its usage at the sample times it missed just before it next
    changes, reading its decode run at the steps started by then. The timeline equals reading every engine at
    every sample (which brings each engine to that instant), in runs and step by step, and the two agree."""
    times, kept = sampled_kv(decode_runs, read_eagerly=False)
    times_eager, eager = sampled_kv(decode_runs, read_eagerly=True)
    assert times == times_eager and len(times) > 500
    assert kept == eager
    assert max(max(v) for v in kept.values()) > 0.5  # the instances filled up: the test saw real usage
    assert len({round(x, 6) for v in kept.values() for x in v}) > 50  # and it moved (mid-run samples)


def test_mid_run_reads_see_the_step_by_step_state() -> None:
    """Reads in the middle of decode runs see what the step-by-step simulator has at that instant."""
    fast, ref = probed_run(True), probed_run(False)
    assert len(fast) > 1000 and fast == ref


def test_the_reference_is_the_step_by_step_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_runs=False must really take one event per step (else the comparison above proves nothing)."""
    spec = dataclasses.replace(AZURE, max_requests=60)
    events = [0]
    run_next = EventQueue.run_next

    def counting(self: EventQueue) -> bool:
        events[0] += 1
        return run_next(self)

    monkeypatch.setattr(EventQueue, "run_next", counting)
    counts: dict[bool, int] = {}
    for decode_runs in (True, False):
        events[0] = 0
        run = run_simulation(dataclasses.replace(spec, options={"decode_runs": decode_runs}))
        counts[decode_runs] = events[0]
    assert counts[False] > run.engine_steps  # at least one event per step
    assert counts[True] < counts[False] / 3  # runs of decode steps: several times fewer events


@pytest.mark.parametrize(
    "spec",
    [
        dataclasses.replace(AZURE, policy="hilum", options={"priority_fraction": 0.2}),
        dataclasses.replace(AZURE, options={"drain": ("node-0-i3@10",)}),
        dataclasses.replace(AZURE, policy="least-loaded"),
    ],
    ids=["hilum-priorities", "llumnix-drain", "least-loaded"],
)
def test_brief_load_reports_decide_as_detailed_ones(spec: SimSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """The domain cores fed brief reports (the batch as counts; detailed only where a rule picks a request)
    make every decision they make on detailed reports: the runs are equal record for record."""
    import sim.schedulers

    briefs = [0]
    build = Cluster._build_load

    def counting(self: Cluster, inst: Any, *args: Any) -> Any:
        got = build(self, inst, *args)
        briefs[0] += not got.detailed
        return got

    monkeypatch.setattr(Cluster, "_build_load", counting)
    fast = run_simulation(spec)
    assert briefs[0] > 1000  # the cores did run on brief reports of busy instances
    monkeypatch.setattr(sim.schedulers._Feed, "brief", False)
    briefs[0] = 0
    ref = run_simulation(spec)
    assert briefs[0] == 0
    assert_same(fast, ref)
    s = summarize(fast)
    assert s.migrations_intra_domain + s.migrations_cross_domain > 0 or spec.policy == "least-loaded"


@pytest.mark.parametrize(
    "spec",
    [
        dataclasses.replace(AZURE, policy="hilum", options={"priority_fraction": 0.2}),
        dataclasses.replace(AZURE, options={"drain": ("node-0-i3@10",), "scale_out": ("node-1-i7@5",)}),
        MOONCAKE,
    ],
    ids=["hilum-priorities", "llumnix-drain-scale-out", "hilum-mooncake-prefix"],
)
def test_rescheduling_rounds_skipped_for_want_of_a_source_decide_as_planned_ones(
    spec: SimSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round that ``_Feed.rebalance`` skips (no instance can be a source as its decode run grows it; neither
    refresh nor plan) leaves every decision as a refreshed and planned round: the runs are equal record for
    record, and rounds were skipped. The check looks only at instances touched since it last found them quiet:
    quiet rounds read fewer than half the load positions a look at every instance would."""
    import sim.schedulers

    planned = [0]
    plan = DomainCore.plan_rebalance

    def counting(self: DomainCore, now_s: float) -> Any:
        planned[0] += 1
        return plan(self, now_s)

    pool_sizes, looked_at, in_round = [0], [0], [False]
    quiet_round, load_position = sim.schedulers._Feed._quiet_round, Cluster.load_position

    def counting_round(self: Any, now_s: float) -> bool:
        in_round[0] = True
        calls = looked_at[0]
        try:
            quiet = quiet_round(self, now_s)
        finally:
            in_round[0] = False
        if not quiet:
            looked_at[0] = calls  # a planned round: not counted
        else:
            pool_sizes[0] += sum(slot.inst.active for slot in self._slots)
        return quiet

    def counting_position(self: Cluster, inst: Any) -> tuple[int, int]:
        looked_at[0] += in_round[0]
        return load_position(self, inst)

    monkeypatch.setattr(DomainCore, "plan_rebalance", counting)
    monkeypatch.setattr(sim.schedulers._Feed, "_quiet_round", counting_round)
    monkeypatch.setattr(Cluster, "load_position", counting_position)
    fast = run_simulation(spec)
    skipping = planned[0]
    assert 0 < looked_at[0] < pool_sizes[0] / 2  # every active instance at every quiet round before touch sets
    monkeypatch.setattr(sim.schedulers._Feed, "skip_quiet_rounds", False)
    planned[0] = 0
    ref = run_simulation(spec)
    assert skipping < planned[0]  # some rounds found no source, and were skipped
    assert_same(fast, ref)
    s = summarize(fast)
    assert s.migrations_intra_domain > 0 and s.preemptions > 0


@pytest.mark.parametrize(
    ("spec", "built_at_most"),
    [
        (dataclasses.replace(AZURE, options={"drain": ("node-0-i3@10",), "scale_out": ("node-1-i7@5",)}), 1.0),
        (dataclasses.replace(AZURE, policy="least-loaded", options={"priority_fraction": 0.2}), 1.0),
        (dataclasses.replace(AZURE, policy="least-loaded", rate_scale=2.0), 0.6),
        (dataclasses.replace(MOONCAKE, policy="llumnix"), 1.0),
    ],
    ids=["llumnix-drain-scale-out", "least-loaded-priorities", "least-loaded-light", "llumnix-mooncake-prefix"],
)
def test_periodic_reports_built_when_the_core_next_reads_decide_as_reports_built_at_once(
    spec: SimSpec, built_at_most: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The single-tier policies' 50 ms report refresh takes the reports of instances in a decode run and builds
    them only when the core is next used (``Cluster.report_ticket``): the runs are equal record for record to
    building every report at once (with preemptions, migrations, drains, a scale-out, priorities, shared
    prefixes), and under a light load, where several refreshes pass between two dispatches, far fewer reports
    are built. A ticket still pending at the next refresh is taken again in place (``again``): fewer tickets
    are made than taken."""
    import sim.schedulers
    from sim.cluster import ReportTicket

    built, made, taken = [0], [0], [0]
    build, make, take = Cluster._build_load, ReportTicket.__init__, Cluster.report_ticket

    def counting(self: Cluster, *args: Any) -> Any:
        built[0] += 1
        return build(self, *args)

    def making(self: ReportTicket, *args: Any) -> None:
        made[0] += 1
        make(self, *args)

    def taking(self: Cluster, *args: Any) -> Any:
        taken[0] += 1
        return take(self, *args)

    monkeypatch.setattr(Cluster, "_build_load", counting)
    monkeypatch.setattr(ReportTicket, "__init__", making)
    monkeypatch.setattr(Cluster, "report_ticket", taking)
    later = run_simulation(spec)
    built_later = built[0]
    assert 0 < made[0] < taken[0]
    monkeypatch.setattr(sim.schedulers._Flat, "later_reports", False)
    built[0] = 0
    ref = run_simulation(spec)
    assert_same(later, ref)
    assert built_later <= built_at_most * built[0]
    if built_at_most == 1.0:  # the equivalence cases: the events that make runs cut and reports built
        s = summarize(later)
        assert s.preemptions > 0 and (s.migrations_intra_domain > 0 or spec.policy == "least-loaded")


def test_a_runs_step_ends_and_gaps_are_the_step_by_step_clock() -> None:
    """``_Run`` sums its step times in order from its start (as one event per step would advance the clock), and
    its gaps between steps ``first`` .. ``last`` are the differences of those end times, bit for bit."""
    rng = random.Random(3)
    for k in range(50):  # short runs summed one float at a time, long ones by numpy (VECTOR_MIN_STEPS)
        n = rng.randint(1, 60) if k % 2 else rng.randint(VECTOR_MIN_STEPS, VECTOR_MIN_STEPS + 200)
        num_seqs = rng.randint(1, 64)
        terms = [rng.uniform(0.5, 40.0), rng.uniform(0.0, 20.0), rng.uniform(0.5, 2.0)]  # token ms, a + e·B ms, k
        terms += [rng.uniform(0.0, 5.0), rng.uniform(0.0, 1e-3)]  # D0 ms, D1 ms per KV token
        times = DecodeStepTimes(num_seqs, rng.randint(num_seqs, 400_000), *terms)
        durations = [times.step_s(j) for j in range(n)]
        assert times.durations_s(n).tolist() == durations  # one float at a time, or numpy: the same doubles
        start = rng.uniform(0.0, 5e4)
        flight = _Run(DecodeRun(("a", "b"), times, n, None), start, seq=7)
        ends, t = [], start
        for d in durations:
            t += d
            ends.append(t)
        assert flight.end_times_s.tolist() == ends
        assert [flight.scheduled_s(j) for j in range(len(ends))] == [start, *ends[:-1]]
        pairs = [(f, la) for f in range(n) for la in range(f, n)] if n <= 60 else [(0, n - 1), (n - 1, n - 1)]
        pairs += [tuple(sorted((rng.randrange(n), rng.randrange(n)))) for _ in range(200 if n > 60 else 0)]
        for first, last in pairs:
            assert flight.gaps_s(first, last).tolist() == [ends[j + 1] - ends[j] for j in range(first, last)]


def test_a_runs_search_is_bisect_over_its_end_times_and_its_guess_is_mostly_right() -> None:
    """``_Run.search`` answers as ``bisect_left``/``bisect_right`` of the end times from ``lo`` (the guess from the
    closed form checked, and searched from when wrong), at the times the simulator asks (step ends, times
    between them, before the start and after the end) and at times chosen to make the guess wrong; and the guess
    (``steps_ended_guess``) is the answer at almost every time between two step ends."""
    rng = random.Random(11)
    exact = between = 0
    for k in range(40):
        n = rng.randint(1, 60) if k % 2 else rng.randint(VECTOR_MIN_STEPS, VECTOR_MIN_STEPS + 300)
        num_seqs = rng.randint(1, 64)
        terms = [rng.uniform(0.5, 40.0), rng.uniform(0.0, 20.0), rng.uniform(0.5, 2.0)]
        terms += [rng.uniform(0.0, 5.0), rng.uniform(0.0, 1e-3) if k % 3 else 0.0]
        times = DecodeStepTimes(num_seqs, rng.randint(num_seqs, 400_000), *terms)
        start = rng.uniform(0.0, 5e4)
        flight = _Run(DecodeRun(("a",), times, n, None), start, seq=1)
        ends = flight.end_times_s.tolist()
        last = max(0, n - 1)
        asked = [*ends, start - 1.0, start, ends[-1] + 1.0]
        asked += [rng.uniform(start, ends[-1]) for _ in range(50)]
        asked += [(a + b) / 2 for a, b in zip([start, *ends], ends, strict=False)]
        for t in asked:
            for right, reference in ((False, bisect.bisect_left), (True, bisect.bisect_right)):
                answer = reference(ends, t, 0, last)
                for lo in {0, answer // 2, answer}:
                    assert flight.search(t, lo, last, right) == answer, (k, t, lo, right)
        for a, b in zip([start, *ends], ends[:last], strict=False):  # inside a step: the guess alone answers
            t = (a + b) / 2
            between += 1
            exact += min(steps_ended_guess(*times.linear_s(), t - start), last) == bisect.bisect_left(ends, t, 0, last)
    assert exact >= 0.99 * between
    assert steps_ended_guess(1e-3, 0.0, 0.0) == 0 and steps_ended_guess(1e-3, 0.0, 2.5e-3) == 2
    assert steps_ended_guess(0.0, 1.0, 5.0) == steps_ended_guess(1e-3, 1e-6, float("inf")) == 0


def test_a_runs_closed_search_answers_as_bisect_or_declines_and_its_bounds_hold() -> None:
    """``_Run.closed_search`` (no end time read) answers as ``bisect_left`` and ``bisect_right`` whenever it answers,
    its bound lying after the time asked and at or before the end of the step it names; it declines (-1) at a
    step's end and a hair either side of it, and answers at almost every time between two ends.
    ``_Run.end_bound_s`` is at or before each end, by less than a microsecond; ``DecodeStepTimes.linear_slop_s``
    bounds every step time's distance from the line of ``linear_s``, measured exactly (``fractions``). Models
    include terms that nearly cancel (a large token time against a negative fixed attention time)."""
    rng = random.Random(5)
    answered = between = 0
    for k in range(40):
        n = rng.randint(1, 60) if k % 2 else rng.randint(VECTOR_MIN_STEPS, VECTOR_MIN_STEPS + 300)
        num_seqs = rng.randint(1, 64)
        token_ms = rng.uniform(0.5, 40.0) if k % 4 else 1e4
        d0_ms = rng.uniform(0.0, 5.0) if k % 4 else 12.0 - 1e4  # k % 4 == 0: 1e4 + (12 - 1e4), cancelling
        terms = [token_ms, rng.uniform(0.0, 20.0), rng.uniform(0.5, 2.0), d0_ms, rng.uniform(0.0, 1e-3)]
        times = DecodeStepTimes(num_seqs, rng.randint(num_seqs, 400_000), *terms)
        a_s, b_s = times.linear_s()
        slop = Fraction(times.linear_slop_s(n))
        for j in range(n):
            assert abs(Fraction(times.step_s(j)) - (Fraction(a_s) + Fraction(b_s) * j)) <= slop, (k, j)
        start = rng.uniform(0.0, 5e4)
        flight = _Run(DecodeRun(("a",), times, n, None), start, seq=1)
        ends = flight.end_times_s.tolist()
        last = max(0, n - 1)
        for j, end in enumerate(ends):
            assert end - 1e-6 < flight.end_bound_s(j) <= end, (k, j)
        for end in ends[:last]:  # an end the answer depends on: too close to tell
            for t in (math.nextafter(end, -math.inf), end, math.nextafter(end, math.inf)):
                assert flight.closed_search(t, 0, last)[0] == -1, (k, t)
                lo = bisect.bisect_left(ends, t, 0, last)  # the ends before lo are known to be before t
                assert flight.closed_search(t, lo, last)[0] in (-1, lo), (k, t, lo)
        mids = [(a + b) / 2 for a, b in zip([start, *ends], ends, strict=False)]
        for t in [start - 1.0, ends[-1] + 1.0, *mids, *(rng.uniform(start, ends[-1]) for _ in range(50))]:
            answer = bisect.bisect_left(ends, t, 0, last)
            assert answer == bisect.bisect_right(ends, t, 0, last) or t in ends
            for lo in {0, answer // 2, answer}:
                n_at, bound_s = flight.closed_search(t, lo, last)
                if n_at >= 0:
                    assert n_at == answer, (k, t, lo)
                    assert t < bound_s <= (ends[n_at] if n_at < last else math.inf), (k, t, lo)
        for t in mids[:last]:
            between += 1
            answered += flight.closed_search(t, 0, last)[0] >= 0
    assert answered >= 0.99 * between
