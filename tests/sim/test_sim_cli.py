"""`hilum sim` from the command line: tables, JSON, results.json, plots, errors, and a real sweep."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hilum_cli.main import main
from sim.results import load_results


def test_sim_json_and_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["sim", "--max-requests", "40", "--policy", "least-loaded,hilum", "--json", "--out", str(out)])
    assert code == 0
    summaries = json.loads(capsys.readouterr().out)
    assert [s["policy"] for s in summaries] == ["least-loaded", "hilum"]
    assert all(s["requests"] == 40 and s["finished"] == 40 for s in summaries)
    stored = load_results(out / "results.json")
    assert [r.policy for r in stored] == ["least-loaded", "hilum"]
    assert stored[1].topology == "2x8-a100-40gb" and stored[1].trace == "azure-conv"
    assert stored[1].rate_scale == 2.75
    for name in ("ttft_cdf.png", "kv_usage_least-loaded.png", "kv_usage_hilum.png"):
        assert (out / name).stat().st_size > 1000
    # again into the same folder with one policy: the other policy's KV plot goes with the results it replaced
    (out / "notes.txt").write_text("mine")
    assert main(["sim", "--max-requests", "20", "--policy", "hilum", "--json", "--out", str(out)]) == 0
    assert "(removed an earlier run's kv_usage_least-loaded.png)" in capsys.readouterr().err.replace("\n", "")
    assert sorted(p.name for p in out.iterdir()) == ["kv_usage_hilum.png", "notes.txt", "results.json", "ttft_cdf.png"]
    # a plot the earlier results.json does not name is not hilum's to remove
    (out / "kv_usage_llumnix.png").write_text("mine too")
    assert main(["sim", "--max-requests", "20", "--policy", "hilum", "--json", "--out", str(out)]) == 0
    assert "removed" not in capsys.readouterr().err
    assert (out / "kv_usage_llumnix.png").read_text() == "mine too"


def test_results_that_cannot_be_written_are_one_error_and_leave_the_earlier_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sim.plots

    assert main(["sim", "--max-requests", "20", "--policy", "hilum", "--json", "--out", str(tmp_path)]) == 0
    earlier = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    capsys.readouterr()

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sim.plots, "plot_kv_usage", full_disk)  # results.json and the TTFT plot are written by then
    assert main(["sim", "--max-requests", "10", "--policy", "hilum", "--json", "--out", str(tmp_path)]) == 1
    printed = capsys.readouterr()
    assert printed.out == ""  # nothing printed as if the run had gone well
    assert f"hilum sim: error: --out {tmp_path}: cannot write the results: " in printed.err.replace("\n", "")
    assert "Traceback" not in printed.err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == earlier  # none of this run's files, no leftovers


def test_an_output_name_taken_by_a_folder_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ttft_cdf.png").mkdir()  # results.json would be written, then the plot would fail
    assert main(["sim", "--max-requests", "20", "--policy", "hilum", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert f"hilum sim: error: --out {tmp_path}: ttft_cdf.png there is not a file but a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ttft_cdf.png"]  # nothing written, no run made


def test_an_interrupt_while_the_results_are_written_leaves_the_earlier_ones_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # results.json was opened for writing in place: Ctrl-C or SIGTERM then left a truncated, invalid file beside
    # the earlier run's plots
    import sim.plots

    assert main(["sim", "--max-requests", "20", "--policy", "hilum,round-robin", "--out", str(tmp_path)]) == 0
    earlier = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    capsys.readouterr()
    plot = sim.plots.plot_kv_usage

    def interrupted_after_one(run: object, path: Path) -> Path:
        if any(p.name.startswith("kv_usage_") for p in path.parent.iterdir()):
            raise KeyboardInterrupt
        return plot(run, path)  # type: ignore[arg-type]

    monkeypatch.setattr(sim.plots, "plot_kv_usage", interrupted_after_one)
    assert main(["sim", "--max-requests", "10", "--policy", "hilum,round-robin", "--out", str(tmp_path)]) == 130
    assert "hilum sim: interrupted; no results written" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == earlier
    assert len(load_results(tmp_path / "results.json")) == 2


def test_sim_table_names_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--max-requests", "30", "--trace", "sharegpt", "--rate-scale", "2"]) == 0
    text = capsys.readouterr().out
    assert "sharegpt x2 (30 requests, " in text
    assert ") on 2x8-a100-40gb (16 llama-2-13b instances, 2 domains)" in text
    for policy in ("round-robin", "least-loaded", "llumnix", "hilum"):
        assert text.count(policy) >= 2  # one row in each table
    assert "TTFT" in text and "downtime" in text
    # columns with nothing to count in this run are left out, and said so; the ratio column is explained
    tables = "\n".join(text.splitlines()[:-2])
    assert "hit %" not in tables and "hi-pri" not in tables and "out/in" not in tables
    assert text.splitlines()[-2:] == [
        "TTFT p99 / base: each policy's P99 TTFT over least-loaded's",
        "not shown, nothing to count: prefix hit % (the trace has no prefix hashes), hi-pri TTFT p99 (no "
        "high-priority request got a first token), scale out/in (no --autoscale)",
    ]


def test_sim_table_shows_the_prefix_and_scaling_columns_when_they_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--max-requests", "60", "--trace", "mooncake-conv", "--policy", "hilum", "--autoscale"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("hit %" in line for line in lines) and any("out/in" in line for line in lines)
    assert "hi-pri" not in "\n".join(lines[:-1])  # the trace has no priorities
    assert lines[-1] == "not shown, nothing to count: hi-pri TTFT p99 (no high-priority request got a first token)"
    assert main([*argv, "--priority-fraction", "0.2", "--out", str(tmp_path)]) == 0  # some requests high priority
    text = capsys.readouterr().out
    assert "hi-pri" in text and "not shown" not in text
    # how many requests the high-priority P99 is taken over: those of 60 x 0.2 drawn that got a first token
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    high = run["summary"]["high_priority_ttft_count"]
    assert high == sum(r["priority"] >= 1 and r["ttft_s"] is not None for r in run["requests"]) and 0 < high < 60
    assert text.splitlines()[-1] == (
        f"hi-pri TTFT p99: over the {high} high-priority requests that got a first token; fewer than 100: about the "
        "slowest of them"
    )
    # a drain of the whole fleet refuses most: the figure is over fewer than were sent, and differs by policy
    drains = [w for i in range(8) for w in ("--drain", f"node-0-i{i}@10")]
    argv = ["sim", "--max-requests", "200", "--topology", "1x8-a100", "--priority-fraction", "0.2", *drains]
    assert main([*argv, "--policy", "hilum,round-robin", "--json", "--out", str(tmp_path)]) == 0
    summaries = json.loads(capsys.readouterr().out)
    counts = [s["high_priority_ttft_count"] for s in summaries]
    assert min(counts) > 0 and max(counts) < 40  # 200 x 0.2 were high priority, most refused
    # what no policy of the run can count: moves without a migrating policy, cross-domain ones on one domain, the
    # prefix hit rate with prefix caching off
    assert main(["sim", "--max-requests", "60", "--policy", "round-robin,least-loaded"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.strip() == "simulator cost" for line in lines)
    assert lines[-1].endswith(
        "mig intra, mig cross, mig aborted, cross GB, downtime mean ms, downtime p99 ms (no policy of the run "
        "migrates), scale out/in (no --autoscale)"
    )
    argv = ["sim", "--max-requests", "60", "--topology", "1x8-a100", "--trace", "mooncake-conv", "--policy", "hilum"]
    assert main([*argv, "--no-prefix-caching"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "not shown, nothing to count: prefix hit % (prefix caching off), hi-pri TTFT p99 (no high-priority "
        "request got a first token), mig cross, cross GB (one domain), scale out/in (no --autoscale)"
    )


def test_sim_autoscale_prints_gpu_hours_and_its_decisions_reach_results_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["sim", "--max-requests", "300", "--policy", "hilum", "--autoscale", "--initial-instances", "2"]
    assert main([*argv, "--cold-start-s", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "GPU-h" in text and "scale" in text
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    starts = [e for e in run["scale_events"] if e["action"] == "scale-out"]
    assert starts and run["summary"]["scale_outs"] == len(starts)  # two instances cannot hold 13 req/s
    assert run["spec"]["config"]["initial_instances"] == 2 and run["spec"]["config"]["cold_start_s"] == 5.0
    # The two from the start for the whole run, each started one from its decision: 1 GPU each.
    end = run["summary"]["sim_duration_s"]
    expected = (2 * end + sum(end - e["at_s"] for e in starts)) / 3600
    assert not [e for e in run["scale_events"] if e["action"] == "scale-in"]  # 78 s: too short for a scale-in
    assert run["summary"]["gpu_hours"] == pytest.approx(expected)


def test_the_configuration_files_autoscale_switch_runs_the_autoscaler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "hilum.yaml"
    text = example.read_text()
    assert "  enabled: false " in text
    config = tmp_path / "on.yaml"
    config.write_text(text.replace("  enabled: false ", "  enabled: true  ", 1))
    argv = ["sim", "--max-requests", "300", "--policy", "hilum", "--initial-instances", "2", "--config", str(config)]
    assert main([*argv, "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["scale_outs"] >= 1  # as with --autoscale: two instances cannot hold 13 req/s
    assert main(["sim", "size", "--target-p99-ttft-ms", "1000", "--config", str(config), "--max-requests", "5"]) == 2
    assert "autoscale.enabled is true" in capsys.readouterr().err


def test_gamma_arrivals_for_a_length_only_trace(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--trace", "sharegpt", "--arrival", "gamma", "--arrival-cv", "3", "--rate", "5"]
    assert main([*argv, "--max-requests", "20", "--policy", "hilum", "--json", "--rate-scale", "1"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["finished"] == 20


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "fifo"], "unknown policy fifo"),
        (["--rate-scale", "0"], "hilum sim: error: --rate-scale must be a finite number > 0, got 0"),
        (["--rate-scale", "inf"], "--rate-scale must be a finite number > 0, got inf"),
        (["--summary-lag-ms", "-1"], "--summary-lag-ms must be a finite number of milliseconds >= 0, got -1"),
        (["--config", "/no/such.yaml"], "--config /no/such.yaml: (file): cannot read the configuration file"),
        (["--config", ""], "--config is empty: give a configuration file, or leave it out for the defaults"),
        (["--topology", "/no/such.yaml"], "invalid topology (--topology /no/such.yaml)"),
        (["--max-requests", "0"], "--max-requests must be >= 1"),
        (["--trace", "no-such-trace"], "no-such-trace"),
        (["--topology", "no-such-topology"], "no-such-topology"),
        (["--drain", "node-0-i0"], "drain (--drain): 'node-0-i0': expected INSTANCE@SECONDS, e.g. node-0-i3@30"),
        (
            ["--priority-fraction", "1.5"],
            "priority_fraction (--priority-fraction): must be <= 1, got 1.5",
        ),
        (["--trace", "sharegpt", "--arrival", "gamma"], "--arrival gamma needs --arrival-cv"),
        (["--arrival-cv", "2"], "--arrival-cv applies only with --arrival gamma"),
        (["--arrival", "gamma", "--arrival-cv", "-1"], "--arrival-cv must be from 0.001 to 1000"),
        (["--arrival", "gamma", "--arrival-cv", "inf"], "--arrival-cv must be from 0.001 to 1000"),  # said "> 0"
        (["--arrival", "gamma", "--arrival-cv", "1e6"], "--arrival-cv must be from 0.001 to 1000 (the Gamma"),
        (["--no-prefix-caching", "--prefix-aware"], "(--prefix-aware) needs prefix caching: with prefix_caching false"),
        (["--arrival", "poisson", "--rate", "0"], "--rate must be a number of requests per second > 0, got 0.0"),
        (["--rate", "3"], "azure-conv (bundled trace): rate_per_s (--rate) applies only to synthetic arrivals"),
        (["--policy", "hilum,llumnix,hilum"], "--policy names hilum more than once"),
        (["--drain", "nope@10"], "drain (--drain) names unknown instance 'nope'"),
        (
            ["--topology", "64x8-h100", "--drain", "node-63-i0@5"],
            "drain (--drain) names 'node-63-i0', which serves llama-2-70b; the run simulates the llama-2-7b instances",
        ),
        (
            ["--drain", "node-0@5"],
            "drain (--drain) names NVLink domain 'node-0'; it takes instances, one per --drain: node-0-i0,",
        ),
        (["--drain", "node-0-i3@nan"], "'node-0-i3@nan': the time must be a finite number of seconds >= 0, got nan"),
        (["--scale-out", "node-0-i3@inf"], "the time must be a finite number of seconds >= 0, got inf"),
        (["--drain", "node-0-i3@5", "--drain", "node-0-i3@8"], "drain (--drain) names node-0-i3 more than once"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--policy", "llumnix", "--summary-lag-ms", "100"], "--summary-lag-ms applies to the hilum policy only"),
        (["--priority-fraction", "nan"], "priority_fraction (--priority-fraction): must be a finite number, got nan"),
        (["--model", "nope"], "model (--model) 'nope': no instance of it in 2x8-a100-40gb; models there: llama-2-13b"),
        (["--out", "/proc/no/such"], "--out /proc/no/such: cannot create the folder"),
        (["--out", "/proc/self"], "--out /proc/self: cannot write there"),
        (["--trace", "[red]x[/red]:x:"], "unknown trace '[red]x[/red]:x:'"),  # printed as given: no markup, no emoji
        (
            ["--drain", "node-0-i1@5", "--scale-out", "node-0-i1@9"],
            "node-0-i1: named by both drain (--drain) and scale_out (--scale-out); an instance is drained or added",
        ),
        (["--out", "README.md"], "exists and is not a directory"),
        (["--out", ""], "--out is empty: give a folder for results.json and the plots"),
        (["--topology", ""], "--topology is empty: give a bundled name or a file"),
        (["--trace", " "], "--trace is empty: give a bundled name or a file"),
        (["--policy", ""], "--policy is empty: give one or more of round-robin, least-loaded, llumnix, hilum"),
        (["--policy", "llumnix,"], "--policy 'llumnix,' has an empty name; separate policies by single commas"),
        (["--policy", "hilum,,llumnix"], "--policy 'hilum,,llumnix' has an empty name"),
        (["--cold-start-s", "5"], "cold_start_s (--cold-start-s) applies only with autoscale (--autoscale)"),
        (
            ["--autoscale", "--cold-start-s", "600"],
            "--cold-start-s (600) must be below autoscale.start_timeout_s (600) of the built-in defaults",
        ),
        (["--autoscale", "--scale-out", "node-0-i1@9"], "cannot be combined with autoscale"),
        (["--initial-instances", "17"], "initial_instances (--initial-instances) 17: 2x8-a100-40gb has only 16"),
        (
            ["--initial-instances", "8", "--drain", "node-1-i7@5"],
            "drain (--drain) names node-1-i7, which initial_instances (--initial-instances) 8 keeps off",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    few = [] if "--max-requests" in argv else ["--max-requests", "5"]  # given twice, it would be refused for that
    assert main(["sim", *few, *argv]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")


def test_an_instance_with_more_blocks_than_the_engine_can_number_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "topologies" / "1x8-a100.yaml"
    text = example.read_text()
    assert "memory_gib: 80\n" in text
    huge = tmp_path / "huge.yaml"  # 3 billion blocks, more than 2**31 - 1
    huge.write_text(text.replace("model: llama-2-7b}", "model: llama-2-7b, kv_capacity_blocks: 3000000000}"))
    assert main(["sim", "--max-requests", "5", "--topology", str(huge)]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert f"hilum sim: error: 1x8-a100 ({huge}): instance node-0-i0 has 3,000,000,000 KV cache blocks (8 such" in err
    assert "at most 2,147,483,647" in err and "a smaller kv_capacity_blocks" in err and "Traceback" not in err
    huge.write_text(text.replace("memory_gib: 80\n", "memory_gib: 80000000\n"))  # 80 PiB a GPU: past any GPU
    assert main(["sim", "--max-requests", "5", "--topology", str(huge)]) == 2
    assert "gpu_types[0].memory_gib: must be <= 1.04858e+06, got 80000000" in capsys.readouterr().err


def test_an_instance_too_small_for_any_request_of_the_trace_is_named_in_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "topologies" / "1x8-a100.yaml"
    text = example.read_text()
    tiny_line = "{id: node-0-i3, gpus: [3], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 1}"
    small = tmp_path / "small.yaml"
    small.write_text(text.replace("{id: node-0-i3, gpus: [3], tensor_parallel_size: 1, model: llama-2-7b}", tiny_line))
    assert main(["sim", "--max-requests", "40", "--topology", str(small), "--policy", "round-robin", "--json"]) == 0
    captured = capsys.readouterr()
    err = captured.err.replace("\n", "")
    assert "hilum sim: warning: 1 llama-2-7b instance of 1x8-a100 holds fewer KV cache blocks than" in err
    assert "node-0-i3 (1); no request will run there" in err
    assert json.loads(captured.out)[0]["finished"] == 40  # the run goes on without it
    assert main(["sim", "--max-requests", "500", "--topology", str(small), "--policy", "round-robin", "--json"]) == 0
    assert "node-0-i3 (1); no request will run there" in capsys.readouterr().err  # 2-token prompts, longer requests
    every = tmp_path / "every.yaml"
    every.write_text(
        text.replace(
            "tensor_parallel_size: 1, model: llama-2-7b}",
            "tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 1}",
        )
    )
    assert main(["sim", "--max-requests", "40", "--topology", str(every)]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert "hilum sim: error: every llama-2-7b instance of 1x8-a100 holds fewer KV cache blocks than" in err
    assert "no request could run" in err
    assert main(["sim", "--max-requests", "5", "--topology", str(example), "--policy", "round-robin"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_configuration_file_named_by_the_environment_is_named_so_in_its_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HILUM_CONFIG", "/no/such.yaml")
    assert main(["sim", "--max-requests", "5"]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert "hilum sim: error: $HILUM_CONFIG /no/such.yaml: (file): cannot read the configuration file" in err


def test_a_request_longer_than_the_context_is_sized_as_the_run_cuts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The too-small check sizes a request as cut to the model's context (``fit_to_context``), as the run does: a
    single 100,000-token prompt runs, cut, on instances that hold a 4,096-token request; and a context below two
    tokens (no room for a prompt token and an output token) is refused where the topology is read."""
    example = Path(__file__).resolve().parents[2] / "examples" / "topologies" / "1x8-a100.yaml"
    trace = tmp_path / "long.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,100000,10\n")
    assert main(["sim", "--topology", str(example), "--trace", str(trace), "--policy", "hilum", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)[0]["finished"] == 1 and "warning" not in captured.err
    one = tmp_path / "one.yaml"  # one instance: "1 ... instance" in the title
    lines = example.read_text().splitlines()
    one.write_text("\n".join(line for line in lines if "node-0-i" not in line or "node-0-i0" in line))
    assert main(["sim", "--topology", str(one), "--max-requests", "3", "--policy", "hilum"]) == 0
    assert "(1 llama-2-7b instance, 1 domain)" in capsys.readouterr().out.replace("\n", "")
    tiny = tmp_path / "ctx1.yaml"
    tiny.write_text(example.read_text().replace("max_context_tokens: 4096", "max_context_tokens: 1"))
    assert main(["sim", "--topology", str(tiny), "--max-requests", "5"]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert "models[0].max_context_tokens" in err and ">= 2" in err and "Traceback" not in err


def test_a_drain_or_scale_out_after_the_last_arrival_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--max-requests", "50", "--policy", "hilum", "--json"]
    assert main([*argv, "--drain", "node-0-i1@99999", "--scale-out", "node-1-i2@5"]) == 0
    err = capsys.readouterr().err.replace("\n", "")
    assert "hilum sim: warning: --drain node-0-i1@99999 comes after the trace's last arrival (9.6 s)" in err
    assert "--scale-out node-1-i2" not in err  # at 5 s, before the last arrival
    assert main([*argv, "--drain", "node-0-i1@9"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_drains_of_every_instance_that_serves_are_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--topology", "1x8-a100", "--max-requests", "30", "--policy", "round-robin", "--json"]
    drains = [a for k in range(8) for a in ("--drain", f"node-0-i{k}@{k / 4:g}")]
    assert main([*argv, *drains]) == 0
    out, err = capsys.readouterr()
    assert (
        "hilum sim: warning: --drain takes every instance that serves out of service (8 instances, the last at "
        "1.75 s): requests arriving from then on are refused" in err.replace("\n", "")
    )
    (summary,) = json.loads(out)
    assert 0 < summary["refused"] < 30
    assert main([*argv, *drains[:-2]]) == 0  # node-0-i7 serves on
    assert "every instance" not in capsys.readouterr().err
    assert main([*argv, "--initial-instances", "7", *drains[:-2]]) == 0  # node-0-i7 never serves
    assert "(7 instances, the last at 1.5 s)" in capsys.readouterr().err.replace("\n", "")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate-scale", "1e-6"], "use a rate_scale (--rate-scale) of at least 1.65e-05 or fewer requests"),
        (["--rate-scale", "1e-300"], "its first 100 requests arrive over 4.27e+301 s"),
        (
            ["--trace", "sharegpt", "--rate", "1e-9"],
            "use a rate_per_s (--rate) of at least 2.92e-05, a rate_scale (--rate-scale) of at least 2.92e+04 or",
        ),
        (["--trace", "llumnix-synthetic", "--rate", "1e-9"], "error: llumnix-synthetic (generated): its first 100"),
    ],
)
def test_a_simulated_span_past_30_days_is_refused_with_the_scale_that_fits(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "--max-requests", "100", *argv]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert "hilum sim: error: " in err and "hilum simulates at most 2,592,000 s (30 days" in err
    assert message in err


def test_the_title_shows_a_huge_or_tiny_rate_in_three_digits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--max-requests", "50", "--rate-scale", "1e300", "--policy", "round-robin"]) == 0
    assert "(50 requests, 1.89e+300 req/s" in capsys.readouterr().out
    assert main(["sim", "--max-requests", "50", "--rate-scale", "0.01", "--policy", "round-robin"]) == 0
    assert "(50 requests, 0.0189 req/s" in capsys.readouterr().out
    assert main(["sim", "--max-requests", "50", "--rate-scale", "1e308", "--policy", "round-robin"]) == 0
    assert "x1e+308 (50 requests, 3 cut to" in capsys.readouterr().out  # a rate past a double's range: none shown
    assert main(["sim", "--max-requests", "1", "--policy", "round-robin"]) == 0
    assert "(1 request) on 2x8-a100-40gb" in capsys.readouterr().out  # no rate for one request


def test_ctrl_c_during_a_run_exits_130_and_leaves_no_empty_out_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sim.runner

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sim.runner, "run_simulation", interrupted)
    out = tmp_path / "runs" / "x"
    assert main(["sim", "--max-requests", "5", "--out", str(out)]) == 130
    assert "hilum sim: interrupted; no results written" in capsys.readouterr().err
    assert not out.exists()
    # a folder that was there before stays, empty or not (the user's own; `--out .` was a traceback)
    mine = tmp_path / "mine"
    mine.mkdir()
    assert main(["sim", "--max-requests", "5", "--out", str(mine)]) == 130
    assert mine.is_dir() and "interrupted; no results written" in capsys.readouterr().err
    monkeypatch.chdir(mine)
    assert main(["sim", "--max-requests", "5", "--out", "."]) == 130
    assert mine.is_dir() and "Traceback" not in capsys.readouterr().err


def test_an_interrupt_while_the_files_are_moved_in_is_held_until_all_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the move was guarded by a signal mask, which holds a signal back from one thread only: an interrupt then
    # left some of this run's files beside an earlier run's others
    import os

    import sim.cli

    assert main(["sim", "--max-requests", "20", "--policy", "hilum,round-robin,llumnix", "--out", str(tmp_path)]) == 0
    earlier = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    capsys.readouterr()
    replace = os.replace
    sent: list[str] = []

    def interrupted_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if not sent and Path(dst).parent == tmp_path:  # the first file moved into --out (not a write in staging)
            sent.append(str(dst))
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, in the middle of the move
        replace(src, dst)

    monkeypatch.setattr(sim.cli.os, "replace", interrupted_replace)
    assert main(["sim", "--max-requests", "10", "--policy", "hilum,round-robin", "--out", str(tmp_path)]) == 130
    assert f"hilum sim: interrupted; the results were written: {tmp_path / 'results.json'}" in capsys.readouterr().err
    now = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    # every file of this run is new, and the earlier run's llumnix plot went with its results
    assert sorted(now) == ["kv_usage_hilum.png", "kv_usage_round-robin.png", "results.json", "ttft_cdf.png"]
    assert all(now[name] != earlier[name] for name in now)
    assert [r.policy for r in load_results(tmp_path / "results.json")] == ["hilum", "round-robin"]


def test_prefix_aware_dispatch_without_a_prefix_cache_is_refused_by_the_configuration_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "hilum.yaml"
    config.write_text("prefix_cache: {enabled: false}\n")
    assert main(["sim", "--config", str(config), "--prefix-aware", "--max-requests", "5"]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert "(--prefix-aware) needs prefix caching, and --config " in err and "has prefix_cache.enabled false" in err


def test_ctrl_c_in_a_sizing_or_a_sweep_exits_130_and_leaves_no_empty_out_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # both printed a KeyboardInterrupt traceback and left the folder made for them
    import sim.sizing
    import sim.sweep

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sim.sizing, "size_fleet", interrupted)
    monkeypatch.setattr(sim.sweep, "run_sweep", interrupted)
    out = tmp_path / "size"
    assert main(["sim", "size", "--target-p99-ttft-ms", "2000", "--max-requests", "5", "--out", str(out)]) == 130
    assert "hilum sim size: interrupted; no results written" in capsys.readouterr().err
    assert not out.exists()
    out = tmp_path / "sweep"
    assert (
        main(["sim", "sweep", str(Path(__file__).resolve().parents[2] / "examples" / "sweep.yaml"), "--out", str(out)])
        == 130
    )
    assert "hilum sim sweep: interrupted; no results written" in capsys.readouterr().err
    assert not out.exists()


def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path: Path) -> None:
    # Python's default ended the process where it stood: while results.json was written, half of one was left
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "hilum"), "sim", "--max-requests", "100000", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not out.exists():  # made once the trace is loaded, just before the run (19,366 requests)
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "hilum sim: interrupted; no results written" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--trace", "no-such-trace.csv"],
        ["--topology", "no-such-topology.yaml"],
        ["--drain", "no-such-instance@1"],
        ["size", "--target-p99-ttft-ms", "100", "--trace", "no-such-trace.csv"],
    ],
)
def test_a_refused_run_leaves_no_out_folder(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` is made once the options, the topology and the trace are known good: a run refused for any of them
    exits 2 and leaves nothing behind (it left an empty folder when the trace was refused)."""
    out = tmp_path / "runs" / "x"
    assert main(["sim", "--max-requests", "5", "--out", str(out), *argv]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_sweeps_configuration_file_is_checked_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "c.yaml").write_text("policy:\n  bogus_key: 1\n")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        "trace: azure-conv\ntopologies: [2x8-a100-40gb]\npolicies: [hilum]\nrate_scales: [1]\n"
        f"max_requests: 5\nconfig: {tmp_path / 'c.yaml'}\n"
    )
    assert main(["sim", "sweep", str(sweep), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    config = tmp_path / "c.yaml"
    assert f"hilum sim sweep: error: {sweep}: config: {config}: policy.bogus_key: unknown key; expected one of:" in err
    assert not (tmp_path / "o").exists()


def test_a_sweep_file_that_cannot_be_read_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-sweep.yaml"
    assert main(["sim", "sweep", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"hilum sim sweep: error: {missing}: (file): cannot read the sweep file: No such file or directory" in err
    assert main(["sim", "sweep", ""]) == 2  # not the folder "."
    assert "hilum sim sweep: error: the sweep file's path is empty: give a sweep YAML file" in capsys.readouterr().err


def test_a_ray_address_ray_cannot_read_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """``--ray-address x``: exit 2 naming the option (it was Ray's traceback), and the ``--out`` folder made for the
    sweep is taken away again. In a fresh interpreter: a Ray this test session started would be used instead."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text("trace: azure-conv\ntopologies: [2x8-a100-40gb]\npolicies: [round-robin]\nrate_scales: [1]\n")
    out = tmp_path / "o"
    code = "import sys\nfrom hilum_cli.main import main\nsys.exit(main(sys.argv[1:]))"
    argv = ["sim", "sweep", str(sweep), "--ray-address", "x", "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "hilum sim sweep: error: --ray-address x: " in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
    argv[argv.index("x")] = "127.0.0.1:99999"  # refused before a connection is tried (Ray's own check wraps it)
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr.strip()) == (
        2,
        "hilum sim sweep: error: --ray-address 127.0.0.1:99999: port 99999 is outside 1-65535",
    )
    assert not out.exists()


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_ray_address_where_nothing_listens_fails_at_once(tmp_path: Path, scheme: str) -> None:
    """``--ray-address HOST:PORT`` with nothing listening: Ray retried for minutes with only its own log lines; now
    exit 1 after a TCP probe, naming the address and what to do, the ``--out`` folder taken away. A fresh
    interpreter, as above."""
    with socket.socket() as s:  # a port nothing listens on: bound, never listening, closed before the sweep
        s.bind(("127.0.0.1", 0))
        address = f"{scheme}127.0.0.1:{s.getsockname()[1]}"
    sweep = tmp_path / "s.yaml"
    sweep.write_text("trace: azure-conv\ntopologies: [2x8-a100-40gb]\npolicies: [round-robin]\nrate_scales: [1]\n")
    out = tmp_path / "o"
    code = "import sys\nfrom hilum_cli.main import main\nsys.exit(main(sys.argv[1:]))"
    argv = ["sim", "sweep", str(sweep), "--ray-address", address, "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"hilum sim sweep: error: --ray-address {address}: nothing accepts a connection there (Connection refused): "
        "start Ray on that host (`ray start --head`) and give the address it prints, or leave --ray-address out for "
        "a local Ray"
    )
    assert not out.exists()


def test_run_options_before_sweep_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--max-requests", "5", "--policy", "hilum", "sweep", "examples/sweep.yaml"]) == 2
    err = capsys.readouterr().err
    assert "hilum sim sweep: error: --max-requests, --policy before 'sweep' would be ignored" in err
    # the options a sweep shares names with, and values equal to the defaults, were let through (and ignored)
    for before in (["--out", "elsewhere"], ["--config", "no-such.yaml"], ["--seed", "0"], ["--ou", "x"]):
        assert main(["sim", *before, "sweep", "examples/sweep.yaml"]) == 2
        err = capsys.readouterr().err
        assert f"hilum sim sweep: error: {before[0]} before 'sweep' would be ignored" in err
        assert ("give --out after 'sweep' for the sweep's folder" in err) == (before[0] in ("--out", "--ou"))


def test_sweep_runs_real_simulations_as_ray_tasks(
    ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sweep.yaml"
    config.write_text(
        "trace: azure-conv\n"
        "topologies: [2x8-a100-40gb]\n"
        "policies: [least-loaded, hilum]\n"
        "rate_scales: [2, 4]\n"
        "seeds: [0]\n"
        "max_requests: 25\n"
    )
    out = tmp_path / "sweep"
    assert main(["sim", "sweep", str(config), "--out", str(out)]) == 0
    data = json.loads((out / "sweep.json").read_text())
    rows = data["rows"]
    assert [(r["policy"], r["rate_scale"]) for r in rows] == [
        ("least-loaded", 2.0),
        ("least-loaded", 4.0),
        ("hilum", 2.0),
        ("hilum", 4.0),
    ]
    assert all(r["summary"]["finished"] == 25 for r in rows)
    assert (out / "p99_ttft_vs_load_2x8-a100-40gb.png").stat().st_size > 1000
    table = capsys.readouterr().out  # not a terminal: every column at its natural width, none cut to '…'
    assert "hilum" in table and "least-loaded" in table and "…" not in table
    # two tables, as hilum sim prints (one of every column was 278 characters wide): latency, then the rest
    tables, _ = table.split("not shown, nothing to count: ")
    latency, rest = tables.split("migrations and simulator cost")
    assert "TTFT" in latency and "engine" not in latency and "engine" in rest and "TTFT" not in rest
    assert max(len(line) for line in tables.splitlines()) < 200
    # the columns with nothing to count are left out, and said, as hilum sim does (every figure is in sweep.json)
    assert "hi-pri" not in tables and "prefix" not in tables and "out/in" not in tables
    assert table.splitlines()[-1] == (
        "not shown, nothing to count: prefix hit % (the trace has no prefix hashes), hi-pri TTFT p99 (no "
        "high-priority request got a first token), scale out/in (the autoscaler off)"
    )
    assert "intra" in rest and "aborted" in rest  # hilum migrates: its columns stay
    assert {"prefix_hit_rate", "high_priority_ttft_p99_s", "scale_outs"} <= rows[0]["summary"].keys()


def _no_instances(path: Path) -> Path:
    """A bundled topology (2x8-a100) with every domain's instances removed, written to ``path``."""
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "topology" / "examples" / "2x8-a100.yaml").read_text())
    for domain in data["domains"]:
        domain["instances"] = []
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_topology_without_instances_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = _no_instances(tmp_path / "empty.yaml")
    assert main(["sim", "--topology", str(empty), "--max-requests", "5"]) == 2
    err = capsys.readouterr().err
    assert f"hilum sim: error: topology 2x8-a100 ({empty}) has no instances: there is nothing to simulate" in err, err


def test_an_instance_with_no_step_time_model_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Llama-2-7B is measured at TP1 and TP2 only: a TP4 one ended the run with a traceback, naming an H100 the
    file does not have (the GPU its model would have been scaled from)."""
    tp4 = _tp4_topology(tmp_path)
    assert main(["sim", "--topology", str(tp4), "--max-requests", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(  # the file named (the copy keeps the bundled file's name), and how many more it has
        f"hilum sim: error: 2x8-a100 ({tp4}): instance node-0-tp4 (and 1 more): no step-time model for llama-2-7b at "
        "TP4 on a100-80gb: none is measured for it on a100 (the family of a100-80gb), nor on h100 (scaled by HBM "
        "bandwidth); measured: llama-2-13b: a100 at TP1/2/4, h100 at TP1/2; "
    ), err
    assert "Traceback" not in err


def _tp4_topology(tmp_path: Path) -> Path:
    """2x8-a100 with a TP4 Llama-2-7B instance in each domain, which the simulator cannot time."""
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "topology" / "examples" / "2x8-a100.yaml").read_text())
    for d in (0, 1):
        data["domains"][d]["instances"][4:] = [{"id": f"node-{d}-tp4", "gpus": [4, 5, 6, 7], "tensor_parallel_size": 4,
                                                "model": "llama-2-7b"}]  # fmt: skip
    path = tmp_path / "tp4.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_problem_of_the_options_is_reported_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """hilum sim stopped at the first problem of its options against the topology; each one hid the next."""
    argv = ["sim", "--topology", str(_tp4_topology(tmp_path)), "--max-requests", "5", "--cold-start-s", "10"]
    argv += ["--drain", "nowhere@5", "--drain", "node-0-i0@5,node-0-i2@6", "--scale-out", "node-0-i1@5"]
    argv += ["--scale-out", "node-0-i1@9"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    starts = [
        "2x8-a100 (",  # the topology's own problem first
        "cold_start_s (--cold-start-s) applies only with autoscale (--autoscale)",
        "drain (--drain) takes one INSTANCE@S an entry, got 'node-0-i0@5,node-0-i2@6': give each instance its own",
        "drain (--drain) names unknown instance 'nowhere'; llama-2-7b instances of 2x8-a100: node-0-i0, node-0-i1,",
        "scale_out (--scale-out) names node-0-i1 more than once; give each instance once",
    ]
    assert len(lines) == len(starts), lines
    for line, start in zip(lines, starts, strict=True):
        assert line.startswith(f"hilum sim: error: {start}"), (line, start)


def test_a_sweep_names_a_topology_it_cannot_time_under_its_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A topology the simulator cannot time was reported as the options' fault ("options, on topologies[1]"); the
    options' own problems on each topology keep that key, every one of them."""
    tp4 = _tp4_topology(tmp_path)
    config = tmp_path / "sweep.yaml"
    config.write_text(
        f"trace: azure-conv\ntopologies: [2x8-a100, {tp4}]\npolicies: [hilum]\nrate_scales: [1]\n"
        "options: {drain: [node-0-i0@5, node-0-i0@6, nowhere@1]}\n"
    )
    assert main(["sim", "sweep", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.removeprefix("hilum sim sweep: error: ")
    lines = [line.removeprefix(f"{config}: ") for line in err.splitlines()]  # each line led by the file
    assert [line.split(": ", 1)[0] for line in lines] == [
        "topologies[1]",
        "options, on topologies[0] (2x8-a100)",
        "options",  # the same on every topology: said once
        f"options, on topologies[1] ({tp4})",
    ], lines
    assert lines[0].startswith(f"topologies[1]: 2x8-a100 ({tp4}): instance node-0-tp4 (and 1 more): no step-time"), (
        lines
    )
    assert lines[1].startswith("options, on topologies[0] (2x8-a100): drain names unknown instance 'nowhere'"), lines
    assert lines[2] == "options: drain names node-0-i0 more than once; give each instance once", lines  # no flag
    assert "drain names unknown instance 'nowhere'" in lines[3], lines


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "trace: burstgpt\ntopologies: [2x8-a100]\npolicies: [hilum]\nrate_scales: [1]\n",
            "trace: unknown trace 'burstgpt'",
        ),
        ("trace: azure-conv\ntopologies: [2x8-a100]\npolicies: [round_robin]\nrate_scales: [1]\n", "round_robin"),
        (
            "trace: azure-conv\ntopologies: [2x8-a100]\npolicies: [hilum]\nrate_scales: [1]\noptions: {foo: 1}\n",
            "options.foo: unknown key; expected one of: priority_fraction, model,",
        ),
        (  # a topology of no instances: named by its entry (it was "max() arg is an empty sequence")
            "trace: azure-conv\ntopologies: [2x8-a100, EMPTY]\npolicies: [hilum]\nrate_scales: [1]\n",
            "topologies[1]: EMPTY has no instances: there is nothing to simulate",
        ),
        (  # an option the topology cannot run, named with the topology
            "trace: azure-conv\ntopologies: [1x8-a100]\npolicies: [hilum]\nrate_scales: [1]\n"
            "options: {drain: [node-1-i0@5]}\n",
            "options, on topologies[0] (1x8-a100): drain names unknown instance 'node-1-i0'",
        ),
        (  # hilum sim refused the pair; a sweep ran it
            "trace: azure-conv\ntopologies: [2x8-a100]\npolicies: [hilum]\nrate_scales: [1]\n"
            "options: {prefix_caching: false, prefix_aware_dispatch: true}\n",
            "options.prefix_aware_dispatch needs prefix caching: with prefix_caching false no engine holds a prefix",
        ),
        (  # the list's entry named (it said "invalid topology" alone)
            "trace: azure-conv\ntopologies: [2x8-a100, nowhere]\npolicies: [hilum]\nrate_scales: [1]\n",
            "topologies[1]: invalid topology: nowhere: (file): file not found",
        ),
        (
            "trace: azure-conv\ntopologies: [2x8-a100-40gb]\npolicies: [hilum]\nrate_scales: [1, 1e-6]\n"
            "max_requests: 100\n",
            "rate_scales[1] = 1e-06, seed 0: azure-conv (bundled trace): its",
        ),
    ],
)
def test_a_sweep_that_cannot_run_fails_before_starting_ray(
    body: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sweep.yaml"
    empty = _no_instances(tmp_path / "empty.yaml")
    body, message = body.replace("EMPTY", str(empty)), message.replace("EMPTY", str(empty))
    config.write_text(body)
    assert main(["sim", "sweep", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    # the file named, then the problem, as load_sweep_config's errors read
    assert f"hilum sim sweep: error: {config}: " in err and message in err, err


def test_a_sweeps_plot_name_taken_by_a_folder_is_refused_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sweep.yaml"
    config.write_text("trace: sharegpt\ntopologies: [2x8-a100]\npolicies: [hilum]\nrate_scales: [1]\n")
    (tmp_path / "o" / "p99_ttft_vs_load_2x8-a100.png").mkdir(parents=True)  # found after the sweep, it was
    assert main(["sim", "sweep", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'o'}: p99_ttft_vs_load_2x8-a100.png there is not a file but a folder" in err, err


def test_the_bundled_sweep_example_is_valid() -> None:
    from sim.cli import _check_sweep
    from sim.sweep import load_sweep_config

    config = load_sweep_config(Path(__file__).resolve().parents[2] / "examples" / "sweep.yaml")
    _check_sweep(config)


def test_a_sweep_reads_its_configuration_file_as_hilum_sim_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``config: null`` is $HILUM_CONFIG's file, named in every run (a remote Ray worker's environment differs), and
    the file's autoscale.enabled turns the autoscaler on unless the options say (the sweep ignored it)."""
    from sim.cli import _check_sweep, _with_config_file
    from sim.sweep import SweepConfig

    on = tmp_path / "on.yaml"
    on.write_text("autoscale: {enabled: true, start_timeout_s: 30}\n")
    grid = {"trace": "sharegpt", "topologies": ["2x8-a100"], "policies": ["hilum"], "rate_scales": [1.0]}
    monkeypatch.delenv("HILUM_CONFIG", raising=False)
    config, settings = _with_config_file(SweepConfig(**grid), "s.yaml")
    assert (config.config, config.options, settings.autoscale.enabled) == (None, {}, False)
    config, settings = _with_config_file(SweepConfig(**grid, config=str(on)), "s.yaml")
    assert (config.config, config.options, settings.autoscale.enabled) == (str(on), {"autoscale": True}, True)
    off = SweepConfig(**grid, config=str(on), options={"autoscale": False})  # said in the options: kept
    assert _with_config_file(off, "s.yaml")[0].options == {"autoscale": False}
    monkeypatch.setenv("HILUM_CONFIG", str(on))
    config, _ = _with_config_file(SweepConfig(**grid), "s.yaml")
    assert (config.config, config.options) == (str(on), {"autoscale": True})
    # a cold start the file's start timeout gives up on: refused before Ray starts, naming the option
    late = SweepConfig(**grid, options={"cold_start_s": 45.0})
    with pytest.raises(
        ValueError,
        match=rf"^options.cold_start_s \(45\) must be below autoscale.start_timeout_s \(30\) of the configuration {on}",
    ):
        _check_sweep(*_with_config_file(late, "s.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: {tie_tolerance: 2.0}\n")
    monkeypatch.setenv("HILUM_CONFIG", str(bad))
    with pytest.raises(ValueError, match=rf"^\$HILUM_CONFIG {bad}: policy.tie_tolerance: must be in"):
        _with_config_file(SweepConfig(**grid), "s.yaml")
    with pytest.raises(ValueError, match=rf"^s.yaml: config: {bad}: policy.tie_tolerance: must be in"):
        _with_config_file(SweepConfig(**grid, config=str(bad)), "s.yaml")


def test_the_title_counts_the_instances_serving_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--max-requests", "5", "--policy", "round-robin", "--initial-instances", "4"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(4 of 16 llama-2-13b instances at start, 2 domains)" in out


def test_prefix_caching_and_prefix_awareness_are_switched_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hits = {}
    off = tmp_path / "off.yaml"
    off.write_text("prefix_cache:\n  enabled: false\n")
    for flags in ([], ["--no-prefix-aware"], ["--no-prefix-caching"], ["--config", str(off)]):
        out = tmp_path / "-".join(flags or ["default"])
        argv = ["sim", "--topology", "2x8-a100", "--trace", "mooncake-conv", "--max-requests", "300"]
        assert main([*argv, "--rate-scale", "3", "--policy", "llumnix", "--out", str(out), *flags]) == 0
        assert "prefix" in capsys.readouterr().out  # the table's hit-rate column
        (run,) = json.loads((out / "results.json").read_text())["runs"]
        config = run["spec"]["config"]
        assert config["options"]["prefix_caching"] == (False if "--no-prefix-caching" in flags else None)
        assert config["prefix_caching"] == (flags in ([], ["--no-prefix-aware"]))  # as resolved: flag, else file
        assert config["options"]["prefix_aware_dispatch"] == (False if flags == ["--no-prefix-aware"] else None)
        assert config["prefix_aware_dispatch"] == (flags != ["--no-prefix-aware"])  # as resolved
        hits[" ".join(flags)] = run["summary"]["prefix_hit_rate"]
    assert hits["--no-prefix-caching"] == 0.0 and hits[f"--config {off}"] == 0.0
    assert hits[""] > hits["--no-prefix-aware"] > 0.0
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text("prefix_cache:\n  report_max_hashes: 64\n")
    assert main(["sim", "--max-requests", "5", "--config", str(tuned)]) == 2
    assert f"--config {tuned}: prefix_cache.report_max_hashes: hilum sim cannot honour it" in capsys.readouterr().err


def _sized(tmp_path: Path, blocks: dict[str, int], name: str) -> Path:
    """The bundled 1x8-a100 example with ``kv_capacity_blocks`` given per instance (``blocks``: id -> blocks)."""
    text = (Path(__file__).resolve().parents[2] / "examples" / "topologies" / "1x8-a100.yaml").read_text()
    for iid, count in blocks.items():
        gpu = iid.rsplit("-i", 1)[1]
        line = f"{{id: {iid}, gpus: [{gpu}], tensor_parallel_size: 1, model: llama-2-7b}}"
        assert line in text
        text = text.replace(line, line.replace("}", f", kv_capacity_blocks: {count}}}"))
    path = tmp_path / name
    path.write_text(text)
    return path


# The first 20 requests of the default trace need 7 to 140 KV blocks of 16 tokens (3 of them at most 10).
ALL = [f"node-0-i{k}" for k in range(8)]


def test_requests_larger_than_every_instance_are_counted_in_a_warning_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = _sized(tmp_path, dict.fromkeys(ALL, 10), "small.yaml")
    argv = ["sim", "--topology", str(small), "--max-requests", "20", "--policy", "least-loaded", "--json"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    err = printed.err.replace("\n", "")
    assert (
        "hilum sim: warning: 17 of 20 requests need more KV cache blocks than the largest llama-2-7b instance holds "
        "(prompt plus output, cut to the model's context: up to 140 blocks of 16 tokens; the largest instance holds "
        "10); they will be refused" in err
    )
    assert err.index("warning") < err.index("least-loaded")  # before the run's progress bar
    (summary,) = json.loads(printed.out)
    assert (summary["finished"], summary["refused"]) == (3, 17)  # as warned
    one = _sized(tmp_path, {**dict.fromkeys(ALL, 10), "node-0-i5": 100}, "one.yaml")
    assert main([*argv[:2], str(one), *argv[3:]]) == 0
    printed = capsys.readouterr()
    assert "1 of 20 requests needs more KV cache blocks than" in printed.err.replace("\n", "")
    assert "up to 140 blocks of 16 tokens; the largest instance holds 100)" in printed.err.replace("\n", "")
    assert json.loads(printed.out)[0]["refused"] == 1


def test_the_size_checks_count_the_instances_that_serve_not_the_whole_topology(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --initial-instances (taken in turn from each domain: here node-0-i0, node-0-i1, ...) only those serve;
    --scale-out and the autoscaler bring others later: a request only a later instance holds waits for it."""
    tiny = _sized(tmp_path, {**dict.fromkeys(ALL[:7], 5), "node-0-i7": 1000}, "tiny.yaml")  # below every request
    argv = ["sim", "--topology", str(tiny), "--max-requests", "20", "--policy", "least-loaded", "--json"]
    assert main([*argv, "--initial-instances", "2"]) == 2  # node-0-i7, the one that holds any, never serves
    err = capsys.readouterr().err.replace("\n", "")
    assert (
        "hilum sim: error: every llama-2-7b instance that --initial-instances 2 puts in service holds fewer KV cache "
        "blocks than the trace's smallest request needs (prompt plus output, cut to the model's context: 7 blocks of "
        "16 tokens): node-0-i0 (5), node-0-i1 (5); no request could run: --initial-instances 8 would include "
        "node-0-i7 (1,000)" in err
    )
    assert main([*argv, "--initial-instances", "2", "--autoscale"]) == 0  # the autoscaler may start node-0-i7
    printed = capsys.readouterr()
    assert (
        "hilum sim: warning: no llama-2-7b instance serving at the start holds the trace's smallest request (7 blocks "
        "of 16 tokens; the largest there holds 5): only node-0-i7 (1,000) can (if the autoscaler starts one); every "
        "request is refused until one of them serves" in printed.err.replace("\n", "")
    )
    assert json.loads(printed.out)[0]["refused"] == 20  # it did not: refused requests are no load to scale for
    # in the tables: no P99 TTFT under least-loaded to divide by, so no ratio column and no line explaining it
    assert main([*argv[:-3], "--policy", "least-loaded,hilum", "--initial-instances", "2", "--autoscale"]) == 0
    text = capsys.readouterr().out
    assert "least-loaded" in text and "/ base" not in "\n".join(text.splitlines()[:-1])
    assert "TTFT p99 / base (least-loaded has no P99 TTFT to divide by)" in text.splitlines()[-1]
    assert main([*argv, "--scale-out", "node-0-i7@2"]) == 0
    printed = capsys.readouterr()
    assert "only node-0-i7 (1,000, at 2 s) can (joining by --scale-out)" in printed.err.replace("\n", "")
    assert json.loads(printed.out)[0]["refused"] == 4  # the 4 that arrived before 2 s
    mixed = _sized(tmp_path, {**dict.fromkeys(ALL[:7], 10), "node-0-i7": 1000}, "mixed.yaml")
    argv[2] = str(mixed)
    assert main([*argv, "--scale-out", "node-0-i7@2"]) == 0
    printed = capsys.readouterr()
    assert (
        "hilum sim: warning: 17 of 20 requests need more KV cache blocks than the largest llama-2-7b instance serving "
        "at the start holds (up to 140 blocks of 16 tokens; the largest there holds 10): they are refused until one "
        "of node-0-i7 (1,000, at 2 s) serves (joining by --scale-out)" in printed.err.replace("\n", "")
    )
    assert "they will be refused" not in printed.err and json.loads(printed.out)[0]["refused"] == 3
    assert main([*argv, "--initial-instances", "3"]) == 0  # node-0-i7 kept off: its requests are refused for good
    printed = capsys.readouterr()
    assert (
        "hilum sim: warning: 17 of 20 requests need more KV cache blocks than the largest llama-2-7b instance that "
        "serves holds (prompt plus output, cut to the model's context: up to 140 blocks of 16 tokens; the largest "
        "instance holds 10); --initial-instances 3 keeps off node-0-i7 (1,000); they will be refused"
        in printed.err.replace("\n", "")
    )
    assert json.loads(printed.out)[0]["refused"] == 17
    assert main([*argv, "--initial-instances", "8"]) == 0  # every instance serves: nothing refused
    printed = capsys.readouterr()
    assert "warning" not in printed.err and json.loads(printed.out)[0]["refused"] == 0


def test_json_summaries_count_the_requests_cut_to_the_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "long.csv"  # one prompt past the 4,096-token context of the example's model, one within it
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,100000,10\n2023-11-16 18:15:47.00,50,10\n"
    )
    example = Path(__file__).resolve().parents[2] / "examples" / "topologies" / "1x8-a100.yaml"
    argv = ["sim", "--topology", str(example), "--trace", str(trace), "--policy", "hilum,round-robin", "--json"]
    assert main(argv) == 0
    summaries = json.loads(capsys.readouterr().out)
    assert [(s["policy"], s["truncated_requests"], s["finished"]) for s in summaries] == [
        ("hilum", 1, 2),
        ("round-robin", 1, 2),
    ]
    assert main(["sim", "--max-requests", "5", "--policy", "round-robin", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["truncated_requests"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--polcy", "hilum"], "hilum sim: error: unrecognized arguments: --polcy (did you mean --policy?)"),
        (["--polcy=hilum"], "hilum sim: error: unrecognized arguments: --polcy (did you mean --policy?)"),
        (
            ["size", "--target-p99-ttft-ms", "5", "--polcy", "hilum"],
            "hilum sim size: error: unrecognized arguments: --polcy (did you mean --policy?)",
        ),
        (["sweep", "g.yaml", "--bogus"], "hilum sim sweep: error: unrecognized arguments: --bogus"),
        (["--bogus", "sweep", "g.yaml"], "hilum sim: error: unrecognized arguments: --bogus"),
        (["--xyzzy", "3", "--sed", "1"], "unrecognized arguments: --xyzzy, --sed (did you mean --seed?)"),
        (["--bogus"], "unrecognized arguments: --bogus"),  # nothing close (the dashes alone made --out close)
        (["--p", "hilum"], "ambiguous option: --p could match --policy, --priority-fraction"),  # argparse's own
    ],
)
def test_a_misspelt_option_is_named_not_read_as_a_sub_command(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["sim", "--max-requests", "3", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert message in err and "invalid choice" not in err and "Traceback" not in err
    assert err.count("did you mean") == message.count("did you mean")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--target-p99-ttft-ms", "500"],
            "--target-p99-ttft-ms is an option of 'hilum sim size': give it after 'size'",
        ),
        (["--target-p99-ttft-ms=500", "size"], "--target-p99-ttft-ms is an option of 'hilum sim size'"),
        (["--ray-address", "auto", "sweep", "grid.yaml"], "--ray-address is an option of 'hilum sim sweep'"),
        (["--target", "500", "size"], "--target-p99-ttft-ms is an option of 'hilum sim size': give it after 'size'"),
        (["--ray-addr", "x", "sweep", "g.yaml"], "--ray-address is an option of 'hilum sim sweep'"),
        (
            ["sizing", "--target-p99-ttft-ms", "5"],
            "--target-p99-ttft-ms is an option of 'hilum sim size': give it after 'size' (did you mean 'size' for "
            "'sizing'?)",
        ),
        (
            ["sweep", "g.yaml", "--policy", "hilum"],
            "sweep: error: --policy: not an option of 'hilum sim sweep' (its runs are set in",
        ),
        (
            ["size", "--target-p99-ttft-ms", "5", "--ray-address", "x"],
            "size: error: --ray-address: not an option of 'hilum sim size'",
        ),
        (["sizing"], "invalid choice: 'sizing' (choose from 'sweep', 'size'); did you mean 'size'?"),
        (["--policy", "hilum", "swep"], "invalid choice: 'swep' (choose from 'sweep', 'size'); did you mean 'sweep'?"),
    ],
)
def test_a_sub_commands_option_before_it_and_a_misspelt_sub_command_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An option of ``size`` or ``sweep`` given before its sub-command (its value was read as the sub-command: "invalid
    choice: '500'") is named with where it goes; a misspelt sub-command gets the closest one."""
    with pytest.raises(SystemExit) as exited:
        main(["sim", "--max-requests", "3", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err.replace("\n", " ")
    said = (
        f"hilum sim: error: {message}",
        f"hilum sim: error: argument {{sweep,size}}: {message}",
        f"hilum sim {message}",
    )
    assert any(s in err for s in said), err  # the sub-command's name and usage for an option given after it
    assert "invalid choice: '500'" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--policy", "llumnix", "--policy", "hilum"],
            "hilum sim: error: argument --policy: given twice ('llumnix', then 'hilum'): give the policies in one "
            "--policy, separated by commas (--policy llumnix,hilum)",
        ),
        (["--pol", "llumnix", "--policy=hilum"], "hilum sim: error: argument --policy: given twice ('llumnix', then"),
        (["--seed", "1", "--seed", "2"], "hilum sim: error: argument --seed: given twice (1, then 2): give it once"),
        (["--config", "a.yaml", "--config", "b.yaml"], "argument --config: given twice ('a.yaml', then 'b.yaml')"),
        (
            ["size", "--target-p99-ttft-ms", "5", "--max-requests", "4", "--max-requests", "6"],
            "hilum sim size: error: argument --max-requests: given twice (4, then 6): give it once",
        ),
        (
            ["sweep", "g.yaml", "--out", "a", "--out", "b"],
            "hilum sim sweep: error: argument --out: given twice ('a', then 'b'): give it once",
        ),
        (  # an on/off pair, either way round: argparse kept the last (the run was without prefix caching)
            ["--prefix-caching", "--no-prefix-caching"],
            "hilum sim: error: argument --prefix-caching/--no-prefix-caching: given twice (then --no-prefix-caching): "
            "give one of the two, once",
        ),
        (
            ["size", "--target-p99-ttft-ms", "5", "--no-prefix-aware", "--prefix-aware"],
            "hilum sim size: error: argument --prefix-aware/--no-prefix-aware: given twice (then --prefix-aware):",
        ),
    ],
)
def test_an_option_of_one_value_given_twice_is_refused_not_the_last_kept(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse keeps the last value: ``--policy llumnix --policy hilum`` ran hilum alone."""
    with pytest.raises(SystemExit) as exited:
        main(["sim", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert message in err, err


def test_a_run_option_before_size_is_still_overridden_after_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--max-requests", "300", "--policy", "hilum", "size", "--max-requests", "3", "--json"]
    assert main([*argv, "--target-p99-ttft-ms", "1e9"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["summary"]["requests"] == 3


@pytest.mark.parametrize(
    ("argv", "usage", "message"),
    [
        (
            ["sweep", "g.yaml", "extra"],
            "usage: hilum sim sweep ",
            "hilum sim sweep: error: unrecognized arguments: extra",
        ),
        (
            ["size", "--target-p99-ttft-ms", "5", "extra", "more"],
            "usage: hilum sim size ",
            "hilum sim size: error: unrecognized arguments: extra more",
        ),
    ],
)
def test_extra_words_get_the_usage_of_the_sub_command_they_were_given_to(
    argv: list[str], usage: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["sim", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and message in err.replace("\n", ""), err
    assert "usage: hilum [-h]" not in err


def test_an_empty_out_or_ray_address_of_a_sweep_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "sweep", "examples/sweep.yaml", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "hilum sim sweep: error: --out is empty: give a folder for sweep.json and the plots" in err
    assert "results.json" not in err
    assert main(["sim", "sweep", "examples/sweep.yaml", "--ray-address", " "]) == 2
    assert "--ray-address is empty: give HOST:PORT, or leave the flag out for a local Ray" in capsys.readouterr().err
    assert main(["sim", "size", "--target-p99-ttft-ms", "5", "--out", " "]) == 2
    assert "hilum sim size: error: --out is empty: give a folder for sizing.json" in capsys.readouterr().err


def test_a_sweep_files_policy_with_a_space_is_shown_quoted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sweep.yaml"
    config.write_text(
        'trace: azure-conv\ntopologies: [2x8-a100]\npolicies: [" hilum", llumnix, fifo]\nrate_scales: [1]\n'
    )
    assert main(["sim", "sweep", str(config), "--out", str(tmp_path / "o")]) == 2
    choose = "choose from round-robin, least-loaded, llumnix, hilum"
    assert capsys.readouterr().err.splitlines() == [
        f"hilum sim sweep: error: {config}: policies[0]: unknown policy ' hilum'; {choose}",
        f"{config}: policies[2]: unknown policy 'fifo'; {choose}",
    ]
    assert not (tmp_path / "o").exists()


def test_a_sweep_file_that_is_not_utf8_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sweep.yaml"
    config.write_bytes(b"trace: caf\xe9\n")
    assert main(["sim", "sweep", str(config)]) == 2
    assert f"{config}: (file): not UTF-8 text (byte 0xe9 at offset 10); save it as UTF-8" in capsys.readouterr().err


def test_a_sub_commands_option_after_it_still_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--max-requests", "3", "size", "--target-p99-ttft-ms", "1e9", "--policy", "round-robin"]) == 0
    assert "round-robin" in capsys.readouterr().out


def test_abbreviated_options_and_negative_numbers_still_parse(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--max-req", "3", "--pol", "round-robin", "--json"]) == 0  # argparse's abbreviations
    assert json.loads(capsys.readouterr().out)[0]["requests"] == 3
    assert main(["sim", "--max-requests", "3", "--seed", "-1"]) == 2  # a value, refused by the run's own check
    assert "--seed must be >= 0, got -1" in capsys.readouterr().err


def test_a_sweep_file_gets_every_problem_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each on its own line led by the file's name, as a configuration file's errors are; it stopped at the first
    (a bad policy hid a bad topology, which showed only once the policy was mended)."""
    config = tmp_path / "sweep.yaml"
    config.write_text(
        "trace: azure-conv\ntopologies: [1x8-a100, nowhere, 2x8-a100]\npolicies: [hilum, fifo]\n"
        "rate_scales: [1, 1e-6, 2e-6]\nmax_requests: 100\noptions: {drain: [node-1-i0@5]}\n"
    )
    assert main(["sim", "sweep", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    lines = err.removeprefix("hilum sim sweep: error: ").splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "policies[1]",
        "rate_scales[1] = 1e-06, seed 0",
        "rate_scales[2] = 2e-06, seed 0",
        "topologies[1]",
        "options, on topologies[0] (1x8-a100)",  # node-1-i0 is not in it; 2x8-a100 has it
    ], err
    assert all(line.startswith(f"{config}: ") for line in lines)
    assert "file not found" in lines[3] and "drain names unknown instance 'node-1-i0'" in lines[4]
    assert not (tmp_path / "o").exists()


def test_step_times_of_a_gpu_without_measured_data_are_said_below_the_tables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """results.json alone said so: the default topology's A100-40GB runs the A100-80GB model scaled by HBM."""
    assert main(["sim", "--max-requests", "20", "--policy", "round-robin"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "step times: llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM (no step times measured on that GPU type" in out
    )
    assert main(["sim", "--topology", "2x8-a100", "--max-requests", "20", "--policy", "round-robin"]) == 0
    assert "step times:" not in capsys.readouterr().out  # the A100-80GB is measured


def test_a_sizing_and_a_sweep_say_which_step_times_are_scaled_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """hilum sim alone said it; sim size and a sweep printed their figures of an A100-40GB as if measured, and their
    JSON files did not record it (results.json did)."""
    scaled = "llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM"
    argv = ["sim", "size", "--target-p99-ttft-ms", "60000", "--max-requests", "30", "--policy", "round-robin"]
    assert main([*argv, "--out", str(tmp_path / "size")]) == 0
    assert f"step times: {scaled} (no step times measured" in " ".join(capsys.readouterr().out.split())
    sized = json.loads((tmp_path / "size" / "sizing.json").read_text())
    assert sized["derived_latency_models"] == [scaled]
    assert {r["summary"]["derived_latency_models"] == [scaled] for r in sized["rows"]} == {True}  # as --json prints
    assert main(["sim", "--max-requests", "20", "--policy", "round-robin", "--json"]) == 0
    assert [row["derived_latency_models"] for row in json.loads(capsys.readouterr().out)] == [[scaled]]
    config = tmp_path / "sweep.yaml"
    config.write_text(
        "trace: azure-conv\ntopologies: [2x8-a100-40gb, 2x8-a100]\npolicies: [round-robin]\nrate_scales: [1]\n"
        "max_requests: 20\n"
    )
    assert main(["sim", "sweep", str(config), "--out", str(tmp_path / "sweep")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"step times on 2x8-a100-40gb: {scaled} (no step times measured" in out and "on 2x8-a100:" not in out
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["rows"]
    assert [(r["topology"], r["derived_latency_models"]) for r in rows] == [
        ("2x8-a100-40gb", [scaled]),
        ("2x8-a100", []),
    ]


def test_sim_sizes_table_fits_a_narrow_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its columns over several tables, each row named by policy and fleet size (it was cut even at 80 columns)."""
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    argv = ["sim", "size", "--target-p99-ttft-ms", "60000", "--max-requests", "30", "--policy", "hilum,least-loaded"]
    assert main(argv) == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # the terminal's styles
    lines = out.splitlines()
    assert "…" not in out and max(map(len, lines)) <= 60
    headers = [line.split() for line in lines if line.split()[:2] == ["policy", "instances"]]
    assert len(headers) == 2 and [h for part in headers for h in part[2:]] == [
        "GPU-h", "TTFT", "p99", "ms", "refused", "meets"
    ]  # fmt: skip
    assert sum("<- smallest found" in line for line in lines) == 2  # one per policy, in the second part
