"""The autoscaler's live shell: the coordinator leader runs ``policy.autoscale.Autoscaler`` and carries it out.

Only the leader runs it. On election it reads the autoscaler's records (``P autoscale/<model>``, one per model)
from its view and resumes each model's state from them; then every ``autoscale.interval_s`` it feeds each model's
:class:`~policy.autoscale.Autoscaler` what production knows — the domains' summaries, the registrations, the drain
intents, the cross-domain migrations in flight, all from its view of etcd — and carries out the decisions:

- ``drain`` / ``undrain`` / ``release``: a drain intent is written or removed, fenced like the leader's other
  writes (``Coordinator.drain``, ``Coordinator.undrain``); the domain schedulers then empty the instance by
  migration (or take it back);
- ``scale-out`` / ``scale-in``: the actuator's hook runs in the background (``global_coord.actuator``), retried
  with backoff; its outcome goes back to the rule (``Autoscaler.done``) and into the decision's event.

After every round and every hook's end the record of the model — its state, the round's evaluation and the last
:data:`MAX_EVENTS` decisions with their outcomes — is written, fenced. ``hilumctl autoscale`` shows it (any
replica answers from its view). A write that fails its fence ends the loop's leadership at once (the
coordinator campaigns again); hooks still running are cancelled (their process groups killed): the next leader
decides again from the record (a start not reported stays coming capacity until ``start_timeout_s``; a stop
whose outcome was lost is decided again).

Which pool instances may be started: those of the topology with no live registration, no drain intent of
their own (an operator's), in a domain that is not drained and whose domain scheduler is registered (an
instance there would never be used).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from clusterstate.aio import until_stopped
from clusterstate.clock import SYSTEM_CLOCK, Clock
from clusterstate.records import ACTIVE_STATES, AutoscaleRecord, DrainKind, ScaleEvent
from global_coord.actuator import CommandActuator, HookResult
from global_coord.coordinator import Coordinator, NotLeader
from policy.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Evaluation,
    PoolInstance,
    ScaleAction,
    ScaleDecision,
)

__all__ = ["MAX_EVENTS", "AutoscaleLoop"]

_log = logging.getLogger(__name__)

#: Decisions kept per model in its record (the oldest go first).
MAX_EVENTS = 32

_HOOKED = (ScaleAction.SCALE_OUT, ScaleAction.SCALE_IN)


class AutoscaleLoop:
    """The autoscaler on one coordinator replica; it acts only while the replica leads.

    Args:
        coordinator: the replica (its view, its fenced writes, whether it leads).
        rule: when to scale (the configuration's ``autoscale`` section).
        actuator: runs the hook.
        pools: model -> its instances in the topology, in topology order (``policy.autoscale.pools_of``).
        clock: wall time for decisions and records (kept across leaders), and the sleeps between rounds.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        rule: AutoscaleConfig,
        actuator: CommandActuator,
        pools: Mapping[str, Sequence[PoolInstance]],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.coordinator = coordinator
        self.rule = rule
        self.actuator = actuator
        self.pools = {model: list(pool) for model, pool in pools.items() if pool}
        self.clock = clock
        self.scalers: dict[str, Autoscaler] = {}  # model -> its rule, while this replica leads
        self._events: dict[str, list[ScaleEvent]] = {}
        self._evaluations: dict[str, Evaluation] = {}
        self._hooks: set[asyncio.Task[None]] = set()
        self._writing: dict[str, asyncio.Lock] = {}  # model -> held while its record is written (see _persist)
        self.rounds = 0  # rounds run while leading (tests, logs)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: wait to lead, then run rounds while leading."""
        while not stop.is_set():
            if not await until_stopped(self.coordinator.elected.wait(), stop):
                return
            try:
                await self._lead(stop)
            except NotLeader as exc:
                _log.warning("autoscaler: stopped, %s", exc)
            finally:
                await self._cancel_hooks()
                self.scalers.clear()
            if not stop.is_set() and self.coordinator.elected.is_set():
                await self.clock.sleep(0.1)  # fenced out but not stepped down yet: let the campaign loop see it

    async def _lead(self, stop: asyncio.Event) -> None:
        view = self.coordinator.view
        await view.synced.wait()
        records = view.autoscale()
        for model, pool in self.pools.items():
            record = records.get(model)
            self.scalers[model] = Autoscaler(model, self.rule, pool, record.state if record else None)
            self._events[model] = list(record.events) if record else []
        _log.info(
            "autoscaler: leading for %s (every %g s; resumed %s)",
            ", ".join(sorted(self.scalers)),
            self.rule.interval_s,
            ", ".join(sorted(m for m in self.scalers if m in records)) or "nothing",
        )
        while not stop.is_set() and self.coordinator.is_leader():
            await self.round()
            if not await until_stopped(self.clock.sleep(self.rule.interval_s), stop):
                return

    async def round(self) -> None:
        """One decision round for every model (the leader only). Raises NotLeader when fenced out."""
        view = self.coordinator.view
        summaries = [s for record in view.summaries().values() for s in record.summaries]
        registered = set(view.instances())
        domains = set(view.domains())
        drains = view.drains()
        migrating = {
            iid
            for record, _ in view.migrations().values()
            if record.state in ACTIVE_STATES
            for iid in (record.src_instance_id, record.dst_instance_id)
        }
        now = self.clock.wall_s()
        for model, scaler in sorted(self.scalers.items()):
            unavailable = {
                p.instance_id
                for p in self.pools[model]
                if ((DrainKind.INSTANCE, p.instance_id) in drains and scaler.phase(p.instance_id) is None)
                or (DrainKind.DOMAIN, p.domain_id) in drains
                or p.domain_id not in domains
            }
            result = scaler.step(summaries, now, registered=registered, unavailable=unavailable, migrating=migrating)
            self._evaluations[model] = result.evaluation
            for iid in result.abandoned:
                _log.warning(
                    "autoscaler %s: %s was started but has not reported within %g s: back in the pool "
                    "(tune autoscale.start_timeout_s)",
                    model,
                    iid,
                    self.rule.start_timeout_s,
                )
                given_up = ScaleEvent("scale-out", iid, now, "no report within start_timeout_s", "failed")
                self._remember(model, replace(given_up, output="given up: it never reported", finished_s=now))
            for decision in result.decisions:
                await self._carry_out(scaler, decision)
            await self._persist(model)
        self.rounds += 1

    async def _carry_out(self, scaler: Autoscaler, d: ScaleDecision) -> None:
        _log.info("autoscaler %s: %s %s: %s", d.model, d.action.value, d.instance_id, d.reason)
        event = ScaleEvent(d.action.value, d.instance_id, d.at_s, d.reason)
        if d.action in _HOOKED:
            self._remember(d.model, event)
            task = asyncio.create_task(self._hook(scaler, d, event), name=f"autoscale-{d.action}-{d.instance_id}")
            self._hooks.add(task)
            task.add_done_callback(self._hooks.discard)
            return
        try:
            if d.action is ScaleAction.DRAIN:
                await self.coordinator.drain(DrainKind.INSTANCE, d.instance_id, f"autoscaler scale-in: {d.reason}")
            else:  # UNDRAIN, RELEASE
                await self.coordinator.undrain(DrainKind.INSTANCE, d.instance_id)
        except NotLeader:
            raise
        except Exception as exc:  # an etcd error: the rule takes the decision back, the next round retries
            _log.warning("autoscaler %s: %s %s failed: %s", d.model, d.action.value, d.instance_id, exc)
            scaler.done(d, False, self.clock.wall_s())
            self._remember(d.model, replace(event, status="failed", output=str(exc), finished_s=self.clock.wall_s()))
            return
        scaler.done(d, True, self.clock.wall_s())
        self._remember(d.model, replace(event, status="done", finished_s=self.clock.wall_s()))

    async def _hook(self, scaler: Autoscaler, d: ScaleDecision, event: ScaleEvent) -> None:
        def attempted(n: int, result: HookResult) -> None:
            self._update(d.model, event, replace(event, attempts=n, exit_code=result.exit_code, output=result.output))

        result = await self.actuator.run(d.action.value, d.model, d.instance_id, on_attempt=attempted)
        if self.scalers.get(d.model) is not scaler:
            return  # leadership changed meanwhile: the next leader decides again from the record
        now = self.clock.wall_s()
        scaler.done(d, result.ok, now)
        final = replace(
            event,
            status="done" if result.ok else "failed",
            attempts=result.attempts,
            exit_code=result.exit_code,
            output=result.output,
            finished_s=now,
        )
        self._update(d.model, event, final)
        with contextlib.suppress(NotLeader):
            await self._persist(d.model)

    def _remember(self, model: str, event: ScaleEvent) -> None:
        events = self._events.setdefault(model, [])
        events.append(event)
        del events[:-MAX_EVENTS]

    def _update(self, model: str, old: ScaleEvent, new: ScaleEvent) -> None:
        """Replace the event of one decision (found by action, instance and time) with its newer version."""
        events = self._events.setdefault(model, [])
        for i in range(len(events) - 1, -1, -1):
            e = events[i]
            if (e.action, e.instance_id, e.at_s) == (old.action, old.instance_id, old.at_s):
                events[i] = new
                return
        self._remember(model, new)

    async def _persist(self, model: str) -> None:
        """Write ``model``'s record as it stands now. The round and each finished hook write it; one write at a
        time per model, each made from the state when its turn comes, so an older record never lands last (two
        puts in flight at once may reach etcd in either order)."""
        async with self._writing.setdefault(model, asyncio.Lock()):
            scaler = self.scalers.get(model)
            if scaler is None:
                return
            record = AutoscaleRecord(model, scaler.state(), self._evaluations.get(model), tuple(self._events[model]))
            await self.coordinator.put_autoscale(record)

    async def _cancel_hooks(self) -> None:
        hooks = list(self._hooks)
        for task in hooks:
            task.cancel()
        for task in hooks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
