"""Dispatch: send a new request to the freest target that can hold it (Llumnix OSDI'24 §4.4.3).

A view keeps the last load report of each target plus the requests it dispatched since then
("reservations"), so a burst that arrives between two reports spreads out instead of piling onto
the target that looked freest. A fresh report replaces the target's state and drops its
reservations: the report already counts whatever arrived. A report that left its source some time
ago (a domain summary published every 100 ms and received later) only counts what arrived before it
was taken: give ``update`` its ``as_of`` stamp and the reservations made after it are kept
(stamps are any increasing number the caller chooses, e.g. seconds on its clock; the rule book reads
no clock).

Rule, per pick of a request needing `demand_blocks` to start and `need_blocks` at most (its prompt plus
max_tokens, what it may grow to; 0 = only the demand is known):
1. capable = targets not draining, not excluded, whose single-instance capacity >= max(demand, need);
   none -> refuse;
2. prefer capable targets with room now (free blocks >= demand); if none, take the capable ones
   anyway (the request will queue) and say so — or, with `only_if_room`, refuse with `full` set, so the
   caller can try elsewhere (a gateway trying the next domain);
3. take the highest freeness; targets within `tie_tolerance`·|F_best| of it are near-ties and one
   is drawn with the seeded rng. With `choices` = d > 0 (power of d choices, Mitzenmacher 2001), d
   targets of the pool are drawn first and the freest of those taken: several dispatchers sharing the
   same lagged view (a fleet of gateways) then spread a burst instead of all picking the same target;
4. reserve: add demand + priority headroom to its usage and one request to its queue.

Prefix-aware dispatch (``PolicyConfig.prefix_aware_dispatch``), for a request that gives the hash ids of its
reusable prompt prefix (``prefix_hashes``, each covering ``prefix_block_tokens`` tokens, ``h`` = that over the
KV block size, the KV blocks one hash stands for):

* a target's hit is ``hit = min(run·h, demand − 1)`` blocks, ``run`` the leading hashes of the request found in
  the target's ``prefix_hashes`` (reported, plus those of the requests this view sent it since the report; a
  target that reports no prefix held has no hit, since nothing says it caches at all):
  an engine reuses a prefix only from its first block on, and always computes the prompt's last token;
* blocks present need no new memory: steps 2 and 4 use the target's effective demand ``demand − hit``;
* step 3 becomes: ``F'`` = a target's freeness after reserving its effective demand; the targets with
  ``F' ≥ F'_best − margin·|F'_best|`` (``margin`` = ``prefix_affinity_margin``) are eligible, and the eligible
  ones with the longest hit are chosen from (the freest by ``F'``, near-ties drawn as in step 3). When no
  eligible target holds any of the prefix, step 3 applies unchanged. So affinity wins only while the prefix
  holder is within the margin of the freest; beyond it load wins, and a popular prefix cannot pile requests
  onto one instance. With ample free memory ``F ≈ M/B``: the holder's batch grows to at most
  ``1/(1 − margin)`` times the freest's (2× at the default 0.5). With ``choices`` = d, the target with the
  longest hit joins the d drawn ones;
* the chosen target's view entry counts the request's hashes as held, so a burst with one prefix lands together
  before the next report (each request still under the margin).

Sources: SGLang's cache-aware router (sgl-router ``cache_aware``: the highest prefix match wins while the
workers' loads are balanced, the shortest queue once ``balance_abs_threshold`` and ``balance_rel_threshold``
are both exceeded) — hilum's margin is that relative threshold, on freeness; NVIDIA Dynamo's KV router
(cost = overlap weight × new prefill blocks + active decode blocks: cached blocks need no new prefill nor
memory) — hilum's effective demand. vLLM's automatic prefix caching and the Mooncake trace's ``hash_ids``
define the hash blocks.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar, overload

from policy.domain import DomainSummary
from policy.load import InstanceLoad
from policy.types import PolicyConfig
from policy.usage import dispatch_freeness_of, dispatch_usage, queued_blocks

__all__ = [
    "DispatchDecision",
    "DispatchView",
    "DomainDispatchView",
    "all_draining",
    "leading_run",
    "request_kv_blocks",
    "reusable_prefix_hashes",
]


def request_kv_blocks(prompt_tokens: int, max_tokens: int, block_size_tokens: int) -> tuple[int, int]:
    """(demand, need): the KV blocks of ``block_size_tokens`` tokens a request of ``prompt_tokens`` prompt tokens and
    at most ``max_tokens`` output tokens needs to start, and may grow to. The gateway, the domain schedulers and the
    simulator all size a request by this one rule.

    - need: ``ceil((prompt + max_tokens − 1) / b)``: the last output token is sampled, never stored (no step runs
      after it), as vLLM's admission counts;
    - demand: the prompt and the slot of the first output token, which the first decode step stores,
      ``ceil((prompt + 1) / b)``; a request of one output token has no decode step, so its demand is its prompt's
      blocks (its need: a prompt that fills an instance exactly fits it).

    Raises ValueError if ``max_tokens`` < 1 or ``block_size_tokens`` < 1.
    """
    if max_tokens < 1 or block_size_tokens < 1:
        raise ValueError(f"need max_tokens >= 1 and block_size_tokens >= 1, got {max_tokens}, {block_size_tokens}")
    need = -(-(prompt_tokens + max_tokens - 1) // block_size_tokens)
    return min(-(-(prompt_tokens + 1) // block_size_tokens), need), need


def reusable_prefix_hashes(hashes: Sequence[int], prefix_block_tokens: int, prompt_tokens: int) -> Sequence[int]:
    """The leading ``hashes`` of a prompt of ``prompt_tokens`` tokens an engine may reuse from its prefix cache:
    the hash blocks (of ``prefix_block_tokens`` tokens) that end before the prompt's last token, which is always
    computed (vLLM's automatic prefix caching; ``llumlet.engine.blocks.BlockManager.match_prefix`` matches at most
    ``prompt_tokens − 1`` tokens). ``hashes`` itself when all of them are reusable (no copy). Raises ValueError
    when hashes are given with ``prefix_block_tokens`` < 1."""
    if not hashes:
        return hashes
    if prefix_block_tokens < 1:
        raise ValueError(f"prefix hashes given but prefix_block_tokens is {prefix_block_tokens}")
    usable = max(0, prompt_tokens - 1) // prefix_block_tokens
    return hashes if usable >= len(hashes) else hashes[:usable]


def leading_run(hashes: Iterable[int], held: Collection[int], also: Collection[int] = ()) -> int:
    """How many leading ``hashes`` are in ``held`` (or in ``also``): a prefix cache is matched from the first block
    on, so the first hash it lacks ends the run (vLLM's automatic prefix caching)."""
    run = 0
    for h in hashes:
        if h not in held and h not in also:
            break
        run += 1
    return run


# The classes below write out their __init__ instead of having dataclasses generate it: compiled
# (hilum_compiled.MODULES), a written-out __init__ is a native call, a generated one is interpreted Python.


class DispatchDecision:
    """Where a request goes: ``target_id`` (an instance or domain id), or None with the refusal reason.

    ``reason``: one line for logs and for the client on refusal. A placement's reason is written when first read
    (from the figures of the pick, kept with it): most are never read, and writing one costs about what the pick
    does. Compared by target, reason and ``full`` (unhashable); ``target_id`` and ``full`` are ``Final`` (compiled,
    read-only; plain Python, mypy refuses an assignment), ``reason`` has no setter; pickles and copies with its
    reason written.
    """

    __slots__ = ("_placed", "_reason", "full", "target_id")

    target_id: Final[str | None]
    full: Final[bool]  # refused only because no capable target has room now (``only_if_room``)

    def __init__(self, target_id: str | None, reason: str, full: bool = False) -> None:
        self.target_id = target_id
        self.full = full
        self._reason = reason
        self._placed: _Placed | None = None  # a placement's figures, until its reason is written

    @property
    def reason(self) -> str:
        placed = self._placed
        if placed is not None:
            self._reason = placed.text()
            self._placed = None
        return self._reason

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DispatchDecision):
            return NotImplemented
        return (self.target_id, self.reason, self.full) == (other.target_id, other.reason, other.full)

    def __repr__(self) -> str:
        return f"DispatchDecision(target_id={self.target_id!r}, reason={self.reason!r}, full={self.full!r})"

    def __reduce__(self) -> tuple[type[DispatchDecision], tuple[str | None, str, bool]]:
        return (DispatchDecision, (self.target_id, self.reason, self.full))


