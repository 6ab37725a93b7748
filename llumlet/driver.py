"""The llumlet's engine driver: the engine thread and lock, the engine loop, the request books, token pushes
and load reports.

One asyncio loop. The engine is not thread-safe: every engine call runs in one worker thread under one
``asyncio.Lock`` (so a call waits at most one step and the event loop never blocks on the engine), and the
engine loop applies a step's results under the same lock — whatever runs "between two steps" (suspend, read
the last blocks) sees the token numbering of every step before it.

The migration source (``llumlet.migration_out``) and destination (``llumlet.migration_in``) work through
this driver: :meth:`EngineDriver.call` for engine calls, :attr:`EngineDriver.owned` for the requests this
instance runs, :meth:`EngineDriver.bump` after any change a load report shows.

An engine that fails (any exception from a step) fails the instance: :attr:`EngineDriver.failure` says why,
Ping and every load report carry it (domain schedulers stop routing to it), every request it owned ends at
once with an error marked ``resumable`` (its origin may replay it elsewhere), and it takes no new request
and no migration. It stays failed until the process is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, TypeVar

import grpc

from llumlet.backends.base import Backend
from llumlet.client import LlumletClient
from llumlet.engine.types import EngineLoad, EngineRequest, StepResult
from llumlet.migration_types import NO_PREFIX, PromptPrefix
from llumlet.tokens import PushOutcome, TokenChunkOut, TokenPusher

__all__ = ["EngineDriver", "LoadSnapshot", "Owned"]

_log = logging.getLogger(__name__)
_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(slots=True)
class Owned:
    """A request this llumlet runs (queued, running or suspended)."""

    request_id: str
    origin: str  # TokenSink address
    next_seq: int  # seq of the next token
    epoch: int  # owner epoch (committed migrations so far; +1 for a claim after an unresolved commit)
    migrating: int = 0  # attempt of the outgoing migration in flight, 0 = none
    committing: bool = False  # Commit sent, outcome unknown
    abort_requested: bool = False  # the client aborted while committing
    prefix: PromptPrefix = NO_PREFIX  # the prompt, for a destination's prefix-cache lookup (may be empty)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The engine's load and the driver's counters at one moment (``hilum.v1.LoadReport``)."""

    load: EngineLoad
    num_requests: int  # requests this llumlet owns (queued, running, suspended)
    version: int  # grows with every change of the load or the books
    recent_step_s: float  # duration of the most recent step that scheduled work, seconds (0 before the first)
    num_reservations: int = 0  # incoming migrations holding blocks here (filled by the llumlet)
    num_migrations_out: int = 0  # outgoing migrations in flight (filled by the llumlet)
    finished_output_tokens: tuple[int, ...] = ()  # output lengths of requests that finished since the last report
    failure: str = ""  # why the engine failed ("" = healthy): the instance takes no work


