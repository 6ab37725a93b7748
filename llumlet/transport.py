"""KV block transports between llumlets, behind one seam, each with an optional token-bucket rate cap.

A :class:`Transport` opens one :class:`BlockStream` per stage of a migration; the source hands it runs of
blocks pinned down by the engine (``Engine.begin_read`` -> ``BlockRun``) and the stream decides how they
travel. ``close()`` returns :class:`TransferStats` with the bandwidth the stage achieved (logical KV bytes /
seconds from open to the destination's reply), which the llumlet reports per migration for the cost model
(``MigrationReport.precopy_bandwidth_bytes_per_s``). Every failure raises :class:`TransportError`.

- ``local`` (llumlets of one host, e.g. one NVLink domain): peer copies. The source exports its KV pool once
  (``llumlet.kvpool.export_pool``: CUDA IPC handles for a GPU pool, a shared-memory segment for a host pool)
  and sends only block ids in the ``WriteBlocks`` stream; the destination opens the pool
  (:class:`PeerPools`) and copies the blocks straight into its reservation (``Engine.write_blocks_from``: a
  GPU-to-GPU copy, no host staging). An engine whose pool cannot be exported (vLLM's CPU build) sends the
  bytes inline instead; the report says so (``local-inline``).
- ``grpc`` (across domains, the fallback): the bytes inline in the ``WriteBlocks`` stream, copied out of the
  pool off the engine lock (pinned host memory on a GPU), paced by the migration budget of every link of the
  path (``capacity x cap fraction``, topology.cost's cap, default 20%), shared by every migration on the link
  (``llumlet.linkbudget``), or by a configured rate.
- ``nixl`` (RDMA across nodes, as vLLM's NIXL connector and Llumnix use): refused by name — with the reason
  "not installed" when the ``nixl`` package is absent, and "not implemented" when it is present: hilum does
  not yet drive NIXL transfers (:func:`nixl_available` tells which).
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import llumlet_pb2_grpc as pb_grpc
from llumlet.engine.protocol import BlockRun
from llumlet.linkbudget import LinkBudgets, Pacer
from topology.bandwidth import default_transport
from topology.graph import TopologyGraph

if TYPE_CHECKING:
    from llumlet.kvpool import KVPool

__all__ = [
    "BlockStream",
    "GrpcStreamTransport",
    "LocalTransport",
    "PeerPools",
    "TokenBucket",
    "TransferStats",
    "Transport",
    "TransportError",
    "TransportName",
    "TransportUnavailable",
    "choose_transport",
    "nixl_available",
]


class TransportError(RuntimeError):
    """A block transfer failed (RPC error, the destination refused the data, or a stale attempt)."""


class TransportUnavailable(ValueError):
    """A transport was asked for by name and cannot be used here (its library is missing or unsupported)."""


class TransportName(enum.Enum):
    """The transports, by the name a command or a configuration asks for."""

    LOCAL = "local"
    GRPC = "grpc"
    NIXL = "nixl"


def nixl_available() -> bool:
    """Whether the NIXL Python package (``nixl``; wheels ``nixl-cu12`` / ``nixl-cu13``) is importable."""
    return importlib.util.find_spec("nixl") is not None


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

    async def send(self, run: BlockRun, first_block: int, num_blocks: int) -> None:
        """Send blocks ``[first_block, first_block + num_blocks)`` of ``run`` (copied out without the engine
        lock, or named by id for a peer copy). Raises TransportError."""
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
    pool: bytes | None  # local: the source's exported KV pool offered for peer copies; None = bytes inline

    @property
    def mode(self) -> str:
        """How the bytes travel, for reports: "local" (peer copies), "local-inline", "grpc"."""
        ...

    def open(self, stub: pb_grpc.LlumletAsyncStub, request_id: str, attempt: int) -> BlockStream:
        """A stream for one stage of ``(request_id, attempt)``."""
        ...


class _GrpcBlockStream:
    """Client-streaming WriteBlocks: the data inline, or (``pool`` given) block ids of the source's pool."""

    def __init__(
        self,
        stub: pb_grpc.LlumletAsyncStub,
        request_id: str,
        attempt: int,
        bucket: Pacer | None,
        pool: bytes | None,
        clock: Callable[[], float],
    ) -> None:
        self._call = stub.WriteBlocks()
        self._request_id = request_id
        self._attempt = attempt
        self._bucket = bucket
        self._pool = pool  # the source's exported pool handle: the first chunk carries it
        self._clock = clock
        self._t0 = clock()
        self._blocks = 0
        self._bytes = 0

    async def send(self, run: BlockRun, first_block: int, num_blocks: int) -> None:
        nbytes = num_blocks * (run.nbytes_per_block)
        if self._bucket is not None:
            await self._bucket.consume(nbytes)
        chunk = pb.BlockChunk(
            request_id=self._request_id,
            attempt=self._attempt,
            first_block=first_block,
            num_blocks=num_blocks,
            nbytes=nbytes,
        )
        if self._pool is not None:
            lo = first_block - run.first_block
            chunk.src_block_ids.extend(run.block_ids[lo : lo + num_blocks])
            if not self._blocks:
                chunk.pool = self._pool
        else:
            payload = await asyncio.to_thread(run.copy, first_block, num_blocks)  # off the engine lock
            chunk.data = payload.data
        try:
            await self._call.write(chunk)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise TransportError(f"WriteBlocks to the destination broke: {await self._why(exc)}") from exc
        self._blocks += num_blocks
        self._bytes += nbytes

    async def close(self) -> TransferStats:
        try:
            await self._call.done_writing()
            reply = await self._call
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise TransportError(f"WriteBlocks to the destination broke: {await self._why(exc)}") from exc
        if reply.status != pb.DEST_OK:
            raise TransportError(f"destination refused blocks ({pb.DestStatus.Name(reply.status)}): {reply.reason}")
        return TransferStats(self._blocks, self._bytes, self._clock() - self._t0)

    async def abort(self) -> None:
        self._call.cancel()

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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


