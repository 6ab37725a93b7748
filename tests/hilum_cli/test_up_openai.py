"""The official ``openai`` client against ``hilum up --engine torch --tokenizer DIR``: a real cluster (etcd,
coordinator, a domain scheduler, two CPU reference llumlets, the gateway) serving a tiny Llama whose
vocabulary is a real tokenizer's (a BPE trained locally, with a chat template). Every endpoint and option
end to end: the answers are that tokenizer's tokens and text, usage counts them, streams equal whole
responses, seeds, n, stop strings, logprobs and the penalties / top-k / min_tokens act in the engine, and
what the torch engine cannot do (guided decoding) is refused by name from its etcd registration. The
gateway runs with an API key file (``--api-keys``): the client sends its key; a wrong key and a priority above
the key's are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from up_harness import CHAT_MESSAGES as MESSAGES
from up_harness import UpProcess, chat_completion, openai_client, running_up

from gateway.tokenizer import HFTokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

MODEL = "tiny-bpe"
API_KEY = "sk-hilum-tests"
TOPOLOGY = """\
name: up-openai-1x2
models:
  - {name: tiny-bpe, num_layers: 2, num_attention_heads: 4, num_kv_heads: 2, head_dim: 16,
     hidden_size: 64, dtype: float32, block_size_tokens: 16, num_params: 100000, max_context_tokens: 1024}
gpu_types:
  - {name: a100-80gb, memory_gib: 80, hbm_gbyte_per_s: 2039, nvlink_gbyte_per_s: 600}
domains:
  - id: dom-a
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-a, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: a0, gpus: [0], tensor_parallel_size: 1, model: tiny-bpe, kv_capacity_blocks: 128}
      - {id: a1, gpus: [1], tensor_parallel_size: 1, model: tiny-bpe, kv_capacity_blocks: 128}
"""


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer_dir: Path) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("up-openai")
    keys = tmp / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: tests, key: {API_KEY}, max_priority: 0}}\n")
    extra = ["--tokenizer", str(bpe_tokenizer_dir), "--api-keys", str(keys)]
    with running_up(tmp, "torch", extra, timeout_s=300, topology=TOPOLOGY) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(up: UpProcess) -> Iterator[Any]:
    with openai_client(up, timeout_s=60, api_key=API_KEY) as c:
        yield c


def test_a_wrong_key_and_a_priority_above_the_keys_are_refused(up: UpProcess, client: Any) -> None:
    with openai_client(up, timeout_s=60, api_key="sk-wrong") as other, pytest.raises(openai.AuthenticationError):
        other.models.list()
    with pytest.raises(openai.PermissionDeniedError, match="the highest the API key 'tests' may ask for"):
        chat(client, max_tokens=2, extra_body={"priority": "high"})
    assert Path(up.info["api_keys_file"]).name == "keys.yaml"  # cluster.json says the gateways need keys


@pytest.fixture(scope="module")
def tok(bpe_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer(bpe_tokenizer_dir, MODEL)


def chat(client: Any, **kw: Any) -> Any:
    return chat_completion(client, MODEL, **kw)


def test_models_and_the_registered_features(client: Any) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == 1024
    hilum = client.models.retrieve(MODEL).model_extra["hilum"]
    assert hilum["sampling_features"] == ["logprobs", "min_tokens", "penalties", "stop_token_ids", "top_k"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("llama-2-7b")


def test_chat_answers_in_the_tokenizers_tokens_and_text(client: Any, tok: HFTokenizer) -> None:
    out = chat(client, temperature=0, max_tokens=24)
    (choice,) = out.choices
    ids = choice.model_extra["token_ids"]
    assert out.usage.prompt_tokens == len(tok.chat_prompt(MESSAGES))  # the model's chat template, counted
    assert out.usage.completion_tokens == len(ids) and all(0 <= t < tok.vocab_size for t in ids)
    assert choice.message.content == tok.decode(ids) and choice.message.content.strip()
    assert choice.finish_reason == ("stop" if ids[-1] == 2 and len(ids) < 24 else "length")
    stream = chat(client, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])] == ids
    assert chunks[-1].usage == out.usage


def test_seeds_n_and_top_k_one_act_in_the_engine(client: Any) -> None:
    def completion(**kw: Any) -> list[Any]:
        out = client.completions.create(model=MODEL, prompt="Grüße aus Zürich", max_tokens=16, **kw)
        return [(c.text, c.model_extra["token_ids"]) for c in out.choices]

    extra = {"return_token_ids": True, "ignore_eos": True}
    seeded = completion(temperature=1.0, seed=11, extra_body=extra)
    assert completion(temperature=1.0, seed=11, extra_body=extra) == seeded
    assert completion(temperature=1.0, seed=12, extra_body=extra) != seeded
    two = completion(temperature=1.0, seed=11, n=2, extra_body=extra)
    assert two == seeded + completion(temperature=1.0, seed=12, extra_body=extra)  # choice i: seed + i
    greedy = completion(temperature=0, extra_body=extra)
    assert completion(temperature=1.0, seed=5, extra_body={**extra, "top_k": 1}) == greedy  # top-1 is argmax


def test_penalties_and_min_tokens_change_the_output(client: Any) -> None:
    def ids(**kw: Any) -> list[int]:
        return chat(client, temperature=0, max_tokens=30, **kw).choices[0].model_extra["token_ids"]

    plain = ids(extra_body={"ignore_eos": True})
    penalized = ids(frequency_penalty=2.0, presence_penalty=1.0, extra_body={"repetition_penalty": 1.5,
                                                                             "ignore_eos": True})  # fmt: skip
    assert penalized != plain and penalized == ids(
        frequency_penalty=2.0, presence_penalty=1.0, extra_body={"repetition_penalty": 1.5, "ignore_eos": True}
    )
    eos_early = ids(extra_body={"stop_token_ids": [plain[0]]})  # greedy's first token is a stop token now
    assert eos_early == plain[:1]
    held = ids(extra_body={"stop_token_ids": [plain[0]], "min_tokens": 5})
    assert plain[0] not in held[:5] and len(held) > 5


def test_stop_strings_on_the_detokenized_text(client: Any, tok: HFTokenizer) -> None:
    full = chat(client, temperature=0, max_tokens=40, extra_body={"ignore_eos": True}).choices[0]
    text = full.message.content
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip() == text[i : i + 2])
    cut = chat(client, temperature=0, max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    kept = cut.choices[0].model_extra["token_ids"]
    assert kept == full.model_extra["token_ids"][: len(kept)] and stop in tok.decode(kept)
    assert cut.usage.completion_tokens == len(kept) < 40
    streamed = chat(client, temperature=0, max_tokens=40, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


def test_logprobs_of_greedy_tokens_are_the_most_probable(client: Any, tok: HFTokenizer) -> None:
    out = chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    ids = out.choices[0].model_extra["token_ids"]
    assert [c.token for c in content] == [tok.token_text(t) for t in ids]
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.logprob <= 0 and [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True
        )
    legacy = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == legacy.usage.completion_tokens


def test_what_the_engine_cannot_do_is_refused_by_name(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, response_format={"type": "json_object"})
    assert err.value.param == "response_format" and "lack the guided_decoding feature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, extra_body={"min_p": 0.1})
    assert err.value.param == "min_p"
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="llama-2-7b", prompt="x")
    assert nf.value.code == "model_not_found"
