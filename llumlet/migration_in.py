"""The destination side of a live migration: Reserve, WriteBlocks, Commit, Release (DESIGN.md "Migration").

One reservation per request, of its newest attempt; an older attempt's message is answered ``STALE`` and
changes nothing; every message of the current attempt extends the reservation's expiry; a reaper releases
expired reservations.

Each attempt ``(request_id, attempt)`` ends once, and its end is remembered (``moved_ttl_s``):

- ``commit`` adopts the request, announces the new owner epoch to its origin and answers once the origin
  acknowledged it (the origin is the arbiter of ownership: the source may claim the same epoch when it cannot
  learn the outcome, and the first of the two the origin sees wins; a destination whose announcement is
  answered ``superseded`` drops the request). Commit runs to its end whatever happens to the RPC that asked
  for it, and is idempotent: a repeated Commit of the attempt waits for the first and returns its outcome;
- ``release`` is idempotent too: it waits for a Commit of the attempt in progress and says whether the attempt
  committed here; if it had not, the attempt is over and a later Commit of it is refused;
- a Commit that fails (no room for the growth, a state the engine refuses, the origin gone) ends the attempt
  and returns its blocks at once.

Recomputing the prefix (docs/cost-model.md): the first Reserve names the request's prefix blocks (the leading
blocks holding prompt tokens only); the reply carries this engine's estimate of re-prefilling the ones it does
not cache (``Engine.prefill_time_s``, None when it offers none). When the source's plan
(``topology.cost.plan_migration``) says recompute, a later Reserve names ``recompute_blocks``: this llumlet
re-prefills them into the reservation (``Engine.recompute_prefix``; a model engine's modelled time is waited
out at the backend's time scale) while the rest is copied, and Commit waits for it (a failed recomputation
fails the Commit: the request stays on the source).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llumlet.driver import EngineDriver, Owned
from llumlet.engine.protocol import KVPayload
from llumlet.migration_types import (
    NO_PREFIX,
    CommitCall,
    DestReply,
    DestStatus,
    MigrationConfig,
    PromptPrefix,
    Released,
    Reserved,
    Written,
    reservation_id,
)
from llumlet.tokens import PushOutcome
from llumlet.transport import PeerPools, TransportError

if TYPE_CHECKING:
    from llumlet.kvpool import KVPool

__all__ = ["IncomingChunk", "MigrationDestination"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IncomingChunk:
    """One run of blocks of a WriteBlocks stream: its data inline, or (local transport) where it lies in
    a peer's KV pool on this host."""

    request_id: str
    attempt: int
    payload: KVPayload  # positions and logical size; the data when inline
    source: tuple[KVPool, tuple[int, ...]] | None = None  # (the source's opened pool, its block ids)


@dataclass(slots=True)
class _Reservation:
    request_id: str
    attempt: int
    reservation_id: str
    src_instance_id: str
    expiry_s: float
    deadline: float
    blocks: int
    prompt_token_ids: tuple[int, ...] = ()  # the first Reserve's prompt (what a recomputation prefills)
    cached_blocks: int = 0  # leading positions adopted from the prefix cache
    recomputed: asyncio.Event | None = None  # set when the asked recomputation ended (None: none asked)
    recompute_error: str = ""  # why it failed ("" = it succeeded, or none was asked)


