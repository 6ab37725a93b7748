"""TokenCollector: a TokenSink server that assembles each request's stream exactly once, in order.

Used by the tests and the benchmark now, by the gateway later. Each pushed token carries its seq; the
collector keeps the first copy of each seq, buffers out-of-order ones and releases the contiguous prefix.
A stream is done when a ``finished`` push arrived and every seq before its end is held.

Ownership: a push names its sender and its owner epoch (token_sink.proto). The collector keeps the sender of
the highest epoch as the request's owner and answers older epochs with ``superseded``; the first sender of an
epoch holds it, so a later push of the same epoch from another sender is ``superseded`` too (the arbitration
of a migration whose source could not learn whether its commit happened: its claim and the destination's
announcement name the same epoch). ``watch(address)`` follows a llumlet's liveness through its WatchLoad
stream: when the stream breaks, every unfinished request that llumlet owns fails with a clear error
("instance ... stopped"), marked ``resumable`` (the request did nothing wrong: its instance is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc

from hilum_proto.tls import bind_server, open_channel
from hilum_proto.v1 import llumlet_pb2, llumlet_pb2_grpc
from hilum_proto.v1 import token_sink_pb2 as pb
from hilum_proto.v1 import token_sink_pb2_grpc as pb_grpc
from llumlet.convert import logprobs_from_pb
from llumlet.engine.types import TokenLogprobs

__all__ = ["CollectedStream", "TokenCollector"]

_log = logging.getLogger(__name__)
_Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


@dataclass(frozen=True, slots=True)
class CollectedStream:
    """One request's stream as the collector holds it."""

    request_id: str
    token_ids: tuple[int, ...]  # contiguous from seq 0
    done: bool  # finished (all tokens held) or failed
    finish_reason: str  # "length" | "stop" | "abort" | "error" | "" while running
    error: str  # why it failed, "" if it did not
    owner_address: str  # llumlet that runs it (highest epoch seen)
    epoch: int  # owner epoch (number of committed migrations seen)
    duplicates: int  # tokens received again (same seq), dropped
    conflicts: int  # of those, with a different id than the first copy (must stay 0)
    pushes: int  # pushes received
    logprobs: tuple[TokenLogprobs, ...] = ()  # aligned with token_ids when the request asked for logprobs, else ()
    resumable: bool = False  # it failed with its instance (dead, or its engine failed), not by its own fault


class _Stream:
    def __init__(self, request_id: str, owner_address: str) -> None:
        self.request_id = request_id
        self.ordered: list[int] = []
        self.pending: dict[int, int] = {}
        self.logprobs: list[TokenLogprobs] = []  # aligned with ordered (requests that ask for logprobs)
        self.pending_logprobs: dict[int, TokenLogprobs] = {}
        self.final_len: int | None = None
        self.finish_reason = ""
        self.error = ""
        self.resumable = False
        self.owner_address = owner_address
        self.epoch = 0
        self.duplicates = 0
        self.conflicts = 0
        self.pushes = 0
        self.done = asyncio.Event()

    def snapshot(self) -> CollectedStream:
        return CollectedStream(
            self.request_id,
            tuple(self.ordered),
            self.done.is_set(),
            self.finish_reason,
            self.error,
            self.owner_address,
            self.epoch,
            self.duplicates,
            self.conflicts,
            self.pushes,
            tuple(self.logprobs),
            self.resumable,
        )

    def add(self, first_seq: int, token_ids: list[int], logprobs: list[TokenLogprobs]) -> None:
        """Hold tokens ``first_seq ...`` (and their logprobs, when given: one per token)."""
        for i, token in enumerate(token_ids):
            seq = first_seq + i
            if self.final_len is not None and seq >= self.final_len:
                break
            held = self.ordered[seq] if seq < len(self.ordered) else self.pending.get(seq)
            if held is not None:
                self.duplicates += 1
                self.conflicts += held != token
            else:
                self.pending[seq] = token
                if i < len(logprobs):
                    self.pending_logprobs[seq] = logprobs[i]
        while len(self.ordered) in self.pending:
            seq = len(self.ordered)
            self.ordered.append(self.pending.pop(seq))
            entry = self.pending_logprobs.pop(seq, None)
            if entry is not None and len(self.logprobs) == seq:
                self.logprobs.append(entry)

    def fail(self, error: str, resumable: bool = False) -> None:
        if not self.done.is_set():
            self.error, self.finish_reason, self.resumable = error, "error", resumable
            self.done.set()


