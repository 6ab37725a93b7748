"""Sessions: liveness as an object (after etcd's client/v3/concurrency Session).

A :class:`Session` is one etcd lease kept alive by a background task. Renewals are timed from the lease's
real expiry: a renewal sent at ``t`` that etcd confirms with TTL ``T`` moves the expiry to ``t + T``
(conservative: the send time, not the reply time), and the next renewal is due at ``expiry - 2T/3``, i.e.
every ``T/3`` while etcd answers. When a renewal fails, it is retried every ``retry_s`` until the expiry;
so an etcd interruption shorter than the TTL loses nothing. When the expiry passes without a confirmed
renewal, or etcd reports the lease gone, ``done`` is set and the session is over for good.

A :class:`Registrar` keeps a set of keys registered under a session's lease, and after the session is
lost opens a new one (with jittered exponential backoff while etcd is unreachable), revokes the old lease
and puts every key again: a clean re-registration after an interruption longer than the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from clusterstate.backoff import RECOVERED_LEVEL, Backoff, BackoffConfig, RepeatedFailures, failed_attempts
from clusterstate.etcd import (
    RETRYABLE_ERRORS,
    Etcd3Client,
    compare_mod_revision,
    error_line,
    kv_of,
    lease_of,
    renew_lease,
)

__all__ = ["KeyTakenError", "Registrar", "Session", "SessionLost"]

_log = logging.getLogger(__name__)


_RENEW_ERRORS: tuple[type[BaseException], ...] = (*RETRYABLE_ERRORS, EOFError)


class SessionLost(Exception):
    """The session's lease expired or was revoked; everything bound to it is gone."""


class KeyTakenError(RuntimeError):
    """Another live lease holds a key this process must hold alone (a second process for the same instance). A
    state of the cluster, not a bad configuration: a daemon exits 1 for it (a crashed holder's key goes with
    its lease, so a restart later may succeed)."""


