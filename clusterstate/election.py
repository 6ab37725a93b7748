"""Leader election on one etcd key (after etcd's client/v3/concurrency election, simplified).

Campaigning is one transaction: if the leader key does not exist, create it under the candidate's session
lease; otherwise read it. The winner's fencing token is the key's create revision. Losers watch the key
and try again when it is deleted (its holder resigned, or its lease expired). A leader that was paused past
its TTL finds its key gone or re-created with a larger revision; its fenced writes then fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from clusterstate.etcd import RETRYABLE_ERRORS, Etcd3Client, kv_of, watch_of
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
        """One transaction: returns (our Leader, rev) if we lead now, else (None, revision read at)."""
        kv = kv_of(self._client)
        resp = await kv.txn(
            compare=[kv.txn_compare_create_revision(self.key, 0)],
            success=[kv.txn_op_put(self.key, _encode(leader_id, address), lease=session.lease_id)],
            failure=[kv.txn_op_get(self.key)],
            timeout=float(session.ttl_s),
        )
        revision = int(resp.header.revision)
        if resp.succeeded:
            return Leader(leader_id, address, revision, session.lease_id), revision
        kvs = list(resp.responses[0].response_range.kvs)
        if kvs and int(kvs[0].lease) == session.lease_id:
            # Our own key from an earlier campaign of this very session: we still lead.
            return _decode(kvs[0]), revision
        return None, revision

    async def _wait_deleted(self, after_revision: int) -> None:
        async for response in watch_of(self._client).watch(self.key, start_revision=after_revision + 1):
            if response.compact_revision > 0 or response.canceled:
                return  # re-check with a fresh transaction
            if any(ev.type == _EVENT_DELETE for ev in response.events):
                return

    async def campaign(self, session: Session, leader_id: str, address: str) -> Leader:
        """Block until this candidate leads; return its :class:`Leader` (with the fencing token).

        Raises:
            SessionLost: when ``session`` is lost before winning.
            EtcdError, TimeoutError: when etcd fails a transaction (the caller retries with backoff).
        """
        while True:
            if session.done.is_set():
                raise SessionLost(session.lost_reason)
            leader, revision = await self._try(session, leader_id, address)
            if leader is not None:
                _log.info("%s leads with fencing token %d", leader_id, leader.token)
                return leader
            waiter = asyncio.ensure_future(self._wait_deleted(revision))
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

        Re-reads the key after any watch interruption. Runs until cancelled; etcd errors propagate.
        """
        while True:
            resp = await kv_of(self._client).get(self.key, timeout=5.0)
            current = _decode(resp.kvs[0]) if resp.kvs else None
            yield current
            created = 0
            async for wresp in watch_of(self._client).watch(self.key, start_revision=int(resp.header.revision) + 1):
                if wresp.created:
                    created += 1
                    if created > 1:
                        break  # the stream reconnected: re-read
                if wresp.compact_revision > 0 or wresp.canceled:
                    break
                if wresp.events:
                    last = wresp.events[-1]
                    current = None if last.type == _EVENT_DELETE else _decode(last.kv)
                    yield current
