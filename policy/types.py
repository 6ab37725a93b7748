"""Value types of the rule book: what an instance reports, and how the rules are tuned.

Everything here is a frozen value: the rules in `policy.usage`, `policy.dispatch` and
`policy.migration` read these and never mutate them. Formulas and their sources are in
`docs/policy.md`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

__all__ = [
    "CANDIDATE_POLICIES",
    "DEFAULT_CANDIDATE_POLICY",
    "InstanceLoad",
    "PolicyConfig",
    "RequestLoad",
    "priority_counts_of",
    "trusted_instance_load",
    "trusted_request_load",
]

#: Names accepted by `PolicyConfig.candidate_policy` (see `policy.migration.candidate_order`).
#: "priority-then-size": normal priority before high, then fewest blocks (cheapest to move);
#: "shortest": fewest blocks first (Llumnix SJF/SR); "longest": most blocks first (Llumnix LJF/LR).
CANDIDATE_POLICIES: tuple[str, ...] = ("priority-then-size", "shortest", "longest")
DEFAULT_CANDIDATE_POLICY = "priority-then-size"


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One running request as its instance reports it.

    Raises ValueError on an empty id or a negative count.
    """

    request_id: str  # unique within its instance
    blocks: int  # KV cache blocks the request holds now
    priority: int = 0  # 0 = normal; higher = more important (headroom per class in PolicyConfig)
    num_tokens: int = 0  # tokens in its KV cache (prompt + generated so far)
    migratable: bool = True  # False: the engine cannot move it (e.g. mid-prefill)
    output_tokens: int = 0  # tokens generated so far
    max_tokens: int = 0  # the request's output limit (its max_tokens); 0 = not known
    max_blocks: int = 0  # KV blocks it may grow to (prompt + max_tokens − 1 tokens); 0 = not known
    # hash ids of its prompt's prefix blocks, in order; each covers its instance's prefix_block_tokens tokens
    # (vLLM's prefix-cache block hashes, Mooncake's hash_ids); () = no prefix information
    prefix_hashes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = f"RequestLoad({self.request_id!r})"
        if not isinstance(self.prefix_hashes, tuple):
            object.__setattr__(self, "prefix_hashes", tuple(self.prefix_hashes))
        _require(bool(self.request_id), "RequestLoad", "request_id must be a non-empty string")
        _require(self.blocks >= 0, where, f"blocks must be >= 0, got {self.blocks}")
        _require(self.priority >= 0, where, f"priority must be >= 0, got {self.priority}")
        _require(self.num_tokens >= 0, where, f"num_tokens must be >= 0, got {self.num_tokens}")
        _require(self.output_tokens >= 0, where, f"output_tokens must be >= 0, got {self.output_tokens}")
        _require(self.max_tokens >= 0, where, f"max_tokens must be >= 0, got {self.max_tokens}")
        _require(self.max_blocks >= 0, where, f"max_blocks must be >= 0, got {self.max_blocks}")


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """A load report of one instance (one engine), the only input of the rules.

    The rules read the batch through two aggregates, ``num_running`` (B) and ``priority_counts`` (the
    headroom of virtual usage); only the choice of which request moves reads ``running`` itself. A report
    has both aggregates computed from ``running``, unless it is *brief* (``brief=True``, ``running`` empty):
    then it carries the aggregates alone. The simulator sends brief reports (when an instance's load changed)
    and asks for the detailed report of an instance only when a rule picks a request from it (``detailed``;
    see ``policy.migration.plan_migrations``'s ``details``).

    Raises ValueError when capacity_blocks <= 0, a block count is negative, used_blocks exceeds
    capacity_blocks, head_demand_blocks is set without a waiting request, two running requests share an id,
    or, in a brief report, the aggregates disagree with each other.
    """

    instance_id: str
    capacity_blocks: int  # M: KV cache blocks of the instance
    used_blocks: int  # KV cache blocks allocated now (running requests and reservations)
    running: tuple[RequestLoad, ...] = ()  # the running batch (empty in a brief report)
    num_waiting: int = 0  # requests queued on this instance, not yet admitted
    head_demand_blocks: int = 0  # blocks the head-of-line queued request needs to be admitted
    queued_demand_blocks: int = 0  # blocks every queued request needs, head included (>= head demand)
    preempting: bool = False  # the engine preempted a request since the last report
    draining: bool = False  # being emptied (scale-in, maintenance): infinite virtual usage
    warming_up: bool = False  # freshly added: negative fake usage so it fills quickly
    domain_id: str = ""  # NVLink domain of the instance ("" when not known)
    decode_step_s: float = 0.0  # duration of its most recent engine step, seconds (0 = not measured yet)
    num_running: int = 0  # requests in the running batch; B = max(1, num_running) (from running unless brief)
    # (priority, running requests of that priority) for every priority > 0 present, ascending (same)
    priority_counts: tuple[tuple[int, int], ...] = ()
    brief: bool = False  # True: running is not listed; num_running and priority_counts say what it holds
    max_num_seqs: int = 0  # batch slots: requests the engine runs in one step at most (0 = not known)
    # hash ids of the prefix blocks it holds (used or cached, evictable): a new request whose prompt starts with
    # them reuses their KV (blocks already present need no new memory). The engine keeps this set and rebuilds
    # it only when its cache inserts or evicts an entry, so consecutive reports share one frozenset.
    prefix_hashes: frozenset[int] = frozenset()
    prefix_block_tokens: int = 0  # tokens per hash block of prefix_hashes (Mooncake: 512); 0 = no prefix cache
    # its engine's estimate of prefilling one prompt token, seconds (``Engine.prefill_time_s`` over a mid-size
    # prompt): what re-prefilling a moved request's missing prefix there costs; 0 = it offers none (vLLM)
    prefill_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        where = f"InstanceLoad({self.instance_id!r})"
        if not isinstance(self.prefix_hashes, frozenset):
            object.__setattr__(self, "prefix_hashes", frozenset(self.prefix_hashes))
        _require(
            self.prefix_block_tokens >= 0, where, f"prefix_block_tokens must be >= 0, got {self.prefix_block_tokens}"
        )
        _require(
            not self.prefix_hashes or self.prefix_block_tokens > 0,
            where,
            f"prefix_hashes lists {len(self.prefix_hashes)} hash blocks but prefix_block_tokens is 0",
        )
        _require(bool(self.instance_id), "InstanceLoad", "instance_id must be a non-empty string")
        _require(self.capacity_blocks > 0, where, f"capacity_blocks must be > 0, got {self.capacity_blocks}")
        _require(self.used_blocks >= 0, where, f"used_blocks must be >= 0, got {self.used_blocks}")
        _require(
            self.used_blocks <= self.capacity_blocks,
            where,
            f"used_blocks {self.used_blocks} exceeds capacity_blocks {self.capacity_blocks}",
        )
        _require(self.num_waiting >= 0, where, f"num_waiting must be >= 0, got {self.num_waiting}")
        _require(
            self.head_demand_blocks >= 0,
            where,
            f"head_demand_blocks must be >= 0, got {self.head_demand_blocks}",
        )
        _require(
            self.head_demand_blocks == 0 or self.num_waiting > 0,
            where,
            f"head_demand_blocks is {self.head_demand_blocks} but num_waiting is 0",
        )
        _require(
            self.queued_demand_blocks == 0 or self.queued_demand_blocks >= self.head_demand_blocks,
            where,
            f"queued_demand_blocks {self.queued_demand_blocks} is below head_demand_blocks {self.head_demand_blocks}",
        )
        _require(
            self.queued_demand_blocks == 0 or self.num_waiting > 0,
            where,
            f"queued_demand_blocks is {self.queued_demand_blocks} but num_waiting is 0",
        )
        _require(
            math.isfinite(self.decode_step_s) and self.decode_step_s >= 0,
            where,
            f"decode_step_s must be a finite number >= 0, got {self.decode_step_s}",
        )
        _require(self.max_num_seqs >= 0, where, f"max_num_seqs must be >= 0, got {self.max_num_seqs}")
        _require(
            math.isfinite(self.prefill_s_per_token) and self.prefill_s_per_token >= 0,
            where,
            f"prefill_s_per_token must be a finite number >= 0, got {self.prefill_s_per_token}",
        )
        object.__setattr__(self, "running", tuple(self.running))
        ids = {r.request_id for r in self.running}
        if len(ids) != len(self.running):
            counts = Counter(r.request_id for r in self.running)
            dupes = sorted(i for i, n in counts.items() if n > 1)
            _require(False, where, f"running request ids repeat: {dupes}")
        if not self.brief:  # the aggregates follow the list (also through dataclasses.replace(load, running=...))
            object.__setattr__(self, "num_running", len(self.running))
            object.__setattr__(self, "priority_counts", priority_counts_of(r.priority for r in self.running))
            return
        _require(not self.running, where, "a brief report lists no running requests (num_running counts them)")
        _require(self.num_running >= 0, where, f"num_running must be >= 0, got {self.num_running}")
        pairs = tuple((int(p), int(n)) for p, n in self.priority_counts)
        _require(
            all(p > 0 and n > 0 for p, n in pairs) and [p for p, _ in pairs] == sorted({p for p, _ in pairs}),
            where,
            f"priority_counts must be ascending (priority > 0, count > 0) pairs, got {self.priority_counts}",
        )
        _require(
            sum(n for _, n in pairs) <= self.num_running,
            where,
            f"priority_counts {pairs} count more requests than num_running {self.num_running}",
        )
        object.__setattr__(self, "priority_counts", pairs)

    @property
    def free_blocks(self) -> int:
        """Real free KV cache blocks now: M − used."""
        return self.capacity_blocks - self.used_blocks

    @property
    def detailed(self) -> bool:
        """True when ``running`` lists the whole batch: every report but a brief one of a busy instance."""
        return not self.brief or self.num_running == 0

    @property
    def slots_starved(self) -> bool:
        """Every batch slot is taken (``num_running`` >= ``max_num_seqs``, when known) and a request waits: it
        waits for a slot whatever the free memory (a rule reading blocks alone does not see it)."""
        return 0 < self.max_num_seqs <= self.num_running and self.num_waiting > 0

    @property
    def takes_one_more(self) -> bool:
        """One more running request would leave it a batch slot for the head of its own queue: num_running + 1
        + (1 if a request waits) <= ``max_num_seqs``; always True when the limit is not known. A request moved
        here then runs at once and does not make this instance :attr:`slots_starved`."""
        return self.max_num_seqs == 0 or self.num_running + 1 + (self.num_waiting > 0) <= self.max_num_seqs


