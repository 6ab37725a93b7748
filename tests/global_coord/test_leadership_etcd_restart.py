"""Leadership after etcd restarts: a real etcd is stopped for longer than the lease TTL and started again.

etcd restores its leases with a fresh TTL when it restarts, so the leader key of the session the leader
lost during the outage outlives it by a whole TTL unless its holder takes it over. Two replicas run
in-process (no gRPC server: only their campaigns and views matter here); the test samples what each one
says while it recovers and checks the asyncio loop for leaked tasks afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from typing import Any

import pytest
from etcd_server import EtcdServer

from clusterstate.backoff import BackoffConfig
from clusterstate.etcd import connect
from clusterstate.records import DrainKind
from global_coord.coordinator import Coordinator, CoordinatorConfig, NotLeader

TTL_S = 3
FAST = BackoffConfig(initial_s=0.05, max_s=0.5)  # retries bounded well below the TTL


def _replica(name: str, client: Any, etcd: EtcdServer) -> Coordinator:
    cfg = CoordinatorConfig(
        coordinator_id=name,
        advertise_address=f"{name}.test:7070",
        etcd_endpoint=etcd.endpoint,
        ttl_s=TTL_S,
        backoff=FAST,
    )
    return Coordinator(cfg, client, rng=random.Random(name))


async def _two_replicas(etcd: EtcdServer) -> tuple[list[Any], list[Coordinator]]:
    """Two replicas, ``coord-a`` and ``coord-b``, each with its own connected etcd client (not running yet)."""
    clients = [connect([etcd.endpoint]) for _ in range(2)]
    for client in clients:
        await client.connect()
    return clients, [_replica(n, c, etcd) for n, c in zip(("coord-a", "coord-b"), clients, strict=True)]


def _leaders(replicas: list[Coordinator]) -> list[str]:
    return [c.cfg.coordinator_id for c in replicas if c.is_leader()]


def test_a_leader_within_one_ttl_after_etcd_answers_again(
    etcd_private: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    loop_errors: list[str] = []

    async def main() -> tuple[str, str, int]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: loop_errors.append(str(ctx["message"])))
        clients, replicas = await _two_replicas(etcd_private)
        stop = asyncio.Event()
        runs = [asyncio.create_task(c.run(stop)) for c in replicas]
        self_named: list[str] = []  # "X is not the leader: the leader is X" would be a lie

        def sample() -> None:
            for c in replicas:
                leader = c.current_leader()
                if not c.is_leader() and leader is not None and leader.leader_id == c.cfg.coordinator_id:
                    self_named.append(c.cfg.coordinator_id)

        async with asyncio.timeout(20):
            while not _leaders(replicas):
                await asyncio.sleep(0.02)
        first = _leaders(replicas)[0]
        first_token = next(c for c in replicas if c.is_leader()).leading.token  # type: ignore[union-attr]

        await asyncio.to_thread(etcd_private.stop)
        async with asyncio.timeout(TTL_S + 10):  # the outage outlasts every session
            while _leaders(replicas):
                sample()
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # each replica has given its lost session up (one failed revocation)
        await asyncio.to_thread(etcd_private.start)  # returns once etcd answers /health
        back = time.monotonic()
        async with asyncio.timeout(TTL_S + 10):
            while not _leaders(replicas):
                sample()
                await asyncio.sleep(0.02)
        took = time.monotonic() - back
        leader = next(c for c in replicas if c.is_leader())
        standby = next(c for c in replicas if c is not leader)
        assert took < TTL_S, f"nobody led for {took:.2f} s after etcd answered again (TTL {TTL_S} s)"
        # the old leader deleted the key of its lost session (see took_over below); either replica may win
        assert leader.leading is not None and leader.leading.token > first_token
        new, leader_token = leader.cfg.coordinator_id, leader.leading.token

        # every replica names the same leader, and a write at the standby says who it is
        async with asyncio.timeout(10):
            while (seen := standby.current_leader()) is None or seen.leader_id != new:
                sample()
                await asyncio.sleep(0.02)
        with pytest.raises(NotLeader, match=f"coordinator {standby.cfg.coordinator_id} is not the leader: "
                           f"the leader is {new} at {new}.test:7070"):  # fmt: skip
            await standby.drain(DrainKind.INSTANCE, "i0")
        assert self_named == []

        stop.set()
        await asyncio.gather(*runs)
        for client in clients:
            await client.close()
        gc.collect()  # a task leaked by a failed stream is reported when it is collected
        await asyncio.sleep(0.1)
        return first, new, leader_token

    first, new, leader_token = asyncio.run(main())
    assert loop_errors == []
    asyncio_errors = [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert asyncio_errors == []
    took_over = [r.getMessage() for r in caplog.records if "taking it over" in r.getMessage()]
    assert len(took_over) == 1 and took_over[0].startswith(f"{first}: the leader key still holds an earlier session")
    # losing the lead is a warning, and so is leading again (a log kept at WARNING says both); stopping is not
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "global_coord.coordinator"]
    down = [level for level, text in lines if text.startswith(f"{first}: stepped down (token ")]
    assert down[0] == logging.WARNING, lines
    again = [(level, text) for level, text in lines if ": leads again, fencing token " in text]
    # only a replica that lost the lead says it leads again (the other one leads for the first time)
    assert again == ([(logging.WARNING, f"{first}: leads again, fencing token {leader_token}")] if new == first else [])
    assert [level for level, text in lines if text.endswith("): stopping")] == [logging.INFO], lines


def test_a_standby_counts_its_failures_from_one_in_each_outage(
    etcd_private: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    # its retry count and delay were reset only when it led: a standby's second outage began at the first one's
    # count ("attempt 17; retrying in 1.85 s") and its recovery line counted one failure
    caplog.set_level(logging.INFO)

    async def main() -> None:
        clients, replicas = await _two_replicas(etcd_private)
        stop = asyncio.Event()
        runs = [asyncio.create_task(c.run(stop)) for c in replicas]

        def failures_of(name: str) -> list[str]:
            said = (r.getMessage() for r in caplog.records)
            return [m for m in said if m.startswith(f"{name}: cannot open an etcd session")]

        async def outage() -> None:
            await asyncio.to_thread(etcd_private.stop)
            async with asyncio.timeout(TTL_S + 10):
                while _leaders(replicas) or not all(failures_of(c.cfg.coordinator_id) for c in replicas):
                    await asyncio.sleep(0.05)
            await asyncio.to_thread(etcd_private.start)
            async with asyncio.timeout(TTL_S + 10):
                while not _leaders(replicas):
                    await asyncio.sleep(0.02)

        async with asyncio.timeout(20):
            while not _leaders(replicas):
                await asyncio.sleep(0.02)
        await outage()
        standby = next(c.cfg.coordinator_id for c in replicas if not c.is_leader())
        async with asyncio.timeout(TTL_S + 10):  # its session open again (the run of failures ended)
            while not any(r.getMessage().startswith(f"{standby}: etcd answers again after ") for r in caplog.records):
                await asyncio.sleep(0.05)
        before = len(failures_of(standby))
        await asyncio.to_thread(etcd_private.stop)
        async with asyncio.timeout(TTL_S + 10):
            while len(failures_of(standby)) == before:
                await asyncio.sleep(0.05)
        assert ", attempt 1; " in failures_of(standby)[before], failures_of(standby)
        await asyncio.to_thread(etcd_private.start)
        stop.set()
        await asyncio.gather(*runs)
        for client in clients:
            await client.close()

    asyncio.run(main())
