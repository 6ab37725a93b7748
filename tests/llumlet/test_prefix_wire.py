"""Prefix hashes across the wire: a llumlet's LoadReport (held hashes, capped; each running request's; the hit
counters), the domain scheduler's InstanceLoad of it, and the coordinator's InstanceBrief / DomainSummary
messages. Every field of each value crosses, both ways."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from global_coord.convert import summary, summary_from_pb
from hilum_proto.v1 import coordinator_pb2 as cpb
from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.convert import load_from_pb, load_to_pb, reported_prefix
from llumlet.engine.types import EngineLoad, RunningRequestLoad
from policy.domain import DomainSummary, InstanceBrief
from policy.summarize import summarize_domain
from policy.types import PolicyConfig
from rack_sched.convert import load_from_pb as rack_load_from_pb

HELD = frozenset({11, 22, 33, 44, 55})


def _load(**more: object) -> EngineLoad:
    running = (
        RunningRequestLoad("a", 6, 0, 100, True, 4, 50, 10, "", (33, 44)),
        RunningRequestLoad("b", 2, 1, 20, False, 0, 8, 2, "", ()),
    )
    values: dict[str, object] = dict(
        total_blocks=100,
        used_blocks=8,
        reserved_blocks=3,
        cached_blocks=4,
        running=running,
        num_waiting=1,
        head_demand_blocks=2,
        queued_demand_blocks=5,
        preempting=True,
        num_suspended=1,
        max_num_seqs=16,
        prefix_hashes=HELD,
        prefix_block_tokens=64,
        prefix_hit_tokens=640,
        prefix_query_tokens=1000,
        prefill_s_per_token=2.5e-5,
    )
    values.update(more)
    return EngineLoad(**values)  # type: ignore[arg-type]


def test_every_field_of_an_engine_load_crosses_the_load_report() -> None:
    load = _load()
    defaults = EngineLoad(1, 0, 0, 0)
    unset = [f.name for f in dataclasses.fields(EngineLoad) if getattr(load, f.name) == getattr(defaults, f.name)]
    assert unset == [], f"the fixture leaves {unset} at their defaults: a dropped field would not show"
    assert load_from_pb(load_to_pb(load, "i", "d")) == load


def test_the_domain_scheduler_sees_the_held_hashes_and_each_requests_prefix() -> None:
    inst = rack_load_from_pb(load_to_pb(_load(), "i", "d"), "i", "d")
    assert inst.prefix_hashes == HELD and inst.prefix_block_tokens == 64
    assert [r.prefix_hashes for r in inst.running] == [(33, 44), ()]
    assert inst.prefill_s_per_token == 2.5e-5  # the engine's prefill estimate reaches the rule book's load
    none = rack_load_from_pb(load_to_pb(_load(prefix_hashes=frozenset(), prefix_block_tokens=0), "i", "d"), "i", "d")
    assert none.prefix_hashes == frozenset() and none.prefix_block_tokens == 0
    bad = load_to_pb(_load(), "i", "d")
    bad.prefix_block_tokens = 0
    with pytest.raises(ValueError, match="load report of i: 5 prefix_hashes but prefix_block_tokens is 0"):
        rack_load_from_pb(bad, "i", "d")
    bad = load_to_pb(_load(), "i", "d")
    bad.prefill_s_per_token = float("nan")
    with pytest.raises(ValueError, match="load report of i: prefill_s_per_token must be a finite number >= 0"):
        rack_load_from_pb(bad, "i", "d")


def test_the_cap_keeps_the_hashes_of_running_requests_first() -> None:
    load = _load()
    assert sorted(reported_prefix(load, None)) == sorted(HELD) == sorted(reported_prefix(load, 5))
    assert reported_prefix(load, 2) == [33, 44]  # in use now: the most recently used
    three = reported_prefix(load, 3)
    assert three[:2] == [33, 44] and len(three) == 3 and set(three) <= HELD
    assert reported_prefix(load, 0) == []
    msg = load_to_pb(load, "i", "d", max_hashes=1)
    assert list(msg.prefix_hashes) == [33] and list(msg.running[0].prefix_hashes) == [33]
    assert list(load_to_pb(load, "i", "d", max_hashes=0).prefix_hashes) == []
    assert load_to_pb(load, "i", "d", max_hashes=0).prefix_block_tokens == 0


def test_domain_summaries_carry_each_instances_hashes_through_the_coordinator_api() -> None:
    loads = [
        rack_load_from_pb(load_to_pb(_load(), "i0", "d"), "i0", "d"),
        rack_load_from_pb(load_to_pb(_load(prefix_hashes=frozenset({99})), "i1", "d"), "i1", "d"),
    ]
    s = summarize_domain("d", loads, PolicyConfig(), model="m", taken_s=3.0)
    assert s.prefix_hashes == HELD | {99}
    back = summary_from_pb(summary(s))
    assert back == s and [b.prefix_hashes for b in back.instances] == [HELD, frozenset({99})]
    assert [b.prefill_s_per_token for b in back.instances] == [2.5e-5, 2.5e-5]  # the engines' prefill estimates
    bare = DomainSummary("e", 0, 0, 0.0, 0.0, 0, 0, 0, 0, False, prefix_hashes=frozenset({7}))
    assert summary_from_pb(summary(bare)).prefix_hashes == frozenset({7})  # no instances: as published


@pytest.mark.parametrize(("value", "message"), [(InstanceBrief, cpb.InstanceBrief), (DomainSummary, cpb.DomainSummary)])
def test_every_field_of_the_summary_values_has_its_message_field(value: type, message: Any) -> None:
    names = {f.name for f in dataclasses.fields(value)}
    assert names <= set(message.DESCRIPTOR.fields_by_name), names - set(message.DESCRIPTOR.fields_by_name)


def test_every_field_of_the_engine_load_has_its_load_report_field() -> None:
    names = {f.name for f in dataclasses.fields(EngineLoad)} - {"running"}
    wire = set(pb.LoadReport.DESCRIPTOR.fields_by_name) | {"total_blocks"}
    assert names <= wire, names - wire
    assert {f.name for f in dataclasses.fields(RunningRequestLoad)} <= set(pb.RunningRequest.DESCRIPTOR.fields_by_name)


def test_a_cross_domain_proposal_carries_the_requests_prefix_to_the_coordinator() -> None:
    """The coordinator prices a move with how many of its leading prefix hash blocks the destination holds: the
    proposal's hashes cross MigrationProposal, every field both ways."""
    from global_coord.approver import MoveProposal
    from global_coord.convert import move_proposal, move_proposal_from_pb

    move = MoveProposal(
        "d0", "r", 3, "a0", "b1", 40, 630, 100, 0.03, model="m", max_blocks=60, dst_domain_id="d1",
        prefix_hashes=(5, 6, 7), prefix_block_tokens=64,
    )  # fmt: skip
    defaults = {f.name: f.default for f in dataclasses.fields(MoveProposal)}
    assert [n for n, d in defaults.items() if getattr(move, n) == d] == []  # every field set: a drop would show
    assert move_proposal_from_pb(move_proposal(move)) == move
    assert set(defaults) <= set(cpb.MigrationProposal.DESCRIPTOR.fields_by_name)
