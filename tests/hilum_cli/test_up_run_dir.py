"""``hilum up --run-dir`` used again: its etcd data keeps the earlier run's drain intents, and the new cluster
says so as it starts (it said nothing, and three of four instances took no requests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from etcd_server import free_port
from up_harness import REPO, start_up


def test_drains_kept_in_a_reused_run_dir_are_said_at_start(tmp_path: Path) -> None:
    ports = ["--etcd-port", str(free_port())]  # the same etcd as before, on its data
    first = start_up(tmp_path, "sim", ports)
    try:
        for target in ("dom-a", "b0"):
            drained = subprocess.run(
                [sys.executable, "-m", "hilum_cli.ctl", "--coordinator", first.info["coordinator"], "drain", target],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert drained.returncode == 0, drained.stderr
    finally:
        first.stop()
    again = start_up(tmp_path, "sim", ports)  # the same --run-dir (tmp_path/run)
    try:
        err = again.wait_stderr("hilum up: warning: etcd holds drain intents from before this start", 30)
        assert "before this start: dom-a, b0 take(s) no new requests;" in err
        assert f"`hilumctl --coordinator {again.info['coordinator']} undrain NAME` lifts one" in err
    finally:
        again.stop()
