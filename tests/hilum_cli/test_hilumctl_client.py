"""hilumctl's leader following against fake coordinator replicas (grpc.aio servers in-process).

The real standby-to-leader redirect is covered in test_hilumctl.py; here the cases a live cluster rarely
shows: no leader at all, a refusal that names no address, and replicas that keep naming each other.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from hilum_cli.ctl_client import AdminClient, CtlError, Target, UsageError, parse_addresses
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import coordinator_pb2_grpc as pb_grpc


class Replica(pb_grpc.CoordinatorServicer):
    """Refuses writes as a standby (naming ``leader`` in the message when ``say_address``), or accepts them."""

    def __init__(self, name: str, *, leads: bool, leader: str = "", say_address: bool = True) -> None:
        self.name, self.leads, self.leader, self.say_address = name, leads, leader, say_address
        self.drains = 0

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusReply:
        return pb.StatusReply(coordinator_id=self.name, is_leader=self.leads, leader_address=self.leader)

    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainReply:
        self.drains += 1
        if not self.leads:
            where = f"the leader is x at {self.leader}" if self.leader and self.say_address else "no leader elected yet"
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"coordinator {self.name} is not the leader: {where}"
            )
        return pb.DrainReply(changed=True, intent=pb.DrainIntent(kind="instance", target_id=request.instance_id))


async def _serve(replica: Replica) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    pb_grpc.add_CoordinatorServicer_to_server(replica, server)
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_no_leader_is_a_clear_error() -> None:
    async def main() -> None:
        standby = Replica("s", leads=False)
        server, address = await _serve(standby)
        try:
            async with AdminClient(Target(coordinators=(address,)), 2.0) as client:
                with pytest.raises(CtlError, match=r"no coordinator leads right now \(coordinator s is not the leader"):
                    await client.write("Drain", pb.DrainRequest(instance_id="i0"))
        finally:
            await server.stop(None)
        assert standby.drains == 1

    asyncio.run(main())


def test_a_refusal_without_an_address_is_followed_through_status() -> None:
    async def main() -> None:
        leader = Replica("l", leads=True)
        lserver, laddress = await _serve(leader)
        standby = Replica("s", leads=False, leader=laddress, say_address=False)
        sserver, saddress = await _serve(standby)
        try:
            async with AdminClient(Target(coordinators=(saddress,)), 2.0) as client:
                reply, at = await client.write("Drain", pb.DrainRequest(instance_id="i0"))
                assert (reply.changed, reply.intent.target_id, at, client.address) == (True, "i0", laddress, laddress)
        finally:
            await sserver.stop(None)
            await lserver.stop(None)
        assert (standby.drains, leader.drains) == (1, 1)

    asyncio.run(main())


def test_replicas_naming_each_other_are_given_up_on() -> None:
    async def main() -> None:
        a, b = Replica("a", leads=False), Replica("b", leads=False)
        aserver, aaddress = await _serve(a)
        bserver, baddress = await _serve(b)
        a.leader, b.leader = baddress, aaddress
        try:
            async with AdminClient(Target(coordinators=(aaddress,)), 2.0) as client:
                with pytest.raises(CtlError, match="gave up after 3 redirects"):
                    await client.write("Drain", pb.DrainRequest(instance_id="i0"))
        finally:
            await aserver.stop(None)
            await bserver.stop(None)
        assert (a.drains, b.drains) == (2, 2)  # a, b, a, b: the first try and 3 redirects

    asyncio.run(main())


def test_a_write_passes_over_a_replica_that_does_not_answer() -> None:
    """``--coordinator DEAD,STANDBY``: the write reaches the leader the standby names (it failed at the first
    address, while reads went on to the next)."""

    async def main() -> None:
        leader = Replica("l", leads=True)
        lserver, laddress = await _serve(leader)
        standby = Replica("s", leads=False, leader=laddress)
        sserver, saddress = await _serve(standby)
        dead, dead_address = await _serve(Replica("d", leads=False))
        await dead.stop(None)  # nothing listens there any more
        try:
            async with AdminClient(Target(coordinators=(dead_address, saddress)), 2.0) as client:
                reply, at = await client.write("Drain", pb.DrainRequest(instance_id="i0"))
                assert (reply.changed, at, client.address) == (True, laddress, laddress)
            async with AdminClient(Target(coordinators=(dead_address,)), 2.0) as client:  # nowhere else to go
                with pytest.raises(CtlError, match=f"no coordinator answers at {dead_address}"):
                    await client.write("Drain", pb.DrainRequest(instance_id="i0"))
        finally:
            await sserver.stop(None)
            await lserver.stop(None)
        assert (standby.drains, leader.drains) == (0, 1)  # the leader named by the standby's Status

    asyncio.run(main())


@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        ("a:1", ("a:1",)),
        (" a:1 , b:2 ", ("a:1", "b:2")),
        ("[::1]:2379,b:2", ("[::1]:2379", "b:2")),
    ],
)
def test_parse_addresses(text: str, wanted: tuple[str, ...]) -> None:
    assert parse_addresses(text, "--coordinator") == wanted


@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        ("a:1,,b:2", "HILUM_COORDINATOR: entry 2 of 'a:1,,b:2' is empty: drop the extra comma"),
        ("a:1,", "HILUM_COORDINATOR: entry 2 of 'a:1,' is empty: drop the extra comma"),
        (",a:1", "HILUM_COORDINATOR: entry 1 of ',a:1' is empty: drop the extra comma"),
        (" , ", "HILUM_COORDINATOR: expected HOST:PORT, got ' , '"),
        ("a:1,b", "HILUM_COORDINATOR: 'b' is not HOST:PORT (port 1-65535)"),
        ("a:0", "HILUM_COORDINATOR: 'a:0' is not HOST:PORT (port 1-65535)"),
    ],
)
def test_parse_addresses_refuses_naming_the_entry(text: str, wanted: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_addresses(text, "HILUM_COORDINATOR")
    assert str(exc.value) == wanted
