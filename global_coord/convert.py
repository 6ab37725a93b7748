"""Conversions between protobuf messages (``hilum_proto.v1``) and hilum's dataclasses — only at the edge.

Nothing outside the gRPC servers and clients touches a ``*_pb2`` message; they call these functions.
Functions named after the message build it; ``*_from_pb`` functions read one and raise ``ValueError``
(with the field named) on bad input.
"""

from __future__ import annotations

from clusterstate.records import (
    AutoscaleRecord,
    DomainRegistration,
    DrainIntent,
    DrainKind,
    InstanceRegistration,
    MigrationRecord,
    MigrationState,
    ScaleEvent,
    SummaryRecord,
)
from global_coord.approver import MoveProposal
from global_coord.coordinator import StatusInfo, TopologyLike
from hilum_proto.v1 import coordinator_pb2 as pb
from policy.autoscale import AutoscaleConfig
from policy.domain import DomainSummary, InstanceBrief

__all__ = [
    "autoscale_reply",
    "brief",
    "brief_from_pb",
    "domain_info",
    "drain_intent",
    "drain_target_from_pb",
    "instance_info",
    "migration",
    "migration_record_from_pb",
    "move_proposal",
    "move_proposal_from_pb",
    "status_reply",
    "summary",
    "summary_from_pb",
    "topology_reply",
]

