"""The cluster-level policies the simulator compares, composed from the production decision cores.

No decision is made here: every one comes from the code the live tiers run — the domain core
(``rack_sched.core.DomainCore``: dispatch, rescheduling with its busy/settle and cool-down rules, what to
propose across domains), the coordinator's core (``global_coord.approver.decide``: destination instance,
cost model, approval, link budgets) and the gateway's core (``gateway.core.GatewayCore``: domain choice with
stamped reservations). This module only decides *when* they run and feeds them what production would see:
load reports of the simulated engines (never a request's true output length: that is the engines' business),
summaries published every ``summary_interval_s`` and received ``summary_lag_s`` later.

- ``round-robin``: dispatch in turn to every instance that can hold the request; no migration (a baseline
  with no rule book).
- ``least-loaded``: one domain core over every instance, with no priority headroom and no migration (the
  paper's INFaaS-style baseline); its reports refreshed every ``report_interval_s``.
- ``llumnix``: Llumnix's single tier: one domain core over every instance (the flat configuration), reports
  every ``report_interval_s`` (its manager's polling), rescheduling every ``migrate_interval_s`` over the
  whole cluster, blind to topology: a pair across domains migrates over the network with no approval.
- ``hilum``: two tiers. The gateway core picks a domain from the lagged summaries; that domain's core
  dispatches and rebalances with fresh reports (llumlets push on every change); every ``cross_interval_s``
  each domain core proposes what ``policy.pair_domains`` makes it a source for, and the coordinator's core
  approves or rejects it with the cost model, pricing each path with the pre-copy rate earlier approved
  moves on it achieved (``topology.bandwidth``: the executor's measurements, as the live coordinator reads the
  llumlets' from the migration records). One cross-domain move per domain at a time (the domain core
  proposes none while one is in flight, as the live domain scheduler's loop carries its proposals out one by
  one); a committed move lets its domain propose again at once (the live loop does the same). The rounds run
  every ``cross_interval_s``; the live loop sleeps that long after a round ends, so its period also holds the
  round's own time (a timing difference, docs/simulator.md "Fidelity").
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar

from gateway.core import GatewayCore, PlacementAttempt
from global_coord.approver import MoveJudge, decide
from policy.dispatch import DispatchDecision, all_draining, reusable_prefix_hashes
from policy.domain import DomainSummary
from policy.load import InstanceLoad
from policy.migration import MigrationDecision, source_slack_blocks
from policy.summarize import same_content, summarize_domain
from rack_sched.core import CrossDomainProposal, DomainConfig, DomainCore, DomainRequest
from topology.bandwidth import BandwidthEstimates, BandwidthSample, MeasuredBandwidthConfig, default_transport
from topology.graph import TopologyGraph

from .cluster import Cluster, GrowthMark, ReportTicket, SimInstance
from .events import EventKind
from .migration import MigrationExecutor
from .results import MigrationRecord
from .traces import TraceRequest

__all__ = [
    "POLICY_NAMES",
    "ClusterScheduler",
    "SchedulerContext",
    "SchedulingConfig",
    "make_scheduler",
    "policy_migrates",
]


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Timing of the control loops, seconds of simulated time (the shared ones come from ``hilum_config``)."""

    report_interval_s: float = 0.05  # load reports reaching a central scheduler (Llumnix: 50 ms)
    migrate_interval_s: float = 0.05  # rescheduling loop period (Llumnix: 50 ms)
    summary_interval_s: float = 0.1  # domain summary publication period (hilum)
    summary_lag_s: float = 0.05  # delay before a summary reaches the coordinator and gateways
    cross_interval_s: float = 0.5  # the domains' cross-domain round
    warmup_s: float = 10.0  # warm-up window of an instance added by scale-out
    reservation_ttl_s: float = 1.0  # a gateway's dispatch reservation counts at most this long

    def __post_init__(self) -> None:
        for name in ("report_interval_s", "migrate_interval_s", "summary_interval_s", "cross_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.summary_lag_s < 0 or self.warmup_s < 0:
            raise ValueError("summary_lag_s and warmup_s must be >= 0")


@dataclass(slots=True)
class SchedulerContext:
    """What every policy works with: the cluster, the migration executor, the decision settings."""

    cluster: Cluster
    executor: MigrationExecutor
    graph: TopologyGraph
    judge: MoveJudge  # the coordinator's cost-model judge (global_coord.wiring.CostModelJudge)
    domain: DomainConfig  # the rule book and the domains' decision settings
    timing: SchedulingConfig
    rng: random.Random
    live: Callable[[], bool]  # True while requests remain; periodic loops stop when it turns False
    measured_bandwidth: MeasuredBandwidthConfig = field(default_factory=MeasuredBandwidthConfig)


def domain_request(req: TraceRequest, model: str, only_if_room: bool = False) -> DomainRequest:
    """The request as a gateway submits it: ``max_tokens`` is the trace's output length (trace replay, as
    ``hilum bench`` and vLLM's benchmark_serving send it; the engines stop there), with the hash ids of its
    prompt's prefix blocks (a gateway hashes the prompt's tokens; a trace carries them). ``only_if_room``: as
    ``DomainRequest``'s."""
    return DomainRequest(
        req.request_id,
        model,
        req.prompt_tokens,
        max(1, req.output_tokens),
        req.priority,
        only_if_room,
        prefix_hashes=req.prefix_block_hashes,
        prefix_block_tokens=req.prefix_block_tokens if req.prefix_block_hashes else 0,
    )


_UNREPORTED = -2  # _Slot.reported of an instance the core does not hold (-1: added, no load reported yet)


class _Slot:
    """A feed's bookkeeping of one instance of its pool, read at every report loop: fields of one object, where
    dicts keyed by instance id cost a lookup each (on a large cluster, a cache miss on the id's hash and one on the
    value)."""

    __slots__ = ("deferred", "holds_until_s", "inst", "mark", "reported")

    def __init__(self, inst: SimInstance) -> None:
        self.inst = inst
        self.reported = _UNREPORTED  # load version of its last report (or of a deferred one)
        self.deferred = False  # a skipped round deferred its report to the next refresh
        self.mark: GrowthMark | None = None  # while it holds, the instance is no migration source
        self.holds_until_s = math.inf  # a time before which its mark holds, while nothing touches it (_quiet_round)


class _Feed:
    """A domain core over some instances, fed their load reports as a domain scheduler would receive them.

    Like a llumlet, an instance reports when its load changed (``Cluster.load_version``) and only then. The
    reports are brief (``InstanceLoad.detailed`` False: the batch as counts); the core asks for an instance's
    detailed report (``details_of``) when a rule picks a request from it — the same state, built only then.
    """

    brief = True  # False: detailed reports every time (the reference the tests compare against)
    skip_quiet_rounds = True  # False: every rescheduling round refreshes and plans (the reference of the tests)

    def __init__(
        self, domain_id: str, cluster: Cluster, instance_ids: Iterable[str], cfg: DomainConfig, rng: random.Random
    ):
        self.cluster = cluster
        self.core = DomainCore(domain_id, cfg, rng, details_of=self._details_of)
        pool = [cluster.instances[i] for i in instance_ids]  # every instance it may ever hold
        self._slots = [_Slot(inst) for inst in pool]  # in the pool's order
        self._slot_of = {slot.inst.instance_id: slot for slot in self._slots}
        self._drained: list[str] = []  # the drains the core has (set by the last refresh or apply_drains)
        self._drain_changes = cluster.drain_changes  # Cluster.drain_changes when they were set
        self._pending: dict[str, ReportTicket] = {}  # reports taken by refresh(later=True), not yet delivered
        # The quiet check's own bookkeeping: instances touched since they were last found quiet, and a time before
        # which every untouched instance's mark holds (Cluster.growth_holds_until_s): a round then costs O(touched).
        self._touched: set[str] = {inst.instance_id for inst in pool}
        self._quiet_until_s = -math.inf
        self._order = {inst.instance_id: k for k, inst in enumerate(pool)}
        for inst in pool:
            inst.watchers.append(self._touched)

    def _details_of(self, instance_id: str) -> InstanceLoad:
        return self.cluster.load(self.cluster.instances[instance_id])

    def refresh(self, *, later: bool = False) -> None:
        """Hand the core the load of every serving instance that changed since its last report (and the
        drains).

        ``later``: the reports of instances in a decode run are taken now and handed over when the core is next
        used (:meth:`deliver`, which every use of the core must follow): a periodic refresh between two uses
        builds only the reports that are not superseded before one (``Cluster.report_ticket``). Everything else
        reaches the core at once, in the same order: the output lengths each report carries, instances joining
        and leaving, the drains. The core decides the same: a report only replaces an instance's load (read
        at the core's next use) and counts as received (read at its next use too: a migration's settle window).
        """
        later = later and self.brief
        if not later:
            self.deliver()
        # methods called on their objects, never through bound aliases: compiled, a call on the object is native
        cluster, core, brief, pending = self.cluster, self.core, self.brief, self._pending
        drained = []
        for slot in self._slots:
            inst = slot.inst
            if not inst.active:
                slot.deferred = False
                if slot.reported != _UNREPORTED:  # stopped (an autoscaler's scale-in)
                    slot.reported = _UNREPORTED
                    pending.pop(inst.instance_id, None)
                    core.remove_instance(inst.instance_id)
                continue
            if slot.reported == _UNREPORTED:
                iid = inst.instance_id
                core.add_instance(iid, inst.spec.model, cluster.model_of(iid).block_size_tokens)
                slot.reported = -1
            version, started = cluster.load_position(inst)
            if version != slot.reported or slot.deferred:
                iid = inst.instance_id
                if later:
                    finished = cluster.take_finished(inst)
                    if finished:
                        core.finished(finished)
                    pending[iid] = cluster.report_ticket(inst, version, started, pending.get(iid))
                else:
                    load = cluster.load(inst, brief=brief, version=version, started=started)
                    core.report(iid, load, cluster.take_finished(inst))
                slot.reported = version
                slot.deferred = False
            if inst.draining:
                drained.append(inst.instance_id)
        self._hand_drains(drained)

    def apply_drains(self) -> None:
        """Hand the core the drains set since it was last given them (``Cluster.set_draining``), without the
        reports a refresh would hand it: a drain is the scheduler's own intent (an operator's or the autoscaler's
        order), held at once; loads still arrive with the report loop. O(1) when no drain changed, else
        O(instances of the feed)."""
        if self.cluster.drain_changes == self._drain_changes:
            return
        # the instances the last refresh handed over (an active one not reported yet joins, drained, at the next)
        self._hand_drains(
            [
                slot.inst.instance_id
                for slot in self._slots
                if slot.inst.active and slot.reported != _UNREPORTED and slot.inst.draining
            ]
        )

    def _hand_drains(self, drained: list[str]) -> None:
        """The core's drains are ``drained`` (ids in the feed's order) as of ``Cluster.drain_changes`` now: set when
        they differ from those it has (none at first; the core has this feed's drains alone)."""
        if drained != self._drained:
            self.core.set_drains(drained, False)
            self._drained = drained
        self._drain_changes = self.cluster.drain_changes

    def deliver(self) -> None:
        """Hand the core the reports a ``refresh(later=True)`` took (call before any other use of the core)."""
        pending = self._pending
        if pending:
            core, cluster = self.core, self.cluster
            for iid, ticket in pending.items():
                core.report(iid, cluster.ticket_load(ticket))
            pending.clear()

    def rebalance(self, now_s: float) -> list[MigrationDecision]:
        """One rescheduling round: :meth:`refresh`, then the core's ``plan_rebalance``; or, when that round
        would find no source (``plan_migrations`` then plans nothing and draws nothing), neither.

        No source: no migration of the domain in flight or settling, no drain, no instance joined or left, and
        every instance within the blocks its last report left it before ``policy.source_slack_blocks`` (less
        one block, against rounding) makes it a source, as its decode run grows it (``Cluster.growth_mark``).
        The skipped refresh changes nothing the core decides with: an instance that changed is reported at
        the next refresh (a dispatch's, a publication's, the next round's; the same state, or a newer one it
        would have been reported with anyway), and the output lengths its report would have carried are handed
        to the core now, in the order the refresh would have (the remaining-output estimate keeps its order).
        """
        if self.skip_quiet_rounds and self._quiet_round(now_s):
            return []
        self.refresh()
        return self.core.plan_rebalance(now_s)

    def _quiet_round(self, now_s: float) -> bool:
        """True when a rescheduling round now would find no source (see :meth:`rebalance`); then the output
        lengths of the instances that changed go to the core, and their reports are deferred.

        Only the instances touched since they were last found quiet are looked at (all of them once the earliest
        mark may have lapsed): an untouched instance is as it was then, its decode run's steps aside, and its
        mark holds until ``Cluster.growth_holds_until_s`` (no finished output length waits for it either: a
        finish touches). Untouched instances' reports are not deferred: their load version moved with their
        run's steps, so the next refresh reports them anyway, with the same load.
        """
        if self._drained or not self.core.settled():
            return False
        touched = self._touched
        if not touched and now_s < self._quiet_until_s:
            return True
        cluster, slots = self.cluster, self._slots
        policy = self.core.cfg.policy
        if now_s < self._quiet_until_s:
            order, slot_of = self._order, self._slot_of
            slots = [slot_of[iid] for iid in sorted(touched, key=order.__getitem__)]
        changed = []
        for slot in slots:
            inst = slot.inst
            if not inst.active:
                if slot.reported != _UNREPORTED:
                    return False  # it stops: the refresh removes it
                slot.holds_until_s = math.inf  # until it starts (a touch)
                continue
            if inst.draining or slot.reported == _UNREPORTED:
                return False
            position = cluster.load_position(inst)
            mark = slot.mark
            if mark is None or not cluster.within_growth(inst, mark, position):
                # the report the refresh would send now (built once: Cluster.load keeps it for that refresh)
                version, started = position
                load = cluster.load(inst, brief=self.brief, version=version, started=started)
                slack = source_slack_blocks(load, policy)
                if slack < 1:
                    return False
                mark = slot.mark = cluster.growth_mark(inst, math.floor(slack) - 1, position)
                slot.holds_until_s = cluster.growth_holds_until_s(inst, mark)
            elif inst.instance_id in touched:  # touched, and the mark still holds: until when, from now
                slot.holds_until_s = cluster.growth_holds_until_s(inst, mark)
            if position[0] != slot.reported:
                changed.append((slot, position[0]))
        for slot, version in changed:  # what the refresh would have reported now
            finished = cluster.take_finished(slot.inst)
            if finished:
                self.core.finished(finished)
            slot.reported = version
            slot.deferred = True
        touched.clear()
        self._quiet_until_s = min([slot.holds_until_s for slot in self._slots], default=math.inf)
        return True


class ClusterScheduler(ABC):
    """A cluster-level policy: dispatch on arrival, optional periodic rescheduling."""

    name: ClassVar[str] = ""
    migrate: ClassVar[bool] = False  # whether it ever moves a running request (its tables' migration columns)

    def __init__(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx
        self.cluster = ctx.cluster
        self.model = ctx.cluster.model_of(next(iter(ctx.cluster.instances)))  # the model every instance serves
        # request -> (its domain's feed, the instances it keeps busy, the cross-domain proposal or None: inside)
        self._pending: dict[str, tuple[_Feed, tuple[str, ...], CrossDomainProposal | None]] = {}
        ctx.executor.on_done.append(self._migration_done)

    def start(self) -> None:  # noqa: B027 - optional hook, most policies have no loop
        """Schedule the policy's periodic loops (none by default)."""

    @abstractmethod
    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        """Choose the instance for a newly arrived request (target_id None: refused, with reason)."""

    def summaries(self) -> list[DomainSummary]:
        """What the autoscaler reads: a summary of every domain's serving instances, as a domain scheduler
        would publish it now (``policy.summarize_domain`` over their load reports). The two-tier policy gives
        the summaries it has delivered instead (published every ``summary_interval_s``, ``summary_lag_s`` old)."""
        now = self._now()
        model = self.model.name
        policy = self.ctx.domain.policy
        cluster = self.cluster
        loads = {d: [cluster.load(i, brief=True) for i in cluster.serving(d)] for d in cluster.domain_ids()}
        return [summarize_domain(d, members, policy, model=model, taken_s=now) for d, members in loads.items()]

    def _every(self, interval_s: float, kind: EventKind, action: Callable[[], None]) -> None:
        """Run ``action`` every ``interval_s`` while requests remain."""

        def tick() -> None:
            if not self.ctx.live():
                return
            action()
            self.cluster.queue.schedule_in(interval_s, kind, tick)

        self.cluster.queue.schedule_in(interval_s, kind, tick)

    def _now(self) -> float:
        return self.cluster.queue.now_s

    def _rebalance(self, feed: _Feed) -> None:
        """One rescheduling round of ``feed``'s core; each move goes to the executor."""
        for move in feed.rebalance(self._now()):
            ids = (move.src_id, move.dst_id)
            self._pending[move.request_id] = (feed, ids, None)  # before starting: a move may end at once
            started = self.ctx.executor.start(move.request_id, move.src_id, move.dst_id, move.reason)
            if not started and self._pending.pop(move.request_id, None) is not None:
                feed.deliver()
                feed.core.migration_done(ids, self._now())

    def _migration_done(self, record: MigrationRecord) -> None:
        pending = self._pending.pop(record.request_id, None)
        if pending is None:
            return
        feed, ids, cross = pending
        feed.deliver()  # the reports taken before the move ended reach the core first
        core = feed.core
        if cross is None:
            core.migration_done(ids, self._now())
            return
        core.cross_domain_done(cross, self._now())
        self._measured_across(record)
        self._cross_ended(core.domain_id, record.outcome == "committed")

    def _cross_ended(self, domain_id: str, committed: bool) -> None:  # noqa: B027 - only the two-tier policy
        """A cross-domain move of ``domain_id`` that was carried out ended (``committed`` or not)."""

    def _measured_across(self, record: MigrationRecord) -> None:  # noqa: B027 - only the two-tier policy prices
        """An approved cross-domain move ended (committed or aborted), with what it measured."""


class RoundRobin(ClusterScheduler):
    """Dispatch in turn to each instance whose capacity can hold the request; never migrate."""

    name = "round-robin"

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        serving = self.cluster.serving()
        candidates = [i for i in serving if not i.draining]
        if serving and not candidates:  # as the load-aware policies' views say it
            return DispatchDecision(None, all_draining(len(serving), "instance"))
        n = len(candidates)
        for k in range(n):
            inst = candidates[(self._next + k) % n]
            bs = self.cluster.model_of(inst.instance_id).block_size_tokens
            if inst.spec.kv_capacity_blocks >= domain_request(req, inst.spec.model).need_blocks(bs):
                self._next = (self._next + k + 1) % n
                return DispatchDecision(inst.instance_id, "round-robin")
        return DispatchDecision(None, f"no instance can hold {req.prompt_tokens} + {req.output_tokens} tokens")


class _Flat(ClusterScheduler):
    """One domain core over every instance, its reports refreshed every ``report_interval_s``."""

    later_reports = True  # False: the periodic refresh builds every report at once (the reference of the tests)

    def domain_cfg(self, cfg: DomainConfig) -> DomainConfig:
        """The domain settings of its core (the rule book's, as given)."""
        return cfg

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        self.feed = _Feed("cluster", ctx.cluster, ctx.cluster.instances, self.domain_cfg(ctx.domain), ctx.rng)
        self.feed.refresh()

    def start(self) -> None:
        later = self.later_reports
        self._every(self.ctx.timing.report_interval_s, EventKind.TICK, lambda: self.feed.refresh(later=later))
        if self.migrate:
            self._every(self.ctx.timing.migrate_interval_s, EventKind.TICK, self._rebalance_all)

    def _rebalance_all(self) -> None:
        self._rebalance(self.feed)

    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        self.feed.deliver()
        self.feed.apply_drains()
        return self.feed.core.dispatch(domain_request(req, self.model.name))


class LeastLoaded(_Flat):
    """Load-aware dispatch on KV usage (no priority headroom), no migration (INFaaS-style baseline)."""

    name = "least-loaded"

    def domain_cfg(self, cfg: DomainConfig) -> DomainConfig:
        """No priority headroom, no migration."""
        return replace(cfg, policy=replace(cfg.policy, priority_headroom_blocks={}, max_migrations_per_round=0))


class LlumnixFlat(_Flat):
    """Llumnix's single tier: virtual-usage dispatch and migration over all instances, topology-blind."""

    name = "llumnix"
    migrate = True


class HilumTwoTier(ClusterScheduler):
    """hilum: the gateway core over lagged summaries, a domain core per domain, the coordinator's core."""

    name = "hilum"
    migrate = True

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        by_domain: dict[str, list[str]] = {}
        for iid, inst in ctx.cluster.instances.items():
            by_domain.setdefault(inst.domain_id, []).append(iid)
        self.feeds = {d: _Feed(d, ctx.cluster, by_domain[d], ctx.domain, ctx.rng) for d in ctx.cluster.domain_ids()}
        self.gateway = GatewayCore(ctx.domain.policy, ctx.rng, reservation_ttl_s=ctx.timing.reservation_ttl_s)
        self.bandwidth = BandwidthEstimates(ctx.measured_bandwidth)  # what the coordinator learns from the records
        self.delivered: dict[str, tuple[DomainSummary, ...]] = {}  # what etcd holds, as the gateway sees it
        self._published: dict[str, tuple[DomainSummary, ...]] = {}  # each domain's last publication written
        for domain_id, feed in self.feeds.items():
            feed.refresh()
            self._published[domain_id] = feed.core.summaries(self._now())
            self._deliver(domain_id, self._published[domain_id])

    def start(self) -> None:
        t = self.ctx.timing
        self._every(t.summary_interval_s, EventKind.SUMMARY, self._publish)
        self._every(t.migrate_interval_s, EventKind.TICK, self._rebalance_domains)
        if len(self.feeds) > 1:
            self._every(t.cross_interval_s, EventKind.TICK, self._cross_domain_round)

    # ---- summaries -------------------------------------------------------------------------------
    def _deliver(self, domain_id: str, summaries: tuple[DomainSummary, ...]) -> None:
        self.delivered[domain_id] = summaries
        self.gateway.update(domain_id, summaries)

    def summaries(self) -> list[DomainSummary]:
        return [s for per_domain in self.delivered.values() for s in per_domain]

    def _publish(self) -> None:
        """Every domain publishes its summaries, delivered ``summary_lag_s`` later in one event, domain by domain
        in the order they were published. A domain whose summaries are its last ones but for when they were taken
        (``policy.summarize.same_content``) publishes nothing, as the live ``SummaryPublisher`` writes nothing
        then: its readers keep the earlier ones, stamps included (delivered by an earlier event, or by one due
        before this one's).

        One event for all domains delivers as one per domain did: those events shared their time, kind and
        scheduled time, and nothing else of that key can fall between them (every event of kind SUMMARY
        is a publication or a delivery, and a publication scheduled at this instant comes after them by its
        seq); a delivery schedules nothing.
        """
        now = self._now()
        published = []
        last = self._published
        for domain_id, feed in self.feeds.items():
            feed.refresh()
            summaries = feed.core.summaries(taken_s=now)
            before = last.get(domain_id)
            if before is not None and same_content(before, summaries):
                continue  # not written again (SummaryPublisher): readers keep the last one, stamp included
            last[domain_id] = summaries
            published.append((domain_id, summaries))

        def deliver() -> None:
            for domain_id, summaries in published:
                self._deliver(domain_id, summaries)

        self.cluster.queue.schedule_in(self.ctx.timing.summary_lag_s, EventKind.SUMMARY, deliver)

    # ---- dispatch --------------------------------------------------------------------------------
    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        request = domain_request(req, self.model.name)
        bs = self.model.block_size_tokens
        attempt = PlacementAttempt(
            self.gateway,
            request.model,
            request.demand_blocks(bs),
            request.need_blocks(bs),
            request.priority,
            prefix_hashes=reusable_prefix_hashes(request.prefix_hashes, request.prefix_block_tokens, req.prompt_tokens),
            prefix_block_tokens=request.prefix_block_tokens,
            block_size_tokens=bs,
        )
        while (domain_id := attempt.next(self._now())) is not None:
            feed = self.feeds[domain_id]
            feed.refresh()
            decision = feed.core.dispatch(domain_request(req, request.model, attempt.only_if_room))
            if decision.target_id is not None:
                return decision
            if decision.full:
                attempt.answered_full(domain_id, decision.reason)
            else:
                attempt.answered_refused(domain_id, decision.reason)
        return DispatchDecision(None, attempt.explain())

    # ---- rescheduling ----------------------------------------------------------------------------
    def _rebalance_domains(self) -> None:
        for feed in self.feeds.values():
            self._rebalance(feed)

    def _cross_domain_round(self) -> None:
        for domain_id in self.feeds:
            self._propose(domain_id)

    def _cross_ended(self, domain_id: str, committed: bool) -> None:
        if committed:  # propose again at once, as the live loop does after a commit
            self._propose(domain_id)

    def _measured_across(self, record: MigrationRecord) -> None:
        """As a domain scheduler writes the llumlet's measurement into the migration record it finishes."""
        if record.precopy_bandwidth_bytes_per_s > 0:
            path = self.ctx.graph.path(record.src_instance_id, record.dst_instance_id)
            transport = default_transport(path.same_domain)
            self.bandwidth.observe(
                BandwidthSample(transport, path.links, record.precopy_bandwidth_bytes_per_s, record.end_s)
            )

    def _others(self, domain_id: str) -> Iterator[DomainSummary]:
        """The delivered summaries of the other domains, read only if the domain's core needs them (a generator
        function, not a generator expression: compiled, mypyc builds an expression's whole list at once, which
        made every domain's proposal O(domains) whether or not its core read them)."""
        for d, summaries in self.delivered.items():
            if d != domain_id:
                yield from summaries

    def _propose(self, domain_id: str) -> bool:
        """The domain's core proposes one move; the coordinator's core decides; the executor carries it out.
        True when a move was started (its end reaches :meth:`_cross_ended`)."""
        feed = self.feeds[domain_id]
        feed.refresh()
        now = self._now()
        move = feed.core.plan_cross_domain(self._others(domain_id), now)
        if move is None:
            return False
        feed.core.cross_domain_started(move)
        ids = (move.src_instance_id,)
        self._pending[move.request_id] = (feed, ids, move)  # before starting: a move may end at once
        if self._approve_and_start(domain_id, move):
            return True
        if self._pending.pop(move.request_id, None) is not None:
            feed.core.cross_domain_done(move, now)
        return False

    def _approve_and_start(self, domain_id: str, move: CrossDomainProposal) -> bool:
        proposal = move.proposal(domain_id, attempt=1)
        summaries = [s for per_domain in self.delivered.values() for s in per_domain]
        executor = self.ctx.executor
        instances = self.cluster.instances
        choice = decide(
            proposal,
            domain_id,
            summaries,
            self.ctx.graph.path,
            self.ctx.judge,
            executor.flows.counts(),
            # the drain intents, current (the live coordinator reads them from etcd), not as the summaries say
            drained=lambda instance_id, _domain_id: instances[instance_id].draining,
            measured=self.bandwidth.at(self._now()),
        )
        if choice.dst_instance_id is None:
            self.feeds[domain_id].core.not_approved(move.request_id, self._now())
            return False
        why = f"{move.reason}; coordinator {choice.judgement.reason}"
        return executor.start(move.request_id, move.src_instance_id, choice.dst_instance_id, why)


_POLICIES: dict[str, type[ClusterScheduler]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, LlumnixFlat, HilumTwoTier)
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_scheduler(name: str, ctx: SchedulerContext) -> ClusterScheduler:
    """Build the policy called ``name``; ValueError naming the known policies otherwise."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}") from None
    return cls(ctx)


def policy_migrates(name: str) -> bool:
    """Whether the policy called ``name`` ever moves a running request. Raises KeyError for an unknown name."""
    return _POLICIES[name].migrate
