"""The engine protocol's contract, one suite for every backend (``EngineCore`` model engine, ``TorchEngine``).

Each test takes ``make`` (instance id, num_blocks) -> Engine and checks only what ``llumlet.engine.protocol``
promises: accounting through ``load()``, step results, abort, reservations, block reads/writes and their
errors, suspend/resume, commit, free_migrated, and block counts back at baseline after every path.
Backend-specific behaviour (real tokens, payload bytes) is tested in the backends' own files.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llumlet.engine import (
    Engine,
    EngineCore,
    EngineRequest,
    KVPayload,
    MigrationState,
    RequestTooLargeError,
    StepResult,
    load_latency_model,
)
from llumlet.engine.torch_engine import TorchEngine

BLOCK = 4  # tokens per block in every backend here
MakeEngine = Callable[[str, int], Engine]


def _sim(instance_id: str, num_blocks: int) -> Engine:
    return EngineCore(
        instance_id, num_blocks, BLOCK, load_latency_model("llama-2-7b", "a100", 1), kv_bytes_per_block=BLOCK * 524_288
    )


def _torch(instance_id: str, num_blocks: int) -> Engine:
    return TorchEngine(instance_id, num_blocks, BLOCK, eos_token_id=None)  # no EOS: exactly max_tokens, as the model


@pytest.fixture(params=["sim", "torch"])
def make(request: pytest.FixtureRequest) -> MakeEngine:
    return _sim if request.param == "sim" else _torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def req(rid: str, prompt_tokens: int, max_tokens: int, arrival_s: float = 0.0, priority: int = 0) -> EngineRequest:
    rng = random.Random(rid)
    ids = tuple(rng.randrange(3, 512) for _ in range(prompt_tokens))
    return EngineRequest(rid, prompt_tokens, max_tokens, priority=priority, arrival_s=arrival_s, prompt_token_ids=ids)


def assert_consistent(engine: Engine) -> None:
    load = engine.load()
    assert load.free_blocks >= 0 and load.reserved_blocks >= 0
    running_blocks = sum(r.blocks for r in load.running)
    if load.num_suspended:
        assert load.used_blocks >= running_blocks
    else:
        assert load.used_blocks == running_blocks


def assert_baseline(engine: Engine) -> None:
    load = engine.load()
    assert (load.used_blocks, load.reserved_blocks, load.num_suspended, load.num_waiting) == (0, 0, 0, 0)
    assert load.running == () and load.free_blocks == load.total_blocks
    assert not engine.has_work()


def produced(result: StepResult) -> dict[str, int]:
    """Tokens per request in a step; a real engine's token ids agree with the counts."""
    if result.token_ids:
        assert {rid: len(ids) for rid, ids in result.token_ids.items()} == {
            rid: n for rid, n in result.new_tokens.items() if n
        }
    return {rid: n for rid, n in result.new_tokens.items() if n}


def run_until_idle(engine: Engine, counts: dict[str, int], max_steps: int = 500) -> list[tuple[str, ...]]:
    finished: list[tuple[str, ...]] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return finished
        result = engine.step()
        for rid, n in produced(result).items():
            counts[rid] = counts.get(rid, 0) + n
        finished.append(result.finished)
        assert_consistent(engine)
    raise AssertionError("did not finish")


def decode_steps(engine: Engine, n: int, counts: dict[str, int]) -> None:
    for _ in range(n):
        for rid, k in produced(engine.step()).items():
            counts[rid] = counts.get(rid, 0) + k


# ---- sizes, requests, steps ------------------------------------------------------------------------


def test_sizes(make: MakeEngine) -> None:
    engine = make("a", 8)
    assert engine.instance_id == "a"
    assert engine.block_size_tokens == BLOCK
    assert engine.kv_bytes_per_block > 0
    load = engine.load()
    assert (load.total_blocks, load.free_blocks) == (8, 8)


def test_steps_count_tokens_blocks_and_finish_each_request_once(make: MakeEngine) -> None:
    engine = make("a", 32)
    engine.add_request(req("r1", 10, 6, arrival_s=0.0))
    engine.add_request(req("r2", 5, 3, arrival_s=1.0))
    engine.add_request(req("r3", 13, 4, arrival_s=2.0, priority=1))
    assert engine.has_work() and engine.load().num_waiting == 3
    first = engine.step()  # all three prefill in one step; each produces its first token
    assert produced(first) == {"r1": 1, "r2": 1, "r3": 1}
    assert (first.num_prefill_tokens, first.num_decode_tokens, first.num_scheduled_seqs) == (28, 0, 3)
    assert first.duration_s > 0 and first.finished == () and first.preempted == ()
    load = engine.load()
    assert load.used_blocks == 3 + 2 + 4  # ceil(10/4) + ceil(5/4) + ceil(13/4)
    assert [(r.request_id, r.blocks, r.num_tokens, r.in_decode, r.priority) for r in load.running] == [
        ("r1", 3, 11, True, 0),
        ("r2", 2, 6, True, 0),
        ("r3", 4, 14, True, 1),
    ]
    counts = dict(produced(first))
    finished = run_until_idle(engine, counts)
    assert finished == [(), ("r2",), ("r3",), (), ("r1",)]  # steps 2..6
    assert counts == {"r1": 6, "r2": 3, "r3": 4}
    idle = engine.step()
    assert idle.is_idle and idle.duration_s == 0.0 and idle.new_tokens == {}
    assert_baseline(engine)


