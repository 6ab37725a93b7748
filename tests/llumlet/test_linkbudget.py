"""Per-link migration budgets (issue 11): concurrent migrations on one link share its budget, as the cost model
and the simulator assume, in one llumlet and across the llumlet processes of a host (shared slots in a
directory); a fake clock, so every wait is exact."""

from __future__ import annotations

import asyncio
import copy
import hashlib
from pathlib import Path

import pytest
from test_llumlet_units import TWO_DOMAINS

from llumlet.linkbudget import LinkBudgets
from llumlet.transport import GrpcStreamTransport, LocalTransport, choose_transport
from topology.cost import effective_bandwidth_bytes_per_s
from topology.graph import TopologyGraph
from topology.load import parse_topology


def _digest(scope: str) -> str:
    return hashlib.sha1(scope.encode()).hexdigest()[:12]


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.slept.append(s)


def test_moves_on_one_link_share_its_budget_and_each_link_of_a_path_paces() -> None:
    t = FakeTime()
    budgets = LinkBudgets(clock=t.clock, sleep=t.sleep)
    a = budgets.pacer({"nic:x": 100.0})
    b = budgets.pacer({"nic:x": 100.0, "spine": 1000.0})
    lone = budgets.pacer({"nic:y": 100.0})

    async def main() -> list[float]:
        return [await a.consume(100), await b.consume(100), await lone.consume(100), await a.consume(50)]

    # b waits behind a on nic:x; another link is free; a's next chunk queues behind both
    assert asyncio.run(main()) == [1.0, 2.0, 1.0, 2.5]
    t.now += 10  # idle time is banked for burst_s (10 ms) only
    assert asyncio.run(a.consume(100)) == pytest.approx(0.99)
    slow = budgets.pacer({"nic:z": 100.0, "spine:2": 10.0})  # the tighter link of the path decides
    assert slow.rate_cap_bytes_per_s == 10.0
    assert asyncio.run(slow.consume(10)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="every budget > 0"):
        budgets.pacer({"nic:x": 0.0})
    with pytest.raises(ValueError, match="at least one link"):
        budgets.pacer({})


