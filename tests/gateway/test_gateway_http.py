"""The HTTP API over a fake backend: validation (each 400, nothing dispatched), responses, SSE, ids,
disconnects, metrics."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from gateway_fakes import FakeBackend, run, serve

# model "tiny": context 64 tokens, largest instance 12 blocks x 4 = 48 KV tokens; prompt text = 1 token per byte
_P = {"model": "tiny", "prompt": "hi"}
BAD_BODIES: list[tuple[str, Any, str, str]] = [
    # (name, body, param, words in the message)
    ("not an object", [1, 2], "", "must be a JSON object"),
    ("no model", {"prompt": "hi"}, "model", "model is required"),
    ("empty prompt", {"model": "tiny", "prompt": ""}, "prompt", "prompt is empty"),
    ("empty token list", {"model": "tiny", "prompt": []}, "prompt", "prompt is empty"),
    ("no prompt", {"model": "tiny"}, "prompt", "prompt is required"),
    ("token out of vocab", {"model": "tiny", "prompt": [5, 512]}, "prompt", "prompt[1] = 512 is not a token id"),
    ("batch", {"model": "tiny", "prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
    ("max_tokens zero", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
    ("max_tokens negative", {"model": "tiny", "prompt": "hi", "max_tokens": -3}, "max_tokens", "must be >= 1, got -3"),
    ("max_tokens float", {**_P, "max_tokens": 2.5}, "max_tokens", "must be an integer, got 2.5"),
    ("max_tokens string", {**_P, "max_tokens": "8"}, "max_tokens", 'must be an integer, got "8"'),
    ("max_tokens bool", {**_P, "max_tokens": True}, "max_tokens", "must be an integer, got true"),
    (
        "max_tokens absurd",
        {"model": "tiny", "prompt": "hi", "max_tokens": 10**9},
        "max_tokens",
        "max_tokens = 1000000000 is larger than the whole context of tiny (64 tokens)",
    ),
    (
        "beyond context",
        {"model": "tiny", "prompt": "x" * 30, "max_tokens": 40},
        "max_tokens",
        "prompt (30 tokens) + max_tokens (40) = 70 tokens exceeds the context of tiny (64 tokens)",
    ),
    (
        "prompt larger than any instance",
        {"model": "tiny", "prompt": "x" * 50, "max_tokens": 1},
        "prompt",
        "prompt of 50 tokens is larger than any instance of tiny can ever hold (the largest KV cache holds 48 tokens",
    ),
    (
        "prompt + output larger than any instance",
        {"model": "tiny", "prompt": "x" * 40, "max_tokens": 10},
        "max_tokens",
        "prompt (40 tokens) + max_tokens (10) needs 49 KV tokens, more than any instance of tiny can ever hold (48",
    ),
    ("temperature", {"model": "tiny", "prompt": "hi", "temperature": 3}, "temperature", "must be in [0, 2], got 3"),
    (
        "temperature infinite",
        {"model": "tiny", "prompt": "hi", "temperature": float("inf")},
        "temperature",
        "temperature must be a finite number, got Infinity",
    ),
    ("top_p", {"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p", "must be in (0, 1], got 0"),
    ("n zero", {"model": "tiny", "prompt": "hi", "n": 0}, "n", "n must be in [1, 128], got 0"),
    ("n huge", {"model": "tiny", "prompt": "hi", "n": 129}, "n", "n must be in [1, 128], got 129"),
    ("empty stop string", {"model": "tiny", "prompt": "hi", "stop": ["x", ""]}, "stop", "stop[1] is empty"),
    ("stop not strings", {"model": "tiny", "prompt": "hi", "stop": [3]}, "stop", "a string or a list of strings"),
    ("priority", {"model": "tiny", "prompt": "hi", "priority": -1}, "priority", "must be an integer 0..9"),
    ("stream not bool", {"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream", "stream must be true or false"),
    (
        "stream_options without stream",
        {**_P, "stream_options": {"include_usage": True}},
        "stream_options",
        "only allowed with stream: true",
    ),
    (
        "unknown stream option",
        {**_P, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options",
        "stream_options.continuous_usage_stats is not supported",
    ),
    ("seed beyond int64", {"model": "tiny", "prompt": "hi", "seed": 10**26}, "seed", "signed 64-bit integer"),
]
BAD_CHAT: list[tuple[str, Any, str]] = [
    ("no messages", {"model": "tiny", "messages": []}, "messages must be a non-empty list"),
    ("empty content", {"model": "tiny", "messages": [{"role": "user", "content": ""}]}, "prompt is empty"),
    ("bad role", {"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}, 'user or assistant; got "bot"'),
    (
        "no role",
        {"model": "tiny", "messages": [{"content": "x"}]},
        "messages[0].role must be system, developer, user or assistant; it is missing",
    ),
    (
        "null role",
        {"model": "tiny", "messages": [{"role": None, "content": "x"}]},
        "messages[0].role must be system, developer, user or assistant; got null",
    ),
    (
        "name not a string",
        {"model": "tiny", "messages": [{"role": "user", "content": "x", "name": [1, 2]}]},
        "messages[0].name must be a string, got [1, 2]",
    ),
    (
        "content neither a string nor parts",
        {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
        "messages[0].content must be a string or a list of text parts, got a number",
    ),
    (
        "chat max_tokens",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        "max_tokens must be >= 1, got 0",
    ),
]


@pytest.mark.parametrize(("name", "body", "param", "words"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_completion_is_400_and_nothing_dispatched(name: str, body: Any, param: str, words: str) -> None:
    backend = FakeBackend()

    async def main() -> None:
        async with serve(backend) as (client, metrics):
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert words in err["message"]
            assert err["type"] == "invalid_request_error"
            assert err["param"] == (param or None)
            assert b'hilum_gateway_requests_total{endpoint="completions",outcome="bad_request"} 1.0' in metrics.render()

    run(main)
    assert backend.started == []


@pytest.mark.parametrize(("name", "body", "words"), BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_is_400_and_nothing_dispatched(name: str, body: Any, words: str) -> None:
    backend = FakeBackend()

    async def main() -> None:
        async with serve(backend) as (client, _):
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 400
            assert words in (await resp.json())["error"]["message"]

    run(main)
    assert backend.started == []


@pytest.mark.parametrize(
    ("part", "words", "code"),
    [
        # a text part without its text was "must be a text part", code unsupported: a malformed request, not a feature
        ({"type": "text"}, "messages[0].content[1].text must be a string; it is missing", "invalid_value"),
        ({"type": "text", "text": 5}, "messages[0].content[1].text must be a string; got 5", "invalid_value"),
        ("hi", 'messages[0].content[1] must be an object with type and text, got "hi"', "invalid_value"),
        (
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            'messages[0].content[1].type must be text (hilum serves text parts only); got "image_url"',
            "unsupported",
        ),
        ({"text": "hi"}, "messages[0].content[1].type must be text; it is missing", "invalid_value"),
    ],
)  # fmt: skip
def test_a_bad_content_part_says_what_is_wrong_with_it(part: Any, words: str, code: str) -> None:
    backend = FakeBackend()
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}

    async def main() -> None:
        async with serve(backend) as (client, _):
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert (err["message"], err["param"], err["code"]) == (words, "messages[0]", code)

    run(main)
    assert backend.started == []


def test_malformed_json_and_bad_priority_header_are_400() -> None:
    backend = FakeBackend()

    async def main() -> None:
        async with serve(backend) as (client, _):
            json_type = {"Content-Type": "application/json"}
            resp = await client.post("/v1/completions", data=b'{"model": "tiny", "prompt": "hi"', headers=json_type)
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert err["code"] == "invalid_json" and "not valid JSON" in err["message"]
            resp = await client.post("/v1/completions", data=b"[" * 100_000, headers=json_type)
            assert resp.status == 400 and "nests JSON too deeply" in (await resp.json())["error"]["message"]
            body = b'{"model": "tiny", "prompt": "\\ud800"}'
            resp = await client.post("/v1/completions", data=body, headers=json_type)
            assert resp.status == 400 and "not valid Unicode" in (await resp.json())["error"]["message"]
            resp = await client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers={"X-Hilum-Priority": "urgent"}
            )
            assert resp.status == 400
            assert "X-Hilum-Priority must be an integer 0..9" in (await resp.json())["error"]["message"]

    run(main)
    assert backend.started == []


def test_completion_whole_response() -> None:
    backend = FakeBackend()

    async def main() -> None:
        async with serve(backend) as (client, metrics):
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "return_token_ids": True}
            resp = await client.post("/v1/completions", json=body, headers={"X-Hilum-Priority": "high"})
            assert resp.status == 200
            out = await resp.json()
            assert out["object"] == "text_completion"
            assert out["choices"][0]["text"] == "ABCDE"
            assert out["choices"][0]["token_ids"] == [68, 69, 70, 71, 72]
            assert out["choices"][0]["finish_reason"] == "length"
            assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
            assert out["hilum"]["domain_id"] == "dom-a" and out["hilum"]["migrations"] == 0
            page = metrics.render().decode()
            assert 'hilum_gateway_requests_total{endpoint="completions",outcome="ok"} 1.0' in page
            assert "hilum_gateway_ttft_seconds_count 1.0" in page
            assert "hilum_gateway_output_tokens_total 5.0" in page

    run(main)
    ((rid, gen),) = backend.started
    assert gen.prompt_token_ids == (107, 104, 111, 111, 114)  # "hello" bytes + 3
    assert gen.priority == 1 and gen.max_tokens == 5
    assert backend.finished == [rid]


def test_reused_client_id_gets_distinct_gateway_ids() -> None:
    backend = FakeBackend(step_s=0.01)

    async def main() -> None:
        async with serve(backend) as (client, _):
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
            headers = {"X-Request-Id": "same"}
            a, b = await asyncio.gather(
                client.post("/v1/completions", json=body, headers=headers),
                client.post("/v1/completions", json=body, headers=headers),
            )
            ja, jb = await a.json(), await b.json()
            assert a.headers["X-Request-Id"] == b.headers["X-Request-Id"] == "same"
            assert ja["id"] != jb["id"]
            assert ja["choices"][0]["text"] == jb["choices"][0]["text"] == "ABCD"

    run(main)
    assert len({rid for rid, _ in backend.started}) == 2


def _events(raw: str) -> list[Any]:
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            payload = block.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_streaming_completion_and_chat() -> None:
    backend = FakeBackend(migrate_at=2)

    async def main() -> None:
        async with serve(backend) as (client, _):
            body = {
                "model": "tiny",
                "prompt": "hi",
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            resp = await client.post("/v1/completions", json=body)
            assert resp.headers["Content-Type"] == "text/event-stream"
            events = _events(await resp.text())
            assert events[-1] == "[DONE]"
            texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
            assert "".join(texts) == "ABCD"
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[0]["hilum"] == {
                "request_id": events[0]["id"].removeprefix("cmpl-"),
                "domain_id": "dom-a",
                "instance_id": "a0",
            }
            assert events[-3]["hilum"]["migrations"] == 1 and events[-3]["hilum"]["instance_id"] == "b0"
            assert events[-3]["hilum"]["domain_id"] == "dom-b"  # where it is now, as instance_id
            assert events[-3]["hilum"]["moves"] == [
                {
                    "src_instance_id": "a0",
                    "dst_instance_id": "b0",
                    "src_domain_id": "dom-a",
                    "dst_domain_id": "dom-b",
                    "cross_domain": True,
                    "token_gap_s": 0.01,
                }
            ]
            assert events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}

            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
            events = _events(await (await client.post("/v1/chat/completions", json=chat)).text())
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert events[0]["object"] == "chat.completion.chunk"
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "ABC"
            assert events[-2]["choices"][0]["finish_reason"] == "length"

    run(main)
    chat_gen = backend.started[1][1]
    assert bytes(t - 3 for t in chat_gen.prompt_token_ids) == b"user: hi\nassistant: "


def test_chat_whole_response() -> None:
    backend = FakeBackend()

    async def main() -> None:
        async with serve(backend) as (client, _):
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 2,
            }
            out = await (await client.post("/v1/chat/completions", json=chat)).json()
            assert out["object"] == "chat.completion"
            assert out["choices"][0]["message"] == {"role": "assistant", "content": "AB"}

    run(main)


def test_client_disconnect_mid_stream_aborts() -> None:
    backend = FakeBackend(step_s=0.05)

    async def main() -> None:
        async with serve(backend) as (client, metrics):
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 40, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            await resp.content.readuntil(b"\n\n")  # the first token
            resp.close()  # the client goes away
            for _ in range(100):
                if backend.aborted:
                    break
                await asyncio.sleep(0.02)
            assert b'outcome="aborted"} 1.0' in metrics.render()

    run(main)
    assert backend.aborted == [backend.started[0][0]]


def test_no_domain_is_503_models_and_health() -> None:
    backend = FakeBackend(fail_dispatch="no domain accepted the request: dom-a: all 2 instances are draining")

    async def main() -> None:
        async with serve(backend) as (client, _):
            resp = await client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers={"X-Request-Id": "r-7"}
            )
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"  # clients that honour it retry once summaries are newer
            assert resp.headers["X-Request-Id"] == "r-7"  # the caller's id kept beside it
            assert "all 2 instances are draining" in (await resp.json())["error"]["message"]
            models = await (await client.get("/v1/models")).json()
            tiny = {
                "id": "tiny",
                "object": "model",
                "created": 1_700_000_000,  # when this gateway began serving it (the fake wall clock)
                "owned_by": "hilum",
                "max_model_len": 64,
                "hilum": {
                    "max_request_kv_tokens": 48,
                    "num_instances": 2,
                    "tokenizer": "byte stand-in",
                    "sampling_features": None,  # the fake backend does not say
                },
            }
            assert models["data"] == [tiny]
            assert await (await client.get("/v1/models/tiny")).json() == tiny
            assert (await client.get("/health")).status == 200

    run(main)


def test_error_paths_answer_the_openai_error_object() -> None:
    """415 (not JSON), a bad gzip body, 404 (route, model), 405, 413: each OpenAI's error object, not text."""
    backend = FakeBackend()
    json_type = {"Content-Type": "application/json"}
    bad_gzip = {**json_type, "Content-Encoding": "gzip", "Connection": "close"}  # aiohttp drops the connection after
    cases: list[tuple[str, str, dict[str, Any], int, str, str]] = [
        # (method, path, request kwargs, status, code, words in the message)
        ("POST", "/v1/completions", {"data": b"model=tiny", "headers": {"Content-Type": "text/plain"}},
         415, "unsupported_media_type", "send Content-Type: application/json (got text/plain)"),
        ("POST", "/v1/completions", {"data": b"\x1f\x8bnot really gzip", "headers": bad_gzip},
         400, "invalid_body", "the request body cannot be read"),
        ("GET", "/v2/completions", {}, 404, "not_found", "no route GET /v2/completions"),
        ("GET", "/v1/models/gpt-9", {}, 404, "model_not_found", '"gpt-9" does not exist here'),
        ("POST", "/v1/completions", {"json": {"model": "gpt-9", "prompt": "x"}},
         404, "model_not_found", '"gpt-9" does not exist here; served: tiny'),
        ("POST", "/v1/completions", {"json": {"model": 5, "prompt": "x"}},  # it was a 404: "the model 5 does not exist"
         400, "invalid_value", "model must be a string (a model's name), got a number"),
        ("POST", "/v1/completions", {"data": b"null", "headers": json_type},
         400, "invalid_json", "must be a JSON object, got null"),  # it named Python's NoneType
        ("POST", "/v1/completions", {"json": ["x"]}, 400, "invalid_json", "must be a JSON object, got an array"),
        ("POST", "/v1/chat/completions", {"json": {"model": "tiny", "messages": [{"role": "user"}]}},
         400, "invalid_value", "messages[0].content is missing (a string, or a list of text parts)"),
        ("POST", "/v1/completions", {"json": {"model": "tiny", "prompt": 3}},
         400, "invalid_value", "prompt must be a string or a list of token ids, got a number"),
        ("DELETE", "/v1/chat/completions", {}, 405, "method_not_allowed", "DELETE is not allowed"),
        ("POST", "/v1/completions", {"data": io.BytesIO(b"x" * (17 * 1024 * 1024)), "headers": json_type},
         413, "request_too_large", "larger than 16777216 bytes"),
    ]  # fmt: skip

    async def main() -> None:
        async with serve(backend) as (client, _):
            for method, path, kwargs, status, code, words in cases:
                resp = await client.request(method, path, **kwargs)
                assert resp.status == status, (code, await resp.text())
                assert resp.content_type == "application/json"
                err = (await resp.json())["error"]
                assert err["code"] == code and words in err["message"], err
                assert set(err) == {"message", "type", "param", "code"}

    run(main)
    assert backend.started == []
