"""Tests of sim.traces: bundled traces against the numbers in shared/data/README.md, generators, errors."""

from __future__ import annotations

import gzip
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.traces
from sim.traces import (
    MAX_SPAN_S,
    TRACE_NAMES,
    Trace,
    TraceError,
    TraceRequest,
    llumnix_lengths_tokens,
    load_trace,
    synthetic_arrivals_s,
    with_priorities,
)

# ---- bundled traces: exact counts and endpoints (shared/data/README.md) --------------------------------


def test_trace_names() -> None:
    assert TRACE_NAMES == ("azure-conv", "azure-code", "mooncake-conv", "sharegpt", "llumnix-synthetic")


def test_azure_code_matches_data_readme() -> None:
    trace = load_trace("azure-code")
    s = trace.summary
    assert len(trace) == s.num_requests == 8_819
    # 18:17:03.9799600 -> 19:14:19.9280160 (7th digit dropped): 57 min 15.948056 s.
    assert trace.requests[0].arrival_s == 0.0
    assert trace.requests[-1].arrival_s == pytest.approx(3435.948056, abs=1e-6)
    assert trace.duration_s == pytest.approx(3436, abs=1)
    assert trace.mean_rate_per_s == pytest.approx(2.57, abs=0.005)
    assert s.interarrival_cv == pytest.approx(13.2, abs=0.05)
    assert s.prompt_mean_tokens == pytest.approx(2048, abs=1)
    assert (s.prompt_p50_tokens, s.prompt_p99_tokens, s.prompt_max_tokens) == (1469, 7436, 7437)
    assert s.output_mean_tokens == pytest.approx(27.9, abs=0.05)
    assert (s.output_p50_tokens, s.output_max_tokens) == (13, 1899)
    # First and last CSV rows.
    first, last = trace.requests[0], trace.requests[-1]
    assert (first.request_id, first.prompt_tokens, first.output_tokens) == ("azure-code-0", 4808, 10)
    assert (last.request_id, last.prompt_tokens, last.output_tokens) == ("azure-code-8818", 549, 173)
    assert first.prefix_block_hashes == () and first.prefix_block_tokens == 0
    assert "Patel" in trace.attribution and "CC-BY-4.0" in trace.attribution


def test_azure_conv_matches_data_readme() -> None:
    trace = load_trace("azure-conv")
    s = trace.summary
    assert len(trace) == 19_366
    # 18:15:46.6805900 -> 19:14:08.4025270: 58 min 21.721937 s.
    assert trace.requests[-1].arrival_s == pytest.approx(3501.721937, abs=1e-6)
    assert trace.mean_rate_per_s == pytest.approx(5.53, abs=0.005)
    assert s.interarrival_cv == pytest.approx(1.09, abs=0.005)
    assert s.prompt_mean_tokens == pytest.approx(1155, abs=1)
    assert (s.prompt_p50_tokens, s.prompt_p99_tokens, s.prompt_max_tokens) == (1020, 4142, 14050)
    assert s.output_mean_tokens == pytest.approx(211, abs=0.5)
    assert (s.output_p50_tokens, s.output_p99_tokens, s.output_max_tokens) == (129, 601, 1000)


def test_mooncake_conv_counts_hash_blocks_and_sharing() -> None:
    trace = load_trace("mooncake-conv")
    s = trace.summary
    assert len(trace) == 12_031
    assert s.prompt_mean_tokens == pytest.approx(12_035, abs=1)
    assert s.output_mean_tokens == pytest.approx(343, abs=0.5)
    assert (s.prompt_p50_tokens, s.prompt_max_tokens, s.output_max_tokens) == (6909, 126_195, 2000)
    for r in trace.requests:
        assert r.prefix_block_tokens == 512
        assert len(r.prefix_block_hashes) == math.ceil(r.prompt_tokens / 512)
    # File line 1: {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, ..., 13]}.
    first = trace.requests[0]
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 6758, 500)
    assert first.prefix_block_hashes == tuple(range(14))
    # README: 36.6 % of all block references repeat an id seen earlier.
    seen: set[int] = set()
    repeats = total = 0
    for r in trace.requests:
        for h in r.prefix_block_hashes:
            repeats += h in seen
            seen.add(h)
            total += 1
    assert repeats / total == pytest.approx(0.366, abs=0.001)


