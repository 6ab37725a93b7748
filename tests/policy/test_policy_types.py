from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest

from policy import CANDIDATE_POLICIES, InstanceLoad, PolicyConfig, RequestLoad, candidate_order


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_blocks": 0}, "capacity_blocks must be > 0, got 0"),
        ({"used_blocks": -1}, "used_blocks must be >= 0, got -1"),
        ({"used_blocks": 101}, "used_blocks 101 exceeds capacity_blocks 100"),
        ({"num_waiting": -2}, "num_waiting must be >= 0, got -2"),
        ({"head_demand_blocks": 5}, "head_demand_blocks is 5 but num_waiting is 0"),
        ({"head_demand_blocks": -1, "num_waiting": 1}, "head_demand_blocks must be >= 0"),
    ],
)
def test_instance_load_rejects_bad_values(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"capacity_blocks": 100, "used_blocks": 0} | kwargs
    with pytest.raises(ValueError, match=rf"InstanceLoad\('i0'\): {message}"):
        InstanceLoad("i0", **fields)


def test_instance_load_rejects_repeated_request_ids() -> None:
    r = RequestLoad("r1", 4)
    with pytest.raises(ValueError, match=r"running request ids repeat: \['r1'\]"):
        InstanceLoad("i0", 100, 8, (r, r))


def test_instance_load_free_blocks_and_tuple_running() -> None:
    load = InstanceLoad("i0", 100, 30, [RequestLoad("r1", 30)])
    assert load.free_blocks == 70
    assert load.running == (RequestLoad("r1", 30),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": -1}, "blocks must be >= 0, got -1"),
        ({"priority": -1}, "priority must be >= 0, got -1"),
        ({"num_tokens": -3}, "num_tokens must be >= 0, got -3"),
    ],
)
def test_request_load_rejects_negative_counts(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"blocks": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        RequestLoad("r1", **fields)


def test_ids_must_be_non_empty() -> None:
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        RequestLoad("", 1)
    with pytest.raises(ValueError, match="instance_id must be a non-empty string"):
        InstanceLoad("", 10, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_usage_blocks": 10}, "warmup_usage_blocks: must be <= 0"),
        ({"tie_tolerance": 1.0}, r"tie_tolerance: must be in \[0, 1\)"),
        ({"tie_tolerance": float("nan")}, "tie_tolerance"),
        ({"migrate_out_freeness_below": float("inf")}, "migrate_out_freeness_below: must be finite"),
        ({"migrate_out_freeness_below": 5.0, "migrate_in_freeness_above": 4.0}, "could be both source"),
        ({"candidate_policy": "fifo"}, "unknown policy 'fifo'; known: priority-then-size, shortest, longest"),
        ({"max_migrations_per_round": -1}, "max_migrations_per_round: must be >= 0"),
        ({"priority_headroom_blocks": {0: 10}}, r"priority_headroom_blocks\[0\]: priority class must be"),
        ({"priority_headroom_blocks": {1: -10}}, r"priority_headroom_blocks\[1\]: blocks must be"),
    ],
)
def test_policy_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


def test_policy_config_is_frozen_hashable_and_copies_headroom() -> None:
    headroom = {2: 64, 1: 32}
    cfg = PolicyConfig(priority_headroom_blocks=headroom)
    headroom[1] = 999
    assert cfg.headroom_blocks(1) == 32
    assert cfg.headroom_blocks(2) == 64
    assert cfg.headroom_blocks(0) == 0
    assert cfg.headroom_blocks(7) == 0
    assert cfg == PolicyConfig(priority_headroom_blocks={1: 32, 2: 64})
    assert hash(cfg) == hash(PolicyConfig(priority_headroom_blocks={1: 32, 2: 64}))
    with pytest.raises(TypeError):
        cfg.priority_headroom_blocks[1] = 0  # type: ignore[index]


def test_candidate_order_factory_knows_every_policy_and_rejects_others() -> None:
    assert all(callable(candidate_order(name)) for name in CANDIDATE_POLICIES)
    with pytest.raises(ValueError, match="unknown candidate policy 'lifo'; known: priority-then-size"):
        candidate_order("lifo")


def test_candidate_orders() -> None:
    big = RequestLoad("a", 50)
    small = RequestLoad("b", 10)
    high = RequestLoad("c", 5, priority=1)
    tie = RequestLoad("d", 10)
    reqs = [big, small, high, tie]
    assert candidate_order("priority-then-size")(reqs, False) == [small, tie, big, high]
    assert candidate_order("priority-then-size")(reqs, True) == [high, small, tie, big]
    assert candidate_order("shortest")(reqs, False) == [high, small, tie, big]
    assert candidate_order("longest")(reqs, False) == [big, small, tie, high]


def test_a_replaced_detailed_load_derives_its_aggregates_again() -> None:
    """``dataclasses.replace`` goes through the written-out ``__init__``: the aggregates follow the new batch."""
    load = InstanceLoad("i0", 100, 30, (RequestLoad("r1", 10, priority=2), RequestLoad("r2", 20)))
    assert load.num_running == 2 and load.priority_counts == ((2, 1),)
    fewer = dataclasses.replace(load, running=(RequestLoad("r2", 20),))
    assert fewer.num_running == 1 and fewer.priority_counts == () and fewer.used_blocks == 30
    assert fewer == InstanceLoad("i0", 100, 30, (RequestLoad("r2", 20),))
    assert fewer != load


