"""The values hilum keeps in etcd: frozen dataclasses, stored as JSON, validated on the way in.

A record read from etcd that fails validation raises :class:`RecordError` naming the key; a watcher logs
it and skips the key rather than crash (a buggy agent must not take the coordinator down).
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Protocol, TypeVar

__all__ = [
    "ACTIVE_STATES",
    "TRANSITIONS",
    "DomainRegistration",
    "DomainSummaryLike",
    "DrainIntent",
    "DrainKind",
    "InstanceLoadLike",
    "InstanceLoadRecord",
    "InstanceRegistration",
    "MigrationRecord",
    "MigrationState",
    "RecordError",
    "SummaryRecord",
    "decode",
    "encode",
]


class RecordError(ValueError):
    """A value in etcd is not a valid record; the message names the key and the problem."""


class MigrationState(enum.StrEnum):
    """Life of an approved cross-domain migration; changes only by compare-and-swap."""

    PROPOSED = "proposed"  # recorded by the leader, not yet judged
    APPROVED = "approved"  # may be carried out; holds link budget
    COMMITTED = "committed"  # the destination committed; terminal
    ABORTED = "aborted"  # rejected, failed or cancelled; terminal


# Allowed state changes (from -> to). Anything else is a bug and raises ValueError before touching etcd.
TRANSITIONS: Mapping[MigrationState, frozenset[MigrationState]] = {
    MigrationState.PROPOSED: frozenset({MigrationState.APPROVED, MigrationState.ABORTED}),
    MigrationState.APPROVED: frozenset({MigrationState.COMMITTED, MigrationState.ABORTED}),
    MigrationState.COMMITTED: frozenset(),
    MigrationState.ABORTED: frozenset(),
}
ACTIVE_STATES = frozenset({MigrationState.PROPOSED, MigrationState.APPROVED})


class DrainKind(enum.StrEnum):
    """What a drain intent names."""

    INSTANCE = "instance"
    DOMAIN = "domain"


@dataclass(frozen=True, slots=True)
class DomainRegistration:
    """A live domain scheduler (bound to its lease)."""

    domain_id: str
    address: str  # host:port of the domain scheduler's gRPC server


@dataclass(frozen=True, slots=True)
class InstanceRegistration:
    """A live instance (llumlet), bound to its lease."""

    instance_id: str
    domain_id: str
    node_id: str
    address: str  # host:port of the llumlet's gRPC server
    model: str
    capacity_blocks: int  # KV cache capacity, blocks
    engine: str = ""  # backend name ("sim" | "torch" | "vllm"); "" = not said
    sampling_features: tuple[str, ...] = ()  # optional sampling features it honours (llumlet SamplingFeature)


class DomainSummaryLike(Protocol):
    """What :class:`SummaryRecord` copies from ``policy.domain.DomainSummary`` (structural)."""

    @property
    def domain_id(self) -> str: ...
    @property
    def num_instances(self) -> int: ...
    @property
    def capacity_blocks(self) -> int: ...
    @property
    def virtual_usage(self) -> float: ...
    @property
    def freeness(self) -> float: ...
    @property
    def largest_free_blocks(self) -> int: ...
    @property
    def max_instance_capacity_blocks(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def draining(self) -> bool: ...


class InstanceLoadLike(Protocol):
    """What :class:`InstanceLoadRecord` copies from ``policy.types.InstanceLoad`` (structural)."""

    @property
    def instance_id(self) -> str: ...
    @property
    def used_blocks(self) -> int: ...
    @property
    def running(self) -> Sequence[object]: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def draining(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class InstanceLoadRecord:
    """One instance's load inside its domain's summary, as the domain scheduler sees it (exact, fresh).

    ``hilumctl drain --wait`` reads it: an instance is empty when its scheduler reports it ``draining``
    (it applies the drain: nothing new is dispatched there) with no running and no queued requests.
    """

    instance_id: str
    used_blocks: int  # KV cache blocks held by its requests
    num_running: int  # requests in its running batch (migrating-out ones included until committed)
    num_waiting: int  # requests queued on it
    draining: bool  # its domain scheduler applies a drain intent (instance or domain) to it

    @classmethod
    def of(cls, load: InstanceLoadLike) -> InstanceLoadRecord:
        """Copy a ``policy.types.InstanceLoad`` (``num_running`` = ``len(load.running)``)."""
        return cls(load.instance_id, load.used_blocks, len(load.running), load.num_waiting, load.draining)


@dataclass(frozen=True, slots=True)
class SummaryRecord:
    """A domain's load summary as published to etcd (the fields of ``policy.domain.DomainSummary``).

    ``instances`` adds the per-instance load (sorted by instance id) that the domain scheduler knows
    exactly; the coordinator serves it through ListInstances. Empty when the publisher omits it.
    """

    domain_id: str
    num_instances: int
    capacity_blocks: int  # KV capacity of all instances, blocks
    virtual_usage: float  # Σ virtual usage, blocks (+inf while draining)
    freeness: float  # (M − Σ V) / B, decode steps (−inf while draining)
    largest_free_blocks: int  # largest free space on one instance, blocks
    max_instance_capacity_blocks: int
    num_running: int
    num_waiting: int
    draining: bool
    instances: tuple[InstanceLoadRecord, ...] = ()  # per-instance load, sorted by instance_id

    def __post_init__(self) -> None:
        ids = [i.instance_id for i in self.instances]
        if ids != sorted(set(ids)):
            raise ValueError(f"summary of {self.domain_id}: instances must be sorted by id, no repeats, got {ids}")

    @classmethod
    def of(cls, summary: DomainSummaryLike, instances: Iterable[InstanceLoadLike] = ()) -> SummaryRecord:
        """Copy a ``policy.domain.DomainSummary`` (or anything with its fields) and the loads of its instances.

        Raises:
            ValueError: when two loads name the same instance.
        """
        copied = {f.name: getattr(summary, f.name) for f in fields(cls) if f.name != "instances"}
        loads = tuple(sorted((InstanceLoadRecord.of(load) for load in instances), key=lambda r: r.instance_id))
        return cls(**copied, instances=loads)


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    """A cross-domain migration in etcd, stamped with the fencing token of the leader that wrote it."""

    migration_id: str  # "<request_id>#<attempt>"
    request_id: str
    attempt: int
    src_instance_id: str
    dst_instance_id: str
    src_domain_id: str
    dst_domain_id: str
    blocks: int  # KV blocks at proposal time
    state: MigrationState
    fencing_token: int  # token of the leader that approved (or rejected) it
    links: tuple[str, ...] = ()  # network links on the path (link budgets)
    expected_transfer_s: float = 0.0
    expected_downtime_s: float = 0.0
    reason: str = ""

    @staticmethod
    def make_id(request_id: str, attempt: int) -> str:
        """The migration id of one attempt to move one request."""
        return f"{request_id}#{attempt}"


@dataclass(frozen=True, slots=True)
class DrainIntent:
    """An operator's wish to empty an instance or a whole domain (durable until undrained)."""

    kind: DrainKind
    target_id: str
    reason: str = ""
    fencing_token: int = 0  # token of the leader that wrote it


