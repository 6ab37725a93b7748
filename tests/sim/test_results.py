"""sim.results: summaries with hand-computed percentiles and counts, results.json round trip."""

from __future__ import annotations

import array
import dataclasses
import enum
import json
import math
import os
import pickle
import re
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.results as results_module
from sim.results import (
    SCHEMA_VERSION,
    KvTimeline,
    MigrationRecord,
    PolicySummary,
    RequestLog,
    RequestRecord,
    ResultsError,
    ScaleRecord,
    SimRun,
    _request_json,
    atomic_file,
    load_results,
    percentile,
    percentiles,
    results_document,
    stored_policies,
    summarize,
    write_results,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "sim-results.md"


def req(
    request_id: str,
    *,
    arrival_s: float,
    first_token_s: float | None = None,
    finish_s: float | None = None,
    gaps: tuple[float, ...] = (),
    priority: int = 0,
    preemptions: int = 0,
    preempted_s: float = 0.0,
    migrations: int = 0,
    refused: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        priority=priority,
        arrival_s=arrival_s,
        prompt_tokens=100,
        output_tokens=len(gaps) + 1,
        generated_tokens=len(gaps) + 1 if first_token_s is not None else 0,
        first_token_s=first_token_s,
        finish_s=finish_s,
        token_gaps_s=gaps,
        preemptions=preemptions,
        preempted_s=preempted_s,
        migrations=migrations,
        refused=refused,
        instance_id="" if refused else "i0",
    )


def mig(
    src_domain: str, dst_domain: str, *, outcome: str, downtime_s: float, bytes_: int | None, rid: str = "r1"
) -> MigrationRecord:
    return MigrationRecord(
        request_id=rid,
        src_instance_id=f"{src_domain}-i0",
        dst_instance_id=f"{dst_domain}-i1",
        src_domain_id=src_domain,
        dst_domain_id=dst_domain,
        start_s=1.0,
        end_s=1.5,
        downtime_s=downtime_s,
        bytes_transferred=bytes_,
        stages=3,
        outcome=outcome,  # type: ignore[arg-type]
        reason="load_balance" if outcome == "committed" else "destination_full",
    )


def hand_run(**overrides: object) -> SimRun:
    """Four requests and four migrations whose statistics are worked out in the tests below."""
    requests = (
        req("r0", arrival_s=0.0, first_token_s=0.1, finish_s=1.0, gaps=(0.02, 0.04)),
        req(
            "r1",
            arrival_s=1.0,
            first_token_s=1.3,
            finish_s=2.0,
            gaps=(0.03,),
            priority=1,
            preemptions=1,
            preempted_s=0.5,
            migrations=1,
        ),
        req("r2", arrival_s=2.0, first_token_s=2.5, gaps=(0.05, 0.01), preemptions=2, preempted_s=0.25),
        req("r3", arrival_s=3.0, refused="no_capacity"),
    )
    migrations = (
        mig("d0", "d0", outcome="committed", downtime_s=0.002, bytes_=1_000_000),
        mig("d0", "d1", outcome="committed", downtime_s=0.010, bytes_=3_000_000_000),
        mig("d1", "d0", outcome="aborted", downtime_s=0.0, bytes_=500_000_000),
        mig("d1", "d1", outcome="aborted", downtime_s=0.0, bytes_=10),
    )
    fields: dict[str, object] = {
        "policy": "hilum",
        "topology": "2x8-a100",
        "trace": "burstgpt",
        "seed": 7,
        "rate_scale": 1.5,
        "sim_duration_s": 10.0,
        "wall_s": 2.0,
        "engine_steps": 1234,
        "requests": requests,
        "migrations": migrations,
        "kv": KvTimeline(interval_s=1.0, times_s=(0.0, 1.0), usage_fraction={"i0": (0.1, 0.5)}),
        "config": {"migration_interval_s": 0.05, "cap_fraction": 0.2},
    }
    fields.update(overrides)
    return SimRun(**fields)  # type: ignore[arg-type]


def test_request_record_ttft_and_e2e() -> None:
    r = req("a", arrival_s=1.0, first_token_s=1.25, finish_s=3.0)
    assert r.ttft_s == pytest.approx(0.25)
    assert r.e2e_s == pytest.approx(2.0)
    unfinished = req("b", arrival_s=1.0, first_token_s=1.5)
    assert unfinished.e2e_s is None
    assert req("c", arrival_s=1.0, refused="no_capacity").ttft_s is None


def test_migration_record_cross_domain() -> None:
    assert mig("d0", "d1", outcome="committed", downtime_s=0.0, bytes_=0).cross_domain
    assert not mig("d0", "d0", outcome="committed", downtime_s=0.0, bytes_=0).cross_domain


def test_summarize_counts_and_percentiles_by_hand() -> None:
    s = summarize(hand_run())
    assert (s.policy, s.requests, s.finished, s.refused) == ("hilum", 4, 2, 1)
    # TTFTs 0.1, 0.3, 0.5: median 0.3; P99 at rank 0.99*(3-1) = 1.98 -> 0.3 + 0.98*0.2 = 0.496
    assert s.ttft_p50_s == pytest.approx(0.3)
    assert s.ttft_p99_s == pytest.approx(0.496)
    # TBT gaps 0.01..0.05: median 0.03; P99 at rank 3.96 -> 0.04 + 0.96*0.01 = 0.0496
    assert s.tbt_p50_s == pytest.approx(0.03)
    assert s.tbt_p99_s == pytest.approx(0.0496)
    # two finished requests, both 1.0 s end to end; r2 (unfinished) and r3 (refused) left out
    assert s.e2e_p99_s == pytest.approx(1.0)
    # only r1 is high priority
    assert s.high_priority_ttft_p99_s == pytest.approx(0.3)
    assert s.high_priority_ttft_mean_s == pytest.approx(0.3)
    # the normal ones with a first token: 0.1 and 0.5 (mean 0.3; P99 at rank 0.99 -> 0.1 + 0.99*0.4 = 0.496)
    assert s.normal_ttft_mean_s == pytest.approx(0.3)
    assert s.normal_ttft_p99_s == pytest.approx(0.496)
    assert s.preemptions == 3
    assert s.preempted_s == pytest.approx(0.75)


def test_summarize_migrations_split_intra_cross_and_aborted() -> None:
    s = summarize(hand_run())
    assert s.migrations_intra_domain == 1
    assert s.migrations_cross_domain == 1
    assert s.migrations_aborted == 2
    # committed cross (3 GB) + aborted cross (0.5 GB); intra-domain bytes do not count
    assert s.cross_domain_bytes == 3_500_000_000
    # downtime over committed moves only: 2 ms and 10 ms
    assert s.downtime_mean_s == pytest.approx(0.006)
    assert s.downtime_p99_s == pytest.approx(0.002 + 0.99 * 0.008)
    assert (s.sim_duration_s, s.engine_steps, s.wall_s) == (10.0, 1234, 2.0)
    assert s.requests_per_wall_s == pytest.approx(2.0)


def test_a_live_run_leaves_what_it_did_not_measure_unknown() -> None:
    moves = (mig("d0", "d1", outcome="committed", downtime_s=0.03, bytes_=None),)  # a move the gateway saw
    s = summarize(hand_run(engine_steps=None, migrations=moves))
    assert (s.migrations_cross_domain, s.cross_domain_bytes, s.engine_steps) == (1, None, None)
    known = (mig("d0", "d0", outcome="committed", downtime_s=0.0, bytes_=None), *hand_run().migrations)
    assert summarize(hand_run(migrations=known)).cross_domain_bytes == 3_500_000_000  # an intra move's bytes: unused


def test_summarize_empty_run_gives_none_not_nan() -> None:
    s = summarize(hand_run(requests=(), migrations=(), wall_s=0.0, kv=KvTimeline.empty()))
    assert (s.requests, s.finished, s.refused, s.preemptions) == (0, 0, 0, 0)
    for name in (
        "ttft_p50_s",
        "ttft_p99_s",
        "tbt_p50_s",
        "tbt_p99_s",
        "e2e_p99_s",
        "high_priority_ttft_p99_s",
        "high_priority_ttft_mean_s",
        "normal_ttft_mean_s",
        "normal_ttft_p99_s",
        "downtime_mean_s",
        "downtime_p99_s",
        "requests_per_wall_s",
    ):
        assert getattr(s, name) is None, name
    assert s.cross_domain_bytes == 0


def test_summarize_without_high_priority_requests() -> None:
    run = hand_run()
    normal_only = tuple(dataclasses.replace(r, priority=0) for r in run.requests)
    s = summarize(dataclasses.replace(run, requests=normal_only))
    assert s.high_priority_ttft_p99_s is None
    assert s.ttft_p99_s == pytest.approx(0.496)


def test_percentile_edges() -> None:
    assert percentile([], 99) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), max_size=40))
