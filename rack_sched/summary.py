"""What a domain scheduler publishes in etcd: its domain summary with each instance's load.

``P summaries/<domain>`` holds a ``global_coord.records.SummaryRecord`` (the fields of
``policy.domain.DomainSummary``) plus ``instances``: one :class:`InstanceLoadEntry` per instance with a load
report, sorted by instance id. ``hilumctl drain --wait`` reads ``num_running``/``num_waiting``/``draining`` of
an instance from there (through the coordinator's ListInstances): the domain scheduler is the only holder of
exact per-instance load.

:class:`RackSummaryRecord` extends ``SummaryRecord`` with that field so that ``SummaryPublisher`` and
``records.encode`` write it unchanged; its JSON is exactly the ``SummaryRecord.instances`` /
``InstanceLoadRecord`` format the ctl helper adds to ``global_coord.records`` (same field names and order).
Readers use :func:`decode_summary`, which accepts records with or without ``instances``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields

from global_coord.records import RecordError, SummaryRecord, decode
from policy.domain import DomainSummary
from policy.types import InstanceLoad

__all__ = ["InstanceLoadEntry", "RackSummaryRecord", "decode_summary", "summary_record"]


@dataclass(frozen=True, slots=True)
class InstanceLoadEntry:
    """One instance's load as its domain scheduler sees it (exact, fresh)."""

    instance_id: str
    used_blocks: int  # KV cache blocks held (reservations for incoming migrations included)
    num_running: int  # requests in its running batch
    num_waiting: int  # requests queued on it
    draining: bool  # the scheduler applies a drain intent to it: nothing new arrives, everything leaves

    @classmethod
    def of(cls, load: InstanceLoad) -> InstanceLoadEntry:
        """Copy an ``InstanceLoad`` (``num_running`` = ``len(load.running)``)."""
        return cls(load.instance_id, load.used_blocks, len(load.running), load.num_waiting, load.draining)


@dataclass(frozen=True, slots=True)
class RackSummaryRecord(SummaryRecord):
    """A ``SummaryRecord`` with the load of every instance of the domain, sorted by instance id."""

    instances: tuple[InstanceLoadEntry, ...] = ()


def summary_record(summary: DomainSummary, loads: Iterable[InstanceLoad]) -> RackSummaryRecord:
    """The record to publish for ``summary`` and the instance ``loads`` it was computed from.

    Raises:
        ValueError: when two loads name the same instance.
    """
    entries = sorted((InstanceLoadEntry.of(load) for load in loads), key=lambda e: e.instance_id)
    ids = [e.instance_id for e in entries]
    if len(set(ids)) != len(ids):
        raise ValueError(f"summary of {summary.domain_id}: instance ids repeat in {ids}")
    base = SummaryRecord.of(summary)
    return RackSummaryRecord(**{f.name: getattr(base, f.name) for f in fields(SummaryRecord)}, instances=tuple(entries))


def decode_summary(value: bytes, key: str) -> SummaryRecord:
    """A ``SummaryRecord`` of a summary stored at ``key``, with or without per-instance loads.

    Raises:
        RecordError: when the value is not a valid summary.
    """
    try:
        raw = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{key}: not JSON: {exc}") from None
    if isinstance(raw, dict):
        raw.pop("instances", None)
    return decode(SummaryRecord, json.dumps(raw).encode(), key)
