"""A TCP proxy on loopback that injects network faults between two gRPC peers, and a reader of the calls
a gRPC client makes (HTTP/2 with HPACK), so a fault can hit one call exactly.

Used by the chaos soak (``bench/chaos_soak.py``: every llumlet behind one, the soak's forced migrations go
through it) and by the llumlet's fault tests. Only 127.0.0.1 is proxied.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

import hpack

__all__ = ["H2Calls", "LinkProxy"]


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP RST (SO_LINGER 0), as a crashed peer or a middlebox does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class LinkProxy:
    """A TCP proxy on 127.0.0.1 in front of one gRPC server (a llumlet), asyncio, loopback only.

    ``upstream``: ``127.0.0.1:PORT`` of the server behind it (ValueError otherwise). A migration reaches the
    destination through it when the source is given :attr:`address` as the destination's. Faults:

    - :meth:`reset_all`: RST on every open connection (new ones are accepted: a blip);
    - :attr:`refuse`: new connections are reset at once;
    - :attr:`delay_s`: each chunk waits this long before it is forwarded, in order, both ways;
    - :meth:`hold` / :meth:`release`: nothing is forwarded meanwhile, or (``answers_only``) nothing the
      server answers: a silent partition, both ways or one way; no connection closes;
    - :meth:`when_called`: an action (one of the above) the moment the client's next call of a method has
      been forwarded, so that, say, the server receives a Commit and acts on it but its answer never
      arrives (``hold(answers_only=True)``). Calls are read from the client's HTTP/2 stream (:class:`H2Calls`).
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        if host not in ("127.0.0.1", "localhost") or not port.isdigit():
            raise ValueError(f"LinkProxy: upstream {upstream!r}: need 127.0.0.1:PORT (loopback only)")
        self.upstream = upstream
        self.target_port = int(port)
        self.refuse = False
        self.delay_s = 0.0
        self.connections = 0  # accepted so far
        self.resets = 0  # connections reset by a fault
        self._to_dst = asyncio.Event()  # set: what the client (the source) sends is forwarded
        self._to_src = asyncio.Event()  # set: what the llumlet (the destination) answers is forwarded
        self._to_dst.set()
        self._to_src.set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._armed: tuple[str, Callable[[], object]] | None = None  # (method, action): see when_called
        self.called = asyncio.Event()  # the armed call came
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>`` (after :meth:`start`)."""
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and reset every connection."""
        self.release()
        if self._server is not None:
            self._server.close()
        self.reset_all(count=False)
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=5.0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    def reset_all(self, *, count: bool = True) -> int:
        """RST every connection through the proxy, both sides; how many."""
        n = len(self._conns)
        for client, upstream in list(self._conns):
            _reset(client)
            _reset(upstream)
        self._conns.clear()
        if count:
            self.resets += n
        return n

    def hold(self, *, answers_only: bool = False) -> None:
        """Forward nothing (``answers_only``: nothing the server answers) until :meth:`release`; bytes wait,
        TCP windows fill, no connection closes."""
        self._to_src.clear()
        if not answers_only:
            self._to_dst.clear()

    def release(self) -> None:
        """Forward again (and disarm :meth:`when_called`)."""
        self._armed = None
        self._to_dst.set()
        self._to_src.set()

    def when_called(self, method: str, action: Callable[[], object]) -> None:
        """Run ``action`` once, synchronously, right after the client's next call of ``method`` (``Commit``; on
        any connection) has been forwarded, before anything else is; :attr:`called` is set then.
        :meth:`release` disarms it."""
        self.called.clear()
        self._armed = (method, action)

    def _calls(self, paths: list[str]) -> None:
        if self._armed is not None and any(p.rsplit("/", 1)[-1] == self._armed[0] for p in paths):
            action = self._armed[1]
            self._armed = None
            action()
            self.called.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            pass  # the loop is closing; asyncio's stream callback (3.11) would log a cancelled handler
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _reset(writer)  # the llumlet is down: so is the link
            return
        self.connections += 1
        conn = (writer, up_writer)
        self._conns.add(conn)
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer, self._to_dst, H2Calls())),
            asyncio.create_task(self._pipe(up_reader, writer, self._to_src, None)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            if conn in self._conns:  # closed by a peer, not reset by a fault: close the other side too
                self._conns.discard(conn)
                for w in conn:
                    w.close()

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, flowing: asyncio.Event, calls: H2Calls | None
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                await flowing.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                dst.write(data)
                await dst.drain()
                if calls is not None:
                    self._calls(calls.feed(data))


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_HEADERS, _H2_CONTINUATION = 0x1, 0x9
_H2_END_HEADERS, _H2_PADDED, _H2_PRIORITY = 0x4, 0x8, 0x20


class H2Calls:
    """The gRPC methods a client calls on one HTTP/2 connection, fed the bytes it sends, in any pieces.

    The bytes are the client connection preface (RFC 9113 §3.4), then frames: a 9-byte header (24-bit payload
    length, type, flags, 31-bit stream id; §4.1) and the payload. A call is a new stream opened by a HEADERS
    frame (§6.2; continued by CONTINUATION frames, §6.10, until END_HEADERS); its method is the ``:path`` of
    that header block, decoded with HPACK (RFC 7541, the ``hpack`` package). Every block is decoded, in order,
    so that the decoder's dynamic table stays in step with the client's encoder.
    """

    def __init__(self) -> None:
        self._preface_left = len(_H2_PREFACE)
        self._buf = bytearray()
        self._block = bytearray()  # a header block whose CONTINUATION frames are still coming
        self._block_stream = 0
        self._last_stream = 0
        self._decoder = hpack.Decoder()

    def feed(self, data: bytes) -> list[str]:
        """Take the next bytes the client sent; the methods (``/pkg.Service/Method``) of the calls they opened."""
        skip = min(self._preface_left, len(data))
        self._preface_left -= skip
        self._buf += data[skip:]
        opened: list[str] = []
        while len(self._buf) >= 9:
            length = int.from_bytes(self._buf[0:3], "big")
            if len(self._buf) < 9 + length:
                break
            kind, flags = self._buf[3], self._buf[4]
            stream = int.from_bytes(self._buf[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self._buf[9 : 9 + length])
            del self._buf[: 9 + length]
            if kind == _H2_HEADERS:
                start, end = 0, len(payload)
                if flags & _H2_PADDED:
                    start, end = 1, len(payload) - payload[0]
                if flags & _H2_PRIORITY:
                    start += 5
                self._block, self._block_stream = bytearray(payload[start:end]), stream
            elif kind == _H2_CONTINUATION:
                self._block += payload
            else:
                continue
            if flags & _H2_END_HEADERS:
                headers = dict(self._decoder.decode(bytes(self._block), raw=True))
                if self._block_stream > self._last_stream:  # a new stream: a call (not trailers)
                    self._last_stream = self._block_stream
                    opened.append(headers.get(b":path", b"").decode(errors="replace"))
                self._block = bytearray()
        return opened
