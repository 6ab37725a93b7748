"""``hilum topology show`` and ``hilum topology path`` through the ``hilum`` entry point."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from hilum_cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_show_of_one_node_does_not_print_a_bisection_of_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "show", "1x8-a100"]) == 0
    out = capsys.readouterr().out
    assert "1x8-a100 (1x8-a100.yaml): 8 GPUs, 1 NVLink domain, 8 instances, 0 racks" in out
    assert "bisection bandwidth: none to measure (one node: no network path between nodes)" in out
    assert "0 Gb/s" not in out


def test_show_2x8_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "show", "2x8-a100"]) == 0
    out = capsys.readouterr().out
    assert "2x8-a100 (2x8-a100.yaml): 16 GPUs, 2 NVLink domains, 16 instances, 1 rack" in out
    assert "524,288" in out  # KV bytes per token of Llama-2-7B fp16
    assert "8 MiB" in out  # per 16-token block
    for figure in ("7,609", "121,744", "60,872", "973,952"):  # per-instance and per-domain blocks / tokens
        assert figure in out
    assert "600.0 GB/s" in out and "8 x llama-2-7b TP1" in out
    assert "bisection bandwidth: 200 Gb/s (25.0 GB/s)" in out
    assert "nic:node-0" in out and "25.0 GB/s" in out


def test_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "show", "64x8-h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_gpus"] == 512 and data["num_instances"] == 336 and len(data["fabric"]["racks"]) == 8
    assert data["models"]["llama-2-70b"]["kv_bytes_per_token"] == 327_680
    assert data["fabric"]["racks"][0]["uplink_bandwidth_bytes_per_s"] == 100e9
    assert data["fabric"]["bisection_bandwidth_bytes_per_s"] == 400e9  # 4 racks x 800 Gb/s
    assert data["paths"]["cross_rack"]["min_bandwidth_bytes_per_s"] == 50e9
    assert data["paths"]["same_domain"]["min_bandwidth_bytes_per_s"] == 900e9


def test_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "path", "2x8-a100", "node-0-i0", "node-1-i3"]) == 0
    out = capsys.readouterr().out
    assert "node-0-i0 -> node-1-i3 (across domains): 25.0 GB/s = 200 Gb/s, bottleneck nic:node-0" in out
    assert "nvlink:node-1-i3" in out
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert {row[0]: row[2] for row in cells}["nic:node-0"] == "yes" and [
        "nvlink:node-0-i0",
        "600.0 GB/s (4,800 Gb/s)",
        "",
    ] in cells
    assert "┃ bottleneck ┃" in out  # the column is named (it had no header)
    assert main(["topology", "path", "2x8-a100", "node-0-i0", "node-0-i1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bandwidth_bytes_per_s"] == 600e9 and data["same_domain"] is True
    assert [link["link"] for link in data["links"]] == ["nvlink:node-0-i0", "nvlink:node-0-i1"]


def test_unknown_instance_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "path", "2x8-a100", "node-0-i0", "ghost"]) == 2
    assert "hilum topology path: error: " in (err := capsys.readouterr().err) and "no instance 'ghost'" in err


def test_invalid_file_prints_every_error_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "topology" / "examples" / "2x8-a100.yaml").read_text()
    text = text.replace("gpus: [7], tensor_parallel_size: 1", "gpus: [9], tensor_parallel_size: 1")
    text = text.replace("nic_gbit_per_s: 200}]", "nic_gbit_per_s: -200}]", 1)
    bad = tmp_path / "2x8.yaml"
    bad.write_text(text)
    assert main(["topology", "show", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"hilum topology show: error: {bad}: domains[0].nodes[0].nic_gbit_per_s: must be >= 0.1, got -200",
        f"hilum topology show: error: {bad}: domains[1].instances[7].gpus: GPU 9 does not exist on node-1 (8 GPUs)",
    ]
    assert main(["topology", "show", "no-such-topology"]) == 2
    assert "hilum topology show: error: no-such-topology: (file): file not found" in capsys.readouterr().err
    for blank in ("", " "):  # not read as the folder "."
        assert main(["topology", "show", blank]) == 2
        assert "hilum topology show: error: the topology is empty: give a path" in capsys.readouterr().err


def _plain(text: str) -> str:
    """``text`` without the terminal's styles (rich writes them to what says it is a terminal)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.mark.parametrize("columns", [60, 80, 100])
