"""Keepalive on every gRPC channel and server (issue 11): a peer that stops answering without closing its
connection — a SIGSTOPped llumlet process — is noticed within the stated bound (keepalive interval + timeout),
not when TCP gives up minutes later."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from hilum_proto.tls import Keepalive, keepalive
from llumlet.client import LlumletClient
from llumlet.procs import LlumletProcess


def test_keepalive_settings_come_from_the_environment_and_bad_ones_are_named() -> None:
    assert keepalive({}) == Keepalive(5.0, 5.0) and keepalive({}).bound_s == 10.0
    got = keepalive({"HILUM_GRPC_KEEPALIVE_S": "1.5", "HILUM_GRPC_KEEPALIVE_TIMEOUT_S": "0.5"})
    assert got == Keepalive(1.5, 0.5) and ("grpc.keepalive_time_ms", 1500) in got.channel_options()
    assert ("grpc.http2.max_ping_strikes", 0) in got.server_options()  # pinging clients are never sent away
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ValueError, match=f"HILUM_GRPC_KEEPALIVE_S={bad!r}: need a number of seconds > 0"):
            keepalive({"HILUM_GRPC_KEEPALIVE_S": bad})


def test_a_sigstopped_peer_is_noticed_within_the_keepalive_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HILUM_GRPC_KEEPALIVE_S", "1")
    monkeypatch.setenv("HILUM_GRPC_KEEPALIVE_TIMEOUT_S", "1")
    bound_s = keepalive().bound_s
    proc = LlumletProcess("k0", [], tmp_path / "k0.log").start()  # inherits the settings
    assert proc.proc is not None

    async def main() -> float:
        async with LlumletClient(proc.address) as client:
            stream = client.watch_load(min_interval_s=0.05)
            first = await anext(stream)
            assert first.instance_id == "k0"
            os.kill(proc.proc.pid, signal.SIGSTOP)  # alive, connections open, answering nothing
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with asyncio.timeout(bound_s + 10):  # without keepalive: TCP's minutes
                    await anext(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            return time.monotonic() - t0

    try:
        noticed_s = asyncio.run(main())
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
        proc.stop()
    assert noticed_s < bound_s + 2.0, f"noticed after {noticed_s:.1f} s, bound {bound_s} s"
