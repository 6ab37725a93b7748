"""``hilumctl requests``: the running requests, asked of every domain scheduler (``GetDomainState``).

The coordinator's ``ListDomains`` names each domain's scheduler (``scheduler_address``); each scheduler
answers with its instances, their running request ids and waiting counts (``hilum.v1.DomainState``).
Schedulers are asked concurrently; one that does not answer is reported (and the others still shown).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from hilum_proto.tls import open_channel
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import rack_sched_pb2, rack_sched_pb2_grpc

__all__ = ["DomainAnswer", "ask_domain", "ask_domains"]


@dataclass(frozen=True, slots=True)
class DomainAnswer:
    """One domain scheduler's answer: ``state`` when it answered, else ``error`` (a sentence)."""

    domain_id: str
    scheduler_address: str | None
    state: rack_sched_pb2.DomainState | None
    error: str | None


async def ask_domain(domain_id: str, address: str | None, timeout_s: float) -> DomainAnswer:
    """``GetDomainState`` of ``domain_id``'s scheduler at ``address`` (host:port), within ``timeout_s`` seconds.

    Never raises for a scheduler that is absent or fails: the answer's ``error`` says what happened.
    """
    if not address:
        return DomainAnswer(
            domain_id, None, None,
            f"domain {domain_id} has no domain scheduler registered: start `python -m rack_sched --domain-id "
            f"{domain_id} ...` (its requests cannot be listed)",
        )  # fmt: skip
    try:
        async with open_channel(address) as channel:
            stub = rack_sched_pb2_grpc.RackSchedulerStub(channel)
            state = await stub.GetDomainState(rack_sched_pb2.GetDomainStateRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            why = f"no domain scheduler answers at {address} ({exc.details()})"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            why = f"the domain scheduler at {address} did not answer within {timeout_s:g} s (raise --rpc-timeout?)"
        else:
            why = f"GetDomainState at {address} failed: {code.name}: {exc.details()}"
        return DomainAnswer(
            domain_id, address, None,
            f"domain {domain_id}: {why}; check that its `python -m rack_sched` runs and listens there",
        )  # fmt: skip
    return DomainAnswer(domain_id, address, state, None)


async def ask_domains(domains: Sequence[pb.DomainInfo], timeout_s: float) -> list[DomainAnswer]:
    """:func:`ask_domain` for each domain, concurrently; answers in the order of ``domains``."""
    return list(
        await asyncio.gather(*(ask_domain(d.domain_id, d.scheduler_address or None, timeout_s) for d in domains))
    )
