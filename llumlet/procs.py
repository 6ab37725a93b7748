"""Spawning llumlet processes (``python -m llumlet``) for integration tests and the benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LlumletProcess"]

_REPO = Path(__file__).resolve().parent.parent


class LlumletProcess:
    """One ``python -m llumlet`` child process.

    ``start()`` waits for its "serving at" line and sets ``address``. Its output goes to ``log_path``.
    Raises RuntimeError (with the log's tail) when it exits or does not serve within ``timeout_s``.
    """

    def __init__(
        self,
        instance_id: str,
        args: Sequence[str],
        log_path: Path,
        *,
        engine: str = "sim",
        listen: str = "127.0.0.1:0",
        python: str = sys.executable,
    ) -> None:
        self.instance_id = instance_id
        self.log_path = log_path
        self.cmd = [python, "-m", "llumlet", "--instance-id", instance_id, "--engine", engine, "--listen", listen]
        self.cmd += list(args)
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._found = threading.Event()

    def start(self, timeout_s: float = 60.0) -> LlumletProcess:
        """Spawn and wait until it serves."""
        self.spawn()
        return self.wait_serving(timeout_s)

    def spawn(self) -> None:
        """Start the process without waiting (start several, then :meth:`wait_serving` on each)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")])}
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        self._found = found = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            with self.proc.stdout, log:
                for line in self.proc.stdout:
                    if " serving at " in line and not found.is_set():
                        self.address = line.rsplit(" ", 1)[1].strip()
                        found.set()
                    log.write(line)
                    log.flush()

        self._reader = threading.Thread(target=read, name=f"out-{self.instance_id}", daemon=True)
        self._reader.start()

    def wait_serving(self, timeout_s: float = 60.0) -> LlumletProcess:
        """Wait for the "serving at" line. Raises RuntimeError (with the log's tail) if it exits or times out."""
        if self.proc is None:
            raise RuntimeError(f"llumlet {self.instance_id}: not spawned")
        deadline = time.monotonic() + timeout_s
        while not self._found.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llumlet {self.instance_id} did not start: {self.log_tail()}")
        return self

    def log_tail(self, n_chars: int = 3000) -> str:
        """The end of the process's output."""
        try:
            return self.log_path.read_text()[-n_chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._join()

    def _join(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def terminate(self) -> None:
        """Send SIGTERM without waiting (stop several at once, then :meth:`stop` each)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            self._join()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._join()
