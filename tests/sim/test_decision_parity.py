"""One decision core: the same load reports give the same decisions live and simulated.

The same scripted sequence of load reports of four instances in two NVLink domains goes

- once through the live shells: llumlets that report the scripted loads over real gRPC (WatchLoad), two real
  domain schedulers (``rack_sched.scheduler``), a real coordinator (``global_coord``) judging with the cost
  model over the topology, a real gateway router (``gateway.router``) reading the summaries from real etcd;
- once through the simulator's composition (``sim.schedulers.HilumTwoTier``), whose cluster reports the same
  loads.

Four decisions are compared: where a new request goes (domain, then instance), which move the busy domain
makes inside itself, which cross-domain move is proposed and where the coordinator sends it, and — once that
move reported a pre-copy rate far below the path's nominal one (live: in the MigrateOut reply, written into
the migration record by the domain scheduler; simulated: in the executor's record) — that the next proposal
on the same path is refused for it. The loads are chosen without near-ties, so the seeded tie-breaks cannot
differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import grpc
from sim_factories import tiny_topology

from clusterstate.clock import ManualClock
from clusterstate.etcd import Etcd3Client, connect, kv_of
from clusterstate.records import InstanceRegistration, encode
from clusterstate.store import ClusterView, Keys
from gateway.router import DomainRouter, GrpcSubmitter
from global_coord.coordinator import Coordinator, CoordinatorConfig
from global_coord.server import start_server as start_coordinator
from global_coord.wiring import CostModelJudge
from hilum_proto.tls import bind_server
from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import llumlet_pb2_grpc as pb_grpc
from llumlet.convert import load_to_pb
from llumlet.engine.types import EngineLoad, RunningRequestLoad
from policy.load import InstanceLoad
from policy.types import PolicyConfig
from rack_sched.core import DomainConfig
from rack_sched.scheduler import DomainScheduler
from rack_sched.server import start_server as start_rack
from rack_sched.types import RackConfig
from sim.schedulers import HilumTwoTier, SchedulerContext, SchedulingConfig
from sim.traces import TraceRequest
from topology.graph import TopologyGraph
from topology.spec import Topology

MODEL = "llama-2-7b"
BS = 16
STEP_S = 0.03
CFG = DomainConfig(policy=PolicyConfig(tie_tolerance=0.0))
SLOW_BYTES_PER_S = 10e6  # measured pre-copy rate of the first cross-domain move: KV grows faster (17 MB/s)


def _engine_load(*blocks: int) -> EngineLoad:
    """An instance of 1000 blocks running one request per entry (``<instance>-r<k>`` is set by the caller)."""
    return EngineLoad(total_blocks=1000, used_blocks=sum(blocks), reserved_blocks=0, cached_blocks=0)


def _running(iid: str, *blocks: int) -> tuple[RunningRequestLoad, ...]:
    return tuple(
        RunningRequestLoad(f"{iid}-r{k}", b, 0, b * BS, True, output_tokens=100, max_tokens=2000, max_blocks=b + 125)
        for k, b in enumerate(blocks)
    )


def script(**per_instance: tuple[int, ...]) -> dict[str, EngineLoad]:
    """Each instance's load: the KV blocks of each of its running requests."""
    out = {}
    for iid, blocks in per_instance.items():
        base = _engine_load(*blocks)
        out[iid] = EngineLoad(base.total_blocks, base.used_blocks, 0, 0, running=_running(iid, *blocks))
    return out


# The three steps. Instance ids are the tiny topology's: n0-i0, n0-i1 (domain n0), n1-i0, n1-i1 (domain n1).
STEP_DISPATCH = script(**{"n0-i0": (200, 200, 200), "n0-i1": (100,), "n1-i0": (300, 300, 300), "n1-i1": (190,) * 5})
STEP_REBALANCE = script(**{"n0-i0": (100,), "n0-i1": (120,), "n1-i0": (248,) * 4, "n1-i1": (300, 300)})
STEP_CROSS = script(**{"n0-i0": (100,), "n0-i1": (), "n1-i0": (248,) * 4, "n1-i1": (249,) * 4})
REQUEST = TraceRequest(request_id="new", arrival_s=0.0, prompt_tokens=150, output_tokens=64)


