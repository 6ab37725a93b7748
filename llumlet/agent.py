"""The llumlet: one engine instance's agent — requests, token pushes, load reports and live migration.

A :class:`Llumlet` is three parts over one engine, each in its own module:

- ``llumlet.driver.EngineDriver``: the engine thread and lock, the engine loop, the request books, token
  pushes (numbered per request, to the request's origin) and load reports;
- ``llumlet.migration_out.MigrationSource``: MigrateOut, multi-stage pre-copy to another llumlet;
- ``llumlet.migration_in.MigrationDestination``: Reserve / WriteBlocks / Commit / Release of incoming moves.

It speaks plain dataclasses (``llumlet.migration_types``); ``llumlet.server`` is the gRPC edge.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from llumlet.backends.base import Backend
from llumlet.driver import EngineDriver, LoadSnapshot
from llumlet.engine.prefix_hash import PrefixCacheConfig
from llumlet.engine.types import EngineRequest
from llumlet.migration_in import IncomingChunk, MigrationDestination
from llumlet.migration_out import MigrationSource
from llumlet.migration_types import (
    NO_PREFIX,
    CommitCall,
    DestReply,
    MigrationCommand,
    MigrationConfig,
    MigrationHooks,
    MigrationReport,
    PromptPrefix,
    Released,
    Reserved,
    Written,
)
from llumlet.transport import Transport
from topology.graph import TopologyGraph
from topology.spec import Topology

__all__ = ["Llumlet", "LlumletConfig", "PingInfo"]


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
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)  # report_max_hashes caps reports


@dataclass(frozen=True, slots=True)
class PingInfo:
    """Identity and KV block geometry of a llumlet (``hilum.v1.LlumletPingReply``)."""

    instance_id: str
    domain_id: str
    engine: str  # backend name: sim, torch, vllm
    block_size_tokens: int
    kv_bytes_per_block: int
    failure: str = ""  # why its engine failed ("" = healthy)


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
        self.driver = EngineDriver(
            config.instance_id,
            backend,
            rng=rng or random.Random(0),
            clock=clock,
            wall_clock=wall_clock,
            push_retries=config.push_retries,
            idle_retry_s=config.idle_retry_s,
            load_min_interval_s=config.load_min_interval_s,
            rpc_timeout_s=config.migration.rpc_timeout_s,
        )
        graph = TopologyGraph(topology) if topology is not None else None
        self.source = MigrationSource(
            self.driver, config.migration, graph=graph, hooks=hooks, transport_for=transport_for
        )
        self.destination = MigrationDestination(self.driver, config.migration, moved_ttl_s=config.moved_ttl_s)

    @property
    def address(self) -> str:
        """This llumlet's ``host:port`` (after ``start``)."""
        return self.driver.address

    async def start(self, address: str) -> None:
        """Start the engine loop and the reservation reaper; ``address`` is this llumlet's ``host:port``."""
        await self.driver.start(address)
        self.destination.start()

    async def stop(self) -> None:
        """Stop every loop, close channels, shut the engine thread down."""
        await self.driver.stop()
        self.source.budgets.close()

    # ---- requests and load ----------------------------------------------------------------------
    async def submit(self, request: EngineRequest, origin: str, *, first_seq: int = 0) -> str | None:
        """Queue a request whose tokens go to ``origin`` (numbered from ``first_seq``); the reason when it is not
        accepted, else None."""
        reserved = request.request_id in self.destination.reservations
        return await self.driver.submit(request, origin, reserved=reserved, first_seq=first_seq)

    def arrival_s(self) -> float:
        """Arrival time stamp of a new request (wall clock, comparable across hosts)."""
        return self.driver.arrival_s()

    async def abort(self, request_id: str) -> tuple[bool, str]:
        """Abort a request here or where it migrated: (found, forwarded_to address)."""
        return await self.driver.abort(request_id)

    def _with_counters(self, snap: LoadSnapshot) -> LoadSnapshot:
        return replace(
            snap,
            num_reservations=len(self.destination.reservations),
            num_migrations_out=self.source.in_flight,
        )

    async def load(self) -> LoadSnapshot:
        """The engine's load with the llumlet's counters."""
        return self._with_counters(await self.driver.load())

    async def watch_load(self, min_interval_s: float) -> AsyncIterator[LoadSnapshot]:
        """The load now, then after every change (at most one report per ``min_interval_s``)."""
        async for snap in self.driver.watch(min_interval_s):
            yield self._with_counters(snap)

    def ping(self) -> PingInfo:
        """Identity and block geometry."""
        return PingInfo(
            instance_id=self.config.instance_id,
            domain_id=self.config.domain_id,
            engine=self.backend.name,
            block_size_tokens=self.engine.block_size_tokens,
            kv_bytes_per_block=self.engine.kv_bytes_per_block,
            failure=self.driver.failure,
        )

    # ---- migration --------------------------------------------------------------------------------
    async def migrate_out(self, cmd: MigrationCommand) -> MigrationReport:
        """Migrate a request to another llumlet (``llumlet.migration_out``)."""
        return await self.source.migrate_out(cmd)

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
        """Destination: reserve or grow, or start re-prefilling the prefix (``llumlet.migration_in``)."""
        return await self.destination.reserve(
            request_id,
            attempt,
            num_blocks,
            src_instance_id=src_instance_id,
            expiry_s=expiry_s,
            prefix=prefix,
            pool=pool,
            prefix_blocks=prefix_blocks,
            recompute_blocks=recompute_blocks,
        )

    async def write_blocks(self, chunks: AsyncIterator[IncomingChunk]) -> Written:
        """Destination: store a stream of block runs."""
        return await self.destination.write_blocks(chunks)

    async def commit(self, call: CommitCall) -> DestReply:
        """Destination: adopt a migrated request."""
        return await self.destination.commit(call)

    async def release(self, request_id: str, attempt: int) -> Released:
        """Destination: release a reservation (idempotent)."""
        return await self.destination.release(request_id, attempt)
