"""Fakes and helpers for the domain-scheduler tests: an in-process fake llumlet on real gRPC, etcd writes
standing in for llumlet registrations and drain intents, and a scheduler running in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from clusterstate.etcd import Etcd3Client, connect, kv_of
from clusterstate.records import DrainIntent, DrainKind, InstanceRegistration, encode
from clusterstate.store import Keys
from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import llumlet_pb2_grpc as pb_grpc
from rack_sched.scheduler import DomainScheduler
from rack_sched.types import RackConfig

BLOCK = 16  # tokens per KV block in these tests


@dataclass
class _Req:
    blocks: int
    num_tokens: int
    priority: int = 0


@dataclass
class FakeLlumlet(pb_grpc.LlumletServicer):
    """A llumlet that holds requests without running them: Submit adds one to the batch, MigrateOut moves it
    to the fake at the destination address at once (COMMITTED). Every change is pushed on WatchLoad."""

    instance_id: str
    domain_id: str
    capacity_blocks: int
    peers: dict[str, FakeLlumlet]  # address -> fake, shared by all fakes of a test
    running: dict[str, _Req] = field(default_factory=dict)
    submits: list[str] = field(default_factory=list)
    commands: list[pb.MigrateOutRequest] = field(default_factory=list)
    version: int = 0
    address: str = ""
    server: grpc.aio.Server | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    fail_watch: bool = False  # WatchLoad fails at once (its load stream is down; Submit still works)
    fail_submits: int = 0  # the next this many Submits fail with UNAVAILABLE
    failure: str = ""  # its engine failed: said in reports and Ping, Submits refused
    pings: int = 0

    async def start(self) -> FakeLlumlet:
        self.server = grpc.aio.server()
        pb_grpc.add_LlumletServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.peers[self.address] = self
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    def used(self) -> int:
        return sum(r.blocks for r in self.running.values())

    def bump(self) -> None:
        self.version += 1
        self.changed.set()

    def add(self, request_id: str, blocks: int, priority: int = 0) -> None:
        self.running[request_id] = _Req(blocks, blocks * BLOCK, priority)
        self.bump()

    def report(self) -> pb.LoadReport:
        return pb.LoadReport(
            instance_id=self.instance_id,
            domain_id=self.domain_id,
            total_blocks=self.capacity_blocks,
            used_blocks=self.used(),
            running=[
                pb.RunningRequest(
                    request_id=rid, blocks=r.blocks, priority=r.priority, num_tokens=r.num_tokens, in_decode=True
                )
                for rid, r in sorted(self.running.items())
            ],
            num_requests=len(self.running),
            version=self.version,
            failure=self.failure,
        )

    async def Ping(self, request: pb.LlumletPingRequest, context: Any) -> pb.LlumletPingReply:
        self.pings += 1
        return pb.LlumletPingReply(
            instance_id=self.instance_id, domain_id=self.domain_id, engine="fake", failure=self.failure
        )

    async def Submit(self, request: pb.SubmitRequest, context: Any) -> pb.SubmitReply:
        if self.fail_submits > 0:
            self.fail_submits -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "blip (test)")
        if self.failure:
            return pb.SubmitReply(accepted=False, reason=self.failure, instance_failed=True)
        prompt = len(request.prompt_token_ids) or request.prompt_tokens
        blocks = math.ceil((prompt + 1) / BLOCK)
        if request.request_id in self.running:
            return pb.SubmitReply(accepted=False, reason=f"duplicate request id {request.request_id}")
        if self.used() + blocks > self.capacity_blocks:
            return pb.SubmitReply(accepted=False, reason="no room in the fake")
        self.submits.append(request.request_id)
        self.add(request.request_id, blocks, request.priority)
        return pb.SubmitReply(accepted=True)

    async def GetLoad(self, request: pb.GetLoadRequest, context: Any) -> pb.LoadReport:
        return self.report()

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: Any) -> AsyncIterator[pb.LoadReport]:
        if self.fail_watch:
            await context.abort(grpc.StatusCode.INTERNAL, "load stream broken (test)")
        while True:
            self.changed.clear()
            yield self.report()
            await self.changed.wait()

    async def MigrateOut(self, request: pb.MigrateOutRequest, context: Any) -> pb.MigrateOutReply:
        self.commands.append(request)
        req = self.running.get(request.request_id)
        dst = self.peers.get(request.dst_address)
        if req is None or dst is None:
            return pb.MigrateOutReply(outcome=pb.MIGRATION_REFUSED, reason="unknown request or destination")
        await asyncio.sleep(0.01)
        del self.running[request.request_id]
        dst.running[request.request_id] = req
        self.bump()
        dst.bump()
        return pb.MigrateOutReply(outcome=pb.MIGRATION_COMMITTED, blocks=req.blocks, plan="pre-copy", downtime_s=0.004)

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        return pb.ReleaseReply(status=pb.DEST_OK, committed=request.request_id in self.running)


async def register(client: Etcd3Client, prefix: str, fake: FakeLlumlet) -> None:
    """Write the fake's instance registration (what a llumlet registers under its lease)."""
    reg = InstanceRegistration(
        fake.instance_id, fake.domain_id, f"node-{fake.domain_id}", fake.address, "llama-2-7b", fake.capacity_blocks
    )
    await kv_of(client).put(Keys(prefix).instance(fake.instance_id), encode(reg))


async def put_drain(client: Etcd3Client, prefix: str, kind: DrainKind, target: str) -> None:
    """Write a drain intent as the coordinator leader would (unfenced here)."""
    await kv_of(client).put(Keys(prefix).drain(kind, target), encode(DrainIntent(kind, target, "test", 1)))


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Wait until ``check()`` is true, polling every 20 ms; AssertionError after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def fakes(
    domain_id: str, capacities: dict[str, int], peers: dict[str, FakeLlumlet] | None = None
) -> AsyncIterator[dict[str, FakeLlumlet]]:
    """Fake llumlets ``instance_id -> capacity_blocks`` of one domain, serving on loopback.

    ``peers`` (address -> fake) is shared with the fakes of other domains a test migrates between.
    """
    peers = {} if peers is None else peers
    out = {iid: await FakeLlumlet(iid, domain_id, cap, peers).start() for iid, cap in capacities.items()}
    try:
        yield out
    finally:
        for f in out.values():
            await f.stop()


@contextlib.asynccontextmanager
async def etcd_client(endpoint: str) -> AsyncIterator[Etcd3Client]:
    client = connect([endpoint])
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def scheduler(endpoint: str, prefix: str, domain_id: str, **overrides: Any) -> AsyncIterator[DomainScheduler]:
    """A domain scheduler running in this loop until the block ends; entered once it is ready."""
    settings: dict[str, Any] = {"ttl_s": 3, "summary_interval_s": 0.1, "cross_interval_s": 0.2, "ready_timeout_s": 3.0}
    settings.update(overrides)
    cfg = RackConfig(
        domain_id=domain_id, advertise_address="127.0.0.1:1", block_size_tokens=BLOCK, prefix=prefix, **settings
    )
    async with etcd_client(endpoint) as client:
        sched = DomainScheduler(cfg, client, rng=random.Random(7))
        stop = asyncio.Event()
        task = asyncio.create_task(sched.run(stop))
        try:
            await asyncio.wait_for(sched.ready.wait(), 10)
            yield sched
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
