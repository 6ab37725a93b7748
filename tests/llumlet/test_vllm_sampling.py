"""vLLM honours every field of hilum's ``SamplingParams``: each changes the output the way the field says.

One ``VllmEngine`` over a tiny random Llama whose vocabulary is a real byte-level BPE tokenizer trained
locally (``tests/bpe_tokenizer.py``; nothing downloaded), so guided decoding (vLLM's xgrammar backend) runs
on real token strings. Logprobs are checked against the model itself: transformers' forward pass over the
same checkpoint, log-softmax of the raw logits (vLLM's ``raw_logprobs``), and against what vLLM's own
``LLMEngine`` returns for the same request. Runs only where vLLM is importable (``make test-vllm``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make test-vllm` builds .venv-vllm and runs these", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from llumlet.engine.vllm_engine import VllmEngine, tiny_llama_checkpoint, vllm_sampling_params

import torch

from llumlet.backends.vllm_backend import VLLM_SAMPLING_FEATURES
from llumlet.engine import EngineRequest, SamplingParams
from llumlet.engine.types import GuidedDecoding, SamplingFeature, TokenLogprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (make test-vllm runs with --noconftest)
from bpe_tokenizer import build_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

BLOCK = 32
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)


@dataclass
class Run:
    """One request run alone to its end."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    reason: str = ""


@dataclass
class Model:
    engine: VllmEngine
    checkpoint: Path
    tokenizer: Any
    prompt: tuple[int, ...]
    runs: int = 0

    def run(self, params: SamplingParams, prompt: tuple[int, ...] | None = None) -> Run:
        ids = self.prompt if prompt is None else prompt
        rid = f"r{self.runs}"
        self.runs += 1
        request = EngineRequest(rid, len(ids), params.max_tokens, prompt_token_ids=ids, sampling_params=params)
        self.engine.add_request(request)
        out = Run()
        deadline = time.monotonic() + 120  # a guided request waits while vLLM compiles its grammar
        while self.engine.has_work() and time.monotonic() < deadline:
            result = self.engine.step()
            out.ids += result.token_ids.get(rid, ())
            out.logprobs += result.logprobs.get(rid, ())
            out.reason = result.finish_reasons.get(rid, out.reason)
        assert out.reason, "did not finish"
        return out

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("vllm-sampling")
    checkpoint = tiny_llama_checkpoint(tmp / "tiny-bpe", seed=3, tokenizer=build_tokenizer(tmp / "bpe"))
    engine = VllmEngine(
        "s0",
        str(checkpoint),
        block_size_tokens=BLOCK,
        num_blocks=32,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        engine_kwargs={"enforce_eager": True},  # no torch.compile on CPU: minutes on 2 cores
    )
    tok = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    prompt = tuple(tok.encode("The quick brown fox jumps over the lazy dog. Hello"))
    yield Model(engine, checkpoint, tok, prompt)
    assert engine.load().used_blocks == 0 and engine.load().total_blocks == 32  # num_blocks is the pool


def test_the_backend_advertises_every_feature() -> None:
    assert frozenset(SamplingFeature) == VLLM_SAMPLING_FEATURES


def test_top_k_one_is_greedy_and_top_k_reshapes_sampling(model: Model) -> None:
    greedy = model.run(GREEDY).ids
    sampled = model.run(SEEDED).ids
    assert sampled != greedy  # temperature 1 over the whole vocabulary
    assert model.run(dataclasses.replace(SEEDED, top_k=1)).ids == greedy  # the single most probable token
    top3 = model.run(dataclasses.replace(SEEDED, top_k=3, logprobs=3))
    for token, lp in zip(top3.ids, top3.logprobs, strict=True):  # every token among the 3 most probable
        assert token in [t for t, _ in lp.top]


