"""Resume on failure (issue 11): the pure rule (``gateway.core.plan_resume``), table-driven, and the gateway's
replay of a request whose instance failed (``gateway.cluster.Replayer`` over a real ``GatewaySink``, pushes
fed by hand, the domain choice faked): the client's stream continues with no token repeated or missing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from gateway.cluster import Replayer
from gateway.core import ResumeAction, plan_resume
from gateway.metrics import GatewayMetrics
from gateway.router import DispatchFailed, Placement
from gateway.sink import GatewaySink, TokenUpdate
from gateway.validation import GenerationRequest
from hilum_proto.v1 import llumlet_pb2
from hilum_proto.v1 import token_sink_pb2 as pb
from llumlet.engine.prefix_hash import PrefixCacheConfig, prefix_block_hashes
from llumlet.engine.types import GuidedDecoding, SamplingParams

PROMPT = (5, 6, 7)
OUT = (40, 41, 42, 43)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.mark.parametrize(
    ("sampling", "output", "replays", "max_replays", "action", "words"),
    [
        (GREEDY, OUT, 0, 3, ResumeAction.REPLAY, "replay 4 delivered tokens after the prompt, 6 more to generate"),
        (SamplingParams(max_tokens=10, temperature=0.8), OUT, 2, 3, ResumeAction.REPLAY, "6 more"),  # unseeded
        (SamplingParams(max_tokens=10, temperature=0.0, seed=7), OUT, 0, 3, ResumeAction.REPLAY, "6 more"),
        (SamplingParams(max_tokens=10, repetition_penalty=1.3), OUT, 0, 3, ResumeAction.REPLAY, "6 more"),
        (
            SamplingParams(max_tokens=10, temperature=0.8, seed=7),
            OUT,
            0,
            3,
            ResumeAction.NOT_REPLAYABLE,
            "seeded sampling (seed 7, temperature 0.8) cannot be replayed faithfully: its random generator's "
            "state after 4 tokens was lost with the instance",
        ),
        (SamplingParams(max_tokens=10, temperature=0.8, seed=7), (), 0, 3, ResumeAction.REPLAY, "10 more"),
        (
            SamplingParams(max_tokens=10, guided=GuidedDecoding("regex", "[a-z]+")),
            OUT,
            0,
            3,
            ResumeAction.NOT_REPLAYABLE,
            "structured output (regex) cannot be replayed faithfully",
        ),
        (SamplingParams(max_tokens=10, presence_penalty=0.5), OUT, 0, 3, ResumeAction.NOT_REPLAYABLE, "penalties"),
        (GREEDY, OUT, 3, 3, ResumeAction.LIMIT, "replayed 3 times already (resume.max_replays = 3)"),
        (GREEDY, OUT, 0, 0, ResumeAction.LIMIT, "resuming is off (resume.max_replays = 0)"),
        (GREEDY, tuple(range(10)), 3, 3, ResumeAction.COMPLETE, "all 10 tokens were delivered"),
    ],
)
def test_plan_resume(
    sampling: SamplingParams,
    output: tuple[int, ...],
    replays: int,
    max_replays: int,
    action: ResumeAction,
    words: str,
) -> None:
    plan = plan_resume(
        PROMPT, sampling, output, replays_done=replays, failed_instance_ids=["a0", "b1", "a0"], max_replays=max_replays
    )
    assert plan.action is action and words in plan.reason
    if action is ResumeAction.REPLAY:
        assert plan.prompt_token_ids == PROMPT + output and plan.first_seq == len(output)
        assert plan.sampling is not None and plan.sampling.max_tokens == sampling.max_tokens - len(output)
        assert plan.avoid_instance_ids == ("a0", "b1")
    else:
        assert plan.sampling is None and plan.prompt_token_ids == ()


def test_a_replay_owes_only_the_rest_of_min_tokens() -> None:
    plan = plan_resume(
        PROMPT, SamplingParams(max_tokens=10, min_tokens=6), OUT, replays_done=0, failed_instance_ids=[], max_replays=1
    )
    assert plan.sampling == SamplingParams(max_tokens=6, min_tokens=2)
    with pytest.raises(ValueError, match="need >= 0"):
        plan_resume(PROMPT, GREEDY, OUT, replays_done=-1, failed_instance_ids=[], max_replays=1)


def _request(sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(
        kind="completion",
        model="m",
        prompt_token_ids=PROMPT,
        sampling=sampling,
        priority=0,
        stream=True,
        include_usage=False,
        return_token_ids=False,
        block_size_tokens=4,
    )


@dataclass
class Dispatcher:
    """The domain choice, faked: records every Submit and places request i on ``instances[i]``."""

    instances: list[str]
    sent: list[llumlet_pb2.SubmitRequest] = field(default_factory=list)
    fail_from: int = 99

    async def __call__(self, msg: llumlet_pb2.SubmitRequest, demand: int, need: int, block_size: int) -> Placement:
        assert block_size == 4  # the model's, for the prefix hashes' blocks
        if len(self.sent) >= self.fail_from:
            raise DispatchFailed("no domain accepted the request: d: full", unavailable=False)
        copy = llumlet_pb2.SubmitRequest()
        copy.CopyFrom(msg)
        self.sent.append(copy)
        iid = self.instances[len(self.sent) - 1]
        return Placement("d", iid, f"{iid}:1", "fake", 1)


def push(sink: GatewaySink, rid: str, first: int, ids: list[int], sender: str, finished: bool = False) -> pb.TokenAck:
    return sink._push(
        pb.TokenChunk(
            request_id=rid,
            first_seq=first,
            token_ids=ids,
            epoch=0,
            sender_instance_id=sender,
            sender_address=f"{sender}:1",
            finished=finished,
            finish_reason="length" if finished else "",
        )
    )


async def _consume(replayer: Replayer, rid: str, into: list[TokenUpdate]) -> None:
    async for update in replayer.updates(rid):
        into.append(update)


def test_a_request_whose_instance_died_is_replayed_and_its_stream_continues() -> None:
    async def main() -> None:
        sink, metrics = GatewaySink(poll_s=0.01), GatewayMetrics()
        dispatch = Dispatcher(["a0", "b0", "b1"])
        one_block = PrefixCacheConfig(blocks_per_hash=1)  # a prefix hash per 4-token block
        replayer = Replayer(sink, dispatch, lambda: "gw:1", metrics, max_replays=2, prefix_cache=one_block)
        await replayer.start("c", _request(SamplingParams(max_tokens=10, temperature=0.0)))
        got: list[TokenUpdate] = []
        reader = asyncio.create_task(_consume(replayer, "c", got))
        push(sink, "c", 0, [0, 1, 2], "a0")
        await asyncio.sleep(0.05)
        sink.fail("c", "instance a0 at a0:1 stopped (UNAVAILABLE: Socket closed): the request is lost", resumable=True)
        while len(dispatch.sent) < 2:
            await asyncio.sleep(0.005)
        replay = dispatch.sent[1]
        assert replay.request_id == "c.r1" and replay.first_seq == 3
        assert list(replay.prompt_token_ids) == [5, 6, 7, 0, 1, 2] and replay.sampling.max_tokens == 7
        assert list(replay.avoid_instance_ids) == ["a0"] and replay.origin == "gw:1"
        # the prefix hashes are those of what each Submit's prompt is: none for 3 tokens, one block of the replay's
        assert list(dispatch.sent[0].prefix_block_hashes) == [] and dispatch.sent[0].prefix_hash_block_tokens == 0
        assert tuple(replay.prefix_block_hashes) == prefix_block_hashes([5, 6, 7, 0], 4)
        assert replay.prefix_hash_block_tokens == 4
        assert push(sink, "c", 3, [99], "a0").unknown  # the dead instance, should it come back: dropped
        assert replayer.engine_id("c") == "c.r1" and replayer.address("c") == "b0:1"
        push(sink, "c.r1", 3, [3, 4], "b0")
        await asyncio.sleep(0.05)  # b0 dies too; b1 finishes it
        sink.fail("c.r1", "instance b0 at b0:1 stopped", resumable=True)
        while len(dispatch.sent) < 3:
            await asyncio.sleep(0.005)
        assert dispatch.sent[2].request_id == "c.r2" and list(dispatch.sent[2].avoid_instance_ids) == ["a0", "b0"]
        push(sink, "c.r2", 5, [5, 6, 7, 8, 9], "b1", finished=True)
        await asyncio.wait_for(reader, 5)
        assert [t for u in got for t in u.token_ids] == list(range(10))
        last = got[-1]
        assert last.done and last.finish_reason == "length" and last.error == ""
        assert last.resumes == 2 and last.instance_id == "b1"
        text = metrics.render().decode()
        assert 'hilum_gateway_resumes_total{outcome="replayed"} 2.0' in text
        assert "hilum_gateway_replayed_tokens_total 8.0" in text  # 3 + 5 tokens sent again as prompt
        replayer.finish("c")
        assert push(sink, "c.r2", 10, [1], "b1").unknown

    asyncio.run(main())


@pytest.mark.parametrize("case", ["seeded", "limit", "no_capacity"])
def test_a_request_that_cannot_be_resumed_ends_with_an_error_that_says_why(case: str) -> None:
    async def main() -> None:
        sink, metrics = GatewaySink(poll_s=0.01), GatewayMetrics()
        dispatch = Dispatcher(["a0", "b0"], fail_from=1 if case == "no_capacity" else 99)
        replayer = Replayer(sink, dispatch, lambda: "gw:1", metrics, max_replays=0 if case == "limit" else 3)
        seeded = SamplingParams(max_tokens=10, temperature=0.7, seed=3)
        await replayer.start("c", _request(seeded if case == "seeded" else GREEDY))
        got: list[TokenUpdate] = []
        reader = asyncio.create_task(_consume(replayer, "c", got))
        push(sink, "c", 0, [0, 1], "a0")
        await asyncio.sleep(0.05)
        sink.fail("c", "instance a0 at a0:1 stopped (UNAVAILABLE)", resumable=True)
        await asyncio.wait_for(reader, 5)
        assert [t for u in got for t in u.token_ids] == [0, 1]
        last = got[-1]
        assert last.done and last.finish_reason == "error"
        assert last.error.startswith("instance a0 at a0:1 stopped (UNAVAILABLE); not resumed: ")
        words = {
            "seeded": "seeded sampling (seed 3, temperature 0.7) cannot be replayed faithfully",
            "limit": "resuming is off (resume.max_replays = 0)",
            "no_capacity": "no domain accepted the request: d: full",
        }[case]
        assert words in last.error
        outcome = {"seeded": "not_replayable", "limit": "limit", "no_capacity": "no_capacity"}[case]
        assert f'hilum_gateway_resumes_total{{outcome="{outcome}"}} 1.0' in metrics.render().decode()

    asyncio.run(main())


def test_an_error_of_the_request_itself_is_not_resumed() -> None:
    async def main() -> None:
        sink, metrics = GatewaySink(poll_s=0.01), GatewayMetrics()
        dispatch = Dispatcher(["a0", "b0"])
        replayer = Replayer(sink, dispatch, lambda: "gw:1", metrics, max_replays=3)
        await replayer.start("c", _request(GREEDY))
        got: list[TokenUpdate] = []
        reader = asyncio.create_task(_consume(replayer, "c", got))
        sink.fail("c", "request c: no token for 300 s (owner a0:1)")  # a stall: not the instance's failure
        await asyncio.wait_for(reader, 5)
        assert got[-1].finish_reason == "error" and len(dispatch.sent) == 1

    asyncio.run(main())