def test_mooncake_buckets_spread_within_their_bucket_and_keep_file_order() -> None:
    burst = load_trace("mooncake-conv", spread_buckets=False)
    spread = load_trace("mooncake-conv")  # auto: the file is quantized
    # As bursts: raw ms timestamps, 0 -> 3,536,999 ms; the first bucket holds 10 requests at 0.
    assert burst.requests[-1].arrival_s == pytest.approx(3536.999)
    assert [r.arrival_s for r in burst.requests[:11]] == [0.0] * 10 + [3.0]
    # Spreading keeps the file order (same lengths in the same order) ...
    assert [r.prompt_tokens for r in spread.requests] == [r.prompt_tokens for r in burst.requests]
    # ... and moves each request by U[0, bucket width) (gaps 2,997-3,003 ms), minus the common shift.
    moves = np.array([a.arrival_s - b.arrival_s for a, b in zip(spread.requests, burst.requests, strict=True)])
    assert 2.9 < moves.max() - moves.min() < 3.003
    assert spread.duration_s == pytest.approx(3537, abs=3)
    # Bursts have inter-arrival CV >> 1; spread uniformly, the arrivals look Poisson-like.
    assert burst.summary.interarrival_cv > 3.0
    assert spread.summary.interarrival_cv == pytest.approx(1.0, abs=0.1)
    other = load_trace("mooncake-conv", seed=1)
    assert [r.arrival_s for r in other.requests] != [r.arrival_s for r in spread.requests]


def test_sharegpt_uses_every_row_once_in_a_seeded_order() -> None:
    trace = load_trace("sharegpt")
    s = trace.summary
    assert len(trace) == 30_731
    assert s.prompt_mean_tokens == pytest.approx(2340, abs=1)
    assert s.output_mean_tokens == pytest.approx(439, abs=0.5)
    assert (s.prompt_p50_tokens, s.output_p50_tokens, s.output_p99_tokens) == (1730, 415, 998)
    assert s.output_max_tokens == 1024
    assert s.mean_rate_per_s == pytest.approx(4.0, rel=0.02)  # default synthetic rate
    again = load_trace("sharegpt")
    assert again == trace
    other = load_trace("sharegpt", seed=1)
    assert [r.prompt_tokens for r in other.requests] != [r.prompt_tokens for r in trace.requests]
    assert sorted(r.prompt_tokens for r in other.requests) == sorted(r.prompt_tokens for r in trace.requests)
    # More requests than rows: each row used once per round.
    big = load_trace("sharegpt", num_requests=30_731 + 5, rate_per_s=100.0)
    assert len(big) == 30_736
    assert big.requests[:30_731] != trace.requests


# ---- options ---------------------------------------------------------------------------------------------


def test_rate_scale_halves_duration_and_max_requests_keeps_first() -> None:
    full = load_trace("azure-code")
    fast = load_trace("azure-code", rate_scale=2.0)
    assert fast.duration_s == pytest.approx(3435.948056 / 2, abs=1e-6)
    assert fast.mean_rate_per_s == pytest.approx(2 * full.mean_rate_per_s)
    assert [r.arrival_s for r in fast.requests[:50]] == [r.arrival_s / 2 for r in full.requests[:50]]
    head = load_trace("azure-code", max_requests=100)
    assert head.requests == full.requests[:100]
    assert load_trace("azure-code", max_requests=0).requests == ()


def test_retiming_a_timestamped_trace_keeps_lengths_and_rate() -> None:
    real = load_trace("azure-conv")
    poisson = load_trace("azure-conv", arrival="poisson", seed=3)
    assert [r.prompt_tokens for r in poisson.requests] == [r.prompt_tokens for r in real.requests]
    assert poisson.mean_rate_per_s == pytest.approx(real.mean_rate_per_s, rel=0.03)
    assert poisson.summary.interarrival_cv == pytest.approx(1.0, abs=0.05)


