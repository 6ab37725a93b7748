"""The coordinator leader's autoscale loop on real etcd with a real hook script; rounds on a manual clock.

A fleet of domains A and B (pool a0, a1, b0, b1; 100 KV blocks each) is published to etcd as domain schedulers
and llumlets publish it. The loop must drain the cheapest instance with a fenced drain intent, call the hook to
stop it once its domain scheduler shows it drained and empty, release it once it is gone, start a pool instance
when the load rises (retrying a failing hook), and keep its state and decisions in etcd, where a new leader
resumes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from autoscale_fakes import Fleet, RecordingHook, events, load, until
from etcd_server import EtcdServer

from clusterstate.clock import ManualClock
from clusterstate.etcd import connect, kv_of
from clusterstate.records import AutoscaleRecord, DrainKind, decode
from clusterstate.store import Keys
from global_coord.actuator import ActuatorConfig, CommandActuator, HookResult
from global_coord.autoscaler import AutoscaleLoop
from global_coord.coordinator import Coordinator, CoordinatorConfig
from policy.autoscale import AutoscaleConfig, Phase, PoolInstance

POOL = {"m": [PoolInstance(i, i[0].upper(), 100) for i in ("a0", "a1", "b0", "b1")]}
RULE = AutoscaleConfig(
    enabled=True, interval_s=10.0, scale_out_hold_s=0.0, scale_in_hold_s=20.0, cool_down_s=30.0, min_instances=1
)


@contextlib.asynccontextmanager
async def leader(
    etcd: EtcdServer, prefix: str, name: str, hook: RecordingHook, clock: ManualClock, rule: AutoscaleConfig = RULE
) -> AsyncIterator[AutoscaleLoop]:
    """A coordinator replica (in-process) that leads, with its autoscale loop running on ``clock``."""
    client = connect([etcd.endpoint])
    await client.connect()
    cfg = CoordinatorConfig(name, "127.0.0.1:1", etcd.endpoint, prefix=prefix, ttl_s=5)
    coordinator = Coordinator(cfg, client, rng=random.Random(1))
    actuator = CommandActuator(ActuatorConfig(str(hook.path), command_retry_s=0.01), random.Random(2))
    loop = AutoscaleLoop(coordinator, rule, actuator, POOL, clock)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(coordinator.run(stop)), asyncio.create_task(loop.run(stop))]
    try:
        await asyncio.wait_for(coordinator.elected.wait(), 30)
        await until("the first round", lambda: loop.rounds >= 1)
        yield loop
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await client.close()


async def next_round(loop: AutoscaleLoop, clock: ManualClock) -> None:
    """Let ``interval_s`` pass on the loop's clock and wait for its round to end."""
    done = loop.rounds
    await until("the loop to sleep", lambda: clock.sleepers > 0)
    await clock.advance(RULE.interval_s)
    await until("the next round", lambda: loop.rounds > done)


