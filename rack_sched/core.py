"""The domain scheduler: exact state of one NVLink domain's instances, dispatch, rescheduling, summaries,
cross-domain proposals and drains (DESIGN.md, "Components"; docs/control-plane.md, "Domain scheduler").

One :class:`DomainScheduler` per domain. It keeps a :class:`~clusterstate.store.ClusterView` of etcd and
from it

- discovers its instances: every ``P instances/<id>`` registration (under the llumlet's lease) that names
  its domain. For each it holds a WatchLoad stream to the llumlet: the llumlet pushes its load on every
  change, so the view is exact and fresh. A lost stream is re-opened with jittered backoff; meanwhile the
  instance gets no new requests and takes part in no migration;
- applies drain intents (``P drains/instance/<id>``, ``P drains/domain/<id>``): a draining instance carries
  infinite virtual usage, so dispatch never picks it and the rescheduling loop moves everything off it;
- finds the coordinator leader (``P leader``) for proposals, and remembers the newest fencing token seen.

Loops (all started by :meth:`DomainScheduler.run`):

- rescheduling, every ``rebalance_interval_s`` (50 ms, Llumnix's period): ``policy.plan_migrations`` over
  the instances not busy with a migration; each move is a MigrateOut command to the source llumlet
  (attempt number, no fencing token: no approval inside a domain);
- summary: on every load or drain change ``policy.summarize_domain`` is offered to a ``SummaryPublisher``
  (at most one put per ``summary_interval_s``, under the scheduler's lease), with each instance's load;
- cross-domain, every ``cross_interval_s``: when ``policy.pair_domains`` over the published summaries makes
  this domain a source, propose one move (``rack_sched.plan.plan_cross_domain``) to the coordinator leader;
  carry out an approval (its fencing token checked by a ``FencingGuard`` and passed to the llumlet), then
  record the outcome by compare-and-swap (``committed`` or ``aborted``).

Restart: the llumlets keep running. On start the scheduler lists etcd, opens a stream to every registered
instance and waits (up to ``ready_timeout_s``) for each first report before it dispatches; approved
cross-domain migrations it left behind are settled by asking the destination (Release answers whether that
attempt committed there).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import grpc

from clusterstate.backoff import Backoff
from clusterstate.etcd import RETRYABLE_ERRORS, Etcd3Client
from clusterstate.fencing import FencingGuard
from clusterstate.records import (
    DomainRegistration,
    DrainKind,
    InstanceRegistration,
    MigrationState,
    RecordError,
    SummaryRecord,
    decode,
    encode,
)
from clusterstate.session import Registrar
from clusterstate.store import ClusterView, Keys, Store, SummaryPublisher
from global_coord import convert as coord_convert
from global_coord.approver import MoveProposal
from hilum_proto.tls import open_channel
from hilum_proto.v1 import coordinator_pb2_grpc, llumlet_pb2, llumlet_pb2_grpc
from policy.dispatch import DispatchView
from policy.domain import DomainSummary, summarize_domain
from policy.migration import plan_migrations
from policy.types import InstanceLoad
from policy.usage import freeness
from rack_sched.convert import load_from_pb
from rack_sched.plan import CrossDomainMove, demand_blocks, domain_summary_of, drained_instances, plan_cross_domain
from rack_sched.types import (
    DispatchOutcome,
    DispatchResult,
    DomainStateInfo,
    InstanceStateInfo,
    RackConfig,
    SubmitSpec,
)

__all__ = ["DomainScheduler"]

_log = logging.getLogger(__name__)
_MAX_REMEMBERED = 65536  # dispatched requests remembered for proposals (older ones use the default estimate)


class _Instance:
    """A registered instance: its llumlet channel, last load and WatchLoad task (mutable, internal)."""

    def __init__(self, registration: InstanceRegistration) -> None:
        self.registration = registration
        self.instance_id = registration.instance_id
        self.channel = open_channel(registration.address)
        self.stub = llumlet_pb2_grpc.LlumletStub(self.channel)
        self.load: InstanceLoad | None = None  # as reported (draining False)
        self.version = 0  # LoadReport.version of the last report
        self.reports = 0  # reports received so far
        self.connected = False
        self.settled = asyncio.Event()  # first report arrived, or the first attempt failed
        self.task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.channel.close()


@dataclass(slots=True)
class _Counters:
    committed: int = 0
    aborted: int = 0
    proposed: int = 0
    approved: int = 0


class DomainScheduler:
    """The scheduler of one NVLink domain. ``await run(stop)`` until ``stop`` is set.

    Args:
        cfg: configuration.
        client: a connected etcd client.
        rng: the seeded random source (dispatch ties, migration ties, backoff jitter).
        topology_instance_ids: the domain's instances in the topology file; a registration of another
            instance is used but logged.
        clock: monotonic clock, seconds.
    """

    def __init__(
        self,
        cfg: RackConfig,
        client: Etcd3Client,
        *,
        rng: random.Random,
        topology_instance_ids: Collection[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self._client = client
        self._rng = rng
        self._clock = clock
        self._topology_ids = frozenset(topology_instance_ids)
        self.keys = Keys(cfg.prefix)
        self.store = Store(client, self.keys)
        self.view = ClusterView(client, self.keys, rng=rng, backoff=cfg.backoff)
        self.registrar = Registrar(client, cfg.ttl_s, rng=rng, backoff=cfg.backoff, name=f"rack {cfg.domain_id}")
        self.publisher = SummaryPublisher(
            self.registrar, self.keys, cfg.domain_id, min_interval_s=cfg.summary_interval_s, clock=clock
        )
        self.dispatch_view = DispatchView([], cfg.policy, rng)
        self.guard = FencingGuard()
        self.ready = asyncio.Event()  # set once the view is rebuilt from the llumlets
        self._instances: dict[str, _Instance] = {}
        self._drained: frozenset[str] = frozenset()
        self._domain_draining = False
        self._busy: dict[str, int] = {}  # instance -> migrations in flight touching it
        self._settle: dict[str, tuple[int, float]] = {}  # instance -> (reports at finish, deadline)
        self._attempts: dict[str, int] = {}  # request -> last migration attempt used
        self._attempt_base = 0  # etcd revision at start: attempts of a restarted scheduler exceed the old ones
        # Requests it dispatched, newest last, at most _MAX_REMEMBERED (remaining-token estimates of proposals).
        self._requests: OrderedDict[str, SubmitSpec] = OrderedDict()
        self._not_approved: dict[str, float] = {}  # request -> until when it is not proposed again
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        self._counters = _Counters()
        self._running = False

    # ---- running ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Register, rebuild the view from the llumlets, then run every loop until ``stop`` is set.

        On stop the registration and summary are revoked with the lease; the llumlets keep running.
        """
        view_task = asyncio.create_task(self.view.run(), name="rack-view")
        registrar_task = asyncio.create_task(self.registrar.run(stop), name="rack-registrar")
        loops: list[asyncio.Task[None]] = []
        try:
            await self.view.synced.wait()
            self._attempt_base = self.view.revision
            self._running = True
            reg = DomainRegistration(self.cfg.domain_id, self.cfg.advertise_address)
            await self.registrar.set(self.keys.domain(self.cfg.domain_id), encode(reg))
            await self._register_static_instances()
            self._apply_view()
            await self._wait_settled()
            await self._recover_cross_domain()
            self.ready.set()
            self._offer_summary()
            _log.info("domain %s ready with %d instances", self.cfg.domain_id, len(self._instances))
            loops = [
                asyncio.create_task(self.publisher.run(stop), name="rack-summary"),
                asyncio.create_task(self._follow_view(), name="rack-follow-view"),
                asyncio.create_task(self._every(self.cfg.rebalance_interval_s, self._rebalance), name="rack-rebalance"),
                asyncio.create_task(self._cross_loop(), name="rack-cross-domain"),
            ]
            await stop.wait()
        finally:
            self._running = False
            for task in [*loops, *self._tasks]:
                task.cancel()
            for task in [*loops, *self._tasks]:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for inst in list(self._instances.values()):
                await inst.close()
            self._instances.clear()
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, *RETRYABLE_ERRORS):
                await registrar_task
            view_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await view_task

    async def _register_static_instances(self) -> None:
        """Register ``cfg.static_instances`` under this scheduler's lease; wait until the view shows them."""
        if not self.cfg.static_instances:
            return
        for inst in self.cfg.static_instances:
            await self.registrar.set(self.keys.instance(inst.instance_id), encode(inst))
        wanted = {inst.instance_id: inst for inst in self.cfg.static_instances}

        def shown() -> bool:
            regs = self.view.instances()
            return all(regs.get(iid) == reg for iid, reg in wanted.items())

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.ready_timeout_s):
                await self.registrar.registered.wait()
                version = self.view.version
                while not shown():
                    version = await self.view.wait_changed(version)
        if not shown():
            _log.warning("domain %s: static instance registrations not visible yet", self.cfg.domain_id)

    async def _wait_settled(self) -> None:
        waits = [asyncio.ensure_future(i.settled.wait()) for i in self._instances.values()]
        if not waits:
            return
        _done, pending = await asyncio.wait(waits, timeout=self.cfg.ready_timeout_s)
        for w in pending:
            w.cancel()
        if pending:
            _log.warning(
                "domain %s: %d instances sent no load within %.1f s; dispatching without them (raise ready_timeout_s)",
                self.cfg.domain_id,
                len(pending),
                self.cfg.ready_timeout_s,
            )

    async def _every(self, interval_s: float, action: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                action()
            except Exception:  # a bug or a bad report must not stop the loop; the log says which
                _log.exception("domain %s: %s failed; retrying next period", self.cfg.domain_id, action.__name__)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- etcd: instances, drains, leader ---------------------------------------------------------
    async def _follow_view(self) -> None:
        version = -1  # apply at once: etcd may have changed while the view was being rebuilt
        while True:
            if version >= 0:
                version = await self.view.wait_changed(version)
            else:
                version = self.view.version
            try:
                self._apply_view()
            except Exception:
                _log.exception(
                    "domain %s: applying etcd changes failed; retrying on the next change", self.cfg.domain_id
                )

    def _apply_view(self) -> None:
        """Bring instances, drains and the newest fencing token in line with the view of etcd."""
        regs = {i: r for i, r in self.view.instances().items() if r.domain_id == self.cfg.domain_id}
        for iid in [i for i, inst in self._instances.items() if regs.get(i) != inst.registration]:
            self._drop_instance(iid)
        for iid, reg in regs.items():
            if iid not in self._instances:
                self._add_instance(reg)
        drained = drained_instances(self.cfg.domain_id, self._instances, self.view.drains())
        domain_draining = (DrainKind.DOMAIN, self.cfg.domain_id) in self.view.drains()
        if drained != self._drained or domain_draining != self._domain_draining:
            _log.info("domain %s: draining instances now %s", self.cfg.domain_id, sorted(drained))
            self._drained, self._domain_draining = drained, domain_draining
            for inst in self._instances.values():
                self._refresh_dispatch(inst)
            self._offer_summary()
        leader = self.view.entries("leader").get(self.keys.leader)
        if leader is not None and leader.create_revision > self.guard.newest:
            self.guard.accepts(leader.create_revision)

    def _add_instance(self, reg: InstanceRegistration) -> None:
        if self._topology_ids and reg.instance_id not in self._topology_ids:
            _log.warning(
                "domain %s: instance %s registered but is not in the topology file", self.cfg.domain_id, reg.instance_id
            )
        inst = _Instance(reg)
        self._instances[reg.instance_id] = inst
        inst.task = asyncio.create_task(self._watch(inst), name=f"watch-load-{reg.instance_id}")
        _log.info("domain %s: instance %s at %s", self.cfg.domain_id, reg.instance_id, reg.address)

    def _drop_instance(self, instance_id: str) -> None:
        inst = self._instances.pop(instance_id)
        self.dispatch_view.remove(instance_id)
        self._spawn(inst.close(), f"close-{instance_id}")
        self._offer_summary()
        _log.info("domain %s: instance %s deregistered", self.cfg.domain_id, instance_id)

    # ---- loads -----------------------------------------------------------------------------------
    async def _watch(self, inst: _Instance) -> None:
        """Keep a WatchLoad stream to one llumlet open; apply every report."""
        backoff = Backoff(self.cfg.backoff, self._rng)
        while True:
            call = inst.stub.WatchLoad(llumlet_pb2.WatchLoadRequest(min_interval_s=self.cfg.watch_min_interval_s))
            try:
                async for report in call:
                    inst.connected = True
                    backoff.reset()
                    self._on_report(inst, report)
                why = "stream ended"
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
            except ValueError as exc:
                why = f"bad load report: {exc}"
            finally:
                call.cancel()
            inst.connected = False
            inst.settled.set()
            self.dispatch_view.remove(inst.instance_id)
            delay = backoff.next_s()
            _log.warning(
                "domain %s: load stream of %s lost (%s); reconnecting in %.2f s",
                self.cfg.domain_id,
                inst.instance_id,
                why,
                delay,
            )
            await asyncio.sleep(delay)

    def _on_report(self, inst: _Instance, report: llumlet_pb2.LoadReport) -> None:
        inst.load = load_from_pb(report, inst.instance_id, self.cfg.domain_id)
        inst.version = int(report.version)
        inst.reports += 1
        inst.settled.set()
        self._refresh_dispatch(inst)
        self._offer_summary()

    def _draining(self, instance_id: str) -> bool:
        return instance_id in self._drained

    def _effective(self, inst: _Instance) -> InstanceLoad | None:
        """The instance's load with drains applied (None before its first report)."""
        if inst.load is None:
            return None
        draining = self._draining(inst.instance_id)
        return inst.load if inst.load.draining == draining else replace(inst.load, draining=draining)

    def _refresh_dispatch(self, inst: _Instance) -> None:
        load = self._effective(inst)
        if load is not None and inst.connected:
            self.dispatch_view.update(load)
        else:
            self.dispatch_view.remove(inst.instance_id)

    def loads(self) -> list[InstanceLoad]:
        """Every instance's last load, drains applied, sorted by instance id."""
        out = [self._effective(i) for _, i in sorted(self._instances.items())]
        return [load for load in out if load is not None]

    def summary(self) -> DomainSummary:
        """This domain's summary now (``policy.summarize_domain`` over :meth:`loads`)."""
        return summarize_domain(self.cfg.domain_id, self.loads(), self.cfg.policy)

    def _offer_summary(self) -> None:
        if not self.ready.is_set():
            return
        loads = self.loads()
        self.publisher.offer(SummaryRecord.of(summarize_domain(self.cfg.domain_id, loads, self.cfg.policy), loads))

    # ---- dispatch --------------------------------------------------------------------------------
    async def submit(self, spec: SubmitSpec, request: llumlet_pb2.SubmitRequest) -> DispatchResult:
        """Choose an instance for a new request with ``policy.DispatchView`` and submit it there.

        ``request`` is forwarded to the chosen llumlet unchanged. An unreachable instance is skipped
        (until its next load report) and the next choice tried.
        """
        demand = demand_blocks(spec.prompt_tokens, self.cfg.block_size_tokens)
        if not self.ready.is_set():
            return DispatchResult(
                DispatchOutcome.UNAVAILABLE,
                "the domain scheduler is rebuilding its view from the llumlets",
                demand_blocks=demand,
            )
        failures: list[str] = []
        for _ in range(max(1, len(self._instances))):
            decision = self.dispatch_view.pick(demand, spec.priority)
            if decision.target_id is None:
                if failures or not any(i.connected for i in self._instances.values()):
                    why = "; ".join([*failures, decision.reason]) if failures else "no instance is reachable"
                    return DispatchResult(DispatchOutcome.UNAVAILABLE, why, demand_blocks=demand)
                return DispatchResult(DispatchOutcome.REFUSED, decision.reason, demand_blocks=demand)
            inst = self._instances[decision.target_id]
            try:
                reply = await inst.stub.Submit(request, timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{inst.instance_id} unreachable ({exc.code().name})")
                self.dispatch_view.remove(inst.instance_id)
                continue
            if not reply.accepted:
                return DispatchResult(
                    DispatchOutcome.REFUSED,
                    f"instance {inst.instance_id} refused it: {reply.reason}",
                    demand_blocks=demand,
                )
            self._requests[spec.request_id] = spec
            while len(self._requests) > _MAX_REMEMBERED:
                self._requests.popitem(last=False)
            return DispatchResult(
                DispatchOutcome.ACCEPTED, decision.reason, inst.instance_id, inst.registration.address, demand
            )
        return DispatchResult(DispatchOutcome.UNAVAILABLE, "; ".join(failures), demand_blocks=demand)

    # ---- intra-domain rescheduling ---------------------------------------------------------------
    def _is_busy(self, instance_id: str) -> bool:
        if self._busy.get(instance_id, 0) > 0:
            return True
        settle = self._settle.get(instance_id)
        if settle is None:
            return False
        reports_at, deadline = settle
        inst = self._instances.get(instance_id)
        if (inst is not None and inst.reports > reports_at) or self._clock() >= deadline:
            del self._settle[instance_id]
            return False
        return True

    def _free_loads(self) -> list[InstanceLoad]:
        """Loads of connected instances with no migration in flight and a report newer than their last one."""
        out = []
        for iid, inst in sorted(self._instances.items()):
            load = self._effective(inst)
            if load is not None and inst.connected and not self._is_busy(iid):
                out.append(load)
        return out

    def _rebalance(self) -> None:
        """One rescheduling round: plan over the free instances, command each move (no approval)."""
        for move in plan_migrations(self._free_loads(), self.cfg.policy, self._rng):
            _log.info(
                "domain %s: migrate %s %s -> %s: %s",
                self.cfg.domain_id,
                move.request_id,
                move.src_id,
                move.dst_id,
                move.reason,
            )
            self._mark_busy((move.src_id, move.dst_id))
            self._spawn(self._intra(move.src_id, move.dst_id, move.request_id), f"migrate-{move.request_id}")

    async def _intra(self, src_id: str, dst_id: str, request_id: str) -> None:
        try:
            dst = self._instances.get(dst_id)
            if dst is not None:
                await self._migrate(src_id, request_id, dst.registration, self._next_attempt(request_id), 0)
        finally:
            self._unmark_busy((src_id, dst_id))

    def _next_attempt(self, request_id: str) -> int:
        recorded = [r.attempt for r, _ in self.view.migrations().values() if r.request_id == request_id]
        attempt = max(self._attempts.get(request_id, self._attempt_base), *recorded, 0) + 1
        self._attempts[request_id] = attempt
        return attempt

    def _mark_busy(self, ids: tuple[str, ...]) -> None:
        for iid in ids:
            self._busy[iid] = self._busy.get(iid, 0) + 1
        self._in_flight += 1

    def _unmark_busy(self, ids: tuple[str, ...]) -> None:
        deadline = self._clock() + self.cfg.settle_s
        for iid in ids:
            self._busy[iid] = self._busy.get(iid, 1) - 1
            inst = self._instances.get(iid)
            self._settle[iid] = (inst.reports if inst else 0, deadline)
        self._in_flight -= 1

    async def _migrate(
        self, src_id: str, request_id: str, dst: InstanceRegistration, attempt: int, fencing_token: int
    ) -> llumlet_pb2.MigrateOutReply | None:
        """Command ``src_id`` to migrate ``request_id`` to ``dst``; the reply, or None when the RPC failed.

        The caller marks the instances busy before and unmarks them after.
        """
        src = self._instances.get(src_id)
        if src is None:
            return None
        msg = llumlet_pb2.MigrateOutRequest(
            request_id=request_id,
            dst_address=dst.address,
            dst_instance_id=dst.instance_id,
            attempt=attempt,
            fencing_token=fencing_token,
        )
        try:
            reply = await src.stub.MigrateOut(msg, timeout=self.cfg.migrate_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._counters.aborted += 1
            _log.warning(
                "domain %s: MigrateOut %s on %s failed: %s", self.cfg.domain_id, request_id, src_id, exc.code().name
            )
            return None
        if reply.outcome == llumlet_pb2.MIGRATION_COMMITTED:
            self._counters.committed += 1
        else:
            self._counters.aborted += 1
            _log.info("domain %s: migration of %s not done: %s", self.cfg.domain_id, request_id, reply.reason)
        return reply

    # ---- cross-domain ----------------------------------------------------------------------------
    def _other_summaries(self) -> list[DomainSummary]:
        out = []
        for key, entry in self.view.entries("summaries/").items():
            try:
                record = decode(SummaryRecord, entry.value, key)
            except RecordError as exc:
                _log.warning("ignoring bad summary: %s", exc)
                continue
            if record.domain_id != self.cfg.domain_id:
                out.append(domain_summary_of(record))
        return out

    def plan_cross_domain(self) -> CrossDomainMove | None:
        """The cross-domain move to propose now, if the domain pairing makes this domain a source.

        A request whose move was not approved is not proposed again for ``5 x cross_interval_s``.
        """
        now = self._clock()
        self._not_approved = {r: t for r, t in self._not_approved.items() if t > now}
        loads = []
        for load in self._free_loads():
            if any(r.request_id in self._not_approved for r in load.running):
                held = tuple(
                    replace(r, migratable=False) if r.request_id in self._not_approved else r for r in load.running
                )
                load = replace(load, running=held)
            loads.append(load)
        return plan_cross_domain(self.summary(), self._other_summaries(), loads, self.cfg.policy, self._rng)

    def _leader_address(self) -> str:
        entry = self.view.entries("leader").get(self.keys.leader)
        if entry is not None:
            try:
                return str(json.loads(entry.value)["address"])
            except (ValueError, KeyError, TypeError):
                _log.warning("domain %s: unreadable leader key", self.cfg.domain_id)
        return self.cfg.coordinator_address

    async def _cross_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.cross_interval_s)
            try:
                while (move := self.plan_cross_domain()) is not None and await self.cross_domain(move):
                    pass
            except Exception:
                _log.exception("domain %s: cross-domain round failed; retrying next period", self.cfg.domain_id)

    async def cross_domain(self, move: CrossDomainMove) -> bool:
        """Propose ``move`` to the coordinator leader; carry out an approval. True when it committed."""
        spec = self._requests.get(move.request_id)
        if spec is not None:
            remaining = max(0, spec.max_tokens - max(0, move.num_tokens - spec.prompt_tokens))
        else:
            remaining = self.cfg.default_remaining_tokens
        attempt = self._next_attempt(move.request_id)
        proposal = MoveProposal(
            proposer_domain_id=self.cfg.domain_id,
            request_id=move.request_id,
            attempt=attempt,
            src_instance_id=move.src_instance_id,
            dst_instance_id="",
            blocks=move.blocks,
            num_tokens=move.num_tokens,
            remaining_tokens=remaining,
            decode_step_s=self.cfg.default_decode_step_s,
        )
        address = self._leader_address()
        if not address:
            _log.warning(
                "domain %s: no coordinator leader to propose to (start one, or pass --coordinator)", self.cfg.domain_id
            )
            return False
        self._mark_busy((move.src_instance_id,))
        try:
            return await self._propose_and_carry_out(proposal, address)
        finally:
            self._unmark_busy((move.src_instance_id,))

    async def _propose_and_carry_out(self, proposal: MoveProposal, address: str) -> bool:
        self._counters.proposed += 1
        try:
            async with open_channel(address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                reply = await stub.ProposeMigration(
                    coord_convert.move_proposal(proposal), timeout=self.cfg.rpc_timeout_s
                )
        except grpc.aio.AioRpcError as exc:
            _log.warning(
                "domain %s: proposal to %s failed: %s %s", self.cfg.domain_id, address, exc.code().name, exc.details()
            )
            return False
        if not reply.approved:
            _log.info("domain %s: move of %s not approved: %s", self.cfg.domain_id, proposal.request_id, reply.reason)
            self._not_approved[proposal.request_id] = self._clock() + 5 * self.cfg.cross_interval_s
            return False
        record, mod_revision = coord_convert.migration_record_from_pb(reply.migration)
        if not self.guard.accepts(reply.fencing_token):
            await self._finish_record(record.migration_id, mod_revision, MigrationState.ABORTED, "stale fencing token")
            return False
        self._counters.approved += 1
        if record.src_instance_id != proposal.src_instance_id or record.request_id != proposal.request_id:
            await self._finish_record(
                record.migration_id, mod_revision, MigrationState.ABORTED, "approval names another move"
            )
            return False
        dst = self.view.instances().get(record.dst_instance_id)
        if dst is None:
            await self._finish_record(
                record.migration_id, mod_revision, MigrationState.ABORTED, "destination instance is not registered"
            )
            return False
        result = await self._migrate(
            proposal.src_instance_id, record.request_id, dst, record.attempt, reply.fencing_token
        )
        committed = result is not None and result.outcome == llumlet_pb2.MIGRATION_COMMITTED
        why = result.reason if result is not None else "MigrateOut failed"
        state = MigrationState.COMMITTED if committed else MigrationState.ABORTED
        await self._finish_record(record.migration_id, mod_revision, state, None if committed else why)
        return committed

    async def _finish_record(
        self, migration_id: str, mod_revision: int, state: MigrationState, reason: str | None
    ) -> None:
        """Move a migration record to ``state`` by compare-and-swap (retrying on a newer revision)."""
        for _ in range(5):
            try:
                result = await self.store.transition(migration_id, mod_revision, state, reason=reason)
            except (KeyError, ValueError) as exc:
                _log.warning("domain %s: cannot record %s as %s: %s", self.cfg.domain_id, migration_id, state, exc)
                return
            except RETRYABLE_ERRORS as exc:
                _log.warning("domain %s: recording %s failed (%s); retrying", self.cfg.domain_id, migration_id, exc)
                await asyncio.sleep(0.1)
                continue
            if (
                result.ok
                or result.current is None
                or result.current.state
                in (
                    MigrationState.COMMITTED,
                    MigrationState.ABORTED,
                )
            ):
                return
            mod_revision = result.mod_revision
        _log.error("domain %s: gave up recording %s as %s", self.cfg.domain_id, migration_id, state)

    async def _recover_cross_domain(self) -> None:
        """Settle approved migrations from this domain that a previous run left without an outcome.

        The destination's Release (idempotent) answers whether that attempt committed there; if it had
        not, Release cancels it (the request continues on the source).
        """
        instances = self.view.instances()
        for mid, (record, mod_revision) in sorted(self.view.migrations().items()):
            if record.state is not MigrationState.APPROVED or record.src_domain_id != self.cfg.domain_id:
                continue
            committed, why = False, "destination unreachable after a domain scheduler restart"
            dst = instances.get(record.dst_instance_id)
            if dst is not None:
                try:
                    async with open_channel(dst.address) as channel:
                        rel = await llumlet_pb2_grpc.LlumletStub(channel).Release(
                            llumlet_pb2.ReleaseRequest(request_id=record.request_id, attempt=record.attempt),
                            timeout=self.cfg.rpc_timeout_s,
                        )
                    committed = rel.committed
                    why = "released after a domain scheduler restart"
                except grpc.aio.AioRpcError as exc:
                    why = f"destination unreachable after a domain scheduler restart ({exc.code().name})"
            state = MigrationState.COMMITTED if committed else MigrationState.ABORTED
            _log.info("domain %s: settling %s as %s", self.cfg.domain_id, mid, state)
            await self._finish_record(mid, mod_revision, state, None if committed else why)

    # ---- state -----------------------------------------------------------------------------------
    def state(self) -> DomainStateInfo:
        """A snapshot for GetDomainState."""
        infos = []
        for iid, inst in sorted(self._instances.items()):
            load = self._effective(inst)
            infos.append(
                InstanceStateInfo(
                    instance_id=iid,
                    address=inst.registration.address,
                    connected=inst.connected,
                    draining=self._draining(iid),
                    load=load,
                    freeness=freeness(load, self.cfg.policy) if load is not None else math.nan,
                    load_version=inst.version,
                )
            )
        return DomainStateInfo(
            domain_id=self.cfg.domain_id,
            ready=self.ready.is_set(),
            domain_draining=self._domain_draining,
            instances=tuple(infos),
            migrations_in_flight=self._in_flight,
            migrations_committed=self._counters.committed,
            migrations_aborted=self._counters.aborted,
            cross_domain_proposed=self._counters.proposed,
            cross_domain_approved=self._counters.approved,
            summaries_published=self.publisher.puts,
            newest_fencing_token=self.guard.newest,
        )