def test_a_brief_load_checks_its_aggregates_and_takes_any_iterables() -> None:
    pairs: Any = [[1, 2]]  # lists, as a decoder may give them
    brief = InstanceLoad("i0", 100, 30, num_running=3, priority_counts=pairs, brief=True)
    assert brief.priority_counts == ((1, 2),) and not brief.detailed
    with pytest.raises(ValueError, match=r"InstanceLoad\('i0'\): prefix_hashes lists 1 hash blocks"):
        InstanceLoad("i0", 100, 30, prefix_hashes=[5])
    assert InstanceLoad("i0", 100, 30, prefix_hashes=[5], prefix_block_tokens=16).prefix_hashes == {5}
    with pytest.raises(ValueError, match=r"InstanceLoad\('i0'\): priority_counts \(\(1, 4\),\) count more requests"):
        InstanceLoad("i0", 100, 30, num_running=3, priority_counts=((1, 4),), brief=True)
    with pytest.raises(ValueError, match=r"InstanceLoad\('i0'\): priority_counts must be ascending"):
        InstanceLoad("i0", 100, 30, num_running=3, priority_counts=((2, 1), (1, 1)), brief=True)
    bads: list[Any] = [(("x", 1),), ((1.7, 1),), ((1, 1, 1),), (1,)]
    for bad in bads:  # not int pairs: refused, never truncated
        with pytest.raises(
            ValueError, match=r"InstanceLoad\('i0'\): priority_counts must be \(priority, count\) pairs"
        ):
            InstanceLoad("i0", 100, 30, num_running=3, priority_counts=bad, brief=True)
    with pytest.raises(ValueError, match=r"InstanceLoad\('i0'\): queued_demand_blocks must be >= 0, got -3"):
        InstanceLoad("i0", 100, 30, queued_demand_blocks=-3)
    with pytest.raises(ValueError, match=r"InstanceLoad\('i0'\): a brief report lists no running requests"):
        InstanceLoad("i0", 100, 30, (RequestLoad("r1", 4),), num_running=1, brief=True)
    with pytest.raises(ValueError, match=r"InstanceLoad\('i0'\): decode_step_s must be a finite number >= 0, got nan"):
        InstanceLoad("i0", 100, 30, decode_step_s=float("nan"))
    with pytest.raises(ValueError, match=r"InstanceLoad\('i0'\): queued_demand_blocks 2 is below head_demand_blocks 3"):
        InstanceLoad("i0", 100, 30, num_waiting=1, head_demand_blocks=3, queued_demand_blocks=2)
    with pytest.raises(ValueError, match=r"RequestLoad\('r1'\): max_blocks must be >= 0, got -1"):
        RequestLoad("r1", 4, max_blocks=-1)
    assert RequestLoad("r1", 4, prefix_hashes=[7, 8]).prefix_hashes == (7, 8)


def test_loads_pickle_and_copy_as_equal_values() -> None:
    load = InstanceLoad("i0", 100, 30, (RequestLoad("r1", 10, priority=2, prefix_hashes=(4,)),), decode_step_s=0.02)
    brief = InstanceLoad("i1", 100, 30, num_running=2, priority_counts=((1, 2),), brief=True, prefix_hashes=[9],
                         prefix_block_tokens=16)  # fmt: skip
    for value in (load, brief, load.running[0]):
        assert pickle.loads(pickle.dumps(value)) == value
        assert copy.copy(value) == value and copy.deepcopy(value) == value


@dataclasses.dataclass(frozen=True, slots=True)
class _Plain:
    name: str
    count: int = 3
    tags: tuple[str, ...] = dataclasses.field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count < 0")


@dataclasses.dataclass(frozen=True, slots=True, weakref_slot=True)
class _WithWeakref:  # its slots are not its fields alone: no same-layout twin, each slot set through its descriptor
    name: str
    count: int = 3


@pytest.mark.parametrize("cls", [_Plain, _WithWeakref])
def test_the_trusted_constructor_builds_the_class_itself_without_validation(cls: Any) -> None:
    from policy.types import _trusted_constructor

    make = _trusted_constructor(cls)
    made = make("a", 5)
    assert type(made) is cls and made == cls("a", 5) and hash(made) == hash(cls("a", 5))
    assert make("b") == cls("b")  # the declared default
    assert make(count=7, name="c") == cls("c", 7)  # by keyword
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.count = 1  # still frozen
    assert pickle.loads(pickle.dumps(made)) == made and copy.copy(made) == made
    assert make("d", -1).count == -1  # no __post_init__: the caller vouches for the values
    uses_twin = "_twin" in make.__globals__
    assert uses_twin is (cls is _Plain)


@dataclasses.dataclass(frozen=True, slots=True)
class _WithList:
    name: str
    items: list[int] = dataclasses.field(default_factory=list)


def test_the_trusted_constructor_makes_each_default_factory_value_anew() -> None:
    from policy.types import _trusted_constructor

    make = _trusted_constructor(_WithList)
    first, second = make("a"), make("b")
    assert first.items == [] and second.items == [] and first.items is not second.items
    assert make("c", [1]).items == [1] and type(first) is _WithList
