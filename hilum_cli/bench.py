"""``hilum bench``: replay a real trace against a live gateway and report the table of ``hilum sim``.

    hilum bench --url http://127.0.0.1:8000 [--trace azure-conv] [--rate-scale X] [--max-requests N]
                [--compare-sim TOPOLOGY] [--out DIR] [--api-key KEY]

Each trace request becomes one streamed ``/v1/completions`` request, sent at its arrival time on the
trace's clock (after ``--rate-scale``): a synthetic prompt of the trace's prompt length (token ids drawn
with ``--seed``), ``max_tokens`` = the trace's output length, ``ignore_eos`` (so every request produces
exactly its output length), greedy. A request whose prompt + output does not fit the model is clipped
first: the prompt to what the model can hold at all, then the output to the rest (the context from
``/v1/models``; the largest KV cache from its ``hilum`` extension); the number clipped is stated.

Measured at the client: arrival (send time), first token, every token's receive time (TBT samples; a chunk
of k tokens counts k gaps of dt/k), finish. Migrations come from each response's ``hilum.moves`` (the
gateway sees each owner change; ``token_gap_s`` stands in for downtime: it is the client-visible pause,
about one decode step more than the real downtime). Preemptions are not visible from outside (0 here). From
these, :class:`sim.results.RequestRecord` / ``MigrationRecord`` values, reduced by ``sim.results.summarize``
and shown by ``sim.report.render_table``: the same columns as ``hilum sim``. With ``--compare-sim``, the
simulator runs the same (clipped) requests with the same arrivals on TOPOLOGY with the ``hilum`` policy and
the settings of ``--config`` (as the live cluster's processes read it; default ``$HILUM_CONFIG``), and its
row is shown beside the measured one.

Everything the command line names is checked before the first request is sent: the gateway URL, every
number, the trace, the ``--compare-sim`` topology (it must describe the model the gateway serves) and
configuration file, and the ``--out`` directory (created, and written to once). A finished replay is never
thrown away: the measured row is printed and written to ``--out`` even when the simulation beside it fails.

Exit status: 0 done (requests that failed are counted in the table); 1 runtime error (the gateway does not
answer or serves no such model; the simulation failed, after the live results were printed and written;
``--out`` could not be written); 2 a bad option or path (nothing was sent).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import random
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import aiohttp

import hilum_config
from sim.results import KvTimeline, MigrationRecord, RequestRecord, SimRun, summarize, write_results
from sim.traces import Trace, TraceRequest, load_trace, with_priorities
from topology.load import TopologyError, load_topology
from topology.spec import Topology

__all__ = [
    "BenchError",
    "BenchUsageError",
    "ClippedTrace",
    "Measured",
    "ModelInfo",
    "clip_trace",
    "records_of",
    "register",
    "replay",
    "synthetic_prompt",
]

_BYTE_IDS = (3, 259)  # token ids of the stand-in tokenizer's bytes: valid for every vocabulary >= 259


class BenchError(RuntimeError):
    """The benchmark cannot run (gateway unreachable, no such model): exit status 1."""


class BenchUsageError(BenchError):
    """A bad option or path, found before anything is sent: exit status 2."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What ``/v1/models`` says about the served model."""

    name: str
    max_context_tokens: int
    max_request_kv_tokens: int | None  # the largest instance's KV cache, tokens (None: not published)


@dataclass(frozen=True, slots=True)
class ClippedTrace:
    """The trace as replayed, and how many requests had to be clipped to fit the model."""

    trace: Trace
    clipped: int
    limit_tokens: int  # prompt + output at most (context, or KV cache + 1)


def clip_trace(trace: Trace, model: ModelInfo) -> ClippedTrace:
    """Clip each request to the model: prompt <= limit - 1, then output <= limit - prompt.

    ``limit`` = min(context, largest KV cache + 1) tokens (the engine holds prompt + output - 1 KV tokens).
    """
    limit = model.max_context_tokens
    if model.max_request_kv_tokens is not None:
        limit = min(limit, model.max_request_kv_tokens + 1)
    out: list[TraceRequest] = []
    clipped = 0
    for r in trace.requests:
        prompt = max(1, min(r.prompt_tokens, limit - 1))
        output = max(1, min(r.output_tokens, limit - prompt))
        if (prompt, output) != (r.prompt_tokens, r.output_tokens):
            clipped += 1
        out.append(
            replace(r, prompt_tokens=prompt, output_tokens=output, prefix_block_hashes=(), prefix_block_tokens=0)
        )
    return ClippedTrace(replace(trace, requests=tuple(out)), clipped, limit)


