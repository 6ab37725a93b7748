"""hilumctl against a real etcd and two real coordinator processes (``python -m global_coord``) on loopback.

Domain schedulers are stood in for by ``ctl_fake_domains.py``, a process that registers domains and
instances under its lease and publishes summaries (with per-instance load) through
``clusterstate.store`` exactly as rack_sched does; node-0's registered scheduler address is a gRPC
server in this process answering ``GetDomainState`` with a fixed state (for ``requests``), node-1's is a
port where nothing listens. Commands run in-process (``main(argv, env)``); the
``--follow`` test runs ``python -m hilum_cli.ctl`` as a process and stops it with SIGINT.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from etcd_server import EtcdServer, free_port
from rich.console import Console

from clusterstate.etcd import connect, kv_of
from clusterstate.fencing import Fence
from clusterstate.records import (
    AutoscaleRecord,
    DrainIntent,
    DrainKind,
    MigrationRecord,
    MigrationState,
    ScaleEvent,
    decode,
)
from clusterstate.store import Keys, Store
from global_coord.convert import topology_reply
from hilum_cli import ctl as ctl_module
from hilum_cli import ctl_views
from hilum_cli.ctl import build_parser, main
from hilum_cli.ctl_client import DEFAULT_PREFIX, CtlError, Target
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import coordinator_pb2_grpc as pb_grpc
from hilum_proto.v1 import rack_sched_pb2 as rs
from hilum_proto.v1 import rack_sched_pb2_grpc as rs_grpc
from policy.autoscale import AutoscaleState, Evaluation
from topology.load import load_topology

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
T = TypeVar("T")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

INSTANCES = [  # InstanceRegistration fields
    {"instance_id": "node-0-i0", "domain_id": "node-0", "node_id": "node-0", "address": "127.0.0.1:9200",
     "model": "llama-2-7b", "capacity_blocks": 2000},
    {"instance_id": "node-0-i1", "domain_id": "node-0", "node_id": "node-0", "address": "127.0.0.1:9201",
     "model": "llama-2-7b", "capacity_blocks": 2000},
    {"instance_id": "node-1-i0", "domain_id": "node-1", "node_id": "node-1", "address": "127.0.0.1:9300",
     "model": "llama-2-7b", "capacity_blocks": 2000},
]  # fmt: skip


def _load(iid: str, used: int, running: int, waiting: int, draining: bool = False) -> dict[str, Any]:
    """The instance's brief in its domain's summary (policy.domain.InstanceBrief) on a 2000-block instance."""
    return {
        "instance_id": iid,
        "capacity_blocks": 2000,
        "free_blocks": 2000 - used,
        "virtual_usage": float("inf") if draining else float(used),
        "num_running": running,
        "num_waiting": waiting,
        "draining": draining,
    }


def summary_node0(i1_running: int = 1, i1_draining: bool = False) -> dict[str, Any]:
    """node-0 as its scheduler would publish it: 2 instances, 4000 blocks, V = 1500, F = 125 steps."""
    return {
        "domain_id": "node-0", "num_instances": 2, "capacity_blocks": 4000, "virtual_usage": 1500.0,
        "freeness": 125.0, "largest_free_blocks": 1200, "max_instance_capacity_blocks": 2000,
        "num_running": 2 + i1_running, "num_waiting": 1, "draining": False, "model": "llama-2-7b",
        "instances": [_load("node-0-i0", 800, 2, 1), _load("node-0-i1", 700, i1_running, 0, i1_draining)],
    }  # fmt: skip


def summary_node1(running: int = 4, draining: bool = False) -> dict[str, Any]:
    """node-1: 1 instance; while draining, V = +inf and F = -inf (policy.summarize.summarize_domain)."""
    return {
        "domain_id": "node-1", "num_instances": 1, "capacity_blocks": 0 if draining else 2000,
        "virtual_usage": float("inf") if draining else 300.0, "freeness": float("-inf") if draining else 85.0,
        "largest_free_blocks": 0 if draining else 1700, "max_instance_capacity_blocks": 0 if draining else 2000,
        "num_running": running, "num_waiting": 0, "draining": draining, "model": "llama-2-7b",
        "instances": [_load("node-1-i0", 300 if running else 0, running, 0, draining)],
    }  # fmt: skip


# node-0 as its domain scheduler's GetDomainState reports it: i0 runs 2 and queues 1, i1 (draining) runs 1.
NODE0_STATE = rs.DomainState(
    domain_id="node-0", ready=True, migrations_in_flight=1,
    instances=[
        rs.InstanceState(instance_id="node-0-i0", address="127.0.0.1:9200", connected=True, has_load=True,
                         num_running=2, num_waiting=1, running_request_ids=["req-b", "req-a"]),
        rs.InstanceState(instance_id="node-0-i1", address="127.0.0.1:9201", connected=True, has_load=True,
                         draining=True, num_running=1, running_request_ids=["req-c"]),
    ],
)  # fmt: skip


class FakeRackScheduler(rs_grpc.RackSchedulerServicer):
    """Answers GetDomainState with :data:`NODE0_STATE`."""

    def GetDomainState(self, request: rs.GetDomainStateRequest, context: Any) -> rs.DomainState:
        return NODE0_STATE


class Agents:
    """The fake domain schedulers' process; ``send`` returns after the command is applied (or scheduled)."""

    def __init__(self, etcd: EtcdServer, prefix: str, log: Path) -> None:
        cmd = [sys.executable, str(HERE / "ctl_fake_domains.py"), "--etcd", etcd.endpoint, "--prefix", prefix]
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
        )

    def send(self, op: str, delay_s: float = 0.0, **fields: Any) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "delay_s": delay_s, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"fake domain schedulers died; see {self._log.name}"

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._log.close()


@dataclass
class Cluster:
    etcd: EtcdServer
    prefix: str
    agents: Agents
    leader: str  # coordinator id
    leader_address: str
    standby: str
    standby_address: str
    token: int  # the leader's fencing token
    node0_scheduler: str  # host:port of the fake node-0 domain scheduler (answers GetDomainState)
    node1_scheduler: str  # host:port registered for node-1, where nothing listens

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)


async def _status(address: str) -> pb.StatusReply | None:
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            return await pb_grpc.CoordinatorStub(ch).Status(pb.StatusRequest(), timeout=0.5)
    except grpc.aio.AioRpcError:
        return None


