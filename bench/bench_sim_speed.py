"""Simulator cost against cluster size: CPU time per simulated request at 16, 256, 1,024 and 4,096 instances.

Each size is a synthetic fabric of 8-GPU H100 nodes (``topology.synthetic``), one TP1 Llama-2-7B instance
per GPU, fed ShareGPT lengths with Poisson arrivals at ``--per-instance-rate`` requests/s per instance (a
moderate load) for ``--requests-per-instance`` requests per instance, so every size simulates about the same
span of time with the same load per instance: a flat per-request cost means the cost of a cluster grows
only with its work. Runs one policy (``--policy``, default hilum, the two-tier design) per size; the
smaller sizes are repeated (``--repeats``, the median is shown) because they take well under a second.
Prints CPU time (this process, user + system) per request, its ratio to the first size, wall time,
simulated time, and simulated seconds per CPU second. Run:

    .venv/bin/python bench/bench_sim_speed.py [--sizes 16,256,1024,4096] [--policy hilum]
"""

from __future__ import annotations

import argparse
import statistics
import time

import hilum_compiled

hilum_compiled.install()  # before the simulator is imported: its compiled modules, when built
from sim.results import summarize  # noqa: E402
from sim.runner import SimSpec, run_simulation  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from topology.load import parse_topology  # noqa: E402
from topology.synthetic import synthetic_topology_data  # noqa: E402


def measure(n: int, policy: str, requests_per_instance: int, rate: float) -> tuple[float, float, float, int]:
    """(CPU s, wall s, simulated s, engine steps) of one run at ``n`` instances."""
    topo = parse_topology(synthetic_topology_data(max(1, n // 8)), source=f"synthetic-{n}")
    count = n * requests_per_instance
    trace = load_trace("sharegpt", num_requests=count, rate_per_s=n * rate, seed=0)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run = run_simulation(SimSpec(topology=topo.name, trace="sharegpt", policy=policy), trace=trace, topology=topo)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    s = summarize(run)
    assert s.finished == count, f"{s.finished} of {count} requests finished"
    assert run.engine_steps is not None  # a simulated run counts its steps
    return cpu, wall, run.sim_duration_s, run.engine_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,256,1024,4096")
    parser.add_argument("--policy", default="hilum")
    parser.add_argument("--requests-per-instance", type=int, default=8)
    parser.add_argument("--per-instance-rate", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5, help="runs of sizes below 1,024 (median shown)")
    args = parser.parse_args()
    print(f"policy {args.policy}, {args.requests_per_instance} ShareGPT requests per instance at "
          f"{args.per_instance_rate:g} req/s per instance; CPU = user + system of this process; "
          f"{hilum_compiled.status()}")  # fmt: skip
    header = ("instances", "requests", "CPU us/req", "vs first", "CPU s", "wall s", "sim s", "sim s/CPU s", "steps")
    print("{:>9} {:>9} {:>11} {:>9} {:>8} {:>8} {:>7} {:>12} {:>10}".format(*header))
    first: float | None = None
    for n in (int(x) for x in args.sizes.split(",")):
        runs = [measure(n, args.policy, args.requests_per_instance, args.per_instance_rate)]
        while n < 1024 and len(runs) < args.repeats:
            runs.append(measure(n, args.policy, args.requests_per_instance, args.per_instance_rate))
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        _, _, sim_s, steps = runs[0]
        count = n * args.requests_per_instance
        per_request_us = cpu / count * 1e6
        first = first or per_request_us
        print(
            f"{n:>9} {count:>9} {per_request_us:>11.0f} {per_request_us / first:>8.2f}x {cpu:>8.1f} {wall:>8.1f} "
            f"{sim_s:>7.1f} {sim_s / cpu:>12.1f} {steps:>10}",
            flush=True,
        )


if __name__ == "__main__":
    main()