def test_percentiles_ordered_and_within_range(values: list[float]) -> None:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    if not values:
        assert p50 is None and p99 is None
        return
    assert p50 is not None and p99 is not None
    assert min(values) <= p50 <= p99 <= max(values)
    assert p99 == pytest.approx(float(np.percentile(values, 99)))
    # one pass for several q gives each figure to the last bit
    assert percentiles(values, (50, 99)) == (p50, p99)
    assert percentiles(np.asarray(values), (99, 0, 50)) == (p99, percentile(values, 0), p50)
    assert percentiles(values, (q for q in (50, 99))) == (p50, p99)  # any iterable of q, read once


def test_kv_timeline_rejects_series_of_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"usage_fraction\['i1'\] has 1 samples, times_s has 2"):
        KvTimeline(interval_s=1.0, times_s=(0.0, 1.0), usage_fraction={"i0": (0.0, 0.1), "i1": (0.2,)})


def test_stored_policies_reads_the_specs_of_a_results_file_alone(tmp_path: Path) -> None:
    path = write_results([hand_run(), hand_run(policy="round_robin", requests=())], tmp_path / "out")
    assert stored_policies(path) == ["hilum", "round_robin"] == [r.policy for r in load_results(path)]
    assert stored_policies(tmp_path / "missing.json") == []
    (tmp_path / "other.json").write_text('{"spec": {"no_policy": 1}}\n')
    assert stored_policies(tmp_path / "other.json") == []
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe")
    assert stored_policies(tmp_path / "binary.json") == []