_STATE_TO_PB = {
    MigrationState.PROPOSED: pb.MIGRATION_STATE_PROPOSED,
    MigrationState.APPROVED: pb.MIGRATION_STATE_APPROVED,
    MigrationState.COMMITTED: pb.MIGRATION_STATE_COMMITTED,
    MigrationState.ABORTED: pb.MIGRATION_STATE_ABORTED,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


def status_reply(info: StatusInfo) -> pb.StatusReply:
    """StatusReply from one replica's :class:`StatusInfo`."""
    leader = info.leader
    return pb.StatusReply(
        coordinator_id=info.coordinator_id,
        is_leader=info.is_leader,
        leader_id=leader.leader_id if leader else "",
        leader_address=leader.address if leader else "",
        fencing_token=leader.token if leader else 0,
        etcd_endpoint=info.etcd_endpoint,
        view_revision=info.view_revision,
        num_domains=info.num_domains,
        num_instances=info.num_instances,
        num_active_migrations=info.num_active_migrations,
        num_drains=info.num_drains,
    )


def brief(b: InstanceBrief) -> pb.InstanceBrief:
    """InstanceBrief message of one instance in its domain's summary (every field)."""
    return pb.InstanceBrief(
        instance_id=b.instance_id,
        capacity_blocks=b.capacity_blocks,
        free_blocks=b.free_blocks,
        virtual_usage=b.virtual_usage,
        num_running=b.num_running,
        num_waiting=b.num_waiting,
        draining=b.draining,
        decode_step_s=b.decode_step_s,
        max_num_seqs=b.max_num_seqs,
        prefix_hashes=sorted(b.prefix_hashes),
        prefill_s_per_token=b.prefill_s_per_token,
    )


def brief_from_pb(msg: pb.InstanceBrief) -> InstanceBrief:
    """The ``policy.domain.InstanceBrief`` of a message. Raises ValueError on inconsistent counts."""
    return InstanceBrief(
        instance_id=msg.instance_id,
        capacity_blocks=msg.capacity_blocks,
        free_blocks=msg.free_blocks,
        virtual_usage=msg.virtual_usage,
        num_running=msg.num_running,
        num_waiting=msg.num_waiting,
        draining=msg.draining,
        decode_step_s=msg.decode_step_s,
        max_num_seqs=msg.max_num_seqs,
        prefix_hashes=frozenset(msg.prefix_hashes),
        prefill_s_per_token=msg.prefill_s_per_token,
    )


def summary(s: DomainSummary) -> pb.DomainSummary:
    """DomainSummary message of the rule book's ``DomainSummary`` (every field)."""
    return pb.DomainSummary(
        domain_id=s.domain_id,
        num_instances=s.num_instances,
        capacity_blocks=s.capacity_blocks,
        virtual_usage=s.virtual_usage,
        freeness=s.freeness,
        largest_free_blocks=s.largest_free_blocks,
        max_instance_capacity_blocks=s.max_instance_capacity_blocks,
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        draining=s.draining,
        queued_blocks=s.queued_blocks,
        model=s.model,
        taken_s=s.taken_s,
        instances=[brief(b) for b in s.instances],
        prefix_hashes=[] if s.instances else sorted(s.prefix_hashes),  # else derived from the instances
    )


def summary_from_pb(msg: pb.DomainSummary) -> DomainSummary:
    """The rule book's ``DomainSummary`` of a message. Raises ValueError on an empty domain id or bad counts."""
    if not msg.domain_id:
        raise ValueError("DomainSummary.domain_id is empty")
    return DomainSummary(
        domain_id=msg.domain_id,
        num_instances=msg.num_instances,
        capacity_blocks=msg.capacity_blocks,
        virtual_usage=msg.virtual_usage,
        freeness=msg.freeness,
        largest_free_blocks=msg.largest_free_blocks,
        max_instance_capacity_blocks=msg.max_instance_capacity_blocks,
        num_running=msg.num_running,
        num_waiting=msg.num_waiting,
        draining=msg.draining,
        queued_blocks=msg.queued_blocks,
        model=msg.model,
        taken_s=msg.taken_s,
        instances=tuple(brief_from_pb(b) for b in msg.instances),
        prefix_hashes=frozenset(msg.prefix_hashes),
    )


def domain_info(
    domain_id: str,
    registration: DomainRegistration | None,
    record: SummaryRecord | None,
    draining: bool,
) -> pb.DomainInfo:
    """DomainInfo of what the view knows about one domain."""
    return pb.DomainInfo(
        domain_id=domain_id,
        scheduler_address=registration.address if registration else "",
        registered=registration is not None,
        draining=draining,
        summaries=[summary(s) for s in record.summaries] if record is not None else [],
    )


def instance_info(reg: InstanceRegistration, draining: bool, load: InstanceBrief | None = None) -> pb.InstanceInfo:
    """InstanceInfo of a registration, with its brief from the domain's summary when published."""
    msg = pb.InstanceInfo(
        instance_id=reg.instance_id,
        domain_id=reg.domain_id,
        node_id=reg.node_id,
        address=reg.address,
        model=reg.model,
        capacity_blocks=reg.capacity_blocks,
        draining=draining,
        has_load=load is not None,
    )
    if load is not None:
        msg.load.CopyFrom(brief(load))
    return msg


def migration(record: MigrationRecord, mod_revision: int) -> pb.Migration:
    """Migration message of a record and its etcd mod revision."""
    return pb.Migration(
        migration_id=record.migration_id,
        request_id=record.request_id,
        attempt=record.attempt,
        src_instance_id=record.src_instance_id,
        dst_instance_id=record.dst_instance_id,
        src_domain_id=record.src_domain_id,
        dst_domain_id=record.dst_domain_id,
        blocks=record.blocks,
        state=_STATE_TO_PB[record.state],
        fencing_token=record.fencing_token,
        links=list(record.links),
        expected_transfer_s=record.expected_transfer_s,
        expected_downtime_s=record.expected_downtime_s,
        reason=record.reason,
        mod_revision=mod_revision,
        transport=record.transport,
        measured_bandwidth_bytes_per_s=record.measured_bandwidth_bytes_per_s,
        measured_at_s=record.measured_at_s,
        plan=record.plan,
        measured_downtime_s=record.measured_downtime_s,
    )


def migration_record_from_pb(msg: pb.Migration) -> tuple[MigrationRecord, int]:
    """(record, mod revision) of a Migration message. Raises ValueError on an unspecified state."""
    if msg.state not in _STATE_FROM_PB:
        raise ValueError(f"Migration {msg.migration_id!r}: state is unspecified")
    record = MigrationRecord(
        migration_id=msg.migration_id,
        request_id=msg.request_id,
        attempt=msg.attempt,
        src_instance_id=msg.src_instance_id,
        dst_instance_id=msg.dst_instance_id,
        src_domain_id=msg.src_domain_id,
        dst_domain_id=msg.dst_domain_id,
        blocks=msg.blocks,
        state=_STATE_FROM_PB[msg.state],
        fencing_token=msg.fencing_token,
        links=tuple(msg.links),
        expected_transfer_s=msg.expected_transfer_s,
        expected_downtime_s=msg.expected_downtime_s,
        reason=msg.reason,
        transport=msg.transport,
        measured_bandwidth_bytes_per_s=msg.measured_bandwidth_bytes_per_s,
        measured_at_s=msg.measured_at_s,
        plan=msg.plan,
        measured_downtime_s=msg.measured_downtime_s,
    )
    return record, msg.mod_revision


def drain_intent(intent: DrainIntent) -> pb.DrainIntent:
    """DrainIntent message."""
    return pb.DrainIntent(
        kind=intent.kind.value,
        target_id=intent.target_id,
        reason=intent.reason,
        fencing_token=intent.fencing_token,
    )


def drain_target_from_pb(msg: pb.DrainRequest | pb.UndrainRequest) -> tuple[DrainKind, str]:
    """(kind, target id) named by a Drain/Undrain request. Raises ValueError when none is set, or it is blank."""
    which = msg.WhichOneof("target")
    if which == "instance_id" and msg.instance_id.strip():
        return DrainKind.INSTANCE, msg.instance_id
    if which == "domain_id" and msg.domain_id.strip():
        return DrainKind.DOMAIN, msg.domain_id
    raise ValueError("drain target: set exactly one of instance_id or domain_id (non-empty, not blank)")


def move_proposal(move: MoveProposal) -> pb.MigrationProposal:
    """MigrationProposal message (used by domain schedulers)."""
    return pb.MigrationProposal(
        proposer_domain_id=move.proposer_domain_id,
        request_id=move.request_id,
        attempt=move.attempt,
        src_instance_id=move.src_instance_id,
        dst_instance_id=move.dst_instance_id,
        blocks=move.blocks,
        num_tokens=move.num_tokens,
        remaining_tokens=move.remaining_tokens,
        decode_step_s=move.decode_step_s,
        model=move.model,
        max_blocks=move.max_blocks,
        dst_domain_id=move.dst_domain_id,
        prefix_hashes=move.prefix_hashes,
        prefix_block_tokens=move.prefix_block_tokens,
    )


def move_proposal_from_pb(msg: pb.MigrationProposal) -> MoveProposal:
    """MoveProposal of a MigrationProposal. Raises ValueError naming each bad field."""
    return MoveProposal(
        proposer_domain_id=msg.proposer_domain_id,
        request_id=msg.request_id,
        attempt=msg.attempt,
        src_instance_id=msg.src_instance_id,
        dst_instance_id=msg.dst_instance_id,
        blocks=msg.blocks,
        num_tokens=msg.num_tokens,
        remaining_tokens=msg.remaining_tokens,
        decode_step_s=msg.decode_step_s,
        model=msg.model,
        max_blocks=msg.max_blocks,
        dst_domain_id=msg.dst_domain_id,
        prefix_hashes=tuple(msg.prefix_hashes),
        prefix_block_tokens=msg.prefix_block_tokens,
    )


def topology_reply(topo: TopologyLike | None) -> pb.TopologyReply:
    """TopologyReply of a loaded topology (``loaded=False`` when None)."""
    if topo is None:
        return pb.TopologyReply(loaded=False)
    return pb.TopologyReply(
        loaded=True,
        name=topo.name,
        source=topo.source,
        domains=[
            pb.TopologyDomain(
                domain_id=d.domain_id,
                kind=d.kind,
                gpu_type=d.gpu_type,
                instances=[
                    pb.TopologyInstance(
                        instance_id=i.instance_id,
                        node_id=i.node_id,
                        gpus=list(i.gpus),
                        tensor_parallel_size=i.tensor_parallel_size,
                        model=i.model,
                        gpu_type=i.gpu_type,
                        kv_capacity_blocks=i.kv_capacity_blocks,
                    )
                    for i in d.instances
                ],
            )
            for d in topo.domains
        ],
    )


def _scale_event(e: ScaleEvent) -> pb.ScaleEvent:
    return pb.ScaleEvent(
        action=e.action,
        instance_id=e.instance_id,
        at_s=e.at_s,
        reason=e.reason,
        status=e.status,
        attempts=e.attempts,
        exit_code=e.exit_code,
        output=e.output,
        finished_s=e.finished_s,
    )


def _autoscale_model(r: AutoscaleRecord) -> pb.AutoscaleModel:
    msg = pb.AutoscaleModel(
        model=r.model,
        instances=[
            pb.AutoscaleInstance(instance_id=t.instance_id, phase=t.phase.value, since_s=t.since_s)
            for t in r.state.tracked
        ],
        last_action_s=r.state.last_action_s,
        events=[_scale_event(e) for e in r.events],
        fencing_token=r.fencing_token,
    )
    ev = r.evaluation
    if ev is not None:
        msg.evaluated_at_s = ev.at_s
        if ev.freeness is not None:
            msg.freeness = ev.freeness
        if ev.freeness_without_candidate is not None:
            msg.freeness_without_candidate = ev.freeness_without_candidate
        msg.candidate = ev.candidate
        msg.live, msg.coming, msg.draining, msg.requests = ev.live, ev.coming, ev.draining, ev.requests
        msg.min_instances, msg.max_instances = ev.min_instances, ev.max_instances
    return msg


def autoscale_reply(
    rule: AutoscaleConfig, command: str, records: dict[str, AutoscaleRecord], revision: int
) -> pb.AutoscaleReply:
    """AutoscaleReply: this replica's rule (and hook ``command``) and every model's record, sorted by model."""
    return pb.AutoscaleReply(
        rule=pb.AutoscaleRule(
            enabled=rule.enabled,
            interval_s=rule.interval_s,
            scale_out_freeness_below=rule.scale_out_freeness_below,
            scale_in_freeness_above=rule.scale_in_freeness_above,
            scale_out_hold_s=rule.scale_out_hold_s,
            scale_in_hold_s=rule.scale_in_hold_s,
            cool_down_s=rule.cool_down_s,
            min_instances=rule.min_instances,
            max_instances=rule.max_instances,
            start_timeout_s=rule.start_timeout_s,
            command=command,
        ),
        models=[_autoscale_model(records[m]) for m in sorted(records)],
        view_revision=revision,
    )
