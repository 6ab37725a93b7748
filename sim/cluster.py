"""Simulated instances: one engine model per instance, stepped on the virtual clock.

Each instance runs :class:`llumlet.engine.core.EngineCore` — the same engine model the real-time
``sim`` llumlet backend runs — and this module only decides *when* its steps happen: a step starts
as soon as the instance is idle and has work, and its results land ``duration_s`` later. Migration
hooks that must happen "between two steps" (suspending a request) are queued on the instance and run
at the next step boundary, exactly as a real engine loop would.

Runs of decode steps (``decode_runs=True``, the default): most steps are pure decode steps of the same
batch, so the cluster asks the engine for a whole run of them (``EngineCore.start_decode_run``) and
schedules one event at its end instead of one per step. The run is materialized lazily and exactly:
anything that looks at an instance in the middle of a run (through :attr:`SimInstance.engine`,
:meth:`Cluster.load`, :attr:`Cluster.requests`, :attr:`SimInstance.last_step_s`) first brings it to the
state the step-by-step engine would have at that instant (every step that has started applied, every
token of a step that has ended recorded at its own time); anything that changes the engine from outside,
or a hook waiting for the next step boundary, cuts the run at the step in flight. The step-by-step path
(``decode_runs=False``) is the reference the tests compare it with, record by record.

The cluster also keeps the per-request records the report is made from (TTFT, TBT samples,
preemptions, migrations).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from llumlet.engine.core import DecodeRun, EngineCore
from llumlet.engine.latency import LatencyModel
from llumlet.engine.scheduler import Admission, SchedulingPolicy
from llumlet.engine.types import EngineRequest, StepResult
from policy.types import InstanceLoad
from topology.spec import InstanceSpec, ModelSpec, Topology

from .events import EventKind, EventQueue
from .results import RequestLog, RequestRecord
from .traces import TraceRequest

__all__ = ["MAX_RUN_STEPS", "Cluster", "EngineLimits", "GrowthMark", "ReportTicket", "RequestState", "SimInstance"]

#: Steps one decode run plans at most (its step times are computed up front; a run is cut by any change).
MAX_RUN_STEPS = 4096


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Continuous-batching limits of every simulated engine (vLLM's defaults for an A100-class GPU)."""

    max_num_seqs: int = 256  # running requests per step
    max_num_batched_tokens: int = 8192  # tokens (prefill chunk + decodes) per step
    admission: Admission = "chunked"  # "chunked" (vLLM v1) or "whole-prompt" (vLLM v0, Llumnix's engine)
    prefix_caching: bool = True  # share prompt prefixes by the trace's hash ids (vLLM V1: automatic prefix caching on)
    scheduling: SchedulingPolicy = "priority"  # engine scheduling: priority classes, or "fcfs" (priorities ignored)


@dataclass(slots=True)
class RequestState:
    """The simulator's running account of one request (turned into a RequestRecord at the end)."""

    trace: TraceRequest
    index: int = 0  # arrival position (admission order)
    instance_id: str = ""
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    generated_tokens: int = 0
    token_gaps_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    preempted_s: float = 0.0
    preempted_at_s: float | None = None  # set while the request waits to be recomputed
    migrations: int = 0
    migrating: bool = False
    refused: str | None = None
    prefix_hit_tokens: int = 0  # prompt tokens reused from prefix caches, on the engines it left
    dispatched_instance_id: str = ""  # where dispatch first placed it

    def record(self) -> RequestRecord:
        """Freeze this account into the report's RequestRecord."""
        t = self.trace
        return RequestRecord(
            request_id=t.request_id,
            priority=t.priority,
            arrival_s=t.arrival_s,
            prompt_tokens=t.prompt_tokens,
            output_tokens=t.output_tokens,
            generated_tokens=self.generated_tokens,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s,
            token_gaps_s=tuple(self.token_gaps_s),
            preemptions=self.preemptions,
            preempted_s=self.preempted_s,
            migrations=self.migrations,
            refused=self.refused,
            instance_id=self.instance_id,
            prefix_hit_tokens=self.prefix_hit_tokens,
            dispatched_instance_id=self.dispatched_instance_id,
        )


