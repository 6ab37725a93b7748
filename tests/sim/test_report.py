"""sim.report tables (text checked cell by cell) and sim.plots PNG output."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from rich.console import Console
from rich.table import Table

from sim.plots import plot_kv_usage, plot_p99_vs_load, plot_ttft_cdf
from sim.report import (
    LATENCY_COLUMNS,
    MIGRATION_COLUMNS,
    format_sweep_table,
    format_table,
    render_table,
    summary_tables,
    ttft_p99_ratios,
)
from sim.results import KvTimeline, PolicySummary, RequestRecord, SimRun, SweepRow, summarize

SUMMARY = PolicySummary(
    policy="hilum",
    requests=1000,
    finished=990,
    refused=3,
    ttft_p50_s=0.0123,
    ttft_p99_s=0.4567,
    tbt_p50_s=0.021,
    tbt_p99_s=0.0489,
    e2e_p99_s=12.3456,
    high_priority_ttft_p99_s=None,
    preemptions=17,
    preempted_s=4.26,
    migrations_intra_domain=40,
    migrations_cross_domain=5,
    migrations_aborted=2,
    cross_domain_bytes=3_456_000_000,
    downtime_mean_s=0.0021,
    downtime_p99_s=0.0099,
    sim_duration_s=600.04,
    engine_steps=123456,
    wall_s=30.0,
    requests_per_wall_s=33.33,
    decode_p99_s=0.0333,
    gpu_hours=2.345,
    scale_outs=3,
    scale_ins=2,
    prefix_hit_rate=0.4321,
)


def body_rows(text: str) -> dict[str, list[str]]:
    """Table body rows keyed by their first cell, split on rich's vertical rule."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            if cells[0]:
                rows[cells[0]] = cells
    return rows


def test_format_table_row_has_the_right_numbers() -> None:
    text = format_table([SUMMARY], title="2x8-a100, burstgpt")
    assert "2x8-a100, burstgpt" in text
    assert body_rows(text)["hilum"] == [
        "hilum",
        "1000",
        "990",
        "3",
        "12.3",  # TTFT p50 ms
        "456.7",  # TTFT p99 ms
        "21.0",
        "48.9",
        "33.3",  # decode p99 ms
        "12345.6",  # E2E p99 ms
        "-",  # no high-priority requests
        "17",
        "4.3",
        "43.2",  # prefix hit %
        "40",
        "5",
        "2",
        "3.46",  # GB
        "2.1",
        "9.9",
        "600.0",
        "123456",
        "30.0",
        "33.3",
        "2.3",  # GPU-hours
        "3/2",  # scale-outs / scale-ins
    ]


@pytest.mark.parametrize(
    ("wall_s", "shown"), [(0.004, "0.004"), (0.01234, "0.012"), (0.5, "0.50"), (9.994, "9.99"), (12.34, "12.3")]
)
def test_a_short_runs_wall_time_is_not_zero(wall_s: float, shown: str) -> None:
    cells = body_rows(format_table([dataclasses.replace(SUMMARY, wall_s=wall_s)], title="t"))["hilum"]
    assert cells[22] == shown  # the column after the engine steps


def test_what_a_live_run_does_not_measure_shows_as_missing() -> None:
    live = dataclasses.replace(SUMMARY, policy="live", cross_domain_bytes=None, engine_steps=None)
    row = body_rows(format_table([live], title="t"))["live"]
    assert (row[17], row[21]) == ("-", "-")  # cross GB, engine steps (not 0: a live run does not count them)


def test_render_table_one_row_per_policy() -> None:
    other = dataclasses.replace(SUMMARY, policy="round_robin")
    table = render_table([SUMMARY, other], title="t")
    assert table.row_count == 2
    assert len(table.columns) == 26


def test_baseline_ratio_column() -> None:
    rr = dataclasses.replace(SUMMARY, policy="round_robin", ttft_p99_s=4.567)
    empty = dataclasses.replace(SUMMARY, policy="idle", ttft_p99_s=None)
    ratios = ttft_p99_ratios([SUMMARY, rr, empty], "round_robin")
    assert ratios["round_robin"] == 1.0
    assert ratios["hilum"] == pytest.approx(0.1)
    assert ratios["idle"] is None
    rows = body_rows(format_table([SUMMARY, rr, empty], baseline="round_robin"))
    assert rows["hilum"][-1] == "0.10x"
    assert rows["round_robin"][-1] == "1.00x"
    assert rows["idle"][-1] == "-"
    with pytest.raises(ValueError, match="baseline policy 'llumnix' not among"):
        render_table([SUMMARY], baseline="llumnix")


