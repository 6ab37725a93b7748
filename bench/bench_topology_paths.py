"""Widest-path query throughput of ``topology.graph.TopologyGraph``.

Run: ``PYTHONPATH=. python bench/bench_topology_paths.py [--queries N] [--seed S]``. Prints, for the bundled
64x8-h100 example and a generated 512x8 = 4096-GPU fabric: the graph and tree build time, queries/s on fresh
random instance pairs (tree walk, cache mostly missing) and on repeated pairs (cache hits).
"""

from __future__ import annotations

import argparse
import random
import time

from topology.graph import TopologyGraph
from topology.load import load_topology, parse_topology
from topology.spec import Topology
from topology.synthetic import synthetic_topology_data


def bench(name: str, topo: Topology, queries: int, rng: random.Random) -> None:
    t0 = time.perf_counter()
    graph = TopologyGraph(topo)
    build_s = time.perf_counter() - t0
    ids = [i.instance_id for i in topo.instances]
    pairs = [tuple(rng.sample(ids, 2)) for _ in range(queries)]
    t0 = time.perf_counter()
    for src, dst in pairs:
        graph.path(src, dst)
    fresh_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for src, dst in pairs:
        graph.path(src, dst)
    cached_s = time.perf_counter() - t0
    print(
        f"{name:>16}: {topo.num_gpus:5d} GPUs, {len(ids):5d} instances, "
        f"{graph.graph.number_of_nodes():5d} vertices; "
        f"build {build_s * 1e3:7.1f} ms; fresh pairs {queries / fresh_s:10,.0f} queries/s; "
        f"cached {queries / cached_s:12,.0f} queries/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    bench("64x8-h100", load_topology("64x8-h100"), args.queries, rng)
    bench("synthetic 512x8", parse_topology(synthetic_topology_data(512), "synthetic-512x8"), args.queries, rng)


if __name__ == "__main__":
    main()
