"""Addresses on the command line: the ``--etcd HOST:PORT,...`` lists, ``--listen``, ``--advertise`` and the other
``HOST:PORT`` options, each by one rule (``clusterstate.endpoints``) in every process that takes them."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from etcd_server import EtcdServer

from clusterstate.endpoints import (
    address_option,
    endpoints_option,
    is_host_port,
    listen_option,
    optional_listen_option,
    parse_endpoints,
    split_address,
)
from clusterstate.etcd import connect, kv_of

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("127.0.0.1:2379", ["127.0.0.1:2379"]), (" a:1 , b:2 ", ["a:1", "b:2"]), ("[::1]:2379", ["[::1]:2379"])],
)
def test_parse_endpoints_splits_and_strips(text: str, parsed: list[str]) -> None:
    assert parse_endpoints(text) == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--etcd: expected HOST:PORT, got ''"),
        (" , ", "--etcd: expected HOST:PORT, got ' , '"),
        ("a:1,,b:2", "--etcd: entry 2 of 'a:1,,b:2' is empty: drop the extra comma"),  # was dropped silently
        ("a:1,", "--etcd: entry 2 of 'a:1,' is empty: drop the extra comma"),
        ("a", "--etcd: 'a' is not HOST:PORT (port 1-65535)"),
        ("a:0", "--etcd: 'a:0' is not HOST:PORT (port 1-65535)"),
        ("a:65536", "--etcd: 'a:65536' is not HOST:PORT (port 1-65535)"),
        (":2379", "--etcd: ':2379' is not HOST:PORT (port 1-65535)"),
    ],
)
def test_parse_endpoints_refuses_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_endpoints(text)
    assert str(exc.value) == message


def test_endpoints_option_keeps_the_text_and_leaves_the_flag_to_argparse() -> None:
    assert endpoints_option("a:1,b:2") == "a:1,b:2"
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        endpoints_option("a:1,,b:2")
    assert str(exc.value) == "entry 2 of 'a:1,,b:2' is empty: drop the extra comma"


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("global_coord", ["--listen", "127.0.0.1:0"]),
        ("gateway", ["--listen", "127.0.0.1:0"]),
        ("rack_sched", ["--listen", "127.0.0.1:0", "--domain", "node-0"]),
        ("llumlet", ["--instance-id", "node-0-i0"]),
    ],
)
def test_every_process_refuses_an_empty_etcd_entry_before_it_starts(module: str, args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--etcd", "127.0.0.1:2379,,127.0.0.1:2380", "--topology", "2x8-a100", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"python -m {module}: error: argument --etcd: entry 2 of '127.0.0.1:2379,,127.0.0.1:2380' is empty: "
        "drop the extra comma"
    )


@pytest.mark.parametrize(
    ("address", "listen", "parsed"),
    [
        ("127.0.0.1:7100", False, ("127.0.0.1", 7100)),
        ("[::1]:65535", False, ("[::1]", 65535)),
        ("node-3.example:1", False, ("node-3.example", 1)),
        ("127.0.0.1:0", True, ("127.0.0.1", 0)),  # listen: port 0 picks a free one
        ("0.0.0.0:65535", True, ("0.0.0.0", 65535)),
    ],
)
def test_split_address(address: str, listen: bool, parsed: tuple[str, int]) -> None:
    assert split_address(address, listen=listen) == parsed


@pytest.mark.parametrize(
    ("address", "listen", "message"),
    [
        ("127.0.0.1:99999", True, "--x: '127.0.0.1:99999' is not HOST:PORT (port 0-65535)"),  # served at 34463 before
        ("127.0.0.1:65536", True, "--x: '127.0.0.1:65536' is not HOST:PORT (port 0-65535)"),
        ("127.0.0.1:0", False, "--x: '127.0.0.1:0' is not HOST:PORT (port 1-65535)"),  # others cannot reach port 0
        (":7100", True, "--x: ':7100': the host is missing (0.0.0.0:7100 for every interface)"),  # gRPC cannot bind ""
        (":7100", False, "--x: ':7100': the host is missing"),
        ("::1:0", True, "--x: '::1:0': an IPv6 address goes in brackets ([::1]:0)"),  # gRPC bound [::0.1.0.0]:443
        ("[::1:0", True, "--x: '[::1:0': an IPv6 address goes in brackets ([::1]:0)"),
        # a URL was read as an IPv6 address without brackets
        ("http://10.0.0.5:8000/", False, "--x: 'http://10.0.0.5:8000/' is a URL: give HOST:PORT (10.0.0.5:8000)"),
        ("no such host:0", True, "--x: 'no such host:0' is not HOST:PORT (port 0-65535)"),
        ("127.0.0.1", True, "--x: '127.0.0.1' is not HOST:PORT (port 0-65535)"),
        ("h:-1", True, "--x: 'h:-1' is not HOST:PORT (port 0-65535)"),
        ("h:\N{SUPERSCRIPT TWO}", False, "--x: 'h:\N{SUPERSCRIPT TWO}' is not HOST:PORT (port 1-65535)"),  # isdigit()
        ("", False, "--x: '' is not HOST:PORT (port 1-65535)"),
        ("a:1,b:2", False, "--x: 'a:1,b:2' is not one HOST:PORT: this option takes a single address"),
        ("a:1,,", False, "--x: 'a:1,,' is not one HOST:PORT: this option takes a single address"),
    ],
)
def test_split_address_refuses_naming_the_option(address: str, listen: bool, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        split_address(address, "--x", listen=listen)
    assert str(exc.value) == message


def test_is_host_port_is_split_address_without_the_message() -> None:
    assert is_host_port("a:1") and is_host_port("a:65535")
    assert not is_host_port("a:0") and not is_host_port("a:65536") and not is_host_port("a:\N{SUPERSCRIPT TWO}")


def test_address_options_keep_the_text_and_leave_the_flag_to_argparse() -> None:
    assert listen_option("127.0.0.1:0") == "127.0.0.1:0"
    assert optional_listen_option("") == ""  # a default of "": not given
    assert optional_listen_option("0.0.0.0:7300") == "0.0.0.0:7300"
    assert address_option("") == ""  # --advertise "" (an empty environment variable): the listen address
    assert address_option("10.0.1.5:7100") == "10.0.1.5:7100"
    for option, text, message in [
        (listen_option, "", "'' is not HOST:PORT (port 0-65535)"),
        (listen_option, "127.0.0.1:99999", "'127.0.0.1:99999' is not HOST:PORT (port 0-65535)"),
        (optional_listen_option, "h:70000", "'h:70000' is not HOST:PORT (port 0-65535)"),
        (address_option, "10.0.1.5:0", "'10.0.1.5:0' is not HOST:PORT (port 1-65535)"),
        (address_option, "a:1,,", "'a:1,,' is not one HOST:PORT: this option takes a single address"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            option(text)
        assert str(exc.value) == message


def _run(module: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


_DAEMONS = {
    "global_coord": ["--etcd", "127.0.0.1:2379", "--listen", "127.0.0.1:0"],
    "gateway": ["--etcd", "127.0.0.1:2379", "--topology", "2x8-a100", "--listen", "127.0.0.1:0"],
    "rack_sched": [
        "--etcd",
        "127.0.0.1:2379",
        "--topology",
        "2x8-a100",
        "--listen",
        "127.0.0.1:0",
        "--domain-id",
        "node-0",
    ],
    "llumlet": ["--etcd", "127.0.0.1:2379", "--topology", "2x8-a100", "--instance-id", "node-0-i0"],
}


@pytest.mark.parametrize(
    ("module", "option", "value", "message"),
    [
        *[(m, "--listen", "127.0.0.1:99999", "'127.0.0.1:99999' is not HOST:PORT (port 0-65535)") for m in _DAEMONS],
        *[
            (m, "--advertise", "10.0.1.5:0", "'10.0.1.5:0' is not HOST:PORT (port 1-65535)")
            for m in ("global_coord", "rack_sched", "llumlet")
        ],
        ("gateway", "--also-listen", "127.0.0.1:65536", "'127.0.0.1:65536' is not HOST:PORT (port 0-65535)"),
        ("gateway", "--sink-listen", "127.0.0.1:70000", "'127.0.0.1:70000' is not HOST:PORT (port 0-65535)"),
        ("gateway", "--sink-advertise", "10.0.0.30:99999", "'10.0.0.30:99999' is not HOST:PORT (port 1-65535)"),
        ("rack_sched", "--coordinator", "a:1,,", "'a:1,,' is not one HOST:PORT: this option takes a single address"),
        ("rack_sched", "--coordinator", "bad", "'bad' is not HOST:PORT (port 1-65535)"),
    ],
)
def test_every_process_refuses_a_bad_address_before_it_starts(
    module: str, option: str, value: str, message: str
) -> None:
    done = _run(module, [*_DAEMONS[module], option, value])  # the last --listen wins
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == f"python -m {module}: error: argument {option}: {message}"


def test_connect_resolves_a_host_name_to_the_ipv4_address_etcd3aio_dials(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd3aio dials an ``ipv4:`` target list: a name (``etcd-0.internal:2379``) failed on every retry with "the
    target uri is not valid". ``connect`` resolves it; here a name the resolver answers for the test's etcd."""
    real = socket.getaddrinfo
    host, port = etcd.endpoint.rsplit(":", 1)

    def resolve(name: str, *args: Any, **kwargs: Any) -> Any:
        return real(host if name == "etcd-0.hilum.test" else name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)

    async def main() -> bytes:
        client = connect([f"etcd-0.hilum.test:{port}"])
        await client.connect()
        try:
            await kv_of(client).put("/endpoints-test/k", "v")
            reply = await kv_of(client).get("/endpoints-test/k", timeout=5)
            return bytes(reply.kvs[0].value)
        finally:
            await client.close()

    assert asyncio.run(main()) == b"v"


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("[::1]:2379", "an IPv6 address, which the etcd client (etcd3aio) cannot dial"),
        ("no-such-host.invalid:2379", "cannot resolve 'no-such-host.invalid' to an IPv4 address"),
    ],
)
def test_connect_refuses_what_etcd3aio_cannot_dial_naming_it(endpoint: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        connect([endpoint])
    assert str(exc.value).startswith(f"etcd endpoint {endpoint!r}: {message}")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_the_gateway_listens_on_a_bracketed_ipv6_address(etcd: EtcdServer) -> None:
    """``--listen [::1]:0`` passed the check, then the gateway looked up the host "[::1]" brackets and all."""
    cmd = [sys.executable, "-m", "gateway", "--etcd", etcd.endpoint, "--topology", "1x8-a100", "--listen", "[::1]:0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once it listens
        assert line.startswith("gateway serving at http://[::1]:"), (line, proc.stderr.read() if proc.stderr else "")
    finally:
        proc.terminate()  # at once: its exit status then depends on whether its signal handlers are in place yet
        proc.communicate(timeout=30)
