"""``python -m gateway`` stopped while etcd does not answer yet: it waits for etcd to sync its cluster view, and a
SIGTERM or SIGINT meanwhile ends it cleanly (it was killed by SIGTERM, and SIGINT gave a KeyboardInterrupt
traceback: its signal handlers came only after etcd answered)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_server import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_gateway_stopped_before_etcd_answers_exits_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    err = tmp_path / "gateway.err"
    cmd = [sys.executable, "-m", "gateway", "--etcd", endpoint, "--topology", "1x8-a100", "--listen", "127.0.0.1:0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with err.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 30
        while "etcd error" not in err.read_text():  # its cluster view is retrying etcd: past the start-up
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        proc.send_signal(sig)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err.read_text()
    assert stdout == ""  # it never served
    assert "Traceback" not in err.read_text()
