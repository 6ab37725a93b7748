"""bench/fidelity.py's side-by-side table: the verdict of each judged figure against the tolerance."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

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
    table, ok = fidelity.report(lives, sim, 0.2)
    rows = _rows(table)
    assert ok
    assert rows["TTFT p50 ms"] == ["1100.0", "1200.0", "1150.0", "1000.0", "1.15", "within"]
    assert rows["migrations"] == ["46", "54", "50", "50", "1.00", "within"]
    assert rows["intra-domain"][-1] == "shown"


def test_a_figure_outside_tolerance_or_missing_fails() -> None:
    fidelity = _fidelity()
    sim = _summary()
    table, ok = fidelity.report([_summary(ttft_p99_s=5.0)], sim, 0.2)
    assert not ok
    assert _rows(table)["TTFT p99 ms"][-2:] == ["1.25", "OUTSIDE"]
    table, ok = fidelity.report([_summary(ttft_p50_s=None)], sim, 0.2)
    assert not ok
    assert _rows(table)["TTFT p50 ms"][-1] == "n/a"