def test_llumlets_of_one_scope_share_a_budget_and_other_scopes_do_not(tmp_path: Path) -> None:
    t = FakeTime()
    one = LinkBudgets("cluster-1", clock=t.clock, sleep=t.sleep, directory=str(tmp_path))
    two = LinkBudgets("cluster-1", clock=t.clock, sleep=t.sleep, directory=str(tmp_path))  # another process
    other = LinkBudgets("cluster-2", clock=t.clock, sleep=t.sleep, directory=str(tmp_path))

    async def main() -> list[float]:
        link = {"nic:node-a": 200.0}
        return [
            await one.pacer(link).consume(200),
            await two.pacer(link).consume(200),
            await other.pacer(link).consume(200),
        ]

    assert asyncio.run(main()) == [1.0, 2.0, 1.0]
    assert len(list(tmp_path.iterdir())) == 2  # one slot per (scope, link)
    for b in (one, two, other):
        b.close()
    assert LinkBudgets.remove_scope("cluster-1", str(tmp_path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"hilum-link-{_digest('cluster-2')}-nic_node-a"]


def test_a_cross_domain_transport_paces_by_every_link_of_its_path() -> None:
    graph = TopologyGraph(parse_topology(TWO_DOMAINS, "test"))
    t = FakeTime()
    budgets = LinkBudgets(clock=t.clock, sleep=t.sleep)
    first = choose_transport(None, graph, "a0", "b1", cap_fraction=0.2, budgets=budgets)
    second = choose_transport(None, graph, "a1", "b0", cap_fraction=0.2, budgets=budgets)
    assert isinstance(first, GrpcStreamTransport) and isinstance(second, GrpcStreamTransport)
    path = graph.path("a0", "b1")
    alone = effective_bandwidth_bytes_per_s(path.bandwidth_bytes_per_s, 0.2, 0)
    assert first.rate_cap_bytes_per_s == pytest.approx(alone)  # what the cost model gives it alone
    pacer = first._bucket
    assert pacer is not None and set(pacer.budgets) == set(path.links)  # type: ignore[attr-defined]

    async def main() -> tuple[float, float]:
        assert first._bucket is not None and second._bucket is not None
        return await first._bucket.consume(int(alone)), await second._bucket.consume(int(alone))

    # both cross the same NICs: the second waits for the first, each gets half (cost model: 1 existing flow)
    one_s, two_s = asyncio.run(main())
    assert one_s == pytest.approx(1.0) and two_s == pytest.approx(2.0)
    assert alone / two_s == pytest.approx(effective_bandwidth_bytes_per_s(path.bandwidth_bytes_per_s, 0.2, 1))
    configured = choose_transport(
        None, graph, "a0", "b1", cap_fraction=0.2, grpc_rate_cap_bytes_per_s=5e6, budgets=budgets
    )
    assert configured.rate_cap_bytes_per_s == 5e6  # the llumlet's own grpc budget, shared by its moves
    local = choose_transport(None, graph, "a0", "a1", cap_fraction=0.2, local_rate_cap_bytes_per_s=1e6, budgets=budgets)
    assert isinstance(local, LocalTransport) and local.rate_cap_bytes_per_s == 1e6


def test_two_live_moves_on_one_link_never_carry_more_than_its_budget() -> None:
    """Two requests migrated at once from a0 to b0 (sim llumlets on real gRPC, 10 Gb/s NICs): together they
    move at most the link's migration budget (20% of the NIC, 250 MB/s); before, each took all of it."""
    from hilum_proto.v1 import llumlet_pb2 as pb
    from llumlet.backends import BackendConfig
    from llumlet.engine.types import SamplingParams
    from llumlet.sink import TokenCollector
    from llumlet.testing import start_llumlet

    spec = copy.deepcopy(TWO_DOMAINS)
    for domain in spec["domains"]:  # type: ignore[attr-defined]
        domain["nodes"][0]["nic_gbit_per_s"] = 10
    topo = parse_topology(spec, "test")
    budget = TopologyGraph(topo).path("a0", "b0").bandwidth_bytes_per_s * 0.2
    assert budget == 250e6

    async def main() -> None:
        col = TokenCollector()
        await col.start()
        nodes = [
            await start_llumlet(
                iid, topology=topo, backend=BackendConfig(instance_id=iid, topology=topo, time_scale=4.0)
            )
            for iid in ("a0", "b0")
        ]
        src, dst = nodes
        try:
            for rid in ("r1", "r2"):
                col.expect(rid, src.address)
                sampling = SamplingParams(max_tokens=200)
                assert (await src.client.submit(rid, col.address, sampling, prompt_tokens=600)).accepted
            while any(len(col.get(rid).token_ids) < 1 for rid in ("r1", "r2")):
                await asyncio.sleep(0.005)
            t0 = asyncio.get_running_loop().time()
            reps = await asyncio.gather(
                *(src.client.migrate_out(rid, dst.address, attempt=1, dst_instance_id="b0") for rid in ("r1", "r2"))
            )
            elapsed = asyncio.get_running_loop().time() - t0
            assert all(r.outcome == pb.MIGRATION_COMMITTED for r in reps), [r.reason for r in reps]
            moved = sum(r.bytes for r in reps)
            assert moved >= 2 * 38 * topo.models["llama-2-7b"].kv_bytes_per_block  # 600 tokens: 38 blocks each
            assert moved / elapsed <= budget * 1.1, f"{moved / elapsed / 1e9:.2f} GB/s on a {budget / 1e9} GB/s budget"
            for rid in ("r1", "r2"):
                await src.client.abort(rid)
        finally:
            for node in nodes:
                await node.stop()
            await col.stop()

    asyncio.run(main())
