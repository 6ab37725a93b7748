"""``hilum up`` refuses clearly when a port is taken, before starting anything."""

from __future__ import annotations

import io
import socket
from pathlib import Path

import pytest
import yaml
from up_harness import TOPOLOGY

from hilum_cli.up import UpConfig, UpError, plan_ports, run_up
from topology.load import parse_topology


def _topology() -> object:
    return parse_topology(yaml.safe_load(TOPOLOGY), "test")


def test_port_zero_picks_distinct_free_ports_for_every_process() -> None:
    plan = plan_ports(_topology(), "127.0.0.1", 0, 0, 0, etcd_embedded=True)  # type: ignore[arg-type]
    assert set(plan.instances) == {"a0", "a1", "b0", "b1"} and set(plan.domains) == {"dom-a", "dom-b"}
    ports = [p for _, p in plan.named()]
    assert len(ports) == 3 + 1 + 2 + 4 + 1 and len(set(ports)) == len(ports) and all(ports)


def test_a_taken_gateway_port_is_a_clear_error_and_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UpError, match=rf"port {port} \(gateway HTTP\) on 127.0.0.1 is already in use: .*--port"):
            plan_ports(_topology(), "127.0.0.1", port, 0, 0, etcd_embedded=True)  # type: ignore[arg-type]
        topo = tmp_path / "t.yaml"
        topo.write_text(TOPOLOGY)
        err = io.StringIO()
        cfg = UpConfig(topology=str(topo), port=port, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "run"))
        assert run_up(cfg, out=io.StringIO(), err=err) == 1
        assert f"hilum up: error: port {port} (gateway HTTP)" in err.getvalue()
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # no log: nothing was started


def test_a_taken_grpc_port_names_the_process_and_the_option() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # the base is the coordinator's port; the domain schedulers and llumlets follow it
        with pytest.raises(UpError, match=rf"port {port} \(coordinator\) .* --grpc-base-port"):
            plan_ports(_topology(), "127.0.0.1", 0, 0, port, etcd_embedded=True)  # type: ignore[arg-type]