class _Run:
    """A decode run in flight on an instance: the engine's run plus its step end times."""

    __slots__ = ("end_times_s", "ended", "recorded", "run", "seq", "start_s")

    def __init__(self, run: DecodeRun, start_s: float, seq: int) -> None:
        self.run = run
        self.start_s = start_s  # when its first step started
        # the clock of step-by-step events: each step ends at (previous end) + d, summed in that order
        ends = list(itertools.accumulate(run.durations_s, initial=start_s))
        del ends[0]
        self.end_times_s = ends  # end_times_s[j]: when step j (from 0) ends
        self.recorded = 0  # steps whose tokens are in the request accounts
        self.seq = seq  # the event queue's seq when the run started (orders ties, see _started_steps)
        # steps that had ended before the last time _started_steps looked (bisect_left of end_times_s at that
        # time): the clock only moves on, so the next look searches from here, in the part of the list in cache
        self.ended = 0

    def scheduled_s(self, step: int) -> float:
        """When the step-by-step event for the end of step ``step`` (from 0) would have been scheduled."""
        return self.start_s if step == 0 else self.end_times_s[step - 1]

    def gaps_s(self, first: int, last: int) -> list[float]:
        """The gaps between the ends of steps ``first`` .. ``last`` (from 0): ``end[j + 1] - end[j]`` for ``j`` in
        ``first`` .. ``last - 1``, seconds (computed when recorded: a cut run never needs those of its later
        steps)."""
        ends = self.end_times_s
        return list(map(operator.sub, ends[first + 1 : last + 1], ends[first:last]))


class ReportTicket:
    """A brief load report taken at some point, built when first read (``Cluster.report_ticket``)."""

    __slots__ = ("flags", "inst", "load", "started", "version")

    def __init__(self, inst: SimInstance, version: int, started: int, flags: tuple[bool, bool]) -> None:
        self.inst = inst
        self.version = version  # Cluster.load_version then
        self.started = started  # started steps of the run in flight then
        self.flags = flags  # (draining, warming up) then
        self.load: InstanceLoad | None = None  # the report, once built


@dataclass(frozen=True, slots=True)
class GrowthMark:
    """Where an instance's load stood (``Cluster.growth_mark``): its decode run, its load version less the run's
    started steps (constant while only the run's steps go on), and the last started step the mark covers."""

    flight: _Run | None  # the decode run in flight then (None: none, the load holds while the version does)
    base: int  # load version − started steps of that run
    last_step: int  # the mark holds while at most this many steps of the run have started


