"""The llumlet: one engine, its request bookkeeping, token pushes, load reports and live migration.

One asyncio loop. The engine is not thread-safe: every engine call runs in one worker thread under one
``asyncio.Lock`` (so a call waits at most one step and the event loop never blocks on the engine), and the
engine loop applies a step's results under the same lock — whatever runs "between two steps" (suspend, read
the last blocks) sees the token numbering of every step before it.

Migration, source side (``migrate_out``; DESIGN.md "Migration", docs/migration.md):

1. check the fencing token (``FencingGuard``), that the request runs here in decode, choose the transport;
2. ``Reserve`` the request's blocks at the destination (reservation ``<request_id>@<attempt>``);
3. pre-copy stages: copy every full block not yet copied while the request keeps decoding; a stage ends with
   the destination's reply; stop when the new full blocks are <= ``stop_remaining_blocks`` or after
   ``max_stages`` stages (``0`` = stop-and-copy);
4. suspend the request between two steps, copy the rest (partial block included) while flushing its pushed
   tokens to the origin, ``Commit`` with the state, the origin, the next seq and the next owner epoch;
5. on success free the blocks here (``free_migrated``) and remember where the request went (aborts are
   forwarded); on any failure ``Release`` the destination (best effort; it also expires) and resume here.

Destination side (``reserve`` / ``write_blocks`` / ``commit`` / ``release``): one reservation per request,
of its newest attempt; an older attempt's message is answered ``DEST_STALE`` and changes nothing; every
message of the current attempt extends the reservation's expiry; a reaper releases expired reservations.
``commit`` adopts the request, announces the new owner epoch to the origin (acknowledged before answering),
and the engine loop resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import grpc

from clusterstate.fencing import FencingGuard, StaleToken
from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.backends.base import Backend
from llumlet.client import LlumletClient
from llumlet.convert import UnmovableStateError, load_to_pb, state_from_pb, state_to_pb
from llumlet.engine.protocol import KVPayload
from llumlet.engine.types import EngineRequest, MigrationState, StepResult
from llumlet.tokens import PushOutcome, TokenChunkOut, TokenPusher
from llumlet.transport import Transport, TransportError, TransportName, choose_transport, read_shm
from topology.graph import TopologyGraph
from topology.spec import Topology

__all__ = [
    "Llumlet",
    "LlumletConfig",
    "MigrationCommand",
    "MigrationConfig",
    "MigrationHooks",
    "MigrationOutcome",
    "MigrationReport",
    "StageStats",
]

_log = logging.getLogger(__name__)
_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """Migration settings of one llumlet (the command may override stages and the rate cap)."""

    max_stages: int = 4  # pre-copy stages at most before the last one
    stop_remaining_blocks: int = 2  # go to the last stage when at most this many new full blocks remain
    reservation_expiry_s: float = 5.0  # a reservation with no message for this long is released
    cap_fraction: float = 0.2  # grpc transport: share of the path bandwidth (topology.cost default)
    grpc_rate_cap_bytes_per_s: float = 0.0  # grpc transport cap; 0 = path bandwidth x cap_fraction, or none
    local_rate_cap_bytes_per_s: float = 0.0  # local transport cap; 0 = none
    chunk_bytes: int = 1 << 20  # blocks per message: this many logical bytes at most (>= 1 block)
    rpc_timeout_s: float = 10.0  # deadline of the control RPCs to the destination

    def __post_init__(self) -> None:
        if self.max_stages < 0 or self.stop_remaining_blocks < 0:
            raise ValueError(f"MigrationConfig: negative max_stages / stop_remaining_blocks in {self}")
        if self.reservation_expiry_s <= 0 or self.rpc_timeout_s <= 0 or self.chunk_bytes < 1:
            raise ValueError(f"MigrationConfig: reservation_expiry_s, rpc_timeout_s, chunk_bytes must be > 0: {self}")
        if not 0 < self.cap_fraction <= 1:
            raise ValueError(f"MigrationConfig.cap_fraction = {self.cap_fraction}: need 0 < f <= 1")


@dataclass(frozen=True, slots=True)
class LlumletConfig:
    """Identity and settings of one llumlet."""

    instance_id: str
    domain_id: str = ""
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    load_min_interval_s: float = 0.01  # WatchLoad: at most one report per this interval by default
    moved_ttl_s: float = 300.0  # remember where a request migrated to (abort forwarding) this long
    push_retries: int = 5  # retries of one token push
    idle_retry_s: float = 0.005  # wait after a step that scheduled nothing (queued work did not fit)


class MigrationOutcome(enum.Enum):
    """How a MigrateOut ended."""

    COMMITTED = "committed"  # the request runs on the destination now
    ABORTED = "aborted"  # started, undone: the request continues here, or it ended meanwhile
    REFUSED = "refused"  # never started


@dataclass(frozen=True, slots=True)
class MigrationCommand:
    """A MigrateOut command (``hilum.v1.MigrateOutRequest``)."""

    request_id: str
    dst_address: str  # host:port of the destination llumlet
    attempt: int  # >= 1, grows with every migration try of this request (cluster-wide)
    dst_instance_id: str = ""  # "" = ask the destination
    transport: TransportName | None = None  # None = by the topology
    fencing_token: int = 0  # 0 = unfenced (intra-domain)
    rate_cap_bytes_per_s: float = 0.0  # 0 = the configured default
    stop_and_copy: bool = False  # naive baseline: suspend first, copy everything
    max_stages: int | None = None
    stop_remaining_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class StageStats:
    """One stage of a migration."""

    stage: int  # 0, 1, ...
    last: bool  # the stage copied while the request was suspended
    blocks: int
    bytes: int  # logical KV bytes
    seconds: float


@dataclass(frozen=True, slots=True)
class MigrationReport:
    """What a MigrateOut did."""

    outcome: MigrationOutcome
    reason: str = ""
    transport: str = ""
    rate_cap_bytes_per_s: float = 0.0
    stages: tuple[StageStats, ...] = ()
    total_s: float = 0.0  # command -> committed (or given up)
    downtime_s: float = 0.0  # suspended -> destination committed

    @property
    def blocks(self) -> int:
        """Blocks copied in all stages."""
        return sum(s.blocks for s in self.stages)

    @property
    def bytes(self) -> int:
        """Logical bytes copied in all stages."""
        return sum(s.bytes for s in self.stages)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Bytes / seconds spent in stages (0 when nothing moved)."""
        seconds = sum(s.seconds for s in self.stages)
        return self.bytes / seconds if seconds > 0 else 0.0


