"""The address a server registers: ``--advertise``, else its listen address; never a wildcard like 0.0.0.0."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hilum_proto.tls import ListenError, advertised_address, bind_server, listen_failure

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("listen", "port", "advertise", "want"),
    [
        ("127.0.0.1:0", 7100, "", "127.0.0.1:7100"),  # the port actually bound
        ("node-3.example:7100", 7100, "", "node-3.example:7100"),
        ("0.0.0.0:7100", 7100, "node-3.example:7100", "node-3.example:7100"),
        ("[::]:7100", 7100, "node-3.example:7100", "node-3.example:7100"),
    ],
)
def test_advertised_address(listen: str, port: int, advertise: str, want: str) -> None:
    assert advertised_address(listen, port, advertise) == want


@pytest.mark.parametrize("listen", ["0.0.0.0:7100", "[::]:7100", ":7100"])
def test_a_wildcard_listen_host_needs_advertise(listen: str) -> None:
    with pytest.raises(
        ValueError, match=rf"--listen {re.escape(listen)} binds every interface.*pass --advertise HOST:PORT"
    ):
        advertised_address(listen, 7100)


DAEMONS = {  # each daemon's arguments but --listen (etcd at port 1 answers nothing; each binds before it asks)
    "rack_sched": ["--domain-id", "node-0", "--topology", "1x8-a100", "--etcd", "127.0.0.1:1"],
    "llumlet": ["--instance-id", "node-0-i0", "--engine", "sim", "--topology", "1x8-a100"],
    "global_coord": ["--etcd", "127.0.0.1:1", "--id", "c0"],
}


def _run_daemon(module: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", DAEMONS)
def test_a_process_listening_on_every_interface_refuses_to_register_it(module: str) -> None:
    done = _run_daemon(module, ["--listen", "0.0.0.0:0", *DAEMONS[module]])
    assert done.returncode == 2, done.stderr  # a usage error, found before anything starts: not restarted
    assert done.stderr.splitlines()[-1] == (
        f"python -m {module}: error: --listen 0.0.0.0:0 binds every interface, which is no address others can reach: "
        "pass --advertise HOST:PORT, the address the other processes reach this one at"
    )


@pytest.fixture
def taken() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a port a listening socket of this test holds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("module", DAEMONS)
def test_a_process_whose_port_is_taken_exits_1_with_the_systems_reason(module: str, taken: str) -> None:
    done = _run_daemon(module, ["--listen", taken, *DAEMONS[module]])
    # exit 1, the machine's state: its service manager restarts it (deploy/systemd: exit 2 is not restarted)
    assert done.returncode == 1, done.stderr
    want = f"{module}: error: cannot listen on {taken} (--listen): address already in use"
    assert done.stderr.splitlines()[-1] == want


def test_gateway_whose_ports_are_taken_exits_1_naming_which(etcd: Any, taken: str) -> None:
    base = ["--etcd", etcd.endpoint, "--topology", "1x8-a100"]
    http = _run_daemon("gateway", [*base, "--listen", taken])
    sink = _run_daemon("gateway", [*base, "--listen", "127.0.0.1:0", "--sink-listen", taken])
    for done, what in ((http, "--listen"), (sink, "--sink-listen")):
        assert done.returncode == 1, done.stderr
        want = f"gateway: error: cannot listen on {taken} ({what}): address already in use"
        assert done.stderr.splitlines()[-1] == want


def test_a_gateway_whose_port_is_taken_says_so_before_etcd_answers(taken: str) -> None:
    base = ["--etcd", "127.0.0.1:1", "--topology", "1x8-a100"]  # nothing answers there
    for args, what in (
        (["--listen", taken], "--listen"),
        (["--listen", "127.0.0.1:0", "--also-listen", taken], "--also-listen"),
        (["--listen", taken, "--reuse-port"], "--listen"),  # shared with other gateways, not with this plain socket
    ):
        done = _run_daemon("gateway", [*base, *args])
        assert done.returncode == 1, done.stderr
        assert (
            done.stderr.splitlines()[-1] == f"gateway: error: cannot listen on {taken} ({what}): address already in use"
        )


def test_listen_failure_gives_the_systems_reason(taken: str) -> None:
    assert listen_failure(taken) == f"cannot listen on {taken} (--listen): address already in use"
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine
    assert listen_failure("192.0.2.1:7100", "--sink-listen") == (
        "cannot listen on 192.0.2.1:7100 (--sink-listen): cannot assign requested address"
    )

    async def bind() -> None:  # a grpc.aio server is made inside a running event loop
        bind_server(taken)

    with pytest.raises(ListenError, match=rf"^cannot listen on {taken} \(--listen\): address already in use$"):
        asyncio.run(bind())


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "the token sink listens on the --listen host (0.0.0.0) when --sink-listen is not given, which is no "),
        (["--sink-listen", "0.0.0.0:7300"], "--sink-listen 0.0.0.0:7300 binds every interface, which is no address "),
        (["--sink-listen", "[::]:7300", "--sink-advertise", ""], "--sink-listen [::]:7300 binds every interface"),
    ],
)
def test_a_gateway_whose_token_sink_binds_every_interface_needs_sink_advertise(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # llumlets push every token to the address the sink names: 0.0.0.0 reached the gateway from its own host only
    from gateway.cli import main as gateway_main

    with pytest.raises(SystemExit) as exc:  # a usage error, before anything starts
        gateway_main(["--listen", "0.0.0.0:0", "--etcd", "127.0.0.1:1", "--topology", "1x8-a100", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"python -m gateway: error: {words}") and "--sink-advertise HOST:PORT" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # it registered 0.0.0.0:7120, an address nobody reaches
        (
            ["--listen", "127.0.0.1:7120", "--advertise", "0.0.0.0:7120"],
            "--advertise 0.0.0.0:7120: 0.0.0.0 is no address others can reach: give the host they reach it at",
        ),
        # it registered port 7120 and listened on a free one
        (
            ["--listen", "127.0.0.1:0", "--advertise", "node-0:7120"],
            "--advertise node-0:7120 names port 7120, but --listen 127.0.0.1:0 takes a free port when it starts: "
            "give --listen 127.0.0.1:7120",
        ),
    ],
)
def test_an_advertised_address_others_cannot_reach_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from llumlet.cli import main as llumlet_main

    with pytest.raises(SystemExit) as exc:
        llumlet_main(["--instance-id", "node-0-i0", "--topology", "1x8-a100", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m llumlet: error: {message}"


def test_a_gateway_advertising_a_sink_port_it_does_not_listen_on_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main as gateway_main

    # it printed "token sink 127.0.0.1:7300" and listened on a free port: llumlets pushed tokens to a dead one
    with pytest.raises(SystemExit) as exc:
        gateway_main(["--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:1", "--topology", "1x8-a100",
                      "--sink-advertise", "127.0.0.1:7300"])  # fmt: skip
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m gateway: error: --sink-advertise 127.0.0.1:7300 names port 7300, but without --sink-listen the "
        "token sink takes a free port on the --listen host when it starts: give --sink-listen 127.0.0.1:7300 too"
    )
    with pytest.raises(SystemExit) as exc:  # the --sink-listen given is named as given
        gateway_main(["--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:1", "--topology", "1x8-a100",
                      "--sink-listen", "127.0.0.1:0", "--sink-advertise", "127.0.0.1:7300"])  # fmt: skip
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m gateway: error: --sink-advertise 127.0.0.1:7300 names port 7300, but --sink-listen 127.0.0.1:0 "
        "takes a free port when it starts: give --sink-listen 127.0.0.1:7300"
    )


@pytest.mark.parametrize(
    ("listen", "other", "refused"),
    [
        ("127.0.0.1:8000", ["--sink-listen", "127.0.0.1:8000"], True),
        ("127.0.0.1:8000", ["--sink-listen", "localhost:8000"], True),  # the name resolves to the same address
        ("0.0.0.0:8000", ["--sink-listen", "127.0.0.1:8000"], True),  # a wildcard takes the port on every address
        ("127.0.0.1:8000", ["--sink-listen", "[::]:8000"], True),  # the sink's gRPC binds :: dual-stack: IPv4 too
        ("[::]:8000", ["--also-listen", "0.0.0.0:8000"], False),  # asyncio binds :: IPv6-only
        ("[::]:8000", ["--also-listen", "[::1]:8000"], True),
        ("127.0.0.1:8000", ["--also-listen", "0.0.0.0:8000"], True),
        ("0.0.0.0:8000", ["--sink-listen", "[::1]:8000"], False),  # an IPv4 wildcard leaves IPv6 addresses
        ("127.0.0.1:8000", ["--sink-listen", "127.0.0.2:8000"], False),  # two addresses of the host
        ("127.0.0.1:0", ["--sink-listen", "127.0.0.1:0"], False),  # each takes a free port
        ("127.0.0.1:8000", ["--sink-listen", "nosuchhost.invalid:8000"], False),  # its bind says why, by name
    ],
)
def test_two_servers_of_a_gateway_on_one_port_are_refused(
    listen: str, other: list[str], refused: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # the second server to bind found the port taken: "address already in use (--listen)", naming one option
    from gateway.cli import _check_sink, build_parser

    parser = build_parser()
    advertise = ["--sink-advertise", "gw:7300"] if "--sink-listen" in other and not other[1].endswith(":0") else []
    if advertise:
        advertise[1] = f"gw:{other[1].rsplit(':', 1)[1]}"
    if other[0] == "--also-listen":  # the sink on its own (a wildcard --listen alone is refused for the sink)
        advertise = ["--sink-listen", "127.0.0.1:0"]
    ns = parser.parse_args(["--listen", listen, "--etcd", "127.0.0.1:1", "--topology", "1x8-a100", *other, *advertise])
    if not refused:
        _check_sink(parser, ns)
        return
    with pytest.raises(SystemExit) as exc:
        _check_sink(parser, ns)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m gateway: error: --listen {listen} and {other[0]} {other[1]} take one port: each server needs "
        "its own"
    )


def test_a_sink_advertised_at_another_host_is_told_to_listen_on_every_interface(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gateway.cli import main as gateway_main

    with pytest.raises(SystemExit) as exc:  # 127.0.0.1:7300 would be no address llumlets reach at 10.0.0.5
        gateway_main(["--listen", "127.0.0.1:8000", "--etcd", "127.0.0.1:1", "--topology", "1x8-a100",
                      "--sink-advertise", "10.0.0.5:7300"])  # fmt: skip
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("give --sink-listen 0.0.0.0:7300 too")
