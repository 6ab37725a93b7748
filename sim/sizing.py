"""``hilum sim size``: the smallest static fleet that meets a P99 TTFT target, each size a real simulation.

For one policy, :func:`size_fleet` simulates the whole pool first (``initial_instances`` = every instance of the
model in the topology): if even that misses the target, no size does and the search stops. Otherwise it bisects
over 1 .. pool size for the smallest fleet that meets it: one that refuses no request (P99 TTFT covers the served
requests only, so a fleet that refuses some, e.g. with no instance large enough for them, never meets a target) and
whose P99 TTFT is at most the target. Each miss says why (:attr:`SizeTrial.miss`). Bisection assumes that more
instances never raise P99 TTFT; a simulation is not bound to that (a different fleet dispatches differently), so
every size simulated is reported, not only the answer, and the answer is the smallest size *found* to meet the
target, with a larger one that met it above it and a smaller one that missed it below it (or size 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .results import PolicySummary

__all__ = ["SizeTrial", "Sizing", "size_fleet"]


@dataclass(frozen=True, slots=True)
class SizeTrial:
    """One fleet size simulated."""

    instances: int  # fleet size (static: no autoscaler)
    summary: PolicySummary  # the run's summary (ttft_p99_s, gpu_hours, ...)
    meets: bool  # no request refused and P99 TTFT at most the target (a run with no TTFT sample never meets it)
    # why it misses the target ("refused 3 of 20 requests", "P99 TTFT 812 ms > 500 ms", "no request got a first
    # token"); None when it meets it
    miss: str | None = None


@dataclass(frozen=True, slots=True)
class Sizing:
    """The search of one policy: every size simulated (by size) and the answer."""

    policy: str
    target_p99_ttft_s: float
    trials: tuple[SizeTrial, ...]  # sorted by instances
    chosen: int | None  # the smallest size found to meet the target; None: not even the whole pool does

    def trial(self, instances: int) -> SizeTrial:
        """The trial of a size (KeyError when it was not simulated)."""
        for t in self.trials:
            if t.instances == instances:
                return t
        raise KeyError(instances)


def size_fleet(
    policy: str, pool_size: int, target_p99_ttft_s: float, simulate: Callable[[int], PolicySummary]
) -> Sizing:
    """Search the smallest fleet of ``policy`` meeting ``target_p99_ttft_s`` (module docstring).

    Args:
        policy: the policy's name (for the result).
        pool_size: the model's instances in the topology (the largest fleet), >= 1.
        target_p99_ttft_s: the target, seconds, > 0.
        simulate: runs the simulation with that many instances serving from the start and returns its summary.

    Returns at most ``1 + ceil(log2(pool_size))`` trials. Raises ValueError on a pool size below 1 or a target
    that is not a positive number.
    """
    if pool_size < 1:
        raise ValueError(f"pool_size must be >= 1, got {pool_size}")
    if not target_p99_ttft_s > 0:
        raise ValueError(f"the P99 TTFT target must be > 0 s, got {target_p99_ttft_s}")
    trials: dict[int, SizeTrial] = {}

    def meets(n: int) -> bool:
        summary = simulate(n)
        miss = _miss(summary, target_p99_ttft_s)
        trials[n] = SizeTrial(n, summary, miss is None, miss)
        return trials[n].meets

    chosen: int | None = None
    if meets(pool_size):
        lo, hi = 0, pool_size  # lo misses (0: nothing serves), hi meets
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid
        chosen = hi
    return Sizing(policy, target_p99_ttft_s, tuple(trials[n] for n in sorted(trials)), chosen)


def _miss(summary: PolicySummary, target_p99_ttft_s: float) -> str | None:
    """Why a run of ``summary`` misses ``target_p99_ttft_s`` (s): refused requests first (its P99 TTFT, over the
    served requests only, does not see them), then no TTFT sample, then a P99 TTFT above the target; None when it
    meets the target."""
    if summary.refused > 0:
        return (
            f"refused {summary.refused:,} of {summary.requests:,} {'request' if summary.requests == 1 else 'requests'}"
        )
    p99 = summary.ttft_p99_s
    if p99 is None:
        return "no request got a first token"
    if p99 > target_p99_ttft_s:
        p99_ms, target_ms = p99 * 1e3, target_p99_ttft_s * 1e3
        shown = f"{p99_ms:,.0f}" if round(p99_ms) > target_ms else f"{p99_ms:,.9g}"  # never "500 ms > 500 ms"
        return f"P99 TTFT {shown} ms > {target_ms:,.10g} ms"
    return None