def test_write_and_load_round_trip(tmp_path: Path) -> None:
    run = hand_run()
    empty = hand_run(policy="round_robin", requests=(), migrations=(), wall_s=0.0)
    path = write_results([run, empty], tmp_path / "out")
    assert path == tmp_path / "out" / "results.json"
    stored = load_results(path)
    assert [s.summary for s in stored] == [summarize(run), summarize(empty)]
    first = stored[0]
    assert (first.policy, first.topology, first.trace, first.seed, first.rate_scale) == (
        "hilum",
        "2x8-a100",
        "burstgpt",
        7,
        1.5,
    )
    assert dict(first.config) == {"migration_interval_s": 0.05, "cap_fraction": 0.2}
    # token gaps are not stored; everything else of each record is
    assert first.requests == tuple(dataclasses.replace(r, token_gaps_s=()) for r in run.requests)
    assert first.migrations == run.migrations
    assert stored[1].requests == () and stored[1].summary.ttft_p99_s is None


def test_json_layout_has_documented_keys(tmp_path: Path) -> None:
    scaled = dataclasses.replace(hand_run(), scale_events=(ScaleRecord(2.0, "drain", "i1", "fleet freeness ..."),))
    doc = json.loads(write_results([scaled], tmp_path).read_text())
    assert doc["schema_version"] == SCHEMA_VERSION
    run = doc["runs"][0]
    assert set(run) == {"spec", "summary", "requests", "migrations", "scale_events"}
    assert run["scale_events"] == [
        {"at_s": 2.0, "action": "drain", "instance_id": "i1", "reason": "fleet freeness ...", "ok": True, "note": ""}
    ]
    assert set(run["spec"]) == {"policy", "topology", "trace", "seed", "rate_scale", "config"}
    assert set(run["summary"]) == {f.name for f in dataclasses.fields(PolicySummary)}
    request = run["requests"][0]
    assert "token_gaps_s" not in request
    assert request["ttft_s"] == pytest.approx(0.1) and request["e2e_s"] == pytest.approx(1.0)
    assert run["requests"][3]["refused"] == "no_capacity"
    assert run["migrations"][1]["cross_domain"] is True
    assert run["migrations"][0]["cross_domain"] is False
    # every key that appears in the file is documented in docs/sim-results.md
    documented = set(re.findall(r"^\| `([a-z_0-9]+)`", DOC.read_text(), flags=re.MULTILINE))
    keys = set(doc) | set(run) | set(run["spec"]) | set(run["summary"]) | set(request)
    keys |= set(run["migrations"][0]) | set(run["scale_events"][0])
    assert keys - documented == set()


