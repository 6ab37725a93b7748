"""Domain choice: the rule book over domain summaries, a local reservation per pick, retries elsewhere.

The gateway sees the cluster through etcd (a :class:`~clusterstate.store.ClusterView`, watched): each
domain scheduler's registration (``P domains/<id>``: its address) and its published summary
(``P summaries/<id>``). :class:`DomainRouter` keeps a :class:`policy.dispatch.DomainDispatchView` over
those summaries — the same freeness rule a domain scheduler applies to its instances (DESIGN.md, "Virtual
usage"): the freest domain that can hold the request, near-ties drawn at random. Each pick reserves the
request's demand in the view until that domain's next summary, so a burst does not herd onto one domain.

The chosen domain scheduler gets ``Submit`` (rack_sched.proto). Its answer:

- ``DISPATCH_ACCEPTED``: done (instance id and llumlet address returned);
- ``DISPATCH_FULL`` (asked ``only_if_room`` and no instance has room now): the next domain is tried; when
  every domain was full, the freest is asked again to queue it (``gateway.core.PlacementAttempt``);
- ``DISPATCH_REFUSED`` (every instance draining, or the llumlet refused it): the next domain is tried;
- ``DISPATCH_UNAVAILABLE`` or an RPC error (view being rebuilt, scheduler down): the next domain is tried;
  when every domain was tried and some were only unavailable, they are tried again after a jittered backoff
  until ``unavailable_wait_s`` has passed. A scheduler that did not answer at all (an RPC error: frozen,
  unreachable) is tried after the other domains by the requests of the next ``unavailable_wait_s``, until it
  answers or publishes a new summary: each would otherwise wait the whole Submit deadline first.

Nothing left: :class:`DispatchFailed` with every domain's reason (the HTTP side answers 503). Tried
domains are excluded from the next pick; their reservations stay.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import grpc

from clusterstate.clock import SYSTEM_CLOCK, Clock
from clusterstate.records import DomainRegistration, SummaryRecord
from gateway.core import GatewayCore, PlacementAttempt
from hilum_proto.tls import open_channel
from hilum_proto.v1 import llumlet_pb2
from hilum_proto.v1 import rack_sched_pb2 as rpb
from hilum_proto.v1 import rack_sched_pb2_grpc as rpb_grpc
from policy.dispatch import reusable_prefix_hashes
from policy.types import PolicyConfig

__all__ = [
    "ClusterSource",
    "DispatchFailed",
    "DomainRouter",
    "DomainSubmitter",
    "GrpcSubmitter",
    "Placement",
]

_log = logging.getLogger(__name__)


class ClusterSource(Protocol):
    """What the router reads (a ``clusterstate.store.ClusterView`` is one)."""

    @property
    def version(self) -> int: ...

    def domains(self) -> dict[str, DomainRegistration]: ...

    def summaries(self) -> dict[str, SummaryRecord]: ...


class DomainSubmitter(Protocol):
    """Sends a Submit to one domain scheduler."""

    async def submit(self, address: str, msg: llumlet_pb2.SubmitRequest, timeout_s: float) -> rpb.DispatchReply:
        """Raises ``grpc.aio.AioRpcError`` when the scheduler does not answer."""


class GrpcSubmitter:
    """:class:`DomainSubmitter` over gRPC, one channel per domain scheduler address."""

    def __init__(self) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, rpb_grpc.RackSchedulerStub]] = {}

    async def submit(self, address: str, msg: llumlet_pb2.SubmitRequest, timeout_s: float) -> rpb.DispatchReply:
        if address not in self._stubs:
            channel = open_channel(address)
            self._stubs[address] = (channel, rpb_grpc.RackSchedulerStub(channel))
        call = self._stubs[address][1].Submit(msg, timeout=timeout_s)
        reply: rpb.DispatchReply = await call  # type: ignore[misc]  # grpc.aio's stubs are typed as sync
        return reply

    async def close(self) -> None:
        """Close every channel."""
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request was submitted."""

    domain_id: str
    instance_id: str
    instance_address: str  # host:port of the llumlet
    reason: str  # the rule that chose the domain, then the instance
    tries: int  # Submit calls made


class DispatchFailed(Exception):
    """No domain accepted the request. ``unavailable``: some domain may accept it later (503 either way)."""

    def __init__(self, message: str, *, unavailable: bool) -> None:
        super().__init__(message)
        self.message = message
        self.unavailable = unavailable