class _CappedTransport:
    """One migration's transport: every stage it opens draws on one pacer — ``pacer`` (the shared link budgets,
    ``llumlet.linkbudget``), or a token bucket of this migration alone (empty at the start, holding at most
    ``burst_bytes``, default 10 ms at the cap) — so the cap holds over the whole migration."""

    name: TransportName

    def __init__(
        self,
        rate_cap_bytes_per_s: float = 0.0,
        burst_bytes: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        pacer: Pacer | None = None,
    ) -> None:
        if rate_cap_bytes_per_s < 0:
            raise ValueError(f"{type(self).__name__}: rate_cap_bytes_per_s = {rate_cap_bytes_per_s} < 0")
        self.rate_cap_bytes_per_s = rate_cap_bytes_per_s
        self.clock = clock
        burst = rate_cap_bytes_per_s * 0.01 if burst_bytes is None else burst_bytes
        self._bucket: Pacer | None = pacer or (
            TokenBucket(rate_cap_bytes_per_s, burst, clock, initial_bytes=0.0) if rate_cap_bytes_per_s else None
        )


class GrpcStreamTransport(_CappedTransport):
    """Blocks inline in a gRPC stream, paced by a token bucket when ``rate_cap_bytes_per_s`` > 0."""

    name = TransportName.GRPC
    pool: bytes | None = None

    @property
    def mode(self) -> str:
        """Always "grpc"."""
        return "grpc"

    def open(self, stub: pb_grpc.LlumletAsyncStub, request_id: str, attempt: int) -> BlockStream:
        """A stream for one stage of ``(request_id, attempt)``."""
        return _GrpcBlockStream(stub, request_id, attempt, self._bucket, None, self.clock)


class LocalTransport(_CappedTransport):
    """Peer copies between llumlets of one host: block ids of the source's exported pool (``pool``) travel
    in the stream, the destination copies the blocks itself; without a pool handle the bytes go inline (the
    source sets ``pool`` to None when the destination's Reserve reply says it could not open the pool).
    Capped like the gRPC transport when ``rate_cap_bytes_per_s`` > 0."""

    name = TransportName.LOCAL

    def __init__(
        self,
        pool: bytes | None,
        rate_cap_bytes_per_s: float = 0.0,
        burst_bytes: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        pacer: Pacer | None = None,
    ) -> None:
        super().__init__(rate_cap_bytes_per_s, burst_bytes, clock, pacer)
        self.pool = pool

    @property
    def mode(self) -> str:
        """ "local" (peer copies) or "local-inline" (the source's pool cannot be exported)."""
        return "local" if self.pool is not None else "local-inline"

    def open(self, stub: pb_grpc.LlumletAsyncStub, request_id: str, attempt: int) -> BlockStream:
        """A stream for one stage of ``(request_id, attempt)``."""
        return _GrpcBlockStream(stub, request_id, attempt, self._bucket, self.pool, self.clock)


