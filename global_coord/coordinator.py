"""The global coordinator: campaigns for leadership, keeps the ClusterView, approves cross-domain moves.

Every replica keeps a :class:`~clusterstate.store.ClusterView` and observes who leads, so any replica
answers reads. Only the leader writes: approvals and drain intents go to etcd in transactions fenced by
its leader key (:class:`~clusterstate.fencing.Fence`), each stamped with its fencing token. A write that
fails its fence proves this replica no longer leads: it drops its session and campaigns again.

Approvals are serialised (one at a time), judged against link budgets counted from the migrations in
the view, and the leader waits for its view to reflect each approval before judging the next, so two
concurrent approvals never both take the last flow on a link. Each move is priced with the pre-copy rate
earlier moves on its path achieved (the measurements the domain schedulers write into the records they
finish: ``approver.measured_rates``), rebuilt from the view at each approval. The coordinator keeps no other
state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from clusterstate.backoff import RECOVERED_LEVEL, Backoff, BackoffConfig, failed_attempts
from clusterstate.election import Election, Leader
from clusterstate.etcd import RETRYABLE_ERRORS, Etcd3Client, error_line
from clusterstate.fencing import Fence, FencedOut
from clusterstate.records import (
    ACTIVE_STATES,
    AutoscaleRecord,
    DrainIntent,
    DrainKind,
    MigrationRecord,
    MigrationState,
)
from clusterstate.session import Session, SessionLost
from clusterstate.store import ClusterView, Keys, Store
from global_coord.approver import (
    MoveJudge,
    MoveProposal,
    PathOf,
    decide,
    link_flows,
    measured_rates,
)
from topology.bandwidth import MeasuredBandwidthConfig

__all__ = ["Coordinator", "CoordinatorConfig", "NotLeader", "ProposeResult", "StatusInfo", "TopologyLike"]

_log = logging.getLogger(__name__)


class _InstanceSpecLike(Protocol):
    @property
    def instance_id(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def gpu_type(self) -> str: ...
    @property
    def kv_capacity_blocks(self) -> int: ...


class _DomainSpecLike(Protocol):
    @property
    def domain_id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def gpu_type(self) -> str: ...
    @property
    def instances(self) -> Sequence[_InstanceSpecLike]: ...


class TopologyLike(Protocol):
    """What the coordinator reports of ``topology.spec.Topology`` in GetTopology (structural)."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def domains(self) -> Sequence[_DomainSpecLike]: ...


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """How one coordinator replica runs."""

    coordinator_id: str  # unique among replicas
    advertise_address: str  # host:port others reach its gRPC server at
    etcd_endpoint: str  # host:port of etcd (for Status)
    prefix: str = "/hilum/v1/"  # etcd key prefix (see store.py)
    ttl_s: int = 10  # session lease TTL: failover time and tolerated etcd outage, seconds
    backoff: BackoffConfig = field(default_factory=BackoffConfig)
    view_catch_up_s: float = 5.0  # how long an approval waits for the view to reflect it

    def __post_init__(self) -> None:
        if not self.coordinator_id:
            raise ValueError("coordinator id must not be empty")
        if self.ttl_s < 2:
            raise ValueError(f"ttl_s must be >= 2 (etcd's minimum lease TTL), got {self.ttl_s}")


class NotLeader(Exception):
    """A write reached a replica that does not lead; ``leader`` is who does (None when nobody)."""

    def __init__(self, coordinator_id: str, leader: Leader | None) -> None:
        where = f"the leader is {leader.leader_id} at {leader.address}" if leader else "no leader elected yet"
        super().__init__(f"coordinator {coordinator_id} is not the leader: {where}")
        self.leader = leader


@dataclass(frozen=True, slots=True)
class ProposeResult:
    """The answer to a proposal."""

    approved: bool
    reason: str
    record: MigrationRecord | None  # as written to etcd; None when nothing was written
    mod_revision: int  # of the record (0 when none)
    fencing_token: int  # the deciding leader's token


@dataclass(frozen=True, slots=True)
class StatusInfo:
    """One replica's view of the control plane."""

    coordinator_id: str
    is_leader: bool
    leader: Leader | None
    etcd_endpoint: str
    view_revision: int
    num_domains: int
    num_instances: int
    num_active_migrations: int
    num_drains: int


