"""In-process llumlets on real gRPC (loopback) for tests: :func:`start_llumlet` and :class:`RunningLlumlet`.

Separate processes: :mod:`llumlet.procs`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from llumlet.agent import Llumlet, LlumletConfig
from llumlet.backends import BackendConfig, make_backend
from llumlet.client import LlumletClient
from llumlet.migration_types import MigrationCommand, MigrationConfig, MigrationHooks
from llumlet.server import serve
from llumlet.transport import Transport
from topology.spec import Topology

__all__ = ["RunningLlumlet", "start_llumlet"]


@dataclass(slots=True)
class RunningLlumlet:
    """A llumlet serving on loopback in this process, with a client to it."""

    llumlet: Llumlet
    server: grpc.aio.Server
    address: str
    client: LlumletClient

    async def stop(self) -> None:
        """Stop the server, the llumlet and the client."""
        await self.server.stop(grace=None)
        await self.llumlet.stop()
        await self.client.close()


async def start_llumlet(
    instance_id: str,
    *,
    engine: str = "sim",
    backend: BackendConfig | None = None,
    domain_id: str = "",
    migration: MigrationConfig | None = None,
    topology: Topology | None = None,
    hooks: MigrationHooks | None = None,
    transport_for: Callable[[MigrationCommand], Transport] | None = None,
    seed: int = 0,
) -> RunningLlumlet:
    """Build a backend, a llumlet and its service on ``127.0.0.1:0``."""
    be = make_backend(engine, backend or BackendConfig(instance_id=instance_id, topology=topology))
    if topology is not None and not domain_id:
        domain_id = topology.instance(instance_id).domain_id
    config = LlumletConfig(instance_id=instance_id, domain_id=domain_id, migration=migration or MigrationConfig())
    llumlet = Llumlet(config, be, topology=topology, rng=random.Random(seed), hooks=hooks, transport_for=transport_for)
    server, address = await serve(llumlet, "127.0.0.1:0")
    return RunningLlumlet(llumlet, server, address, LlumletClient(address))
