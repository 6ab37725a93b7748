"""Prefix-aware dispatch on the Mooncake trace, end to end in the simulator (issue #15): the rule book's prefix
rule (policy/dispatch.py) composed by the simulated tiers, on engines that report their cached hash blocks."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from sim.results import SimRun, summarize
from sim.runner import SimSpec, run_simulation

# 600 requests at 3x the trace's rate on 16 Llama-2-7B instances with ample KV memory: busy, not saturated.
SLICE = SimSpec("2x8-a100", "mooncake-conv", "llumnix", rate_scale=3.0, max_requests=600)


def run(policy: str, **options: object) -> SimRun:
    return run_simulation(dataclasses.replace(SLICE, policy=policy, options=options))


def busiest_share(result: SimRun, num_instances: int = 16) -> float:
    """Requests dispatched to the busiest instance over its fair share (admitted requests / instances)."""
    counts = Counter(r.dispatched_instance_id for r in result.requests if r.dispatched_instance_id)
    return max(counts.values()) / (sum(counts.values()) / num_instances)


@pytest.mark.parametrize("policy", ["llumnix", "hilum"])
def test_prefix_awareness_raises_the_hit_rate_without_piling_up(policy: str) -> None:
    aware, blind = summarize(aware_run := run(policy)), summarize(run(policy, prefix_aware_dispatch=False))
    assert aware.finished == blind.finished == 600
    assert aware.prefix_hit_rate is not None and blind.prefix_hit_rate is not None
    # Every Mooncake prompt starts with the same 512-token block: load-only dispatch hits on it and little
    # more (~18 % of prompt tokens); routing a conversation's next turn where its context is cached adds more.
    assert blind.prefix_hit_rate > 0.1
    assert aware.prefix_hit_rate > blind.prefix_hit_rate + 0.08
    assert busiest_share(aware_run) <= 2.0


def test_prefix_caching_off_means_no_hit() -> None:
    off = summarize(run("llumnix", prefix_caching=False))
    assert off.prefix_hit_rate == 0.0 and off.finished == 600