class _Placed:
    """The figures a placement's reason is written from (:attr:`DispatchDecision.reason`)."""

    def __init__(
        self, noun: str, freeness: float, num_near: int, demand_blocks: int, has_room: bool, hit_blocks: int
    ) -> None:
        self.noun = noun
        self.freeness = freeness  # the chosen target's, after reserving
        self.num_near = num_near
        self.demand_blocks = demand_blocks
        self.has_room = has_room
        self.hit_blocks = hit_blocks

    def text(self) -> str:
        noun = self.noun
        where = f"freest {noun} (F={self.freeness:.2f} after reserving, {self.num_near} near-tied)"
        if self.has_room:
            reason = f"{where} with room for {self.demand_blocks} blocks"
        else:
            reason = f"no {noun} has {self.demand_blocks} free blocks now; the request will queue on the {where}"
        return f"{reason}; prefix hit {self.hit_blocks} blocks" if self.hit_blocks else reason


def _placement(target_id: str, placed: _Placed) -> DispatchDecision:
    """The decision to place on ``target_id``, its reason written from ``placed`` when read."""
    decision = DispatchDecision(target_id, "")
    decision._placed = placed
    return decision


@dataclass(init=False, slots=True)
class _Target:
    """Mutable per-target state inside a view: the last report plus local reservations."""

    target_id: str
    capacity_blocks: int  # M
    usage: float  # ΣV as reported
    num_running: int  # running requests as reported
    num_waiting: int  # queued requests as reported (the requests dispatched since go to reserved_count)
    free_blocks: int  # blocks a new request could use now (instance: M − used − queued head)
    max_request_blocks: int  # the largest request one instance of it can ever hold
    draining: bool
    prefix_hashes: frozenset[int]  # prefix hash blocks it holds, as reported (shared, not copied)
    prefix_block_tokens: int  # tokens per hash block of those (0: not reported, any size matches)
    reserved_usage: float  # Σ(demand + headroom) dispatched since the report
    reserved_blocks: int  # Σ demand dispatched since the report
    reserved_count: int  # requests dispatched since the report
    added_hashes: set[int] | None  # prefix hashes of the requests dispatched since the report
    # (stamp, demand, virtual, prefix hashes) of stamped reservations
    stamped: tuple[tuple[float, int, int, Sequence[int]], ...]

    def __init__(
        self,
        target_id: str,
        capacity_blocks: int,
        usage: float,
        num_running: int,
        num_waiting: int,
        free_blocks: int,
        max_request_blocks: int,
        draining: bool,
        prefix_hashes: frozenset[int] = frozenset(),
        prefix_block_tokens: int = 0,
    ) -> None:
        self.target_id = target_id
        self.capacity_blocks = capacity_blocks
        self.usage = usage
        self.num_running = num_running
        self.num_waiting = num_waiting
        self.free_blocks = free_blocks
        self.max_request_blocks = max_request_blocks
        self.draining = draining
        self.prefix_hashes = prefix_hashes
        self.prefix_block_tokens = prefix_block_tokens
        self.reserved_usage = 0.0
        self.reserved_blocks = 0
        self.reserved_count = 0
        self.added_hashes = None
        self.stamped = ()

    def freeness(self, extra_usage: float = 0.0, extra_requests: int = 0) -> float:
        return dispatch_freeness_of(
            self.capacity_blocks,
            self.usage + self.reserved_usage + extra_usage,
            self.num_running,
            self.num_waiting + self.reserved_count + extra_requests,  # they join the queue
        )

    def has_room(self, demand_blocks: int) -> bool:
        return self.free_blocks - self.reserved_blocks >= demand_blocks

    def prefix_run(self, hashes: Sequence[int], block_tokens: int) -> int:
        """How many leading ``hashes`` (of ``block_tokens``-token hash blocks) it holds or was sent. A target
        whose report holds no prefix counts none: nothing says it caches at all (prefix caching off, an engine
        without a cache), so what this view sent it is no evidence either."""
        if self.prefix_block_tokens not in (0, block_tokens):
            return 0  # hashed at another granularity: the ids do not name the same blocks
        held, added = self.prefix_hashes, self.added_hashes
        if not held:
            return 0
        return leading_run(hashes, held, added or ())

    def reserve(
        self, demand_blocks: int, virtual_blocks: int, stamp: float | None = None, hashes: Sequence[int] = ()
    ) -> None:
        self.reserved_usage += virtual_blocks
        self.reserved_blocks += demand_blocks
        self.reserved_count += 1
        if hashes:
            if self.added_hashes is None:
                self.added_hashes = set()
            self.added_hashes.update(hashes)
        if stamp is not None:
            self.stamped += ((stamp, demand_blocks, virtual_blocks, hashes),)

    def keep_after(self, previous: _Target, as_of: float) -> None:
        """Carry over ``previous``'s stamped reservations made after ``as_of`` (the new report misses them)."""
        for stamp, demand, virtual, hashes in previous.stamped:
            if stamp > as_of:
                self.reserve(demand, virtual, stamp, hashes)