def synthetic_prompt(num_tokens: int, rng: random.Random) -> list[int]:
    """``num_tokens`` token ids of the stand-in tokenizer's byte range (3..258)."""
    return [rng.randrange(*_BYTE_IDS) for _ in range(num_tokens)]


@dataclass(slots=True)
class Measured:
    """One replayed request as the client saw it (times in seconds since the replay started)."""

    request: TraceRequest
    sent_s: float = 0.0
    token_times_s: list[tuple[float, int]] = field(default_factory=list)  # (receive time, tokens in the chunk)
    finish_s: float | None = None
    generated: int = 0
    status: int = 0
    error: str | None = None
    instance_id: str = ""
    moves: list[dict[str, Any]] = field(default_factory=list)


def _auth(api_key: str) -> dict[str, str]:
    """The request headers that carry ``api_key`` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _model_info(session: aiohttp.ClientSession, url: str, model: str | None) -> ModelInfo:
    try:
        async with session.get(f"{url}/v1/models") as resp:
            if resp.status == 401:
                message = ((await resp.json()).get("error") or {}).get("message", "")
                raise BenchError(f"{url} refused the API key ({message}): pass --api-key KEY (or $OPENAI_API_KEY)")
            body = await resp.json()
    except (aiohttp.ClientError, json.JSONDecodeError, TimeoutError) as exc:
        raise BenchError(f"cannot reach the gateway at {url} ({type(exc).__name__}: {exc}); is it running?") from None
    data = body.get("data") or []
    if not data:
        raise BenchError(f"{url}/v1/models lists no model")
    names = [m["id"] for m in data]
    if model is None and len(names) > 1:
        raise BenchError(f"the gateway serves several models ({', '.join(names)}): choose one with --model")
    chosen = next((m for m in data if m["id"] == (model or names[0])), None)
    if chosen is None:
        raise BenchError(f"model {model!r} is not served at {url}; served: {', '.join(names)}")
    kv = (chosen.get("hilum") or {}).get("max_request_kv_tokens")
    return ModelInfo(chosen["id"], int(chosen.get("max_model_len") or 4096), int(kv) if kv else None)


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, m: Measured, prompt: list[int], t0: float, timeout_s: float
) -> None:
    await asyncio.sleep(max(0.0, t0 + m.request.arrival_s - time.monotonic()))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": m.request.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
        "priority": m.request.priority,
    }
    m.sent_s = time.monotonic() - t0
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            m.status = resp.status
            if resp.status != 200:
                m.error = ((await resp.json()).get("error") or {}).get("message", f"HTTP {resp.status}")
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    m.error = event["error"].get("message", "error")
                    continue
                now = time.monotonic() - t0
                for choice in event.get("choices", []):
                    n = len(choice.get("token_ids") or [])
                    if n:
                        m.token_times_s.append((now, n))
                        m.generated += n
                    if choice.get("finish_reason"):
                        m.finish_s = now
                ext = event.get("hilum") or {}
                if "moves" in ext:
                    m.moves = list(ext["moves"])
                    m.instance_id = ext.get("instance_id", "")
    except (aiohttp.ClientError, TimeoutError) as exc:
        m.error = f"{type(exc).__name__}: {exc}"


async def replay(
    url: str,
    clipped: ClippedTrace,
    *,
    model: str,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress: TextIO | None = None,
    api_key: str = "",
) -> tuple[list[Measured], float]:
    """Send every request at its arrival time; return the measurements and the wall time of the replay."""
    rng = random.Random(seed)
    prompts = [synthetic_prompt(r.prompt_tokens, rng) for r in clipped.trace.requests]
    measured = [Measured(r) for r in clipped.trace.requests]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=_auth(api_key)) as session:
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(_one(session, url, model, m, p, t0, timeout_s))
            for m, p in zip(measured, prompts, strict=True)
        ]
        for done, task in enumerate(asyncio.as_completed(tasks), start=1):
            await task
            if progress is not None and (done % 25 == 0 or done == len(tasks)):
                print(f"hilum bench: {done}/{len(tasks)} requests done", file=progress, flush=True)
        wall = time.monotonic() - t0
    return measured, wall


def records_of(measured: Sequence[Measured]) -> tuple[list[RequestRecord], list[MigrationRecord]]:
    """The simulator's records of measured requests (arrival = send time; see the module docstring)."""
    requests: list[RequestRecord] = []
    migrations: list[MigrationRecord] = []
    for m in measured:
        r = m.request
        gaps: list[float] = []
        prev: float | None = None
        for t, n in m.token_times_s:
            if prev is not None:
                gaps.extend([(t - prev) / n] * n)
            else:
                gaps.extend([0.0] * (n - 1))  # tokens that arrived together with the first one
            prev = t
        ok = m.error is None and m.finish_s is not None
        refused = None if m.status == 200 else (m.error or f"HTTP {m.status}")
        requests.append(
            RequestRecord(
                request_id=r.request_id,
                priority=r.priority,
                arrival_s=m.sent_s,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
                generated_tokens=m.generated,
                first_token_s=m.token_times_s[0][0] if m.token_times_s else None,
                finish_s=m.finish_s if ok else None,
                token_gaps_s=tuple(gaps),
                preemptions=0,
                preempted_s=0.0,
                migrations=len(m.moves),
                refused=refused,
                instance_id=m.instance_id,
            )
        )
        for mv in m.moves:
            gap = mv.get("token_gap_s")
            migrations.append(
                MigrationRecord(
                    request_id=r.request_id,
                    src_instance_id=mv.get("src_instance_id", ""),
                    dst_instance_id=mv.get("dst_instance_id", ""),
                    src_domain_id=mv.get("src_domain_id", ""),
                    dst_domain_id=mv.get("dst_domain_id", ""),
                    start_s=m.sent_s,
                    end_s=m.finish_s or m.sent_s,
                    downtime_s=float(gap) if gap is not None else 0.0,
                    bytes_transferred=None,  # the gateway does not see a move's bytes
                    stages=0,
                    outcome="committed",
                    reason="seen by the gateway",
                )
            )
    return requests, migrations