@dataclass
class Decisions:
    dispatch: tuple[str, str] = ("", "")  # (domain, instance) of the new request
    intra: list[tuple[str, str, str]] = field(default_factory=list)  # (src, dst, request) moves in n1
    cross: list[tuple[str, str, str]] = field(default_factory=list)  # (src, dst, request) across domains
    after_measured: list[tuple[str, str, str]] = field(default_factory=list)  # moves started after the report
    refused: list[str] = field(default_factory=list)  # requests of n1 whose move was not approved


# ---------------------------------------------------------------------------------------------- simulated
class _Queue:
    now_s = 0.0

    def schedule_in(self, delay_s: float, kind: Any, action: Callable[[], None]) -> None:
        action()  # summaries are delivered at once: the live side waits for them too


@dataclass
class _Inst:
    instance_id: str
    domain_id: str
    spec: Any
    active: bool = True
    draining: bool = False
    watchers: list[set[str]] = field(default_factory=list)


class _Cluster:
    """What HilumTwoTier reads of a cluster, reporting the scripted loads."""

    def __init__(self, topo: Topology) -> None:
        self.topology = topo
        self.queue = _Queue()
        self.instances = {s.instance_id: _Inst(s.instance_id, s.domain_id, s) for s in topo.instances}
        self.loads: dict[str, EngineLoad] = {}
        self._version = 0
        self.drain_changes = 0  # no scripted drain

    def model_of(self, instance_id: str) -> Any:
        return self.topology.model_of(instance_id)

    def domain_ids(self) -> list[str]:
        return [d.domain_id for d in self.topology.domains]

    def load_version(self, inst: _Inst) -> int:
        """A new version at every read: the scripted loads may change between any two refreshes."""
        self._version += 1
        return self._version

    def load_position(self, inst: _Inst) -> tuple[int, int]:
        return self.load_version(inst), 0

    def growth_mark(self, inst: _Inst, extra_blocks: int, position: tuple[int, int]) -> None:
        return None

    def within_growth(self, inst: _Inst, mark: None, position: tuple[int, int]) -> bool:
        """Never: the scripted loads may change between any two rounds, so every round refreshes and plans."""
        return False

    def growth_holds_until_s(self, inst: _Inst, mark: None) -> float:
        """Never beyond now: nothing touches a scripted instance when its load changes."""
        return -math.inf

    def load(
        self, inst: _Inst, *, brief: bool = False, version: int | None = None, started: int | None = None
    ) -> InstanceLoad:
        load = self.loads[inst.instance_id].to_instance_load(inst.instance_id, inst.domain_id, decode_step_s=STEP_S)
        if not brief:
            return load
        return replace(
            load, running=(), brief=True, num_running=len(load.running), priority_counts=load.priority_counts
        )

    def take_finished(self, inst: _Inst) -> list[int]:
        return []


class _Executor:
    def __init__(self) -> None:
        self.on_done: list[Callable[[Any], None]] = []
        self.started: list[tuple[str, str, str]] = []

    class flows:
        @staticmethod
        def counts() -> dict[str, int]:
            return {}

    def start(self, request_id: str, src_id: str, dst_id: str, why: str = "") -> bool:
        """Record the move; :meth:`commit_all` ends it (as the live side's llumlets answer MigrateOut)."""
        self.started.append((src_id, dst_id, request_id))
        return True

    def commit_all(self, precopy_bytes_per_s: float = 0.0) -> None:
        started, self.started = self.started, []  # a commit may start the next move at once
        for src, dst, request_id in started:
            record = SimpleNamespace(
                request_id=request_id,
                outcome="committed",
                src_instance_id=src,
                dst_instance_id=dst,
                end_s=0.0,
                precopy_bandwidth_bytes_per_s=precopy_bytes_per_s,
            )
            for listener in self.on_done:
                listener(record)