class _InIdOrder(Sequence[_Target]):
    """The targets of a view in id order, less those at ``gaps`` (sorted positions in ``ids``): the pool a pick
    draws from, as a sequence a pick reads ``len`` and the ``k`` items it draws of (:func:`_sample_positions`)
    without the pool being listed. Item ``j``: O(len(gaps))."""

    __slots__ = ("_gaps", "_ids", "_targets")

    def __init__(self, ids: list[str], targets: dict[str, _Target], gaps: list[int]) -> None:
        self._ids = ids
        self._targets = targets
        self._gaps = gaps

    def __len__(self) -> int:
        return len(self._ids) - len(self._gaps)

    @overload
    def __getitem__(self, j: int) -> _Target: ...
    @overload
    def __getitem__(self, j: slice) -> list[_Target]: ...
    def __getitem__(self, j: int | slice) -> _Target | list[_Target]:
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        n = len(self)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(j)
        p = j  # the j-th position not in gaps: every gap at or before it moves it one further
        for g in self._gaps:
            if g > p:
                break
            p += 1
        return self._targets[self._ids[p]]

    def __iter__(self) -> Iterator[_Target]:
        gaps, targets = set(self._gaps), self._targets
        return (targets[tid] for p, tid in enumerate(self._ids) if p not in gaps)


