"""Election, fenced writes and compare-and-swap migration transitions on a real etcd."""

from __future__ import annotations

import asyncio

import pytest
from etcd_server import EtcdServer

from clusterstate.election import Election
from clusterstate.etcd import connect, lease_of
from clusterstate.fencing import Fence, FencedOut
from clusterstate.records import DrainIntent, DrainKind, MigrationRecord, MigrationState
from clusterstate.session import Session
from clusterstate.store import Keys, Store


def _record(mid: str, token: int) -> MigrationRecord:
    return MigrationRecord(mid, "req", 1, "a0", "b0", "A", "B", 64, MigrationState.PROPOSED, token, ("l1",))


def test_election_failover_and_stale_leader_is_fenced_out(etcd: EtcdServer, prefix: str) -> None:
    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        keys = Keys(prefix)
        election = Election(client, keys.leader)
        store = Store(client, keys)
        sa = await Session.open(client, 5)
        sb = await Session.open(client, 5)
        a = await election.campaign(sa, "a", "h:1")
        b_campaign = asyncio.create_task(election.campaign(sb, "b", "h:2"))
        await asyncio.sleep(0.3)
        assert not b_campaign.done()  # b waits while a leads
        assert await election.leader() == a
        # a re-campaigning with the same session still leads, with the same token
        assert (await election.campaign(sa, "a", "h:1")).token == a.token

        observed: list[str | None] = []

        async def observe() -> None:
            async for leader in election.observe():
                observed.append(leader.leader_id if leader else None)

        obs = asyncio.create_task(observe())
        await asyncio.sleep(0.2)
        # a "pauses": its lease is gone (revoked here, as etcd would expire it) and b takes over
        await lease_of(client).revoke(sa.lease_id)
        b = await asyncio.wait_for(b_campaign, 5)
        assert b.token > a.token
        await asyncio.sleep(0.2)
        assert observed[0] == "a" and observed[-1] == "b"
        obs.cancel()

        # a wakes up and tries to act with its old token: every fenced write is refused
        with pytest.raises(FencedOut, match=f"no longer has fencing token {a.token}"):
            await store.create_migration(_record("req#1", a.token), Fence(keys.leader, a.token))
        with pytest.raises(FencedOut):
            await store.put_drain(DrainIntent(DrainKind.DOMAIN, "A"), Fence(keys.leader, a.token))
        assert await store.get_migration("req#1") is None
        # the new leader's writes go through
        created = await store.create_migration(_record("req#1", b.token), Fence(keys.leader, b.token))
        assert created.ok
        assert not await election.resign(a)  # a cannot delete b's key
        assert await election.resign(b)
        assert await election.leader() is None
        await sa.close()
        await sb.close()
        await client.close()

    asyncio.run(main())


def test_cas_transitions_are_applied_once(etcd: EtcdServer, prefix: str) -> None:
    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        keys = Keys(prefix)
        session = await Session.open(client, 5)
        leader = await Election(client, keys.leader).campaign(session, "c", "h:1")
        fence = Fence(keys.leader, leader.token)
        store = Store(client, keys)

        created = await store.create_migration(_record("r#1", leader.token), fence)
        assert created.ok
        again = await store.create_migration(_record("r#1", leader.token), fence)
        assert not again.ok and again.current == _record("r#1", leader.token)  # never created twice
        assert again.mod_revision == created.mod_revision

        approved = await store.transition("r#1", created.mod_revision, MigrationState.APPROVED, fence=fence)
        assert approved.ok and approved.current is not None
        assert approved.current.state is MigrationState.APPROVED
        assert approved.current.fencing_token == leader.token

        # two domain schedulers race to finish the same migration: exactly one wins
        results = await asyncio.gather(
            store.transition("r#1", approved.mod_revision, MigrationState.COMMITTED, reason="dst committed"),
            store.transition("r#1", approved.mod_revision, MigrationState.ABORTED, reason="src gave up"),
        )
        assert sorted(r.ok for r in results) == [False, True]
        winner = next(r for r in results if r.ok)
        loser = next(r for r in results if not r.ok)
        assert loser.current == winner.current and loser.mod_revision == winner.mod_revision
        # a stale retry with the old revision is refused, not applied again
        stale = await store.transition("r#1", approved.mod_revision, MigrationState.COMMITTED)
        assert not stale.ok
        assert winner.current is not None
        with pytest.raises(ValueError, match=rf"illegal transition {winner.current.state} -> approved"):
            await store.transition("r#1", winner.mod_revision, MigrationState.APPROVED)
        with pytest.raises(KeyError, match="r#2"):
            await store.transition("r#2", 1, MigrationState.APPROVED)

        # drains: created once, deleted once
        assert await store.put_drain(DrainIntent(DrainKind.INSTANCE, "a0", "x", leader.token), fence)
        assert not await store.put_drain(DrainIntent(DrainKind.INSTANCE, "a0", "x", leader.token), fence)
        assert await store.delete_drain(DrainKind.INSTANCE, "a0", fence)
        assert not await store.delete_drain(DrainKind.INSTANCE, "a0", fence)
        await session.close()
        await client.close()

    asyncio.run(main())
