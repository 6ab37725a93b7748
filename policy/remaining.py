"""How many output tokens a running request still has to produce: an estimate from what production knows.

A cross-domain move pays off only while the request keeps running on the destination, so the coordinator
weighs its remaining decode time against the copy (``global_coord.approval``). Nobody knows a request's true
output length until it ends (the model decides when to stop), so neither the live domain schedulers nor the
simulator may use it. Both estimate it with :class:`RemainingEstimator`, fed the same observations:

- the request's own bound, ``max_tokens − output_tokens`` (what the client allowed; in trace replay, as in
  vLLM's benchmark_serving and ``hilum bench``, ``max_tokens`` is the trace's output length);
- the lengths of the requests that finished on this domain, a bounded sample of the most recent ones: the
  expected remaining output of a request that has produced ``g`` tokens is the mean residual
  ``E[L − g | L > g]`` over that sample (the mean residual life of the observed length distribution).

The estimate is the smaller of the two once at least ``min_samples`` finished requests outlived ``g``
(heavy-tailed output lengths make the bound loose: most clients send a generous ``max_tokens``); the bound
alone before that; ``default_tokens`` when the request names no bound and nothing was observed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["RemainingConfig", "RemainingEstimator"]


@dataclass(frozen=True, slots=True)
class RemainingConfig:
    """Settings of :class:`RemainingEstimator`. Raises ValueError on a bad value."""

    window: int = 1024  # finished requests remembered (the most recent)
    min_samples: int = 16  # finished requests longer than g needed before the mean residual is used
    default_tokens: int = 256  # estimate for a request with no max_tokens while nothing was observed

    def __post_init__(self) -> None:
        for name, least in (("window", 1), ("min_samples", 1), ("default_tokens", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"RemainingConfig.{name}: must be >= {least}, got {getattr(self, name)}")


class RemainingEstimator:
    """Expected remaining output tokens of running requests (see the module docstring). Not thread-safe."""

    def __init__(self, cfg: RemainingConfig | None = None) -> None:
        self.cfg = cfg or RemainingConfig()
        self._lengths: deque[int] = deque(maxlen=self.cfg.window)

    def observe(self, output_tokens: int) -> None:
        """A request ended having produced ``output_tokens`` tokens. Raises ValueError when negative."""
        if output_tokens < 0:
            raise ValueError(f"observe: output_tokens must be >= 0, got {output_tokens}")
        self._lengths.append(output_tokens)

    @property
    def samples(self) -> int:
        """Finished requests remembered."""
        return len(self._lengths)

    def estimate(self, output_tokens: int, max_tokens: int = 0) -> int:
        """Expected output tokens still to come of a request that produced ``output_tokens`` so far.

        ``max_tokens``: its limit (0 = not known). Never above ``max_tokens − output_tokens`` when the limit is
        known, never negative.
        """
        bound = max(0, max_tokens - output_tokens) if max_tokens > 0 else None
        longer = [n - output_tokens for n in self._lengths if n > output_tokens]
        if len(longer) >= self.cfg.min_samples:
            residual = round(sum(longer) / len(longer))
            return residual if bound is None else min(bound, residual)
        return bound if bound is not None else self.cfg.default_tokens
