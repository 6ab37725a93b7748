"""hilum bench: clipping to the model, records from client-side measurements, and a replay against an
in-process gateway (fake cluster) on the trace's clock."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from gateway.apikeys import ApiKeys, parse_api_keys
from gateway.app import GatewayApp
from gateway.metrics import GatewayMetrics
from gateway.router import Placement
from gateway.sink import Move, TokenUpdate
from gateway.validation import GenerationRequest, ModelLimits
from hilum_cli import bench
from hilum_cli.bench import (
    ClippedTrace,
    Measured,
    ModelInfo,
    clip_trace,
    records_of,
    replay,
    run_bench,
    time_scale_warning,
)
from hilum_cli.up import LOCAL_TOPOLOGY
from sim.traces import Trace, TraceRequest, load_trace, with_priorities


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


def bench_args(url: str = "http://127.0.0.1:9", **changes: Any) -> argparse.Namespace:
    """``hilum bench``'s options (3 requests of azure-conv) with ``changes``."""
    options: dict[str, Any] = {
        "url": url, "trace": "azure-conv", "rate_scale": 50.0, "max_requests": 3, "model": None,
        "compare_sim": None, "api_key": "", "priority_fraction": 0.0, "seed": 0, "timeout": 5.0, "out": None,
        "config": None,
    }  # fmt: skip
    return argparse.Namespace(**{**options, **changes})


def test_run_bench_says_clearly_when_no_gateway_answers() -> None:
    err = io.StringIO()
    assert run_bench(bench_args(), out=io.StringIO(), err=err) == 1
    assert "hilum bench: error: cannot reach the gateway at http://127.0.0.1:9" in err.getvalue()


@contextlib.contextmanager
def echo_gateway(api_keys: ApiKeys | None = None) -> Iterator[tuple[str, EchoBackend]]:
    """A gateway over :class:`EchoBackend` on a loop of its own (``run_bench`` runs its own loop)."""
    backend = EchoBackend()
    loop = asyncio.new_event_loop()
    server = TestServer(GatewayApp(backend, GatewayMetrics(), api_keys=api_keys).app())  # type: ignore[arg-type]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start_server(), loop).result(timeout=30)
    try:
        yield str(server.make_url("")).rstrip("/"), backend
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def test_every_option_and_path_is_checked_before_the_first_request(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    other_model = tmp_path / "other-model.yaml"
    other_model.write_text(LOCAL_TOPOLOGY)  # llama-2-7b; the echo gateway serves "m"
    served = tmp_path / "m.yaml"
    served.write_text(LOCAL_TOPOLOGY.replace("llama-2-7b", "m"))
    bad_config = tmp_path / "hilum.yaml"
    bad_config.write_text("policy:\n  no_such_key: 1\n")
    cases = [
        ({"compare_sim": str(tmp_path / "nosuch.yaml")}, "--compare-sim: ", "nosuch.yaml: (file): file not found"),
        ({"compare_sim": str(other_model)}, f"--compare-sim {other_model}: its instances run llama-2-7b, not m", ""),
        (  # refused before the load (it ran, then the simulation failed)
            {"compare_sim": str(served)},
            f"--compare-sim {served}: the simulator cannot time it: instance a0 (and 3 more): ",
            "no step-time model for m at TP1",
        ),
        ({"out": str(a_file / "results")}, f"--out {a_file / 'results'}: cannot write there", ""),
        ({"compare_sim": str(served), "config": str(bad_config)}, f"--config {bad_config}: policy", ""),
        ({"config": str(bad_config)}, f"--config {bad_config}: policy", ""),  # without --compare-sim too
        ({"trace": str(tmp_path / "nosuch.csv")}, f"--trace {tmp_path / 'nosuch.csv'}: ", ""),
        ({"rate_scale": 0.0}, "--rate-scale: must be a number > 0, got 0", ""),
        ({"timeout": float("nan")}, "--timeout: must be a number > 0, got nan", ""),
        ({"max_requests": 0}, "--max-requests: must be >= 1, got 0", ""),
        ({"priority_fraction": 1.5}, "--priority-fraction: must be within 0..1, got 1.5", ""),
        ({"seed": -1}, "--seed: must be >= 0, got -1", ""),  # it named --trace, whose loader checks it
        ({"url": "127.0.0.1:8000"}, "--url '127.0.0.1:8000': expected http://HOST:PORT", ""),
    ]
    with echo_gateway() as (url, backend):
        for changes, words, more in cases:
            out, err = io.StringIO(), io.StringIO()
            args = bench_args(url, **changes) if "url" not in changes else bench_args(**changes)
            t0 = time.monotonic()
            assert run_bench(args, out=out, err=err) == 2, (changes, err.getvalue())
            assert time.monotonic() - t0 < 10  # at once, not after a replay
            assert err.getvalue().startswith(f"hilum bench: error: {words}"), err.getvalue()
            assert more in err.getvalue() and out.getvalue() == ""
        assert backend.requests == {}  # nothing was sent


def test_a_failed_comparison_keeps_the_live_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topo = tmp_path / "m.yaml"
    topo.write_text(LOCAL_TOPOLOGY.replace("llama-2-7b", "m"))

    def fail(*args: object) -> None:
        raise ValueError("the simulator broke")

    monkeypatch.setattr(bench, "simulate", fail)
    # the echo gateway's model "m" stands in for one the simulator can time (else refused before the load)
    monkeypatch.setattr("llumlet.engine.latency.latency_model_problems", lambda *args: [])
    out, err = io.StringIO(), io.StringIO()
    with echo_gateway() as (url, backend):
        args = bench_args(url, compare_sim=str(topo), out=str(tmp_path / "out"))
        assert run_bench(args, out=out, err=err) == 1
    assert len(backend.requests) == 3
    assert f"hilum bench: error: --compare-sim {topo}: the simulation failed: the simulator broke" in err.getvalue()
    rows = {c[0]: c for c in table_rows(out.getvalue())}
    assert rows["live"][1:4] == ["3", "3", "0"] and "sim: hilum" not in rows  # requests, done, refused
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["spec"]["policy"] for r in results["runs"]] == ["live"]
    assert f"results written to {tmp_path / 'out' / 'results.json'}" in err.getvalue()


