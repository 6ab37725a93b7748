"""What ``hilum`` costs before it does anything: start-up CPU time on this checkout against another commit.

``bench/bench_vs_vidur.py`` charges each simulator its whole process, start-up included, so the imports a
``hilum sim`` run pays for count against it. Each command below runs as a fresh process of this checkout's
interpreter with ``PYTHONPATH`` pointing at one side's tree (the other commit, ``--base``, default ``main``,
extracted with ``git archive`` into a temporary folder, as ``bench/bench_sim_vs_commit.py`` does), the two
sides alternating (which one goes first alternates too) for ``--rounds`` rounds. Each run is charged the CPU
time (user + system) of the child process (``getrusage(RUSAGE_CHILDREN)``); the table gives the median per
side and the ratio base / this checkout. Commands:

- ``hilum --help``, ``hilum sim --help``: what ``hilum`` (``hilum_cli.main.main``) imports to print them; the
  two sides' output is compared (``same`` when identical);
- ``import sim.runner``: the simulator's core, as a script running simulations imports it;
- ``hilum sim, N requests``: a whole short run (``--max-requests --short-requests``, ``--policy
  round-robin``), start-up, trace loading and the printed tables included (its tables hold wall times, so
  its output is not compared).

Run:

    .venv/bin/python bench/bench_startup.py [--base main] [--rounds 10] [--short-requests 100]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_sim_vs_commit import alternating, trees  # noqa: E402

# ``hilum ARGS``: what the installed ``hilum`` script runs, with the arguments after ``-c CODE``
_HILUM = "import sys; from hilum_cli.main import main; sys.exit(main(sys.argv[1:]))"


def commands(short_requests: int) -> dict[str, tuple[list[str], bool]]:
    """Label -> (the interpreter's arguments, whether both sides must print the same)."""
    return {
        "hilum --help": (["-c", _HILUM, "--help"], True),
        "hilum sim --help": (["-c", _HILUM, "sim", "--help"], True),
        "import sim.runner": (["-c", "import sim.runner"], True),
        f"hilum sim, {short_requests} requests": (
            ["-c", _HILUM, "sim", "--max-requests", str(short_requests), "--policy", "round-robin"],
            False,
        ),
    }


def run_once(tree: Path, args: list[str]) -> tuple[float, str]:
    """(CPU s of the child process, its stdout) of ``python ARGS`` against ``tree``'s code.

    Raises SystemExit with the child's stderr when it fails.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, *args],
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "COLUMNS": "120"},
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: python {' '.join(args[:3])} ... failed:\n{out.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="the commit to compare with (any git revision)")
    parser.add_argument("--rounds", type=int, default=10, help="runs of each command per side (default 10)")
    parser.add_argument("--short-requests", type=int, default=100, help="requests of the short run (default 100)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.short_requests < 1:
        parser.error(f"--short-requests must be >= 1, got {args.short_requests}")
    with trees(args.base) as tree:
        print(f"start-up: base {args.base} vs this checkout; CPU s of the whole process, median of {args.rounds}")
        print(f"{'command':<26} {'base CPU s':>11} {'this CPU s':>11} {'base / this':>12}  output")
        for label, (argv, compared) in commands(args.short_requests).items():
            cpu: dict[str, list[float]] = {"base": [], "this": []}
            outputs: dict[str, set[str]] = {"base": set(), "this": set()}
            for side in alternating(args.rounds):
                spent, stdout = run_once(tree[side], argv)
                cpu[side].append(spent)
                outputs[side].add(stdout)
            base_s, this_s = statistics.median(cpu["base"]), statistics.median(cpu["this"])
            same = "-" if not compared else "same" if outputs["base"] == outputs["this"] else "DIFFERS"
            print(f"{label:<26} {base_s:>11.2f} {this_s:>11.2f} {base_s / this_s:>11.2f}x  {same}", flush=True)


if __name__ == "__main__":
    main()
