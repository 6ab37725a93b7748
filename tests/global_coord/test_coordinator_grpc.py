"""The coordinator's admin API and ProposeMigration over real gRPC on loopback, two replicas in-process."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from etcd_server import EtcdServer

from clusterstate.etcd import Etcd3Client, connect
from clusterstate.records import (
    DomainRegistration,
    DrainKind,
    InstanceRegistration,
    MigrationState,
    SummaryRecord,
    encode,
)
from clusterstate.session import Registrar
from clusterstate.store import Keys, Store, SummaryPublisher
from global_coord.approver import Judgement, MoveProposal, PathLike
from global_coord.convert import drain_target_from_pb
from global_coord.coordinator import Coordinator, CoordinatorConfig
from global_coord.server import start_server
from hilum_proto.tls import bind_server
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import coordinator_pb2_grpc as pb_grpc
from policy.domain import DomainSummary, InstanceBrief


@dataclass(frozen=True)
class _Path:
    bandwidth_bytes_per_s: float
    links: tuple[str, ...]
    same_domain: bool


def _path_of(src: str, dst: str) -> PathLike:
    return _Path(12.5e9, ("nic:" + src, "spine", "nic:" + dst), src[0] == dst[0])


def _judge(
    move: MoveProposal,
    dst: str,
    path: PathLike,
    busiest_link_flows: int,
    measured: float | None = None,
    dst_prefix_hash_blocks: int = 0,
    dst_prefill_s_per_token: float = 0.0,
) -> Judgement:
    if busiest_link_flows >= 1:  # one migration per link
        return Judgement(False, f"link budget full: {busiest_link_flows} on the busiest link")
    return Judgement(True, "approved: test judge", transfer_s=0.4, downtime_s=0.01)


@dataclass(frozen=True)
class _Inst:
    instance_id: str
    node_id: str
    gpus: tuple[int, ...]
    tensor_parallel_size: int
    model: str
    gpu_type: str
    kv_capacity_blocks: int


@dataclass(frozen=True)
class _Dom:
    domain_id: str
    kind: str
    gpu_type: str
    instances: tuple[_Inst, ...]


@dataclass(frozen=True)
class _Topo:
    name: str
    source: str
    domains: tuple[_Dom, ...]


TOPO = _Topo(
    "t",
    "test.yaml",
    (
        _Dom("a", "node", "a100", (_Inst("a0", "n-a", (0, 1), 2, "llama-2-7b", "a100", 2000),)),
        _Dom("b", "node", "a100", (_Inst("b0", "n-b", (0,), 1, "llama-2-7b", "a100", 1000),)),
    ),
)


@contextlib.asynccontextmanager
async def _replica(etcd: EtcdServer, prefix: str, name: str) -> AsyncIterator[tuple[Coordinator, str]]:
    client = connect([etcd.endpoint])
    await client.connect()
    server, port = bind_server("127.0.0.1:0")
    cfg = CoordinatorConfig(name, f"127.0.0.1:{port}", etcd.endpoint, prefix=prefix, ttl_s=3)
    coord = Coordinator(cfg, client, rng=random.Random(1), path_of=_path_of, judge=_judge, topology=TOPO)
    await start_server(coord, server)
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        yield coord, cfg.advertise_address
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await server.stop(grace=0.5)
        await client.close()


async def _register(
    agents: Etcd3Client, prefix: str, schedulers: dict[str, str], instances: dict[str, str], stop: asyncio.Event
) -> tuple[Registrar, asyncio.Task[None]]:
    """What a cluster's agents register under one lease: ``schedulers`` (domain -> address) and ``instances``
    (instance -> domain); returns the registrar and its task (it runs until ``stop``)."""
    keys = Keys(prefix)
    reg = Registrar(agents, 3, rng=random.Random(2), name="agents")
    for domain_id, address in schedulers.items():
        await reg.set(keys.domain(domain_id), encode(DomainRegistration(domain_id, address)))
    for iid, dom in instances.items():
        await reg.set(keys.instance(iid), encode(InstanceRegistration(iid, dom, "n-" + dom, "h:1", "m", 1000)))
    return reg, asyncio.create_task(reg.run(stop))


def _move(request_id: str, src: str = "a0", dst: str = "", attempt: int = 0) -> pb.MigrationProposal:
    return pb.MigrationProposal(
        proposer_domain_id=src[0],
        request_id=request_id,
        attempt=attempt,
        src_instance_id=src,
        dst_instance_id=dst,
        blocks=100,
        num_tokens=1600,
        remaining_tokens=400,
        decode_step_s=0.02,
    )


def test_admin_api_and_approvals_over_grpc(etcd: EtcdServer, prefix: str) -> None:
    async def main() -> None:
        agents = connect([etcd.endpoint])
        await agents.connect()
        keys = Keys(prefix)
        stop_agents = asyncio.Event()
        schedulers = {"a": "127.0.0.1:9001", "b": "127.0.0.1:9002"}
        reg, reg_task = await _register(agents, prefix, schedulers, {"a0": "a", "b0": "b", "b1": "b"}, stop_agents)
        publisher = SummaryPublisher(reg, keys, "b", min_interval_s=0.05)
        pub_task = asyncio.create_task(publisher.run(stop_agents))
        await reg.registered.wait()
        briefs = (
            InstanceBrief("b0", 1000, 900, 100.0, 2, 0, False),
            InstanceBrief("b1", 1000, 800, 200.0, 2, 0, False),
        )
        summary = DomainSummary("b", 2, 2000, 300.0, 85.0, 900, 1000, 4, 0, False, model="m", instances=briefs)
        publisher.offer(SummaryRecord("b", (summary,)))

        async with _replica(etcd, prefix, "c1") as (c1, addr1), _replica(etcd, prefix, "c2") as (c2, addr2):
            waits = [asyncio.ensure_future(c.elected.wait()) for c in (c1, c2)]
            await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), 5)
            leader = c1 if c1.is_leader() else c2
            laddr, saddr = (addr1, addr2) if leader is c1 else (addr2, addr1)
            async with grpc.aio.insecure_channel(laddr) as lch, grpc.aio.insecure_channel(saddr) as sch:
                lstub, sstub = pb_grpc.CoordinatorStub(lch), pb_grpc.CoordinatorStub(sch)
                # both views catch up with the leader key and the summary (the leader approves from its own view:
                # a proposal before its view holds b's summary finds no destination)
                async with asyncio.timeout(5):
                    while True:
                        st = await sstub.Status(pb.StatusRequest())
                        doms = await sstub.ListDomains(pb.ListDomainsRequest())
                        ldoms = await lstub.ListDomains(pb.ListDomainsRequest())
                        if st.leader_id and all(
                            any(d.domain_id == "b" and d.summaries for d in ds.domains) for ds in (doms, ldoms)
                        ):
                            break
                        await asyncio.sleep(0.05)
                lst = await lstub.Status(pb.StatusRequest())
                assert (lst.is_leader, st.is_leader) == (True, False)
                assert st.leader_id == lst.leader_id == leader.cfg.coordinator_id
                assert st.leader_address == laddr
                assert st.fencing_token == lst.fencing_token > 0
                assert (st.num_domains, st.num_instances, st.etcd_endpoint) == (2, 3, etcd.endpoint)

                assert [(d.domain_id, d.registered, bool(d.summaries)) for d in doms.domains] == [
                    ("a", True, False),
                    ("b", True, True),
                ]
                assert doms.domains[1].summaries[0].freeness == 85.0
                assert doms.domains[1].summaries[0].largest_free_blocks == 900
                topo = await sstub.GetTopology(pb.GetTopologyRequest())
                assert (topo.loaded, topo.name, [d.domain_id for d in topo.domains]) == (
                    True,
                    "t",
                    ["a", "b"],
                )
                assert list(topo.domains[0].instances[0].gpus) == [0, 1]

                # writes: only the leader; the standby names it
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await sstub.Drain(pb.DrainRequest(instance_id="b1"))
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"the leader is {leader.cfg.coordinator_id} at {laddr}" in (err.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await lstub.Drain(pb.DrainRequest())
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                drained = await lstub.Drain(pb.DrainRequest(instance_id="b1", reason="maintenance"))
                assert drained.changed and drained.intent.fencing_token == lst.fencing_token
                assert not (await lstub.Drain(pb.DrainRequest(instance_id="b1"))).changed

                follow = lstub.FollowMigrations(pb.FollowMigrationsRequest())
                # approvals: one migration per link (the test judge), so two moves over the spine conflict
                first = await lstub.ProposeMigration(_move("r1"))
                assert first.approved, first.reason
                assert first.fencing_token == lst.fencing_token
                m = first.migration
                # b1 is drained, so b0 is the only destination
                assert (m.migration_id, m.dst_instance_id, m.dst_domain_id) == ("r1#0", "b0", "b")
                assert m.state == pb.MIGRATION_STATE_APPROVED and list(m.links) == [
                    "nic:a0",
                    "spine",
                    "nic:b0",
                ]
                second = await lstub.ProposeMigration(_move("r2"))
                assert not second.approved
                assert second.reason == "b0: link budget full: 1 on the busiest link"
                assert not second.HasField("migration")
                again = await lstub.ProposeMigration(_move("r1"))
                assert again.approved and again.reason.startswith("already approved")
                unknown = await lstub.ProposeMigration(_move("r3", src="zz"))
                assert (unknown.approved, unknown.reason) == (False, "source instance 'zz' is not registered")
                bad = _move("r4")
                bad.decode_step_s = 0.0
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await lstub.ProposeMigration(bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "decode_step_s must be a positive number" in (err.value.details() or "")
                # the domain scheduler commits: the link is free again
                store = Store(agents, keys)
                done = await store.transition("r1#0", m.mod_revision, MigrationState.COMMITTED)
                assert done.ok
                await leader.view.wait_revision(done.mod_revision)
                third = await lstub.ProposeMigration(_move("r2", attempt=1))
                assert third.approved and third.migration.migration_id == "r2#1"
                listed = await sstub.ListMigrations(pb.ListMigrationsRequest())
                async with asyncio.timeout(5):
                    while len(listed.migrations) < 2:
                        await asyncio.sleep(0.05)
                        listed = await sstub.ListMigrations(pb.ListMigrationsRequest())
                assert [(x.migration_id, x.state) for x in listed.migrations] == [
                    ("r1#0", pb.MIGRATION_STATE_COMMITTED),
                    ("r2#1", pb.MIGRATION_STATE_APPROVED),
                ]
                active = await sstub.ListMigrations(pb.ListMigrationsRequest(active_only=True))
                assert [x.migration_id for x in active.migrations] == ["r2#1"]
                events = []
                async with asyncio.timeout(5):
                    async for ev in follow:
                        events.append((ev.migration.migration_id, ev.migration.state))
                        if events[-1] == ("r2#1", pb.MIGRATION_STATE_APPROVED):
                            break
                follow.cancel()
                assert ("r1#0", pb.MIGRATION_STATE_APPROVED) in events
                assert ("r1#0", pb.MIGRATION_STATE_COMMITTED) in events
                # concurrent proposals over the same link: the approvals are serialised, one wins
                done = await store.transition("r2#1", third.migration.mod_revision, MigrationState.ABORTED)
                assert done.ok
                await leader.view.wait_revision(done.mod_revision)
                racing = await asyncio.gather(*(lstub.ProposeMigration(_move(f"x{i}")) for i in range(4)))
                assert sorted(r.approved for r in racing) == [False, False, False, True]
                undrained = await lstub.Undrain(pb.UndrainRequest(instance_id="b1"))
                assert undrained.changed and undrained.intent.reason == "maintenance"
                insts = await lstub.ListInstances(pb.ListInstancesRequest(domain_id="b"))
                assert [i.instance_id for i in insts.instances] == ["b0", "b1"]
        stop_agents.set()
        await asyncio.gather(reg_task, pub_task)
        await agents.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "msg",
    [
        pb.DrainRequest(),
        pb.DrainRequest(instance_id=""),
        pb.DrainRequest(domain_id=" "),
        pb.UndrainRequest(domain_id="\t"),
    ],
)
def test_a_drain_of_no_target_or_a_blank_one_is_refused(msg: pb.DrainRequest | pb.UndrainRequest) -> None:
    with pytest.raises(ValueError, match="non-empty, not blank"):
        drain_target_from_pb(msg)
    assert drain_target_from_pb(pb.DrainRequest(domain_id="d 1")) == (DrainKind.DOMAIN, "d 1")


def test_a_domain_without_a_registered_scheduler_is_listed_unregistered(etcd: EtcdServer, prefix: str) -> None:
    """ListDomains names every domain the topology lists or a llumlet names, registered or not: a domain whose
    scheduler had been away past its lease vanished from `hilumctl domains` and `requests` (exit 0, "1 of 1 domain
    scheduler answered") while its llumlets still ran requests."""

    async def main() -> None:
        agents = connect([etcd.endpoint])
        await agents.connect()
        stop_agents = asyncio.Event()
        # c0: a llumlet of a domain the topology lacks; b has no scheduler registered
        reg, reg_task = await _register(
            agents, prefix, {"a": "127.0.0.1:9001"}, {"a0": "a", "b0": "b", "c0": "c"}, stop_agents
        )
        await reg.registered.wait()
        async with _replica(etcd, prefix, "c1") as (_, address), grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            async with asyncio.timeout(5):
                while (await stub.Status(pb.StatusRequest())).num_instances < 3:
                    await asyncio.sleep(0.05)
            listed = (await stub.ListDomains(pb.ListDomainsRequest())).domains
            assert [(d.domain_id, d.registered, d.scheduler_address) for d in listed] == [
                ("a", True, "127.0.0.1:9001"),
                ("b", False, ""),  # the topology's, its scheduler gone
                ("c", False, ""),  # a llumlet's
            ]
        stop_agents.set()
        await reg_task
        await agents.close()

    asyncio.run(main())
