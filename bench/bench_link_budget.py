"""Concurrent migrations on one link: the cost model's prediction beside the live llumlets' measured times.

Four sim llumlet processes on node ``node-a`` (domain ``dom-a``) and four on ``node-b`` (``dom-b``), 10 Gb/s
NICs: every cross-domain move crosses both NICs, whose migration budget is 20% of 10 Gb/s = 250 MB/s
(``cost.cap_fraction``), shared by every migration on the link (``llumlet.linkbudget``; the llumlets of the run
share one ``--link-budget-scope``). For k = 2, 3, 4, k requests (one per source instance, the same prompt)
are migrated at the same moment, each to its own destination instance. The prediction is
``topology.cost.plan_migration`` for one of them with ``existing_flows = k - 1``, the request's tokens at the
command and the source's measured step time; the measurement is each ``MigrateOut`` reply's ``total_s``
(command -> committed). Repeats cycle through k, so drift in the machine's load hits every k alike.

Usage::

    PYTHONPATH=. python bench/bench_link_budget.py [--flows 2 3 4] [--repeats 2] [--prompt-tokens 600]

Prints one row per k: predicted and measured seconds, their ratio and whether it is within 30%.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.client import LlumletClient
from llumlet.engine.types import SamplingParams
from llumlet.linkbudget import LinkBudgets
from llumlet.procs import LlumletProcess
from llumlet.sink import TokenCollector
from topology.cost import CostConfig, MigrationCostInput, plan_migration
from topology.graph import TopologyGraph
from topology.load import parse_topology

INSTANCES = 4
_MODEL = {
    "name": "llama-2-7b", "num_layers": 32, "num_attention_heads": 32, "num_kv_heads": 32, "head_dim": 128,
    "hidden_size": 4096, "dtype": "float16", "block_size_tokens": 16, "num_params": 6738415616,
    "max_context_tokens": 4096,
}  # fmt: skip
TOPOLOGY: dict[str, object] = {
    "name": "bench-link-budget",
    "models": [_MODEL],
    "gpu_types": [{"name": "a100-80gb", "memory_gib": 80, "hbm_gbyte_per_s": 2039, "nvlink_gbyte_per_s": 600}],
    "domains": [
        {
            "id": f"dom-{d}",
            "kind": "node",
            "gpu_type": "a100-80gb",
            "nodes": [{"id": f"node-{d}", "num_gpus": INSTANCES, "nic_gbit_per_s": 10}],
            "instances": [
                {
                    "id": f"{d}{i}",
                    "gpus": [i],
                    "tensor_parallel_size": 1,
                    "model": "llama-2-7b",
                    "kv_capacity_blocks": 512,
                }
                for i in range(INSTANCES)
            ],
        }
        for d in ("a", "b")
    ],
    "fabric": {"oversubscription": 1.0, "racks": [{"id": "rack-0", "domains": ["dom-a", "dom-b"]}]},
}


@dataclass(frozen=True, slots=True)
class Row:
    flows: int
    predicted_s: float
    measured_s: list[float]


async def _round(
    col: TokenCollector,
    srcs: list[LlumletClient],
    dsts: list[LlumletClient],
    k: int,
    prompt_tokens: int,
    tag: str,
    graph: TopologyGraph,
) -> tuple[float, list[float]]:
    rids = [f"{tag}-{i}" for i in range(k)]
    for rid, src in zip(rids, srcs, strict=False):
        col.expect(rid, src.address)
        reply = await src.submit(rid, col.address, SamplingParams(max_tokens=3000), prompt_tokens=prompt_tokens)
        if not reply.accepted:
            raise RuntimeError(f"{rid}: not accepted: {reply.reason}")
    while any(len(col.get(rid).token_ids) < 8 for rid in rids):  # decoding, the step time measured
        await asyncio.sleep(0.005)
    loads = [await src.get_load() for src in srcs[:k]]
    commands = [
        src.migrate_out(rid, dst.address, 1, dst_instance_id=f"b{i}")
        for i, (rid, src, dst) in enumerate(zip(rids, srcs, dsts, strict=False))
    ]
    reps = await asyncio.gather(*commands)
    for rid, rep in zip(rids, reps, strict=True):
        if rep.outcome != pb.MIGRATION_COMMITTED:
            raise RuntimeError(f"{rid}: {pb.MigrationOutcome.Name(rep.outcome)}: {rep.reason}")
    for rid, dst in zip(rids, dsts, strict=False):
        await dst.abort(rid)
        await col.wait(rid, 30)
    model = graph.topology.models["llama-2-7b"]
    path = graph.path("a0", "b0")
    step_s = statistics.mean(load.recent_step_s for load in loads)
    tokens = statistics.mean(next(r.num_tokens for r in load.running) for load in loads)
    plan = plan_migration(
        MigrationCostInput(
            kv_tokens=round(tokens),
            kv_bytes_per_token=model.kv_bytes_per_token,
            block_size_tokens=model.block_size_tokens,
            decode_step_s=step_s,
            path_bandwidth_bytes_per_s=path.bandwidth_bytes_per_s,
            existing_flows=k - 1,
        ),
        CostConfig(),
    )
    return plan.completion_s, [rep.total_s for rep in reps]


async def _run(src_addresses: list[str], dst_addresses: list[str], flows: Sequence[int], repeats: int,
               prompt_tokens: int, graph: TopologyGraph) -> list[Row]:  # fmt: skip
    col = TokenCollector()
    await col.start()
    srcs = [LlumletClient(a, migrate_timeout_s=300) for a in src_addresses]
    dsts = [LlumletClient(a) for a in dst_addresses]
    rows = {k: Row(k, 0.0, []) for k in flows}
    predicted: dict[int, list[float]] = {k: [] for k in flows}
    try:
        await _round(col, srcs, dsts, 1, 64, "warm-up", graph)
        for rep in range(repeats):
            for k in flows:
                p, measured = await _round(col, srcs, dsts, k, prompt_tokens, f"k{k}-{rep}", graph)
                predicted[k].append(p)
                rows[k].measured_s.extend(measured)
    finally:
        for c in [*srcs, *dsts]:
            await c.close()
        await col.stop()
    return [Row(k, statistics.mean(predicted[k]), rows[k].measured_s) for k in flows]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; prints the table. Returns 0 when every k is within 30%, else 1."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flows", type=int, nargs="+", default=[2, 3, 4], help="concurrent moves on the link")
    p.add_argument("--repeats", type=int, default=2, help="rounds per k")
    p.add_argument("--prompt-tokens", type=int, default=600, help="each request's prompt, tokens")
    ns = p.parse_args(argv)
    if not all(1 <= k <= INSTANCES for k in ns.flows):
        p.error(f"--flows: each k must be 1..{INSTANCES}")
    graph = TopologyGraph(parse_topology(TOPOLOGY, "bench"))
    budget = graph.path("a0", "b0").bandwidth_bytes_per_s * CostConfig().cap_fraction
    with tempfile.TemporaryDirectory() as tmp:
        topo = Path(tmp) / "topology.yaml"
        topo.write_text(yaml.safe_dump(TOPOLOGY))
        scope = f"bench-{uuid.uuid4().hex}"
        args = ["--topology", str(topo), "--link-budget-scope", scope]
        procs = [
            LlumletProcess(f"{d}{i}", args, Path(tmp) / f"{d}{i}.log") for d in ("a", "b") for i in range(INSTANCES)
        ]
        try:
            for proc in procs:
                proc.spawn()
            for proc in procs:
                proc.wait_serving(timeout_s=120)
            addresses = [proc.address for proc in procs]
            rows = asyncio.run(
                _run(addresses[:INSTANCES], addresses[INSTANCES:], ns.flows, ns.repeats, ns.prompt_tokens, graph)
            )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.stop()
            LinkBudgets.remove_scope(scope)
    print(
        f"{ns.prompt_tokens}-token requests, sources on node-a, destinations on node-b; NIC budget "
        f"{budget / 1e6:.0f} MB/s each, shared by the moves on it; {ns.repeats} rounds per k"
    )
    print()
    print("| concurrent moves | predicted (s) | measured mean (s) | measured min-max (s) | measured / predicted |")
    print("|---:|---:|---:|---:|---:|")
    ok = True
    for row in rows:
        mean = statistics.mean(row.measured_s)
        ratio = mean / row.predicted_s
        ok &= abs(ratio - 1) <= 0.3
        print(
            f"| {row.flows} | {row.predicted_s:.2f} | {mean:.2f} | {min(row.measured_s):.2f}-{max(row.measured_s):.2f} "
            f"| {ratio:.2f} |"
        )
    print()
    print("every k within 30% of the prediction" if ok else "NOT within 30% for some k")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
