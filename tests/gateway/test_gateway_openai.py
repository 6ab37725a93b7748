"""The official ``openai`` client against the real HTTP gateway (in process) over a scripted cluster that answers
in the tokens of a real tokenizer (a BPE trained locally): every endpoint and option — completions and chat,
streaming or not, n, stop strings, logprobs, the sampling fields, usage, errors, models.list / retrieve.

The answers mix ASCII, accented Latin, CJK and an emoji split across three tokens, so detokenization and
stop strings are exercised on multi-byte text; the cluster side of each option (what an engine does with a
penalty) is tested on the real engines (tests/llumlet, tests/hilum_cli/test_up_openai.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from gateway_fakes import ScriptedBackend

from gateway.app import GatewayApp
from gateway.cluster import submit_message
from gateway.metrics import GatewayMetrics
from gateway.router import DispatchFailed
from gateway.tokenizer import HFTokenizer
from gateway.validation import ModelLimits
from llumlet.convert import sampling_from_pb
from llumlet.engine.types import SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

MODEL = "tiny-bpe"
ANSWERS = (
    "Hello world! Grüße aus Zürich, 你好 🙂 The end.",
    "Stop here. STOP. Later text that never shows.",
    "naïve café — déjà vu",
)
ALL_FEATURES = frozenset({"logprobs", "min_tokens", "penalties", "stop_token_ids", "top_k"})  # torch's
LIMITS = ModelLimits(MODEL, max_context_tokens=512, block_size_tokens=16, max_instance_capacity_blocks=64,
                     num_instances=2, sampling_features=ALL_FEATURES)  # fmt: skip
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello 🙂"}]


@pytest.fixture(scope="module")
def tok(bpe_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer(bpe_tokenizer_dir, MODEL)


@contextlib.asynccontextmanager
async def gateway(
    tok: HFTokenizer, limits: ModelLimits = LIMITS, **backend_kw: Any
) -> AsyncIterator[tuple[Any, ScriptedBackend]]:
    """An in-process gateway over a scripted cluster and an ``AsyncOpenAI`` client to it (no retries)."""
    backend = ScriptedBackend(limits={MODEL: limits}, tokenizer=tok, answers=ANSWERS, **backend_kw)
    app = GatewayApp(backend, GatewayMetrics(), {MODEL: tok}, max_body_bytes=64 * 1024).app()
    server = TestServer(app)
    await server.start_server()
    client = openai.AsyncOpenAI(api_key="none", base_url=str(server.make_url("/v1")), max_retries=0)
    try:
        yield client, backend
    finally:
        await client.close()
        await server.close()


def run(tok: HFTokenizer, body: Any, limits: ModelLimits = LIMITS, **backend_kw: Any) -> ScriptedBackend:
    """Run ``body(client, backend)`` against a fresh gateway; returns the backend (what it was sent)."""

    async def main() -> ScriptedBackend:
        async with gateway(tok, limits, **backend_kw) as (client, backend):
            await body(client, backend)
            return backend

    return asyncio.run(main())


def answer_tokens(tok: HFTokenizer, seed: int) -> list[int]:
    return [*tok.encode(ANSWERS[seed % len(ANSWERS)])[1:], 2]  # the scripted answer, then EOS


def test_models_list_and_retrieve(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert models.data[0].created > 1_600_000_000 and models.data[0].owned_by == "hilum"
        model = await client.models.retrieve(MODEL)
        assert model.id == MODEL and model.model_extra["max_model_len"] == 512
        with pytest.raises(openai.NotFoundError) as err:
            await client.models.retrieve("gpt-9")
        assert err.value.code == "model_not_found" and '"gpt-9" does not exist here' in err.value.message

    run(tok, body)


def test_completion_whole_and_streamed_are_the_answer_with_matching_usage(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        out = await client.completions.create(model=MODEL, prompt="Say hello", max_tokens=64)
        (choice,) = out.choices
        assert choice.text == ANSWERS[0] and choice.finish_reason == "stop"
        assert out.usage.prompt_tokens == len(tok.encode("Say hello"))  # the model's tokens, BOS included
        assert out.usage.completion_tokens == len(answer_tokens(tok, 0))  # EOS counted, not shown
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        chunks = [
            c
            async for c in await client.completions.create(
                model=MODEL, prompt="Say hello", max_tokens=64, stream=True, stream_options={"include_usage": True}
            )
        ]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWERS[0]
        assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)  # 🙂 is 3 tokens: held whole
        assert chunks[-1].usage == out.usage and chunks[-2].choices[0].finish_reason == "stop"
        short = await client.completions.create(model=MODEL, prompt="Say hello", max_tokens=3)
        assert short.choices[0].finish_reason == "length"
        assert short.choices[0].text == tok.decode(answer_tokens(tok, 0)[:3])

    backend = run(tok, body)
    assert backend.started[0][1].prompt_token_ids == tok.encode("Say hello")


def test_chat_uses_the_chat_template_and_counts_its_tokens(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        out = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=64)
        assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ANSWERS[0]
        assert out.usage.prompt_tokens == len(tok.chat_prompt(MESSAGES))
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, stream=True)
        deltas = [c.choices[0].delta async for c in stream]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == ANSWERS[0]
        with pytest.raises(openai.BadRequestError) as err:  # the template's own refusal is a 400
            await client.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "hi"}])
        assert "must not start with an assistant message" in err.value.message and err.value.param == "messages"

    backend = run(tok, body)
    assert backend.started[0][1].prompt_token_ids == tok.chat_prompt(MESSAGES)


def test_stop_strings_cut_the_text_and_the_usage_and_abort_the_engine(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        out = await client.completions.create(model=MODEL, prompt="x", seed=1, stop=["STOP", "never"], max_tokens=64)
        assert out.choices[0].text == "Stop here. " and out.choices[0].finish_reason == "stop"
        kept = out.usage.completion_tokens
        assert tok.decode(answer_tokens(tok, 1)[:kept]).endswith("STOP")  # up to the token completing it
        assert not tok.decode(answer_tokens(tok, 1)[: kept - 1]).endswith("STOP")
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, seed=1, stop="STOP", max_tokens=64, stream=True
        )
        shown = [c.choices[0].delta.content or "" async for c in stream]
        assert "".join(shown) == "Stop here. "  # a delta is never taken back: no chunk showed "S", "ST", ...

    backend = run(tok, body)
    assert backend.aborted == [rid for rid, _ in backend.started]  # each engine request stopped at the match


def test_n_choices_with_seeds_and_summed_usage(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        out = await client.completions.create(model=MODEL, prompt="x", n=3, seed=0, max_tokens=64)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == list(ANSWERS)  # seeds 0, 1, 2: three different answers
        assert out.usage.prompt_tokens == len(tok.encode("x"))  # counted once
        assert out.usage.completion_tokens == sum(len(answer_tokens(tok, s)) for s in range(3))
        assert [c["index"] for c in out.model_extra["hilum"]["choices"]] == [0, 1, 2]
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, seed=1, max_tokens=64, stream=True
        )
        texts = ["", ""]
        finishes = [None, None]
        async for c in stream:
            (choice,) = c.choices
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        assert texts == [ANSWERS[1], ANSWERS[2]] and finishes == ["stop", "stop"]

    backend = run(tok, body)
    seeds = [gen.sampling.seed for _, gen in backend.started]
    assert seeds == [0, 1, 2, 1, 2]
    assert len({rid for rid, _ in backend.started}) == 5


def test_logprobs_in_both_formats_streamed_or_not(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        out = await client.completions.create(model=MODEL, prompt="x", logprobs=2, max_tokens=4)
        lp = out.choices[0].logprobs
        ids = answer_tokens(tok, 0)[:4]
        assert lp.tokens == [tok.token_text(t) for t in ids]
        assert lp.token_logprobs == [0.0, -0.5, -1.0, -1.5]
        assert lp.top_logprobs[1] == {tok.token_text(ids[1]): -0.5, tok.token_text(3): -10.0}
        assert lp.text_offset == [0, *(sum(len(t) for t in lp.tokens[:i]) for i in range(1, 4))]
        chat = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=1, max_tokens=4
        )
        content = chat.choices[0].logprobs.content
        assert [c.token for c in content] == [tok.token_text(t) for t in ids]
        assert content[2].bytes == list(tok.token_text(ids[2]).encode()) and content[2].logprob == -1.0
        assert [[t.logprob for t in c.top_logprobs] for c in content] == [[0.0], [-0.5], [-1.0], [-1.5]]
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, max_tokens=4, stream=True
        )
        chunks = [c async for c in stream]
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
        plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert plain.choices[0].logprobs is None

    run(tok, body)


def test_every_sampling_field_reaches_the_engine_request(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        await client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=20,
            temperature=0.7,
            top_p=0.9,
            seed=42,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
            extra_body={"top_k": 5, "min_tokens": 3, "repetition_penalty": 1.2, "stop_token_ids": [7],
                        "ignore_eos": True},
        )  # fmt: skip

    backend = run(tok, body)
    ((rid, gen),) = backend.started
    want = SamplingParams(
        max_tokens=20, temperature=0.7, top_p=0.9, seed=42, ignore_eos=True, stop_token_ids=(7,), top_k=5,
        min_tokens=3, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.25,
    )  # fmt: skip
    assert gen.sampling == want
    assert sampling_from_pb(submit_message(rid, gen, "sink:1").sampling) == want  # and so on the wire


def test_refusals_name_the_field(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"temperature": 3}, "temperature", "temperature must be in [0, 2], got 3"),
            ({"extra_body": {"foo": 1}}, "foo", "Unrecognized request argument supplied: foo"),
            ({"logit_bias": {"5": 10}}, "logit_bias", "logit_bias is not supported by hilum"),
            ({"echo": True}, "echo", "echo is not supported by hilum"),
            ({"suffix": "x"}, "suffix", "suffix is not supported by hilum"),
            ({"best_of": 3}, "best_of", "best_of must equal n (1)"),
            ({"extra_body": {"guided_regex": "[a-z]+"}}, "guided_regex", "lack the guided_decoding feature"),
            ({"extra_body": {"min_tokens": 99}}, "min_tokens", "min_tokens must be in [0, 16], got 99"),
            ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
            ({"frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ]
        for kwargs, param, words in cases:
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model=MODEL, prompt="x", **kwargs)
            assert (err.value.param, err.value.type) == (param, "invalid_request_error"), kwargs
            assert words in err.value.message, (kwargs, err.value.message)
        chat_cases: list[tuple[dict[str, Any], str, str]] = [
            ({"response_format": {"type": "json_object"}}, "response_format", "lack the guided_decoding feature"),
            ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools is not supported"),
            ({"extra_body": {"prompt": "x"}}, "prompt", "Unrecognized request argument supplied: prompt"),
        ]
        for kwargs, param, words in chat_cases:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
            assert err.value.param == param and words in err.value.message, (kwargs, err.value.message)
        with pytest.raises(openai.NotFoundError) as err:
            await client.completions.create(model="gpt-9", prompt="x")
        assert err.value.code == "model_not_found"

    backend = run(tok, body)
    assert backend.started == []  # nothing was dispatched


def test_an_engine_without_a_feature_refuses_it_by_name(tok: HFTokenizer) -> None:
    sim = ModelLimits(MODEL, 512, 16, 64, 2, sampling_features=frozenset({"penalties", "top_k", "min_tokens"}))

    async def body(client: Any, backend: ScriptedBackend) -> None:
        for kwargs, param in [
            ({"logprobs": 1}, "logprobs"),
            ({"extra_body": {"stop_token_ids": [5]}}, "stop_token_ids"),
        ]:
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model=MODEL, prompt="x", **kwargs)
            assert err.value.param == param and "they offer: min_tokens, penalties, top_k" in err.value.message
        await client.completions.create(model=MODEL, prompt="x", frequency_penalty=1.0, extra_body={"top_k": 3})

    backend = run(tok, body, sim)
    assert len(backend.started) == 1


def test_error_objects_on_every_path(tok: HFTokenizer) -> None:
    async def body(client: Any, backend: ScriptedBackend) -> None:
        with pytest.raises(openai.NotFoundError) as nf:
            await client.get("/nothing", cast_to=object)
        assert nf.value.code == "not_found" and "no route GET /v1/nothing" in nf.value.message
        with pytest.raises(openai.APIStatusError) as na:
            await client.get("/completions", cast_to=object)
        assert (na.value.status_code, na.value.code) == (405, "method_not_allowed")
        assert "GET is not allowed on /v1/completions" in na.value.message
        with pytest.raises(openai.APIStatusError) as big:
            await client.completions.create(model=MODEL, prompt="x" * 70_000)
        assert (big.value.status_code, big.value.code) == (413, "request_too_large")
        assert "larger than 65536 bytes" in big.value.message

    run(tok, body)


def test_5xx_are_error_objects_too(tok: HFTokenizer) -> None:
    class Broken(ScriptedBackend):
        async def start(self, request_id: str, request: Any) -> Any:
            if request.sampling.seed == 1:
                raise DispatchFailed("no domain accepted the request: dom-a: draining", unavailable=True)
            raise RuntimeError("the scheduler exploded")

    async def main() -> None:
        backend = Broken(limits={MODEL: LIMITS}, tokenizer=tok, answers=ANSWERS)
        server = TestServer(GatewayApp(backend, GatewayMetrics(), {MODEL: tok}).app())
        await server.start_server()
        client = openai.AsyncOpenAI(api_key="none", base_url=str(server.make_url("/v1")), max_retries=0)
        try:
            with pytest.raises(openai.InternalServerError) as err:
                await client.completions.create(model=MODEL, prompt="x")
            assert err.value.status_code == 500 and "the scheduler exploded" in err.value.message
            with pytest.raises(openai.APIStatusError) as unavailable:
                await client.completions.create(model=MODEL, prompt="x", seed=1)
            assert (unavailable.value.status_code, unavailable.value.code) == (503, "no_capacity")
        finally:
            await client.close()
            await server.close()

    asyncio.run(main())


def test_a_503_is_retried_after_its_retry_after(tok: HFTokenizer) -> None:
    """The client's own retry of a 503 waits the gateway's ``Retry-After`` (1 s), not its shorter default backoff
    (0.5 s at most for the first retry), and the retry is served."""

    refusals = [DispatchFailed("no domain accepted the request: dom-a: no room now", unavailable=True)]

    class FullOnce(ScriptedBackend):
        async def start(self, request_id: str, request: Any) -> Any:
            if refusals:
                raise refusals.pop()
            return await super().start(request_id, request)

    async def main() -> None:
        backend = FullOnce(limits={MODEL: LIMITS}, tokenizer=tok, answers=ANSWERS)
        server = TestServer(GatewayApp(backend, GatewayMetrics(), {MODEL: tok}).app())
        await server.start_server()
        client = openai.AsyncOpenAI(api_key="none", base_url=str(server.make_url("/v1")), max_retries=1)
        try:
            t0 = time.monotonic()
            out = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            waited_s = time.monotonic() - t0
        finally:
            await client.close()
            await server.close()
        assert out.choices[0].text and len(backend.started) == 1  # the second try was served
        assert 0.95 <= waited_s < 5, waited_s

    asyncio.run(main())