def priority_counts_of(priorities: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """``InstanceLoad.priority_counts`` of a batch with these priorities: (priority, count) for each priority
    > 0 present, ascending."""
    high = [p for p in priorities if p > 0]  # usually none: one pass, no Counter
    if not high:
        return ()
    return tuple(sorted(Counter(high).items()))


_T = TypeVar("_T")


def _trusted_constructor(cls: type[_T]) -> Callable[..., _T]:
    """A constructor of the frozen, slotted dataclass ``cls`` that skips ``__post_init__``.

    It makes the assignments the dataclass's own ``__init__`` makes (keyword or positional arguments in
    field order, the declared defaults for omitted ones), so it follows any field added to ``cls``; what
    it leaves out is the validation. Generated once per class, like the dataclass's ``__init__``.
    """
    params, body = [], []
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    for i, f in enumerate(dataclasses.fields(cls)):  # type: ignore[arg-type]
        env[f"_set{i}"] = getattr(cls, f.name).__set__  # the slot's descriptor: no frozen __setattr__
        if f.default is not dataclasses.MISSING:
            env[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_factory{i}"] = f.default_factory
            params.append(f"{f.name}=_factory{i}")
            body.append(f"    if {f.name} is _factory{i}: {f.name} = _factory{i}()")
        else:
            params.append(f.name)
        body.append(f"    _set{i}(obj, {f.name})")
    source = f"def trusted({', '.join(params)}):\n    obj = _new(_cls)\n" + "\n".join(body) + "\n    return obj\n"
    exec(source, env)  # generated from the dataclass's own field list, as dataclasses does for __init__
    constructor: Callable[..., _T] = env["trusted"]
    constructor.__doc__ = f"{cls.__name__}(...) without validation, for values already checked."
    return constructor


#: ``RequestLoad(...)`` without the checks of ``__post_init__``: for an engine's own counters, which are
#: valid by construction (a count of blocks it holds cannot be negative). Input from outside (protobuf,
#: files, users) goes through ``RequestLoad`` itself.
trusted_request_load: Callable[..., RequestLoad] = _trusted_constructor(RequestLoad)

#: ``InstanceLoad(...)`` without the checks of ``__post_init__``; same use. Pass ``running`` as a tuple and
#: ``num_running`` / ``priority_counts`` consistent with it (``priority_counts_of``): nothing derives them here.
trusted_instance_load: Callable[..., InstanceLoad] = _trusted_constructor(InstanceLoad)


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
        _require(
            self.migrate_out_freeness_below <= self.migrate_in_freeness_above,
            "PolicyConfig",
            f"migrate_out_freeness_below ({self.migrate_out_freeness_below}) must be <= "
            f"migrate_in_freeness_above ({self.migrate_in_freeness_above}), "
            "or an instance could be both source and destination",
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
