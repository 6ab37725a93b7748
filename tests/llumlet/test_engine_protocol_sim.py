"""The model engine (EngineCore) satisfies the engine protocol's migration hooks."""

from __future__ import annotations

import pytest

from llumlet.engine import Engine, EngineCore, EngineRequest, KVPayload, load_latency_model


def _engine(instance_id: str, num_blocks: int = 64) -> EngineCore:
    return EngineCore(
        instance_id,
        num_blocks=num_blocks,
        block_size_tokens=16,
        latency_model=load_latency_model("llama-2-7b", "a100", 1),
        kv_bytes_per_block=16 * 524_288,
    )


def test_engine_core_is_an_engine() -> None:
    engine: Engine = _engine("a")
    assert engine.block_size_tokens == 16
    assert engine.kv_bytes_per_block == 8_388_608


def test_read_and_write_blocks_check_bounds_and_carry_logical_size() -> None:
    src, dst = _engine("a"), _engine("b")
    src.add_request(EngineRequest("r", prompt_tokens=40, max_tokens=10))
    assert src.migratable("r") is not None  # still queued
    src.step()  # prefill 40 tokens -> 3 blocks, first token
    assert src.migratable("r") is None
    payload = src.read_blocks("r", 0, 2)
    assert payload == KVPayload(first_block=0, num_blocks=2, nbytes=2 * 8_388_608)
    with pytest.raises(IndexError, match="holds 3 blocks"):
        src.read_blocks("r", 2, 2)
    with pytest.raises(KeyError, match="unknown request"):
        src.read_blocks("nope", 0, 1)
    assert dst.reserve("m1", 3)
    dst.write_blocks("m1", payload)
    with pytest.raises(IndexError, match="exceed reservation"):
        dst.write_blocks("m1", KVPayload(2, 2, 0))
    with pytest.raises(KeyError, match="unknown reservation"):
        dst.write_blocks("m2", payload)
    assert dst.release_reservation("m1") == 3
    assert dst.release_reservation("m1") == 0