def simulated(topo: Topology, measured_bytes_per_s: float = SLOW_BYTES_PER_S) -> Decisions:
    cluster = _Cluster(topo)
    executor = _Executor()
    cluster.loads = STEP_DISPATCH
    ctx = SchedulerContext(
        cluster=cluster,  # type: ignore[arg-type]
        executor=executor,  # type: ignore[arg-type]
        graph=TopologyGraph(topo),
        judge=CostModelJudge(topo),
        domain=CFG,
        timing=SchedulingConfig(),
        rng=random.Random(0),
        live=lambda: True,
    )
    sched = HilumTwoTier(ctx)
    out = Decisions()
    decision = sched.dispatch(REQUEST)
    assert decision.target_id is not None, decision.reason
    out.dispatch = (cluster.instances[decision.target_id].domain_id, decision.target_id)
    cluster.loads = STEP_REBALANCE
    sched._rebalance_domains()
    out.intra = list(executor.started)
    executor.commit_all()
    cluster.loads = STEP_CROSS
    sched._publish()
    sched._propose("n1")
    out.cross = list(executor.started)
    executor.commit_all(measured_bytes_per_s)  # the move reports its pre-copy rate; n1 proposes again at once
    out.after_measured = list(executor.started)
    out.refused = sorted(sched.feeds["n1"].core._not_approved)
    return out


# ---------------------------------------------------------------------------------------------- live
class _ScriptedLlumlet(pb_grpc.LlumletServicer):
    """Reports its scripted load on WatchLoad; accepts Submits and MigrateOuts without changing it."""

    def __init__(self, instance_id: str, domain_id: str) -> None:
        self.instance_id, self.domain_id = instance_id, domain_id
        self.load = EngineLoad(1000, 0, 0, 0)
        self.version = 0
        self.changed = asyncio.Event()
        self.commands: list[pb.MigrateOutRequest] = []
        self.precopy_bytes_per_s = 0.0  # what MigrateOut reports having measured
        self.address = ""
        self.server = grpc.aio.server()

    async def start(self) -> None:
        pb_grpc.add_LlumletServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()

    def set(self, load: EngineLoad) -> None:
        self.load = load
        self.version += 1
        self.changed.set()

    def report(self) -> pb.LoadReport:
        msg = load_to_pb(self.load, self.instance_id, self.domain_id)
        msg.version = self.version
        msg.recent_step_s = STEP_S
        return msg

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: Any) -> AsyncIterator[pb.LoadReport]:
        while True:
            self.changed.clear()
            yield self.report()
            await self.changed.wait()

    async def Submit(self, request: pb.SubmitRequest, context: Any) -> pb.SubmitReply:
        return pb.SubmitReply(accepted=True)

    async def MigrateOut(self, request: pb.MigrateOutRequest, context: Any) -> pb.MigrateOutReply:
        self.commands.append(request)
        return pb.MigrateOutReply(
            outcome=pb.MIGRATION_COMMITTED, transport="grpc", precopy_bandwidth_bytes_per_s=self.precopy_bytes_per_s
        )

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        return pb.ReleaseReply(status=pb.DEST_OK)


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


@contextlib.asynccontextmanager
async def _client(endpoint: str) -> AsyncIterator[Etcd3Client]:
    client = connect([endpoint])
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


