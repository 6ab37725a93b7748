"""BlockManager: accounting invariants (hypothesis state machine), reservations, prefix cache."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from llumlet.engine.blocks import MAX_BLOCKS, BlockManager, decode_blocks_taken, decode_rounds_within


def test_allocate_append_and_free_counts() -> None:
    bm = BlockManager(num_blocks=4, block_size_tokens=4)
    assert bm.allocate_slots("a", 5) == (0, 1)  # 5 tokens -> 2 blocks
    assert bm.num_tokens_of("a") == 5
    assert bm.allocate_slots("a", 3) == ()  # slots 6..8 fit in block 1
    assert bm.append_slot("a")  # slot 9 -> block 2
    assert bm.num_blocks_of("a") == 3
    assert bm.allocate_slots("b", 5) is None  # needs 2, only 1 free: nothing changes
    assert not bm.has_request("b")
    assert bm.free_blocks == 1
    assert bm.free("a") == 3
    assert bm.free("a") == 0  # idempotent
    assert bm.free_blocks == 4
    bm.check_invariants()


def test_a_pool_larger_than_its_packed_ids_can_number_is_refused() -> None:
    assert BlockManager(num_blocks=MAX_BLOCKS, block_size_tokens=16).allocate_slots("a", 17) == (0, 1)
    with pytest.raises(ValueError, match=r"num_blocks = 2147483648, at most 2147483647"):
        BlockManager(num_blocks=MAX_BLOCKS + 1, block_size_tokens=16)


def test_freed_blocks_are_handed_out_again_last_given_back_first() -> None:
    bm = BlockManager(num_blocks=8, block_size_tokens=4)
    assert bm.allocate_slots("a", 12) == (0, 1, 2)
    assert bm.reserve("m", 2) and bm.reservation_blocks("m") == (3, 4)
    assert bm.free("a") == 3 and bm.release("m") == 2
    # given back: 2, 1, 0 (a's, its last first), then 4, 3 (m's); handed out from the end, then fresh ones
    assert bm.allocate_slots("b", 28) == (3, 4, 0, 1, 2, 5, 6)
    bm.check_invariants()


def test_reservation_commit_release_idempotent() -> None:
    bm = BlockManager(num_blocks=10, block_size_tokens=16)
    assert bm.release("never") == 0  # safe without reserve
    assert bm.reserve("m1", 4)
    assert not bm.reserve("m1", 1)  # id in use
    assert not bm.reserve("m2", 7)  # 4 + 7 > 10
    assert bm.reserved_blocks == 4 and bm.free_blocks == 6
    # the request grew to 5 blocks (65..80 tokens) since the reservation: one more is taken
    table = bm.commit("m1", "r", 70)
    assert table is not None and len(table) == 5
    assert bm.reserved_blocks == 0 and bm.used_blocks == 5 and bm.free_blocks == 5
    assert bm.release("m1") == 0  # committed: nothing left to release
    with pytest.raises(KeyError, match="m1"):
        bm.commit("m1", "r2", 10)
    assert bm.reserve("m3", 3)
    assert bm.commit("m3", "s", 20) is not None  # needs 2 of 3: surplus back to free
    assert bm.used_blocks == 7 and bm.free_blocks == 3
    assert bm.reserve("m4", 3)
    assert bm.commit("m4", "t", 16 * 4) is None  # needs 4: 1 more does not fit, reservation intact
    assert bm.reserved_for("m4") == 3
    assert bm.release("m4") == 3 and bm.release("m4") == 0
    bm.check_invariants()


def test_prefix_cache_share_publish_evict() -> None:
    bm = BlockManager(num_blocks=8, block_size_tokens=4, enable_prefix_caching=True)
    hashes = (11, 22, 33)  # hash blocks of 8 tokens = 2 engine blocks each
    assert bm.match_prefix("a", hashes, 8, max_hit_tokens=23).hit_tokens == 0  # cold cache
    assert bm.allocate_slots("a", 24) is not None  # 6 blocks
    assert bm.publish_prefix("a", hashes, 8, num_computed_tokens=20) == 2  # blocks 0,1 complete; 2 is not
    assert bm.used_blocks == 6
    m = bm.match_prefix("b", hashes, 8, max_hit_tokens=23)
    assert (m.hit_tokens, m.hit_blocks) == (16, 4)  # shares 2 hash blocks, stops at the unpublished 3rd
    assert bm.used_blocks == 6  # shared blocks counted once
    assert bm.block_table("b")[:4] == bm.block_table("a")[:4]
    assert bm.free("a") == 6
    assert (bm.used_blocks, bm.cached_blocks) == (4, 0)  # still referenced by b
    assert bm.free("b") == 4
    assert (bm.used_blocks, bm.cached_blocks, bm.free_blocks) == (0, 4, 4)
    bm.check_invariants()
    assert bm.allocate_slots("c", 24) is not None  # 6 blocks: 4 free + the LRU entry (11) evicted
    assert bm.cached_blocks == 2 and bm.free_blocks == 0
    assert bm.match_prefix("d", hashes, 8, max_hit_tokens=23).hit_tokens == 0  # chain starts at evicted 11
    bm.check_invariants()


def test_prefix_hashes_are_one_frozenset_until_the_cache_changes() -> None:
    bm = BlockManager(num_blocks=8, block_size_tokens=4, enable_prefix_caching=True)
    assert bm.prefix_hashes == frozenset() and bm.prefix_block_tokens == 0
    assert bm.allocate_slots("a", 24) is not None
    assert bm.publish_prefix("a", (11, 22, 33), 8, num_computed_tokens=24) == 3
    held = bm.prefix_hashes
    assert held == {11, 22, 33} and bm.prefix_block_tokens == 8
    bm.free("a")  # referenced -> cached: the same entries, the same set object
    assert bm.prefix_hashes is held
    assert bm.allocate_slots("c", 12) is not None  # 3 blocks: 2 free + the LRU entry 11 evicted
    assert bm.prefix_hashes == {22, 33}
    assert BlockManager(8, 4).prefix_hashes == frozenset()  # no prefix caching: nothing held


def test_a_reservation_adopts_the_cached_prefix_and_commits_it_shared() -> None:
    # Entries 11, 22 (2 blocks each) cached; an incoming request of 21 tokens with hashes 11, 22, 44.
    bm = BlockManager(num_blocks=12, block_size_tokens=4, enable_prefix_caching=True)
    assert bm.allocate_slots("a", 16) is not None
    bm.publish_prefix("a", (11, 22), 8, num_computed_tokens=16)
    bm.free("a")
    assert (bm.cached_blocks, bm.used_blocks) == (4, 0)
    assert bm.reserve("m", 0)
    assert bm.adopt_prefix("m", (11, 22, 44), 8, max_hit_tokens=20) == 4  # 44 is not cached
    assert (bm.cached_blocks, bm.used_blocks, bm.adopted_blocks("m")) == (0, 4, 4)  # referenced: not evictable
    assert bm.grow_reservation("m", 2)  # the rest: 21 tokens = 6 blocks, 4 of them adopted
    bm.check_invariants()
    with pytest.raises(ValueError, match="adopted a prefix already"):
        bm.adopt_prefix("m", (11,), 8, 20)
    table = bm.commit("m", "r", 21)
    assert table is not None and len(table) == 6
    assert table[:4] == bm.block_table("r")[:4] and bm.num_blocks_of("r") == 6
    assert (bm.used_blocks, bm.reserved_blocks) == (6, 0)  # the prefix counted once, not allocated twice
    bm.check_invariants()
    assert bm.free("r") == 6
    assert bm.cached_blocks == 4  # back in the cache
    # A released reservation gives its adopted entries back too.
    assert bm.reserve("m2", 1)
    assert bm.adopt_prefix("m2", (11,), 8, 8) == 2
    assert bm.release("m2") == 1
    assert (bm.cached_blocks, bm.used_blocks) == (4, 0)
    bm.check_invariants()
    with pytest.raises(KeyError):
        bm.adopt_prefix("gone", (11,), 8, 8)
    assert BlockManager(8, 4).reserve("x", 1)


def test_prefix_hash_block_must_be_multiple_of_block_size() -> None:
    bm = BlockManager(num_blocks=8, block_size_tokens=16, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="multiple"):
        bm.match_prefix("a", (1,), 24, max_hit_tokens=100)


ids = st.sampled_from(["r0", "r1", "r2", "r3"])
res_ids = st.sampled_from(["m0", "m1", "m2"])


class BlockMachine(RuleBasedStateMachine):
    """Random operations never break used + free + reserved + cached == total, and mirror a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size_tokens=4, enable_prefix_caching=True)
        self.tokens: dict[str, int] = {}

    @rule(rid=ids, n=st.integers(0, 30))
    def allocate(self, rid: str, n: int) -> None:
        before = self.bm.available_blocks
        got = self.bm.allocate_slots(rid, n)
        if got is None:
            assert self.bm.available_blocks == before
        else:
            self.tokens[rid] = self.tokens.get(rid, 0) + n
        assert self.bm.num_tokens_of(rid) == self.tokens.get(rid, 0)

    @rule(rid=ids)
    def free(self, rid: str) -> None:
        self.bm.free(rid)
        self.tokens.pop(rid, None)

    @rule(rid=ids, depth=st.integers(1, 3))
    def match(self, rid: str, depth: int) -> None:
        hashes = (1, 2, 3)[:depth]
        if rid not in self.tokens:
            hit = self.bm.match_prefix(rid, hashes, 8, max_hit_tokens=30).hit_tokens
            if hit:
                self.tokens[rid] = hit

    @rule(rid=ids)
    def publish(self, rid: str) -> None:
        self.bm.publish_prefix(rid, (1, 2, 3), 8, self.tokens.get(rid, 0))

    @rule(res=res_ids, n=st.integers(0, 10))
    def reserve(self, res: str, n: int) -> None:
        self.bm.reserve(res, n)

    @rule(res=res_ids)
    def release(self, res: str) -> None:
        self.bm.release(res)
        assert self.bm.release(res) == 0

    @rule(res=res_ids, depth=st.integers(1, 3))
    def adopt(self, res: str, depth: int) -> None:
        with contextlib.suppress(KeyError, ValueError):  # not reserved, or adopted already
            self.bm.adopt_prefix(res, (1, 2, 3)[:depth], 8, max_hit_tokens=24)

    @rule(res=res_ids, rid=st.sampled_from(["x0", "x1"]), n=st.integers(1, 40))
    def commit(self, res: str, rid: str, n: int) -> None:
        if rid in self.tokens:
            return
        try:
            table = self.bm.commit(res, rid, n)
        except KeyError:  # not reserved (or already committed / released)
            return
        except ValueError:  # fewer tokens than the prefix it adopted
            return
        if table is not None:
            self.tokens[rid] = n

    @invariant()
    def accounting(self) -> None:
        self.bm.check_invariants()
        held = sum(self.bm.num_blocks_of(r) for r in self.tokens)
        held += sum(self.bm.adopted_blocks(m) for m in ("m0", "m1", "m2"))  # a reservation's prefix is used
        assert held >= self.bm.used_blocks  # shared blocks count once in used, per holder in held


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["allocate", "free", "decode"]), st.sampled_from(["r0", "r1", "r2"]), st.integers(0, 9)
        ),
        max_size=60,
    )
)
def test_blocks_are_handed_out_as_from_one_list_of_every_free_id(ops: list[tuple[str, str, int]]) -> None:
    """The short free list (blocks given back, then fresh ids on demand) hands out the very blocks, in the very
    order, of the list of every free id it replaced: ``pop()`` from ``[N-1, ..., 1, 0]``, blocks given back
    appended in reverse table order."""
    bm = BlockManager(num_blocks=12, block_size_tokens=2)
    ref = list(range(11, -1, -1))  # the reference free list
    tables: dict[str, list[int]] = {}
    tokens: dict[str, int] = {}
    for op, rid, n in ops:
        if op == "allocate":
            got = bm.allocate_slots(rid, n)
            need = -(-(tokens.get(rid, 0) + n) // 2) - len(tables.get(rid, []))
            if need > len(ref):
                assert got is None
                continue
            expected = tuple(ref.pop() for _ in range(need))
            assert got == expected
            tables.setdefault(rid, []).extend(expected)
            tokens[rid] = tokens.get(rid, 0) + n
        elif op == "free":
            bm.free(rid)
            ref.extend(reversed(tables.pop(rid, [])))
            tokens.pop(rid, None)
        else:  # n rounds of one decode slot for every request holding a table, in one call
            rids = sorted(tables)
            rounds = min(n, bm.decode_rounds_that_fit(rids, n))
            bm.extend_decode_slots(rids, rounds)
            for _ in range(rounds):
                for r in rids:
                    tokens[r] += 1
                    if tokens[r] > 2 * len(tables[r]):
                        tables[r].append(ref.pop())
        assert bm.free_blocks == len(ref)
        for r, table in tables.items():
            assert bm.block_table(r) == tuple(table)
    bm.check_invariants()


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    spare=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    budget=st.integers(0, 40),
    max_rounds=st.integers(0, 90),
)
def test_decode_rounds_in_closed_form_match_rounds_of_append_slot(
    tokens: list[int], spare: list[int], budget: int, max_rounds: int
) -> None:
    """The closed forms a decode run's figures and ``decode_rounds_that_fit`` read (``decode_blocks_taken``,
    ``decode_rounds_within``) against ``append_slot`` round after round, with tables holding spare blocks too
    (a first new-block round past the block size: the search's path)."""
    bs = 4
    bm = BlockManager(num_blocks=1000, block_size_tokens=bs)
    rids = [f"r{i}" for i in range(len(tokens))]
    for rid, n, extra in zip(rids, tokens, spare, strict=False):
        assert bm.allocate_slots(rid, n + extra * bs) is not None  # its blocks, and ``extra`` spare ones
    for rid, n in zip(rids, tokens, strict=True):
        bm._tables[rid].num_tokens = n  # the spare blocks' slots are free again
    firsts = bm.decode_first_rounds(rids)
    assert firsts == sorted(firsts) and len(firsts) == len(rids)
    used = bm.used_blocks
    taken = [0]  # taken[r]: blocks taken by r rounds, round after round
    for _ in range(max_rounds):
        for rid in rids:
            assert bm.append_slot(rid)
        taken.append(bm.used_blocks - used)
    assert [decode_blocks_taken(firsts, bs, r) for r in range(max_rounds + 1)] == taken
    want = max((r for r in range(max_rounds + 1) if taken[r] <= budget), default=-1)
    assert decode_rounds_within(firsts, bs, budget, max_rounds) == want
