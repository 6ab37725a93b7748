"""Per-instance load inside a domain summary (what `hilumctl instances` and `drain --wait` read)."""

from __future__ import annotations

import math

import pytest

from clusterstate.records import InstanceLoadRecord, RecordError, SummaryRecord, decode, encode
from policy.domain import summarize_domain
from policy.types import InstanceLoad, PolicyConfig, RequestLoad


def test_summary_with_instance_loads_round_trips() -> None:
    s = SummaryRecord(
        "d0", 2, 0, math.inf, -math.inf, 0, 0, 3, 1, True,
        (InstanceLoadRecord("d0-a", 800, 2, 1, True), InstanceLoadRecord("d0-b", 96, 1, 0, True)),
    )  # fmt: skip
    raw = encode(s)
    assert (
        b'"instances":[{"draining":true,"instance_id":"d0-a","num_running":2,"num_waiting":1,"used_blocks":800}' in raw
    )
    assert decode(SummaryRecord, raw, "k") == s
    # a summary written without per-instance load (older publishers) still decodes
    old = b'{"capacity_blocks":10,"domain_id":"d1","draining":false,"freeness":1.0,"largest_free_blocks":5,'
    old += b'"max_instance_capacity_blocks":10,"num_instances":1,"num_running":0,"num_waiting":0,"virtual_usage":2.0}'
    assert decode(SummaryRecord, old, "k").instances == ()


def test_summary_of_a_policy_summary_and_its_loads() -> None:
    cfg = PolicyConfig()
    loads = [
        InstanceLoad("d0-b", 1000, 300, running=(RequestLoad("r1", 200), RequestLoad("r2", 100)), num_waiting=1),
        InstanceLoad("d0-a", 1000, 0, draining=True),
    ]
    record = SummaryRecord.of(summarize_domain("d0", loads, cfg), loads)
    assert record.instances == (
        InstanceLoadRecord("d0-a", 0, 0, 0, True),  # sorted by instance id
        InstanceLoadRecord("d0-b", 300, 2, 1, False),
    )
    assert (record.num_instances, record.num_running, record.num_waiting) == (2, 2, 1)


def test_bad_instance_loads_are_rejected_with_the_key() -> None:
    with pytest.raises(ValueError, match=r"instances must be sorted by id, no repeats, got \['b', 'a'\]"):
        SummaryRecord("d", 2, 0, 0.0, 0.0, 0, 0, 0, 0, False,
                      (InstanceLoadRecord("b", 0, 0, 0, False), InstanceLoadRecord("a", 0, 0, 0, False)))  # fmt: skip
    base = b'"capacity_blocks":10,"domain_id":"d","draining":false,"freeness":1.0,"largest_free_blocks":5,'
    base += b'"max_instance_capacity_blocks":10,"num_instances":1,"num_running":0,"num_waiting":0,"virtual_usage":2.0'
    bad = b"{" + base + b',"instances":[{"instance_id":"a","used_blocks":"9","num_running":0,"num_waiting":0,'
    bad += b'"draining":false}]}'
    with pytest.raises(RecordError, match=r"/p/summaries/d: instances\[0\]: used_blocks: expected an integer"):
        decode(SummaryRecord, bad, "/p/summaries/d")
    with pytest.raises(RecordError, match=r"k: instances: expected a list"):
        decode(SummaryRecord, b"{" + base + b',"instances":{}}', "k")
    twice = (
        b"{"
        + base
        + b',"instances":['
        + b",".join([b'{"instance_id":"a","used_blocks":0,"num_running":0,"num_waiting":0,"draining":false}'] * 2)
        + b"]}"
    )
    with pytest.raises(RecordError, match=r"k: summary of d: instances must be sorted"):
        decode(SummaryRecord, twice, "k")
