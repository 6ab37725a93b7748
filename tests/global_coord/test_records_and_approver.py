"""etcd records (JSON codec, validation) and the pure approver: candidates, link budgets, choice."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import replace

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
from policy.domain import DomainSummary, InstanceBrief
from topology.bandwidth import BandwidthKey


def _brief(
    instance_id: str, free: int, running: int = 1, capacity: int = 1000, draining: bool = False
) -> InstanceBrief:
    return InstanceBrief(instance_id, capacity, free, float(capacity - free), running, 0, draining)


def _summary(domain_id: str, *briefs: InstanceBrief, draining: bool = False, model: str = "m") -> DomainSummary:
    capacity = sum(b.capacity_blocks for b in briefs)
    usage = sum(b.virtual_usage for b in briefs)
    running = sum(b.num_running for b in briefs)
    return DomainSummary(
        domain_id,
        len(briefs),
        capacity,
        usage,
        (capacity - usage) / max(1, running),
        max((b.free_blocks for b in briefs), default=0),
        max((b.capacity_blocks for b in briefs), default=0),
        running,
        0,
        draining,
        model=model,
        instances=tuple(briefs),
    )


def _mig(mid: str, state: MigrationState, links: tuple[str, ...]) -> MigrationRecord:
    return MigrationRecord(mid, mid, 0, "a0", "b0", "A", "B", 10, state, 5, links)


def _move(dst: str = "", blocks: int = 100, max_blocks: int = 0, paired: str = "") -> MoveProposal:
    return MoveProposal(
        "A", "req-1", 0, "a0", dst, blocks, 1600, 500, 0.02, model="m", max_blocks=max_blocks, dst_domain_id=paired
    )


def test_records_round_trip_including_infinite_usage() -> None:
    s = SummaryRecord("d0", (DomainSummary("d0", 8, 8000, math.inf, -math.inf, 0, 1000, 5, 2, True),))
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
    with pytest.raises(RecordError, match=r"k: state: expected one of 'proposed', .* got 'done'"):
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


def test_candidates_by_instance_freeness_skip_own_draining_full_and_other_models() -> None:
    summaries = [
        _summary("A", _brief("a1", 900)),  # the proposer's own domain
        _summary("B", _brief("b0", 500, running=2), _brief("b1", 900, running=1)),
        _summary("C", _brief("c0", 700, running=1)),
        _summary("D", _brief("d0", 50, running=0)),  # freest by F, but no room for 100 blocks
        _summary("E", _brief("e0", 1000, running=0), draining=True),
        _summary("G", _brief("g0", 1000, running=0), model="other"),  # serves another model
        _summary("H", _brief("h0", 1000, running=0, capacity=1000), _brief("h1", 150, running=0, capacity=150)),
    ]
    drained = lambda iid, did: iid == "b1"  # noqa: E731 - a drain intent names b1
    move = _move(max_blocks=200)
    # F: h0 1000, c0 700, b0 250; b1 drained; h1 cannot hold what the request may grow to (200 > 150)
    assert candidate_destinations(move, "A", summaries, drained) == ["h0", "c0", "b0"]
    assert candidate_destinations(_move(dst="b0"), "A", summaries, drained) == ["b0"]
    assert candidate_destinations(_move(dst="b1"), "A", summaries, drained) == []
    assert candidate_destinations(move, "A", summaries, drained, registered={"c0", "b0"}) == ["c0", "b0"]


def test_a_full_instance_is_never_chosen_next_to_an_empty_one() -> None:
    # issue 10: the coordinator ranked by domain freeness and instance id, so it chose a 1000/1000-block
    # instance next to an empty one; the Reserve failed, the request cooled down, and the same pick repeated.
    summaries = [_summary("B", _brief("b0", 0, running=8), _brief("b1", 1000, running=0))]
    assert candidate_destinations(_move(), "A", summaries) == ["b1"]


def test_an_instance_without_a_batch_slot_for_one_more_is_no_candidate() -> None:
    # b0 is the freest (F 900) but runs 2 of 2 slots; b1 (F 450) has a slot. Before the engines reported
    # their slots (max_num_seqs 0), b0 was chosen and the request would have waited there without a slot
    full = replace(_brief("b0", 900, running=2), max_num_seqs=2)
    roomy = replace(_brief("b1", 900, running=2), free_blocks=450, virtual_usage=550.0, max_num_seqs=4)
    assert not full.takes_one_more and roomy.takes_one_more
    assert candidate_destinations(_move(), "A", [_summary("B", full, roomy)]) == ["b1"]
    unknown = replace(full, max_num_seqs=0)
    assert candidate_destinations(_move(), "A", [_summary("B", unknown, roomy)]) == ["b0", "b1"]
    queued = replace(roomy, num_running=3, num_waiting=1)  # 3 + 1 + its own queue's head > 4
    assert candidate_destinations(_move(), "A", [_summary("B", queued)]) == []


def test_the_paired_domain_wins_among_equals() -> None:
    summaries = [_summary("B", _brief("b0", 800)), _summary("C", _brief("c0", 800))]
    assert candidate_destinations(_move(), "A", summaries) == ["b0", "c0"]
    assert candidate_destinations(_move(paired="C"), "A", summaries) == ["c0", "b0"]


class _PathInfo:
    def __init__(self, links: tuple[str, ...]) -> None:
        self.bandwidth_bytes_per_s = 1e9
        self.links = links
        self.same_domain = False


def test_choose_takes_first_approved_and_reports_last_rejection() -> None:
    paths = {"b0": ("l1",), "c0": ("l2",)}
    seen: list[tuple[str, int]] = []

    def judge(
        move: MoveProposal,
        dst: str,
        path: _PathInfo,
        busiest: int,
        measured: float | None = None,
        on_dst: int = 0,
        prefill_s_per_token: float = 0.0,
    ) -> Judgement:
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


class _LookupsOnly(Mapping[BandwidthKey, float]):
    """Measured rates that may only be looked up (as a lazy ``BandwidthEstimates.at`` view is meant to be)."""

    def __init__(self, rates: dict[BandwidthKey, float]) -> None:
        self.rates = rates
        self.looked_up: list[BandwidthKey] = []

    def __getitem__(self, key: BandwidthKey) -> float:
        self.looked_up.append(key)
        return self.rates[key]

    def __iter__(self) -> Iterator[BandwidthKey]:
        raise AssertionError("choose_destination iterated over every measured path")

    def __len__(self) -> int:
        raise AssertionError("choose_destination computed every measured path (len / bool)")


def test_choose_prices_each_candidate_with_its_paths_measured_rate_looking_up_only_that() -> None:
    paths = {"b0": ("l1",), "c0": ("l2",)}
    priced: list[tuple[str, float | None]] = []

    def judge(
        move: MoveProposal,
        dst: str,
        path: _PathInfo,
        busiest: int,
        measured: float | None = None,
        on_dst: int = 0,
        prefill_s_per_token: float = 0.0,
    ) -> Judgement:
        priced.append((dst, measured))
        return Judgement(dst == "c0", "ok" if dst == "c0" else "slow")

    measured = _LookupsOnly({("grpc", ("l1",)): 1e6})  # c0's path has no measurement
    choice = choose_destination(_move(), ["b0", "c0"], lambda s, d: _PathInfo(paths[d]), judge, {}, measured=measured)
    assert choice.dst_instance_id == "c0"
    assert priced == [("b0", 1e6), ("c0", None)]
    assert measured.looked_up == [("grpc", ("l1",)), ("grpc", ("l2",))]
