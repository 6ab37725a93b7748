"""The source side of a live migration: ``MigrateOut`` (DESIGN.md "Migration", docs/migration.md).

1. check the fencing token (``FencingGuard``), that the request runs here in decode, choose the transport;
2. ``Reserve`` the request's blocks at the destination (reservation ``<request_id>@<attempt>``); the reply
   says which leading prefix blocks it caches (not sent) and its estimate of re-prefilling the rest of the
   prompt's blocks. With an estimate and a rate cap, the move is priced with ``topology.cost.plan_migration``
   (the cost model the simulator's executor prices with too): when its plan is ``pre-copy+recompute-prefix``, a
   second Reserve asks the destination to re-prefill those blocks, which are then not sent either;
3. pre-copy stages: copy every full block not yet copied while the request keeps decoding; a stage ends with
   the destination's reply; when to stop is ``topology.cost.PrecopyRule`` — the rule the cost model prices
   moves with (``0`` stages = stop-and-copy);
4. suspend the request between two steps, copy the rest (partial block included) while flushing its pushed
   tokens to the origin, ``Commit`` with the state, the origin, the next seq and the next owner epoch;
5. on success free the blocks here (``free_migrated``) and remember where the request went (aborts are
   forwarded); on any failure before the Commit ``Release`` the destination (best effort; it also expires)
   and resume here. A failure inside ``suspend`` resumes the request too (whatever the engine did before it
   raised).

When the Commit's answer is lost (deadline, broken connection) the source must learn the outcome before it
either resumes or frees the request, or two engines would run it. It asks again (Commit is idempotent: the
destination answers the first one's outcome, waiting for it); if the destination cannot answer, it asks the
request's origin, the arbiter of ownership: it claims the next owner epoch there (``EngineDriver.claim``).
The origin takes the first of that claim and the destination's announcement: claim taken → the source
resumes as owner and the destination, whose announcement is refused, drops its copy; claim refused → the
destination owns the request and the source frees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from clusterstate.fencing import FencingGuard, StaleToken
from llumlet.client import LlumletClient
from llumlet.convert import UnmovableStateError
from llumlet.driver import EngineDriver, Owned
from llumlet.engine.types import MigrationState
from llumlet.linkbudget import LinkBudgets
from llumlet.migration_types import (
    CommitCall,
    DestStatus,
    MigrationCommand,
    MigrationConfig,
    MigrationHooks,
    MigrationOutcome,
    MigrationReport,
    StageStats,
)
from llumlet.tokens import PushOutcome
from llumlet.transport import Transport, TransportError, choose_transport
from topology.cost import DEFAULT_DECODE_STEP_S, MigrationCostInput, MigrationPlan, PrecopyRule, plan_migration
from topology.graph import TopologyGraph

__all__ = ["MigrationSource"]

_log = logging.getLogger(__name__)


class _Ended(Exception):
    """The request finished or was aborted on the source during the migration."""


class _Failed(Exception):
    """The migration failed; the request continues on the source."""


@dataclass(frozen=True, slots=True)
class _CommitOutcome:
    moved: bool  # the destination runs the request (else: this instance does, its claim was taken)
    reason: str  # how it was learned, when not from the first Commit's answer


class MigrationSource:
    """Moves requests of one llumlet to other llumlets (see the module docstring).

    Args:
        driver: the llumlet's engine driver.
        config: migration settings.
        graph: chooses transports and rate caps (``TopologyGraph.path``); None = grpc, configured caps.
        hooks: test seams.
        transport_for: replaces the topology's transport choice (tests).
    """

    def __init__(
        self,
        driver: EngineDriver,
        config: MigrationConfig,
        *,
        graph: TopologyGraph | None = None,
        hooks: MigrationHooks | None = None,
        transport_for: Callable[[MigrationCommand], Transport] | None = None,
    ) -> None:
        self._d = driver
        self.config = config
        self.graph = graph
        self.fence = FencingGuard()
        self._hooks = hooks or MigrationHooks()
        self._transport_for = transport_for
        self.in_flight = 0  # MigrateOut calls running now
        self.budgets = LinkBudgets(config.link_budget_scope)  # every migration from here paces by them
        self._pool: bytes | None = None  # the engine's exported KV pool, b"" when it cannot be exported

    async def migrate_out(self, cmd: MigrationCommand) -> MigrationReport:
        """Migrate ``cmd.request_id`` to ``cmd.dst_address``; see the module doc. Never raises for RPC errors."""
        d = self._d
        t0 = d.clock()
        rid = cmd.request_id
        refused = self._precheck(cmd)
        if refused is not None:
            return MigrationReport(MigrationOutcome.REFUSED, refused)
        reason = await d.call(d.engine.migratable, rid)
        if reason is not None:
            return MigrationReport(MigrationOutcome.REFUSED, reason)
        rec = d.owned.get(rid)
        if rec is None or rec.migrating:
            return MigrationReport(MigrationOutcome.REFUSED, f"{d.instance_id}: {rid!r} left or is migrating")
        rec.migrating = cmd.attempt
        self.in_flight += 1
        d.bump()
        try:
            try:
                transport = await self._choose_transport(cmd)
            except (KeyError, ValueError, grpc.aio.AioRpcError) as exc:  # TransportUnavailable is a ValueError
                return MigrationReport(MigrationOutcome.REFUSED, f"no transport to {cmd.dst_address}: {exc}")
            report = await self._migrate(rec, cmd, transport, t0)
        finally:
            rec.migrating = 0
            rec.committing = False
            self.in_flight -= 1
            d.bump()
        _log.info(
            "%s: migrate %s@%d -> %s: %s %s (%s, %d blocks, %d recomputed there, %.1f ms, downtime %.1f ms) %s",
            d.instance_id,
            rid,
            cmd.attempt,
            cmd.dst_address,
            report.outcome.value,
            report.reason,
            report.plan or "-",
            report.blocks,
            report.recomputed_blocks,
            report.total_s * 1e3,
            report.downtime_s * 1e3,
            report.timing_line(),
        )
        return report

    def _precheck(self, cmd: MigrationCommand) -> str | None:
        me = self._d.instance_id
        if self._d.failure:
            return f"{me}: {self._d.failure}"
        if cmd.attempt < 1:
            return f"{me}: attempt = {cmd.attempt}, need >= 1"
        if not cmd.dst_address or cmd.dst_address == self._d.address:
            return f"{me}: bad destination address {cmd.dst_address!r}"
        if cmd.fencing_token:
            try:
                self.fence.check(cmd.fencing_token)
            except (StaleToken, ValueError) as exc:
                return f"{me}: {exc}"
        rec = self._d.owned.get(cmd.request_id)
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
            dst_id = (await self._d.peer(cmd.dst_address).ping()).instance_id
        cfg = self.config
        return choose_transport(
            cmd.transport,
            self.graph,
            self._d.instance_id,
            dst_id,
            cap_fraction=cfg.cap_fraction,
            pool=self._pool_handle(),
            grpc_rate_cap_bytes_per_s=cfg.grpc_rate_cap_bytes_per_s,
            local_rate_cap_bytes_per_s=cfg.local_rate_cap_bytes_per_s,
            override_rate_cap_bytes_per_s=cmd.rate_cap_bytes_per_s,
            budgets=self.budgets,
        )

    def _pool_handle(self) -> bytes | None:
        """The engine's KV pool exported for peers on this host (once; None: no data, or not shareable)."""
        if self._pool is None:
            pool = self._d.engine.kv_pool()
            if pool is None:
                self._pool = b""
            else:
                from llumlet.kvpool import export_pool

                self._pool = export_pool(pool) or b""
        return self._pool or None

    async def _migrate(self, rec: Owned, cmd: MigrationCommand, transport: Transport, t0: float) -> MigrationReport:
        d, cfg = self._d, self.config
        rid, attempt = cmd.request_id, cmd.attempt
        peer = d.peer(cmd.dst_address)
        rule = PrecopyRule(
            0 if cmd.stop_and_copy else (cfg.precopy.max_stages if cmd.max_stages is None else cmd.max_stages),
            cfg.precopy.stop_remaining_blocks if cmd.stop_remaining_blocks is None else cmd.stop_remaining_blocks,
        )
        block_size = d.engine.block_size_tokens
        stages: list[StageStats] = []
        copied = 0  # blocks [0, copied) are at the destination
        cached = 0  # of those, the leading ones it already held (never sent)
        reserved = 0
        suspended: MigrationState | None = None
        suspending = False  # suspend was called: on failure the request may need resuming even without a state
        setup_s = reserve_s = presuspend_s = suspend_wait_s = commit_s = 0.0  # where the time went (MigrationReport)
        plan = "stop-and-copy" if rule.max_stages == 0 else "pre-copy"
        recomputed, recompute_s = 0, 0.0  # prefix blocks the destination re-prefills, its estimate of that

        def report(outcome: MigrationOutcome, reason: str = "", downtime_s: float = 0.0) -> MigrationReport:
            return MigrationReport(
                outcome,
                reason,
                transport.mode,
                transport.rate_cap_bytes_per_s,
                tuple(stages),
                d.clock() - t0,
                downtime_s,
                cached,
                setup_s=setup_s,
                reserve_s=reserve_s,
                presuspend_s=presuspend_s,
                suspend_wait_s=suspend_wait_s,
                commit_s=commit_s,
                plan=plan,
                recomputed_blocks=recomputed,
                recompute_s=recompute_s,
            )

        try:
            kv = await d.call(d.engine.request_kv, rid)
            if kv is None:
                return report(MigrationOutcome.REFUSED, f"{rid!r} finished before the migration started")
            t_reserve = d.clock()
            setup_s = t_reserve - t0
            prefix_blocks = rec.prefix.prompt_blocks(kv[0], block_size)
            reply = await peer.reserve(
                rid,
                attempt,
                kv[1],
                src_instance_id=d.instance_id,
                expiry_s=cfg.reservation_expiry_s,
                prefix=rec.prefix,
                pool=transport.pool or b"",
                prefix_blocks=prefix_blocks,
            )
            reserve_s = d.clock() - t_reserve
            if reply.status is not DestStatus.OK:
                return report(
                    MigrationOutcome.REFUSED,
                    f"destination {cmd.dst_address}: {reply.status.name}: {reply.reason}",
                )
            reserved = reply.num_blocks
            if transport.pool is not None and not reply.pool_opened:
                transport.pool = None  # the destination cannot map our pool (another host, GPU not visible)
            copied = cached = min(reply.num_cached_blocks, kv[1])  # what the destination caches is not sent
            priced = self._price(kv[0], prefix_blocks, cached, reply.prefix_reprefill_s, transport, rule)
            if priced is not None and priced.mode == "pre-copy+recompute-prefix":
                again = await peer.reserve(
                    rid,
                    attempt,
                    reserved,
                    src_instance_id=d.instance_id,
                    expiry_s=cfg.reservation_expiry_s,
                    recompute_blocks=priced.recomputed_prefix_blocks,
                )
                if again.status is not DestStatus.OK:
                    raise _Failed(f"destination would not re-prefill the prefix: {again.reason}")
                plan, recomputed, recompute_s = priced.mode, priced.recomputed_prefix_blocks, priced.recompute_s
                copied += recomputed  # the destination computes these: not sent
            # pre-copy stages: the request keeps decoding
            while True:
                t_stage = d.clock()
                tokens, _ = await self._kv_or_end(rec)
                n = rule.next_live_stage(tokens, copied, len(stages), block_size)
                if n is None:
                    break
                full = copied + n
                reserved = await self._grow(peer, rid, attempt, full, reserved)
                stats = await self._copy(peer, transport, rec, copied, full, len(stages), last=False)
                stages.append(replace(stats, wall_s=d.clock() - t_stage))
                copied = full
                await self._hooks.stage_copied(rid, attempt, len(stages) - 1)
            t_live_done = d.clock()
            # last stage: suspended between two steps. Grow the reservation first, while the request still
            # decodes, by one block for a step that may run before the suspension: the last stage then
            # rarely needs a Reserve round trip in the downtime (best effort: it grows there if needed).
            _, held = await self._kv_or_end(rec)
            with contextlib.suppress(_Failed):
                reserved = await self._grow(peer, rid, attempt, held + 1, reserved)
            self._check_alive(rec)
            suspending = True
            t_ask = d.clock()
            presuspend_s = t_ask - t_live_done
            suspended = await d.call(d.engine.suspend, rid)
            if suspended is None:
                raise _Ended(f"{rid!r} finished (or left decode) before the last stage")
            t_suspend = d.clock()
            suspend_wait_s = t_suspend - t_ask
            if suspended.num_output_tokens != rec.next_seq:
                raise _Failed(f"token numbering mismatch: engine {suspended.num_output_tokens}, llumlet {rec.next_seq}")
            _, held = await self._kv_or_end(rec)
            reserved = await self._grow(peer, rid, attempt, held, reserved)
            flushed = asyncio.ensure_future(d.pusher.flush(rid))
            try:
                last_stage = await self._copy(peer, transport, rec, copied, held, len(stages), last=True)
            finally:
                pushed = await flushed
            stages.append(replace(last_stage, wall_s=d.clock() - t_suspend))
            if pushed is not PushOutcome.ACKED:
                raise _Ended(f"the origin of {rid!r} no longer takes its tokens ({pushed.value})")
            await self._hooks.before_commit(rid, attempt)
            self._check_alive(rec)
            rec.committing = True
            commit = CommitCall(
                request_id=rid,
                attempt=attempt,
                state=suspended,
                origin=rec.origin,
                next_seq=rec.next_seq,
                epoch=rec.epoch + 1,
                src_instance_id=d.instance_id,
            )
            t_commit = d.clock()
            committed = await self._commit(peer, rec, commit)
            commit_s = d.clock() - t_commit
        except _Ended as exc:
            await self._undo(peer, rec, attempt, suspending)
            return report(MigrationOutcome.ABORTED, str(exc))
        except (_Failed, TransportError, UnmovableStateError, KeyError, IndexError, grpc.aio.AioRpcError) as exc:
            await self._undo(peer, rec, attempt, suspending)
            why = _describe(exc)
            if rid not in d.owned:
                why = f"{rid!r} finished or was aborted during the migration ({why})"
            return report(MigrationOutcome.ABORTED, why)
        except Exception as exc:  # a bug or an engine fault must not leave the request suspended: undo, log
            _log.exception("%s: migration of %s@%d failed", d.instance_id, rid, attempt)
            await self._undo(peer, rec, attempt, suspending)
            return report(MigrationOutcome.ABORTED, f"internal error: {type(exc).__name__}: {exc}")
        if not committed.moved:  # the origin took this instance's claim: the request runs here again
            if rec.abort_requested:
                await d.drop(rid, push=("abort", ""))
            else:
                await self._resume(rec)
            d.spawn(self._release(peer, rid, attempt), f"release-{rid}@{attempt}")
            return report(MigrationOutcome.ABORTED, committed.reason)
        # committed: the destination runs the request now
        try:
            await d.call(d.engine.free_migrated, rid)
        except Exception as exc:
            _log.exception("%s: free_migrated failed", d.instance_id)
            d.fail(f"engine free_migrated raised {type(exc).__name__}: {exc}")
        d.owned.pop(rid, None)
        d.moved[rid] = (cmd.dst_address, d.clock())
        downtime_s = d.clock() - t_suspend
        if rec.abort_requested:
            d.spawn(self._forward_abort(cmd.dst_address, rid), f"forward-abort-{rid}")
        d.bump()
        return report(MigrationOutcome.COMMITTED, committed.reason, downtime_s)

    def _price(
        self,
        kv_tokens: int,
        prefix_blocks: int,
        cached: int,
        reprefill_s: float | None,
        transport: Transport,
        rule: PrecopyRule,
    ) -> MigrationPlan | None:
        """The cost model's plan of this move with its prefix (``topology.cost.plan_migration``, the one the
        simulator's executor follows), or None when there is nothing to choose: no missing prefix block, no
        estimate from the destination, stop-and-copy, or a transport without a rate cap (no rate to price the
        copy with: it copies). Priced at the transport's rate cap (the migration cap of the path already applied)
        with the configured overheads and this move's pre-copy rule; the source's recent step time is the decode
        step (:data:`topology.cost.DEFAULT_DECODE_STEP_S` before its first step)."""
        rate = transport.rate_cap_bytes_per_s
        if reprefill_s is None or prefix_blocks <= cached or rule.max_stages == 0 or not rate:
            return None
        engine = self._d.engine
        bs = engine.block_size_tokens
        cost = replace(
            self.config.cost,
            cap_fraction=1.0,
            max_stages=rule.max_stages,
            stop_remaining_blocks=rule.stop_remaining_blocks,
        )
        return plan_migration(
            MigrationCostInput(
                kv_tokens=kv_tokens,
                kv_bytes_per_token=max(1, engine.kv_bytes_per_block // bs),
                block_size_tokens=bs,
                decode_step_s=self._d.recent_step_s or DEFAULT_DECODE_STEP_S,
                path_bandwidth_bytes_per_s=rate,
                prefix_blocks=prefix_blocks,
                prefix_blocks_on_dst=cached,
                prefix_reprefill_s=reprefill_s,
            ),
            cost,
        )

    def _check_alive(self, rec: Owned) -> None:
        if self._d.owned.get(rec.request_id) is not rec:
            raise _Ended(f"{rec.request_id!r} finished or was aborted during the migration")
        if rec.abort_requested:
            raise _Ended(f"{rec.request_id!r} was aborted by the client during the migration")

    async def _kv_or_end(self, rec: Owned) -> tuple[int, int]:
        self._check_alive(rec)
        kv = await self._d.call(self._d.engine.request_kv, rec.request_id)
        if kv is None:
            raise _Ended(f"{rec.request_id!r} finished during the migration")
        return kv

    async def _grow(self, peer: LlumletClient, rid: str, attempt: int, n_blocks: int, reserved: int) -> int:
        if n_blocks <= reserved:
            return reserved
        reply = await peer.reserve(
            rid, attempt, n_blocks, src_instance_id=self._d.instance_id, expiry_s=self.config.reservation_expiry_s
        )
        if reply.status is not DestStatus.OK:
            raise _Failed(f"destination could not grow the reservation to {n_blocks} blocks: {reply.reason}")
        return reply.num_blocks

    async def _copy(
        self, peer: LlumletClient, transport: Transport, rec: Owned, first: int, end: int, stage: int, last: bool
    ) -> StageStats:
        """Copy blocks ``[first, end)`` of the request as one stage.

        The blocks are pinned down under the engine lock once (``Engine.begin_read``); the transport copies
        them out without it (or names them for a peer copy), one message (``chunk_bytes``) at a time, while
        the engine keeps stepping; once the destination acknowledged the stage (a peer copy reads the source's
        pool until then), a pre-copy stage checks under the lock that the request held those blocks
        throughout (else what was copied may be another request's: the migration fails).
        """
        if end <= first:
            return StageStats(stage, last, 0, 0, 0.0)
        d = self._d
        per_msg = max(1, self.config.chunk_bytes // max(1, d.engine.kv_bytes_per_block))
        stream = transport.open(peer.stub, rec.request_id, rec.migrating)
        try:
            run = await d.call(d.engine.begin_read, rec.request_id, first, end - first)
            for pos in range(first, end, per_msg):
                if not last:
                    self._check_alive(rec)
                await stream.send(run, pos, min(per_msg, end - pos))
            stats = await stream.close()  # a peer copy reads the source's pool until the destination replies
            if not last and not await d.call(run.still_valid):
                self._check_alive(rec)  # it finished (or was aborted): _Ended
                raise _Failed(f"{rec.request_id!r} was preempted during pre-copy stage {stage}: its blocks were freed")
        except BaseException:
            await stream.abort()
            raise
        return StageStats(stage, last, stats.blocks, stats.bytes, stats.seconds)

    async def _commit(self, peer: LlumletClient, rec: Owned, call: CommitCall) -> _CommitOutcome:
        """Send Commit and learn its outcome (see the module docstring).

        Raises _Failed when the destination answered that the attempt did not commit (the request stays here,
        suspended), _Ended when the origin no longer takes the request.
        """
        try:
            reply = await peer.commit(call)
        except grpc.aio.AioRpcError as first:
            why = _describe(first)
            try:  # the same Commit again: idempotent, it answers the first one's outcome
                reply = await peer.commit(call)
            except grpc.aio.AioRpcError as again:
                return await self._arbitrate(rec, call, f"Commit broke ({why}; asked again: {_describe(again)})")
            if reply.status is DestStatus.OK:
                return _CommitOutcome(True, f"Commit broke ({why}); asked again: committed")
        if reply.status is not DestStatus.OK:
            raise _Failed(f"destination refused the commit ({reply.status.name}): {reply.reason}")
        return _CommitOutcome(True, "")

    async def _arbitrate(self, rec: Owned, call: CommitCall, why: str) -> _CommitOutcome:
        """The destination cannot say whether it committed: claim the next owner epoch at the origin."""
        d = self._d
        outcome = await d.claim(rec)
        _log.warning("%s: %s: claimed %s at its origin: %s", d.instance_id, why, call.request_id, outcome.value)
        if outcome is PushOutcome.ACKED:
            return _CommitOutcome(False, f"{why}; the origin took this instance's claim: the request stays here")
        if outcome is PushOutcome.SUPERSEDED:
            d.pusher.forget(call.request_id)
            return _CommitOutcome(True, f"{why}; the origin says the destination owns the request")
        await d.drop(call.request_id, push=None)  # no owner here: the destination's copy, if any, is the only one
        raise _Ended(f"{why}; the origin of {call.request_id!r} no longer takes its tokens ({outcome.value})")

    async def _undo(self, peer: LlumletClient, rec: Owned, attempt: int, suspending: bool) -> None:
        """After a failed or ended migration: release the destination, resume (or abort) the request here."""
        await self._release(peer, rec.request_id, attempt)
        rec.committing = False
        if not suspending or self._d.owned.get(rec.request_id) is not rec:
            return
        if rec.abort_requested:
            await self._d.drop(rec.request_id, push=("abort", ""))
            return
        await self._resume(rec)

    async def _resume(self, rec: Owned) -> None:
        """Put the request back in batching here (a no-op if the engine never took it out)."""
        d = self._d
        rec.committing = False
        if d.failure:
            d.end_failed(rec.request_id)
            return
        try:
            await d.call(d.engine.resume, rec.request_id)
        except Exception as exc:
            _log.exception("%s: resume of %s failed", d.instance_id, rec.request_id)
            d.fail(f"engine resume raised {type(exc).__name__}: {exc}")
            d.end_failed(rec.request_id)
            return
        d.wake()

    async def _release(self, peer: LlumletClient, request_id: str, attempt: int) -> None:
        try:
            await peer.release(request_id, attempt, timeout_s=2.0)
        except grpc.aio.AioRpcError as exc:
            _log.warning(
                "%s: release of %s@%d at %s failed (%s); it expires there",
                self._d.instance_id, request_id, attempt, peer.address, _describe(exc),
            )  # fmt: skip

    async def _forward_abort(self, address: str, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._d.peer(address).abort(request_id)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)