class _PoolIndex:
    """What a sampling view (``choices`` > 0) keeps to find its pick's pool without going over every target:
    the targets' ids sorted, their room (free − reserved blocks) and their largest request (blocks) each in a
    sorted list, and the draining ones. A pick's pool is every target less the few that fail its filters
    (draining, too small, excluded, no room), found by bisection: O(log targets + those left out), where the
    scan of :meth:`_View.pick` is O(targets). Each change of a target costs O(log targets) comparisons (and a
    memmove of the lists).

    The two sorted lists hold one int per target, ``(count << _SLOT_BITS) | slot`` (its room or largest request,
    then a number of its own while it is listed, :attr:`_slot_ids`): ints ordered as the counts, where (count, id)
    pairs cost each comparison of a bisection two objects read (on a gateway over hundreds of domains, mostly out
    of the CPU's caches) and a string comparison on a tie. Positions in the sorted ids are kept in a dict, made
    again after a target joins or leaves."""

    __slots__ = ("_caps", "_draining", "_free_slots", "_ids", "_keys", "_positions", "_rooms", "_slot_ids")

    def __init__(self) -> None:
        self._ids: list[str] = []  # every target id, sorted
        self._positions: dict[str, int] | None = None  # id -> its position in _ids (None: to be made again)
        self._rooms: list[int] = []  # (free − reserved blocks) << _SLOT_BITS | slot, sorted
        self._caps: list[int] = []  # max_request_blocks << _SLOT_BITS | slot, sorted
        self._draining: set[str] = set()
        self._keys: dict[str, tuple[int, int, int]] = {}  # id -> (room key, cap key, slot) as listed
        self._slot_ids: list[str] = []  # slot -> the id holding it (a free slot keeps the id of its last holder)
        self._free_slots: list[int] = []

    def put(self, target: _Target) -> None:
        """``target`` was added, replaced or reserved on."""
        tid = target.target_id
        old = self._keys.get(tid)
        if old is not None:
            slot = old[2]
        else:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_ids[slot] = tid
            else:
                slot = len(self._slot_ids)
                self._slot_ids.append(tid)
            bisect.insort(self._ids, tid)
            self._positions = None
        room = ((target.free_blocks - target.reserved_blocks) << _SLOT_BITS) | slot
        cap = (target.max_request_blocks << _SLOT_BITS) | slot
        if old is None or room != old[0]:
            if old is not None:
                _discard(self._rooms, old[0])
            bisect.insort(self._rooms, room)
        if old is None or cap != old[1]:  # a domain's largest request changes far less often than its room
            if old is not None:
                _discard(self._caps, old[1])
            bisect.insort(self._caps, cap)
        self._keys[tid] = (room, cap, slot)
        if target.draining:
            self._draining.add(tid)
        else:
            self._draining.discard(tid)

    def drop(self, target_id: str) -> None:
        """``target_id`` left the view (idempotent)."""
        old = self._keys.pop(target_id, None)
        if old is None:
            return
        _discard(self._ids, target_id)
        self._positions = None
        _discard(self._rooms, old[0])
        _discard(self._caps, old[1])
        self._free_slots.append(old[2])
        self._draining.discard(target_id)

    def pools(
        self, targets: dict[str, _Target], size: int, demand_blocks: int, exclude: Collection[str]
    ) -> tuple[_InIdOrder, _InIdOrder]:
        """(capable, roomy) of :meth:`_View.pick` without hits, in id order: capable = not draining, not
        excluded, ``max_request_blocks >= size``; roomy = capable with ``room >= demand_blocks``."""
        slot_ids = self._slot_ids
        out = set(self._draining)
        out.update(
            slot_ids[key & _SLOT_MASK] for key in self._caps[: bisect.bisect_left(self._caps, size << _SLOT_BITS)]
        )
        out.update(tid for tid in exclude if tid in self._keys)
        cut = bisect.bisect_left(self._rooms, demand_blocks << _SLOT_BITS)
        short = {slot_ids[key & _SLOT_MASK] for key in self._rooms[:cut]} - out
        positions = self._positions
        if positions is None:
            positions = self._positions = {tid: k for k, tid in enumerate(self._ids)}
        capable_gaps = sorted([positions[tid] for tid in out])
        roomy_gaps = sorted([*capable_gaps, *(positions[tid] for tid in short)])
        return _InIdOrder(self._ids, targets, capable_gaps), _InIdOrder(self._ids, targets, roomy_gaps)


