"""Run one simulation: a topology, a trace and a policy in, a :class:`sim.results.SimRun` out.

``run_simulation`` is a pure function of its :class:`SimSpec` (same spec and seed, same result); it
keeps no module state, so several simulations can run in one process or as Ray tasks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from global_coord.wiring import CostModelJudge
from hilum_config import DEFAULTS_SOURCE, HilumConfig, load_config
from llumlet.engine.blocks import MAX_BLOCKS
from llumlet.engine.latency import LatencyModel, gpu_latency_model, latency_model_problems, scaled_latency_models
from policy.autoscale import pools_of
from policy.types import MIN_LOOP_INTERVAL_S
from topology.graph import TopologyGraph
from topology.load import load_topology, pydantic_message
from topology.spec import InstanceSpec, Topology

from .autoscale import SimAutoscaler, initial_fleet
from .cluster import Cluster, EngineLimits
from .events import EventKind, EventQueue
from .migration import LinkFlows, MigrationExecutor
from .results import KvTimeline, RequestLog, SimRun
from .schedulers import SchedulerContext, SchedulingConfig, make_scheduler
from .traces import Trace, TraceRequest, load_trace, with_priorities

#: Seconds from an autoscaler's scale-out until the instance serves, unless ``SimOptions.cold_start_s`` says
#: otherwise (loading a 13B model's weights and capturing CUDA graphs: about a minute).
DEFAULT_COLD_START_S = 60.0

__all__ = [
    "DEFAULTS",
    "DEFAULT_COLD_START_S",
    "SimCheckError",
    "SimOptions",
    "SimSpec",
    "check_autoscale",
    "check_options",
    "check_prefix_aware",
    "fit_to_context",
    "run_simulation",
    "served_model",
    "simulable_problems",
]


class SimOptions(BaseModel):
    """Optional knobs of one simulation (validated; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    priority_fraction: float = Field(0.0, ge=0.0, le=1.0, description="share of requests marked high priority")
    model: str | None = Field(
        None, description="the model the trace's requests are for (default: the model with most instances)"
    )
    drain: tuple[str, ...] = Field((), description="scripted drains, each 'INSTANCE@SECONDS'")
    scale_out: tuple[str, ...] = Field(
        (), description="scripted scale-outs, each 'INSTANCE@SECONDS': the instance is idle until then"
    )
    autoscale: bool = Field(
        False,
        description="run the autoscaler (policy.autoscale, the configuration file's autoscale section) on the "
        "virtual clock: it starts pool instances and drains and stops serving ones",
    )
    initial_instances: int | None = Field(
        None,
        ge=1,
        description="instances of the model serving from the start, taken in turn from each domain (None: all; "
        "the others wait in the pool for the autoscaler, or stay off without it)",
    )
    cold_start_s: float | None = Field(
        None,
        ge=0,
        description="with autoscale: seconds from a scale-out until the instance serves (None: 60); its GPUs "
        "count from the decision",
    )
    report_interval_s: float = Field(
        0.05,
        ge=MIN_LOOP_INTERVAL_S,
        description="load reports reaching a central scheduler (llumnix, least-loaded; Llumnix: 50 ms)",
    )
    summary_lag_s: float = Field(0.05, ge=0, description="delay before a published summary reaches its readers")
    # Overrides of the configuration file's keys (for sweeps); None = the file's value (hilum_config).
    migrate_interval_s: float | None = Field(
        None, ge=MIN_LOOP_INTERVAL_S, description="overrides intervals.rebalance_interval_s"
    )
    summary_interval_s: float | None = Field(
        None, ge=MIN_LOOP_INTERVAL_S, description="overrides intervals.summary_interval_s"
    )
    cross_interval_s: float | None = Field(
        None, ge=MIN_LOOP_INTERVAL_S, description="overrides intervals.cross_interval_s"
    )
    cap_fraction: float | None = Field(None, gt=0, le=1.0, description="overrides cost.cap_fraction")
    downtime_budget_s: float | None = Field(None, gt=0, description="overrides approval.downtime_budget_s")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=16)
    admission: Literal["chunked", "whole-prompt"] = Field(
        "chunked", description="engine admission: vLLM v1 chunk by chunk, or vLLM v0 whole prompt + watermark"
    )
    scheduling: Literal["priority", "fcfs"] = Field(
        "priority",
        description="engine scheduling: priority classes in admission and preemption, or fcfs (priorities ignored)",
    )
    kv_samples: int = Field(
        200,
        ge=2,
        description="the per-instance KV usage timeline is sampled every (last arrival / kv_samples) seconds "
        "until every request has finished: about this many points up to the last arrival, more after it",
    )
    prefix_caching: bool | None = Field(
        None,
        description="engines share prompt prefixes by the trace's prefix hash ids (Mooncake traces carry them), "
        "as vLLM V1's automatic prefix caching does by default; False: every prompt is computed in full; "
        "None: the configuration's prefix_cache.enabled (default true)",
    )
    prefix_aware_dispatch: bool | None = Field(
        None, description="overrides policy.prefix_aware_dispatch (dispatch counts the prefix blocks a target holds)"
    )
    decode_runs: bool = Field(
        True,
        description="account pure decode steps in runs, one event per run (False: one event per engine step, "
        "the reference; the results are the same)",
    )

    @field_validator("drain", "scale_out")
    @classmethod
    def _check_events(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            _parse_event(item)
        return value


def _parse_event(item: str) -> tuple[str, float]:
    instance, sep, when = item.rpartition("@")
    if not sep or not instance:
        raise ValueError(f"{item!r}: expected INSTANCE@SECONDS, e.g. node-0-i3@30")
    try:
        at_s = float(when)
    except ValueError:
        raise ValueError(f"{item!r}: {when!r} is not a number of seconds") from None
    if not (math.isfinite(at_s) and at_s >= 0):
        raise ValueError(f"{item!r}: the time must be a finite number of seconds >= 0, got {when}")
    return instance, at_s


@dataclass(frozen=True, slots=True)
class SimSpec:
    """One simulation: where, what traffic, which policy."""

    topology: str  # bundled topology name or path to a topology YAML file
    trace: str  # bundled trace name or path to a trace file
    policy: str  # one of sim.schedulers.POLICY_NAMES
    rate_scale: float = 1.0  # arrivals compressed by this factor (2 = twice the rate)
    max_requests: int | None = None  # keep only the first N requests by arrival
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    config: str | None = None  # the configuration file every tier reads (hilum_config); None: HILUM_CONFIG or defaults

    def parsed_options(self) -> SimOptions:
        """The options, validated. Raises :class:`SimCheckError` with one problem per bad key, each led by the key
        and its ``hilum sim`` flag (``drain (--drain): ...``)."""
        try:
            return SimOptions(**dict(self.options))
        except ValidationError as exc:
            problems = [  # in hilum's words, as a sweep file's options
                f"{_option_name(e['loc'])}: {pydantic_message(e, SimOptions.model_fields)}" for e in exc.errors()
            ]
            raise SimCheckError([], problems) from None


#: The ``hilum sim`` flag of each option that has one (the others are set in a sweep file's ``options`` only).
_SAME_NAMED = ("priority_fraction", "drain", "scale_out", "autoscale", "model", "initial_instances", "cold_start_s")
_OPTION_FLAGS = {
    **{k: "--" + k.replace("_", "-") for k in (*_SAME_NAMED, "admission", "scheduling", "prefix_caching")},
    "prefix_aware_dispatch": "--prefix-aware",
    "summary_lag_s": "--summary-lag-ms, in ms there",
}


def _option_name(loc: tuple[int | str, ...]) -> str:
    """``priority_fraction (--priority-fraction)``: a sweep file's key, and the flag of ``hilum sim`` that sets
    it when one does."""
    key = ".".join(map(str, loc))
    flag = _OPTION_FLAGS.get(str(loc[0])) if loc else None
    return f"{key} ({flag})" if flag else key


#: The embedded defaults of a bare ``hilum sim``: the bundled 2 x 8 A100-40GB topology (16 Llama-2-13B
#: instances) and the Azure conversation trace, compressed to a load at which the baselines preempt.
DEFAULTS = SimSpec(topology="2x8-a100-40gb", trace="azure-conv", policy="hilum", rate_scale=2.75, max_requests=5000)


def _latency_for(topology: Topology) -> Callable[[InstanceSpec], LatencyModel]:
    """Step-time models per (model, GPU, TP): ``llumlet.engine.latency.gpu_latency_model``, the live sim engine's
    rule (a GPU without measured data, or whose HBM bandwidth is more than 5 % off the measured GPU of its family,
    gets a measured model scaled by HBM bandwidth: ``scaled_latency_models`` lists those, for the run's config).
    """
    cache: dict[tuple[str, str, int], LatencyModel] = {}

    def get(spec: InstanceSpec) -> LatencyModel:
        key = (spec.model, spec.gpu_type, spec.tensor_parallel_size)
        if key not in cache:
            hbm = topology.gpu_types[spec.gpu_type].hbm_bandwidth_bytes_per_s
            cache[key] = gpu_latency_model(*key, hbm)[0]
        return cache[key]

    return get


def configured(path: str | None, options: SimOptions) -> HilumConfig:
    """The configuration file's settings (``hilum_config.load_config``) with the run's overrides applied.

    Raises:
        hilum_config.ConfigError: the file is unreadable or invalid.
    """
    cfg = load_config(path)
    intervals = cfg.intervals
    for option, key in (
        ("migrate_interval_s", "rebalance_interval_s"),
        ("summary_interval_s", "summary_interval_s"),
        ("cross_interval_s", "cross_interval_s"),
    ):
        value = getattr(options, option)
        if value is not None:
            intervals = dataclasses.replace(intervals, **{key: value})
    cost = (
        cfg.cost if options.cap_fraction is None else dataclasses.replace(cfg.cost, cap_fraction=options.cap_fraction)
    )
    approval = cfg.approval
    if options.downtime_budget_s is not None:
        approval = dataclasses.replace(approval, downtime_budget_s=options.downtime_budget_s)
    policy, domain = cfg.policy, cfg.domain
    if options.prefix_aware_dispatch is not None:
        policy = dataclasses.replace(policy, prefix_aware_dispatch=options.prefix_aware_dispatch)
        domain = dataclasses.replace(domain, policy=policy)
    check_prefix_cache(cfg)
    prefix_cache = cfg.prefix_cache
    if options.prefix_caching is not None:
        prefix_cache = dataclasses.replace(prefix_cache, enabled=options.prefix_caching)
    # the autoscaler runs exactly when the option says (hilum sim and a sweep set it from the file's switch)
    autoscale = dataclasses.replace(cfg.autoscale, enabled=options.autoscale)
    return dataclasses.replace(
        cfg,
        policy=policy,
        domain=domain,
        intervals=intervals,
        cost=cost,
        approval=approval,
        prefix_cache=prefix_cache,
        autoscale=autoscale,
    )


def check_prefix_cache(cfg: HilumConfig) -> None:
    """Refuse, by key, the ``prefix_cache`` settings the simulator cannot honour: its engines match prefixes by
    the trace's own hash blocks (Mooncake: 512 tokens), not by ``blocks_per_hash``, and report every hash they
    hold (no ``report_max_hashes`` cap). Raises ValueError."""
    default = type(cfg.prefix_cache)()
    for key in ("blocks_per_hash", "report_max_hashes"):
        if getattr(cfg.prefix_cache, key) != getattr(default, key):
            raise ValueError(
                f"{cfg.source}: prefix_cache.{key}: hilum sim cannot honour it (its engines match prefixes by the "
                f"trace's own hash blocks and report every hash they hold); leave it at {getattr(default, key)} "
                "for hilum sim (prefix_cache.enabled is honoured)"
            )


def run_simulation(
    spec: SimSpec,
    *,
    trace: Trace | None = None,
    topology: Topology | None = None,
    progress: Callable[[float], None] | None = None,
) -> SimRun:
    """Simulate ``spec`` and return its run record.

    Args:
        spec: what to simulate.
        trace: an already loaded trace (skips loading ``spec.trace``; rate scale and limit are then
            assumed applied).
        topology: an already loaded topology (skips loading ``spec.topology``).
        progress: called with the fraction of requests finished, from time to time.

    Raises:
        ValueError: unknown policy, bad options, scripted events naming unknown instances.
        topology.load.TopologyError, and the trace loader's errors, for bad input files.
    """
    wall_start = time.perf_counter()
    options = spec.parsed_options()
    topo = topology if topology is not None else load_topology(spec.topology)
    if trace is None:
        trace = load_trace(spec.trace, rate_scale=spec.rate_scale, max_requests=spec.max_requests, seed=spec.seed)
    if options.priority_fraction > 0:
        trace = with_priorities(trace, options.priority_fraction, spec.seed)
    model = served_model(topo, options.model)
    max_context = topo.models[model].max_context_tokens
    trace, truncated = fit_to_context(trace, max_context)
    drains, scale_outs = check_options(topo, options)
    config = configured(spec.config, options)
    cold_start_s = check_autoscale(options, config)
    pool = pools_of(i for i in topo.instances if i.model == model)[model]
    serving = set(initial_fleet(pool, options.initial_instances or len(pool)))
    off = [p.instance_id for p in pool if p.instance_id not in serving]

    # Few collections from the first engine built: a fleet of thousands is built without full collections going
    # over every object (0.1-0.3 CPU-s of a 4,096-instance run, and over a previous run's garbage first).
    with _few_collections():
        queue = EventQueue()
        limits = EngineLimits(
            options.max_num_seqs,
            options.max_num_batched_tokens,
            options.admission,
            config.prefix_cache.enabled,  # the option's override, else the file's
            options.scheduling,
        )
        cluster = Cluster(
            queue,
            topo,
            _latency_for(topo),
            limits,
            inactive=[*(i for i, _ in scale_outs), *off],
            model=model,
            decode_runs=options.decode_runs,
            log=RequestLog(len(trace.requests)),
        )
        graph = TopologyGraph(topo, lazy=True)  # built at the first path asked for (a run may ask for none)
        executor = MigrationExecutor(cluster, graph, config.cost, LinkFlows())
        timing = SchedulingConfig(
            report_interval_s=options.report_interval_s,
            migrate_interval_s=config.intervals.rebalance_interval_s,
            summary_interval_s=config.intervals.summary_interval_s,
            summary_lag_s=options.summary_lag_s,
            cross_interval_s=config.intervals.cross_interval_s,
            reservation_ttl_s=config.intervals.reservation_ttl_s,
        )
        total = len(trace.requests)
        done = [0]
        last_done_s = [0.0]  # when the last request finished or was refused: the run's end

        def count_done(_request_id: str) -> None:
            done[0] += 1
            last_done_s[0] = queue.now_s
            if progress is not None and done[0] % 200 == 0:
                progress(done[0] / total)

        cluster.on_finished.append(count_done)
        ctx = SchedulerContext(
            cluster=cluster,
            executor=executor,
            graph=graph,
            judge=CostModelJudge(topo, config.cost, config.approval),
            domain=config.domain,
            timing=timing,
            rng=random.Random(spec.seed),
            live=lambda: done[0] < total,
            measured_bandwidth=config.measured_bandwidth,
        )
        scheduler = make_scheduler(spec.policy, ctx)
        autoscaler = None
        if options.autoscale:
            autoscaler = SimAutoscaler(
                model,
                config.autoscale,
                pool,
                cluster,
                scheduler,
                executor,
                cold_start_s=cold_start_s,
                warmup_s=timing.warmup_s,
                drained=[i for i, _ in drains],
                live=ctx.live,
            )

        arrivals = iter(trace.requests)

        def arrive(req: TraceRequest) -> None:
            schedule_arrival()
            cluster.admit(req)
            decision = scheduler.dispatch(req)
            if decision.target_id is None:
                cluster.refuse(req, decision.reason)
                count_done(req.request_id)
            else:
                cluster.submit(req, decision.target_id)

        def schedule_arrival() -> None:
            # One arrival in the queue at a time, the next one scheduled as this one arrives: a trace's whole arrival
            # list in the heap made it (and the cost of every event) grow with the trace. Arrivals are the only
            # events of their kind and all count as scheduled at 0 s, so they keep the order they had all scheduled
            # up front (sim.events: ties go by kind, then scheduled_s).
            req = next(arrivals, None)
            if req is not None:
                queue.schedule(req.arrival_s, EventKind.ARRIVAL, functools.partial(arrive, req), scheduled_s=0.0)

        schedule_arrival()
        for instance_id, at_s in drains:
            queue.schedule(at_s, EventKind.SCRIPTED, functools.partial(cluster.set_draining, instance_id, True))
        for instance_id, at_s in scale_outs:
            queue.schedule(
                at_s, EventKind.SCRIPTED, functools.partial(_scale_out, cluster, instance_id, timing.warmup_s)
            )

        trace_end_s = trace.requests[-1].arrival_s if trace.requests else 0.0
        sample_every_s = max(trace_end_s, 1.0) / options.kv_samples

        def sample() -> None:
            cluster.take_kv_sample()  # each instance writes its usage at this time itself (Cluster.take_kv_sample)
            if done[0] < total:
                queue.schedule_in(sample_every_s, EventKind.SAMPLE, sample)

        queue.schedule(0.0, EventKind.SAMPLE, sample)
        scheduler.start()
        if autoscaler is not None:
            autoscaler.start()
        while queue.run_next():
            pass
    usage = cluster.kv_usage_series()
    if progress is not None:
        progress(1.0)
    log = cluster.close_log()
    # the last finish, or a refusal after it (a run that refuses every request held its GPUs until then too)
    end_s = max(log.totals.max_finish_s, last_done_s[0])
    run_config: dict[str, object] = {
        "options": options.model_dump(),
        "max_requests": spec.max_requests,
        "model": model,
        "max_context_tokens": max_context,
        "truncated_requests": truncated,
        "derived_latency_models": scaled_latency_models(topo, model),
        "initial_instances": len(serving),
        "prefix_aware_dispatch": config.policy.prefix_aware_dispatch,  # the file's, or the option's override
        "prefix_caching": limits.prefix_caching,  # the option, else the file's prefix_cache.enabled
        # every setting the run used, in the configuration file's layout (the file's, or the defaults, with the
        # options' overrides applied), and the file it came from: a results file says what made it
        "config_file": None if config.source == DEFAULTS_SOURCE else config.source,
        "settings": config.sections(),
    }
    if autoscaler is not None:
        run_config["autoscale"] = dataclasses.asdict(autoscaler.rule)
        run_config["cold_start_s"] = autoscaler.cold_start_s
    return SimRun(
        policy=spec.policy,
        topology=topo.name,
        trace=trace.name,
        seed=spec.seed,
        rate_scale=spec.rate_scale,
        sim_duration_s=end_s,
        wall_s=time.perf_counter() - wall_start,
        engine_steps=cluster.engine_steps,
        requests=log,
        migrations=tuple(executor.records),
        kv=KvTimeline(
            interval_s=sample_every_s,
            times_s=tuple(cluster.kv_times_s),
            usage_fraction=usage,  # the instances' own arrays: the cluster is done with them
        ),
        config=run_config,
        gpu_hours=cluster.gpu_hours(end_s),
        scale_events=tuple(autoscaler.records) if autoscaler is not None else (),
    )


#: Net allocations of container objects between two young-generation collections while a simulation runs (Python's
#: default is 700). The event loop makes no cyclic garbage (a 4,096-instance run of ``bench/bench_sim_speed.py``
#: leaves the same unreachable objects behind with the collector off as on), so collections only go over live
#: objects: at the default, 8-10 % of a 1,024-instance run's CPU; at 10,000, 1.10-1.21 of about 10 CPU s at 4,096
#: instances (the size benchmark's ``gc s`` column), mostly cache misses on objects long out of the CPU's caches,
#: against 0.46-0.49 at a million, which still bounds what a cycle made in some rarer path could hold.
_GC_YOUNG_THRESHOLD = 1_000_000


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """While the cluster is built and its event loop runs: the objects made before (topology, trace) are frozen out
    of the cyclic collector (``gc.freeze``: the full collections do not go over them again) and young collections
    run every ``_GC_YOUNG_THRESHOLD`` allocations (building thousands of engines at the default of 700 ran full
    collections over every object); both restored after. Nothing simulated depends on when the
    collector runs (reference counting frees what it can at once either way). A process that froze objects itself
    keeps them frozen (nothing is frozen or unfrozen then)."""
    thresholds = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(thresholds[0], _GC_YOUNG_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()


class SimCheckError(ValueError):
    """The problems :func:`check_options` found, every one of them: ``topology_problems`` are the topology's own
    (the simulator cannot run it whatever the options), ``option_problems`` the options' against it. ``str()`` is
    one line per problem, the topology's first."""

    def __init__(self, topology_problems: Sequence[str], option_problems: Sequence[str]) -> None:
        self.topology_problems = list(topology_problems)
        self.option_problems = list(option_problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """Every problem, one a line: the topology's, then the options'."""
        return [*self.topology_problems, *self.option_problems]


def simulable_problems(topology: Topology, model: str) -> list[str]:
    """Why the simulator cannot run ``topology``'s ``model`` instances, whatever the options: instances with more
    KV cache blocks than the simulated engine can number (``llumlet.engine.blocks.MAX_BLOCKS``), and those whose
    model, GPU and TP degree have no step-time model (``llumlet.engine.latency.latency_model_problems``), each
    led by the topology's name and file (a copy of a bundled file keeps its name). Empty when it can."""
    problems: list[str] = []
    named = f"{topology.name} ({topology.source})"
    huge = [i for i in topology.instances if i.model == model and i.kv_capacity_blocks > MAX_BLOCKS]
    if huge:
        problems.append(
            f"{named}: instance {huge[0].instance_id} has {huge[0].kv_capacity_blocks:,} KV cache blocks "
            f"({len(huge)} such instance{'s' if len(huge) > 1 else ''}); the simulated engine numbers at most "
            f"{MAX_BLOCKS:,} (block ids are C ints, as in vLLM's block tables): set a smaller "
            "kv_capacity_blocks for the instance in the topology, or a larger block_size_tokens for the model"
        )
    problems += [f"{named}: {line}" for line in latency_model_problems(topology, model)]
    return problems


def check_options(topology: Topology, options: SimOptions) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Check the options against the topology; returns the parsed drains and scale-outs (instance, time s).

    Raises:
        ValueError: for an unknown model (:func:`served_model`; nothing else is checked then).
        SimCheckError: with every other problem found: the topology's own (:func:`simulable_problems`), and the
            options': ``initial_instances`` above the model's instances, options that clash (autoscale with
            scale_out, cold_start_s without autoscale, initial_instances with scale_out), a scripted event that
            holds several instances or names an instance that does not exist or does not serve the simulated model, an
            instance named twice or both drained and scaled out, a drain of an instance ``initial_instances``
            keeps off. Each problem names the option as a sweep file's key and ``hilum sim``'s flag.
    """
    model = served_model(topology, options.model)
    known = sorted(i.instance_id for i in topology.instances if i.model == model)
    problems: list[str] = []
    if options.initial_instances is not None and options.initial_instances > len(known):
        problems.append(
            f"initial_instances (--initial-instances) {options.initial_instances}: {topology.name} has only "
            f"{len(known)} {model} instances"
        )
    if options.autoscale and options.scale_out:
        problems.append("scale_out (--scale-out) cannot be combined with autoscale: the autoscaler starts instances")
    if options.cold_start_s is not None and not options.autoscale:
        problems.append("cold_start_s (--cold-start-s) applies only with autoscale (--autoscale)")
    if options.initial_instances is not None and options.scale_out:
        problems.append(
            "initial_instances (--initial-instances) cannot be combined with scale_out (--scale-out): "
            "the instances kept off would clash"
        )
    # each named as a sweep file's key and hilum sim's flag (as the messages above): a sweep's options come here too
    label = {"--drain": "drain (--drain)", "--scale-out": "scale_out (--scale-out)"}
    parsed: dict[str, list[tuple[str, float]]] = {"--drain": [], "--scale-out": []}
    for flag, raw in (("--drain", options.drain), ("--scale-out", options.scale_out)):
        for value in raw:
            if "," in value:
                one = f"{label[flag]} takes one INSTANCE@S an entry"  # in a sweep file's list, or a flag's value
                problems.append(f"{one}, got {value!r}: give each instance its own")
                continue
            parsed[flag].append(_parse_event(value))  # well-formed: SimOptions checked each
    drains, scale_outs = parsed["--drain"], parsed["--scale-out"]
    for flag, events in parsed.items():
        for instance_id, _ in events:
            if instance_id in known:
                continue
            other = next((i for i in topology.instances if i.instance_id == instance_id), None)
            members = [i for i in known if topology.instance(i).domain_id == instance_id]
            if other is not None:  # an instance the run does not simulate
                problems.append(
                    f"{label[flag]} names {instance_id!r}, which serves {other.model}; the run simulates the "
                    f"{model} instances (model, --model, chooses the model)"
                )
            elif members:  # a domain: name its instances, each drained or added by its own flag
                problems.append(
                    f"{label[flag]} names NVLink domain {instance_id!r}; it takes instances, one per {flag}: "
                    f"{', '.join(members)}"
                )
            else:
                shown = ", ".join(known[:6]) + (", ..." if len(known) > 6 else "")
                problems.append(
                    f"{label[flag]} names unknown instance {instance_id!r}; {model} instances of {topology.name}: "
                    f"{shown}"
                )
        repeated = sorted({i for i, _ in events if sum(1 for j, _ in events if j == i) > 1})
        if repeated:
            problems.append(f"{label[flag]} names {', '.join(repeated)} more than once; give each instance once")
    both = {i for i, _ in drains} & {i for i, _ in scale_outs}
    if both:
        problems.append(
            f"{', '.join(sorted(both))}: named by both drain (--drain) and scale_out (--scale-out); an instance is "
            "drained or added during a run, not both"
        )
    if options.initial_instances is not None and drains and options.initial_instances <= len(known):
        pool = pools_of(i for i in topology.instances if i.model == model)[model]
        serving = set(initial_fleet(pool, options.initial_instances))
        off = sorted(i for i, _ in drains if i in known and i not in serving)
        if off:
            problems.append(
                f"drain (--drain) names {', '.join(off)}, which initial_instances (--initial-instances) "
                f"{options.initial_instances} keeps off (a drain of an instance that never serves would do nothing); "
                "drain a serving instance"
            )
    simulable = simulable_problems(topology, model)
    if simulable or problems:
        raise SimCheckError(simulable, problems)
    return drains, scale_outs


def check_prefix_aware(options: SimOptions, config: HilumConfig, *, source: str = "the configuration") -> None:
    """Refuse prefix-aware dispatch asked for by the options when prefix caching is off, by the options
    (``prefix_caching`` false) or by the configuration (its ``prefix_cache.enabled`` false, the options silent):
    no engine then holds a prefix for dispatch to count. ``source`` names the configuration in the message.

    Raises ValueError."""
    if not options.prefix_aware_dispatch:
        return
    if options.prefix_caching is False:
        raise ValueError(
            "prefix_aware_dispatch (--prefix-aware) needs prefix caching: with prefix_caching false "
            "(--no-prefix-caching) no engine holds a prefix for dispatch to count; leave one of the two out"
        )
    if options.prefix_caching is None and not config.prefix_cache.enabled:
        raise ValueError(
            f"prefix_aware_dispatch (--prefix-aware) needs prefix caching, and {source} has prefix_cache.enabled "
            "false: no engine holds a prefix for dispatch to count"
        )


def check_autoscale(
    options: SimOptions, config: HilumConfig, *, cold_start: str = "cold_start_s", source: str = "the configuration"
) -> float:
    """The cold start an autoscaled run uses (``options.cold_start_s`` or :data:`DEFAULT_COLD_START_S`), s.

    Raises ValueError when it is not below the configuration's ``autoscale.start_timeout_s`` (every start
    would be given up before it serves); only checked with ``options.autoscale``. ``cold_start`` and ``source``
    name the option and the configuration in the message, as the caller's user gave them (``--cold-start-s``,
    ``--config FILE``).
    """
    cold_start_s = DEFAULT_COLD_START_S if options.cold_start_s is None else options.cold_start_s
    timeout_s = config.autoscale.start_timeout_s
    if options.autoscale and not cold_start_s < timeout_s:
        default = ", the default" if options.cold_start_s is None else ""
        raise ValueError(
            f"{cold_start} ({cold_start_s:g}{default}) must be below autoscale.start_timeout_s ({timeout_s:g}) of "
            f"{source}, or every start would be given up before it serves"
        )
    return cold_start_s


def served_model(topology: Topology, requested: str | None) -> str:
    """The model a simulation serves: ``requested``, or the one with the most instances (first in file on ties).

    Raises ValueError naming the topology's models when ``requested`` is not one of them, or when the topology has
    no instance at all (there is nothing to simulate).
    """
    counts: dict[str, int] = {}
    for spec in topology.instances:
        counts[spec.model] = counts.get(spec.model, 0) + 1
    if not counts:
        raise ValueError(f"topology {topology.name} ({topology.source}) has no instances: there is nothing to simulate")
    if requested is not None:
        if requested not in counts:
            raise ValueError(
                f"model (--model) {requested!r}: no instance of it in {topology.name}; models there: "
                f"{', '.join(sorted(counts))}"
            )
        return requested
    return max(counts, key=lambda m: counts[m])


def fit_to_context(trace: Trace, max_context_tokens: int) -> tuple[Trace, int]:
    """Clip requests whose prompt + output exceed the model's context window.

    A server would reject them (or truncate the prompt); the simulator keeps them, as a serving stack
    with prompt truncation would: the output is capped at ``max_context_tokens - 1`` and the prompt keeps
    its first ``max_context_tokens - output`` tokens (so its prefix block hashes stay valid; hash blocks
    past the cut are dropped). Returns the new trace and how many requests changed
    (reported as ``truncated_requests`` in the run's config). About 8 % of the Azure conversation trace
    exceeds Llama-2's 4,096 tokens.

    Raises ValueError when ``max_context_tokens`` < 2.
    """
    if max_context_tokens < 2:
        raise ValueError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
    out: list[TraceRequest] = []
    changed = 0
    for req in trace.requests:
        if req.prompt_tokens + req.output_tokens <= max_context_tokens:
            out.append(req)
            continue
        output = min(req.output_tokens, max_context_tokens - 1)
        prompt = min(req.prompt_tokens, max_context_tokens - output)
        hashes = req.prefix_block_hashes
        if hashes and req.prefix_block_tokens:
            hashes = hashes[: prompt // req.prefix_block_tokens]
        out.append(dataclasses.replace(req, prompt_tokens=prompt, output_tokens=output, prefix_block_hashes=hashes))
        changed += 1
    if not changed:
        return trace, 0
    return dataclasses.replace(trace, requests=tuple(out)), changed


def _scale_out(cluster: Cluster, instance_id: str, warmup_s: float) -> None:
    cluster.activate(instance_id, warmup_s)