def test_queue_head_demand_and_admission_after_a_finish(make: MakeEngine) -> None:
    engine = make("a", 6)
    engine.add_request(req("big", 16, 2))  # 4 blocks, then 5 at 17 tokens
    engine.add_request(req("next", 12, 2, arrival_s=1.0))  # 3 blocks: does not fit beside it
    engine.step()
    load = engine.load()
    assert (load.used_blocks, load.num_waiting, load.head_demand_blocks) == (4, 1, 3)
    counts: dict[str, int] = {}
    run_until_idle(engine, counts)
    assert counts == {"big": 1, "next": 2}  # + big's first token from the first step
    assert_baseline(engine)


def test_add_request_errors(make: MakeEngine) -> None:
    engine = make("a", 4)  # 16 token slots
    with pytest.raises(RequestTooLargeError):
        engine.add_request(req("huge", 12, 6))  # 17 KV tokens
    engine.add_request(req("r", 12, 5))
    with pytest.raises(ValueError, match="already in this engine"):
        engine.add_request(req("r", 12, 5))
    assert engine.abort("r")
    assert_baseline(engine)


def test_abort_wherever_the_request_is(make: MakeEngine) -> None:
    engine = make("a", 8)
    engine.add_request(req("run", 8, 5))
    engine.add_request(req("susp", 4, 5, arrival_s=1.0))
    engine.add_request(req("wait", 24, 5, arrival_s=2.0))  # 6 blocks: only 5 left after the first two
    engine.step()
    assert engine.load().num_waiting == 1
    assert engine.suspend("susp") is not None
    assert engine.abort("wait") and engine.abort("susp") and engine.abort("run")
    assert not engine.abort("run") and not engine.abort("never")
    assert engine.request_kv("run") is None
    assert_baseline(engine)


# ---- source side -----------------------------------------------------------------------------------


def test_request_kv_and_migratable(make: MakeEngine) -> None:
    engine = make("a", 16)
    assert engine.request_kv("r") is None
    assert engine.migratable("r") is not None
    engine.add_request(req("r", 10, 5))
    assert engine.request_kv("r") == (0, 0)
    reason = engine.migratable("r")
    assert reason is not None and "waiting" in reason
    engine.step()
    assert engine.request_kv("r") == (10, 3)
    assert engine.migratable("r") is None
    engine.step()
    assert engine.request_kv("r") == (11, 3)
    assert engine.abort("r")


def test_read_blocks_bounds(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 10, 5))
    engine.step()
    payload = engine.read_blocks("r", 1, 2)
    assert (payload.first_block, payload.num_blocks, payload.nbytes) == (1, 2, 2 * engine.kv_bytes_per_block)
    assert engine.read_blocks("r", 3, 0).num_blocks == 0
    with pytest.raises(IndexError, match="holds 3 blocks"):
        engine.read_blocks("r", 2, 2)
    with pytest.raises(IndexError):
        engine.read_blocks("r", -1, 1)
    with pytest.raises(KeyError, match="unknown request"):
        engine.read_blocks("nope", 0, 1)
    assert engine.abort("r")
    assert_baseline(engine)


def test_begin_read_copies_without_the_lock_and_detects_preemption(make: MakeEngine) -> None:
    engine = make("a", 6)  # two 10-token prompts fill the pool: the first to grow preempts the other
    engine.add_request(req("r1", 10, 8, arrival_s=0.0))
    engine.add_request(req("r2", 10, 8, arrival_s=1.0))
    engine.step()
    run = engine.begin_read("r2", 0, 2)
    assert (run.first_block, run.num_blocks, run.request_id) == (0, 2, "r2")
    before = run.copy(0, 2)
    assert before == engine.read_blocks("r2", 0, 2)
    assert run.copy(1, 1) == engine.read_blocks("r2", 1, 1)  # a sub-run
    with pytest.raises(IndexError, match="outside the run"):
        run.copy(1, 2)
    assert run.still_valid()
    preempted: list[str] = []
    for _ in range(10):
        preempted += engine.step().preempted
        if preempted:
            break
    assert preempted == ["r2"]
    assert not run.still_valid()  # its blocks were freed: whatever was copied must be discarded
    with pytest.raises(KeyError, match="unknown request"):
        engine.begin_read("nope", 0, 1)
    assert engine.abort("r1") and engine.abort("r2")
    assert_baseline(engine)


