"""KV block transports between llumlets, chosen by the topology, each with an optional token-bucket rate cap.

- ``local`` (inside an NVLink domain): the block data goes through POSIX shared memory
  (``multiprocessing.shared_memory``) between the two processes — a stand-in for an NVLink copy — while the
  control message (a ``BlockChunk`` naming the segment) still goes over gRPC. Both processes must be on one
  host.
- ``grpc`` (across domains): the data goes inline in a client-streaming ``WriteBlocks`` call, paced by a token
  bucket at ``path bandwidth x cap fraction`` (topology.cost's cap, default 20%) or a configured rate.

A transport object serves one migration and opens one :class:`BlockStream` per stage; the source sends
runs of blocks into it as it reads them and ``close()`` returns :class:`TransferStats` with the bandwidth
achieved (logical KV bytes / seconds from open to the destination's reply). Every failure raises
:class:`TransportError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

import grpc

from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import llumlet_pb2_grpc as pb_grpc
from llumlet.engine.protocol import KVPayload
from topology.graph import TopologyGraph

_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory objects

__all__ = [
    "BlockStream",
    "GrpcStreamTransport",
    "SharedMemoryTransport",
    "TokenBucket",
    "TransferStats",
    "Transport",
    "TransportError",
    "TransportName",
    "choose_transport",
    "read_shm",
]


class TransportError(RuntimeError):
    """A block transfer failed (RPC error, the destination refused the data, or a stale attempt)."""


class TransportName(enum.Enum):
    """The two transports."""

    LOCAL = "local"
    GRPC = "grpc"


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one stage moved."""

    blocks: int
    bytes: int  # logical KV bytes (what a GPU copy would move)
    seconds: float  # open -> destination's reply

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Achieved bandwidth (0 when nothing moved or no time passed)."""
        return self.bytes / self.seconds if self.seconds > 0 and self.bytes else 0.0


class TokenBucket:
    """A token bucket: ``consume(n)`` returns once ``n`` bytes fit under ``rate_bytes_per_s``.

    The bucket holds up to ``burst_bytes`` and starts with ``initial_bytes`` (default full); a request larger
    than what it holds goes into debt and waits the debt out (so the long-run rate is exact whatever the chunk
    size). Clock and sleep are injected.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst_bytes: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        initial_bytes: float | None = None,
    ) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"TokenBucket: rate_bytes_per_s = {rate_bytes_per_s}, need > 0")
        if burst_bytes < 0:
            raise ValueError(f"TokenBucket: burst_bytes = {burst_bytes}, need >= 0")
        self.rate_bytes_per_s = rate_bytes_per_s
        self.burst_bytes = burst_bytes
        self._clock = clock
        self._sleep = sleep
        self._tokens = burst_bytes if initial_bytes is None else min(initial_bytes, burst_bytes)
        self._last = clock()

    async def consume(self, n_bytes: int) -> float:
        """Take ``n_bytes``; returns the seconds waited."""
        now = self._clock()
        self._tokens = min(self.burst_bytes, self._tokens + (now - self._last) * self.rate_bytes_per_s)
        self._last = now
        self._tokens -= n_bytes
        if self._tokens >= 0:
            return 0.0
        wait_s = -self._tokens / self.rate_bytes_per_s
        await self._sleep(wait_s)
        return wait_s


class BlockStream(Protocol):
    """One stage's transfer to a destination."""

    async def send(self, payload: KVPayload) -> None:
        """Send a run of blocks. Raises TransportError."""
        ...

    async def close(self) -> TransferStats:
        """Finish the stage; the destination's verdict. Raises TransportError."""
        ...

    async def abort(self) -> None:
        """Give up (cancel the call, free local resources); never raises."""
        ...


class Transport(Protocol):
    """Opens block streams to a destination llumlet."""

    name: TransportName
    rate_cap_bytes_per_s: float  # 0 = no cap

    def open(self, stub: pb_grpc.LlumletAsyncStub, request_id: str, attempt: int) -> BlockStream:
        """A stream for one stage of ``(request_id, attempt)``."""
        ...


class _GrpcBlockStream:
    """Client-streaming WriteBlocks; data inline (grpc) or by shared-memory reference (local)."""

    def __init__(
        self,
        stub: pb_grpc.LlumletAsyncStub,
        request_id: str,
        attempt: int,
        bucket: TokenBucket | None,
        use_shm: bool,
        clock: Callable[[], float],
    ) -> None:
        self._call = stub.WriteBlocks()
        self._request_id = request_id
        self._attempt = attempt
        self._bucket = bucket
        self._use_shm = use_shm
        self._clock = clock
        self._t0 = clock()
        self._blocks = 0
        self._bytes = 0
        self._segments: list[shared_memory.SharedMemory] = []

    async def send(self, payload: KVPayload) -> None:
        if self._bucket is not None:
            await self._bucket.consume(payload.nbytes)
        chunk = pb.BlockChunk(
            request_id=self._request_id,
            attempt=self._attempt,
            first_block=payload.first_block,
            num_blocks=payload.num_blocks,
            nbytes=payload.nbytes,
        )
        if self._use_shm and payload.data:
            seg = shared_memory.SharedMemory(create=True, size=len(payload.data))
            self._segments.append(seg)
            buf = seg.buf
            assert buf is not None
            buf[: len(payload.data)] = payload.data
            chunk.shm.CopyFrom(pb.ShmRef(name=seg.name, offset=0, size=len(payload.data)))
        else:
            chunk.data = payload.data
        try:
            await self._call.write(chunk)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._free_segments()
            raise TransportError(f"WriteBlocks to the destination broke: {await self._why(exc)}") from exc
        self._blocks += payload.num_blocks
        self._bytes += payload.nbytes

    async def close(self) -> TransferStats:
        try:
            await self._call.done_writing()
            reply = await self._call
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise TransportError(f"WriteBlocks to the destination broke: {await self._why(exc)}") from exc
        finally:
            self._free_segments()
        if reply.status != pb.DEST_OK:
            raise TransportError(f"destination refused blocks ({pb.DestStatus.Name(reply.status)}): {reply.reason}")
        return TransferStats(self._blocks, self._bytes, self._clock() - self._t0)

    async def abort(self) -> None:
        self._call.cancel()
        self._free_segments()

    async def _why(self, exc: BaseException) -> str:
        """The call's own status when it already ended (the destination answered early or died)."""
        if isinstance(exc, grpc.aio.AioRpcError) or not self._call.done():
            return _describe(exc)
        try:
            reply = await self._call
        except grpc.aio.AioRpcError as status:
            return _describe(status)
        except asyncio.CancelledError:
            return "cancelled"
        return f"{pb.DestStatus.Name(reply.status)}: {reply.reason}"

    def _free_segments(self) -> None:
        for seg in self._segments:
            seg.close()
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
        self._segments.clear()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