class PeerPools:
    """Destination side of the local transport: KV pools of peers on this host, opened once, by pool id.

    Keeps the ``capacity`` most recently used (an opened CUDA IPC pool maps the peer's whole KV memory).
    """

    def __init__(self, capacity: int = 16) -> None:
        self._capacity = capacity
        self._pools: OrderedDict[str, KVPool] = OrderedDict()

    def open(self, handle: bytes) -> KVPool:
        """The pool a handle names (opened now or earlier). Raises TransportError when it cannot be opened."""
        from llumlet.kvpool import PoolExportError, open_pool, pool_id

        try:
            key = pool_id(handle)
            pool = self._pools.get(key)
            if pool is None:
                pool = open_pool(handle)
                self._pools[key] = pool
                while len(self._pools) > self._capacity:
                    self._pools.popitem(last=False)
        except (PoolExportError, ValueError) as exc:
            raise TransportError(f"cannot open the source's KV pool: {exc}") from exc
        self._pools.move_to_end(key)
        return pool


def choose_transport(
    hint: TransportName | None,
    graph: TopologyGraph | None,
    src_instance_id: str,
    dst_instance_id: str,
    *,
    cap_fraction: float,
    pool: bytes | None = None,
    grpc_rate_cap_bytes_per_s: float = 0.0,
    local_rate_cap_bytes_per_s: float = 0.0,
    override_rate_cap_bytes_per_s: float = 0.0,
    budgets: LinkBudgets | None = None,
) -> Transport:
    """The transport for a migration ``src -> dst``.

    ``hint`` None = by the topology: ``local`` when both instances are in one NVLink domain
    (``TopologyGraph.path(...).same_domain``), else ``grpc``; without a graph, ``grpc``. ``pool``: the source
    engine's exported KV pool (``llumlet.kvpool.export_pool``), used by ``local``. Rate caps, first that
    applies:

    1. ``override_rate_cap_bytes_per_s`` (the command's): this migration's own cap;
    2. the configured cap of that transport: a budget of this llumlet's migrations on it, shared by them;
    3. ``grpc`` with a graph: the migration budget of every link of the path, ``capacity x cap_fraction``,
       shared by every migration on the link (``budgets``: this llumlet's :class:`LinkBudgets`; None = this
       migration's alone);

    else none.

    Raises:
        KeyError: an instance is not in the topology.
        TransportUnavailable: ``nixl`` was asked for (not installed, or installed but not driven by hilum yet).
    """
    if hint is TransportName.NIXL:
        if not nixl_available():
            raise TransportUnavailable(
                "transport 'nixl' needs the NIXL library, which is not installed here "
                "(pip install nixl-cu12 or nixl-cu13 on a node with RDMA NICs); use 'grpc'"
            )
        raise TransportUnavailable(
            "transport 'nixl': NIXL is installed, but hilum does not drive NIXL transfers yet; use 'grpc' "
            '(docs/migration.md, "Transports")'
        )
    path = graph.path(src_instance_id, dst_instance_id) if graph is not None else None
    name = hint if hint is not None else TransportName(default_transport(path is not None and path.same_domain))
    budgets = budgets or LinkBudgets()
    if name is TransportName.LOCAL:
        if override_rate_cap_bytes_per_s or not local_rate_cap_bytes_per_s:
            return LocalTransport(pool, rate_cap_bytes_per_s=override_rate_cap_bytes_per_s)
        pacer = budgets.pacer({f"llumlet:{src_instance_id}:local": local_rate_cap_bytes_per_s})
        return LocalTransport(pool, local_rate_cap_bytes_per_s, pacer=pacer)
    if override_rate_cap_bytes_per_s:
        return GrpcStreamTransport(rate_cap_bytes_per_s=override_rate_cap_bytes_per_s)
    if grpc_rate_cap_bytes_per_s:
        pacer = budgets.pacer({f"llumlet:{src_instance_id}:grpc": grpc_rate_cap_bytes_per_s})
        return GrpcStreamTransport(grpc_rate_cap_bytes_per_s, pacer=pacer)
    if graph is not None and path is not None and not path.same_domain:
        link_budgets = {link: graph.link_capacity_bytes_per_s(link) * cap_fraction for link in path.links}
        pacer = budgets.pacer({k: v for k, v in link_budgets.items() if math.isfinite(v) and v > 0})
        return GrpcStreamTransport(pacer.rate_cap_bytes_per_s, pacer=pacer)
    return GrpcStreamTransport()
