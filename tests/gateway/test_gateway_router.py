"""DomainRouter: the freest domain, reservations spread a burst, refused/unavailable domains are retried
elsewhere, and nothing left is a DispatchFailed naming every domain's reason."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc
import pytest
from gateway_fakes import Source

from clusterstate.clock import ManualClock
from clusterstate.records import DomainRegistration, SummaryRecord
from gateway.router import DispatchFailed, DomainRouter
from hilum_proto.v1 import llumlet_pb2
from hilum_proto.v1 import rack_sched_pb2 as rpb
from policy.domain import DomainSummary
from policy.types import PolicyConfig


def record(
    domain: str,
    used: int,
    capacity: int = 100,
    running: int = 1,
    draining: bool = False,
    taken_s: float = 0.0,
    model: str = "m",
) -> SummaryRecord:
    """A two-instance domain summary with ``used`` of ``capacity`` blocks in use."""
    free = capacity - used
    summary = DomainSummary(
        domain,
        2,
        capacity,
        float(used),
        free / max(1, running),
        free // 2,
        capacity // 2,
        running,
        0,
        draining,
        model=model,
        taken_s=taken_s,
    )
    return SummaryRecord(domain, (summary,))


@dataclass
class Submitter:
    """Answers per domain address: an outcome, or an RPC error code."""

    answers: dict[str, object]
    calls: list[str] = field(default_factory=list)

    async def submit(self, address: str, msg: llumlet_pb2.SubmitRequest, timeout_s: float) -> rpb.DispatchReply:
        self.calls.append(address)
        answer = self.answers[address]
        if isinstance(answer, grpc.StatusCode):
            raise grpc.aio.AioRpcError(answer, grpc.aio.Metadata(), grpc.aio.Metadata(), details="boom")
        assert isinstance(answer, int)
        inst = f"{address}-i0" if answer == rpb.DISPATCH_ACCEPTED else ""
        return rpb.DispatchReply(
            outcome=answer,
            reason=f"{address} says {answer}",
            instance_id=inst,
            instance_address="127.0.0.1:1" if inst else "",
        )


def router(sums: dict[str, SummaryRecord], answers: dict[str, object], **kw: float) -> tuple[DomainRouter, Submitter]:
    regs = {d: DomainRegistration(d, d) for d in sums}  # address = domain id
    sub = Submitter(answers)
    retries: list[str] = []
    r = DomainRouter(
        Source(regs, sums),
        sub,
        PolicyConfig(tie_tolerance=0.0),
        random.Random(1),
        unavailable_wait_s=kw.get("wait", 0.2),
        backoff_s=0.01,
        on_retry=retries.append,
    )
    return r, sub


def msg(priority: int = 0, model: str = "m") -> llumlet_pb2.SubmitRequest:
    return llumlet_pb2.SubmitRequest(request_id="r", prompt_tokens=10, priority=priority, model=model)


def test_picks_the_freest_domain() -> None:
    r, _ = router(
        {"busy": record("busy", 80), "idle": record("idle", 10)},
        {"busy": rpb.DISPATCH_ACCEPTED, "idle": rpb.DISPATCH_ACCEPTED},
    )
    place = asyncio.run(r.dispatch(msg(), demand_blocks=5))
    assert (place.domain_id, place.instance_id, place.tries) == ("idle", "idle-i0", 1)


def test_reservations_spread_a_burst_until_the_next_summary() -> None:
    # equal domains; without reservations every pick would see the same freeness
    r, _ = router(
        {"a": record("a", 0, running=0), "b": record("b", 0, running=0)},
        {"a": rpb.DISPATCH_ACCEPTED, "b": rpb.DISPATCH_ACCEPTED},
    )

    async def burst() -> list[str]:
        return [(await r.dispatch(msg(), demand_blocks=10)).domain_id for _ in range(6)]

    picks = asyncio.run(burst())
    assert sorted(picks) == ["a", "a", "a", "b", "b", "b"]


def test_reservations_expire_when_no_summary_comes() -> None:
    # short requests never change a domain's published summary: old reservations must not pile up
    clock = ManualClock(start_s=1.0, wall_offset_s=0.0)  # the summaries were taken at 0
    regs = {d: DomainRegistration(d, d) for d in ("a", "b")}
    r = DomainRouter(
        Source(regs, {"a": record("a", 0, running=0), "b": record("b", 10, running=0)}),
        Submitter({"a": rpb.DISPATCH_ACCEPTED, "b": rpb.DISPATCH_ACCEPTED}),
        PolicyConfig(tie_tolerance=0.0),
        random.Random(1),
        clock=clock,
    )

    async def main() -> list[str]:
        picks = [(await r.dispatch(msg(), demand_blocks=20)).domain_id for _ in range(2)]  # a is freer, then b
        await clock.advance(5.0)  # both reservations are older than reservation_ttl_s: a is the freer again
        return [*picks, (await r.dispatch(msg(), demand_blocks=20)).domain_id]

    assert asyncio.run(main()) == ["a", "b", "a"]


def test_a_lagged_summary_keeps_the_reservations_made_after_it_was_taken() -> None:
    # issue 10: the live gateway dropped its picks on every new summary, so a summary that missed in-flight
    # requests sent the next burst to the same domain. A summary keeps what was dispatched after its taken_s.
    clock = ManualClock(wall_offset_s=0.0)
    source = Source({d: DomainRegistration(d, d) for d in ("a", "b")}, {"a": record("a", 0), "b": record("b", 5)})
    r = DomainRouter(
        source,
        Submitter({"a": rpb.DISPATCH_ACCEPTED, "b": rpb.DISPATCH_ACCEPTED}),
        PolicyConfig(tie_tolerance=0.0),
        random.Random(1),
        clock=clock,
        reservation_ttl_s=10.0,
    )

    async def main() -> list[str]:
        await clock.advance(1.0)
        first = (await r.dispatch(msg(), demand_blocks=30)).domain_id  # a (freer), stamped t = 1
        # a summary of a taken at t = 0.5 (before that pick) arrives: it does not count the pick
        source.sums = {**source.sums, "a": record("a", 1, taken_s=0.5)}
        source.version += 1
        second = (await r.dispatch(msg(), demand_blocks=30)).domain_id
        # a summary taken at t = 1.5 (after the pick: it counts it) replaces the reservation
        source.sums = {**source.sums, "a": record("a", 1, taken_s=1.5)}
        source.version += 1
        await clock.advance(1.0)
        third = (await r.dispatch(msg(), demand_blocks=1)).domain_id
        return [first, second, third]

    assert asyncio.run(main()) == ["a", "b", "a"]


def test_only_domains_serving_the_model_are_tried() -> None:
    # issue 11: requests for one model were served by another model's instances
    r, sub = router(
        {"x": record("x", 0, model="llama-2-7b"), "y": record("y", 50, model="llama-2-13b")},
        {"x": rpb.DISPATCH_ACCEPTED, "y": rpb.DISPATCH_ACCEPTED},
    )
    place = asyncio.run(r.dispatch(msg(model="llama-2-13b"), demand_blocks=5))
    assert place.domain_id == "y" and sub.calls == ["y"]
    with pytest.raises(DispatchFailed, match=r"model 'llama-3' is not served \(served: llama-2-13b, llama-2-7b\)"):
        asyncio.run(r.dispatch(msg(model="llama-3"), demand_blocks=5))


def test_refused_domain_is_skipped_for_the_next() -> None:
    r, sub = router(
        {"a": record("a", 0), "b": record("b", 50)}, {"a": rpb.DISPATCH_REFUSED, "b": rpb.DISPATCH_ACCEPTED}
    )
    place = asyncio.run(r.dispatch(msg(), demand_blocks=5))
    assert place.domain_id == "b" and sub.calls == ["a", "b"] and r.retries == {"refused": 1}


def test_unavailable_domains_are_retried_then_fail_with_every_reason() -> None:
    r, sub = router(
        {"a": record("a", 0), "b": record("b", 50)},
        {"a": rpb.DISPATCH_UNAVAILABLE, "b": grpc.StatusCode.UNAVAILABLE},
        wait=0.1,
    )
    with pytest.raises(DispatchFailed) as info:
        asyncio.run(r.dispatch(msg(), demand_blocks=5))
    assert info.value.unavailable
    assert (
        "a: a says 3" in info.value.message
        and "b: scheduler at b did not answer (UNAVAILABLE: boom)" in info.value.message
    )
    assert sub.calls[:2] == ["a", "b"] and len(sub.calls) > 2  # tried again after a backoff


def test_a_scheduler_that_did_not_answer_is_tried_after_the_others_until_it_shows_life() -> None:
    # a frozen scheduler (SIGSTOP) cost every request picked for it the whole Submit deadline before the next
    # domain was tried: on two domains, half of the new requests waited 7.7 s while the other domain was idle
    clock = ManualClock(wall_offset_s=0.0)
    source = Source({d: DomainRegistration(d, d) for d in ("a", "b")}, {"a": record("a", 0), "b": record("b", 50)})
    sub = Submitter({"a": grpc.StatusCode.DEADLINE_EXCEEDED, "b": rpb.DISPATCH_ACCEPTED})
    r = DomainRouter(
        source, sub, PolicyConfig(tie_tolerance=0.0), random.Random(1), clock=clock, unavailable_wait_s=5.0
    )

    async def main() -> list[tuple[str, int]]:
        placed = [await r.dispatch(msg(), demand_blocks=5)]  # a is the freer: tried, silent, then b
        placed.append(await r.dispatch(msg(), demand_blocks=5))  # a is tried after b: b takes it at once
        source.sums = {**source.sums, "a": record("a", 0, taken_s=1.0)}  # a publishes again: it runs
        source.version += 1
        sub.answers["a"] = rpb.DISPATCH_ACCEPTED
        placed.append(await r.dispatch(msg(), demand_blocks=5))
        sub.answers["a"] = grpc.StatusCode.UNAVAILABLE  # silent again, with no new summary: held for 5 s
        placed.append(await r.dispatch(msg(), demand_blocks=5))
        placed.append(await r.dispatch(msg(), demand_blocks=5))
        await clock.advance(5.0)
        placed.append(await r.dispatch(msg(), demand_blocks=5))  # the hold has lapsed: a is asked first again
        return [(p.domain_id, p.tries) for p in placed]

    assert asyncio.run(main()) == [("b", 2), ("b", 1), ("a", 1), ("b", 2), ("b", 1), ("b", 2)]
    assert sub.calls == ["a", "b", "b", "a", "a", "b", "b", "a", "b"]


def test_draining_everywhere_is_refused_at_once() -> None:
    r, sub = router({"a": record("a", 0, draining=True)}, {"a": rpb.DISPATCH_ACCEPTED})
    with pytest.raises(DispatchFailed, match="the only domain is draining"):
        asyncio.run(r.dispatch(msg(), demand_blocks=5))
    assert sub.calls == []


def test_invalid_argument_is_not_retried() -> None:
    r, sub = router(
        {"a": record("a", 0), "b": record("b", 0)},
        {"a": grpc.StatusCode.INVALID_ARGUMENT, "b": grpc.StatusCode.INVALID_ARGUMENT},
    )
    with pytest.raises(DispatchFailed, match="rejected the request: boom"):
        asyncio.run(r.dispatch(msg(), demand_blocks=5))
    assert len(sub.calls) == 1


def test_a_domain_holding_the_prompts_prefix_wins_within_the_margin() -> None:
    """The Submit's prefix hashes (the gateway's, llumlet.engine.prefix_hash) reach the domain choice: the domain
    whose summary lists them wins while it is within policy.prefix_affinity_margin of the freest; without the
    model's block size they take no part (as before)."""
    import dataclasses

    from llumlet.engine.prefix_hash import prefix_block_hashes

    prompt = list(range(200, 330))  # 130 tokens: two 64-token hash blocks
    hashes = prefix_block_hashes(prompt, 64)
    sums = {"idle": record("idle", 10), "warm": record("warm", 30)}
    warm = sums["warm"].summaries[0]
    sums["warm"] = SummaryRecord("warm", (dataclasses.replace(warm, prefix_hashes=frozenset(hashes)),))
    answers: dict[str, object] = {"idle": rpb.DISPATCH_ACCEPTED, "warm": rpb.DISPATCH_ACCEPTED}
    m = llumlet_pb2.SubmitRequest(
        request_id="r", prompt_token_ids=prompt, model="m", prefix_block_hashes=hashes, prefix_hash_block_tokens=64
    )
    r, _ = router(sums, answers)
    assert asyncio.run(r.dispatch(m, demand_blocks=9, block_size_tokens=16)).domain_id == "warm"
    r, _ = router(sums, answers)
    assert asyncio.run(r.dispatch(m, demand_blocks=9)).domain_id == "idle"  # no block size: load alone
    far = {**sums, "warm": SummaryRecord("warm", (dataclasses.replace(sums["warm"].summaries[0], freeness=10.0,
                                                                       virtual_usage=90.0),))}  # fmt: skip
    r, _ = router(far, answers)
    assert asyncio.run(r.dispatch(m, demand_blocks=9, block_size_tokens=16)).domain_id == "idle"  # load wins


