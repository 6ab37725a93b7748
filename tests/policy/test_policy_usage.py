from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_factories import CFG, inst

from policy import (
    InstanceLoad,
    RequestLoad,
    freeness,
    instance_virtual_usage,
    request_virtual_usage,
    summarize_domain,
)
from policy.summarize import DomainSummarizer
from policy.usage import dispatch_freeness_of


@pytest.mark.parametrize(
    ("load", "usage", "free"),
    [
        # plain: V = used = 60; F = (100 − 60) / 3
        (inst("a", 100, [20, 20, 20]), 60.0, 40 / 3),
        # empty: B = max(1, 0) = 1, F = M
        (inst("a", 100), 0.0, 100.0),
        # one high-priority request: + headroom 20
        (inst("a", 100, [20, 20], priorities=[1, 0]), 60.0, 20.0),
        # head-of-line queued request needs 50 blocks: counts on this instance
        (inst("a", 100, [30, 30], num_waiting=2, head_demand_blocks=50), 110.0, -5.0),
        # warming up: fake usage −50
        (inst("a", 100, [10], warming_up=True), -40.0, 140.0),
        # draining: infinite usage, F = −inf (wins over warm-up)
        (inst("a", 100, [10], draining=True, warming_up=True), math.inf, -math.inf),
    ],
)
def test_instance_virtual_usage_and_freeness(load: InstanceLoad, usage: float, free: float) -> None:
    assert instance_virtual_usage(load, CFG) == usage
    assert freeness(load, CFG) == pytest.approx(free)


def test_dispatch_freeness_below_zero_is_the_share_of_capacity_short() -> None:
    assert dispatch_freeness_of(100, 60, 2, 2) == 10.0  # room: over every request, running and queued (Llumnix)
    assert dispatch_freeness_of(100, 140, 10, 2) == -0.4  # 40 of 100 blocks short
    # the count does not matter below zero: 20 queued requests do not make the deficit look smaller (Llumnix's
    # −40 / 30 ranked that instance above one with −40 / 12), nor a longer batch larger
    assert dispatch_freeness_of(100, 140, 10, 20) == dispatch_freeness_of(100, 140, 50, 0) == -0.4
    assert dispatch_freeness_of(400, 440, 40, 0) > dispatch_freeness_of(100, 140, 10, 0)  # 10 % short above 40 %
    assert dispatch_freeness_of(100, 100, 10, 20) == 0.0 and dispatch_freeness_of(0, 5, 0, 1) == -5.0
    assert dispatch_freeness_of(100, math.inf, 5, 0) == -math.inf


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(0, 10_000),
    usage=st.floats(-1_000, 20_000, allow_nan=False),
    more_usage=st.floats(0, 1_000, allow_nan=False),
    running=st.integers(0, 500),
    waiting=st.integers(0, 500),
    more=st.integers(0, 500),
)
def test_dispatch_freeness_falls_with_usage_and_never_rises_with_more_requests(
    capacity: int, usage: float, more_usage: float, running: int, waiting: int, more: int
) -> None:
    f = dispatch_freeness_of(capacity, usage, running, waiting)
    assert dispatch_freeness_of(capacity, usage + more_usage, running, waiting) <= f
    assert dispatch_freeness_of(capacity, usage, running + more, waiting) <= f
    assert dispatch_freeness_of(capacity, usage, running, waiting + more) <= f
    assert (f >= 0) == (capacity >= usage)  # every F >= 0 ranks above every F < 0


def test_used_blocks_not_the_request_sum_is_the_real_usage() -> None:
    # 16 blocks are reserved for an incoming migration: they count.
    load = InstanceLoad("a", 100, 36, (RequestLoad("r", 20),))
    assert instance_virtual_usage(load, CFG) == 36.0


def test_request_virtual_usage_adds_headroom_of_its_class() -> None:
    assert request_virtual_usage(RequestLoad("r", 7), CFG) == 7
    assert request_virtual_usage(RequestLoad("r", 7, priority=1), CFG) == 27
    assert request_virtual_usage(RequestLoad("r", 7, priority=3), CFG) == 7


def test_summarize_domain_by_hand() -> None:
    loads = [
        inst("x", 100, [20, 20], domain_id="d"),  # V 40, free 60
        inst("y", 200, [50], priorities=[1], domain_id="d"),  # V 70, free 150
        inst("z", 100, [30], draining=True, domain_id="d"),  # no capacity; its 30 real blocks count
    ]
    s = summarize_domain("d", loads, CFG)
    assert s.num_instances == 3
    assert s.capacity_blocks == 300
    assert s.virtual_usage == 140.0
    assert s.freeness == pytest.approx((300 - 140) / 4)
    assert s.largest_free_blocks == 150
    assert s.max_instance_capacity_blocks == 200
    assert (s.num_running, s.num_waiting, s.draining) == (4, 0, False)


def test_sum_does_not_hide_fragmentation() -> None:
    # Four instances each 30 blocks free: 120 free in sum, but no single instance fits 40.
    s = summarize_domain("d", [inst(f"i{k}", 100, [70]) for k in range(4)], CFG)
    assert s.capacity_blocks - s.virtual_usage == 120
    assert s.largest_free_blocks == 30


def test_all_draining_domain_is_draining_and_empty_is_not() -> None:
    s = summarize_domain("d", [inst("a", 100, [10], draining=True), inst("b", 50, draining=True)], CFG)
    assert s.draining
    assert (s.virtual_usage, s.freeness, s.capacity_blocks) == (math.inf, -math.inf, 0)
    assert (s.largest_free_blocks, s.max_instance_capacity_blocks) == (0, 0)
    empty = summarize_domain("e", [], CFG)
    assert not empty.draining
    assert (empty.capacity_blocks, empty.freeness, empty.num_instances) == (0, 0.0, 0)
    assert empty.virtual_usage == 0.0 and isinstance(empty.virtual_usage, float)  # a float, as every domain's


@pytest.mark.parametrize("taken_s", [math.nan, math.inf, -math.inf])
def test_a_summary_stamped_at_no_finite_time_is_refused(taken_s: float) -> None:
    loads = [inst("a", 100, [10])]
    with pytest.raises(ValueError, match=r"summarize_domain\('d'\): taken_s must be a finite time in seconds"):
        summarize_domain("d", loads, CFG, taken_s=taken_s)
    with pytest.raises(ValueError, match=r"summarize_domain\('d'\): taken_s must be a finite time"):
        DomainSummarizer("d", CFG).summarize(loads, taken_s=taken_s)
    with pytest.raises(ValueError, match=r"DomainSummary\('d'\): taken_s must be a finite time in seconds"):
        replace(summarize_domain("d", loads, CFG), taken_s=taken_s)


def test_summarize_domain_rejects_a_load_of_another_domain() -> None:
    with pytest.raises(ValueError, match=r"instance 'a' reports domain 'other'"):
        summarize_domain("d", [inst("a", 100, domain_id="other")], CFG)
