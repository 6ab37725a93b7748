"""``hilum sim size``: the bisection over static fleet sizes (sim/sizing.py) and the command."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_report import SUMMARY

from hilum_cli.main import main
from sim.results import PolicySummary
from sim.sizing import size_fleet


def fake(p99_by_size: dict[int, float | None], calls: list[int]) -> Callable[[int], PolicySummary]:
    def simulate(n: int) -> PolicySummary:
        calls.append(n)
        return dataclasses.replace(SUMMARY, ttft_p99_s=p99_by_size[n], gpu_hours=float(n))

    return simulate


def test_bisection_finds_the_smallest_size_that_meets_the_target_in_few_runs() -> None:
    p99 = {n: 10.0 / n for n in range(1, 17)}  # 10 s on one instance, 0.625 s on 16
    calls: list[int] = []
    sizing = size_fleet("hilum", 16, 2.0, fake(p99, calls))
    assert sizing.chosen == 5  # 10 / 5 = 2.0 <= 2.0; 10 / 4 = 2.5 > 2.0
    assert calls == [16, 8, 4, 6, 5]  # whole pool first, then bisection: 1 + log2(16) runs
    assert [t.instances for t in sizing.trials] == [4, 5, 6, 8, 16]
    assert [t.meets for t in sizing.trials] == [False, True, True, True, True]
    assert sizing.trial(5).summary.gpu_hours == 5.0


def test_a_target_the_whole_pool_misses_stops_after_one_run_and_a_run_without_ttft_never_meets() -> None:
    calls: list[int] = []
    sizing = size_fleet("llumnix", 16, 0.1, fake({16: 0.5}, calls))
    assert sizing.chosen is None and calls == [16]
    none = size_fleet("hilum", 1, 1.0, fake({1: None}, []))
    assert none.chosen is None and not none.trials[0].meets
    one = size_fleet("hilum", 1, 1.0, fake({1: 0.2}, []))
    assert one.chosen == 1
    with pytest.raises(ValueError, match="target must be > 0"):
        size_fleet("hilum", 4, 0.0, fake({}, []))
    with pytest.raises(ValueError, match="pool_size must be >= 1"):
        size_fleet("hilum", 0, 1.0, fake({}, []))


def test_sim_size_runs_real_simulations_and_prints_each_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "size", "--target-p99-ttft-ms", "1500", "--max-requests", "400", "--policy", "hilum"]
    assert main([*argv, "--json", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    sizes = [r["instances"] for r in rows]
    assert sizes[-1] == 16 and sizes == sorted(sizes) and len(sizes) <= 5
    (chosen,) = [r for r in rows if r["chosen"]]
    assert chosen["meets"] and chosen["summary"]["ttft_p99_s"] <= 1.5
    below = [r for r in rows if r["instances"] == chosen["instances"] - 1]
    assert chosen["instances"] == 1 or (below and not below[0]["meets"])  # the next size down was simulated: missed
    for r in rows:  # a static fleet: GPU-hours = instances x run (1 GPU each), and it meets iff P99 <= target
        s = r["summary"]
        assert s["gpu_hours"] == pytest.approx(r["instances"] * s["sim_duration_s"] / 3600)
        assert r["meets"] == (s["ttft_p99_s"] <= 1.5) and s["scale_outs"] == 0
    assert json.loads((tmp_path / "sizing.json").read_text())["rows"] == rows


def test_sim_size_exits_1_when_even_the_whole_pool_misses_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "size", "--target-p99-ttft-ms", "1", "--max-requests", "60", "--policy", "hilum"]
    assert main([*argv, "--json"]) == 1
    printed = capsys.readouterr()
    (row,) = json.loads(printed.out)  # the whole pool first: it misses 1 ms, nothing smaller is tried
    assert (row["instances"], row["meets"], row["chosen"]) == (16, False, False)
    assert row["summary"]["ttft_p99_s"] > 0.001
    assert "target not met by hilum even with all 16 instances" in printed.err


def test_run_options_given_before_size_count_and_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--max-requests", "30", "--policy", "hilum", "size", "--target-p99-ttft-ms", "100000", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in rows} == {"hilum"} and all(r["summary"]["finished"] == 30 for r in rows)
    assert main(["sim", "--autoscale", "size", "--target-p99-ttft-ms", "100"]) == 2  # refused there too
    assert "--autoscale cannot be combined with sim size" in capsys.readouterr().err


def test_sim_size_help_lists_no_option_it_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "size", "--help"])
    shown = capsys.readouterr().out
    assert "--target-p99-ttft-ms" in shown and "--policy" in shown
    for refused in ("--autoscale", "--initial-instances N", "--scale-out", "--cold-start-s"):
        assert refused not in shown


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target-p99-ttft-ms", "0"], "--target-p99-ttft-ms must be > 0"),
        (["--target-p99-ttft-ms", "100", "--autoscale"], "--autoscale cannot be combined with sim size"),
        (["--target-p99-ttft-ms", "100", "--initial-instances", "3"], "--initial-instances cannot be combined"),
        (["--target-p99-ttft-ms", "100", "--scale-out", "node-0-i1@3"], "--scale-out cannot be combined"),
        (["--target-p99-ttft-ms", "100", "--cold-start-s", "3"], "--cold-start-s cannot be combined with sim size"),
    ],
)
def test_sim_size_refuses_what_it_cannot_honour(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "size", "--max-requests", "5", *argv]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")