async def live(topo: Topology, endpoint: str, prefix: str) -> Decisions:
    keys = Keys(prefix)
    llumlets = {s.instance_id: _ScriptedLlumlet(s.instance_id, s.domain_id) for s in topo.instances}
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task[None]] = []
    async with _client(endpoint) as etcd, contextlib.AsyncExitStack() as stack:
        for ll in llumlets.values():
            await ll.start()
            stack.push_async_callback(ll.server.stop, None)
            spec = topo.instance(ll.instance_id)
            reg = InstanceRegistration(ll.instance_id, ll.domain_id, spec.node_id, ll.address, MODEL, 1000)
            await kv_of(etcd).put(keys.instance(ll.instance_id), encode(reg))
        for iid, load in STEP_DISPATCH.items():
            llumlets[iid].set(load)
        # the coordinator, judging with the cost model over the topology
        server, port = bind_server("127.0.0.1:0")
        coord_client = await stack.enter_async_context(_client(endpoint))
        coord = Coordinator(
            CoordinatorConfig("coord", f"127.0.0.1:{port}", endpoint, prefix=prefix, ttl_s=3),
            coord_client,
            rng=random.Random(1),
            path_of=TopologyGraph(topo).path,
            judge=CostModelJudge(topo),
            wall_clock=ManualClock().wall_s,  # the domain schedulers' clock stamps the measurements
        )
        await start_coordinator(coord, server)
        stack.push_async_callback(server.stop, None)
        stop = asyncio.Event()
        stops.append(stop)
        tasks.append(asyncio.create_task(coord.run(stop)))
        await asyncio.wait_for(coord.elected.wait(), 10)
        # the two domain schedulers, serving gRPC for the gateway; a manual clock, so their loops never run by
        # themselves: the test calls each decision
        scheds: dict[str, DomainScheduler] = {}
        for dom in ("n0", "n1"):
            rack_server, rack_port = bind_server("127.0.0.1:0")
            cfg = RackConfig(
                dom, f"127.0.0.1:{rack_port}", BS, prefix=prefix, ttl_s=3, decide=CFG, summary_interval_s=0.05
            )
            client = await stack.enter_async_context(_client(endpoint))
            scheds[dom] = DomainScheduler(cfg, client, rng=random.Random(2), clock=ManualClock())
            await start_rack(scheds[dom], rack_server)
            stack.push_async_callback(rack_server.stop, None)
            stop = asyncio.Event()
            stops.append(stop)
            tasks.append(asyncio.create_task(scheds[dom].run(stop)))
        for sched in scheds.values():
            await asyncio.wait_for(sched.ready.wait(), 15)
        view_client = await stack.enter_async_context(_client(endpoint))
        view = ClusterView(view_client, keys, rng=random.Random(3))
        tasks.append(asyncio.create_task(view.run()))
        submitter = GrpcSubmitter()
        stack.push_async_callback(submitter.close)
        router = DomainRouter(view, submitter, CFG.policy, random.Random(4))

        def reported(step: dict[str, EngineLoad]) -> bool:
            for iid, load in step.items():
                got = scheds[iid[:2]].core.load(iid)
                if got is None or got.used_blocks != load.used_blocks or len(got.running) != len(load.running):
                    return False
            return True

        def published(step: dict[str, EngineLoad]) -> bool:
            records = view.summaries()
            for dom in ("n0", "n1"):
                record = records.get(dom)
                if record is None or view.domains().get(dom) is None:
                    return False
                briefs = record.instances()
                for iid, load in step.items():
                    if iid.startswith(dom) and (iid not in briefs or briefs[iid].used_blocks != load.used_blocks):
                        return False
            return True

        try:
            out = Decisions()
            await _until(lambda: reported(STEP_DISPATCH) and published(STEP_DISPATCH), "dispatch loads seen")
            msg = pb.SubmitRequest(
                request_id=REQUEST.request_id,
                prompt_tokens=REQUEST.prompt_tokens,
                sampling=pb.Sampling(max_tokens=REQUEST.output_tokens),
                origin="127.0.0.1:9",
                model=MODEL,
            )
            placement = await router.dispatch(msg, demand_blocks=10, need_blocks=14)
            out.dispatch = (placement.domain_id, placement.instance_id)

            for iid, load in STEP_REBALANCE.items():
                llumlets[iid].set(load)
            await _until(lambda: reported(STEP_REBALANCE), "rebalance loads reported")
            for sched in scheds.values():
                sched._rebalance()
            await _until(
                lambda: scheds["n1"].core.migrations_in_flight == 0 and scheds["n0"].core.migrations_in_flight == 0,
                "moves done",
            )
            out.intra = [(iid, c.dst_instance_id, c.request_id) for iid, ll in llumlets.items() for c in ll.commands]
            for ll in llumlets.values():
                ll.commands.clear()

            for iid, load in STEP_CROSS.items():
                llumlets[iid].set(load)
            await _until(lambda: reported(STEP_CROSS) and published(STEP_CROSS), "cross-domain loads seen")
            await _until(
                lambda: all(
                    len(s._other_summaries()) == 1 and s._other_summaries()[0].instances for s in scheds.values()
                ),
                "each scheduler sees the other's summary",
            )
            move = scheds["n1"].plan_cross_domain()
            assert move is not None
            for ll in llumlets.values():
                ll.precopy_bytes_per_s = SLOW_BYTES_PER_S
            assert await scheds["n1"].cross_domain(move), "the approved cross-domain move did not commit"
            out.cross = [(iid, c.dst_instance_id, c.request_id) for iid, ll in llumlets.items() for c in ll.commands]
            for ll in llumlets.values():
                ll.commands.clear()

            def measured() -> bool:
                return any(r.measured_bandwidth_bytes_per_s > 0 for r, _ in coord.view.migrations().values())

            await _until(measured, "the coordinator sees the measured rate in the migration record")
            for iid, load in STEP_CROSS.items():
                llumlets[iid].set(load)  # a fresh report: the source settles after its move
            await _until(lambda: not scheds["n1"].core.is_busy(move.src_instance_id, 0.0), "the source settled")
            again = scheds["n1"].plan_cross_domain()
            assert again is not None
            assert not await scheds["n1"].cross_domain(again)
            out.after_measured = [
                (iid, c.dst_instance_id, c.request_id) for iid, ll in llumlets.items() for c in ll.commands
            ]
            out.refused = sorted(scheds["n1"].core._not_approved)
            answer = await coord.propose(again.proposal("n1", 10**9))
            assert not answer.approved and "at 10.0 MB/s (measured)" in answer.reason, answer.reason
            return out
        finally:
            # the shells stop by themselves (closing their channels and watches) before anything is cancelled:
            # a gRPC aio call left pending when the loop closes can hang the process at a later collection
            for stop in stops:
                stop.set()
            shells = tasks[: len(stops)]  # each shell's task was started with its stop event; the view has none
            _, pending = await asyncio.wait(shells, timeout=10)
            for task in [*pending, *tasks[len(stops) :]]:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def test_live_shells_and_the_simulator_make_the_same_decisions(etcd: Any, prefix: str) -> None:
    topo = tiny_topology(kv_capacity_blocks=1000)
    sim = simulated(topo)
    assert sim.dispatch == ("n0", "n0-i1")
    assert sim.intra == [("n1-i0", "n1-i1", "n1-i0-r0")]
    assert len(sim.cross) == 1 and sim.cross[0][1] == "n0-i1"  # the empty instance, not merely the freest domain
    assert sim.after_measured == [] and sim.refused == [sim.cross[0][2]]  # priced at 10 MB/s: not approved
    nominal = simulated(topo, measured_bytes_per_s=5e9)  # a measurement at the nominal share changes nothing
    assert nominal.after_measured == sim.cross and nominal.refused == []
    got = asyncio.run(live(topo, etcd.endpoint, prefix))
    assert got == sim


