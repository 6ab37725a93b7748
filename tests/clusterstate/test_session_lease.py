"""Session keep-alive across etcd interruptions, and clean re-registration after long ones."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
from etcd_server import EtcdServer

from clusterstate.etcd import connect, kv_of, lease_of
from clusterstate.session import Registrar, Session


async def _lease_ttl(endpoint: str, lease_id: int) -> int:
    client = connect([endpoint])
    await client.connect()
    try:
        return int((await lease_of(client).time_to_live(lease_id, timeout=2.0)).TTL)
    finally:
        await client.close()


def test_session_renews_and_close_revokes(etcd: EtcdServer, prefix: str) -> None:
    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        session = await Session.open(client, 2)
        await kv_of(client).put(prefix + "k", b"v", lease=session.lease_id)
        await asyncio.sleep(2.5)  # longer than the TTL: only renewals keep the key
        assert not session.done.is_set()
        assert session.renewals >= 2
        assert len((await kv_of(client).get(prefix + "k")).kvs) == 1
        await session.close()
        assert session.done.is_set()
        assert len((await kv_of(client).get(prefix + "k")).kvs) == 0
        await client.close()

    asyncio.run(main())


def test_session_survives_short_etcd_stop(
    etcd_private: EtcdServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    def said(words: str) -> list[int]:
        return [r.levelno for r in caplog.records if r.name == "clusterstate.session" and words in r.getMessage()]

    async def main() -> None:
        client = connect([etcd_private.endpoint])
        await client.connect()
        session = await Session.open(client, 3)
        await kv_of(client).put(prefix + "k", b"v", lease=session.lease_id)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(etcd_private.stop)
        deadline = time.monotonic() + 2.5  # a renewal is due every second
        while not said(f"lease {session.lease_id:x}: renewal failed ("):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.to_thread(etcd_private.start)
        await asyncio.sleep(2.5)  # the old expiry has passed: only a renewal after the restart saves it
        assert not session.done.is_set(), session.lost_reason
        assert session.remaining_s() > 0
        resp = await kv_of(client).get(prefix + "k")
        assert [int(kv.lease) for kv in resp.kvs] == [session.lease_id]
        # the failed renewal was a warning, and so is the one that ends the run: a log at WARNING says both
        assert said(f"lease {session.lease_id:x}: renewal failed (")[0] == logging.WARNING
        assert said(f"lease {session.lease_id:x}: renewal confirmed again after ") == [logging.WARNING]
        await session.close()
        await client.close()

    asyncio.run(main())


def test_a_session_paused_past_its_ttl_says_so(etcd: EtcdServer) -> None:
    """No renewal failed (etcd answers): the lease lapsed because this process did not run; the TTL is the knob."""

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        now = [time.monotonic()]
        session = await Session.open(client, 2, clock=lambda: now[0])
        now[0] += 5.0  # as if the process had been stopped for 5 s: the keep-alive wakes past the expiry
        await asyncio.wait_for(session.done.wait(), 5)
        assert session.lost_reason == (
            f"lease {session.lease_id:x} expired: no renewal confirmed for 2 s; this process did not run in time to "
            "renew it (paused, or its event loop blocked): raise the TTL if that is expected"
        )
        await session.close()
        await client.close()

    asyncio.run(main())


def test_a_session_whose_renewals_get_no_answer_in_time_names_etcd_and_the_ttl(etcd_private: EtcdServer) -> None:
    """A frozen etcd (as a slow one) takes the connection and answers nothing: each renewal times out."""

    async def main() -> None:
        client = connect([etcd_private.endpoint])
        await client.connect()
        session = await Session.open(client, 2)
        etcd_private.pause()
        try:
            await asyncio.wait_for(session.done.wait(), 6)
        finally:
            etcd_private.resume()
        assert session.lost_reason == (
            f"lease {session.lease_id:x} expired: no renewal confirmed for 2 s; etcd answered no renewal in time "
            "(TimeoutError): check that etcd runs; raise the TTL if it is slow"
        )
        await session.close()
        await client.close()

    asyncio.run(main())


def test_registrar_reregisters_after_long_etcd_stop(
    etcd_private: EtcdServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="clusterstate.session")

    async def main() -> None:
        client = connect([etcd_private.endpoint])
        await client.connect()
        reg = Registrar(client, 2, rng=random.Random(1), name="test")
        await reg.set(prefix + "instances/i0", b"i0")
        stop = asyncio.Event()
        task = asyncio.create_task(reg.run(stop))
        await asyncio.wait_for(reg.registered.wait(), 5)
        assert reg.session is not None
        first = reg.session
        await asyncio.to_thread(etcd_private.stop)
        t0 = time.monotonic()
        await asyncio.wait_for(first.done.wait(), 5)  # lost locally at the expiry, while etcd is down
        assert time.monotonic() - t0 < 2.5
        # why, with what to do: etcd did not answer (refused, or no answer in time: the TTL is then named too)
        assert first.lost_reason.startswith(f"lease {first.lease_id:x} expired: no renewal confirmed for 2 s; etcd ")
        assert "): check that etcd runs" in first.lost_reason
        await asyncio.to_thread(etcd_private.start)
        await asyncio.wait_for(reg.registered.wait(), 10)
        second = reg.session
        assert second is not None and second.lease_id != first.lease_id
        assert reg.sessions_opened == 2
        resp = await kv_of(client).get(prefix + "instances/", range_end=prefix + "instances0")
        assert [(kv.key, kv.value, int(kv.lease)) for kv in resp.kvs] == [
            ((prefix + "instances/i0").encode(), b"i0", second.lease_id)
        ]
        assert await _lease_ttl(etcd_private.endpoint, first.lease_id) == -1  # the old lease was revoked
        # the loss was a warning, and so is the recovery: a log kept at WARNING (a llumlet's default) says both
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "clusterstate.session"]
        lost = [k for k, (level, text) in enumerate(lines) if level == logging.WARNING and "session lost (" in text]
        again = (logging.WARNING, f"test: 1 key registered again under lease {second.lease_id:x}")
        assert lost and again in lines[lost[0] :], lines
        assert (logging.INFO, f"test: 1 key registered under lease {first.lease_id:x}") in lines  # the first: INFO
        stop.set()
        await asyncio.wait_for(task, 5)
        assert len((await kv_of(client).get(prefix + "instances/i0")).kvs) == 0
        await client.close()

    asyncio.run(main())


def test_a_claim_takes_over_only_its_own_previous_registration(etcd: EtcdServer, prefix: str) -> None:
    """A crashed holder's key (its lease still alive in etcd) holding exactly the claimed value is the previous
    run of the same registrant: taken over at once. Another value is another holder: refused."""

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        crashed = int((await lease_of(client).grant(30)).ID)  # nobody renews it; it outlives the "crash"
        await kv_of(client).put(prefix + "mine", b'{"address":"h:1"}', lease=crashed)
        await kv_of(client).put(prefix + "theirs", b'{"address":"h:2"}', lease=crashed)
        reg = Registrar(client, 5, rng=random.Random(1), name="restarted")
        stop = asyncio.Event()
        task = asyncio.create_task(reg.run(stop))
        assert await reg.claim(prefix + "mine", b'{"address":"h:1"}')
        assert not await reg.claim(prefix + "theirs", b'{"address":"h:3"}')
        assert reg.session is not None
        leases = {}
        for key in ("mine", "theirs"):
            kvs = (await kv_of(client).get(prefix + key)).kvs
            leases[key] = int(kvs[0].lease)
        assert leases == {"mine": reg.session.lease_id, "theirs": crashed}
        stop.set()
        await task
        await lease_of(client).revoke(crashed)
        await client.close()

    asyncio.run(main())


def test_a_put_that_gets_no_answer_is_logged_with_its_reason(
    etcd: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a TimeoutError has no message: the line read "put /hilum/v1/summaries/node-a failed ()"
    import clusterstate.session as session_module

    class NoAnswer:
        async def put(self, *args: object, **kwargs: object) -> None:
            raise TimeoutError

    async def main() -> None:
        client = connect([etcd.endpoint])
        await client.connect()
        reg = Registrar(client, 5, rng=random.Random(1), name="rack node-a")
        stop = asyncio.Event()
        task = asyncio.create_task(reg.run(stop))
        await asyncio.wait_for(reg.registered.wait(), 5)
        monkeypatch.setattr(session_module, "kv_of", lambda _client: NoAnswer())
        with caplog.at_level(logging.WARNING, logger="clusterstate.session"):
            await reg.set(prefix + "summaries/node-a", b"s")
        monkeypatch.undo()
        stop.set()
        await task
        await client.close()

    asyncio.run(main())
    assert (
        f"rack node-a: put {prefix}summaries/node-a failed (TimeoutError); it is written again on re-registration"
    ) in caplog.text
