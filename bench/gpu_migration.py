"""GPU check: live migration between two torch-engine llumlet processes on one GPU, blocks copied by CUDA IPC.

Needs only PyTorch with CUDA and hilum's light dependencies (no vLLM, no network, no model download: the
engine is the seeded tiny Llama of ``llumlet.engine.torch_engine``, made bigger so that its KV is worth
moving). Two ``python -m llumlet --engine torch --engine-option device=cuda`` processes share the GPU, in one
NVLink domain of an inline topology, so each migration takes the ``local`` transport: the source exports
its KV pool once through CUDA IPC and the destination copies the blocks it names GPU to GPU into its
reservation (``llumlet.kvpool``). For each context length a greedy request runs once unmigrated on the
destination (the reference), then again on the source, migrated in pre-copy stages once it decodes.
Printed per context: KV size, pre-copy stages, downtime (request suspended -> destination committed),
pre-copy bandwidth (``MigrateOutReply.precopy_bandwidth_bytes_per_s``), the transport the report names,
and whether the migrated stream is token-for-token the reference. Exit status 1 when a stream differs, a
migration did not commit, or (on CUDA) a move did not take the peer-copy path.

Usage::

    PYTHONPATH=. python bench/gpu_migration.py                      # CUDA, contexts 256 .. 8192
    PYTHONPATH=. python bench/gpu_migration.py --device cpu --contexts 64 256 --layers 2 --hidden 128
                                                                    # the same path on the host (a dry run:
                                                                    # shared-memory pools instead of CUDA IPC)
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
name: gpu-migration-check
models:
  - {name: tiny, num_layers: 2, num_attention_heads: 4, num_kv_heads: 2, head_dim: 16, hidden_size: 64,
     dtype: float32, block_size_tokens: 16, num_params: 1000000, max_context_tokens: 16384}
gpu_types:
  - {name: gpu, memory_gib: 80, hbm_gbyte_per_s: 2000, nvlink_gbyte_per_s: 450}
domains:
  - id: node
    kind: node
    gpu_type: gpu
    nodes: [{id: node-0, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: src, gpus: [0], tensor_parallel_size: 1, model: tiny, kv_capacity_blocks: 1024}
      - {id: dst, gpus: [1], tensor_parallel_size: 1, model: tiny, kv_capacity_blocks: 1024}
fabric:
  oversubscription: 1.0
  racks:
    - {id: rack-0, domains: [node]}
"""


@dataclass(frozen=True, slots=True)
class Sample:
    """One migrated request."""

    context_tokens: int
    kv_bytes: int
    stages: int
    downtime_s: float
    precopy_bandwidth_bytes_per_s: float
    transport: str
    identical: bool


async def _stream(col: TokenCollector, client: LlumletClient, rid: str, prompt: list[int], max_tokens: int) -> None:
    col.expect(rid, client.address)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reply = await client.submit(rid, col.address, params, prompt_token_ids=prompt)
    if not reply.accepted:
        raise RuntimeError(f"{rid}: not accepted: {reply.reason}")


async def _one(
    col: TokenCollector, src: LlumletClient, dst: LlumletClient, context: int, max_tokens: int, run: int
) -> Sample:
    prompt = [random.Random(context * 1000 + run).randrange(3, 512) for _ in range(context)]
    ref_id, rid = f"ref-{context}-{run}", f"mig-{context}-{run}"
    await _stream(col, dst, ref_id, prompt, max_tokens)
    reference = await col.wait(ref_id, 600)
    await _stream(col, src, rid, prompt, max_tokens)
    while len(col.get(rid).token_ids) < 4:  # decoding
        await asyncio.sleep(0.001)
    rep = await src.migrate_out(rid, dst.address, 1, dst_instance_id="dst")
    if rep.outcome != pb.MIGRATION_COMMITTED:
        raise RuntimeError(f"{rid}: migration {pb.MigrationOutcome.Name(rep.outcome)}: {rep.reason}")
    got = await col.wait(rid, 600)
    return Sample(
        context,
        rep.bytes,
        rep.stages,
        rep.downtime_s,
        rep.precopy_bandwidth_bytes_per_s,
        rep.transport,
        got.token_ids == reference.token_ids and got.error == "" and got.epoch == 1,
    )


