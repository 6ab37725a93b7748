"""cluster.json as ``hilum up`` rewrites it when a process changes state (RunningCluster.write_info), and the lines
it prints from it once the cluster serves (``describe``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hilum_cli.up import RunningCluster, describe


@dataclass
class _Child:
    name: str
    pid: int
    restarts: int
    now: str

    def state(self) -> str:
        return self.now


class _Supervisor:
    def __init__(self, children: list[_Child]) -> None:
        self._children = children

    def children(self) -> list[_Child]:
        return self._children

    def pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in self._children}


def test_the_coordinator_named_at_the_top_is_one_that_runs(tmp_path: Path) -> None:
    # it named the first replica whatever its state: a script's `hilumctl --coordinator` then reached a down one
    children = [_Child("etcd", 10, 0, "running"), _Child("coordinator-coord-0", 11, 5, "down")]
    children.append(_Child("coordinator-coord-1", 12, 0, "running"))
    info: dict[str, Any] = {"coordinators": {"coord-0": "127.0.0.1:7070", "coord-1": "127.0.0.1:7071"}}
    cluster = RunningCluster(SimpleNamespace(run_dir=tmp_path), _Supervisor(children), info)  # type: ignore[arg-type]

    def written() -> dict[str, Any]:
        cluster.write_info()
        data: dict[str, Any] = json.loads((tmp_path / "cluster.json").read_text())
        return data

    data = written()
    assert data["coordinator"] == "127.0.0.1:7071"
    assert data["processes"]["coordinator-coord-0"] == {"pid": 11, "restarts": 5, "state": "down"}
    children[1].now = "running"  # back: the first replica again
    assert written()["coordinator"] == "127.0.0.1:7070"
    children[1].now = children[2].now = "restarting"  # none runs: the first, as before
    assert written()["coordinator"] == "127.0.0.1:7070"


@pytest.mark.parametrize("simulable", [True, False])
def test_the_printed_bench_line_compares_with_the_simulator_only_where_it_can_time_the_topology(
    simulable: bool,
) -> None:
    """A torch cluster of a model the simulator has no step times for printed a line whose comparison failed after
    the whole live load had run."""
    info = {
        "topology": "t", "engine": "torch", "gateway_url": "http://127.0.0.1:8000", "gateway_urls": [],
        "gateways": {"gateway-0": {}}, "gateway_port_shared": False, "etcd": "127.0.0.1:2379", "etcd_embedded": True,
        "coordinators": {"c0": "127.0.0.1:1"}, "instance_domains": {}, "llumlets": {}, "domain_schedulers": {},
        "run_dir": "/r", "models": ["mistral-7b"], "topology_file": "/r/topology.yaml", "config_file": None,
        "api_keys_file": None, "max_restarts": 5,
    }  # fmt: skip
    line = next(line for line in describe(info, simulable=simulable).splitlines() if line.startswith("bench it:"))
    assert ("--compare-sim /r/topology.yaml" in line) == simulable and "--max-requests 50" in line


def test_the_sim_engines_scaled_step_times_are_said_as_hilum_sim_says_them() -> None:
    """hilum sim said which step times are another GPU's scaled by HBM; hilum up --engine sim on the same topology
    did not."""
    from hilum_cli.up import _scaled
    from topology.load import load_topology

    info = {
        "topology": "t", "engine": "sim", "gateway_url": "http://127.0.0.1:8000", "gateway_urls": [],
        "gateways": {"gateway-0": {}}, "gateway_port_shared": False, "etcd": "127.0.0.1:2379", "etcd_embedded": True,
        "coordinators": {"c0": "127.0.0.1:1"}, "instance_domains": {}, "llumlets": {}, "domain_schedulers": {},
        "run_dir": "/r", "models": ["llama-2-13b"], "topology_file": "/r/topology.yaml", "config_file": None,
        "api_keys_file": None, "max_restarts": 5,
    }  # fmt: skip
    scaled = _scaled(load_topology("2x8-a100-40gb"))
    assert scaled == ["llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM"]
    lines = [line for line in describe(info, scaled=scaled).splitlines() if "step times" in line]
    assert lines == [
        f'  step times    {scaled[0]} (no step times measured on that GPU type: docs/simulator.md, "Model")'
    ]
    assert _scaled(load_topology("2x8-a100")) == []
    assert "step times" not in describe(info)
