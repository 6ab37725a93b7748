"""Where a ``hilum sim`` run's time goes: cProfile of the default run under one policy, by cumulative time.

Runs ``sim.runner.DEFAULTS`` (the default run, as ``bench/bench_sim_default.py``) once under cProfile and
prints the profiled seconds, then the functions with the most cumulative time, each with its share of the
whole (cumulative shares overlap: a caller's includes its callees') and how many times it was called.
Profiling slows the run about 4x; the shares and the calls, not the seconds, are the figure. Run:

    .venv/bin/python bench/profile_sim.py [--policy hilum] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats

from sim.runner import DEFAULTS, run_simulation
from sim.schedulers import POLICY_NAMES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="hilum", choices=POLICY_NAMES)
    parser.add_argument("--top", type=int, default=25, help="functions shown")
    args = parser.parse_args()
    spec = dataclasses.replace(DEFAULTS, policy=args.policy)
    profile = cProfile.Profile()
    profile.runcall(run_simulation, spec)
    stats = pstats.Stats(profile, stream=io.StringIO())
    total_s = max(t for _, _, _, t, _ in stats.stats.values())  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)  # type: ignore[attr-defined]
    print(f"hilum sim defaults under {args.policy}: {total_s:.1f} profiled s")
    print(f"{'cumulative s':>12}  {'share':>6}  {'calls':>9}  function")
    for (path, line, name), (_, calls, _, cum_s, _) in rows[: args.top]:
        print(f"{cum_s:12.2f}  {cum_s / total_s:6.1%}  {calls:9d}  {path.rsplit('/', 2)[-1]}:{line}({name})")


if __name__ == "__main__":
    main()