def test_an_unchanged_summary_is_not_published_again_so_readers_keep_its_stamp() -> None:
    # As the live SummaryPublisher writes nothing for summaries equal but for their stamps (policy.summarize.
    # same_content), the simulator's gateway and coordinator keep the earlier ones, stamps included.
    topo = tiny_topology()
    cluster = _Cluster(topo)
    cluster.loads = STEP_DISPATCH
    ctx = SchedulerContext(
        cluster=cluster,  # type: ignore[arg-type]
        executor=_Executor(),  # type: ignore[arg-type]
        graph=TopologyGraph(topo),
        judge=CostModelJudge(topo),
        domain=CFG,
        timing=SchedulingConfig(),
        rng=random.Random(0),
        live=lambda: True,
    )
    sched = HilumTwoTier(ctx)
    cluster.queue.now_s = 1.0
    sched._publish()  # the loads are rebuilt (a new version at every read), the same figures as at 0 s
    assert {d: [s.taken_s for s in summaries] for d, summaries in sched.delivered.items()} == {"n0": [0.0], "n1": [0.0]}
    first = dict(sched.delivered)
    cluster.queue.now_s = 2.0
    cluster.loads = {**STEP_DISPATCH, "n1-i1": STEP_REBALANCE["n1-i1"]}  # only n1 changes
    sched._publish()
    assert sched.delivered["n0"] is first["n0"]
    assert [s.taken_s for s in sched.delivered["n1"]] == [2.0]
    assert [b.free_blocks for b in sched.delivered["n1"][0].instances] != [
        b.free_blocks for b in first["n1"][0].instances
    ]