class _Servicer(pb_grpc.TokenSinkServicer):
    def __init__(self, collector: TokenCollector) -> None:
        self._c = collector

    async def PushTokens(self, request: pb.TokenChunk, context: _Ctx) -> pb.TokenAck:
        return self._c._push(request)


class TokenCollector:
    """A TokenSink gRPC server on ``listen`` (``host:port``, port 0 picks one) that collects streams. ``what``: the
    option that gave ``listen``, for the error when it cannot be bound.

    Call :meth:`expect` before submitting a request (pushes for unknown requests are answered ``unknown``, and
    the llumlet stops the request). Not thread-safe; runs on one asyncio loop.
    """

    def __init__(self, listen: str = "127.0.0.1:0", what: str = "token sink") -> None:
        self._listen = listen
        self._what = what
        self._server: grpc.aio.Server | None = None
        self._port = 0
        self._streams: dict[str, _Stream] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._instance_at: dict[str, str] = {}  # address -> the instance its llumlet serves, once known

    @property
    def address(self) -> str:
        """``host:port`` the collector serves on (after :meth:`start`)."""
        host = self._listen.rsplit(":", 1)[0]
        return f"{host}:{self._port}"

    async def start(self) -> None:
        """Bind and serve. Raises hilum_proto.tls.ListenError when the address cannot be bound."""
        server, self._port = bind_server(self._listen, what=self._what)
        pb_grpc.add_TokenSinkServicer_to_server(_Servicer(self), server)
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop watches and the server."""
        for task in self._watches.values():
            task.cancel()
        for task in self._watches.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._watches.clear()
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    # ---- requests ---------------------------------------------------------------------------
    def expect(self, request_id: str, owner_address: str = "") -> None:
        """Start collecting ``request_id``, submitted to the llumlet at ``owner_address``.

        Raises ValueError when the id is already collected.
        """
        if request_id in self._streams:
            raise ValueError(f"TokenCollector: request {request_id!r} is already expected")
        self._streams[request_id] = _Stream(request_id, owner_address)

    def resume(self, request_id: str, new_request_id: str) -> int:
        """Collect ``new_request_id`` as the continuation of ``request_id`` (a replay of it elsewhere): its stream
        starts with the contiguous tokens (and logprobs) held for ``request_id``, which is forgotten (its later
        pushes are answered ``unknown``). Returns how many tokens it starts with.

        Raises KeyError for a request not expected, ValueError when ``new_request_id`` already is.
        """
        if new_request_id in self._streams:
            raise ValueError(f"TokenCollector: request {new_request_id!r} is already expected")
        old = self._streams.pop(request_id, None)
        if old is None:
            raise KeyError(f"TokenCollector: request {request_id!r} is not expected")
        new = self._streams[new_request_id] = _Stream(new_request_id, "")
        new.ordered = list(old.ordered)
        new.logprobs = list(old.logprobs[: len(old.ordered)])
        return len(new.ordered)

    def placed(self, request_id: str, owner_address: str) -> None:
        """The request was submitted to the llumlet at ``owner_address``: it owns the request until a push says
        otherwise (so its failure fails the request even before its first token). No-op for an unknown id or
        once an owner is known."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.owner_address:
            stream.owner_address = owner_address

    def forget(self, request_id: str) -> None:
        """Stop collecting (the client went away): further pushes are answered ``unknown``."""
        self._streams.pop(request_id, None)

    def fail(self, request_id: str, error: str, *, resumable: bool = False) -> None:
        """Mark a request failed with ``error`` (no-op when done or unknown); ``resumable``: by its instance."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error, resumable)

    def get(self, request_id: str) -> CollectedStream:
        """The stream as held now. Raises KeyError for a request not expected."""
        try:
            return self._streams[request_id].snapshot()
        except KeyError:
            raise KeyError(f"TokenCollector: request {request_id!r} is not expected") from None

    async def wait(self, request_id: str, timeout_s: float) -> CollectedStream:
        """Wait until the request's stream is done (finished or failed).

        Raises KeyError for a request not expected, TimeoutError (with what was held) after ``timeout_s``.
        """
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"TokenCollector: request {request_id!r} is not expected")
        try:
            await asyncio.wait_for(stream.done.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"request {request_id!r} not done after {timeout_s} s: {stream.snapshot()}") from None
        return stream.snapshot()

    # ---- liveness of llumlets -------------------------------------------------------------------
    def watch(self, address: str, instance_id: str = "") -> None:
        """Follow the llumlet at ``address``; when it stops, fail the unfinished requests it owns, naming it by
        ``instance_id`` (the instance it serves, when the caller knows it), else by its load reports' id, else
        by its address alone (it stopped before its first report)."""
        if instance_id:
            self._instance_at[address] = instance_id
        if address not in self._watches:
            self._watches[address] = asyncio.get_running_loop().create_task(self._watch(address))

    async def _watch(self, address: str) -> None:
        reason = "stream ended"
        async with open_channel(address) as channel:
            stub = llumlet_pb2_grpc.LlumletStub(channel)
            try:
                call = stub.WatchLoad(llumlet_pb2.WatchLoadRequest(min_interval_s=1.0), wait_for_ready=True)
                async for report in call:
                    self._instance_at[address] = report.instance_id
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
        instance_id = self._instance_at.pop(address, "")
        who = f"instance {instance_id} at {address}" if instance_id else f"the llumlet at {address}"
        for stream in self._streams.values():
            if stream.owner_address == address and not stream.done.is_set():
                stream.fail(f"{who} stopped ({reason}): the request is lost", resumable=True)  # its id: the caller's
        self._watches.pop(address, None)

    # ---- the service --------------------------------------------------------------------------
    def _push(self, msg: pb.TokenChunk) -> pb.TokenAck:
        stream = self._streams.get(msg.request_id)
        if stream is None:
            return pb.TokenAck(request_id=msg.request_id, unknown=True)
        stream.pushes += 1
        taken = msg.epoch == stream.epoch and stream.owner_address and msg.sender_address != stream.owner_address
        if msg.epoch < stream.epoch or (taken and msg.epoch > 0):
            return pb.TokenAck(request_id=msg.request_id, next_seq=len(stream.ordered), superseded=True)
        if msg.epoch > stream.epoch or not stream.owner_address:
            stream.epoch = msg.epoch
            stream.owner_address = msg.sender_address
        if stream.done.is_set() and stream.error:
            return pb.TokenAck(request_id=msg.request_id, next_seq=len(stream.ordered), unknown=True)
        try:
            logprobs = [logprobs_from_pb(e) for e in msg.logprobs]
        except ValueError as exc:
            stream.fail(f"request {msg.request_id}: malformed logprobs from {msg.sender_instance_id}: {exc}")
            return pb.TokenAck(request_id=msg.request_id, next_seq=len(stream.ordered), unknown=True)
        stream.add(msg.first_seq, list(msg.token_ids), logprobs)
        if msg.finished and stream.final_len is None:
            stream.final_len = msg.first_seq + len(msg.token_ids)
            stream.finish_reason, stream.error = msg.finish_reason, msg.error
            stream.resumable = msg.resumable and bool(msg.error)
            del stream.ordered[stream.final_len :]
            del stream.logprobs[stream.final_len :]
        if stream.final_len is not None and len(stream.ordered) >= stream.final_len:
            stream.done.set()
        return pb.TokenAck(request_id=msg.request_id, next_seq=len(stream.ordered))
