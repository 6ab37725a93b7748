"""Migration hooks: reserve/commit/release on the destination, suspend/resume/free on the source."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from llumlet.engine import EngineCore, EngineRequest, LatencyModel


def flat_model() -> LatencyModel:
    return LatencyModel("flat", "none", 1, (1, 2), (0.0, 0.0), 0.0, 0.0, 0.0, 0.0, 0.0, step_overhead_ms=1.0)


def engine(name: str, num_blocks: int = 50) -> EngineCore:
    return EngineCore(name, num_blocks=num_blocks, block_size_tokens=4, latency_model=flat_model())


def tokens_of(e: EngineCore, rid: str, steps: int) -> int:
    n = 0
    for _ in range(steps):
        n += e.step().new_tokens.get(rid, 0)
        e.blocks.check_invariants()
    return n


def test_round_trip_request_continues_on_destination() -> None:
    src, dst = engine("A"), engine("B")
    src.add_request(EngineRequest("r", prompt_tokens=10, max_tokens=12, priority=1, arrival_s=3.0))
    produced = tokens_of(src, "r", 4)  # prefill + 3 decodes
    assert produced == 4
    kv_tokens, kv_blocks = src.request_kv("r") or (0, 0)
    assert (kv_tokens, kv_blocks) == (13, 4)  # 10 prompt + 3 outputs in KV (the 4th is not yet)
    assert dst.reserve("m1", kv_blocks)
    produced += tokens_of(src, "r", 2)  # pre-copy stages: the request keeps decoding (15 tokens, 4 blocks)
    state = src.suspend("r")
    assert state is not None
    assert (state.num_output_tokens, state.num_computed_tokens, state.remaining_tokens) == (6, 15, 6)
    assert (state.priority, state.arrival_s) == (1, 3.0)
    assert src.step().new_tokens == {}  # suspended: not batched, keeps its blocks
    assert src.blocks.num_blocks_of("r") == 4 and src.load().num_suspended == 1
    assert dst.commit_incoming("m1", state)
    assert dst.release_reservation("m1") == 0  # committed: release is a no-op
    assert src.free_migrated("r") == 4 and src.free_migrated("r") == 0
    assert src.blocks.used_blocks == 0 and not src.has_work()
    assert dst.blocks.num_blocks_of("r") == 4
    load = dst.load()
    assert [(r.request_id, r.in_decode, r.priority) for r in load.running] == [("r", True, 1)]
    last = None
    while dst.has_work():
        result = dst.step()
        produced += result.new_tokens.get("r", 0)
        last = result
    assert produced == 12 and last is not None and last.finished == ("r",)
    assert dst.blocks.used_blocks == 0


def test_commit_with_growth_beyond_reservation_and_failure_keeps_reservation() -> None:
    src, dst = engine("A"), engine("B", num_blocks=5)
    src.add_request(EngineRequest("r", prompt_tokens=16, max_tokens=20))
    tokens_of(src, "r", 1)  # 16 prompt tokens in KV: 4 blocks
    assert dst.reserve("m", 4)
    tokens_of(src, "r", 5)  # 21 tokens in KV: 6 blocks > 5 on B
    state = src.suspend("r")
    assert state is not None
    assert not dst.commit_incoming("m", state)  # growth does not fit: nothing changes
    assert dst.blocks.reserved_blocks == 4 and dst.request_kv("r") is None
    assert dst.release_reservation("m") == 4 and dst.release_reservation("m") == 0
    assert src.resume("r") and not src.resume("r")  # migration aborted: continues on the source
    assert tokens_of(src, "r", 100) == 14  # 6 before + 14 = 20


def test_suspend_refusals_and_finish_during_migration() -> None:
    e = engine("A")
    e.add_request(EngineRequest("r", prompt_tokens=8, max_tokens=2))
    assert e.suspend("r") is None  # waiting
    assert e.suspend("nope") is None
    e.step()  # prefill -> first token, now in decode
    assert dst_ok(e)
    e.add_request(EngineRequest("f", prompt_tokens=4, max_tokens=2))
    e.step()
    e.step()  # f finishes while a migration could be in pre-copy
    assert e.suspend("f") is None and e.request_kv("f") is None


def dst_ok(e: EngineCore) -> bool:
    state = e.suspend("r")
    return state is not None and e.suspend("r") is None and e.resume("r")


def test_commit_rejects_unknown_reservation_and_duplicates() -> None:
    src, dst = engine("A"), engine("B")
    src.add_request(EngineRequest("r", prompt_tokens=8, max_tokens=5))
    src.step()
    state = src.suspend("r")
    assert state is not None
    with pytest.raises(KeyError, match="unknown reservation"):
        dst.commit_incoming("never", state)
    assert dst.reserve("m", 3)
    with pytest.raises(ValueError, match="already here"):
        src.commit_incoming("m2", state)
    assert src.abort("r") and src.blocks.used_blocks == 0  # abort of a suspended request frees it


@dataclass(frozen=True)
class _RequestLoad:
    request_id: str
    blocks: int
    priority: int = 0
    num_tokens: int = 0
    migratable: bool = True


@dataclass(frozen=True)
class _InstanceLoad:
    instance_id: str
    capacity_blocks: int
    used_blocks: int
    running: tuple[_RequestLoad, ...] = ()
    num_waiting: int = 0
    head_demand_blocks: int = 0
    preempting: bool = False
    draining: bool = False
    warming_up: bool = False
    domain_id: str = ""


def test_to_instance_load(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import policy.types  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:  # the policy package is written in parallel: stand in with the contract's fields
        stub = types.ModuleType("policy.types")
        stub.InstanceLoad = _InstanceLoad  # type: ignore[attr-defined]
        stub.RequestLoad = _RequestLoad  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "policy.types", stub)
    e = engine("A", num_blocks=24)
    e.add_request(EngineRequest("r", prompt_tokens=8, max_tokens=5, priority=2))
    e.step()  # r: 8 tokens in 2 blocks, first output token
    assert e.reserve("m", 3)
    e.add_request(EngineRequest("w", prompt_tokens=80, max_tokens=5))
    e.step()  # r decodes into a 3rd block; w needs 20 blocks, 18 are free: it waits
    il = e.load().to_instance_load("A", "d0", draining=True)
    assert (il.instance_id, il.domain_id, il.capacity_blocks) == ("A", "d0", 24)
    assert (il.draining, il.warming_up, il.preempting) == (True, False, False)
    assert il.used_blocks == 3 + 3  # r holds 3 blocks (9 slots), plus the reservation
    assert il.num_waiting == 1 and il.head_demand_blocks == 20
    assert [(r.request_id, r.blocks, r.priority, r.num_tokens, r.migratable) for r in il.running] == [
        ("r", 3, 2, 10, True)
    ]


def test_the_model_engine_prices_a_re_prefill_with_its_latency_model_and_writes_nothing() -> None:
    from llumlet.engine.latency import load_latency_model

    latency = load_latency_model("llama-2-7b", "a100", 1)
    dst = EngineCore("B", num_blocks=50, block_size_tokens=4, latency_model=latency)
    assert dst.prefill_time_s(0, 8) == 0.0
    assert dst.prefill_time_s(12, 8) == latency.step_time_s([(12, 8)], [])
    assert dst.load().prefill_s_per_token == pytest.approx(latency.step_time_s([(1024, 0)], []) / 1024)
    assert dst.instance_load("B", "d").prefill_s_per_token == dst.load().prefill_s_per_token
    assert dst.reserve("m1", 6)
    # blocks 2..4 after 2 adopted ones: the modelled time of prefilling their 12 tokens after 8, for the caller
    # (a sim llumlet, the simulator's executor) to wait out
    assert dst.recompute_prefix("m1", (), 2, 3) == latency.step_time_s([(12, 8)], [])
    with pytest.raises(IndexError, match="exceed reservation 'm1' of 6 blocks"):
        dst.recompute_prefix("m1", (), 4, 3)
    with pytest.raises(KeyError, match="unknown reservation 'nope'"):
        dst.recompute_prefix("nope", (), 0, 1)
    assert dst.load().reserved_blocks == 6  # nothing allocated or written
