"""Decode runs: the engine that applies pure decode steps in runs equals the step-by-step engine.

Two ``EngineCore``s, one with ``decode_runs=True`` (``step()`` takes pure decode steps from a planned run)
and one with ``decode_runs=False`` (every batch formed by ``Scheduler.schedule``), get the same random
operations: requests with shared prefixes, steps, aborts, reservations, suspend / resume / commit of
migrations. After every operation their step results, loads, load versions and internal state (every
request's counters, queues, block tables, free list order, prefix cache and its LRU order) must be
equal. Small caches and budgets make preemption, eviction and head-of-line blocking common.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llumlet.engine import EngineCore, EngineRequest, MigrationState
from llumlet.engine.latency import VECTOR_MIN_STEPS, load_latency_model

LATENCY = load_latency_model("llama-2-7b", "a100", 1)


def make(decode_runs: bool, caching: bool, admission: str, num_blocks: int) -> EngineCore:
    return EngineCore(
        "i0",
        num_blocks=num_blocks,
        block_size_tokens=4,
        latency_model=LATENCY,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        enable_prefix_caching=caching,
        admission=admission,  # type: ignore[arg-type]
        decode_runs=decode_runs,
    )


def state_of(e: EngineCore) -> tuple[Any, ...]:
    """Everything the engine holds, in a comparable form."""
    s, b = e.scheduler, e.blocks
    requests = [
        (
            r.request_id,
            r.status,
            r.num_output_tokens,
            r.num_computed_tokens,
            r.num_preemptions,
            r.recompute_pending,
            r.recompute_tokens_total,
            r.recompute_time_s,
            r.prefix_hit_tokens,
        )
        for r in s.requests.values()
    ]
    tables = {rid: (tuple(t.shared), tuple(t.private), t.num_tokens, t.num_blocks) for rid, t in b._tables.items()}
    entries = {h: (x.blocks, x.refs) for h, x in b._entries.items()}
    stats = {rid: repr(x) for rid, x in e.stats.items()}
    return (
        requests,
        [r.request_id for r in s.waiting],
        [r.request_id for r in s.running],
        sorted(e._suspended),
        (list(b._free), b._fresh),
        tables,
        dict(b._reservations),
        entries,
        list(b._lru),
        (b.prefix_hit_tokens_total, b.prefix_queries_tokens_total, s.num_preemptions_total),
        stats,
    )


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "step", "step", "abort", "reserve", "release", "move"]),
        st.integers(0, 10_000),
    ),
    min_size=40,
    max_size=150,
)


def apply(e: EngineCore, op: str, x: int, n_added: int, moved: dict[str, MigrationState]) -> object:
    """One operation; returns what it returned (compared between the two engines)."""
    if op == "add":
        prompt, output = 1 + x % 37, 1 + (x // 37) % 29
        hashes = tuple((x >> k) % 3 for k in range(prompt // 8))  # few distinct chains: much sharing
        req = EngineRequest(
            f"r{n_added}",
            prompt,
            output,
            priority=x % 2,
            arrival_s=float(n_added),
            prefix_block_hashes=hashes,
            prefix_hash_block_tokens=8 if hashes else 0,
        )
        try:
            e.add_request(req)
        except ValueError as exc:
            return str(exc)
        return None
    if op == "step":
        return e.step() if e.has_work() else None
    rid = f"r{x % max(1, n_added)}"
    if op == "abort":
        return e.abort(rid)
    if op == "reserve":
        return e.reserve(f"m{x}", x % 9)
    if op == "release":
        return e.release_reservation(f"m{x}")
    # "move": suspend a request and either resume it or commit it back as a migrated-in request
    state = e.suspend(rid)
    if state is None:
        return None
    if x % 2:
        return (state, e.resume(rid))
    freed = e.free_migrated(rid)
    ok = e.reserve(f"in-{rid}", 0) and e.commit_incoming(f"in-{rid}", state)
    e.release_reservation(f"in-{rid}")
    moved[rid] = state
    return (state, freed, ok)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    caching=st.booleans(),
    admission=st.sampled_from(["chunked", "whole-prompt"]),
    num_blocks=st.integers(12, 60),
)
def test_decode_runs_equal_step_by_step(
    ops: list[tuple[str, int]], caching: bool, admission: str, num_blocks: int
) -> None:
    fast, ref = make(True, caching, admission, num_blocks), make(False, caching, admission, num_blocks)
    added = 0
    moved_fast: dict[str, MigrationState] = {}
    moved_ref: dict[str, MigrationState] = {}
    for op, x in ops:
        # a run of steps in a row is where runs form: repeat each step a few times
        for _ in range(1 + (x % 7 if op == "step" else 0)):
            out_fast = apply(fast, op, x, added, moved_fast)
            out_ref = apply(ref, op, x, added, moved_ref)
            assert out_fast == out_ref, (op, x)
            assert state_of(fast) == state_of(ref), (op, x)
            assert fast.load() == ref.load()
            assert fast.instance_load("i0", "d0", True) == ref.load().to_instance_load("i0", "d0", True)
            fast.blocks.check_invariants()
        added += op == "add"


def test_runs_are_used_and_cut_by_a_change_from_outside() -> None:
    e = make(True, False, "chunked", 200)
    for i in range(3):
        e.add_request(EngineRequest(f"r{i}", prompt_tokens=6, max_tokens=20, arrival_s=float(i)))
    first = e.step()  # all three prefill
    assert first.num_prefill_tokens == 18
    run = e.start_decode_run(100)
    assert run is not None and run.request_ids == ("r0", "r1", "r2")
    assert run.steps == 19 and run.applied == 1  # 19 more tokens each: r0..r2 finish together at the last step
    e.advance_decode_run(5)
    assert [s.num_output_tokens for s in e.scheduler.running] == [6, 6, 6]
    with pytest.raises(RuntimeError, match="in progress"):  # advance it or cut it first
        e.start_decode_run(3)
    seen: list[int] = []
    e.cut_decode_run()
    assert run.steps == 5 and run.done
    run3 = e.start_decode_run(10, on_interrupt=lambda r: seen.append(r.applied))
    assert run3 is not None and run3.steps == 10
    e.add_request(EngineRequest("late", prompt_tokens=4, max_tokens=2, arrival_s=9.0))  # a change from outside
    assert seen == [1] and run3.steps == 1 and run3.done
    nxt = e.step()  # the next step admits "late": a mixed step, formed by the scheduler
    assert nxt.num_prefill_tokens == 4 and nxt.num_decode_tokens == 3


def test_a_run_ends_at_the_first_finish_and_before_a_block_the_free_list_lacks() -> None:
    e = make(True, False, "chunked", 10)  # 10 blocks of 4 tokens
    e.add_request(EngineRequest("a", prompt_tokens=4, max_tokens=20, arrival_s=0.0))
    e.add_request(EngineRequest("b", prompt_tokens=4, max_tokens=3, arrival_s=1.0))
    e.add_request(EngineRequest("c", prompt_tokens=4, max_tokens=20, arrival_s=2.0))
    e.step()  # all prefill: 4 slots in 1 block each, first tokens; 7 blocks free
    run = e.start_decode_run(100)
    assert run is not None and run.steps == 2  # b produces its 2 remaining tokens and finishes
    e.advance_decode_run(2)
    assert run.finished == ("b",) and "b" in e.stats and e.blocks.free_blocks == 6
    run = e.start_decode_run(100)
    # a and c hold 6 slots in 2 blocks each and need a block at slots 9, 13, 17 (rounds 3, 7, 11): the 6 free
    # blocks last 14 rounds, round 15 would need a 7th (that step may preempt, it is not in the run)
    assert run is not None and run.steps == 14
    assert e.blocks.decode_rounds_that_fit(["a", "c"], 100) == 13  # the run's first step is applied already
    e.advance_decode_run(14)
    assert e.blocks.free_blocks == 0 and e.start_decode_run(100) is None
    assert e.step().preempted == ("c",)  # the step-by-step scheduler takes over: c, the latest, is preempted


@pytest.mark.parametrize("num_steps", [5, VECTOR_MIN_STEPS - 1, VECTOR_MIN_STEPS, 700])
def test_decode_step_times_equal_step_time_bit_for_bit(num_steps: int) -> None:
    """Short runs one float at a time, long ones by numpy (``VECTOR_MIN_STEPS``): both the per-step formula."""
    for num_seqs, first_kv in ((1, 1), (7, 900), (64, 40_000), (255, 500_000)):
        times = LATENCY.decode_step_times_s(num_seqs, first_kv, num_steps)
        closed_form = LATENCY.decode_step_times(num_seqs, first_kv)
        assert len(times) == num_steps and times.typecode == "d"
        for j, t in enumerate(times):
            contexts = [first_kv // num_seqs + j] * (num_seqs - 1)
            contexts.append(first_kv + j * num_seqs - sum(contexts))
            assert t == LATENCY.step_time_s([], contexts) == closed_form.step_s(j)
    with pytest.raises(ValueError, match="first_kv_tokens >= num_seqs"):
        LATENCY.decode_step_times_s(4, 3, 1)
    with pytest.raises(ValueError, match="need num_steps >= 0"):
        LATENCY.decode_step_times_s(4, 8, -1)


def test_a_load_ahead_of_the_applied_steps_is_the_load_once_they_are_applied() -> None:
    e = make(True, False, "whole-prompt", 40)
    for i in range(3):
        e.add_request(EngineRequest(f"r{i}", prompt_tokens=3 + 2 * i, max_tokens=12 + i, arrival_s=float(i)))
    e.add_request(EngineRequest("w", prompt_tokens=150, max_tokens=1, arrival_s=9.0))  # 38 blocks: waits
    e.step()
    run = e.start_decode_run(100)
    assert run is not None and run.steps == 11  # r0 has 11 tokens left
    base = run.applied
    ahead = [e.instance_load("i0", "d0", steps_ahead=k) for k in range(run.steps - base)]
    used_ahead = [e.decode_run_used_blocks(base + k) for k in range(run.steps - base)]
    applied, used_applied = [], []
    for k in range(run.steps - base):
        e.advance_decode_run(base + k)
        applied.append(e.instance_load("i0", "d0"))
        used_applied.append(e.blocks.used_blocks)
    assert ahead == applied and ahead[3].num_waiting == 1
    assert used_ahead == used_applied and used_applied[-1] > used_applied[0]  # the runs' blocks grow
    with pytest.raises(ValueError, match="steps_ahead=1"):  # the last step (r0 finishes) must be applied
        e.instance_load("i0", "d0", steps_ahead=1)
    with pytest.raises(ValueError, match=r"decode_run_used_blocks\(11\)"):  # nor is it read ahead here
        e.decode_run_used_blocks(run.steps)
    with pytest.raises(ValueError, match=r"decode_run_used_blocks\(9\)"):  # nor before the applied steps
        e.decode_run_used_blocks(run.applied - 1)


def test_a_brief_load_of_a_run_is_the_detailed_one_as_counts() -> None:
    """Brief reports in a run come from figures taken once per run (blocks by round); every one, read ahead
    or after the steps are applied, has the aggregates of the detailed report of that state."""
    e = make(True, False, "whole-prompt", 40)
    for i in range(3):
        e.add_request(EngineRequest(f"r{i}", prompt_tokens=3 + 5 * i, max_tokens=30 + i, priority=i % 2))
    e.add_request(EngineRequest("w", prompt_tokens=150, max_tokens=1, arrival_s=9.0))  # 38 blocks: waits
    e.step()
    run = e.start_decode_run(100)
    assert run is not None and run.steps > 16  # long enough for every request to take a block in it
    base = run.applied

    def counts(load: Any) -> tuple[object, ...]:
        return (load.used_blocks, load.num_running, load.priority_counts, load.num_waiting, load.head_demand_blocks,
                load.queued_demand_blocks, load.preempting)  # fmt: skip

    ahead = [counts(e.instance_load("i0", "d0", steps_ahead=k, brief=True)) for k in range(run.steps - base)]
    for k in range(run.steps - base):
        e.advance_decode_run(base + k)
        brief = e.instance_load("i0", "d0", brief=True)
        assert brief.brief and counts(brief) == ahead[k] == counts(e.instance_load("i0", "d0")), k
        later = [counts(e.instance_load("i0", "d0", steps_ahead=j, brief=True)) for j in range(run.steps - base - k)]
        assert later == ahead[k:]
    assert ahead[-1][0] > ahead[0][0] + 2 and ahead[0][2] == ((1, 1),)
    e.advance_decode_run(run.steps)  # the last step: r0 finishes, the figures are the state's again
    assert counts(e.instance_load("i0", "d0", brief=True)) == counts(e.instance_load("i0", "d0"))
    assert e.instance_load("i0", "d0", brief=True).num_running == 2


def test_the_steps_within_some_blocks_are_those_whose_load_holds_at_most_that_many_more() -> None:
    """``decode_run_steps_within(steps, extra)``: the last step of the run (before the finishing one) whose
    brief load holds at most ``extra`` blocks more than after ``steps``, checked against the loads themselves."""
    e = make(True, False, "whole-prompt", 40)
    for i in range(3):
        e.add_request(EngineRequest(f"r{i}", prompt_tokens=3 + 5 * i, max_tokens=30 + i))
    e.step()
    run = e.start_decode_run(100)
    assert run is not None and run.steps > 16
    base = run.applied
    used = [e.instance_load("i0", "d0", steps_ahead=k, brief=True).used_blocks for k in range(run.steps - base)]
    for start in range(base, run.steps - 1, 3):
        for extra in range(4):
            want = max(k for k in range(len(used)) if used[k] <= used[start - base] + extra and k >= start - base)
            assert e.decode_run_steps_within(start, extra) == base + want, (start, extra)
    assert e.decode_run_steps_within(base, 0) < run.steps - 1  # the batch does take blocks in the run
    assert e.decode_run_steps_within(base, 100) == run.steps - 1  # never the last step
    e.advance_decode_run(run.steps)
    assert e.decode_run_steps_within(run.steps, 0) == run.steps  # no run with steps left: the steps given


def test_load_version_moves_exactly_when_the_load_changes() -> None:
    e = make(True, True, "chunked", 30)
    seen = [(e.load_version, e.load())]

    def check(changed: bool) -> None:
        version, load = e.load_version, e.load()
        assert (version != seen[-1][0]) == changed == (load != seen[-1][1])
        seen.append((version, load))

    e.add_request(EngineRequest("a", prompt_tokens=8, max_tokens=6))
    check(True)
    assert not e.reserve("big", 1000)  # refused: nothing changes
    check(False)
    assert e.release_reservation("never") == 0
    check(False)
    e.step()
    check(True)
    assert e.load() is e.load()  # cached between changes
    assert e.reserve("m", 2)
    check(True)
    assert e.grow_reservation("m", 2)  # already that large
    check(False)
    assert e.abort("a")
    check(True)
    assert not e.has_work()


def test_a_brief_load_is_the_detailed_one_field_by_field() -> None:
    """The brief report is built apart from the detailed one (``EngineCore._brief_load``): every field but the list
    of running requests must be the detailed report's, by name, in a state that sets each of them (a reservation, a
    waiting request, priorities, a cached prefix, flags and a step time), during a run, read ahead or not."""
    e = EngineCore("i0", 120, 16, LATENCY, max_num_seqs=5, enable_prefix_caching=True)
    e.add_request(EngineRequest("a", 1100, 40, priority=1, prefix_block_hashes=(1, 2, 3), prefix_hash_block_tokens=512))
    e.add_request(EngineRequest("b", 40, 30, priority=2))
    e.add_request(EngineRequest("w", 900, 3, arrival_s=9.0))  # 57 blocks: 46 are left, it waits
    e.add_request(EngineRequest("x", 200, 3, arrival_s=9.5))  # behind it
    assert e.reserve("m", 2)
    e.step()  # a and b prefilled
    run = e.start_decode_run(50)
    assert run is not None and run.steps > 3
    for ahead in (0, 1, 2):
        flags = {"draining": ahead == 1, "warming_up": ahead == 2, "decode_step_s": 0.02 + ahead}
        brief = e.instance_load("i1", "d7", steps_ahead=ahead, brief=True, **flags)  # type: ignore[arg-type]
        detailed = e.instance_load("i1", "d7", steps_ahead=ahead, **flags)  # type: ignore[arg-type]
        assert brief == dataclasses.replace(detailed, running=(), brief=True), ahead
        assert brief.num_waiting == 2 and 0 < brief.head_demand_blocks < brief.queued_demand_blocks
        assert brief.priority_counts == ((1, 1), (2, 1)) and brief.preempting is False
        assert brief.prefix_hashes == {1, 2} and brief.prefix_block_tokens == 512 and brief.max_num_seqs == 5
        assert brief.used_blocks == detailed.used_blocks > sum(r.blocks for r in detailed.running) + 1  # + reserved
