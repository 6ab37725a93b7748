"""Simulated migrations follow the cost model: stages, timing, link sharing, aborts."""

from __future__ import annotations

import pytest
from sim_factories import tiny_topology

from llumlet.engine.latency import load_latency_model
from sim.cluster import Cluster, EngineLimits, RequestState
from sim.events import EventKind, EventQueue
from sim.migration import LinkFlows, MigrationExecutor
from sim.results import MigrationRecord
from sim.traces import TraceRequest
from topology.cost import CostConfig, MigrationCostInput, plan_migration
from topology.graph import TopologyGraph


class Rig:
    """A cluster of the tiny topology with a migration executor, driven by hand."""

    def __init__(self, cost: CostConfig | None = None) -> None:
        self.topo = tiny_topology(kv_capacity_blocks=2000)
        self.queue = EventQueue()
        latency = load_latency_model("llama-2-7b", "a100", 1)
        self.cluster = Cluster(self.queue, self.topo, lambda _spec: latency, EngineLimits())
        self.cost = cost or CostConfig()
        self.executor = MigrationExecutor(self.cluster, TopologyGraph(self.topo), self.cost, LinkFlows())

    def submit(self, request_id: str, instance_id: str, prompt: int, output: int) -> RequestState:
        req = TraceRequest(request_id, self.queue.now_s, prompt_tokens=prompt, output_tokens=output)
        state = self.cluster.admit(req)
        self.cluster.submit(req, instance_id)
        return state

    def run_until(self, predicate: object, probe_s: float = 1e-3) -> None:
        """Run events until ``predicate()`` holds, checked at every event and at least every ``probe_s``
        of simulated time (a decode run is one event: the probes let a condition be seen mid-run; read
        request accounts through ``cluster.requests``, which brings them to the current time)."""
        assert callable(predicate)
        probing = [False]

        def probe() -> None:
            probing[0] = False

        while not predicate():
            if not probing[0]:
                probing[0] = True
                self.queue.schedule_in(probe_s, EventKind.SAMPLE, probe)
            assert self.queue.run_next(), "simulation ended before the condition held"

    def run_all(self) -> None:
        while self.queue.run_next():
            pass


