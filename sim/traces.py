"""Request traces for the simulator: real production traces and synthetic workloads.

A trace is a tuple of :class:`TraceRequest` sorted by arrival time, with arrivals in seconds from the
trace start (the first request arrives at 0 s). :func:`load_trace` reads one of the bundled traces
(:data:`TRACE_NAMES`) or a file in one of their formats:

- ``azure-conv``, ``azure-code``: Azure LLM inference trace 2023 (Patel et al., "Splitwise", ISCA 2024).
  CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps carry 7 fractional digits (100 ns ticks),
  the 7th is dropped (microsecond resolution) and arrivals are taken relative to the first request.
- ``mooncake-conv``: Mooncake conversation trace (FAST 2025). JSON Lines with ``timestamp`` (ms),
  ``input_length``, ``output_length``, ``hash_ids`` (prefix KV block ids, 512 tokens per block).
  The timestamps are quantized to ~3 s buckets; the requests of each bucket are spread uniformly
  (seeded) across the bucket, see :func:`load_trace`.
- ``sharegpt``: ShareGPT prompt/output lengths (Sarathi-Serve stats file, Llama-2 tokenizer; CSV
  ``num_prefill_tokens,num_decode_tokens,...``) with synthetic Poisson or Gamma arrivals.
- ``llumnix-synthetic``: the power-law (Zipf) length generator of Llumnix (Sun et al., OSDI 2024) with
  Poisson or Gamma arrivals, see :func:`llumnix_lengths_tokens`.

Everything is deterministic per ``seed``; no global random state is read or written.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
import math
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import date, datetime
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_SYNTHETIC_RATE_PER_S",
    "LLUMNIX_DEFAULT_NUM_REQUESTS",
    "LLUMNIX_MAX_TOKENS",
    "MAX_ARRIVAL_CV",
    "MAX_SPAN_S",
    "MIN_ARRIVAL_CV",
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_NAMES",
    "Trace",
    "TraceError",
    "TraceRequest",
    "TraceSummary",
    "llumnix_lengths_tokens",
    "llumnix_zipf_alpha",
    "load_trace",
    "synthetic_arrivals_s",
    "with_priorities",
]

TRACE_NAMES: tuple[str, ...] = ("azure-conv", "azure-code", "mooncake-conv", "sharegpt", "llumnix-synthetic")
"""Names :func:`load_trace` accepts besides file paths."""

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_ids`` block (Mooncake FAST25-release/traces README)."""

DEFAULT_SYNTHETIC_RATE_PER_S = 4.0
"""Default arrival rate of synthetic arrivals (the default ``--qps`` of Llumnix's benchmark_serving.py)."""

LLUMNIX_DEFAULT_NUM_REQUESTS = 10_000
"""Default number of requests of ``llumnix-synthetic``."""

LLUMNIX_MAX_TOKENS = 6144
"""Default length cap of ``llumnix-synthetic`` (Llumnix's ``len_range`` 6144 for its Zipf workloads)."""

MAX_SPAN_S = 30 * 86_400.0
"""The longest simulated span :func:`load_trace` hands out, first arrival to last: 30 days, four times the
week-long Azure LLM inference traces. Past it an idle cluster's periodic loops (every 50 ms) cost minutes of CPU
for nothing, and float timestamps lose the precision latencies need (at 1e16 s a double's step is 2 s)."""

ArrivalKind = Literal["trace", "poisson", "gamma"]

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_SHAREGPT_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
_MOONCAKE_LINES = f"JSON Lines with Mooncake keys {', '.join(_MOONCAKE_KEYS)} (hash_ids optional)"
_MOONCAKE_FORMAT = f"expected {_MOONCAKE_LINES}"
_EXPECTED_FORMATS = (
    f"expected a CSV with Azure columns {', '.join(_AZURE_COLUMNS)}, a CSV with ShareGPT columns "
    f"{', '.join(_SHAREGPT_COLUMNS)}, or {_MOONCAKE_LINES}"
)

# Independent random streams per purpose, so that e.g. changing the arrival process keeps the lengths.
_STREAM_LENGTHS = 1
_STREAM_ARRIVALS = 2
_STREAM_BUCKETS = 3

_AZURE_ATTRIBUTION = (
    "Azure LLM inference trace 2023, Azure/AzurePublicDataset data/{file} @ 790921015d50, CC-BY-4.0. "
    'Cite: Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024.'
)
_BUNDLED: dict[str, tuple[str, str]] = {
    # name -> (file in sim/data, attribution)
    "azure-code": (
        "AzureLLMInferenceTrace_code.csv.gz",
        _AZURE_ATTRIBUTION.format(file="AzureLLMInferenceTrace_code.csv"),
    ),
    "azure-conv": (
        "AzureLLMInferenceTrace_conv.csv.gz",
        _AZURE_ATTRIBUTION.format(file="AzureLLMInferenceTrace_conv.csv"),
    ),
    "mooncake-conv": (
        "conversation_trace.jsonl.gz",
        "Mooncake conversation trace, kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl "
        '@ 3cca71daccf2, Apache-2.0. Qin et al., "Mooncake: Trading More Storage for Less Computation", '
        "FAST 2025.",
    ),
    "sharegpt": (
        "sharegpt_8k_filtered_stats_llama2_tokenizer.csv.gz",
        "ShareGPT length statistics (Llama-2 tokenizer), microsoft/sarathi-serve "
        "data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv @ 72339db5b120, Apache-2.0. "
        "Arrivals are synthetic.",
    ),
}
_LLUMNIX_ATTRIBUTION = (
    'Synthetic workload after Sun et al., "Llumnix: Dynamic Scheduling for Large Language Model Serving", '
    "OSDI 2024 (Zipf length generator of AlibabaPAI/llumnix benchmark/benchmark_serving.py, Apache-2.0)."
)
_USER_FILE_ATTRIBUTION = "user-supplied file (origin and licence unknown to hilum)"
_REINSTALL = "the hilum installation is incomplete: reinstall it (`pip install .` or `make demo` in its checkout)"