def test_poisson_arrival_statistics() -> None:
    trace = load_trace("llumnix-synthetic", num_requests=20_000, rate_per_s=5.0, seed=7)
    assert trace.requests[0].arrival_s == 0.0
    assert trace.mean_rate_per_s == pytest.approx(5.0, rel=0.03)
    assert trace.summary.interarrival_cv == pytest.approx(1.0, abs=0.05)
    scaled = load_trace("llumnix-synthetic", num_requests=20_000, rate_per_s=5.0, seed=7, rate_scale=2.0)
    assert scaled.mean_rate_per_s == pytest.approx(2 * trace.mean_rate_per_s)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_arrival_statistics(cv: float) -> None:
    trace = load_trace("sharegpt", arrival="gamma", arrival_cv=cv, rate_per_s=2.0, num_requests=20_000)
    assert trace.mean_rate_per_s == pytest.approx(2.0, rel=0.07)
    assert trace.summary.interarrival_cv == pytest.approx(cv, rel=0.1)


def test_synthetic_arrivals_edge_cases() -> None:
    rng = np.random.default_rng(0)
    assert synthetic_arrivals_s(0, 1.0, rng).shape == (0,)
    assert synthetic_arrivals_s(1, 1.0, rng).tolist() == [0.0]
    with pytest.raises(ValueError, match="needs arrival_cv"):
        synthetic_arrivals_s(10, 1.0, rng, arrival="gamma")
    with pytest.raises(ValueError, match="rate_per_s"):
        synthetic_arrivals_s(10, 0.0, rng)


def test_llumnix_synthetic_means_and_determinism() -> None:
    trace = load_trace("llumnix-synthetic")
    s = trace.summary
    assert len(trace) == 10_000
    # Mean hit exactly before rounding up, then lowered a little by the 6,144-token cap.
    assert 250 <= s.prompt_mean_tokens < 257
    assert 250 <= s.output_mean_tokens < 257
    assert s.prompt_max_tokens <= 6144 and s.output_max_tokens <= 6144
    assert s.prompt_p50_tokens < 64  # heavy tail: the median is far below the mean
    assert load_trace("llumnix-synthetic") == trace
    assert load_trace("llumnix-synthetic", seed=1) != trace
    short = load_trace("llumnix-synthetic", mean_prompt_tokens=128, mean_output_tokens=512, num_requests=5000)
    assert 126 <= short.summary.prompt_mean_tokens < 129
    assert 500 <= short.summary.output_mean_tokens < 513


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    mean=st.integers(1, 600),
    n=st.integers(1, 400),
)
def test_llumnix_lengths_uncapped_mean_is_hit(seed: int, mean: int, n: int) -> None:
    lengths = llumnix_lengths_tokens(n, mean, np.random.default_rng(seed), max_tokens=10**9)
    assert lengths.shape == (n,)
    assert lengths.min() >= 1
    assert mean - 1e-6 <= lengths.mean() < mean + 1


def test_arrival_stream_independent_of_lengths() -> None:
    poisson = load_trace("llumnix-synthetic", num_requests=500)
    gamma = load_trace("llumnix-synthetic", num_requests=500, arrival="gamma", arrival_cv=2.0)
    assert [r.prompt_tokens for r in poisson.requests] == [r.prompt_tokens for r in gamma.requests]
    assert [r.arrival_s for r in poisson.requests] != [r.arrival_s for r in gamma.requests]


# ---- priorities ------------------------------------------------------------------------------------------


def test_with_priorities_marks_a_seeded_share() -> None:
    trace = load_trace("azure-code", max_requests=1000)
    marked = with_priorities(trace, 0.3, seed=5)
    assert sum(r.priority for r in marked.requests) == 300
    assert {r.priority for r in marked.requests} == {0, 1}
    assert [replace_priority(r) for r in marked.requests] == list(trace.requests)
    assert with_priorities(trace, 0.3, seed=5) == marked
    assert with_priorities(trace, 0.3, seed=6) != marked
    assert with_priorities(trace, 0.0, seed=5) == trace
    assert all(r.priority == 1 for r in with_priorities(trace, 1.0, seed=5).requests)
    with pytest.raises(ValueError, match="high_fraction"):
        with_priorities(trace, 1.5, seed=0)


def replace_priority(r: TraceRequest) -> TraceRequest:
    return TraceRequest(
        r.request_id,
        r.arrival_s,
        r.prompt_tokens,
        r.output_tokens,
        0,
        r.prefix_block_hashes,
        r.prefix_block_tokens,
    )


# ---- user files ------------------------------------------------------------------------------------------

AZURE_SMALL = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 23:59:59.9999999,100,5\n"
    "2023-11-17 00:00:01.2500004,200,6\n"
    "2023-11-17 00:00:00.5000000,300,7"
)


