"""Where a ``hilum sim`` run's time goes: cProfile of one run under one policy, by cumulative time.

Runs ``sim.runner.DEFAULTS`` (the default run, as ``bench/bench_sim_default.py``) once under cProfile, or with
``--synthetic N`` ``bench/bench_sim_speed.py``'s workload at N instances (8-GPU H100 nodes, 8 ShareGPT requests
per instance at 0.5 req/s per instance), and prints the profiled seconds, then the functions with the most
cumulative time, each with its share of the whole (cumulative shares overlap: a caller's includes its callees'),
how many times it was called and its profiled microseconds per simulated request (compare two sizes by that
column: a function whose cost per request grows with the cluster keeps the simulator from being flat in size).
``--sort tottime`` ranks by time spent in the function itself. Profiling slows the run 4-10x; the shares and the
calls, not the seconds, are the figure. Times are CPU seconds of this process (the machine is shared). Run:

    .venv/bin/python bench/profile_sim.py [--policy hilum] [--synthetic 1024] [--top 25] [--sort tottime]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time

import hilum_compiled

hilum_compiled.install()  # before the simulator is imported: its compiled modules, when built

from sim.runner import DEFAULTS, SimSpec, run_simulation  # noqa: E402
from sim.schedulers import POLICY_NAMES  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from topology.load import parse_topology  # noqa: E402
from topology.synthetic import synthetic_topology_data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="hilum", choices=POLICY_NAMES)
    parser.add_argument("--synthetic", type=int, default=0, help="instances of a synthetic fabric (0: the defaults)")
    parser.add_argument("--top", type=int, default=25, help="functions shown")
    parser.add_argument("--sort", default="cumulative", choices=("cumulative", "tottime"))
    args = parser.parse_args()
    profile = cProfile.Profile(time.process_time)  # CPU time: the machine is shared
    if args.synthetic:
        n = args.synthetic
        topo = parse_topology(synthetic_topology_data(max(1, n // 8)), source=f"synthetic-{n}")
        trace = load_trace("sharegpt", num_requests=8 * n, rate_per_s=0.5 * n, seed=0)
        what, requests = f"synthetic fabric of {n} instances", len(trace.requests)
        profile.runcall(run_simulation, SimSpec(topo.name, "sharegpt", args.policy), trace=trace, topology=topo)
    else:
        what, requests = "hilum sim defaults", DEFAULTS.max_requests or 0
        profile.runcall(run_simulation, dataclasses.replace(DEFAULTS, policy=args.policy))
    stats = pstats.Stats(profile, stream=io.StringIO())
    table = stats.stats  # type: ignore[attr-defined]
    total_s = max(t for _, _, _, t, _ in table.values())
    column = 3 if args.sort == "cumulative" else 2
    rows = sorted(table.items(), key=lambda kv: kv[1][column], reverse=True)
    print(f"{what} under {args.policy}: {total_s:.1f} profiled s, {requests} requests")
    print(f"{args.sort + ' s':>14}  {'share':>6}  {'calls':>9}  {'us/request':>10}  function")
    for (path, line, name), stat in rows[: args.top]:
        s, calls, where = stat[column], stat[1], f"{path.rsplit('/', 2)[-1]}:{line}({name})"
        print(f"{s:14.2f}  {s / total_s:6.1%}  {calls:9d}  {s / max(1, requests) * 1e6:10.1f}  {where}")


if __name__ == "__main__":
    main()
