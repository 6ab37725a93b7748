"""LlumletClient: a thin async client of one llumlet's gRPC service (used by llumlets, tests, the benchmark,
and later the domain scheduler)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from types import TracebackType

from hilum_proto.tls import open_channel
from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import llumlet_pb2_grpc as pb_grpc
from llumlet.convert import commit_to_pb, dest_status_from_pb, sampling_to_pb
from llumlet.engine.types import SamplingParams
from llumlet.migration_types import NO_PREFIX, CommitCall, DestReply, PromptPrefix, Released, Reserved

__all__ = ["LlumletClient"]


class LlumletClient:
    """Calls to the llumlet at ``address`` (``host:port``). RPC errors surface as ``grpc.aio.AioRpcError``.

    ``timeout_s`` is the deadline of unary calls (MigrateOut uses ``migrate_timeout_s``).
    """

    def __init__(self, address: str, *, timeout_s: float = 10.0, migrate_timeout_s: float = 120.0) -> None:
        self.address = address
        self.channel = open_channel(address)
        self.stub = pb_grpc.LlumletStub(self.channel)
        self.timeout_s = timeout_s
        self.migrate_timeout_s = migrate_timeout_s

    async def __aenter__(self) -> LlumletClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()

    async def ping(self, *, wait_for_ready: bool = False) -> pb.LlumletPingReply:
        """Identity of the llumlet."""
        return await self.stub.Ping(pb.LlumletPingRequest(), timeout=self.timeout_s, wait_for_ready=wait_for_ready)

    async def submit(
        self,
        request_id: str,
        origin: str,
        sampling: SamplingParams,
        *,
        prompt_token_ids: Sequence[int] = (),
        prompt_tokens: int = 0,
        priority: int = 0,
        prefix_block_hashes: Sequence[int] = (),
        prefix_hash_block_tokens: int = 0,
    ) -> pb.SubmitReply:
        """Submit a request whose tokens go to the TokenSink at ``origin``; ``prefix_block_hashes`` (each of
        ``prefix_hash_block_tokens`` tokens) name its prompt's prefix blocks for the engine's prefix cache."""
        msg = pb.SubmitRequest(
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling_to_pb(sampling),
            priority=priority,
            origin=origin,
            prefix_block_hashes=prefix_block_hashes,
            prefix_hash_block_tokens=prefix_hash_block_tokens,
        )
        return await self.stub.Submit(msg, timeout=self.timeout_s)

    async def abort(self, request_id: str) -> pb.AbortReply:
        """Abort a request (forwarded if it migrated away)."""
        return await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout_s)

    async def get_load(self) -> pb.LoadReport:
        """The current load."""
        return await self.stub.GetLoad(pb.GetLoadRequest(), timeout=self.timeout_s)

    async def watch_load(self, min_interval_s: float = 0.0) -> AsyncGenerator[pb.LoadReport, None]:
        """The current load, then every change, until the caller stops iterating."""
        call = self.stub.WatchLoad(pb.WatchLoadRequest(min_interval_s=min_interval_s))
        try:
            async for report in call:
                yield report
        finally:
            call.cancel()

    async def migrate_out(
        self,
        request_id: str,
        dst_address: str,
        attempt: int,
        *,
        dst_instance_id: str = "",
        transport: pb.TransportKind.ValueType = pb.TRANSPORT_AUTO,
        fencing_token: int = 0,
        rate_cap_bytes_per_s: float = 0.0,
        mode: pb.MigrationMode.ValueType = pb.MIGRATION_PRE_COPY,
        max_stages: int | None = None,
        stop_remaining_blocks: int | None = None,
    ) -> pb.MigrateOutReply:
        """Command this llumlet to migrate ``request_id`` to ``dst_address``; returns when it is done."""
        msg = pb.MigrateOutRequest(
            request_id=request_id,
            dst_address=dst_address,
            dst_instance_id=dst_instance_id,
            transport=transport,
            attempt=attempt,
            fencing_token=fencing_token,
            rate_cap_bytes_per_s=rate_cap_bytes_per_s,
            mode=mode,
        )
        if max_stages is not None:
            msg.max_stages = max_stages
        if stop_remaining_blocks is not None:
            msg.stop_remaining_blocks = stop_remaining_blocks
        return await self.stub.MigrateOut(msg, timeout=self.migrate_timeout_s)

    # ---- destination side (what a source llumlet calls; dataclasses in and out) -----------------
    async def reserve(
        self,
        request_id: str,
        attempt: int,
        num_blocks: int,
        *,
        src_instance_id: str = "",
        expiry_s: float = 0.0,
        prefix: PromptPrefix = NO_PREFIX,
        pool: bytes = b"",
        prefix_blocks: int = 0,
        recompute_blocks: int = 0,
    ) -> Reserved:
        """Reserve (or grow a reservation to) ``num_blocks`` for ``(request_id, attempt)``; with a ``prefix``
        (first Reserve) the destination says which leading blocks it already caches, and with ``prefix_blocks``
        (the leading blocks holding prompt tokens only) its estimate of re-prefilling the rest of them; a later
        Reserve with ``recompute_blocks`` asks it to re-prefill that many after the cached ones."""
        msg = pb.ReserveRequest(
            request_id=request_id,
            attempt=attempt,
            src_instance_id=src_instance_id,
            num_blocks=num_blocks,
            expiry_s=expiry_s,
            prefix_token_ids=prefix.token_ids,
            prefix_block_hashes=prefix.block_hashes,
            prefix_hash_block_tokens=prefix.hash_block_tokens,
            pool=pool,
            prefix_blocks=prefix_blocks,
            recompute_blocks=recompute_blocks,
        )
        reply = await self.stub.Reserve(msg, timeout=self.timeout_s)
        return Reserved(
            dest_status_from_pb(reply.status),
            reply.reason,
            reply.reservation_id,
            reply.num_blocks,
            reply.num_cached_blocks,
            reply.pool_opened,
            reply.prefix_reprefill_s if reply.HasField("prefix_reprefill_s") else None,
        )

    async def commit(self, call: CommitCall) -> DestReply:
        """Commit an incoming request. Raises ``llumlet.convert.UnmovableStateError`` for unmovable state."""
        reply = await self.stub.Commit(commit_to_pb(call), timeout=self.timeout_s)
        return DestReply(dest_status_from_pb(reply.status), reply.reason)

    async def release(self, request_id: str, attempt: int, *, timeout_s: float | None = None) -> Released:
        """Release the reservation of ``(request_id, attempt)`` (idempotent)."""
        msg = pb.ReleaseRequest(request_id=request_id, attempt=attempt)
        reply = await self.stub.Release(msg, timeout=timeout_s or self.timeout_s)
        return Released(dest_status_from_pb(reply.status), reply.committed, reply.released_blocks)