_SLOT_BITS: Final = 32  # the bits of a _PoolIndex key below the count: its slot (a target's number while listed)
_SLOT_MASK: Final = (1 << _SLOT_BITS) - 1


_K = TypeVar("_K", str, int)


def _sample_positions(rng: random.Random, n: int, k: int) -> list[int]:
    """The positions (0 <= position < ``n``) of the ``k`` items ``rng.sample(population, k)`` draws from a population
    of ``n`` (0 < k <= n), in its order, drawn with the same calls on ``rng``: CPython's ``Random.sample`` (a pool
    of positions when ``n`` is at most its small-set size, else draws until a new position) with its
    ``_randbelow`` (``getrandbits`` of ``n.bit_length()`` bits until one is below ``n``). Called from compiled code
    it spares a pick at a gateway over hundreds of domains ``Random.sample``'s interpreted Python; the tests hold
    it equal to ``Random.sample``."""
    setsize = 21
    if k > 5:
        setsize += 4 ** math.ceil(math.log(k * 3, 4))
    positions: list[int] = []
    if n <= setsize:
        pool = list(range(n))
        for i in range(k):
            j = _below(rng, n - i)
            positions.append(pool[j])
            pool[j] = pool[n - i - 1]
        return positions
    selected: set[int] = set()
    for _ in range(k):
        j = _below(rng, n)
        while j in selected:
            j = _below(rng, n)
        selected.add(j)
        positions.append(j)
    return positions


def _below(rng: random.Random, n: int) -> int:
    """A draw in [0, n) (n > 0) as ``Random._randbelow`` makes it with ``getrandbits``: ``seq[_below(rng, len(seq))]``
    is ``rng.choice(seq)``."""
    bits = n.bit_length()
    r = rng.getrandbits(bits)
    while r >= n:
        r = rng.getrandbits(bits)
    return r


def all_draining(count: int, noun: str) -> str:
    """The refusal of a dispatch whose ``count`` (>= 1) targets all drain: "all 3 instances are draining", "the
    only domain is draining"."""
    return f"all {count} {noun}s are draining" if count > 1 else f"the only {noun} is draining"


def _discard(items: list[_K], item: _K) -> None:
    """Remove ``item`` from the sorted list ``items`` (absent: nothing)."""
    k = bisect.bisect_left(items, item)
    if k < len(items) and items[k] == item:
        del items[k]


