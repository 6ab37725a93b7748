"""The values hilum keeps in etcd: frozen dataclasses, stored as JSON, validated on the way in.

A record read from etcd that fails validation raises :class:`RecordError` naming the key and the field; a
watcher logs it and skips the key rather than crash (a buggy agent must not take the coordinator down).
The codec follows each dataclass's type hints (``str``, ``int``, ``float``, ``bool``, enums, tuples, frozensets
(as sorted lists), nested dataclasses): strict — no bool for an int, no NaN — and every ``__post_init__`` check applies.

A domain's load is the rule book's own ``policy.domain.DomainSummary`` (one per model it serves, in one
:class:`SummaryRecord`): the same value from the domain scheduler to etcd, to the wire and back.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, TypeVar

from policy.autoscale import AutoscaleState, Evaluation
from policy.domain import DomainSummary, InstanceBrief

__all__ = [
    "ACTIVE_STATES",
    "TRANSITIONS",
    "AutoscaleRecord",
    "DomainRegistration",
    "DrainIntent",
    "DrainKind",
    "InstanceRegistration",
    "MigrationRecord",
    "MigrationState",
    "RecordError",
    "ScaleEvent",
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


@dataclass(frozen=True, slots=True)
class SummaryRecord:
    """What a domain scheduler publishes at ``P summaries/<domain_id>``: one summary per model it serves.

    Raises ValueError when a summary names another domain or two name the same model.
    """

    domain_id: str
    summaries: tuple[DomainSummary, ...]  # sorted by model

    def __post_init__(self) -> None:
        object.__setattr__(self, "summaries", tuple(self.summaries))
        models = [s.model for s in self.summaries]
        if models != sorted(set(models)):
            raise ValueError(f"summary of {self.domain_id}: models must be sorted without repeats, got {models}")
        for summary in self.summaries:
            if summary.domain_id != self.domain_id:
                raise ValueError(f"summary of {self.domain_id}: one summary names domain {summary.domain_id!r}")

    def instances(self) -> dict[str, InstanceBrief]:
        """Every instance of the domain (all models), by id."""
        return {b.instance_id: b for s in self.summaries for b in s.instances}

    def of_model(self, model: str) -> DomainSummary | None:
        """The summary of ``model``'s instances, None when the domain serves no such model."""
        return next((s for s in self.summaries if s.model == model), None)


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
    # what the carried-out move measured (written with its outcome by the domain scheduler; the coordinator
    # prices later moves on the path with it: topology.bandwidth)
    transport: str = ""  # how the bytes went (MigrateOutReply.transport); "" = not carried out / not known
    measured_bandwidth_bytes_per_s: float = 0.0  # pre-copy rate achieved (MigrateOutReply); 0 = none measured
    measured_at_s: float = 0.0  # wall-clock seconds of the measurement (the domain scheduler's clock)
    # the plan the source carried out (MigrateOutReply.plan: "pre-copy", "pre-copy+recompute-prefix",
    # "stop-and-copy"; "" = not carried out) and the pause it measured, s (beside expected_downtime_s)
    plan: str = ""
    measured_downtime_s: float = 0.0

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


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """One decision of the autoscaler (``policy.autoscale.ScaleDecision``) and what became of it."""

    action: str  # policy.autoscale.ScaleAction value: scale-out, undrain, drain, scale-in, release
    instance_id: str
    at_s: float  # when it was decided, wall clock (seconds since the epoch)
    reason: str  # the rule that decided, with its figures
    status: str = "running"  # "running", "done" or "failed"
    attempts: int = 0  # hook attempts made (actions without a hook: 0)
    exit_code: int | None = None  # of the hook's last attempt (None: no hook, not finished, timed out)
    output: str = ""  # the end of the hook's last output, or why the action failed
    finished_s: float | None = None  # when it ended, wall clock


@dataclass(frozen=True, slots=True)
class AutoscaleRecord:
    """What the autoscaler leader keeps at ``P autoscale/<model>``: its state, its last round, recent decisions.

    Written by the leader only (fenced); a new leader resumes from ``state``.
    """

    model: str
    state: AutoscaleState
    evaluation: Evaluation | None = None  # the last round (None before the first)
    events: tuple[ScaleEvent, ...] = ()  # the most recent decisions, oldest first
    fencing_token: int = 0  # token of the leader that wrote it


Record = DomainRegistration | InstanceRegistration | SummaryRecord | MigrationRecord | DrainIntent | AutoscaleRecord
R = TypeVar("R", DomainRegistration, InstanceRegistration, SummaryRecord, MigrationRecord, DrainIntent, AutoscaleRecord)


def encode(record: Record) -> bytes:
    """JSON bytes of ``record`` (sorted keys; ±inf allowed for usage and freeness). A field whose metadata says
    ``derived_from`` another field that is set (``DomainSummary.prefix_hashes``, the union of its instances') is
    left out: decoding derives it again, so the record never holds it twice."""
    return json.dumps(_plain(record), sort_keys=True, separators=(",", ":"), default=_json_set).encode()


def _plain(value: Any) -> Any:
    """``dataclasses.asdict`` without the fields derived from another set field (:func:`encode`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in fields(value)
            if not ("derived_from" in f.metadata and getattr(value, f.metadata["derived_from"]))
        }
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _json_set(value: Any) -> Any:
    """A set (prefix hash ids) as its sorted list; TypeError for anything else JSON cannot hold."""
    if isinstance(value, frozenset | set):
        return sorted(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as type ``tp``, strictly; RecordError naming ``where`` otherwise."""
    origin = typing.get_origin(tp)
    if origin is types.UnionType or origin is typing.Union:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _coerce(inner, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {value!r}")
        (item, _ellipsis) = typing.get_args(tp)
        return tuple(_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is frozenset:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {value!r}")
        (member,) = typing.get_args(tp)
        return frozenset(_coerce(member, v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _from_dict(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            known = ", ".join(repr(m.value) for m in tp)
            raise RecordError(f"{where}: expected one of {known}, got {value!r}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise RecordError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise RecordError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecordError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: no codec for type {tp!r}")  # a record declared a type the codec lacks: a bug


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


def _from_dict(cls: type[Any], raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    names = {f.name: f for f in fields(cls) if f.init}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise RecordError(f"{where}: unknown fields {unknown} for {cls.__name__}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in names.items():
        if name not in raw:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise RecordError(f"{where}: missing field {name!r} for {cls.__name__}")
        kwargs[name] = _coerce(hints[name], raw[name], f"{where}: {name}")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise RecordError(f"{where}: {exc}") from None
