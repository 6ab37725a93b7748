"""Bounded, jittered exponential backoff for every long-lived retry loop in the control plane."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Backoff", "BackoffConfig"]


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
        self.failures = 0  # consecutive failures since the last reset

    def next_s(self) -> float:
        """The delay before the next retry, seconds, in ``[(1 - jitter) · d, d]`` with ``d <= max_s``."""
        base = self._next_s
        self._next_s = min(self._cfg.max_s, base * self._cfg.multiplier)
        self.failures += 1
        return base * (1.0 - self._cfg.jitter * self._rng.random())

    def reset(self) -> None:
        """Start again from ``initial_s``."""
        self._next_s = self._cfg.initial_s
        self.failures = 0