def test_user_azure_csv_and_gzip(tmp_path: Path) -> None:
    plain = tmp_path / "small.csv"
    plain.write_text(AZURE_SMALL)
    trace = load_trace(plain)
    assert trace.name == "small" and trace.source == str(plain)
    # 7th digit dropped; rows sorted by time; relative to the first; day boundary crossed.
    assert [(r.arrival_s, r.prompt_tokens) for r in trace.requests] == [
        (0.0, 100),
        (pytest.approx(0.500001), 300),
        (pytest.approx(1.250001), 200),
    ]
    packed = tmp_path / "small.csv.gz"
    packed.write_bytes(gzip.compress(AZURE_SMALL.encode()))
    assert load_trace(packed).requests == trace.requests


def test_csv_read_row_by_row_as_in_one_pass(tmp_path: Path) -> None:
    """A regular CSV is read in one fast pass; one with blank rows and spaces around its cells row by row: the same
    requests (the timestamps' 7th digit dropped by both)."""
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    regular = tmp_path / "regular.csv"
    regular.write_text(header + "2023-11-16 18:00:00.1234567,5,1\n2023-11-16T18:00:01.5,7,2\n2023-11-16 17:59:59,3,4\n")
    spaced = tmp_path / "spaced.csv"
    spaced.write_text(
        header + " 2023-11-16 18:00:00.1234567 , 5 ,1\n\n2023-11-16T18:00:01.5,7, 2\n,,\n2023-11-16 17:59:59,3,4\n"
    )
    want = [(0.0, 3, 4), (pytest.approx(1.123456), 5, 1), (pytest.approx(2.5), 7, 2)]
    for path in (regular, spaced):
        assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in load_trace(path).requests] == want
    assert [r.arrival_s for r in load_trace(regular).requests] == [r.arrival_s for r in load_trace(spaced).requests]
    leading = tmp_path / "leading.csv"  # blank rows before the header too
    leading.write_text("\n \n" + regular.read_text())
    assert [r.arrival_s for r in load_trace(leading).requests] == [r.arrival_s for r in load_trace(regular).requests]
    sharegpt = tmp_path / "lengths.csv"
    sharegpt.write_text("num_prefill_tokens,num_decode_tokens\n5,1\n 7 ,2\n")
    assert sorted((r.prompt_tokens, r.output_tokens) for r in load_trace(sharegpt).requests) == [(5, 1), (7, 2)]


def test_user_mooncake_jsonl_spreads_only_quantized_files(tmp_path: Path) -> None:
    quantized = tmp_path / "q.jsonl"
    quantized.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'
        '{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1]}\n'
        '{"timestamp": 3000, "input_length": 10, "output_length": 4}\n'
        '{"timestamp": 3000, "input_length": 10, "output_length": 5, "hash_ids": []}\n'
    )
    trace = load_trace(quantized, seed=2)
    assert [r.output_tokens for r in trace.requests] == [2, 3, 4, 5]
    assert trace.requests[0].prefix_block_hashes == (1, 2)
    assert trace.requests[2].prefix_block_hashes == () and trace.requests[2].prefix_block_tokens == 0
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0 and arrivals[1] < 3.0 and 0.0 < arrivals[2] < 6.0
    distinct = tmp_path / "d.jsonl"
    distinct.write_text(
        '{"timestamp": 100, "input_length": 5, "output_length": 1}\n'
        '{"timestamp": 350, "input_length": 5, "output_length": 1}\n'
    )
    assert [r.arrival_s for r in load_trace(distinct).requests] == [0.0, 0.25]


def test_user_sharegpt_csv(tmp_path: Path) -> None:
    path = tmp_path / "lens.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,1\n20,2\n30,3\n")
    trace = load_trace(path, rate_per_s=1.0)
    assert sorted((r.prompt_tokens, r.output_tokens) for r in trace.requests) == [(10, 1), (20, 2), (30, 3)]


