"""Fingerprints of simulation runs, to check that a change to the simulator's hot path changed no decision.

Runs a fixed set of simulations (the default run under every policy, and variants that exercise
priorities, drains, scale-outs, prefix sharing, the autoscaler and a larger two-tier fabric), and for each
one hashes every request record (TTFT, every TBT gap, preemptions, migrations, where it finished), every
migration record, the KV usage timeline and the engine step count. ``--save FILE`` writes the fingerprints
(one digest per request, so a difference names the first request that differs); ``--compare FILE`` runs
the same set and exits non-zero, naming what differs, unless every run is identical. Typical use: save on
``main``, compare on the branch. Run:

    .venv/bin/python bench/sim_fingerprint.py --save before.json [--cases default-hilum,...]
    .venv/bin/python bench/sim_fingerprint.py --compare before.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import hilum_compiled

hilum_compiled.install()  # before the simulator is imported: its compiled modules, when built

from sim.results import SimRun  # noqa: E402
from sim.runner import DEFAULTS, SimSpec, run_simulation  # noqa: E402
from sim.schedulers import POLICY_NAMES  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from topology.load import parse_topology  # noqa: E402
from topology.synthetic import synthetic_topology_data  # noqa: E402


def _synthetic(n: int, policy: str) -> Callable[[], SimRun]:
    """``bench/bench_sim_speed.py``'s workload at ``n`` instances (8 ShareGPT requests each, 0.5 req/s each)."""

    def run() -> SimRun:
        topo = parse_topology(synthetic_topology_data(max(1, n // 8)), source=f"synthetic-{n}")
        trace = load_trace("sharegpt", num_requests=8 * n, rate_per_s=0.5 * n, seed=0)
        return run_simulation(SimSpec(topo.name, "sharegpt", policy), trace=trace, topology=topo)

    return run


def _spec(spec: SimSpec) -> Callable[[], SimRun]:
    return lambda: run_simulation(spec)


MOONCAKE = SimSpec("2x8-a100-40gb", "mooncake-conv", "hilum", rate_scale=3.0, max_requests=1000)
CASES: dict[str, Callable[[], SimRun]] = {
    **{f"default-{p}": _spec(dataclasses.replace(DEFAULTS, policy=p)) for p in POLICY_NAMES},
    "hilum-priorities-drain-scale-out": _spec(
        dataclasses.replace(
            DEFAULTS,
            max_requests=2000,
            options={"priority_fraction": 0.2, "drain": ("node-0-i3@30",), "scale_out": ("node-1-i7@20",)},
        )
    ),
    "llumnix-priorities-whole-prompt": _spec(
        dataclasses.replace(
            DEFAULTS,
            policy="llumnix",
            max_requests=2000,
            options={"priority_fraction": 0.2, "admission": "whole-prompt"},
        )
    ),
    **{
        f"mooncake-prefix-{p}": _spec(dataclasses.replace(MOONCAKE, policy=p, options={"prefix_caching": True}))
        for p in ("least-loaded", "llumnix", "hilum")
    },
    "hilum-autoscale": _spec(
        dataclasses.replace(DEFAULTS, max_requests=2000, options={"autoscale": True, "initial_instances": 4})
    ),
    "synthetic-256-hilum": _synthetic(256, "hilum"),
}


def fingerprint(run: SimRun) -> dict[str, object]:
    """Digests of one run: per request (in arrival order), of the migrations, the KV timeline and the totals."""

    def digest(value: object) -> str:
        return hashlib.sha256(repr(value).encode()).hexdigest()[:16]

    return {
        "requests": [[r.request_id, digest(r)] for r in run.requests],
        "migrations": digest(run.migrations),
        "num_migrations": len(run.migrations),
        # as tuples: the digest of the timeline's values, whichever sequence type holds them
        "kv": digest(
            dataclasses.replace(run.kv, usage_fraction={k: tuple(v) for k, v in run.kv.usage_fraction.items()})
        ),
        "engine_steps": run.engine_steps,
        "sim_duration_s": run.sim_duration_s,
        "scale_events": digest(run.scale_events),
    }


def differences(want: dict[str, object], got: dict[str, object]) -> list[str]:
    """What differs between two fingerprints of one case (empty: identical)."""
    out = []
    want_reqs, got_reqs = want["requests"], got["requests"]
    assert isinstance(want_reqs, list) and isinstance(got_reqs, list)
    if len(want_reqs) != len(got_reqs):
        out.append(f"{len(got_reqs)} requests, want {len(want_reqs)}")
    bad = [w[0] for w, g in zip(want_reqs, got_reqs, strict=False) if w != g]
    if bad:
        out.append(f"{len(bad)} request records differ, first {bad[0]}")
    for key in ("migrations", "num_migrations", "kv", "engine_steps", "sim_duration_s", "scale_events"):
        if want[key] != got[key]:
            out.append(f"{key}: {got[key]} != {want[key]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path, help="write the fingerprints here")
    mode.add_argument("--compare", type=Path, help="compare with fingerprints saved here")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    saved: dict[str, dict[str, object]] = json.loads(args.compare.read_text()) if args.compare else {}
    missing = [c for c in names if args.compare and c not in saved]
    if missing:
        parser.error(f"{args.compare} has no fingerprint of {missing}")
    got: dict[str, dict[str, object]] = {}
    failed = False
    print(hilum_compiled.status())  # compiled or plain Python: the fingerprints must not depend on it
    for name in names:
        cpu0 = time.process_time()
        got[name] = fingerprint(CASES[name]())
        cpu_s = time.process_time() - cpu0
        if args.compare:
            diff = differences(saved[name], got[name])
            failed |= bool(diff)
            verdict = "identical" if not diff else "DIFFERS: " + "; ".join(diff)
        else:
            verdict = "saved"
        print(f"{name:<36} {len(got[name]['requests']):>6} requests  {cpu_s:6.1f} CPU s  {verdict}", flush=True)  # type: ignore[arg-type]
    if args.save:
        args.save.write_text(json.dumps(got))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
