"""The cost of recording a run's final requests (``sim.results.RequestLog``) on this checkout against another commit.

Issue #12's profile put ~7 % of a simulation's CPU in ``RequestLog.add`` (every record JSON-encoded into the
spool as the request finished). This script isolates that cost: it simulates a run once (``--max-requests`` of
``hilum sim``'s default run, this checkout), keeps its final records in the order they finished, and then, in
fresh processes of this checkout's interpreter with ``PYTHONPATH`` pointing at one side's tree (the other commit,
``--base``, default ``main``, extracted with ``git archive``), sides alternating for ``--rounds`` rounds, times
on each side: ``add`` of every record in finish order, reading every record back, and ``write_results`` of the
log (CPU time, user + system). It prints the medians in µs per request, the ratio base / this checkout, the
spool's bytes per request, and whether both sides wrote the same ``results.json`` (byte for byte). Run:

    .venv/bin/python bench/bench_request_log.py [--base main] [--max-requests 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_sim_vs_commit import alternating, child_output, trees  # noqa: E402

# One side in a child process: prints {phase: CPU s, ...} for the records pickled in argv[1].
_CHILD = r"""
import dataclasses, hashlib, json, pickle, sys, tempfile, time
from sim.results import RequestLog, write_results
records_file, run_file = sys.argv[1:3]
with open(records_file, "rb") as f:
    order, records = pickle.load(f)
with open(run_file, "rb") as f:
    run = pickle.load(f)
log = RequestLog(len(records))
t0 = time.process_time()
for i in order:
    log.add(i, records[i])
t1 = time.process_time()
back = list(log)
t2 = time.process_time()
with tempfile.TemporaryDirectory() as out:
    path = write_results([dataclasses.replace(run, requests=log)], out)
    t3 = time.process_time()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
assert back == records
spool_bytes = log._end  # both sides count the bytes written so (spool_bytes is new)
print(json.dumps({"add": t1 - t0, "read": t2 - t1, "write": t3 - t2, "spool_bytes": spool_bytes, "digest": digest}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="the commit to compare with (any git revision)")
    parser.add_argument("--max-requests", type=int, default=5000, help="requests of the default run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from sim.runner import DEFAULTS, run_simulation

    run = run_simulation(dataclasses.replace(DEFAULTS, max_requests=args.max_requests))
    records = list(run.requests)
    finish = [r.finish_s if r.finish_s is not None else float("inf") for r in records]
    order = sorted(range(len(records)), key=lambda i: (finish[i], i))  # as the simulator adds them
    with tempfile.TemporaryDirectory(prefix="hilum-records-") as tmp, trees(args.base) as tree:
        records_file, run_file = Path(tmp) / "records.pickle", Path(tmp) / "run.pickle"
        records_file.write_bytes(pickle.dumps((order, records)))
        run_file.write_bytes(pickle.dumps(dataclasses.replace(run, requests=())))
        got: dict[str, list[dict[str, float | str]]] = {"base": [], "this": []}
        for side in alternating(args.rounds):
            got[side].append(json.loads(child_output(tree[side], _CHILD, str(records_file), str(run_file))))
    n = len(records)
    gaps = sum(len(r.token_gaps_s) for r in records) / n
    print(f"{n} requests of the default run ({gaps:.0f} token gaps each), base {args.base} vs this checkout,")
    print(f"CPU µs per request, median of {args.rounds} rounds")
    print(f"{'phase':<8} {'base':>8} {'this':>8} {'base / this':>12}")
    for phase in ("add", "read", "write"):
        b = statistics.median(float(g[phase]) for g in got["base"]) / n * 1e6
        t = statistics.median(float(g[phase]) for g in got["this"]) / n * 1e6
        print(f"{phase:<8} {b:>8.1f} {t:>8.1f} {b / t:>11.2f}x")
    spool = {side: float(got[side][0]["spool_bytes"]) / n for side in got}
    print(f"spool bytes per request: base {spool['base']:.0f}, this {spool['this']:.0f}")
    digests = {str(g["digest"]) for side in got for g in got[side]}
    print("results.json: " + ("identical on both sides" if len(digests) == 1 else f"DIFFERS ({sorted(digests)})"))
    if len(digests) != 1:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