@pytest.mark.parametrize("width", [50, 80, 200])
def test_the_two_tables_fit_the_terminal_whole(width: int) -> None:
    """By policy where they fit; one row per metric in an 80-column terminal, where rich cut every cell to "…"; below
    that, the policies over several tables by metric (their numbers were cut)."""
    policies = ["round-robin", "least-loaded", "llumnix", "hilum"]
    summaries = [dataclasses.replace(SUMMARY, policy=p, e2e_p99_s=1234.5678) for p in policies]
    tables = summary_tables(
        summaries,
        width,
        baseline="least-loaded",
        latency=LATENCY_COLUMNS,
        migration=MIGRATION_COLUMNS,
        migration_title="migrations and simulator cost",
    )
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= width
    lines = text.splitlines()
    if width == 80:
        assert all(t.row_count == len(c) + (i == 0) for i, (t, c) in enumerate(zip(tables, (LATENCY_COLUMNS,
                   MIGRATION_COLUMNS), strict=True)))  # fmt: skip
        assert [len(t.columns) for t in tables] == [5, 5]  # the metric, then a column per policy
        header = next(line for line in lines if "round-robin" in line).split()
        assert header == policies
        row = next(line for line in lines if line.strip().startswith("E2E p99 ms")).split()
        assert row[3:] == ["1234567.8"] * 4
        assert next(line for line in lines if "TTFT p99 / base" in line).split()[-4:] == ["1.00x"] * 4
        assert "migrations and simulator cost" in text
    elif width == 50:  # each table by metric split over its policies, each part with every metric
        parts = [[c.header for c in t.columns[1:]] for t in tables]
        assert len(parts) > 2 and [p for part in parts for p in part] == policies * 2
        latency_parts = len(tables) // 2
        assert all(t.row_count == len(LATENCY_COLUMNS) + 1 for t in tables[:latency_parts])
        assert all(t.row_count == len(MIGRATION_COLUMNS) for t in tables[latency_parts:])
        ratios = [line.split()[4:] for line in lines if "TTFT p99 / base" in line]
        assert [r for row in ratios for r in row] == ["1.00x"] * 4  # to least-loaded, in every part
        assert [t.title for t in tables] == [None] + ["(continued)"] * (latency_parts - 1) + [
            "migrations and simulator cost"
        ] + ["migrations and simulator cost (continued)"] * (len(tables) - latency_parts - 1)
    else:
        assert [t.row_count for t in tables] == [4, 4]  # a row per policy
        assert any(line.strip().startswith("least-loaded") for line in lines)


@pytest.mark.parametrize("width", [60, 80, 120, 400])
def test_a_sweeps_columns_are_split_over_tables_that_fit(width: int) -> None:
    """A terminal too narrow for a sweep's table gets its columns over several tables, each whole, none cut to '…'
    (a sweep has a row per grid point: it cannot turn a quarter as hilum sim's tables do)."""
    from sim.report import render_sweep_table
    from topology.tables import split_to_fit

    rows = [SweepRow("2x8-a100-40gb", "burstgpt", p, r, 0, 100, dataclasses.replace(SUMMARY, policy=p))
            for p in ("least-loaded", "hilum") for r in (1.0, 2.5)]  # fmt: skip

    def build(columns: Sequence[str], title: str) -> Table:
        return render_sweep_table(rows, title=title, columns=columns, compact=True)

    tables = split_to_fit(build, LATENCY_COLUMNS, "hilum sim sweep", width)
    shown = [
        c.header for t in tables for c in t.columns if c.header not in ("topology", "policy", "rate\nscale", "seed")
    ]
    assert shown == list(LATENCY_COLUMNS)  # each once, in order
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= width
    assert [t.title for t in tables] == ["hilum sim sweep"] + ["hilum sim sweep (continued)"] * (len(tables) - 1)
    assert (len(tables) == 1) == (width == 400)


