"""ClusterView converges to etcd's exact contents across etcd restarts and compactions."""

from __future__ import annotations

import asyncio
import random

import pytest
from etcd_server import EtcdServer

from clusterstate.etcd import Etcd3Client, connect, kv_of, lease_of, prefix_range_end
from clusterstate.store import ClusterView, Entry, Keys

PREFIX = "/hilum/v1/"


async def _etcd_contents(client: Etcd3Client) -> dict[str, Entry]:
    resp = await kv_of(client).get(PREFIX, range_end=prefix_range_end(PREFIX), timeout=5.0)
    return {
        bytes(kv.key).decode(): Entry(bytes(kv.value), int(kv.mod_revision), int(kv.create_revision), int(kv.lease))
        for kv in resp.kvs
    }


async def _converged(view: ClusterView, client: Etcd3Client, timeout_s: float = 5.0) -> dict[str, Entry]:
    truth = await _etcd_contents(client)
    async with asyncio.timeout(timeout_s):
        while view.entries("") != truth:
            await asyncio.sleep(0.05)
            truth = await _etcd_contents(client)
    return truth


async def _churn(client: Etcd3Client, rng: random.Random, stop: asyncio.Event, leases: list[int]) -> int:
    """Registrations come and go (puts under leases, deletes, updates) until ``stop``; tolerate outages."""
    ops = 0
    while not stop.is_set():
        i = rng.randrange(12)
        key = f"{PREFIX}instances/i{i}"
        try:
            if rng.random() < 0.35:
                await kv_of(client).delete(key, timeout=1.0)
            else:
                value = f'{{"n":{ops}}}'.encode()
                await kv_of(client).put(key, value, lease=rng.choice(leases), timeout=1.0)
            ops += 1
        except Exception:  # etcd is down for a moment: that is the point of the test
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.005)
    return ops


def test_view_converges_after_compaction_and_etcd_restart(etcd_private: EtcdServer) -> None:
    async def main() -> None:
        writer = connect([etcd_private.endpoint])
        await writer.connect()
        reader = connect([etcd_private.endpoint])
        await reader.connect()
        leases = [int((await lease_of(writer).grant(60)).ID) for _ in range(3)]
        for i in range(5):
            await kv_of(writer).put(f"{PREFIX}domains/d{i}", b"{}", lease=leases[i % 3])
        await kv_of(writer).put("/other/key", b"outside the prefix")

        gate = asyncio.Event()
        listed: list[int] = []

        async def on_listed(revision: int) -> None:
            listed.append(revision)
            if len(listed) == 1:
                await gate.wait()  # hold the first watch back until history is compacted past it

        view = ClusterView(reader, Keys(PREFIX), rng=random.Random(0), on_listed=on_listed)
        task = asyncio.create_task(view.run())
        await view.synced.wait()
        for i in range(5, 9):
            await kv_of(writer).put(f"{PREFIX}domains/d{i}", b"{}", lease=leases[0])
        await kv_of(writer).delete(f"{PREFIX}domains/d0")
        latest = int((await kv_of(writer).get("/other/key")).header.revision)
        await kv_of(writer).compact(latest, physical=True)
        gate.set()
        truth = await _converged(view, writer)
        assert view.relists.get("compacted") == 1
        assert sorted(truth) == [f"{PREFIX}domains/d{i}" for i in range(1, 9)]

        # registrations come and go while etcd restarts, and a lease is revoked (its keys vanish)
        stop = asyncio.Event()
        churn = asyncio.create_task(_churn(writer, random.Random(7), stop, leases))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(etcd_private.stop)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(etcd_private.start)
        await asyncio.sleep(0.8)
        await lease_of(writer).revoke(leases[1], timeout=5.0)
        await asyncio.sleep(0.3)
        stop.set()
        ops = await churn
        assert ops > 20
        truth = await _converged(view, writer)
        assert view.snapshot() == {k: e.value for k, e in truth.items()}
        assert all(e.lease != leases[1] for e in truth.values())
        assert sum(n for cause, n in view.relists.items() if cause not in ("initial", "compacted")) >= 1
        assert "/other/key" not in view.snapshot()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await writer.close()
        await reader.close()

    asyncio.run(main())


def test_list_at_holds_the_contents_of_a_past_revision(etcd: EtcdServer, prefix: str) -> None:
    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        kv = kv_of(client)
        await kv.put(f"{prefix}domains/d0", b'{"domain_id": "d0", "address": "h:1"}')
        then = int((await kv.put(f"{prefix}instances/i0", b"{}")).header.revision)
        await kv.put(f"{prefix}domains/d1", b'{"domain_id": "d1", "address": "h:2"}')
        await kv.delete(f"{prefix}instances/i0")
        view = ClusterView(client, Keys(prefix), rng=random.Random(0))
        await view.list_at(then)
        assert view.revision == then and sorted(view.snapshot()) == [f"{prefix}domains/d0", f"{prefix}instances/i0"]
        assert {d: r.address for d, r in view.domains().items()} == {"d0": "h:1"}
        now = int((await kv.get(f"{prefix}x")).header.revision)
        await view.list_at(now)
        assert sorted(view.snapshot()) == [f"{prefix}domains/d0", f"{prefix}domains/d1"]
        with pytest.raises(ValueError, match="revision must be >= 1, got 0"):
            await view.list_at(0)
        await client.close()

    asyncio.run(main())
