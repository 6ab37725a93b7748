"""``hilum up --run-dir`` used again: its etcd data keeps the earlier run's drain intents, and the new cluster
says so as it starts (it said nothing, and three of four instances took no requests). A gateway whose every domain
drains answers ``/health`` 503 (it answered 200 while it could place nothing), and ``hilum up`` still starts on
such a run directory. A second ``hilum up`` on a run directory in use is refused."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from etcd_server import free_port
from up_harness import REPO, UpProcess, start_up

from hilum_cli.up import UpConfig, run_up


def _ctl(up: UpProcess, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hilum_cli.ctl", "--coordinator", up.info["coordinator"], *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def _health(up: UpProcess) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{up.url}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _health_until(up: UpProcess, status: int, timeout_s: float = 20.0) -> dict[str, object]:
    """The gateway's /health body once it answers ``status`` (the drains reach it with the next summaries)."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, body = _health(up)
        if code == status or time.monotonic() > deadline:
            assert code == status, body
            return body
        time.sleep(0.2)


def test_drains_kept_in_a_reused_run_dir_are_said_at_start(tmp_path: Path) -> None:
    ports = ["--etcd-port", str(free_port())]  # the same etcd as before, on its data
    first = start_up(tmp_path, "sim", ports)
    try:
        # a second hilum up on the run directory in use is refused at once, naming the first (it waited for a
        # second etcd on the same data until its start timeout, then quoted the first etcd's log)
        err = io.StringIO()
        t0 = time.monotonic()
        second = UpConfig(run_dir=str(first.run_dir), port=0, etcd_port=0, grpc_base_port=0, start_timeout_s=60)
        assert run_up(second, out=io.StringIO(), err=err) == 2
        assert time.monotonic() - t0 < 5
        assert err.getvalue() == (
            f"hilum up: error: --run-dir {first.run_dir}: another hilum up (pid {first.proc.pid}) uses it; stop that "
            "one first, or give another --run-dir\n"
        )
        for target in ("dom-a", "b0"):
            _ctl(first, "drain", target)
        deadline = time.monotonic() + 20
        while "draining: dom-a" not in str(_health(first)[1]["detail"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _health(first) == (200, {"status": "ok", "detail": "2 domain(s): dom-a, dom-b; draining: dom-a",
                                        "domains": ["dom-a", "dom-b"]})  # fmt: skip
        _ctl(first, "drain", "b1")  # dom-b's last instance: no domain takes requests
        body = _health_until(first, 503)
        assert body["status"] == "unavailable"
        assert str(body["detail"]).startswith("every domain drains (dom-a, dom-b): no instance takes new requests")
    finally:
        first.stop()
    again = start_up(tmp_path, "sim", ports)  # the same --run-dir (tmp_path/run): it starts though nothing serves
    try:
        err = again.wait_stderr("hilum up: warning: etcd holds drain intents from before this start", 30)
        assert (
            "before this start: dom-a, b0, b1 (no new requests go there); that is every instance: the cluster refuses "
            "every request until one is lifted;" in err
        )
        assert f"`hilumctl --coordinator {again.info['coordinator']} undrain NAME` lifts one" in err
        assert _health_until(again, 503)["domains"] == ["dom-a", "dom-b"]
        _ctl(again, "undrain", "b1")
        assert _health_until(again, 200)["detail"] == "2 domain(s): dom-a, dom-b; draining: dom-a"
    finally:
        again.stop()