def test_the_simulated_rows_scaled_step_times_are_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hilum sim says which step times are another GPU's scaled by HBM; --compare-sim showed such a row as measured."""
    topo = tmp_path / "m.yaml"
    topo.write_text(LOCAL_TOPOLOGY.replace("llama-2-7b", "m"))
    real = bench.simulate

    def simulated(trace: Any, topology: str, *args: Any) -> Any:  # the echo gateway's "m" timed as an A100-40GB's
        run = real(trace, "2x8-a100-40gb", *args)
        assert run.config["derived_latency_models"] == ["llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM"]
        return run

    monkeypatch.setattr(bench, "simulate", simulated)
    monkeypatch.setattr("llumlet.engine.latency.latency_model_problems", lambda *args: [])
    out, err = io.StringIO(), io.StringIO()
    with echo_gateway() as (url, _backend):
        assert run_bench(bench_args(url, compare_sim=str(topo)), out=out, err=err) == 0, err.getvalue()
    assert (
        "step times of the simulated row (and of a live row of sim engines): llama-2-13b/a100-40gb/tp1 scaled from "
        "a100 by HBM (no step times measured "
        "on that GPU type" in out.getvalue()
    )


def test_a_gateway_with_api_keys_is_benched_with_one(tmp_path: Path) -> None:
    keys = parse_api_keys({"keys": [{"name": "bench", "key": "sk-bench"}]})
    with echo_gateway(keys) as (url, backend):
        out, err = io.StringIO(), io.StringIO()
        assert run_bench(bench_args(url, api_key="sk-nope"), out=out, err=err) == 1
        assert "refused the API key (the API key is not valid here): pass --api-key KEY" in err.getvalue()
        assert backend.requests == {}
        out, err = io.StringIO(), io.StringIO()
        assert run_bench(bench_args(url, api_key="sk-bench"), out=out, err=err) == 0
    rows = {c[0]: c for c in table_rows(out.getvalue())}
    assert rows["live"][1:4] == ["3", "3", "0"]  # requests, done, refused