class Session:
    """One etcd lease kept alive in the background until it is lost or closed.

    Attributes:
        lease_id: the etcd lease id.
        ttl_s: the TTL etcd granted, seconds.
        done: set once the lease is lost or the session closed; never cleared.
        lost_reason: why ``done`` was set ("" while alive).

    Use :meth:`open` to create one.
    """

    def __init__(
        self,
        client: Etcd3Client,
        lease_id: int,
        ttl_s: int,
        expires_at: float,
        *,
        clock: Callable[[], float],
        retry_s: float,
    ) -> None:
        self._client = client
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self._expires_at = expires_at
        self._clock = clock
        self._retry_s = retry_s
        self._renewals_failed = RepeatedFailures()  # a warning at the first failed renewal of a run, then every 30 s
        self.done = asyncio.Event()
        self.lost_reason = ""
        self.renewals = 0  # confirmed renewals so far
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        client: Etcd3Client,
        ttl_s: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float | None = None,
        timeout_s: float | None = None,
    ) -> Session:
        """Grant a lease of ``ttl_s`` seconds and start keeping it alive.

        Args:
            client: a connected etcd client.
            ttl_s: requested TTL, seconds (>= 1; etcd may round it up to its minimum).
            clock: monotonic clock, seconds.
            retry_s: delay between failed renewals (default ``ttl_s / 10``, at least 0.1 s).
            timeout_s: deadline of the grant RPC (default ``ttl_s``).

        Raises:
            ValueError: on ``ttl_s < 1``.
            EtcdError, TimeoutError: when etcd does not grant the lease.
        """
        if ttl_s < 1:
            raise ValueError(f"session TTL must be >= 1 s, got {ttl_s}")
        sent = clock()
        resp = await lease_of(client).grant(ttl=ttl_s, timeout=timeout_s or float(ttl_s))
        granted = int(resp.TTL)
        session = cls(
            client,
            int(resp.ID),
            granted,
            sent + granted,
            clock=clock,
            retry_s=retry_s if retry_s is not None else max(0.1, granted / 10),
        )
        session._task = asyncio.create_task(session._keep_alive(), name=f"lease-keepalive-{session.lease_id:x}")
        return session

    def remaining_s(self) -> float:
        """Seconds until the lease expires unless renewed (as far as this process knows)."""
        return self._expires_at - self._clock()

    def _lose(self, reason: str) -> None:
        if not self.done.is_set():
            self.lost_reason = reason
            self.done.set()

    def abandon(self, reason: str) -> None:
        """Declare the session lost now (e.g. a fenced write proved it no longer leads); stops renewals."""
        self._lose(reason)
        if self._task is not None:
            self._task.cancel()

    async def _keep_alive(self) -> None:
        failed: BaseException | None = None  # the last renewal's error, while renewals fail (None once one succeeds)
        while not self.done.is_set():
            due = self._expires_at - self.ttl_s * 2.0 / 3.0
            await asyncio.sleep(max(0.0, due - self._clock()))
            while True:
                remaining = self._expires_at - self._clock()
                if remaining <= 0:
                    if isinstance(failed, TimeoutError):  # no answer in time: etcd gone, or too slow for this TTL
                        why = (
                            f"etcd answered no renewal in time ({error_line(failed)}): check that etcd runs; raise the "
                            "TTL if it is slow"
                        )
                    elif failed is not None:  # etcd down or unreachable: a longer TTL would only have waited longer
                        why = f"etcd did not answer its renewals ({error_line(failed)}): check that etcd runs"
                    else:  # none failed, none tried in time: the process did not run
                        why = (
                            "this process did not run in time to renew it (paused, or its event loop blocked): raise "
                            "the TTL if that is expected"
                        )
                    self._lose(f"lease {self.lease_id:x} expired: no renewal confirmed for {self.ttl_s} s; {why}")
                    return
                sent = self._clock()
                try:
                    async with asyncio.timeout(min(remaining, max(self._retry_s, self.ttl_s / 3.0))):
                        ttl = await renew_lease(self._client, self.lease_id)
                except asyncio.CancelledError:
                    raise
                except _RENEW_ERRORS as exc:
                    failed = exc
                    _log.log(
                        self._renewals_failed.failed(),
                        "lease %x: renewal failed (%s), attempt %d; retrying in %.2f s, %.2f s before expiry: check "
                        "that etcd runs",
                        self.lease_id,
                        error_line(exc),
                        self._renewals_failed.failures,
                        self._retry_s,
                        remaining,
                    )
                    await asyncio.sleep(min(self._retry_s, max(0.0, self._expires_at - self._clock())))
                    continue
                if ttl <= 0:
                    self._lose(f"lease {self.lease_id:x} expired or was revoked (etcd reported TTL {ttl})")
                    return
                self._expires_at = sent + ttl
                self.renewals += 1
                if self._renewals_failed.failures:  # said at the level of the warning it ends
                    _log.log(
                        RECOVERED_LEVEL,
                        "lease %x: renewal confirmed again after %s",
                        self.lease_id,
                        failed_attempts(self._renewals_failed.failures),
                    )
                self._renewals_failed.reset()
                failed = None
                break

    async def close(self, *, revoke: bool = True) -> None:
        """Stop renewing; with ``revoke`` also revoke the lease (deleting its keys), best effort.

        A live session's revocation is retried (etcd3aio's default attempts): it is what lets others take
        over its keys at once. A lost one's is tried once (etcd is likely unreachable), so whoever closes it
        can go on without waiting out the retries.
        """
        attempts = 1 if self.done.is_set() else None
        self._lose("closed")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if revoke:
            with contextlib.suppress(*RETRYABLE_ERRORS, RuntimeError):
                timeout = max(1.0, self.ttl_s / 3.0)
                await lease_of(self._client).revoke(self.lease_id, timeout=timeout, max_attempts=attempts)