def _write_trace_jsonl(trace: Trace, path: Path) -> None:
    """The replayed requests as a Mooncake-format trace (ms timestamps) for the simulator."""
    with gzip.open(path, "wt") as f:
        for r in trace.requests:
            row = {"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": r.prompt_tokens}
            row["output_length"] = r.output_tokens
            f.write(json.dumps(row) + "\n")


def simulate(
    trace: Trace, topology: str, seed: int, config: str | None = None, priority_fraction: float = 0.0
) -> SimRun:
    """The simulator's run of exactly these requests and arrivals on ``topology`` (policy ``hilum``), with the
    configuration file ``config`` (None: ``$HILUM_CONFIG``, else the defaults) and the high-priority requests
    of ``trace`` (those ``with_priorities(trace, priority_fraction, seed)`` marked: the simulator marks the
    same ones from the same seed). Raises ValueError when its classes would differ from the trace's."""
    from sim.runner import SimSpec, run_simulation

    with tempfile.TemporaryDirectory(prefix="hilum-bench-") as tmp:
        path = Path(tmp) / "replayed.jsonl.gz"
        _write_trace_jsonl(trace, path)
        options = {"priority_fraction": priority_fraction} if priority_fraction else {}
        spec = SimSpec(topology=topology, trace=str(path), policy="hilum", seed=seed, config=config, options=options)
        run = run_simulation(spec)
    if [r.priority for r in run.requests] != [r.priority for r in trace.requests]:
        raise ValueError("the simulated requests' priority classes differ from the replayed ones")
    return run


@dataclass(frozen=True, slots=True)
class _Checked:
    """What the command line names, checked before anything is sent."""

    url: str  # without a trailing "/"
    trace: Trace
    compare: Topology | None  # the --compare-sim topology
    out: Path | None  # the --out directory, created and writable


