"""Both backends through the factory: sizes, options, pacing, and ``grow_reservation`` (the hook the
llumlet added to the engine protocol for blocks a request adds during pre-copy)."""

from __future__ import annotations

import pytest

from llumlet.backends import Backend, BackendConfig, make_backend
from llumlet.engine.protocol import KVPayload
from llumlet.engine.types import EngineRequest, SamplingParams, StepResult

pytest.importorskip("torch")


@pytest.fixture(params=["sim", "torch"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return make_backend(request.param, BackendConfig(instance_id="x", num_blocks=12, block_size_tokens=4))


def test_grow_reservation_keeps_written_blocks_and_is_bounded(backend: Backend) -> None:
    engine = backend.engine
    assert engine.reserve("r@1", 3)
    assert engine.grow_reservation("r@1", 2)  # never shrinks
    assert engine.grow_reservation("r@1", 5)
    assert engine.load().reserved_blocks == 5
    nbytes = engine.kv_bytes_per_block
    data = bytes(nbytes) if backend.real_token_ids else b""
    engine.write_blocks("r@1", KVPayload(4, 1, nbytes if data else 0, data))  # position 4 exists now
    assert not engine.grow_reservation("r@1", 13)  # more than the whole cache: nothing changes
    assert engine.load().reserved_blocks == 5
    with pytest.raises(KeyError, match="unknown reservation"):
        engine.grow_reservation("nope", 1)
    assert engine.release_reservation("r@1") == 5
    assert engine.load().reserved_blocks == 0


def test_pacing_follows_the_backend() -> None:
    sim = make_backend("sim", BackendConfig(instance_id="x", time_scale=0.5, min_step_s=0.01))
    step = StepResult(0.1, {}, (), (), 0, 0)
    assert sim.step_wall_s(step) == pytest.approx(0.05)
    assert sim.step_wall_s(StepResult(0.0, {}, (), (), 0, 0)) == pytest.approx(0.01)
    torch_backend = make_backend("torch", BackendConfig(instance_id="x", num_blocks=8))
    assert torch_backend.step_wall_s(step) == 0.0 and torch_backend.real_token_ids


def test_torch_options() -> None:
    no_eos = make_backend(
        "torch",
        BackendConfig(instance_id="x", num_blocks=16, options={"eos_token_id": "none", "model.num_hidden_layers": "1"}),
    )
    engine = no_eos.engine
    assert engine.kv_bytes_per_block == 1 * 2 * 2 * 16 * 16 * 4  # layers x K,V x kv heads x block x head_dim x fp32
    engine.add_request(
        EngineRequest("r", 3, 5, prompt_token_ids=(5, 6, 7), sampling_params=SamplingParams(max_tokens=5))
    )
    produced = 0
    while engine.has_work():
        produced += len(engine.step().token_ids.get("r", ()))
    assert produced == 5  # no EOS: exactly max_tokens
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        make_backend("torch", BackendConfig(instance_id="x", options={"colour": "red"}))
    with pytest.raises(ValueError, match="need a number"):
        make_backend("torch", BackendConfig(instance_id="x", options={"threads": "many"}))
