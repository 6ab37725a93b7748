"""A two-model cluster end to end: ``hilum up --engine sim`` on the chaos soak's topology
(``bench.chaos_soak.TOPOLOGY``: llama-2-7b on a0, a1, b0; llama-2-13b on b1, c0, c1; dom-b holds both), behind
two gateways on their own ports. Requests of both models, streamed at once through both gateways, reach only
instances serving their model, as the llumlets' own running sets show while they decode; an unknown model is a
404 in OpenAI's error shape; ``/v1/models`` lists what is served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from up_harness import UpProcess, alive, idle_load, start_up, wait_load

from bench.chaos_soak import MODELS as SERVES
from bench.chaos_soak import TOPOLOGY
from llumlet.client import LlumletClient

pytestmark = pytest.mark.slow

PER_MODEL = 10  # streamed requests of each model, all at once
MAX_TOKENS = 120  # long enough (several seconds of sim decode) for the samplers to see every request run


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    extra = ["--gateways", "2", "--gateway-ports", "separate"]
    cluster = start_up(tmp_path_factory.mktemp("up-models"), "sim", extra, topology=TOPOLOGY)
    try:
        yield cluster
    finally:
        err = cluster.stop()
        assert "no process left" in err
        assert [p for p in cluster.read_info()["pids"] if alive(p)] == []


def test_models_are_listed_by_every_gateway(up: UpProcess) -> None:
    urls = up.info["gateway_urls"]
    assert len(urls) == 2 and urls == [g["url"] for g in up.info["gateways"].values()]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            for url in urls:
                async with session.get(url + "/v1/models") as resp:
                    data = (await resp.json())["data"]
                got = {m["id"]: (m["max_model_len"], m["hilum"]["num_instances"]) for m in data}
                assert got == {"llama-2-13b": (4096, 3), "llama-2-7b": (4096, 3)}

    asyncio.run(main())


def test_an_unknown_model_is_a_404_in_openais_error_shape(up: UpProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            url = up.info["gateway_urls"][1]
            posts = [
                ("/v1/completions", {"model": "llama-2-70b", "prompt": "hi"}),
                ("/v1/chat/completions", {"model": "llama-2-70b", "messages": [{"role": "user", "content": "hi"}]}),
            ]
            for path, body in posts:
                async with session.post(url + path, json=body) as resp:
                    assert resp.status == 404
                    error = (await resp.json())["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == "model"
                assert error["code"] == "model_not_found"
                assert "llama-2-70b" in error["message"] and "llama-2-13b, llama-2-7b" in error["message"]
            async with session.get(url + "/v1/models/llama-2-70b") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        assert await wait_load(up.info, idle_load(up.info)) == idle_load(up.info)  # nothing was dispatched

    asyncio.run(main())


async def _stream(session: aiohttp.ClientSession, url: str, model: str, i: int) -> dict[str, Any]:
    body = {"model": model, "prompt": "m" * (20 + 7 * i), "max_tokens": MAX_TOKENS, "stream": True}
    body["return_token_ids"] = True
    ids: list[int] = []
    placed: dict[str, Any] = {}
    last: dict[str, Any] = {}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            ids += event["choices"][0].get("token_ids", [])
            placed = placed or event.get("hilum", {})
            last = event.get("hilum", last)
    return {"model": model, "ids": ids, "placed": placed, "last": last}


async def _sample(info: dict[str, Any], stop: asyncio.Event, seen: dict[str, set[str]]) -> None:
    """Every llumlet's running set until ``stop``: request id -> the instances it was seen running on."""
    clients = {i: LlumletClient(a) for i, a in info["llumlets"].items()}
    try:
        while not stop.is_set():
            for iid, client in clients.items():
                for r in (await client.get_load()).running:
                    seen.setdefault(r.request_id, set()).add(iid)
            await asyncio.sleep(0.05)
    finally:
        for client in clients.values():
            await client.close()


def test_requests_reach_only_instances_serving_their_model(up: UpProcess) -> None:
    urls = up.info["gateway_urls"]

    async def main() -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
        stop = asyncio.Event()
        seen: dict[str, set[str]] = {}
        sampler = asyncio.create_task(_sample(up.info, stop, seen))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            jobs = [
                _stream(session, urls[k % 2], model, k)
                for k in range(PER_MODEL)
                for model in ("llama-2-7b", "llama-2-13b")
            ]
            results = await asyncio.gather(*jobs)
        stop.set()
        await sampler
        return results, seen

    results, seen = asyncio.run(main())
    model_of = {r["placed"]["request_id"]: r["model"] for r in results}
    assert len(model_of) == 2 * PER_MODEL
    for r in results:
        assert r["ids"] == list(range(MAX_TOKENS))  # complete, in order, once
        assert SERVES[r["placed"]["instance_id"]] == r["model"]
        assert all(SERVES[m["dst_instance_id"]] == r["model"] for m in r["last"]["moves"])
    # what the llumlets themselves ran: every request was seen, and only where its model is served
    assert set(seen) == set(model_of)
    wrong = {rid: sorted(on) for rid, on in seen.items() if any(SERVES[i] != model_of[rid] for i in on)}
    assert wrong == {}
    # both models used more than one domain: dom-b, holding both, took requests of each
    ran_on = {model: {i for rid, on in seen.items() if model_of[rid] == model for i in on} for model in SERVES.values()}
    assert ran_on["llama-2-7b"] & {"b0"} and ran_on["llama-2-7b"] & {"a0", "a1"}
    assert ran_on["llama-2-13b"] & {"b1"} and ran_on["llama-2-13b"] & {"c0", "c1"}


def test_the_printed_bench_line_names_a_model(up: UpProcess) -> None:
    """hilum bench refuses to guess among several models: the line hilum up prints ended in that refusal."""
    line = next(line for line in up.printed.splitlines() if line.startswith("bench it:"))
    assert f" --model {min(SERVES.values())} " in f"{line} ", line
