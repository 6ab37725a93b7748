"""``hilum up --engine vllm`` end to end, with the official ``openai`` client: two vLLM llumlets (one per
NVLink domain) serving a tiny random Llama saved with a real tokenizer and chat template (a BPE trained
locally, ``tests/bpe_tokenizer.py``; nothing downloaded), the gateway serving that checkpoint's tokenizer.

The answers are that tokenizer's tokens and text (its chat template, counted in ``usage``), the registrations
advertise every sampling feature and the engine honours them (guided decoding through vLLM's xgrammar), and
a streamed request moved mid-decode from one vLLM engine to the other (the llumlet's MigrateOut, across
domains: the gRPC transport) streams exactly what the same request streams without a move. Runs only where
vLLM is importable (``make test-vllm``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make test-vllm` builds .venv-vllm and runs these", allow_module_level=True)

from up_harness import CHAT_MESSAGES as MESSAGES
from up_harness import UpProcess, chat_completion, openai_client, running_up

from gateway.tokenizer import HFTokenizer
from hilum_proto.v1 import llumlet_pb2 as lpb
from llumlet.client import LlumletClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (make test-vllm runs with --noconftest)
from bpe_tokenizer import build_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MODEL = "tiny-bpe"
TOPOLOGY = """\
name: up-vllm-2x1
models:
  - {name: tiny-bpe, num_layers: 2, num_attention_heads: 4, num_kv_heads: 2, head_dim: 32,
     hidden_size: 128, dtype: float32, block_size_tokens: 32, num_params: 500000, max_context_tokens: 1024}
gpu_types:
  - {name: a100-80gb, memory_gib: 80, hbm_gbyte_per_s: 2039, nvlink_gbyte_per_s: 600}
domains:
  - id: dom-a
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-a, num_gpus: 1, nic_gbit_per_s: 100}]
    instances:
      - {id: a0, gpus: [0], tensor_parallel_size: 1, model: tiny-bpe, kv_capacity_blocks: 64}
  - id: dom-b
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-b, num_gpus: 1, nic_gbit_per_s: 100}]
    instances:
      - {id: b0, gpus: [0], tensor_parallel_size: 1, model: tiny-bpe, kv_capacity_blocks: 64}
fabric:
  oversubscription: 1.0
  racks:
    - {id: rack-0, domains: [dom-a, dom-b]}
"""
ATTEMPT = 1_000_000  # above any attempt a domain scheduler uses


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llumlet.engine.vllm_engine import tiny_llama_checkpoint

    tmp = tmp_path_factory.mktemp("up-vllm-model")
    return tiny_llama_checkpoint(tmp / "tiny-bpe", seed=3, tokenizer=build_tokenizer(tmp / "bpe"))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[UpProcess]:
    options = [f"model={checkpoint}", "dtype=float32", "enforce_eager=true"]  # enforce_eager: no torch.compile
    extra = [arg for o in options for arg in ("--engine-option", o)]
    extra += ["--min-step-s", "0.04", "--start-timeout", "400"]  # steps slow enough to move a request mid-stream
    with running_up(tmp_path_factory.mktemp("up-vllm"), "vllm", extra, timeout_s=600, topology=TOPOLOGY) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(up: UpProcess) -> Iterator[Any]:
    with openai_client(up, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(checkpoint: Path) -> HFTokenizer:
    return HFTokenizer(checkpoint, MODEL)


def chat(client: Any, **kw: Any) -> Any:
    return chat_completion(client, MODEL, **kw)


def test_the_gateway_serves_the_checkpoints_tokenizer_and_every_feature(client: Any, checkpoint: Path) -> None:
    (model,) = client.models.list().data
    hilum = model.model_extra["hilum"]
    assert hilum["tokenizer"] == str(checkpoint)
    assert hilum["sampling_features"] == [
        "guided_decoding", "logprobs", "min_tokens", "penalties", "stop_token_ids", "top_k"
    ]  # fmt: skip


def test_chat_answers_in_the_tokenizers_tokens_and_text(client: Any, tok: HFTokenizer) -> None:
    out = chat(client, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    ids = choice.model_extra["token_ids"]
    assert out.usage.prompt_tokens == len(tok.chat_prompt(MESSAGES))  # the chat template, BOS included
    assert out.usage.completion_tokens == len(ids) == 24 and all(0 <= t < tok.vocab_size for t in ids)
    assert choice.message.content == tok.decode(ids) and choice.finish_reason == "length"
    stream = chat(client, temperature=0, max_tokens=24, stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])] == ids


def test_sampling_fields_act_in_the_vllm_engine(client: Any) -> None:
    greedy = chat(client, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = greedy.choices[0].logprobs.content
    assert len(content) == 12 and all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    top1 = chat(client, temperature=1.0, seed=9, max_tokens=12, extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].model_extra["token_ids"] == greedy.choices[0].model_extra["token_ids"]
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    guided = chat(client, temperature=0, max_tokens=40, response_format=fmt)
    assert isinstance(json.loads(guided.choices[0].message.content)["n"], int)
    assert guided.choices[0].finish_reason == "stop"


async def _move(address: str, request_id: str, dst_address: str, dst_instance_id: str) -> lpb.MigrateOutReply:
    async with LlumletClient(address) as src:
        return await src.migrate_out(request_id, dst_address, ATTEMPT, dst_instance_id=dst_instance_id)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 17}],
    ids=["greedy", "seeded"],
)
def test_a_request_moved_between_vllm_engines_streams_what_an_unmoved_one_does(
    client: Any, up: UpProcess, sampling: dict[str, Any]
) -> None:
    extra = {"ignore_eos": True}
    reference = chat(client, max_tokens=48, extra_body=extra, **sampling)
    assert reference.model_extra["hilum"]["migrations"] == 0
    stream = chat(client, max_tokens=48, stream=True, extra_body=extra, **sampling)
    ids: list[int] = []
    text, placed, last, reply = "", None, None, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        ids += choice.model_extra.get("token_ids", [])
        text += choice.delta.content or ""
        last = chunk.model_extra.get("hilum", last)
        placed = placed or last  # the first chunk says where the request runs
        if reply is None and len(ids) >= 8:  # mid-decode: move it to the other domain's engine
            src = placed["instance_id"]
            dst = next(i for i in up.info["llumlets"] if i != src)
            llumlets = up.info["llumlets"]
            reply = asyncio.run(_move(llumlets[src], placed["request_id"], llumlets[dst], dst))
    assert reply is not None and reply.outcome == lpb.MIGRATION_COMMITTED, reply
    assert reply.transport == "grpc" and reply.downtime_s > 0  # across domains: the gRPC stream
    assert ids == reference.choices[0].model_extra["token_ids"] and len(ids) == 48
    assert text == reference.choices[0].message.content
    assert last is not None and last["migrations"] == 1 and last["moves"][0]["cross_domain"]
