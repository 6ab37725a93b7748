"""Simulator fidelity: the same trace through a live ``hilum up --engine sim`` cluster and through ``hilum sim``.

For each repeat, starts a fresh live cluster (``hilum up --engine sim``: every process real — etcd, the
coordinator, one domain scheduler per NVLink domain, one llumlet per instance with the simulated engine,
the gateway — on loopback ports), replays the trace against its gateway with ``hilum bench`` (streamed
``/v1/completions``, ``max_tokens`` = the trace's output length, ``ignore_eos``), and has ``hilum bench
--compare-sim`` run the simulator (policy ``hilum``) on exactly the replayed requests and arrivals, on the
topology and configuration file the cluster serves. Both sides therefore run the same decision cores
(``rack_sched.core``, ``global_coord.approver``, ``gateway.core``) with the same settings on the same
latency model; what differs is timing: the live control plane's real delays (gRPC, etcd, summaries in
flight, migrations that take wall time) against the simulator's event queue.

Prints, side by side, the live repeats, their mean, the simulator, and live/sim for TTFT P50 and P99, TBT
P50, and the committed migrations (all, inside a domain, across domains), with a verdict per figure
against ``--tolerance`` (issue 10 asks for TTFT P50/P99 and the migration counts within 20%). With
``--sim-seeds K`` the simulator runs K times on the first repeat's replayed requests (seeds from
``--seed``: the tie-breaks alone change) and the live mean is judged against the mean of those runs. Live
migrations are counted at the gateway (each owner change a response reports); the simulator counts
committed moves; both exclude aborted attempts.

Then where a committed move's time goes, live (each llumlet logs its moves' phases at INFO:
``MigrationReport.timing_line``; the cluster runs at ``--log-level INFO`` for it) against the simulator's
moves, inside a domain and across (p50 / p90), and the ``cost`` keys the live moves calibrate
(``setup_overhead_s``, ``stage_overhead_s``, ``suspend_resume_overhead_s``: docs/cost-model.md, "Calibrating
the fixed overheads"), beside the values of the configuration in use. ``bench/fidelity.yaml`` holds such a
calibration: ``--config bench/fidelity.yaml`` runs the cluster and the simulator with it.

Run (about 70 s of wall time per repeat on the default 200 requests):

    .venv/bin/python bench/fidelity.py [--topology FILE] [--config FILE] [--trace azure-conv]
        [--max-requests 200] [--rate-scale 4] [--repeats 2] [--tolerance 0.2] [--sim-seeds 1] [--out DIR]
        [--check]

Exit status: 0 done (``--check``: and every judged figure within tolerance); 1 a figure outside tolerance
with ``--check``, or the cluster or the replay failed (its log tail is printed); 2 a bad option.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import hilum_config  # noqa: E402
from llumlet.migration_types import TIMING_TAG, MigrationTiming, parse_timing_line  # noqa: E402
from sim.results import MigrationRecord, PolicySummary, StoredRun, load_results  # noqa: E402

HILUM = [sys.executable, "-m", "hilum_cli.main"]


@dataclass(frozen=True, slots=True)
class Figure:
    """One compared figure: its label, how to read it from a summary, its unit and whether it is judged."""

    label: str
    field: str
    scale: float  # multiply the summary's value (s for latencies, a count otherwise) by this to print it
    unit: str
    judged: bool  # compared against --tolerance


FIGURES = (
    Figure("TTFT p50", "ttft_p50_s", 1e3, "ms", True),
    Figure("TTFT p99", "ttft_p99_s", 1e3, "ms", True),
    Figure("TBT p50", "tbt_p50_s", 1e3, "ms", False),
    Figure("migrations", "migrations", 1.0, "", True),
    Figure("  intra-domain", "migrations_intra_domain", 1.0, "", False),
    Figure("  cross-domain", "migrations_cross_domain", 1.0, "", False),
)


def value(summary: PolicySummary, field: str) -> float | None:
    """``field`` of ``summary`` (``migrations``: intra + cross committed), None where the run had none."""
    if field == "migrations":
        return float(summary.migrations_intra_domain + summary.migrations_cross_domain)
    raw = getattr(summary, field)
    return None if raw is None else float(raw)


class FidelityError(Exception):
    """The live cluster or the replay failed; the message says which and carries the log tail."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_up(proc: subprocess.Popen[bytes], run_dir: Path, log: Path, timeout_s: float) -> str:
    """Wait until ``hilum up`` wrote ``cluster.json`` and its gateway answers /health; returns the URL."""
    deadline = time.monotonic() + timeout_s
    cluster = run_dir / "cluster.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FidelityError(
                f"hilum up exited with status {proc.returncode} before the cluster was up:\n{_tail(log)}"
            )
        if cluster.exists():
            try:
                url = str(json.loads(cluster.read_text(encoding="utf-8"))["gateway_url"])
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return url
            except (OSError, ValueError, KeyError, urllib.error.URLError):
                pass
        time.sleep(0.5)
    raise FidelityError(f"the cluster was not up within {timeout_s:.0f} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``hilum up`` as Ctrl-C does (it stops and reaps every child), SIGKILL after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True, slots=True)
class Repeat:
    """One repeat: the live and the simulated run, and the live moves' timing lines (cross-domain or not)."""

    live: StoredRun
    sim: StoredRun
    timings: tuple[tuple[bool, MigrationTiming], ...]  # committed moves: (cross-domain, where the time went)


def live_timings(run_dir: Path) -> tuple[tuple[bool, MigrationTiming], ...]:
    """The committed moves' timing lines in the llumlets' logs of ``hilum up``'s ``run_dir`` (each llumlet logs
    one per MigrateOut at INFO, ``MigrationReport.timing_line``), each flagged cross-domain from
    ``cluster.json`` (the destination's address -> its instance -> its domain)."""
    info = json.loads((run_dir / "cluster.json").read_text(encoding="utf-8"))
    domain_of = info["instance_domains"]
    domain_at = {addr: domain_of[iid] for iid, addr in info["llumlets"].items()}
    out: list[tuple[bool, MigrationTiming]] = []
    for log in sorted(run_dir.glob("*.log")):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            if TIMING_TAG not in line or ": committed " not in line:
                continue
            timing = parse_timing_line(line)
            head = line.split(": migrate ", 1)
            if timing is None or len(head) != 2:
                continue
            src_id = head[0].rsplit(" ", 1)[-1]
            dst_addr = head[1].split(" -> ", 1)[1].split(":", 2)
            dst = ":".join(dst_addr[:2])
            if src_id in domain_of and dst in domain_at:
                out.append((domain_of[src_id] != domain_at[dst], timing))
    return tuple(out)


def run_once(ns: argparse.Namespace, work: Path, repeat: int) -> Repeat:
    """One fresh live cluster, one replay with the simulator beside it.

    Raises:
        FidelityError: if the cluster does not come up, or ``hilum bench`` fails (log tails included).
    """
    run_dir = work / f"cluster-{repeat}"
    up_log, bench_log, out = work / f"up-{repeat}.log", work / f"bench-{repeat}.log", work / f"bench-{repeat}"
    up_cmd = [*HILUM, "up", "--engine", "sim", "--port", "0", "--etcd-port", "0", "--grpc-base-port", "0"]
    up_cmd += ["--run-dir", str(run_dir), "--seed", str(ns.seed), "--log-level", "INFO"]  # INFO: timing lines
    if ns.topology:
        up_cmd += ["--topology", ns.topology]
    if ns.config:
        up_cmd += ["--config", ns.config]
    env = {k: v for k, v in os.environ.items() if k != "HILUM_CONFIG"}  # the file is named, or none
    with up_log.open("wb") as log:
        proc = subprocess.Popen(up_cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = _wait_up(proc, run_dir, up_log, ns.start_timeout)
        bench_cmd = [*HILUM, "bench", "--url", url, "--trace", ns.trace, "--max-requests", str(ns.max_requests)]
        bench_cmd += ["--rate-scale", str(ns.rate_scale), "--seed", str(ns.seed), "--out", str(out)]
        bench_cmd += ["--compare-sim", str(run_dir / "topology.yaml")]
        if ns.config:
            bench_cmd += ["--config", str(run_dir / "hilum.yaml")]
        with bench_log.open("wb") as log:
            status = subprocess.run(bench_cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        if status != 0:
            raise FidelityError(f"hilum bench exited with status {status}:\n{_tail(bench_log)}")
    finally:
        _stop(proc)
    runs = load_results(out / "results.json")
    if len(runs) != 2:
        raise FidelityError(f"{out}/results.json: expected the live and the simulated run, found {len(runs)}")
    return Repeat(runs[0], runs[1], live_timings(run_dir))


def _fmt(x: float | None, figure: Figure) -> str:
    if x is None:
        return "-"
    return f"{x * figure.scale:.1f}" if figure.unit else f"{x:.0f}"


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean, None when any value is missing (or there is none)."""
    known = [x for x in values if x is not None]
    return statistics.fmean(known) if len(known) == len(values) and known else None


def report(lives: Sequence[PolicySummary], sims: Sequence[PolicySummary], tolerance: float) -> tuple[str, bool]:
    """The side-by-side table and whether every judged figure is within ``tolerance``: the live repeats' mean
    against the simulated runs' (one run, or one per seed: ``--sim-seeds``)."""
    sim_head = "sim" if len(sims) == 1 else f"sim mean of {len(sims)}"
    heads = [f"live #{i + 1}" for i in range(len(lives))] + ["live mean", sim_head, "live/sim", "verdict"]
    rows = [["figure", *heads]]
    ok = True
    for fig in FIGURES:
        lv = [value(s, fig.field) for s in lives]
        mean = _mean(lv)
        sv = _mean([value(s, fig.field) for s in sims])
        ratio = mean / sv if mean is not None and sv else None
        if not fig.judged:
            verdict = "shown"
        elif ratio is None:
            verdict, ok = "n/a", False
        elif abs(ratio - 1.0) <= tolerance:
            verdict = "within"
        else:
            verdict, ok = "OUTSIDE", False
        label = f"{fig.label} {fig.unit}".rstrip()
        rows.append(
            [
                label,
                *(_fmt(x, fig) for x in lv),
                _fmt(mean, fig),
                _fmt(sv, fig),
                "-" if ratio is None else f"{ratio:.2f}",
                verdict,
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    return "\n".join(lines) + "\n", ok


def _pct(xs: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``xs``, None when empty."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def timing_report(repeats: Sequence[Repeat]) -> str:
    """Where a committed move's time goes, live (the llumlets' timing lines) against the simulator (its
    records), inside a domain and across: p50 / p90 in ms over every repeat's moves."""
    rows: list[list[str]] = [["phase (ms, p50 / p90)", "live intra", "live cross", "sim intra", "sim cross"]]

    def cell(xs: Sequence[float]) -> str:
        p50, p90 = _pct(xs, 0.5), _pct(xs, 0.9)
        return "-" if p50 is None or p90 is None else f"{p50 * 1e3:.1f} / {p90 * 1e3:.1f} (n={len(xs)})"

    def live(pick: str, cross: bool) -> list[float]:
        ts = [t for r in repeats for c, t in r.timings if c == cross]
        if pick == "stage":
            return [x for t in ts for x, b in zip(t.stage_s, t.blocks, strict=False) if b > 0]
        if pick == "stages":
            return [float(sum(1 for b in t.blocks[:-1] if b > 0)) for t in ts]
        return [getattr(t, pick) for t in ts]

    def sim(pick: str, cross: bool) -> list[float]:
        ms: list[MigrationRecord] = [
            m for m in repeats[0].sim.migrations if m.outcome == "committed" and m.cross_domain == cross
        ]
        if pick == "total_s":
            return [m.end_s - m.start_s for m in ms]
        if pick == "downtime_s":
            return [m.downtime_s for m in ms]
        if pick == "stages":
            return [float(m.stages - 1) for m in ms]
        return []

    def gaps(cross: bool) -> list[float]:
        return [m.downtime_s for r in repeats for m in r.live.migrations if m.cross_domain == cross]

    phases = (
        ("MigrateOut, command -> committed", "total_s"),
        ("  setup: command -> Reserve sent", "setup_s"),
        ("  Reserve round trip", "reserve_s"),
        ("  one live stage that sends blocks", "stage"),
        ("  live stages per move (count)", "stages"),
        ("  last live stage -> suspend asked", "presuspend_s"),
        ("  suspend: ask -> suspended", "suspend_wait_s"),
        ("  last stage (+ token flush)", "last_s"),
        ("  Commit round trip", "commit_s"),
        ("downtime: suspended -> committed", "downtime_s"),
    )
    for label, pick in phases:
        scale = 1e-3 if pick == "stages" else 1.0  # counts print as themselves
        row = [label]
        for cross in (False, True):
            row.append(cell([x * scale for x in live(pick, cross)]))
        for cross in (False, True):
            row.append(cell([x * scale for x in sim(pick, cross)]))
        rows.append(row)
    rows.append(["token gap at the client (gateway)", cell(gaps(False)), cell(gaps(True)), "-", "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) + "\n"
        for r in rows
    )


def calibration(repeats: Sequence[Repeat]) -> dict[str, float] | None:
    """The ``cost`` keys these live moves measure (docs/cost-model.md, "Calibrating the fixed overheads"), each
    a median over the committed moves inside a domain of every repeat: ``setup_overhead_s`` = setup + Reserve
    round trip + last live stage -> suspend asked; ``stage_overhead_s`` = the wall time of a live stage that
    sent blocks; ``suspend_resume_overhead_s`` = the downtime. Inside a domain the sim engines' local
    transport moves no bytes and is not paced, so all of that is control plane (across domains the grpc
    stream is paced to the path's share: its stages also hold the copy time the cost model prices anyway; on
    a real engine, subtract each stage's copy, its bytes / the path's rate). None without such moves."""
    ts = [t for r in repeats for cross, t in r.timings if not cross]
    stage = [x for t in ts for x, b in zip(t.stage_s, t.blocks, strict=False) if b > 0]
    if not ts:
        return None
    return {
        "setup_overhead_s": statistics.median(t.setup_s + t.reserve_s + t.presuspend_s for t in ts),
        "stage_overhead_s": statistics.median(stage) if stage else 0.0,
        "suspend_resume_overhead_s": statistics.median(t.downtime_s for t in ts),
    }


def sim_spread(repeat: Repeat, work: Path, config: str | None, seeds: Sequence[int]) -> list[PolicySummary]:
    """The simulator alone on the first repeat's replayed requests (as ``hilum bench --compare-sim`` ran it:
    its topology and configuration file), once per seed: how much the simulated figures move with the seeded
    tie-breaks alone. The repeat's own seed reproduces its simulated row."""
    from hilum_cli.bench import simulate
    from sim.results import summarize
    from sim.traces import Trace, TraceRequest

    replayed = sorted(repeat.sim.requests, key=lambda r: r.arrival_s)
    t0 = replayed[0].arrival_s
    trace = Trace(
        "replayed",
        "bench/fidelity.py",
        "",
        tuple(TraceRequest(r.request_id, r.arrival_s - t0, r.prompt_tokens, r.output_tokens) for r in replayed),
    )
    run_dir = work / "cluster-0"
    cfg = str(run_dir / "hilum.yaml") if config else None
    return [summarize(simulate(trace, str(run_dir / "topology.yaml"), seed, cfg)) for seed in seeds]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=None, help="topology file or bundled name (default: hilum up's local-2x2)")
    p.add_argument("--config", default=None, help="hilum configuration file for the cluster and the simulator")
    p.add_argument("--trace", default="azure-conv", help="bundled trace name or trace file (default azure-conv)")
    p.add_argument("--max-requests", type=int, default=200, help="first N requests of the trace (default 200)")
    p.add_argument("--rate-scale", type=float, default=4.0, help="compress arrivals X times (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="live runs, each on a fresh cluster (default 2)")
    p.add_argument("--tolerance", type=float, default=0.2, help="allowed |live/sim - 1| (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, the cluster and the simulation")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds the cluster may take to start")
    p.add_argument("--out", default=None, help="keep the logs and results.json files here (default: temporary)")
    p.add_argument("--check", action="store_true", help="exit 1 if a judged figure is outside --tolerance")
    p.add_argument(
        "--sim-seeds", type=int, default=1, help="also run the simulator alone with this many seeds (default 1: no)"
    )
    ns = p.parse_args(argv)
    if ns.max_requests < 1 or ns.repeats < 1 or ns.sim_seeds < 1:
        p.error("--max-requests, --repeats and --sim-seeds must be >= 1")
    if not (math.isfinite(ns.rate_scale) and ns.rate_scale > 0 and math.isfinite(ns.tolerance) and ns.tolerance >= 0):
        p.error("--rate-scale must be > 0 and --tolerance >= 0")
    if ns.config and not Path(ns.config).is_file():
        p.error(f"--config {ns.config}: no such file")

    with tempfile.TemporaryDirectory(prefix="hilum-fidelity-") as tmp:
        work = Path(ns.out) if ns.out else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        repeats: list[Repeat] = []
        for repeat in range(ns.repeats):
            print(
                f"fidelity: live run {repeat + 1}/{ns.repeats} (hilum up --engine sim + hilum bench) ...",
                file=sys.stderr,
                flush=True,
            )
            try:
                repeats.append(run_once(ns, work, repeat))
            except FidelityError as exc:
                print(f"fidelity: error: {exc}", file=sys.stderr)
                return 1
        seeds = list(range(ns.seed, ns.seed + ns.sim_seeds))
        spread: list[PolicySummary] = []
        if ns.sim_seeds > 1:
            try:
                spread = sim_spread(repeats[0], work, ns.config, seeds)
            except (ValueError, OSError) as exc:  # the live results are still printed, judged against seed 0
                print(f"fidelity: error: the simulator's runs with seeds {seeds}: {exc}", file=sys.stderr)
    lives = [r.live.summary for r in repeats]
    sims = [r.sim.summary for r in repeats]
    if any(value(s, f.field) != value(sims[0], f.field) for s in sims[1:] for f in FIGURES):  # deterministic
        print(
            "fidelity: note: the simulated rows differ between repeats (the replayed requests differed)",
            file=sys.stderr,
        )
    topo = ns.topology or "local-2x2 (hilum up's built-in)"
    print(
        f"fidelity: {ns.max_requests} requests of {ns.trace} at x{ns.rate_scale:g} on {topo}, "
        f"config {ns.config or 'defaults'}, tolerance {ns.tolerance:.0%}"
    )
    table, ok = report(lives, spread or sims[:1], ns.tolerance)
    print(table, end="")
    print("\nwhere a committed move's time goes (live: the llumlets' timing lines; sim: its records)")
    print(timing_report(repeats), end="")
    if spread:
        print(f"\nthe simulator alone on live #1's replayed requests, seeds {seeds[0]}..{seeds[-1]}:")
        for fig in FIGURES:
            label = f"{fig.label} {fig.unit}".rstrip()
            print(f"  {label:<16}" + "  ".join(f"{_fmt(value(s, fig.field), fig):>8}" for s in spread))
    measured = calibration(repeats)
    if measured is not None:
        used = hilum_config.load_config(ns.config).cost
        print("\ncalibration (put these in the config's cost section to price and simulate moves as measured):")
        for key, val in measured.items():
            print(f"  cost.{key}: {val:.4f}   (the config in use: {getattr(used, key):g})")
    return 1 if ns.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
