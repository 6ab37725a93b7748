"""The simulator's CPU time on this checkout against another commit, side by side, alternating.

A change to the simulator's hot path is judged by the same runs on both sides: the other commit (``--base``,
default ``main``) is extracted with ``git archive`` into a temporary folder, and each run is a fresh process
of this checkout's interpreter with ``PYTHONPATH`` pointing at one side's tree, the two sides alternating
(which one goes first alternates too) for ``--rounds`` rounds. Each run is charged the CPU time (user +
system) of ``run_simulation`` alone (the trace and topology loaded before the clock starts); the table
gives the median per side, the ratio base / this checkout, and whether both sides' request records and
migrations were identical (a digest of them, as ``bench/sim_fingerprint.py``). Workloads:

- ``default``: ``hilum sim``'s embedded defaults (16 Llama-2-13B instances, 5,000 Azure conversation
  requests at 2.75x), under each ``--policies``;
- ``vidur``: issue #12's workload as ``bench/bench_vs_vidur.py`` writes it (its topology file, from
  ``--vidur-topology``; the first 10,000 Azure conversation requests at their recorded rate);
- ``synthetic-N``: ``bench/bench_sim_speed.py``'s workload at N instances.

Both sides run as plain Python (``HILUM_PURE_PYTHON=1``), so the ratio is the code change's own; with
``--this-compiled`` this checkout runs its compiled modules (``hilum_compiled``, built by ``make``; the header
says whether they were in use), so ``--base HEAD --this-compiled`` measures what compiling gives. Run:

    .venv/bin/python bench/bench_sim_vs_commit.py [--base main] [--workload default] [--rounds 3] [--this-compiled]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from sim.schedulers import POLICY_NAMES

# One run in a child process: prints [CPU s of run_simulation, simulated s, digest of the records].
_CHILD = r"""
import dataclasses, hashlib, json, sys, time
try:
    import hilum_compiled  # this checkout's compiled modules (HILUM_PURE_PYTHON unset); another tree's sources
    hilum_compiled.install()
except ImportError:  # a commit before hilum_compiled
    pass
from sim.runner import DEFAULTS, SimSpec, run_simulation
workload, policy, vidur_topology = sys.argv[1:4]
trace = topology = None
if workload == "default":
    spec = dataclasses.replace(DEFAULTS, policy=policy)
elif workload == "vidur":
    spec = SimSpec(vidur_topology, "azure-conv", policy, rate_scale=1.0, max_requests=10_000)
else:
    from sim.traces import load_trace
    from topology.load import parse_topology
    from topology.synthetic import synthetic_topology_data
    n = int(workload.split("-", 1)[1])
    topology = parse_topology(synthetic_topology_data(max(1, n // 8)), source=f"synthetic-{n}")
    trace = load_trace("sharegpt", num_requests=8 * n, rate_per_s=0.5 * n, seed=0)
    spec = SimSpec(topology.name, "sharegpt", policy)
if trace is None:
    from sim.traces import load_trace
    trace = load_trace(spec.trace, rate_scale=spec.rate_scale, max_requests=spec.max_requests, seed=spec.seed)
cpu0 = time.process_time()
run = run_simulation(spec, trace=trace, topology=topology)
cpu_s = time.process_time() - cpu0
digest = hashlib.sha256(repr((tuple(run.requests), run.migrations)).encode()).hexdigest()[:16]
print(json.dumps([cpu_s, run.sim_duration_s, digest]))
"""


@contextlib.contextmanager
def trees(base: str) -> Iterator[dict[str, Path]]:
    """``{"base": commit base's tree, "this": this checkout}``: the commit is extracted with ``git archive`` into
    a temporary folder, removed on exit. Raises CalledProcessError when git cannot archive ``base``."""
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="hilum-base-") as tmp:
        archive = subprocess.run(["git", "-C", str(here), "archive", base], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield {"base": Path(tmp), "this": here}


def alternating(rounds: int) -> Iterator[str]:
    """The sides in the order they run: ``rounds`` rounds of both, which one goes first alternating."""
    for rnd in range(rounds):
        yield from ("base", "this") if rnd % 2 == 0 else ("this", "base")


def child_output(tree: Path, code: str, *args: str, compiled: bool = False) -> str:
    """The last line ``python -c code args`` prints, run by this interpreter on ``tree``'s sources (PYTHONPATH)
    in a fresh process, as plain Python unless ``compiled`` (then ``tree``'s compiled modules serve it, if this
    environment holds an up-to-date build of that tree); SystemExit with its stderr's tail when it fails."""
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    if not compiled:
        env["HILUM_PURE_PYTHON"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def run_once(
    tree: Path, workload: str, policy: str, vidur_topology: str, compiled: bool = False
) -> tuple[float, float, str]:
    """(CPU s, simulated s, records digest) of one run of ``tree``'s simulator (``compiled``: see child_output)."""
    out = child_output(tree, _CHILD, workload, policy, vidur_topology, compiled=compiled)
    cpu_s, sim_s, digest = json.loads(out)
    return float(cpu_s), float(sim_s), str(digest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="the commit to compare with (any git revision)")
    parser.add_argument("--workload", default="default", help="default, vidur or synthetic-N")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--vidur-topology",
        default=str(Path.home() / ".cache" / "hilum-bench-vs-vidur" / "hilum-topology.yaml"),
        help="the topology bench/bench_vs_vidur.py wrote (workload vidur)",
    )
    parser.add_argument("--this-compiled", action="store_true", help="this checkout runs its compiled modules")
    args = parser.parse_args()
    if args.workload not in ("default", "vidur") and not args.workload.startswith("synthetic-"):
        parser.error(f"unknown workload {args.workload!r}: default, vidur or synthetic-N")
    if args.workload == "vidur" and not Path(args.vidur_topology).is_file():
        parser.error(f"{args.vidur_topology} does not exist: run bench/bench_vs_vidur.py once first")
    policies = [p for p in args.policies.split(",") if p]
    with trees(args.base) as tree:
        this = "plain Python"
        if args.this_compiled:
            code = "import hilum_compiled; hilum_compiled.install(); print(hilum_compiled.status())"
            this = child_output(tree["this"], code, compiled=True)
        print(f"{args.workload}: base {args.base} (plain Python) vs this checkout ({this}); CPU s of run_simulation, "
              f"{args.rounds} round{'s' if args.rounds != 1 else ''}")  # fmt: skip
        print(f"{'policy':<13} {'sim s':>7} {'base CPU s':>11} {'this CPU s':>11} {'base / this':>12}  records")
        for policy in policies:
            cpu: dict[str, list[float]] = {"base": [], "this": []}
            digests: dict[str, set[str]] = {"base": set(), "this": set()}
            sim_s = 0.0
            for side in alternating(args.rounds):
                compiled = args.this_compiled and side == "this"
                spent, sim_s, digest = run_once(tree[side], args.workload, policy, args.vidur_topology, compiled)
                cpu[side].append(spent)
                digests[side].add(digest)
            base_s, this_s = statistics.median(cpu["base"]), statistics.median(cpu["this"])
            same = "identical" if digests["base"] == digests["this"] and len(digests["this"]) == 1 else "DIFFER"
            print(
                f"{policy:<13} {sim_s:>7.1f} {base_s:>11.2f} {this_s:>11.2f} {base_s / this_s:>11.2f}x  {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
