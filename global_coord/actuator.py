"""The autoscaler's actuator: a command hook that starts or stops an instance.

The coordinator leader carries out a scale-out or a scale-in stop (``policy.autoscale.ScaleDecision``) by running
the configured command (``autoscale.command``; no shell: the string is split like a shell would split it) with
three more arguments::

    <command ...> scale-out MODEL INSTANCE      start the pool instance INSTANCE of MODEL
    <command ...> scale-in  MODEL INSTANCE      stop INSTANCE: it is drained and empty

and the same in its environment (``HILUM_AUTOSCALE_ACTION``, ``HILUM_MODEL``, ``HILUM_INSTANCE``). Exit status 0
means done. Any other status, a command that cannot be started, or one that runs past ``command_timeout_s``
(its process group is killed) is a failed attempt: it is logged with its output and retried after a jittered,
doubling delay (``command_retry_s``, at most 60 s) up to ``command_attempts`` attempts; then the decision is
reported failed (logged at ERROR, shown by ``hilumctl autoscale``) and the autoscaler's rule takes it from there
(a failed start sends the instance back to the pool, a failed stop is decided again after a cool-down). The
example hook for systemd is ``deploy/hilum-autoscale-hook``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shlex
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from clusterstate.backoff import Backoff, BackoffConfig
from clusterstate.clock import SYSTEM_CLOCK, Clock

__all__ = ["OUTPUT_TAIL_CHARS", "ActuatorConfig", "CommandActuator", "HookResult"]

_log = logging.getLogger(__name__)

#: How much of a hook's output (stdout and stderr together, the end of it) is kept with its decision.
OUTPUT_TAIL_CHARS = 2000
_RETRY_MAX_S = 60.0


@dataclass(frozen=True, slots=True)
class ActuatorConfig:
    """How the coordinator runs the autoscaler's hook (the ``autoscale`` section's actuator keys).

    Raises ValueError on a command that cannot be split, a non-positive timeout or retry delay, or fewer than one
    attempt.
    """

    command: str = ""  # the hook, e.g. "/usr/local/bin/hilum-autoscale-hook" ("" = none: the autoscaler cannot run)
    command_timeout_s: float = 120.0  # one attempt that runs longer is killed and counts as failed
    command_attempts: int = 4  # attempts before a decision is reported failed
    command_retry_s: float = 5.0  # delay before the first retry; doubles (jittered) up to 60 s

    def __post_init__(self) -> None:
        try:
            shlex.split(self.command)
        except ValueError as exc:
            raise ValueError(f"command {self.command!r} cannot be split into arguments: {exc}") from None
        if not (math.isfinite(self.command_timeout_s) and self.command_timeout_s > 0):
            raise ValueError(f"command_timeout_s must be > 0, got {self.command_timeout_s}")
        if self.command_attempts < 1:
            raise ValueError(f"command_attempts must be >= 1, got {self.command_attempts}")
        if not (math.isfinite(self.command_retry_s) and self.command_retry_s > 0):
            raise ValueError(f"command_retry_s must be > 0, got {self.command_retry_s}")

    def argv(self) -> list[str]:
        """The command's words (the hook's arguments come after them)."""
        return shlex.split(self.command)

    def check(self) -> None:
        """Raise ValueError unless the command is set and names an executable file (checked at start)."""
        words = self.argv()
        if not words:
            raise ValueError("autoscale.command is empty: the autoscaler has no way to start or stop an instance")
        program = words[0]
        found = shutil.which(program) if os.sep not in program else program
        if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
            raise ValueError(f"autoscale.command: {program!r} is not an executable file (nor one on PATH)")


@dataclass(frozen=True, slots=True)
class HookResult:
    """What became of one decision's hook."""

    ok: bool
    attempts: int  # attempts made
    exit_code: int | None  # of the last attempt; None: it could not start or timed out
    output: str  # the last OUTPUT_TAIL_CHARS characters of the last attempt's output (or why it failed)


@dataclass(slots=True)
class CommandActuator:
    """Runs the hook for one decision at a time per call (calls may run concurrently).

    Args:
        cfg: the command and its retry settings.
        rng: the random source of the retry jitter.
        clock: sleeps between attempts (tests pass a manual clock).
    """

    cfg: ActuatorConfig
    rng: random.Random = field(default_factory=random.Random)
    clock: Clock = SYSTEM_CLOCK

    async def run(
        self,
        action: str,
        model: str,
        instance_id: str,
        on_attempt: Callable[[int, HookResult], None] | None = None,
    ) -> HookResult:
        """Run ``<command> ACTION MODEL INSTANCE`` until it succeeds or the attempts are spent.

        ``on_attempt(n, result)`` is called after each attempt (n from 1). Never raises for a failing hook
        (CancelledError propagates, after killing a running hook).
        """
        backoff = Backoff(BackoffConfig(self.cfg.command_retry_s, _RETRY_MAX_S, 2.0, 0.5), self.rng)
        result = HookResult(False, 0, None, "not run")
        for attempt in range(1, self.cfg.command_attempts + 1):
            code, output = await self._once(action, model, instance_id)
            result = HookResult(code == 0, attempt, code, output)
            if on_attempt is not None:
                on_attempt(attempt, result)
            words = f"{action} {model} {instance_id}"
            if result.ok:
                _log.info("autoscale hook %s: exit 0 (attempt %d): %s", words, attempt, _one_line(output))
                return result
            if attempt == self.cfg.command_attempts:
                _log.error(
                    "autoscale hook %s failed %d times, giving up (tune autoscale.command_attempts): exit %s: %s",
                    words,
                    attempt,
                    code,
                    _one_line(output),
                )
                break
            delay = backoff.next_s()
            _log.warning(
                "autoscale hook %s failed (attempt %d of %d, exit %s): %s; retrying in %.1f s",
                words,
                attempt,
                self.cfg.command_attempts,
                code,
                _one_line(output),
                delay,
            )
            await self.clock.sleep(delay)
        return result

    async def _once(self, action: str, model: str, instance_id: str) -> tuple[int | None, str]:
        import asyncio  # here: the configuration reads ActuatorConfig and runs no event loop (clusterstate.clock)

        argv = [*self.cfg.argv(), action, model, instance_id]
        env = {**os.environ, "HILUM_AUTOSCALE_ACTION": action, "HILUM_MODEL": model, "HILUM_INSTANCE": instance_id}
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: a timeout kills what it started too
            )
        except OSError as exc:
            return None, f"cannot run {argv[0]!r}: {exc.strerror or exc}"
        try:
            async with asyncio.timeout(self.cfg.command_timeout_s):
                out, _ = await proc.communicate()
        except (TimeoutError, asyncio.CancelledError) as exc:
            _kill_group(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return None, f"timed out after {self.cfg.command_timeout_s:g} s (tune autoscale.command_timeout_s)"
        text = out.decode(errors="replace")
        return proc.returncode, text[-OUTPUT_TAIL_CHARS:]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _one_line(text: str, limit: int = 300) -> str:
    line = " | ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return (line[: limit - 3] + "...") if len(line) > limit else (line or "(no output)")