def test_stop_token_ids_end_the_output_and_min_tokens_holds_them_back(model: Model) -> None:
    greedy = model.run(GREEDY).ids
    k = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])  # first new token after the 2nd
    stop = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=(greedy[k],))
    stopped = model.run(stop)
    assert (stopped.ids, stopped.reason) == (greedy[: k + 1], "stop")  # the stop token is the last one
    held = model.run(dataclasses.replace(stop, min_tokens=k + 3))
    assert len(held.ids) >= k + 3 and greedy[k] not in held.ids[: k + 2]  # masked until min_tokens


def _repeats(ids: list[int], seen: tuple[int, ...] = ()) -> int:
    """Tokens of ``ids`` that occurred before them (in ``seen`` or earlier in ``ids``)."""
    before = set(seen)
    count = 0
    for t in ids:
        count += t in before
        before.add(t)
    return count


def test_penalties_make_repeats_rarer(model: Model) -> None:
    plain = model.run(dataclasses.replace(GREEDY, max_tokens=40)).ids
    repetition = model.run(dataclasses.replace(GREEDY, max_tokens=40, repetition_penalty=2.0)).ids
    frequency = model.run(dataclasses.replace(GREEDY, max_tokens=40, frequency_penalty=2.0)).ids
    presence = model.run(dataclasses.replace(GREEDY, max_tokens=40, presence_penalty=2.0)).ids
    assert _repeats(plain) > 0  # the tiny greedy model loops: something to penalise
    # repetition: tokens of the prompt or the output so far; frequency and presence: of the output only
    assert _repeats(repetition, model.prompt) < _repeats(plain, model.prompt)
    assert _repeats(frequency) < _repeats(plain) and _repeats(presence) < _repeats(plain)
    counts = Counter(frequency)  # frequency grows with each occurrence: no token dominates
    assert max(counts.values()) < max(Counter(plain).values())


def _reference_logprobs(model: Model, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at each output position: float[len(ids), vocab]."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(model.checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([[*model.prompt, *ids]])).logits[0, len(model.prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_are_the_models_raw_distribution(model: Model) -> None:
    # sampling settings do not touch them (vLLM's raw_logprobs): temperature, penalties and top-k are on
    params = dataclasses.replace(SEEDED, temperature=0.7, top_k=40, repetition_penalty=1.2, logprobs=5)
    run = model.run(params)
    assert len(run.logprobs) == len(run.ids) == 24
    reference = _reference_logprobs(model, run.ids)
    for i, (token, lp) in enumerate(zip(run.ids, run.logprobs, strict=True)):
        assert lp.logprob == pytest.approx(float(reference[i, token]), abs=1e-3)
        values, order = torch.sort(reference[i], descending=True)
        assert [t for t, _ in lp.top] == order[:5].tolist()
        assert [v for _, v in lp.top] == pytest.approx(values[:5].tolist(), abs=1e-3)
    greedy = model.run(dataclasses.replace(GREEDY, logprobs=0))  # 0: the sampled token's alone
    assert all(lp.top == () for lp in greedy.logprobs)
    best = _reference_logprobs(model, greedy.ids).max(dim=-1).values  # greedy takes the most probable token
    assert [lp.logprob for lp in greedy.logprobs] == pytest.approx(best.tolist(), abs=1e-3)


def test_logprobs_equal_what_vllm_returns_itself(model: Model) -> None:
    params = dataclasses.replace(SEEDED, logprobs=3)
    ours = model.run(params)
    llm = model.engine.llm
    from vllm.inputs import TokensPrompt

    llm.add_request("direct", TokensPrompt(prompt_token_ids=list(model.prompt)), vllm_sampling_params(params))
    ids: list[int] = []
    positions: list[dict[int, Any]] = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            ids += out.outputs[0].token_ids
            positions += list(out.outputs[0].logprobs or ())
    assert ids == ours.ids
    for token, theirs, mine in zip(ids, positions, ours.logprobs, strict=True):
        assert mine.logprob == theirs[token].logprob
        by_rank = sorted((lp.rank, t, lp.logprob) for t, lp in theirs.items() if lp.rank <= 3)
        assert list(mine.top) == [(t, v) for _, t, v in by_rank]


@pytest.mark.parametrize(
    ("guided", "check", "ends"),
    [
        (GuidedDecoding("choice", json.dumps(["Hello world", "Stop"])), lambda t: t in ("Hello world", "Stop"), True),
        (GuidedDecoding("regex", "(ab|cd){3}x"), lambda t: re.fullmatch("(ab|cd){3}x", t) is not None, True),
        # an object, though the model may write one string value until max_tokens
        (GuidedDecoding("json_object"), lambda t: t.startswith("{"), False),
        (
            GuidedDecoding(
                "json_schema",
                json.dumps(
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": False}
                ),
            ),
            lambda t: set(json.loads(t)) == {"a"} and isinstance(json.loads(t)["a"], int),
            True,
        ),
        (GuidedDecoding("grammar", 'root ::= "yes" | "no"'), lambda t: t in ("yes", "no"), True),
    ],
    ids=["choice", "regex", "json_object", "json_schema", "grammar"],
)  # fmt: skip
def test_guided_decoding_constrains_the_output(model: Model, guided: GuidedDecoding, check: Any, ends: bool) -> None:
    free = model.run(dataclasses.replace(GREEDY, max_tokens=48))
    assert not check_quietly(check, model.text(free.ids))  # unconstrained, the tiny model writes noise
    run = model.run(SamplingParams(max_tokens=48, temperature=0.0, guided=guided))
    text = model.text(run.ids)
    assert check(text), text
    if ends:
        assert run.reason == "stop", text  # the grammar ended it (EOS) on a complete output


def check_quietly(check: Any, text: str) -> bool:
    try:
        return bool(check(text))
    except (ValueError, KeyError, TypeError):
        return False


def test_a_guided_request_runs_but_does_not_migrate(model: Model) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedDecoding("regex", "(ab)+x"))
    prompt = model.prompt
    model.engine.add_request(EngineRequest("g", len(prompt), 40, prompt_token_ids=prompt, sampling_params=params))
    deadline = time.monotonic() + 120  # vLLM compiles the grammar in the background: the request waits
    while not any(r.in_decode for r in model.engine.load().running) and time.monotonic() < deadline:
        model.engine.step()
    reason = model.engine.migratable("g")
    assert reason is not None and "guided decoding (regex): the destination's grammar would start over" in reason
    (running,) = model.engine.load().running
    assert running.unmigratable_reason and running.in_decode
    assert model.engine.suspend("g") is None
    assert model.engine.abort("g")