class TraceError(ValueError):
    """A trace file or trace argument is invalid; the message names the file, line and column."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        request_id: unique within the trace, ``"<trace name>-<index>"`` (index in arrival order of the
            full trace, so ids do not change with ``max_requests``).
        arrival_s: arrival time in seconds from the trace start (the first request of a loaded trace
            arrives at 0.0).
        prompt_tokens: prompt (prefill) length in tokens, >= 1.
        output_tokens: number of tokens to generate (decode), >= 1.
        priority: 0 = normal, 1 = high (see :func:`with_priorities`).
        prefix_block_hashes: ids of the prompt's prefix KV blocks (Mooncake ``hash_ids``); the same id in
            two requests means a shareable block of ``prefix_block_tokens`` tokens. Empty if unknown.
        prefix_block_tokens: tokens per entry of ``prefix_block_hashes`` (512 for Mooncake), 0 if none.

    Raises:
        ValueError: on a negative or non-finite arrival, lengths < 1, or hashes without a block size.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    prefix_block_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0.0):
            raise ValueError(f"request {self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"request {self.request_id}: output_tokens must be >= 1, got {self.output_tokens}")
        if self.prefix_block_tokens < 0 or (self.prefix_block_hashes and self.prefix_block_tokens == 0):
            raise ValueError(
                f"request {self.request_id}: prefix_block_tokens must be >= 0 and > 0 when "
                f"prefix_block_hashes is set, got {self.prefix_block_tokens}"
            )


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """Summary statistics of a trace (percentiles by linear interpolation, as numpy's default).

    ``mean_rate_per_s`` is ``num_requests / duration_s`` (0.0 when the duration is 0);
    ``interarrival_cv`` is the population standard deviation of the inter-arrival gaps divided by their
    mean (1.0 for a Poisson process; 0.0 when there are fewer than two requests).
    """

    num_requests: int
    duration_s: float
    mean_rate_per_s: float
    interarrival_cv: float
    prompt_mean_tokens: float
    prompt_p50_tokens: float
    prompt_p99_tokens: float
    prompt_max_tokens: int
    output_mean_tokens: float
    output_p50_tokens: float
    output_p99_tokens: float
    output_max_tokens: int


@dataclass(frozen=True, slots=True)
class Trace:
    """A named sequence of requests sorted by arrival.

    Attributes:
        name: the bundled name (``azure-code``) or the file's stem.
        source: where the requests came from (bundled file, user path, or ``generated``).
        attribution: origin, commit and licence of the data, to be cited with results.
        requests: sorted by ``arrival_s`` (non-decreasing); ids unique.

    Raises:
        ValueError: if the requests are not sorted by arrival or ids repeat.
    """

    name: str
    source: str
    attribution: str
    requests: tuple[TraceRequest, ...]

    def __post_init__(self) -> None:
        for i in range(1, len(self.requests)):
            if self.requests[i].arrival_s < self.requests[i - 1].arrival_s:
                raise ValueError(
                    f"trace {self.name}: requests not sorted by arrival at index {i} "
                    f"({self.requests[i - 1].arrival_s} > {self.requests[i].arrival_s})"
                )
        if len({r.request_id for r in self.requests}) != len(self.requests):
            raise ValueError(f"trace {self.name}: request ids are not unique")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Last arrival minus first arrival, in seconds (0.0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rate_per_s(self) -> float:
        """Requests per second: ``len(requests) / duration_s``; 0.0 when the duration is 0."""
        duration = self.duration_s
        return len(self.requests) / duration if duration > 0.0 else 0.0

    @property
    def summary(self) -> TraceSummary:
        """Counts, duration, rate, inter-arrival CV and prompt/output length mean, P50, P99, max.

        Raises:
            ValueError: if the trace is empty.
        """
        if not self.requests:
            raise ValueError(f"trace {self.name}: no requests to summarize")
        arrivals = np.fromiter((r.arrival_s for r in self.requests), dtype=np.float64)
        prompts = np.fromiter((r.prompt_tokens for r in self.requests), dtype=np.int64)
        outputs = np.fromiter((r.output_tokens for r in self.requests), dtype=np.int64)
        gaps = np.diff(arrivals)
        gap_mean = float(gaps.mean()) if gaps.size else 0.0
        cv = float(gaps.std()) / gap_mean if gap_mean > 0.0 else 0.0
        return TraceSummary(
            num_requests=len(self.requests),
            duration_s=self.duration_s,
            mean_rate_per_s=self.mean_rate_per_s,
            interarrival_cv=cv,
            prompt_mean_tokens=float(prompts.mean()),
            prompt_p50_tokens=float(np.percentile(prompts, 50)),
            prompt_p99_tokens=float(np.percentile(prompts, 99)),
            prompt_max_tokens=int(prompts.max()),
            output_mean_tokens=float(outputs.mean()),
            output_p50_tokens=float(np.percentile(outputs, 50)),
            output_p99_tokens=float(np.percentile(outputs, 99)),
            output_max_tokens=int(outputs.max()),
        )


# ---------------------------------------------------------------------------------------------------------
# Parsed files


@dataclass(frozen=True, slots=True)
class _Table:
    """A parsed trace file, rows sorted by time (stable). Immutable, so it can be cached."""

    kind: Literal["azure", "mooncake", "sharegpt"]
    times: tuple[float, ...]  # azure: s from the first row; mooncake: raw ms; sharegpt: ()
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    block_hashes: tuple[tuple[int, ...], ...]  # mooncake: per row; others: ()


def _read_text(data: bytes, source: str) -> str:
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TraceError(f"{source}: not a valid gzip file: {exc}") from exc
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not UTF-8 text: {exc}") from exc


def _parse(data: bytes, source: str) -> _Table:
    text = _read_text(data, source)
    first = next((line.strip() for line in text.splitlines() if line.strip()), None)
    # JSON Lines by content, or by name: a .jsonl file whose first line is broken gets JSON's error, not a CSV one
    json_lines = source.removesuffix(".gz").endswith((".jsonl", ".json"))
    if first is None:
        raise TraceError(f"{source}: empty file; {_MOONCAKE_FORMAT if json_lines else _EXPECTED_FORMATS}")
    if first.startswith("{") or json_lines:
        return _parse_mooncake(text, source)
    return _parse_csv(text, source)


#: The largest token count a trace may give (the int64 the request arrays hold).
_MAX_TOKEN_COUNT = 2**63 - 1


def _parse_int(value: str, source: str, line: int, column: str, minimum: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise TraceError(f"{source}:{line}: column {column}: not an integer: {value!r}") from None
    if number < minimum:
        raise TraceError(f"{source}:{line}: column {column}: must be >= {minimum}, got {number}")
    if number > _MAX_TOKEN_COUNT:
        raise TraceError(f"{source}:{line}: column {column}: must be <= {_MAX_TOKEN_COUNT}, got {number}")
    return number


_TIMESTAMP_RE = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?")


def _parse_azure_timestamp_us(value: str, source: str, line: int) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` -> microseconds since 0001-01-01; digits after the 6th dropped."""
    match = _TIMESTAMP_RE.fullmatch(value.strip())
    bad = f"{source}:{line}: column TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fffffff', got {value!r}"
    if match is None:
        raise TraceError(bad)
    day_text, hour, minute, second, fraction = match.groups()
    try:
        day = date.fromisoformat(day_text).toordinal()
    except ValueError:
        raise TraceError(bad) from None
    if int(hour) > 23 or int(minute) > 59 or int(second) > 59:
        raise TraceError(bad)
    micros = int((fraction or "")[:6].ljust(6, "0"))
    return (((day * 24 + int(hour)) * 60 + int(minute)) * 60 + int(second)) * 1_000_000 + micros


class _Irregular(Exception):
    """A CSV row the fast pass does not take as it is (:func:`_parse_csv` then parses the file row by row, and
    says what is wrong, if anything)."""


def _parse_csv_regular(
    reader: Iterator[list[str]], width: int, timestamp: int | None, prompt: int, output: int
) -> tuple[list[int], list[int], list[int]]:
    """The columns of a CSV body whose every row is regular: ``width`` cells, integers >= 1 in the two token
    columns, and (``timestamp``: its column, None for ShareGPT) a timestamp ``_TIMESTAMP_RE`` takes as it is.
    Gives what :func:`_parse_csv`'s careful pass gives for such a file (the same microseconds: ``fromisoformat``
    keeps the first six digits of the fraction, as :func:`_parse_azure_timestamp_us` does), in C calls.

    Raises _Irregular (or ValueError from ``int``/``fromisoformat``, csv.Error from the reader) at the first row it
    does not take."""
    times_us: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    shape, parse = _TIMESTAMP_RE.fullmatch, datetime.fromisoformat
    for row in reader:
        if len(row) != width:
            raise _Irregular
        p, o = int(row[prompt]), int(row[output])  # int() ignores surrounding whitespace, as .strip() then int()
        if not (1 <= p <= _MAX_TOKEN_COUNT and 1 <= o <= _MAX_TOKEN_COUNT):
            raise _Irregular
        prompts.append(p)
        outputs.append(o)
        if timestamp is not None:
            match = shape(row[timestamp])
            # the clock's ranges checked here: what fromisoformat takes differs between Python versions (24:00)
            if match is None or match[2] > "23" or match[3] > "59" or match[4] > "59":
                raise _Irregular
            t = parse(row[timestamp])
            times_us.append(
                (((t.toordinal() * 24 + t.hour) * 60 + t.minute) * 60 + t.second) * 1_000_000 + t.microsecond
            )
    return times_us, prompts, outputs


def _blank(row: list[str]) -> bool:
    return all(not cell.strip() for cell in row)


def _header(reader: Iterator[list[str]]) -> list[str]:
    """The first row that is not blank, its names stripped (blank rows before it are skipped, as after it)."""
    for row in reader:
        if not _blank(row):
            return [name.strip() for name in row]
    return []


def _parse_csv(text: str, source: str) -> _Table:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = _header(reader)
    except csv.Error as exc:
        raise TraceError(f"{source}:{reader.line_num}: not a valid CSV row: {exc}") from None
    if all(c in header for c in _AZURE_COLUMNS):
        kind: Literal["azure", "sharegpt"] = "azure"
        columns: tuple[str, ...] = _AZURE_COLUMNS
    elif all(c in header for c in _SHAREGPT_COLUMNS):
        kind = "sharegpt"
        columns = _SHAREGPT_COLUMNS
    else:
        raise TraceError(f"{source}: unknown trace format: CSV header {header}; {_EXPECTED_FORMATS}")
    index = {c: header.index(c) for c in columns}
    try:  # a regular file (every bundled one) in one fast pass; anything else row by row below
        if kind == "azure":
            fast = _parse_csv_regular(
                reader, len(header), index["TIMESTAMP"], index["ContextTokens"], index["GeneratedTokens"]
            )
        else:
            fast = _parse_csv_regular(
                reader, len(header), None, index["num_prefill_tokens"], index["num_decode_tokens"]
            )
    except (_Irregular, ValueError, csv.Error):
        times_us, prompts, outputs = _parse_csv_rows(text, source, kind, header, index)
    else:
        times_us, prompts, outputs = fast
    if not prompts:
        raise TraceError(f"{source}: no requests after the header")
    if kind == "sharegpt":
        return _Table("sharegpt", (), tuple(prompts), tuple(outputs), ())
    order = sorted(range(len(times_us)), key=times_us.__getitem__)
    first_us = times_us[order[0]]
    return _Table(
        "azure",
        tuple((times_us[i] - first_us) / 1e6 for i in order),
        tuple(prompts[i] for i in order),
        tuple(outputs[i] for i in order),
        (),
    )


def _parse_csv_rows(
    text: str, source: str, kind: str, header: list[str], index: dict[str, int]
) -> tuple[list[int], list[int], list[int]]:
    """The careful pass of :func:`_parse_csv` over the body of ``text``: row by row, blank rows skipped, TraceError
    naming the line and the column of the first bad cell."""
    reader = csv.reader(io.StringIO(text, newline=""))
    _header(reader)
    times_us: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:  # a field over the csv module's limit, a NUL byte, ...
            raise TraceError(f"{source}:{reader.line_num}: not a valid CSV row: {exc}") from None
        line = reader.line_num
        if _blank(row):
            continue
        if len(row) != len(header):
            raise TraceError(f"{source}:{line}: expected {len(header)} columns ({header}), got {len(row)}")
        if kind == "azure":
            times_us.append(_parse_azure_timestamp_us(row[index["TIMESTAMP"]], source, line))
            prompts.append(_parse_int(row[index["ContextTokens"]], source, line, "ContextTokens", 1))
            outputs.append(_parse_int(row[index["GeneratedTokens"]], source, line, "GeneratedTokens", 1))
        else:
            prompts.append(_parse_int(row[index["num_prefill_tokens"]], source, line, "num_prefill_tokens", 1))
            outputs.append(_parse_int(row[index["num_decode_tokens"]], source, line, "num_decode_tokens", 1))
    return times_us, prompts, outputs


def _json_int(record: dict[str, object], key: str, source: str, line: int, minimum: int) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{source}:{line}: key {key}: expected an integer, got {_json_text(value)}")
    if value < minimum:
        raise TraceError(f"{source}:{line}: key {key}: must be >= {minimum}, got {value}")
    if value > _MAX_TOKEN_COUNT:
        raise TraceError(f"{source}:{line}: key {key}: must be <= {_MAX_TOKEN_COUNT}, got {value}")
    return value


def _json_text(value: object) -> str:
    """A value read from a JSON line as JSON writes it (``[1, 2]``, ``true``, ``"7"``; not Python's ``list``,
    ``True``, ``'7'``), cut to 60 characters."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _parse_mooncake(text: str, source: str) -> _Table:
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    hashes: list[tuple[int, ...]] = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{source}:{line}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{source}:{line}: expected a JSON object, got {_json_text(record)}")
        missing = [k for k in _MOONCAKE_KEYS if k not in record]
        if missing:
            raise TraceError(
                f"{source}:{line}: missing key(s) {', '.join(missing)}; found {sorted(record)}; {_MOONCAKE_FORMAT}"
            )
        stamp = record["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp):
            raise TraceError(f"{source}:{line}: key timestamp: expected a number of ms, got {_json_text(stamp)}")
        prompt = _json_int(record, "input_length", source, line, 1)
        block_ids = record.get("hash_ids", [])
        if not isinstance(block_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in block_ids
        ):
            raise TraceError(f"{source}:{line}: key hash_ids: expected a list of integers")
        if len(block_ids) > math.ceil(prompt / MOONCAKE_BLOCK_TOKENS):
            raise TraceError(
                f"{source}:{line}: key hash_ids: {len(block_ids)} blocks of {MOONCAKE_BLOCK_TOKENS} tokens "
                f"exceed input_length {prompt}"
            )
        times.append(float(stamp))
        prompts.append(prompt)
        outputs.append(_json_int(record, "output_length", source, line, 1))
        hashes.append(tuple(block_ids))
    order = sorted(range(len(times)), key=times.__getitem__)
    return _Table(
        "mooncake",
        tuple(times[i] for i in order),
        tuple(prompts[i] for i in order),
        tuple(outputs[i] for i in order),
        tuple(hashes[i] for i in order),
    )


@functools.cache
def _bundled_table(name: str) -> _Table:
    """The parsed file of bundled trace ``name``.

    Raises:
        TraceError: the file is missing or does not parse (a broken installation); the message names the trace
            by ``name``, then the file where it is installed.
    """
    file = resources.files("sim.data").joinpath(_BUNDLED[name][0])
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise TraceError(f"bundled trace {name}: cannot read {file} ({exc.strerror or exc}); {_REINSTALL}") from None
    try:
        return _parse(data, str(file))
    except TraceError as exc:
        raise TraceError(f"bundled trace {name}: its file is damaged: {exc}; {_REINSTALL}") from None


# ---------------------------------------------------------------------------------------------------------
# Generators


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream]))


def synthetic_arrivals_s(
    num_requests: int,
    rate_per_s: float,
    rng: np.random.Generator,
    *,
    arrival: Literal["poisson", "gamma"] = "poisson",
    cv: float | None = None,
) -> npt.NDArray[np.float64]:
    """Arrival times (s) of a renewal process starting at 0.0: shape ``(num_requests,)``, non-decreasing.

    The ``num_requests - 1`` gaps are i.i.d. with mean ``1 / rate_per_s``: exponential for ``"poisson"``;
    for ``"gamma"`` Gamma(shape ``k = 1/cv²``, scale ``θ = cv² / rate_per_s``), whose coefficient of
    variation is ``cv`` (cv = 1 is Poisson; Llumnix §6 uses Gamma arrivals to vary burstiness).

    Raises:
        ValueError: on a rate <= 0, a negative count, ``cv`` missing/<= 0 for gamma or given for poisson.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not (math.isfinite(rate_per_s) and rate_per_s > 0.0):
        raise ValueError(f"rate_per_s must be finite and > 0, got {rate_per_s}")
    mean_gap_s = 1.0 / rate_per_s
    count = max(num_requests - 1, 0)
    if arrival == "poisson":
        if cv is not None:
            raise ValueError("arrival_cv applies only to arrival='gamma' (Poisson has CV 1)")
        gaps = rng.exponential(mean_gap_s, count)
    elif arrival == "gamma":
        if cv is None or not (MIN_ARRIVAL_CV <= cv <= MAX_ARRIVAL_CV):
            raise ValueError(
                f"arrival='gamma' needs arrival_cv (the inter-arrival CV) from {MIN_ARRIVAL_CV:g} to "
                f"{MAX_ARRIVAL_CV:g}, got {cv}"
            )
        gaps = rng.gamma(1.0 / cv**2, mean_gap_s * cv**2, count)
    else:
        raise ValueError(f"unknown arrival process {arrival!r}; expected 'poisson' or 'gamma'")
    return np.concatenate([np.zeros(min(num_requests, 1)), np.cumsum(gaps)])


# the Gamma inter-arrival CVs taken: its shape 1/cv² from 1e-6 to 1e6 (beyond, its parameters overflow or vanish)
MIN_ARRIVAL_CV, MAX_ARRIVAL_CV = 1e-3, 1e3

_LLUMNIX_ALPHAS = {128: 2.0, 256: 1.5, 512: 1.15, 1024: 1.0005}


def llumnix_zipf_alpha(mean_tokens: int) -> float:
    """Zipf exponent Llumnix uses for a mean length: 128 → 2.0, 256 → 1.5, 512 → 1.15, 1024 → 1.0005,
    any other mean → 1.0 (AlibabaPAI/llumnix benchmark/benchmark_serving.py, ``zipf`` lengths)."""
    return _LLUMNIX_ALPHAS.get(mean_tokens, 1.0)


def llumnix_lengths_tokens(
    num_requests: int,
    mean_tokens: int,
    rng: np.random.Generator,
    *,
    max_tokens: int = LLUMNIX_MAX_TOKENS,
    alpha: float | None = None,
) -> npt.NDArray[np.int64]:
    """Power-law (Zipf) lengths with a target mean, as in Llumnix's synthetic workloads.

    Returns an int64 array of shape ``(num_requests,)``:

    1. Draw ranks ``k`` i.i.d. from ``{1, …, 2·mean − 1}`` with ``P(k) ∝ k^(−alpha)`` (a Zipf law truncated
       to that support; ``alpha`` defaults to :func:`llumnix_zipf_alpha`, 1.5 for mean 256).
    2. Scale by ``s = mean / (sample mean of k)`` and round up: ``len = ceil(s·k)``. So the sample mean of
       the lengths is hit exactly before rounding, and lies in ``[mean, mean + 1)`` after it.
    3. Cap at ``max_tokens`` (6144 as Llumnix), which lowers the mean slightly when the tail is cut.

    Lengths are >= 1. With mean 256 and alpha 1.5, ``s`` ≈ 14.7, so lengths are multiples of ~14.7
    tokens between ~15 and the cap, the median ~30 and the mean 256.

    Raises:
        ValueError: on ``mean_tokens < 1``, ``max_tokens < 1``, ``alpha <= 0`` or a negative count.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if mean_tokens < 1 or max_tokens < 1:
        raise ValueError(f"mean_tokens and max_tokens must be >= 1, got {mean_tokens}, {max_tokens}")
    exponent = llumnix_zipf_alpha(mean_tokens) if alpha is None else alpha
    if not (math.isfinite(exponent) and exponent > 0.0):
        raise ValueError(f"alpha must be finite and > 0, got {exponent}")
    if num_requests == 0:
        return np.zeros(0, dtype=np.int64)
    ranks = np.arange(1, 2 * mean_tokens, dtype=np.float64)
    weights = ranks**-exponent
    sample = rng.choice(ranks, size=num_requests, p=weights / weights.sum())
    scale = mean_tokens / float(sample.mean())
    # The 1e-9 guards integers that floating point puts a hair above themselves (e.g. 256.00000000003).
    lengths = np.ceil(sample * scale - 1e-9).astype(np.int64)
    return np.clip(lengths, 1, max_tokens)


def _spread_buckets_s(times_ms: Sequence[float], rng: np.random.Generator) -> npt.NDArray[np.float64]:
    """Spread requests sharing a quantized timestamp uniformly over their bucket; returns seconds from 0.

    Bucket ``b`` spans ``[t_b, t_{b+1})`` (``t`` the sorted distinct timestamps; the last bucket gets the
    median gap as width). Each request gets ``t_b + U``, ``U ~ Uniform[0, width)``; the offsets of a bucket
    are sorted and given in file order, so the file order is kept. Times are shifted so the first is 0.
    """
    times = np.asarray(times_ms, dtype=np.float64)
    starts = np.unique(times)
    gaps = np.diff(starts)
    last_width = float(np.median(gaps)) if gaps.size else 0.0
    widths = np.append(gaps, last_width)
    bucket = np.searchsorted(starts, times)
    offsets = rng.random(times.size) * widths[bucket]
    # Rows are sorted by time, so each bucket is a contiguous run; lexsort orders by bucket, then offset.
    sorted_offsets = offsets[np.lexsort((offsets, bucket))]
    arrivals_ms = times + sorted_offsets
    result: npt.NDArray[np.float64] = (arrivals_ms - arrivals_ms[0]) / 1000.0
    return result


# ---------------------------------------------------------------------------------------------------------
# Loading


def _resolve(name_or_path: str | os.PathLike[str]) -> tuple[str, str, str, str, _Table | None]:
    """-> (name, source, shown, attribution, table or None for llumnix-synthetic).

    ``shown`` names the trace in error messages as the user named it: ``azure-conv (bundled trace)``,
    ``llumnix-synthetic (generated)``, or a file's path as given (``source`` is the bundled file's place in the
    package, kept in :attr:`Trace.source` but no help in an error about an option).
    """
    if isinstance(name_or_path, str) and name_or_path in TRACE_NAMES:
        if name_or_path == "llumnix-synthetic":
            return name_or_path, "generated", f"{name_or_path} (generated)", _LLUMNIX_ATTRIBUTION, None
        file_name, attribution = _BUNDLED[name_or_path]
        shown = f"{name_or_path} (bundled trace)"
        return name_or_path, f"sim/data/{file_name}", shown, attribution, _bundled_table(name_or_path)
    path = Path(name_or_path)
    if path.is_dir() or not path.exists():  # anything else is read: a file, a pipe (--trace <(zcat t.csv.gz))
        what = "a directory, not a trace file" if path.is_dir() else "no such file"
        raise TraceError(
            f"unknown trace {os.fspath(name_or_path)!r}: not a bundled trace ({', '.join(TRACE_NAMES)}) and {what}"
        )
    name = path.name
    for suffix in (".gz", ".csv", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name, str(path), str(path), _USER_FILE_ATTRIBUTION, _parse(path.read_bytes(), str(path))


def load_trace(
    name_or_path: str | os.PathLike[str],
    *,
    rate_scale: float = 1.0,
    max_requests: int | None = None,
    seed: int = 0,
    arrival: ArrivalKind | None = None,
    rate_per_s: float | None = None,
    arrival_cv: float | None = None,
    num_requests: int | None = None,
    mean_prompt_tokens: int | None = None,
    mean_output_tokens: int | None = None,
    max_tokens: int | None = None,
    spread_buckets: bool | None = None,
) -> Trace:
    """Load a bundled trace (:data:`TRACE_NAMES`) or a trace file, as a :class:`Trace`.

    Files: a CSV in Azure format (``TIMESTAMP,ContextTokens,GeneratedTokens``) or ShareGPT-stats format
    (``num_prefill_tokens,num_decode_tokens``), detected by header, or JSON Lines in Mooncake format
    (``timestamp`` ms, ``input_length``, ``output_length``, optional ``hash_ids``); any may be gzipped.

    Args:
        name_or_path: a bundled name or a file path.
        rate_scale: time compression factor X > 0: every arrival is divided by X (X = 2 doubles the rate).
        max_requests: keep only the first N requests by arrival (after ``rate_scale``).
        seed: seed (int >= 0) of every random choice (bucket spreading, synthetic arrivals and lengths);
            lengths and arrivals use independent streams.
        arrival: ``"trace"`` keeps the file's timestamps (only for Azure and Mooncake formats);
            ``"poisson"`` or ``"gamma"`` draws synthetic arrivals at ``rate_per_s`` (see
            :func:`synthetic_arrivals_s`), keeping the request order. Default: ``"trace"`` when the trace
            has timestamps, else ``"poisson"``.
        rate_per_s: rate of synthetic arrivals, before ``rate_scale``. Default:
            :data:`DEFAULT_SYNTHETIC_RATE_PER_S` (4.0) for ``sharegpt``/``llumnix-synthetic``, the trace's
            own mean rate when re-timing a timestamped trace.
        arrival_cv: coefficient of variation of the Gamma inter-arrival gaps (``arrival="gamma"`` only).
        num_requests: number of requests of traces without timestamps. ShareGPT: default all rows,
            in a seeded random order (a permutation; more than the rows repeats fresh permutations);
            ``llumnix-synthetic``: default :data:`LLUMNIX_DEFAULT_NUM_REQUESTS`.
        mean_prompt_tokens, mean_output_tokens, max_tokens: ``llumnix-synthetic`` only (defaults 256,
            256, :data:`LLUMNIX_MAX_TOKENS`), see :func:`llumnix_lengths_tokens`; prompt and output
            lengths are drawn independently.
        spread_buckets: Mooncake format only. True spreads the requests that share a timestamp uniformly
            (seeded) over their bucket (to the next distinct timestamp; the last bucket gets the median
            bucket width), keeping file order; False keeps each bucket as a burst; default None spreads
            when the file's timestamps are quantized (at most half as many distinct values as requests),
            which is the case for ``mooncake-conv`` (1,180 buckets of ~3 s for 12,031 requests).

    Returns:
        The trace; ids ``"<name>-<i>"``, i the position in arrival order before ``max_requests``.

    Raises:
        TraceError: unknown name or missing file; unknown format (names the file and the expected
            headers/keys); a bad value (names file, line and column/key); an option that does not apply
            to this trace; a bundled file missing or damaged (a broken installation: names the trace, then the
            file). Errors about a user's file start with its path as given, those about a bundled trace with its
            name (``azure-conv (bundled trace)``, ``llumnix-synthetic (generated)``), never its file in sim/data.
        ValueError: a bad argument value (rate_scale <= 0, negative seed or counts, ...), or arrivals (after
            ``rate_scale`` and ``max_requests``) that span more than :data:`MAX_SPAN_S`.
    """
    if not (math.isfinite(rate_scale) and rate_scale > 0.0):
        raise ValueError(f"rate_scale must be finite and > 0, got {rate_scale}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    name, source, shown, attribution, table = _resolve(name_or_path)
    is_llumnix = table is None
    if not is_llumnix and (mean_prompt_tokens, mean_output_tokens, max_tokens) != (None, None, None):
        raise TraceError(f"{shown}: mean_prompt_tokens/mean_output_tokens/max_tokens apply only to llumnix-synthetic")
    if spread_buckets is not None and (table is None or table.kind != "mooncake"):
        raise TraceError(f"{shown}: spread_buckets applies only to Mooncake-format traces")
    has_times = table is not None and table.kind != "sharegpt"
    if arrival is None:
        arrival = "trace" if has_times else "poisson"
    if arrival not in ("trace", "poisson", "gamma"):
        raise ValueError(f"unknown arrival {arrival!r}; expected 'trace', 'poisson' or 'gamma'")
    if arrival == "trace" and not has_times:
        raise TraceError(
            f"{shown}: has no timestamps: its arrivals must be drawn, with arrival (--arrival) poisson or gamma"
        )
    if arrival == "trace" and (rate_per_s is not None or arrival_cv is not None):
        given = [
            name
            for name, v in (("rate_per_s (--rate)", rate_per_s), ("arrival_cv (--arrival-cv)", arrival_cv))
            if v is not None
        ]
        raise TraceError(
            f"{shown}: {' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} only to synthetic arrivals "
            "(arrival poisson or gamma); to replay the trace's own timestamps faster use rate_scale (--rate-scale)"
        )
    if num_requests is not None and has_times:
        raise TraceError(f"{shown}: num_requests applies only to traces without timestamps; use max_requests")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")

    # Lengths (and prefix hashes) in request order.
    hashes: tuple[tuple[int, ...], ...] | None = None
    if table is None:
        count = LLUMNIX_DEFAULT_NUM_REQUESTS if num_requests is None else num_requests
        lengths_rng = _rng(seed, _STREAM_LENGTHS)
        cap = LLUMNIX_MAX_TOKENS if max_tokens is None else max_tokens
        prompt_mean = 256 if mean_prompt_tokens is None else mean_prompt_tokens
        output_mean = 256 if mean_output_tokens is None else mean_output_tokens
        prompts = llumnix_lengths_tokens(count, prompt_mean, lengths_rng, max_tokens=cap)
        outputs = llumnix_lengths_tokens(count, output_mean, lengths_rng, max_tokens=cap)
    elif table.kind == "sharegpt":
        rows = len(table.prompt_tokens)
        count = rows if num_requests is None else num_requests
        lengths_rng = _rng(seed, _STREAM_LENGTHS)
        perms = [lengths_rng.permutation(rows) for _ in range(-(-count // rows))]
        picked = np.concatenate(perms)[:count] if perms else np.zeros(0, dtype=np.int64)
        prompts = np.asarray(table.prompt_tokens, dtype=np.int64)[picked]
        outputs = np.asarray(table.output_tokens, dtype=np.int64)[picked]
    else:
        count = len(table.prompt_tokens)
        prompts = np.asarray(table.prompt_tokens, dtype=np.int64)
        outputs = np.asarray(table.output_tokens, dtype=np.int64)
        hashes = table.block_hashes or None

    # Arrival times, seconds from 0, non-decreasing.
    if arrival == "trace":
        assert table is not None
        spread = spread_buckets
        if table.kind == "mooncake" and spread is None:
            spread = len(set(table.times)) * 2 <= len(table.times)
        if spread:
            arrivals = _spread_buckets_s(table.times, _rng(seed, _STREAM_BUCKETS))
        else:
            scale = 1000.0 if table.kind == "mooncake" else 1.0
            raw = np.asarray(table.times, dtype=np.float64)
            arrivals = (raw - raw[0]) / scale
    else:
        if rate_per_s is None:
            if has_times:
                assert table is not None
                span = table.times[-1] - table.times[0]
                span_s = span / 1000.0 if table.kind == "mooncake" else span
                rate_per_s = count / span_s if span_s > 0 else DEFAULT_SYNTHETIC_RATE_PER_S
            else:
                rate_per_s = DEFAULT_SYNTHETIC_RATE_PER_S
        arrivals = synthetic_arrivals_s(count, rate_per_s, _rng(seed, _STREAM_ARRIVALS), arrival=arrival, cv=arrival_cv)

    keep = count if max_requests is None else min(max_requests, count)
    with np.errstate(over="ignore"):  # a span past a double's range is refused below, by name
        scaled = arrivals / rate_scale
    span_s = float(scaled[keep - 1] - scaled[0]) if keep > 1 else 0.0
    if not span_s <= MAX_SPAN_S:
        raise ValueError(_span_problem(shown, keep, arrivals[:keep], span_s, rate_scale, rate_per_s))
    arrivals = scaled
    block_tokens = MOONCAKE_BLOCK_TOKENS if hashes is not None else 0
    requests = tuple(
        TraceRequest(
            request_id=f"{name}-{i}",
            arrival_s=float(arrivals[i]),
            prompt_tokens=int(prompts[i]),
            output_tokens=int(outputs[i]),
            prefix_block_hashes=hashes[i] if hashes is not None else (),
            prefix_block_tokens=block_tokens if hashes is not None and hashes[i] else 0,
        )
        for i in range(keep)
    )
    return Trace(name=name, source=source, attribution=attribution, requests=requests)


def _span_problem(
    source: str,
    count: int,
    unscaled_s: npt.NDArray[np.float64],
    span_s: float,
    rate_scale: float,
    rate_per_s: float | None,
) -> str:
    """The message of a trace whose arrivals span more than :data:`MAX_SPAN_S`: what to change, and by how much
    (``unscaled_s``: the kept arrivals before ``rate_scale``; ``rate_per_s``: the rate of synthetic arrivals, None for
    the trace's own timestamps). The smallest ``rate_scale`` that fits is rounded up to three significant digits and
    checked by the same division ``load_trace`` makes."""
    first, last = float(unscaled_s[0]), float(unscaled_s[-1])
    least = _round_up_3((last - first) / MAX_SPAN_S)
    while last / least - first / least > MAX_SPAN_S:  # the span as load_trace computes it
        least = _round_up_3(least * (1 + 1e-6))
    fixes = [f"a rate_scale (--rate-scale) of at least {least:.3g}"]
    if rate_per_s is not None:
        rate = rate_per_s * ((last - first) / rate_scale) / MAX_SPAN_S  # synthetic gaps scale as 1 / rate
        if math.isfinite(rate):
            fixes.insert(0, f"a rate_per_s (--rate) of at least {_round_up_3(rate * (1 + 1e-9)):.3g}")
    over = f"{span_s:.3g} s ({span_s / 86_400:.3g} days)" if math.isfinite(span_s) else "more seconds than a double"
    return (
        f"{source}: its first {count:,} requests arrive over {over} of simulated time; hilum simulates at most "
        f"{MAX_SPAN_S:,.0f} s (30 days: past that an idle cluster's 50 ms loops cost minutes for nothing and "
        f"timestamps lose precision): use {', '.join(fixes)} or fewer requests (max_requests, --max-requests)"
    )


def _round_up_3(value: float) -> float:
    """``value`` (> 0, finite) rounded up to three significant digits (as ``:.3g`` prints it, never below)."""
    step = 10.0 ** (math.floor(math.log10(value)) - 2)
    rounded = float(f"{math.ceil(value / step) * step:.3g}")
    return rounded if rounded >= value else float(f"{rounded + step:.3g}")


def with_priorities(trace: Trace, high_fraction: float, seed: int) -> Trace:
    """Return a copy of ``trace`` where ``round(high_fraction · len(trace))`` requests, chosen uniformly
    without replacement with ``random.Random(seed)``, have priority 1; the others keep their priority.

    Raises:
        ValueError: if ``high_fraction`` is not in [0, 1].
    """
    if not (0.0 <= high_fraction <= 1.0):
        raise ValueError(f"high_fraction must be in [0, 1], got {high_fraction}")
    count = round(high_fraction * len(trace.requests))
    chosen = set(random.Random(seed).sample(range(len(trace.requests)), count))
    requests = tuple(replace(r, priority=1) if i in chosen else r for i, r in enumerate(trace.requests))
    return replace(trace, requests=requests)
