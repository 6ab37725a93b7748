"""bench/link_proxy.py: the HTTP/2 call reader, and the TCP proxy's faults against real sockets and a real
gRPC server."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import grpc
import hpack
import pytest

from bench.link_proxy import H2Calls, LinkProxy


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def test_h2_calls_reads_the_methods_of_new_streams_in_any_pieces() -> None:
    enc = hpack.Encoder()
    headers = [(":method", "POST"), (":scheme", "http"), ("content-type", "application/grpc")]
    reserve = enc.encode([*headers, (":path", "/hilum.v1.Llumlet/Reserve")])
    commit = enc.encode([*headers, (":path", "/hilum.v1.Llumlet/Commit")])  # the common ones now indexed
    wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0, b"\x00\x03\x00\x00\x00\x64")  # SETTINGS
    wire += _frame(0x1, 0x4, 1, reserve) + _frame(0x0, 0x1, 1, b"\x00\x00\x00\x00\x02ab")  # HEADERS, DATA
    padded = bytes([3]) + bytes(5) + commit[:4] + b"\x00\x00\x00"  # PADDED | PRIORITY, then a CONTINUATION
    wire += _frame(0x1, 0x8 | 0x20, 3, padded) + _frame(0x9, 0x4, 3, commit[4:])
    wire += _frame(0x1, 0x5, 1, enc.encode([("grpc-status", "0")]))  # trailers on stream 1: not a call
    for pieces in ([wire], [wire[i : i + 1] for i in range(len(wire))], _random_pieces(wire, 11)):
        calls = H2Calls()
        assert [m for p in pieces for m in calls.feed(p)] == ["/hilum.v1.Llumlet/Reserve", "/hilum.v1.Llumlet/Commit"]


def _random_pieces(data: bytes, seed: int) -> list[bytes]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(data):
        n = rng.randint(1, 40)
        out.append(data[i : i + n])
        i += n
    return out


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


def test_the_proxy_forwards_delays_holds_resets_and_refuses() -> None:
    async def main() -> None:
        server, port = await _echo_server()
        proxy = LinkProxy(f"127.0.0.1:{port}")
        await proxy.start()
        assert proxy.address.startswith("127.0.0.1:")
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        proxy.delay_s = 0.2
        t0 = time.monotonic()
        writer.write(b"slow")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"slow"
        assert time.monotonic() - t0 >= 0.4  # both ways
        proxy.delay_s = 0.0
        proxy.hold()
        writer.write(b"held")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), 0.3)
        proxy.release()
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
        assert proxy.reset_all() == 1 and proxy.resets == 1
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 5)
        writer.close()
        proxy.refuse = True
        r2, w2 = await asyncio.open_connection("127.0.0.1", proxy.port)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(r2.readexactly(1), 5)
        w2.close()
        assert proxy.connections == 1  # the refused one never reached the echo server
        await proxy.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_a_one_way_hold_lets_the_call_through_and_loses_its_answer() -> None:
    """Real gRPC through the proxy: the server runs the held call; the client never hears back."""

    async def main() -> None:
        ran: list[str] = []

        def handler(name: str) -> Any:
            def unary(request: bytes, context: Any) -> bytes:
                ran.append(name)
                return b"ok:" + request

            return grpc.unary_unary_rpc_method_handler(unary)

        server = grpc.aio.server()
        methods = {m: handler(m) for m in ("Reserve", "Commit")}
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("hilum.v1.Llumlet", methods)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        proxy = LinkProxy(f"127.0.0.1:{port}")
        await proxy.start()
        try:  # stopped whatever happens: a server left to the GC disturbs the tests after this one
            async with grpc.aio.insecure_channel(proxy.address) as channel:
                reserve = channel.unary_unary("/hilum.v1.Llumlet/Reserve")
                commit = channel.unary_unary("/hilum.v1.Llumlet/Commit")
                proxy.when_called("Commit", lambda: proxy.hold(answers_only=True))
                assert await reserve(b"r", timeout=10) == b"ok:r" and not proxy.called.is_set()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await commit(b"c", timeout=1.5)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert proxy.called.is_set() and ran == ["Reserve", "Commit"]  # the destination did commit
                proxy.reset_all()
                proxy.release()
            # A new connection (its own subchannel: gRPC would otherwise reuse the reset one from its global pool
            # and fail the first call while it notices): answers flow again.
            fresh = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(proxy.address, options=fresh) as channel:
                assert await channel.unary_unary("/hilum.v1.Llumlet/Reserve")(b"again", timeout=10) == b"ok:again"
        finally:
            await proxy.close()
            await server.stop(None)

    asyncio.run(main())


def test_only_loopback_is_proxied() -> None:
    for bad in ("10.0.0.5:7000", "example.com:80", "127.0.0.1:http"):
        with pytest.raises(ValueError, match=r"need 127\.0\.0\.1:PORT \(loopback only\)"):
            LinkProxy(bad)


def test_a_one_way_hold_from_the_start_holds_only_the_answers() -> None:
    async def main() -> None:
        seen: list[bytes] = []

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1024):
                seen.append(data)
                writer.write(data)
                await writer.drain()

        server = await asyncio.start_server(sink, "127.0.0.1", 0)
        proxy = LinkProxy(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        proxy.hold(answers_only=True)
        writer.write(b"heard")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(5), 0.3)
        assert b"".join(seen) == b"heard"  # the server got it; its answer waits in the proxy
        proxy.release()
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"heard"
        writer.close()
        await proxy.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
