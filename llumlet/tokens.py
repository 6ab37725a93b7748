"""Pushing a request's tokens to its origin's TokenSink (token_sink.proto), numbered, in order, with retries.

One lane per origin address: a queue drained by one task; each drain merges the queued chunks of a request
into one push (seq-contiguous) and pushes different requests concurrently, so the chunks of one request reach
the sink in order. A push that fails is retried (exponential backoff with jitter, at most ``retries`` times);
the sink de-duplicates by seq, so a retried push whose first acknowledgement was lost does no harm.

Outcomes a llumlet must act on are reported to ``on_failure(request_id, outcome, reason)``: the origin does
not expect the request (``UNKNOWN``: the client is gone), a newer owner epoch holds it (``SUPERSEDED``: it
migrated and this copy must stop), or the origin stayed unreachable (``UNREACHABLE``). After any of them the
request's further chunks are dropped.

A chunk may wait before it is sent (``TokenChunkOut.not_before_s``): the sim engine computes a step at once and
its tokens exist only once the modelled step has run, so they are held until then. A request's chunks leave in
the order they were queued (one held holds those after it), and :meth:`TokenPusher.flush` sends a request's held
chunks at once (a migration suspends the request mid-step and must hand its tokens over).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from hilum_proto.tls import open_channel
from hilum_proto.v1 import token_sink_pb2 as pb
from hilum_proto.v1 import token_sink_pb2_grpc as pb_grpc
from llumlet.convert import logprobs_to_pb
from llumlet.engine.types import TokenLogprobs

__all__ = ["PushOutcome", "TokenChunkOut", "TokenPusher"]

_log = logging.getLogger(__name__)


class PushOutcome(enum.Enum):
    """How the pushes of one request ended (``ACKED``: every chunk so far was acknowledged)."""

    ACKED = "acked"
    UNKNOWN = "unknown"  # the sink does not expect the request: the client is gone
    SUPERSEDED = "superseded"  # a newer owner epoch holds the request
    UNREACHABLE = "unreachable"  # the origin did not answer after every retry


@dataclass(slots=True)
class TokenChunkOut:
    """Tokens of one request on their way to its origin."""

    request_id: str
    first_seq: int  # seq of token_ids[0]
    token_ids: list[int]  # may be empty (final or ownership-only chunk)
    epoch: int  # owner epoch of this llumlet for the request
    finished: bool = False
    finish_reason: str = ""  # "length" | "stop" | "abort" | "error"
    error: str = ""
    merged: int = field(default=1)  # queued chunks this one stands for
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token when the request asked, else []
    resumable: bool = False  # finished with an error of the instance, not the request: the origin may replay it
    not_before_s: float = 0.0  # event-loop time before which it is not sent (a modelled step's end); 0: at once

    @property
    def end_seq(self) -> int:
        """Seq after the last token."""
        return self.first_seq + len(self.token_ids)


class _Lane:
    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.channel = open_channel(origin)
        self.stub = pb_grpc.TokenSinkStub(self.channel)
        self.queue: list[TokenChunkOut] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


def _merge(batch: list[TokenChunkOut]) -> dict[str, list[TokenChunkOut]]:
    """Group by request (first-seen order) and join seq-contiguous chunks of a request."""
    out: dict[str, list[TokenChunkOut]] = {}
    for chunk in batch:
        runs = out.setdefault(chunk.request_id, [])
        last = runs[-1] if runs else None
        if last is not None and not last.finished and last.end_seq == chunk.first_seq and last.epoch == chunk.epoch:
            last.token_ids.extend(chunk.token_ids)
            last.logprobs.extend(chunk.logprobs)
            last.finished, last.finish_reason, last.error = chunk.finished, chunk.finish_reason, chunk.error
            last.resumable = chunk.resumable
            last.merged += chunk.merged
        else:
            runs.append(
                TokenChunkOut(
                    chunk.request_id,
                    chunk.first_seq,
                    list(chunk.token_ids),
                    chunk.epoch,
                    chunk.finished,
                    chunk.finish_reason,
                    chunk.error,
                    chunk.merged,
                    list(chunk.logprobs),
                    chunk.resumable,
                )
            )
    return out


class TokenPusher:
    """Pushes the tokens of the requests one llumlet runs to their origins.

    Args:
        instance_id, address: the sender, named in every push (``address``: its Llumlet service).
        on_failure: told once per request when its pushes end other than ``ACKED`` (see module doc).
        rng: jitter of the retry backoff.
        retries: retries of one push after the first try; backoff_s: first backoff (doubles per retry).
        timeout_s: deadline of one push.
    """

    def __init__(
        self,
        instance_id: str,
        address: str,
        on_failure: Callable[[str, PushOutcome, str], None],
        rng: random.Random,
        *,
        retries: int = 5,
        backoff_s: float = 0.05,
        timeout_s: float = 5.0,
    ) -> None:
        self.instance_id = instance_id
        self.address = address
        self._on_failure = on_failure
        self._rng = rng
        self._retries = retries
        self._backoff_s = backoff_s
        self._timeout_s = timeout_s
        self._lanes: dict[str, _Lane] = {}
        # request_id -> [chunks queued, chunks done (sent or given up)], while some are queued or in flight; a flush
        # holds on to the list it found, so chunks queued after it do not hold it (new ones come every step)
        self._books: dict[str, list[int]] = {}
        self._failed: dict[str, PushOutcome] = {}  # request_id -> how its pushes ended (not ACKED)
        self._changed = asyncio.Condition()
        self._closed = False

    def push(self, origin: str, chunk: TokenChunkOut) -> None:
        """Queue ``chunk`` for ``origin`` (never blocks). Dropped if the request's pushes already failed."""
        if self._closed or chunk.request_id in self._failed:
            return
        lane = self._lanes.get(origin)
        if lane is None:
            lane = self._lanes[origin] = _Lane(origin)
            lane.task = asyncio.get_running_loop().create_task(self._drain(lane), name=f"push->{origin}")
        lane.queue.append(chunk)
        self._books.setdefault(chunk.request_id, [0, 0])[0] += 1
        lane.wake.set()

    def outcome(self, request_id: str) -> PushOutcome:
        """``ACKED`` unless the request's pushes failed."""
        return self._failed.get(request_id, PushOutcome.ACKED)

    async def flush(self, request_id: str) -> PushOutcome:
        """Send ``request_id``'s held chunks at once, and wait until every chunk queued for it so far is acknowledged
        (or its pushes failed); chunks queued after the call do not hold it."""
        for lane in self._lanes.values():
            held = [c for c in lane.queue if c.request_id == request_id and c.not_before_s > 0]
            for chunk in held:
                chunk.not_before_s = 0.0
            if held:
                lane.wake.set()
        async with self._changed:
            book = self._books.get(request_id)
            if book is not None:
                queued = book[0]  # the chunks queued so far
                await self._changed.wait_for(lambda: book[1] >= queued)
        return self.outcome(request_id)

    def forget(self, request_id: str) -> None:
        """Drop the memory of a request whose pushes failed (after the llumlet dealt with it)."""
        self._failed.pop(request_id, None)

    async def close(self) -> None:
        """Stop every lane and close the channels (queued chunks are dropped)."""
        self._closed = True
        for lane in self._lanes.values():
            if lane.task is not None:
                lane.task.cancel()
        for lane in self._lanes.values():
            if lane.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await lane.task
            await lane.channel.close()
        self._lanes.clear()

    async def _drain(self, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not lane.queue:
                lane.wake.clear()
                await lane.wake.wait()
            now = loop.time()
            held: set[str] = set()  # requests with a chunk held: their later chunks wait behind it
            batch, kept = [], []
            for chunk in lane.queue:
                if chunk.not_before_s > now or chunk.request_id in held:
                    held.add(chunk.request_id)
                    kept.append(chunk)
                else:
                    batch.append(chunk)
            if not batch:  # all held: until the first is due, or a push or a flush wakes the lane
                lane.wake.clear()
                due_s = min(c.not_before_s for c in kept if c.not_before_s > now) - now  # not those held behind
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lane.wake.wait(), max(0.0, due_s))
                continue
            lane.queue = kept
            groups = _merge(batch)
            await asyncio.gather(*(self._send_runs(lane, runs) for runs in groups.values()))

    async def _send_runs(self, lane: _Lane, runs: list[TokenChunkOut]) -> None:
        for chunk in runs:
            if chunk.request_id not in self._failed:
                outcome, reason = await self._send(lane, chunk)
                if outcome is not PushOutcome.ACKED and chunk.request_id not in self._failed:
                    self._failed[chunk.request_id] = outcome
                    _log.warning(
                        "%s: pushes of %s to %s ended: %s", self.instance_id, chunk.request_id, lane.origin, reason
                    )
                    self._on_failure(chunk.request_id, outcome, reason)
            async with self._changed:
                book = self._books.get(chunk.request_id)
                if book is not None:
                    book[1] += chunk.merged
                    if book[1] >= book[0]:
                        del self._books[chunk.request_id]
                self._changed.notify_all()

    async def _send(self, lane: _Lane, chunk: TokenChunkOut) -> tuple[PushOutcome, str]:
        msg = pb.TokenChunk(
            request_id=chunk.request_id,
            first_seq=chunk.first_seq,
            token_ids=chunk.token_ids,
            finished=chunk.finished,
            finish_reason=chunk.finish_reason,
            error=chunk.error,
            epoch=chunk.epoch,
            sender_instance_id=self.instance_id,
            sender_address=self.address,
            logprobs=[logprobs_to_pb(e) for e in chunk.logprobs],
            resumable=chunk.resumable,
        )
        error = ""
        for attempt in range(self._retries + 1):
            try:
                ack = await lane.stub.PushTokens(msg, timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
                if attempt < self._retries:
                    await asyncio.sleep(self._backoff_s * 2**attempt * (0.5 + self._rng.random()))
                continue
            if ack.superseded:
                return PushOutcome.SUPERSEDED, f"origin {lane.origin}: a newer owner holds {chunk.request_id}"
            if ack.unknown:
                return PushOutcome.UNKNOWN, f"origin {lane.origin} does not expect {chunk.request_id} (client gone)"
            return PushOutcome.ACKED, ""
        tries = self._retries + 1
        return PushOutcome.UNREACHABLE, f"origin {lane.origin} unreachable after {tries} tries: {error}"