def test_health_says_whether_no_domain_is_dispatchable_yet_or_any_more() -> None:
    source = Source({}, {})
    r = DomainRouter(source, Submitter({}), PolicyConfig(), random.Random(1))
    assert r.health() == (False, "no domain scheduler has registered and published a summary yet")
    source.regs, source.sums, source.version = {"a": DomainRegistration("a", "a")}, {}, 2
    assert r.health() == (False, "no domain scheduler has registered and published a summary yet")  # no summary
    source.sums, source.version = {"a": record("a", 10)}, 3
    assert r.health() == (True, "1 domain(s): a")
    # a domain of the topology without a scheduler: still serving, and named
    assert r.health(expected=["a", "b", "c"]) == (True, "1 domain(s): a; not registered: b, c")
    # every instance of a drained: it refuses every Submit, so the gateway can place nothing
    source.regs["b"] = DomainRegistration("b", "b")
    source.sums, source.version = {"a": record("a", 10, draining=True), "b": record("b", 10)}, 5
    assert r.health() == (True, "2 domain(s): a, b; draining: a")
    source.sums, source.version = {"a": record("a", 10, draining=True), "b": record("b", 10, draining=True)}, 6
    assert r.health() == (
        False,
        "every domain drains (a, b): no instance takes new requests until a drain is undone (hilumctl undrain) or "
        "an instance joins",
    )
    source.sums, source.version = {"a": record("a", 10)}, 7
    assert r.health() == (True, "1 domain(s): a")
    del source.regs["b"]
    source.regs, source.sums, source.version = {}, {}, 4  # its scheduler stopped: registration and summary gone
    assert r.health() == (
        False,
        "no domain scheduler is registered with a summary now (those that were have stopped, or lost etcd): "
        "check the domain schedulers",
    )