class _View:
    """Mechanics shared by instance and domain views; subclasses turn reports into `_Target`s."""

    _noun = "target"

    def __init__(self, cfg: PolicyConfig, rng: random.Random, choices: int = 0) -> None:
        if choices < 0:
            raise ValueError(f"choices must be >= 0 (0: every target), got {choices}")
        self._cfg = cfg
        self._rng = rng
        self._choices = choices
        self._targets: dict[str, _Target] = {}
        # a sampling view finds its pool by index (a gateway's view of hundreds of domains); a view that ranks
        # every target (choices 0) goes over all of them anyway
        self._index = _PoolIndex() if choices > 0 else None

    def remove(self, target_id: str) -> None:
        """Forget a target (gone, deregistered). Idempotent: an unknown id is ignored."""
        self._targets.pop(target_id, None)
        if self._index is not None:
            self._index.drop(target_id)

    def freeness(self, target_id: str) -> float:
        """Freeness of a target as this view sees it, reservations included. KeyError if unknown."""
        return self._targets[target_id].freeness()

    def drops_reservations(self, target_id: str, as_of: float) -> bool:
        """Whether ``update(report, as_of=as_of)`` from the report the target holds would drop a reservation it
        counts (one stamped at or before ``as_of``, or one without a stamp); when not, that update would rebuild
        it as it is. True for an unknown target (the update would add it)."""
        target = self._targets.get(target_id)
        if target is None:
            return True
        stamped = target.stamped
        return target.reserved_count != len(stamped) or any(stamp <= as_of for stamp, _, _, _ in stamped)

    def reservations(self, target_id: str) -> int:
        """Requests dispatched to a target since its report (those the view still counts); 0 if unknown."""
        target = self._targets.get(target_id)
        return target.reserved_count if target is not None else 0

    def pick(
        self,
        demand_blocks: int,
        priority: int = 0,
        stamp: float | None = None,
        *,
        need_blocks: int = 0,
        exclude: Collection[str] = (),
        only_if_room: bool = False,
        prefix_hashes: Sequence[int] = (),
        prefix_block_tokens: int = 0,
        block_size_tokens: int = 0,
    ) -> DispatchDecision:
        """Choose a target for a request and reserve it there.

        Args:
            demand_blocks: KV blocks it needs to start (its prompt).
            priority: its priority class (the headroom it carries).
            stamp: marks the reservation so that a later `update(..., as_of=...)` with an older report
                keeps it.
            need_blocks: KV blocks it may grow to (prompt + max_tokens); a target must be able to hold
                that many on one instance. 0: not known, only the demand counts.
            exclude: targets not to choose this time (tried already); their state is kept.
            only_if_room: refuse (``full=True``) rather than queue when no capable target has room now.
            prefix_hashes: hash ids of the prompt's prefix blocks an engine may reuse, in order (the full hash
                blocks before the prompt's last token: vLLM always computes that one).
            prefix_block_tokens: tokens each hash covers (a multiple of ``block_size_tokens``).
            block_size_tokens: tokens per KV block of the targets (``demand_blocks``' unit); with
                ``prefix_block_tokens`` it gives the blocks one hash stands for. 0 (either): no prefix.

        Returns target_id None, with the reason, only when no target (not excluded) can ever hold the
        request. Raises ValueError if demand_blocks or need_blocks < 0.
        """
        for name, value in (("demand_blocks", demand_blocks), ("need_blocks", need_blocks)):
            if value < 0:
                raise ValueError(f"pick: {name} must be >= 0, got {value}")
        size = max(demand_blocks, need_blocks)
        capable, roomy = self._pools(size, demand_blocks, exclude)
        if not capable:
            return DispatchDecision(None, self._refusal(size, exclude))
        per_hash = self._blocks_per_hash(prefix_hashes, prefix_block_tokens, block_size_tokens)
        hits: dict[str, int] = {}
        if per_hash and demand_blocks > 1:
            for t in capable:
                run = t.prefix_run(prefix_hashes, prefix_block_tokens)
                if run:
                    hits[t.target_id] = min(run * per_hash, demand_blocks - 1)
            if hits:  # blocks present need no room
                roomy = [t for t in capable if t.has_room(demand_blocks - hits.get(t.target_id, 0))]
        if not roomy and only_if_room:
            noun = self._noun
            why = f"no {noun} has {demand_blocks} free blocks now ({len(capable)} could hold the request later)"
            return DispatchDecision(None, why, full=True)
        headroom = self._cfg.headroom_blocks(priority)
        pool = roomy or capable
        if hits and any(t.target_id in hits for t in pool):
            chosen, num_near = self._choose_by_prefix(pool, hits, demand_blocks + headroom)
        else:
            chosen, num_near = self._choose(pool)
        hit = hits.get(chosen.target_id, 0)
        chosen.reserve(demand_blocks - hit, demand_blocks - hit + headroom, stamp, prefix_hashes if per_hash else ())
        if self._index is not None:
            self._index.put(chosen)
        placed = _Placed(self._noun, chosen.freeness(), num_near, demand_blocks, bool(roomy), hit)
        return _placement(chosen.target_id, placed)

    def _pools(
        self, size: int, demand_blocks: int, exclude: Collection[str]
    ) -> tuple[Sequence[_Target], Sequence[_Target]]:
        """(capable, roomy) of a pick, before prefix hits (module docstring, steps 1 and 2): capable = not
        draining, not excluded, able to hold ``size`` blocks; roomy = capable with ``demand_blocks`` free. By
        the index when the view samples (in id order), else by going over every target."""
        if self._index is not None:
            return self._index.pools(self._targets, size, demand_blocks, exclude)
        capable = [
            t
            for t in self._targets.values()
            if not t.draining and t.max_request_blocks >= size and t.target_id not in exclude
        ]
        return capable, [t for t in capable if t.has_room(demand_blocks)]

    def _blocks_per_hash(self, hashes: Sequence[int], block_tokens: int, block_size_tokens: int) -> int:
        """KV blocks one prefix hash stands for; 0 when the request's prefix takes no part."""
        if not hashes or not self._cfg.prefix_aware_dispatch:
            return 0
        if block_size_tokens < 1 or block_tokens < 1 or block_tokens % block_size_tokens:
            raise ValueError(
                f"pick: prefix_block_tokens {block_tokens} must be a positive multiple of block_size_tokens "
                f"{block_size_tokens} when prefix_hashes are given"
            )
        return block_tokens // block_size_tokens

    def _set(self, target: _Target, as_of: float | None = None) -> None:
        previous = self._targets.get(target.target_id)
        if previous is not None and as_of is not None:
            target.keep_after(previous, as_of)
        self._targets[target.target_id] = target
        if self._index is not None:
            self._index.put(target)

    def _sample(self, pool: Sequence[_Target]) -> Sequence[_Target]:
        """`choices` targets drawn from `pool` in id order (all of it when unset or larger): ``random.sample``'s
        draw (:func:`_sample_positions`)."""
        if 0 < self._choices < len(pool):
            in_order = pool if isinstance(pool, _InIdOrder) else sorted(pool, key=lambda t: t.target_id)
            return [in_order[j] for j in _sample_positions(self._rng, len(in_order), self._choices)]
        return pool

    def _freest(self, scored: list[tuple[float, str, _Target]]) -> tuple[_Target, int]:
        """The highest-scored of (freeness, id, target); near-ties (within tie_tolerance of the best) drawn as
        ``rng.choice`` draws (:func:`_below`, compiled)."""
        best = max(f for f, _, _ in scored)
        floor = best - self._cfg.tie_tolerance * abs(best)
        near = sorted((tid, t) for f, tid, t in scored if f >= floor)
        return near[_below(self._rng, len(near))][1], len(near)

    def _choose(self, pool: Sequence[_Target]) -> tuple[_Target, int]:
        """The freest of `pool` (of `choices` targets drawn from it, when set); near-ties (within
        tie_tolerance of the best) drawn with the rng."""
        return self._freest([(t.freeness(), t.target_id, t) for t in self._sample(pool)])

    def _choose_by_prefix(
        self, pool: Sequence[_Target], hits: dict[str, int], virtual_blocks: int
    ) -> tuple[_Target, int]:
        """The longest prefix hit among the targets whose freeness after the reservation is within
        ``prefix_affinity_margin`` of the freest's (module docstring); plain :meth:`_choose` when none of
        those holds the prefix. ``virtual_blocks``: demand + headroom, before the hit."""
        drawn = sample = self._sample(pool)
        if len(drawn) < len(pool):  # the longest hit joins the drawn ones
            best_hit = max(pool, key=lambda t: (hits.get(t.target_id, 0), t.target_id))
            if best_hit not in drawn:
                sample = [*drawn, best_hit]
        after = [(t.freeness(virtual_blocks - hits.get(t.target_id, 0), 1), t.target_id, t) for t in sample]
        best = max(f for f, _, _ in after)
        floor = best - self._cfg.prefix_affinity_margin * abs(best)
        eligible = [x for x in after if x[0] >= floor]
        longest = max(hits.get(tid, 0) for _, tid, _ in eligible)
        if longest == 0:
            return self._freest([(t.freeness(), t.target_id, t) for t in drawn])
        return self._freest([x for x in eligible if hits.get(x[1], 0) == longest])

    def _refusal(self, demand_blocks: int, exclude: Collection[str] = ()) -> str:
        noun = self._noun
        if not self._targets:
            return f"no {noun}s to dispatch to"
        active = [t for t in self._targets.values() if not t.draining]
        if not active:
            return all_draining(len(self._targets), noun)
        left = [t for t in active if t.target_id not in exclude]
        if not left:
            return f"every {noun} that is not draining was tried"
        active = left
        largest = max(t.max_request_blocks for t in active)
        return (
            f"request needs {demand_blocks} blocks but the largest non-draining {noun} "
            f"can hold {largest} blocks; no {noun} can ever hold it"
        )


