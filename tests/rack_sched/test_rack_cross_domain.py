"""Cross-domain moves: a drained domain proposes to a real coordinator (in-process, test judge), carries out
each approval with the leader's fencing token and records the outcome; stale tokens are refused; a restarted
scheduler settles the approved migrations its previous run left behind."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from rack_fakes import FakeLlumlet, etcd_client, eventually, fakes, put_drain, register, scheduler

from clusterstate.etcd import connect, kv_of
from clusterstate.records import DrainKind, MigrationRecord, MigrationState, encode
from clusterstate.store import Keys, Store
from global_coord.approver import Judgement, MoveProposal, PathLike
from global_coord.coordinator import Coordinator, CoordinatorConfig
from global_coord.server import start_server
from hilum_proto.tls import bind_server


@dataclass(frozen=True)
class _Path:
    bandwidth_bytes_per_s: float
    links: tuple[str, ...]
    same_domain: bool


def _path_of(src: str, dst: str) -> PathLike:
    return _Path(12.5e9, ("spine",), False)


def _judge(
    move: MoveProposal,
    dst: str,
    path: PathLike,
    busiest_link_flows: int,
    measured: float | None = None,
    dst_prefix_hash_blocks: int = 0,
    dst_prefill_s_per_token: float = 0.0,
) -> Judgement:
    return Judgement(True, "approved: test judge", 0.1, 0.005)


@contextlib.asynccontextmanager
async def _coordinator(endpoint: str, prefix: str) -> AsyncIterator[Coordinator]:
    client = connect([endpoint])
    await client.connect()
    server, port = bind_server("127.0.0.1:0")
    cfg = CoordinatorConfig("coord", f"127.0.0.1:{port}", endpoint, prefix=prefix, ttl_s=3)
    coord = Coordinator(cfg, client, rng=random.Random(1), path_of=_path_of, judge=_judge)
    await start_server(coord, server)
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        await asyncio.wait_for(coord.elected.wait(), 5)
        yield coord
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await server.stop(grace=None)
        await client.close()


def _records(coord: Coordinator) -> dict[str, MigrationRecord]:
    return {mid: rec for mid, (rec, _) in coord.view.migrations().items()}


def test_drained_domain_moves_out_with_fenced_approvals(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        peers: dict[str, FakeLlumlet] = {}
        async with (
            fakes("a", {"a0": 100}, peers) as fa,
            fakes("b", {"b0": 100}, peers) as fb,
            etcd_client(etcd.endpoint) as client,
            _coordinator(etcd.endpoint, prefix) as coord,
        ):
            for k in range(2):
                fa["a0"].add(f"r{k}", 5)
            for f in (*fa.values(), *fb.values()):
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "a") as rack_a, scheduler(etcd.endpoint, prefix, "b"):
                await asyncio.sleep(0.5)
                assert fa["a0"].commands == []  # one instance, not overloaded: nothing to do
                await put_drain(client, prefix, DrainKind.DOMAIN, "a")
                await eventually(lambda: not fa["a0"].running, 10, "domain a emptied into b")
                assert sorted(fb["b0"].running) == ["r0", "r1"]
                token = coord.leading.token if coord.leading else 0
                assert token > 0
                assert {(c.request_id, c.dst_instance_id, c.fencing_token) for c in fa["a0"].commands} == {
                    ("r0", "b0", token),
                    ("r1", "b0", token),
                }
                await eventually(lambda: len(_records(coord)) == 2, 5, "records in the view")
                await eventually(
                    lambda: {r.state for r in _records(coord).values()} == {MigrationState.COMMITTED}, 5, "committed"
                )
                for cmd in fa["a0"].commands:
                    record = _records(coord)[MigrationRecord.make_id(cmd.request_id, cmd.attempt)]
                    assert (record.src_instance_id, record.dst_instance_id, record.fencing_token) == ("a0", "b0", token)
                    assert (record.plan, record.measured_downtime_s) == ("pre-copy", 0.004)  # what the source ran
                state = rack_a.state()
                assert (state.cross_domain_approved, state.newest_fencing_token) == (2, token)

                # A scheduler that has seen a newer token refuses this leader's approval and aborts the record.
                rack_a.guard.check(token + 100)
                fa["a0"].add("late", 5)
                await eventually(lambda: len(_records(coord)) == 3, 5, "a third proposal")
                late = next(r for r in _records(coord).values() if r.request_id == "late")
                await eventually(
                    lambda: _records(coord)[late.migration_id].state is MigrationState.ABORTED, 5, "aborted"
                )
                assert _records(coord)[late.migration_id].reason == "stale fencing token"
                assert "late" in fa["a0"].running

    asyncio.run(main())


def test_restarted_scheduler_settles_approved_migrations(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        peers: dict[str, FakeLlumlet] = {}
        async with (
            fakes("a", {"a0": 100}, peers) as fa,
            fakes("b", {"b0": 100}, peers) as fb,
            etcd_client(etcd.endpoint) as client,
        ):
            fb["b0"].add("arrived", 5)  # committed on b0 before the old scheduler died
            fa["a0"].add("stayed", 5)  # never committed
            for f in (*fa.values(), *fb.values()):
                await register(client, prefix, f)
            store = Store(client, Keys(prefix))
            for rid in ("arrived", "stayed"):
                record = MigrationRecord(
                    MigrationRecord.make_id(rid, 3), rid, 3, "a0", "b0", "a", "b", 5, MigrationState.APPROVED, 9
                )
                await kv_of(client).put(Keys(prefix).migration(record.migration_id), encode(record))
            async with scheduler(etcd.endpoint, prefix, "a"):
                arrived = await store.get_migration("arrived#3")
                stayed = await store.get_migration("stayed#3")
                assert arrived is not None and stayed is not None
                assert arrived[0].state is MigrationState.COMMITTED
                assert (stayed[0].state, stayed[0].reason) == (
                    MigrationState.ABORTED,
                    "released after a domain scheduler restart",
                )

    asyncio.run(main())
