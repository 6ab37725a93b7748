"""The process supervisor under ``hilum up``: start children, restart crashed ones, stop them all.

Each child is a command with a way to tell that it serves (a line it prints, or a check). A child that
exits while the cluster runs is handled as systemd's ``Restart=on-failure`` with
``RestartPreventExitStatus=2`` would (deploy/systemd/):

- exit status 0, or killed by SIGTERM, SIGINT, SIGHUP or SIGPIPE: it stopped cleanly (someone stopped
  it): it stays down;
- exit status 2: a configuration error, which a restart would only repeat: it stays down;
- anything else (a non-zero status, SIGKILL, SIGSEGV, ...) is a crash: it is restarted after a delay that
  doubles with each crash in the window (``delay_s``, ``2 delay_s``, ... up to ``max_delay_s``), at most
  ``max_restarts`` times within ``window_s`` seconds (systemd's ``StartLimitBurst`` /
  ``StartLimitIntervalSec``); one more crash in the window and the supervisor gives up on the cluster.

:func:`decide` is that rule, a pure function. Every child shares one process group (swept with SIGKILL
at the end, so no grandchild survives), writes its stdout and stderr to ``<log dir>/<name>.log`` (appended
across restarts, each restart marked), and on Linux gets SIGTERM if the supervisor itself dies
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

__all__ = [
    "Child",
    "ChildSpec",
    "Decision",
    "RestartPolicy",
    "StartFailed",
    "Supervisor",
    "decide",
    "describe_exit",
]

CLEAN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE})
CONFIG_ERROR_STATUS = 2  # every hilum process exits 2 on a bad flag or configuration


class StartFailed(RuntimeError):
    """A child did not start: it exited, or did not say it serves in time (the message has its log's tail)."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a crashed child is restarted (see the module docstring)."""

    max_restarts: int = 5  # restarts allowed within window_s (0: never restart, a crash stops the cluster)
    window_s: float = 60.0  # seconds a crash counts against max_restarts
    delay_s: float = 0.5  # delay before the first restart, seconds; doubles with each crash in the window
    max_delay_s: float = 8.0  # cap on one delay, seconds

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not (self.window_s > 0 and 0 <= self.delay_s <= self.max_delay_s):
            raise ValueError(
                f"need window_s > 0 and 0 <= delay_s <= max_delay_s, got {self.window_s}, {self.delay_s}, "
                f"{self.max_delay_s}"
            )


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do about a child that exited: ``restart`` (after ``delay_s``), ``stay_down`` or ``give_up``."""

    action: str
    delay_s: float
    reason: str  # the end of the log line: why


def describe_exit(returncode: int) -> str:
    """``exited with status N`` or ``was killed by SIGNAME`` (Popen's negative return codes)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def decide(returncode: int, crash_times_s: Sequence[float], now_s: float, policy: RestartPolicy) -> Decision:
    """The restart rule (module docstring) for a child that exited with ``returncode``.

    Args:
        returncode: Popen's return code (negative: killed by that signal).
        crash_times_s: when this child crashed before, within or outside the window (monotonic seconds).
        now_s: now (monotonic seconds).
        policy: the limits.
    """
    if returncode == 0 or (returncode < 0 and -returncode in CLEAN_SIGNALS):
        return Decision("stay_down", 0.0, "it stopped cleanly, so it is not restarted (Restart=on-failure)")
    if returncode == CONFIG_ERROR_STATUS:
        return Decision("stay_down", 0.0, "status 2 is a configuration error, which a restart would repeat")
    recent = sum(1 for t in crash_times_s if now_s - t < policy.window_s)  # crashes before this one
    if recent >= policy.max_restarts:
        if policy.max_restarts == 0:
            return Decision("give_up", 0.0, "restarts are off (--max-restarts 0)")
        return Decision(
            "give_up",
            0.0,
            f"it crashed {recent + 1} times within {policy.window_s:g} s (at most {policy.max_restarts} restarts; "
            "--max-restarts)",
        )
    delay = min(policy.max_delay_s, policy.delay_s * 2.0**recent)
    return Decision(
        "restart", delay, f"restart {recent + 1} of at most {policy.max_restarts} within {policy.window_s:g} s"
    )


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to run one child.

    ``ready_marker``: a substring of the stdout line it prints once it serves; or ``ready_check``: a
    function polled until it returns True (e.g. etcd's ``/health``). ``waits_for`` says what readiness
    means, for progress lines ("to listen", "its /health").
    """

    name: str  # also the log file's name: <log dir>/<name>.log
    cmd: tuple[str, ...]
    ready_marker: str | None = None
    ready_check: Callable[[], bool] | None = None
    waits_for: str = "to serve"


def _pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(slots=True)
class Child:
    """One supervised child: its spec, the running process, and its restart history."""

    spec: ChildSpec
    log_path: Path
    proc: subprocess.Popen[str] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None
    started_s: float = 0.0  # monotonic time of the last start
    restarts: int = 0  # restarts so far
    crash_times_s: deque[float] = field(default_factory=deque)
    restart_at_s: float | None = None  # a restart is due then
    down: bool = False  # stays down (a clean stop or a configuration error)
    back_s: float = -1.0  # the start (started_s) that was last reported serving again

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        """The current process's pid (0 before its first start)."""
        return self.proc.pid if self.proc is not None else 0

    def running(self) -> bool:
        """Whether its current process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def state(self) -> str:
        """``running``, ``restarting`` (exited, a restart is due) or ``down`` (it stopped cleanly or on a
        configuration error, and stays down)."""
        if self.down:
            return "down"
        return "running" if self.running() else "restarting"

    def is_ready(self) -> bool:
        """Whether it says it serves now (its ready line was printed, or its check passes)."""
        if self.spec.ready_check is not None:
            return self.running() and self.spec.ready_check()
        return self.ready.is_set()

    def log_tail(self, n_chars: int = 2000) -> str:
        """The last ``n_chars`` characters of its log, or ``(nothing: the log is empty)`` / ``(the log cannot be
        read: ...)``, so that a message quoting it never ends on an empty line (a child that said nothing yet)."""
        try:
            tail = self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError as exc:
            return f"(the log cannot be read: {exc.strerror or exc})"
        return tail if tail.strip() else "(nothing: the log is empty)"


class Supervisor:
    """The children of ``hilum up`` (module docstring): :meth:`spawn`, :meth:`wait_ready`, :meth:`tick`
    while the cluster runs, :meth:`stop_all` at the end.

    Args:
        log_dir: where each child's log goes.
        env: the children's environment; ``cwd`` their working directory.
        policy: the restart rule's limits.
        say: where progress and restart lines go (one line each, without the ``hilum up:`` prefix).
        ready_timeout_s: how long a restarted child may take to serve again before it is killed (a crash).
        clock: monotonic clock, seconds.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        env: dict[str, str],
        cwd: Path,
        policy: RestartPolicy,
        say: Callable[[str], None],
        ready_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self._env, self._cwd = env, cwd
        self.policy = policy
        self._say = say
        self._clock = clock
        self.stages: list[list[Child]] = []
        self._pgids: list[int] = []  # the process group, and any other one a restart had to start
        # called when a child's state changes after the start: a restarted one serves again, or one stays down
        self.on_change: Callable[[Child], None] | None = None

    # ---- starting ----------------------------------------------------------------------------------
    def _start(self, child: Child) -> None:
        spec = child.spec
        log = child.log_path.open("a")
        if child.restarts:
            log.write(f"\n---- hilum up: restart {child.restarts} at {time.strftime('%H:%M:%S')} ----\n")
            log.flush()
        child.ready = threading.Event()
        try:
            proc = self._popen(spec.cmd, log)
        except BaseException:
            log.close()
            raise
        child.proc = proc
        child.started_s = self._clock()
        ready, marker = child.ready, spec.ready_marker

        def read() -> None:
            assert proc.stdout is not None
            with proc.stdout, log:
                for line in proc.stdout:
                    if marker is not None and marker in line:
                        ready.set()
                    log.write(line)
                    log.flush()

        child.reader = threading.Thread(target=read, name=f"log-{spec.name}", daemon=True)
        child.reader.start()

    def _popen(self, cmd: Sequence[str], log: TextIO) -> subprocess.Popen[str]:
        def popen(group: int) -> subprocess.Popen[str]:
            return subprocess.Popen(
                list(cmd),
                cwd=self._cwd,
                env=self._env,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
                process_group=group,
                preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
            )

        if self._pgids:
            try:
                return popen(self._pgids[-1])
            except (PermissionError, subprocess.SubprocessError):
                pass  # every member of the group has exited: the group is gone; start a new one
        proc = popen(0)
        self._pgids.append(proc.pid)
        return proc

    def spawn(self, spec: ChildSpec) -> Child:
        """Start ``spec`` now (its log is ``<log dir>/<name>.log``)."""
        child = Child(spec, self.log_dir / f"{spec.name}.log")
        self._start(child)
        return child

    def add_stage(self, children: list[Child]) -> None:
        """Remember children started together (stopped together, in reverse stage order)."""
        self.stages.append(children)

    def children(self) -> list[Child]:
        """Every child, in start order."""
        return [c for stage in self.stages for c in stage]

    def wait_ready(self, children: Sequence[Child], timeout_s: float, *, progress_every_s: float = 10.0) -> None:
        """Wait until each child serves; every ``progress_every_s`` say who is still awaited.

        Raises:
            StartFailed: when a child (of these or started before) exits, or one is not ready in time.
        """
        t0 = self._clock()
        deadline, next_note = t0 + timeout_s, t0 + progress_every_s
        pending = list(children)
        while pending:
            pending = [c for c in pending if not c.is_ready()]
            self.raise_if_exited()
            now = self._clock()
            if pending and now > deadline:
                child = pending[0]
                raise StartFailed(
                    f"{child.name} did not start within {timeout_s:g} s (it did not say it serves); its log "
                    f"{child.log_path} ends with:\n{child.log_tail()}"
                )
            if pending and now >= next_note:
                names = ", ".join(c.name for c in pending)
                self._say(f"  still waiting for {names} {pending[0].spec.waits_for} ({now - t0:.0f} s)")
                next_note = now + progress_every_s
            if pending:
                time.sleep(0.05)

    def raise_if_exited(self) -> None:
        """While starting: raise StartFailed (with its log's tail) if a child has exited."""
        for child in self.children():
            if child.proc is not None and child.proc.poll() is not None:
                raise StartFailed(
                    f"{child.name} {describe_exit(child.proc.returncode)} while starting; its log "
                    f"{child.log_path} ends with:\n{child.log_tail()}"
                )

    # ---- running -----------------------------------------------------------------------------------
    def tick(self) -> str | None:
        """Look after every child once: note exits, restart crashed children when due, report those that
        serve again. Returns why the cluster cannot go on (a child crashed too often), else None."""
        now = self._clock()
        for child in self.children():
            if child.down:
                continue
            proc = child.proc
            if child.restart_at_s is not None:
                if now >= child.restart_at_s:
                    child.restart_at_s = None
                    child.restarts += 1
                    try:
                        self._start(child)
                    except OSError as exc:
                        return f"{child.name} could not be restarted ({exc}); its log: {child.log_path}"
                continue
            if proc is None or proc.poll() is None:
                if proc is not None and child.restarts and child.back_s < child.started_s:
                    self._follow_restart(child, proc, now)
                continue
            decision = decide(proc.returncode, child.crash_times_s, now, self.policy)
            what = f"{child.name} (pid {proc.pid}) {describe_exit(proc.returncode)}"
            if decision.action == "stay_down":
                child.down = True
                if self.on_change is not None:  # first: once the line is out, cluster.json says it is down
                    self.on_change(child)
                self._say(f"{what}: {decision.reason}; its log: {child.log_path}")
            elif decision.action == "give_up":
                return (
                    f"{what}; giving up: {decision.reason}. Its log ({child.log_path}) ends with:\n{child.log_tail()}"
                )
            else:
                child.crash_times_s.append(now)
                while child.crash_times_s and now - child.crash_times_s[0] >= self.policy.window_s:
                    child.crash_times_s.popleft()
                child.restart_at_s = now + decision.delay_s
                self._say(f"{what}; restarting it in {decision.delay_s:.1f} s ({decision.reason}); its log: "
                          f"{child.log_path}")  # fmt: skip
        return None

    def _follow_restart(self, child: Child, proc: subprocess.Popen[str], now: float) -> None:
        """A restarted child: say when it serves again; kill it (a crash) if it does not within the limit."""
        if child.is_ready():
            child.back_s = child.started_s
            if self.on_change is not None:  # first: once the line is out, cluster.json shows the restart
                self.on_change(child)
            self._say(f"{child.name} serves again (pid {proc.pid}; restarts in all: {child.restarts})")
        elif now - child.started_s > self.ready_timeout_s:
            self._say(f"{child.name} (pid {proc.pid}) did not serve within {self.ready_timeout_s:g} s of its "
                      "restart; killing it")  # fmt: skip
            proc.kill()

    def pids(self) -> list[int]:
        """Pids of the children running now."""
        return [c.pid for c in self.children() if c.running()]

    # ---- stopping ----------------------------------------------------------------------------------
    def stop_all(self, timeout_s: float = 10.0) -> None:
        """SIGTERM each stage (last started first), SIGKILL what is left after ``timeout_s``, sweep the
        process group(s), reap everything. No restart happens from here on."""
        for child in self.children():
            child.restart_at_s = None
            child.down = True
        for stage in reversed(self.stages):
            for child in stage:
                if child.running():
                    assert child.proc is not None
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)
            deadline = self._clock() + timeout_s
            for child in stage:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(timeout=max(0.0, deadline - self._clock()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()
                    child.proc.wait()
        for pgid in self._pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        for child in self.children():
            if child.proc is not None:
                child.proc.wait()
            if child.reader is not None:
                child.reader.join(timeout=5)
