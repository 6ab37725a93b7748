"""``bench/gpu_migration.py`` on the host (``--device cpu``): the GPU check's whole path except CUDA IPC.

The same two torch llumlet processes, the local transport with the source's KV pool opened by the
destination (a shared-memory segment instead of CUDA IPC handles), streams compared with the unmigrated
reference. On a GPU the script runs with ``--device cuda`` (docs/migration.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_gpu_check_runs_on_the_host_with_identical_streams() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "gpu_migration.py"), "--device", "cpu", "--contexts", "48", "200"]
    cmd += ["--repeats", "1", "--layers", "2", "--hidden", "128", "--num-blocks", "128", "--max-tokens", "96"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 48 |", "| 200 |"))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[5] == "local" and cells[6] == "True", row  # peer copy from the opened pool; same tokens
        assert int(cells[2]) >= 1  # pre-copy stages while decoding
    assert "downtime 200 / 48 tokens:" in out.stdout
