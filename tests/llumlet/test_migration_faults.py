"""Exactly one owner per request whatever fails during a migration's commit (sim backend, in-process llumlets on
real gRPC; the destination is reached through a loopback TCP proxy, bench.link_proxy, that cuts or freezes
connections).

After every fault: the request runs in exactly one engine (its running or suspended set), its stream is
exactly 0, 1, ..., n-1 (no token lost, repeated or conflicting), the MigrateOut outcome names the instance that
runs it, and both engines return to no blocks used or reserved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from bench.link_proxy import LinkProxy
from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.backends import BackendConfig
from llumlet.engine.types import MigrationState, SamplingParams
from llumlet.migration_types import MigrationConfig, MigrationHooks
from llumlet.sink import TokenCollector
from llumlet.testing import RunningLlumlet, start_llumlet


class _BeforeCommit(MigrationHooks):
    def __init__(self) -> None:
        self.action: Callable[[], None] | None = None

    async def before_commit(self, request_id: str, attempt: int) -> None:
        if self.action is not None:
            self.action()


@dataclass
class Pair:
    col: TokenCollector
    a: RunningLlumlet  # the source
    b: RunningLlumlet  # the destination, reached through ``proxy``
    proxy: LinkProxy
    hooks: _BeforeCommit

    async def submit(self, rid: str, max_tokens: int, prompt_tokens: int = 100) -> None:
        self.col.expect(rid, self.a.address)
        reply = await self.a.client.submit(
            rid, self.col.address, SamplingParams(max_tokens=max_tokens), prompt_tokens=prompt_tokens
        )
        assert reply.accepted, reply.reason
        while len(self.col.get(rid).token_ids) < 3:
            await asyncio.sleep(0.002)

    async def holders(self, rid: str) -> list[str]:
        """The instances whose engine holds ``rid`` (running or suspended), read from the engines themselves."""
        out = []
        for node in (self.a, self.b):
            engine = node.llumlet.engine
            if await node.llumlet.driver.call(engine.request_kv, rid) is not None:
                out.append(node.llumlet.config.instance_id)
        return out

    async def one_owner(self, rid: str, rep: pb.MigrateOutReply) -> None:
        """Right after the move answered: exactly one engine holds the request, the one the outcome names."""
        where = "b" if rep.outcome == pb.MIGRATION_COMMITTED else "a"
        deadline = time.monotonic() + 10
        while (held := await self.holders(rid)) != [where] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # a destination whose adoption lost to the source's claim drops it
        assert held == [where], (rep.outcome, rep.reason, held)

    async def complete(self, rid: str, n: int) -> None:
        got = await self.col.wait(rid, 20)
        assert got.error == "" and got.finish_reason == "length"
        assert got.token_ids == tuple(range(n)) and got.conflicts == 0

    async def baseline(self) -> None:
        for node in (self.a, self.b):
            deadline = time.monotonic() + 10
            while True:
                load = await node.client.get_load()
                idle = (load.used_blocks, load.reserved_blocks, load.num_requests, load.num_reservations) == (0,) * 4
                if idle or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            assert idle, f"{load.instance_id} did not return to idle: {load}"


def run(body: Callable[[Pair], Awaitable[None]], *, rpc_timeout_s: float = 10.0, slow_commit_s: float = 0.0) -> None:
    async def main() -> None:
        col = TokenCollector()
        await col.start()
        hooks = _BeforeCommit()
        mig = MigrationConfig(rpc_timeout_s=rpc_timeout_s)
        a = await start_llumlet(
            "a", backend=BackendConfig(instance_id="a", num_blocks=256, time_scale=0.2), migration=mig, hooks=hooks
        )
        b = await start_llumlet("b", backend=BackendConfig(instance_id="b", num_blocks=256, time_scale=0.2))
        if slow_commit_s:
            _slow_commit(b, slow_commit_s)
        proxy = LinkProxy(b.address)
        await proxy.start()
        try:
            await asyncio.wait_for(body(Pair(col, a, b, proxy, hooks)), 120)
        finally:
            await proxy.close()
            await a.stop()
            await b.stop()
            await col.stop()

    asyncio.run(main())


def _slow_commit(node: RunningLlumlet, delay_s: float) -> None:
    """The destination engine's adoption takes ``delay_s`` (in the engine thread, as a slow GPU would)."""
    engine = node.llumlet.engine
    adopt = engine.commit_incoming

    def slow(reservation_id: str, state: MigrationState) -> bool:
        time.sleep(delay_s)
        return adopt(reservation_id, state)

    engine.commit_incoming = slow  # type: ignore[method-assign]


