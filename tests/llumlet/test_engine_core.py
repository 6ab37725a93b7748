"""EngineCore / Scheduler: chunked prefill, TTFT and decode step counts, preemption by recompute."""

from __future__ import annotations

import random

import pytest

from llumlet.engine import EngineCore, EngineRequest, LatencyModel, RequestTooLargeError, StepResult
from llumlet.engine.scheduler import Admission, SchedulingPolicy


def flat_model(step_ms: float = 10.0) -> LatencyModel:
    """Every non-empty step takes step_ms."""
    return LatencyModel(
        model="flat",
        gpu="none",
        tensor_parallel_size=1,
        token_knots=(1, 2),
        token_ms=(0.0, 0.0),
        prefill_attn_fixed_ms=0.0,
        prefill_attn_ms_per_work=0.0,
        prefill_attn_ms_per_token=0.0,
        decode_attn_fixed_ms=0.0,
        decode_attn_ms_per_kv_token=0.0,
        step_overhead_ms=step_ms,
    )


def engine(
    num_blocks: int = 100,
    block: int = 4,
    budget: int = 8192,
    seqs: int = 256,
    admission: Admission = "chunked",
    scheduling: SchedulingPolicy = "priority",
) -> EngineCore:
    return EngineCore(
        "i0",
        num_blocks=num_blocks,
        block_size_tokens=block,
        latency_model=flat_model(),
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        admission=admission,
        scheduling=scheduling,
    )


def run(e: EngineCore, max_steps: int = 1000) -> list[StepResult]:
    out: list[StepResult] = []
    while e.has_work() and len(out) < max_steps:
        out.append(e.step())
        e.blocks.check_invariants()
    return out


def test_chunked_prefill_ttft_and_decode_steps() -> None:
    e = engine(budget=4)
    e.add_request(EngineRequest("a", prompt_tokens=10, max_tokens=3))
    steps = run(e)
    # prefill 4 + 4 + 2 tokens (first token at the end of the last chunk), then 2 decodes
    assert [s.num_prefill_tokens for s in steps] == [4, 4, 2, 0, 0]
    assert [s.num_decode_tokens for s in steps] == [0, 0, 0, 1, 1]
    assert [s.new_tokens["a"] for s in steps] == [0, 0, 1, 1, 1]
    assert [s.finished for s in steps] == [(), (), (), (), ("a",)]
    assert sum(s.duration_s for s in steps[:3]) == pytest.approx(0.030)  # TTFT = 3 steps x 10 ms
    assert e.blocks.used_blocks == 0


def test_budget_shared_decode_first_then_chunks_then_admission() -> None:
    e = engine(budget=6)
    e.add_request(EngineRequest("a", prompt_tokens=5, max_tokens=4, arrival_s=0.0))
    e.add_request(EngineRequest("b", prompt_tokens=7, max_tokens=2, arrival_s=1.0))
    s1 = e.step()  # a: 5 tokens (done, first token); b: 1-token chunk fills the budget
    assert s1.num_prefill_tokens == 6 and s1.new_tokens == {"a": 1, "b": 0}
    s2 = e.step()  # a decodes (1), b continues its prefill with the remaining 5 of the budget
    assert (s2.num_decode_tokens, s2.num_prefill_tokens) == (1, 5)
    assert s2.new_tokens == {"a": 1, "b": 0}
    s3 = e.step()  # b's last prompt token -> its first output token
    assert (s3.num_decode_tokens, s3.num_prefill_tokens) == (1, 1)
    assert s3.new_tokens == {"a": 1, "b": 1}
    rest = run(e)
    total = {"a": 0, "b": 0}
    for s in [s1, s2, s3, *rest]:
        for rid, n in s.new_tokens.items():
            total[rid] += n
    assert total == {"a": 4, "b": 2}