class MigrationDestination:
    """Takes requests migrated to one llumlet (see the module docstring).

    Args:
        driver: the llumlet's engine driver.
        config: migration settings (reservation expiry).
        moved_ttl_s: how long ended attempts and attempt numbers are remembered.
    """

    def __init__(self, driver: EngineDriver, config: MigrationConfig, *, moved_ttl_s: float = 300.0) -> None:
        self._d = driver
        self.config = config
        self._moved_ttl_s = moved_ttl_s
        self.reservations: dict[str, _Reservation] = {}  # request_id -> its newest attempt's reservation
        self._attempts: dict[str, tuple[int, float]] = {}  # request_id -> (newest attempt seen, when)
        self._commits: dict[tuple[str, int], asyncio.Task[DestReply]] = {}  # Commits in progress
        self._ended: dict[tuple[str, int], tuple[DestReply, float]] = {}  # (request_id, attempt) -> its end, when
        self.pools = PeerPools()  # local transport: KV pools of the source llumlets on this host, opened once

    def start(self) -> None:
        """Start the reservation reaper (after the driver started)."""
        self._d.spawn(self._reaper(), "reservation-reaper")

    def status_of(self, request_id: str, attempt: int) -> tuple[DestStatus, str]:
        """Whether ``(request_id, attempt)`` holds the current reservation here: (OK, "") or why not."""
        _, status, reason = self._current(request_id, attempt)
        return status, reason

    def committed(self, request_id: str, attempt: int) -> bool:
        """True when ``(request_id, attempt)`` committed here (the request ran here from then on)."""
        end = self._ended.get((request_id, attempt))
        return end is not None and end[0].status is DestStatus.OK

    def _current(self, request_id: str, attempt: int) -> tuple[_Reservation | None, DestStatus, str]:
        """The reservation of ``(request_id, attempt)`` or (None, status, reason)."""
        newest = self._attempts.get(request_id, (0, 0.0))[0]
        if attempt < newest:
            return None, DestStatus.STALE, f"attempt {attempt} of {request_id!r} is older than attempt {newest}"
        end = self._ended.get((request_id, attempt))
        if end is not None:
            reply = end[0]
            rid = reservation_id(request_id, attempt)
            if reply.status is DestStatus.OK:
                return None, DestStatus.REFUSED, f"{self._d.instance_id}: {rid!r} committed here"
            return None, DestStatus.REFUSED, f"{self._d.instance_id}: no reservation {rid!r} ({reply.reason})"
        cur = self.reservations.get(request_id)
        if cur is None or cur.attempt != attempt:
            rid = reservation_id(request_id, attempt)
            return None, DestStatus.REFUSED, f"{self._d.instance_id}: no reservation {rid!r} (expired or released)"
        return cur, DestStatus.OK, ""

    def _end(self, request_id: str, attempt: int, reply: DestReply) -> DestReply:
        self._ended[(request_id, attempt)] = (reply, self._d.clock())
        return reply

    async def reserve(
        self,
        request_id: str,
        attempt: int,
        num_blocks: int,
        *,
        src_instance_id: str = "",
        expiry_s: float = 0.0,
        prefix: PromptPrefix = NO_PREFIX,
        pool: bytes = b"",
        prefix_blocks: int = 0,
        recompute_blocks: int = 0,
    ) -> Reserved:
        """Reserve ``num_blocks`` for ``(request_id, attempt)``, or grow the reservation of the same attempt.

        A new reservation with a ``prefix`` (the request's prompt, its prefix hash ids) adopts the leading
        blocks of that prompt this engine already caches (``Engine.adopt_cached_prefix``): the reply's
        ``num_cached_blocks`` says how many positions the source need not send. With ``pool`` (the source's
        exported KV pool, local transport) the reply says whether this llumlet could open it
        (``pool_opened``): peer copies when it could, bytes inline when not (another host, a GPU not visible).
        With ``prefix_blocks`` (first Reserve) the reply's ``prefix_reprefill_s`` estimates re-prefilling those not
        cached; ``recompute_blocks`` (a later Reserve of the attempt) starts re-prefilling that many blocks after
        the cached ones (module docstring); asked twice, the second is refused.
        """
        rid, d = request_id, self._d
        me = d.instance_id
        if not rid or attempt < 1:
            return Reserved(DestStatus.REFUSED, f"{me}: need a request_id and attempt >= 1")
        if d.failure:
            return Reserved(DestStatus.REFUSED, f"{me}: {d.failure}")
        newest = self._attempts.get(rid, (0, 0.0))[0]
        if attempt < newest:
            return Reserved(DestStatus.STALE, f"attempt {attempt} of {rid!r} < newest {newest}")
        if (rid, attempt) in self._ended or (rid, attempt) in self._commits:
            return Reserved(DestStatus.REFUSED, self._current(rid, attempt)[2] or f"{me}: {rid!r}@{attempt} commits")
        if rid in d.owned:
            return Reserved(DestStatus.REFUSED, f"{me}: {rid!r} already runs here")
        self._attempts[rid] = (attempt, d.clock())
        cur = self.reservations.get(rid)
        if cur is not None and cur.attempt != attempt:  # an older attempt's leftovers
            await self._release_local(cur, f"superseded by attempt {attempt}")
            cur = None
        res_id = reservation_id(rid, attempt)
        cached = 0
        if cur is not None and recompute_blocks:
            return self._start_recompute(cur, recompute_blocks)
        if cur is None:
            ok = await d.call(d.engine.reserve, res_id, num_blocks)
            expiry = expiry_s or self.config.reservation_expiry_s
            if ok:
                cur = _Reservation(rid, attempt, res_id, src_instance_id, expiry, d.clock() + expiry, num_blocks)
                self.reservations[rid] = cur  # with its deadline: the reaper may run at the next await
                if prefix.token_ids or prefix.block_hashes:
                    cached = await d.call(
                        d.engine.adopt_cached_prefix,
                        res_id,
                        prefix.token_ids,
                        prefix.block_hashes,
                        prefix.hash_block_tokens,
                    )
                cur.prompt_token_ids, cur.cached_blocks = prefix.token_ids, cached
        else:
            ok = await d.call(d.engine.grow_reservation, res_id, num_blocks)
            if ok:
                cur.blocks = max(cur.blocks, num_blocks)
        if not ok or cur is None:
            free = (await d.call(d.engine.load)).free_blocks
            return Reserved(DestStatus.NO_ROOM, f"{me}: {num_blocks} blocks asked, {free} free", res_id)
        cur.deadline = d.clock() + cur.expiry_s
        d.bump()
        opened = False
        if pool:
            try:
                self.pools.open(pool)
                opened = True
            except TransportError as exc:
                _log.warning("%s: %s: the source's blocks come inline", me, exc)
        reprefill_s = None
        if prefix_blocks > cached:
            bs = d.engine.block_size_tokens
            reprefill_s = await d.call(d.engine.prefill_time_s, (prefix_blocks - cached) * bs, cached * bs)
        return Reserved(DestStatus.OK, "", res_id, cur.blocks, cached, opened, reprefill_s)

    def _start_recompute(self, cur: _Reservation, num_blocks: int) -> Reserved:
        """Begin re-prefilling ``num_blocks`` after the cached positions of ``cur`` (module docstring)."""
        d = self._d
        if cur.recomputed is not None:
            return Reserved(DestStatus.REFUSED, f"{d.instance_id}: {cur.reservation_id!r} already recomputes")
        cur.recomputed = asyncio.Event()
        cur.deadline = d.clock() + cur.expiry_s
        d.spawn(self._recompute(cur, cur.cached_blocks, num_blocks), f"recompute-{cur.reservation_id}")
        return Reserved(DestStatus.OK, "", cur.reservation_id, cur.blocks, cur.cached_blocks)

    async def _recompute(self, cur: _Reservation, first_block: int, num_blocks: int) -> None:
        d = self._d
        assert cur.recomputed is not None
        try:
            modelled_s = await d.call(
                d.engine.recompute_prefix, cur.reservation_id, cur.prompt_token_ids, first_block, num_blocks
            )
            wait_s = modelled_s * d.backend.time_scale
            if wait_s > 0:
                await asyncio.sleep(wait_s)  # the model engine's re-prefill takes its modelled time
            cur.deadline = d.clock() + cur.expiry_s
        except Exception as exc:  # refused (KeyError, IndexError, ValueError) or an engine fault: the Commit fails
            refused = isinstance(exc, KeyError | IndexError | ValueError)
            why = _describe(exc) if refused else f"{type(exc).__name__}: {exc}"
            cur.recompute_error = f"{d.instance_id}: re-prefilling {num_blocks} blocks from {first_block} failed: {why}"
            _log.warning("%s", cur.recompute_error)
        finally:
            cur.recomputed.set()

    async def write_blocks(self, chunks: AsyncIterator[IncomingChunk]) -> Written:
        """Store a stream of block runs into their reservation."""
        written = nbytes = 0
        d = self._d
        try:
            async for chunk in chunks:
                cur, status, reason = self._current(chunk.request_id, chunk.attempt)
                if cur is None:
                    return Written(status, reason, written, nbytes)
                try:
                    if chunk.source is None:
                        await d.call(d.engine.write_blocks, cur.reservation_id, chunk.payload)
                    else:
                        pool, ids = chunk.source
                        if len(ids) != chunk.payload.num_blocks:
                            raise ValueError(f"{len(ids)} source block ids for {chunk.payload.num_blocks} blocks")
                        first = chunk.payload.first_block
                        await d.call(d.engine.write_blocks_from, cur.reservation_id, first, pool, ids)
                except (KeyError, IndexError, ValueError) as exc:
                    return Written(DestStatus.FAILED, _describe(exc), written, nbytes)
                cur.deadline = d.clock() + cur.expiry_s
                written += chunk.payload.num_blocks
                nbytes += chunk.payload.nbytes
        except TransportError as exc:  # the data could not be read (the source's pool cannot be opened)
            return Written(DestStatus.FAILED, str(exc), written, nbytes)
        return Written(DestStatus.OK, "", written, nbytes)

    async def commit(self, call: CommitCall) -> DestReply:
        """Adopt the request, announce the new owner to its origin, resume it (see the module docstring).

        Idempotent per ``(request_id, attempt)``; runs to its end even when the caller is cancelled.
        """
        key = (call.request_id, call.attempt)
        newest = self._attempts.get(call.request_id, (0, 0.0))[0]
        if call.attempt < newest:
            return DestReply(DestStatus.STALE, f"attempt {call.attempt} of {call.request_id!r} < newest {newest}")
        end = self._ended.get(key)
        if end is not None:
            return end[0]
        task = self._commits.get(key)
        if task is None:
            cur, status, reason = self._current(*key)
            if cur is None:
                return DestReply(status, reason)
            task = self._commits[key] = asyncio.get_running_loop().create_task(
                self._commit(cur, call), name=f"commit-{reservation_id(*key)}"
            )
        return await asyncio.shield(task)

    async def _commit(self, cur: _Reservation, call: CommitCall) -> DestReply:
        rid, attempt, d = call.request_id, call.attempt, self._d
        try:
            try:
                reply = await self._adopt(cur, call)
            except Exception as exc:  # a bug or an engine fault: the attempt fails, nothing of it stays here
                _log.exception("%s: commit of %s failed", d.instance_id, reservation_id(rid, attempt))
                if rid in d.owned:
                    await d.drop(rid, push=None)
                reply = DestReply(DestStatus.FAILED, f"{d.instance_id}: internal error: {type(exc).__name__}: {exc}")
            if reply.status is not DestStatus.OK and self.reservations.get(rid) is cur:
                await self._release_local(cur, f"commit failed: {reply.reason}")
            return self._end(rid, attempt, reply)
        finally:
            self._commits.pop((rid, attempt), None)
            d.bump()

    async def _adopt(self, cur: _Reservation, call: CommitCall) -> DestReply:
        rid, d = call.request_id, self._d
        me = d.instance_id
        if d.failure:
            return DestReply(DestStatus.REFUSED, f"{me}: {d.failure}")
        if rid in d.owned:
            return DestReply(DestStatus.REFUSED, f"{me}: {rid!r} already runs here")
        if not call.origin:
            return DestReply(DestStatus.FAILED, f"{me}: commit of {rid!r} names no origin")
        if call.state.request_id != rid:
            return DestReply(DestStatus.FAILED, f"{me}: state is of {call.state.request_id!r}, not {rid!r}")
        if cur.recomputed is not None:  # the prefix re-prefilled here, in parallel with the copy
            await cur.recomputed.wait()
            if cur.recompute_error:
                return DestReply(DestStatus.FAILED, cur.recompute_error)
        async with d.lock:
            try:
                ok = await d.call_locked(d.engine.commit_incoming, cur.reservation_id, call.state)
            except (KeyError, ValueError) as exc:
                return DestReply(DestStatus.FAILED, f"{me}: {exc}")
            if not ok:
                return DestReply(DestStatus.NO_ROOM, f"{me}: the grown request of {rid!r} does not fit")
            # adopted: the engine and the books change together, with no await in between
            if self.reservations.get(rid) is cur:
                del self.reservations[rid]
            st = call.state
            prefix = PromptPrefix(st.prompt_token_ids or (), st.prefix_block_hashes, st.prefix_hash_block_tokens)
            d.adopt(Owned(rid, call.origin, next_seq=call.next_seq, epoch=call.epoch, prefix=prefix))
        outcome = await d.pusher.flush(rid)  # the ownership announcement, acknowledged by the origin
        if outcome is not PushOutcome.ACKED:
            if rid in d.owned:
                await d.drop(rid, push=None)
            return DestReply(DestStatus.FAILED, f"{me}: origin {call.origin}: {outcome.value}")
        return DestReply(DestStatus.OK)

    async def release(self, request_id: str, attempt: int) -> Released:
        """Release ``(request_id, attempt)``'s reservation and end the attempt; idempotent; says whether that
        attempt committed here (waiting for a Commit of it in progress)."""
        rid, key = request_id, (request_id, attempt)
        task = self._commits.get(key)
        if task is not None:
            await asyncio.shield(task)
        if self.committed(rid, attempt):
            return Released(DestStatus.OK, committed=True)
        if attempt < self._attempts.get(rid, (0, 0.0))[0]:
            return Released(DestStatus.STALE)
        if key not in self._ended:  # the attempt is over: a late Reserve or Commit of it is refused
            self._end(rid, attempt, DestReply(DestStatus.REFUSED, "released by the source"))
        cur = self.reservations.get(rid)
        if cur is None or cur.attempt != attempt:
            return Released(DestStatus.OK)
        n = await self._release_local(cur, "released by the source")
        return Released(DestStatus.OK, released_blocks=n)

    async def _release_local(self, cur: _Reservation, why: str) -> int:
        d = self._d
        if self.reservations.get(cur.request_id) is cur:
            del self.reservations[cur.request_id]
        n = await d.call(d.engine.release_reservation, cur.reservation_id)
        _log.info("%s: reservation %s (%d blocks) released: %s", d.instance_id, cur.reservation_id, n, why)
        d.bump()
        return n

    async def _reaper(self) -> None:
        period = max(0.02, min(0.25, self.config.reservation_expiry_s / 4))
        d = self._d
        while True:
            await asyncio.sleep(period)
            now = d.clock()
            for cur in [r for r in self.reservations.values() if r.deadline <= now]:
                if (cur.request_id, cur.attempt) in self._commits:
                    continue  # being adopted
                self._end(cur.request_id, cur.attempt, DestReply(DestStatus.REFUSED, "the reservation expired"))
                await self._release_local(cur, f"expired (no message for {cur.expiry_s} s)")
            horizon = now - self._moved_ttl_s
            d.forget_moved(horizon)
            self._ended = {k: v for k, v in self._ended.items() if v[1] > horizon}
            self._attempts = {k: v for k, v in self._attempts.items() if v[1] > horizon or k in self.reservations}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)
