"""hilum bench: clipping to the model, records from client-side measurements, and a replay against an
in-process gateway (fake cluster) on the trace's clock."""

from __future__ import annotations

import argparse
import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from gateway.app import GatewayApp
from gateway.metrics import GatewayMetrics
from gateway.router import Placement
from gateway.sink import Move, TokenUpdate
from gateway.validation import GenerationRequest, ModelLimits
from hilum_cli.bench import ClippedTrace, Measured, ModelInfo, clip_trace, records_of, replay, run_bench
from sim.traces import Trace, TraceRequest


def trace(*rows: tuple[float, int, int]) -> Trace:
    reqs = tuple(TraceRequest(f"t-{i}", at, p, o) for i, (at, p, o) in enumerate(rows))
    return Trace("t", "test", "", reqs)


def test_clip_keeps_the_prompt_then_clips_the_output() -> None:
    model = ModelInfo("m", max_context_tokens=100, max_request_kv_tokens=80)  # limit = min(100, 80 + 1) = 81
    clipped = clip_trace(trace((0.0, 10, 20), (0.1, 70, 30), (0.2, 500, 5)), model)
    assert [(r.prompt_tokens, r.output_tokens) for r in clipped.trace.requests] == [(10, 20), (70, 11), (80, 1)]
    assert (clipped.clipped, clipped.limit_tokens) == (2, 81)


def test_records_of_measurements() -> None:
    m = Measured(TraceRequest("t-0", 0.0, 10, 4), sent_s=1.0, finish_s=1.9, generated=4, status=200, instance_id="b0")
    m.token_times_s = [(1.2, 1), (1.5, 2), (1.9, 1)]  # the second chunk carried two tokens
    m.moves = [
        {
            "src_instance_id": "a0",
            "dst_instance_id": "b0",
            "src_domain_id": "A",
            "dst_domain_id": "B",
            "cross_domain": True,
            "token_gap_s": 0.25,
        }
    ]
    bad = Measured(TraceRequest("t-1", 0.5, 10, 4), sent_s=1.5, status=400, error="prompt is empty")
    (rec, rec_bad), (mig,) = records_of([m, bad])
    assert rec.ttft_s == pytest.approx(0.2) and rec.e2e_s == pytest.approx(0.9)
    assert rec.token_gaps_s == pytest.approx((0.15, 0.15, 0.4))
    assert (rec.migrations, rec.instance_id, rec.refused) == (1, "b0", None)
    assert (mig.src_domain_id, mig.dst_domain_id, mig.downtime_s, mig.cross_domain) == ("A", "B", 0.25, True)
    assert rec_bad.refused == "prompt is empty" and rec_bad.finish_s is None and rec_bad.first_token_s is None


class EchoBackend:
    """Produces max_tokens tokens at once, one migration each (a0 -> b0)."""

    def __init__(self) -> None:
        self.limits = {"m": ModelLimits("m", 64, 4, 12, 1)}
        self.requests: dict[str, GenerationRequest] = {}

    def health(self) -> tuple[bool, str]:
        return True, ""

    def ready_domains(self) -> list[str]:
        return ["A"]

    def domain_of(self, instance_id: str) -> str:
        return {"a0": "A", "b0": "B"}[instance_id]

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        self.requests[request_id] = request
        return Placement("A", "a0", "x:1", "", 1)

    async def updates(self, request_id: str) -> AsyncIterator[TokenUpdate]:
        n = self.requests[request_id].max_tokens
        yield TokenUpdate(tuple(range(3, 3 + n)), True, "length", "", "b0", 1, (Move("a0", "b0", 0.01),))

    async def abort(self, request_id: str) -> None: ...

    def abort_soon(self, request_id: str, placement: Any = None) -> None: ...

    def finish(self, request_id: str) -> None: ...


def test_replay_against_a_gateway_sends_the_trace() -> None:
    backend = EchoBackend()

    async def main() -> list[Measured]:
        server = TestServer(GatewayApp(backend, GatewayMetrics()).app())  # type: ignore[arg-type]
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            clipped = clip_trace(trace((0.0, 10, 5), (0.2, 30, 60)), ModelInfo("m", 64, 48))
            measured, wall = await replay(url, clipped, model="m", seed=3)
            assert wall >= 0.2  # the second request waited for its arrival time
            return measured
        finally:
            await server.close()

    measured = asyncio.run(main())
    sent = sorted(backend.requests.values(), key=lambda r: r.prompt_tokens)
    assert [(r.prompt_tokens, r.max_tokens, r.ignore_eos, r.temperature) for r in sent] == [
        (10, 5, True, 0.0),
        (30, 19, True, 0.0),
    ]  # 30 + 60 clipped to 49 tokens (48 KV + 1)
    assert all(3 <= t < 259 for r in sent for t in r.prompt_token_ids)
    assert [m.generated for m in measured] == [5, 19]
    assert measured[1].sent_s >= 0.2 and measured[0].moves[0]["cross_domain"] is True


def test_run_bench_says_clearly_when_no_gateway_answers() -> None:
    ns = argparse.Namespace(
        url="http://127.0.0.1:9",
        trace="azure-conv",
        rate_scale=1.0,
        max_requests=3,
        model=None,
        compare_sim=None,
        seed=0,
        timeout=5.0,
        out=None,
    )
    err = io.StringIO()
    assert run_bench(ns, out=io.StringIO(), err=err) == 1
    assert "hilum bench: error: cannot reach the gateway at http://127.0.0.1:9" in err.getvalue()


def test_clipped_trace_type() -> None:
    assert ClippedTrace(trace(), 0, 10).clipped == 0