class DomainRouter:
    """Picks a domain for each request and submits it there (see the module docstring).

    Args:
        source: registrations and summaries (refreshed whenever ``source.version`` changes).
        submitter: sends Submit to a domain scheduler.
        cfg: the rule book's configuration (priority headroom, tie tolerance).
        rng: near-tie draws and backoff jitter.
        submit_timeout_s: deadline of one Submit.
        unavailable_wait_s: how long unavailable domains are retried before giving up.
        backoff_s: first pause before retrying unavailable domains (doubles, jittered).
        on_retry: told the reason ("refused" | "unavailable" | "full") each time a domain did not take a request.
    """

    def __init__(
        self,
        source: ClusterSource,
        submitter: DomainSubmitter,
        cfg: PolicyConfig,
        rng: random.Random,
        *,
        submit_timeout_s: float = 10.0,
        unavailable_wait_s: float = 5.0,
        backoff_s: float = 0.05,
        clock: Clock = SYSTEM_CLOCK,
        on_retry: Callable[[str], None] | None = None,
        reservation_ttl_s: float = 1.0,
    ) -> None:
        self._source = source
        self._on_retry = on_retry
        self._submitter = submitter
        self._rng = rng
        self.core = GatewayCore(cfg, rng, reservation_ttl_s=reservation_ttl_s)
        self._records: dict[str, SummaryRecord] = {}
        self._addresses: dict[str, str] = {}
        self._seen_version = -1
        self._submit_timeout_s = submit_timeout_s
        self._unavailable_wait_s = unavailable_wait_s
        self._backoff_s = backoff_s
        self._clock = clock
        self.retries: dict[str, int] = {}  # reason ("refused" | "unavailable" | "full") -> count
        self._had_domains = False  # some domain was dispatchable once (health: "none yet" or "none now")
        # domain -> (until when (clock.now_s) it is tried after the others, why): its scheduler did not answer a
        # Submit (a frozen or unreachable process). Every request picked for it waited the whole Submit deadline
        # before trying another domain (half of them on two domains, 7.7 s each); now only one request in
        # unavailable_wait_s does, until the scheduler answers or publishes a new summary.
        self._silent: dict[str, tuple[float, str]] = {}

    def _retry(self, reason: str) -> None:
        self.retries[reason] = self.retries.get(reason, 0) + 1
        if self._on_retry is not None:
            self._on_retry(reason)

    def domains(self) -> dict[str, str]:
        """Dispatchable domains (registered and summarised): id -> scheduler address."""
        self._refresh()
        return {d: a for d, a in self._addresses.items() if d in self._records}

    def health(self, expected: Collection[str] = ()) -> tuple[bool, str]:
        """(True when some domain is dispatchable and not draining, what the gateway's ``/health`` says: the
        domains, or why none takes requests). ``expected``: the domains the topology names; those not dispatchable
        are named too (still True). A domain drains when every summary it published says so (every instance
        drained: it refuses every Submit); while every dispatchable domain drains, the gateway can place nothing
        and is not healthy."""
        domains = self.domains()
        if domains:
            draining = sorted(d for d in domains if self._draining(d))
            if len(draining) == len(domains):
                return False, (
                    f"every domain drains ({', '.join(draining)}): no instance takes new requests until a drain "
                    "is undone (hilumctl undrain) or an instance joins"
                )
            missing = sorted(set(expected) - domains.keys())
            gone = f"; not registered: {', '.join(missing)}" if missing else ""
            drains = f"; draining: {', '.join(draining)}" if draining else ""
            return True, f"{len(domains)} domain(s): {', '.join(sorted(domains))}{drains}{gone}"
        if self._had_domains:
            return False, (
                "no domain scheduler is registered with a summary now (those that were have stopped, or lost etcd): "
                "check the domain schedulers"
            )
        return False, "no domain scheduler has registered and published a summary yet"

    def _draining(self, domain_id: str) -> bool:
        """True when ``domain_id``'s latest summaries (one per model) all say every instance drains."""
        summaries = self._records[domain_id].summaries
        return bool(summaries) and all(s.draining for s in summaries)

    def models(self) -> list[str]:
        """Models some dispatchable domain serves, sorted."""
        self._refresh()
        return self.core.models()

    def _refresh(self) -> None:
        version = self._source.version
        if version == self._seen_version:
            return
        self._seen_version = version
        regs = self._source.domains()
        records = self._source.summaries()
        self._addresses = {d: r.address for d, r in regs.items()}
        for domain_id in list(self._records):
            if domain_id not in records or domain_id not in regs:
                self.core.remove(domain_id)
                del self._records[domain_id]
        for domain_id, record in records.items():
            if domain_id not in regs or self._records.get(domain_id) == record:
                continue  # no scheduler to submit to, or nothing new
            self._silent.pop(domain_id, None)  # a new summary: its scheduler runs
            try:
                self.core.update(domain_id, record.summaries)
            except ValueError as exc:
                _log.warning("ignoring summary of %s: %s", domain_id, exc)
                continue
            self._records[domain_id] = record
        if self._records.keys() & self._addresses.keys():
            self._had_domains = True

    async def dispatch(
        self, msg: llumlet_pb2.SubmitRequest, demand_blocks: int, need_blocks: int = 0, block_size_tokens: int = 0
    ) -> Placement:
        """Place ``msg`` on some domain serving ``msg.model`` (its ``priority`` and prefix hashes count).

        ``demand_blocks``: KV blocks it needs to start; ``need_blocks``: what it may grow to (0: not known);
        ``block_size_tokens``: the model's KV block size, with which its ``prefix_block_hashes`` (each of
        ``prefix_hash_block_tokens`` tokens) become blocks a domain already holds (0: its prefix plays no part).
        Raises :class:`DispatchFailed`.
        """
        deadline = self._clock.now_s() + self._unavailable_wait_s
        attempt = PlacementAttempt(
            self.core,
            msg.model,
            demand_blocks,
            need_blocks,
            msg.priority,
            prefix_hashes=reusable_prefix_hashes(
                tuple(msg.prefix_block_hashes), msg.prefix_hash_block_tokens, len(msg.prompt_token_ids)
            )
            if block_size_tokens
            else (),
            prefix_block_tokens=msg.prefix_hash_block_tokens,
            block_size_tokens=block_size_tokens,
        )
        tries = 0
        backoff = self._backoff_s
        self._refresh()
        now_s = self._clock.now_s()
        for silent_id, (until_s, why) in list(self._silent.items()):
            if now_s < until_s:  # the others first; it is tried again after a backoff if none takes the request
                attempt.answered_unavailable(silent_id, why)
            else:
                del self._silent[silent_id]
        while True:
            self._refresh()
            domain_id = attempt.next(self._clock.wall_s())
            if domain_id is None:
                if attempt.unavailable and self._clock.now_s() < deadline:
                    await self._clock.sleep(backoff * (0.5 + self._rng.random()))
                    backoff = min(backoff * 2, 1.0)
                    attempt.retry_unavailable()
                    continue
                if not self._records and self._clock.now_s() < deadline:
                    await self._clock.sleep(backoff)  # nothing published yet (cluster starting)
                    continue
                raise DispatchFailed(
                    f"no domain accepted the request: {attempt.explain()}", unavailable=bool(attempt.unavailable)
                )
            tries += 1
            address = self._addresses[domain_id]
            msg.only_if_room = attempt.only_if_room
            try:
                reply = await self._submitter.submit(address, msg, self._submit_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    message = f"domain {domain_id} rejected the request: {exc.details()}"
                    raise DispatchFailed(message, unavailable=False) from None
                why = f"scheduler at {address} did not answer ({exc.code().name}: {exc.details()})"
                self._silent[domain_id] = (self._clock.now_s() + self._unavailable_wait_s, why)
                attempt.answered_unavailable(domain_id, why)
                self._retry("unavailable")
                continue
            self._silent.pop(domain_id, None)  # it answers
            if reply.outcome == rpb.DISPATCH_ACCEPTED:
                return Placement(
                    domain_id,
                    reply.instance_id,
                    reply.instance_address,
                    f"{attempt.last_reason}; {reply.reason}",
                    tries,
                )
            why = reply.reason or rpb.DispatchOutcome.Name(reply.outcome)
            if reply.outcome == rpb.DISPATCH_UNAVAILABLE:
                attempt.answered_unavailable(domain_id, why)
                self._retry("unavailable")
            elif reply.outcome == rpb.DISPATCH_FULL:
                attempt.answered_full(domain_id, why)
                self._retry("full")
            else:
                attempt.answered_refused(domain_id, why)
                self._retry("refused")