def test_sweep_table_has_grid_columns() -> None:
    rows = [
        SweepRow("2x8-a100", "burstgpt", "hilum", 1.5, 3, 100, SUMMARY),
        SweepRow("2x8-a100", "burstgpt", "hilum", 0.5, 3, 100, dataclasses.replace(SUMMARY, ttft_p99_s=0.1)),
    ]
    cells = [r for r in format_sweep_table(rows).splitlines() if r.startswith("│ 2x8")]
    split = [[c.strip() for c in line.strip("│").split("│")] for line in cells]
    assert [s[:4] for s in split] == [["2x8-a100", "hilum", "1.5", "3"], ["2x8-a100", "hilum", "0.5", "3"]]
    assert [s[8] for s in split] == ["456.7", "100.0"]


# ---------------------------------------------------------------------------------------------- plots


def record(i: int, ttft_s: float | None) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        priority=0,
        arrival_s=float(i),
        prompt_tokens=10,
        output_tokens=5,
        generated_tokens=5 if ttft_s is not None else 0,
        first_token_s=None if ttft_s is None else i + ttft_s,
        finish_s=None if ttft_s is None else i + ttft_s + 1.0,
        token_gaps_s=(0.02,) * 4 if ttft_s is not None else (),
        preemptions=0,
        preempted_s=0.0,
        migrations=0,
        refused=None if ttft_s is not None else "no_capacity",
        instance_id="i0",
    )


def run_with(policy: str, ttfts: list[float | None], instances: int) -> SimRun:
    times = tuple(float(t) for t in range(30))
    usage = {f"i{k}": tuple((k + t) % 10 / 10 for t in range(30)) for k in range(instances)}
    return SimRun(
        policy=policy,
        topology="2x8-a100",
        trace="burstgpt",
        seed=0,
        rate_scale=1.0,
        sim_duration_s=30.0,
        wall_s=1.0,
        engine_steps=10,
        requests=tuple(record(i, t) for i, t in enumerate(ttfts)),
        migrations=(),
        kv=KvTimeline(interval_s=1.0, times_s=times, usage_fraction=usage),
    )


def assert_png_drawn(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert float(np.std(pixels)) > 0.01  # not a blank canvas


def test_plot_ttft_cdf(tmp_path: Path) -> None:
    runs = [
        run_with("hilum", [0.01, 0.02, 0.5, None], 2),
        run_with("round_robin", [0.0, 0.2, 3.0, 9.0], 2),  # a 0 s TTFT must not break the log axis
        run_with("empty", [None], 2),
    ]
    out = plot_ttft_cdf(runs, tmp_path / "sub" / "ttft.png")
    assert out == tmp_path / "sub" / "ttft.png"
    assert_png_drawn(out)
    assert_png_drawn(plot_ttft_cdf([], tmp_path / "none.png"))


@pytest.mark.parametrize("instances", [3, 40])  # lines; heat map
def test_plot_kv_usage(tmp_path: Path, instances: int) -> None:
    assert_png_drawn(plot_kv_usage(run_with("hilum", [0.1], instances), tmp_path / "kv.png"))


def test_plot_kv_usage_without_samples(tmp_path: Path) -> None:
    run = dataclasses.replace(run_with("hilum", [0.1], 1), kv=KvTimeline.empty())
    assert_png_drawn(plot_kv_usage(run, tmp_path / "kv.png"))


def test_plot_p99_vs_load(tmp_path: Path) -> None:
    base = summarize(run_with("hilum", [0.1, 0.2], 1))
    rows = [
        SweepRow("t", "tr", policy, rate, seed, None, dataclasses.replace(base, policy=policy, ttft_p99_s=v))
        for policy, rate, seed, v in [
            ("hilum", 0.5, 0, 0.05),
            ("hilum", 0.5, 1, 0.07),
            ("hilum", 1.0, 0, 0.2),
            ("rr", 0.5, 0, 0.5),
            ("rr", 1.0, 0, None),  # missing P99 is skipped
        ]
    ]
    assert_png_drawn(plot_p99_vs_load(rows, tmp_path / "p99.png"))
    assert_png_drawn(plot_p99_vs_load([], tmp_path / "empty.png"))
