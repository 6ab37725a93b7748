"""The worked example of docs/policy.md, number by number."""

from __future__ import annotations

import random

import pytest
from policy_factories import apply_move

from policy import (
    DispatchView,
    InstanceLoad,
    PolicyConfig,
    RequestLoad,
    freeness,
    instance_virtual_usage,
    plan_migrations,
    potential,
    summarize_domain,
)

CFG = PolicyConfig()  # defaults: headroom {1: 128}, warm-up −512, thresholds 3.0
I0 = InstanceLoad(
    "i0",
    1000,
    890,
    tuple(RequestLoad(f"i0-r{k}", b) for k, b in enumerate([150] * 5 + [140])),
    num_waiting=1,
    head_demand_blocks=100,
)
I1 = InstanceLoad(
    "i1",
    1000,
    400,
    (RequestLoad("i1-r0", 200, priority=1), RequestLoad("i1-r1", 100), RequestLoad("i1-r2", 100)),
)
I2 = InstanceLoad("i2", 1000, 0, warming_up=True)
LOADS = [I0, I1, I2]


def test_table() -> None:
    assert [instance_virtual_usage(x, CFG) for x in LOADS] == [990.0, 528.0, -512.0]
    assert [freeness(x, CFG) for x in LOADS] == pytest.approx([10 / 6, 472 / 3, 1512.0])


def test_domain_summary() -> None:
    s = summarize_domain("d", LOADS, CFG)
    assert (s.capacity_blocks, s.virtual_usage, s.num_running) == (3000, 1006.0, 9)
    assert s.freeness == pytest.approx(1994 / 9)
    assert (s.largest_free_blocks, s.max_instance_capacity_blocks) == (1000, 1000)


def test_dispatch() -> None:
    v = DispatchView(LOADS, CFG, random.Random(0))
    assert v.pick(60).target_id == "i2"
    assert v.freeness("i2") == 1452.0
    assert v.pick(60).target_id == "i2"
    assert v.freeness("i2") == 696.0


def test_migration_and_after() -> None:
    decisions = plan_migrations(LOADS, CFG, random.Random(0))
    assert [(d.src_id, d.dst_id, d.request_id, d.blocks) for d in decisions] == [("i0", "i2", "i0-r5", 140)]
    after = apply_move(LOADS, decisions[0])
    assert instance_virtual_usage(after[0], CFG) == 850.0
    assert freeness(after[0], CFG) == 30.0
    assert after[0].free_blocks == 250
    assert potential(instance_virtual_usage(x, CFG) for x in LOADS) == 1_521_028
    assert potential(instance_virtual_usage(x, CFG) for x in after) == 1_139_668
    assert plan_migrations(after, CFG, random.Random(0)) == []