@pytest.mark.parametrize(
    ("file_name", "content", "message"),
    [
        (
            "x.csv",
            "a,b\n1,2\n",
            r"x\.csv: unknown trace format: CSV header \['a', 'b'\].*TIMESTAMP, ContextTokens",
        ),
        ("x.csv", "", r"x\.csv: empty file"),
        ("x.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", r"x\.csv: no requests"),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,5,1\n2023-11-16 18:00:01.0,abc,1\n",
            r"x\.csv:3: column ContextTokens: not an integer: 'abc'",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,5,0\n",
            r"x\.csv:2: column GeneratedTokens: must be >= 1, got 0",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n16/11/2023 18:00,5,1\n",
            r"x\.csv:2: column TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fffffff'",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,5\n",
            r"x\.csv:2: expected 3 columns",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,5,1\n2023-11-16 24:00:00.0,5,1\n",
            r"x\.csv:3: column TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fffffff', got '2023-11-16 24:00:00.0'",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-30 18:00:00.0,5,1\n",
            r"x\.csv:2: column TIMESTAMP: expected",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00+00:00,5,1\n",
            r"x\.csv:2: column TIMESTAMP: expected",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0," + "9" * 30 + ",1\n",
            r"x\.csv:2: column ContextTokens: must be <= 9223372036854775807, got 9{30}",
        ),
        (
            "x.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,5,1\n2023-11-16 18:00:01.0,5,"
            + "1" * 200_000
            + "\n",
            r"x\.csv:3: not a valid CSV row: field larger than field limit",
        ),
        (
            "x.jsonl",
            '{"timestamp": 0, "input_length": 100000000000000000000000000, "output_length": 1}\n',
            r"x\.jsonl:1: key input_length: must be <= 9223372036854775807",
        ),
        (
            "x.csv",
            "num_prefill_tokens,num_decode_tokens\n5,1\n-3,1\n",
            r"x\.csv:3: column num_prefill_tokens: must be >= 1, got -3",
        ),
        (  # the JSON Lines format alone (it listed the CSV formats too)
            "x.jsonl",
            '{"timestamp": 0, "input_length": 5}\n',
            r"x\.jsonl:1: missing key\(s\) output_length; found \['input_length', 'timestamp'\]; expected JSON "
            r"Lines with Mooncake keys timestamp, input_length, output_length \(hash_ids optional\)$",
        ),
        (
            "x.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, \n',
            r"x\.jsonl:2: invalid JSON",
        ),
        (
            "x.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": "7"}\n',
            r'x\.jsonl:1: key output_length: expected an integer, got "7"',
        ),
        (
            "x.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\n',
            r"x\.jsonl:1: key hash_ids: 2 blocks of 512 tokens exceed input_length 5",
        ),
        # a .jsonl file is read as JSON Lines whatever its first line: it was "unknown trace format: CSV header"
        ("x.jsonl", "not json\n", r"x\.jsonl:1: invalid JSON: Expecting value"),
        ("x.jsonl", "[1, 2]\n", r"x\.jsonl:1: expected a JSON object, got \[1, 2\]$"),
        ("x.jsonl", "\n\n", r"x\.jsonl: empty file; expected JSON Lines with Mooncake keys timestamp, "),
    ],
)
def test_bad_files_give_clear_errors(tmp_path: Path, file_name: str, content: str, message: str) -> None:
    path = tmp_path / file_name
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_a_trace_is_read_from_a_pipe_and_dev_null_is_an_empty_file(tmp_path: Path) -> None:
    # --trace <(zcat t.csv.gz): the shell passes a pipe's path (/dev/fd/63), which is no regular file
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=("num_prefill_tokens,num_decode_tokens\n10,5\n20,7\n",))
    writer.start()
    try:
        trace = load_trace(fifo, rate_per_s=1.0)
    finally:
        writer.join(timeout=10)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.requests] == [(10, 5), (20, 7)]
    with pytest.raises(TraceError, match=r"^/dev/null: empty file; expected a CSV with Azure columns"):
        load_trace("/dev/null")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"not a bundled trace .*azure-conv.* and no such file"):
        load_trace("azure-cod")
    with pytest.raises(TraceError, match=r"not a bundled trace .* and a directory, not a trace file"):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match="has no timestamps"):
        load_trace("sharegpt", arrival="trace")
    with pytest.raises(TraceError, match="apply only to llumnix-synthetic"):
        load_trace("sharegpt", mean_prompt_tokens=100)
    with pytest.raises(TraceError, match="num_requests applies only"):
        load_trace("azure-code", num_requests=10)
    with pytest.raises(TraceError, match="spread_buckets applies only"):
        load_trace("azure-code", spread_buckets=True)
    with pytest.raises(TraceError, match="use rate_scale"):
        load_trace("azure-code", rate_per_s=3.0)
    with pytest.raises(ValueError, match="needs arrival_cv"):
        load_trace("llumnix-synthetic", arrival="gamma", num_requests=10)
    with pytest.raises(ValueError, match="rate_scale"):
        load_trace("azure-code", rate_scale=0.0)
    with pytest.raises(ValueError, match="seed"):
        load_trace("azure-code", seed=-1)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (
            "azure-conv",
            {"rate_per_s": 5.0},
            "azure-conv (bundled trace): rate_per_s (--rate) applies only to synthetic "
            "arrivals (arrival poisson or gamma); to replay the trace's own timestamps faster use rate_scale "
            "(--rate-scale)",
        ),
        (
            "azure-conv",
            {"rate_per_s": 5.0, "arrival_cv": 2.0},
            "azure-conv (bundled trace): rate_per_s (--rate) and arrival_cv (--arrival-cv) apply only to synthetic "
            "arrivals (arrival poisson or gamma); to replay the trace's own timestamps faster use rate_scale "
            "(--rate-scale)",
        ),
        (
            "sharegpt",
            {"arrival": "trace"},
            "sharegpt (bundled trace): has no timestamps: its arrivals must be drawn, with arrival (--arrival) "
            "poisson or gamma",
        ),
        (
            "azure-code",
            {"num_requests": 10},
            "azure-code (bundled trace): num_requests applies only to traces without timestamps; use max_requests",
        ),
        (
            "azure-conv",
            {"mean_prompt_tokens": 100},
            "azure-conv (bundled trace): mean_prompt_tokens/mean_output_tokens/max_tokens apply only to "
            "llumnix-synthetic",
        ),
        (
            "sharegpt",
            {"spread_buckets": True},
            "sharegpt (bundled trace): spread_buckets applies only to Mooncake-format traces",
        ),
        (
            "llumnix-synthetic",
            {"spread_buckets": True},
            "llumnix-synthetic (generated): spread_buckets applies only to Mooncake-format traces",
        ),
        (
            "azure-code",
            {"max_requests": 3, "rate_scale": 1e-9},
            "azure-code (bundled trace): its first 3 requests arrive",
        ),
    ],
)
def test_errors_name_a_bundled_trace_as_the_user_named_it(name: str, options: dict[str, object], message: str) -> None:
    """Not by its file inside the package (sim/data/AzureLLMInferenceTrace_conv.csv.gz), which the user never typed."""
    with pytest.raises(ValueError) as caught:
        load_trace(name, **options)  # type: ignore[arg-type]
    assert str(caught.value).startswith(message), str(caught.value)
    assert "sim/data" not in str(caught.value) and ".csv" not in str(caught.value)


