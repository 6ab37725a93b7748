"""The llumlet's gRPC service with the sim backend (in-process servers on loopback): submit, token pushes,
abort, load reports, the origin going away, and the CLI's configuration errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.backends import BackendConfig
from llumlet.cli import main as cli_main
from llumlet.engine.types import SamplingParams
from llumlet.sink import TokenCollector
from llumlet.testing import RunningLlumlet, start_llumlet


def run(body: Callable[[TokenCollector, RunningLlumlet], Awaitable[None]], num_blocks: int = 64) -> None:
    async def main() -> None:
        col = TokenCollector()
        await col.start()
        node = await start_llumlet(
            "i0", backend=BackendConfig(instance_id="i0", num_blocks=num_blocks, block_size_tokens=16, time_scale=0.1)
        )
        try:
            await asyncio.wait_for(body(col, node), 15)
        finally:
            await node.stop()
            await col.stop()

    asyncio.run(main())


async def settle(node: RunningLlumlet, timeout_s: float = 3.0) -> pb.LoadReport:
    """The load once no request is left."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        load = await node.client.get_load()
        if load.num_requests == 0 or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.01)


def test_tokens_are_pushed_numbered_and_blocks_return() -> None:
    async def body(col: TokenCollector, node: RunningLlumlet) -> None:
        ping = await node.client.ping()
        assert (ping.instance_id, ping.engine, ping.block_size_tokens) == ("i0", "sim", 16)
        col.expect("r", node.address)
        reply = await node.client.submit("r", col.address, SamplingParams(max_tokens=40), prompt_tokens=50)
        assert reply.accepted
        got = await col.wait("r", 10)
        # the sim backend numbers tokens by position: the stream is 0, 1, ..., 39, each exactly once
        assert got.token_ids == tuple(range(40)) and got.finish_reason == "length" and got.error == ""
        assert got.conflicts == 0
        load = await settle(node)
        assert (load.total_blocks, load.used_blocks, load.reserved_blocks, load.num_requests) == (64, 0, 0, 0)

    run(body)


def test_a_modelled_steps_tokens_come_at_its_end() -> None:
    """The sim engine pushed a step's tokens when the step began, then slept its modelled time: a long prompt's
    first token came in milliseconds and its prefill after it (a live TTFT without the prefill)."""

    async def main() -> None:
        col = TokenCollector()
        await col.start()
        cfg = BackendConfig(instance_id="i0", num_blocks=512, block_size_tokens=16, time_scale=1.0)
        node = await start_llumlet("i0", backend=cfg)
        try:
            prefill_s = node.llumlet.engine.latency_model.step_time_s([(3000, 0)], [])
            decode_s = node.llumlet.engine.latency_model.step_time_s([], [3001])
            assert prefill_s > 0.1 and prefill_s > 5 * decode_s  # a step long enough to tell the two apart
            col.expect("r", node.address)
            loop = asyncio.get_running_loop()
            start = loop.time()
            assert (
                await node.client.submit("r", col.address, SamplingParams(max_tokens=3), prompt_tokens=3000)
            ).accepted
            arrived: list[float] = []  # when the stream held its 1st, 2nd, 3rd token
            while len(arrived) < 3:
                arrived += [loop.time() - start] * (len(col.get("r").token_ids) - len(arrived))
                await asyncio.sleep(0.002)
            # the first token after the prefill step (it was at about 0.01 s), the second one decode step later
            assert arrived[0] >= 0.95 * prefill_s, (arrived, prefill_s)
            assert arrived[1] - arrived[0] < prefill_s / 2, (arrived, prefill_s)
        finally:
            await node.stop()
            await col.stop()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_submit_errors_are_clear() -> None:
    async def body(col: TokenCollector, node: RunningLlumlet) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await node.client.submit("r", "", SamplingParams(max_tokens=4), prompt_tokens=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "origin is empty" in (err.value.details() or "")
        too_big = await node.client.submit("big", col.address, SamplingParams(max_tokens=10), prompt_tokens=2000)
        assert not too_big.accepted and "needs 2009 KV tokens, the cache holds 1024" in too_big.reason
        col.expect("r", node.address)
        assert (await node.client.submit("r", col.address, SamplingParams(max_tokens=300), prompt_tokens=5)).accepted
        again = await node.client.submit("r", col.address, SamplingParams(max_tokens=3), prompt_tokens=5)
        assert not again.accepted and "already here" in again.reason
        lp = await node.client.submit("lp", col.address, SamplingParams(max_tokens=3, logprobs=2), prompt_tokens=5)
        assert not lp.accepted
        assert lp.reason == (
            "i0: request 'lp': the sim engine does not honour logprobs (it honours: min_tokens, penalties, top_k)"
        )
        await node.client.abort("r")

    run(body)


def test_abort_ends_the_stream_and_frees_blocks() -> None:
    async def body(col: TokenCollector, node: RunningLlumlet) -> None:
        col.expect("r", node.address)
        await node.client.submit("r", col.address, SamplingParams(max_tokens=500), prompt_tokens=100)
        while len(col.get("r").token_ids) < 3:
            await asyncio.sleep(0.005)
        reply = await node.client.abort("r")
        assert reply.found and reply.forwarded_to == ""
        got = await col.wait("r", 5)
        n = len(got.token_ids)
        assert got.finish_reason == "abort" and got.token_ids == tuple(range(n)) and 3 <= n < 500
        assert not (await node.client.abort("r")).found
        load = await settle(node)
        assert (load.used_blocks, load.num_requests) == (0, 0)

    run(body)


def test_a_request_the_origin_forgot_is_dropped() -> None:
    async def body(col: TokenCollector, node: RunningLlumlet) -> None:
        col.expect("r", node.address)
        await node.client.submit("r", col.address, SamplingParams(max_tokens=500), prompt_tokens=100)
        while len(col.get("r").token_ids) < 2:
            await asyncio.sleep(0.005)
        col.forget("r")  # the client went away: the next push is answered "unknown"
        load = await settle(node)
        assert (load.used_blocks, load.num_requests) == (0, 0)

    run(body)


def test_watch_load_reports_changes() -> None:
    async def body(col: TokenCollector, node: RunningLlumlet) -> None:
        reports = node.client.watch_load(min_interval_s=0.001)
        first = await anext(reports)
        assert (first.instance_id, first.num_requests, first.used_blocks) == ("i0", 0, 0)
        col.expect("r", node.address)
        await node.client.submit("r", col.address, SamplingParams(max_tokens=400), prompt_tokens=40)
        seen = first
        while seen.used_blocks == 0:
            seen = await anext(reports)
        assert seen.num_requests == 1 and seen.version > first.version and seen.used_blocks >= 3
        await node.client.abort("r")
        while seen.used_blocks:
            seen = await anext(reports)
        await reports.aclose()

    run(body)


def test_cli_rejects_an_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--instance-id", "x", "--engine", "trtllm"]) == 2
    assert "unknown engine backend 'trtllm'; known: sim, torch, vllm" in capsys.readouterr().err
    assert cli_main(["--instance-id", "x", "--topology", "1x8-a100"]) == 2
    assert "'x'" in capsys.readouterr().err