class MigrationHooks:
    """Test seams of the source side; the defaults do nothing."""

    async def stage_copied(self, request_id: str, attempt: int, stage: int) -> None:
        """After a pre-copy stage was acknowledged (the request is still decoding)."""

    async def before_commit(self, request_id: str, attempt: int) -> None:
        """After the last stage was copied, before Commit is sent (the request is suspended)."""


@dataclass(slots=True)
class _Owned:
    """A request this llumlet runs (queued, running or suspended)."""

    request_id: str
    origin: str  # TokenSink address
    next_seq: int  # seq of the next token
    epoch: int  # owner epoch (committed migrations so far)
    migrating: int = 0  # attempt of the outgoing migration in flight, 0 = none
    committing: bool = False  # Commit sent, outcome unknown
    abort_requested: bool = False  # the client aborted while committing


@dataclass(slots=True)
class _Reservation:
    request_id: str
    attempt: int
    reservation_id: str
    src_instance_id: str
    expiry_s: float
    deadline: float
    blocks: int


class _Ended(Exception):
    """The request finished or was aborted on the source during the migration."""


class _Failed(Exception):
    """The migration failed; the request continues on the source."""


def reservation_id(request_id: str, attempt: int) -> str:
    """The destination's reservation id of ``(request_id, attempt)``."""
    return f"{request_id}@{attempt}"


