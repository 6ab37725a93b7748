"""etcd records (JSON codec, validation) and the pure approver: candidates, link budgets, choice."""

from __future__ import annotations

import math

import pytest

from clusterstate.records import (
    DrainIntent,
    DrainKind,
    InstanceRegistration,
    MigrationRecord,
    MigrationState,
    RecordError,
    SummaryRecord,
    decode,
    encode,
)
from global_coord.approver import (
    Judgement,
    MoveProposal,
    busiest_link_flows,
    candidate_destinations,
    choose_destination,
    link_flows,
)


def _summary(domain_id: str, freeness: float, largest_free_blocks: int, draining: bool = False) -> SummaryRecord:
    return SummaryRecord(domain_id, 2, 2000, 100.0, freeness, largest_free_blocks, 1000, 3, 0, draining)


def _mig(mid: str, state: MigrationState, links: tuple[str, ...]) -> MigrationRecord:
    return MigrationRecord(mid, mid, 0, "a0", "b0", "A", "B", 10, state, 5, links)


def _move(dst: str = "", blocks: int = 100) -> MoveProposal:
    return MoveProposal("A", "req-1", 0, "a0", dst, blocks, 1600, 500, 0.02)


def test_records_round_trip_including_infinite_usage() -> None:
    s = SummaryRecord("d0", 8, 8000, math.inf, -math.inf, 0, 1000, 5, 2, True)
    m = _mig("r#1", MigrationState.APPROVED, ("nic:n0", "tor:r0"))
    d = DrainIntent(DrainKind.DOMAIN, "d0", "maintenance", 42)
    assert decode(SummaryRecord, encode(s), "k") == s
    assert decode(MigrationRecord, encode(m), "k") == m
    assert decode(DrainIntent, encode(d), "k") == d
    assert encode(m).startswith(b'{"attempt":0,"blocks":10,')  # sorted keys: byte-stable values


def test_decode_names_key_and_field() -> None:
    with pytest.raises(RecordError, match=r"/p/instances/i0: capacity_blocks: expected an integer, got '9'"):
        decode(
            InstanceRegistration,
            b'{"instance_id":"i0","domain_id":"d","node_id":"n","address":"h:1","model":"m","capacity_blocks":"9"}',
            "/p/instances/i0",
        )
    with pytest.raises(RecordError, match=r"k: missing field 'domain_id'"):
        decode(InstanceRegistration, b'{"instance_id":"i0"}', "k")
    with pytest.raises(RecordError, match=r"k: state: unknown migration state 'done'"):
        decode(MigrationRecord, encode(_mig("x", MigrationState.PROPOSED, ())).replace(b"proposed", b"done"), "k")
    with pytest.raises(RecordError, match="k: not JSON"):
        decode(DrainIntent, b"{", "k")


def test_move_proposal_validation_lists_every_problem() -> None:
    with pytest.raises(ValueError, match=r"request_id is empty; blocks must be >= 0, got -1; decode_step_s"):
        MoveProposal("A", "", 0, "a0", "", -1, 0, 0, 0.0)


def test_link_flows_count_only_active_migrations() -> None:
    flows = link_flows(
        [
            _mig("1", MigrationState.APPROVED, ("l1", "l2")),
            _mig("2", MigrationState.PROPOSED, ("l2",)),
            _mig("3", MigrationState.COMMITTED, ("l1", "l2")),
            _mig("4", MigrationState.ABORTED, ("l3",)),
        ]
    )
    assert dict(flows) == {"l1": 1, "l2": 2}
    assert busiest_link_flows(("l1", "l3"), flows) == 1
    assert busiest_link_flows(("l2", "l1"), flows) == 2
    assert busiest_link_flows((), flows) == 0


def test_candidates_by_freeness_skip_own_draining_and_full_domains() -> None:
    instances = {
        i.instance_id: i
        for i in [
            InstanceRegistration("a0", "A", "n0", "h:1", "m", 1000),
            InstanceRegistration("b0", "B", "n1", "h:2", "m", 1000),
            InstanceRegistration("b1", "B", "n1", "h:3", "m", 1000),
            InstanceRegistration("c0", "C", "n2", "h:4", "m", 1000),
            InstanceRegistration("d0", "D", "n3", "h:5", "m", 1000),
            InstanceRegistration("e0", "E", "n4", "h:6", "m", 1000),
            InstanceRegistration("f0", "F", "n5", "h:7", "m", 1000),
        ]
    }
    summaries = {
        "A": _summary("A", 50.0, 900),
        "B": _summary("B", 10.0, 500),
        "C": _summary("C", 30.0, 500),
        "D": _summary("D", 90.0, 50),  # freest, but no single instance fits 100 blocks
        "E": _summary("E", 95.0, 900, draining=True),
    }  # F has no summary yet: tried last
    drains = {(DrainKind.INSTANCE, "b1"): DrainIntent(DrainKind.INSTANCE, "b1")}
    assert candidate_destinations(_move(), "A", instances, summaries, drains) == ["c0", "b0", "f0"]
    assert candidate_destinations(_move(dst="b0"), "A", instances, summaries, drains) == ["b0"]
    assert candidate_destinations(_move(dst="b1"), "A", instances, summaries, drains) == []


class _PathInfo:
    def __init__(self, links: tuple[str, ...]) -> None:
        self.bandwidth_bytes_per_s = 1e9
        self.links = links
        self.same_domain = False


def test_choose_takes_first_approved_and_reports_last_rejection() -> None:
    paths = {"b0": ("l1",), "c0": ("l2",)}
    seen: list[tuple[str, int]] = []

    def judge(move: MoveProposal, dst: str, path: _PathInfo, busiest: int) -> Judgement:
        seen.append((dst, busiest))
        if busiest >= 1:
            return Judgement(False, "link budget full")
        return Judgement(True, "ok", 0.5, 0.01)

    choice = choose_destination(_move(), ["b0", "c0"], lambda s, d: _PathInfo(paths[d]), judge, {"l1": 1})
    assert choice.dst_instance_id == "c0"
    assert choice.judgement == Judgement(True, "ok", 0.5, 0.01)
    assert seen == [("b0", 1), ("c0", 0)]
    none = choose_destination(_move(), ["b0"], lambda s, d: _PathInfo(paths[d]), judge, {"l1": 1})
    assert none.dst_instance_id is None
    assert none.judgement.reason == "b0: link budget full"
    empty = choose_destination(_move(), [], lambda s, d: _PathInfo(()), judge, {})
    assert empty.judgement.reason.startswith("no destination")