def test_show_in_a_narrow_terminal_splits_its_tables_to_fit(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a terminal narrower than a table, the table's columns go over several tables that fit, each led by the
    row's name: the Models table (113 characters) used to be drawn 120 wide whatever the terminal, so an 80-column
    one wrapped every line of it."""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(["topology", "show", "2x8-a100-40gb"]) == 0
    out = _plain(capsys.readouterr().out)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= columns and "…" not in out
    for header in ("KV B/token", "max ctx", "NVLink per GPU", "head dim", "oversubscription", "bottleneck of min"):
        assert sum(header in line for line in lines) == 1, header  # each column once
    for figure in ("819,200", "12.5 MiB", "4,096", "123,264", "15,408", "rack-0", "8 x llama-2-13b TP1"):
        assert figure in out
    assert "Models (continued)" in out  # 113 characters whole
    assert ("NVLink domains (continued)" in out) == (columns < 99)  # 99 whole
    assert sum(line.startswith("│ llama-2-13b ") for line in lines) == out.count("Models (continued)") + 1


def test_show_into_a_pipe_draws_each_table_whole(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # a terminal's width says nothing of where a pipe's lines go
    assert main(["topology", "show", "2x8-a100-40gb"]) == 0
    out = capsys.readouterr().out
    assert "(continued)" not in out and "…" not in out
    models = next(line for line in out.splitlines() if line.startswith("│ llama-2-13b "))
    assert models.split("│")[1:-1] == [
        " llama-2-13b ", "     40 ", "    40 / 40 ", "      128 ", " float16 ", "    16 ", "    819,200 ",
        " 12.5 MiB ", "       26.0 ", "   4,096 ",
    ]  # fmt: skip


@pytest.mark.parametrize("columns", [40, 50, 60])
def test_path_in_a_narrow_terminal(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its table was squeezed, link names cut (``nvlink:nvl72…``: which tray is the bottleneck?)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(["topology", "path", "nvl72-gb200", "nvl72-0-i0", "nvl72-1-i15"]) == 0
    out = _plain(capsys.readouterr().out)
    assert "…" not in out and max(map(len, out.splitlines())) <= columns
    links = [line.split()[1] for line in out.splitlines() if line.startswith("│ ") and ":" in line.split()[1]]
    assert links[0] == "nvlink:nvl72-0-i0" and links[-1] == "nvlink:nvl72-1-i15"


def test_show_never_cuts_a_cell_even_where_a_column_alone_is_too_wide(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A column wider than the terminal beside the row's name gets its table alone, wrapped (it was cut to '…')."""
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(["topology", "show", "nvl72-gb200"]) == 0
    out = _plain(capsys.readouterr().out)
    assert "…" not in out and max(map(len, out.splitlines())) <= 40


def test_show_prints_slow_links_and_an_island_over_two_racks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.1 Gb/s read '0 Gb/s' (bisection 0.0 GB/s); an island with nodes in two racks showed the first alone."""
    data = yaml.safe_load((ROOT / "topology" / "examples" / "2x8-a100.yaml").read_text())
    for domain in data["domains"]:
        domain["nodes"][0]["nic_gbit_per_s"] = 0.1
    data["fabric"]["racks"] = [{"id": "ra", "nodes": ["node-0"]}, {"id": "rb", "nodes": ["node-1"]}]
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["topology", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bisection bandwidth: 0.1 Gb/s (0.0125 GB/s)" in out
    island = yaml.safe_load((ROOT / "topology" / "examples" / "nvl72-gb200.yaml").read_text())
    island["fabric"]["racks"] = [
        {"id": "ra", "nodes": [n["id"] for n in island["domains"][0]["nodes"][:9]]},
        {"id": "rb", "nodes": [n["id"] for d in island["domains"] for n in d["nodes"]][9:]},
    ]
    path.write_text(yaml.safe_dump(island))
    assert main(["topology", "show", str(path), "--json"]) == 0
    domains = json.loads(capsys.readouterr().out)["domains"]
    assert (domains[0]["rack"], domains[0]["racks"], domains[1]["racks"]) == ("ra", ["ra", "rb"], ["rb"])
