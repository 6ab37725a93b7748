"""Simulator cost against cluster size: CPU time per simulated request at 16, 256, 1,024 and 4,096 instances.

Each size is a synthetic fabric of 8-GPU H100 nodes (``topology.synthetic``), one TP1 Llama-2-7B instance
per GPU, fed ShareGPT lengths with Poisson arrivals at ``--per-instance-rate`` requests/s per instance (a
moderate load) for ``--requests-per-instance`` requests per instance, so every size simulates about the same
span of time with the same load per instance: a flat per-request cost means the cost of a cluster grows
only with its work. Runs one policy (``--policy``, default hilum, the two-tier design) per size; every size is
run several times and the median shown: ``--repeats`` (5) runs of the sizes below 1,024, which take well under a
second, ``--large-repeats`` (3) of the larger ones (about 2 and 10 CPU-s at 1,024 and 4,096 instances), whose single
runs move by a third from one to the next on a shared machine (``range`` shows the lowest and highest ratio). One
run of the first size comes first, untimed: the first run of a process costs more (a 16-instance run up to 4x).

The first size is the yardstick, and it is measured beside each run of another size: ``--beside`` runs of it just
before and as many just after (a run of 16 instances takes 20-40 ms), and that run's ratio is its cost per
request over the median of those; "vs first" is the median of a size's ratios. On a shared machine whose speed
drifts by tens of percent within minutes, a ratio of two figures measured a minute apart says more about the drift
than about the simulator. Prints CPU time (this process, user + system) per request, its ratio to the first size
beside it, wall time, simulated time, simulated seconds per CPU second, and the CPU time the cyclic collector took
in the run (``gc.callbacks``; `sim.runner._GC_YOUNG_THRESHOLD`), and the page faults the run took (memory it touched
for the first time, which the system must clear: ``getrusage``'s minor faults). Run:

    .venv/bin/python bench/bench_sim_speed.py [--sizes 16,256,1024,4096] [--policy hilum]   # sizes: multiples of 8

``--loop-interval-s 1`` runs the periodic loops once a second at every size (a policy's decisions then differ): what
remains of the gap between the sizes is the cost of the requests' own events, not of the loops over every instance.
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
import statistics
import time

import hilum_compiled

hilum_compiled.install()  # before the simulator is imported: its compiled modules, when built
from policy.types import MIN_LOOP_INTERVAL_S  # noqa: E402
from sim.results import summarize  # noqa: E402
from sim.runner import SimSpec, run_simulation  # noqa: E402
from sim.schedulers import POLICY_NAMES  # noqa: E402
from sim.traces import MAX_SPAN_S, load_trace  # noqa: E402
from topology.load import parse_topology  # noqa: E402
from topology.synthetic import synthetic_topology_data  # noqa: E402

_LOOPS = ("migrate_interval_s", "summary_interval_s", "cross_interval_s")  # SimOptions' periods of the loops


def measure(
    n: int, policy: str, requests_per_instance: int, rate: float, loop_interval_s: float | None = None
) -> tuple[float, float, float, int, float, int]:
    """(CPU s, wall s, simulated s, engine steps, CPU s in the cyclic collector, page faults) of one run at ``n``
    instances; ``loop_interval_s``: the period of the periodic loops (rescheduling, summaries, cross-domain rounds),
    None for the configuration's."""
    topo = parse_topology(synthetic_topology_data(n // 8), source=f"synthetic-{n}")
    count = n * requests_per_instance
    trace = load_trace("sharegpt", num_requests=count, rate_per_s=n * rate, seed=0)
    collector = [0.0, 0.0]  # CPU s in collections so far, CPU time at the start of the one running

    def timed(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            collector[1] = time.process_time()
        else:
            collector[0] += time.process_time() - collector[1]

    gc.callbacks.append(timed)
    try:
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu0, wall0 = time.process_time(), time.perf_counter()
        loops = {} if loop_interval_s is None else dict.fromkeys(_LOOPS, loop_interval_s)
        spec = SimSpec(topology=topo.name, trace="sharegpt", policy=policy, options=loops)
        run = run_simulation(spec, trace=trace, topology=topo)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    finally:
        gc.callbacks.remove(timed)
    s = summarize(run)
    assert s.finished == count, f"{s.finished} of {count} requests finished"
    assert run.engine_steps is not None  # a simulated run counts its steps
    return cpu, wall, run.sim_duration_s, run.engine_steps, collector[0], faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,256,1024,4096")
    parser.add_argument("--policy", default="hilum", choices=POLICY_NAMES)
    parser.add_argument("--requests-per-instance", type=int, default=8)
    parser.add_argument("--per-instance-rate", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5, help="runs of sizes below 1,024 (median shown)")
    parser.add_argument("--large-repeats", type=int, default=3, help="runs of sizes of 1,024 and more (median shown)")
    parser.add_argument("--beside", type=int, default=5, help="runs of the first size before and after each run")
    parser.add_argument(
        "--loop-interval-s",
        type=float,
        default=None,
        metavar="S",
        help="period of the periodic loops (rescheduling, summaries, cross-domain rounds), every size (default: the "
        "configuration's, 0.05 / 0.25 / 0.5 s): a long one shows what the cost is without them",
    )
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: comma-separated instance counts, got {args.sizes!r}")
    if any(n < 8 or n % 8 for n in sizes):  # the fabric is whole 8-GPU nodes
        parser.error(f"--sizes: multiples of 8 instances (whole 8-GPU nodes), got {args.sizes!r}")
    for option in ("repeats", "large_repeats", "beside", "requests_per_instance"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')}: must be >= 1, got {getattr(args, option)}")
    if not 0 < args.per_instance_rate < math.inf:
        parser.error(f"--per-instance-rate: a finite number > 0 of requests/s, got {args.per_instance_rate:g}")
    lowest = 2 * args.requests_per_instance / MAX_SPAN_S  # the arrivals' span, about requests / rate, with room
    if args.per_instance_rate < lowest:
        parser.error(
            f"--per-instance-rate {args.per_instance_rate:g}: {args.requests_per_instance} requests per instance would "
            f"arrive over about {args.requests_per_instance / args.per_instance_rate:.3g} s, and a simulation spans at "
            f"most {MAX_SPAN_S:,.0f} s (30 days): at least {lowest:.3g} requests/s"
        )
    if args.loop_interval_s is not None and not MIN_LOOP_INTERVAL_S <= args.loop_interval_s < math.inf:
        parser.error(f"--loop-interval-s: a finite number >= {MIN_LOOP_INTERVAL_S:g} s, got {args.loop_interval_s:g}")
    loops = "" if args.loop_interval_s is None else f"; every loop every {args.loop_interval_s:g} s"
    print(f"policy {args.policy}, {args.requests_per_instance} ShareGPT requests per instance at "
          f"{args.per_instance_rate:g} req/s per instance{loops}; CPU = user + system of this process; each run beside "
          f"{args.beside} run{'s' if args.beside > 1 else ''} of {sizes[0]} instances before and after it; "
          f"{hilum_compiled.status()}")  # fmt: skip
    header = (
        "instances",
        "requests",
        "CPU us/req",
        "vs first",
        "range",
        "CPU s",
        "wall s",
        "sim s",
        "sim s/CPU s",
        "steps",
        "gc s",
        "faults",
    )
    print("{:>9} {:>9} {:>11} {:>9} {:>12} {:>8} {:>8} {:>7} {:>12} {:>10} {:>6} {:>8}".format(*header))

    def run(n: int) -> tuple[float, float, float, int, float, int]:
        return measure(n, args.policy, args.requests_per_instance, args.per_instance_rate, args.loop_interval_s)

    requests_per_instance: int = args.requests_per_instance

    def per_request_us(n: int, cpu_s: float) -> float:
        return cpu_s / (n * requests_per_instance) * 1e6

    first = sizes[0]
    run(first)  # a warm-up, not counted: the first run of a process pays for what later runs find ready
    yardstick: list[float] = []  # every run of the first size, CPU us per request
    for n in sizes:
        runs, ratios = [], []
        beside = 0 if n == first else args.beside  # the first size is its own yardstick
        for _ in range(args.repeats if n < 1024 else args.large_repeats):
            before = [per_request_us(first, run(first)[0]) for _ in range(beside)]
            runs.append(run(n))
            cost = per_request_us(n, runs[-1][0])
            around = before + [per_request_us(first, run(first)[0]) for _ in range(beside)]
            yardstick += around or [cost]
            ratios.append(cost / statistics.median(around or [cost]))
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        _, _, sim_s, steps, _, _ = runs[0]
        collector = statistics.median(r[4] for r in runs)
        faults = statistics.median(r[5] for r in runs)
        count = n * requests_per_instance
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 and n != first else "-"
        print(
            f"{n:>9} {count:>9} {per_request_us(n, cpu):>11.0f} {statistics.median(ratios):>8.2f}x {spread:>12} "
            f"{cpu:>8.2f} {wall:>8.2f} {sim_s:>7.1f} {sim_s / cpu:>12.1f} {steps:>10} {collector:>6.2f} {faults:>8.0f}",
            flush=True,
        )
    if len(sizes) > 1:
        low, high, mid = min(yardstick), max(yardstick), statistics.median(yardstick)
        print(f"{len(yardstick)} runs of {first} instances: {low:.0f} to {high:.0f} CPU us a request, median {mid:.0f}")


if __name__ == "__main__":
    main()
