"""Autoscaling by the rule book: when to add or remove an instance of a model, and which one (pure).

One :class:`Autoscaler` per model. Its shell — the coordinator leader live (``global_coord.autoscaler``), the
simulator on its virtual clock (``sim.autoscale``) — calls :meth:`Autoscaler.step` every ``interval_s`` with the
domains' summaries (:class:`policy.domain.DomainSummary`, each with an :class:`~policy.domain.InstanceBrief` of
every instance), carries out the :class:`ScaleDecision` s it returns and reports each outcome back
(:meth:`Autoscaler.done`). No I/O and no clock reads: time comes in as ``now_s``.

**The signal: the fleet's freeness.** Over the model's instances that are not draining,

    F = (ΣM − ΣV) / max(1, Σ (running + waiting))                                   (fleet_freeness)

where ΣM is their KV capacity and ΣV their virtual usage (real blocks, the priority headroom of every running
request, the head-of-line demand) plus the demand queued behind each head (``DomainSummary.queued_blocks``)
plus the real blocks held on draining instances (those requests must find room on the others), and the
divisor counts every running and queued request, draining instances included. This is Llumnix's scaling load
(Llumnix v0, ``llumnix/instance_info.py`` ``DispatchAndScaleLoadComputation``: available blocks minus the blocks
of every waiting request, over running + waiting requests, summed over the cluster in
``llumnix/global_scheduler/scale_scheduler.py`` ``compute_load_metric_avg``; AlibabaPAI/llumnix, initial commit
37d8e5e), computed with hilum's virtual usage.

**Priority.** The high-priority class is seen through the rule book's headroom: each running high-priority
request adds ``priority_headroom_blocks`` to ΣV, so a fleet busy with high-priority work looks fuller and scales
out sooner (the same way it repels new work from their instances). A separate per-class freeness is not
computed: summaries carry no per-class counts, and the headroom already is the class's reserved room.

**When.** Scale out while F (counting instances still cold-starting as capacity that is coming, so one burst
does not start a new instance every round) stays below ``scale_out_freeness_below`` for ``scale_out_hold_s``;
scale in while the fleet's freeness *without the instance it would remove* (its capacity gone, its real blocks
still to place) stays above ``scale_in_freeness_above`` for ``scale_in_hold_s`` — Llumnix's ``AvgLoad``
scale-down figure, so a removal never drops the fleet below the threshold it scales in at. Llumnix v0's
defaults: out below 10, in above 60, checked every 10 s (``llumnix/arg_utils.py``: ``scaling_interval`` 10,
``scale_up_threshold`` 10, ``scale_down_threshold`` 60; ``llumnix/config.py`` negates them into loads). After
any action both conditions start over and nothing is decided for ``cool_down_s``. Counts stay within
``[min_instances, max_instances]``: below the minimum it scales out, above the maximum it scales in, whatever F.
Scale-out adds as many instances as bring F back to the threshold (Llumnix's ``check_scale`` loop), within
the maximum.

**Which.** A scale-out first cancels a scale-in still draining (it has its capacity back at once, no cold
start), then starts pool instances: the model's instances of the topology without a live registration, those
that failed to start the fewest times first, then those in the domain whose summary is least free (the new
capacity lands next to the load, reachable over NVLink), then topology order. A scale-in drains the instance
cheapest to empty: one that is not the last live instance of its domain (its requests then move over NVLink,
not across the network), then the fewest KV blocks held (blocks to migrate), then the fewest requests, then
its id. Draining is the rule book's infinite virtual usage: the domain schedulers dispatch nothing to it and
migrate everything away. It is **safe to stop** once its domain scheduler shows it draining with no running or
queued request and no block held (reservations of incoming migrations count as held) and no cross-domain
migration touches it; then the stop is decided, and once the instance's registration is gone its drain is
released and it is back in the pool. One scale-in runs at a time, and none while an instance is starting.

Each instance the autoscaler acts on moves through :class:`Phase`: pool → ``starting`` → live → ``draining``
→ ``stopping`` → ``stopped`` → pool (``undrain`` takes a draining instance back to live). The whole state is
one value (:class:`AutoscaleState`), so a new coordinator leader resumes where the last one stopped.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from policy.domain import DomainSummary, InstanceBrief
from policy.types import loop_interval_problem
from policy.usage import freeness_of

__all__ = [
    "AutoscaleConfig",
    "AutoscaleState",
    "Autoscaler",
    "Evaluation",
    "FleetLoad",
    "Phase",
    "PoolInstance",
    "ScaleAction",
    "ScaleDecision",
    "StartFailures",
    "StepResult",
    "Tracked",
    "fleet_load",
    "pools_of",
    "safe_to_stop",
]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"AutoscaleConfig: {message}")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """When the autoscaler acts (module docstring). Times in seconds, freeness in decode steps.

    Raises ValueError on a non-finite or negative time, thresholds that are not ordered
    (``scale_out_freeness_below`` < ``scale_in_freeness_above``, or the fleet could oscillate), a minimum below 1,
    or a maximum below the minimum.
    """

    enabled: bool = False  # the coordinator leader (and hilum sim) run the autoscaler
    interval_s: float = 10.0  # one decision round per this (Llumnix: scaling_interval 10 s)
    scale_out_freeness_below: float = 10.0  # scale out while the fleet's freeness stays below (Llumnix: 10)
    scale_in_freeness_above: float = 60.0  # scale in while it would stay above without one instance (Llumnix: 60)
    scale_out_hold_s: float = 10.0  # the scale-out condition must hold this long
    scale_in_hold_s: float = 60.0  # the scale-in condition must hold this long
    cool_down_s: float = 30.0  # after an action, nothing is decided for this long
    min_instances: int = 1  # instances of the model kept serving, >= 1
    max_instances: int = 0  # most instances serving or starting; 0 = every instance of the model in the topology
    start_timeout_s: float = 600.0  # a started instance that has not reported by then is given up (back to the pool)

    def __post_init__(self) -> None:
        problem = loop_interval_problem("interval_s", self.interval_s)
        _require(problem is None, problem or "")
        for name in ("scale_out_hold_s", "scale_in_hold_s", "cool_down_s"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value}")
        timeout = self.start_timeout_s
        _require(math.isfinite(timeout) and timeout > 0, f"start_timeout_s must be a finite number > 0, got {timeout}")
        for name in ("scale_out_freeness_below", "scale_in_freeness_above"):
            value = getattr(self, name)
            _require(math.isfinite(value), f"{name} must be finite, got {value}")
        _require(
            self.scale_out_freeness_below < self.scale_in_freeness_above,
            f"scale_out_freeness_below ({self.scale_out_freeness_below}) must be below scale_in_freeness_above "
            f"({self.scale_in_freeness_above}), or the fleet could scale in and out in turn",
        )
        _require(self.min_instances >= 1, f"min_instances must be >= 1, got {self.min_instances}")
        _require(
            self.max_instances == 0 or self.max_instances >= self.min_instances,
            f"max_instances ({self.max_instances}) must be 0 (the whole pool) or >= min_instances "
            f"({self.min_instances})",
        )


@dataclass(frozen=True, slots=True)
class PoolInstance:
    """An instance of the topology the autoscaler may start or stop (``topology.spec.InstanceSpec`` in short)."""

    instance_id: str
    domain_id: str
    capacity_blocks: int  # its KV cache capacity, blocks (M)
    num_gpus: int = 1  # GPUs it occupies (GPU-hours)


class _InstanceSpecLike(Protocol):
    """What :func:`pools_of` reads of ``topology.spec.InstanceSpec``."""

    @property
    def instance_id(self) -> str: ...
    @property
    def domain_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def kv_capacity_blocks(self) -> int: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...


def pools_of(instances: Iterable[_InstanceSpecLike]) -> dict[str, list[PoolInstance]]:
    """model -> its instances as :class:`PoolInstance` s, in the order given (a topology's instances)."""
    out: dict[str, list[PoolInstance]] = {}
    for spec in instances:
        pool = PoolInstance(spec.instance_id, spec.domain_id, spec.kv_capacity_blocks, len(spec.gpus))
        out.setdefault(spec.model, []).append(pool)
    return out


class ScaleAction(enum.StrEnum):
    """What a decision asks its shell to do."""

    SCALE_OUT = "scale-out"  # start a pool instance (the actuator's hook: scale-out MODEL INSTANCE)
    UNDRAIN = "undrain"  # cancel a scale-in still draining: remove its drain intent (no hook)
    DRAIN = "drain"  # begin a scale-in: put a drain intent on the instance (no hook)
    SCALE_IN = "scale-in"  # the drained instance is empty: stop it (the actuator's hook: scale-in MODEL INSTANCE)
    RELEASE = "release"  # the stopped instance's registration is gone: remove its drain intent (no hook)


class Phase(enum.StrEnum):
    """Where an instance the autoscaler acts on stands (module docstring)."""

    STARTING = "starting"  # started, not reported yet: counted as capacity that is coming
    DRAINING = "draining"  # the autoscaler drains it: it waits to be empty
    STOPPING = "stopping"  # empty, its stop is being carried out
    STOPPED = "stopped"  # stopped; waits for its registration to disappear


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One thing to do, with why."""

    action: ScaleAction
    model: str
    instance_id: str
    at_s: float  # when it was decided, on the shell's clock
    reason: str  # the rule that decided, in words, with its figures


@dataclass(frozen=True, slots=True)
class Tracked:
    """An instance in one of the autoscaler's phases, since when (the shell's clock)."""

    instance_id: str
    phase: Phase
    since_s: float
    retry_at_s: float | None = None  # a failed stop is decided again at this time (None: now)


@dataclass(frozen=True, slots=True)
class StartFailures:
    """How often a pool instance failed to start (a hook that failed, or no report within the timeout)."""

    instance_id: str
    count: int


@dataclass(frozen=True, slots=True)
class AutoscaleState:
    """Everything an :class:`Autoscaler` remembers (persisted by the live shell, restored by a new leader)."""

    model: str
    tracked: tuple[Tracked, ...] = ()  # sorted by instance id
    failures: tuple[StartFailures, ...] = ()  # sorted by instance id
    last_action_s: float | None = None  # when it last scaled out or began a scale-in (the cool-down runs from it)
    out_since_s: float | None = None  # since when the scale-out condition holds (None: it does not)
    in_since_s: float | None = None  # since when the scale-in condition holds


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """The fleet of one model as :func:`fleet_load` adds it up from the summaries."""

    capacity_blocks: int  # ΣM over instances not draining
    usage_blocks: float  # ΣV over them + queued demand + real blocks held on draining instances
    requests: int  # running + queued requests, draining instances included
    live: tuple[InstanceBrief, ...]  # instances not draining, by id
    draining: tuple[InstanceBrief, ...]  # draining instances (by an operator or the autoscaler), by id

    def freeness(self, extra_capacity_blocks: float = 0.0) -> float:
        """F = (ΣM + extra − ΣV) / max(1, requests), decode steps (module docstring)."""
        return freeness_of(self.capacity_blocks + extra_capacity_blocks, self.usage_blocks, self.requests)

    def freeness_without(self, brief: InstanceBrief) -> float:
        """F without the live instance ``brief``: its capacity gone, its real blocks still to place (Llumnix
        ``AvgLoad.compute_load_metric_down``)."""
        usage = self.usage_blocks - brief.virtual_usage + brief.used_blocks
        return freeness_of(self.capacity_blocks - brief.capacity_blocks, usage, self.requests)


def fleet_load(summaries: Iterable[DomainSummary], model: str, leaving: Collection[str] = ()) -> FleetLoad:
    """Add up the summaries of ``model`` (module docstring; a summary with model "" counts for any model).

    ``leaving``: instances counted as draining even where their summary does not show it yet (a drain intent
    written but not applied by the domain scheduler).
    """
    capacity, usage, requests = 0, 0.0, 0
    live: list[InstanceBrief] = []
    draining: list[InstanceBrief] = []
    for summary in summaries:
        if summary.model and summary.model != model:
            continue
        usage += summary.queued_blocks
        for brief in summary.instances:
            requests += brief.num_running + brief.num_waiting
            if brief.draining or brief.instance_id in leaving:
                draining.append(brief)
                usage += brief.used_blocks
            else:
                live.append(brief)
                capacity += brief.capacity_blocks
                usage += brief.virtual_usage
    key = lambda b: b.instance_id  # noqa: E731
    return FleetLoad(capacity, usage, requests, tuple(sorted(live, key=key)), tuple(sorted(draining, key=key)))


def safe_to_stop(brief: InstanceBrief, migrations_touching: int = 0) -> bool:
    """True when ``brief`` shows a drained instance with nothing left: its domain scheduler applies the drain,
    no running or queued request, no KV block held (reservations of incoming migrations count), and no
    cross-domain migration from or to it in flight (``migrations_touching``)."""
    return (
        brief.draining
        and brief.num_running == 0
        and brief.num_waiting == 0
        and brief.used_blocks == 0
        and migrations_touching == 0
    )


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What the last round saw (for ``hilumctl autoscale`` and logs)."""

    at_s: float
    freeness: float | None  # the fleet's F with coming capacity (None: no live instance reported yet)
    freeness_without_candidate: float | None  # F without the scale-in candidate (None: no candidate)
    candidate: str  # the instance a scale-in would drain ("" = none)
    live: int  # instances serving (reported, not draining)
    coming: int  # started or registered, not reported yet
    draining: int  # instances the autoscaler drains or stops
    requests: int  # running + queued requests of the model
    min_instances: int
    max_instances: int  # the effective maximum (the pool's size when the configuration says 0)