class EngineDriver:
    """Runs one engine (see the module docstring). ``await start(address)``, ``await stop()``.

    Args:
        instance_id: for messages.
        backend: the engine and how to pace it.
        rng: jitter of token-push retries.
        clock: monotonic seconds; wall_clock: seconds since the epoch (arrival times).
        push_retries: retries of one token push.
        idle_retry_s: wait after a step that scheduled nothing (queued work did not fit).
        load_min_interval_s: default spacing of WatchLoad reports.
        rpc_timeout_s: deadline of calls to peer llumlets (abort forwarding, migration).
    """

    def __init__(
        self,
        instance_id: str,
        backend: Backend,
        *,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        push_retries: int = 5,
        idle_retry_s: float = 0.005,
        load_min_interval_s: float = 0.01,
        rpc_timeout_s: float = 10.0,
    ) -> None:
        self.instance_id = instance_id
        self.backend = backend
        self.engine = backend.engine
        self.clock = clock
        self._wall_clock = wall_clock
        self._rng = rng
        self._push_retries = push_retries
        self._idle_retry_s = idle_retry_s
        self._load_min_interval_s = load_min_interval_s
        self._rpc_timeout_s = rpc_timeout_s
        self.address = ""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{instance_id}")
        self.lock = asyncio.Lock()  # held by every engine call; a caller holding it runs "between two steps"
        self._work = asyncio.Event()
        self.owned: dict[str, Owned] = {}
        self.moved: dict[str, tuple[str, float]] = {}  # request_id -> (destination address, when)
        self._peers: dict[str, LlumletClient] = {}
        self._version = 0
        self._changed = asyncio.Event()
        self._recent_step_s = 0.0
        # (sequence number, output tokens) of the most recent natural finishes, for the WatchLoad streams
        self._finished: deque[tuple[int, int]] = deque(maxlen=4096)
        self._finished_seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._pusher: TokenPusher | None = None
        self.failure = ""  # why the engine failed; "" while healthy
        self._last_load: EngineLoad | None = None  # the engine's last load (reported once it failed)

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self, address: str) -> None:
        """Start the engine loop; ``address`` is this llumlet's ``host:port``."""
        self.address = address
        self._pusher = TokenPusher(
            self.instance_id, address, self._on_push_failure, self._rng, retries=self._push_retries
        )
        self.spawn(self._engine_loop(), "engine-loop")

    async def stop(self) -> None:
        """Stop the loops, close the pusher and the peer channels, shut the engine thread down."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pusher is not None:
            await self._pusher.close()
        for peer in self._peers.values():
            await peer.close()
        self._executor.shutdown(wait=True)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` as a background task of this llumlet (cancelled by :meth:`stop`)."""
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    @property
    def pusher(self) -> TokenPusher:
        """The token pusher (after ``start``)."""
        if self._pusher is None:
            raise RuntimeError(f"llumlet {self.instance_id}: not started")
        return self._pusher

    def peer(self, address: str) -> LlumletClient:
        """The (cached) client of the llumlet at ``address``."""
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = LlumletClient(address, timeout_s=self._rpc_timeout_s)
        return peer

    # ---- engine access ----------------------------------------------------------------------------
    async def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run one engine call in the engine thread, between two steps."""
        async with self.lock:
            return await self.call_locked(fn, *args, **kwargs)

    async def call_locked(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run one engine call in the engine thread; the caller holds :attr:`lock`."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    @property
    def recent_step_s(self) -> float:
        """Duration of the most recent step that scheduled work, seconds (0 before the first)."""
        return self._recent_step_s

    def bump(self) -> None:
        """Something a load report shows changed: wake the WatchLoad streams."""
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """The engine may have work now (a request queued or resumed)."""
        self._work.set()

    async def _engine_loop(self) -> None:
        while True:
            self._work.clear()
            t0 = self.clock()
            try:
                async with self.lock:
                    busy = self.engine.has_work()
                    result = await self.call_locked(self.engine.step) if busy else None
                    if result is not None:
                        self._apply(result, self._tokens_due(result, t0))
            except Exception as exc:  # the engine is broken: fail the instance rather than hang its requests
                _log.exception("%s: engine step failed", self.instance_id)
                self.fail(f"engine step raised {type(exc).__name__}: {exc}")
                return
            if result is None:
                await self._work.wait()
                continue
            if result.is_idle:
                await asyncio.sleep(self._idle_retry_s)
                continue
            rest_s = self.backend.step_wall_s(result) - (self.clock() - t0)
            await asyncio.sleep(max(0.0, rest_s))
            self._recent_step_s = self.clock() - t0

    def _tokens_due(self, result: StepResult, t0: float) -> float:
        """When the tokens of the step that began at ``t0`` (:attr:`clock`) exist, in event-loop time: a modelled
        step's (the sim engine's, ``time_scale`` > 0) at its modelled end, as a GPU's at the end of its step, so a
        first token comes after its prefill (pushed at once, a live TTFT left the prefill out: a 3,000-token
        prompt's first token at 12 ms, its second at 611 ms); a real engine's at once (0)."""
        if self.backend.time_scale <= 0 or result.is_idle:
            return 0.0
        rest_s = self.backend.step_wall_s(result) - (self.clock() - t0)
        return asyncio.get_running_loop().time() + max(0.0, rest_s)

    def _apply(self, result: StepResult, tokens_due: float = 0.0) -> None:
        """Push the step's tokens (numbered; held by the pusher until ``tokens_due``, event-loop time, 0: at once),
        retire finished requests. Runs under the engine lock."""
        finished = set(result.finished)
        for rid, n in result.new_tokens.items():
            rec = self.owned.get(rid)
            if rec is None or n <= 0:
                continue
            if self.backend.real_token_ids:
                ids = list(result.token_ids.get(rid, ()))
            else:
                ids = list(range(rec.next_seq, rec.next_seq + n))
            done = rid in finished
            reason = result.finish_reasons.get(rid, "length") if done else ""
            logprobs = list(result.logprobs.get(rid, ()))
            chunk = TokenChunkOut(
                rid, rec.next_seq, ids, rec.epoch, done, reason, logprobs=logprobs, not_before_s=tokens_due
            )
            self.pusher.push(rec.origin, chunk)
            rec.next_seq += len(ids)
        for rid in result.finished:
            rec = self.owned.pop(rid, None)
            if rec is None:
                continue
            if result.new_tokens.get(rid, 0) <= 0:
                reason = result.finish_reasons.get(rid, "length")
                end = TokenChunkOut(rid, rec.next_seq, [], rec.epoch, True, reason, not_before_s=tokens_due)
                self.pusher.push(rec.origin, end)
            self._finished_seq += 1
            self._finished.append((self._finished_seq, rec.next_seq))
        if result.new_tokens or result.finished or result.preempted:
            self.bump()

    # ---- requests -----------------------------------------------------------------------------------
    async def submit(
        self, request: EngineRequest, origin: str, *, reserved: bool = False, first_seq: int = 0
    ) -> str | None:
        """Queue a request whose tokens go to ``origin``; the reason when it is not accepted, else None.

        ``reserved``: the request id holds an incoming migration's reservation here (refused). ``first_seq``:
        the seq of its first output token (a request resumed elsewhere continues its origin's numbering).
        """
        rid = request.request_id
        if self.failure:
            return f"{self.instance_id}: {self.failure}"
        if rid in self.owned or reserved:
            return f"{self.instance_id}: request {rid!r} is already here"
        refused = self.backend.refuses(request.sampling_params)
        if refused is not None:
            return f"{self.instance_id}: request {rid!r}: {refused}"
        try:
            await self.call(self.engine.add_request, request)
        except ValueError as exc:  # RequestTooLargeError, duplicate id
            return str(exc)
        prefix = PromptPrefix(
            request.prompt_token_ids or (), request.prefix_block_hashes, request.prefix_hash_block_tokens
        )
        self.owned[rid] = Owned(rid, origin, next_seq=first_seq, epoch=0, prefix=prefix)
        self.moved.pop(rid, None)
        self.pusher.forget(rid)
        self.wake()
        self.bump()
        return None

    def adopt(self, rec: Owned) -> None:
        """A migrated request now runs here (the engine adopted it): book it and announce its owner epoch to its
        origin (an ownership-only push; :meth:`TokenPusher.flush` says whether the origin took it)."""
        self.owned[rec.request_id] = rec
        self.moved.pop(rec.request_id, None)
        self.pusher.forget(rec.request_id)
        self.pusher.push(rec.origin, TokenChunkOut(rec.request_id, rec.next_seq, [], rec.epoch))
        self.wake()
        self.bump()

    async def claim(self, rec: Owned) -> PushOutcome:
        """Ask the origin to make this instance the owner of ``rec`` at the next epoch (a move whose commit
        outcome is unknown: the origin takes the first claim of an epoch, so either this one or the
        destination's announcement wins). ``ACKED``: this instance owns it at ``rec.epoch + 1`` now."""
        self.pusher.push(rec.origin, TokenChunkOut(rec.request_id, rec.next_seq, [], rec.epoch + 1))
        outcome = await self.pusher.flush(rec.request_id)
        if outcome is PushOutcome.ACKED:
            rec.epoch += 1
        return outcome

    def fail(self, reason: str) -> None:
        """The engine failed: end every request here with a resumable error, refuse all new work (see the module
        docstring). Requests whose outgoing commit is in flight are left to their migration."""
        if self.failure:
            return
        self.failure = reason
        _log.error("%s: instance failed: %s; its requests end with a resumable error", self.instance_id, reason)
        for rid, rec in list(self.owned.items()):
            if rec.committing:
                continue
            self.end_failed(rid)
        self.bump()

    def end_failed(self, request_id: str) -> None:
        """Forget a request of a failed engine and tell its origin, resumable (no engine call)."""
        rec = self.owned.pop(request_id, None)
        if rec is None:
            return
        error = f"instance {self.instance_id} failed ({self.failure}): the request is lost"  # whose: the chunk says
        chunk = TokenChunkOut(request_id, rec.next_seq, [], rec.epoch, True, "error", error, resumable=True)
        self.pusher.push(rec.origin, chunk)

    def arrival_s(self) -> float:
        """Arrival time stamp of a new request (wall clock, comparable across hosts)."""
        return self._wall_clock()

    async def abort(self, request_id: str) -> tuple[bool, str]:
        """Abort a request: here, or forwarded to where it migrated. (found, forwarded_to address).

        A forward to a destination that does not answer gives (False, its address).
        """
        rec = self.owned.get(request_id)
        if rec is not None:
            if rec.committing:
                rec.abort_requested = True  # the migration decides where the abort applies
                return True, ""
            await self.drop(request_id, push=("abort", ""))
            return True, ""
        moved = self.moved.get(request_id)
        if moved is not None:
            try:
                reply = await self.peer(moved[0]).abort(request_id)
            except grpc.aio.AioRpcError as exc:
                _log.warning("%s: abort of %s not forwarded to %s: %s", self.instance_id, request_id, moved[0], exc)
                return False, moved[0]
            return reply.found, reply.forwarded_to or moved[0]
        return False, ""

    async def drop(self, request_id: str, push: tuple[str, str] | None) -> None:
        """Remove a request from the engine and the books; push its end (reason, error) unless ``push`` is None.

        A failed engine is not called (its requests are only in the books)."""
        if not self.failure:
            try:
                await self.call(self.engine.abort, request_id)
            except Exception as exc:
                _log.exception("%s: engine abort failed", self.instance_id)
                self.fail(f"engine abort raised {type(exc).__name__}: {exc}")
        rec = self.owned.pop(request_id, None)
        if rec is not None and push is not None:
            reason, error = push
            self.pusher.push(rec.origin, TokenChunkOut(request_id, rec.next_seq, [], rec.epoch, True, reason, error))
        self.bump()

    def _on_push_failure(self, request_id: str, outcome: PushOutcome, reason: str) -> None:
        rec = self.owned.get(request_id)
        if rec is None or rec.committing:
            return  # gone, or a migration in flight handles it
        _log.warning("%s: dropping %s: %s", self.instance_id, request_id, reason)
        self.spawn(self.drop(request_id, push=None), f"drop-{request_id}")

    def forget_moved(self, horizon_s: float) -> None:
        """Forget where requests that left before ``horizon_s`` (this clock) went."""
        self.moved = {k: v for k, v in self.moved.items() if v[1] > horizon_s}

    # ---- load -----------------------------------------------------------------------------------------
    async def load(self) -> LoadSnapshot:
        """The engine's load now, with the driver's counters (once failed: its last load and the failure)."""
        if not self.failure:
            try:
                self._last_load = await self.call(self.engine.load)
            except Exception as exc:  # a broken engine fails the instance
                _log.exception("%s: engine load failed", self.instance_id)
                self.fail(f"engine load raised {type(exc).__name__}: {exc}")
        load = self._last_load if self._last_load is not None else EngineLoad(0, 0, 0, 0)
        if self.failure:
            load = replace(load, running=(), num_waiting=0)
        return LoadSnapshot(load, len(self.owned), self._version, self._recent_step_s, failure=self.failure)

    async def watch(self, min_interval_s: float) -> AsyncIterator[LoadSnapshot]:
        """The load now, then after every change (at most one report per ``min_interval_s``; 0 = the default).

        Each report carries the output lengths of the requests that finished since this stream's previous
        report (none in the first).
        """
        interval = min_interval_s or self._load_min_interval_s
        seen = -1
        cursor = self._finished_seq
        while True:
            if seen == self._version:
                await self._changed.wait()
            seen = self._version
            snap = await self.load()
            finished = tuple(n for seq, n in self._finished if seq > cursor)
            cursor = self._finished_seq
            yield replace(snap, finished_output_tokens=finished)
            await asyncio.sleep(interval)