def test_a_spec_vllm_cannot_compile_is_refused_at_add_request(model: Model) -> None:
    bad = SamplingParams(max_tokens=8, temperature=0.0, guided=GuidedDecoding("json_schema", "{not json"))
    prompt = model.prompt
    with pytest.raises(ValueError, match="s0: request 'bad': vLLM refused it"):
        model.engine.add_request(EngineRequest("bad", len(prompt), 8, prompt_token_ids=prompt, sampling_params=bad))
    assert not model.engine.has_work()


def test_the_backend_sizes_the_pool_and_loads_the_tokenizer_it_is_given(model: Model) -> None:
    from llumlet.backends.base import BackendConfig, make_backend

    tokenizer = model.checkpoint.parent / "bpe"
    options = {"model": str(model.checkpoint), "dtype": "float32", "enforce_eager": "true", "max_model_len": "512"}
    config = BackendConfig("b0", num_blocks=16, block_size_tokens=BLOCK, tokenizer=str(tokenizer), options=options)
    with pytest.raises(ValueError, match="give kv_cache_memory_bytes or --num-blocks, not both"):
        make_backend("vllm", dataclasses.replace(config, options={**options, "kv_cache_memory_bytes": "1000000"}))
    backend = make_backend("vllm", config)
    engine = backend.engine
    assert isinstance(engine, VllmEngine) and engine.load().total_blocks == 16  # --num-blocks: exactly
    assert Path(engine.llm.model_config.tokenizer) == tokenizer  # --tokenizer: the one vLLM loads
    guided = SamplingParams(max_tokens=4, guided=GuidedDecoding("regex", "a+"), logprobs=1, top_k=2)
    assert backend.refuses(guided) is None
