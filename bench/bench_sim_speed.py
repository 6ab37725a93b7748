"""Simulator speed: simulated requests and engine steps per wall-clock second at 16, 256 and 4096 instances.

Each size is a synthetic fabric of 8-GPU H100 nodes (``topology.synthetic``), one TP1 Llama-2-7B instance
per GPU, fed ShareGPT lengths with Poisson arrivals at ``--per-instance-rate`` requests/s per instance
(a moderate load) for ``--requests-per-instance`` requests per instance. Runs one policy per size
(``--policy``, default hilum, the two-tier design) and prints the figures. Run:

    .venv/bin/python bench/bench_sim_speed.py [--sizes 16,256,4096] [--policy hilum]
"""

from __future__ import annotations

import argparse

from sim.results import summarize
from sim.runner import SimSpec, run_simulation
from sim.traces import load_trace
from topology.load import parse_topology
from topology.synthetic import synthetic_topology_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,256,4096")
    parser.add_argument("--policy", default="hilum")
    parser.add_argument("--requests-per-instance", type=int, default=8)
    parser.add_argument("--per-instance-rate", type=float, default=0.5)
    args = parser.parse_args()
    print(f"policy {args.policy}, {args.requests_per_instance} ShareGPT requests per instance")
    print(f"{'instances':>9} {'requests':>9} {'sim s':>8} {'wall s':>8} {'req/wall s':>11} {'steps/wall s':>13}")
    for n in (int(x) for x in args.sizes.split(",")):
        topo = parse_topology(synthetic_topology_data(max(1, n // 8)), source=f"synthetic-{n}")
        count = n * args.requests_per_instance
        trace = load_trace("sharegpt", num_requests=count, rate_per_s=n * args.per_instance_rate, seed=0)
        run = run_simulation(
            SimSpec(topology=topo.name, trace="sharegpt", policy=args.policy), trace=trace, topology=topo
        )
        s = summarize(run)
        assert s.finished == count, f"{s.finished} of {count} requests finished"
        print(
            f"{n:>9} {count:>9} {run.sim_duration_s:>8.1f} {run.wall_s:>8.1f} {count / run.wall_s:>11.0f} "
            f"{run.engine_steps / run.wall_s:>13.0f}"
        )


if __name__ == "__main__":
    main()
