"""Both backends through the factory: sizes, options, pacing, the torch engine's vocabulary from a real
tokenizer, and ``grow_reservation`` (the hook the llumlet added to the engine protocol for blocks a request
adds during pre-copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llumlet.backends import Backend, BackendConfig, make_backend
from llumlet.engine.protocol import KVPayload
from llumlet.engine.torch_engine import TorchEngine
from llumlet.engine.types import EngineRequest, SamplingParams, StepResult
from topology.load import bundled_path, load_topology

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


def test_the_sim_backend_refuses_any_option_by_name() -> None:
    with pytest.raises(ValueError, match=r"sim backend: unknown option\(s\) colour, nosuch \(it takes none\)"):
        make_backend("sim", BackendConfig(instance_id="x", options={"nosuch": "1", "colour": "red"}))
    with pytest.raises(ValueError) as err:  # accepted and ignored before
        make_backend("sim", BackendConfig(instance_id="x", tokenizer="/tok"))
    assert str(err.value) == (
        "--tokenizer /tok: the sim engine reads no tokenizer (its tokens are the ids the gateway's tokenizer made): "
        "give it to the gateway"
    )


def test_torch_takes_vocabulary_and_eos_from_the_tokenizer(bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    from gateway.tokenizer import HFTokenizer

    tok = HFTokenizer(bpe_tokenizer_dir)
    backend = make_backend("torch", BackendConfig(instance_id="x", num_blocks=16, tokenizer=str(bpe_tokenizer_dir)))
    engine = backend.engine
    assert isinstance(engine, TorchEngine)
    assert engine.vocab_size == tok.vocab_size == 400 and engine.eos_token_id == tok.eos_token_id == 2
    prompt = tok.chat_prompt([{"role": "user", "content": "Grüße 你好"}])
    engine.add_request(
        EngineRequest("r", len(prompt), 12, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=12))
    )
    out: list[int] = []
    while engine.has_work():
        out += engine.step().token_ids.get("r", ())
    assert out and all(0 <= t < 400 for t in out)
    assert tok.decode(out)  # real tokens of that vocabulary: real text, not <|id|> placeholders
    # the topology names it: relative to the file; missing: the error names the key
    bundled = bundled_path("1x8-a100")
    assert bundled is not None
    topo_doc = yaml.safe_load(bundled.read_text())
    topo_doc["models"][0]["tokenizer"] = "tok"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo_doc))
    topo = load_topology(tmp_path / "t.yaml")
    with pytest.raises(ValueError, match=r"t\.yaml: models\[0\]\.tokenizer: .*/tok does not exist"):
        make_backend("torch", BackendConfig(instance_id="node-0-i0", num_blocks=16, topology=topo))
    (tmp_path / "tok").symlink_to(bpe_tokenizer_dir)
    from_topology = make_backend("torch", BackendConfig(instance_id="node-0-i0", num_blocks=16, topology=topo))
    assert from_topology.engine.vocab_size == 400  # type: ignore[attr-defined]


def test_the_sim_backend_caches_prefixes_unless_the_configuration_turns_it_off() -> None:
    """prefix_cache.enabled (on by default): a second request with the same prefix hashes reuses them."""
    from llumlet.engine.prefix_hash import PrefixCacheConfig, prefix_block_hashes

    hashes = prefix_block_hashes(list(range(200)), 64)  # 3 hash blocks of 64 tokens

    def second_hit(cfg: BackendConfig) -> int:
        engine = make_backend("sim", cfg).engine
        for rid in ("first", "second"):
            engine.add_request(EngineRequest(rid, 200, 2, prefix_block_hashes=hashes, prefix_hash_block_tokens=64))
            while engine.has_work():
                engine.step()
        return engine.load().prefix_hit_tokens

    assert second_hit(BackendConfig(instance_id="on", time_scale=0)) == 3 * 64
    off = PrefixCacheConfig(enabled=False)
    assert second_hit(BackendConfig(instance_id="off", time_scale=0, prefix_cache=off)) == 0
