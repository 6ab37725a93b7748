"""The coordinator's gRPC server (grpc.aio): the admin API for ``hilumctl`` and ProposeMigration.

Reads are answered by any replica from its view; writes by the leader only — a standby answers them
with ``FAILED_PRECONDITION`` and a message naming the leader and its address. Bad requests get
``INVALID_ARGUMENT`` with the field named.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from clusterstate.records import ACTIVE_STATES, DrainKind, MigrationRecord
from global_coord import convert
from global_coord.actuator import ActuatorConfig
from global_coord.coordinator import Coordinator, NotLeader
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import coordinator_pb2_grpc as pb_grpc
from policy.autoscale import AutoscaleConfig

__all__ = ["CoordinatorService", "start_server"]

_log = logging.getLogger(__name__)

_Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """Implements ``hilum.v1.Coordinator`` over one :class:`Coordinator` replica.

    ``autoscale`` / ``actuator``: the replica's autoscale settings, shown by GetAutoscale (defaults: disabled).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        autoscale: AutoscaleConfig | None = None,
        actuator: ActuatorConfig | None = None,
    ) -> None:
        self._c = coordinator
        self._autoscale = autoscale if autoscale is not None else AutoscaleConfig()
        self._actuator = actuator if actuator is not None else ActuatorConfig()

    async def Status(self, request: pb.StatusRequest, context: _Ctx) -> pb.StatusReply:
        return convert.status_reply(self._c.status())

    def _known(self) -> tuple[set[str], set[str]]:
        """(instance ids, domain ids) the cluster has, drain intents aside: registered, or in the coordinator's
        topology; a domain also when it has a summary or a registered llumlet names it."""
        view, topology = self._c.view, self._c.topology
        instances = set(view.instances())
        domains = set(view.domains()) | set(view.summaries()) | {r.domain_id for r in view.instances().values()}
        if topology is not None:
            instances |= {i.instance_id for d in topology.domains for i in d.instances}
            domains |= {d.domain_id for d in topology.domains}
        return instances, domains

    async def ListDomains(self, request: pb.ListDomainsRequest, context: _Ctx) -> pb.ListDomainsReply:
        view = self._c.view
        regs, summaries, drains = view.domains(), view.summaries(), view.drains()
        # every domain the cluster has, not only those with a scheduler now: the topology's, and any a registered
        # llumlet names (a scheduler that has been away past its lease, or was never started, shows as registered
        # False, and hilumctl says so, instead of the domain vanishing from `domains` and `requests`)
        ids = sorted(self._known()[1] | {t for k, t in drains if k is DrainKind.DOMAIN})
        domains = [convert.domain_info(d, regs.get(d), summaries.get(d), (DrainKind.DOMAIN, d) in drains) for d in ids]
        return pb.ListDomainsReply(domains=domains, view_revision=view.revision)

    async def ListInstances(self, request: pb.ListInstancesRequest, context: _Ctx) -> pb.ListInstancesReply:
        view = self._c.view
        drains = view.drains()
        summaries = view.summaries()
        out = []
        for iid, reg in sorted(view.instances().items()):
            if request.domain_id and reg.domain_id != request.domain_id:
                continue
            draining = (DrainKind.INSTANCE, iid) in drains or (DrainKind.DOMAIN, reg.domain_id) in drains
            record = summaries.get(reg.domain_id)
            load = record.instances().get(iid) if record else None
            out.append(convert.instance_info(reg, draining, load))
        return pb.ListInstancesReply(instances=out, view_revision=view.revision)

    async def ListDrains(self, request: pb.ListDrainsRequest, context: _Ctx) -> pb.ListDrainsReply:
        view = self._c.view
        instances, domains = self._known()
        out = [
            pb.DrainEntry(
                intent=convert.drain_intent(intent),
                target_known=target in (instances if kind is DrainKind.INSTANCE else domains),
            )
            for (kind, target), intent in sorted(view.drains().items(), key=lambda kv: (kv[0][0].value, kv[0][1]))
        ]
        return pb.ListDrainsReply(drains=out, view_revision=view.revision)

    async def ListMigrations(self, request: pb.ListMigrationsRequest, context: _Ctx) -> pb.ListMigrationsReply:
        view = self._c.view
        out = [
            convert.migration(record, rev)
            for _, (record, rev) in sorted(view.migrations().items())
            if not request.active_only or record.state in ACTIVE_STATES
        ]
        return pb.ListMigrationsReply(migrations=out, view_revision=view.revision)

    async def FollowMigrations(
        self, request: pb.FollowMigrationsRequest, context: _Ctx
    ) -> AsyncIterator[pb.MigrationEvent]:
        view = self._c.view
        sent: dict[str, tuple[MigrationRecord, int]] = {}
        while True:
            # The version read with the snapshot, before anything is sent: a change made while the events are
            # being sent (each send awaits the client) wakes the next round instead of being missed.
            version = view.version
            current = view.migrations()
            for mid in sorted(set(sent) - set(current)):
                yield pb.MigrationEvent(deleted=True, migration=pb.Migration(migration_id=mid))
            for mid, (record, rev) in sorted(current.items()):
                if sent.get(mid) != (record, rev):
                    yield pb.MigrationEvent(deleted=False, migration=convert.migration(record, rev))
            sent = current
            await view.wait_changed(version)

    async def _leader_only(self, context: _Ctx, exc: NotLeader) -> None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def Drain(self, request: pb.DrainRequest, context: _Ctx) -> pb.DrainReply:
        try:
            kind, target = convert.drain_target_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            changed, intent = await self._c.drain(kind, target, request.reason)
        except NotLeader as exc:
            await self._leader_only(context, exc)
            raise
        return pb.DrainReply(changed=changed, intent=convert.drain_intent(intent))

    async def Undrain(self, request: pb.UndrainRequest, context: _Ctx) -> pb.DrainReply:
        try:
            kind, target = convert.drain_target_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            changed, intent = await self._c.undrain(kind, target)
        except NotLeader as exc:
            await self._leader_only(context, exc)
            raise
        return pb.DrainReply(changed=changed, intent=convert.drain_intent(intent))

    async def GetTopology(self, request: pb.GetTopologyRequest, context: _Ctx) -> pb.TopologyReply:
        return convert.topology_reply(self._c.topology)

    async def GetAutoscale(self, request: pb.GetAutoscaleRequest, context: _Ctx) -> pb.AutoscaleReply:
        view = self._c.view
        return convert.autoscale_reply(self._autoscale, self._actuator.command, view.autoscale(), view.revision)

    async def ProposeMigration(self, request: pb.MigrationProposal, context: _Ctx) -> pb.Approval:
        try:
            move = convert.move_proposal_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            result = await self._c.propose(move)
        except NotLeader as exc:
            await self._leader_only(context, exc)
            raise
        reply = pb.Approval(approved=result.approved, reason=result.reason, fencing_token=result.fencing_token)
        if result.record is not None:
            reply.migration.CopyFrom(convert.migration(result.record, result.mod_revision))
        return reply


async def start_server(
    coordinator: Coordinator,
    server: grpc.aio.Server,
    autoscale: AutoscaleConfig | None = None,
    actuator: ActuatorConfig | None = None,
) -> None:
    """Add the Coordinator service for ``coordinator`` to a bound ``server`` and start it (``autoscale``,
    ``actuator``: the settings GetAutoscale shows)."""
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorService(coordinator, autoscale, actuator), server)
    await server.start()
    _log.debug("coordinator %s serving at %s", coordinator.cfg.coordinator_id, coordinator.cfg.advertise_address)