def _check(ns: argparse.Namespace) -> _Checked:
    """Check every option and path of ``ns``. Raises BenchUsageError naming the option and what is wrong."""
    url = urllib.parse.urlsplit(ns.url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise BenchUsageError(f"--url {ns.url!r}: expected http://HOST:PORT (the gateway's base URL)")
    for option, value in (("--rate-scale", ns.rate_scale), ("--timeout", ns.timeout)):
        if not (math.isfinite(value) and value > 0):
            raise BenchUsageError(f"{option}: must be a number > 0, got {value:g}")
    if ns.max_requests < 1:
        raise BenchUsageError(f"--max-requests: must be >= 1, got {ns.max_requests}")
    if not 0.0 <= ns.priority_fraction <= 1.0:
        raise BenchUsageError(f"--priority-fraction: must be within 0..1, got {ns.priority_fraction:g}")
    if ns.seed < 0:  # as hilum sim says it (the trace's synthetic parts are drawn from it)
        raise BenchUsageError(f"--seed: must be >= 0, got {ns.seed}")
    try:
        trace = load_trace(ns.trace, rate_scale=ns.rate_scale, max_requests=ns.max_requests, seed=ns.seed)
    except (ValueError, OSError) as exc:
        raise BenchUsageError(f"--trace {ns.trace}: {exc}") from None
    if not trace.requests:
        raise BenchUsageError(f"--trace {ns.trace}: the trace has no requests")
    trace = with_priorities(trace, ns.priority_fraction, ns.seed)  # sent as each request's "priority"
    compare = None
    try:  # checked even without --compare-sim: a bad file named on the command line is a usage error
        hilum_config.load_config(ns.config)
        if ns.compare_sim:
            compare = load_topology(ns.compare_sim)
    except TopologyError as exc:
        raise BenchUsageError(f"--compare-sim: {exc}") from None
    except hilum_config.ConfigError as exc:
        raise BenchUsageError(exc.for_flag()) from None
    out = None
    if ns.out:
        out = Path(ns.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):
                pass
        except OSError as exc:
            raise BenchUsageError(f"--out {ns.out}: cannot write there ({exc.strerror or exc})") from None
    return _Checked(ns.url.rstrip("/"), trace, compare, out)


def _check_model(compare: Topology, path: str, model: ModelInfo) -> None:
    """The --compare-sim topology must run the served model, on instances the simulator can time
    (``llumlet.engine.latency.latency_model_problems``). Raises BenchUsageError."""
    served = {i.model for i in compare.instances}
    if model.name not in served:
        raise BenchUsageError(
            f"--compare-sim {path}: its instances run {', '.join(sorted(served))}, not {model.name} (the model "
            "the gateway serves); compare against the topology the cluster serves (hilum up: <run dir>/topology.yaml)"
        )
    from llumlet.engine.latency import latency_model_problems

    untimed = latency_model_problems(compare, model.name)
    if untimed:  # refused before the load, not after it (the simulation came last)
        raise BenchUsageError(f"--compare-sim {path}: the simulator cannot time it: {untimed[0]}")


def time_scale_warning(compare_sim: str, url: str) -> str | None:
    """A warning when the ``--compare-sim`` topology is a ``hilum up`` run directory's (``cluster.json`` beside it)
    whose cluster, the one at ``url``, runs sim engines at a time scale other than 1: its steps last ``time_scale``
    wall seconds per modelled second, so what the client measures is that many times what the simulation, in
    modelled seconds, gives. None otherwise (no such file, another cluster's, real engines, a time scale of 1)."""
    try:
        info = json.loads((Path(compare_sim).parent / "cluster.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("engine") != "sim":
        return None
    gateways = [info.get("gateway_url"), *(info.get("gateway_urls") or [])]
    gateways += [g.get("url") for g in (info.get("gateways") or {}).values() if isinstance(g, dict)]
    scale = info.get("time_scale")
    if url.rstrip("/") not in {str(g).rstrip("/") for g in gateways if g} or not isinstance(scale, (int, float)):
        return None
    if scale == 1:
        return None
    return (
        f"--compare-sim {compare_sim}: its cluster ({info.get('run_dir', 'that run directory')}) runs sim engines "
        f"at --time-scale {scale:g} (wall seconds per modelled second): the measured latencies are {scale:g} times "
        "the simulated ones, which are modelled seconds; for a comparison start it with --time-scale 1"
    )


def run_bench(ns: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """``hilum bench``; returns the exit status (module docstring: 0 ok, 1 runtime error, 2 bad option)."""
    from sim.report import LATENCY_COLUMNS, MIGRATION_COLUMNS, format_table

    try:
        checked = _check(ns)
    except BenchUsageError as exc:
        print(f"hilum bench: error: {exc}", file=err)
        return 2
    scaled = time_scale_warning(ns.compare_sim, checked.url) if ns.compare_sim else None
    if scaled is not None:
        print(f"hilum bench: warning: {scaled}", file=err)
    trace = checked.trace

    async def main() -> tuple[ModelInfo, ClippedTrace, list[Measured], float]:
        async with aiohttp.ClientSession(headers=_auth(ns.api_key)) as session:
            model = await _model_info(session, checked.url, ns.model)
        if checked.compare is not None:
            _check_model(checked.compare, ns.compare_sim, model)
        clipped = clip_trace(trace, model)
        print(
            f"hilum bench: {len(trace.requests)} requests of {trace.name} over {trace.requests[-1].arrival_s:.1f} s "
            f"(rate x{ns.rate_scale:g}) against {ns.url} ({model.name}); {clipped.clipped} clipped to "
            f"prompt + output <= {clipped.limit_tokens} tokens",
            file=err,
            flush=True,
        )
        measured, wall = await replay(
            checked.url,
            clipped,
            model=model.name,
            seed=ns.seed,
            timeout_s=ns.timeout,
            progress=err,
            api_key=ns.api_key,
        )
        return model, clipped, measured, wall

    try:
        model, clipped, measured, wall = asyncio.run(main())
    except BenchUsageError as exc:
        print(f"hilum bench: error: {exc}", file=err)
        return 2
    except BenchError as exc:
        print(f"hilum bench: error: {exc}", file=err)
        return 1
    requests, migrations = records_of(measured)
    live = SimRun(
        policy="live",
        topology=ns.url,
        trace=trace.name,
        seed=ns.seed,
        rate_scale=ns.rate_scale,
        sim_duration_s=wall,
        wall_s=wall,
        engine_steps=None,  # a live run's engine steps are not counted
        requests=tuple(requests),
        migrations=tuple(migrations),
        kv=KvTimeline.empty(),
        config={"url": ns.url, "model": model.name, "clipped": clipped.clipped, "limit_tokens": clipped.limit_tokens},
    )
    runs, status = [live], 0
    summaries = [summarize(live)]
    if ns.compare_sim:
        print(f"hilum bench: simulating the same requests on {ns.compare_sim} ...", file=err, flush=True)
        try:
            simulated = simulate(clipped.trace, ns.compare_sim, ns.seed, ns.config, ns.priority_fraction)
        except (ValueError, OSError, KeyError) as exc:
            print(f"hilum bench: error: --compare-sim {ns.compare_sim}: the simulation failed: {exc}", file=err)
            status = 1
        else:
            runs.append(simulated)
            summaries.append(replace(summarize(simulated), policy="sim: hilum"))
    failed = [m for m in measured if m.error is not None]
    # two tables, as hilum sim prints (one of every column was 26 columns wide)
    title = f"hilum bench: {trace.name} against {ns.url}"
    print(format_table(summaries, title=title, columns=("reqs", *LATENCY_COLUMNS)), file=out, end="")
    print(format_table(summaries, title="migrations and cost", columns=MIGRATION_COLUMNS), file=out, end="")
    derived = runs[-1].config.get("derived_latency_models") if len(runs) > 1 else None
    if isinstance(derived, list) and derived:  # the simulated row's GPUs, as hilum sim says them
        from llumlet.engine.latency import scaled_note

        note = scaled_note([str(s) for s in derived])
        print(f"step times of the simulated row (and of a live row of sim engines): {note}", file=out)
    if failed:
        print(f"hilum bench: {len(failed)} request(s) failed; first: {failed[0].error}", file=err)
    if checked.out is not None:
        try:
            path = write_results(runs, checked.out)
        except OSError as exc:
            print(f"hilum bench: error: --out {ns.out}: cannot write results.json ({exc})", file=err)
            return 1
        print(f"hilum bench: results written to {path}", file=err)
    return status


def register(sub: Any, summary: str) -> None:
    """Add ``hilum bench`` to an argparse sub-parsers action; ``summary``: its one-line help."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help=summary,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", default="azure-conv", help="bundled trace name or trace file (default azure-conv)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="compress arrivals X times")
    p.add_argument("--max-requests", type=int, default=200, help="first N requests only (default 200)")
    p.add_argument("--model", default=None, help="model to ask for (default: the only one served)")
    p.add_argument("--compare-sim", default=None, metavar="TOPOLOGY", help="also simulate on this topology")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts (and the simulation)")
    p.add_argument(
        "--priority-fraction",
        type=float,
        default=0.0,
        help="a seeded share of the requests sent with priority high (the table's hi-pri column; the simulation "
        "marks the same ones)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", ""),
        help="sent as Authorization: Bearer KEY (a gateway with --api-keys needs one; default $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--out", default=None, help="write results.json (sim.results format: the live run, and the simulated one)"
    )
    hilum_config.add_argument(p)  # the simulation's settings: give it the file the live cluster reads
    p.set_defaults(func=run_bench)