def test_the_commit_deadline_firing_while_the_destination_adopts_leaves_one_owner() -> None:
    """The source's Commit deadline (0.3 s) fires while the destination's engine adopts the request (1 s)."""

    async def body(p: Pair) -> None:
        await p.submit("r", max_tokens=300)
        rep = await p.a.client.migrate_out("r", p.proxy.address, attempt=1, dst_instance_id="b")
        assert rep.outcome in (pb.MIGRATION_COMMITTED, pb.MIGRATION_ABORTED), rep.reason
        await p.one_owner("r", rep)
        await p.complete("r", 300)
        await p.baseline()

    run(body, rpc_timeout_s=0.3, slow_commit_s=1.0)


def test_a_commit_that_outlives_its_deadline_is_confirmed_by_asking_again() -> None:
    """Commit is idempotent: the source's second Commit waits for the first's outcome and the move commits."""

    async def body(p: Pair) -> None:
        await p.submit("r", max_tokens=300)
        rep = await p.a.client.migrate_out("r", p.proxy.address, attempt=1, dst_instance_id="b")
        assert rep.outcome == pb.MIGRATION_COMMITTED, rep.reason
        await p.one_owner("r", rep)
        assert (await p.b.client.release("r", 1)).committed  # the outcome stays queryable by (request, attempt)
        await p.complete("r", 300)
        await p.baseline()

    run(body, rpc_timeout_s=0.6, slow_commit_s=0.9)


@pytest.mark.parametrize("trial", range(8))
def test_a_network_blip_during_the_commit_leaves_one_owner(trial: int) -> None:
    """Every connection between source and destination is reset 0-7 ms after the Commit is sent."""

    async def body(p: Pair) -> None:
        def blip() -> None:  # every connection reset trial ms after the Commit is sent
            asyncio.get_running_loop().call_later(trial / 1000, p.proxy.reset_all)

        p.hooks.action = blip
        await p.submit("r", max_tokens=300)
        rep = await p.a.client.migrate_out("r", p.proxy.address, attempt=1, dst_instance_id="b")
        p.hooks.action = None
        assert rep.outcome in (pb.MIGRATION_COMMITTED, pb.MIGRATION_ABORTED), rep.reason
        await p.one_owner("r", rep)
        # and it can move again, either way (no leftover state refuses it)
        here, there = (p.b, p.a) if rep.outcome == pb.MIGRATION_COMMITTED else (p.a, p.b)
        again = await here.client.migrate_out("r", there.address, attempt=2)
        assert again.outcome == pb.MIGRATION_COMMITTED, again.reason
        await p.complete("r", 300)
        await p.baseline()

    run(body, rpc_timeout_s=1.0, slow_commit_s=0.2)


@pytest.mark.parametrize("slow_commit_s", [0.0, 2.0])
def test_a_destination_cut_off_after_the_commit_is_arbitrated_by_the_origin(slow_commit_s: float) -> None:
    """The destination's answers stop reaching the source from the Commit on (the connection stalls without
    closing), but the destination still reaches the origin. The origin decides: the first of the destination's
    ownership announcement and the source's claim wins. Fast adoption: the destination's; slow: the source's."""

    async def body(p: Pair) -> None:
        p.hooks.action = lambda: p.proxy.hold(answers_only=True)
        await p.submit("r", max_tokens=1000)  # still running when the source has learned the outcome
        rep = await p.a.client.migrate_out("r", p.proxy.address, attempt=1, dst_instance_id="b")
        assert rep.outcome in (pb.MIGRATION_COMMITTED, pb.MIGRATION_ABORTED), rep.reason
        await p.one_owner("r", rep)
        p.proxy.release()
        await p.complete("r", 1000)
        await p.baseline()

    run(body, rpc_timeout_s=0.5, slow_commit_s=slow_commit_s)


def test_a_failing_suspend_resumes_the_request_on_the_source() -> None:
    async def body(p: Pair) -> None:
        engine = p.a.llumlet.engine
        suspend = engine.suspend

        def broken(request_id: str) -> MigrationState | None:
            suspend(request_id)  # the request is taken out of batching, then the engine fails
            raise RuntimeError("injected fault inside suspend")

        engine.suspend = broken  # type: ignore[method-assign]
        await p.submit("r", max_tokens=200)
        rep = await p.a.client.migrate_out("r", p.b.address, attempt=1)
        assert rep.outcome == pb.MIGRATION_ABORTED and "injected fault inside suspend" in rep.reason
        await p.one_owner("r", rep)
        await p.complete("r", 200)
        await p.baseline()

    run(body)