class _Mode(enum.Enum):
    FAST = "fast"


def test_config_values_converted_to_json_and_bad_ones_named(tmp_path: Path) -> None:
    config = {
        "path": Path("/x/y.yaml"),
        "levels": (1, np.int64(2)),
        "mode": _Mode.FAST,
        "cap": math.inf,
    }
    doc = results_document([hand_run(config=config)])
    assert doc["runs"][0]["spec"]["config"] == {
        "path": "/x/y.yaml",
        "levels": [1, 2],
        "mode": "fast",
        "cap": None,
    }
    with pytest.raises(TypeError, match=r"runs\[0\]\.spec\.config\.nested\.fn: cannot write a value of type"):
        write_results([hand_run(config={"nested": {"fn": object()}})], tmp_path)


def test_numpy_scalars_in_records_are_written_as_numbers(tmp_path: Path) -> None:
    run = hand_run()
    first = dataclasses.replace(run.requests[0], prompt_tokens=np.int64(100), arrival_s=np.float64(0.0))  # type: ignore[arg-type]
    path = write_results([dataclasses.replace(run, requests=(first, *run.requests[1:]))], tmp_path)
    stored = load_results(path)[0].requests[0]
    assert (stored.prompt_tokens, type(stored.prompt_tokens)) == (100, int)