class DispatchView(_View):
    """Dispatch over the instances of one domain (used by a domain scheduler and the simulator).

    `loads`: the latest report of each instance; instance ids must be unique (ValueError otherwise).
    `rng`: the seeded random source for near-ties. Not thread-safe; one view per scheduler loop.
    `choices`: power-of-d-choices sampling (0: every instance; the default, with exact, fresh state).
    """

    _noun = "instance"

    def __init__(self, loads: Iterable[InstanceLoad], cfg: PolicyConfig, rng: random.Random, choices: int = 0) -> None:
        super().__init__(cfg, rng, choices)
        for load in loads:
            if load.instance_id in self._targets:
                raise ValueError(f"DispatchView: instance {load.instance_id!r} appears twice")
            self.update(load)

    def update(self, load: InstanceLoad, as_of: float | None = None) -> None:
        """Replace an instance's state with a report (or add it).

        Drops its reservations, or with `as_of` (the report's stamp) only those stamped at or before it.
        """
        self._set(
            _Target(
                target_id=load.instance_id,
                capacity_blocks=load.capacity_blocks,
                usage=dispatch_usage(load, self._cfg),
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                free_blocks=load.free_blocks - queued_blocks(load),
                max_request_blocks=load.capacity_blocks,
                draining=load.draining,
                prefix_hashes=load.prefix_hashes,
                prefix_block_tokens=load.prefix_block_tokens,
            ),
            as_of,
        )