async def _run(addresses: tuple[str, str], contexts: Sequence[int], repeats: int, max_tokens: int) -> list[Sample]:
    col = TokenCollector()
    await col.start()
    src, dst = LlumletClient(addresses[0]), LlumletClient(addresses[1])
    try:
        await _one(col, src, dst, contexts[0], max_tokens, -1)  # warm-up: CUDA context, IPC handles opened
        return [await _one(col, src, dst, c, max_tokens, i) for c in contexts for i in range(repeats)]
    finally:
        await src.close()
        await dst.close()
        await col.stop()


def _table(samples: list[Sample], contexts: Sequence[int], device: str) -> str:
    lines = [
        f"torch engine on {device}, two llumlet processes, one NVLink domain (local transport); "
        f"medians of {len(samples) // len(contexts)} runs",
        "",
        "| context (tokens) | KV moved (MiB) | stages | downtime (ms) | pre-copy bandwidth (GB/s) | transport "
        "| stream identical |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    downtimes = []
    for c in contexts:
        runs = [s for s in samples if s.context_tokens == c]
        downtime_ms = statistics.median(s.downtime_s for s in runs) * 1e3
        downtimes.append(downtime_ms)
        lines.append(
            f"| {c} | {statistics.median(s.kv_bytes for s in runs) / 2**20:.1f} "
            f"| {statistics.median(s.stages for s in runs):.0f} | {downtime_ms:.1f} "
            f"| {statistics.median(s.precopy_bandwidth_bytes_per_s for s in runs) / 1e9:.2f} "
            f"| {', '.join(sorted({s.transport for s in runs}))} | {all(s.identical for s in runs)} |"
        )
    lines += ["", f"downtime {contexts[-1]} / {contexts[0]} tokens: {downtimes[-1] / downtimes[0]:.2f}x (flat = 1)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; prints the table. Returns 0 when every move committed with an identical stream."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:<i>, or cpu for a dry run")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 8192], help="prompt tokens")
    p.add_argument("--repeats", type=int, default=3, help="runs per context")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--layers", type=int, default=8, help="tiny Llama layers")
    p.add_argument("--hidden", type=int, default=1024, help="tiny Llama hidden size (heads of 64)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV pool per engine, blocks of 16 tokens")
    p.add_argument("--timeout-s", type=float, default=300.0, help="start-up limit of each llumlet")
    ns = p.parse_args(argv)
    heads = max(1, ns.hidden // 64)
    model = {
        "num_hidden_layers": ns.layers,
        "hidden_size": ns.hidden,
        "intermediate_size": 2 * ns.hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": ns.hidden // heads,
        "max_position_embeddings": max(ns.contexts) + ns.max_tokens + 16,
    }
    with tempfile.TemporaryDirectory() as tmp:
        topo = Path(tmp) / "topology.yaml"
        topo.write_text(TOPOLOGY)
        args = ["--topology", str(topo), "--num-blocks", str(ns.num_blocks), "--seed", "1"]
        args += ["--engine-option", f"device={ns.device}"]
        for key, value in model.items():
            args += ["--engine-option", f"model.{key}={value}"]
        procs = [LlumletProcess(i, args, Path(tmp) / f"{i}.log", engine="torch") for i in ("src", "dst")]
        try:
            for proc in procs:
                proc.spawn()
            for proc in procs:
                proc.wait_serving(timeout_s=ns.timeout_s)
            addresses = (procs[0].address, procs[1].address)
            samples = asyncio.run(_run(addresses, ns.contexts, ns.repeats, ns.max_tokens))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.stop()
    print(_table(samples, ns.contexts, ns.device))
    bad = [s for s in samples if not s.identical or (ns.device != "cpu" and s.transport != "local")]
    for s in bad:
        print(f"FAILED: {s.context_tokens} tokens: transport {s.transport}, stream identical {s.identical}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
