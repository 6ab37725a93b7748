"""bench/fidelity.py's side-by-side table: the verdict of each judged figure against the tolerance."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from sim.results import PolicySummary

_PATH = Path(__file__).resolve().parents[2] / "bench" / "fidelity.py"


def _fidelity() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fidelity_bench", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _summary(**fields: object) -> PolicySummary:
    base = PolicySummary(
        policy="x",
        requests=10,
        finished=10,
        refused=0,
        ttft_p50_s=1.0,
        ttft_p99_s=4.0,
        tbt_p50_s=0.013,
        tbt_p99_s=0.05,
        e2e_p99_s=9.0,
        high_priority_ttft_p99_s=None,
        preemptions=0,
        preempted_s=0.0,
        migrations_intra_domain=40,
        migrations_cross_domain=10,
        migrations_aborted=0,
        cross_domain_bytes=0,
        downtime_mean_s=0.01,
        downtime_p99_s=0.02,
        sim_duration_s=60.0,
        engine_steps=0,
        wall_s=60.0,
        requests_per_wall_s=None,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def _rows(table: str) -> dict[str, list[str]]:
    return {line[:16].strip(): line[16:].split() for line in table.splitlines()[1:]}


def test_figures_within_tolerance_pass_and_the_mean_of_repeats_is_compared() -> None:
    fidelity = _fidelity()
    sim = _summary()
    lives = [_summary(ttft_p50_s=1.1, migrations_intra_domain=36), _summary(ttft_p50_s=1.2, migrations_intra_domain=44)]
    table, ok = fidelity.report(lives, [sim], 0.2)
    rows = _rows(table)
    assert ok
    assert rows["TTFT p50 ms"] == ["1100.0", "1200.0", "1150.0", "1000.0", "1.15", "within"]
    assert rows["migrations"] == ["46", "54", "50", "50", "1.00", "within"]
    assert rows["intra-domain"][-1] == "shown"


def test_with_several_seeds_the_live_mean_is_judged_against_the_simulated_mean() -> None:
    fidelity = _fidelity()
    live = [_summary(migrations_intra_domain=50, migrations_cross_domain=10)]  # 60 moves
    sims = [_summary(migrations_intra_domain=30, migrations_cross_domain=10), _summary(migrations_intra_domain=70)]
    table, ok = fidelity.report(live, sims, 0.2)
    assert ok and "sim mean of 2" in table.splitlines()[0]
    assert _rows(table)["migrations"] == ["60", "60", "60", "1.00", "within"]  # (40 + 80) / 2
    _, alone = fidelity.report(live, sims[:1], 0.2)
    assert not alone  # 60 against the first seed's 40 alone: 1.50


def test_a_figure_outside_tolerance_or_missing_fails() -> None:
    fidelity = _fidelity()
    sim = _summary()
    table, ok = fidelity.report([_summary(ttft_p99_s=5.0)], [sim], 0.2)
    assert not ok
    assert _rows(table)["TTFT p99 ms"][-2:] == ["1.25", "OUTSIDE"]
    table, ok = fidelity.report([_summary(ttft_p50_s=None)], [sim], 0.2)
    assert not ok
    assert _rows(table)["TTFT p50 ms"][-1] == "n/a"


def _line(src: str, dst: str, outcome: str, **phases: float) -> str:
    from llumlet.migration_types import MigrationOutcome, MigrationReport, StageStats

    stage_s = phases.pop("stage_s")
    report = MigrationReport(
        MigrationOutcome(outcome),
        stages=(StageStats(0, False, 20, 0, stage_s / 2, stage_s), StageStats(1, True, 1, 0, 0.001, 0.004)),
        **phases,  # type: ignore[arg-type]
    )
    return (
        f"2026-12-01 17:06:19,665 {src} llumlet.migration_out INFO {src}: migrate r@1 -> {dst}: {outcome} "
        f"(21 blocks, 1.0 ms, downtime 1.0 ms) {report.timing_line()}"
    )


def test_the_live_moves_timing_lines_calibrate_the_fixed_overheads(tmp_path: Path) -> None:
    import json

    fidelity = _fidelity()
    (tmp_path / "cluster.json").write_text(
        json.dumps(
            {
                "instance_domains": {"a0": "node-a", "a1": "node-a", "b0": "node-b"},
                "llumlets": {"a0": "127.0.0.1:5000", "a1": "127.0.0.1:5001", "b0": "127.0.0.1:5002"},
            }
        )
    )
    intra = {"setup_s": 0.001, "reserve_s": 0.004, "presuspend_s": 0.003, "total_s": 0.1, "commit_s": 0.01}
    (tmp_path / "llumlet-a0.log").write_text(
        "\n".join(
            [
                "2026-12-01 17:06:05 a0 llumlet.cli INFO llumlet a0 serving",
                _line("a0", "127.0.0.1:5001", "committed", stage_s=0.030, downtime_s=0.020, **intra),
                _line("a0", "127.0.0.1:5001", "committed", stage_s=0.050, downtime_s=0.030, **intra),
                _line("a0", "127.0.0.1:5001", "aborted", stage_s=9.0, downtime_s=9.0, **intra),  # not a move
                _line("a0", "127.0.0.1:5002", "committed", stage_s=0.300, downtime_s=0.025, **intra),  # across
            ]
        )
    )
    (tmp_path / "llumlet-a1.log").write_text(
        _line("a1", "127.0.0.1:5000", "committed", stage_s=0.040, downtime_s=0.026, **intra) + "\n"
    )
    timings = fidelity.live_timings(tmp_path)
    assert sorted((cross, round(t.stage_s[0], 6)) for cross, t in timings) == [
        (False, 0.03),
        (False, 0.04),
        (False, 0.05),
        (True, 0.3),
    ]
    repeat = fidelity.Repeat(live=None, sim=None, timings=timings)
    # medians of the three moves inside a domain: the cross-domain one (its stage holds a paced copy) is left out
    assert fidelity.calibration([repeat]) == {
        "setup_overhead_s": pytest.approx(0.008),
        "stage_overhead_s": pytest.approx(0.04),
        "suspend_resume_overhead_s": pytest.approx(0.026),
    }
    assert fidelity.calibration([fidelity.Repeat(None, None, ())]) is None