def test_suspend_and_resume(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 10, 6, priority=2, arrival_s=5.0))
    assert engine.suspend("r") is None  # queued
    counts: dict[str, int] = {}
    decode_steps(engine, 3, counts)
    state = engine.suspend("r")
    assert state is not None and isinstance(state, MigrationState)
    assert (state.num_output_tokens, state.num_computed_tokens, state.remaining_tokens) == (3, 12, 3)
    assert (state.prompt_tokens, state.max_tokens, state.priority, state.arrival_s) == (10, 6, 2, 5.0)
    assert engine.suspend("r") is None  # already suspended
    assert not engine.has_work()  # suspended alone is not work
    assert engine.step().new_tokens == {}
    load = engine.load()
    assert (load.num_suspended, load.used_blocks, load.running) == (1, 3, ())
    assert engine.request_kv("r") == (12, 3)
    assert engine.free_migrated("other") == 0
    assert engine.resume("r") and not engine.resume("r")
    run_until_idle(engine, counts)
    assert counts == {"r": 6}
    assert_baseline(engine)


def test_free_migrated_only_frees_suspended_requests(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 10, 6))
    engine.step()
    assert engine.free_migrated("r") == 0  # running, not suspended: untouched
    assert engine.load().used_blocks == 3
    assert engine.suspend("r") is not None
    assert engine.free_migrated("r") == 3 and engine.free_migrated("r") == 0
    assert engine.request_kv("r") is None
    assert_baseline(engine)


# ---- destination side ------------------------------------------------------------------------------


def test_reservations_are_idempotent_and_bounded(make: MakeEngine) -> None:
    engine = make("a", 8)
    assert engine.reserve("x", 3)
    assert not engine.reserve("x", 1)  # id in use
    assert not engine.reserve("y", 6)  # 5 free
    assert engine.reserve("y", 5)
    load = engine.load()
    assert (load.reserved_blocks, load.free_blocks, load.used_blocks) == (8, 0, 0)
    assert engine.release_reservation("x") == 3 and engine.release_reservation("x") == 0
    assert engine.release_reservation("never") == 0
    assert engine.release_reservation("y") == 5
    assert_baseline(engine)


def test_write_blocks_bounds(make: MakeEngine) -> None:
    src, dst = make("src", 16), make("dst", 16)
    src.add_request(req("r", 10, 5))
    src.step()
    payload = src.read_blocks("r", 0, 3)
    assert dst.reserve("m", 3)
    dst.write_blocks("m", payload)
    with pytest.raises(IndexError, match="exceed reservation"):
        dst.write_blocks("m", KVPayload(2, 2, 2 * src.kv_bytes_per_block, src.read_blocks("r", 1, 2).data))
    with pytest.raises(KeyError, match="unknown reservation"):
        dst.write_blocks("other", payload)
    assert dst.release_reservation("m") == 3
    with pytest.raises(KeyError, match="unknown reservation"):
        dst.write_blocks("m", payload)  # released
    assert src.abort("r")
    assert_baseline(src)
    assert_baseline(dst)


def migrate(src: Engine, dst: Engine, rid: str, reservation_id: str, counts: dict[str, int]) -> MigrationState:
    """reserve -> stage 0 (full blocks) -> one decode -> suspend -> copy the rest -> commit -> free."""
    tokens, blocks = src.request_kv(rid) or (0, 0)
    assert dst.reserve(reservation_id, blocks + 1)
    full = tokens // src.block_size_tokens
    dst.write_blocks(reservation_id, src.read_blocks(rid, 0, full))
    decode_steps(src, 1, counts)
    state = src.suspend(rid)
    assert state is not None
    _tokens, blocks = src.request_kv(rid) or (0, 0)
    dst.write_blocks(reservation_id, src.read_blocks(rid, full, blocks - full))
    assert dst.commit_incoming(reservation_id, state)
    assert src.free_migrated(rid) == blocks
    return state


