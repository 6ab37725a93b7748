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


def fake(
    p99_by_size: dict[int, float | None], calls: list[int], refused_by_size: dict[int, int] | None = None
) -> Callable[[int], PolicySummary]:
    """A simulation whose summary at n instances has P99 TTFT ``p99_by_size[n]`` (s) and refuses
    ``refused_by_size[n]`` of its 1,000 requests (none when absent); each n simulated is appended to ``calls``."""

    def simulate(n: int) -> PolicySummary:
        calls.append(n)
        refused = (refused_by_size or {}).get(n, 0)
        return dataclasses.replace(SUMMARY, ttft_p99_s=p99_by_size[n], gpu_hours=float(n), refused=refused)

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


def test_a_fleet_that_refuses_a_request_misses_the_target_whatever_its_p99_and_says_so() -> None:
    """P99 TTFT covers the served requests only: a fleet that refuses some must not meet the target on it."""
    p99 = {n: 0.1 for n in range(1, 17)}  # every size far below the 1 s target on what it serves
    refused = {1: 900, 2: 600, 4: 40, 6: 2}  # fewer than 7 instances lack room for the largest requests
    calls: list[int] = []
    sizing = size_fleet("hilum", 16, 1.0, fake(p99, calls, refused))
    assert calls == [16, 8, 4, 6, 7] and sizing.chosen == 7
    assert [(t.instances, t.meets, t.miss) for t in sizing.trials] == [
        (4, False, "refused 40 of 1,000 requests"),
        (6, False, "refused 2 of 1,000 requests"),
        (7, True, None),
        (8, True, None),
        (16, True, None),
    ]
    everywhere = size_fleet("hilum", 4, 1.0, fake(p99, [], {4: 1}))  # even the whole pool refuses one
    assert everywhere.chosen is None and everywhere.trials[0].miss == "refused 1 of 1,000 requests"
    slow = size_fleet("hilum", 2, 0.5, fake({2: 0.8123}, []))
    assert slow.trials[0].miss == "P99 TTFT 812 ms > 500 ms"
    close = size_fleet("hilum", 2, 0.5, fake({2: 0.5002}, []))  # rounds to the target: more digits
    assert close.trials[0].miss == "P99 TTFT 500.2 ms > 500 ms"
    slower = size_fleet("hilum", 2, 1.5, fake({2: 12.3456}, []))
    assert slower.trials[0].miss == "P99 TTFT 12,346 ms > 1,500 ms"  # counted as the title counts its target
    empty = size_fleet("hilum", 2, 0.5, fake({2: None}, []))
    assert empty.trials[0].miss == "no request got a first token"


def test_sim_size_counts_refused_requests_against_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Instances of 10 KV blocks refuse 17 of the first 20 requests (7 to 140 blocks each): the run warns before it
    starts, and no fleet meets even a target of 100 s, each size saying why."""
    example = Path(__file__).resolve().parents[2] / "examples" / "topologies" / "1x8-a100.yaml"
    small = tmp_path / "small.yaml"
    small.write_text(example.read_text().replace("model: llama-2-7b}", "model: llama-2-7b, kv_capacity_blocks: 10}"))
    argv = ["sim", "size", "--topology", str(small), "--target-p99-ttft-ms", "100000", "--max-requests", "20"]
    assert main([*argv, "--policy", "least-loaded", "--json"]) == 1
    printed = capsys.readouterr()
    err = printed.err.replace("\n", "")
    assert (
        "hilum sim size: warning: 17 of 20 requests need more KV cache blocks than the largest llama-2-7b instance "
        "holds (prompt plus output, cut to the model's context: up to 140 blocks of 16 tokens; the largest instance "
        "holds 10); they will be refused" in err
    )
    (row,) = json.loads(printed.out)  # the whole pool misses: nothing smaller is tried
    assert (row["instances"], row["meets"], row["chosen"]) == (8, False, False)
    assert row["miss"] == "refused 17 of 20 requests" and row["summary"]["refused"] == 17
    assert row["summary"]["ttft_p99_s"] < 100  # its P99 alone would have met the target
    p99_ms = row["summary"]["ttft_p99_s"] * 1e3
    assert f"least-loaded: 8 instances: P99 TTFT {p99_ms:.0f} ms, refused 17 requests" in err  # the progress line
    assert "target not met by least-loaded even with all 8 instances (least-loaded: refused 17 of 20 requests)" in err
    assert main([*argv, "--policy", "least-loaded"]) == 1  # the table says it too
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if line.lstrip().startswith("least-loaded")]
    assert len(rows) == 1 and rows[0][1] == "8"  # the one size tried, and no row of dashes under it
    assert table.count("refused 17 of 20 requests: not met even by all 8") == 1


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
        assert r["meets"] == (s["ttft_p99_s"] <= 1.5 and s["refused"] == 0) and s["scale_outs"] == 0
        assert (r["miss"] is None) == r["meets"]
    stored = json.loads((tmp_path / "sizing.json").read_text())
    assert stored["rows"] == rows
    assert {k: v for k, v in stored.items() if k != "rows"} == {
        "target_p99_ttft_ms": 1500.0,
        "topology": "2x8-a100-40gb",
        "trace": "azure-conv",
        "requests": 400,
        "rate_scale": 2.75,
        "seed": 0,
        "model": "llama-2-13b",
        "derived_latency_models": ["llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM"],
    }
    # every summary carries the requests cut to the model's context, as `hilum sim --json`'s do
    assert main(["sim", "--max-requests", "400", "--policy", "hilum", "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)
    assert plain["truncated_requests"] > 0
    assert {r["summary"]["truncated_requests"] for r in rows} == {plain["truncated_requests"]}


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
        (["--target-p99-ttft-ms", "0"], "--target-p99-ttft-ms must be a finite number of milliseconds > 0, got 0"),
        (["--target-p99-ttft-ms", "inf"], "--target-p99-ttft-ms must be a finite number of milliseconds > 0, got inf"),
        (["--target-p99-ttft-ms", "100", "--autoscale"], "--autoscale cannot be combined with sim size"),
        (["--target-p99-ttft-ms", "100", "--initial-instances", "3"], "--initial-instances cannot be combined"),
        (["--target-p99-ttft-ms", "100", "--scale-out", "node-0-i1@3"], "--scale-out cannot be combined"),
        (["--target-p99-ttft-ms", "100", "--drain", "node-0-i7@5"], "--drain cannot be combined with sim size"),
        (["--target-p99-ttft-ms", "100", "--cold-start-s", "3"], "--cold-start-s cannot be combined with sim size"),
    ],
)
def test_sim_size_refuses_what_it_cannot_honour(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "size", "--max-requests", "5", *argv]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")


def test_the_title_writes_the_target_as_typed_not_in_exponent_form(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "size", "--max-requests", "10", "--policy", "round-robin", "--target-p99-ttft-ms", "1e9"]
    assert main(argv) == 0
    assert "smallest static fleet with P99 TTFT <= 1,000,000,000 ms (" in capsys.readouterr().out  # it read 1e+09