Record = DomainRegistration | InstanceRegistration | SummaryRecord | MigrationRecord | DrainIntent
R = TypeVar("R", DomainRegistration, InstanceRegistration, SummaryRecord, MigrationRecord, DrainIntent)

_INT_FIELDS = {
    "capacity_blocks",
    "num_instances",
    "largest_free_blocks",
    "max_instance_capacity_blocks",
    "num_running",
    "num_waiting",
    "attempt",
    "blocks",
    "fencing_token",
    "used_blocks",
}
_FLOAT_FIELDS = {"virtual_usage", "freeness", "expected_transfer_s", "expected_downtime_s"}


def encode(record: Record) -> bytes:
    """JSON bytes of ``record`` (sorted keys; ±inf allowed for usage/freeness)."""
    data = asdict(record)
    if isinstance(record, MigrationRecord):
        data["links"] = list(record.links)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _coerce(cls: type[Any], name: str, value: Any, key: str) -> Any:
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{key}: {name}: expected an integer, got {value!r}")
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise RecordError(f"{key}: {name}: expected a number, got {value!r}")
        return float(value)
    if name == "draining":
        if not isinstance(value, bool):
            raise RecordError(f"{key}: {name}: expected true/false, got {value!r}")
        return value
    if name == "state":
        try:
            return MigrationState(value)
        except ValueError:
            raise RecordError(f"{key}: state: unknown migration state {value!r}") from None
    if name == "kind" and cls is DrainIntent:
        try:
            return DrainKind(value)
        except ValueError:
            raise RecordError(f"{key}: kind: expected 'instance' or 'domain', got {value!r}") from None
    if name == "instances" and cls is SummaryRecord:
        if not isinstance(value, list):
            raise RecordError(f"{key}: instances: expected a list of instance loads, got {value!r}")
        return tuple(_from_dict(InstanceLoadRecord, item, f"{key}: instances[{i}]") for i, item in enumerate(value))
    if name in ("links", "sampling_features"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RecordError(f"{key}: {name}: expected a list of strings, got {value!r}")
        return tuple(value)
    if not isinstance(value, str):
        raise RecordError(f"{key}: {name}: expected a string, got {value!r}")
    return value


def decode(cls: type[R], value: bytes, key: str) -> R:
    """Parse JSON ``value`` stored at ``key`` into ``cls``.

    Raises:
        RecordError: on bad JSON, a missing or unknown field, or a field of the wrong type.
    """
    try:
        raw = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{key}: not JSON: {exc}") from None
    record: R = _from_dict(cls, raw, key)
    return record


def _from_dict(cls: type[Any], raw: Any, key: str) -> Any:
    if not isinstance(raw, dict):
        raise RecordError(f"{key}: expected a JSON object, got {type(raw).__name__}")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise RecordError(f"{key}: unknown fields {unknown} for {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for name, f in names.items():
        if name not in raw:
            if f.default is not MISSING:
                continue
            raise RecordError(f"{key}: missing field {name!r} for {cls.__name__}")
        kwargs[name] = _coerce(cls, name, raw[name], key)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise RecordError(f"{key}: {exc}") from None
