"""The gateway's token sink: the llumlet helper's :class:`~llumlet.sink.TokenCollector` plus delivery.

Every request the gateway dispatches names this sink as its origin. Whichever llumlet runs the request
pushes its tokens here, numbered; the collector keeps the first copy of each seq, reorders, and follows
the owner epoch (+1 per committed migration), so a stream is assembled exactly once, in order, before,
during and after migrations. :class:`GatewaySink` adds what the HTTP side needs:

- :meth:`GatewaySink.updates` yields each request's new tokens as they become contiguous, then its end;
- per-token receive times (TTFT, TBT) and owner changes, reported to an :class:`SinkObserver`: an epoch
  that grows is a committed migration from the previous owner instance to the sender, inside or across
  NVLink domains (``domain_of``), and the gap between the old owner's last token and the new owner's first
  is its client-visible downtime;
- liveness: each owner llumlet is watched (``TokenCollector.watch``), so a llumlet that dies fails the
  requests it owns with a clear error, marked ``resumable``, instead of leaving the client waiting; so does a
  llumlet whose engine failed (its pushed error is marked so). :meth:`GatewaySink.resume` continues such a
  request under a new id (a replay elsewhere, ``gateway.core.plan_resume``) from the tokens already held.

The hook is ``TokenCollector._push`` (overridden, the collector's logic unchanged): the collector has no
public per-push callback yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from hilum_proto.v1 import token_sink_pb2 as pb
from llumlet.engine.types import TokenLogprobs
from llumlet.sink import TokenCollector

__all__ = ["GatewaySink", "Move", "SinkObserver", "TokenUpdate"]


@dataclass(frozen=True, slots=True)
class Move:
    """One committed migration of a request, as the sink saw it."""

    src_instance_id: str  # owner before ("" if no push from it was seen)
    dst_instance_id: str  # owner after (the sender of the newer epoch)
    token_gap_s: float | None  # old owner's last token -> new owner's first; None if unknown


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """New tokens of one request, in order, and whether the stream ended with them."""

    token_ids: tuple[int, ...]  # the tokens after the ones already delivered
    done: bool
    finish_reason: str  # "length" | "stop" | "abort" | "error" when done, else ""
    error: str  # why the request failed, "" if it did not
    instance_id: str  # the instance that owns the request now ("" before its first push)
    migrations: int  # committed migrations seen so far
    moves: tuple[Move, ...] = ()  # those migrations whose first new token arrived (or that ended the stream)
    logprobs: tuple[TokenLogprobs, ...] = ()  # aligned with token_ids when the request asked for logprobs
    resumable: bool = False  # done with an error of its instance (dead or failed): it may be replayed elsewhere
    resumes: int = 0  # replays on another instance after a failure so far (set by the backend that replays)


class SinkObserver(Protocol):
    """What the sink reports (the gateway's metrics)."""

    def on_tokens(self, request_id: str, count: int, gap_s: float | None, first: bool) -> None:
        """``count`` new tokens; ``gap_s`` since the previous delivery (None for the first)."""

    def on_migration(self, request_id: str, src_instance_id: str, dst_instance_id: str, gap_s: float | None) -> None:
        """A committed migration seen (owner epoch grew); ``gap_s`` the token gap across it."""


@dataclass(slots=True)
class _Progress:
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    received: int = 0  # contiguous tokens held when last seen
    last_token_s: float | None = None  # receive time of the newest token
    epoch: int = 0
    owner_instance_id: str = ""
    migrations: int = 0
    pending_gap_from_s: float | None = None  # a migration seen, waiting for the new owner's first token
    pending_move: tuple[str, str] = ("", "")
    moves: list[Move] = field(default_factory=list)


class GatewaySink(TokenCollector):
    """A TokenSink server for the gateway's requests (see the module docstring).

    Args:
        listen: ``host:port`` (port 0 picks one).
        what: the option that gave ``listen``, for the error when it cannot be bound.
        observer: told about tokens and migrations.
        clock: monotonic clock, seconds.
        poll_s: how often :meth:`updates` re-checks a request without pushes (a failed owner).
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        what: str = "token sink",
        observer: SinkObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.25,
    ) -> None:
        super().__init__(listen, what)
        self._observer = observer
        self._clock = clock
        self._poll_s = poll_s
        self._progress: dict[str, _Progress] = {}

    def open(self, request_id: str) -> None:
        """Start collecting ``request_id`` (before it is submitted). Raises ValueError on a repeated id."""
        self.expect(request_id)
        self._progress[request_id] = _Progress()

    def dispatched(self, request_id: str, instance_id: str, address: str) -> None:
        """The domain scheduler placed the request on ``instance_id`` at ``address``: watch that llumlet."""
        prog = self._progress.get(request_id)
        if prog is not None and not prog.owner_instance_id:
            prog.owner_instance_id = instance_id
        if address:
            self.placed(request_id, address)
            self.watch(address, instance_id)

    def resume(self, request_id: str, new_request_id: str) -> int:
        """Continue ``request_id`` as ``new_request_id`` (replayed elsewhere): the new stream starts with the
        tokens held, its progress (migrations, moves) carries over; returns the tokens held. Raises KeyError
        for a request not opened, ValueError for a new id already open."""
        held = super().resume(request_id, new_request_id)
        prog = self._progress.pop(request_id, None) or _Progress()
        prog.wake = asyncio.Event()
        prog.received, prog.epoch, prog.owner_instance_id = held, 0, ""
        prog.pending_gap_from_s, prog.pending_move = None, ("", "")
        self._progress[new_request_id] = prog
        return held

    def close(self, request_id: str) -> None:
        """Stop collecting: later pushes are answered ``unknown`` (the llumlet drops the request)."""
        self.forget(request_id)
        self._progress.pop(request_id, None)

    def fail_all(self, error: str) -> None:
        """Fail every unfinished request with ``error`` (the gateway is stopping).

        Their :meth:`updates` end with an error update, so each client gets an error event, not a cut stream.
        """
        for request_id, prog in self._progress.items():
            self.fail(request_id, error)
            prog.wake.set()

    def owner_address(self, request_id: str) -> str:
        """The llumlet that runs the request as far as the sink knows ("" before any push)."""
        try:
            return self.get(request_id).owner_address
        except KeyError:
            return ""

    async def updates(
        self, request_id: str, stall_timeout_s: float = 300.0, *, delivered: int = 0
    ) -> AsyncGenerator[TokenUpdate, None]:
        """New tokens of ``request_id`` after the first ``delivered`` as they arrive, then one update with
        ``done`` set.

        A request with no progress for ``stall_timeout_s`` ends with an error update. Raises KeyError for a
        request not opened.
        """
        prog = self._progress[request_id]
        last_progress = self._clock()
        while True:
            prog.wake.clear()
            snap = self.get(request_id)
            new = snap.token_ids[delivered:]
            if new or snap.done:
                logprobs = snap.logprobs[delivered : delivered + len(new)]
                delivered += len(new)
                last_progress = self._clock()
                yield TokenUpdate(
                    new,
                    snap.done,
                    snap.finish_reason,
                    snap.error,
                    prog.owner_instance_id,
                    prog.migrations,
                    tuple(prog.moves),
                    logprobs,
                    snap.resumable,
                )
                if snap.done:
                    return
                continue
            if self._clock() - last_progress > stall_timeout_s:
                error = f"request {request_id}: no token for {stall_timeout_s:g} s (owner {snap.owner_address or '?'})"
                self.fail(request_id, error)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(prog.wake.wait(), self._poll_s)

    # ---- the hook ----------------------------------------------------------------------------------
    def _push(self, msg: pb.TokenChunk) -> pb.TokenAck:
        ack = super()._push(msg)
        prog = self._progress.get(msg.request_id)
        if prog is None or (ack.unknown and not msg.finished):
            return ack
        now = self._clock()
        if msg.epoch > prog.epoch and not ack.superseded and msg.sender_instance_id == prog.owner_instance_id:
            prog.epoch = int(msg.epoch)  # the owner claimed the next epoch (a move whose commit it could not learn)
        elif msg.epoch > prog.epoch and not ack.superseded:
            src = prog.owner_instance_id
            prog.migrations += int(msg.epoch - prog.epoch)
            prog.epoch = int(msg.epoch)
            prog.owner_instance_id = msg.sender_instance_id
            prog.pending_gap_from_s = prog.last_token_s
            prog.pending_move = (src, msg.sender_instance_id)
            if msg.sender_address:
                self.watch(msg.sender_address, msg.sender_instance_id)
            if prog.pending_gap_from_s is None:  # no token before it: no gap to measure
                self._moved(msg.request_id, prog, None)
        elif not prog.owner_instance_id and msg.sender_instance_id:
            prog.owner_instance_id = msg.sender_instance_id
        snap = self.get(msg.request_id)
        held = len(snap.token_ids)
        if held > prog.received:
            count = held - prog.received
            gap = None if prog.last_token_s is None else now - prog.last_token_s
            if self._observer is not None:
                self._observer.on_tokens(msg.request_id, count, gap, prog.received == 0)
            if prog.pending_gap_from_s is not None:
                self._moved(msg.request_id, prog, now - prog.pending_gap_from_s)
            prog.received = held
            prog.last_token_s = now
        elif snap.done and prog.pending_gap_from_s is not None:  # moved, then ended without a new token
            self._moved(msg.request_id, prog, None)
        prog.wake.set()
        return ack

    def _moved(self, request_id: str, prog: _Progress, gap_s: float | None) -> None:
        src, dst = prog.pending_move
        prog.pending_gap_from_s = None
        prog.moves.append(Move(src, dst, gap_s))
        if self._observer is not None:
            self._observer.on_migration(request_id, src, dst, gap_s)