def test_scale_in_then_out_with_fenced_drains_the_hook_and_a_record_a_new_leader_resumes(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    hook = RecordingHook(tmp_path / "hook")
    keys = Keys(prefix)
    light = [load("a0", "A", [5]), load("a1", "A", [3]), load("b0", "B", [8])]

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        clock = ManualClock()
        fleet = await Fleet(client, keys, ["A", "B"]).__aenter__()
        async with leader(etcd, prefix, "c1", hook, clock) as loop:
            view = loop.coordinator.view
            await fleet.publish(light)
            await until("the summaries", lambda: len(view.summaries()) == 2 and len(view.instances()) == 3)
            # F without a1 (3 blocks, not alone in A): (200 - 16) / 3 = 61.3 > 60; held for 20 s, then drained.
            for _ in range(3):
                await next_round(loop, clock)
            token = loop.coordinator.leading.token  # type: ignore[union-attr]
            intent = view.drains().get((DrainKind.INSTANCE, "a1"))
            assert intent is not None and intent.fencing_token == token
            assert intent.reason.startswith("autoscaler scale-in: fleet freeness without it 61.3 above 60 for 20 s")
            assert events(view.autoscale()) == [("drain", "a1", "done")]
            record = view.autoscale()["m"]
            assert record.fencing_token == token and record.evaluation is not None
            assert [(t.instance_id, t.phase) for t in record.state.tracked] == [("a1", Phase.DRAINING)]

            # Its domain scheduler applies the drain; a request still runs there: not yet safe to stop.
            await fleet.publish([light[0], load("a1", "A", [3], draining=True), light[2]])
            await until("a1 draining", lambda: view.summaries()["A"].instances()["a1"].draining)
            await next_round(loop, clock)
            assert hook.calls() == []
            # Empty: the stop is decided and the hook called.
            await fleet.publish([light[0], load("a1", "A", draining=True), light[2]])
            await until("a1 empty", lambda: view.summaries()["A"].instances()["a1"].num_running == 0)
            await next_round(loop, clock)
            await until("the stop", lambda: events(view.autoscale())[-1:] == [("scale-in", "a1", "done")])
            assert hook.calls() == ["scale-in m a1 scale-in"]
            stop_event = view.autoscale()["m"].events[-1]
            assert (stop_event.exit_code, stop_event.attempts, stop_event.output) == (0, 1, "did scale-in a1\n")
            assert stop_event.reason.startswith("safe to stop: drained and empty")

        # A new leader (the old one stepped down) resumes from the record: the instance is stopped; once its
        # registration is gone, the new leader releases it (its drain intent is removed).
        clock2 = ManualClock(start_s=100.0)
        async with leader(etcd, prefix, "c2", hook, clock2) as loop:
            view = loop.coordinator.view
            assert loop.scalers["m"].phase("a1") is Phase.STOPPED
            await fleet.publish([light[0], light[2]])
            await until("a1 deregistered", lambda: "a1" not in view.instances() and len(view.summaries()) == 2)
            await next_round(loop, clock2)
            await until("the release", lambda: (DrainKind.INSTANCE, "a1") not in view.drains())
            assert [e[:2] for e in events(view.autoscale())] == [("drain", "a1"), ("scale-in", "a1"), ("release", "a1")]

            # The load rises past the threshold: F = (200 - 185) / 18 = 0.8. b0's domain is the fuller: b1 first,
            # then a1 (back in the pool). The hook fails once for b1 and is retried.
            hook.fail("scale-out", "b1", 1)
            heavy = [load("a0", "A", [10] * 9), load("b0", "B", [15] + [10] * 8)]
            await fleet.publish(heavy)
            await until("the load", lambda: view.summaries()["B"].of_model("m").num_running == 9)
            await next_round(loop, clock2)
            await until(
                "both starts",
                lambda: (
                    [e for e in events(view.autoscale()) if e[0] == "scale-out"]
                    == [("scale-out", "b1", "done"), ("scale-out", "a1", "done")]
                ),
            )
            started = [e for e in view.autoscale()["m"].events if e.action == "scale-out"]
            assert [e.attempts for e in started] == [2, 1]
            assert sorted(hook.calls()[1:]) == ["scale-out m a1 scale-out"] + ["scale-out m b1 scale-out"] * 2
            assert {t.instance_id: t.phase for t in view.autoscale()["m"].state.tracked} == {
                "a1": Phase.STARTING,
                "b1": Phase.STARTING,
            }
            # b1 comes up (registers and reports): live.
            await fleet.publish([*heavy, load("b1", "B")])
            await until("b1 live", lambda: "b1" in view.summaries()["B"].instances())
            await next_round(loop, clock2)
            assert loop.scalers["m"].phase("b1") is None and loop.scalers["m"].phase("a1") is Phase.STARTING
        await fleet.__aexit__()
        await client.close()

    asyncio.run(main())


def test_a_hook_that_keeps_failing_is_reported_and_its_instance_goes_back_to_the_pool(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    hook = RecordingHook(tmp_path / "hook")
    hook.fail("scale-out", "a1", 100)
    keys = Keys(prefix)

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        clock = ManualClock()
        floor = replace(RULE, min_instances=2)  # below the minimum: scale out whatever the load
        async with Fleet(client, keys, ["A", "B"]) as fleet, leader(etcd, prefix, "c1", hook, clock, floor) as loop:
            view = loop.coordinator.view
            await fleet.publish([load("a0", "A", [5])])
            await until("a0", lambda: len(view.instances()) == 1 and "a0" in view.summaries()["A"].instances())
            await next_round(loop, clock)
            await until("the failure", lambda: events(view.autoscale()) == [("scale-out", "a1", "failed")])
            failed = view.autoscale()["m"].events[-1]
            assert failed.attempts == 4 and failed.exit_code == 3
            assert "simulated failure of scale-out a1" in failed.output
            assert hook.calls() == ["scale-out m a1 scale-out"] * 4
            assert loop.scalers["m"].phase("a1") is None  # back in the pool, one failure
            assert [(f.instance_id, f.count) for f in loop.scalers["m"].state().failures] == [("a1", 1)]
        await client.close()

    asyncio.run(main())


def test_only_the_leader_acts_and_its_successor_does_not_start_the_same_instance_again(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    hook = RecordingHook(tmp_path / "hook")
    keys = Keys(prefix)

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        floor = replace(RULE, min_instances=2)  # below the minimum: one start, whatever the load
        clock, clock2 = ManualClock(), ManualClock(start_s=5.0)
        async with Fleet(client, keys, ["A", "B"]) as fleet:
            await fleet.publish([load("a0", "A", [5])])
            async with leader(etcd, prefix, "c1", hook, clock, floor) as loop:
                view = loop.coordinator.view
                await until("a0", lambda: "a0" in view.summaries()["A"].instances())
                # A second replica, following: its loop waits to lead and never runs a round.
                client2 = connect([etcd.endpoint])
                await client2.connect()
                cfg2 = CoordinatorConfig("c2", "127.0.0.1:2", etcd.endpoint, prefix=prefix, ttl_s=5)
                follower = Coordinator(cfg2, client2, rng=random.Random(3))
                actuator2 = CommandActuator(ActuatorConfig(str(hook.path), command_retry_s=0.01), random.Random(4))
                loop2 = AutoscaleLoop(follower, floor, actuator2, POOL, clock2)
                stop2 = asyncio.Event()
                tasks2 = [asyncio.create_task(follower.run(stop2)), asyncio.create_task(loop2.run(stop2))]
                await asyncio.wait_for(follower.view.synced.wait(), 30)
                await next_round(loop, clock)
                await until("the start", lambda: events(view.autoscale()) == [("scale-out", "a1", "done")])
                for _ in range(3):
                    await clock2.advance(floor.interval_s)
                    await next_round(loop, clock)
                assert not follower.is_leader() and loop2.rounds == 0 and loop2.scalers == {}
                assert hook.calls() == ["scale-out m a1 scale-out"]
                started = view.autoscale()["m"].state.tracked
                assert [(t.instance_id, t.phase) for t in started] == [("a1", Phase.STARTING)]
            # c1 resigns; c2 leads and resumes a1 as starting (coming capacity): it does not start a1 again.
            await asyncio.wait_for(follower.elected.wait(), 30)
            await until("c2's first round", lambda: loop2.rounds >= 1)
            await clock2.advance(floor.interval_s)
            await until("c2's second round", lambda: loop2.rounds >= 2)
            assert loop2.scalers["m"].state().tracked == started
            token2 = follower.leading.token  # type: ignore[union-attr]
            await until("c2's record", lambda: follower.view.autoscale()["m"].fencing_token == token2)
            assert hook.calls() == ["scale-out m a1 scale-out"]
            stop2.set()
            await asyncio.gather(*tasks2)
            await client2.close()
        await client.close()

    asyncio.run(main())


def test_a_hooks_record_is_not_overwritten_by_the_rounds_slower_write(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    # The round writes the record with the start "running" while the hook runs; when that put is slow and the hook
    # ends first, the record must still end "done" (two puts in flight may land in either order).
    hook = RecordingHook(tmp_path / "hook")
    keys = Keys(prefix)

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        clock = ManualClock()
        floor = replace(RULE, min_instances=2)  # below the minimum: one start, whatever the load
        async with Fleet(client, keys, ["A", "B"]) as fleet, leader(etcd, prefix, "c1", hook, clock, floor) as loop:
            view = loop.coordinator.view
            hook_ended = asyncio.Event()
            actuator, put = loop.actuator, loop.coordinator.put_autoscale

            class Telling:
                async def run(self, *args: Any, **kwargs: Any) -> HookResult:
                    result = await actuator.run(*args, **kwargs)
                    hook_ended.set()
                    return result

            writes = 0

            async def slow_while_running(record: AutoscaleRecord) -> None:
                nonlocal writes
                if any(e.status == "running" for e in record.events):
                    await hook_ended.wait()
                    await asyncio.sleep(0.05)
                await put(record)
                writes += 1

            loop.actuator = Telling()  # type: ignore[assignment]
            loop.coordinator.put_autoscale = slow_while_running  # type: ignore[method-assign]
            await fleet.publish([load("a0", "A", [5])])
            await until("a0", lambda: "A" in view.summaries() and "a0" in view.summaries()["A"].instances())
            await next_round(loop, clock)
            await until("the round's and the hook's writes", lambda: writes == 2)
            key = keys.autoscale("m")
            stored = decode(AutoscaleRecord, bytes((await kv_of(client).get(key, timeout=5.0)).kvs[0].value), key)
            assert events({"m": stored}) == [("scale-out", "a1", "done")]
        await client.close()

    asyncio.run(main())