class Llumlet:
    """One instance's agent. Create, ``await start(address)``, serve (``llumlet.server``), ``await stop()``.

    Args:
        config: identity and settings.
        backend: the engine and how to pace it.
        topology: chooses transports and rate caps (``TopologyGraph.path``); None = grpc, configured caps.
        rng: jitter of retries.
        clock: monotonic seconds (durations, expiry); wall_clock: seconds since the epoch (arrival times).
        hooks: test seams of the migration.
        transport_for: replaces the topology's transport choice (tests).
    """

    def __init__(
        self,
        config: LlumletConfig,
        backend: Backend,
        *,
        topology: Topology | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        hooks: MigrationHooks | None = None,
        transport_for: Callable[[MigrationCommand], Transport] | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.engine = backend.engine
        self.graph = TopologyGraph(topology) if topology is not None else None
        self._rng = rng or random.Random(0)
        self._clock = clock
        self._wall_clock = wall_clock
        self._hooks = hooks or MigrationHooks()
        self._transport_for = transport_for
        self.address = ""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{config.instance_id}")
        self._lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._owned: dict[str, _Owned] = {}
        self._moved: dict[str, tuple[str, float]] = {}  # request_id -> (destination address, when)
        self._reservations: dict[str, _Reservation] = {}  # request_id -> its newest attempt's reservation
        self._attempts: dict[str, tuple[int, float]] = {}  # request_id -> (newest attempt seen, when)
        self._committed: dict[tuple[str, int], float] = {}  # (request_id, attempt) committed here -> when
        self._fence = FencingGuard()
        self._peers: dict[str, LlumletClient] = {}
        self._migrations_out = 0
        self._version = 0
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._pusher: TokenPusher | None = None

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self, address: str) -> None:
        """Start the engine loop and the reservation reaper; ``address`` is this llumlet's ``host:port``."""
        self.address = address
        self._pusher = TokenPusher(
            self.config.instance_id, address, self._on_push_failure, self._rng, retries=self.config.push_retries
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._engine_loop(), name="engine-loop"),
            loop.create_task(self._reaper(), name="reservation-reaper"),
        ]

    async def stop(self) -> None:
        """Stop the loops, close the pusher and the peer channels, shut the engine thread down."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pusher is not None:
            await self._pusher.close()
        for peer in self._peers.values():
            await peer.close()
        self._executor.shutdown(wait=True)

    @property
    def pusher(self) -> TokenPusher:
        """The token pusher (after ``start``)."""
        if self._pusher is None:
            raise RuntimeError(f"llumlet {self.config.instance_id}: not started")
        return self._pusher

    # ---- engine access ----------------------------------------------------------------------------
    async def _call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run one engine call in the engine thread, between two steps."""
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(fn, *args, **kwargs)
            )

    def _bump(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._work.clear()
            async with self._lock:
                busy = self.engine.has_work()
            if not busy:
                await self._work.wait()
                continue
            t0 = self._clock()
            async with self._lock:
                result = await loop.run_in_executor(self._executor, self.engine.step)
                self._apply(result)
            if result.is_idle:
                await asyncio.sleep(self.config.idle_retry_s)
                continue
            rest_s = self.backend.step_wall_s(result) - (self._clock() - t0)
            await asyncio.sleep(max(0.0, rest_s))

    def _apply(self, result: StepResult) -> None:
        """Push the step's tokens (numbered), retire finished requests. Runs under the engine lock."""
        finished = set(result.finished)
        for rid, n in result.new_tokens.items():
            rec = self._owned.get(rid)
            if rec is None or n <= 0:
                continue
            if self.backend.real_token_ids:
                ids = list(result.token_ids.get(rid, ()))
            else:
                ids = list(range(rec.next_seq, rec.next_seq + n))
            done = rid in finished
            reason = result.finish_reasons.get(rid, "length") if done else ""
            self.pusher.push(rec.origin, TokenChunkOut(rid, rec.next_seq, ids, rec.epoch, done, reason))
            rec.next_seq += len(ids)
        for rid in result.finished:
            rec = self._owned.pop(rid, None)
            if rec is not None and result.new_tokens.get(rid, 0) <= 0:
                reason = result.finish_reasons.get(rid, "length")
                self.pusher.push(rec.origin, TokenChunkOut(rid, rec.next_seq, [], rec.epoch, True, reason))
        if result.new_tokens or result.finished or result.preempted:
            self._bump()

    # ---- requests -----------------------------------------------------------------------------------
    async def submit(self, request: EngineRequest, origin: str) -> str | None:
        """Queue a request whose tokens go to ``origin``; the reason when it is not accepted, else None."""
        rid = request.request_id
        if rid in self._owned or rid in self._reservations:
            return f"{self.config.instance_id}: request {rid!r} is already here"
        try:
            await self._call(self.engine.add_request, request)
        except ValueError as exc:  # RequestTooLargeError, duplicate id
            return str(exc)
        self._owned[rid] = _Owned(rid, origin, next_seq=0, epoch=0)
        self._moved.pop(rid, None)
        self._work.set()
        self._bump()
        return None

    def arrival_s(self) -> float:
        """Arrival time stamp of a new request (wall clock, comparable across hosts)."""
        return self._wall_clock()

    async def abort(self, request_id: str) -> tuple[bool, str]:
        """Abort a request: here, or forwarded to where it migrated. (found, forwarded_to address).

        A forward to a destination that does not answer gives (False, its address).
        """
        rec = self._owned.get(request_id)
        if rec is not None:
            if rec.committing:
                rec.abort_requested = True  # the migration decides where the abort applies
                return True, ""
            await self._drop(request_id, push=("abort", ""))
            return True, ""
        moved = self._moved.get(request_id)
        if moved is not None:
            try:
                reply = await self._peer(moved[0]).abort(request_id)
            except grpc.aio.AioRpcError as exc:
                _log.warning(
                    "%s: abort of %s not forwarded to %s: %s", self.config.instance_id, request_id, moved[0], exc
                )
                return False, moved[0]
            return reply.found, reply.forwarded_to or moved[0]
        return False, ""

    async def _drop(self, request_id: str, push: tuple[str, str] | None) -> None:
        """Remove a request from the engine and the books; push its end (reason, error) unless ``push`` is None."""
        await self._call(self.engine.abort, request_id)
        rec = self._owned.pop(request_id, None)
        if rec is not None and push is not None:
            reason, error = push
            self.pusher.push(rec.origin, TokenChunkOut(request_id, rec.next_seq, [], rec.epoch, True, reason, error))
        self._bump()

    def _on_push_failure(self, request_id: str, outcome: PushOutcome, reason: str) -> None:
        rec = self._owned.get(request_id)
        if rec is None or rec.committing:
            return  # gone, or a migration in flight handles it
        _log.warning("%s: dropping %s: %s", self.config.instance_id, request_id, reason)
        task = asyncio.get_running_loop().create_task(self._drop(request_id, push=None))
        self._tasks.append(task)

    # ---- load -----------------------------------------------------------------------------------------
    async def load_report(self) -> pb.LoadReport:
        """Engine load plus the llumlet's counters."""
        load = await self._call(self.engine.load)
        msg = load_to_pb(load, self.config.instance_id, self.config.domain_id)
        msg.num_requests = len(self._owned)
        msg.num_reservations = len(self._reservations)
        msg.num_migrations_out = self._migrations_out
        msg.version = self._version
        return msg

    async def watch_load(self, min_interval_s: float) -> AsyncIterator[pb.LoadReport]:
        """The load now, then after every change (at most one report per ``min_interval_s``)."""
        interval = min_interval_s or self.config.load_min_interval_s
        seen = -1
        while True:
            if seen == self._version:
                await self._changed.wait()
            seen = self._version
            yield await self.load_report()
            await asyncio.sleep(interval)

    def ping(self) -> pb.LlumletPingReply:
        """Identity and block geometry."""
        return pb.LlumletPingReply(
            instance_id=self.config.instance_id,
            domain_id=self.config.domain_id,
            engine=self.backend.name,
            block_size_tokens=self.engine.block_size_tokens,
            kv_bytes_per_block=self.engine.kv_bytes_per_block,
        )

    # ---- migration: source side -------------------------------------------------------------------------
    def _peer(self, address: str) -> LlumletClient:
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = LlumletClient(address, timeout_s=self.config.migration.rpc_timeout_s)
        return peer

    async def migrate_out(self, cmd: MigrationCommand) -> MigrationReport:
        """Migrate ``cmd.request_id`` to ``cmd.dst_address``; see the module doc. Never raises for RPC errors."""
        t0 = self._clock()
        rid = cmd.request_id
        refused = self._precheck(cmd)
        if refused is not None:
            return MigrationReport(MigrationOutcome.REFUSED, refused)
        reason = await self._call(self.engine.migratable, rid)
        if reason is not None:
            return MigrationReport(MigrationOutcome.REFUSED, reason)
        rec = self._owned.get(rid)
        if rec is None or rec.migrating:
            return MigrationReport(MigrationOutcome.REFUSED, f"{self.config.instance_id}: {rid!r} left or is migrating")
        rec.migrating = cmd.attempt
        self._migrations_out += 1
        self._bump()
        try:
            try:
                transport = await self._choose_transport(cmd)
            except (KeyError, ValueError, grpc.aio.AioRpcError) as exc:
                return MigrationReport(MigrationOutcome.REFUSED, f"no transport to {cmd.dst_address}: {exc}")
            report = await self._migrate(rec, cmd, transport, t0)
        finally:
            rec.migrating = 0
            rec.committing = False
            self._migrations_out -= 1
            self._bump()
        _log.info(
            "%s: migrate %s@%d -> %s: %s %s (%d blocks, %.1f ms, downtime %.1f ms)",
            self.config.instance_id,
            rid,
            cmd.attempt,
            cmd.dst_address,
            report.outcome.value,
            report.reason,
            report.blocks,
            report.total_s * 1e3,
            report.downtime_s * 1e3,
        )
        return report

    def _precheck(self, cmd: MigrationCommand) -> str | None:
        me = self.config.instance_id
        if cmd.attempt < 1:
            return f"{me}: attempt = {cmd.attempt}, need >= 1"
        if not cmd.dst_address or cmd.dst_address == self.address:
            return f"{me}: bad destination address {cmd.dst_address!r}"
        if cmd.fencing_token:
            try:
                self._fence.check(cmd.fencing_token)
            except (StaleToken, ValueError) as exc:
                return f"{me}: {exc}"
        rec = self._owned.get(cmd.request_id)
        if rec is None:
            return f"{me}: request {cmd.request_id!r} does not run here"
        if rec.migrating:
            return f"{me}: request {cmd.request_id!r} is already migrating (attempt {rec.migrating})"
        return None

    async def _choose_transport(self, cmd: MigrationCommand) -> Transport:
        if self._transport_for is not None:
            return self._transport_for(cmd)
        dst_id = cmd.dst_instance_id
        if self.graph is not None and not dst_id:
            dst_id = (await self._peer(cmd.dst_address).ping()).instance_id
        cfg = self.config.migration
        return choose_transport(
            cmd.transport,
            self.graph,
            self.config.instance_id,
            dst_id,
            cap_fraction=cfg.cap_fraction,
            grpc_rate_cap_bytes_per_s=cfg.grpc_rate_cap_bytes_per_s,
            local_rate_cap_bytes_per_s=cfg.local_rate_cap_bytes_per_s,
            override_rate_cap_bytes_per_s=cmd.rate_cap_bytes_per_s,
        )

    async def _migrate(self, rec: _Owned, cmd: MigrationCommand, transport: Transport, t0: float) -> MigrationReport:
        cfg = self.config.migration
        rid, attempt = cmd.request_id, cmd.attempt
        peer = self._peer(cmd.dst_address)
        max_stages = 0 if cmd.stop_and_copy else (cfg.max_stages if cmd.max_stages is None else cmd.max_stages)
        threshold = cfg.stop_remaining_blocks if cmd.stop_remaining_blocks is None else cmd.stop_remaining_blocks
        block_size = self.engine.block_size_tokens
        stages: list[StageStats] = []
        copied = 0  # blocks [0, copied) are at the destination
        reserved = 0
        suspended: MigrationState | None = None

        def report(outcome: MigrationOutcome, reason: str = "", downtime_s: float = 0.0) -> MigrationReport:
            return MigrationReport(
                outcome,
                reason,
                transport.name.value,
                transport.rate_cap_bytes_per_s,
                tuple(stages),
                self._clock() - t0,
                downtime_s,
            )

        try:
            kv = await self._call(self.engine.request_kv, rid)
            if kv is None:
                return report(MigrationOutcome.REFUSED, f"{rid!r} finished before the migration started")
            reply = await peer.reserve(
                rid, attempt, kv[1], src_instance_id=self.config.instance_id, expiry_s=cfg.reservation_expiry_s
            )
            if reply.status != pb.DEST_OK:
                return report(
                    MigrationOutcome.REFUSED,
                    f"destination {cmd.dst_address}: {pb.DestStatus.Name(reply.status)}: {reply.reason}",
                )
            reserved = reply.num_blocks
            # pre-copy stages: the request keeps decoding
            while True:
                tokens, _ = await self._kv_or_end(rec)
                full = tokens // block_size
                if len(stages) >= max_stages or full - copied <= threshold:
                    break
                reserved = await self._grow(peer, rid, attempt, full, reserved)
                stages.append(await self._copy(peer, transport, rec, copied, full, len(stages), last=False))
                copied = full
                await self._hooks.stage_copied(rid, attempt, len(stages) - 1)
            # last stage: suspended between two steps. Grow the reservation first, while the request still
            # decodes, by one block for a step that may run before the suspension: the last stage then
            # rarely needs a Reserve round trip in the downtime (best effort: it grows there if needed).
            _, held = await self._kv_or_end(rec)
            with contextlib.suppress(_Failed):
                reserved = await self._grow(peer, rid, attempt, held + 1, reserved)
            self._check_alive(rec)
            suspended = await self._call(self.engine.suspend, rid)
            if suspended is None:
                raise _Ended(f"{rid!r} finished (or left decode) before the last stage")
            t_suspend = self._clock()
            if suspended.num_output_tokens != rec.next_seq:
                raise _Failed(f"token numbering mismatch: engine {suspended.num_output_tokens}, llumlet {rec.next_seq}")
            state_msg = state_to_pb(suspended)
            _, held = await self._kv_or_end(rec)
            reserved = await self._grow(peer, rid, attempt, held, reserved)
            flushed = asyncio.ensure_future(self.pusher.flush(rid))
            try:
                stages.append(await self._copy(peer, transport, rec, copied, held, len(stages), last=True))
            finally:
                pushed = await flushed
            if pushed is not PushOutcome.ACKED:
                raise _Ended(f"the origin of {rid!r} no longer takes its tokens ({pushed.value})")
            await self._hooks.before_commit(rid, attempt)
            self._check_alive(rec)
            rec.committing = True
            commit = pb.CommitRequest(
                request_id=rid,
                attempt=attempt,
                state=state_msg,
                origin=rec.origin,
                next_seq=rec.next_seq,
                epoch=rec.epoch + 1,
                src_instance_id=self.config.instance_id,
            )
            await self._commit(peer, commit)
        except _Ended as exc:
            await self._undo(peer, rec, attempt, suspended)
            return report(MigrationOutcome.ABORTED, str(exc))
        except (_Failed, TransportError, UnmovableStateError, KeyError, IndexError, grpc.aio.AioRpcError) as exc:
            await self._undo(peer, rec, attempt, suspended)
            why = _describe(exc)
            if rid not in self._owned:
                why = f"{rid!r} ended during the migration ({why})"
            return report(MigrationOutcome.ABORTED, why)
        except Exception as exc:  # a bug must not leave the request suspended: undo, report, log
            _log.exception("%s: migration of %s@%d failed", self.config.instance_id, rid, attempt)
            await self._undo(peer, rec, attempt, suspended)
            return report(MigrationOutcome.ABORTED, f"internal error: {type(exc).__name__}: {exc}")
        # committed: the destination runs the request now
        await self._call(self.engine.free_migrated, rid)
        self._owned.pop(rid, None)
        self._moved[rid] = (cmd.dst_address, self._clock())
        downtime_s = self._clock() - t_suspend
        if rec.abort_requested:
            task = asyncio.get_running_loop().create_task(self._forward_abort(cmd.dst_address, rid))
            self._tasks.append(task)
        self._bump()
        return report(MigrationOutcome.COMMITTED, "", downtime_s)

    def _check_alive(self, rec: _Owned) -> None:
        if self._owned.get(rec.request_id) is not rec:
            raise _Ended(f"{rec.request_id!r} finished or was aborted during the migration")
        if rec.abort_requested:
            raise _Ended(f"{rec.request_id!r} was aborted by the client during the migration")

    async def _kv_or_end(self, rec: _Owned) -> tuple[int, int]:
        self._check_alive(rec)
        kv = await self._call(self.engine.request_kv, rec.request_id)
        if kv is None:
            raise _Ended(f"{rec.request_id!r} finished during the migration")
        return kv

    async def _grow(self, peer: LlumletClient, rid: str, attempt: int, n_blocks: int, reserved: int) -> int:
        if n_blocks <= reserved:
            return reserved
        reply = await peer.reserve(
            rid, attempt, n_blocks, src_instance_id=self.config.instance_id,
            expiry_s=self.config.migration.reservation_expiry_s,
        )  # fmt: skip
        if reply.status != pb.DEST_OK:
            raise _Failed(f"destination could not grow the reservation to {n_blocks} blocks: {reply.reason}")
        return reply.num_blocks

    async def _copy(
        self, peer: LlumletClient, transport: Transport, rec: _Owned, first: int, end: int, stage: int, last: bool
    ) -> StageStats:
        """Copy blocks ``[first, end)`` of the request as one stage.

        The blocks are pinned down under the engine lock once (``Engine.begin_read``) and copied out in a
        worker thread without it, one message (``chunk_bytes``) at a time, while the engine keeps stepping;
        a pre-copy stage then checks under the lock that the request held those blocks throughout.
        """
        if end <= first:
            return StageStats(stage, last, 0, 0, 0.0)
        per_msg = max(1, self.config.migration.chunk_bytes // max(1, self.engine.kv_bytes_per_block))
        stream = transport.open(peer.stub, rec.request_id, rec.migrating)
        try:
            run = await self._call(self.engine.begin_read, rec.request_id, first, end - first)
            for pos in range(first, end, per_msg):
                if not last:
                    self._check_alive(rec)
                payload: KVPayload = await asyncio.to_thread(run.copy, pos, min(per_msg, end - pos))
                await stream.send(payload)
            if not last and not await self._call(run.still_valid):
                self._check_alive(rec)  # it finished (or was aborted): _Ended
                raise _Failed(f"{rec.request_id!r} was preempted during pre-copy stage {stage}: its blocks were freed")
            stats = await stream.close()
        except BaseException:
            await stream.abort()
            raise
        return StageStats(stage, last, stats.blocks, stats.bytes, stats.seconds)

    async def _commit(self, peer: LlumletClient, msg: pb.CommitRequest) -> None:
        """Send Commit; on an RPC error ask the destination (Release) whether it committed. Raises _Failed."""
        try:
            reply = await peer.commit(msg)
        except grpc.aio.AioRpcError as exc:
            try:
                rel = await peer.release(msg.request_id, msg.attempt, timeout_s=2.0)
            except grpc.aio.AioRpcError:
                raise _Failed(f"Commit broke ({_describe(exc)}) and the destination does not answer") from exc
            if rel.committed:
                return
            raise _Failed(f"Commit broke ({_describe(exc)}); the destination released the reservation") from exc
        if reply.status != pb.DEST_OK:
            raise _Failed(f"destination refused the commit ({pb.DestStatus.Name(reply.status)}): {reply.reason}")

    async def _undo(self, peer: LlumletClient, rec: _Owned, attempt: int, suspended: MigrationState | None) -> None:
        """After a failed or ended migration: release the destination, resume (or abort) the request here."""
        try:
            await peer.release(rec.request_id, attempt, timeout_s=2.0)
        except grpc.aio.AioRpcError as exc:
            _log.warning(
                "%s: release of %s@%d at %s failed (%s); it expires there",
                self.config.instance_id, rec.request_id, attempt, peer.address, _describe(exc),
            )  # fmt: skip
        rec.committing = False
        if suspended is None or self._owned.get(rec.request_id) is not rec:
            return
        if rec.abort_requested:
            await self._drop(rec.request_id, push=("abort", ""))
            return
        await self._call(self.engine.resume, rec.request_id)
        self._work.set()

    async def _forward_abort(self, address: str, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._peer(address).abort(request_id)

    # ---- migration: destination side ----------------------------------------------------------------
    def _current(self, request_id: str, attempt: int) -> tuple[_Reservation | None, pb.DestStatus.ValueType, str]:
        """The reservation of ``(request_id, attempt)`` or (None, status, reason)."""
        newest = self._attempts.get(request_id, (0, 0.0))[0]
        if attempt < newest:
            return None, pb.DEST_STALE, f"attempt {attempt} of {request_id!r} is older than attempt {newest}"
        cur = self._reservations.get(request_id)
        if cur is None or cur.attempt != attempt:
            rid = reservation_id(request_id, attempt)
            return None, pb.DEST_REFUSED, f"{self.config.instance_id}: no reservation {rid!r} (expired or released)"
        return cur, pb.DEST_OK, ""

    async def reserve(self, msg: pb.ReserveRequest) -> pb.ReserveReply:
        """Reserve, or grow the reservation of the same attempt (see module doc)."""
        rid, attempt, me = msg.request_id, msg.attempt, self.config.instance_id
        if not rid or attempt < 1:
            return pb.ReserveReply(status=pb.DEST_REFUSED, reason=f"{me}: need a request_id and attempt >= 1")
        newest = self._attempts.get(rid, (0, 0.0))[0]
        if attempt < newest:
            return pb.ReserveReply(status=pb.DEST_STALE, reason=f"attempt {attempt} of {rid!r} < newest {newest}")
        if (rid, attempt) in self._committed or rid in self._owned:
            return pb.ReserveReply(status=pb.DEST_REFUSED, reason=f"{me}: {rid!r} already runs here")
        self._attempts[rid] = (attempt, self._clock())
        cur = self._reservations.get(rid)
        if cur is not None and cur.attempt != attempt:  # an older attempt's leftovers
            await self._release_local(cur, f"superseded by attempt {attempt}")
            cur = None
        res_id = reservation_id(rid, attempt)
        if cur is None:
            ok = await self._call(self.engine.reserve, res_id, msg.num_blocks)
            expiry = msg.expiry_s or self.config.migration.reservation_expiry_s
            if ok:
                cur = _Reservation(rid, attempt, res_id, msg.src_instance_id, expiry, 0.0, msg.num_blocks)
                self._reservations[rid] = cur
        else:
            ok = await self._call(self.engine.grow_reservation, res_id, msg.num_blocks)
            if ok:
                cur.blocks = max(cur.blocks, msg.num_blocks)
        if not ok or cur is None:
            free = (await self._call(self.engine.load)).free_blocks
            return pb.ReserveReply(
                status=pb.DEST_NO_ROOM,
                reason=f"{me}: {msg.num_blocks} blocks asked, {free} free",
                reservation_id=res_id,
            )
        cur.deadline = self._clock() + cur.expiry_s
        self._bump()
        return pb.ReserveReply(status=pb.DEST_OK, reservation_id=res_id, num_blocks=cur.blocks)

    async def write_blocks(self, chunks: AsyncIterator[pb.BlockChunk]) -> pb.WriteBlocksReply:
        """Store a stream of block runs into their reservation."""
        written = nbytes = 0
        async for chunk in chunks:
            cur, status, reason = self._current(chunk.request_id, chunk.attempt)
            if cur is None:
                return pb.WriteBlocksReply(status=status, reason=reason, blocks_written=written, bytes_written=nbytes)
            try:
                data = read_shm(chunk.shm) if chunk.shm.name else chunk.data
                payload = KVPayload(chunk.first_block, chunk.num_blocks, chunk.nbytes, data)
                await self._call(self.engine.write_blocks, cur.reservation_id, payload)
            except (TransportError, KeyError, IndexError, ValueError) as exc:
                return pb.WriteBlocksReply(
                    status=pb.DEST_FAILED, reason=_describe(exc), blocks_written=written, bytes_written=nbytes
                )
            cur.deadline = self._clock() + cur.expiry_s
            written += chunk.num_blocks
            nbytes += chunk.nbytes
        return pb.WriteBlocksReply(status=pb.DEST_OK, blocks_written=written, bytes_written=nbytes)

    async def commit(self, msg: pb.CommitRequest) -> pb.CommitReply:
        """Adopt the request, announce the new owner to its origin, resume it."""
        rid, attempt, me = msg.request_id, msg.attempt, self.config.instance_id
        cur, status, reason = self._current(rid, attempt)
        if cur is None:
            return pb.CommitReply(status=status, reason=reason)
        if rid in self._owned:
            return pb.CommitReply(status=pb.DEST_REFUSED, reason=f"{me}: {rid!r} already runs here")
        if not msg.origin:
            return pb.CommitReply(status=pb.DEST_FAILED, reason=f"{me}: commit of {rid!r} names no origin")
        try:
            state = state_from_pb(msg.state)
        except ValueError as exc:
            return pb.CommitReply(status=pb.DEST_FAILED, reason=f"{me}: bad state of {rid!r}: {exc}")
        if state.request_id != rid:
            return pb.CommitReply(status=pb.DEST_FAILED, reason=f"{me}: state is of {state.request_id!r}, not {rid!r}")
        loop = asyncio.get_running_loop()
        async with self._lock:
            try:
                fn = functools.partial(self.engine.commit_incoming, cur.reservation_id, state)
                ok = await loop.run_in_executor(self._executor, fn)
            except (KeyError, ValueError) as exc:
                return pb.CommitReply(status=pb.DEST_FAILED, reason=f"{me}: {exc}")
            if not ok:
                return pb.CommitReply(status=pb.DEST_NO_ROOM, reason=f"{me}: the grown request of {rid!r} does not fit")
            del self._reservations[rid]
            self._committed[(rid, attempt)] = self._clock()
            self._owned[rid] = _Owned(rid, msg.origin, next_seq=msg.next_seq, epoch=msg.epoch)
            self._moved.pop(rid, None)
            self.pusher.push(msg.origin, TokenChunkOut(rid, msg.next_seq, [], msg.epoch))  # ownership
        self._work.set()
        self._bump()
        outcome = await self.pusher.flush(rid)
        if outcome is not PushOutcome.ACKED:
            if rid in self._owned:
                await self._drop(rid, push=None)
            return pb.CommitReply(status=pb.DEST_FAILED, reason=f"{me}: origin {msg.origin}: {outcome.value}")
        return pb.CommitReply(status=pb.DEST_OK)

    async def release(self, msg: pb.ReleaseRequest) -> pb.ReleaseReply:
        """Release ``(request_id, attempt)``'s reservation; idempotent; says if that attempt committed here."""
        rid, attempt = msg.request_id, msg.attempt
        if (rid, attempt) in self._committed:
            return pb.ReleaseReply(status=pb.DEST_OK, committed=True)
        if attempt < self._attempts.get(rid, (0, 0.0))[0]:
            return pb.ReleaseReply(status=pb.DEST_STALE)
        cur = self._reservations.get(rid)
        if cur is None or cur.attempt != attempt:
            return pb.ReleaseReply(status=pb.DEST_OK)
        n = await self._release_local(cur, "released by the source")
        return pb.ReleaseReply(status=pb.DEST_OK, released_blocks=n)

    async def _release_local(self, cur: _Reservation, why: str) -> int:
        if self._reservations.get(cur.request_id) is cur:
            del self._reservations[cur.request_id]
        n = await self._call(self.engine.release_reservation, cur.reservation_id)
        _log.info("%s: reservation %s (%d blocks) released: %s", self.config.instance_id, cur.reservation_id, n, why)
        self._bump()
        return n

    async def _reaper(self) -> None:
        period = max(0.02, min(0.25, self.config.migration.reservation_expiry_s / 4))
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            for cur in [r for r in self._reservations.values() if r.deadline <= now]:
                await self._release_local(cur, f"expired (no message for {cur.expiry_s} s)")
            horizon = now - self.config.moved_ttl_s
            self._moved = {k: v for k, v in self._moved.items() if v[1] > horizon}
            self._committed = {k: t for k, t in self._committed.items() if t > horizon}
            self._attempts = {k: v for k, v in self._attempts.items() if v[1] > horizon or k in self._reservations}
            self._tasks = [
                t for t in self._tasks if not t.done() or t.get_name() in ("engine-loop", "reservation-reaper")
            ]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)
