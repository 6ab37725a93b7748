"""The default ``hilum sim`` run: simulated seconds per CPU second for every policy, with decode runs and
with the step-by-step reference, side by side.

Runs ``sim.runner.DEFAULTS`` (16 Llama-2-13B instances on two A100-40GB nodes, the first 5,000 Azure
conversation requests at 2.75x their rate) once per policy and engine mode, alternating the two modes,
``--repeats`` rounds; prints the median CPU seconds (this process, user + system, the simulation alone:
trace and topology loading included, interpreter start-up not), the times real time (simulated seconds
per CPU second) and the speed-up of decode runs over the reference. The results of both modes are
checked equal, record for record. Run:

    .venv/bin/python bench/bench_sim_default.py [--repeats 3] [--policies round-robin,least-loaded,llumnix,hilum]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import hilum_compiled

hilum_compiled.install()  # before the simulator is imported: its compiled modules, when built
from sim.results import SimRun  # noqa: E402
from sim.runner import DEFAULTS, run_simulation  # noqa: E402
from sim.schedulers import POLICY_NAMES  # noqa: E402


def timed(policy: str, decode_runs: bool, max_requests: int | None) -> tuple[float, SimRun]:
    spec = dataclasses.replace(DEFAULTS, policy=policy, max_requests=max_requests, options={"decode_runs": decode_runs})
    cpu0 = time.process_time()
    run = run_simulation(spec)
    return time.process_time() - cpu0, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every run (the median is shown)")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated policies to run")
    parser.add_argument("--max-requests", type=int, default=DEFAULTS.max_requests, help="first N trace requests")
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    rounds = f"{args.repeats} round{'s' if args.repeats != 1 else ''}"
    print(f"hilum sim defaults ({DEFAULTS.topology}, {DEFAULTS.trace} x{DEFAULTS.rate_scale:g}, "
          f"{args.max_requests} requests); CPU = user + system of this process; {rounds}; "
          f"{hilum_compiled.status()}")  # fmt: skip
    cpu: dict[tuple[str, bool], list[float]] = {}
    sim_s: dict[str, float] = {}
    for rnd in range(args.repeats):
        for policy in policies:
            modes = (True, False) if rnd % 2 == 0 else (False, True)  # alternate which mode goes first
            runs = {}
            for decode_runs in modes:
                spent, runs[decode_runs] = timed(policy, decode_runs, args.max_requests)
                cpu.setdefault((policy, decode_runs), []).append(spent)
            fast, ref = runs[True], runs[False]
            if fast.requests != ref.requests or fast.migrations != ref.migrations:
                raise SystemExit(f"{policy}: decode runs and the step-by-step reference disagree")
            sim_s[policy] = fast.sim_duration_s
    header = ("policy", "sim s", "runs CPU s", "x real time", "ref CPU s", "x real time", "speed-up")
    print("{:<13} {:>7} {:>11} {:>12} {:>10} {:>12} {:>9}".format(*header))
    for policy in policies:
        fast_s = statistics.median(cpu[(policy, True)])
        ref_s = statistics.median(cpu[(policy, False)])
        t = sim_s[policy]
        print(
            f"{policy:<13} {t:>7.1f} {fast_s:>11.2f} {t / fast_s:>11.0f}x {ref_s:>10.2f} {t / ref_s:>11.0f}x "
            f"{ref_s / fast_s:>8.1f}x"
        )


if __name__ == "__main__":
    main()
