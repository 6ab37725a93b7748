"""A llumlet started with --etcd registers its instance under its own lease, and leaves with it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_server import EtcdServer, free_port

from clusterstate.etcd import connect, kv_of
from clusterstate.records import InstanceRegistration, decode
from clusterstate.store import Keys
from llumlet.procs import LlumletProcess

REPO = Path(__file__).resolve().parents[2]


async def _read(endpoint: str, key: str) -> bytes | None:
    client = connect([endpoint])
    await client.connect()
    try:
        reply = await kv_of(client).get(key)
        return bytes(reply.kvs[0].value) if reply.kvs else None
    finally:
        await client.close()


def test_llumlet_registers_itself_and_its_key_goes_with_it(etcd: EtcdServer, prefix: str, tmp_path: Path) -> None:
    args = ["--topology", "1x8-a100", "--etcd", etcd.endpoint, "--prefix", prefix, "--ttl", "3", "--num-blocks", "256"]
    proc = LlumletProcess("node-0-i3", args, tmp_path / "llumlet.log").start()
    key = Keys(prefix).instance("node-0-i3")
    try:
        deadline = time.monotonic() + 10.0
        value = None
        while value is None and time.monotonic() < deadline:
            value = asyncio.run(_read(etcd.endpoint, key))
            if value is None:
                time.sleep(0.1)
        assert value is not None, (tmp_path / "llumlet.log").read_text()
        record = decode(InstanceRegistration, value, key)
        features = ("min_tokens", "penalties", "top_k")  # the sim engine's (llumlet.backends.sim)
        assert record == InstanceRegistration(
            "node-0-i3", "node-0", "node-0", proc.address, "llama-2-7b", 256, "sim", features
        )
    finally:
        proc.stop()
    # SIGTERM revokes the lease: the registration disappears at once, not after the TTL.
    assert asyncio.run(_read(etcd.endpoint, key)) is None


def test_a_second_llumlet_cannot_take_a_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llumlet.cli import main as cli_main

    proc = LlumletProcess("node-0-i0", ["--topology", "1x8-a100"], tmp_path / "first.log").start()
    try:
        # gRPC would share the port (SO_REUSEPORT) and split connections between the two: it must fail, with exit
        # 1 (the machine's state, which a restart may outlast; 2 is a bad option, which systemd does not restart)
        assert cli_main(["--instance-id", "node-0-i1", "--topology", "1x8-a100", "--listen", proc.address]) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"llumlet: error: cannot listen on {proc.address} (--listen): address already in use"
        )
    finally:
        proc.stop()


def test_etcd_without_a_topology_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from llumlet.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:  # argparse's usage error: its server was left to a closed event loop
        cli_main(["--instance-id", "node-0-i0", "--etcd", "127.0.0.1:2379"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m llumlet: error: --etcd needs --topology (the registration names the node, model and KV capacity)"
    )


def test_a_llumlet_whose_registration_fails_stops_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to print "serving at" and then serve unregistered, silently, until killed. It says it serves once its
    # instance's key is claimed, which this one never was.
    import llumlet.cli

    async def failing_register(*_: object) -> None:
        raise RuntimeError("registration failed (test)")

    monkeypatch.setattr(llumlet.cli, "_register", failing_register)
    args = ["--instance-id", "node-0-i0", "--topology", "1x8-a100", "--etcd", f"127.0.0.1:{free_port()}"]
    assert llumlet.cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1] == "llumlet: error: registration failed (test)"


def test_a_second_llumlet_of_a_live_instance_is_refused_and_the_first_stays_registered(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    # It used to overwrite the key; stopping, it left the first llumlet running but registered nowhere.
    args = ["--topology", "1x8-a100", "--etcd", etcd.endpoint, "--prefix", prefix, "--ttl", "2"]
    first = LlumletProcess("node-0-i5", args, tmp_path / "first.log").start()
    key = Keys(prefix).instance("node-0-i5")
    try:
        deadline = time.monotonic() + 10.0
        while asyncio.run(_read(etcd.endpoint, key)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "llumlet", "--instance-id", "node-0-i5", "--engine", "sim", *args]
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stderr  # the cluster's state: systemd restarts it (exit 2 it does not)
        assert second.stderr.splitlines()[-1] == (
            f"llumlet: error: instance node-0-i5 already has a live process at {first.address}; stop it first "
            "(a crashed one's registration expires with its lease TTL)"
        )
        assert "waiting up to 4 s for it to expire" in second.stderr  # 1.5 x TTL + 1 s, said while it waits
        assert second.stdout == ""  # never "serving at": a spawner waiting for it must not take this one as up
        value = asyncio.run(_read(etcd.endpoint, key))
        assert value is not None and decode(InstanceRegistration, value, key).address == first.address
    finally:
        first.stop()
