"""Prefix-aware dispatch on the Mooncake trace, end to end in the simulator (issue #15): the rule book's prefix
rule (policy/dispatch.py) composed by the simulated tiers, on engines that report their cached hash blocks."""

from __future__ import annotations

import dataclasses

import pytest

from sim.results import RequestRecord, SimRun, busiest_dispatch_share, summarize
from sim.runner import SimSpec, run_simulation

# 600 requests at 3x the trace's rate on 16 Llama-2-7B instances with ample KV memory: busy, not saturated.
SLICE = SimSpec("2x8-a100", "mooncake-conv", "llumnix", rate_scale=3.0, max_requests=600)


def run(policy: str, **options: object) -> SimRun:
    return run_simulation(dataclasses.replace(SLICE, policy=policy, options=options))


@pytest.mark.parametrize("policy", ["llumnix", "hilum"])
def test_prefix_awareness_raises_the_hit_rate_without_piling_up(policy: str) -> None:
    aware, blind = summarize(aware_run := run(policy)), summarize(run(policy, prefix_aware_dispatch=False))
    assert aware.finished == blind.finished == 600
    assert aware.prefix_hit_rate is not None and blind.prefix_hit_rate is not None
    # Every Mooncake prompt starts with the same 512-token block: load-only dispatch hits on it and little
    # more (~18 % of prompt tokens); routing a conversation's next turn where its context is cached adds more.
    assert blind.prefix_hit_rate > 0.1
    assert aware.prefix_hit_rate > blind.prefix_hit_rate + 0.08
    share = busiest_dispatch_share(aware_run.requests, 16)
    assert share is not None and share <= 2.0


def test_busiest_dispatch_share_is_the_busiest_instance_over_the_fair_share() -> None:
    def placed(*ids: str) -> list[RequestRecord]:
        base = RequestRecord("r", 0, 0.0, 10, 1, 1, 0.1, 0.2, (), 0, 0.0, 0, None, "")
        return [dataclasses.replace(base, request_id=f"r{k}", dispatched_instance_id=i) for k, i in enumerate(ids)]

    # 6 placed on 3 instances (fair share 2): a got 3, so 1.5; an unplaced request does not count.
    assert busiest_dispatch_share(placed("a", "a", "a", "b", "c", "c", ""), 3) == pytest.approx(1.5)
    assert busiest_dispatch_share(placed(""), 3) is None
    with pytest.raises(ValueError, match="num_instances"):
        busiest_dispatch_share([], 0)


def test_prefix_caching_off_means_no_hit() -> None:
    off = summarize(run("llumnix", prefix_caching=False))
    assert off.prefix_hit_rate == 0.0 and off.finished == 600
