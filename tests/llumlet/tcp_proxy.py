"""A loopback TCP proxy for fault tests: forwards to one upstream, and on command cuts every connection (a
network blip) or freezes them (a peer that stops answering without closing, like a SIGSTOPped process)."""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    """``await start()``; point clients at :attr:`address`; :meth:`cut`, :meth:`freeze`, :meth:`thaw`."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._server: asyncio.Server | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thawed = asyncio.Event()  # clear: nothing is forwarded
        self._thawed.set()
        self._replies = asyncio.Event()  # clear: nothing is forwarded from the upstream back to the clients
        self._replies.set()
        self.address = ""
        self.cuts = 0

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.thaw()
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def cut(self) -> None:
        """Reset every open connection now (new ones are accepted: a blip)."""
        self.cuts += 1
        for a, b in list(self._conns):
            for w in (a, b):
                w.transport.abort()
        self._conns.clear()

    def cut_in(self, delay_s: float) -> None:
        """:meth:`cut` after ``delay_s``."""
        asyncio.get_running_loop().call_later(delay_s, self.cut)

    def freeze(self) -> None:
        """Stop forwarding bytes on every connection, old and new, without closing any."""
        self._thawed.clear()

    def freeze_replies(self) -> None:
        """Stop forwarding what the upstream sends back (requests still get through), without closing."""
        self._replies.clear()

    def thaw(self) -> None:
        """Forward again (what was held is delivered)."""
        self._thawed.set()
        self._replies.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._conns.add(pair)
        for src, dst, gate in ((reader, up_writer, self._thawed), (up_reader, writer, self._replies)):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst, gate))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gate: asyncio.Event) -> None:
        try:
            while data := await src.read(65536):
                await self._thawed.wait()
                await gate.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.transport.abort()
