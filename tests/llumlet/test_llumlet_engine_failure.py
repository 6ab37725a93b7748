"""An instance whose engine fails is failed (issue 11): its requests end at once with a resumable error, Ping and
every load report say why, and it takes no request and no migration (sim backend, in-process llumlets on real
gRPC)."""

from __future__ import annotations

import asyncio
import time

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.backends import BackendConfig
from llumlet.engine.types import SamplingParams, StepResult
from llumlet.migration_types import DestStatus
from llumlet.sink import TokenCollector
from llumlet.testing import RunningLlumlet, start_llumlet


def _break_after(node: RunningLlumlet, steps: int) -> None:
    """The engine's step raises from the ``steps``-th call on (a CUDA error, a bug in the engine)."""
    engine = node.llumlet.engine
    step = engine.step
    calls = 0

    def broken() -> StepResult:
        nonlocal calls
        calls += 1
        if calls >= steps:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return step()

    engine.step = broken  # type: ignore[method-assign]


def test_a_failed_engine_ends_its_requests_and_says_so_everywhere() -> None:
    async def main() -> None:
        col = TokenCollector()
        await col.start()
        a = await start_llumlet("a", backend=BackendConfig(instance_id="a", num_blocks=256, time_scale=0.2))
        b = await start_llumlet("b", backend=BackendConfig(instance_id="b", num_blocks=256, time_scale=0.2))
        reports: list[pb.LoadReport] = []

        async def watch() -> None:
            async for report in a.client.watch_load(min_interval_s=0.05):
                reports.append(report)

        watcher = asyncio.create_task(watch())
        try:
            for rid in ("r1", "r2"):
                col.expect(rid, a.address)
                assert (
                    await a.client.submit(rid, col.address, SamplingParams(max_tokens=500), prompt_tokens=40)
                ).accepted
            while len(col.get("r2").token_ids) < 3:
                await asyncio.sleep(0.005)
            _break_after(a, 1)
            t_fault = time.monotonic()
            for rid in ("r1", "r2"):
                got = await col.wait(rid, 10)  # ended, not hanging
                assert got.finish_reason == "error" and got.resumable
                assert "instance a failed (engine step raised RuntimeError: CUDA error" in got.error
                assert "the request is lost" in got.error and rid not in got.error  # named once, by its caller
            while not (reports and reports[-1].failure):
                assert time.monotonic() - t_fault < 5, "no load report said the instance failed"
                await asyncio.sleep(0.01)
            assert "engine step raised RuntimeError" in reports[-1].failure and not reports[-1].running
            assert (await a.client.ping()).failure == reports[-1].failure
            load = await a.client.get_load()
            assert load.failure == reports[-1].failure and load.num_requests == 0
            col.expect("r3", a.address)
            refused = await a.client.submit("r3", col.address, SamplingParams(max_tokens=5), prompt_tokens=4)
            assert not refused.accepted and refused.instance_failed and "engine step raised" in refused.reason
            reserve = await a.client.reserve("x", 1, 4)  # no migration to it ...
            assert reserve.status is DestStatus.REFUSED and "engine step raised" in reserve.reason
            col.expect("r4", b.address)
            assert (await b.client.submit("r4", col.address, SamplingParams(max_tokens=300), prompt_tokens=40)).accepted
            while len(col.get("r4").token_ids) < 3:
                await asyncio.sleep(0.005)
            move = await b.client.migrate_out("r4", a.address, attempt=1)
            assert move.outcome == pb.MIGRATION_REFUSED and "engine step raised" in move.reason
            out = await a.client.migrate_out("r1", b.address, attempt=1)  # ... and none from it
            assert out.outcome == pb.MIGRATION_REFUSED and "engine step raised" in out.reason
            assert (await col.wait("r4", 20)).token_ids == tuple(range(300))  # the healthy instance is unharmed
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await a.stop()
            await b.stop()
            await col.stop()

    asyncio.run(main())