def test_migration_commit_moves_the_request_once(make: MakeEngine) -> None:
    src, dst = make("src", 16), make("dst", 16)
    src.add_request(req("r", 10, 8, priority=1, arrival_s=2.0))
    counts: dict[str, int] = {}
    decode_steps(src, 2, counts)
    state = migrate(src, dst, "r", "m1", counts)
    assert counts == {"r": 3}
    assert_baseline(src)
    assert dst.release_reservation("m1") == 0  # committed: release is a no-op
    with pytest.raises(ValueError, match="already"):
        dst.commit_incoming("m1", state)  # committed twice: the request is already here
    load = dst.load()
    assert [(r.request_id, r.in_decode, r.priority, r.blocks) for r in load.running] == [("r", True, 1, 3)]
    assert (load.used_blocks, load.reserved_blocks) == (3, 0)  # 12 KV tokens: the surplus block returned
    assert dst.request_kv("r") == (12, 3)
    run_until_idle(dst, counts)
    assert counts == {"r": 8}
    assert_baseline(dst)


def test_commit_errors_leave_everything_unchanged(make: MakeEngine) -> None:
    src, dst = make("src", 16), make("dst", 16)
    src.add_request(req("r", 10, 8))
    dst.add_request(req("r", 6, 2))  # a different request with the same id already on dst
    decode_steps(src, 2, {})
    decode_steps(dst, 1, {})
    assert dst.reserve("m", 4)
    dst.write_blocks("m", src.read_blocks("r", 0, 3))
    state = src.suspend("r")
    assert state is not None
    with pytest.raises(ValueError, match="already"):
        dst.commit_incoming("m", state)
    assert dst.abort("r")
    with pytest.raises(KeyError):
        dst.commit_incoming("nope", state)
    prefill_state = MigrationState(
        request_id="r",
        prompt_tokens=10,
        num_output_tokens=1,
        num_computed_tokens=5,
        max_tokens=8,
        priority=0,
        arrival_s=0.0,
        prompt_token_ids=state.prompt_token_ids,
        output_token_ids=state.output_token_ids[:1],
        sampling_params=state.sampling_params,
        extra=state.extra,
    )
    with pytest.raises(ValueError, match="not in decode phase"):
        dst.commit_incoming("m", prefill_state)
    assert dst.load().reserved_blocks == 4 and dst.load().used_blocks == 0
    # the migration is abandoned: the source resumes, the destination releases
    assert src.resume("r")
    assert dst.release_reservation("m") == 4
    counts: dict[str, int] = {}
    run_until_idle(src, counts)
    assert counts == {"r": 6}
    assert_baseline(src)
    assert_baseline(dst)


def test_request_finishing_during_precopy_is_simply_finished(make: MakeEngine) -> None:
    src, dst = make("src", 16), make("dst", 16)
    src.add_request(req("r", 10, 3))
    src.step()
    assert dst.reserve("m", 3)
    dst.write_blocks("m", src.read_blocks("r", 0, 2))
    counts: dict[str, int] = {}
    run_until_idle(src, counts)
    assert counts == {"r": 2}
    assert src.suspend("r") is None and src.request_kv("r") is None
    with pytest.raises(KeyError):
        src.read_blocks("r", 0, 1)
    assert dst.release_reservation("m") == 3
    assert_baseline(src)
    assert_baseline(dst)


def test_migrate_back_and_forth(make: MakeEngine) -> None:
    a, b = make("a", 16), make("b", 16)
    a.add_request(req("r", 9, 12))
    b.add_request(req("other", 5, 12))
    counts: dict[str, int] = {}
    decode_steps(a, 2, counts)
    migrate(a, b, "r", "m1", counts)
    decode_steps(b, 3, counts)
    migrate(b, a, "r", "m2", counts)
    run_until_idle(a, counts)
    run_until_idle(b, counts)
    assert counts == {"r": 12, "other": 12}
    assert_baseline(a)
    assert_baseline(b)


# ---- any sequence of operations keeps the accounting whole -----------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "abort", "reserve", "release", "suspend", "resume", "free"]),
        st.integers(0, 3),
        st.integers(1, 9),
    ),
    max_size=25,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_any_operation_sequence_returns_to_baseline(make: MakeEngine, ops: list[tuple[str, int, int]]) -> None:
    engine = make("a", 12)
    added: set[str] = set()
    reservations: set[str] = set()
    for op, k, n in ops:
        rid, res = f"r{k}", f"m{k}"
        if op == "add" and rid not in added:
            engine.add_request(req(rid, n, 1 + n % 4, arrival_s=float(len(added))))
            added.add(rid)
        elif op == "step":
            engine.step()
        elif op == "abort":
            engine.abort(rid)
        elif op == "reserve" and engine.reserve(res, n % 4):
            reservations.add(res)
        elif op == "release":
            engine.release_reservation(res)
        elif op == "suspend":
            engine.suspend(rid)
        elif op == "resume":
            engine.resume(rid)
        elif op == "free":
            engine.free_migrated(rid)
        assert_consistent(engine)
    for rid in added:
        engine.abort(rid)
    for res in reservations:
        engine.release_reservation(res)
    assert_baseline(engine)
