"""Where the simulator's cost per request grows with the cluster: time per simulated request by kind of event.

Runs ``bench/bench_sim_speed.py``'s workload (8-GPU H100 nodes, one TP1 Llama-2-7B instance per GPU, 8 ShareGPT
requests per instance at 0.5 req/s per instance, policy hilum by default) at each size and splits each run's time by
the kind of event it was spent in (``sim.events.EventKind``):

- ``STEP_DONE``: an engine step or a decode run ending on an instance, and the next one starting;
- ``ARRIVAL``: a request arriving and being dispatched (the gateway's domain, then the domain's instance);
- ``TICK``: the periodic rescheduling and cross-domain rounds;
- ``SUMMARY``: the domains publishing their summaries, and the gateway receiving them;
- ``MIGRATION``, ``SCRIPTED``, ``SAMPLE``: migration stages, scripted drains, KV usage samples;
- ``outside events``: the run's set-up and its end (building the cluster, closing the request log).

Every size's domains see the same load (eight instances at 0.5 req/s each), so each kind's work per request is about
the same at every size (a periodic event visits every domain: fewer events per request on a larger cluster, each
doing more), and a kind whose cost per request grows does the same work more slowly (memory further from the CPU) or
more work (something that grows with the cluster). Each event is timed with ``time.perf_counter``
(``EventQueue.run_next`` wrapped, here only: about 0.1 µs an event, where a CPU clock costs 0.6 µs a reading), and so
is the whole run; its CPU time is the last row (on a machine busy with other work the wall times grow, and only their
shares mean much). The first size is run ``--repeats`` times (median shown), the others once each: as
``bench_sim_speed.py`` notes, a large run's cost moves by a third between runs on a shared machine. Read the split,
not the last digit. Run:

    .venv/bin/python bench/sim_event_costs.py [--sizes 16,1024,4096] [--policy hilum] [--repeats 20]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable

import hilum_compiled

hilum_compiled.install()  # before the simulator is imported: its compiled modules, when built
from sim.events import EventKind, EventQueue  # noqa: E402
from sim.runner import SimSpec, run_simulation  # noqa: E402
from sim.schedulers import POLICY_NAMES  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from topology.load import parse_topology  # noqa: E402
from topology.synthetic import synthetic_topology_data  # noqa: E402

OUTSIDE = "outside events"


def timed_events(spent: dict[str, float]) -> Callable[[], None]:
    """Wrap ``EventQueue.run_next`` so that each event's wall seconds add to ``spent[kind name]``; returns the undo."""
    original = EventQueue.run_next

    def run_next(queue: EventQueue) -> bool:
        heap = queue._heap  # the event about to run: its kind (read here only)
        if not heap:
            return original(queue)
        kind = EventKind(heap[0].kind).name
        t0 = time.perf_counter()
        ran = original(queue)
        spent[kind] += time.perf_counter() - t0
        return ran

    EventQueue.run_next = run_next  # type: ignore[method-assign, assignment]

    def undo() -> None:
        EventQueue.run_next = original  # type: ignore[method-assign]

    return undo


def measure(n: int, policy: str) -> dict[str, float]:
    """µs per request of one run at ``n`` instances: wall time split by event kind (and ``OUTSIDE``), adding up to
    ``"total"``, and the process's CPU time, ``"CPU"``."""
    topo = parse_topology(synthetic_topology_data(n // 8), source=f"synthetic-{n}")
    trace = load_trace("sharegpt", num_requests=8 * n, rate_per_s=0.5 * n, seed=0)
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    undo = timed_events(spent)
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        run_simulation(SimSpec(topology=topo.name, trace="sharegpt", policy=policy), trace=trace, topology=topo)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        undo()
    per_request = 1e6 / len(trace.requests)
    split = {kind: s * per_request for kind, s in spent.items()}
    split[OUTSIDE] = wall * per_request - sum(split.values())
    split["total"] = wall * per_request
    split["CPU"] = cpu * per_request
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,1024,4096")
    parser.add_argument("--policy", default="hilum", choices=POLICY_NAMES)
    parser.add_argument("--repeats", type=int, default=20, help="runs of the first size (median shown)")
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: comma-separated instance counts, got {args.sizes!r}")
    if any(n < 8 or n % 8 for n in sizes):
        parser.error(f"--sizes: multiples of 8 instances (whole 8-GPU nodes), got {args.sizes!r}")
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1, got {args.repeats}")
    measure(sizes[0], args.policy)  # a warm-up, not counted (bench_sim_speed.py)
    columns: list[dict[str, float]] = []
    for k, n in enumerate(sizes):
        runs = [measure(n, args.policy) for _ in range(args.repeats if k == 0 else 1)]
        columns.append({key: statistics.median(r.get(key, 0.0) for r in runs) for key in {k for r in runs for k in r}})
    rows = [kind.name for kind in EventKind if any(kind.name in c for c in columns)] + [OUTSIDE, "total", "CPU"]
    print(f"policy {args.policy}; µs per simulated request by event kind (wall; the run's CPU time last); "
          f"{hilum_compiled.status()}")  # fmt: skip
    print(f"{'':>15}" + "".join(f"{n:>10}" for n in sizes) + f"{'growth':>10}")
    for row in rows:
        first, last = columns[0].get(row, 0.0), columns[-1].get(row, 0.0)
        print(f"{row:>15}" + "".join(f"{c.get(row, 0.0):>10.1f}" for c in columns) + f"{last - first:>+10.1f}")


if __name__ == "__main__":
    main()
