"""Leader election on one etcd key (after etcd's client/v3/concurrency election, simplified).

Campaigning is one transaction: if the leader key does not exist, create it under the candidate's session
lease; otherwise read it. The winner's fencing token is the key's create revision. Losers watch the key
and try again when it is deleted (its holder resigned, or its lease expired). A leader that was paused past
its TTL finds its key gone or re-created with a larger revision; its fenced writes then fail.

A key that names this very candidate (same id and address) under another lease is an earlier session of
it: one lost while etcd was unreachable (etcd restores leases with a fresh TTL when it restarts, so the key
would otherwise outlive the outage by a whole TTL), or the previous run of a restarted process. The
candidate deletes that key, compared on its create revision so nothing newer is touched, and campaigns at
once. Two live replicas cannot share an address, so this never takes the key from another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from clusterstate.etcd import RETRYABLE_ERRORS, Etcd3Client, error_line, kv_of, watch
from clusterstate.fencing import Fence
from clusterstate.session import Session, SessionLost

__all__ = ["Election", "Leader"]

_log = logging.getLogger(__name__)
_EVENT_DELETE = 1  # mvccpb.Event.EventType


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads: the leader key's contents and its fencing token."""

    leader_id: str
    address: str  # host:port of the leader's gRPC server
    token: int  # create revision of the leader key (the fencing token)
    lease_id: int  # the leader's session lease


def _encode(leader_id: str, address: str) -> bytes:
    return json.dumps({"id": leader_id, "address": address}, sort_keys=True).encode()


def _decode(kv: Any) -> Leader:  # kv: mvccpb.KeyValue (untyped in etcd3aio)
    raw = json.loads(bytes(kv.value))
    return Leader(
        leader_id=str(raw["id"]),
        address=str(raw["address"]),
        token=int(kv.create_revision),
        lease_id=int(kv.lease),
    )


class Election:
    """Elect one leader among candidates that share ``key``."""

    def __init__(self, client: Etcd3Client, key: str) -> None:
        self._client = client
        self.key = key

    async def _try(self, session: Session, leader_id: str, address: str) -> tuple[Leader | None, int]:
        """Create the key under ``session``: (our Leader, rev) if we lead now, else (None, revision read at)."""
        kv = kv_of(self._client)
        while True:
            resp = await kv.txn(
                compare=[kv.txn_compare_create_revision(self.key, 0)],
                success=[kv.txn_op_put(self.key, _encode(leader_id, address), lease=session.lease_id)],
                failure=[kv.txn_op_get(self.key)],
                timeout=float(session.ttl_s),
            )
            revision = int(resp.header.revision)
            if resp.succeeded:
                return Leader(leader_id, address, revision, session.lease_id), revision
            holder = _decode(resp.responses[0].response_range.kvs[0])  # the txn failed: the key exists
            if holder.lease_id == session.lease_id:
                return holder, revision  # our own key from an earlier campaign of this very session
            if (holder.leader_id, holder.address) != (leader_id, address):
                return None, revision
            _log.info(
                "%s: the leader key still holds an earlier session of this replica (lease %x, token %d); "
                "taking it over",
                leader_id,
                holder.lease_id,
                holder.token,
            )
            await kv.txn(
                compare=[Fence(self.key, holder.token).compare()],
                success=[kv.txn_op_delete(self.key)],
                timeout=float(session.ttl_s),
            )

    async def _wait_deleted(self, after_revision: int) -> None:
        stream = watch(self._client, self.key, start_revision=after_revision + 1)
        async with contextlib.aclosing(stream):
            async for response in stream:
                if response.compact_revision > 0 or response.canceled:
                    return  # re-check with a fresh transaction
                if any(ev.type == _EVENT_DELETE for ev in response.events):
                    return

    async def campaign(self, session: Session, leader_id: str, address: str) -> Leader:
        """Block until this candidate leads; return its :class:`Leader` (with the fencing token).

        While ``session`` lives, an etcd error is retried every ``ttl / 10`` seconds (at least 0.1 s), so an
        interruption shorter than the TTL costs the candidate nothing.

        Raises:
            SessionLost: when ``session`` is lost before winning.
        """
        retry_s = max(0.1, session.ttl_s / 10)
        while True:
            if session.done.is_set():
                raise SessionLost(session.lost_reason)
            try:
                leader, revision = await self._try(session, leader_id, address)
            except RETRYABLE_ERRORS as exc:
                _log.debug(
                    "%s: campaign transaction failed (%s); retrying in %.2f s", leader_id, error_line(exc), retry_s
                )
                await self._until(asyncio.sleep(retry_s), session)
                continue
            if leader is not None:
                _log.info("%s leads with fencing token %d", leader_id, leader.token)
                return leader
            await self._until(self._wait_deleted(revision), session)

    @staticmethod
    async def _until(aw: Coroutine[Any, Any, None], session: Session) -> None:
        """Run ``aw`` until it ends (an etcd error included) or ``session`` is lost."""
        waiter = asyncio.ensure_future(aw)
        lost = asyncio.ensure_future(session.done.wait())
        try:
            await asyncio.wait({waiter, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            lost.cancel()
            with contextlib.suppress(asyncio.CancelledError, *RETRYABLE_ERRORS):
                await waiter

    async def resign(self, leader: Leader) -> bool:
        """Delete the leader key if it is still ``leader``'s; True when it was deleted."""
        kv = kv_of(self._client)
        resp = await kv.txn(
            compare=[Fence(self.key, leader.token).compare()],
            success=[kv.txn_op_delete(self.key)],
            timeout=5.0,
        )
        return bool(resp.succeeded)

    async def leader(self) -> Leader | None:
        """The current leader, or None."""
        resp = await kv_of(self._client).get(self.key, timeout=5.0)
        return _decode(resp.kvs[0]) if resp.kvs else None

    async def observe(self) -> AsyncIterator[Leader | None]:
        """Yield the current leader, then the latest one after each change (not necessarily every change).

        Re-reads the key whenever the watch ends. Runs until cancelled; etcd errors propagate.
        """
        while True:
            resp = await kv_of(self._client).get(self.key, timeout=5.0)
            current = _decode(resp.kvs[0]) if resp.kvs else None
            yield current
            stream = watch(self._client, self.key, start_revision=int(resp.header.revision) + 1)
            async with contextlib.aclosing(stream):
                async for wresp in stream:
                    if wresp.compact_revision > 0 or wresp.canceled:
                        break
                    if wresp.events:
                        last = wresp.events[-1]
                        current = None if last.type == _EVENT_DELETE else _decode(last.kv)
                        yield current