def test_load_results_errors_name_file_and_key(tmp_path: Path) -> None:
    path = write_results([hand_run()], tmp_path)
    doc = json.loads(path.read_text())
    del doc["runs"][0]["summary"]["ttft_p99_s"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsError, match=r"results\.json: runs\[0\]\.summary: missing key 'ttft_p99_s'"):
        load_results(path)
    doc["schema_version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsError, match="schema_version: unsupported 99"):
        load_results(path)
    path.write_text("{not json")
    with pytest.raises(ResultsError, match="not valid JSON"):
        load_results(path)


def logged(run: SimRun, order: list[int]) -> SimRun:
    """The same run with its records in a RequestLog, added in ``order`` (as requests finish)."""
    log = RequestLog(len(run.requests))
    for i in order:
        log.add(i, run.requests[i])
    return dataclasses.replace(run, requests=log)


def test_a_request_log_reads_back_in_arrival_order_and_summarizes_the_same(tmp_path: Path) -> None:
    run = hand_run()
    log_run = logged(run, [2, 0, 3, 1])  # finish order differs from arrival order
    log = log_run.requests
    assert isinstance(log, RequestLog)
    assert list(log) == list(run.requests) and log == run.requests and run.requests == log
    assert log[1].token_gaps_s == (0.03,) and log[-1].refused == "no_capacity" and log[1:3] == list(run.requests[1:3])
    assert summarize(log_run) == summarize(run)
    assert list(log.totals.gaps_s) == [0.05, 0.01, 0.02, 0.04, 0.03]  # in the order the records came
    assert log.totals.max_finish_s == 2.0
    # results.json: the streamed file is the in-memory document, and the same with or without a log
    doc = json.loads(write_results([log_run, run], tmp_path).read_text())
    assert doc == results_document([log_run, run]) == results_document([run, run])
    assert pickle.loads(pickle.dumps(log)) == tuple(run.requests)


def test_a_request_log_refuses_a_second_record_and_names_a_missing_one() -> None:
    run = hand_run()
    log = RequestLog(4)
    log.add(1, run.requests[1])
    assert log[1] == run.requests[1]  # a read in between writes
    log.add(3, run.requests[3])
    assert (log[3], log[1]) == (run.requests[3], run.requests[1])
    with pytest.raises(ValueError, match=r"'r1' \(index 1\) is already recorded"):
        log.add(1, run.requests[1])
    with pytest.raises(LookupError, match="request 0 has no record yet"):
        log[0]
    with pytest.raises(IndexError, match="index 4 outside"):
        log.add(4, run.requests[0])


def test_request_totals_keep_gaps_in_chunks_and_read_them_back_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """With chunks of 3 gaps, records of 0-4 gaps: a request's gaps stay in one chunk, ``gaps_s`` is every gap in
    the order added, and the log reads each record back with its own gaps, before and after more adds."""
    monkeypatch.setattr(results_module, "_GAP_CHUNK", 3)
    records = [
        req(f"r{i}", arrival_s=float(i), gaps=tuple(0.001 * (10 * i + k) for k in range(i % 5))) for i in range(12)
    ]
    log = RequestLog(len(records))
    for i, rec in enumerate(records[:6]):
        log.add(i, rec)
    assert log[4] == records[4] and log.totals.gaps_s.tolist() == [g for r in records[:6] for g in r.token_gaps_s]
    for i, rec in enumerate(records[6:], start=6):
        log.add(i, dataclasses.replace(rec, token_gaps_s=()), array.array("d", rec.token_gaps_s))
    totals = log.totals
    every = [g for r in records for g in r.token_gaps_s]
    assert len(totals._full_chunks) >= 5 and totals.num_gaps == len(every) == 21
    assert totals.gaps_s.tolist() == every and totals.gaps_s is totals.gaps_s  # joined once, then kept
    assert list(log) == records
    with pytest.raises(IndexError, match=r"2 gaps from 20, outside 0\.\.21"):
        totals.gaps_of(20, 2)


def test_a_request_log_takes_token_gaps_packed_as_the_same_record() -> None:
    """The simulator hands a log each request's gaps as ``array('d')`` beside a record without them: the log then
    reads back, and totals up, exactly what it does for the whole record."""
    run = hand_run()
    whole, packed = RequestLog(4), RequestLog(4)
    for i in (2, 0, 3, 1):
        rec = run.requests[i]
        whole.add(i, rec)
        packed.add(i, dataclasses.replace(rec, token_gaps_s=()), array.array("d", rec.token_gaps_s))
    assert list(packed) == list(whole) == list(run.requests)
    assert packed.totals.gaps_s.tolist() == whole.totals.gaps_s.tolist() == [0.05, 0.01, 0.02, 0.04, 0.03]
    assert summarize(dataclasses.replace(run, requests=packed)) == summarize(run)
    log = RequestLog(2)
    with pytest.raises(ValueError, match="'r1' has token gaps in its record and in gaps_s"):
        log.add(1, run.requests[1], array.array("d", [0.5]))
    assert log.totals.num_gaps == 0 and log.spool_bytes == 0  # nothing half-done
    with pytest.raises(ValueError, match=r"RequestTotals\.add: request 'r1' has token gaps in its record and in"):
        log.totals.add(1, run.requests[1], array.array("d", [0.5]))
    bare = dataclasses.replace(run.requests[1], token_gaps_s=())
    for bad, kind in ((array.array("f", [0.5]), r"array\('f'\)"), (np.array([0.5, 0.25]), "ndarray")):
        with pytest.raises(
            TypeError, match=rf"RequestLog\.add: gaps_s of request 'r1' must be an array\('d'\).*{kind}"
        ):
            log.add(1, bare, bad)  # type: ignore[arg-type]
    with pytest.raises(struct.error):
        log.add(1, dataclasses.replace(bare, token_gaps_s=(0.5, "x")))  # type: ignore[arg-type]
    assert log.totals.num_gaps == 0 and math.isnan(log.totals.ttft_s[1]) and log.spool_bytes == 0  # nothing stored
    held = log.totals.gaps_s  # holding the gaps read so far never keeps the log from growing
    log.add(1, bare, array.array("d", [0.5]))
    assert log[1].token_gaps_s == (0.5,) and held.size == 0 and log.totals.gaps_s.tolist() == [0.5]
    with pytest.raises(LookupError, match="request 0 has no record yet"):
        log[0]


def test_a_request_log_keeps_a_few_numbers_per_request_in_memory() -> None:
    gaps = tuple(0.01 * k for k in range(1, 11))
    records = [
        req(f"r{i}", arrival_s=float(i), first_token_s=i + 0.5, finish_s=i + 1.0, gaps=gaps) for i in range(20_000)
    ]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    log = RequestLog(len(records))
    for i, rec in enumerate(records):
        log.add(i, rec)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # per request: 59 bytes of totals + an 8-byte spool offset + 10 gaps of 8 bytes (RequestLog's docstring),
    # plus the 64 KiB write buffer; records and their tuples are not kept
    assert held < 20_000 * (59 + 8 + 10 * 8 + 10) + 65_536
    assert log[19_999] == records[19_999]


def test_a_request_log_spools_a_compact_row_per_request_and_no_token_gaps() -> None:
    def spooled(num_gaps: int) -> int:
        log = RequestLog(1000)
        for i in range(1000):
            rec = req(f"azure-conv-{i:05d}", arrival_s=float(i), first_token_s=i + 0.5, finish_s=i + 9.0)
            log.add(i, dataclasses.replace(rec, token_gaps_s=(0.04,) * num_gaps, instance_id="node-3-i5"))
        return log.spool_bytes

    # ~106 bytes a row with 16-character ids (its JSON object: ~330); the gaps live in the totals only
    assert 90_000 < spooled(0) < 120_000
    # 1,000 gaps a request (8,000 bytes): the row grows by less than one gap (the gaps' place, a few bytes)
    assert spooled(1000) - spooled(0) < 1000 * 8


def varied_records() -> list[RequestRecord]:
    """Records that exercise every JSON form of a field: None, refusals, priorities, numpy scalars, non-ASCII."""
    base = list(hand_run().requests)
    return [
        *base,
        dataclasses.replace(base[0], request_id='r-é"\\x\u2028', prompt_tokens=np.int64(7), arrival_s=np.float64(0.1)),  # type: ignore[arg-type]
        dataclasses.replace(base[1], priority=3, prefix_hit_tokens=64, dispatched_instance_id="node-1-i2"),
        req("r6", arrival_s=1 / 3, first_token_s=2 / 3, finish_s=1e-300, gaps=(1e300, 5e-324)),
    ]


def test_results_json_from_a_log_is_byte_for_byte_the_reference_encoding(tmp_path: Path) -> None:
    records = varied_records()
    run = hand_run(requests=tuple(records))
    log_run = logged(run, list(reversed(range(len(records)))))
    from_log = write_results([log_run], tmp_path / "log").read_bytes()
    assert from_log == write_results([run], tmp_path / "tuple").read_bytes()
    # each request's line is _request_json of the record as added (no gap is written)
    text = from_log.decode()
    lines = text[text.index('"requests": [\n') + 14 : text.index('\n],\n"migrations"')].split(",\n")
    assert lines == [_request_json(r) for r in records] and "token_gaps" not in text
    assert log_run.requests == records and summarize(log_run) == summarize(run)


def test_a_request_log_encodes_json_only_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import sim.results as results

    encoded: list[str] = []
    real = results._request_json

    def counting(rec: RequestRecord) -> str:
        encoded.append(rec.request_id)
        return real(rec)

    monkeypatch.setattr(results, "_request_json", counting)
    run = hand_run()
    log = logged(run, [2, 0, 3, 1]).requests
    assert isinstance(log, RequestLog)
    assert encoded == []  # recording a final request encodes nothing
    assert list(log) == list(run.requests) and encoded == []  # nor does reading the records back
    assert log.json_line(1) == real(run.requests[1]) and encoded == ["r1"]
    with pytest.raises(IndexError, match="index 4 outside a log of 4"):
        log.json_line(4)


def test_a_value_with_no_json_form_is_refused_when_the_log_is_written(tmp_path: Path) -> None:
    run = hand_run()
    bad = dataclasses.replace(run.requests[0], instance_id=Path("i0"))  # type: ignore[arg-type]
    log_run = logged(dataclasses.replace(run, requests=(bad, *run.requests[1:])), [0, 1, 2, 3])
    assert log_run.requests[0] == bad  # kept as given
    with pytest.raises(TypeError, match="cannot write a value of type PosixPath to JSON"):
        write_results([log_run], tmp_path)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 1e6),  # arrival_s
            st.none() | st.floats(0.0, 100.0),  # TTFT
            st.none() | st.floats(0.0, 100.0),  # time from first token to finish
            st.lists(st.floats(0.0, 1.0), max_size=6),  # gaps
            st.integers(0, 3),  # priority
            st.integers(0, 5),  # preemptions
            st.booleans(),  # refused
        ),
        max_size=12,
    )
)
def test_request_totals_hold_each_records_figures_by_arrival_position(
    rows: list[tuple[float, float | None, float | None, list[float], int, int, bool]],
) -> None:
    records = []
    for i, (arrival, ttft, rest, gaps, priority, preemptions, refused) in enumerate(rows):
        first = None if ttft is None else arrival + ttft
        finish = None if first is None or rest is None else first + rest
        rec = req(f"r{i}", arrival_s=arrival, first_token_s=first, finish_s=finish, gaps=tuple(gaps))
        records.append(
            dataclasses.replace(
                rec,
                priority=priority,
                preemptions=preemptions,
                preempted_s=0.1 * preemptions,
                refused="no_capacity" if refused else None,
                prefix_hit_tokens=i,
            )
        )
    order = list(reversed(range(len(records))))
    log = RequestLog(len(records))
    for i in order:
        log.add(i, records[i])
    t = log.totals

    def col(values: list[float | None]) -> list[float]:
        return [math.nan if v is None else v for v in values]

    np.testing.assert_array_equal(t.ttft_s, col([r.ttft_s for r in records]))
    np.testing.assert_array_equal(t.e2e_s, col([r.e2e_s for r in records]))
    np.testing.assert_array_equal(
        t.decode_mean_s, col([sum(r.token_gaps_s) / len(r.token_gaps_s) if r.token_gaps_s else None for r in records])
    )
    assert t.preempted_s.tolist() == [r.preempted_s for r in records]
    assert t.preemptions.tolist() == [r.preemptions for r in records]
    assert t.high_priority.tolist() == [r.priority >= 1 for r in records]
    assert t.finished.tolist() == [r.finish_s is not None for r in records]
    assert t.refused.tolist() == [r.refused is not None for r in records]
    assert t.prompt_tokens.tolist() == [100] * len(records)
    assert t.prefix_hit_tokens.tolist() == list(range(len(records)))
    assert t.gaps_s.tolist() == [g for i in order for g in records[i].token_gaps_s] and t.num_gaps == len(t.gaps_s)
    assert t.max_finish_s == max([r.finish_s for r in records if r.finish_s is not None], default=0.0)
    assert list(log) == records


