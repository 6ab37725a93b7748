"""Restart of a domain scheduler process with requests running on real llumlet processes (sim engine).

The scheduler (``python -m rack_sched``) dispatches requests to two ``python -m llumlet`` processes, is
killed with SIGKILL, and started again: the requests finish normally (every token once, in order, to the
end) and the new scheduler's view shows them running on the instances where they were dispatched.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from rack_fakes import etcd_client, eventually

from clusterstate.etcd import kv_of
from clusterstate.records import InstanceRegistration, decode
from clusterstate.store import Keys
from hilum_proto.v1 import llumlet_pb2, rack_sched_pb2, rack_sched_pb2_grpc
from llumlet.procs import LlumletProcess
from llumlet.sink import TokenCollector

REPO = Path(__file__).resolve().parents[2]
DOMAIN = "node-0"  # of the bundled 1x8-a100 topology (16-token blocks, like the llumlets' default)
LLUMLET_ARGS = ["--num-blocks", "512", "--domain-id", DOMAIN]
MAX_TOKENS = 400  # ~5 s of decoding on the modelled A100: they outlive a scheduler restart


class RackProcess:
    """One ``python -m rack_sched`` child; ``start()`` waits for its "serving at" line."""

    def __init__(self, etcd_endpoint: str, prefix: str, log_path: Path, extra: list[str]) -> None:
        self.cmd = [
            sys.executable, "-m", "rack_sched", "--domain-id", DOMAIN, "--listen", "127.0.0.1:0",
            "--etcd", etcd_endpoint, "--topology", "1x8-a100", "--prefix", prefix, "--ttl", "3",
            "--seed", "1", "--log-level", "INFO", *extra,
        ]  # fmt: skip
        self.log_path = log_path
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 30.0) -> RackProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        found = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            with self.proc.stdout as out:
                for line in out:
                    if " serving at " in line and not found.is_set():
                        self.address = line.rsplit(" ", 1)[1].strip()
                        found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(timeout_s):
            self.kill()
            raise RuntimeError(f"rack_sched did not start: {self.log_path.read_text()[-3000:]}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


@pytest.fixture
def llumlets(tmp_path: Path) -> Iterator[list[LlumletProcess]]:
    procs = [LlumletProcess(f"{DOMAIN}-i{k}", LLUMLET_ARGS, tmp_path / f"i{k}.log") for k in range(2)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def _ready(address: str) -> rack_sched_pb2_grpc.RackSchedulerStub:
    channel = grpc.aio.insecure_channel(address)
    stub = rack_sched_pb2_grpc.RackSchedulerStub(channel)
    for _ in range(200):
        try:
            if (await stub.Ping(rack_sched_pb2.RackPingRequest(), timeout=1.0)).ready:
                return stub
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"rack_sched at {address} never became ready")


def test_restart_loses_no_running_request(
    etcd: Any, prefix: str, llumlets: list[LlumletProcess], tmp_path: Path
) -> None:
    async def main() -> None:
        col = TokenCollector()
        await col.start()
        # The scheduler registers the llumlets in etcd on their behalf (--instance), under its own lease.
        flags = [arg for p in llumlets for arg in ("--instance", f"{p.instance_id}={p.address}")]
        rack = RackProcess(etcd.endpoint, prefix, tmp_path / "rack.log", flags)
        try:
            async with etcd_client(etcd.endpoint) as client:
                for p in llumlets:
                    col.watch(p.address)
                stub = await _ready(rack.start().address)
                placed: dict[str, str] = {}
                for k in range(6):
                    rid = f"r{k}"
                    col.expect(rid)
                    reply = await stub.Submit(
                        llumlet_pb2.SubmitRequest(
                            request_id=rid,
                            prompt_tokens=100,
                            sampling=llumlet_pb2.Sampling(max_tokens=MAX_TOKENS, ignore_eos=True),
                            origin=col.address,
                        )
                    )
                    assert reply.outcome == rack_sched_pb2.DISPATCH_ACCEPTED, reply.reason
                    placed[rid] = reply.instance_id
                assert set(placed.values()) == {p.instance_id for p in llumlets}  # spread over both
                await eventually(lambda: all(len(col.get(r).token_ids) >= 2 for r in placed), 10, "decoding")

                rack.kill()  # a crash: no lease revoked, streams cut
                assert not any(col.get(r).done for r in placed)
                rack = RackProcess(etcd.endpoint, prefix, tmp_path / "rack.log", flags)
                stub = await _ready(rack.start().address)
                state = await stub.GetDomainState(rack_sched_pb2.GetDomainStateRequest())
                registered = await kv_of(client).get(Keys(prefix).instance(llumlets[0].instance_id))
                reg = decode(InstanceRegistration, bytes(registered.kvs[0].value), "k")
                assert (reg.domain_id, reg.address, reg.capacity_blocks) == (DOMAIN, llumlets[0].address, 7609)
                seen = {rid: i.instance_id for i in state.instances for rid in i.running_request_ids}
                unfinished = {r for r in placed if not col.get(r).done}
                assert unfinished, "requests finished before the new scheduler came up; raise MAX_TOKENS"
                assert {r: seen.get(r) for r in unfinished} == {r: placed[r] for r in unfinished}

                for rid in placed:
                    got = await col.wait(rid, 20)
                    assert (got.finish_reason, got.error) == ("length", "")
                    assert got.token_ids == tuple(range(MAX_TOKENS))  # every token once, in order
                    assert (got.duplicates, got.conflicts) == (0, 0)
        finally:
            assert rack.stop() == 0, rack.log_path.read_text()[-3000:]
            await col.stop()

    asyncio.run(main())


def test_a_second_scheduler_for_a_live_domain_is_refused(etcd: Any, prefix: str, tmp_path: Path) -> None:
    first = RackProcess(etcd.endpoint, prefix, tmp_path / "first.log", ["--instance", f"{DOMAIN}-i0=127.0.0.1:1"])
    first.start()
    try:
        cmd = list(first.cmd)  # same domain and prefix; the first keeps its lease alive
        cmd[cmd.index("--ttl") + 1] = "2"  # waits 1.5 x 2 + 1 s for the key to go, then gives up
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stderr  # the cluster's state, not a bad option: systemd restarts it
        assert f"domain {DOMAIN} already has a live domain scheduler at {first.address}" in second.stderr
        # and while it waits it says so (it printed nothing for 1.5 x TTL + 1 s)
        assert (
            f"domain {DOMAIN}: a domain scheduler at {first.address} holds its registration; waiting up to 4 s for it "
            "to expire"
        ) in second.stderr
    finally:
        first.stop()
