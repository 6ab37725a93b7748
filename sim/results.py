"""Results of one simulation run: per-request and per-migration records, summaries, ``results.json``.

The simulator core (``sim.runner.run_simulation``) produces one :class:`SimRun` per policy run;
:func:`summarize` reduces it to a :class:`PolicySummary` (the row printed by ``sim.report`` and the
unit of comparison between policies); :func:`write_results` stores runs as ``results.json``, whose
schema is documented field by field in ``docs/sim-results.md``; :func:`load_results` reads it back.

Large runs: the simulator writes each request's record to a :class:`RequestLog` when it becomes final
(finished, refused, or unfinished at the end). The log spools the records to a temporary file as
compact binary rows (about 110 bytes a request, no token gaps) and keeps in memory only what a summary
needs (:class:`RequestTotals`: a few numbers per request in fixed columns, plus every token gap, 8 bytes
each, because percentiles are exact); ``write_results`` JSON-encodes the spooled records into
``results.json`` one at a time, and nothing is JSON-encoded while the simulation runs. Memory is then
about 70 bytes per request plus 8 bytes per output token, instead of Python objects for every record
and gap.

Percentiles are computed with ``numpy.percentile`` (linear interpolation between closest ranks,
numpy's default ``method="linear"``). An empty sample gives ``None``, never NaN.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import dataclasses
import enum
import json
import math
import operator
import os
import pickle
import secrets
import struct
import tempfile
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, overload

import numpy as np

from policy.types import _trusted_constructor

__all__ = [
    "HIGH_PRIORITY_MIN",
    "RESULTS_FILE_NAME",
    "SCHEMA_VERSION",
    "KvTimeline",
    "MigrationOutcome",
    "MigrationRecord",
    "PolicySummary",
    "RequestLog",
    "RequestRecord",
    "RequestTotals",
    "ResultsError",
    "ScaleRecord",
    "SimRun",
    "StoredRun",
    "SweepRow",
    "atomic_file",
    "busiest_dispatch_share",
    "json_default",
    "load_results",
    "percentile",
    "percentiles",
    "request_totals",
    "results_document",
    "summarize",
    "summary_from_dict",
    "summary_to_dict",
    "write_results",
]

SCHEMA_VERSION = 1
"""Version of the ``results.json`` layout; bumped on any incompatible change (docs/sim-results.md)."""

RESULTS_FILE_NAME = "results.json"

HIGH_PRIORITY_MIN = 1
"""Requests with ``priority >= HIGH_PRIORITY_MIN`` count as high-priority (0 is the normal class)."""

MigrationOutcome = Literal["committed", "aborted"]


class ResultsError(ValueError):
    """A ``results.json`` file (or a record) is malformed; the message names the file and key path."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request of the trace during a simulation run.

    Times are simulated seconds since the start of the run (the trace's time axis).
    """

    request_id: str  # the trace's request id
    priority: int  # scheduling class: 0 normal, >= HIGH_PRIORITY_MIN high
    arrival_s: float  # arrival time at the gateway, s
    prompt_tokens: int  # prompt length, tokens
    output_tokens: int  # target output length from the trace, tokens
    generated_tokens: int  # output tokens actually produced by the end of the run, tokens
    first_token_s: float | None  # time the first output token was produced, s; None if never
    finish_s: float | None  # time the last output token was produced, s; None if unfinished/refused
    token_gaps_s: tuple[float, ...]  # TBT samples: times between consecutive output tokens, s
    preemptions: int  # times the request was preempted (recompute) on its instance
    preempted_s: float  # time lost to preemption (from preemption until resumed decoding), s
    migrations: int  # committed migrations of this request
    refused: str | None  # refusal reason (e.g. "no_capacity"); None if the request was admitted
    instance_id: str  # instance where the request finished (or was last), "" if never placed
    prefix_hit_tokens: int = 0  # prompt tokens its engines reused from their prefix cache (every admission)
    dispatched_instance_id: str = ""  # instance dispatch first placed it on, "" if never placed

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (first_token_s − arrival_s), s; None if no token was produced."""
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency (finish_s − arrival_s), s; None if the request did not finish."""
        if self.finish_s is None:
            return None
        return self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class ScaleRecord:
    """One decision of the autoscaler in a simulation (``hilum sim --autoscale``) and how it went."""

    at_s: float  # simulated time of the decision, s
    action: str  # policy.autoscale.ScaleAction: scale-out, drain, undrain, scale-in, release
    instance_id: str
    reason: str  # the rule that decided, with its figures
    ok: bool = True  # False: it could not be carried out (a stop of an instance not empty after all)
    note: str = ""  # why it failed


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    """One live-migration attempt of a running request (pre-copy, DESIGN.md "Migration")."""

    request_id: str  # the migrated request
    src_instance_id: str  # instance the request ran on
    dst_instance_id: str  # instance that reserved blocks for it
    src_domain_id: str  # NVLink domain of the source instance
    dst_domain_id: str  # NVLink domain of the destination instance
    start_s: float  # time the destination reservation was made, s
    end_s: float  # time of commit (or of abort), s
    downtime_s: float  # time the request was suspended (last stage only), s; 0.0 if never suspended
    bytes_transferred: int | None  # KV-cache bytes copied over all stages, bytes; None = not measured (live)
    stages: int  # pre-copy stages run, including the last (stop-and-copy) stage
    outcome: MigrationOutcome  # "committed": the request resumed on dst; "aborted": it stayed on src
    reason: str  # why the move was made (committed) or why it was aborted
    precopy_bandwidth_bytes_per_s: float = 0.0  # bytes / seconds of the completed live stages; 0 = none
    skipped_prefix_blocks: int = 0  # leading prefix blocks the destination's cache held: adopted, not copied
    recomputed_prefix_blocks: int = 0  # prefix blocks the destination recomputed instead (the cost model's plan)

    @property
    def cross_domain(self) -> bool:
        """True when source and destination are in different NVLink domains."""
        return self.src_domain_id != self.dst_domain_id


@dataclass(frozen=True, slots=True)
class KvTimeline:
    """Per-instance KV-cache usage sampled at regular simulated times.

    Raises:
        ValueError: if a usage series does not have one value per sample time.
    """

    interval_s: float  # sampling interval, s
    times_s: tuple[float, ...]  # sample times, s; shape (num_samples,)
    # instance_id -> used/capacity blocks, shape (num_samples,); the simulator gives each instance's own packed
    # array('d') (a float object per sample would be tens of MB on a large cluster)
    usage_fraction: Mapping[str, Sequence[float]]

    def __post_init__(self) -> None:
        for instance_id, series in self.usage_fraction.items():
            if len(series) != len(self.times_s):
                raise ValueError(
                    f"KvTimeline: usage_fraction[{instance_id!r}] has {len(series)} samples, "
                    f"times_s has {len(self.times_s)}"
                )

    @staticmethod
    def empty() -> KvTimeline:
        """A timeline with no samples (for runs that did not record KV usage)."""
        return KvTimeline(interval_s=0.0, times_s=(), usage_fraction={})


_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord) if f.name != "token_gaps_s")
new_request_record: Callable[..., RequestRecord] = _trusted_constructor(RequestRecord)
"""``RequestRecord(...)`` at a third of the cost, for the simulator's one record per request: it sets the slots
directly (a frozen dataclass's ``__init__`` goes through ``object.__setattr__``); positional, in field order."""
_OPTIONAL_REQUEST = frozenset({"prefix_hit_tokens", "dispatched_instance_id"})  # absent in older files
_GAP_CHUNK = 1 << 17  # token gaps per chunk of RequestTotals' gaps (1 MiB of doubles)


def _request_dict(rec: RequestRecord) -> dict[str, Any]:
    out = {name: getattr(rec, name) for name in _REQUEST_FIELDS}
    out["ttft_s"] = rec.ttft_s
    out["e2e_s"] = rec.e2e_s
    return out


def json_default(value: object) -> Any:
    """``json.dumps`` hook: numpy scalars become Python numbers; anything else is a TypeError."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write a value of type {type(value).__name__} to JSON")


def _request_json(rec: RequestRecord) -> str:
    """A request's object in ``results.json`` (token gaps are not stored), one line."""
    return json.dumps(_request_dict(rec), allow_nan=False, default=json_default)


class RequestTotals:
    """The per-request figures :func:`summarize` needs, kept compactly, for ``num_requests`` requests.

    Arrays over requests in arrival order (``add``'s ``index``), each a numpy view of a fixed-size
    ``array.array`` column that ``add`` stores into (a plain item store, cheaper than a numpy scalar
    store): TTFT, end-to-end latency and mean TBT in seconds (NaN: no value), preemption time in
    seconds, preemption counts, prompt and prefix-hit tokens, and three flags; plus every token gap of
    every request in the order the requests were added (``gaps_s``). Memory: 59 bytes per request
    (seven 8-byte columns, three 1-byte flags) and 8 bytes per token gap, 16 once ``gaps_s`` has been read (its
    joined copy is kept until the next add).

    The gaps are stored in chunks of about ``_GAP_CHUNK`` doubles (1 MiB; a request's gaps never straddle two), not
    in one growing array: an array grows by 1/16 at a time, and each growth copies all of it, which for a
    long run's tens of megabytes of gaps is many times their size in memory traffic, far outside the CPU's
    caches. ``gaps_s`` joins the chunks once when read.

    Raises ValueError for a negative ``num_requests``, IndexError for an index out of range.
    """

    def __init__(self, num_requests: int) -> None:
        if num_requests < 0:
            raise ValueError(f"RequestTotals: num_requests = {num_requests}, need >= 0")
        self.num_requests = num_requests
        n = num_requests
        self._ttft_s = array.array("d", [math.nan]) * n
        self._e2e_s = array.array("d", [math.nan]) * n
        self._decode_mean_s = array.array("d", [math.nan]) * n
        self._preempted_s = array.array("d", [0.0]) * n
        self._preemptions = array.array("q", [0]) * n
        self._high_priority = array.array("b", [0]) * n
        self._finished = array.array("b", [0]) * n
        self._refused = array.array("b", [0]) * n
        self._prompt_tokens = array.array("q", [0]) * n
        self._prefix_hit_tokens = array.array("q", [0]) * n
        # numpy views of the columns (shape (num_requests,), no copy; the columns are never resized)
        self.ttft_s = np.frombuffer(self._ttft_s, dtype=np.float64)  # first_token_s - arrival_s
        self.e2e_s = np.frombuffer(self._e2e_s, dtype=np.float64)  # finish_s - arrival_s
        self.decode_mean_s = np.frombuffer(self._decode_mean_s, dtype=np.float64)  # mean of the request's gaps
        self.preempted_s = np.frombuffer(self._preempted_s, dtype=np.float64)  # time lost to preemption
        self.preemptions = np.frombuffer(self._preemptions, dtype=np.int64)
        self.high_priority = np.frombuffer(self._high_priority, dtype=np.bool_)  # priority >= HIGH_PRIORITY_MIN
        self.finished = np.frombuffer(self._finished, dtype=np.bool_)
        self.refused = np.frombuffer(self._refused, dtype=np.bool_)
        self.prompt_tokens = np.frombuffer(self._prompt_tokens, dtype=np.int64)
        self.prefix_hit_tokens = np.frombuffer(self._prefix_hit_tokens, dtype=np.int64)  # reused from a prefix cache
        self._gaps = array.array("d")  # the chunk being filled
        self._full_chunks: list[array.array[float]] = []  # the chunks before it, in order
        self._chunk_starts: list[int] = [0]  # where each chunk (the full ones, then _gaps) starts in gaps_s
        self._joined: np.ndarray[Any, np.dtype[np.float64]] | None = None  # gaps_s, joined at its last read
        self.max_finish_s = 0.0  # the latest finish_s, 0 before any

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> RequestTotals:
        """The totals of a sequence of records (index = position)."""
        totals = cls(len(records))
        for i, rec in enumerate(records):
            totals.add(i, rec)
        return totals

    def add(self, index: int, rec: RequestRecord, gaps_s: array.array[float] | None = None) -> None:
        """Count the final record of the request at arrival position ``index`` (each index once); ``gaps_s``, when
        given, are its token gaps packed (``array('d')``) in place of ``rec.token_gaps_s``, which must then be empty
        (see :meth:`RequestLog.add`). Raises IndexError for an index out of range, TypeError for ``gaps_s`` not an
        ``array('d')``, ValueError for gaps given both ways, struct.error for a gap that is not a real number
        (nothing counted then)."""
        if not 0 <= index < self.num_requests:
            raise IndexError(f"RequestTotals.add: index {index} outside 0..{self.num_requests - 1}")
        _check_packed_gaps("RequestTotals.add", rec, gaps_s)
        gaps: Sequence[float] = rec.token_gaps_s if gaps_s is None else gaps_s
        if gaps:  # the gaps first: packing a bad one raises before anything is counted
            if len(self._gaps) >= _GAP_CHUNK:  # a new chunk before this request's gaps, so that they are in one
                self._chunk_starts.append(self._chunk_starts[-1] + len(self._gaps))
                self._full_chunks.append(self._gaps)
                self._gaps = array.array("d")
            if gaps_s is not None:
                self._gaps.extend(gaps_s)  # one copy of the doubles
            else:  # packed in one C pass (array.extend goes item by item), then summed while in cache
                self._gaps.frombytes(struct.pack(f"{len(gaps)}d", *gaps))
            self._decode_mean_s[index] = sum(gaps) / len(gaps)  # the same sum, in the same order, either way
            self._joined = None
        if (ttft := rec.ttft_s) is not None:
            self._ttft_s[index] = ttft
        if (e2e := rec.e2e_s) is not None:
            self._e2e_s[index] = e2e
        self._preempted_s[index] = rec.preempted_s
        self._preemptions[index] = rec.preemptions
        self._high_priority[index] = rec.priority >= HIGH_PRIORITY_MIN
        self._finished[index] = rec.finish_s is not None
        self._refused[index] = rec.refused is not None
        self._prompt_tokens[index] = rec.prompt_tokens
        self._prefix_hit_tokens[index] = rec.prefix_hit_tokens
        if rec.finish_s is not None and rec.finish_s > self.max_finish_s:
            self.max_finish_s = rec.finish_s

    @property
    def num_gaps(self) -> int:
        """Token gaps added so far (the length of :attr:`gaps_s`)."""
        return self._chunk_starts[-1] + len(self._gaps)

    @property
    def gaps_s(self) -> np.ndarray[Any, np.dtype[np.float64]]:
        """Every token gap (TBT sample) of every request added, seconds, shape (num_gaps,): the chunks joined into one
        array, a copy made at the first read and kept until the next add (never a view of a chunk: an exported
        buffer would keep the chunk being filled from growing)."""
        if self._joined is None:
            self._joined = np.concatenate(
                [np.frombuffer(c, dtype=np.float64) for c in (*self._full_chunks, self._gaps)]
            )
        return self._joined

    def gaps_of(self, start: int, count: int) -> tuple[float, ...]:
        """The ``count`` gaps from position ``start`` of :attr:`gaps_s` that one request added (they lie in one
        chunk), without joining the chunks. Raises IndexError outside the gaps added."""
        if start < 0 or count < 0 or start + count > self.num_gaps:
            raise IndexError(f"RequestTotals.gaps_of: {count} gaps from {start}, outside 0..{self.num_gaps}")
        k = bisect.bisect_right(self._chunk_starts, start) - 1
        chunk = self._gaps if k == len(self._full_chunks) else self._full_chunks[k]
        offset = start - self._chunk_starts[k]
        return tuple(chunk[offset : offset + count])


def _check_packed_gaps(where: str, rec: RequestRecord, gaps_s: object) -> None:
    """Refuse packed gaps that are not an ``array('d')`` (TypeError) or that come beside gaps in the record
    (ValueError); ``None`` (no packed gaps) passes."""
    if gaps_s is None:
        return
    if not isinstance(gaps_s, array.array) or gaps_s.typecode != "d":
        kind = f"array('{gaps_s.typecode}')" if isinstance(gaps_s, array.array) else type(gaps_s).__name__
        raise TypeError(f"{where}: gaps_s of request {rec.request_id!r} must be an array('d') of seconds, got {kind}")
    if rec.token_gaps_s:
        raise ValueError(f"{where}: request {rec.request_id!r} has token gaps in its record and in gaps_s")


_request_values = operator.attrgetter(*_REQUEST_FIELDS)  # a record's stored fields, in _REQUEST_FIELDS order

_SPOOL_BUFFER_BYTES = 1 << 16  # the spool's write buffer: one write(2) per ~500 records


class RequestLog(Sequence["RequestRecord"]):
    """The request records of a large run, streamed: each written to a spool file when it becomes final.

    ``add(index, record)`` stores the final record of the request at arrival position ``index``; the log
    reads as a sequence of ``num_requests`` records in arrival order (from the spool, token gaps
    included), and :attr:`totals` holds what :func:`summarize` needs in memory. The spool is an
    anonymous temporary file, removed when the log is closed or collected. Pickling a log gives a tuple
    of its records.

    The spool holds each record as one pickled row: its fields but the token gaps, as given, and where
    its gaps lie in ``totals.gaps_s``. A row is cheap to write (no JSON encoding while the simulation
    runs), reads back exactly (same values, same types), and becomes its ``results.json`` object
    (:meth:`json_line`, the same encoding a record outside a log gets) only when someone reads the
    log or writes ``results.json``; so a value with no JSON form (or NaN) is refused then, not by
    ``add``. Sizes: on disk about 110 bytes per request in a run of a bundled trace (its JSON object:
    about 440; a byte more per character more in its ids) and nothing per token (the gaps are kept once, in the
    totals); in memory 8 bytes per request for the row's offset, plus :class:`RequestTotals`' 59 bytes
    per request and 8 per token gap, plus the spool's 64 KiB write buffer: 67 bytes per request and 8
    per token gap in all.

    Raises ValueError for a negative ``num_requests`` or a second record for one index; reading a
    request not recorded yet raises LookupError.
    """

    def __init__(self, num_requests: int) -> None:
        self.totals = RequestTotals(num_requests)
        self._spool = tempfile.TemporaryFile(buffering=_SPOOL_BUFFER_BYTES)  # noqa: SIM115 - lives as long as the log
        weakref.finalize(self, self._spool.close)  # the log collected: the spool goes too, quietly
        self._end = 0  # bytes written
        self._read_since_write = False  # the file position is not at the end
        self._offset = array.array("q", [-1]) * num_requests  # where each record's row starts, -1: none yet

    def add(self, index: int, rec: RequestRecord, gaps_s: array.array[float] | None = None) -> None:
        """Store the final record of the request at arrival position ``index``.

        ``gaps_s``: its token gaps already packed as ``array('d')``, given in place of ``rec.token_gaps_s``, which
        must then be empty; the simulator keeps a request's gaps packed while it runs, and so never makes a float
        object per token (nor reads a run's worth of them back from memory when the request finishes).

        Raises IndexError outside the log, ValueError for an index already recorded or for gaps given both ways,
        TypeError for ``gaps_s`` not an ``array('d')``, struct.error for a gap that is not a real number; nothing is
        stored then.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"RequestLog.add: index {index} outside 0..{len(self) - 1}")
        if self._offset[index] >= 0:
            raise ValueError(f"RequestLog.add: request {rec.request_id!r} (index {index}) is already recorded")
        _check_packed_gaps("RequestLog.add", rec, gaps_s)
        num_gaps = len(rec.token_gaps_s) if gaps_s is None else len(gaps_s)
        row = pickle.dumps((self.totals.num_gaps, num_gaps, _request_values(rec)), pickle.HIGHEST_PROTOCOL)
        self.totals.add(index, rec, gaps_s)  # raises (for a gap that is not a number) before it counts anything
        if self._read_since_write:  # a seek flushes the write buffer: only after a read moved the position
            self._spool.seek(self._end)
            self._read_since_write = False
        self._spool.write(row)
        self._offset[index] = self._end
        self._end += len(row)

    @property
    def spool_bytes(self) -> int:
        """Bytes written to the spool file so far."""
        return self._end

    def _stored(self, index: int, *, gaps: bool) -> RequestRecord:
        """The record stored for ``index`` (0 <= index < len), with its token gaps or with ``()``."""
        offset = self._offset[index]
        if offset < 0:
            raise LookupError(f"RequestLog: request {index} has no record yet")
        self._spool.seek(offset)
        self._read_since_write = True
        gap_start, gap_count, values = pickle.load(self._spool)  # our own spool (written by add); reads one row
        token_gaps_s = self.totals.gaps_of(gap_start, gap_count) if gaps else ()
        return RequestRecord(**dict(zip(_REQUEST_FIELDS, values, strict=True)), token_gaps_s=token_gaps_s)

    def json_line(self, index: int) -> str:
        """The JSON object of the request at ``index`` as in ``results.json`` (encoded now, from the spool).

        Raises IndexError outside the log, LookupError if it has no record yet, TypeError or ValueError if a
        field has no JSON form."""
        if not 0 <= index < len(self):
            raise IndexError(f"RequestLog: index {index} outside a log of {len(self)}")
        return _request_json(self._stored(index, gaps=False))

    def __len__(self) -> int:
        return self.totals.num_requests

    @overload
    def __getitem__(self, index: int) -> RequestRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[RequestRecord]: ...

    def __getitem__(self, index: int | slice) -> RequestRecord | list[RequestRecord]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"RequestLog: index {index} outside a log of {len(self)}")
        return self._stored(index % len(self), gaps=True)

    def __iter__(self) -> Iterator[RequestRecord]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same records (a tuple of them, another log)."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (list(self),))

    def close(self) -> None:
        """Remove the spool (the records can no longer be read; the totals stay)."""
        self._spool.close()


def request_totals(requests: Sequence[RequestRecord]) -> RequestTotals:
    """The totals of a run's requests: kept by a :class:`RequestLog`, computed for any other sequence."""
    return requests.totals if isinstance(requests, RequestLog) else RequestTotals.of(requests)


@dataclass(frozen=True, slots=True)
class SimRun:
    """Everything one simulation run produced: its spec, records and cost."""

    policy: str  # scheduling policy name (e.g. "hilum", "llumnix", "round-robin")
    topology: str  # topology name or file
    trace: str  # trace name or file
    seed: int  # seed of the run's random sources
    rate_scale: float  # arrival-rate multiplier applied to the trace (1.0 = as recorded)
    sim_duration_s: float  # simulated time to the run's end, s: its last finish, or a refusal after it
    wall_s: float  # wall-clock time the run took, s
    engine_steps: int | None  # engine steps simulated over all instances; None = not counted (a live run)
    requests: Sequence[RequestRecord]  # one record per trace request, arrival order (a RequestLog from the simulator)
    migrations: tuple[MigrationRecord, ...]  # one record per migration attempt, start order
    kv: KvTimeline  # per-instance KV usage over time
    config: Mapping[str, object] = field(default_factory=dict)  # resolved options (JSON-able values)
    gpu_hours: float | None = None  # Σ over instances of the time their GPUs were held × GPUs, GPU-hours
    scale_events: tuple[ScaleRecord, ...] = ()  # the autoscaler's decisions, in order (--autoscale)


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """The comparison row of one run. Latencies in seconds (the table shows ms); None = no sample."""

    policy: str  # scheduling policy name
    requests: int  # requests in the trace
    finished: int  # requests whose last token was produced
    refused: int  # requests refused at admission
    ttft_p50_s: float | None  # median TTFT over requests with a first token, s
    ttft_p99_s: float | None  # P99 TTFT, s
    tbt_p50_s: float | None  # median TBT over all token gaps of all requests, s
    tbt_p99_s: float | None  # P99 TBT, s
    e2e_p99_s: float | None  # P99 end-to-end latency over finished requests, s
    high_priority_ttft_p99_s: float | None  # P99 TTFT of high-priority requests, s; None if none
    preemptions: int  # preemptions summed over requests
    preempted_s: float  # time lost to preemption summed over requests, s
    migrations_intra_domain: int  # committed migrations inside one NVLink domain
    migrations_cross_domain: int  # committed migrations between domains
    migrations_aborted: int  # aborted migration attempts (both kinds)
    # bytes sent between domains by all cross-domain attempts, bytes; None when a move's bytes are not known
    cross_domain_bytes: int | None
    downtime_mean_s: float | None  # mean downtime of committed migrations, s
    downtime_p99_s: float | None  # P99 downtime of committed migrations, s
    sim_duration_s: float  # simulated duration, s
    engine_steps: int | None  # engine steps over all instances; None = not counted (a live run)
    wall_s: float  # wall-clock time of the run, s
    requests_per_wall_s: float | None  # simulated requests per wall-clock second; None if wall_s <= 0
    decode_p99_s: float | None = None  # P99 over requests of their mean TBT (Llumnix's "decode latency"), s
    high_priority_ttft_mean_s: float | None = None  # mean TTFT of high-priority requests, s; None if none
    normal_ttft_mean_s: float | None = None  # mean TTFT of normal (priority 0) requests, s; None if none
    normal_ttft_p99_s: float | None = None  # P99 TTFT of normal (priority 0) requests, s; None if none
    gpu_hours: float | None = None  # GPUs held (serving, cold-starting) × time until the run's end, GPU-hours
    scale_outs: int = 0  # instances the autoscaler started
    scale_ins: int = 0  # instances the autoscaler stopped
    prefix_hit_rate: float | None = None  # Σ prompt tokens reused from prefix caches / Σ prompt tokens (admitted)
    high_priority_ttft_count: int = 0  # high-priority requests with a first token: what the two figures above are over


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation; None when empty.

    Raises:
        ValueError: if ``q`` is outside [0, 100].
    """
    return percentiles(values, (q,))[0]


def percentiles(values: Iterable[float], qs: Iterable[float]) -> tuple[float | None, ...]:
    """:func:`percentile` of ``values`` at each of ``qs``, in one pass over them (one partial sort for every q:
    the same figures as one call per q, at the cost of one); every figure None when ``values`` is empty.

    Raises:
        ValueError: if a q is outside [0, 100].
    """
    at = tuple(qs)  # read once (a generator would be spent by the check)
    for q in at:
        if not 0.0 <= q <= 100.0:
            raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    # an array (the totals' columns, every token gap) as it is: fromiter would walk it element by element
    arr = np.asarray(values, dtype=np.float64) if isinstance(values, np.ndarray) else np.fromiter(values, np.float64)
    if arr.size == 0:
        return (None,) * len(at)
    return tuple(float(x) for x in np.percentile(arr, at, method="linear"))


def _total_or_none(values: Sequence[int | None]) -> int | None:
    """The sum, or None when any value is not known."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(np.asarray(values, dtype=np.float64))) if values else None


def summarize(run: SimRun) -> PolicySummary:
    """Reduce a run to its :class:`PolicySummary`.

    TTFT is taken over requests that produced a first token, end-to-end latency over finished ones,
    TBT over every token gap of every request. Migration counts split committed moves by
    :attr:`MigrationRecord.cross_domain`; ``cross_domain_bytes`` also counts aborted cross-domain
    attempts (their bytes did cross the network); downtime statistics cover committed moves only.
    The request figures come from :func:`request_totals` (kept by the run's :class:`RequestLog`).
    """
    t = request_totals(run.requests)
    has_ttft = ~np.isnan(t.ttft_s)
    committed = [m for m in run.migrations if m.outcome == "committed"]
    downtimes = [m.downtime_s for m in committed]
    n = t.num_requests
    ttft_p50_s, ttft_p99_s = percentiles(t.ttft_s[has_ttft], (50, 99))
    tbt_p50_s, tbt_p99_s = percentiles(t.gaps_s, (50, 99))  # every token gap: millions in a long run
    return PolicySummary(
        policy=run.policy,
        requests=n,
        finished=int(t.finished.sum()),
        refused=int(t.refused.sum()),
        ttft_p50_s=ttft_p50_s,
        ttft_p99_s=ttft_p99_s,
        tbt_p50_s=tbt_p50_s,
        tbt_p99_s=tbt_p99_s,
        e2e_p99_s=percentile(t.e2e_s[~np.isnan(t.e2e_s)], 99),
        high_priority_ttft_p99_s=percentile(t.ttft_s[has_ttft & t.high_priority], 99),
        preemptions=int(t.preemptions.sum()),
        preempted_s=float(sum(t.preempted_s.tolist())),  # in arrival order, as a sum over the records
        migrations_intra_domain=sum(1 for m in committed if not m.cross_domain),
        migrations_cross_domain=sum(1 for m in committed if m.cross_domain),
        migrations_aborted=sum(1 for m in run.migrations if m.outcome == "aborted"),
        cross_domain_bytes=_total_or_none([m.bytes_transferred for m in run.migrations if m.cross_domain]),
        downtime_mean_s=_mean(downtimes),
        downtime_p99_s=percentile(downtimes, 99),
        sim_duration_s=run.sim_duration_s,
        engine_steps=run.engine_steps,
        wall_s=run.wall_s,
        requests_per_wall_s=n / run.wall_s if run.wall_s > 0 else None,
        decode_p99_s=percentile(t.decode_mean_s[~np.isnan(t.decode_mean_s)], 99),
        high_priority_ttft_mean_s=_mean(t.ttft_s[has_ttft & t.high_priority].tolist()),
        normal_ttft_mean_s=_mean(t.ttft_s[has_ttft & ~t.high_priority].tolist()),
        normal_ttft_p99_s=percentile(t.ttft_s[has_ttft & ~t.high_priority], 99),
        gpu_hours=run.gpu_hours,
        scale_outs=sum(1 for e in run.scale_events if e.action == "scale-out" and e.ok),
        scale_ins=sum(1 for e in run.scale_events if e.action == "scale-in" and e.ok),
        prefix_hit_rate=_hit_rate(t),
        high_priority_ttft_count=int((has_ttft & t.high_priority).sum()),
    )


def busiest_dispatch_share(requests: Iterable[RequestRecord], num_instances: int) -> float | None:
    """Requests dispatch placed on the busiest instance over its fair share (placed requests / ``num_instances``):
    1.0 is a perfectly even spread; None when no request was placed. Raises ValueError for ``num_instances`` < 1."""
    if num_instances < 1:
        raise ValueError(f"busiest_dispatch_share: num_instances = {num_instances}, need >= 1")
    counts = Counter(r.dispatched_instance_id for r in requests if r.dispatched_instance_id)
    if not counts:
        return None
    return max(counts.values()) / (sum(counts.values()) / num_instances)


def _hit_rate(t: RequestTotals) -> float | None:
    """Prompt tokens reused from prefix caches over the prompt tokens of the admitted requests (None: none).

    A request preempted and admitted again may hit again, so this is the share of prompt tokens a request's
    first prefill would have computed that some prefill did not (it can exceed 1 only under repeated
    preemption of cached prompts)."""
    admitted = ~t.refused
    prompt = int(t.prompt_tokens[admitted].sum())
    return int(t.prefix_hit_tokens[admitted].sum()) / prompt if prompt else None


# --------------------------------------------------------------------------------------------------
# results.json


@dataclass(frozen=True, slots=True)
class StoredRun:
    """One run as read back from ``results.json`` (token gaps and the KV timeline are not stored)."""

    policy: str
    topology: str
    trace: str
    seed: int
    rate_scale: float
    config: Mapping[str, object]  # as stored (JSON values)
    summary: PolicySummary
    requests: tuple[RequestRecord, ...]  # token_gaps_s is () in every record
    migrations: tuple[MigrationRecord, ...]


_MIGRATION_FIELDS = tuple(f.name for f in dataclasses.fields(MigrationRecord))
_OPTIONAL_MIGRATION = frozenset({"skipped_prefix_blocks", "recomputed_prefix_blocks"})  # absent in older files
_SUMMARY_FIELDS = tuple(f.name for f in dataclasses.fields(PolicySummary))
#: Summary fields a results.json written before them lacks (read as their default).
_OPTIONAL_SUMMARY = frozenset({"gpu_hours", "scale_outs", "scale_ins", "prefix_hit_rate", "high_priority_ttft_count"})


def _to_json_value(value: object, where: str) -> Any:
    """Convert a config value to plain JSON types, or raise naming its key path."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.generic):
        return _to_json_value(value.item(), where)
    if isinstance(value, enum.Enum):
        return _to_json_value(value.value, where)
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json_value(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _to_json_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [_to_json_value(v, f"{where}[{i}]") for i, v in enumerate(items)]
    raise TypeError(f"{where}: cannot write a value of type {type(value).__name__} to JSON")


def _finite_or_none(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _summary_dict(summary: PolicySummary) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _SUMMARY_FIELDS:
        value = getattr(summary, name)
        out[name] = _finite_or_none(value) if isinstance(value, float) else value
    return out


def _migration_dict(rec: MigrationRecord) -> dict[str, Any]:
    out = {name: getattr(rec, name) for name in _MIGRATION_FIELDS}
    out["cross_domain"] = rec.cross_domain
    return out


def _run_head(index: int, run: SimRun) -> dict[str, Any]:
    """A run's ``spec`` and ``summary`` objects."""
    spec = {
        "policy": run.policy,
        "topology": run.topology,
        "trace": run.trace,
        "seed": run.seed,
        "rate_scale": run.rate_scale,
        "config": _to_json_value(run.config, f"runs[{index}].spec.config"),
    }
    return {"spec": spec, "summary": _summary_dict(summarize(run))}


def _request_lines(run: SimRun) -> Iterator[str]:
    """The JSON object of each request of ``run``, in order (a log's are read back as stored)."""
    requests = run.requests
    if isinstance(requests, RequestLog):
        for i in range(len(requests)):
            yield requests.json_line(i)
    else:
        for rec in requests:
            yield _request_json(rec)


def results_document(runs: Sequence[SimRun]) -> dict[str, Any]:
    """The JSON document written by :func:`write_results` (see docs/sim-results.md), in memory.

    Raises:
        TypeError: if a run's config holds a value with no JSON form (message names the key path).
    """
    doc_runs = []
    for i, run in enumerate(runs):
        doc = _run_head(i, run)
        doc["requests"] = [json.loads(line) for line in _request_lines(run)]
        doc["migrations"] = [_migration_dict(m) for m in run.migrations]
        doc["scale_events"] = [dataclasses.asdict(e) for e in run.scale_events]
        doc_runs.append(doc)
    return {"schema_version": SCHEMA_VERSION, "runs": doc_runs}


@contextlib.contextmanager
def atomic_file(path: Path, *, binary: bool = False) -> Iterator[IO[Any]]:
    """Write ``path`` whole or not at all: a temporary file beside it (``.NAME.PID.XXXX.tmp``, UTF-8 text unless
    ``binary``) that replaces it when the block ends cleanly (``os.replace``: a reader sees the old file or the new
    one, complete), and is removed when the block raises, an interrupt (Ctrl-C) included, leaving ``path`` as it
    was. Raises OSError when the folder cannot be written or ``path`` is a folder (before anything is written)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder")
    # opened by name, not by tempfile.mkstemp: the file gets the permissions the umask gives (mkstemp's are 0600)
    name = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(name, "xb" if binary else "x", encoding=None if binary else "utf-8") as f:
            yield f
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def write_results(runs: Sequence[SimRun], out_dir: str | Path) -> Path:
    """Write ``results.json`` for ``runs`` into ``out_dir`` (created if missing); return its path.

    The layout is documented in docs/sim-results.md; the document is :func:`results_document`'s, written
    one record per line without building it in memory (a :class:`RequestLog`'s records are copied from
    its spool). Token gaps and KV timelines are not stored (they are summarised and plotted instead).
    The JSON is strict: no NaN or Infinity. Written whole or not at all (:func:`atomic_file`): an error or an
    interrupt while it is written leaves an earlier ``results.json`` as it was.

    Raises:
        TypeError: if a run's config holds a value with no JSON form.
        OSError: if the directory or file cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE_NAME
    heads = [_run_head(i, run) for i, run in enumerate(runs)]  # config errors before the file is touched

    def dumps(value: object) -> str:
        return json.dumps(value, allow_nan=False, default=json_default)

    with atomic_file(path) as f:
        f.write(f'{{"schema_version": {SCHEMA_VERSION}, "runs": [')
        for i, (run, head) in enumerate(zip(runs, heads, strict=True)):
            f.write(",\n" if i else "\n")
            f.write(f'{{"spec": {dumps(head["spec"])},\n"summary": {dumps(head["summary"])},\n"requests": [')
            for j, line in enumerate(_request_lines(run)):
                f.write(",\n" if j else "\n")
                f.write(line)
            f.write('\n],\n"migrations": [')
            for j, mig in enumerate(run.migrations):
                f.write(",\n" if j else "\n")
                f.write(dumps(_migration_dict(mig)))
            f.write('\n],\n"scale_events": [')
            for j, event in enumerate(run.scale_events):
                f.write(",\n" if j else "\n")
                f.write(dumps(dataclasses.asdict(event)))
            f.write("\n]}")
        f.write("\n]}\n")
    return path


def _require(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ResultsError(f"{where}: missing key {key!r}")
    return obj[key]


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ResultsError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _record(cls: type[Any], names: Sequence[str], obj: Any, where: str, **extra: Any) -> Any:
    data = _mapping(obj, where)
    kwargs = {name: _require(data, name, where) for name in names}
    try:
        return cls(**kwargs, **extra)
    except (TypeError, ValueError) as exc:
        raise ResultsError(f"{where}: {exc}") from exc


def _summary_from(obj: Any, where: str) -> PolicySummary:
    """A summary; the fields added after the first layout (those with a default) may be absent."""
    data = _mapping(obj, where)
    present = [f.name for f in dataclasses.fields(PolicySummary) if f.name in data or f.name not in _OPTIONAL_SUMMARY]
    summary: PolicySummary = _record(PolicySummary, present, data, where)
    return summary


def summary_from_dict(obj: Mapping[str, Any], where: str = "summary") -> PolicySummary:
    """Rebuild a :class:`PolicySummary` from its JSON object (as in results.json and sweep.json).

    Raises:
        ResultsError: if a field is missing (the message names ``where`` and the key).
    """
    return _summary_from(obj, where)


def summary_to_dict(summary: PolicySummary) -> dict[str, Any]:
    """The JSON object of a :class:`PolicySummary` (non-finite floats become null)."""
    return _summary_dict(summary)


def stored_policies(path: str | Path) -> list[str]:
    """The policies of the runs a ``results.json`` written by :func:`write_results` holds, read from their specs
    alone (one per line, as it writes them: a file of millions of records is not parsed); empty when the file is
    missing, unreadable or not laid out so (nothing is claimed of a file hilum did not write)."""
    policies = []
    try:
        with Path(path).open(encoding="utf-8") as f:
            for line in f:
                if line.startswith('{"spec": {'):
                    spec = json.loads(line.removeprefix('{"spec": ').rstrip().removesuffix(","))
                    policies.append(str(spec["policy"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return []
    return policies


def load_results(path: str | Path) -> list[StoredRun]:
    """Read a ``results.json`` written by :func:`write_results`.

    Raises:
        ResultsError: on invalid JSON, an unsupported ``schema_version`` or a missing key; the
            message gives the file and the key path
            (e.g. ``out/results.json: runs[0].summary: missing key 'policy'``).
        OSError: if the file cannot be read.
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{p}: not valid JSON: {exc}") from exc
    top = _mapping(doc, str(p))
    version = _require(top, "schema_version", str(p))
    if version != SCHEMA_VERSION:
        raise ResultsError(f"{p}: schema_version: unsupported {version!r} (this reader: {SCHEMA_VERSION})")
    runs_obj = _require(top, "runs", str(p))
    if not isinstance(runs_obj, list):
        raise ResultsError(f"{p}: runs: expected a list")
    stored: list[StoredRun] = []
    for i, run_obj in enumerate(runs_obj):
        where = f"{p}: runs[{i}]"
        run_map = _mapping(run_obj, where)
        spec = _mapping(_require(run_map, "spec", where), f"{where}.spec")
        reqs = _require(run_map, "requests", where)
        migs = _require(run_map, "migrations", where)
        if not isinstance(reqs, list) or not isinstance(migs, list):
            raise ResultsError(f"{where}: requests and migrations must be lists")
        stored.append(
            StoredRun(
                policy=_require(spec, "policy", f"{where}.spec"),
                topology=_require(spec, "topology", f"{where}.spec"),
                trace=_require(spec, "trace", f"{where}.spec"),
                seed=_require(spec, "seed", f"{where}.spec"),
                rate_scale=_require(spec, "rate_scale", f"{where}.spec"),
                config=_mapping(_require(spec, "config", f"{where}.spec"), f"{where}.spec.config"),
                summary=_summary_from(_require(run_map, "summary", where), f"{where}.summary"),
                requests=tuple(
                    _record(
                        RequestRecord,
                        [n for n in _REQUEST_FIELDS if n not in _OPTIONAL_REQUEST or n in r],
                        r,
                        f"{where}.requests[{j}]",
                        token_gaps_s=(),
                    )
                    for j, r in enumerate(reqs)
                ),
                migrations=tuple(
                    _record(
                        MigrationRecord,
                        [n for n in _MIGRATION_FIELDS if n not in _OPTIONAL_MIGRATION or n in m],
                        m,
                        f"{where}.migrations[{j}]",
                    )
                    for j, m in enumerate(migs)
                ),
            )
        )
    return stored


@dataclass(frozen=True, slots=True)
class SweepRow:
    """The result of one grid point: where it ran and its summary."""

    topology: str
    trace: str
    policy: str
    rate_scale: float  # arrival-rate multiplier
    seed: int
    max_requests: int | None
    summary: PolicySummary
    # the run's step-time models scaled from another GPU's (its config's derived_latency_models); () when measured
    derived_latency_models: tuple[str, ...] = ()
