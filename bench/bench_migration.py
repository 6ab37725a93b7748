"""Downtime and total time of a live migration: multi-stage pre-copy vs naive stop-and-copy.

Two torch llumlet processes (the CPU reference engine) in two NVLink domains of a small topology, so the
migration takes the cross-domain gRPC transport with a token-bucket rate cap (``--rate-cap-mb-s``; small on
purpose, to make the tiny model's KV take visible time). For each context length (prompt tokens) and mode, a
greedy request is submitted to the source, migrated once it decodes, then aborted; the MigrateOut reply gives
the stages, bytes, total time and downtime (request suspended -> destination committed).

The point (DESIGN.md, "Migration"): pre-copy downtime stays flat as the context grows, stop-and-copy grows
with it (all the KV moves while the request is stopped).

Usage::

    PYTHONPATH=. python bench/bench_migration.py [--contexts 128 1024 4096] [--repeats 3] [--rate-cap-mb-s 10]

Prints a table, the stop-and-copy / pre-copy downtime ratio per context, and the pre-copy downtime of the
longest context over the shortest (flat in the context = 1); results go in docs/migration.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.client import LlumletClient
from llumlet.engine.types import SamplingParams
from llumlet.procs import LlumletProcess
from llumlet.sink import TokenCollector

TOPOLOGY = """\
name: bench-two-domains
models:
  - {name: llama-2-7b, num_layers: 32, num_attention_heads: 32, num_kv_heads: 32, head_dim: 128,
     hidden_size: 4096, dtype: float16, block_size_tokens: 16, num_params: 6738415616, max_context_tokens: 4096}
gpu_types:
  - {name: a100-80gb, memory_gib: 80, hbm_gbyte_per_s: 2039, nvlink_gbyte_per_s: 600}
domains:
  - id: dom-a
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-a, num_gpus: 1, nic_gbit_per_s: 100}]
    instances: [{id: src, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 1024}]
  - id: dom-b
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-b, num_gpus: 1, nic_gbit_per_s: 100}]
    instances: [{id: dst, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 1024}]
fabric:
  oversubscription: 1.0
  racks:
    - {id: rack-0, domains: [dom-a, dom-b]}
"""

MODES = {"pre-copy": pb.MIGRATION_PRE_COPY, "stop-and-copy": pb.MIGRATION_STOP_AND_COPY}


@dataclass(frozen=True, slots=True)
class Sample:
    context_tokens: int
    mode: str
    stages: int
    blocks: int
    bytes: int
    total_s: float
    downtime_s: float
    bandwidth_bytes_per_s: float


async def _one(
    col: TokenCollector, src: LlumletClient, dst: LlumletClient, rid: str, context: int, mode: str, rng: random.Random
) -> Sample:
    prompt = [rng.randrange(3, 512) for _ in range(context)]
    col.expect(rid, src.address)
    reply = await src.submit(rid, col.address, SamplingParams(max_tokens=600, ignore_eos=True), prompt_token_ids=prompt)
    if not reply.accepted:
        raise RuntimeError(f"{rid}: not accepted: {reply.reason}")
    while len(col.get(rid).token_ids) < 4:  # decoding
        await asyncio.sleep(0.002)
    rep = await src.migrate_out(rid, dst.address, 1, dst_instance_id="dst", mode=MODES[mode])
    if rep.outcome != pb.MIGRATION_COMMITTED:
        raise RuntimeError(f"{rid}: migration {pb.MigrationOutcome.Name(rep.outcome)}: {rep.reason}")
    await dst.abort(rid)
    await col.wait(rid, 30)
    return Sample(
        context, mode, rep.stages, rep.blocks, rep.bytes, rep.total_s, rep.downtime_s, rep.bandwidth_bytes_per_s
    )


async def _run(addresses: tuple[str, str], contexts: Sequence[int], repeats: int) -> list[Sample]:
    col = TokenCollector()
    await col.start()
    src, dst = LlumletClient(addresses[0]), LlumletClient(addresses[1])
    rng = random.Random(0)
    out: list[Sample] = []
    try:
        await _one(col, src, dst, "warm-up", 64, "pre-copy", rng)
        for i in range(repeats):  # contexts and modes interleaved, so drift in the machine's load hits all alike
            for context in contexts:
                for mode in MODES:
                    out.append(await _one(col, src, dst, f"{mode}-{context}-{i}", context, mode, rng))
    finally:
        await src.close()
        await dst.close()
        await col.stop()
    return out


def _table(samples: list[Sample], contexts: Sequence[int], rate_cap_bytes_per_s: float) -> str:
    lines = [
        f"cross-domain gRPC transport, rate cap {rate_cap_bytes_per_s / 1e6:.1f} MB/s; medians of "
        f"{len(samples) // (2 * len(contexts))} runs",
        "",
        "| context (tokens) | mode | stages | blocks | KV moved (KiB) | total (ms) | downtime (ms) | achieved (MB/s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    precopy_ms: list[float] = []
    for context in contexts:
        downtimes: dict[str, float] = {}
        for mode in MODES:
            runs = [s for s in samples if s.context_tokens == context and s.mode == mode]
            downtime_ms = statistics.median(s.downtime_s for s in runs) * 1e3
            downtimes[mode] = downtime_ms
            lines.append(
                f"| {context} | {mode} | {statistics.median(s.stages for s in runs):.0f} "
                f"| {statistics.median(s.blocks for s in runs):.0f} "
                f"| {statistics.median(s.bytes for s in runs) / 1024:.0f} "
                f"| {statistics.median(s.total_s for s in runs) * 1e3:.1f} | {downtime_ms:.1f} "
                f"| {statistics.median(s.bandwidth_bytes_per_s for s in runs) / 1e6:.1f} |"
            )
        ratios.append(f"{context} tokens: {downtimes['stop-and-copy'] / downtimes['pre-copy']:.1f}x")
        precopy_ms.append(downtimes["pre-copy"])
    lines += ["", "downtime stop-and-copy / pre-copy: " + ", ".join(ratios)]
    lines.append(
        f"pre-copy downtime {contexts[-1]} / {contexts[0]} tokens: {precopy_ms[-1] / precopy_ms[0]:.2f}x (flat = 1)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; prints the table. Returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096], help="prompt lengths, tokens")
    p.add_argument("--repeats", type=int, default=3, help="runs per context and mode")
    p.add_argument("--rate-cap-mb-s", type=float, default=10.0, help="cross-domain transport cap, MB/s")
    ns = p.parse_args(argv)
    rate = ns.rate_cap_mb_s * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        topo = Path(tmp) / "topology.yaml"
        topo.write_text(TOPOLOGY)
        args = ["--topology", str(topo), "--num-blocks", "1024", "--grpc-rate-cap", str(rate)]
        args += ["--engine-option", "model.max_position_embeddings=8192", "--seed", "1"]
        procs = [LlumletProcess(i, args, Path(tmp) / f"{i}.log", engine="torch") for i in ("src", "dst")]
        try:
            for proc in procs:
                proc.spawn()
            for proc in procs:
                proc.wait_serving(timeout_s=120)
            samples = asyncio.run(_run((procs[0].address, procs[1].address), ns.contexts, ns.repeats))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.stop()
    print(_table(samples, ns.contexts, rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
