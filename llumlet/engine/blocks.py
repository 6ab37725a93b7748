"""KV cache block accounting: per-request block tables, reservations, optional prefix cache.

Mechanism only: every operation that needs space returns ``None`` / ``False`` when it does not fit and
changes nothing; it never raises for "full" and never picks a victim (the scheduler or policy does).

Every block is in exactly one of four states, so ``used + free + reserved + cached == total`` always
(``check_invariants``):

- used: in a request's private blocks, or in a prefix-cache entry referenced by at least one request;
- reserved: held by a reservation for an incoming migration;
- cached: in a prefix-cache entry no request references (evictable, least recently used first);
- free: on the free list.

Prefix caching (after vLLM's automatic prefix caching, with Mooncake-style hash ids): a prompt's hash
block ``j`` covers tokens ``[j·H, (j+1)·H)`` where ``H`` is the hash-block size in tokens (Mooncake: 512),
``H`` a multiple of the engine block size. A cache entry maps a hash id to the ``H / block_size`` engine
blocks holding that hash block's KV; the chain of a request's prefix is matched from its first hash block
and stops at the first miss.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_BLOCKS", "BlockManager", "PrefixMatch", "decode_blocks_taken", "decode_rounds_within"]

#: The most blocks one pool may have: block ids are kept packed as C ints (``array("i")``), not as an ``int``
#: object each. A simulated cluster of thousands of instances holds millions of block ids; as objects they are
#: ~40 bytes apiece and every block handed out or given back touches one (its reference count), far apart in
#: memory; packed they are 4 bytes, side by side.
MAX_BLOCKS = 2**31 - 1


def _ids(values: Sequence[int] = ()) -> array.array[int]:
    """Block ids, packed (see :data:`MAX_BLOCKS`)."""
    return array.array("i", values)


def decode_blocks_taken(firsts: Sequence[int], block_size_tokens: int, rounds: int) -> int:
    """New blocks ``rounds`` rounds of one slot per request take, the requests' first new-block rounds being
    ``firsts`` (sorted, :meth:`BlockManager.decode_first_rounds`): request i takes one in rounds f_i, f_i + B,
    f_i + 2B, ..., so ``sum_i max(0, (rounds - f_i) // B + 1)``. O(requests), nothing built."""
    taken = 0
    for f in firsts:
        if f > rounds:
            break
        taken += (rounds - f) // block_size_tokens + 1
    return taken


def decode_rounds_within(firsts: Sequence[int], block_size_tokens: int, budget_blocks: int, max_rounds: int) -> int:
    """The most rounds, at most ``max_rounds``, whose new blocks (:func:`decode_blocks_taken`) are at most
    ``budget_blocks``; -1 when even round 0 takes more (a first round <= 0). ``firsts``: sorted, not empty.

    O(requests) when every f_i <= B (no table holds a spare block: the (k + 1)-th new block is taken in round
    ``(k // n) * B + f_(k mod n)``), O(requests x log max_rounds) otherwise.
    """
    bs = block_size_tokens
    if decode_blocks_taken(firsts, bs, max_rounds) <= budget_blocks:
        return max_rounds
    if firsts[-1] <= bs:
        full, rem = divmod(budget_blocks, len(firsts))
        return full * bs + firsts[rem] - 1  # the round before the (budget + 1)-th new block
    lo, hi = -1, max_rounds  # taken(lo) <= budget < taken(hi), with taken(-1) = 0 <= budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if decode_blocks_taken(firsts, bs, mid) <= budget_blocks else (lo, mid)
    return lo


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of :meth:`BlockManager.match_prefix`."""

    hit_tokens: int  # prompt tokens whose KV is reused
    hit_blocks: int  # engine blocks shared with the cache


@dataclass(slots=True)
class _Entry:
    blocks: tuple[int, ...]
    refs: int = 0


@dataclass(init=False, slots=True)
class _Table:
    """One request's blocks. Its ``__init__`` is written out: compiled (``hilum_compiled.MODULES``), a table is
    then built by a native call, not by the interpreted one ``dataclasses`` generates."""

    shared: list[int]  # hash ids of referenced cache entries, in order
    private: array.array[int]  # block ids owned by the request, packed
    num_tokens: int  # token slots allocated
    num_blocks: int  # len(private) + blocks of every shared entry, kept up to date

    def __init__(
        self,
        shared: list[int] | None = None,
        private: array.array[int] | None = None,
        num_tokens: int = 0,
        num_blocks: int = 0,
    ) -> None:
        self.shared = [] if shared is None else shared
        self.private = _ids() if private is None else private
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks


class BlockManager:
    """Fixed pool of ``num_blocks`` KV blocks of ``block_size_tokens`` tokens each.

    Raises ValueError for non-positive sizes and for more than :data:`MAX_BLOCKS` blocks.
    """

    def __init__(self, num_blocks: int, block_size_tokens: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager: num_blocks = {num_blocks}, need >= 1")
        if num_blocks > MAX_BLOCKS:
            raise ValueError(f"BlockManager: num_blocks = {num_blocks}, at most {MAX_BLOCKS} (block ids are C ints)")
        if block_size_tokens < 1:
            raise ValueError(f"BlockManager: block_size_tokens = {block_size_tokens}, need >= 1")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.enable_prefix_caching = enable_prefix_caching
        # The free list, kept short: blocks given back (the last one given back is handed out first), then
        # the blocks never handed out yet, _fresh .. num_blocks - 1, in increasing order (a pool of thousands of
        # blocks per instance costs nothing until its blocks are used: what a list of every free id would cost
        # a simulated cluster of thousands of instances in memory)
        self._free = _ids()
        self._fresh = 0
        self._tables: dict[str, _Table] = {}
        self._reservations: dict[str, array.array[int]] = {}
        self._reserved = 0  # blocks held by all reservations
        self._reserved_prefix: dict[str, list[int]] = {}  # reservation -> hash ids of the cached entries it adopted
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced entries, oldest first
        self._used_private = 0
        self._used_shared = 0
        self._cached = 0
        self._prefix_hashes: frozenset[int] | None = frozenset()  # ids of _entries; None: rebuild on next read
        self.prefix_block_tokens = 0  # tokens per hash block of the entries (the last published; 0 = none yet)
        self.prefix_hit_tokens_total = 0  # prompt tokens reused from the cache since creation
        self.prefix_queries_tokens_total = 0  # prompt tokens looked up (for a hit rate)

    # ---- counters -----------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks on the free list (not counting evictable cached blocks)."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests (private + referenced prefix entries)."""
        return self._used_private + self._used_shared

    @property
    def reserved_blocks(self) -> int:
        """Blocks held by reservations."""
        return self._reserved

    @property
    def cached_blocks(self) -> int:
        """Blocks in unreferenced prefix-cache entries (evictable)."""
        return self._cached

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation can get: free plus evictable cached."""
        return len(self._free) + self.num_blocks - self._fresh + self._cached

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size_tokens)."""
        return -(-num_tokens // self.block_size_tokens)

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds a block table here."""
        return request_id in self._tables

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds (0 if unknown)."""
        t = self._tables.get(request_id)
        return 0 if t is None else t.num_blocks

    def num_tokens_of(self, request_id: str) -> int:
        """Token slots allocated to the request (0 if unknown)."""
        t = self._tables.get(request_id)
        return 0 if t is None else t.num_tokens

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """Block ids in token order (shared prefix blocks first); empty if unknown."""
        t = self._tables.get(request_id)
        if t is None:
            return ()
        out: list[int] = []
        for h in t.shared:
            out.extend(self._entries[h].blocks)
        out.extend(t.private)
        return tuple(out)

    # ---- allocation ---------------------------------------------------------------------------------
    def _take(self, n: int) -> array.array[int] | None:
        """Take n blocks from the free list, evicting LRU cached entries if needed; None if impossible."""
        if n > self.available_blocks:
            return None
        while self.free_blocks < n:
            h, _ = self._lru.popitem(last=False)
            entry = self._entries.pop(h)
            self._prefix_hashes = None
            self._cached -= len(entry.blocks)
            self._free.extend(entry.blocks)
        return self._pop_free(n)

    def _pop_free(self, n: int) -> array.array[int]:
        """Take ``n`` blocks off the free list (``n <= free_blocks``), in the order it hands them out: the blocks
        given back, the last first, then fresh ones in increasing order."""
        free = self._free
        given_back = min(n, len(free))
        out = free[len(free) - given_back :]
        del free[len(free) - given_back :]
        out.reverse()
        if given_back < n:
            fresh = self._fresh
            out.extend(range(fresh, fresh + n - given_back))
            self._fresh = fresh + n - given_back
        return out

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> tuple[int, ...] | None:
        """Extend the request's slots by ``num_new_tokens``; create its table if new.

        Returns the newly allocated block ids (possibly empty: the last block had room), or None when the
        pool cannot supply them (nothing changes). Raises ValueError for a negative count.
        """
        if num_new_tokens < 0:
            raise ValueError(f"allocate_slots({request_id!r}): num_new_tokens = {num_new_tokens} < 0")
        t = self._tables.get(request_id)
        held_tokens, held_blocks = (0, 0) if t is None else (t.num_tokens, t.num_blocks)
        need = -(-(held_tokens + num_new_tokens) // self.block_size_tokens) - held_blocks
        new: array.array[int] | None = None
        if need > 0:
            new = self._take(need)
            if new is None:
                return None
        if t is None:
            t = self._tables[request_id] = _Table()
        t.num_tokens += num_new_tokens
        if new is None:  # the last block had room (most decode steps): no array made
            return ()
        t.private.extend(new)
        t.num_blocks += len(new)
        self._used_private += len(new)
        return tuple(new)

    def append_slot(self, request_id: str) -> bool:
        """One more token slot (a decode); a new block every ``block_size_tokens`` tokens. False if full."""
        return self.allocate_slots(request_id, 1) is not None

    # ---- decode rounds (many decode steps at once) -------------------------------------------------
    def decode_first_rounds(self, request_ids: Sequence[str]) -> list[int]:
        """Each request's first round of one slot per round in which it needs a new block (then every B rounds),
        sorted: what :func:`decode_blocks_taken` and :func:`decode_rounds_within` read. Round r takes slot
        ``num_tokens + r``; it needs a block when that exceeds ``num_blocks x B`` slots. Raises KeyError for a
        request that holds no table."""
        bs = self.block_size_tokens
        tables = self._tables
        return sorted(tables[rid].num_blocks * bs - tables[rid].num_tokens + 1 for rid in request_ids)

    def decode_rounds_that_fit(self, request_ids: Sequence[str], max_rounds: int) -> int:
        """How many rounds of one new slot for every request (``append_slot`` over ``request_ids``, round after
        round) the free list can supply, at most ``max_rounds``; evictable cached blocks are not counted
        (:func:`decode_rounds_within` of the free blocks). Raises KeyError for a request that holds no table.
        """
        if max_rounds <= 0 or not request_ids:
            return max(0, max_rounds)
        firsts = self.decode_first_rounds(request_ids)
        return decode_rounds_within(firsts, self.block_size_tokens, self.free_blocks, max_rounds)

    def decode_rounds_new_blocks(self, request_ids: Sequence[str], rounds: int) -> int:
        """New blocks that ``rounds`` rounds of ``append_slot`` over ``request_ids`` would take (changes nothing)."""
        return sum(self.decode_new_blocks_each(request_ids, rounds))

    def decode_new_blocks_each(self, request_ids: Sequence[str], rounds: int) -> list[int]:
        """New blocks each request would take over ``rounds`` rounds of ``append_slot`` (changes nothing)."""
        bs = self.block_size_tokens
        out = []
        for rid in request_ids:
            t = self._tables[rid]
            first = t.num_blocks * bs - t.num_tokens + 1  # decode_first_rounds, inlined: this is per report
            out.append((rounds - first) // bs + 1 if first <= rounds else 0)
        return out

    def extend_decode_slots(self, request_ids: Sequence[str], rounds: int) -> int:
        """Give every request ``rounds`` more token slots, exactly as ``rounds`` rounds of ``append_slot`` over
        ``request_ids`` (in that order, round after round) would: the same blocks, in the same order.

        Only from the free list: the caller checks ``decode_rounds_that_fit`` first. Returns the number of
        blocks allocated. Raises KeyError for a request without a table, ValueError (nothing changed) when the
        free list cannot supply them.
        """
        if rounds <= 0:
            return 0
        bs = self.block_size_tokens
        tables = [self._tables[rid] for rid in request_ids]
        events: list[tuple[int, int]] = []  # (round, position in request_ids) of each new block
        for i, t in enumerate(tables):
            first = t.num_blocks * bs - t.num_tokens + 1  # decode_first_rounds, inlined: this is per step
            if first <= rounds:
                events.extend([(r, i) for r in range(first, rounds + 1, bs)])
        if len(events) > self.free_blocks:
            raise ValueError(f"extend_decode_slots: {len(events)} new blocks needed, {self.free_blocks} free")
        for t in tables:
            t.num_tokens += rounds
        if rounds > 1:
            events.sort()  # round by round; with one round they are in request order already
        for (_, i), block in zip(events, self._pop_free(len(events)), strict=True):
            t = tables[i]
            t.private.append(block)
            t.num_blocks += 1
        self._used_private += len(events)
        return len(events)

    def free(self, request_id: str) -> int:
        """Release the request's blocks; shared prefix entries lose a reference (cached when unreferenced).

        Returns the number of blocks the request held; 0 (no-op) for an unknown request.
        """
        t = self._tables.pop(request_id, None)
        if t is None:
            return 0
        private = t.private
        n = len(private)
        private.reverse()  # the table is gone: its last block is handed out first
        self._free.extend(private)
        self._used_private -= n
        return n + self._unref(t.shared)

    def _ref(self, hashes: Sequence[int]) -> None:
        """One more holder of each entry (an unreferenced one leaves the LRU: used, no longer evictable)."""
        for h in hashes:
            entry = self._entries[h]
            if entry.refs == 0:
                del self._lru[h]
                self._cached -= len(entry.blocks)
                self._used_shared += len(entry.blocks)
            entry.refs += 1

    def _unref(self, hashes: Sequence[int]) -> int:
        """One holder fewer of each entry (cached, evictable, when none is left); returns their blocks."""
        n = 0
        for h in hashes:
            entry = self._entries[h]
            n += len(entry.blocks)
            entry.refs -= 1
            if entry.refs == 0:
                self._used_shared -= len(entry.blocks)
                self._cached += len(entry.blocks)
                self._lru[h] = None
        return n

    # ---- reservations (incoming migrations) ---------------------------------------------------------
    def reserve(self, reservation_id: str, n_blocks: int) -> bool:
        """Hold ``n_blocks`` for an incoming migration. False if they don't fit or the id is in use."""
        if n_blocks < 0:
            raise ValueError(f"reserve({reservation_id!r}): n_blocks = {n_blocks} < 0")
        if reservation_id in self._reservations:
            return False
        got = self._take(n_blocks)
        if got is None:
            return False
        self._reservations[reservation_id] = got
        self._reserved += n_blocks
        return True

    def grow_reservation(self, reservation_id: str, n_blocks: int) -> bool:
        """Make the reservation hold at least ``n_blocks`` (the request grew during pre-copy).

        True when it already holds that many or the extra blocks were taken; False when they don't fit
        (nothing changes). Raises KeyError for an unknown reservation.
        """
        held = self._reservations.get(reservation_id)
        if held is None:
            raise KeyError(f"grow_reservation: unknown reservation {reservation_id!r} (released or never made)")
        if n_blocks <= len(held):
            return True
        got = self._take(n_blocks - len(held))
        if got is None:
            return False
        held.extend(got)
        self._reserved += len(got)
        return True

    def adopt_prefix(
        self, reservation_id: str, prefix_block_hashes: Sequence[int], hash_block_tokens: int, max_hit_tokens: int
    ) -> int:
        """An incoming request's leading hash blocks this cache holds become its first block-table positions at
        :meth:`commit` (referenced from now, never copied): the migration sends only the rest. Matched as
        :meth:`prefix_matching` matches (``max_hit_tokens``: the request's full blocks of KV). Once per
        reservation, before :meth:`commit`; the reservation's own blocks are for the rest of the request.

        Returns the blocks adopted (0 without prefix caching, or when nothing matches). Raises KeyError for an
        unknown reservation, ValueError when it adopted already.
        """
        if reservation_id not in self._reservations:
            raise KeyError(f"adopt_prefix: unknown reservation {reservation_id!r} (released or never made)")
        if reservation_id in self._reserved_prefix:
            raise ValueError(f"adopt_prefix({reservation_id!r}): adopted a prefix already")
        if not self.enable_prefix_caching or not prefix_block_hashes:
            return 0
        per = self._blocks_per_hash(hash_block_tokens)
        matched = self.prefix_matching(prefix_block_hashes, hash_block_tokens, max_hit_tokens)
        if matched:
            self._ref(matched)
            self._reserved_prefix[reservation_id] = matched
        return len(matched) * per

    def adopted_blocks(self, reservation_id: str) -> int:
        """Blocks of the cached entries the reservation adopted (:meth:`adopt_prefix`; 0 if none or unknown)."""
        return sum(len(self._entries[h].blocks) for h in self._reserved_prefix.get(reservation_id, ()))

    def reservation_size(self, reservation_id: str) -> int | None:
        """Blocks held by a reservation; None when it does not exist (never made, committed or released)."""
        held = self._reservations.get(reservation_id)
        return None if held is None else len(held)

    def reservation_blocks(self, reservation_id: str) -> tuple[int, ...] | None:
        """Physical block ids of a reservation in position order (position i becomes block-table entry i
        at ``commit``); None when it does not exist."""
        held = self._reservations.get(reservation_id)
        return None if held is None else tuple(held)

    def reserved_for(self, reservation_id: str) -> int:
        """Blocks held by the reservation (0 if unknown)."""
        return len(self._reservations.get(reservation_id, ()))

    def commit(self, reservation_id: str, request_id: str, num_tokens: int) -> tuple[int, ...] | None:
        """Turn the reservation into ``request_id``'s blocks for ``num_tokens`` token slots.

        The cached entries it adopted (:meth:`adopt_prefix`) come first, shared; the reservation's blocks hold
        the rest. Surplus reserved blocks go back to the free list; missing ones (the request grew) are taken
        from the pool. Returns the request's block table, or None when the growth does not fit (nothing changes, the
        reservation stays). Raises KeyError for an unknown reservation, ValueError if the request already
        holds blocks here or ``num_tokens`` is less than its adopted prefix.
        """
        if reservation_id not in self._reservations:
            raise KeyError(f"commit: unknown reservation {reservation_id!r} (released or never made)")
        if request_id in self._tables:
            raise ValueError(f"commit({reservation_id!r}): request {request_id!r} already holds blocks")
        held = self._reservations[reservation_id]
        adopted = self._reserved_prefix.get(reservation_id, [])
        shared_blocks = sum(len(self._entries[h].blocks) for h in adopted)
        need = self.blocks_for_tokens(num_tokens) - shared_blocks
        if need < 0:
            raise ValueError(
                f"commit({reservation_id!r}): {num_tokens} tokens are fewer than the {shared_blocks} prefix blocks "
                "it adopted hold"
            )
        extra = _ids()
        if need > len(held):
            got = self._take(need - len(held))
            if got is None:
                return None
            extra = got
        del self._reservations[reservation_id]
        self._reserved_prefix.pop(reservation_id, None)
        self._reserved -= len(held)
        blocks = held + extra
        surplus = blocks[need:]
        blocks = blocks[:need]
        surplus.reverse()
        self._free.extend(surplus)
        table = _Table(private=blocks, shared=list(adopted), num_tokens=num_tokens, num_blocks=shared_blocks + need)
        self._tables[request_id] = table
        self._used_private += len(blocks)
        return self.block_table(request_id)

    def release(self, reservation_id: str) -> int:
        """Give a reservation's blocks back (its adopted entries lose a reference). Idempotent; 0 for an unknown
        or already released id. Returns the reservation's own blocks released."""
        blocks = self._reservations.pop(reservation_id, None)
        if blocks is None:
            return 0
        self._reserved -= len(blocks)
        blocks.reverse()  # popped: no longer the reservation's
        self._free.extend(blocks)
        self._unref(self._reserved_prefix.pop(reservation_id, []))
        return len(blocks)

    # ---- prefix cache -------------------------------------------------------------------------------
    @property
    def prefix_hashes(self) -> frozenset[int]:
        """Hash ids of every prefix-cache entry, referenced or evictable (what a load report lists). The same
        frozenset until an entry is inserted or evicted: rebuilt only then, and on its first read after."""
        held = self._prefix_hashes
        if held is None:
            held = self._prefix_hashes = frozenset(self._entries)
        return held

    def _blocks_per_hash(self, hash_block_tokens: int) -> int:
        if hash_block_tokens < 1 or hash_block_tokens % self.block_size_tokens:
            raise ValueError(
                f"prefix hash block of {hash_block_tokens} tokens is not a positive multiple of the "
                f"engine block size {self.block_size_tokens}"
            )
        return hash_block_tokens // self.block_size_tokens

    def match_prefix(
        self, request_id: str, prefix_block_hashes: Sequence[int], hash_block_tokens: int, max_hit_tokens: int
    ) -> PrefixMatch:
        """Share the cached prefix of a request that holds no blocks yet.

        Matches hash blocks from the first while cached and while the hit stays ``<= max_hit_tokens`` (the
        caller passes prompt_tokens - 1 so the last prompt token is always computed). References the
        matched entries (they become used) and records the hit. Without prefix caching, or for a request
        that already has blocks, returns a zero match.
        """
        if not self.enable_prefix_caching or not prefix_block_hashes or request_id in self._tables:
            return PrefixMatch(0, 0)
        per = self._blocks_per_hash(hash_block_tokens)
        self.prefix_queries_tokens_total += max(0, max_hit_tokens)
        matched = self.prefix_matching(prefix_block_hashes, hash_block_tokens, max_hit_tokens)
        if not matched:
            return PrefixMatch(0, 0)
        t = self._tables[request_id] = _Table()
        self._ref(matched)
        t.shared.extend(matched)
        t.num_tokens = len(matched) * hash_block_tokens
        t.num_blocks = len(matched) * per
        self.prefix_hit_tokens_total += t.num_tokens
        return PrefixMatch(hit_tokens=t.num_tokens, hit_blocks=len(matched) * per)

    def prefix_matching(
        self, prefix_block_hashes: Sequence[int], hash_block_tokens: int, max_hit_tokens: int
    ) -> list[int]:
        """The hash ids ``match_prefix`` would share, in order (changes nothing; without prefix caching, [])."""
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        for j, h in enumerate(prefix_block_hashes):
            if (j + 1) * hash_block_tokens > max_hit_tokens or h not in self._entries or h in matched:
                break
            matched.append(h)
        return matched

    def cached_blocks_in(self, hashes: Sequence[int]) -> int:
        """Blocks of the unreferenced (evictable) entries among ``hashes``: what matching them takes out of
        :attr:`available_blocks`."""
        return sum(len(self._entries[h].blocks) for h in hashes if self._entries[h].refs == 0)

    def repeat_unadmitted_lookups(
        self, prefix_block_hashes: Sequence[int], hash_block_tokens: int, max_hit_tokens: int, times: int
    ) -> None:
        """The effects of ``times`` rounds of ``match_prefix`` then ``free`` for a request that holds no
        blocks and is not admitted (a blocked head of the queue, step after step): the lookup counters
        grow, and the matched unreferenced entries move to the most recently used end, in prefix order."""
        if times <= 0 or not self.enable_prefix_caching or not prefix_block_hashes:
            return
        self._blocks_per_hash(hash_block_tokens)
        self.prefix_queries_tokens_total += times * max(0, max_hit_tokens)
        matched = self.prefix_matching(prefix_block_hashes, hash_block_tokens, max_hit_tokens)
        self.prefix_hit_tokens_total += times * len(matched) * hash_block_tokens
        for h in matched:
            if self._entries[h].refs == 0:
                self._lru.move_to_end(h)

    def publish_prefix(
        self,
        request_id: str,
        prefix_block_hashes: Sequence[int],
        hash_block_tokens: int,
        num_computed_tokens: int,
    ) -> int:
        """Offer the request's computed full hash blocks to the cache (shared from now on).

        Hash block ``j`` is published when ``(j+1)·H <= num_computed_tokens``, it directly follows the
        request's shared prefix, and no entry with that id exists (a duplicate stays private). Returns the
        number of hash blocks published.
        """
        t = self._tables.get(request_id)
        if not self.enable_prefix_caching or t is None or not prefix_block_hashes:
            return 0
        per = self._blocks_per_hash(hash_block_tokens)
        published = 0
        while self._publishable(t, prefix_block_hashes, hash_block_tokens, num_computed_tokens, per):
            h = prefix_block_hashes[len(t.shared)]
            blocks = tuple(t.private[:per])
            del t.private[:per]
            self._entries[h] = _Entry(blocks=blocks, refs=1)
            self._prefix_hashes = None
            self.prefix_block_tokens = hash_block_tokens
            self._used_private -= per
            self._used_shared += per
            t.shared.append(h)
            published += 1
        return published

    def _publishable(
        self, t: _Table, prefix_block_hashes: Sequence[int], hash_block_tokens: int, num_computed_tokens: int, per: int
    ) -> bool:
        """Whether ``publish_prefix`` would publish the hash block right after the table's shared prefix."""
        j = len(t.shared)
        return (
            j < len(prefix_block_hashes)
            and (j + 1) * hash_block_tokens <= num_computed_tokens
            and prefix_block_hashes[j] not in self._entries
            and len(t.private) >= per
        )

    def would_publish(
        self, request_id: str, prefix_block_hashes: Sequence[int], hash_block_tokens: int, num_computed_tokens: int
    ) -> bool:
        """Whether ``publish_prefix`` with these arguments would publish anything (changes nothing)."""
        t = self._tables.get(request_id)
        if not self.enable_prefix_caching or t is None or not prefix_block_hashes:
            return False
        per = self._blocks_per_hash(hash_block_tokens)
        return self._publishable(t, prefix_block_hashes, hash_block_tokens, num_computed_tokens, per)

    # ---- checks -------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (for tests and debug runs)."""
        private = [b for t in self._tables.values() for b in t.private]
        reserved = [b for bl in self._reservations.values() for b in bl]
        shared = [b for e in self._entries.values() for b in e.blocks]
        every = private + reserved + shared + list(self._free) + list(range(self._fresh, self.num_blocks))
        assert len(every) == len(set(every)) == self.num_blocks, "a block is lost or in two places"
        assert self._used_private == len(private), "private count drifted"
        assert self._reserved == len(reserved), "reserved count drifted"
        for rid, t in self._tables.items():
            held = len(t.private) + sum(len(self._entries[h].blocks) for h in t.shared)
            assert t.num_blocks == held, f"{rid}: block count {t.num_blocks} != {held} held"
        refs: dict[int, int] = {}
        for holder in [*(t.shared for t in self._tables.values()), *self._reserved_prefix.values()]:
            for h in holder:
                refs[h] = refs.get(h, 0) + 1
        for h, e in self._entries.items():
            assert e.refs == refs.get(h, 0), f"entry {h}: refs {e.refs} != holders {refs.get(h, 0)}"
            assert (e.refs == 0) == (h in self._lru), f"entry {h}: LRU membership wrong"
        used_shared = sum(len(e.blocks) for e in self._entries.values() if e.refs > 0)
        assert self._used_shared == used_shared, "shared count drifted"
        assert self._cached == sum(len(e.blocks) for e in self._entries.values() if e.refs == 0)
        total = self.used_blocks + self.free_blocks + self.reserved_blocks + self.cached_blocks
        assert total == self.num_blocks, f"used+free+reserved+cached = {total} != {self.num_blocks}"
        for rid, t in self._tables.items():
            assert self.blocks_for_tokens(t.num_tokens) <= self.num_blocks_of(rid), f"{rid}: too few blocks"
