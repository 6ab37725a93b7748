"""The address a server registers: ``--advertise``, else its listen address; never a wildcard like 0.0.0.0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hilum_proto.tls import advertised_address

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


@pytest.mark.parametrize(
    ("module", "args", "status"),
    [
        ("rack_sched", ["--domain-id", "node-0", "--topology", "1x8-a100", "--etcd", "127.0.0.1:1"], 2),
        ("llumlet", ["--instance-id", "node-0-i0", "--engine", "sim", "--topology", "1x8-a100"], 2),
        ("global_coord", ["--etcd", "127.0.0.1:1", "--id", "c0"], 1),
    ],
)
def test_a_process_listening_on_every_interface_refuses_to_register_it(
    module: str, args: list[str], status: int
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", module, "--listen", "0.0.0.0:0", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert "--listen 0.0.0.0:0 binds every interface" in done.stderr and "--advertise" in done.stderr