def test_a_cross_domain_move_takes_the_time_the_cost_model_predicts() -> None:
    rig = Rig()
    state = rig.submit("r0", "n0-i0", prompt=1000, output=3000)
    rig.run_until(lambda: rig.cluster.requests["r0"].generated_tokens >= 50)
    src = rig.cluster.instances["n0-i0"]
    tokens, _blocks = src.engine.request_kv("r0") or (0, 0)
    step_s = src.last_step_s
    model = rig.topo.model_of("n0-i0")
    plan = plan_migration(
        MigrationCostInput(
            kv_tokens=tokens,
            kv_bytes_per_token=model.kv_bytes_per_token,
            block_size_tokens=model.block_size_tokens,
            decode_step_s=step_s,
            path_bandwidth_bytes_per_s=25e9,  # 200 Gb/s NIC, the path's bottleneck
        ),
        rig.cost,
    )
    assert plan.converges and plan.mode == "pre-copy"
    start = rig.queue.now_s
    assert rig.executor.start("r0", "n0-i0", "n1-i0")
    rig.run_until(lambda: bool(rig.executor.records))
    (record,) = rig.executor.records
    assert record.outcome == "committed" and record.src_domain_id == "n0" and record.dst_domain_id == "n1"
    assert record.start_s == start
    # 66 blocks of 8 MiB at 20% of 25 GB/s: stage 0 alone is 0.11 s; later stages copy what decode added.
    assert plan.stage_s[0] == pytest.approx((tokens // 16) * model.kv_bytes_per_block / 5e9)
    assert record.stages == len(plan.stage_bytes)
    # The simulator waits up to one decode step for the step boundary before the last stage.
    assert record.end_s - record.start_s == pytest.approx(plan.completion_s, abs=1.5 * step_s)
    assert record.downtime_s == pytest.approx(plan.downtime_s, rel=0.05, abs=1e-4)
    assert record.bytes_transferred == pytest.approx(plan.total_bytes, rel=0.02)
    # The request continues on the destination and finishes with every token.
    rig.run_all()
    assert state.instance_id == "n1-i0" and state.migrations == 1
    assert state.generated_tokens == 3000 and state.finish_s is not None
    for inst in rig.cluster.instances.values():
        load = inst.engine.load()
        assert load.used_blocks == 0 and load.reserved_blocks == 0


def test_the_fixed_overheads_lengthen_a_move_as_the_cost_model_prices_them() -> None:
    # the same move with the control-plane times a loopback cluster measures (bench/fidelity.py): the setup
    # before stage 0, each live stage that sends blocks costs stage_overhead_s more, the downtime
    # suspend_resume_overhead_s
    moved: dict[float, tuple[float, float, int]] = {}
    for stage_overhead_s in (0.0, 0.02):
        cost = CostConfig(stage_overhead_s=stage_overhead_s, suspend_resume_overhead_s=0.03, setup_overhead_s=0.04)
        rig = Rig(cost)
        rig.submit("r0", "n0-i0", prompt=1000, output=3000)
        rig.run_until(lambda r=rig: r.cluster.requests["r0"].generated_tokens >= 50)
        src = rig.cluster.instances["n0-i0"]
        tokens, _blocks = src.engine.request_kv("r0") or (0, 0)
        model = rig.topo.model_of("n0-i0")
        plan = plan_migration(
            MigrationCostInput(tokens, model.kv_bytes_per_token, model.block_size_tokens, src.last_step_s, 25e9),
            cost,
        )
        assert rig.executor.start("r0", "n0-i0", "n1-i0")
        rig.run_until(lambda r=rig: bool(r.executor.records))
        (record,) = rig.executor.records
        assert record.outcome == "committed" and record.stages == plan.num_stages
        live_sending = sum(1 for b in plan.stage_bytes[:-1] if b > 0)
        assert live_sending >= 2
        assert plan.transfer_s == pytest.approx(
            plan.total_bytes / 5e9 + live_sending * stage_overhead_s, rel=1e-9
        )  # 20% of the 25 GB/s NIC
        assert record.end_s - record.start_s == pytest.approx(plan.completion_s, abs=1.5 * src.last_step_s)
        assert record.end_s - record.start_s > 0.04 + plan.transfer_s  # the setup, then the stages
        assert record.downtime_s == pytest.approx(plan.downtime_s, rel=0.05, abs=1e-4)
        assert record.downtime_s >= 0.03
        # the pre-copy rate a move reports includes the stages' round trips, as a llumlet's does
        live_s = sum(plan.stage_s[:-1])
        assert record.precopy_bandwidth_bytes_per_s == pytest.approx(sum(plan.stage_bytes[:-1]) / live_s, rel=0.05)
        moved[stage_overhead_s] = (record.end_s - record.start_s, record.downtime_s, live_sending)
    (fast_s, _, _), (slow_s, _, stages) = moved[0.0], moved[0.02]
    assert slow_s - fast_s == pytest.approx(stages * 0.02, abs=1.5 * 0.03)


def test_pre_copy_downtime_does_not_grow_with_the_context() -> None:
    downtimes = []
    for prompt in (256, 3000):
        rig = Rig()
        rig.submit("r", "n0-i0", prompt=prompt, output=1000)
        rig.run_until(lambda r=rig: r.cluster.requests["r"].generated_tokens >= 20)
        assert rig.executor.start("r", "n0-i0", "n1-i0")
        rig.run_until(lambda r=rig: bool(r.executor.records))
        downtimes.append(rig.executor.records[0].downtime_s)
    short, long = downtimes
    assert long == pytest.approx(short, rel=0.5)  # a ~12x longer context, about the same pause
    assert long < 0.01


def test_two_moves_on_one_link_share_it() -> None:
    alone = Rig()
    alone.submit("a", "n0-i0", prompt=2000, output=500)
    alone.run_until(lambda: alone.cluster.requests["a"].generated_tokens >= 5)
    alone.executor.start("a", "n0-i0", "n1-i0")
    alone.run_all()
    shared = Rig()
    shared.submit("a", "n0-i0", prompt=2000, output=500)
    shared.submit("b", "n0-i1", prompt=2000, output=500)
    shared.run_until(lambda: shared.cluster.requests["b"].generated_tokens >= 5)
    assert shared.executor.start("a", "n0-i0", "n1-i0")
    assert shared.executor.flows.count("nic:n0") == 1
    assert shared.executor.start("b", "n0-i1", "n1-i1")
    assert shared.executor.flows.count("nic:n0") == 2
    shared.run_all()
    solo_s = alone.executor.records[0].end_s - alone.executor.records[0].start_s
    first = next(m for m in shared.executor.records if m.request_id == "a")
    second = next(m for m in shared.executor.records if m.request_id == "b")
    # "a" started alone, so its stage 0 keeps the full rate it started with (piecewise-constant
    # sharing); "b" joined the link and its stages run at half the rate.
    assert second.end_s - second.start_s > 1.6 * solo_s
    assert first.end_s - first.start_s >= solo_s * 0.99
    assert shared.executor.flows.count("nic:n0") == 0


def test_a_request_that_finishes_during_pre_copy_aborts_and_releases_the_reservation() -> None:
    rig = Rig(CostConfig(cap_fraction=0.01))  # a slow link: 250 MB/s
    state = rig.submit("r", "n0-i0", prompt=2000, output=30)
    rig.run_until(lambda: rig.cluster.requests["r"].generated_tokens >= 25)
    assert rig.executor.start("r", "n0-i0", "n1-i0")
    dst = rig.cluster.instances["n1-i0"]
    assert dst.engine.load().reserved_blocks > 0
    rig.run_all()
    (record,) = rig.executor.records
    assert record.outcome == "aborted" and "finished during pre-copy" in record.reason
    assert state.instance_id == "n0-i0" and state.generated_tokens == 30
    assert dst.engine.load().reserved_blocks == 0


def test_no_room_on_the_destination_means_no_start() -> None:
    rig = Rig()
    state = rig.submit("big", "n0-i0", prompt=3000, output=900)
    rig.submit("filler", "n1-i0", prompt=3000, output=900)
    rig.run_until(lambda: rig.cluster.requests["big"].generated_tokens >= 2)
    # The destination holds 2000 blocks; "filler" leaves fewer than "big" needs plus the margin.
    dst = rig.cluster.instances["n1-i0"]
    assert dst.engine.reserve("squat", dst.engine.load().free_blocks - 10)
    assert not rig.executor.start("big", "n0-i0", "n1-i0")
    assert rig.executor.records == [] and not state.migrating


def prefixed(rig: Rig, request_id: str, instance_id: str, prompt: int, output: int, hashes: tuple[int, ...]) -> None:
    req = TraceRequest(
        request_id,
        rig.queue.now_s,
        prompt_tokens=prompt,
        output_tokens=output,
        prefix_block_hashes=hashes,
        prefix_block_tokens=512,
    )
    rig.cluster.admit(req)
    rig.cluster.submit(req, instance_id)


def moved(
    rig: Rig, warm_dst: bool, dst: str = "n0-i1", hashes: tuple[int, ...] = (1, 2), prompt: int = 1100
) -> MigrationRecord:
    """Migrate a request with prefix ``hashes`` from n0-i0 to ``dst``, whose cache holds hash blocks 1, 2 when
    ``warm_dst`` (an earlier request there computed them)."""
    if warm_dst:
        prefixed(rig, "w", dst, 1100, 1, (1, 2, 9))
        rig.run_until(lambda: rig.cluster.requests["w"].finish_s is not None)
    prefixed(rig, "r", "n0-i0", prompt, 400, hashes)
    rig.run_until(lambda: rig.cluster.requests["r"].generated_tokens >= 20)
    assert rig.executor.start("r", "n0-i0", dst)
    rig.run_until(lambda: bool(rig.executor.records))
    (record,) = rig.executor.records
    assert record.outcome == "committed"
    rig.run_all()
    assert rig.cluster.requests["r"].generated_tokens == 400
    for inst in rig.cluster.instances.values():
        inst.engine.blocks.check_invariants()
        assert inst.engine.load().used_blocks == 0 and inst.engine.load().reserved_blocks == 0
    return record


def test_a_move_copies_only_the_blocks_the_destination_does_not_cache() -> None:
    # Inside the domain (NVLink, 120 GB/s after the cap) copying beats recomputing: the plan is pre-copy.
    bb = tiny_topology().model_of("n0-i0").kv_bytes_per_block
    cold, warm = moved(Rig(), warm_dst=False), moved(Rig(), warm_dst=True)
    assert (cold.skipped_prefix_blocks, warm.skipped_prefix_blocks) == (0, 64)  # hash blocks 1, 2: 2 x 32 blocks
    assert cold.recomputed_prefix_blocks == warm.recomputed_prefix_blocks == 0
    # The same request, the same stages: 64 blocks fewer cross NVLink (a block more or less may fill
    # meanwhile, as the shorter copy lets fewer decode steps run).
    assert cold.bytes_transferred - warm.bytes_transferred == pytest.approx(64 * bb, abs=2 * bb)


def test_a_slow_path_recomputes_the_missing_prefix_when_the_cost_model_says_so() -> None:
    # 1 % of a 200 Gb/s NIC: 250 MB/s, 33 ms per 8 MiB block. 4 hash blocks (128 blocks, 2048 tokens) take
    # 4.3 s to copy, re-prefilling them on the destination far less: the plan recomputes them.
    rig = Rig(CostConfig(cap_fraction=0.01))
    record = moved(rig, warm_dst=False, dst="n1-i0", hashes=(1, 2, 3, 4), prompt=2100)
    assert record.recomputed_prefix_blocks == 128 and record.skipped_prefix_blocks == 0
    model = rig.topo.model_of("n0-i0")
    plan = plan_migration(
        MigrationCostInput(
            kv_tokens=2100 + 19,
            kv_bytes_per_token=model.kv_bytes_per_token,
            block_size_tokens=16,
            decode_step_s=rig.cluster.instances["n0-i0"].last_step_s,
            path_bandwidth_bytes_per_s=25e9,
            prefix_blocks=128,
            prefix_reprefill_s=rig.cluster.instances["n1-i0"].engine.latency_model.step_time_s([(2048, 0)], []),
        ),
        rig.cost,
    )
    assert plan.mode == "pre-copy+recompute-prefix"
    assert record.end_s - record.start_s >= plan.recompute_s  # it resumed once the recomputation was done
    # Only the non-prefix blocks were sent: 2119 tokens hold 132 full blocks, 128 of them prefix.
    assert record.bytes_transferred < 10 * model.kv_bytes_per_block
