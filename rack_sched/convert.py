"""Protobuf <-> hilum dataclasses at the domain scheduler's gRPC edge; nothing else touches ``*_pb2``.

``*_from_pb`` functions read a message and raise ``ValueError`` naming the field on bad input; functions
named after a message build it.
"""

from __future__ import annotations

import math

from hilum_proto.v1 import llumlet_pb2
from hilum_proto.v1 import rack_sched_pb2 as pb
from llumlet.convert import load_from_pb as engine_load_from_pb
from policy.load import InstanceLoad
from rack_sched.types import DispatchOutcome, DispatchResult, DomainStateInfo

__all__ = ["dispatch_reply", "domain_state", "load_from_pb", "prompt_length"]

_OUTCOME_TO_PB = {
    DispatchOutcome.ACCEPTED: pb.DISPATCH_ACCEPTED,
    DispatchOutcome.REFUSED: pb.DISPATCH_REFUSED,
    DispatchOutcome.UNAVAILABLE: pb.DISPATCH_UNAVAILABLE,
    DispatchOutcome.FULL: pb.DISPATCH_FULL,
}


def load_from_pb(report: llumlet_pb2.LoadReport, instance_id: str, domain_id: str) -> InstanceLoad:
    """The ``InstanceLoad`` of a llumlet's ``LoadReport``: ``llumlet.convert.load_from_pb`` then
    ``EngineLoad.to_instance_load`` — the one conversion every tier uses — with the report's step time.

    ``used_blocks`` counts reservations for incoming migrations (they hold capacity); evictable cached prefix
    blocks count as free; suspended (leaving) requests are not running; a request still in prefill, or one
    its engine cannot move faithfully (``unmigratable_reason``), is not migratable. ``draining`` is left
    False: the scheduler applies drain intents itself.

    Raises:
        ValueError: when the report names another instance, or its counts are inconsistent
            (e.g. more used than total blocks), with the instance named.
    """
    if report.instance_id and report.instance_id != instance_id:
        raise ValueError(f"load report of {instance_id}: it names instance {report.instance_id!r}")
    if report.prefix_hashes and report.prefix_block_tokens < 1:
        raise ValueError(
            f"load report of {instance_id}: {len(report.prefix_hashes)} prefix_hashes but prefix_block_tokens is 0"
        )
    step_s = report.recent_step_s if math.isfinite(report.recent_step_s) and report.recent_step_s > 0 else 0.0
    if not (math.isfinite(report.prefill_s_per_token) and report.prefill_s_per_token >= 0):
        raise ValueError(
            f"load report of {instance_id}: prefill_s_per_token must be a finite number >= 0, "
            f"got {report.prefill_s_per_token}"
        )
    return engine_load_from_pb(report).to_instance_load(instance_id, domain_id, decode_step_s=step_s)


def prompt_length(request: llumlet_pb2.SubmitRequest) -> int:
    """Prompt tokens of a Submit: ``len(prompt_token_ids)`` when given, else ``prompt_tokens``.

    Raises:
        ValueError: on an empty request id, a negative priority, ``max_tokens`` < 1, or both prompt fields
            set and disagreeing.
    """
    problems = []
    if not request.request_id:
        problems.append("request_id is empty")
    if request.priority < 0:
        problems.append(f"priority must be >= 0, got {request.priority}")
    if request.sampling.max_tokens < 1:
        problems.append(f"sampling.max_tokens must be >= 1, got {request.sampling.max_tokens}")
    n_ids = len(request.prompt_token_ids)
    if n_ids and request.prompt_tokens and n_ids != request.prompt_tokens:
        problems.append(f"prompt_tokens is {request.prompt_tokens} but prompt_token_ids has {n_ids} tokens")
    if problems:
        raise ValueError(f"SubmitRequest {request.request_id!r}: " + "; ".join(problems))
    return n_ids or request.prompt_tokens


def dispatch_reply(result: DispatchResult) -> pb.DispatchReply:
    """DispatchReply of a :class:`DispatchResult`."""
    return pb.DispatchReply(
        outcome=_OUTCOME_TO_PB[result.outcome],
        reason=result.reason,
        instance_id=result.instance_id,
        instance_address=result.instance_address,
        demand_blocks=result.demand_blocks,
    )


def domain_state(info: DomainStateInfo) -> pb.DomainState:
    """DomainState of the scheduler's :class:`DomainStateInfo`."""
    return pb.DomainState(
        domain_id=info.domain_id,
        ready=info.ready,
        domain_draining=info.domain_draining,
        migrations_in_flight=info.migrations_in_flight,
        migrations_committed=info.migrations_committed,
        migrations_aborted=info.migrations_aborted,
        cross_domain_proposed=info.cross_domain_proposed,
        cross_domain_approved=info.cross_domain_approved,
        summaries_published=info.summaries_published,
        newest_fencing_token=info.newest_fencing_token,
        fallback_dispatches=info.fallback_dispatches,
        instances=[
            pb.InstanceState(
                instance_id=i.instance_id,
                address=i.address,
                connected=i.connected,
                has_load=i.load is not None,
                draining=i.draining,
                capacity_blocks=i.load.capacity_blocks if i.load else 0,
                used_blocks=i.load.used_blocks if i.load else 0,
                num_running=len(i.load.running) if i.load else 0,
                num_waiting=i.load.num_waiting if i.load else 0,
                freeness=i.freeness if i.load else math.nan,
                load_version=i.load_version,
                running_request_ids=[r.request_id for r in i.load.running] if i.load else [],
                failure=i.failure,
                num_prefix_hashes=len(i.load.prefix_hashes) if i.load else 0,
            )
            for i in info.instances
        ],
    )