class SimInstance:
    """One model instance: its spec, its engine model, and its place in the schedule.

    Read the engine through :attr:`engine`: in the middle of a decode run it is first brought to the
    current time.
    """

    def __init__(
        self, spec: InstanceSpec, engine: EngineCore, active: bool, sync: Callable[[SimInstance], None]
    ) -> None:
        self.spec = spec
        self.instance_id = spec.instance_id  # read at every load report: a plain attribute, not a property
        self.domain_id = spec.domain_id
        self._engine = engine
        self._sync = sync
        self.busy = False  # a step (or a decode run) is in flight
        self.watchers: list[set[str]] = []  # sets this instance's id joins at every change (see touch)
        self.active = active  # False until a scripted scale-out adds it
        self._draining = False
        self.warm_until_s = -math.inf  # warm-up (negative fake usage) ends at this time
        self._last_step_s = 0.0
        self.at_boundary: list[Callable[[], None]] = []  # hooks to run at the next step boundary
        self._run: _Run | None = None  # the decode run in flight
        self._flags = (False, False)  # (draining, warming up) as of the last load_version
        self._flag_changes = 0  # times _flags changed
        self._load: tuple[int, InstanceLoad] | None = None  # (load version, the detailed report of it)
        self._brief: tuple[int, InstanceLoad] | None = None  # (load version, the brief report of it)
        self._ticket: ReportTicket | None = None  # a report taken and not built yet (Cluster.report_ticket)
        engine.on_change = self.touch

    def touch(self) -> None:
        """Something changed the instance other than the steps of its decode run going on (a request added or
        aborted, a reservation, a migration hook, a step or run started or ended, a run cut, the draining flag,
        a start or stop): its id joins every set in :attr:`watchers`. A watcher that empties its set can rely
        on the instance being as it left it, its decode run's steps aside, until the id shows up again (the
        warm-up ending is a change of time, not an event: watchers mind ``warm_until_s`` themselves)."""
        iid = self.instance_id
        for watcher in self.watchers:
            watcher.add(iid)

    @property
    def draining(self) -> bool:
        """True while the instance is drained (infinite virtual usage: nothing new, everything moves away)."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        if value != self._draining:
            self._draining = value
            self.touch()

    @property
    def engine(self) -> EngineCore:
        """The engine, in the state step-by-step stepping would have now."""
        if self._run is not None:
            self._sync(self)
        return self._engine

    @property
    def last_step_s(self) -> float:
        """Duration of the latest step started, seconds (the decode step time estimate)."""
        if self._run is not None:
            self._sync(self)
        return self._last_step_s


class _SyncedRequests(Mapping[str, "RequestState"]):
    """The request accounts, each brought to the current time when read (its instance may be mid-run)."""

    def __init__(self, accounts: dict[str, RequestState], cluster: Cluster) -> None:
        self._accounts = accounts
        self._cluster = cluster

    def __getitem__(self, request_id: str) -> RequestState:
        state = self._accounts[request_id]
        inst = self._cluster.instances.get(state.instance_id)
        if inst is not None and inst._run is not None:
            self._cluster._sync_accounts(inst)
        return state

    def __iter__(self) -> Iterator[str]:
        return iter(self._accounts)

    def __len__(self) -> int:
        return len(self._accounts)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._accounts


class Cluster:
    """The simulated instances of a topology (those serving ``model``, or all), stepped on one event queue.

    ``on_finished`` listeners are told of every finished or aborted request (so a migration in
    flight can release its reservation). ``decode_runs``: account pure decode steps in runs (one event
    per run, see the module docstring); False steps every instance one event per step (the reference).
    ``log``: where final request records go (a finished or refused request's account is then written
    there and dropped, and :meth:`close_log` writes the unfinished ones); without one, every account
    stays and :meth:`records` gives them.
    """

    def __init__(
        self,
        queue: EventQueue,
        topology: Topology,
        latency: Callable[[InstanceSpec], LatencyModel],
        limits: EngineLimits,
        inactive: Iterable[str] = (),
        model: str | None = None,
        decode_runs: bool = True,
        log: RequestLog | None = None,
    ) -> None:
        self.queue = queue
        self.topology = topology
        self.decode_runs = decode_runs
        self.log = log
        self._admitted = 0
        self._accounts: dict[str, RequestState] = {}
        self.requests: Mapping[str, RequestState] = _SyncedRequests(self._accounts, self)
        self.engine_steps = 0
        self.on_finished: list[Callable[[str], None]] = []
        self._finished_lengths: dict[str, list[int]] = {}  # instance -> output lengths finished, not yet reported
        inactive_ids = set(inactive)
        self.instances: dict[str, SimInstance] = {}
        for spec in topology.instances:
            if model is not None and spec.model != model:
                continue  # the trace's requests are for one model; other instances are not simulated
            model_spec = topology.model_of(spec.instance_id)
            engine = EngineCore(
                instance_id=spec.instance_id,
                num_blocks=spec.kv_capacity_blocks,
                block_size_tokens=model_spec.block_size_tokens,
                latency_model=latency(spec),
                max_num_seqs=limits.max_num_seqs,
                max_num_batched_tokens=limits.max_num_batched_tokens,
                kv_bytes_per_block=model_spec.kv_bytes_per_block,
                admission=limits.admission,
                enable_prefix_caching=limits.prefix_caching,
                scheduling=limits.scheduling,
                decode_runs=False,  # the cluster drives runs itself (start_decode_run), step() is one step
            )
            active = spec.instance_id not in inactive_ids
            self.instances[spec.instance_id] = SimInstance(spec, engine, active, self._sync)
        self._by_domain: dict[str, list[SimInstance]] = {}  # domain -> its instances, in topology order
        for inst in self.instances.values():
            self._by_domain.setdefault(inst.domain_id, []).append(inst)
        # GPU time: instance -> since when its GPUs are held (serving, or cold-starting); seconds held so far.
        self._held_since: dict[str, float] = {i: 0.0 for i, inst in self.instances.items() if inst.active}
        self._gpu_s = 0.0

    # ------------------------------------------------------------------ fleet
    def hold_gpus(self, instance_id: str) -> None:
        """``instance_id`` holds its GPUs from now (a start: scripted, or an autoscaler's with its cold start).
        Idempotent."""
        self._held_since.setdefault(instance_id, self.queue.now_s)

    def free_gpus(self, instance_id: str) -> None:
        """``instance_id`` gives its GPUs back now (it stopped). Idempotent."""
        since = self._held_since.pop(instance_id, None)
        if since is not None:
            self._gpu_s += (self.queue.now_s - since) * len(self.instances[instance_id].spec.gpus)

    def gpu_hours(self, end_s: float) -> float:
        """Σ over instances of the time their GPUs were held up to ``end_s`` × their GPU count, GPU-hours.

        Instances still holding GPUs count until ``end_s`` (the run's end); an interval past ``end_s`` counts 0.
        """
        held = sum(max(0.0, end_s - since) * len(self.instances[i].spec.gpus) for i, since in self._held_since.items())
        return (self._gpu_s + held) / 3600.0

    def activate(self, instance_id: str, warmup_s: float) -> None:
        """``instance_id`` starts serving now, with a warm-up of ``warmup_s`` (negative fake usage), holding its
        GPUs from now unless it already does (an autoscaler's start holds them from its decision)."""
        inst = self.instances[instance_id]
        inst.active = True
        inst.warm_until_s = self.queue.now_s + warmup_s
        inst.touch()
        self.hold_gpus(instance_id)

    def deactivate(self, instance_id: str) -> None:
        """``instance_id`` stops now: it serves nothing and its GPUs are free.

        Raises ValueError unless it is idle and empty (no request, no KV block held or reserved, no step in flight).
        """
        inst = self.instances[instance_id]
        load = self.load(inst, brief=True)
        if inst.busy or load.num_running or load.num_waiting or load.used_blocks:
            raise ValueError(
                f"{instance_id}: cannot stop: {load.num_running} running, {load.num_waiting} waiting, "
                f"{load.used_blocks} KV blocks held{', a step in flight' if inst.busy else ''}"
            )
        inst.active = False
        inst.warm_until_s = -math.inf
        inst.touch()
        self.free_gpus(instance_id)

    # ------------------------------------------------------------------ views
    def model_of(self, instance_id: str) -> ModelSpec:
        """The model ``instance_id`` serves. Raises KeyError for an unknown instance."""
        return self.topology.model_of(instance_id)

    def domain_ids(self) -> list[str]:
        """Domains with at least one simulated instance, in topology order."""
        present = {i.domain_id for i in self.instances.values()}
        return [d.domain_id for d in self.topology.domains if d.domain_id in present]

    def serving(self, domain_id: str | None = None) -> list[SimInstance]:
        """Active instances (optionally of one domain: O(its instances)), draining ones included."""
        if domain_id is None:
            return [i for i in self.instances.values() if i.active]
        return [i for i in self._by_domain.get(domain_id, ()) if i.active]

    def load_version(self, inst: SimInstance) -> int:
        """A counter that moves exactly when :meth:`load` of ``inst`` would report something new: its engine's
        ``load_version`` plus the changes of its draining and warming-up flags. Compare it with the value
        of the last report used to skip an instance that did not change.

        A busy instance changes at every engine step (token counts grow, and with them blocks).
        """
        return self.load_position(inst)[0]

    def load_position(self, inst: SimInstance) -> tuple[int, int]:
        """(:meth:`load_version`, the steps of the decode run in flight that have started: 0 without one)."""
        draining, warming_up = inst._draining, self.queue.now_s < inst.warm_until_s  # read at every report loop
        flags = inst._flags
        if draining is not flags[0] or warming_up is not flags[1]:
            inst._flags = (draining, warming_up)
            inst._flag_changes += 1
        version = inst._engine.load_version + inst._flag_changes
        flight = inst._run
        if flight is None:
            return version, 0
        started = self._started_steps(flight)  # each step started but not applied yet moves the version by one
        return version + started - flight.run.applied, started

    def growth_mark(self, inst: SimInstance, extra_blocks: int, position: tuple[int, int]) -> GrowthMark:
        """A mark that :meth:`within_growth` holds while ``inst``'s load differs from what :meth:`load` reports
        now by at most ``extra_blocks`` more KV blocks held, and in nothing else a policy reads (its decode
        run's steps go on, nothing else changed; the step time aside). ``position``: its :meth:`load_position`
        now. O(log steps of the run)."""
        version, started = position
        flight = inst._run
        last = 0 if flight is None else inst._engine.decode_run_steps_within(started, extra_blocks)
        return GrowthMark(flight, version - started, last)

    def growth_holds_until_s(self, inst: SimInstance, mark: GrowthMark) -> float:
        """A time before which :meth:`within_growth` holds for ``mark`` (a :meth:`growth_mark` of ``inst`` just
        made) as long as nothing touches ``inst`` (:meth:`SimInstance.touch`): the end of the last step the mark
        covers (the next one starts then), or the end of its warm-up; inf when only a touch can end it (no decode
        run, or the mark covers the run's last step, whose end touches)."""
        until = math.inf
        flight = mark.flight
        if flight is not None and mark.last_step < flight.run.steps:
            until = flight.end_times_s[mark.last_step - 1]
        if self.queue.now_s < inst.warm_until_s:
            until = min(until, inst.warm_until_s)
        return until

    def within_growth(self, inst: SimInstance, mark: GrowthMark, position: tuple[int, int]) -> bool:
        """True while ``mark`` (a :meth:`growth_mark` of ``inst``) holds; ``position``: its :meth:`load_position`
        now."""
        version, started = position
        return inst._run is mark.flight and version - started == mark.base and started <= mark.last_step

    def load(
        self, inst: SimInstance, *, brief: bool = False, version: int | None = None, started: int | None = None
    ) -> InstanceLoad:
        """The instance's load report, as its llumlet would push it (policy's InstanceLoad), with its most
        recent step time; rebuilt only when :meth:`load_version` moved (a new step is a new version).

        ``brief``: the brief report (every figure but the list of running requests, ``InstanceLoad.detailed``
        False while busy), cheap at any batch size; the detailed one of the same version is ``load(inst)``.
        ``version``: :meth:`load_version` of ``inst``, when the caller just read it (now, nothing changed since);
        ``started`` with it: the started steps of its :meth:`load_position`.
        """
        if version is None:
            version = self.load_version(inst)
        return self._cached_load(inst, brief, version, started, inst._flags)

    def _cached_load(
        self, inst: SimInstance, brief: bool, version: int, started: int | None, flags: tuple[bool, bool]
    ) -> InstanceLoad:
        """The report of ``version`` (:meth:`_build_load`), from the instance's cache when it holds that version;
        the cache keeps the newest version built."""
        cache = inst._brief if brief else inst._load
        if cache is not None and cache[0] == version:
            return cache[1]
        load = self._build_load(inst, brief, started, flags)
        if cache is None or cache[0] < version:
            if brief:
                inst._brief = (version, load)
            else:
                inst._load = (version, load)
        return load

    def _build_load(
        self, inst: SimInstance, brief: bool, started: int | None, flags: tuple[bool, bool]
    ) -> InstanceLoad:
        """:meth:`load` of ``inst`` with ``started`` steps of its run started (None: as now) and these
        (draining, warming up) flags, built from the engine."""
        ahead = self._steps_ahead(inst, started)
        flight = inst._run  # its latest started step's time, as step-by-step stepping has it now
        step_s = flight.run.durations_s[flight.run.applied + ahead - 1] if flight is not None else inst._last_step_s
        draining, warming_up = flags
        return inst._engine.instance_load(
            inst.instance_id, inst.domain_id, draining, warming_up, step_s, steps_ahead=ahead, brief=brief
        )

    def report_ticket(
        self, inst: SimInstance, version: int, started: int, again: ReportTicket | None = None
    ) -> ReportTicket:
        """The brief report :meth:`load` would give now (``version``, ``started``: :meth:`load_position` now),
        built only when read (:meth:`ticket_load`): a reader of many reports of an instance in a decode run,
        only the latest of which it uses, builds one. The report is as of now whenever it is read: before the
        instance's engine moves on (its run's steps applied, the run cut or ended) the pending ticket is built.
        One ticket per instance is pending; taking another drops the older one, which then builds nothing.

        ``again``: the caller's previous ticket of ``inst``, which it will not read: while it is the pending one
        (not built, no newer one taken) it is taken again in place (the same object returned, as of now), which
        spares a ticket per instance per report loop to a reader that keeps only the latest.
        """
        if again is not None and inst._ticket is again:
            ticket = again
            ticket.version, ticket.started, ticket.flags = version, started, inst._flags
            inst._ticket = None  # pending again below, unless built now
        else:
            ticket = ReportTicket(inst, version, started, inst._flags)
        flight = inst._run
        cache = inst._brief
        if flight is None or started >= flight.run.steps or (cache is not None and cache[0] == version):
            ticket.load = self.load(inst, brief=True, version=version, started=started)
        else:
            inst._ticket = ticket
        return ticket

    def ticket_load(self, ticket: ReportTicket) -> InstanceLoad:
        """The brief report ``ticket`` stands for (:meth:`report_ticket`). Raises RuntimeError for a ticket that a
        newer one of its instance dropped (never built: the reader should have read the newer one)."""
        if ticket.load is None:
            if ticket.inst._ticket is not ticket:
                raise RuntimeError(f"{ticket.inst.instance_id}: a report ticket read after a newer one was taken")
            self._build_ticket(ticket.inst)
        assert ticket.load is not None
        return ticket.load

    def _build_ticket(self, inst: SimInstance) -> None:
        """Build ``inst``'s pending report ticket, if any (its engine is still where the ticket was taken, its
        run's applied steps at most the ticket's started ones)."""
        ticket = inst._ticket
        if ticket is None:
            return
        inst._ticket = None
        ticket.load = self._cached_load(inst, True, ticket.version, ticket.started, ticket.flags)

    def _steps_ahead(self, inst: SimInstance, started: int | None = None) -> int:
        """Steps of the decode run in flight that have started and are not applied: a reader computes the state
        from the run ahead of them, the engine need not move. The run's last step (requests finish in it) is
        applied instead, and 0 returned. ``started``: the run's started steps, when the caller just read them."""
        flight = inst._run
        if flight is None:
            return 0
        if started is None:
            started = self._started_steps(flight)
        if started < flight.run.steps:
            return started - flight.run.applied
        self._sync(inst)
        return 0

    def take_finished(self, instance_id: str) -> Sequence[int]:
        """Output lengths of the requests that finished on ``instance_id`` since the last call (what its
        llumlet's next load report would carry; an empty tuple when none did)."""
        return self._finished_lengths.pop(instance_id, ())

    # ------------------------------------------------------------------ requests
    def admit(self, req: TraceRequest) -> RequestState:
        """Start the account of a request that arrived (before dispatch)."""
        state = RequestState(trace=req, index=self._admitted)
        self._admitted += 1
        self._accounts[req.request_id] = state
        return state

    def submit(self, req: TraceRequest, instance_id: str) -> None:
        """Queue the request on ``instance_id`` and start stepping if the instance is idle."""
        inst = self.instances[instance_id]
        state = self._accounts[req.request_id]
        state.instance_id = instance_id
        state.dispatched_instance_id = state.dispatched_instance_id or instance_id
        inst.engine.add_request(
            EngineRequest(
                request_id=req.request_id,
                prompt_tokens=req.prompt_tokens,
                max_tokens=req.output_tokens,
                priority=req.priority,
                arrival_s=req.arrival_s,
                prefix_block_hashes=req.prefix_block_hashes,
                prefix_hash_block_tokens=req.prefix_block_tokens,
            )
        )
        self.kick(inst)

    def kick(self, inst: SimInstance) -> None:
        """Start the next step (or decode run) on an idle instance with work (no-op otherwise)."""
        if inst.busy:
            return
        self._run_boundary(inst)
        engine = inst._engine
        if not engine.has_work():
            return
        if self.decode_runs:
            run = engine.start_decode_run(MAX_RUN_STEPS, on_interrupt=lambda _run: self._cut(inst))
            if run is not None:
                self._start_run(inst, run)
                return
        result = engine.step()
        if result.is_idle:  # nothing fits now (space held by reservations): wait for the next event
            return
        inst.touch()
        self.engine_steps += 1
        inst._last_step_s = result.duration_s
        inst.busy = True
        self.queue.schedule_in(result.duration_s, EventKind.STEP_DONE, lambda: self._step_done(inst, result))

    def at_step_boundary(self, inst: SimInstance, hook: Callable[[], None]) -> None:
        """Run ``hook`` between two steps of ``inst`` (now if it is idle)."""
        inst.at_boundary.append(hook)
        if not inst.busy:
            self._run_boundary(inst)
            self.kick(inst)
        elif inst._run is not None:  # the next boundary is the end of the step in flight
            self._cut(inst)
            inst._engine.cut_decode_run()

    def _run_boundary(self, inst: SimInstance) -> None:
        while inst.at_boundary:
            inst.at_boundary.pop(0)()

    def _step_done(self, inst: SimInstance, result: StepResult) -> None:
        now = self.queue.now_s
        inst.busy = False
        inst.touch()
        for request_id, count in result.new_tokens.items():
            self._tokens(self._accounts[request_id], count, now)
        for request_id in result.preempted:
            state = self._accounts[request_id]
            state.preemptions += 1
            state.preempted_at_s = now
        for request_id in result.finished:
            self._finish(request_id, now)
        self.kick(inst)

    # ------------------------------------------------------------------ decode runs
    def _start_run(self, inst: SimInstance, run: DecodeRun) -> None:
        """One event at the end of the run (the engine applied its first step)."""
        flight = _Run(run, self.queue.now_s, self.queue.next_seq())
        inst._run = flight
        inst.touch()
        inst._last_step_s = run.durations_s[0]
        inst.busy = True
        self._schedule_run_end(inst, flight)

    def _schedule_run_end(self, inst: SimInstance, flight: _Run) -> None:
        last = flight.run.steps - 1
        self.queue.schedule(
            flight.end_times_s[last],
            EventKind.STEP_DONE,
            lambda: self._run_done(inst, flight, last + 1),
            scheduled_s=flight.scheduled_s(last),
        )

    def _started_steps(self, flight: _Run) -> int:
        """Steps of the run that have started at this point of the event order (1..steps).

        Step j + 1 starts when step j ends, at ``end_times_s[j]``; an event at the same instant runs
        after it when of a later kind, or, being another step end, when scheduled later.
        """
        ends = flight.end_times_s
        last = flight.run.steps - 1
        now = self.queue.now_s
        # bisect_left(ends, now, 0, last), galloping from the last answer (a lower bound: ends never decrease, and
        # neither does now): a look costs O(log of the steps since the last one) and touches only their part
        n = min(flight.ended, last)
        if n < last and ends[n] < now:
            lo, width = n + 1, 1
            hi = lo + width
            while hi < last and ends[hi] < now:  # every end up to hi is before now
                lo = hi + 1
                width *= 2
                hi = lo + width
            n = bisect.bisect_left(ends, now, lo, min(hi, last))
        flight.ended = n
        if n < last and ends[n] == now:
            key = self.queue.current_key()
            while n < last and ends[n] == now:
                if key is not None and (EventKind.STEP_DONE, flight.scheduled_s(n), flight.seq) >= key[1:]:
                    break
                n += 1
        return n + 1

    def _sync(self, inst: SimInstance) -> None:
        """Bring the engine of an instance in a decode run to the current time: every step that has started
        is applied."""
        flight = inst._run
        if flight is None:
            return
        started = self._started_steps(flight)
        if started > flight.run.applied:
            if inst._ticket is not None:
                self._build_ticket(inst)
            inst._engine.advance_decode_run(started)
        inst._last_step_s = flight.run.durations_s[started - 1]

    def _sync_accounts(self, inst: SimInstance) -> None:
        """Bring the request accounts of an instance in a decode run to the current time: every token of a
        step that has ended is recorded."""
        flight = inst._run
        if flight is not None:
            self._record_run_tokens(flight, self._started_steps(flight) - 1)

    def _cut(self, inst: SimInstance) -> None:
        """The run is about to be cut (a change from outside, a boundary hook): bring it to now and end it
        with the step in flight."""
        flight = inst._run
        if flight is None:
            return
        inst.touch()
        if inst._ticket is not None:  # a change follows
            self._build_ticket(inst)
        self._sync(inst)
        run = flight.run
        if run.applied < run.steps:
            run.steps = run.applied  # what the engine's cut does too; the old end event goes stale
            self._schedule_run_end(inst, flight)

    def _run_done(self, inst: SimInstance, flight: _Run, steps: int) -> None:
        if inst._run is not flight or flight.run.steps != steps:
            return  # the run was cut; a later event ends it
        if inst._ticket is not None:
            self._build_ticket(inst)
        run = flight.run
        if run.applied < steps:
            inst._engine.advance_decode_run(steps)
        self._record_run_tokens(flight, steps)
        inst._run = None
        inst._last_step_s = run.durations_s[steps - 1]
        inst.busy = False
        inst.touch()
        self.engine_steps += steps
        now = self.queue.now_s
        for request_id in run.finished:
            self._finish(request_id, now)
        self.kick(inst)

    def _record_run_tokens(self, flight: _Run, ended: int) -> None:
        """Record the tokens of the run's steps ``flight.recorded`` .. ``ended - 1`` (one per request and
        step, each at its step's end), as ``_tokens`` would step by step."""
        first = flight.recorded
        if ended <= first:
            return
        flight.recorded = ended
        ends = flight.end_times_s
        t_first, t_last = ends[first], ends[ended - 1]
        later_gaps = flight.gaps_s(first, ended - 1)
        count = ended - first
        accounts = self._accounts
        for request_id in flight.run.request_ids:
            state = accounts[request_id]
            if state.first_token_s is None:
                state.first_token_s = t_first
                state.token_gaps_s.extend(later_gaps)
            else:
                if state.last_token_s is not None:
                    state.token_gaps_s.append(t_first - state.last_token_s)
                state.token_gaps_s.extend(later_gaps)
            if state.preempted_at_s is not None:
                state.preempted_s += t_first - state.preempted_at_s
                state.preempted_at_s = None
            state.last_token_s = t_last
            state.generated_tokens += count

    def _tokens(self, state: RequestState, count: int, now: float) -> None:
        if count <= 0:
            return
        if state.first_token_s is None:
            state.first_token_s = now
        elif state.last_token_s is not None:
            state.token_gaps_s.append(now - state.last_token_s)
            state.token_gaps_s.extend([0.0] * (count - 1))
        if state.preempted_at_s is not None:
            state.preempted_s += now - state.preempted_at_s
            state.preempted_at_s = None
        state.last_token_s = now
        state.generated_tokens += count

    def count_prefix_hits(self, state: RequestState, inst: SimInstance) -> None:
        """The request left ``inst``'s engine (finished, or migrated away): add the prompt tokens it reused there."""
        stats = inst.engine.stats.get(state.trace.request_id)
        if stats is not None:
            state.prefix_hit_tokens += stats.prefix_hit_tokens

    def _finish(self, request_id: str, now: float) -> None:
        state = self._accounts[request_id]
        state.finish_s = now
        self.count_prefix_hits(state, self.instances[state.instance_id])
        self._finished_lengths.setdefault(state.instance_id, []).append(state.generated_tokens)
        for listener in self.on_finished:
            listener(request_id)
        self._retire(state)

    def _retire(self, state: RequestState) -> None:
        """A final account goes to the log (with one) and leaves memory."""
        if self.log is not None:
            self.log.add(state.index, state.record())
            del self._accounts[state.trace.request_id]

    def refuse(self, req: TraceRequest, reason: str) -> None:
        """Record that no instance could ever hold ``req``."""
        state = self._accounts[req.request_id]
        state.refused = reason
        self._retire(state)

    def records(self) -> tuple[RequestRecord, ...]:
        """The record of every request still held (all of them without a log), in arrival order."""
        for inst in self.instances.values():
            self._sync_accounts(inst)
        return tuple(s.record() for s in self._accounts.values())

    def close_log(self) -> RequestLog:
        """Write the requests still held (unfinished at the end) to the log and return it.

        Raises RuntimeError without a log.
        """
        if self.log is None:
            raise RuntimeError("Cluster.close_log: the cluster has no request log")
        for inst in self.instances.values():
            self._sync_accounts(inst)
        for state in list(self._accounts.values()):
            self._retire(state)
        return self.log

    def kv_usage_fraction(self) -> dict[str, float]:
        """Per-instance KV usage (blocks held by requests / total blocks), for the timeline plot.

        An instance in the middle of a decode run is read ahead of its applied steps
        (``EngineCore.held_blocks``), without moving its engine."""
        out: dict[str, float] = {}
        for inst in self.instances.values():
            if not inst.active:
                out[inst.instance_id] = 0.0
                continue
            engine = inst._engine
            out[inst.instance_id] = engine.held_blocks(self._steps_ahead(inst)) / engine.blocks.num_blocks
        return out
