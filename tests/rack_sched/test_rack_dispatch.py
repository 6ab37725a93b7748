"""Dispatch, refusal, intra-domain rescheduling, summaries and drains of a domain scheduler over fake
llumlets (real gRPC, real etcd)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from rack_fakes import BLOCK, etcd_client, eventually, fakes, put_drain, register, scheduler

from clusterstate.etcd import kv_of
from clusterstate.records import DrainKind
from clusterstate.store import Keys
from hilum_proto.tls import bind_server
from hilum_proto.v1 import llumlet_pb2, rack_sched_pb2, rack_sched_pb2_grpc
from rack_sched.core import DomainRequest
from rack_sched.scheduler import DomainScheduler
from rack_sched.server import start_server
from rack_sched.types import DispatchOutcome


def _submit(request_id: str, prompt_tokens: int, priority: int = 0) -> tuple[DomainRequest, llumlet_pb2.SubmitRequest]:
    msg = llumlet_pb2.SubmitRequest(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        sampling=llumlet_pb2.Sampling(max_tokens=32),
        priority=priority,
        origin="127.0.0.1:9",
    )
    return DomainRequest(request_id, "", prompt_tokens, 32, priority), msg


def test_burst_spreads_over_instances_by_reservation(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        async with (
            fakes("d", {"i0": 1000, "i1": 1000, "i2": 1000, "i3": 1000}) as fs,
            etcd_client(etcd.endpoint) as client,
        ):
            for f in fs.values():
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "d") as sched:
                # Eight requests of ceil(161 / 16) = 11 blocks picked in one loop pass, before any report: with
                # reservations an instance holding two looks (1000 - 22) / 2 = 489 free against 989 or 1000, far
                # outside the 5% near-tie band, so each instance gets exactly two.
                results = await asyncio.gather(*(sched.submit(*_submit(f"r{k}", 160)) for k in range(8)))
                assert [r.outcome for r in results] == [DispatchOutcome.ACCEPTED] * 8
                assert {r.demand_blocks for r in results} == {11}
                assert sorted(len(f.submits) for f in fs.values()) == [2, 2, 2, 2]
                by_result = {r.instance_id for r in results}
                assert by_result == {"i0", "i1", "i2", "i3"}
                assert {r.instance_address for r in results} == {f.address for f in fs.values()}

    asyncio.run(main())


def test_refusal_reasons_and_invalid_input_over_grpc(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        async with fakes("d", {"i0": 100, "i1": 80}) as fs, etcd_client(etcd.endpoint) as client:
            for f in fs.values():
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "d") as sched:
                server, port = bind_server("127.0.0.1:0")
                await start_server(sched, server)
                try:
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                        stub = rack_sched_pb2_grpc.RackSchedulerStub(channel)
                        ping = await stub.Ping(rack_sched_pb2.RackPingRequest())
                        assert (ping.domain_id, ping.num_instances, ping.ready) == ("d", 2, True)
                        # 100 blocks hold a request that may grow to 100 * 16 tokens: prompt + max_tokens (32) - 1.
                        ok = await stub.Submit(_submit("fits", 100 * BLOCK - 31)[1])
                        assert (ok.outcome, ok.instance_id, ok.demand_blocks) == (
                            rack_sched_pb2.DISPATCH_ACCEPTED,
                            "i0",
                            99,  # ceil((1569 + 1) / 16) to start
                        )
                        big = await stub.Submit(_submit("big", 100 * BLOCK - 30)[1])
                        assert big.outcome == rack_sched_pb2.DISPATCH_REFUSED
                        assert big.demand_blocks == 99  # it would start in 99, but may grow to 101
                        assert big.reason == (
                            "request needs 101 blocks but the largest non-draining instance can hold 100 blocks; "
                            "no instance can ever hold it"
                        )
                        # i0 is full now; both go to i1, whose llumlet refuses the second (a duplicate id).
                        first = await stub.Submit(_submit("x", 10)[1])
                        assert (first.outcome, first.instance_id) == (rack_sched_pb2.DISPATCH_ACCEPTED, "i1")
                        dup = await stub.Submit(_submit("x", 10)[1])
                        assert dup.outcome == rack_sched_pb2.DISPATCH_REFUSED
                        assert dup.reason == "instance i1 refused it: duplicate request id x"
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await stub.Submit(llumlet_pb2.SubmitRequest(request_id="", prompt_tokens=3))
                        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                        assert "request_id is empty" in str(err.value.details())
                        assert "max_tokens must be >= 1" in str(err.value.details())
                        for tokens, why in ((0, "prefix_hashes given but prefix_block_tokens < 1"),
                                            (24, "prefix_hash_block_tokens 24 is not a multiple of this domain's "
                                                 "KV block size 16")):  # fmt: skip
                            bad = _submit("p", 100)[1]
                            bad.prefix_block_hashes.extend([7, 8])
                            bad.prefix_hash_block_tokens = tokens
                            with pytest.raises(grpc.aio.AioRpcError) as err:
                                await stub.Submit(bad)
                            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                            assert why in str(err.value.details())
                finally:
                    await server.stop(grace=None)

    asyncio.run(main())


def test_overloaded_instance_migrates_inside_the_domain(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        async with fakes("d", {"a": 100, "b": 100}) as fs, etcd_client(etcd.endpoint) as client:
            # a: F = (100 - 98) / 2 = 1 < 3 (source); b: F = 100 (destination). The smaller request moves first
            # (priority-then-size): V_a - V_b = 98 > 40. Afterwards a = 58 / 1, b = 40 / 1: no source, no move.
            fs["a"].add("r-big", 58)
            fs["a"].add("r-small", 40)
            for f in fs.values():
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "d") as sched:
                await eventually(lambda: "r-small" in fs["b"].running, what="r-small moved to b")
                await asyncio.sleep(0.4)  # several more rounds: nothing else moves
                assert [c.request_id for c in fs["a"].commands] == ["r-small"]
                cmd = fs["a"].commands[0]
                assert (cmd.dst_address, cmd.dst_instance_id, cmd.fencing_token) == (fs["b"].address, "b", 0)
                assert cmd.attempt >= 1
                assert fs["b"].commands == []
                state = sched.state()
                assert (state.migrations_committed, state.migrations_aborted, state.migrations_in_flight) == (1, 0, 0)

    asyncio.run(main())


def test_summary_is_published_at_the_rate_limit(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        async with fakes("d", {"a": 1000, "b": 1000}) as fs, etcd_client(etcd.endpoint) as client:
            for f in fs.values():
                await register(client, prefix, f)
            key = Keys(prefix).summary("d")
            async with scheduler(etcd.endpoint, prefix, "d", summary_interval_s=0.25) as sched:
                await eventually(lambda: sched.publisher.puts >= 1, what="first summary")
                first = await kv_of(client).get(key)
                start_version = int(first.kvs[0].version)
                assert int(first.kvs[0].lease) != 0  # bound to the scheduler's lease
                for k in range(50):  # a load change every 20 ms for 1 s
                    fs["a"].add(f"r{k}", 1)
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.3)
                resp = await kv_of(client).get(key)
                puts = int(resp.kvs[0].version) - start_version
                # 50 changes in ~1.3 s at most one put per 0.25 s: between 3 and 1.3 / 0.25 + 1 = 6 puts.
                assert 3 <= puts <= 6, puts
                value = json.loads(resp.kvs[0].value)
                assert value["domain_id"] == "d"
                (summary,) = value["summaries"]  # one model
                assert (summary["num_instances"], summary["num_running"], summary["capacity_blocks"]) == (2, 50, 2000)
                assert summary["model"] == "llama-2-7b" and summary["taken_s"] > 1e9  # wall clock
                brief = {
                    "draining": False,
                    "num_waiting": 0,
                    "capacity_blocks": 1000,
                    "decode_step_s": 0.0,
                    "max_num_seqs": 0,
                    "prefix_hashes": [],  # the fakes hold no prefix cache
                    "prefill_s_per_token": 0.0,  # nor offer a prefill estimate
                }
                assert summary["instances"] == [
                    {**brief, "instance_id": "a", "num_running": 50, "free_blocks": 950, "virtual_usage": 50.0},
                    {**brief, "instance_id": "b", "num_running": 0, "free_blocks": 1000, "virtual_usage": 0.0},
                ]
            gone = await kv_of(client).get(key)
            assert not gone.kvs  # the lease was revoked on stop

    asyncio.run(main())


def test_drain_intent_empties_an_instance_then_a_domain_drain_refuses(etcd: Any, prefix: str) -> None:
    async def main() -> None:
        async with fakes("d", {"a": 100, "b": 100}) as fs, etcd_client(etcd.endpoint) as client:
            for k in range(3):
                fs["a"].add(f"r{k}", 5)
            for f in fs.values():
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "d") as sched:
                await asyncio.sleep(0.2)
                assert fs["a"].commands == []  # balanced enough: nothing moves before the drain
                await put_drain(client, prefix, DrainKind.INSTANCE, "a")
                await eventually(lambda: not fs["a"].running, what="a emptied")
                assert sorted(fs["b"].running) == ["r0", "r1", "r2"]
                result = await sched.submit(*_submit("new", 10))
                assert (result.outcome, result.instance_id) == (DispatchOutcome.ACCEPTED, "b")
                await eventually(lambda: _instance_entry(sched, "a") == (True, 0, 0), what="a drained in the summary")
                want = [(True, 0, 0, 100)]  # draining, running, waiting, free blocks

                def entry_a(summary: dict[str, Any]) -> list[tuple[bool, int, int, int]]:
                    briefs = summary["summaries"][0]["instances"]
                    return [
                        (b["draining"], b["num_running"], b["num_waiting"], b["free_blocks"])
                        for b in briefs
                        if b["instance_id"] == "a"
                    ]

                for _ in range(100):  # the publisher is rate-limited: the etcd copy follows within an interval
                    summary = await _published(client, prefix)
                    if entry_a(summary) == want:
                        break
                    await asyncio.sleep(0.05)
                assert entry_a(summary) == want
                await put_drain(client, prefix, DrainKind.DOMAIN, "d")
                await eventually(lambda: sched.state().domain_draining, what="domain drain applied")
                refused = await sched.submit(*_submit("late", 10))
                assert (refused.outcome, refused.reason) == (DispatchOutcome.REFUSED, "all 2 instances are draining")
                await eventually(
                    lambda: sched.publisher.puts > 0 and sched.summaries()[0].draining, what="summary draining"
                )

    asyncio.run(main())


def _instance_entry(sched: DomainScheduler, instance_id: str) -> tuple[bool, int, int]:
    info = next(i for i in sched.state().instances if i.instance_id == instance_id)
    assert info.load is not None
    return info.draining, len(info.load.running), info.load.num_waiting


async def _published(client: Any, prefix: str) -> dict[str, Any]:
    resp = await kv_of(client).get(Keys(prefix).summary("d"))
    out: dict[str, Any] = json.loads(resp.kvs[0].value)
    return out


def test_a_domain_whose_load_streams_all_fail_still_dispatches_evenly(etcd: Any, prefix: str) -> None:
    # issue 11: with every load stream failing while Submit works, every request got UNAVAILABLE
    async def main() -> None:
        async with fakes("d", {"i0": 100, "i1": 100}) as fs, etcd_client(etcd.endpoint) as client:
            for f in fs.values():
                f.fail_watch = True
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "d", ready_timeout_s=1.0) as sched:
                results = [await sched.submit(*_submit(f"r{k}", 10)) for k in range(4)]
                assert [r.outcome for r in results] == [DispatchOutcome.ACCEPTED] * 4
                assert sorted(len(f.submits) for f in fs.values()) == [2, 2]  # spread evenly
                assert sched.state().fallback_dispatches == 4

    asyncio.run(main())


def test_an_idle_instance_excluded_by_one_failed_call_is_readmitted_by_a_heartbeat(etcd: Any, prefix: str) -> None:
    # issue 11: one RPC error excluded an idle instance until its next load report, which never came
    async def main() -> None:
        async with fakes("d", {"i0": 1000, "i1": 100}) as fs, etcd_client(etcd.endpoint) as client:
            for f in fs.values():
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "d") as sched:
                fs["i0"].fail_submits = 1  # one blip on the freer instance
                first = await sched.submit(*_submit("r0", 10))
                assert (first.outcome, first.instance_id) == (DispatchOutcome.ACCEPTED, "i1")
                await eventually(lambda: fs["i0"].pings > 0 and sched.core.answering("i0"), what="i0 re-admitted")
                again = await sched.submit(*_submit("r1", 10))
                assert (again.outcome, again.instance_id) == (DispatchOutcome.ACCEPTED, "i0")

    asyncio.run(main())


def test_a_failed_instance_is_routed_nothing_from_its_next_report_on(etcd: Any, prefix: str) -> None:
    # issue 11: an instance whose engine loop died kept answering load queries and kept receiving work
    async def main() -> None:
        async with fakes("d", {"i0": 1000, "i1": 100}) as fs, etcd_client(etcd.endpoint) as client:
            for f in fs.values():
                await register(client, prefix, f)
            async with scheduler(etcd.endpoint, prefix, "d") as sched:
                assert (await sched.submit(*_submit("r0", 10))).instance_id == "i0"  # the freer one
                # a Submit that races the failure's report: the llumlet refuses it as failed, the next instance
                # takes it, and the instance is excluded from then on
                fs["i0"].failure = "engine step raised RuntimeError: boom"
                raced = await sched.submit(*_submit("r1", 10))
                assert (raced.outcome, raced.instance_id) == (DispatchOutcome.ACCEPTED, "i1")
                assert sched.core.failure("i0") == "engine step raised RuntimeError: boom"
                fs["i0"].bump()  # the report the llumlet pushes when its engine fails
                await eventually(lambda: fs["i0"].version == sched.state().instances[0].load_version, what="report")
                results = [await sched.submit(*_submit(f"r{k}", 10)) for k in range(2, 5)]
                assert {(r.outcome, r.instance_id) for r in results} == {(DispatchOutcome.ACCEPTED, "i1")}
                assert fs["i0"].submits == ["r0"]
                info = next(i for i in sched.state().instances if i.instance_id == "i0")
                assert info.failure == "engine step raised RuntimeError: boom" and not info.connected
                fs["i0"].failure = ""  # restarted: its next report is healthy
                fs["i0"].bump()
                await eventually(lambda: sched.core.failure("i0") == "", what="i0 healthy again")
                assert (await sched.submit(*_submit("r5", 10))).instance_id == "i0"
                request, msg = _submit("r6", 10)  # a request resumed after failing on i0 avoids it
                msg.avoid_instance_ids.append("i0")
                assert (await sched.submit(request, msg)).instance_id == "i1"

    asyncio.run(main())