@dataclass(frozen=True, slots=True)
class StepResult:
    """The decisions of one round, what it saw, and the starts it gave up on (instance ids)."""

    decisions: tuple[ScaleDecision, ...]
    evaluation: Evaluation
    abandoned: tuple[str, ...] = ()  # started instances that did not report within start_timeout_s


@dataclass(slots=True)
class _Instance:
    phase: Phase
    since_s: float
    retry_at_s: float | None = None


class Autoscaler:
    """The autoscaling decisions of one model (module docstring).

    Args:
        model: the model it scales.
        cfg: when it acts.
        pool: every instance of the model in the topology, in topology order (the ones it may start or stop).
        state: a state to resume from (:meth:`state` of a previous autoscaler), None to start fresh.

    Raises ValueError when ``pool`` is empty, repeats an id, or ``state`` is of another model.
    """

    def __init__(
        self, model: str, cfg: AutoscaleConfig, pool: Sequence[PoolInstance], state: AutoscaleState | None = None
    ) -> None:
        if not pool:
            raise ValueError(f"Autoscaler({model!r}): the pool of instances is empty")
        ids = [p.instance_id for p in pool]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Autoscaler({model!r}): pool instance ids repeat: {ids}")
        self.model = model
        self.cfg = cfg
        self._pool = {p.instance_id: p for p in pool}
        self._order = {iid: i for i, iid in enumerate(ids)}
        self._tracked: dict[str, _Instance] = {}
        self._failures: dict[str, int] = {}
        self._last_action_s: float | None = None
        self._out_since_s: float | None = None
        self._in_since_s: float | None = None
        if state is not None:
            self._restore(state)

    @property
    def max_instances(self) -> int:
        """The effective maximum: ``cfg.max_instances``, or the pool's size when that is 0."""
        return self.cfg.max_instances or len(self._pool)

    # ---- state -----------------------------------------------------------------------------------------
    def state(self) -> AutoscaleState:
        """The whole state, as one value."""
        return AutoscaleState(
            model=self.model,
            tracked=tuple(Tracked(iid, t.phase, t.since_s, t.retry_at_s) for iid, t in sorted(self._tracked.items())),
            failures=tuple(StartFailures(iid, n) for iid, n in sorted(self._failures.items())),
            last_action_s=self._last_action_s,
            out_since_s=self._out_since_s,
            in_since_s=self._in_since_s,
        )

    def _restore(self, state: AutoscaleState) -> None:
        if state.model != self.model:
            raise ValueError(f"Autoscaler({self.model!r}): cannot resume the state of model {state.model!r}")
        for t in state.tracked:
            if t.instance_id not in self._pool:
                continue  # the topology changed: no longer ours to act on
            # A stop whose outcome the previous shell never reported is decided again (stopping is idempotent).
            phase = Phase.DRAINING if t.phase is Phase.STOPPING else t.phase
            self._tracked[t.instance_id] = _Instance(phase, t.since_s, t.retry_at_s)
        self._failures = {f.instance_id: f.count for f in state.failures if f.instance_id in self._pool}
        self._last_action_s, self._out_since_s, self._in_since_s = (
            state.last_action_s,
            state.out_since_s,
            state.in_since_s,
        )

    def phase(self, instance_id: str) -> Phase | None:
        """The phase of an instance (None: not acted on: in the pool or live)."""
        tracked = self._tracked.get(instance_id)
        return tracked.phase if tracked is not None else None

    # ---- outcomes ----------------------------------------------------------------------------------------
    def done(self, decision: ScaleDecision, ok: bool, now_s: float) -> None:
        """The shell carried out ``decision`` (``ok``) or gave up on it after its retries (not ``ok``)."""
        iid = decision.instance_id
        tracked = self._tracked.get(iid)
        if decision.action is ScaleAction.SCALE_OUT:
            if not ok and tracked is not None and tracked.phase is Phase.STARTING:
                del self._tracked[iid]
                self._failures[iid] = self._failures.get(iid, 0) + 1
        elif decision.action is ScaleAction.SCALE_IN:
            if tracked is not None and tracked.phase is Phase.STOPPING:
                if ok:
                    self._tracked[iid] = _Instance(Phase.STOPPED, now_s)
                else:  # still drained and empty: decided again after a cool-down
                    self._tracked[iid] = _Instance(Phase.DRAINING, tracked.since_s, now_s + self.cfg.cool_down_s)
        elif decision.action is ScaleAction.DRAIN:
            if not ok and tracked is not None and tracked.phase is Phase.DRAINING:
                del self._tracked[iid]  # the intent was not written: it keeps serving
        elif decision.action is ScaleAction.UNDRAIN:
            if not ok:
                self._tracked[iid] = _Instance(Phase.DRAINING, now_s)  # still drained: the scale-in goes on
        elif decision.action is ScaleAction.RELEASE and not ok:
            self._tracked[iid] = _Instance(Phase.STOPPED, now_s)  # released again next round

    # ---- one round -----------------------------------------------------------------------------------------
    def step(
        self,
        summaries: Iterable[DomainSummary],
        now_s: float,
        *,
        registered: Collection[str] = (),
        unavailable: Collection[str] = (),
        migrating: Collection[str] = (),
    ) -> StepResult:
        """One decision round.

        Args:
            summaries: the latest summary of every domain (those of other models are skipped).
            now_s: now, on the shell's clock (the one :meth:`done` and the state use).
            registered: instances with a live registration (an instance registered but not in a summary yet
                counts as coming capacity, and one stopped is released only once it is neither).
            unavailable: pool instances that must not be started (an operator's drain, a drained domain, a domain
                with no domain scheduler).
            migrating: instances a cross-domain migration in flight touches (never safe to stop).
        """
        given = list(summaries)
        leaving = {i for i, t in self._tracked.items() if t.phase is not Phase.STARTING}
        fleet = fleet_load(given, self.model, leaving)
        briefs = {b.instance_id: b for b in (*fleet.live, *fleet.draining)}
        decisions: list[ScaleDecision] = []
        abandoned = self._advance(briefs, set(registered), set(migrating), now_s, decisions)
        live = list(fleet.live)
        joining = [i for i in registered if i in self._pool and i not in briefs and i not in self._tracked]
        starting = [i for i, t in self._tracked.items() if t.phase is Phase.STARTING]
        coming = sorted({*joining, *starting})
        coming_blocks = sum(self._pool[i].capacity_blocks for i in coming)
        count = len(live) + len(coming)
        freeness = fleet.freeness(coming_blocks) if live or coming else None
        candidate = self._candidate(live)
        without = fleet.freeness_without(candidate) if candidate is not None else None
        evaluation = Evaluation(
            at_s=now_s,
            freeness=freeness,
            freeness_without_candidate=without,
            candidate=candidate.instance_id if candidate is not None else "",
            live=len(live),
            coming=len(coming),
            draining=len(leaving),
            requests=fleet.requests,
            min_instances=self.cfg.min_instances,
            max_instances=self.max_instances,
        )
        if freeness is None:  # nothing reported yet: no signal to act on
            self._out_since_s = self._in_since_s = None
            return StepResult(tuple(decisions), evaluation, abandoned)
        cfg = self.cfg
        self._out_since_s = _since(self._out_since_s, freeness < cfg.scale_out_freeness_below, now_s)
        self._in_since_s = _since(
            self._in_since_s, without is not None and without > cfg.scale_in_freeness_above, now_s
        )
        if self._last_action_s is not None and now_s < self._last_action_s + cfg.cool_down_s:
            return StepResult(tuple(decisions), evaluation, abandoned)
        by_domain = {  # a domain with no live instance of the model (empty or drained) comes last
            s.domain_id: s.freeness if s.capacity_blocks > 0 else math.inf
            for s in given
            if not s.model or s.model == self.model
        }
        taken = set(briefs) | set(registered)
        action = self._scale_out(fleet, count, coming_blocks, taken, unavailable, by_domain, now_s)
        if not action and not coming and not leaving and candidate is not None and without is not None:
            action = self._scale_in(candidate, count, without, now_s)
        if action:
            self._last_action_s = now_s
            self._out_since_s = self._in_since_s = None
            decisions.extend(action)
        return StepResult(tuple(decisions), evaluation, abandoned)

    def _advance(
        self,
        briefs: dict[str, InstanceBrief],
        registered: set[str],
        migrating: set[str],
        now_s: float,
        decisions: list[ScaleDecision],
    ) -> tuple[str, ...]:
        """Move tracked instances on: started ones that reported are live, empty drained ones are stopped,
        stopped ones that are gone are released. Returns the starts given up on."""
        abandoned: list[str] = []
        for iid, t in sorted(self._tracked.items()):
            brief = briefs.get(iid)
            if t.phase is Phase.STARTING:
                if brief is not None:
                    del self._tracked[iid]  # it serves: live
                elif now_s >= t.since_s + self.cfg.start_timeout_s:
                    del self._tracked[iid]
                    self._failures[iid] = self._failures.get(iid, 0) + 1
                    abandoned.append(iid)
            elif t.phase is Phase.DRAINING:
                if t.retry_at_s is not None and now_s < t.retry_at_s:
                    continue
                if brief is None and iid not in registered:
                    why = "its registration disappeared while it drained"
                elif brief is not None and safe_to_stop(brief, 1 if iid in migrating else 0):
                    why = "drained and empty: no request, no KV block held, no migration in flight"
                else:
                    continue
                self._tracked[iid] = _Instance(Phase.STOPPING, t.since_s)
                decisions.append(ScaleDecision(ScaleAction.SCALE_IN, self.model, iid, now_s, f"safe to stop: {why}"))
            elif t.phase is Phase.STOPPED and brief is None and iid not in registered:
                del self._tracked[iid]
                decisions.append(
                    ScaleDecision(
                        ScaleAction.RELEASE, self.model, iid, now_s, "stopped and deregistered: back in the pool"
                    )
                )
        return tuple(abandoned)

    def _candidate(self, live: Sequence[InstanceBrief]) -> InstanceBrief | None:
        """The live instance cheapest to empty (module docstring), None when there is none to spare."""
        if len(live) < 2:
            return None
        per_domain: dict[str, int] = {}
        for b in live:
            domain = self._domain_of(b.instance_id)
            per_domain[domain] = per_domain.get(domain, 0) + 1

        def cost(b: InstanceBrief) -> tuple[bool, int, int, str]:
            alone = per_domain[self._domain_of(b.instance_id)] == 1
            return (alone, b.used_blocks, b.num_running + b.num_waiting, b.instance_id)

        candidates = [b for b in live if b.instance_id in self._pool]
        return min(candidates, key=cost) if candidates else None

    def _domain_of(self, instance_id: str) -> str:
        pool = self._pool.get(instance_id)
        return pool.domain_id if pool is not None else ""

    def _scale_out(
        self,
        fleet: FleetLoad,
        count: int,
        extra_blocks: float,
        taken: set[str],
        unavailable: Collection[str],
        domain_freeness: dict[str, float],
        now_s: float,
    ) -> list[ScaleDecision]:
        cfg = self.cfg
        room = self.max_instances - count
        if room <= 0:
            return []
        below_min = count < cfg.min_instances
        held_s = now_s - self._out_since_s if self._out_since_s is not None else -math.inf
        if not below_min and held_s < cfg.scale_out_hold_s:
            return []
        # Capacity to add, cheapest first: scale-ins still draining (no cold start), then pool instances.
        options: list[tuple[ScaleAction, str, int]] = [
            (ScaleAction.UNDRAIN, iid, self._pool[iid].capacity_blocks)
            for iid, t in sorted(self._tracked.items())
            if t.phase is Phase.DRAINING
        ]
        free = [p for iid, p in self._pool.items() if iid not in self._tracked and iid not in taken | set(unavailable)]

        def order(p: PoolInstance) -> tuple[int, float, int]:
            return (
                self._failures.get(p.instance_id, 0),
                domain_freeness.get(p.domain_id, math.inf),
                self._order[p.instance_id],
            )

        options += [(ScaleAction.SCALE_OUT, p.instance_id, p.capacity_blocks) for p in sorted(free, key=order)]
        chosen: list[tuple[ScaleAction, str, int]] = []
        added = 0.0
        for option in options[:room]:
            enough = fleet.freeness(extra_blocks + added) >= cfg.scale_out_freeness_below
            if chosen and enough and count + len(chosen) >= cfg.min_instances:
                break
            chosen.append(option)
            added += option[2]
        if not chosen:
            return []
        before = fleet.freeness(extra_blocks)
        after = fleet.freeness(extra_blocks + added)
        if below_min:
            why = f"{count} instances serving or starting, below min_instances {cfg.min_instances}"
        else:
            why = f"fleet freeness {before:.1f} below {cfg.scale_out_freeness_below:g} for {held_s:.0f} s"
        decisions = []
        for action, iid, _ in chosen:
            if action is ScaleAction.UNDRAIN:
                self._tracked.pop(iid)
                text = f"{why}: cancel its scale-in (freeness {after:.1f} with {len(chosen)} more)"
            else:
                self._tracked[iid] = _Instance(Phase.STARTING, now_s)
                text = f"{why}: start it (freeness {after:.1f} with {len(chosen)} more once started)"
            decisions.append(ScaleDecision(action, self.model, iid, now_s, text))
        return decisions

    def _scale_in(self, candidate: InstanceBrief, count: int, without: float, now_s: float) -> list[ScaleDecision]:
        cfg = self.cfg
        if count <= cfg.min_instances:
            return []
        above_max = count > self.max_instances
        held_s = now_s - self._in_since_s if self._in_since_s is not None else -math.inf
        if not above_max and held_s < cfg.scale_in_hold_s:
            return []
        if above_max:
            why = f"{count} instances serving, above max_instances {self.max_instances}"
        else:
            why = f"fleet freeness without it {without:.1f} above {cfg.scale_in_freeness_above:g} for {held_s:.0f} s"
        self._tracked[candidate.instance_id] = _Instance(Phase.DRAINING, now_s)
        text = (
            f"{why}; cheapest to empty: {candidate.used_blocks} KV blocks, "
            f"{candidate.num_running + candidate.num_waiting} requests"
        )
        return [ScaleDecision(ScaleAction.DRAIN, self.model, candidate.instance_id, now_s, text)]


def _since(since_s: float | None, holds: bool, now_s: float) -> float | None:
    """Since when a condition holds: kept while it holds, set now when it starts, None when it does not."""
    if not holds:
        return None
    return now_s if since_s is None else since_s
