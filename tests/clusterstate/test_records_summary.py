"""A domain's published summaries in etcd: the rule book's own DomainSummary, every field, both ways."""

from __future__ import annotations

import json
import math

import pytest

from clusterstate.records import RecordError, SummaryRecord, decode, encode
from policy.domain import DomainSummary, InstanceBrief
from policy.load import InstanceLoad, RequestLoad
from policy.summarize import summarize_domain
from policy.types import PolicyConfig


def _record() -> SummaryRecord:
    cfg = PolicyConfig()
    loads = [
        InstanceLoad(
            "d0-b",
            1000,
            300,
            running=(RequestLoad("r1", 200), RequestLoad("r2", 100)),
            num_waiting=2,
            head_demand_blocks=30,
            queued_demand_blocks=50,
            decode_step_s=0.031,
            prefill_s_per_token=2.5e-5,
        ),
        InstanceLoad("d0-a", 1000, 0, draining=True),
    ]
    return SummaryRecord("d0", (summarize_domain("d0", loads, cfg, model="llama-2-7b", taken_s=12.5),))


def test_every_field_of_the_summary_survives_etcd() -> None:
    record = _record()
    (s,) = record.summaries
    assert s.queued_blocks == 20  # the demand behind each head of line: kept (it was dropped before)
    assert (s.model, s.taken_s) == ("llama-2-7b", 12.5)
    assert [b.instance_id for b in s.instances] == ["d0-a", "d0-b"]  # sorted by instance id
    assert s.instances[1] == InstanceBrief("d0-b", 1000, 700, 330.0, 2, 2, False, 0.031, prefill_s_per_token=2.5e-5)
    assert s.instances[0].draining and s.instances[0].freeness == -math.inf
    raw = encode(record)
    assert decode(SummaryRecord, raw, "k") == record
    assert record.instances()["d0-b"].used_blocks == 300
    assert record.of_model("llama-2-7b") is s and record.of_model("other") is None


def test_infinite_usage_of_a_draining_domain_round_trips() -> None:
    loads = [InstanceLoad("a", 100, 10, draining=True)]
    record = SummaryRecord("d", (summarize_domain("d", loads, PolicyConfig(), model="m"),))
    back = decode(SummaryRecord, encode(record), "k")
    assert back.summaries[0].virtual_usage == math.inf and back.summaries[0].freeness == -math.inf
    assert back == record


def test_the_prefix_union_is_stored_once_in_the_instances_and_derived_again() -> None:
    cfg = PolicyConfig()
    loads = [
        InstanceLoad("a", 100, 0, prefix_hashes=frozenset({1, 2}), prefix_block_tokens=512),
        InstanceLoad("b", 100, 0, prefix_hashes=frozenset({2, 3}), prefix_block_tokens=512),
    ]
    record = SummaryRecord("d", (summarize_domain("d", loads, cfg, model="m"),))
    assert record.summaries[0].prefix_hashes == {1, 2, 3}
    raw = json.loads(encode(record))
    (stored,) = raw["summaries"]
    assert "prefix_hashes" not in stored  # derived from the instances' own lists
    assert [b["prefix_hashes"] for b in stored["instances"]] == [[1, 2], [2, 3]]
    assert decode(SummaryRecord, encode(record), "k") == record
    # a summary without instances (a stand-in) keeps its own list; one with instances ignores what is given
    bare = DomainSummary("e", 1, 100, 0.0, 100.0, 100, 100, 0, 0, False, prefix_hashes=frozenset({7}))
    assert json.loads(encode(SummaryRecord("e", (bare,))))["summaries"][0]["prefix_hashes"] == [7]
    assert decode(SummaryRecord, encode(SummaryRecord("e", (bare,))), "k").summaries[0].prefix_hashes == {7}
    given = DomainSummary(**{**_fields(record.summaries[0]), "prefix_hashes": frozenset({9})})
    assert given.prefix_hashes == {1, 2, 3}


def _fields(summary: DomainSummary) -> dict[str, object]:
    return {f: getattr(summary, f) for f in DomainSummary.__dataclass_fields__}


def test_bad_summaries_are_rejected_naming_the_key_and_field() -> None:
    raw = json.loads(encode(_record()))
    raw["summaries"][0]["instances"][1]["free_blocks"] = "9"
    with pytest.raises(
        RecordError, match=r"/p/summaries/d0: summaries\[0\]: instances\[1\]: free_blocks: expected an integer"
    ):
        decode(SummaryRecord, json.dumps(raw).encode(), "/p/summaries/d0")
    raw = json.loads(encode(_record()))
    raw["summaries"][0]["instances"][1]["num_running"] = True
    with pytest.raises(RecordError, match=r"num_running: expected an integer, got True"):
        decode(SummaryRecord, json.dumps(raw).encode(), "k")
    raw = json.loads(encode(_record()))
    raw["summaries"] = {}
    with pytest.raises(RecordError, match=r"k: summaries: expected a list"):
        decode(SummaryRecord, json.dumps(raw).encode(), "k")
    raw = json.loads(encode(_record()))
    raw["summaries"][0]["instances"].reverse()
    with pytest.raises(RecordError, match=r"instances must be sorted by id without repeats"):
        decode(SummaryRecord, json.dumps(raw).encode(), "k")
    raw = json.loads(encode(_record()))
    raw["summaries"][0]["surprise"] = 1
    with pytest.raises(RecordError, match=r"unknown fields \['surprise'\] for DomainSummary"):
        decode(SummaryRecord, json.dumps(raw).encode(), "k")


def test_one_record_holds_one_summary_per_model() -> None:
    a = DomainSummary("d", 1, 10, 0.0, 10.0, 10, 10, 0, 0, False, model="a")
    b = DomainSummary("d", 1, 10, 0.0, 10.0, 10, 10, 0, 0, False, model="b")
    assert SummaryRecord("d", (a, b)).of_model("b") == b
    with pytest.raises(ValueError, match=r"models must be sorted without repeats, got \['b', 'a'\]"):
        SummaryRecord("d", (b, a))
    with pytest.raises(ValueError, match="one summary names domain 'x'"):
        SummaryRecord("d", (DomainSummary("x", 1, 10, 0.0, 10.0, 10, 10, 0, 0, False),))
