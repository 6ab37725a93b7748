"""The llumlet's gRPC service (``hilum.v1.Llumlet``, grpc.aio): a thin edge over :class:`llumlet.agent.Llumlet`.

Every protobuf message is converted here, and only here, to and from the llumlet's dataclasses. Malformed
requests get ``INVALID_ARGUMENT`` naming the field; everything else is answered in the reply
(``accepted``/``reason``, ``DestStatus``, ``MigrationOutcome``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from hilum_proto.tls import advertised_address, bind_server
from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import llumlet_pb2_grpc as pb_grpc
from llumlet.agent import Llumlet
from llumlet.convert import commit_from_pb, dest_status_to_pb, load_to_pb, request_from_submit
from llumlet.driver import LoadSnapshot
from llumlet.engine.protocol import KVPayload
from llumlet.migration_in import IncomingChunk
from llumlet.migration_types import DestStatus, MigrationCommand, MigrationOutcome, MigrationReport, PromptPrefix
from llumlet.transport import TransportError, TransportName

__all__ = ["LlumletService", "command_from_pb", "report_to_pb", "serve"]

_Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

_OUTCOMES = {
    MigrationOutcome.COMMITTED: pb.MIGRATION_COMMITTED,
    MigrationOutcome.ABORTED: pb.MIGRATION_ABORTED,
    MigrationOutcome.REFUSED: pb.MIGRATION_REFUSED,
}
_TRANSPORTS = {
    pb.TRANSPORT_AUTO: None,
    pb.TRANSPORT_LOCAL: TransportName.LOCAL,
    pb.TRANSPORT_GRPC: TransportName.GRPC,
    pb.TRANSPORT_NIXL: TransportName.NIXL,
}


def command_from_pb(msg: pb.MigrateOutRequest) -> MigrationCommand:
    """``hilum.v1.MigrateOutRequest`` -> :class:`MigrationCommand`. Raises ValueError naming the field."""
    if not msg.request_id or not msg.dst_address:
        raise ValueError("MigrateOut: request_id and dst_address are required")
    if msg.transport not in _TRANSPORTS:
        raise ValueError(f"MigrateOut: unknown transport {msg.transport}")
    if msg.rate_cap_bytes_per_s < 0:
        raise ValueError(f"MigrateOut: rate_cap_bytes_per_s = {msg.rate_cap_bytes_per_s} < 0")
    return MigrationCommand(
        request_id=msg.request_id,
        dst_address=msg.dst_address,
        attempt=msg.attempt,
        dst_instance_id=msg.dst_instance_id,
        transport=_TRANSPORTS[msg.transport],
        fencing_token=msg.fencing_token,
        rate_cap_bytes_per_s=msg.rate_cap_bytes_per_s,
        stop_and_copy=msg.mode == pb.MIGRATION_STOP_AND_COPY,
        max_stages=msg.max_stages if msg.HasField("max_stages") else None,
        stop_remaining_blocks=msg.stop_remaining_blocks if msg.HasField("stop_remaining_blocks") else None,
    )


def report_to_pb(report: MigrationReport) -> pb.MigrateOutReply:
    """:class:`MigrationReport` -> ``hilum.v1.MigrateOutReply``."""
    return pb.MigrateOutReply(
        outcome=_OUTCOMES[report.outcome],
        reason=report.reason,
        transport=report.transport,
        rate_cap_bytes_per_s=report.rate_cap_bytes_per_s,
        stages=sum(not s.last for s in report.stages),
        blocks=report.blocks,
        bytes=report.bytes,
        total_s=report.total_s,
        downtime_s=report.downtime_s,
        bandwidth_bytes_per_s=report.bandwidth_bytes_per_s,
        precopy_bandwidth_bytes_per_s=report.precopy_bandwidth_bytes_per_s,
        cached_blocks=report.cached_blocks,
        setup_s=report.setup_s,
        reserve_s=report.reserve_s,
        presuspend_s=report.presuspend_s,
        suspend_wait_s=report.suspend_wait_s,
        commit_s=report.commit_s,
        plan=report.plan,
        recomputed_blocks=report.recomputed_blocks,
        recompute_s=report.recompute_s,
        stage_reports=[
            pb.StageReport(
                stage=s.stage, last=s.last, blocks=s.blocks, bytes=s.bytes, seconds=s.seconds, wall_s=s.wall_s
            )
            for s in report.stages
        ],
    )


class LlumletService(pb_grpc.LlumletServicer):
    """Implements ``hilum.v1.Llumlet`` over one :class:`Llumlet`."""

    def __init__(self, llumlet: Llumlet) -> None:
        self._l = llumlet
        self._migrations: set[asyncio.Task[MigrationReport]] = set()

    async def Ping(self, request: pb.LlumletPingRequest, context: _Ctx) -> pb.LlumletPingReply:
        info = self._l.ping()
        return pb.LlumletPingReply(
            instance_id=info.instance_id,
            domain_id=info.domain_id,
            engine=info.engine,
            block_size_tokens=info.block_size_tokens,
            kv_bytes_per_block=info.kv_bytes_per_block,
            failure=info.failure,
        )

    async def Submit(self, request: pb.SubmitRequest, context: _Ctx) -> pb.SubmitReply:
        try:
            engine_request = request_from_submit(request, self._l.arrival_s())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reason = await self._l.submit(engine_request, request.origin, first_seq=request.first_seq)
        failed = reason is not None and bool(self._l.driver.failure)
        return pb.SubmitReply(accepted=reason is None, reason=reason or "", instance_failed=failed)

    async def Abort(self, request: pb.AbortRequest, context: _Ctx) -> pb.AbortReply:
        found, forwarded_to = await self._l.abort(request.request_id)
        return pb.AbortReply(found=found, forwarded_to=forwarded_to)

    async def GetLoad(self, request: pb.GetLoadRequest, context: _Ctx) -> pb.LoadReport:
        return self._load(await self._l.load())

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: _Ctx) -> AsyncIterator[pb.LoadReport]:
        async for snap in self._l.watch_load(request.min_interval_s):
            yield self._load(snap)

    def _load(self, snap: LoadSnapshot) -> pb.LoadReport:
        cfg = self._l.config
        msg = load_to_pb(snap.load, cfg.instance_id, cfg.domain_id, cfg.prefix_cache.report_max_hashes)
        msg.num_requests = snap.num_requests
        msg.num_reservations = snap.num_reservations
        msg.num_migrations_out = snap.num_migrations_out
        msg.version = snap.version
        msg.recent_step_s = snap.recent_step_s
        msg.finished_output_tokens.extend(snap.finished_output_tokens)
        msg.failure = snap.failure
        return msg

    async def MigrateOut(self, request: pb.MigrateOutRequest, context: _Ctx) -> pb.MigrateOutReply:
        try:
            cmd = command_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # the migration must finish (or undo itself) even if the caller goes away: shield it
        task = asyncio.get_running_loop().create_task(self._l.migrate_out(cmd))
        self._migrations.add(task)
        task.add_done_callback(self._migrations.discard)
        return report_to_pb(await asyncio.shield(task))

    async def Reserve(self, request: pb.ReserveRequest, context: _Ctx) -> pb.ReserveReply:
        got = await self._l.reserve(
            request.request_id,
            request.attempt,
            request.num_blocks,
            src_instance_id=request.src_instance_id,
            expiry_s=request.expiry_s,
            prefix=PromptPrefix(
                tuple(request.prefix_token_ids), tuple(request.prefix_block_hashes), request.prefix_hash_block_tokens
            ),
            pool=request.pool,
            prefix_blocks=request.prefix_blocks,
            recompute_blocks=request.recompute_blocks,
        )
        return pb.ReserveReply(
            status=dest_status_to_pb(got.status),
            reason=got.reason,
            reservation_id=got.reservation_id,
            num_blocks=got.num_blocks,
            num_cached_blocks=got.num_cached_blocks,
            pool_opened=got.pool_opened,
            prefix_reprefill_s=got.prefix_reprefill_s,
        )

    async def WriteBlocks(self, request_iterator: AsyncIterator[pb.BlockChunk], context: _Ctx) -> pb.WriteBlocksReply:
        async def chunks() -> AsyncIterator[IncomingChunk]:
            pool = None
            async for chunk in request_iterator:
                if chunk.pool:
                    pool = self._l.destination.pools.open(chunk.pool)  # TransportError: the stream ends FAILED
                source = None
                if chunk.src_block_ids:
                    if pool is None:
                        raise TransportError("block ids of a peer pool, and the stream named no pool")
                    source = (pool, tuple(chunk.src_block_ids))
                payload = KVPayload(chunk.first_block, chunk.num_blocks, chunk.nbytes, chunk.data)
                yield IncomingChunk(chunk.request_id, chunk.attempt, payload, source)

        got = await self._l.write_blocks(chunks())
        return pb.WriteBlocksReply(
            status=dest_status_to_pb(got.status),
            reason=got.reason,
            blocks_written=got.blocks,
            bytes_written=got.bytes,
        )

    async def Commit(self, request: pb.CommitRequest, context: _Ctx) -> pb.CommitReply:
        try:
            call = commit_from_pb(request)
        except ValueError as exc:  # a stale or unknown attempt is answered as such, whatever its state
            status, reason = self._l.destination.status_of(request.request_id, request.attempt)
            if status is not DestStatus.OK:
                return pb.CommitReply(status=dest_status_to_pb(status), reason=reason)
            me = self._l.config.instance_id
            return pb.CommitReply(status=pb.DEST_FAILED, reason=f"{me}: bad state of {request.request_id!r}: {exc}")
        got = await asyncio.shield(self._l.commit(call))
        return pb.CommitReply(status=dest_status_to_pb(got.status), reason=got.reason)

    async def Release(self, request: pb.ReleaseRequest, context: _Ctx) -> pb.ReleaseReply:
        got = await self._l.release(request.request_id, request.attempt)
        return pb.ReleaseReply(
            status=dest_status_to_pb(got.status), committed=got.committed, released_blocks=got.released_blocks
        )


async def serve(llumlet: Llumlet, listen: str, advertise: str = "") -> tuple[grpc.aio.Server, str]:
    """Bind ``listen`` (``host:port``, port 0 picks one), start ``llumlet`` and the service.

    Returns the server and the address others reach it at: ``advertise``, else the listen host with the bound
    port (:func:`hilum_proto.tls.advertised_address`); the llumlet names that address in its token pushes.

    Raises:
        hilum_proto.tls.ListenError: when the address cannot be bound.
        ValueError: for a wildcard listen host without ``advertise``.
    """
    server, port = bind_server(listen, [("grpc.max_receive_message_length", 64 << 20)])
    address = advertised_address(listen, port, advertise)
    pb_grpc.add_LlumletServicer_to_server(LlumletService(llumlet), server)
    await llumlet.start(address)
    await server.start()
    return server, address
