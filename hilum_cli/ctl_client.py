"""How ``hilumctl`` reaches the coordinator: replica addresses or the leader key in etcd, leader following.

Reads go to any replica (each answers from its own view of etcd). Writes (Drain, Undrain) need the leader:
a standby answers them with ``FAILED_PRECONDITION`` and "the leader is NAME at HOST:PORT"
(``global_coord.coordinator.NotLeader``), and :meth:`AdminClient.write` retries at that address.
Every failure becomes a :class:`CtlError` whose message says what was tried, for how long, and what to check.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from clusterstate.endpoints import parse_endpoints
from clusterstate.options import DEFAULT_PREFIX, check_prefix
from hilum_proto.tls import open_channel
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_PREFIX",
    "AdminClient",
    "CtlError",
    "Target",
    "UsageError",
    "leader_from_etcd",
    "parse_addresses",
    "short_error",
]

MAX_REDIRECTS = 3  # standby -> leader hops for one write
_LEADER_RE = re.compile(r"the leader is (?P<id>\S+) at (?P<address>\S+)$")


class CtlError(Exception):
    """A runtime failure to report (exit status 1); the message says what failed and what to check."""


class UsageError(CtlError):
    """Bad command-line input (exit status 2); the message names the option and what was wrong."""


def parse_addresses(text: str, what: str) -> tuple[str, ...]:
    """Split a comma-separated ``host:port`` list (blanks around an entry are dropped).

    Raises:
        UsageError: naming ``what`` (``--coordinator``, or ``HILUM_COORDINATOR`` when the list came from there)
            when the list is empty, an entry is empty (``a:1,,b:2``, a trailing comma) or is not host:port.
    """
    try:
        return tuple(parse_endpoints(text, what))  # the rule every hilum process's --etcd follows
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Target:
    """Where to find the coordinator: replica addresses, or etcd endpoints holding the leader key."""

    coordinators: tuple[str, ...] = ()  # host:port of replicas, tried in order
    etcd: tuple[str, ...] = ()  # host:port of etcd; the leader's address is read from ``prefix + "leader"``
    prefix: str = DEFAULT_PREFIX  # the coordinators' --prefix
    # where the addresses and the prefix came from, named in errors: "--coordinator" or "HILUM_COORDINATOR",
    # "--etcd" or "HILUM_ETCD", "--prefix" or "HILUM_PREFIX"; "" = the flag
    source: str = ""
    prefix_source: str = "--prefix"

    def __post_init__(self) -> None:
        if bool(self.coordinators) == bool(self.etcd):
            raise UsageError("give exactly one of --coordinator HOST:PORT or --etcd HOST:PORT")
        if not self.source:
            object.__setattr__(self, "source", "--etcd" if self.etcd else "--coordinator")
        try:
            check_prefix(self.prefix)  # the rule of every daemon's --prefix
        except ValueError as exc:
            raise UsageError(f"{self.prefix_source}: {exc}") from None


async def leader_from_etcd(
    endpoints: Sequence[str], prefix: str, timeout_s: float, *, source: str = "--etcd", prefix_source: str = "--prefix"
) -> tuple[str, str]:
    """(leader id, leader address) from the leader key ``prefix + "leader"`` in etcd.

    ``source`` and ``prefix_source`` name where the endpoints and the prefix came from (a flag or an environment
    variable), for the errors.

    Raises:
        CtlError: when an endpoint cannot be dialled (a name that does not resolve, an IPv6 address) or the TLS
            variables are wrong, etcd does not answer within ``timeout_s`` seconds, or no coordinator leads.
    """
    from clusterstate.etcd import RETRYABLE_ERRORS, connect, kv_of  # etcd3aio only when --etcd is used

    where = ",".join(endpoints)
    key = prefix + "leader"
    try:
        client = connect(list(endpoints))
    except ValueError as exc:  # a name that does not resolve, an IPv6 address, the TLS variables
        raise CtlError(f"{source}: {exc}") from None
    errors: tuple[type[BaseException], ...] = (TimeoutError, *RETRYABLE_ERRORS)
    try:
        async with asyncio.timeout(timeout_s):
            await client.connect()
            resp = await kv_of(client).get(key, timeout=timeout_s)
    except errors as exc:
        why = (
            f"did not answer within {timeout_s:g} s"
            if isinstance(exc, TimeoutError)
            else f"failed ({short_error(exc)})"
        )
        raise CtlError(
            f"etcd at {where} {why}: check that etcd runs there (`etcdctl --endpoints {where} endpoint health`) "
            f"and that {source} names its client URL"
        ) from None
    finally:
        await client.close()
    if not resp.kvs:
        raise CtlError(
            f"no coordinator leads: etcd at {where} has no key {key}. Start one "
            f"(`python -m global_coord --etcd {where} --listen HOST:PORT ...`), give it a few seconds to win the "
            f"election, and check that {prefix_source} matches the coordinators' --prefix ({prefix})"
        )
    try:
        raw = json.loads(bytes(resp.kvs[0].value))
        return str(raw["id"]), str(raw["address"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CtlError(
            f"etcd key {key} does not hold a coordinator leader ({exc}): is {prefix_source} right?"
        ) from None


def short_error(exc: BaseException) -> str:
    """One line for an etcd or gRPC error (an AioRpcError's own text spans several lines)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    text = str(exc) or type(exc).__name__
    return text if len(text) < 200 else text[:200] + "..."


class AdminClient:
    """The coordinator's admin API for one ``hilumctl`` run: ``async with AdminClient(target, 5.0) as c:``.

    Args:
        target: where to find the coordinator.
        rpc_timeout_s: deadline of each unary call, seconds (also the etcd look-up's limit).
    """

    def __init__(self, target: Target, rpc_timeout_s: float) -> None:
        if not (math.isfinite(rpc_timeout_s) and rpc_timeout_s > 0):
            raise UsageError(f"--rpc-timeout: must be a finite number of seconds > 0, got {rpc_timeout_s:g}")
        self.target = target
        self.rpc_timeout_s = rpc_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._candidates: list[str] = list(target.coordinators)
        self.address = ""  # the replica the last successful call went to

    async def __aenter__(self) -> AdminClient:
        if self.target.etcd:
            t = self.target
            _, address = await leader_from_etcd(
                t.etcd, t.prefix, self.rpc_timeout_s, source=t.source, prefix_source=t.prefix_source
            )
            self._candidates = [address]
        self.address = self._candidates[0]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def stub(self, address: str) -> pb_grpc.CoordinatorAsyncStub:
        """A stub on a (cached) channel to ``address``."""
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return pb_grpc.CoordinatorStub(self._channels[address])

    def _error(self, address: str, exc: grpc.aio.AioRpcError, method: str) -> CtlError:
        code, details = exc.code(), exc.details() or ""
        found = "the leader in etcd" if self.target.etcd else self.target.source
        if code == grpc.StatusCode.UNAVAILABLE:
            return CtlError(
                f"no coordinator answers at {address} ({details}): check that a coordinator "
                f"(`python -m global_coord`) runs there and that {found} names its --listen/--advertise address"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return CtlError(
                f"the coordinator at {address} did not answer {method} within {self.rpc_timeout_s:g} s: it may be "
                "paused or overloaded; try another replica or raise --rpc-timeout"
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return CtlError(
                f"{address} does not implement {method}: a coordinator older than hilumctl, or no coordinator (check "
                "that --coordinator names a coordinator's address)"
            )
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return CtlError(f"the coordinator at {address} rejected {method}: {details}")
        return CtlError(f"{method} at {address} failed: {code.name}: {details}")

    async def read(self, method: str, request: Any) -> Any:
        """Call a read-only unary method (``"Status"``, ``"ListDomains"``, ...); any replica answers.

        With several ``--coordinator`` addresses, an unreachable or silent replica is skipped for the next one;
        when none answers, the error names every address tried and what each said.

        Raises:
            CtlError: when no replica answers, or the call fails.
        """
        failed: list[tuple[str, grpc.aio.AioRpcError]] = []
        for address in [self.address, *(a for a in self._candidates if a != self.address)]:
            try:
                reply = await getattr(self.stub(address), method)(request, timeout=self.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise self._error(address, exc, method) from None
                failed.append((address, exc))
                continue
            self.address = address
            return reply
        if len(failed) == 1:
            raise self._error(*failed[0], method)
        found = "the leader in etcd" if self.target.etcd else self.target.source
        tried = "; ".join(f"{address}: {short_error(exc)}" for address, exc in failed)
        raise CtlError(
            f"no coordinator answers {method} at any of the {len(failed)} addresses ({tried}): check that the "
            f"coordinators (`python -m global_coord`) run there and that {found} names their --listen/--advertise "
            "addresses"
        )

    async def write(self, method: str, request: Any) -> tuple[Any, str]:
        """Call a leader-only unary method (``"Drain"``, ``"Undrain"``); (reply, address of the leader).

        A standby's ``FAILED_PRECONDITION`` names the leader; the call is retried there (at most
        :data:`MAX_REDIRECTS` hops; when the message names no address, the replica's Status is asked). A first
        address that does not answer (with several ``--coordinator`` addresses) is passed over as :meth:`read`
        does: the write goes to the first replica that answers Status, and on to the leader it names. A write
        retried after a deadline is harmless: a drain intent is put, an undrain deletes it, either way once.

        Raises:
            CtlError: when nobody leads, no replica answers, or the call fails.
        """
        address = self.address
        failed_over = len(self._candidates) < 2
        for _ in range(MAX_REDIRECTS + 1):
            try:
                reply = await getattr(self.stub(address), method)(request, timeout=self.rpc_timeout_s)
                self.address = address
                return reply, address
            except grpc.aio.AioRpcError as exc:
                silent = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if silent and not failed_over:
                    failed_over = True
                    status = await self.read("Status", pb.StatusRequest())  # every address; raises when none answers
                    address = status.leader_address or self.address
                    continue
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise self._error(address, exc, method) from None
                leader = await self._leader_named(address, exc.details() or "")
                if leader == address:  # leadership is moving: give the election a moment
                    await asyncio.sleep(0.2)
                address = leader
        raise CtlError(
            f"{method}: gave up after {MAX_REDIRECTS} redirects between replicas that each name another leader; "
            "the election is unsettled: check the coordinators' logs and etcd, then retry"
        )

    async def _leader_named(self, address: str, details: str) -> str:
        match = _LEADER_RE.search(details)
        if match and match["address"]:
            return match["address"]
        status = await self.read_at(address, "Status", pb.StatusRequest())
        if not status.leader_address:
            raise CtlError(
                f"no coordinator leads right now ({details or 'the replica names no leader'}); writes need a "
                "leader: check that coordinators run and reach etcd (their logs say why), then retry"
            )
        return str(status.leader_address)

    async def read_at(self, address: str, method: str, request: Any) -> Any:
        """Call a unary method at one replica. Raises CtlError on failure."""
        try:
            return await getattr(self.stub(address), method)(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(address, exc, method) from None

    async def follow_migrations(self) -> AsyncIterator[pb.MigrationEvent]:
        """The current migrations, then every change, until cancelled (FollowMigrations, no deadline).

        Raises:
            CtlError: when the replica cannot be reached or the stream breaks.
        """
        address = self.address
        call = self.stub(address).FollowMigrations(pb.FollowMigrationsRequest())
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise self._error(address, exc, "FollowMigrations") from None
        finally:
            call.cancel()
        raise CtlError(f"the coordinator at {address} ended the migration stream (it is stopping?)")
