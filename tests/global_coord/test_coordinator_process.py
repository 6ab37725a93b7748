"""Coordinator replicas as real processes: failover within the TTL, and a paused leader is fenced out."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from etcd_server import EtcdServer, free_port

from clusterstate.etcd import connect
from clusterstate.fencing import FencingGuard
from clusterstate.records import InstanceRegistration, SummaryRecord, encode
from clusterstate.session import Registrar
from clusterstate.store import Keys, Store
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import coordinator_pb2_grpc as pb_grpc
from policy.domain import DomainSummary, InstanceBrief

REPO = Path(__file__).resolve().parents[2]
TTL_S = 2


class Replica:
    def __init__(self, name: str, address: str, proc: subprocess.Popen[bytes]) -> None:
        self.name, self.address, self.proc = name, address, proc


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(etcd: EtcdServer, prefix: str, name: str, *, module: list[str]) -> Replica:
        address = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}  # hilum's `proto`, not proto-plus's
        cmd = [sys.executable, *module, "--etcd", etcd.endpoint, "--listen", address, "--id", name]
        cmd += ["--ttl", str(TTL_S), "--prefix", prefix]
        with (tmp_path / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return Replica(name, address, proc)

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _status(address: str) -> pb.StatusReply | None:
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            return await pb_grpc.CoordinatorStub(ch).Status(pb.StatusRequest(), timeout=0.5)
    except grpc.aio.AioRpcError:
        return None


async def _until_leader(replicas: list[Replica], timeout_s: float, exclude: str = "") -> tuple[Replica, int]:
    async with asyncio.timeout(timeout_s):
        while True:
            for r in replicas:
                st = await _status(r.address)
                if st is not None and st.is_leader and r.name != exclude:
                    return r, st.fencing_token
            await asyncio.sleep(0.05)


def test_failover_within_ttl_after_leader_is_killed(
    etcd: EtcdServer, prefix: str, spawn: object, tmp_path: Path
) -> None:
    replicas = [spawn(etcd, prefix, f"c{i}", module=["-m", "global_coord"]) for i in (1, 2)]  # type: ignore[operator]

    async def main() -> None:
        leader, token = await _until_leader(replicas, 15)
        standby = next(r for r in replicas if r is not leader)
        async with asyncio.timeout(5):
            while (st := await _status(standby.address)) is None or st.leader_id != leader.name:
                await asyncio.sleep(0.05)
        assert not st.is_leader and st.fencing_token == token and st.leader_address == leader.address
        leader.proc.kill()
        t0 = time.monotonic()
        new, new_token = await _until_leader([standby], TTL_S + 3)
        took = time.monotonic() - t0
        assert new is standby and new_token > token
        assert took < TTL_S + 1.5, f"failover took {took:.2f} s with a {TTL_S} s TTL"
        # a clean stop resigns at once: nobody leads right after, without waiting for the TTL
        standby.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(standby.proc.wait, 5) == 0

    asyncio.run(main())
    for r in replicas:  # ready, as every hilum process says it (hilum up waits for " serving at "), once
        log = (tmp_path / f"{r.name}.log").read_text()
        assert f"coordinator {r.name} serving at {r.address}\n" in log and log.count(" serving at ") == 1, log


def test_paused_leader_cannot_get_an_approval_accepted(etcd: EtcdServer, prefix: str, spawn: object) -> None:
    module = [str(REPO / "tests" / "global_coord" / "coord_proc.py")]
    keys = Keys(prefix)

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        reg = Registrar(client, 5, rng=random.Random(3), name="agents")
        await reg.set(keys.instance("a0"), encode(InstanceRegistration("a0", "a", "n0", "h:1", "m", 1000)))
        await reg.set(keys.instance("b0"), encode(InstanceRegistration("b0", "b", "n1", "h:2", "m", 1000)))
        # destinations come from the domains' summaries (their real free space): b publishes one
        brief = InstanceBrief("b0", 1000, 1000, 0.0, 0, 0, False)
        summary = DomainSummary("b", 1, 1000, 0.0, 1000.0, 1000, 1000, 0, 0, False, model="m", instances=(brief,))
        await reg.set(keys.summary("b"), encode(SummaryRecord("b", (summary,))))
        stop = asyncio.Event()
        reg_task = asyncio.create_task(reg.run(stop))
        await reg.registered.wait()
        replicas = [spawn(etcd, prefix, f"p{i}", module=module) for i in (1, 2)]  # type: ignore[operator]
        old, old_token = await _until_leader(replicas, 15)
        standby = next(r for r in replicas if r is not old)

        def move(request_id: str) -> pb.MigrationProposal:
            return pb.MigrationProposal(
                proposer_domain_id="a", request_id=request_id, src_instance_id="a0",
                blocks=10, num_tokens=160, remaining_tokens=500, decode_step_s=0.02,
            )  # fmt: skip

        async with grpc.aio.insecure_channel(old.address) as och:
            ostub = pb_grpc.CoordinatorStub(och)
            # the views must see the instances before the leader can place anything
            async with asyncio.timeout(5):
                while (await ostub.Status(pb.StatusRequest())).num_instances < 2:
                    await asyncio.sleep(0.05)
            ok = await ostub.ProposeMigration(move("r1"), timeout=5)
            assert ok.approved and ok.fencing_token == old_token

            os.kill(old.proc.pid, signal.SIGSTOP)  # the leader pauses past its TTL
            new, new_token = await _until_leader([standby], TTL_S + 4)
            assert new_token > old_token
            # a request reaches the paused leader; it wakes up and tries to approve with its old token
            stale = asyncio.ensure_future(ostub.ProposeMigration(move("r-stale"), timeout=10))
            await asyncio.sleep(0.2)
            os.kill(old.proc.pid, signal.SIGCONT)
            try:
                reply = await stale
                assert not reply.approved, reply
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
                assert f"the leader is {new.name}" in (exc.details() or "") or "no leader" in (exc.details() or "")
        store = Store(client, keys)
        assert await store.get_migration("r-stale#0") is None  # nothing was written with the old token
        # receivers that saw the new leader refuse anything stamped with the old token
        guard = FencingGuard()
        guard.check(new_token)
        assert not guard.accepts(old_token)
        # the woken replica knows it lost and names the new leader
        async with asyncio.timeout(5):
            while (st := await _status(old.address)) is None or st.is_leader or st.leader_id != new.name:
                await asyncio.sleep(0.05)
        assert st.fencing_token == new_token
        stop.set()
        await reg_task
        await client.close()

    asyncio.run(main())
