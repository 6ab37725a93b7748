"""TorchEngine's sampling settings, computed for real: min_tokens, the repetition / frequency / presence
penalties, top-k, raw logprobs — checked against an independent reference (transformers' own forward pass
on the whole sequence, the penalties written out in plain Python), and carried through a migration."""

from __future__ import annotations

import math

import pytest
import torch
from test_torch_engine import (  # _one_thread: the module's autouse fixture, shared
    Streams,
    _one_thread,  # noqa: F401
    assert_baseline,
    make_engine,
    precopy_migrate,
    prompt_ids,
    request,
    run_alone,
)

from llumlet.engine.torch_engine import TorchEngine, apply_penalties, sample_token, token_logprobs
from llumlet.engine.types import SamplingParams, StepResult, TokenLogprobs

PENALIZED = SamplingParams(
    max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=77, repetition_penalty=1.3,
    frequency_penalty=0.6, presence_penalty=0.4, min_tokens=6, logprobs=3,
)  # fmt: skip


def drain_with_logprobs(engine: TorchEngine, rid: str) -> tuple[list[int], list[TokenLogprobs]]:
    """Step ``engine`` until idle: the tokens of ``rid`` and their logprobs."""
    tokens: list[int] = []
    lps: list[TokenLogprobs] = []
    while engine.has_work():
        result = engine.step()
        tokens += result.token_ids.get(rid, ())
        lps += result.logprobs.get(rid, ())
    return tokens, lps


def reference_greedy(
    engine: TorchEngine, prompt: tuple[int, ...], n: int, params: SamplingParams
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers' forward over the whole sequence each step, the penalties applied by
    hand (CTRL's repetition penalty over prompt + output, OpenAI's frequency / presence over the output).
    Returns the tokens and the raw logits of each step."""
    out: list[int] = []
    raw: list[torch.Tensor] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = engine.model(torch.tensor([[*prompt, *out]])).logits[0, -1].clone()
            raw.append(logits.clone())
            for t in set(prompt) | set(out):
                v = float(logits[t])
                logits[t] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
            for t in set(out):
                logits[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
            out.append(int(torch.argmax(logits)))
    return out, raw


def test_apply_penalties_numbers() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3)
    got = apply_penalties(logits, p, prompt_ids=[0], output_ids=[1, 1, 3], stop_ids=[4])
    # token 0 (prompt): 2/2 = 1; token 1: -1*2 = -2, then -0.5*2 - 0.25 = -3.25; token 2 untouched;
    # token 3: 3/2 = 1.5, then -0.5 - 0.25 = 0.75; token 4 is a stop id and 3 outputs are not < 3: untouched
    assert got.tolist() == [1.0, -3.25, 0.5, 0.75, -2.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # the input is not changed
    early = apply_penalties(logits, SamplingParams(min_tokens=3), [], [1], [4, 0])
    assert early.tolist() == [-math.inf, -1.0, 0.5, 3.0, -math.inf]
    assert apply_penalties(logits, SamplingParams(), [0], [1], [4]) is logits  # nothing to apply


def test_top_k_keeps_the_k_most_probable() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    g = torch.Generator().manual_seed(1)
    assert {sample_token(logits, 1.0, 1.0, g, top_k=2) for _ in range(300)} == {1, 2}
    assert {sample_token(logits, 5.0, 1.0, g, top_k=1) for _ in range(50)} == {1}
    # top-k then top-p on the renormalized top-k: {0.5, 0.3} -> {0.625, 0.375}; top_p 0.6 keeps token 1 only
    assert {sample_token(logits, 1.0, 0.6, g, top_k=2) for _ in range(100)} == {1}


def test_token_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0])
    lp = token_logprobs(logits, 2, k=3)
    ref = torch.log_softmax(logits, -1)
    assert lp.logprob == pytest.approx(float(ref[2]))
    assert [t for t, _ in lp.top] == [1, 3, 2]  # descending, a tie by id
    assert [v for _, v in lp.top] == pytest.approx([float(ref[1]), float(ref[3]), float(ref[2])])
    assert token_logprobs(logits, 0, k=0) == TokenLogprobs(pytest.approx(float(ref[0])), ())


def test_greedy_with_penalties_matches_the_reference_and_logprobs_are_raw() -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.8,
                            presence_penalty=0.3, logprobs=2)  # fmt: skip
    engine = make_engine(block_size_tokens=4)
    prompt = prompt_ids(3, 11)
    engine.add_request(request("r", prompt, 20, params))
    got, lps = drain_with_logprobs(engine, "r")
    ref, raw = reference_greedy(engine, prompt, 20, params)
    assert got == ref
    assert got != run_alone(request("r", prompt, 20, SamplingParams(max_tokens=20, temperature=0.0)))
    for token, entry, logits in zip(got, lps, raw, strict=True):
        want = torch.log_softmax(logits, -1)
        assert entry.logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(want, 2).indices.tolist()
    assert_baseline(engine)


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    prompt = prompt_ids(8, 9)
    full = run_alone(request("r", prompt, 16))
    eos = full[0]  # greedy would stop at once
    engine = make_engine(eos_token_id=eos)
    engine.add_request(request("r", prompt, 16, SamplingParams(max_tokens=16, temperature=0.0, min_tokens=5)))
    streams = Streams()
    streams.drain(engine)
    out = streams.tokens["r"]
    assert eos not in out[:5] and len(out) >= 6  # the first 5 could not be EOS
    engine = make_engine(eos_token_id=None)
    stop = SamplingParams(max_tokens=16, temperature=0.0, min_tokens=4, stop_token_ids=(full[0], full[1]))
    engine.add_request(request("s", prompt, 16, stop))
    streams.drain(engine)
    assert not set(streams.tokens["s"][:4]) & {full[0], full[1]}


def test_every_setting_survives_a_migration() -> None:
    """Penalties, top-k, min_tokens, seeded sampling and logprobs continue on the destination exactly."""
    target = request("m", prompt_ids(91, 14), 24, PENALIZED)
    alone = make_engine("alone")
    alone.add_request(target)
    ref_tokens, ref_lps = drain_with_logprobs(alone, "m")
    assert ref_tokens != run_alone(request("m", prompt_ids(91, 14), 24, SamplingParams(max_tokens=24, seed=77)))

    class Collect(Streams):
        def __init__(self) -> None:
            super().__init__()
            self.lps: list[TokenLogprobs] = []

        def add(self, result: StepResult) -> StepResult:
            self.lps += result.logprobs.get("m", ())
            return super().add(result)

    src, dst = make_engine("src"), make_engine("dst")
    src.add_request(target)
    streams = Collect()
    for _ in range(3):
        streams.add(src.step())
    precopy_migrate(src, dst, "m", streams, steps_per_stage=(2, 1), reservation_id="m#1")
    precopy_migrate(dst, src, "m", streams, steps_per_stage=(1,), reservation_id="m#2")
    streams.drain(src)
    assert streams.tokens["m"] == ref_tokens and streams.lps == ref_lps
    assert_baseline(src)
    assert_baseline(dst)
