"""How the rules are tuned (``PolicyConfig``); what an instance reports is in `policy.load`.

Everything here is a frozen value: the rules in `policy.usage`, `policy.dispatch` and
`policy.migration` read these and never mutate them. Formulas and their sources are in
`docs/policy.md`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from policy.load import InstanceLoad, RequestLoad, priority_counts_of  # they lived here: old imports keep working

__all__ = [
    "CANDIDATE_POLICIES",
    "DEFAULT_CANDIDATE_POLICY",
    "MIN_LOOP_INTERVAL_S",
    "InstanceLoad",
    "PolicyConfig",
    "RequestLoad",
    "loop_interval_problem",
    "priority_counts_of",
]

#: Names accepted by `PolicyConfig.candidate_policy` (see `policy.migration.candidate_order`).
#: "priority-then-size": normal priority before high, then fewest blocks (cheapest to move);
#: "shortest": fewest blocks first (Llumnix SJF/SR); "longest": most blocks first (Llumnix LJF/LR).
CANDIDATE_POLICIES: tuple[str, ...] = ("priority-then-size", "shortest", "longest")
DEFAULT_CANDIDATE_POLICY = "priority-then-size"

#: The shortest period accepted for any decision loop (rescheduling, summaries, cross-domain rounds, the autoscaler),
#: seconds: no scheduler runs one more often than every millisecond (Llumnix's rounds: 50 ms and 10 s), and a
#: simulation of one would not end in any useful time.
MIN_LOOP_INTERVAL_S = 1e-3


def loop_interval_problem(name: str, value: float) -> str | None:
    """Why ``value`` (seconds) cannot be the period of the decision loop ``name``: below
    :data:`MIN_LOOP_INTERVAL_S` or not finite; None when it can."""
    if MIN_LOOP_INTERVAL_S <= value < math.inf:
        return None
    return (
        f"{name} must be a finite number of seconds, at least {MIN_LOOP_INTERVAL_S:g} (no decision loop runs more "
        f"often than every millisecond), got {value}"
    )


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {message}")


_T = TypeVar("_T")


def _trusted_constructor(cls: type[_T]) -> Callable[..., _T]:
    """A constructor of the frozen, slotted dataclass ``cls`` that skips ``__post_init__``.

    It makes the assignments the dataclass's own ``__init__`` makes (keyword or positional arguments in
    field order, the declared defaults for omitted ones), so it follows any field added to ``cls``; what
    it leaves out is the validation. Generated once per class, like the dataclass's ``__init__``.

    How it sets the fields: a frozen dataclass refuses ``obj.field = value`` (its ``__setattr__`` raises), so
    the values go in through each slot's descriptor, one call per field; or, where ``cls`` declares its own
    slots directly on ``object`` (the dataclasses here), into an object of a plain class with the same slots,
    whose class is then set to ``cls``: plain stores of the interpreter, 2.4x cheaper for an 11-field
    ``InstanceBrief`` (250 ns against 610 in a microbenchmark). Python allows that ``__class__`` assignment
    between classes of the same layout, and the constructor checks once, when made, that ``cls`` accepts it.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    params, stores, sets = [], [], []
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    for i, f in enumerate(fields):
        env[f"_set{i}"] = getattr(cls, f.name).__set__  # the slot's descriptor: no frozen __setattr__
        if f.default is not dataclasses.MISSING:
            env[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_factory{i}"] = f.default_factory
            params.append(f"{f.name}=_factory{i}")
            stores.append(f"    if {f.name} is _factory{i}: {f.name} = _factory{i}()")
            sets.append(stores[-1])
        else:
            params.append(f.name)
        stores.append(f"    obj.{f.name} = {f.name}")
        sets.append(f"    _set{i}(obj, {f.name})")
    twin = _same_layout_twin(cls, tuple(f.name for f in fields))
    if twin is not None:  # filled as an object of the plain twin class, then made a ``cls``
        env["_twin"] = twin
        body = ["    obj = _new(_twin)", *stores, "    obj.__class__ = _cls"]
    else:
        body = ["    obj = _new(_cls)", *sets]
    source = f"def trusted({', '.join(params)}):\n" + "\n".join(body) + "\n    return obj\n"
    exec(source, env)  # generated from the dataclass's own field list, as dataclasses does for __init__
    constructor: Callable[..., _T] = env["trusted"]
    constructor.__doc__ = f"{cls.__name__}(...) without validation, for values already checked."
    return constructor


def _same_layout_twin(cls: type, names: tuple[str, ...]) -> type | None:
    """A plain class whose objects can become ``cls`` objects by ``__class__`` assignment: ``cls`` declares the
    slots ``names`` (its fields) directly on ``object``, and Python accepts the assignment (tried once, here).
    None when it does not."""
    if cls.__bases__ != (object,) or cls.__dict__.get("__slots__") != names:
        return None
    twin = type(f"_{cls.__name__}Slots", (), {"__slots__": names})
    try:
        object.__new__(twin).__class__ = cls  # type: ignore[assignment]  # what the constructor will do
    except TypeError:  # another interpreter, or a layout this code did not foresee
        return None
    return twin


def _freeze_headroom(headroom: Mapping[int, int]) -> Mapping[int, int]:
    for priority, blocks in headroom.items():
        where = f"PolicyConfig.priority_headroom_blocks[{priority!r}]"
        _require(isinstance(priority, int) and priority > 0, where, "priority class must be an int > 0")
        _require(isinstance(blocks, int) and blocks >= 0, where, f"blocks must be an int >= 0, got {blocks!r}")
    return MappingProxyType(dict(sorted(headroom.items())))


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Tuning of the rule book (Llumnix OSDI'24 §4.4). Validated; raises ValueError on bad values.

    Freeness thresholds are in freeness units, (blocks free after virtual usage) per running
    request — Llumnix reads this as "decode steps the batch can still run".
    """

    # Extra virtual blocks each running request of a priority class carries (class 0 carries none).
    priority_headroom_blocks: Mapping[int, int] = field(default_factory=lambda: {1: 128})
    # Fake usage of a warming-up instance, <= 0: it looks this many blocks emptier than it is.
    warmup_usage_blocks: int = -512
    # Dispatch near-tie: instances with F >= F_best − tie_tolerance·|F_best| are picked at random.
    tie_tolerance: float = 0.05
    # Migration sources: F below this (or preempting, or draining). Llumnix MIGRATE_OUT_THRESHOLD 3.0.
    migrate_out_freeness_below: float = 3.0
    # Migration destinations: F above this, and not draining.
    migrate_in_freeness_above: float = 3.0
    # Which running request of a source moves first; one of CANDIDATE_POLICIES.
    candidate_policy: str = DEFAULT_CANDIDATE_POLICY
    # Most migrations one planning round returns.
    max_migrations_per_round: int = 8
    # Domain choice (gateways): draw this many candidate domains and take the freest (power of d choices), so
    # many gateways sharing lagged summaries spread a burst; 0 = consider every domain.
    domain_choices: int = 2
    # Prefix-aware dispatch (policy.dispatch): a target holding a request's prompt prefix needs fewer new blocks
    # for it and, among targets within prefix_affinity_margin of the freest, the longest prefix hit wins.
    # False: dispatch by load alone (the request's prefix is ignored), to compare.
    prefix_aware_dispatch: bool = True
    # Affinity yields to load: a target whose freeness after the reservation is below F_best − margin·|F_best|
    # (F_best: the freest target's, after its reservation) is not chosen for its prefix. Share in [0, 1); with
    # ample free memory F ≈ M/B, so a prefix holder carries at most 1/(1 − margin) times the freest's batch.
    prefix_affinity_margin: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority_headroom_blocks", _freeze_headroom(self.priority_headroom_blocks))
        _require(
            self.warmup_usage_blocks <= 0,
            "PolicyConfig.warmup_usage_blocks",
            f"must be <= 0 (a negative fake usage), got {self.warmup_usage_blocks}",
        )
        _require(
            math.isfinite(self.tie_tolerance) and 0.0 <= self.tie_tolerance < 1.0,
            "PolicyConfig.tie_tolerance",
            f"must be in [0, 1), got {self.tie_tolerance}",
        )
        for name in ("migrate_out_freeness_below", "migrate_in_freeness_above"):
            value = getattr(self, name)
            _require(math.isfinite(value), f"PolicyConfig.{name}", f"must be finite, got {value}")
        if not self.migrate_out_freeness_below <= self.migrate_in_freeness_above:
            # a value the user did not write is named as such
            defaults = {f.name: f.default for f in dataclasses.fields(self)}

            def shown(name: str) -> str:
                value = getattr(self, name)
                return f"{name} ({value}{', the default' if value == defaults[name] else ''})"

            _require(
                False,
                "PolicyConfig",
                # a rule between keys: its message starts with neither (a configuration file's loader blames a key
                # named first, sets it aside and tries again, which would report the rule twice)
                f"the migration thresholds cross: {shown('migrate_out_freeness_below')} must be <= "
                f"{shown('migrate_in_freeness_above')}, or an instance could be both source and destination",
            )
        _require(
            self.candidate_policy in CANDIDATE_POLICIES,
            "PolicyConfig.candidate_policy",
            f"unknown policy {self.candidate_policy!r}; known: {', '.join(CANDIDATE_POLICIES)}",
        )
        _require(
            self.max_migrations_per_round >= 0,
            "PolicyConfig.max_migrations_per_round",
            f"must be >= 0, got {self.max_migrations_per_round}",
        )
        _require(
            self.domain_choices >= 0,
            "PolicyConfig.domain_choices",
            f"must be >= 0 (0: every domain), got {self.domain_choices}",
        )
        _require(
            math.isfinite(self.prefix_affinity_margin) and 0.0 <= self.prefix_affinity_margin < 1.0,
            "PolicyConfig.prefix_affinity_margin",
            f"must be in [0, 1), got {self.prefix_affinity_margin}",
        )

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.priority_headroom_blocks.items()),
                self.warmup_usage_blocks,
                self.tie_tolerance,
                self.migrate_out_freeness_below,
                self.migrate_in_freeness_above,
                self.candidate_policy,
                self.max_migrations_per_round,
                self.domain_choices,
                self.prefix_aware_dispatch,
                self.prefix_affinity_margin,
            )
        )

    def headroom_blocks(self, priority: int) -> int:
        """Headroom a request of `priority` carries, in blocks (0 for an unlisted class)."""
        return self.priority_headroom_blocks.get(priority, 0)