class DomainDispatchView(_View):
    """Dispatch over domains (used by the gateway and the coordinator), from `DomainSummary` values.

    The capacity check uses max_instance_capacity_blocks, the room check largest_free_blocks (a
    reservation lowers it by the demand: conservative, the request may land elsewhere).
    `choices`: power-of-d-choices sampling (0: every domain). Raises ValueError on a repeated domain id.
    """

    _noun = "domain"

    def __init__(
        self, summaries: Iterable[DomainSummary], cfg: PolicyConfig, rng: random.Random, choices: int = 0
    ) -> None:
        super().__init__(cfg, rng, choices)
        for summary in summaries:
            if summary.domain_id in self._targets:
                raise ValueError(f"DomainDispatchView: domain {summary.domain_id!r} appears twice")
            self.update(summary)

    def update(self, summary: DomainSummary, as_of: float | None = None) -> None:
        """Replace a domain's state with a summary (or add it).

        Drops its reservations, or with `as_of` (when the summary was taken, on the stamps' clock) only
        those stamped at or before it: a summary that took time to arrive misses the later dispatches.
        """
        self._set(
            _Target(
                target_id=summary.domain_id,
                capacity_blocks=summary.capacity_blocks,
                usage=summary.virtual_usage + summary.queued_blocks,
                num_running=summary.num_running,
                num_waiting=summary.num_waiting,
                free_blocks=summary.largest_free_blocks,
                max_request_blocks=summary.max_instance_capacity_blocks,
                draining=summary.draining,
                prefix_hashes=summary.prefix_hashes,
            ),
            as_of,
        )
