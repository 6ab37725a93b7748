"""``python -m rack_sched`` started before etcd answers: it waits for etcd, saying so, like every other hilum
process (systemd starts the units in any order; deploy/README.md), and never dies with a traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from etcd_server import EtcdServer, free_port

REPO = Path(__file__).resolve().parents[2]
WARNING = re.compile(
    r"node-0 rack_sched WARNING domain node-0: etcd at (?P<etcd>\S+) does not answer \((?P<why>.+)\), attempt 1; "
    r"retrying in \d+\.\d s: check that etcd runs and that --etcd names its client address"
)


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def test_a_scheduler_started_before_etcd_waits_for_it_then_serves(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd-data")  # its port is chosen; nothing listens there until start()
    out, err = tmp_path / "rack.out", tmp_path / "rack.err"
    cmd = [
        sys.executable, "-m", "rack_sched", "--domain-id", "node-0", "--listen", "127.0.0.1:0",
        "--etcd", etcd.endpoint, "--topology", "1x8-a100", "--ttl", "3", "--seed", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)
    try:
        _wait_for("warning", lambda: WARNING.search(err.read_text()) is not None)
        assert proc.poll() is None, err.read_text()  # it used to exit 1 with AioRpcError's traceback here
        warning = WARNING.search(err.read_text())
        assert warning is not None and warning["etcd"] == etcd.endpoint
        assert "UNAVAILABLE" in warning["why"] and "Connection refused" in warning["why"]
        assert out.read_text() == ""  # it serves nothing before it could check the domain's registration
        etcd.start()
        _wait_for("'serving at' line", lambda: " serving at " in out.read_text())
        assert out.read_text().startswith("rack_sched node-0 serving at 127.0.0.1:")
        assert " serving at " not in err.read_text()  # said once, on stdout: under a service manager both are logged
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        etcd.stop()
    assert "Traceback" not in err.read_text()


def test_a_scheduler_stopped_while_etcd_does_not_answer_exits_cleanly(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    err = tmp_path / "rack.err"
    cmd = [
        sys.executable, "-m", "rack_sched", "--domain-id", "node-0", "--listen", "127.0.0.1:0",
        "--etcd", endpoint, "--topology", "1x8-a100",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with err.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        _wait_for("warning", lambda: WARNING.search(err.read_text()) is not None)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert stdout == ""
    lines = err.read_text().splitlines()  # the warnings, and nothing else (no traceback, no "Event loop is closed")
    assert lines and all((w := WARNING.search(line)) is not None and w["etcd"] == endpoint for line in lines), lines