def test_an_account_freezes_into_the_record_field_by_field() -> None:
    """RequestState.record builds the record positionally (new_request_record): every field lands where its
    name says, as the keyword constructor puts it."""
    from sim.cluster import RequestState
    from sim.traces import TraceRequest

    state = RequestState(TraceRequest("t-7", arrival_s=1.5, prompt_tokens=11, output_tokens=13, priority=1), index=3)
    values = {
        "instance_id": "i-2", "first_token_s": 2.5, "finish_s": 4.5, "generated_tokens": 12,
        "token_gaps_s": [0.25, 0.5], "preemptions": 2, "preempted_s": 0.75, "migrations": 1, "refused": "x",
        "prefix_hit_tokens": 16, "dispatched_instance_id": "i-1",
    }  # fmt: skip
    for name, value in values.items():
        setattr(state, name, value)
    expected = RequestRecord(
        request_id="t-7", priority=1, arrival_s=1.5, prompt_tokens=11, output_tokens=13,
        **{**values, "token_gaps_s": (0.25, 0.5)},
    )  # fmt: skip
    assert state.record() == expected


def test_a_file_written_atomically_is_whole_or_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text("earlier")
    with pytest.raises(KeyboardInterrupt), atomic_file(path) as f:
        f.write("half of a new one")
        raise KeyboardInterrupt  # Ctrl-C while it is written
    assert path.read_text() == "earlier" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    with atomic_file(path) as f:
        f.write("new")
        assert path.read_text() == "earlier"  # replaced only when the block ends
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    old_umask = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "plot.png", binary=True) as b:
            b.write(b"\x89PNG")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "plot.png").read_bytes() == b"\x89PNG"
    assert (tmp_path / "plot.png").stat().st_mode & 0o777 == 0o644  # as any file the umask shapes, not 0600
    (tmp_path / "a-folder").mkdir()
    with pytest.raises(IsADirectoryError, match="a-folder is a folder"), atomic_file(tmp_path / "a-folder"):
        pass
