"""One domain scheduler per domain, also when two start at the same moment (the claim is one transaction)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from rack_fakes import BLOCK, etcd_client

from clusterstate.etcd import kv_of
from clusterstate.records import DomainRegistration, decode
from clusterstate.store import Keys
from rack_sched.scheduler import DomainScheduler
from rack_sched.types import DomainTakenError, RackConfig


def test_two_schedulers_started_together_cannot_both_run(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        async with etcd_client(etcd.endpoint) as c1, etcd_client(etcd.endpoint) as c2:
            scheds = [
                DomainScheduler(
                    RackConfig("d", f"127.0.0.1:{port}", BLOCK, prefix=prefix, ttl_s=3, ready_timeout_s=1.0),
                    client,
                    rng=random.Random(port),
                )
                for port, client in ((1, c1), (2, c2))
            ]
            stops = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(s.run(stop)) for s, stop in zip(scheds, stops, strict=True)]
            done, _ = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            (loser,) = done  # the other keeps running
            error = loser.exception()
            assert isinstance(error, DomainTakenError) and "already has a live domain scheduler" in str(error)
            winner = scheds[1 - tasks.index(loser)]
            await asyncio.wait_for(winner.ready.wait(), 10)
            reply = await kv_of(c1).get(Keys(prefix).domain("d"))
            held = decode(DomainRegistration, bytes(reply.kvs[0].value), "k")
            assert held.address == winner.cfg.advertise_address  # the registration names the one that runs
            for stop in stops:
                stop.set()
            await asyncio.wait_for(tasks[1 - tasks.index(loser)], 10)

    asyncio.run(main())


def test_a_scheduler_stops_while_its_claim_waits_for_an_etcd_session(etcd: Any, prefix: str) -> None:
    # the claim waits for the registrar's session; when etcd grants none (it refused a TTL above its maximum) the
    # scheduler ignored SIGTERM until it was killed
    async def main() -> None:
        async with etcd_client(etcd.endpoint) as client:
            sched = DomainScheduler(
                RackConfig("d", "127.0.0.1:1", BLOCK, prefix=prefix, ttl_s=3, ready_timeout_s=1.0),
                client,
                rng=random.Random(1),
            )
            waiting = asyncio.Event()

            async def no_session(_key: str, _value: bytes) -> bool:
                waiting.set()
                await asyncio.Event().wait()  # as Registrar.claim waits for a session that never opens
                return True

            sched.registrar.claim = no_session  # type: ignore[method-assign]
            stop = asyncio.Event()
            task = asyncio.create_task(sched.run(stop))
            await asyncio.wait_for(waiting.wait(), 10)
            stop.set()
            await asyncio.wait_for(task, 5)  # returns, having claimed nothing
            assert not sched.ready.is_set()
            assert (await kv_of(client).get(Keys(prefix).domain("d"))).kvs == []

    asyncio.run(main())
