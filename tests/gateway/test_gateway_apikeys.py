"""API keys (gateway.apikeys): the key file's checks, authentication, and each key's priority class, through
the official ``openai`` client against the real HTTP gateway (in process, over a scripted cluster)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from gateway_fakes import ScriptedBackend

from gateway.apikeys import ApiKey, Unauthorized, load_api_keys, parse_api_keys
from gateway.app import GatewayApp
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import HFTokenizer
from gateway.validation import ModelLimits

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

MODEL = "tiny-bpe"
LIMITS = ModelLimits(MODEL, max_context_tokens=512, block_size_tokens=16, max_instance_capacity_blocks=64,
                     num_instances=2)  # fmt: skip
KEYS = {
    "keys": [
        {"name": "chat", "key_sha256": hashlib.sha256(b"sk-chat").hexdigest(), "priority": "high"},
        {"name": "batch", "key": "sk-batch", "priority": 0, "max_priority": 0},
        {"name": "either", "key": "sk-either", "max_priority": 1},
    ]
}


def test_keys_authenticate_by_digest_and_carry_their_classes() -> None:
    keys = parse_api_keys(KEYS, "keys.yaml")
    assert keys.authenticate("Bearer sk-chat") == ApiKey("chat", hashlib.sha256(b"sk-chat").hexdigest(), 1, 1)
    assert keys.authenticate("bearer  sk-batch ").name == "batch"
    assert (keys.authenticate("Bearer sk-either").priority, keys.authenticate("Bearer sk-either").max_priority) == (
        0,
        1,
    )
    for header, message in [
        (None, "needs an API key: send the header Authorization: Bearer <key>"),
        ("sk-chat", "must be 'Bearer <key>'"),
        ("Basic sk-chat", "must be 'Bearer <key>'"),
        ("Bearer sk-nope", "the API key is not valid here"),
    ]:
        with pytest.raises(Unauthorized, match=message):
            keys.authenticate(header)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], r"^keys\.yaml: \(top level\): expected a mapping with one key, keys \(a list of keys\), got a list$"),
        ({"kees": []}, r"^keys\.yaml: kees: unknown key; expected one of: keys\nkeys\.yaml: keys: missing required"),
        ({"keys": "k"}, r"^keys\.yaml: keys: expected a list, got 'k' \(a string\)$"),
        ({"keys": []}, "keys is empty"),
        ({"keys": [{"key": "k"}]}, r"keys\[0\]: name: a non-empty string is required"),
        ({"keys": [{"name": "a"}]}, r"keys\[0\] \(a\): give exactly one of key and key_sha256"),
        ({"keys": [{"name": "a", "key": "k", "key_sha256": "0" * 64}]}, "give exactly one of key and key_sha256"),
        ({"keys": [{"name": "a", "key_sha256": "abc"}]}, "key_sha256 must be 64 hexadecimal digits"),
        ({"keys": [{"name": "a", "key": " k"}]}, "key must be a non-empty string without surrounding spaces"),
        ({"keys": [{"name": "a", "key": "k", "prio": 1}]}, r"\(a\): prio: unknown key; expected one of: name, key,"),
        ({"keys": [{"name": "a", "key": "k", "priority": 11}]}, "priority must be an integer 0..9"),
        ({"keys": [{"name": "a", "key": "k", "priority": 1, "max_priority": 0}]}, "max_priority 0 is below priority 1"),
        (
            {"keys": [{"name": "a", "key": "k"}, {"name": "a", "key": "j"}]},
            r"keys\[0\] \(a\), keys\[1\] \(a\): the same name in 2",
        ),
        (
            {"keys": [{"name": "a", "key": "k"}, {"name": "b", "key": "k"}]},
            r"keys\[0\] \(a\), keys\[1\] \(b\): the same key in 2",
        ),
    ],
)
def test_a_bad_key_file_names_the_entry_and_what_is_wrong(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_api_keys(raw, "keys.yaml")


def test_load_api_keys_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path / 'none.yaml'}: \\(file\\): cannot read the API key file"):
        load_api_keys(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: [\n")
    with pytest.raises(ValueError, match=f"{bad}: line 2, column 1: YAML syntax error"):
        load_api_keys(bad)
    bad.write_bytes(b"keys:\n  - {name: \xff, key: sk-a}\n")  # never a UnicodeDecodeError's traceback
    refused = f"^{bad}: \\(file\\): not UTF-8 text \\(byte 0xff at offset 17\\); save it as UTF-8$"
    with pytest.raises(ValueError, match=refused):
        load_api_keys(bad)
    bad.write_text("keys: " + "[" * 5000 + "]" * 5000)  # nor a RecursionError's
    with pytest.raises(ValueError, match=f"^{bad}: \\(file\\): lists and mappings nested too deeply to read"):
        load_api_keys(bad)
    bad.write_text("keys:\n  - {name: a, key: sk-a}\nkeys: []\n")
    with pytest.raises(ValueError, match="duplicate key 'keys'"):  # never the last one silently
        load_api_keys(bad)
    good = tmp_path / "keys.yaml"
    good.write_text("keys:\n  - {name: a, key: sk-a, priority: high}\n")
    assert load_api_keys(good).authenticate("Bearer sk-a").priority == 1


@pytest.fixture(scope="module")
def tok(bpe_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer(bpe_tokenizer_dir, MODEL)


def test_the_openai_client_with_and_without_a_key(tok: HFTokenizer) -> None:
    backend = ScriptedBackend(limits={MODEL: LIMITS}, tokenizer=tok, answers=("Hello world!",))
    metrics = GatewayMetrics()

    async def main() -> dict[str, Any]:
        app = GatewayApp(backend, metrics, {MODEL: tok}, api_keys=parse_api_keys(KEYS)).app()
        server = TestServer(app)
        await server.start_server()
        base = str(server.make_url("/v1"))
        seen: dict[str, Any] = {}

        def client(key: str) -> Any:
            return openai.AsyncOpenAI(api_key=key, base_url=base, max_retries=0)

        try:
            for key in ("sk-wrong", ""):
                async with client(key or "none") as c:
                    with pytest.raises(openai.AuthenticationError) as caught:
                        await c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                    seen.setdefault("401", []).append(caught.value)
                    with pytest.raises(openai.AuthenticationError):
                        await c.models.list()
            async with client("sk-chat") as c:  # its default class is high
                await c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                seen["models"] = [m.id async for m in c.models.list()]
            async with client("sk-batch") as c:
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                with pytest.raises(openai.PermissionDeniedError) as denied:
                    await c.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": "high"})
                seen["403"] = denied.value
            async with client("sk-either") as c:  # may ask up to high, gets normal by default
                await c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                await c.completions.create(
                    model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Hilum-Priority": "high"}
                )
            async with aiohttp.ClientSession() as http:  # probes and scrapers need no key
                for path in ("/health", "/metrics"):
                    async with http.get(server.make_url(path)) as resp:
                        seen[path] = resp.status
        finally:
            await server.close()
        return seen

    seen = asyncio.run(main())
    assert [e.status_code for e in seen["401"]] == [401, 401]
    assert seen["401"][0].body["code"] == "invalid_api_key" and "not valid here" in seen["401"][0].body["message"]
    assert seen["403"].status_code == 403 and seen["403"].body["code"] == "priority_not_allowed"
    assert (
        "priority \"high\" (class 1) is above 0, the highest the API key 'batch' may ask for"
        in seen["403"].body["message"]
    )
    assert seen["models"] == [MODEL] and (seen["/health"], seen["/metrics"]) == (200, 200)
    assert [r.priority for _, r in backend.started] == [1, 0, 0, 1]  # chat, batch, either, either asking high
    text = metrics.render().decode()
    assert 'hilum_gateway_requests_total{endpoint="completions",outcome="unauthorized"} 2.0' in text