def test_errors_about_a_user_file_name_its_path(tmp_path: Path) -> None:
    path = tmp_path / "small.csv"
    path.write_text(AZURE_SMALL)
    with pytest.raises(TraceError) as caught:
        load_trace(path, rate_per_s=3.0)
    assert str(caught.value).startswith(f"{path}: rate_per_s (--rate) applies only to synthetic arrivals")
    with pytest.raises(ValueError) as caught_span:
        load_trace(path, rate_scale=1e-12)
    assert str(caught_span.value).startswith(f"{path}: its first 3 requests arrive over ")


@pytest.fixture
def bundled_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lets a test point a bundled name at another file of sim/data; the parsed-table cache is emptied around it."""
    monkeypatch.setattr(sim.traces, "_BUNDLED", dict(sim.traces._BUNDLED))
    sim.traces._bundled_table.cache_clear()
    yield
    sim.traces._bundled_table.cache_clear()


@pytest.mark.usefixtures("bundled_files")
def test_a_missing_bundled_file_is_named_by_the_trace_then_the_file() -> None:
    sim.traces._BUNDLED["azure-conv"] = ("AzureLLMInferenceTrace_gone.csv.gz", "attribution")
    installed = Path(sim.traces.__file__).parent / "data" / "AzureLLMInferenceTrace_gone.csv.gz"
    with pytest.raises(TraceError) as caught:
        load_trace("azure-conv")
    assert str(caught.value) == (
        f"bundled trace azure-conv: cannot read {installed} (No such file or directory); the hilum installation is "
        "incomplete: reinstall it (`pip install .` or `make demo` in its checkout)"
    )


@pytest.mark.usefixtures("bundled_files")
def test_a_damaged_bundled_file_is_named_by_the_trace_then_the_file() -> None:
    sim.traces._BUNDLED["azure-conv"] = ("ATTRIBUTION.md", "attribution")  # in sim/data, not a trace
    installed = Path(sim.traces.__file__).parent / "data" / "ATTRIBUTION.md"
    with pytest.raises(TraceError) as caught:
        load_trace("azure-conv")
    message = str(caught.value)
    assert message.startswith(
        f"bundled trace azure-conv: its file is damaged: {installed}: unknown trace format: CSV header "
        "['# Bundled trace files: origin and licence']; expected a CSV with Azure columns"
    )
    assert message.endswith(
        "; the hilum installation is incomplete: reinstall it (`pip install .` or `make demo` in its checkout)"
    )


def test_value_types_validate() -> None:
    with pytest.raises(ValueError, match="output_tokens must be >= 1"):
        TraceRequest("r", 0.0, 5, 0)
    with pytest.raises(ValueError, match="arrival_s"):
        TraceRequest("r", -1.0, 5, 1)
    with pytest.raises(ValueError, match="prefix_block_tokens"):
        TraceRequest("r", 0.0, 5, 1, prefix_block_hashes=(1,))
    a, b = TraceRequest("a", 1.0, 5, 1), TraceRequest("b", 0.5, 5, 1)
    with pytest.raises(ValueError, match="not sorted by arrival at index 1"):
        Trace("t", "test", "", (a, b))
    with pytest.raises(ValueError, match="not unique"):
        Trace("t", "test", "", (a, a))
    empty = Trace("t", "test", "", ())
    assert empty.duration_s == 0.0 and empty.mean_rate_per_s == 0.0
    with pytest.raises(ValueError, match="no requests"):
        _ = empty.summary


def test_arrivals_spanning_more_than_max_span_are_refused_at_the_scale_that_crosses_it() -> None:
    span_s = load_trace("azure-code", max_requests=3).duration_s  # as recorded
    fits = load_trace("azure-code", max_requests=3, rate_scale=span_s / MAX_SPAN_S * 1.0001)
    assert MAX_SPAN_S * 0.999 < fits.duration_s <= MAX_SPAN_S
    with pytest.raises(ValueError, match=r"its first 3 requests arrive over 2\.59e\+06 s \(30 days\)") as caught:
        load_trace("azure-code", max_requests=3, rate_scale=span_s / MAX_SPAN_S * 0.9999)
    assert f"of at least {span_s / MAX_SPAN_S:.3g}" in str(caught.value)
    assert load_trace("azure-code", max_requests=1, rate_scale=1e-300).duration_s == 0.0  # one request spans nothing


@pytest.mark.parametrize(
    ("name", "max_requests"), [("azure-code", 1000), ("azure-conv", None), ("azure-conv", 100), ("mooncake-conv", 500)]
)
def test_the_suggested_rate_scale_fits_and_one_a_little_smaller_does_not(name: str, max_requests: int | None) -> None:
    """The suggestion is rounded up (to three significant digits), never down to a scale that is refused again."""
    with pytest.raises(ValueError, match="of at least") as caught:
        load_trace(name, max_requests=max_requests, rate_scale=1e-9)
    suggested = float(str(caught.value).split("(--rate-scale) of at least ")[1].split()[0])
    assert load_trace(name, max_requests=max_requests, rate_scale=suggested).duration_s <= MAX_SPAN_S
    with pytest.raises(ValueError, match="of at least"):
        load_trace(name, max_requests=max_requests, rate_scale=suggested * 0.99)


def test_a_span_past_a_doubles_range_is_refused_without_inf_in_the_advice() -> None:
    with pytest.raises(ValueError, match=r"more seconds than a double of simulated time") as caught:
        load_trace("azure-code", max_requests=3, rate_scale=1e-320)
    assert "inf" not in str(caught.value)


def test_gamma_arrivals_refuse_a_cv_whose_shape_overflows() -> None:
    for cv in (1e-200, 1e200):
        with pytest.raises(ValueError, match=r"arrival_cv \(the inter-arrival CV\) from 0.001 to 1000"):
            load_trace("sharegpt", num_requests=10, arrival="gamma", arrival_cv=cv)