class Coordinator:
    """One coordinator replica. ``run(stop)`` until ``stop`` is set; then it resigns.

    Args:
        cfg: configuration.
        client: a connected etcd client (etcd3aio).
        rng: random source for backoff jitter.
        path_of, judge: the topology's paths and the cost-model judge; without them every proposal is
            rejected with a reason saying so.
        topology: the loaded topology (served by GetTopology), or None.
        bandwidth: how the measured rates in the migration records price later moves (``topology.bandwidth``).
        clock: monotonic seconds (the session); wall_clock: seconds since the epoch, to age the measurements
            the domain schedulers stamped with theirs.
    """

    def __init__(
        self,
        cfg: CoordinatorConfig,
        client: Etcd3Client,
        *,
        rng: random.Random,
        path_of: PathOf | None = None,
        judge: MoveJudge | None = None,
        topology: TopologyLike | None = None,
        bandwidth: MeasuredBandwidthConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self._client = client
        self._rng = rng
        self._clock = clock
        self._wall_clock = wall_clock
        self.bandwidth = bandwidth if bandwidth is not None else MeasuredBandwidthConfig()
        self.path_of = path_of
        self.judge = judge
        self.topology = topology
        self.keys = Keys(cfg.prefix)
        self.store = Store(client, self.keys)
        self.view = ClusterView(client, self.keys, rng=rng, backoff=cfg.backoff)
        self.election = Election(client, self.keys.leader)
        self.leading: Leader | None = None  # set while this replica leads
        self.observed_leader: Leader | None = None  # the latest leader seen in etcd
        self._session: Session | None = None
        self._approve_lock = asyncio.Lock()
        self.elected = asyncio.Event()  # set while this replica leads (tests, logs)

    # ---- running ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Keep the view, observe the leader, campaign; until ``stop``."""
        tasks = [
            asyncio.create_task(self.view.run(), name="view"),
            asyncio.create_task(self._observe(), name="observe-leader"),
        ]
        try:
            await self._campaign_loop(stop)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _observe(self) -> None:
        backoff = Backoff(self.cfg.backoff, self._rng)
        while True:
            try:
                async for leader in self.election.observe():
                    self.observed_leader = leader
                    if failures := backoff.reset():
                        _log.log(RECOVERED_LEVEL, "observing the leader again after %s", failed_attempts(failures))
            except RETRYABLE_ERRORS as exc:
                delay = backoff.next_s()
                _log.log(
                    backoff.level(),
                    "observing the leader failed (%s), attempt %d; retrying in %.2f s: check that etcd runs and that "
                    "--etcd names its client address",
                    error_line(exc),
                    backoff.failures,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _first(self, aw: asyncio.Future[Any], *events: asyncio.Event) -> bool:
        """Wait for ``aw`` or any of ``events``; True when ``aw`` finished first."""
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait([aw, *waiters], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return aw.done()

    async def _campaign_loop(self, stop: asyncio.Event) -> None:
        backoff = Backoff(self.cfg.backoff, self._rng)
        unanswered = 0  # sessions etcd did not open since the last it did
        lost_lead = False  # it stepped down other than to stop, and does not lead again yet
        while not stop.is_set():
            try:
                session = await Session.open(self._client, self.cfg.ttl_s, clock=self._clock)
                if unanswered:  # etcd answers: the next failure is the first of a new run (a standby never leads)
                    _log.log(
                        RECOVERED_LEVEL,
                        "%s: etcd answers again after %s",
                        self.cfg.coordinator_id,
                        failed_attempts(unanswered),
                    )
                    unanswered = 0
                    backoff.reset()
            except RETRYABLE_ERRORS as exc:
                unanswered += 1
                delay = backoff.next_s()
                _log.log(
                    backoff.level(),
                    "%s: cannot open an etcd session (%s), attempt %d; retrying in %.2f s: check that etcd runs and "
                    "that --etcd names its client address",
                    self.cfg.coordinator_id,
                    error_line(exc),
                    backoff.failures,
                    delay,
                )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()
                continue
            self._session = session
            campaign = asyncio.ensure_future(
                self.election.campaign(session, self.cfg.coordinator_id, self.cfg.advertise_address)
            )
            try:
                if not await self._first(campaign, stop, session.done):
                    continue
                leader = campaign.result()
                backoff.reset()
                self.leading = leader
                self.elected.set()
                if lost_lead:  # at the level of the step-down's warning: a log kept at WARNING says both
                    _log.log(
                        RECOVERED_LEVEL, "%s: leads again, fencing token %d", self.cfg.coordinator_id, leader.token
                    )
                    lost_lead = False
                await self._on_elected(leader)
                done = asyncio.ensure_future(session.done.wait())
                await self._first(done, stop)
                done.cancel()
            except (SessionLost, FencedOut) as exc:
                _log.warning("%s: lost leadership or session: %s", self.cfg.coordinator_id, exc)
            except RETRYABLE_ERRORS as exc:
                delay = backoff.next_s()
                _log.log(
                    backoff.level(),
                    "%s: campaign failed (%s), attempt %d; retrying in %.2f s",
                    self.cfg.coordinator_id,
                    error_line(exc),
                    backoff.failures,
                    delay,
                )
                await asyncio.sleep(delay)
            finally:
                campaign.cancel()
                with contextlib.suppress(asyncio.CancelledError, SessionLost, *RETRYABLE_ERRORS):
                    await campaign
                was_leading, self.leading = self.leading, None
                self.elected.clear()
                if was_leading is not None:  # a loss is a warning (a log kept at WARNING says it); a stop is not
                    lost_lead = not stop.is_set()
                    _log.log(
                        logging.INFO if stop.is_set() else logging.WARNING,
                        "%s: stepped down (token %d): %s",
                        self.cfg.coordinator_id,
                        was_leading.token,
                        "stopping" if stop.is_set() else session.lost_reason,
                    )
                # Revoking the lease deletes our leader key at once, so a standby takes over without
                # waiting for the TTL (and a stale key of a paused leader disappears).
                await session.close(revoke=True)
                self._session = None

    async def _on_elected(self, leader: Leader) -> None:
        """Abort proposals a previous leader recorded but never approved (they hold link budget)."""
        await self.view.synced.wait()
        fence = Fence(self.keys.leader, leader.token)
        for mid, (record, mod_revision) in self.view.migrations().items():
            if record.state is MigrationState.PROPOSED:
                result = await self.store.transition(
                    mid,
                    mod_revision,
                    MigrationState.ABORTED,
                    reason="leader changed before approval",
                    fence=fence,
                )
                _log.info("aborted stale proposal %s: %s", mid, "done" if result.ok else "changed meanwhile")

    # ---- state -----------------------------------------------------------------------------------
    def is_leader(self) -> bool:
        """True while this replica leads (its session alive and its campaign won)."""
        session = self._session
        # The clock check makes a leader that was paused past its TTL stop acting the moment it wakes,
        # before its keep-alive task has even run; the fence in etcd catches everything else.
        return (
            self.leading is not None and session is not None and not session.done.is_set() and session.remaining_s() > 0
        )

    def current_leader(self) -> Leader | None:
        """This replica when it leads, else the latest leader observed in etcd.

        A leader key that names this replica while it does not lead is the key of a session it lost (see
        :mod:`clusterstate.election`); it campaigns to take it over, so nobody leads until it does: None.
        """
        if self.is_leader():
            return self.leading
        seen = self.observed_leader
        if seen is not None and (seen.leader_id, seen.address) == (self.cfg.coordinator_id, self.cfg.advertise_address):
            return None
        return seen

    def status(self) -> StatusInfo:
        """A snapshot of this replica's view."""
        view = self.view
        active = sum(1 for r, _ in view.migrations().values() if r.state in ACTIVE_STATES)
        return StatusInfo(
            coordinator_id=self.cfg.coordinator_id,
            is_leader=self.is_leader(),
            leader=self.current_leader(),
            etcd_endpoint=self.cfg.etcd_endpoint,
            view_revision=view.revision,
            num_domains=len(view.domains()),
            num_instances=len(view.instances()),
            num_active_migrations=active,
            num_drains=len(view.drains()),
        )

    def _fence(self) -> tuple[Leader, Fence]:
        leader = self.leading
        if leader is None or not self.is_leader():
            raise NotLeader(self.cfg.coordinator_id, self.current_leader())
        return leader, Fence(self.keys.leader, leader.token)

    def _fenced_out(self, exc: FencedOut) -> NotLeader:
        if self._session is not None:
            self._session.abandon(f"fenced out: {exc}")
        return NotLeader(self.cfg.coordinator_id, self.current_leader())

    # ---- writes (leader only) --------------------------------------------------------------------
    async def propose(self, move: MoveProposal) -> ProposeResult:
        """Judge a cross-domain move; record and approve it in etcd (fenced) when it passes.

        Raises:
            NotLeader: on a standby, or when the fence shows this replica no longer leads.
        """
        async with self._approve_lock:
            leader, fence = self._fence()
            try:
                return await self._propose(move, leader, fence)
            except FencedOut as exc:
                raise self._fenced_out(exc) from exc

    def _reject(self, reason: str, token: int) -> ProposeResult:
        return ProposeResult(False, reason, None, 0, token)

    async def _propose(self, move: MoveProposal, leader: Leader, fence: Fence) -> ProposeResult:
        mid = MigrationRecord.make_id(move.request_id, move.attempt)
        existing = await self.store.get_migration(mid)
        if existing is not None:
            record, mod_revision = existing
            approved = record.state in (MigrationState.APPROVED, MigrationState.COMMITTED)
            return ProposeResult(
                approved, f"already {record.state}: {record.reason}", record, mod_revision, leader.token
            )
        if self.path_of is None or self.judge is None:
            return self._reject("no topology loaded: start the coordinator with --topology FILE", leader.token)
        instances = self.view.instances()
        src = instances.get(move.src_instance_id)
        if src is None:
            return self._reject(f"source instance {move.src_instance_id!r} is not registered", leader.token)
        if src.domain_id != move.proposer_domain_id:
            return self._reject(
                f"source instance {src.instance_id} is in domain {src.domain_id}, "
                f"not the proposer's {move.proposer_domain_id}",
                leader.token,
            )
        if move.model and src.model != move.model:
            return self._reject(f"source instance {src.instance_id} serves {src.model}, not {move.model}", leader.token)
        migrations = self.view.migrations()
        drains = self.view.drains()
        summaries = [s for record in self.view.summaries().values() for s in record.summaries]
        choice = decide(
            replace(move, model=move.model or src.model),
            src.domain_id,
            summaries,
            self.path_of,
            self.judge,
            link_flows(r for r, _ in migrations.values()),
            drained=lambda iid, did: (DrainKind.INSTANCE, iid) in drains or (DrainKind.DOMAIN, did) in drains,
            registered=instances.keys(),
            measured=measured_rates(migrations.values(), self.bandwidth, self._wall_clock()),
        )
        if choice.dst_instance_id is None or choice.path is None:
            return self._reject(choice.judgement.reason, leader.token)
        dst = instances[choice.dst_instance_id]
        record = MigrationRecord(
            migration_id=mid,
            request_id=move.request_id,
            attempt=move.attempt,
            src_instance_id=src.instance_id,
            dst_instance_id=dst.instance_id,
            src_domain_id=src.domain_id,
            dst_domain_id=dst.domain_id,
            blocks=move.blocks,
            state=MigrationState.PROPOSED,
            fencing_token=leader.token,
            links=tuple(choice.path.links),
            expected_transfer_s=choice.judgement.transfer_s,
            expected_downtime_s=choice.judgement.downtime_s,
            reason=choice.judgement.reason,
        )
        created = await self.store.create_migration(record, fence)
        if not created.ok:  # raced with an identical proposal
            current = created.current
            approved = current is not None and current.state in (
                MigrationState.APPROVED,
                MigrationState.COMMITTED,
            )
            return ProposeResult(approved, "already recorded", current, created.mod_revision, leader.token)
        result = await self.store.transition(mid, created.mod_revision, MigrationState.APPROVED, fence=fence)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.view_catch_up_s):
                await self.view.wait_revision(result.mod_revision)
        return ProposeResult(result.ok, record.reason, result.current, result.mod_revision, leader.token)

    async def drain(self, kind: DrainKind, target_id: str, reason: str = "") -> tuple[bool, DrainIntent]:
        """Record a drain intent; (created, intent). Raises NotLeader on a standby."""
        leader, fence = self._fence()
        intent = DrainIntent(kind, target_id, reason, leader.token)
        try:
            created = await self.store.put_drain(intent, fence)
        except FencedOut as exc:
            raise self._fenced_out(exc) from exc
        if not created:
            intent = self.view.drains().get((kind, target_id), intent)
        return created, intent

    async def put_autoscale(self, record: AutoscaleRecord) -> None:
        """Write the autoscaler's record of one model, stamped with this leader's token (fenced).

        Raises NotLeader on a standby, or when the fence shows this replica no longer leads.
        """
        leader, fence = self._fence()
        try:
            await self.store.put_autoscale(replace(record, fencing_token=leader.token), fence)
        except FencedOut as exc:
            raise self._fenced_out(exc) from exc

    async def undrain(self, kind: DrainKind, target_id: str) -> tuple[bool, DrainIntent]:
        """Remove a drain intent; (deleted, intent). Raises NotLeader on a standby."""
        leader, fence = self._fence()
        intent = self.view.drains().get((kind, target_id), DrainIntent(kind, target_id, "", leader.token))
        try:
            deleted = await self.store.delete_drain(kind, target_id, fence)
        except FencedOut as exc:
            raise self._fenced_out(exc) from exc
        return deleted, intent
