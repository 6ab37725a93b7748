"""The gateway's tokenizers: the model's own (a BPE trained locally), its chat template, incremental
detokenization that is exact for multi-byte text and merges; the byte stand-in; loading errors."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tokenizer import (
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    TokenizerLoadError,
    load_tokenizers,
)
from topology.load import parse_topology

pytest.importorskip("transformers")

TEXTS = [
    "Hello world! Grüße aus Zürich, 你好世界 🙂🎉 done.",
    "🙂",
    "naïve café — déjà vu",
    "こんにちは、世界。 KV cache blocks move.",
]


@pytest.fixture(scope="module")
def tok(bpe_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer(bpe_tokenizer_dir, "tiny-bpe")


def stream(tok: HFTokenizer, prompt: tuple[int, ...], ids: list[int], chunks: list[int]) -> list[str]:
    """Deltas of pushing ``ids`` in chunks of the given sizes (cycled), then the flush."""
    d = tok.detokenizer(prompt)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        out.append(d.step(ids[i : i + n]))
        i, k = i + n, k + 1
    out.append(d.flush())
    return out


def test_encode_adds_bos_and_chat_uses_the_template(tok: HFTokenizer) -> None:
    ids = tok.encode("Hello")
    assert ids[0] == 1 and tok.decode(ids) == "Hello"  # BOS from the post-processor, skipped when decoding
    prompt = tok.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    special = {t: tok.encode(t)[1] for t in ("<|system|>", "<|user|>", "<|end|>", "<|assistant|>")}
    assert all(tok.token_text(i) == t for t, i in special.items())  # each marker is one token
    assert prompt[:2] == (1, special["<|system|>"])  # the template writes BOS once: not added twice
    assert prompt[-1] == special["<|assistant|>"]  # add_generation_prompt
    body = tok.chat_prompt([{"role": "user", "content": "Hello"}], add_generation_prompt=False)
    assert body[-1] == special["<|end|>"]


def test_chat_template_errors_and_missing_template(tok: HFTokenizer, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="must not start with an assistant message"):
        tok.chat_prompt([{"role": "assistant", "content": "hi"}])
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in Path(tok.path).iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ChatTemplateError, match="has no chat template: use /v1/completions"):
        HFTokenizer(bare, "m").chat_prompt([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_are_the_whole_text_whatever_the_chunking(tok: HFTokenizer, text: str) -> None:
    ids = list(tok.encode(text)[1:])  # the output tokens of a model that answered exactly this text
    prompt = tok.chat_prompt([{"role": "user", "content": "say it"}])
    whole = "".join(stream(tok, prompt, ids, [len(ids)]))
    assert whole == text == tok.decode(ids)
    for chunks in ([1], [2], [1, 3], [5, 1, 2]):
        deltas = stream(tok, prompt, ids, chunks)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)  # a split character is held back, never shown broken


def test_a_character_split_across_tokens_is_held_back(tok: HFTokenizer) -> None:
    ids = list(tok.encode("🙂")[1:])
    assert len(ids) == 3  # the emoji's 4 bytes are 3 tokens in this vocabulary
    d = tok.detokenizer(tok.encode("x"))
    assert [d.step([i]) for i in ids] == ["", "", "🙂"]
    d = tok.detokenizer(tok.encode("x"))
    assert d.step(ids[:2]) == "" and d.flush() == "\ufffd"  # the output ended mid-character: as decode shows it


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="abc é你好🙂\n", min_size=1, max_size=30), seed=st.integers(0, 2**16))
def test_detokenizer_property(bpe_tokenizer_dir: Path, text: str, seed: int) -> None:
    tok = HFTokenizer(bpe_tokenizer_dir, "m")
    ids = list(tok.encode(text)[1:])
    rng = random.Random(seed)
    chunks = [rng.randint(1, 4) for _ in range(8)]
    assert "".join(stream(tok, tok.encode("prompt"), ids, chunks)) == tok.decode(ids)


def test_random_ids_match_a_plain_decode(tok: HFTokenizer) -> None:
    rng = random.Random(5)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        assert "".join(stream(tok, (1,), ids, [rng.randint(1, 3)])) == tok.decode(ids)


def test_byte_stand_in() -> None:
    t = ByteTokenizer()
    assert t.encode("hi") == (107, 108)
    assert t.decode([107, 108, 2, 300]) == "hi<|2|><|300|>"
    assert t.chat_prompt([{"role": "user", "content": "x"}]) == t.encode("user: x\nassistant: ")
    d = t.detokenizer(())
    assert (d.step([107]), d.step([108]), d.flush()) == ("h", "i", "")
    with pytest.raises(ValueError, match="vocab_size must be >= 259"):
        ByteTokenizer(100)


TOPOLOGY = {
    "name": "t",
    "models": [
        {"name": "m", "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16,
         "hidden_size": 64, "dtype": "float32", "num_params": 100, "max_context_tokens": 256, "tokenizer": "tok"},
        {"name": "plain", "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16,
         "hidden_size": 64, "dtype": "float32", "num_params": 100, "max_context_tokens": 256},
    ],
    "gpu_types": [{"name": "g", "memory_gib": 80, "hbm_gbyte_per_s": 2000, "nvlink_gbyte_per_s": 600}],
    "domains": [
        {"id": "d", "kind": "node", "gpu_type": "g", "nodes": [{"id": "n", "num_gpus": 2, "nic_gbit_per_s": 100}],
         "instances": [
             {"id": "i0", "gpus": [0], "tensor_parallel_size": 1, "model": "m", "kv_capacity_blocks": 10},
             {"id": "i1", "gpus": [1], "tensor_parallel_size": 1, "model": "plain", "kv_capacity_blocks": 10},
         ]},
    ],
}  # fmt: skip


def test_load_tokenizers_per_model(bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tok").symlink_to(bpe_tokenizer_dir)
    topo = parse_topology(TOPOLOGY, "t.yaml", base_dir=tmp_path)  # "tok" is relative to the file's folder
    toks = load_tokenizers(topo)
    assert isinstance(toks["m"], HFTokenizer) and toks["m"].vocab_size == 400
    assert isinstance(toks["plain"], ByteTokenizer)
    assert isinstance(load_tokenizers(topo, {"plain": str(bpe_tokenizer_dir)})["plain"], HFTokenizer)


def test_load_tokenizers_refuses_a_missing_directory_naming_the_key(tmp_path: Path) -> None:
    topo = parse_topology(TOPOLOGY, "t.yaml", base_dir=tmp_path)
    with pytest.raises(TokenizerLoadError) as err:
        load_tokenizers(topo)
    assert str(err.value) == (
        f"t.yaml: models[0].tokenizer: {tmp_path / 'tok'} does not exist (model m: need the directory of its "
        "Hugging Face tokenizer)"
    )
    with pytest.raises(TokenizerLoadError, match=r"--tokenizer for gpt: not a model served by t\.yaml"):
        load_tokenizers(topo, {"gpt": "/x"})
    (tmp_path / "tok").mkdir()  # there, but empty
    with pytest.raises(TokenizerLoadError, match=re.escape(f"{tmp_path / 'tok'} holds no tokenizer file (")):
        load_tokenizers(topo)
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")  # one, but not a tokenizer
    with pytest.raises(TokenizerLoadError, match=re.escape(f"tokenizer '{tmp_path / 'tok'}' cannot be loaded")):
        load_tokenizers(topo)


def test_a_gateway_refuses_a_byte_vocabulary_too_small_by_its_option(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main as gateway_main

    with pytest.raises(SystemExit) as exit_:
        gateway_main(
            ["--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:1", "--topology", "1x8-a100", "--vocab-size", "258"]
        )
    assert exit_.value.code == 2
    assert "error: --vocab-size: at least 259 (the byte stand-in's 3 reserved ids and 256 bytes), got 258" in (
        capsys.readouterr().err
    )
