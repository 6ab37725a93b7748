"""GatewaySink: tokens pushed out of order and twice, from two owners across a migration, are delivered
once and in order; the migration is seen with its token gap."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sink import GatewaySink, Move, TokenUpdate
from hilum_proto.v1 import token_sink_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Observer:
    def __init__(self) -> None:
        self.tokens: list[tuple[int, float | None, bool]] = []
        self.migrations: list[tuple[str, str, float | None]] = []

    def on_tokens(self, request_id: str, count: int, gap_s: float | None, first: bool) -> None:
        self.tokens.append((count, gap_s, first))

    def on_migration(self, request_id: str, src: str, dst: str, gap_s: float | None) -> None:
        self.migrations.append((src, dst, gap_s))


def chunk(
    first: int, ids: list[int], epoch: int, sender: str, finished: bool = False, address: str = ""
) -> pb.TokenChunk:
    return pb.TokenChunk(
        request_id="r",
        first_seq=first,
        token_ids=ids,
        epoch=epoch,
        sender_instance_id=sender,
        sender_address=address,
        finished=finished,
        finish_reason="length" if finished else "",
    )


def test_delivery_across_a_migration() -> None:
    clock, obs = Clock(), Observer()

    async def main() -> list[TokenUpdate]:
        sink = GatewaySink(observer=obs, clock=clock, poll_s=0.01)
        sink.open("r")
        sink.dispatched("r", "a0", "")
        got: list[TokenUpdate] = []

        async def consume() -> None:
            async for update in sink.updates("r"):
                got.append(update)

        task = asyncio.create_task(consume())
        pushes = [
            (0.0, chunk(0, [10, 11], 0, "a0")),
            (0.5, chunk(3, [13], 0, "a0")),  # out of order: seq 2 is missing
            (0.1, chunk(2, [12], 0, "a0")),  # fills the hole
            (0.1, chunk(2, [12, 13], 0, "a0")),  # a retried push: duplicates dropped
            (0.3, chunk(4, [14], 1, "b0")),  # the new owner after a committed migration
            (0.1, chunk(4, [99], 0, "a0")),  # a late push of the old owner: superseded, ignored
            (0.1, chunk(5, [15], 1, "b0", finished=True)),
        ]
        acks = []
        for dt, msg in pushes:
            clock.now += dt
            acks.append(sink._push(msg))
            await asyncio.sleep(0.02)
        await asyncio.wait_for(task, 2)
        assert [a.next_seq for a in acks] == [2, 2, 4, 4, 5, 5, 6]
        assert acks[5].superseded
        return got

    got = asyncio.run(main())
    ids = [t for u in got for t in u.token_ids]
    assert ids == [10, 11, 12, 13, 14, 15]
    last = got[-1]
    assert last.done and last.finish_reason == "length" and last.instance_id == "b0" and last.migrations == 1
    # a0's last contiguous token arrived at t = 100.6 (the push that filled the hole), b0's first at 101.0
    assert last.moves == (Move("a0", "b0", pytest.approx(0.4)),)
    assert obs.migrations == [("a0", "b0", pytest.approx(0.4))]
    counts = [c for c, _, _ in obs.tokens]
    assert sum(counts) == 6 and obs.tokens[0] == (2, None, True)


def test_a_request_never_opened_is_unknown_and_a_closed_one_too() -> None:
    async def main() -> None:
        sink = GatewaySink()
        assert sink._push(chunk(0, [1], 0, "a0")).unknown
        sink.open("r")
        assert not sink._push(chunk(0, [1], 0, "a0")).unknown
        sink.close("r")
        assert sink._push(chunk(1, [2], 0, "a0")).unknown

    asyncio.run(main())


def test_the_first_sender_of_an_epoch_owns_the_request() -> None:
    """A source that could not learn whether its commit happened claims the next epoch; the sink takes the first
    of that claim and the destination's announcement and supersedes the other. A claim by the owner itself is
    no migration."""
    clock, obs = Clock(), Observer()

    async def main() -> None:
        sink = GatewaySink(observer=obs, clock=clock)
        sink.open("r")
        sink.dispatched("r", "a0", "")
        assert not sink._push(chunk(0, [10, 11], 0, "a0", address="a:1")).superseded
        assert not sink._push(chunk(2, [], 1, "a0", address="a:1")).superseded  # a0 claims epoch 1 first
        late = sink._push(chunk(2, [], 1, "b0", address="b:1"))  # b0's announcement of epoch 1 comes second
        assert late.superseded
        assert not sink._push(chunk(2, [12], 1, "a0", address="a:1", finished=True)).superseded
        got = sink.get("r")
        assert got.token_ids == (10, 11, 12) and got.done and got.owner_address == "a:1" and got.epoch == 1
        assert obs.migrations == []  # the owner stayed a0

        sink.open("q")  # the other order: the destination's announcement wins, the source's claim is refused
        for msg in (chunk(0, [10], 0, "a0", address="a:1"), chunk(1, [], 1, "b0", address="b:1")):
            msg.request_id = "q"
            assert not sink._push(msg).superseded
        claim = chunk(1, [], 1, "a0", address="a:1")
        claim.request_id = "q"
        assert sink._push(claim).superseded and sink.get("q").owner_address == "b:1"

    asyncio.run(main())