class _CappedTransport:
    """One migration's transport: every stage it opens draws on one token bucket (empty at the start, holding
    at most ``burst_bytes``, default 10 ms at the cap), so the cap holds over the whole migration."""

    name: TransportName

    def __init__(
        self,
        rate_cap_bytes_per_s: float = 0.0,
        burst_bytes: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_cap_bytes_per_s < 0:
            raise ValueError(f"{type(self).__name__}: rate_cap_bytes_per_s = {rate_cap_bytes_per_s} < 0")
        self.rate_cap_bytes_per_s = rate_cap_bytes_per_s
        self.clock = clock
        burst = rate_cap_bytes_per_s * 0.01 if burst_bytes is None else burst_bytes
        self._bucket = (
            TokenBucket(rate_cap_bytes_per_s, burst, clock, initial_bytes=0.0) if rate_cap_bytes_per_s else None
        )

    def _open(self, stub: pb_grpc.LlumletAsyncStub, request_id: str, attempt: int, use_shm: bool) -> BlockStream:
        return _GrpcBlockStream(stub, request_id, attempt, self._bucket, use_shm, self.clock)


class GrpcStreamTransport(_CappedTransport):
    """Blocks inline in a gRPC stream, paced by a token bucket when ``rate_cap_bytes_per_s`` > 0."""

    name = TransportName.GRPC

    def open(self, stub: pb_grpc.LlumletAsyncStub, request_id: str, attempt: int) -> BlockStream:
        """A stream for one stage of ``(request_id, attempt)``."""
        return self._open(stub, request_id, attempt, use_shm=False)


class SharedMemoryTransport(_CappedTransport):
    """Block data through shared-memory segments (one per run, unlinked when the stage closes); control
    messages over gRPC. Capped like the gRPC transport when ``rate_cap_bytes_per_s`` > 0."""

    name = TransportName.LOCAL

    def open(self, stub: pb_grpc.LlumletAsyncStub, request_id: str, attempt: int) -> BlockStream:
        """A stream for one stage of ``(request_id, attempt)``."""
        return self._open(stub, request_id, attempt, use_shm=True)


def read_shm(ref: pb.ShmRef) -> bytes:
    """Destination side: copy the block data out of the segment ``ref`` names (the source unlinks it).

    Reads the POSIX shared-memory object through ``/dev/shm`` (Linux) rather than attaching a
    ``SharedMemory``, whose resource tracker would claim the source's segment. Raises TransportError when the
    segment is gone or too small.
    """
    path = os.path.join(_SHM_DIR, ref.name.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise TransportError(f"shared memory segment {ref.name!r}: {exc.strerror}") from exc
    try:
        data = os.pread(fd, ref.size, ref.offset)
    finally:
        os.close(fd)
    if len(data) != ref.size:
        raise TransportError(f"shared memory segment {ref.name!r}: {ref.size} bytes asked, {len(data)} read")
    return data


def choose_transport(
    hint: TransportName | None,
    graph: TopologyGraph | None,
    src_instance_id: str,
    dst_instance_id: str,
    *,
    cap_fraction: float,
    grpc_rate_cap_bytes_per_s: float = 0.0,
    local_rate_cap_bytes_per_s: float = 0.0,
    override_rate_cap_bytes_per_s: float = 0.0,
) -> Transport:
    """The transport for a migration ``src -> dst``.

    ``hint`` None = by the topology: ``local`` when both instances are in one NVLink domain
    (``TopologyGraph.path(...).same_domain``), else ``grpc``; without a graph, ``grpc``. Rate caps, first
    that applies: ``override_rate_cap_bytes_per_s`` (the command's), the configured cap of that transport,
    and for ``grpc`` with a graph ``path bandwidth x cap_fraction``; else none.

    Raises:
        KeyError: an instance is not in the topology.
    """
    path = graph.path(src_instance_id, dst_instance_id) if graph is not None else None
    name = (
        hint
        if hint is not None
        else (TransportName.LOCAL if path is not None and path.same_domain else TransportName.GRPC)
    )
    if name is TransportName.LOCAL:
        rate = override_rate_cap_bytes_per_s or local_rate_cap_bytes_per_s
        return SharedMemoryTransport(rate_cap_bytes_per_s=rate)
    rate = override_rate_cap_bytes_per_s or grpc_rate_cap_bytes_per_s
    if not rate and path is not None and not path.same_domain:
        rate = path.bandwidth_bytes_per_s * cap_fraction
    return GrpcStreamTransport(rate_cap_bytes_per_s=rate)