def test_a_seeded_share_is_sent_high_priority_and_simulated_so(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    with echo_gateway() as (url, backend):
        assert run_bench(bench_args(url, priority_fraction=0.5, max_requests=4), out=out, err=err) == 0
    assert sorted(r.priority for r in backend.requests.values()) == [0, 0, 1, 1]  # round(0.5 x 4) sent high
    hi_pri = 10  # the "hi-pri TTFT p99" cell (11, which this read before, is preemptions: "0", never "-")
    (live,) = table_rows(out.getvalue())
    assert live[0] == "live" and float(live[hi_pri]) > 0  # measured for the high class
    topo = tmp_path / "local.yaml"
    topo.write_text(LOCAL_TOPOLOGY)  # llama-2-7b, which the simulator has a latency model of
    replayed = with_priorities(load_trace("azure-conv", max_requests=20, rate_scale=10.0), 0.25, 3)
    run = bench.simulate(replayed, str(topo), 3, None, 0.25)
    assert [r.priority for r in run.requests] == [r.priority for r in replayed.requests]
    assert sum(r.priority for r in run.requests) == 5  # the same five requests high, simulated as sent
    with pytest.raises(ValueError, match="priority classes differ from the replayed ones"):
        bench.simulate(replayed, str(topo), 4, None, 0.25)  # another seed would mark other requests


def table_rows(output: str, table: int = 0) -> list[list[str]]:
    """The cells of each row of ``hilum bench``'s ``table`` (0: latency, 1: migrations and cost): two tables, as
    ``hilum sim`` prints."""
    latency, rest = output.split("migrations and cost")
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in (latency, rest)[table].splitlines()]
    return [c for c in cells if len(c) > 4]


def test_clipped_trace_type() -> None:
    assert ClippedTrace(trace(), 0, 10).clipped == 0


def test_a_time_scaled_sim_cluster_is_warned_of_beside_its_simulation(tmp_path: Path) -> None:
    """``hilum up --engine sim --time-scale 0.25``: its steps last a quarter of their modelled time, so what the
    client measures is a quarter of what the simulation beside it gives, and nothing said so."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    topo = run_dir / "topology.yaml"
    info = {
        "engine": "sim", "time_scale": 0.25, "run_dir": str(run_dir), "gateway_url": "http://127.0.0.1:8000",
        "gateway_urls": ["http://127.0.0.1:8000"], "gateways": {"gw-0": {"url": "http://127.0.0.1:8001"}},
    }  # fmt: skip
    (run_dir / "cluster.json").write_text(json.dumps(info))
    warning = time_scale_warning(str(topo), "http://127.0.0.1:8000/")
    assert warning == (
        f"--compare-sim {topo}: its cluster ({run_dir}) runs sim engines at --time-scale 0.25 (wall seconds per "
        "modelled second): the measured latencies are 0.25 times the simulated ones, which are modelled seconds; "
        "for a comparison start it with --time-scale 1"
    )
    assert time_scale_warning(str(topo), "http://127.0.0.1:8001") == warning  # a gateway's own URL
    assert time_scale_warning(str(topo), "http://10.0.0.9:8000") is None  # another cluster's gateway
    assert time_scale_warning(str(tmp_path / "topology.yaml"), "http://127.0.0.1:8000") is None  # no cluster.json
    for changed in ({"time_scale": 1.0}, {"engine": "torch", "time_scale": None}):
        (run_dir / "cluster.json").write_text(json.dumps({**info, **changed}))
        assert time_scale_warning(str(topo), "http://127.0.0.1:8000") is None
    (run_dir / "cluster.json").write_text("{not json")
    assert time_scale_warning(str(topo), "http://127.0.0.1:8000") is None
