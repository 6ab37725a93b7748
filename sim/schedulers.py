"""The cluster-level scheduling policies the simulator compares, built from hilum's own rule book.

- ``round-robin``: dispatch in turn to every instance that can hold the request; no migration.
- ``least-loaded``: dispatch to the instance with the most free KV (virtual usage without priority
  headroom, the paper's INFaaS-style baseline), from load reports refreshed every
  ``report_interval_s``; no migration.
- ``llumnix``: the original single tier. One central scheduler dispatches with virtual usage over
  every instance and, every ``migrate_interval_s``, pairs instances over the whole cluster and
  migrates, blind to topology: a pair across domains migrates over the network with no approval.
- ``hilum``: two tiers. The gateway picks a domain from the domain summaries (published every
  ``summary_interval_s``, received ``summary_lag_s`` later); that domain's scheduler dispatches and
  rebalances inside the domain with exact, fresh state; every ``cross_interval_s`` the coordinator pairs
  domains from the summaries, the source domain proposes its most loaded instance's candidates, and a
  move crosses domains only when :func:`global_coord.approval.judge_move` approves it with the cost model.

Every decision comes from :mod:`policy` (virtual usage, freeness, dispatch, pairing) — the same code
the production tiers run.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from global_coord.approval import ApprovalConfig, Verdict, price_and_judge
from policy.dispatch import DispatchDecision, DispatchView, DomainDispatchView
from policy.domain import DomainSummary, summarize_domain
from policy.migration import pair_domains, plan_migrations
from policy.types import InstanceLoad, PolicyConfig
from topology.cost import CostConfig
from topology.graph import TopologyGraph

from .cluster import Cluster, SimInstance
from .events import EventKind
from .migration import MigrationExecutor
from .traces import TraceRequest

__all__ = ["POLICY_NAMES", "ClusterScheduler", "SchedulingConfig", "make_scheduler"]


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Timing of the control loops, seconds of simulated time."""

    report_interval_s: float = 0.05  # load reports reaching a central scheduler (Llumnix: 50 ms)
    migrate_interval_s: float = 0.05  # rescheduling loop period (Llumnix: 50 ms)
    summary_interval_s: float = 0.1  # domain summary publication period (hilum)
    summary_lag_s: float = 0.05  # delay before a summary reaches the coordinator and gateways
    cross_interval_s: float = 0.5  # coordinator's cross-domain round
    warmup_s: float = 10.0  # warm-up window of an instance added by scale-out

    def __post_init__(self) -> None:
        for name in ("report_interval_s", "migrate_interval_s", "summary_interval_s", "cross_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.summary_lag_s < 0 or self.warmup_s < 0:
            raise ValueError("summary_lag_s and warmup_s must be >= 0")


@dataclass(slots=True)
class SchedulerContext:
    """What every policy works with: the cluster, the migration executor and the configuration."""

    cluster: Cluster
    executor: MigrationExecutor
    graph: TopologyGraph
    policy: PolicyConfig
    cost: CostConfig
    approval: ApprovalConfig
    timing: SchedulingConfig
    rng: random.Random
    live: Callable[[], bool]  # True while requests remain; periodic loops stop when it turns False


def demand_blocks(req: TraceRequest, block_size_tokens: int) -> int:
    """KV blocks a request needs to start: its prompt plus the first output token."""
    return math.ceil((req.prompt_tokens + 1) / block_size_tokens)


class ClusterScheduler(ABC):
    """A cluster-level policy: dispatch on arrival, optional periodic rescheduling."""

    name: str = ""

    def __init__(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx
        self.cluster = ctx.cluster

    def start(self) -> None:  # noqa: B027 - optional hook, most policies have no loop
        """Schedule the policy's periodic loops (none by default)."""

    @abstractmethod
    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        """Choose the instance for a newly arrived request (target_id None: refused, with reason)."""

    def _every(self, interval_s: float, kind: EventKind, action: Callable[[], None]) -> None:
        """Run ``action`` every ``interval_s`` while requests remain."""

        def tick() -> None:
            if not self.ctx.live():
                return
            action()
            self.cluster.queue.schedule_in(interval_s, kind, tick)

        self.cluster.queue.schedule_in(interval_s, kind, tick)

    def _loads(self, instances: Iterable[SimInstance]) -> list[InstanceLoad]:
        return [self.cluster.load(i) for i in instances]

    def _migrate(self, loads: list[InstanceLoad]) -> None:
        """Plan moves over ``loads`` with the rule book and start those whose instances are free."""
        free = [load for load in loads if not self.ctx.executor.is_busy(load.instance_id)]
        for move in plan_migrations(free, self.ctx.policy, self.ctx.rng):
            self.ctx.executor.start(move.request_id, move.src_id, move.dst_id, move.reason)


class RoundRobin(ClusterScheduler):
    """Dispatch in turn to each instance whose capacity can hold the request; never migrate."""

    name = "round-robin"

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        candidates = [i for i in self.cluster.serving() if not i.draining]
        n = len(candidates)
        for k in range(n):
            inst = candidates[(self._next + k) % n]
            need = demand_blocks(req, self.cluster.model_of(inst.instance_id).block_size_tokens)
            if inst.spec.kv_capacity_blocks >= need:
                self._next = (self._next + k + 1) % n
                return DispatchDecision(inst.instance_id, "round-robin")
        return DispatchDecision(None, f"no instance can hold {req.prompt_tokens} prompt tokens")


class _CentralView(ClusterScheduler):
    """A central scheduler whose view of every instance is refreshed every ``report_interval_s``."""

    policy_override: Callable[[PolicyConfig], PolicyConfig] = staticmethod(lambda cfg: cfg)

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        self.cfg = self.policy_override(ctx.policy)
        self.view = DispatchView(self._loads(self.cluster.serving()), self.cfg, ctx.rng)

    def start(self) -> None:
        self._every(self.ctx.timing.report_interval_s, EventKind.TICK, self._refresh)

    def _refresh(self) -> None:
        for load in self._loads(self.cluster.serving()):
            self.view.update(load)

    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        block_size = self.cluster.model_of(self.cluster.serving()[0].instance_id).block_size_tokens
        return self.view.pick(demand_blocks(req, block_size), req.priority)


class LeastLoaded(_CentralView):
    """Load-aware dispatch on KV usage (no priority headroom), no migration (INFaaS-style baseline)."""

    name = "least-loaded"
    policy_override = staticmethod(lambda cfg: replace(cfg, priority_headroom_blocks={}))


class LlumnixFlat(_CentralView):
    """Llumnix's single tier: virtual-usage dispatch and migration over all instances, topology-blind."""

    name = "llumnix"

    def start(self) -> None:
        super().start()
        self._every(self.ctx.timing.migrate_interval_s, EventKind.TICK, self._rebalance)

    def _rebalance(self) -> None:
        self._migrate(self._loads(self.cluster.serving()))


class HilumTwoTier(ClusterScheduler):
    """hilum: gateway over lagged domain summaries, per-domain schedulers, approved cross-domain moves."""

    name = "hilum"

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        self.domain_ids = self.cluster.domain_ids()
        self.summaries: dict[str, DomainSummary] = {d: self._summary(d) for d in self.domain_ids}
        self.gateway = DomainDispatchView(list(self.summaries.values()), ctx.policy, ctx.rng)

    def start(self) -> None:
        t = self.ctx.timing
        self._every(t.summary_interval_s, EventKind.SUMMARY, self._publish)
        self._every(t.migrate_interval_s, EventKind.TICK, self._rebalance_domains)
        if len(self.domain_ids) > 1:
            self._every(t.cross_interval_s, EventKind.TICK, self._cross_domain_round)

    # ------------------------------------------------------------------ summaries
    def _summary(self, domain_id: str) -> DomainSummary:
        return summarize_domain(domain_id, self._loads(self.cluster.serving(domain_id)), self.ctx.policy)

    def _publish(self) -> None:
        published = {d: self._summary(d) for d in self.domain_ids}

        def deliver() -> None:
            self.summaries.update(published)
            for summary in published.values():
                self.gateway.update(summary)

        self.cluster.queue.schedule_in(self.ctx.timing.summary_lag_s, EventKind.SUMMARY, deliver)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, req: TraceRequest) -> DispatchDecision:
        block_size = self.cluster.model_of(self.cluster.serving()[0].instance_id).block_size_tokens
        need = demand_blocks(req, block_size)
        tried: set[str] = set()
        reasons: list[str] = []
        while len(tried) < len(self.domain_ids):
            domain = self.gateway.pick(need, req.priority)
            if domain.target_id is None or domain.target_id in tried:
                reasons.append(domain.reason)
                break
            tried.add(domain.target_id)
            view = DispatchView(self._loads(self.cluster.serving(domain.target_id)), self.ctx.policy, self.ctx.rng)
            decision = view.pick(need, req.priority)
            if decision.target_id is not None:
                return decision
            reasons.append(f"{domain.target_id}: {decision.reason}")
        return DispatchDecision(None, "; ".join(reasons) or "no domain")

    # ------------------------------------------------------------------ rescheduling
    def _rebalance_domains(self) -> None:
        for domain_id in self.domain_ids:
            self._migrate(self._loads(self.cluster.serving(domain_id)))

    def _cross_domain_round(self) -> None:
        for src_domain, dst_domain in pair_domains(list(self.summaries.values()), self.ctx.policy):
            self._propose(src_domain, dst_domain)

    def _propose(self, src_domain: str, dst_domain: str) -> None:
        """The source domain proposes its most loaded instance's best move; the coordinator judges it."""
        executor = self.ctx.executor
        src_loads = [x for x in self._loads(self.cluster.serving(src_domain)) if not executor.is_busy(x.instance_id)]
        dst_loads = [
            x
            for x in self._loads(self.cluster.serving(dst_domain))
            if not executor.is_busy(x.instance_id) and not x.draining
        ]
        if not src_loads or not dst_loads:
            return
        for move in plan_migrations(src_loads + dst_loads, self.ctx.policy, self.ctx.rng):
            src_in = any(x.instance_id == move.src_id for x in src_loads)
            dst_in = any(x.instance_id == move.dst_id for x in dst_loads)
            if not (src_in and dst_in):
                continue
            verdict = self._judge(move.request_id, move.src_id, move.dst_id)
            if verdict is not None and verdict.approved:
                executor.start(
                    move.request_id, move.src_id, move.dst_id, f"{move.reason}; coordinator {verdict.reason}"
                )
                return

    def _judge(self, request_id: str, src_id: str, dst_id: str) -> Verdict | None:
        """The coordinator's verdict on a proposed cross-domain move (None: the request left the source)."""
        src = self.cluster.instances[src_id]
        kv = src.engine.request_kv(request_id)
        if kv is None:
            return None
        tokens, _blocks = kv
        path = self.ctx.graph.path(src_id, dst_id)
        state = self.cluster.requests[request_id]
        verdict, _plan = price_and_judge(
            self.cluster.model_of(src_id),
            kv_tokens=tokens,
            remaining_tokens=max(0, state.trace.output_tokens - state.generated_tokens),
            decode_step_s=max(src.last_step_s, 1e-4),
            path_bandwidth_bytes_per_s=path.bandwidth_bytes_per_s,
            busiest_link_flows=self.ctx.executor.flows.busiest(path.links),
            cost=self.ctx.cost,
            cfg=self.ctx.approval,
        )
        return verdict


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