async def _settled(addresses: dict[str, str]) -> tuple[str, int]:
    """Wait until one replica leads and every view shows the 3 instances and 2 summaries; (leader, token)."""
    async with asyncio.timeout(20):
        while True:
            sts = [await _status(a) for a in addresses.values()]
            if all(s is not None and s.num_instances == 3 and s.leader_id for s in sts):
                async with grpc.aio.insecure_channel(next(iter(addresses.values()))) as ch:
                    doms = await pb_grpc.CoordinatorStub(ch).ListDomains(pb.ListDomainsRequest())
                if sum(bool(d.summaries) for d in doms.domains) == 2:
                    st = next(s for s in sts if s is not None)
                    return st.leader_id, st.fencing_token
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("hilumctl")
    prefix = f"/ctl-{uuid.uuid4().hex[:8]}/"
    agents = Agents(etcd, prefix, logs / "agents.log")
    addresses = {name: f"127.0.0.1:{free_port()}" for name in ("c1", "c2")}
    rack = grpc.server(ThreadPoolExecutor(max_workers=2))
    rs_grpc.add_RackSchedulerServicer_to_server(FakeRackScheduler(), rack)
    node0 = f"127.0.0.1:{rack.add_insecure_port('127.0.0.1:0')}"
    node1 = f"127.0.0.1:{free_port()}"
    rack.start()
    procs = []
    for name, address in addresses.items():
        cmd = [sys.executable, "-m", "global_coord", "--etcd", etcd.endpoint, "--listen", address, "--id", name]
        cmd += ["--ttl", "2", "--prefix", prefix, "--topology", "2x8-a100", "--log-level", "WARNING"]
        with (logs / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT))
    try:
        agents.send("domain", record={"domain_id": "node-0", "address": node0})
        agents.send("domain", record={"domain_id": "node-1", "address": node1})
        for record in INSTANCES:
            agents.send("instance", record=record)
        agents.send("summary", record=summary_node0())
        agents.send("summary", record=summary_node1())
        leader, token = asyncio.run(_settled(addresses))
        standby = next(n for n in addresses if n != leader)
        yield Cluster(etcd, prefix, agents, leader, addresses[leader], standby, addresses[standby], token, node0, node1)
    finally:
        rack.stop(None)
        agents.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ctl(capsys: pytest.CaptureFixture[str], *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run hilumctl in-process; (exit status, stdout, stderr)."""
    rc = main(list(argv), env=env if env is not None else {})
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def until(read: Callable[[], T], ok: Callable[[T], object], timeout_s: float = 5.0) -> T:
    """``read()`` again until ``ok(value)`` (a standby's view follows etcd a moment later); the last value."""
    deadline = time.monotonic() + timeout_s
    while not ok(value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def ctl_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    rc, out, err = ctl(capsys, *argv)
    assert rc == 0, err
    return json.loads(out)


async def _get(c: Cluster, key: str) -> bytes | None:
    client = connect([c.etcd.endpoint])
    await client.connect()
    try:
        resp = await kv_of(client).get(key, timeout=5)
        return bytes(resp.kvs[0].value) if resp.kvs else None
    finally:
        await client.close()


async def _record_migration(
    c: Cluster, record: MigrationRecord, *then: MigrationState, measured: dict[str, object] | None = None
) -> None:
    """Create a migration record as the leader does (fenced with its token), then move it through ``then``
    (the last transition with the ``measured`` fields, as a domain scheduler records a move's outcome)."""
    client = connect([c.etcd.endpoint])
    await client.connect()
    try:
        store, fence = Store(client, c.keys), Fence(c.keys.leader, c.token)
        created = await store.create_migration(replace(record, fencing_token=c.token), fence)
        assert created.ok
        rev = created.mod_revision
        for k, state in enumerate(then):
            update = measured if k == len(then) - 1 else None
            result = await store.transition(record.migration_id, rev, state, fence=fence, update=update)
            assert result.ok
            rev = result.mod_revision
    finally:
        await client.close()


def _migration(rid: str, src: str, dst: str, blocks: int = 64) -> MigrationRecord:
    return MigrationRecord(
        migration_id=MigrationRecord.make_id(rid, 0), request_id=rid, attempt=0,
        src_instance_id=src, dst_instance_id=dst, src_domain_id=src.rsplit("-", 1)[0],
        dst_domain_id=dst.rsplit("-", 1)[0], blocks=blocks, state=MigrationState.PROPOSED, fencing_token=0,
        links=("nic:node-0", "tor:rack-0"), expected_transfer_s=0.25, expected_downtime_s=0.004, reason="test move",
    )  # fmt: skip


# ---- reads ---------------------------------------------------------------------------------------
def test_status_at_a_standby_names_the_leader(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    st = ctl_json(capsys, "--coordinator", cluster.standby_address, "--json", "status")
    assert st["address"] == cluster.standby_address
    assert st["coordinator_id"] == cluster.standby and st["is_leader"] is False
    assert (st["leader_id"], st["leader_address"]) == (cluster.leader, cluster.leader_address)
    assert st["fencing_token"] == cluster.token > 0
    assert st["etcd_endpoint"] == cluster.etcd.endpoint
    assert (st["num_domains"], st["num_instances"]) == (2, 3)
    assert st["view_revision"] >= cluster.token
    rc, out, _ = ctl(capsys, "status", "--coordinator", cluster.standby_address)  # options after the command
    assert rc == 0
    assert f"{cluster.standby} at {cluster.standby_address} (standby)" in out
    assert f"{cluster.leader} at {cluster.leader_address}, fencing token {cluster.token}" in out
    assert "3 registered" in out


def test_status_through_etcd_talks_to_the_leader(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    st = ctl_json(capsys, "--etcd", cluster.etcd.endpoint, "--prefix", cluster.prefix, "--json", "status")
    assert (st["coordinator_id"], st["is_leader"], st["address"]) == (cluster.leader, True, cluster.leader_address)
    # the environment is read when the command runs
    env = {"HILUM_ETCD": cluster.etcd.endpoint, "HILUM_PREFIX": cluster.prefix}
    rc, out, _ = ctl(capsys, "--json", "status", env=env)
    assert rc == 0 and json.loads(out)["coordinator_id"] == cluster.leader
    rc, out, _ = ctl(capsys, "--json", "status", env={"HILUM_COORDINATOR": cluster.standby_address, **env})
    assert rc == 0 and json.loads(out)["coordinator_id"] == cluster.standby  # HILUM_COORDINATOR first


def test_domains(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    data = ctl_json(capsys, "--coordinator", cluster.standby_address, "--json", "domains")
    assert data["view_revision"] > 0
    node0, node1 = data["domains"]
    assert node0 == {
        "domain_id": "node-0", "registered": True, "scheduler_address": cluster.node0_scheduler, "draining": False,
        "instances_drained": False, "drain_state": "none",
        "summaries": [{
            "model": "llama-2-7b", "num_instances": 2, "capacity_blocks": 4000, "virtual_usage_blocks": 1500.0,
            "freeness": 125.0, "largest_free_blocks": 1200, "max_instance_capacity_blocks": 2000, "num_running": 3,
            "num_waiting": 1, "draining": False,
        }],
    }  # fmt: skip
    assert (node1["domain_id"], node1["summaries"][0]["num_running"], node1["summaries"][0]["freeness"]) == (
        "node-1",
        4,
        85.0,
    )
    rc, out, _ = ctl(capsys, "--coordinator", cluster.standby_address, "domains")
    assert rc == 0
    row = next(line.split() for line in out.splitlines() if line.lstrip().startswith("node-0"))
    assert row == [
        "node-0",
        cluster.node0_scheduler,
        "-",
        "llama-2-7b",
        "2",
        "4000",
        "1500.0",
        "125.0",
        "1200",
        "3",
        "1",
    ]
    assert "2 domains" in out


def test_instances_with_load_and_domain_filter(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    data = ctl_json(capsys, "--coordinator", cluster.leader_address, "--json", "instances")
    assert [i["instance_id"] for i in data["instances"]] == ["node-0-i0", "node-0-i1", "node-1-i0"]
    assert data["instances"][0] == {
        **INSTANCES[0], "draining": False, "drain_state": "none",
        "load": {"used_blocks": 800, "free_blocks": 1200, "num_running": 2, "num_waiting": 1, "draining": False},
    }  # fmt: skip
    only = ctl_json(capsys, "--coordinator", cluster.leader_address, "--json", "instances", "--domain", "node-1")
    assert [(i["instance_id"], i["load"]["num_running"]) for i in only["instances"]] == [("node-1-i0", 4)]
    rc, out, _ = ctl(capsys, "--coordinator", cluster.leader_address, "instances", "--domain", "node-0")
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("node-0-")]
    assert rows == [
        ["node-0-i0", "node-0", "node-0", "127.0.0.1:9200", "llama-2-7b", "2000", "800", "2", "1", "-"],
        ["node-0-i1", "node-0", "node-0", "127.0.0.1:9201", "llama-2-7b", "2000", "700", "1", "0", "-"],
    ]


def test_topology(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    data = ctl_json(capsys, "--coordinator", cluster.standby_address, "topology", "--json")
    assert (data["loaded"], data["name"]) == (True, "2x8-a100")
    assert [d["domain_id"] for d in data["domains"]] == ["node-0", "node-1"]
    # floor((0.9 · 80 GiB − 2 B · 6 738 415 616 params) / (16 tokens · 0.5 MiB)) = 7609 blocks (2x8-a100.yaml)
    assert data["domains"][1]["instances"][3] == {
        "instance_id": "node-1-i3", "node_id": "node-1", "gpus": [3], "tensor_parallel_size": 1,
        "model": "llama-2-7b", "gpu_type": "a100-80gb", "kv_capacity_blocks": 7609,
    }  # fmt: skip
    rc, out, _ = ctl(capsys, "--coordinator", cluster.standby_address, "topology")
    assert rc == 0
    assert "topology 2x8-a100" in out and "2 domains, 16 instances" in out
    row = next(line.split() for line in out.splitlines() if "node-1-i3" in line)
    assert row == ["node-1-i3", "node-1", "3", "1", "llama-2-7b", "a100-80gb", "7609"]


async def _put_autoscale(c: Cluster, record: AutoscaleRecord) -> None:
    """Write the autoscaler's record of a model as the leader does (fenced with its token)."""
    client = connect([c.etcd.endpoint])
    await client.connect()
    try:
        await Store(client, c.keys).put_autoscale(replace(record, fencing_token=c.token), Fence(c.keys.leader, c.token))
    finally:
        await client.close()


def test_autoscale_shows_the_record_and_events_limits_the_decisions_in_both_forms(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    events = tuple(
        ScaleEvent("scale-out", f"node-1-i{k}", 1_700_000_000.0 + k, f"freeness below 50 (round {k})", "done", 1, 0)
        for k in range(12)
    )
    evaluation = Evaluation(1_700_000_100.0, 42.5, None, "", 3, 0, 0, 7, 1, 16)
    asyncio.run(
        _put_autoscale(cluster, AutoscaleRecord("llama-2-7b", AutoscaleState("llama-2-7b"), evaluation, events))
    )
    address = cluster.standby_address  # a standby answers from its view of etcd, a moment behind

    def read(*extra: str) -> Any:
        return ctl_json(capsys, "--coordinator", address, "autoscale", "--json", *extra)

    data = until(read, lambda d: bool(d["models"]))
    assert data["rule"]["enabled"] is False  # these coordinators run without autoscale.enabled
    (model,) = data["models"]
    assert (model["model"], model["freeness"], model["live"], model["requests"]) == ("llama-2-7b", 42.5, 3, 7)
    assert model["fencing_token"] == cluster.token
    assert [e["instance_id"] for e in model["events"]] == [f"node-1-i{k}" for k in range(12)]  # every one kept
    assert [e["instance_id"] for e in read("--events", "2")["models"][0]["events"]] == ["node-1-i10", "node-1-i11"]
    assert read("--events", "0")["models"][0]["events"] == []  # none, not every one ([-0:])
    rc, out, err = ctl(capsys, "--coordinator", address, "autoscale")
    assert rc == 0, err
    shown = [line for line in out.splitlines() if "freeness below 50" in line]
    assert len(shown) == 10 and "(round 2)" in shown[0] and "(round 11)" in shown[-1]  # the latest 10
    rc, out, err = ctl(capsys, "--coordinator", address, "autoscale", "--events", "0")
    assert rc == 0, err
    assert "freeness below 50" not in out and "llama-2-7b" in out
    assert ctl(capsys, "--coordinator", address, "autoscale", "--events", "-1")[0] == 2


def test_the_topology_title_counts_one_domain_in_the_singular() -> None:
    console = Console(file=io.StringIO(), width=200)
    ctl_views.render_topology(console, ctl_views.topology_json(topology_reply(load_topology("1x8-a100"))))
    title = console.file.getvalue().splitlines()[0].strip()
    assert title.startswith("topology 1x8-a100") and title.endswith(": 1 domain, 8 instances")


@pytest.mark.parametrize(("drains", "row"), [(0, "drains       0 intents"), (1, "drains       1 intent")])
def test_the_status_counts_one_drain_intent_in_the_singular(drains: int, row: str) -> None:
    console = Console(file=io.StringIO(), width=200)
    status = {"is_leader": True, "coordinator_id": "c", "address": "a:1", "leader_id": "c", "leader_address": "a:1",
              "fencing_token": 3, "etcd_endpoint": "e:2", "view_revision": 7, "num_domains": 1, "num_instances": 8,
              "num_active_migrations": 0, "num_drains": drains}  # fmt: skip
    ctl_views.render_status(console, status)
    assert console.file.getvalue().splitlines()[-1].rstrip() == row


@pytest.mark.parametrize(
    ("render", "key", "line"),
    [
        (ctl_views.render_domains, "domains", "0 domains (view at revision 7)"),
        (ctl_views.render_instances, "instances", "0 instances (view at revision 7)"),
        (ctl_views.render_migrations, "migrations", "0 migrations (view at revision 7)"),
    ],
)
def test_an_empty_list_prints_its_count_alone(render: Callable[[Console, Any], None], key: str, line: str) -> None:
    # the table's header alone read as a blank row
    console = Console(file=io.StringIO(), width=200)
    render(console, {key: [], "view_revision": 7})
    assert console.file.getvalue() == line + "\n"


def test_migrations_list_and_state_filter(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(_record_migration(cluster, _migration("list-a", "node-x-i0", "node-y-i0"), MigrationState.APPROVED))
    measured = {"transport": "grpc", "measured_bandwidth_bytes_per_s": 12.5e6, "measured_at_s": 1.7e9}
    b = _migration("list-b", "node-x-i1", "node-y-i1", 8)
    asyncio.run(_record_migration(cluster, b, MigrationState.APPROVED, MigrationState.ABORTED, measured=measured))
    c = _migration("list-c", "node-x-i2", "node-y-i2", 4)
    ran = {**measured, "plan": "pre-copy+recompute-prefix", "measured_downtime_s": 0.0062}
    asyncio.run(_record_migration(cluster, c, MigrationState.APPROVED, MigrationState.COMMITTED, measured=ran))
    address = cluster.standby_address
    # the standby's view follows etcd's watch
    by_id = until(
        lambda: {
            m["migration_id"]: m
            for m in ctl_json(capsys, "--coordinator", address, "--json", "migrations")["migrations"]
        },
        lambda ms: {"list-a#0", "list-b#0", "list-c#0"} <= set(ms),
    )
    assert by_id["list-a#0"] == {
        "migration_id": "list-a#0", "request_id": "list-a", "attempt": 0, "state": "approved",
        "src_instance_id": "node-x-i0", "dst_instance_id": "node-y-i0", "src_domain_id": "node-x",
        "dst_domain_id": "node-y", "blocks": 64, "fencing_token": cluster.token,
        "links": ["nic:node-0", "tor:rack-0"], "expected_transfer_s": 0.25, "expected_downtime_s": 0.004,
        "reason": "test move", "mod_revision": by_id["list-a#0"]["mod_revision"],
        "transport": None, "measured_bandwidth_bytes_per_s": None, "plan": None, "measured_downtime_s": None,
    }  # fmt: skip
    assert by_id["list-b#0"]["state"] == "aborted"
    assert (by_id["list-b#0"]["transport"], by_id["list-b#0"]["measured_bandwidth_bytes_per_s"]) == ("grpc", 12.5e6)
    active = ctl_json(capsys, "--coordinator", address, "--json", "migrations", "--state", "active")
    assert "list-a#0" in {m["migration_id"] for m in active["migrations"]}
    assert {m["state"] for m in active["migrations"]} <= {"proposed", "approved"}
    aborted = ctl_json(capsys, "--coordinator", address, "--json", "migrations", "--state", "aborted")
    assert [m["migration_id"] for m in aborted["migrations"]] == ["list-b#0"]
    rc, out, _ = ctl(capsys, "--coordinator", address, "migrations", "--state", "approved")
    assert rc == 0
    row = next(line.split() for line in out.splitlines() if line.lstrip().startswith("list-a#0"))
    assert row[:10] == ["list-a#0", "approved", "node-x-i0", "(node-x)", "node-y-i0", "(node-y)", "64",
                        str(cluster.token), "0.250", "s"]  # fmt: skip
    assert row[10:14] == ["4.0", "ms", "-", "-"]  # the approved downtime; not carried out: no plan, not measured
    rc, out, _ = ctl(capsys, "--coordinator", address, "migrations", "--state", "aborted")
    row = next(line.split() for line in out.splitlines() if line.lstrip().startswith("list-b#0"))
    assert row[12:16] == ["-", "12.5", "MB/s", "(grpc)"]
    # a committed move: the plan the source ran and the pause it measured, beside what was approved
    assert (by_id["list-c#0"]["plan"], by_id["list-c#0"]["measured_downtime_s"]) == (
        "pre-copy+recompute-prefix",
        0.0062,
    )
    rc, out, _ = ctl(capsys, "--coordinator", address, "migrations", "--state", "committed")
    row = next(line.split() for line in out.splitlines() if line.lstrip().startswith("list-c#0"))
    assert row[10:16] == ["4.0", "ms", "(paused", "6.2", "ms)", "pre-copy+recompute-prefix"]  # the unit was missing


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT as a terminal delivers it (default, unblocked). An exec'd process inherits an
    ignored or blocked signal, and Python then never turns it into KeyboardInterrupt: the Ctrl-C below would go
    unseen if this test process ignored SIGINT when it started the child (in 3 of 4 full runs the child outlived
    its Ctrl-C by 30 s, never when the test ran alone)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_follow_prints_a_migration_created_while_it_runs(cluster: Cluster) -> None:
    asyncio.run(_record_migration(cluster, _migration("follow-0", "node-x-i0", "node-y-i0")))
    cmd = [sys.executable, "-m", "hilum_cli.ctl", "--coordinator", cluster.standby_address, "--json"]
    proc = subprocess.Popen(
        [*cmd, "migrations", "--follow", "--state", "proposed", "--state", "committed"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_terminal_sigint,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None and proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()
    # stderr drained as it comes too: a child blocked writing to a full pipe would never see its Ctrl-C through
    errors: list[str] = []
    drainer = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    drainer.start()

    def next_event(migration_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                event: dict[str, Any] = json.loads(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
            if event["migration_id"] == migration_id:
                return event
        raise AssertionError(f"no event for {migration_id} within 10 s")

    try:
        assert next_event("follow-0#0")["migration"]["state"] == "proposed"  # the current records first
        record = _migration("follow-1", "node-x-i0", "node-y-i0", blocks=32)
        asyncio.run(_record_migration(cluster, record))  # created while it follows
        event = next_event("follow-1#0")
        assert event["deleted"] is False
        assert (event["migration"]["state"], event["migration"]["blocks"]) == ("proposed", 32)
        assert event["migration"]["fencing_token"] == cluster.token
        # approved is filtered out (--state proposed --state committed); committed comes through
        asyncio.run(_commit_via_approved(cluster, "follow-1#0"))
        assert next_event("follow-1#0")["migration"]["state"] == "committed"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        reader.join(timeout=5)
        drainer.join(timeout=5)
        proc.stderr.close()
        proc.stdout.close()
    err = "".join(errors)
    assert rc == 0, (
        f"hilumctl migrations --follow: exit {rc} after Ctrl-C (None: still running after 30 s); stderr:\n{err[-4000:]}"
    )


async def _commit_via_approved(c: Cluster, migration_id: str) -> None:
    client = connect([c.etcd.endpoint])
    await client.connect()
    try:
        store = Store(client, c.keys)
        current = await store.get_migration(migration_id)
        assert current is not None
        approved = await store.transition(
            migration_id, current[1], MigrationState.APPROVED, fence=Fence(c.keys.leader, c.token)
        )
        await store.transition(migration_id, approved.mod_revision, MigrationState.COMMITTED)
    finally:
        await client.close()


def test_requests_of_one_domain_both_forms(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    coord = ["--coordinator", cluster.standby_address]
    data = ctl_json(capsys, *coord, "--json", "requests", "--domain", "node-0")
    assert data == {
        "domains": [{"domain_id": "node-0", "scheduler_address": cluster.node0_scheduler, "answered": True,
                     "ready": True, "draining": False, "migrations_in_flight": 1, "error": None}],
        "instances": [
            {"instance_id": "node-0-i0", "domain_id": "node-0", "address": "127.0.0.1:9200", "connected": True,
             "failure": "", "draining": False, "num_running": 2, "num_waiting": 1},
            {"instance_id": "node-0-i1", "domain_id": "node-0", "address": "127.0.0.1:9201", "connected": True,
             "failure": "", "draining": True, "num_running": 1, "num_waiting": 0},
        ],
        "requests": [
            {"request_id": "req-a", "domain_id": "node-0", "instance_id": "node-0-i0"},
            {"request_id": "req-b", "domain_id": "node-0", "instance_id": "node-0-i0"},
            {"request_id": "req-c", "domain_id": "node-0", "instance_id": "node-0-i1"},
        ],
    }  # fmt: skip
    rc, out, err = ctl(capsys, *coord, "requests", "--domain", "node-0")
    assert (rc, err) == (0, "")
    rows = [line.split() for line in out.splitlines()]
    assert [r for r in rows if r and r[0].startswith("req-")] == [
        ["req-a", "node-0", "node-0-i0"], ["req-b", "node-0", "node-0-i0"], ["req-c", "node-0", "node-0-i1"],
    ]  # fmt: skip
    assert [r[:5] for r in rows if r and r[0] == "node-0-i1"] == [["node-0-i1", "node-0", "1", "0", "draining"]]
    assert "3 running, 1 waiting on 2 instances (1 of 1 domain scheduler answered)" in out


def test_requests_of_one_instance(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    coord = ["--coordinator", cluster.leader_address]
    data = ctl_json(capsys, *coord, "requests", "--instance", "node-0-i1", "--domain", "node-0", "--json")
    assert [i["instance_id"] for i in data["instances"]] == ["node-0-i1"]
    assert data["requests"] == [{"request_id": "req-c", "domain_id": "node-0", "instance_id": "node-0-i1"}]
    rc, out, err = ctl(capsys, *coord, "requests", "--domain", "node-0", "--instance", "node-9-i9")
    assert (rc, out) == (1, "")
    assert "instance 'node-9-i9' is not known to domain node-0" in err
    rc, out, err = ctl(capsys, *coord, "requests", "--domain", "node-9")
    assert (rc, out) == (1, "")
    assert "domain 'node-9' is not known to the coordinator" in err


def test_requests_names_a_scheduler_that_does_not_answer(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    coord = ["--coordinator", cluster.leader_address]
    rc, out, err = ctl(capsys, *coord, "--json", "requests")
    assert rc == 1
    data = json.loads(out)  # node-0 is still shown
    assert [r["request_id"] for r in data["requests"]] == ["req-a", "req-b", "req-c"]
    node1 = data["domains"][1]
    assert (node1["domain_id"], node1["answered"], node1["ready"]) == ("node-1", False, None)
    assert f"no domain scheduler answers at {cluster.node1_scheduler}" in node1["error"]
    assert err.count("hilumctl: error: ") == 1
    assert f"domain node-1: no domain scheduler answers at {cluster.node1_scheduler}" in err
    assert "python -m rack_sched" in err
    rc, out, err = ctl(capsys, *coord, "requests")
    assert rc == 1 and "(1 of 2 domain schedulers answered)" in out and cluster.node1_scheduler in err


# ---- drain ---------------------------------------------------------------------------------------
def test_drain_and_undrain_via_a_standby_round_trip(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    key = cluster.keys.drain(DrainKind.INSTANCE, "node-1-i0")
    standby = ["--coordinator", cluster.standby_address]
    data = ctl_json(capsys, *standby, "--json", "drain", "node-1-i0", "--reason", "kernel upgrade")
    assert data == {
        "action": "drain", "kind": "instance", "target_id": "node-1-i0", "changed": True, "reason": "kernel upgrade",
        "fencing_token": cluster.token, "leader_address": cluster.leader_address, "wait": None,
    }  # fmt: skip
    stored = asyncio.run(_get(cluster, key))
    assert stored is not None
    assert decode(DrainIntent, stored, key) == DrainIntent(
        DrainKind.INSTANCE, "node-1-i0", "kernel upgrade", cluster.token
    )
    listed = until(
        lambda: ctl_json(capsys, *standby, "--json", "instances", "--domain", "node-1"),
        lambda data: data["instances"][0]["draining"],
    )
    assert listed["instances"][0]["instance_id"] == "node-1-i0"
    rc, out, _ = ctl(capsys, *standby, "drain", "node-1-i0")
    assert (
        rc == 0
        and out.strip() == f"instance node-1-i0 was already draining (recorded with fencing token {cluster.token})"
    )
    data = ctl_json(capsys, *standby, "--json", "undrain", "node-1-i0")
    assert (data["action"], data["changed"], data["leader_address"]) == ("undrain", True, cluster.leader_address)
    assert asyncio.run(_get(cluster, key)) is None
    rc, out, _ = ctl(capsys, *standby, "undrain", "node-1-i0")
    assert rc == 0 and out.strip() == "instance node-1-i0 was not draining: nothing to undo"


def test_drain_wait_returns_once_the_instance_is_empty(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    agents = cluster.agents
    # the scheduler applies the drain at 0.4 s (one request still running); the instance empties at 0.9 s
    t0 = time.monotonic()
    agents.send("summary", delay_s=0.4, record=summary_node0(i1_running=1, i1_draining=True))
    agents.send("summary", delay_s=0.9, record=summary_node0(i1_running=0, i1_draining=True))
    rc, out, err = ctl(
        capsys, "--coordinator", cluster.standby_address, "--json", "drain", "node-0-i1", "--wait",
        "--interval", "0.05", "--timeout", "10",
    )  # fmt: skip
    took = time.monotonic() - t0
    assert rc == 0, err
    data = json.loads(out)
    assert (data["kind"], data["changed"], data["leader_address"]) == ("instance", True, cluster.leader_address)
    assert data["wait"]["empty"] is True
    assert (data["wait"]["num_running"], data["wait"]["num_waiting"], data["wait"]["active_migrations"]) == (0, 0, 0)
    assert 0.9 <= took < 8  # the instance is empty only from 0.9 s on
    assert 0 < data["wait"]["waited_s"] <= took
    assert asyncio.run(_get(cluster, cluster.keys.drain(DrainKind.INSTANCE, "node-0-i1"))) is not None
    assert ctl(capsys, "--coordinator", cluster.leader_address, "undrain", "node-0-i1")[0] == 0
    agents.send("summary", record=summary_node0())


def test_drain_wait_on_a_domain_waits_for_its_migrations(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    agents = cluster.agents
    leader = ["--coordinator", cluster.leader_address]
    # not applied by the scheduler within the limit: exit 1, with the progress in JSON
    rc, out, err = ctl(capsys, *leader, "--json", "drain", "node-0", "--wait", "--timeout", "0.3", "--interval", "0.05")
    assert rc == 1
    wait = json.loads(out)["wait"]
    assert (wait["empty"], wait["num_running"], wait["num_waiting"]) == (False, 3, 1)
    assert "timed out after" in err and "domain node-0: the domain scheduler of node-0 has not applied" in err
    assert ctl(capsys, *leader, "undrain", "node-0")[0] == 0

    # node-1 empties at 0.6 s, but a request moving out of it is committed only at 1.2 s
    move = _migration("drain-out", "node-1-i0", "node-0-i0")
    asyncio.run(_record_migration(cluster, move, MigrationState.APPROVED))
    agents.send("summary", delay_s=0.6, record=summary_node1(running=0, draining=True))
    agents.send("commit", delay_s=1.2, migration_id=move.migration_id)
    rc, out, err = ctl(capsys, *leader, "drain", "node-1", "--wait", "--interval", "0.05", "--timeout", "10")
    assert rc == 0, err
    assert out.strip() == (
        "domain node-1 is empty: no running or queued requests, no migrations in flight. It is safe to stop it."
    )
    assert f"drain of domain node-1 recorded by the leader at {cluster.leader_address}" in err
    assert "domain node-1: the domain scheduler of node-1 has not applied the drain yet" in err
    assert "domain node-1: 1 cross-domain migration in flight" in err
    # a draining domain's usage is +inf and its freeness -inf: null in JSON; the table shows the state
    node1 = ctl_json(capsys, *leader, "--json", "domains")["domains"][1]
    assert node1["draining"] is True and node1["summaries"][0]["draining"] is True
    assert node1["drain_state"] == "draining"
    assert (node1["summaries"][0]["virtual_usage_blocks"], node1["summaries"][0]["freeness"]) == (None, None)
    rc, out, _ = ctl(capsys, *leader, "domains")
    assert next(line.split() for line in out.splitlines() if line.lstrip().startswith("node-1"))[2:10] == [
        "draining", "llama-2-7b", "1", "-", "-", "-", "-", "0",
    ]  # fmt: skip
    instance = ctl_json(capsys, *leader, "--json", "instances", "--domain", "node-1")["instances"][0]
    assert (instance["draining"], instance["load"]["draining"], instance["drain_state"]) == (True, True, "draining")
    assert ctl(capsys, *leader, "undrain", "node-1")[0] == 0
    agents.send("summary", record=summary_node1())


def test_a_domain_whose_every_instance_is_drained_is_draining_not_undraining(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every instance of node-1 drained one by one: its scheduler drains the domain with no domain intent, which
    ``domains`` showed as ``undraining`` (a drain whose intent was removed)."""
    leader = ["--coordinator", cluster.leader_address]

    def node1_until(summary_draining: bool) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            node1 = ctl_json(capsys, *leader, "--json", "domains")["domains"][1]
            if node1["summaries"][0]["draining"] is summary_draining or time.monotonic() > deadline:
                return dict(node1)
            time.sleep(0.05)

    assert ctl(capsys, *leader, "drain", "node-1-i0")[0] == 0  # node-1's one registered instance
    cluster.agents.send("summary", record=summary_node1(running=0, draining=True))
    node1 = node1_until(True)
    assert (node1["draining"], node1["instances_drained"], node1["drain_state"]) == (False, True, "draining")
    rc, out, _ = ctl(capsys, *leader, "domains")
    assert rc == 0
    assert next(line.split() for line in out.splitlines() if line.lstrip().startswith("node-1"))[2] == "draining"
    assert ctl(capsys, *leader, "undrain", "node-1-i0")[0] == 0  # its scheduler has not published since
    node1 = ctl_json(capsys, *leader, "--json", "domains")["domains"][1]
    assert (node1["draining"], node1["instances_drained"], node1["drain_state"]) == (False, False, "undraining")
    cluster.agents.send("summary", record=summary_node1())
    assert node1_until(False)["drain_state"] == "none"


def test_drain_target_must_be_known_unless_its_kind_is_given(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    leader = ["--coordinator", cluster.leader_address]
    rc, _, err = ctl(capsys, *leader, "drain", "node-9-i0")
    assert rc == 1 and "'node-9-i0' is not a registered instance or domain, nor" in err and "--instance" in err
    # an instance listed only in the topology (not registered) is known; an explicit kind skips the check
    data = ctl_json(capsys, *leader, "--json", "drain", "node-1-i7", "--wait", "--timeout", "1")
    assert data["kind"] == "instance" and data["wait"]["empty"] is True  # not registered: nothing runs there
    assert "not registered" in data["wait"]["detail"]
    data = ctl_json(capsys, *leader, "--json", "drain", "--domain", "future-rack")
    assert (data["kind"], data["target_id"], data["changed"]) == ("domain", "future-rack", True)
    # every intent is listed, each saying whether its target is known (a mistyped one shows up here)
    listed = until(lambda: ctl_json(capsys, *leader, "--json", "drains"), lambda data: len(data["drains"]) == 2)
    assert listed["drains"] == [
        {"kind": "domain", "target_id": "future-rack", "reason": "", "fencing_token": cluster.token,
         "target_known": False},
        {"kind": "instance", "target_id": "node-1-i7", "reason": "", "fencing_token": cluster.token,
         "target_known": True},
    ]  # fmt: skip
    rc, out, _ = ctl(capsys, "--coordinator", cluster.standby_address, "drains")  # a read: any replica answers
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["domain"], ["instance"])]
    assert rc == 0 and ["domain", "future-rack", str(cluster.token), "no:"] == rows[0][:4], out
    assert ["instance", "node-1-i7", str(cluster.token), "yes", "-"] == rows[1], out
    assert out.splitlines()[-1].startswith("2 drain intents (view at revision ") and "; 1 names nothing known" in out
    assert ctl(capsys, *leader, "--json", "drain", "--instance", "node-1-i77")[0] == 0  # a typo, recorded
    until(lambda: ctl_json(capsys, *leader, "--json", "drains"), lambda data: len(data["drains"]) == 3)
    rc, out, err = ctl(capsys, *leader, "undrain", "node-1-i77")  # found by its intent, without --instance
    assert (rc, out.strip()) == (0, "instance node-1-i77 is no longer draining"), err
    for argv in (["node-1-i7"], ["--domain", "future-rack"]):
        assert ctl(capsys, *leader, "undrain", *argv)[0] == 0
    assert until(lambda: ctl_json(capsys, *leader, "--json", "drains"), lambda data: not data["drains"])
    rc, out, _ = ctl(capsys, *leader, "drains")
    assert rc == 0 and out.startswith("0 drain intents (view at revision "), out
    # a kind that contradicts what the name is known as: its intent would name nothing (nothing recorded)
    for argv, said in (
        (["node-1", "--instance"], "'node-1' is a domain, not an instance: drop --instance"),
        (["node-1-i7", "--domain"], "'node-1-i7' is an instance, not a domain: drop --domain"),
    ):
        rc, out, err = ctl(capsys, *leader, "drain", *argv)
        assert (rc, out) == (2, "") and said in err, err
    assert ctl_json(capsys, *leader, "--json", "status")["num_drains"] == 0
    rc, out, err = ctl(capsys, *leader, "undrain", "node-1", "--instance")  # not checked: an old intent can go
    assert rc == 0 and "instance node-1 was not draining" in out, (out, err)


# ---- errors --------------------------------------------------------------------------------------
def test_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    rc, out, err = ctl(capsys, "--coordinator", f"127.0.0.1:{port}", "status")
    assert (rc, out) == (1, "")
    assert f"no coordinator answers at 127.0.0.1:{port}" in err and "python -m global_coord" in err
    rc, out, err = ctl(capsys, "--etcd", f"127.0.0.1:{port}", "--rpc-timeout", "1", "domains")
    assert (rc, out) == (1, "")
    assert f"etcd at 127.0.0.1:{port}" in err and "etcdctl" in err
    # several replicas: a dead one is skipped; when none answers, every address is named
    other = free_port()
    rc, out, err = ctl(capsys, "--coordinator", f"127.0.0.1:{port},127.0.0.1:{other}", "status")
    assert (rc, out) == (1, "")
    assert "no coordinator answers Status at any of the 2 addresses" in err
    assert f"127.0.0.1:{port}: UNAVAILABLE" in err and f"127.0.0.1:{other}: UNAVAILABLE" in err


def test_a_dead_replica_is_skipped(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    addresses = f"127.0.0.1:{free_port()},{cluster.standby_address}"
    st = ctl_json(capsys, "--coordinator", addresses, "--json", "status")
    assert st["address"] == cluster.standby_address


def test_an_unknown_name_is_exit_1_in_every_command(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    coord = ["--coordinator", cluster.leader_address]
    for argv in (["instances", "--domain", "nosuch"], ["requests", "--domain", "nosuch"], ["--json", "instances",
                 "--domain", "nosuch"]):  # fmt: skip
        rc, out, err = ctl(capsys, *coord, *argv)
        assert (rc, out) == (1, ""), argv
        assert f"hilumctl: error: domain 'nosuch' is not known to the coordinator at {cluster.leader_address}" in err
        assert "its topology does not list it" in err
    rc, out, err = ctl(capsys, *coord, "requests", "--domain", "node-0", "--instance", "node-9-i9")
    assert (rc, out) == (1, "") and "instance 'node-9-i9' is not known to domain node-0" in err
    rc, out, err = ctl(capsys, *coord, "drain", "nosuch")
    assert (rc, out) == (1, "") and "'nosuch' is not a registered instance or domain, nor" in err


def test_an_etcd_endpoint_that_cannot_be_dialled_is_an_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, err = ctl(capsys, "--etcd", "no-such-host.invalid:2379", "status")
    assert (rc, out) == (1, "")
    assert err.startswith(
        "hilumctl: error: --etcd: etcd endpoint 'no-such-host.invalid:2379': cannot resolve 'no-such-host.invalid' "
        "to an IPv4 address"
    )
    rc, out, err = ctl(capsys, "status", env={"HILUM_ETCD": "[::1]:2379"})
    assert (rc, out) == (1, "")
    assert err.startswith("hilumctl: error: HILUM_ETCD: etcd endpoint '[::1]:2379': an IPv6 address")


def test_etcd_without_a_leader(etcd: EtcdServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = ctl(capsys, "--etcd", etcd.endpoint, "--prefix", "/nobody-leads/", "status")
    assert (rc, out) == (1, "")
    assert "no coordinator leads" in err and "/nobody-leads/leader" in err and "--prefix" in err
    rc, out, err = ctl(capsys, "status", env={"HILUM_ETCD": etcd.endpoint, "HILUM_PREFIX": "/nobody-leads/"})
    assert (rc, out) == (1, "") and "/nobody-leads/leader" in err
    assert "check that HILUM_PREFIX matches the coordinators' --prefix (/nobody-leads/)" in err


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = ctl(capsys, "status")
    assert rc == 2 and "pass --coordinator HOST:PORT" in err and "HILUM_COORDINATOR" in err
    for flag, wanted in (("--coordinator", "HOST:PORT"), ("--etcd", "HOST:PORT")):
        rc, out, err = ctl(capsys, flag, "", "status")  # given empty: refused, not taken for absent
        assert (rc, out) == (2, "") and f"{flag} is empty: give {wanted}" in err
    rc, out, err = ctl(capsys, "--etcd", "h:2", "--prefix", " ", "status")  # it was the default prefix
    assert (rc, out) == (2, "") and "--prefix is empty: give the coordinators' key prefix, or leave it out" in err
    for argv, wanted in (
        (["drain", " ", "--domain"], "error: DOMAIN is empty: give a domain id"),  # it was recorded: domain " "
        (["undrain", "", "--instance"], "error: INSTANCE is empty: give an instance id"),
        (["drain", " "], "error: INSTANCE|DOMAIN is empty: give an instance id or a domain id"),
        (["instances", "--domain", ""], "--domain is empty: give a domain id"),  # it listed every domain
        (["requests", "--instance", " "], "--instance is empty: give an instance id"),
    ):
        rc, out, err = ctl(capsys, "--coordinator", "h:1", *argv)  # refused before anything is contacted
        assert (rc, out) == (2, "") and wanted in err
    rc, _, err = ctl(capsys, "--coordinator", "localhost", "status")
    assert rc == 2 and "'localhost' is not HOST:PORT" in err
    rc, _, err = ctl(capsys, "--etcd", "h:1", "--prefix", "hilum", "status")
    assert rc == 2 and "--prefix: etcd key prefix must start and end with '/', got 'hilum'" in err
    # an option the command checks is a usage error before anything is contacted (nothing listens at h:1)
    rc, out, err = ctl(capsys, "--coordinator", "h:1", "drain", "i0", "--wait", "--interval", "0")
    assert (rc, out) == (2, "") and "--interval: must be a finite number of seconds > 0, got 0" in err
    for bad in ("0", "nan", "inf"):
        rc, out, err = ctl(capsys, "--coordinator", "h:1", "--rpc-timeout", bad, "status")
        assert (rc, out) == (2, "") and "--rpc-timeout: must be a finite number of seconds > 0" in err
    with pytest.raises(SystemExit) as exc:
        main(["--coordinator", "h:1", "--etcd", "h:2", "status"], env={})
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["--coordinator", "h:1", "migrations", "--state", "running"], env={})
    assert exc.value.code == 2
    assert "invalid choice: 'running'" in capsys.readouterr().err


@pytest.fixture
def contacted(monkeypatch: pytest.MonkeyPatch) -> list[Target]:
    """The targets hilumctl went on to contact: AdminClient is replaced by one that records its target and stops
    with a runtime error (exit 1), so a usage error leaves this empty."""
    targets: list[Target] = []

    class Recorder:
        def __init__(self, target: Target, rpc_timeout_s: float) -> None:
            targets.append(target)
            raise CtlError("contacted")

    monkeypatch.setattr(ctl_module, "AdminClient", Recorder)
    return targets


def test_prefix_applies_only_with_etcd(capsys: pytest.CaptureFixture[str], contacted: list[Target]) -> None:
    for argv in (["--prefix", "/p/", "status"], ["status", "--prefix", "/p/"], ["--prefix", "", "status"]):
        rc, out, err = ctl(capsys, "--coordinator", "h:1", *argv)
        assert (rc, out) == (2, ""), argv
        assert "hilumctl: error: --prefix applies only with --etcd" in err
        assert "the coordinator's address is given by --coordinator: drop --prefix" in err
    for env in ({"HILUM_COORDINATOR": "h:1"}, {"HILUM_COORDINATOR": "h:1", "HILUM_ETCD": "h:2"}):
        rc, out, err = ctl(capsys, "--prefix", "/p/", "status", env=env)  # HILUM_COORDINATOR wins over HILUM_ETCD
        assert (rc, out) == (2, "") and "the coordinator's address is taken from HILUM_COORDINATOR" in err
    assert contacted == []
    # HILUM_PREFIX is ambient: ignored beside a coordinator address, even a malformed one
    for env in ({"HILUM_PREFIX": "/p/"}, {"HILUM_PREFIX": "hilum"}):
        assert ctl(capsys, "--coordinator", "h:1", "status", env=env)[0] == 1
        assert ctl(capsys, "status", env={"HILUM_COORDINATOR": "h:1", **env})[0] == 1
    assert [(t.coordinators, t.prefix) for t in contacted] == [(("h:1",), DEFAULT_PREFIX)] * 4
    contacted.clear()
    # with etcd: the flag, else HILUM_PREFIX, else the default
    assert ctl(capsys, "--etcd", "h:2", "--prefix", "/p/", "status", env={"HILUM_PREFIX": "/q/"})[0] == 1
    assert ctl(capsys, "--prefix", "/p/", "status", env={"HILUM_ETCD": "h:2", "HILUM_PREFIX": "/q/"})[0] == 1
    assert ctl(capsys, "status", env={"HILUM_ETCD": "h:2", "HILUM_PREFIX": "/q/"})[0] == 1
    assert ctl(capsys, "--etcd", "h:2", "status")[0] == 1
    assert [(t.etcd, t.prefix, t.source, t.prefix_source) for t in contacted] == [
        (("h:2",), "/p/", "--etcd", "--prefix"),
        (("h:2",), "/p/", "HILUM_ETCD", "--prefix"),
        (("h:2",), "/q/", "HILUM_ETCD", "HILUM_PREFIX"),
        (("h:2",), DEFAULT_PREFIX, "--etcd", "--prefix"),
    ]


def test_drain_timeout_and_interval_need_wait(capsys: pytest.CaptureFixture[str], contacted: list[Target]) -> None:
    for flag, value in (("--timeout", "600"), ("--interval", "0.5")):  # they were ignored: no wait happened
        for kind in ([], ["--instance"]):
            rc, out, err = ctl(capsys, "--coordinator", "h:1", "drain", "i0", *kind, flag, value)
            assert (rc, out) == (2, ""), (flag, kind)
            assert f"hilumctl: error: {flag} applies only with --wait: add --wait, or drop {flag}" in err
    for flag, value, wanted in (
        ("--timeout", "-1", ">= 0, got -1"),
        ("--timeout", "nan", ">= 0, got nan"),  # it never timed out
        ("--timeout", "inf", ">= 0, got inf"),
        ("--interval", "0", "> 0, got 0"),  # the message named --timeout and its default too
        ("--interval", "nan", "> 0, got nan"),  # it polled without a pause
    ):
        rc, out, err = ctl(capsys, "--coordinator", "h:1", "drain", "i0", "--wait", flag, value)
        assert (rc, out) == (2, ""), (flag, value)
        assert err.strip() == f"hilumctl: error: {flag}: must be a finite number of seconds {wanted}"
    assert contacted == []
    assert ctl(capsys, "--coordinator", "h:1", "drain", "i0", "--wait", "--timeout", "600")[0] == 1  # accepted
    assert len(contacted) == 1
    # not given: the defaults, with or without --wait
    for argv, wanted in (
        (["drain", "i0"], (300.0, 1.0)),
        (["drain", "i0", "--wait"], (300.0, 1.0)),
        (["drain", "i0", "--wait", "--timeout", "600", "--interval", "0.5"], (600.0, 0.5)),
    ):
        ns = build_parser().parse_args(argv)
        ctl_module._check_options(ns)
        assert (ns.timeout, ns.interval) == wanted, argv


def test_errors_about_environment_values_name_the_variable(
    capsys: pytest.CaptureFixture[str], contacted: list[Target]
) -> None:
    for env, wanted in (
        ({"HILUM_COORDINATOR": "bad"}, "hilumctl: error: HILUM_COORDINATOR: 'bad' is not HOST:PORT"),
        ({"HILUM_ETCD": "bad"}, "hilumctl: error: HILUM_ETCD: 'bad' is not HOST:PORT"),
        (
            {"HILUM_ETCD": "h:1", "HILUM_PREFIX": "hilum"},
            "HILUM_PREFIX: etcd key prefix must start and end with '/', got 'hilum'",
        ),
        ({"HILUM_COORDINATOR": "h:1,"}, "hilumctl: error: HILUM_COORDINATOR: entry 2 of 'h:1,' is empty"),
    ):
        rc, out, err = ctl(capsys, "status", env=env)
        assert (rc, out) == (2, "") and wanted in err, env
        assert "--coordinator:" not in err and "--etcd:" not in err and "--prefix:" not in err
    rc, out, err = ctl(capsys, "--etcd", "h:1", "status", env={"HILUM_PREFIX": "hilum"})  # the flag's etcd
    assert (rc, out) == (2, "") and "hilumctl: error: HILUM_PREFIX: etcd key prefix must start and end with '/'" in err
    rc, out, err = ctl(capsys, "--coordinator", "bad", "status", env={"HILUM_COORDINATOR": "h:1"})
    assert (rc, out) == (2, "") and "hilumctl: error: --coordinator: 'bad' is not HOST:PORT" in err
    assert contacted == []


def test_a_runtime_error_names_the_variable_the_address_came_from(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    rc, out, err = ctl(capsys, "status", env={"HILUM_COORDINATOR": f"127.0.0.1:{port}"})
    assert (rc, out) == (1, "") and f"no coordinator answers at 127.0.0.1:{port}" in err
    assert "that HILUM_COORDINATOR names its --listen/--advertise address" in err
    rc, out, err = ctl(capsys, "--rpc-timeout", "1", "status", env={"HILUM_ETCD": f"127.0.0.1:{port}"})
    assert (rc, out) == (1, "") and f"etcd at 127.0.0.1:{port}" in err and "that HILUM_ETCD names its client URL" in err


def test_an_empty_entry_in_an_address_list_is_refused(
    capsys: pytest.CaptureFixture[str], contacted: list[Target]
) -> None:
    for flag, value, wanted in (
        ("--coordinator", "a:1,,b:2", "--coordinator: entry 2 of 'a:1,,b:2' is empty: drop the extra comma"),
        ("--coordinator", "a:1,", "--coordinator: entry 2 of 'a:1,' is empty"),  # a trailing comma
        ("--etcd", ",a:1", "--etcd: entry 1 of ',a:1' is empty"),
        ("--etcd", "a:1, ,b:2", "--etcd: entry 2 of 'a:1, ,b:2' is empty"),
    ):
        rc, out, err = ctl(capsys, flag, value, "status")
        assert (rc, out) == (2, "") and f"hilumctl: error: {wanted}" in err, value
    assert contacted == []
    assert ctl(capsys, "--coordinator", " a:1 , b:2 ", "status")[0] == 1  # blanks around an entry are fine
    assert [t.coordinators for t in contacted] == [("a:1", "b:2")]


@pytest.mark.parametrize("width", [120, 200, 400])
def test_a_migrations_table_too_wide_for_the_console_is_split_and_its_long_reason_wrapped(width: int) -> None:
    """Squeezed beside ten columns, a reason took about 14 characters a line (each row 7 lines at 200 columns)."""
    reason = ("freeness -3.2 below -1.0: node-0-i3 holds 410 of 420 blocks, 12 requests waiting; coordinator approved: "
              "downtime 4.1 ms within 50 ms, 1.1 GB over nic:node-0")  # fmt: skip
    move = {"migration_id": "req-7#0", "state": "committed", "src_instance_id": "node-0-i3", "src_domain_id": "node-0",
            "dst_instance_id": "node-1-i5", "dst_domain_id": "node-1", "blocks": 64, "fencing_token": 12,
            "expected_transfer_s": 0.25, "expected_downtime_s": 0.0041, "measured_downtime_s": 0.0052,
            "plan": "pre-copy", "measured_bandwidth_bytes_per_s": 4.4e9, "transport": "grpc",
            "reason": reason}  # fmt: skip
    console = Console(file=io.StringIO(), width=width)
    ctl_views.render_migrations(console, {"migrations": [move], "view_revision": 9})
    text = console.file.getvalue()
    lines = [line.strip() for line in text.splitlines()]
    assert max(len(line) for line in text.splitlines()) <= width and "…" not in text
    headers = [line.split() for line in lines if line.startswith("MIGRATION")]
    assert all(h[0] == "MIGRATION" for h in headers)  # each part led by the id
    assert [c for h in headers for c in h[1:]] == ["STATE", "FROM", "TO", "BLOCKS", "TOKEN", "TRANSFER", "DOWNTIME",
                                                  "PLAN", "MEASURED", "REASON"]  # fmt: skip
    assert len(headers) == {120: 3, 200: 2, 400: 1}[width]  # at 200 the reason alone in the second
    if width == 400:  # one table: the reason last
        assert next(line for line in lines if line.startswith("req-7#0")).endswith(reason)
    else:  # the reason table's rows: its text, wrapped at 120, after the id
        start = next(k for k, line in enumerate(lines) if line.split() == ["MIGRATION", "REASON"]) + 2
        assert " ".join(" ".join(lines[start : lines.index("", start)]).removeprefix("req-7#0").split()) == reason
    assert lines[-1] == "1 migration (view at revision 9)"
