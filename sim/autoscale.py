"""The autoscaler on the virtual clock (``hilum sim --autoscale``): the SAME rule the coordinator leader runs.

Every ``autoscale.interval_s`` (the configuration file's ``autoscale`` section, ``policy.autoscale.AutoscaleConfig``)
:class:`SimAutoscaler` feeds ``policy.autoscale.Autoscaler`` what the coordinator would see — the policy's domain
summaries (for ``hilum`` the ones it delivered to the gateway, ``summary_lag_s`` old; for the single-tier policies
a summary per domain of its serving instances' load reports), the registered (serving) instances, the scripted
drains, the instances a migration in flight touches — and carries out its decisions the way the live shell's
drain intents and hook would:

- ``scale-out``: the pool instance holds its GPUs from now (GPU-hours count the cold start) and serves after
  ``cold_start_s``, then warms up like a scripted ``--scale-out`` (``SchedulingConfig.warmup_s`` of negative fake
  usage);
- ``drain`` / ``undrain``: the instance's draining flag (infinite virtual usage: the policy's cores dispatch nothing
  to it and migrate everything away; ``DomainCore.set_drains``);
- ``scale-in``: the instance stops (``Cluster.deactivate``: its GPUs are free from now); an instance the rule found
  safe to stop that is not idle and empty after all (a summary older than the truth) fails like a hook and is
  decided again after the cool-down;
- ``release``: its draining flag is cleared: back in the pool.

Every decision is kept as a :class:`sim.results.ScaleRecord` (``results.json``: ``scale_events``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from policy.autoscale import AutoscaleConfig, Autoscaler, PoolInstance, ScaleAction, ScaleDecision

from .cluster import Cluster
from .events import EventKind
from .migration import MigrationExecutor
from .results import ScaleRecord
from .schedulers import ClusterScheduler

__all__ = ["SimAutoscaler", "initial_fleet"]


def initial_fleet(pool: Sequence[PoolInstance], count: int) -> list[str]:
    """The ``count`` instances of ``pool`` that serve from the start: taken in turn from each domain (in the
    order the domains first appear in ``pool``, each domain's instances in pool order), so that a fleet of 8 on
    two 8-instance domains is 4 + 4.

    Raises ValueError when ``count`` is not within 1 .. len(pool).
    """
    if not 1 <= count <= len(pool):
        raise ValueError(f"initial_instances must be within 1..{len(pool)} (the model's instances), got {count}")
    by_domain: dict[str, list[str]] = {}
    for p in pool:
        by_domain.setdefault(p.domain_id, []).append(p.instance_id)
    order: list[str] = []
    columns = max(len(ids) for ids in by_domain.values())
    for k in range(columns):
        order += [ids[k] for ids in by_domain.values() if k < len(ids)]
    return order[:count]


class SimAutoscaler:
    """The autoscaler's shell in a simulation (module docstring).

    Args:
        model: the simulated model.
        rule: when to scale (``policy.autoscale.AutoscaleConfig``).
        pool: every instance of the model in the topology, in topology order.
        cluster, scheduler, executor: the simulation it acts on.
        cold_start_s: seconds from a scale-out decision until the instance serves (must be below
            ``rule.start_timeout_s``, or every start would be given up).
        warmup_s: warm-up window once it serves, s.
        drained: instances drained by a script (``--drain``): never started by the autoscaler.
        live: True while requests remain; the rounds stop when it turns False.

    Raises ValueError on a negative or non-finite ``cold_start_s``, or one not below ``rule.start_timeout_s``.
    """

    def __init__(
        self,
        model: str,
        rule: AutoscaleConfig,
        pool: Sequence[PoolInstance],
        cluster: Cluster,
        scheduler: ClusterScheduler,
        executor: MigrationExecutor,
        *,
        cold_start_s: float,
        warmup_s: float,
        drained: Sequence[str] = (),
        live: Callable[[], bool] = lambda: True,
    ) -> None:
        if not 0 <= cold_start_s < rule.start_timeout_s:
            raise ValueError(
                f"cold_start_s ({cold_start_s:g}) must be >= 0 and below autoscale.start_timeout_s "
                f"({rule.start_timeout_s:g}), or every start would be given up"
            )
        self.scaler = Autoscaler(model, rule, pool)
        self.rule = rule
        self.cluster = cluster
        self.scheduler = scheduler
        self.executor = executor
        self.cold_start_s = cold_start_s
        self.warmup_s = warmup_s
        self._drained = set(drained)
        self._pool = {p.instance_id for p in pool}
        self._live = live
        self.records: list[ScaleRecord] = []
        self.rounds = 0

    def start(self) -> None:
        """Schedule the rounds: the first at time 0, then every ``interval_s`` while requests remain."""

        def tick() -> None:
            if not self._live():
                return
            self.round()
            self.cluster.queue.schedule_in(self.rule.interval_s, EventKind.TICK, tick)

        self.cluster.queue.schedule(0.0, EventKind.TICK, tick)

    def round(self) -> None:
        """One decision round, carried out at once."""
        now = self.cluster.queue.now_s
        registered = {i for i, inst in self.cluster.instances.items() if inst.active and i in self._pool}
        unavailable = {i for i in self._drained if self.scaler.phase(i) is None}
        migrating = {inst.instance_id for move in self.executor.active.values() for inst in (move.src, move.dst)}
        result = self.scaler.step(
            self.scheduler.summaries(), now, registered=registered, unavailable=unavailable, migrating=migrating
        )
        for decision in result.decisions:
            self._carry_out(decision)
        self.rounds += 1

    def _carry_out(self, d: ScaleDecision) -> None:
        iid = d.instance_id
        ok, note = True, ""
        if d.action is ScaleAction.SCALE_OUT:
            self.cluster.hold_gpus(iid)
            self.cluster.queue.schedule_in(self.cold_start_s, EventKind.SCRIPTED, lambda: self._ready(iid))
        elif d.action is ScaleAction.DRAIN:
            self.cluster.set_draining(iid, True)
        elif d.action in (ScaleAction.UNDRAIN, ScaleAction.RELEASE):
            self.cluster.set_draining(iid, False)
        else:  # SCALE_IN
            try:
                self.cluster.deactivate(iid)
            except ValueError as exc:
                ok, note = False, str(exc)
        self.scaler.done(d, ok, self.cluster.queue.now_s)
        self.records.append(ScaleRecord(d.at_s, d.action.value, iid, d.reason, ok, note))

    def _ready(self, instance_id: str) -> None:
        self.cluster.activate(instance_id, self.warmup_s)
