"""Bounded, jittered exponential backoff for every long-lived retry loop in the control plane, and the level of
each retry's log line (:class:`RepeatedFailures`)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RECOVERED_LEVEL", "WARN_EVERY_S", "Backoff", "BackoffConfig", "RepeatedFailures", "failed_attempts"]

#: While a failure repeats, a retry loop warns at its first and then once every this many seconds; the retries
#: between are logged at debug level. Every loop retrying every ``max_s`` through an etcd outage wrote a warning a
#: second or two each (a coordinator: three loops, 2 lines a second).
WARN_EVERY_S = 30.0

#: The level of the line a retry loop writes when it succeeds after failures: that of the warning it ends, so a log
#: kept at WARNING (a llumlet's and a gateway's default) says that etcd answers again, not only that it did not.
RECOVERED_LEVEL = logging.WARNING


def failed_attempts(count: int) -> str:
    """``count`` failed attempts in words, for a recovery line: "1 failed attempt", "3 failed attempts"."""
    return f"{count} failed attempt{'' if count == 1 else 's'}"


class RepeatedFailures:
    """The log level of each failure of a run of them: WARNING for the first (since :meth:`reset`, a success) and
    then for one every ``every_s`` seconds (``clock``: seconds), DEBUG for the others. :attr:`failures` counts them.
    """

    def __init__(self, every_s: float = WARN_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._warned_s = -float("inf")
        self.failures = 0  # failures since the last reset

    def failed(self) -> int:
        """Count a failure; its log level (``logging.WARNING`` or ``logging.DEBUG``)."""
        self.failures += 1
        now = self._clock()
        if self.failures == 1 or now - self._warned_s >= self._every_s:
            self._warned_s = now
            return logging.WARNING
        return logging.DEBUG

    def reset(self) -> None:
        """A success: the next failure is the first of a new run."""
        self.failures = 0


@dataclass(frozen=True, slots=True)
class BackoffConfig:
    """Delays between retries: ``initial_s · multiplier^k``, capped at ``max_s``, then jittered.

    Jitter draws each delay uniformly from ``[(1 - jitter) · d, d]`` so that many agents reconnecting
    to etcd after an outage do not retry in lock-step ("full jitter" when ``jitter = 1``).
    """

    initial_s: float = 0.1  # first delay, seconds
    max_s: float = 2.0  # cap on one delay, seconds
    multiplier: float = 2.0  # growth per failed attempt
    jitter: float = 0.5  # fraction of each delay that is randomised, in [0, 1]

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"BackoffConfig: need 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.multiplier < 1:
            raise ValueError(f"BackoffConfig: multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"BackoffConfig: jitter must be in [0, 1], got {self.jitter}")


class Backoff:
    """Stateful delay sequence for one retry loop; ``reset()`` after a success.

    The random source is injected so tests and simulations are deterministic.
    """

    def __init__(self, cfg: BackoffConfig, rng: random.Random) -> None:
        self._cfg = cfg
        self._rng = rng
        self._next_s = cfg.initial_s
        self._repeats = RepeatedFailures()
        self._level = logging.WARNING

    @property
    def failures(self) -> int:
        """Consecutive failures (calls of :meth:`next_s`) since the last reset."""
        return self._repeats.failures

    def next_s(self) -> float:
        """Count a failure; the delay before the next retry, seconds, in ``[(1 - jitter) · d, d]`` with
        ``d <= max_s``."""
        base = self._next_s
        self._next_s = min(self._cfg.max_s, base * self._cfg.multiplier)
        self._level = self._repeats.failed()
        return base * (1.0 - self._cfg.jitter * self._rng.random())

    def level(self) -> int:
        """The log level of the failure :meth:`next_s` counted last (:class:`RepeatedFailures`): a warning for the
        first since the last reset and for one every :data:`WARN_EVERY_S` seconds after it, debug between them."""
        return self._level

    def reset(self) -> int:
        """Start again from ``initial_s``; the failures counted before (a loop that had any says it recovered)."""
        failures = self.failures
        self._next_s = self._cfg.initial_s
        self._repeats.reset()
        return failures
