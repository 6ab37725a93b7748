"""The domain scheduler's service: a thin async shell around its decision core (``rack_sched.core``).

One :class:`DomainScheduler` per NVLink domain (DESIGN.md, "Components"; docs/control-plane.md, "Domain
scheduler"). It keeps a :class:`~clusterstate.store.ClusterView` of etcd and

- discovers its instances: every ``P instances/<id>`` registration (under the llumlet's lease) that names
  its domain. For each it holds a WatchLoad stream to the llumlet: the llumlet pushes its load on every
  change, and each report goes to the :class:`~rack_sched.core.DomainCore`. A lost stream is re-opened with
  jittered backoff; meanwhile the core gives the instance no new requests and no migrations;
- applies drain intents (``P drains/instance/<id>``, ``P drains/domain/<id>``) through the core: a draining
  instance carries infinite virtual usage, so dispatch never picks it and rescheduling empties it;
- finds the coordinator leader (``P leader``) for proposals, and remembers the newest fencing token seen.

Loops (all started by :meth:`DomainScheduler.run`):

- rescheduling, every ``rebalance_interval_s`` (50 ms, Llumnix's period): the core plans the moves, each
  becomes a MigrateOut command to the source llumlet (attempt number, no fencing token: no approval inside a
  domain);
- summary: on every load or drain change the core's summaries (one per model) are offered to a
  ``SummaryPublisher`` (at most one put per ``summary_interval_s``, under the scheduler's lease);
- cross-domain, every ``cross_interval_s``: the move the core proposes goes to the coordinator leader; an
  approval is carried out (its fencing token checked by a ``FencingGuard`` and passed to the llumlet), its
  outcome recorded by compare-and-swap (``committed`` or ``aborted``) together with the transport and the
  pre-copy bandwidth the llumlet measured, which the coordinator prices later moves on that path with.

Its registration is claimed in one transaction (``Registrar.claim``): two schedulers started together for
one domain cannot both run.

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
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from clusterstate.aio import until_stopped
from clusterstate.backoff import Backoff
from clusterstate.clock import SYSTEM_CLOCK, Clock
from clusterstate.etcd import RETRYABLE_ERRORS, Etcd3Client, error_line
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
from policy.domain import DomainSummary
from policy.usage import freeness
from rack_sched.convert import load_from_pb
from rack_sched.core import CrossDomainProposal, DomainCore, DomainRequest
from rack_sched.plan import drained_instances
from rack_sched.types import (
    DispatchOutcome,
    DispatchResult,
    DomainStateInfo,
    DomainTakenError,
    InstanceStateInfo,
    RackConfig,
)

__all__ = ["DomainScheduler"]

_log = logging.getLogger(__name__)


class _Instance:
    """A registered instance's connection: its llumlet channel, WatchLoad task (mutable, internal)."""

    def __init__(self, registration: InstanceRegistration) -> None:
        self.registration = registration
        self.instance_id = registration.instance_id
        self.channel = open_channel(registration.address)
        self.stub = llumlet_pb2_grpc.LlumletStub(self.channel)
        self.version = 0  # LoadReport.version of the last report
        self.settled = asyncio.Event()  # first report arrived, or the first attempt failed
        self.task: asyncio.Task[None] | None = None
        self.heartbeat: asyncio.Task[None] | None = None  # pings it while it does not answer

    async def close(self) -> None:
        for task in (self.task, self.heartbeat):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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
        clock: time (monotonic for deadlines, wall for the summaries' stamps) and sleeps.
    """

    def __init__(
        self,
        cfg: RackConfig,
        client: Etcd3Client,
        *,
        rng: random.Random,
        topology_instance_ids: Collection[str] = (),
        clock: Clock = SYSTEM_CLOCK,
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
            self.registrar, self.keys, cfg.domain_id, min_interval_s=cfg.summary_interval_s, clock=clock.now_s
        )
        self.core = DomainCore(cfg.domain_id, cfg.decide, rng)
        self.guard = FencingGuard()
        self.ready = asyncio.Event()  # set once the view is rebuilt from the llumlets
        self._instances: dict[str, _Instance] = {}
        self._attempts: dict[str, int] = {}  # request -> last migration attempt used
        self._attempt_base = 0  # etcd revision at start: attempts of a restarted scheduler exceed the old ones
        self._tasks: set[asyncio.Task[None]] = set()
        self._counters = _Counters()

    # ---- running ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Register, rebuild the view from the llumlets, then run every loop until ``stop`` is set.

        On stop the registration and summary are revoked with the lease; the llumlets keep running.

        Raises:
            DomainTakenError: another domain scheduler holds this domain's registration.
        """
        view_task = asyncio.create_task(self.view.run(), name="rack-view")
        registrar_task = asyncio.create_task(self.registrar.run(stop), name="rack-registrar")
        loops: list[asyncio.Task[None]] = []
        try:
            if not await until_stopped(self.view.synced.wait(), stop):
                return  # stopped before etcd answered
            self._attempt_base = self.view.revision
            reg = DomainRegistration(self.cfg.domain_id, self.cfg.advertise_address)
            key = self.keys.domain(self.cfg.domain_id)
            claim = asyncio.ensure_future(self.registrar.claim(key, encode(reg)))
            if not await until_stopped(claim, stop):
                return  # stopped before a session was open (etcd refusing leases: a TTL above its maximum)
            if not claim.result():
                raise DomainTakenError(
                    f"domain {self.cfg.domain_id} already has a live domain scheduler; stop it first "
                    "(a crashed one's registration expires with its lease TTL)"
                )
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
                asyncio.create_task(self._watch_claim(stop), name="rack-claim"),
            ]
            await stop.wait()
        finally:
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

    async def _watch_claim(self, stop: asyncio.Event) -> None:
        """Stop when another scheduler took this domain's registration while etcd was out of reach."""
        await self.registrar.lost_claim.wait()
        _log.error("domain %s: stopping: %s", self.cfg.domain_id, self.registrar.conflict)
        stop.set()

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
            await self._clock.sleep(interval_s)
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
        drains = self.view.drains()
        drained = drained_instances(self.cfg.domain_id, self._instances, drains)
        if self.core.set_drains(drained, (DrainKind.DOMAIN, self.cfg.domain_id) in drains):
            _log.info("domain %s: draining instances now %s", self.cfg.domain_id, sorted(drained))
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
        self.core.add_instance(reg.instance_id, reg.model, self.cfg.block_size_tokens, reg.capacity_blocks)
        inst.task = asyncio.create_task(self._watch(inst), name=f"watch-load-{reg.instance_id}")
        _log.info("domain %s: instance %s (%s) at %s", self.cfg.domain_id, reg.instance_id, reg.model, reg.address)

    def _drop_instance(self, instance_id: str) -> None:
        inst = self._instances.pop(instance_id)
        self.core.remove_instance(instance_id)
        self._spawn(inst.close(), f"close-{instance_id}")
        self._offer_summary()
        _log.info("domain %s: instance %s deregistered", self.cfg.domain_id, instance_id)

    # ---- loads -----------------------------------------------------------------------------------
    async def _watch(self, inst: _Instance) -> None:
        """Keep a WatchLoad stream to one llumlet open; hand every report to the core."""
        backoff = Backoff(self.cfg.backoff, self._rng)
        while True:
            call = inst.stub.WatchLoad(llumlet_pb2.WatchLoadRequest(min_interval_s=self.cfg.watch_min_interval_s))
            try:
                async for report in call:
                    backoff.reset()
                    self._on_report(inst, report)
                why = "stream ended"
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
            except ValueError as exc:
                why = f"bad load report: {exc}"
            finally:
                call.cancel()
            self.core.stream_lost(inst.instance_id)
            inst.settled.set()
            delay = backoff.next_s()
            _log.log(
                backoff.level(),
                "domain %s: load stream of %s lost (%s), attempt %d; reconnecting in %.2f s",
                self.cfg.domain_id,
                inst.instance_id,
                why,
                backoff.failures,
                delay,
            )
            await self._clock.sleep(delay)

    def _on_report(self, inst: _Instance, report: llumlet_pb2.LoadReport) -> None:
        if report.failure:
            self._failed(inst, report.failure)
            inst.version = int(report.version)
            inst.settled.set()
            return
        load = load_from_pb(report, inst.instance_id, self.cfg.domain_id)
        self.core.report(inst.instance_id, load, report.finished_output_tokens)
        inst.version = int(report.version)
        inst.settled.set()
        self._offer_summary()

    def _failed(self, inst: _Instance, failure: str) -> None:
        """The instance's engine failed: route nothing to it, move nothing to or from it (``DomainCore``)."""
        if not self.core.failure(inst.instance_id):
            _log.error("domain %s: instance %s failed: %s", self.cfg.domain_id, inst.instance_id, failure)
        self.core.engine_failed(inst.instance_id, failure)
        self._offer_summary()

    def summaries(self) -> tuple[DomainSummary, ...]:
        """This domain's summaries now, one per model (``DomainCore.summaries``)."""
        return self.core.summaries(self._clock.wall_s())

    def _offer_summary(self) -> None:
        if self.ready.is_set():
            self.publisher.offer(SummaryRecord(self.cfg.domain_id, self.summaries()))

    # ---- dispatch --------------------------------------------------------------------------------
    async def submit(self, request: DomainRequest, msg: llumlet_pb2.SubmitRequest) -> DispatchResult:
        """Choose an instance for a new request (``DomainCore.dispatch``) and submit it there.

        ``msg`` is forwarded to the chosen llumlet unchanged; its ``avoid_instance_ids`` are not chosen. An
        unreachable instance is skipped (until its next load report or an answered heartbeat) and the next choice
        tried; so is one whose engine failed (until a healthy report).
        """
        demand = request.demand_blocks(self.cfg.block_size_tokens)
        if not self.ready.is_set():
            return DispatchResult(
                DispatchOutcome.UNAVAILABLE,
                "the domain scheduler is rebuilding its view from the llumlets",
                demand_blocks=demand,
            )
        failures: list[str] = []
        failed: set[str] = set(msg.avoid_instance_ids)  # a resumed request avoids where it failed
        for _ in range(max(1, len(self._instances))):
            spread_before = self.core.fallback_dispatches
            decision = self.core.dispatch(request, exclude=failed)
            if self.core.fallback_dispatches > spread_before:
                _log.warning("domain %s: %s (request %s)", self.cfg.domain_id, decision.reason, request.request_id)
            if decision.target_id is None:
                if failures or not any(self.core.answering(i) for i in self._instances):
                    why = "; ".join([*failures, decision.reason]) if failures else "no instance answers"
                    return DispatchResult(DispatchOutcome.UNAVAILABLE, why, demand_blocks=demand)
                outcome = DispatchOutcome.FULL if decision.full else DispatchOutcome.REFUSED
                return DispatchResult(outcome, decision.reason, demand_blocks=demand)
            inst = self._instances[decision.target_id]
            try:
                reply = await inst.stub.Submit(msg, timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{inst.instance_id} unreachable ({exc.code().name})")
                failed.add(inst.instance_id)
                self._unreachable(inst)
                continue
            if reply.instance_failed:  # excluded by the core from now on: the next choice
                self._failed(inst, reply.reason)
                continue
            if not reply.accepted:
                return DispatchResult(
                    DispatchOutcome.REFUSED,
                    f"instance {inst.instance_id} refused it: {reply.reason}",
                    demand_blocks=demand,
                )
            return DispatchResult(
                DispatchOutcome.ACCEPTED, decision.reason, inst.instance_id, inst.registration.address, demand
            )
        return DispatchResult(DispatchOutcome.UNAVAILABLE, "; ".join(failures), demand_blocks=demand)

    def _unreachable(self, inst: _Instance) -> None:
        """A call to ``inst`` got no answer: it takes nothing until a heartbeat (Ping) answers again."""
        self.core.unreachable(inst.instance_id)
        if inst.heartbeat is None or inst.heartbeat.done():
            inst.heartbeat = asyncio.create_task(self._heartbeat(inst), name=f"heartbeat-{inst.instance_id}")
            self._tasks.add(inst.heartbeat)
            inst.heartbeat.add_done_callback(self._tasks.discard)

    async def _heartbeat(self, inst: _Instance) -> None:
        """Ping ``inst`` with jittered backoff until it answers (or reports), then re-admit it."""
        backoff = Backoff(self.cfg.backoff, self._rng)
        while not self.core.answering(inst.instance_id) and inst.instance_id in self._instances:
            try:
                pong = await inst.stub.Ping(llumlet_pb2.LlumletPingRequest(), timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError:
                await self._clock.sleep(backoff.next_s())
                continue
            if pong.failure:
                self._failed(inst, pong.failure)
            self.core.answered(inst.instance_id)
            _log.info("domain %s: instance %s answers again", self.cfg.domain_id, inst.instance_id)

    # ---- intra-domain rescheduling ---------------------------------------------------------------
    def _rebalance(self) -> None:
        """One rescheduling round: the core's moves, each commanded to its source (no approval)."""
        for move in self.core.plan_rebalance(self._clock.now_s()):
            _log.info(
                "domain %s: migrate %s %s -> %s: %s",
                self.cfg.domain_id,
                move.request_id,
                move.src_id,
                move.dst_id,
                move.reason,
            )
            self._spawn(self._intra(move.src_id, move.dst_id, move.request_id), f"migrate-{move.request_id}")

    async def _intra(self, src_id: str, dst_id: str, request_id: str) -> None:
        try:
            dst = self._instances.get(dst_id)
            if dst is not None:
                await self._migrate(src_id, request_id, dst.registration, self._next_attempt(request_id), 0)
        finally:
            self.core.migration_done((src_id, dst_id), self._clock.now_s())

    def _next_attempt(self, request_id: str) -> int:
        recorded = [r.attempt for r, _ in self.view.migrations().values() if r.request_id == request_id]
        attempt = max(self._attempts.get(request_id, self._attempt_base), *recorded, 0) + 1
        self._attempts[request_id] = attempt
        return attempt

    async def _migrate(
        self, src_id: str, request_id: str, dst: InstanceRegistration, attempt: int, fencing_token: int
    ) -> llumlet_pb2.MigrateOutReply | None:
        """Command ``src_id`` to migrate ``request_id`` to ``dst``; the reply, or None when the RPC failed."""
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
        out: list[DomainSummary] = []
        for key, entry in self.view.entries("summaries/").items():
            try:
                record = decode(SummaryRecord, entry.value, key)
            except RecordError as exc:
                _log.warning("ignoring bad summary: %s", exc)
                continue
            if record.domain_id != self.cfg.domain_id:
                out.extend(record.summaries)
        return out

    def plan_cross_domain(self) -> CrossDomainProposal | None:
        """The cross-domain move to propose now (``DomainCore.plan_cross_domain``), if any."""
        return self.core.plan_cross_domain(self._other_summaries(), self._clock.now_s())

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
            await self._clock.sleep(self.cfg.cross_interval_s)
            try:
                while (move := self.plan_cross_domain()) is not None and await self.cross_domain(move):
                    pass
            except Exception:
                _log.exception("domain %s: cross-domain round failed; retrying next period", self.cfg.domain_id)

    async def cross_domain(self, move: CrossDomainProposal) -> bool:
        """Propose ``move`` to the coordinator leader; carry out an approval. True when it committed."""
        proposal = move.proposal(self.cfg.domain_id, self._next_attempt(move.request_id))
        address = self._leader_address()
        if not address:
            _log.warning(
                "domain %s: no coordinator leader to propose to (start one, or pass --coordinator)", self.cfg.domain_id
            )
            return False
        self.core.cross_domain_started(move)
        try:
            return await self._propose_and_carry_out(proposal, address)
        finally:
            self.core.cross_domain_done(move, self._clock.now_s())

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
            self.core.not_approved(proposal.request_id, self._clock.now_s())
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
        measured: dict[str, Any] = {}
        if result is not None and result.precopy_bandwidth_bytes_per_s > 0 and result.transport:
            # what the transport sustained on this path: the coordinator prices later moves with it
            measured = {
                "transport": result.transport,
                "measured_bandwidth_bytes_per_s": result.precopy_bandwidth_bytes_per_s,
                "measured_at_s": self._clock.wall_s(),
            }
        if committed and result is not None:  # what it ran and what the request paused (hilumctl migrations)
            measured.update(plan=result.plan, measured_downtime_s=result.downtime_s)
        await self._finish_record(record.migration_id, mod_revision, state, None if committed else why, measured)
        return committed

    async def _finish_record(
        self,
        migration_id: str,
        mod_revision: int,
        state: MigrationState,
        reason: str | None,
        update: dict[str, Any] | None = None,
    ) -> None:
        """Move a migration record to ``state`` by compare-and-swap (retrying on a newer revision), with the
        fields of ``update`` (the move's measurements) changed too."""
        for _ in range(5):
            try:
                result = await self.store.transition(migration_id, mod_revision, state, reason=reason, update=update)
            except (KeyError, ValueError) as exc:
                _log.warning("domain %s: cannot record %s as %s: %s", self.cfg.domain_id, migration_id, state, exc)
                return
            except RETRYABLE_ERRORS as exc:
                _log.warning(
                    "domain %s: recording %s failed (%s); retrying", self.cfg.domain_id, migration_id, error_line(exc)
                )
                await self._clock.sleep(0.1)
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
            load = self.core.load(iid)
            infos.append(
                InstanceStateInfo(
                    instance_id=iid,
                    address=inst.registration.address,
                    connected=self.core.reachable(iid),
                    draining=self.core.draining(iid),
                    load=load,
                    freeness=freeness(load, self.cfg.decide.policy) if load is not None else math.nan,
                    load_version=inst.version,
                    failure=self.core.failure(iid),
                )
            )
        return DomainStateInfo(
            domain_id=self.cfg.domain_id,
            ready=self.ready.is_set(),
            domain_draining=self.core.domain_draining,
            instances=tuple(infos),
            migrations_in_flight=self.core.migrations_in_flight,
            migrations_committed=self._counters.committed,
            migrations_aborted=self._counters.aborted,
            cross_domain_proposed=self._counters.proposed,
            cross_domain_approved=self._counters.approved,
            summaries_published=self.publisher.puts,
            newest_fencing_token=self.guard.newest,
            fallback_dispatches=self.core.fallback_dispatches,
        )