def test_max_num_seqs_limits_admission() -> None:
    e = engine(seqs=2)
    for i in range(3):
        e.add_request(EngineRequest(f"r{i}", prompt_tokens=4, max_tokens=5, arrival_s=float(i)))
    s = e.step()
    assert set(s.new_tokens) == {"r0", "r1"}
    assert e.load().num_waiting == 1


def test_preemption_by_recompute_latest_arrival() -> None:
    # 4 blocks of 4 tokens. a and b (prompt 4, 10 outputs) grow until a decode finds no block.
    e = engine(num_blocks=4, block=4)
    e.add_request(EngineRequest("a", prompt_tokens=4, max_tokens=10, arrival_s=0.0))
    e.add_request(EngineRequest("b", prompt_tokens=4, max_tokens=10, arrival_s=1.0))
    steps = run(e)
    # steps 1-5: both run (8 slots each in 2 blocks); step 6: a needs slot 9 -> b (latest) is preempted
    assert [i for i, s in enumerate(steps, 1) if s.preempted] == [6]
    assert steps[5].preempted == ("b",) and "b" not in steps[5].new_tokens
    # b waits (needs 3 blocks for 9 tokens) until a finishes at step 10, then recomputes 8 tokens
    assert steps[9].finished == ("a",)
    assert steps[10].num_prefill_tokens == 9 and steps[10].num_recompute_tokens == 8
    assert steps[10].new_tokens == {"b": 1}
    assert len(steps) == 15 and steps[-1].finished == ("b",)
    assert e.stats["b"].num_preemptions == 1 and e.stats["b"].recompute_tokens == 8
    assert e.stats["b"].recompute_time_s == pytest.approx(0.010 * 8 / 9)
    assert e.stats["a"].num_preemptions == 0


def test_load_reports_head_demand_and_preempting() -> None:
    e = engine(num_blocks=4, block=4)
    e.add_request(EngineRequest("a", prompt_tokens=4, max_tokens=10, arrival_s=0.0))
    e.add_request(EngineRequest("b", prompt_tokens=4, max_tokens=10, arrival_s=1.0))
    for _ in range(6):
        e.step()
    load = e.load()
    assert load.preempting and load.num_waiting == 1
    assert load.head_demand_blocks == 3  # b: 4 prompt + 5 outputs = 9 tokens
    assert [r.request_id for r in load.running] == ["a"]
    assert load.used_blocks == 3 and load.free_blocks == 1


def test_too_large_and_duplicate_requests_rejected() -> None:
    e = engine(num_blocks=2, block=4)
    with pytest.raises(RequestTooLargeError, match="needs 9 KV tokens"):
        e.add_request(EngineRequest("x", prompt_tokens=8, max_tokens=2))
    e.add_request(EngineRequest("y", prompt_tokens=4, max_tokens=2))
    with pytest.raises(ValueError, match="already"):
        e.add_request(EngineRequest("y", prompt_tokens=4, max_tokens=2))


def test_abort_frees_everything() -> None:
    e = engine()
    e.add_request(EngineRequest("a", prompt_tokens=30, max_tokens=5))
    e.add_request(EngineRequest("b", prompt_tokens=3, max_tokens=5))
    e.step()
    assert e.abort("a") and e.abort("b") and not e.abort("a")
    assert e.blocks.used_blocks == 0 and not e.has_work()


def test_random_workload_conserves_tokens_and_blocks() -> None:
    rng = random.Random(7)
    e = engine(num_blocks=60, block=16, budget=256, seqs=16)
    want = {}
    for i in range(40):
        p, o = rng.randint(1, 400), rng.randint(1, 80)
        want[f"r{i}"] = o
        e.add_request(EngineRequest(f"r{i}", prompt_tokens=p, max_tokens=o, arrival_s=float(i)))
    got: dict[str, int] = {}
    for s in run(e, max_steps=20000):
        for rid, n in s.new_tokens.items():
            got[rid] = got.get(rid, 0) + n
    assert got == want
    assert e.blocks.used_blocks == 0 and set(e.stats) == set(want)
    assert sum(st.num_preemptions for st in e.stats.values()) > 0  # the instance is small enough to preempt


