"""Migration planning: which request moves from which instance to which (Llumnix OSDI'24 §4.4.3).

One planning round:
1. sources: instances with F < migrate_out_freeness_below, or preempting, or draining, or starved of
   batch slots (``InstanceLoad.slots_starved``: every slot taken and a request waits, free memory or not);
   destinations: not a source, not draining, F > migrate_in_freeness_above, with a batch slot for one
   more request beside the head of their own queue (``InstanceLoad.takes_one_more``). A draining source
   may also use any other instance that is neither draining nor preempting (everything must leave);
2. pair the lowest-F source with the highest-F destination still free this round, and so on
   (Llumnix's pairing); each instance takes part in at most one move per round;
3. the request: the first of the source's migratable requests, in the configured candidate order,
   that fits in the destination's real free blocks, whose largest possible size (``max_blocks``: prompt
   plus max_tokens) the destination's capacity can hold, and that lowers the potential Φ = Σ V_i²
   (true iff V_src − V_dst > v_r; always true from a draining source, and from a source starved of
   slots to a destination that reports a free slot: the move gives the source's queue a slot, which Φ, a
   sum over blocks, cannot see).
   Prefix caching (``block_size_tokens`` given, ``prefix_aware_dispatch`` on): the leading prefix hash blocks
   of the request that the destination's cache holds (``InstanceLoad.prefix_hashes``, same hash granularity)
   are adopted there, not copied nor allocated again, so the request needs ``h`` fewer free blocks there and
   adds ``v_r − h`` to its usage: the move lowers Φ iff ``2·v_r·V_src − 2·(v_r − h)·V_dst > v_r² + (v_r − h)²``
   (the change of Φ with the two different steps; ``V_src − V_dst > v_r`` when ``h`` = 0), which a destination
   holding the prefix passes at a smaller gap. The same blocks are what the coordinator's judge and the
   migration executor skip.
Because every move lowers Φ, the reverse move can never be planned next: no ping-pong. A move for slots
may raise Φ, but its reverse is never planned either: the destination keeps a slot for its own queue
(not starved, so not a source for slots) and the source, its slot taken by its queue at the next step,
does not take one more (not a destination).

The slot rule is hilum's (issue 15: a high-priority request waited 396 steps on an instance whose slots
were full of normal decodes, an empty instance next door, because the rules saw memory, not slots);
Llumnix's freeness counts blocks only. The engine's own priority admission (``llumlet.engine.scheduler``)
gives a high-priority arrival a slot by preempting a normal request; the normal request then waits on a
full batch, and this rule moves a running request out to give it a slot.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from policy.dispatch import leading_run
from policy.domain import DomainSummary
from policy.load import InstanceLoad, RequestLoad
from policy.ordering import freest_first, fullest_first
from policy.types import CANDIDATE_POLICIES, PolicyConfig
from policy.usage import batch_size, freeness, instance_virtual_usage, request_virtual_usage

__all__ = [
    "CandidateOrder",
    "MigrationDecision",
    "candidate_order",
    "gives_a_slot",
    "is_source_domain",
    "move_lowers_potential",
    "pair_domains",
    "plan_migrations",
    "potential",
    "prefix_blocks_on",
    "source_slack_blocks",
]

#: Orders a source's migratable requests, first to move first; the bool is "source is draining".
CandidateOrder = Callable[[Sequence[RequestLoad], bool], list[RequestLoad]]


@dataclass(frozen=True, slots=True)
class MigrationDecision:
    """Move request `request_id` (holding `blocks` KV blocks) from instance `src_id` to `dst_id`."""

    src_id: str
    dst_id: str
    request_id: str
    blocks: int  # KV cache blocks the request holds at planning time
    reason: str  # one line: why this source, this destination, this request


def potential(usages: Iterable[float]) -> float:
    """Φ = Σ V_i² over instance virtual usages (blocks²); +inf if any usage is infinite.

    A move of v blocks from s to d changes Φ by 2v(v − V_s + V_d): it lowers Φ iff V_s − V_d > v
    (for v > 0). Source: hilum seed §10.1, after Llumnix's balancing goal (OSDI'24 §4.4).
    """
    return sum(v * v for v in usages)


def _priority_then_size(requests: Sequence[RequestLoad], draining: bool) -> list[RequestLoad]:
    # Normal priority leaves first, then the fewest blocks (cheapest to move). From a draining
    # instance everything leaves, so the most important go first.
    sign = -1 if draining else 1
    return sorted(requests, key=lambda r: (sign * r.priority, r.blocks, r.request_id))


def _shortest(requests: Sequence[RequestLoad], draining: bool) -> list[RequestLoad]:
    return sorted(requests, key=lambda r: (r.blocks, r.request_id))


def _longest(requests: Sequence[RequestLoad], draining: bool) -> list[RequestLoad]:
    return sorted(requests, key=lambda r: (-r.blocks, r.request_id))


_CANDIDATE_ORDERS: dict[str, CandidateOrder] = {
    "priority-then-size": _priority_then_size,
    "shortest": _shortest,
    "longest": _longest,
}
assert tuple(_CANDIDATE_ORDERS) == CANDIDATE_POLICIES


def candidate_order(name: str) -> CandidateOrder:
    """The candidate ordering called `name`; raises ValueError naming the known policies."""
    try:
        return _CANDIDATE_ORDERS[name]
    except KeyError:
        known = ", ".join(CANDIDATE_POLICIES)
        raise ValueError(f"unknown candidate policy {name!r}; known: {known}") from None


def move_lowers_potential(
    src: InstanceLoad, dst: InstanceLoad, request: RequestLoad, cfg: PolicyConfig, dst_held_blocks: int = 0
) -> bool:
    """True iff moving `request` from src to dst lowers Φ: V_src − V_dst > v_r with v_r > 0.

    ``dst_held_blocks`` (h, 0 <= h <= request.blocks): blocks of the request the destination's prefix cache holds;
    the destination's usage then grows by v_r − h only, and the rule is the module docstring's
    ``2·v_r·V_src − 2·(v_r − h)·V_dst > v_r² + (v_r − h)²``. Always true from a draining source to a non-draining
    destination; never true into a draining one. Raises ValueError when h is outside [0, request.blocks].
    """
    if not 0 <= dst_held_blocks <= request.blocks:
        raise ValueError(f"move_lowers_potential: dst_held_blocks {dst_held_blocks} not in [0, {request.blocks}]")
    if dst.draining:
        return False
    if src.draining:
        return True
    v_r = request_virtual_usage(request, cfg)
    v_src, v_dst = instance_virtual_usage(src, cfg), instance_virtual_usage(dst, cfg)
    if dst_held_blocks == 0:
        return v_r > 0 and v_src - v_dst > v_r
    w = v_r - dst_held_blocks
    return v_r > 0 and 2 * v_r * v_src - 2 * w * v_dst > v_r * v_r + w * w


def prefix_blocks_on(dst: InstanceLoad, request: RequestLoad, prefix_block_tokens: int, block_size_tokens: int) -> int:
    """KV blocks of ``request`` that ``dst``'s prefix cache holds: its leading prefix hash blocks that ``dst``
    reports (:func:`policy.dispatch.leading_run`), times the KV blocks one hash stands for, at most
    ``request.blocks``. ``prefix_block_tokens``: tokens per hash of the request's ``prefix_hashes`` (its source's
    ``InstanceLoad.prefix_block_tokens``); 0 when hashed at another granularity than ``dst``'s, or either
    size is 0 (no prefix information). Raises ValueError when ``prefix_block_tokens`` is not a multiple of
    ``block_size_tokens``."""
    if not request.prefix_hashes or not dst.prefix_hashes or block_size_tokens < 1:
        return 0
    if prefix_block_tokens < 1 or dst.prefix_block_tokens != prefix_block_tokens:
        return 0
    if prefix_block_tokens % block_size_tokens:
        raise ValueError(
            f"prefix_blocks_on: prefix_block_tokens {prefix_block_tokens} is not a multiple of block_size_tokens "
            f"{block_size_tokens}"
        )
    run = leading_run(request.prefix_hashes, dst.prefix_hashes)
    return min(run * (prefix_block_tokens // block_size_tokens), request.blocks)


def plan_migrations(
    loads: Sequence[InstanceLoad],
    cfg: PolicyConfig,
    rng: random.Random,
    max_moves: int | None = None,
    details: Callable[[InstanceLoad], InstanceLoad] | None = None,
    block_size_tokens: int = 0,
) -> list[MigrationDecision]:
    """Plan at most `max_moves` (default cfg.max_migrations_per_round) migrations among `loads`.

    Ties in freeness are broken by a seeded draw from `rng` (one per instance, taken only when some instance
    is a source), then by instance id. `loads` may be brief
    (``InstanceLoad.detailed`` False): sources and destinations are chosen from the aggregates, and
    `details` turns a brief source into its detailed report (same state, the batch listed) when its
    requests are looked at. ``block_size_tokens``: tokens per KV block of these instances; given (and
    ``cfg.prefix_aware_dispatch`` on), a destination's cached prefix blocks of a request count as present
    (module docstring, 3); 0: prefixes take no part. Raises ValueError on repeated instance ids, a negative
    max_moves, or a brief source without `details`.
    """
    limit = cfg.max_migrations_per_round if max_moves is None else max_moves
    if limit < 0:
        raise ValueError(f"plan_migrations: max_moves must be >= 0, got {limit}")
    f = _freeness_by_id(loads, cfg)
    sources = [x for x in loads if _is_source(x, f[x.instance_id], cfg)]
    if not sources or limit == 0:  # nothing to plan: no tie to break either (no draw taken from rng)
        return []
    draw = {i: rng.random() for i in sorted(f)}
    sources.sort(key=lambda x: fullest_first(f[x.instance_id], x.instance_id, draw[x.instance_id]))
    by_freeness = sorted(loads, key=lambda x: freest_first(f[x.instance_id], x.instance_id, draw[x.instance_id]))
    source_ids = {x.instance_id for x in sources}
    order = candidate_order(cfg.candidate_policy)
    used: set[str] = set()
    decisions: list[MigrationDecision] = []
    for src in sources:
        if len(decisions) >= limit:
            break
        if src.instance_id in used:
            continue
        pool = [d for d in by_freeness if _accepts(d, src, f[d.instance_id], cfg, used, source_ids)]
        if not pool:
            continue
        if not src.detailed:
            if details is None:
                raise ValueError(f"plan_migrations: {src.instance_id!r} is a brief report and no details are given")
            src = details(src)
        bs = block_size_tokens if cfg.prefix_aware_dispatch else 0
        decision = _first_move(src, pool, order, f, cfg, bs)
        if decision is not None:
            decisions.append(decision)
            used.update((decision.src_id, decision.dst_id))
    return decisions


def _freeness_by_id(loads: Sequence[InstanceLoad], cfg: PolicyConfig) -> dict[str, float]:
    f: dict[str, float] = {}
    for load in loads:
        if load.instance_id in f:
            raise ValueError(f"plan_migrations: instance {load.instance_id!r} appears twice")
        f[load.instance_id] = freeness(load, cfg)
    return f


def _is_source(load: InstanceLoad, f: float, cfg: PolicyConfig) -> bool:
    return load.draining or load.preempting or f < cfg.migrate_out_freeness_below or load.slots_starved


def source_slack_blocks(load: InstanceLoad, cfg: PolicyConfig) -> float:
    """KV blocks the instance may still take, its batch and queue as they are, before `plan_migrations` takes it
    as a source: the largest u with F(used_blocks + u) >= migrate_out_freeness_below, i.e. M − ΣV − thr·B
    (blocks; fractional when the threshold is). Negative when it is a source now; −inf when it is one whatever
    its blocks (draining, preempting, starved of slots). A caller that knows how the blocks held grow (an
    engine's decode run) can tell from it how long a rescheduling round would find no source there."""
    if load.draining or load.preempting or load.slots_starved:
        return -math.inf
    return load.capacity_blocks - instance_virtual_usage(load, cfg) - cfg.migrate_out_freeness_below * batch_size(load)


def gives_a_slot(src: InstanceLoad, dst: InstanceLoad) -> bool:
    """True iff a move from ``src`` to ``dst`` is allowed for batch slots alone (module docstring, 1 and 3):
    ``src`` is starved of slots and not draining, ``dst`` is not draining, reports its slot limit and takes
    one more request. A destination that does not report its limit (a domain's stand-in in
    ``rack_sched.plan``, whose summary has no slots) gets such a move only when it also lowers Φ."""
    return src.slots_starved and not src.draining and not dst.draining and dst.max_num_seqs > 0 and dst.takes_one_more


def _accepts(
    dst: InstanceLoad,
    src: InstanceLoad,
    f_dst: float,
    cfg: PolicyConfig,
    used: set[str],
    source_ids: set[str],
) -> bool:
    """Can `dst` receive from `src` this round? (`used`: instances already paired this round.)

    Normally dst must not be a source, must be above the destination threshold and must take one more
    request (a batch slot, when it reports its limit); a draining source may use any instance that is
    neither draining nor preempting (everything must leave).
    """
    if dst.draining or dst.instance_id == src.instance_id or dst.instance_id in used:
        return False
    if src.draining:
        return not dst.preempting
    return dst.instance_id not in source_ids and f_dst > cfg.migrate_in_freeness_above and dst.takes_one_more


def _first_move(
    src: InstanceLoad,
    pool: list[InstanceLoad],
    order: CandidateOrder,
    f: dict[str, float],
    cfg: PolicyConfig,
    block_size_tokens: int,
) -> MigrationDecision | None:
    """The first (destination, request) pair, destinations freest first, that is allowed."""
    candidates = order([r for r in src.running if r.migratable], src.draining)
    for dst in pool:
        for request in candidates:
            held = prefix_blocks_on(dst, request, src.prefix_block_tokens, block_size_tokens)
            if (
                request.blocks - held <= dst.free_blocks
                and request.max_blocks <= dst.capacity_blocks
                and (move_lowers_potential(src, dst, request, cfg, held) or gives_a_slot(src, dst))
            ):
                reason = _reason(src, dst, request, f, cfg, held)
                return MigrationDecision(src.instance_id, dst.instance_id, request.request_id, request.blocks, reason)
    return None


def _reason(
    src: InstanceLoad, dst: InstanceLoad, request: RequestLoad, f: dict[str, float], cfg: PolicyConfig, held: int
) -> str:
    if src.draining:
        why = "source draining"
    elif src.preempting:
        why = f"source preempting (F={f[src.instance_id]:.2f})"
    elif src.slots_starved:
        why = f"source slots full ({src.num_running} of {src.max_num_seqs} running, {src.num_waiting} waiting)"
    else:
        why = f"source F={f[src.instance_id]:.2f} < {cfg.migrate_out_freeness_below}"
    v_src = instance_virtual_usage(src, cfg)
    v_dst = instance_virtual_usage(dst, cfg)
    v_r = request_virtual_usage(request, cfg)
    if src.draining or move_lowers_potential(src, dst, request, cfg, held):
        rule = f"V_src {v_src:.0f} − V_dst {v_dst:.0f} > v_r {v_r}"
        if held:
            rule = f"V_src {v_src:.0f}, V_dst {v_dst:.0f}, v_r {v_r}, {held} of its blocks cached there: Φ lowers"
    else:
        rule = f"a batch slot ({dst.num_running} of {dst.max_num_seqs} running there)"
    return f"{why}; destination F={f[dst.instance_id]:.2f}; {rule} ({cfg.candidate_policy})"


def pair_domains(summaries: Sequence[DomainSummary], cfg: PolicyConfig) -> list[tuple[str, str]]:
    """Pair source domains with destination domains, as `plan_migrations` pairs instances.

    Sources: draining or F < migrate_out_freeness_below, fullest first; destinations: not a source,
    not draining, F > migrate_in_freeness_above, with free blocks on some instance, freest first.
    A draining source may pair with any non-draining domain that has free blocks. Ties by domain
    id. Returns (src_domain_id, dst_domain_id) pairs; each domain appears at most once. The
    coordinator prices and approves the actual moves. Raises ValueError on repeated domain ids.
    """
    ids = [s.domain_id for s in summaries]
    if len(set(ids)) != len(ids):
        raise ValueError(f"pair_domains: repeated domain ids in {sorted(ids)}")
    sources = sorted(
        (s for s in summaries if is_source_domain(s, cfg)), key=lambda s: fullest_first(s.freeness, s.domain_id)
    )
    by_freeness = sorted(summaries, key=lambda s: freest_first(s.freeness, s.domain_id))
    source_ids = {s.domain_id for s in sources}
    used: set[str] = set()
    pairs: list[tuple[str, str]] = []
    for src in sources:
        if src.domain_id in used:
            continue
        dst = next((d for d in by_freeness if _domain_accepts(d, src, used, source_ids, cfg)), None)
        if dst is not None:
            pairs.append((src.domain_id, dst.domain_id))
            used.update((src.domain_id, dst.domain_id))
    return pairs


def is_source_domain(summary: DomainSummary, cfg: PolicyConfig) -> bool:
    """True iff ``pair_domains`` takes the domain as a source: draining, or F < migrate_out_freeness_below. A
    domain that is not is never paired as a source, whatever the other summaries."""
    return summary.draining or summary.freeness < cfg.migrate_out_freeness_below


def _domain_accepts(
    dst: DomainSummary, src: DomainSummary, used: set[str], source_ids: set[str], cfg: PolicyConfig
) -> bool:
    if dst.draining or dst.largest_free_blocks <= 0 or dst.domain_id == src.domain_id or dst.domain_id in used:
        return False
    if src.draining:
        return True
    return dst.domain_id not in source_ids and dst.freeness > cfg.migrate_in_freeness_above