class Registrar:
    """Keeps ``key -> value`` entries registered under a session lease, across lost sessions.

    ``run()`` opens a session, puts every entry with its lease and waits; when the session is lost it
    opens a new one (retrying with jittered backoff while etcd is unreachable), revokes the old lease and
    puts the entries again. ``set``/``remove`` change the entries at any time. ``claim`` registers a key only
    if nobody else holds it (one transaction: created now, or already under this registrar's lease, or holding
    exactly this value: the registration of this holder's previous run), also on every re-registration;
    losing a claimed key to another holder sets :attr:`conflict`.
    """

    def __init__(
        self,
        client: Etcd3Client,
        ttl_s: int,
        *,
        rng: random.Random,
        backoff: BackoffConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "registrar",
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._backoff = Backoff(backoff or BackoffConfig(), rng)
        self._clock = clock
        self._name = name
        self._entries: dict[str, bytes] = {}
        self._claimed: set[str] = set()  # keys registered only if nobody else holds them
        self.conflict: str | None = None  # why a claimed key is held by someone else (set once)
        self.lost_claim = asyncio.Event()  # set with conflict
        self.session: Session | None = None  # the live session, None between sessions
        self.sessions_opened = 0
        self.registered = asyncio.Event()  # set while every entry is written under the live session

    async def set(self, key: str, value: bytes) -> None:
        """Register ``key`` with ``value`` (now if a session is live, else when the next one opens)."""
        self._entries[key] = value
        session = self.session
        if session is not None and not session.done.is_set():
            try:
                await kv_of(self._client).put(key, value, lease=session.lease_id, timeout=float(self._ttl_s))
            except RETRYABLE_ERRORS as exc:
                _log.warning(
                    "%s: put %s failed (%s); it is written again on re-registration", self._name, key, error_line(exc)
                )

    async def claim(self, key: str, value: bytes) -> bool:
        """Register ``key`` with ``value`` only if no other lease holds it, now and on re-registration.

        Returns False (nothing written) when another holder's key exists. Waits for the session to be open.
        Raises one of ``RETRYABLE_ERRORS`` when etcd does not answer.
        """
        await self.registered.wait()
        session = self.session
        if session is None or session.done.is_set():
            raise TimeoutError(f"{self._name}: the etcd session was lost before {key} could be claimed")
        self._entries[key] = value
        self._claimed.add(key)
        if await self._put_claimed(key, value, session.lease_id):
            return True
        self._entries.pop(key, None)
        self._claimed.discard(key)
        return False

    async def claim_or_wait(
        self,
        key: str,
        value: bytes,
        wait_s: float,
        stop: asyncio.Event,
        *,
        holder_of: Callable[[bytes], str],
        what: str,
    ) -> bool:
        """Claim ``key`` for ``value`` (:meth:`claim`; :meth:`run` must be running), waiting up to ``wait_s`` seconds
        from the first refusal for another holder's key to go: a crashed holder's goes with its lease. A key holding
        this very ``value`` (this process's previous run, at the same address) is taken over at once. While etcd
        does not answer, it retries.

        Returns True once claimed, False when ``stop`` is set first. Raises KeyTakenError naming ``what`` and the
        holder (``holder_of`` its value: an address) when the key is still held after ``wait_s``.
        """
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        unanswered = RepeatedFailures()
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                claim = asyncio.ensure_future(self.claim(key, value))
                await asyncio.wait({claim, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not claim.done():  # stopped while the session was not open
                    claim.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await claim
                    return False
                try:
                    if claim.result():
                        return True
                    reply = await kv_of(self._client).get(key, timeout=float(self._ttl_s))
                except RETRYABLE_ERRORS as exc:
                    level = unanswered.failed()
                    _log.log(
                        level, "%s: etcd does not answer (%s); retrying the claim of %s", what, error_line(exc), key
                    )
                    await asyncio.wait({stopped}, timeout=1.0)
                    continue
                unanswered.reset()
                holder = holder_of(bytes(reply.kvs[0].value)) if reply.kvs else "?"
                if deadline is None:
                    deadline = loop.time() + wait_s
                    _log.warning(
                        "%s: a process at %s holds its registration; waiting up to %.0f s for it to expire (a crashed "
                        "one's goes with its lease)",
                        what,
                        holder,
                        wait_s,
                    )
                if loop.time() >= deadline:
                    raise KeyTakenError(
                        f"{what} already has a live process at {holder}; stop it first (a crashed one's registration "
                        "expires with its lease TTL)"
                    )
                await asyncio.wait({stopped}, timeout=0.5)
            return False
        finally:
            stopped.cancel()

    async def _put_claimed(self, key: str, value: bytes, lease_id: int) -> bool:
        kv = kv_of(self._client)
        resp = await kv.txn(
            [kv.txn_compare_create_revision(key, 0)],
            [kv.txn_op_put(key, value, lease=lease_id)],
            [kv.txn_op_get(key)],
            timeout=float(self._ttl_s),
        )
        if resp.succeeded:
            return True
        kvs = resp.responses[0].response_range.kvs
        if not kvs:
            return False
        held = kvs[0]
        if int(held.lease) != lease_id and bytes(held.value) != value:
            return False
        # Ours already (a repeated claim), or this very registration left by an earlier run of its holder: the
        # value names the holder's address, which two live processes cannot share. Take it (if unchanged).
        took = await kv.txn(
            [compare_mod_revision(key, int(held.mod_revision))],
            [kv.txn_op_put(key, value, lease=lease_id)],
            [],
            timeout=float(self._ttl_s),
        )
        return bool(took.succeeded)

    async def remove(self, key: str) -> None:
        """Unregister ``key`` (delete it now if a session is live)."""
        self._entries.pop(key, None)
        if self.session is not None and not self.session.done.is_set():
            with contextlib.suppress(*RETRYABLE_ERRORS):
                await kv_of(self._client).delete(key, timeout=float(self._ttl_s))

    async def _open(self, stop: asyncio.Event) -> Session | None:
        while not stop.is_set():
            try:
                session = await Session.open(self._client, self._ttl_s, clock=self._clock)
                if failures := self._backoff.reset():
                    _log.log(RECOVERED_LEVEL, "%s: etcd answers again after %s", self._name, failed_attempts(failures))
                return session
            except RETRYABLE_ERRORS as exc:
                delay = self._backoff.next_s()
                _log.log(
                    self._backoff.level(),
                    "%s: cannot open an etcd session (%s), attempt %d; retrying in %.2f s: check that etcd runs "
                    "and that --etcd names its client address",
                    self._name,
                    error_line(exc),
                    self._backoff.failures,
                    delay,
                )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()
        return None

    async def _register_all(self, session: Session) -> None:
        for key, value in list(self._entries.items()):
            if key not in self._claimed:
                await kv_of(self._client).put(key, value, lease=session.lease_id, timeout=float(self._ttl_s))
            elif not await self._put_claimed(key, value, session.lease_id):
                self._entries.pop(key, None)
                self._claimed.discard(key)
                self.conflict = f"{key} is held by another lease (someone else claimed it while this one was away)"
                self.lost_claim.set()
                _log.error("%s: %s", self._name, self.conflict)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the entries registered until ``stop`` is set; then revoke the lease (entries vanish)."""
        old_lease: int | None = None
        while not stop.is_set():
            session = await self._open(stop)
            if session is None:
                break
            self.sessions_opened += 1
            if old_lease is not None:
                with contextlib.suppress(*RETRYABLE_ERRORS):
                    await lease_of(self._client).revoke(old_lease, timeout=float(self._ttl_s))
            try:
                await self._register_all(session)
            except RETRYABLE_ERRORS as exc:
                delay = self._backoff.next_s()
                _log.log(
                    self._backoff.level(),
                    "%s: registering under lease %x failed (%s), attempt %d; retrying in %.2f s",
                    self._name,
                    session.lease_id,
                    exc,
                    self._backoff.failures,
                    delay,
                )
                old_lease = session.lease_id
                await session.close(revoke=False)
                await asyncio.sleep(delay)
                continue
            self.session = session
            self.registered.set()
            n = len(self._entries)
            keys = f"{n} key{'' if n == 1 else 's'}"
            if n and old_lease is not None:  # after a warning: said at its level (RECOVERED_LEVEL)
                _log.log(RECOVERED_LEVEL, "%s: %s registered again under lease %x", self._name, keys, session.lease_id)
            elif n:
                _log.info("%s: %s registered under lease %x", self._name, keys, session.lease_id)
            else:  # a claim (claim_or_wait) registers its key next
                _log.info("%s: etcd session open under lease %x, no key registered yet", self._name, session.lease_id)
            stop_task = asyncio.ensure_future(stop.wait())
            done_task = asyncio.ensure_future(session.done.wait())
            try:
                await asyncio.wait({stop_task, done_task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_task.cancel()
                done_task.cancel()
            self.registered.clear()
            self.session = None
            if stop.is_set():
                await session.close(revoke=True)
                break
            _log.warning(
                "%s: session lost (%s); re-registering under a new lease",
                self._name,
                session.lost_reason,
            )
            old_lease = session.lease_id
            await session.close(revoke=False)