def test_load_reports_list_the_cached_prefix_hashes_only_with_prefix_caching() -> None:
    for caching in (True, False):
        e = EngineCore("i0", 200, 16, flat_model(), enable_prefix_caching=caching)
        e.add_request(EngineRequest("a", 1100, 3, prefix_block_hashes=(1, 2, 3), prefix_hash_block_tokens=512))
        e.step()  # a's prompt computed: hash blocks 1, 2 are full (3 is not)
        detailed, brief = e.instance_load("i0", "d"), e.instance_load("i0", "d", brief=True)
        want = frozenset({1, 2}) if caching else frozenset()
        assert detailed.prefix_hashes == brief.prefix_hashes == e.load().prefix_hashes == want
        assert detailed.prefix_block_tokens == brief.prefix_block_tokens == (512 if caching else 0)
        assert e.load().to_instance_load("i0", "d").prefix_hashes == want
        assert detailed.running[0].prefix_hashes == (1, 2, 3)  # the request's own, for pricing a move
        e.step()  # a decode step: the cache did not change, the report shares the same set
        assert e.instance_load("i0", "d", brief=True).prefix_hashes is brief.prefix_hashes


def test_a_migrated_request_adopts_the_prefix_its_destination_caches() -> None:
    src = EngineCore("s", 200, 16, flat_model(), enable_prefix_caching=True)
    dst = EngineCore("d", 200, 16, flat_model(), enable_prefix_caching=True)
    dst.add_request(EngineRequest("w", 1100, 1, prefix_block_hashes=(1, 2, 3), prefix_hash_block_tokens=512))
    run(dst)  # dst caches hash blocks 1, 2 (64 blocks), evictable
    src.add_request(EngineRequest("r", 1100, 50, prefix_block_hashes=(1, 2, 3), prefix_hash_block_tokens=512))
    for _ in range(3):
        src.step()
    tokens, blocks = src.request_kv("r") or (0, 0)
    assert dst.reserve("m", 0)
    version = dst.load_version
    assert dst.adopt_prefix("m", (1, 2, 3), 512, tokens) == 64
    assert dst.load_version != version and dst.load().cached_blocks == 0  # referenced now
    assert dst.grow_reservation("m", blocks - 64)
    state = src.suspend("r")
    assert state is not None and dst.commit_incoming("m", state)
    src.free_migrated("r")
    assert dst.blocks.num_blocks_of("r") == blocks and dst.load().used_blocks == blocks  # no block twice
    dst.blocks.check_invariants()
    run(dst)
    assert dst.blocks.used_blocks == 0 and dst.blocks.cached_blocks == 64
    # Nothing cached, nothing adopted (and no change reported).
    cold = EngineCore("c", 200, 16, flat_model(), enable_prefix_caching=True)
    assert cold.reserve("m", 0)
    version = cold.load_version
    assert cold.adopt_prefix("m", (1, 2), 512, tokens) == 0 and cold.load_version == version
    with pytest.raises(KeyError):
        cold.adopt_prefix("nope", (1,), 512, tokens)


def test_prefix_caching_skips_shared_prompt_blocks() -> None:
    e = EngineCore("i0", 200, 16, flat_model(), enable_prefix_caching=True)
    e.add_request(EngineRequest("a", 1100, 2, prefix_block_hashes=(1, 2, 3), prefix_hash_block_tokens=512))
    s = e.step()
    assert s.num_prefill_tokens == 1100
    e.add_request(EngineRequest("b", 1030, 2, prefix_block_hashes=(1, 2, 9), prefix_hash_block_tokens=512))
    s = e.step()  # a decodes; b reuses hash blocks 1, 2 (1024 tokens) and prefills 6
    assert s.num_prefix_hit_tokens == 1024 and s.num_prefill_tokens == 6 and s.num_decode_tokens == 1
    run(e)
    assert e.stats["b"].prefix_hit_tokens == 1024
