"""The domain's decision core, driven with hand-built load reports: no I/O, no clock, no sleeps."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest

from policy.domain import DomainSummary
from policy.load import InstanceLoad, RequestLoad
from policy.remaining import RemainingConfig
from policy.types import PolicyConfig
from rack_sched.core import DomainConfig, DomainCore, DomainRequest

BS = 16


def core(cfg: DomainConfig | None = None, **members: str) -> DomainCore:
    c = DomainCore("d", cfg or DomainConfig(), random.Random(0))
    for iid, model in members.items():
        c.add_instance(iid, model, BS)
    return c


def load(iid: str, capacity: int, *blocks: int, step_s: float = 0.0, **kw: object) -> InstanceLoad:
    running = tuple(
        RequestLoad(f"{iid}-r{k}", b, num_tokens=b * BS, output_tokens=10, max_tokens=500, max_blocks=b + 32)
        for k, b in enumerate(blocks)
    )
    return InstanceLoad(iid, capacity, sum(blocks), running, domain_id="d", decode_step_s=step_s, **kw)  # type: ignore[arg-type]


def test_dispatch_reaches_only_instances_of_the_model_and_refuses_others_by_name() -> None:
    c = core(a="llama-2-7b", b="llama-2-13b")
    c.report("a", load("a", 1000))
    c.report("b", load("b", 1000))
    assert c.dispatch(DomainRequest("r1", "llama-2-13b", 100, 50)).target_id == "b"
    assert c.dispatch(DomainRequest("r2", "llama-2-7b", 100, 50)).target_id == "a"
    refused = c.dispatch(DomainRequest("r3", "llama-3", 100, 50))
    assert refused.target_id is None
    assert refused.reason == "domain d serves llama-2-13b, llama-2-7b, not model 'llama-3'"
    # a request naming no model: only a domain with one model can take it
    assert "a request that names no model" in (c.dispatch(DomainRequest("r4", "", 10, 5)).reason)
    one = core(a="m")
    one.report("a", load("a", 100))
    assert one.dispatch(DomainRequest("r5", "", 10, 5)).target_id == "a"


def test_dispatch_uses_the_instance_that_can_hold_what_the_request_grows_to() -> None:
    # issue 11: the freer 100-block instance cannot hold a request that may grow to 100 + 3000 tokens
    c = core(big="m", small="m")
    c.report("big", load("big", 1000, 900))
    c.report("small", load("small", 100))
    assert c.dispatch(DomainRequest("short", "m", 100, 10)).target_id == "small"
    assert c.dispatch(DomainRequest("long", "m", 100, 3000)).target_id == "big"  # needs 194 blocks
    refused = c.dispatch(DomainRequest("huge", "m", 100, 16000))
    assert refused.target_id is None and "can hold 1000 blocks" in refused.reason


def test_a_prompt_that_fills_an_instance_exactly_fits_it_with_one_output_token() -> None:
    """Its one token is sampled from the prefill, never stored: the engine serves 2,048 + 1 tokens in 128 blocks. The
    domain counted a slot for it (129 blocks) and refused it as one no instance could ever hold, after the gateway,
    which counts as the engine does, had let it through (a 503 where a 400 or a reply was due)."""
    c = core(a="m")
    c.report("a", load("a", 128))
    assert c.dispatch(DomainRequest("one", "m", 128 * BS, 1)).target_id == "a"
    c.report("a", load("a", 128))
    refused = c.dispatch(DomainRequest("two", "m", 128 * BS, 2))  # its second token is stored: 2,049 tokens
    assert refused.target_id is None
    assert refused.reason == (
        "request needs 129 blocks but the largest non-draining instance can hold 128 blocks; no instance can ever "
        "hold it"
    )


def test_an_unanswered_instance_takes_nothing_until_its_next_report() -> None:
    c = core(a="m", b="m")
    c.report("a", load("a", 1000))
    c.report("b", load("b", 1000, 500))
    c.unreachable("a")
    assert c.dispatch(DomainRequest("r", "m", 10, 5)).target_id == "b"
    assert (
        c.dispatch(DomainRequest("r2", "m", 10, 5), exclude={"b"}).reason
        == "every instance that is not draining was tried"
    )
    c.report("a", load("a", 1000))
    assert c.dispatch(DomainRequest("r3", "m", 10, 5)).target_id == "a"


def test_busy_instances_take_no_second_move_until_they_report_or_settle() -> None:
    c = core(DomainConfig(settle_s=0.2), a="m", b="m")
    c.report("a", load("a", 100, 24, 24, 24, 24))  # F = 4 / 4 < 3: a source
    c.report("b", load("b", 100))
    (move,) = c.plan_rebalance(now_s=0.0)
    assert (move.src_id, move.dst_id) == ("a", "b")
    assert c.plan_rebalance(now_s=0.01) == []  # both busy while the move runs
    c.migration_done(("a", "b"), now_s=0.05)
    assert c.plan_rebalance(now_s=0.1) == []  # settling: their reports still show the old state
    c.report("a", load("a", 100, 24, 24, 24, 24))
    c.report("b", load("b", 100))
    assert len(c.plan_rebalance(now_s=0.1)) == 1  # fresh reports end the settle window
    c.migration_done(("a", "b"), now_s=0.2)
    assert c.plan_rebalance(now_s=0.3) == []
    assert len(c.plan_rebalance(now_s=0.41)) == 1  # or settle_s passes
    assert c.migrations_in_flight == 1


def test_settled_while_no_move_is_in_flight_or_settling() -> None:
    c = core(DomainConfig(settle_s=0.2), a="m", b="m")
    c.report("a", load("a", 100, 24, 24, 24, 24))
    c.report("b", load("b", 100))
    assert c.settled()
    (move,) = c.plan_rebalance(now_s=0.0)
    assert not c.settled()  # in flight
    c.migration_done((move.src_id, move.dst_id), now_s=0.05)
    assert not c.settled()  # settling
    c.report("a", load("a", 100, 24, 24, 24))  # the move's effect reported: F = 28 / 3, no source
    c.report("b", load("b", 100, 24))
    assert not c.settled()  # until a round sees the reports
    assert c.plan_rebalance(now_s=0.1) == []
    assert c.settled()


def test_finished_lengths_teach_the_estimate_as_a_report_carrying_them() -> None:
    cfg = DomainConfig(remaining=RemainingConfig(min_samples=2))
    by_report, alone = core(cfg, a="m"), core(cfg, a="m")
    by_report.report("a", load("a", 1000, 300), finished_output_tokens=[110, 150, 5])
    alone.finished([110, 150, 5])
    alone.report("a", load("a", 1000, 300))
    assert by_report.remaining.estimate(10, 500) == alone.remaining.estimate(10, 500) == 120


def _summary(domain_id: str, free: int) -> DomainSummary:
    return DomainSummary(domain_id, 1, 1000, 1000.0 - free, float(free), free, 1000, 1, 0, False, model="m")


def test_cross_domain_proposal_estimates_remaining_output_and_cools_down() -> None:
    cfg = DomainConfig(cool_down_s=2.5, remaining=RemainingConfig(min_samples=2))
    c = core(cfg, a="m")
    c.report("a", load("a", 1000, 300, 300, 396, step_s=0.031))  # F = 4 / 3: the domain is a source
    move = c.plan_cross_domain([_summary("e", 900)], now_s=0.0)
    assert move is not None and move.dst_domain_id == "e" and move.model == "m"
    assert move.decode_step_s == 0.031  # the source's measured step time, not a constant
    assert move.remaining_tokens == 490  # max_tokens 500 - 10 generated: nothing finished yet
    assert move.max_blocks == move.blocks + 32
    c.not_approved(move.request_id, now_s=0.0)
    again = c.plan_cross_domain([_summary("e", 900)], now_s=1.0)
    assert again is not None and again.request_id != move.request_id  # the first one cools down
    # finished requests teach the estimate: those that outlived 10 tokens ran 100 and 140 more on average
    c.report("a", load("a", 1000, 300, 300, 396, step_s=0.031), finished_output_tokens=[110, 150, 5])
    later = c.plan_cross_domain([_summary("e", 900)], now_s=3.0)
    assert later is not None and later.request_id == move.request_id  # cool-down over
    assert later.remaining_tokens == 120  # min(490, mean residual (100 + 140) / 2)


def test_one_cross_domain_move_of_a_domain_at_a_time() -> None:
    # the live domain scheduler's loop carries its proposals out one by one; the simulator asks the core the
    # same, so a round that comes while a move is in flight proposes nothing there either
    c = core(DomainConfig(settle_s=0.2), a="m", b="m")
    c.report("a", load("a", 1000, 300, 300, 396))  # both instances sources: the domain is one
    c.report("b", load("b", 1000, 300, 300, 396))
    move = c.plan_cross_domain([_summary("e", 900)], now_s=0.0)
    assert move is not None
    c.cross_domain_started(move)
    assert c.migrations_in_flight == 1 and c.is_busy(move.src_instance_id, 0.0)
    assert c.plan_cross_domain([_summary("e", 900)], now_s=0.6) is None  # the other instance is free, yet none
    c.cross_domain_done(move, now_s=0.7)
    assert c.migrations_in_flight == 0
    again = c.plan_cross_domain([_summary("e", 900)], now_s=0.7)
    assert again is not None and again.src_instance_id != move.src_instance_id  # the source still settles
    c.cross_domain_started(again)
    c.cross_domain_done(again, now_s=0.8)  # refused, committed or aborted: the domain may propose again
    assert c.plan_cross_domain([_summary("e", 900)], now_s=1.0) is not None


def test_no_proposal_without_a_destination_domain_of_the_model() -> None:
    c = core(a="m")
    c.report("a", load("a", 1000, 300, 300, 396))
    other_model = DomainSummary("e", 1, 1000, 0.0, 1000.0, 1000, 1000, 0, 0, False, model="other")
    assert c.plan_cross_domain([other_model], now_s=0.0) is None
    assert c.plan_cross_domain([], now_s=0.0) is None


def test_a_domain_that_is_no_source_reads_no_other_summary() -> None:
    """The others' summaries are read only when this domain is a source (at 4,096 instances every domain's
    round would otherwise read the 511 others')."""
    reads = [0]

    def others() -> Iterator[DomainSummary]:
        reads[0] += 1
        yield _summary("e", 900)

    c = core(a="m")
    c.report("a", load("a", 1000, 100))  # F = 900: no source
    assert c.plan_cross_domain(others(), now_s=0.0) is None and reads[0] == 0
    c.report("a", load("a", 1000, 300, 300, 396))  # F = 4 / 3: a source
    assert c.plan_cross_domain(others(), now_s=0.0) is not None and reads[0] == 1


def test_members_and_models_follow_registrations_in_id_order() -> None:
    """The core keeps its members sorted and its models listed between registrations: both follow every one."""
    c = core(b="m", d="m")
    for iid in ("b", "d"):
        c.report(iid, load(iid, 100))
    assert [x.instance_id for x in c.loads()] == ["b", "d"] and c.models() == ["m"]
    c.add_instance("a", "x", BS)
    c.add_instance("c", "m", BS)
    c.report("a", load("a", 100))
    c.report("c", load("c", 100))
    assert [x.instance_id for x in c.loads()] == ["a", "b", "c", "d"] and c.models() == ["m", "x"]
    assert [x.instance_id for x in c.free_loads(0.0, "m")] == ["b", "c", "d"]
    c.remove_instance("b")
    c.remove_instance("a")
    assert [x.instance_id for x in c.loads()] == ["c", "d"] and c.models() == ["m"]
    c.models().append("not kept")  # a copy: the core's own list does not change
    assert c.models() == ["m"]


def test_one_summary_per_model_stamped_with_the_publishers_time() -> None:
    c = core(a="x", b="y", c="y")
    for iid in ("a", "b", "c"):
        c.report(iid, load(iid, 100, 10))
    c.set_drains({"c"}, False)
    sx, sy = c.summaries(taken_s=42.0)
    assert (sx.model, sx.num_instances, sy.model, sy.num_instances) == ("x", 1, "y", 2)
    assert sx.taken_s == sy.taken_s == 42.0
    assert [b.instance_id for b in sy.instances] == ["b", "c"] and sy.instances[1].draining
    assert c.dispatch(DomainRequest("r", "y", 10, 5)).target_id == "b"  # c drains


def test_bad_requests_are_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="need a request id, prompt_tokens >= 0, max_tokens >= 1"):
        DomainRequest("r", "m", 10, 0)
    with pytest.raises(ValueError, match="block_size_tokens must be >= 1"):
        core().add_instance("a", "m", 0)
    with pytest.raises(ValueError, match=r"DomainConfig\.settle_s: must be a finite number >= 0, got -1"):
        DomainConfig(settle_s=-1)
    assert DomainRequest("r", "m", 16, 17).demand_blocks(16) == 2
    assert DomainRequest("r", "m", 16, 17).need_blocks(16) == 2  # 16 + 17 - 1 = 32 tokens
    assert PolicyConfig() == DomainConfig().policy


def test_stale_streams_are_deprioritised_and_all_stale_spreads_evenly() -> None:
    c = core(a="m", b="m", c="m")
    for iid in ("a", "b", "c"):
        c.report(iid, load(iid, 1000, 100 if iid == "c" else 0))
    c.stream_lost("a")
    assert c.dispatch(DomainRequest("r0", "m", 10, 5)).target_id == "b"  # fresh ones first (b freer than c)
    c.stream_lost("b")
    c.stream_lost("c")
    picks = [c.dispatch(DomainRequest(f"r{k}", "m", 10, 5)).target_id for k in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"] and c.fallback_dispatches == 6
    c.unreachable("b")  # a failed Submit: not even the spread uses it
    assert {c.dispatch(DomainRequest(f"s{k}", "m", 10, 5)).target_id for k in range(4)} == {"a", "c"}
    c.report("c", load("c", 1000, 100))  # c's stream is back: it alone is fresh
    assert c.dispatch(DomainRequest("t", "m", 10, 5)).target_id == "c"


def test_an_unanswered_instance_comes_back_with_an_answer_not_only_a_report() -> None:
    c = core(a="m", b="m")
    c.report("a", load("a", 1000))
    c.report("b", load("b", 1000, 500))
    c.unreachable("a")
    assert c.dispatch(DomainRequest("r", "m", 10, 5)).target_id == "b"
    assert not c.answering("a")
    c.answered("a")  # a heartbeat got an answer; a is idle and sends no report
    assert c.answering("a") and c.dispatch(DomainRequest("r2", "m", 10, 5)).target_id == "a"


def test_a_failed_instance_takes_nothing_and_is_in_no_move_or_summary_until_a_healthy_report() -> None:
    c = core(a="m", b="m", f="m")
    c.report("a", load("a", 100, 24, 24, 24, 24))  # F = 4 / 4 < 3: a source
    c.report("b", load("b", 100, 60))
    c.report("f", load("f", 1000))  # the freest by far
    assert c.dispatch(DomainRequest("r0", "m", 10, 5)).target_id == "f"
    c.engine_failed("f", "engine step raised RuntimeError: boom")
    assert c.failure("f") == "engine step raised RuntimeError: boom" and not c.reachable("f")
    assert {c.dispatch(DomainRequest(f"r{k}", "m", 10, 5)).target_id for k in range(1, 5)} == {"b"}
    assert [(m.src_id, m.dst_id) for m in c.plan_rebalance(now_s=0.0)] == [("a", "b")]  # not to f
    assert [s.capacity_blocks for s in c.summaries(1.0)] == [200]  # f's 1000 blocks are not offered
    c.answered("f")  # answering a heartbeat does not make it healthy
    assert c.dispatch(DomainRequest("r5", "m", 10, 5)).target_id != "f"
    c.engine_failed("a", "x")
    c.engine_failed("b", "y")
    refused = c.dispatch(DomainRequest("r6", "m", 10, 5))
    assert refused.target_id is None and refused.reason.startswith("every instance of m here failed (a: x; b: y; f:")
    c.report("f", load("f", 1000))  # restarted: a healthy report
    assert c.failure("f") == "" and c.dispatch(DomainRequest("r7", "m", 10, 5)).target_id == "f"


def test_a_queue_behind_full_batch_slots_is_moved_for_over_the_live_load_reports() -> None:
    # issue 15 end to end, as a domain scheduler sees it: engine a runs 4 of 4 slots of high-priority decodes
    # with 980 free blocks; a fifth high-priority request waits there (equal classes never preempt each
    # other), b is empty. a is no source by memory (F = (1000 − 20 − 4 x 128 headroom − 4 queued) / 4 = 116,
    # not preempting); with the slot limit in the reports (hilum.v1.LoadReport.max_num_seqs, field 20) the
    # domain moves one of a's decodes to b, which gives h4 a slot
    from llumlet.convert import load_to_pb
    from llumlet.engine import EngineCore, EngineRequest
    from rack_sched.convert import load_from_pb
    from tests.llumlet.test_engine_core import flat_model

    def engine(iid: str) -> EngineCore:
        return EngineCore(iid, num_blocks=1000, block_size_tokens=BS, latency_model=flat_model(), max_num_seqs=4)

    a, b = engine("a"), engine("b")
    for i in range(4):
        a.add_request(EngineRequest(f"h{i}", prompt_tokens=64, max_tokens=500, priority=1, arrival_s=float(i)))
    for _ in range(3):
        a.step()
    a.add_request(EngineRequest("h4", prompt_tokens=64, max_tokens=50, priority=1, arrival_s=10.0))
    assert a.step().preempted == ()
    c = core(a="m", b="m")
    reports = {iid: load_from_pb(load_to_pb(e.load(), iid, "d"), iid, "d") for iid, e in (("a", a), ("b", b))}
    ra = reports["a"]
    assert (ra.max_num_seqs, len(ra.running), ra.num_waiting, ra.free_blocks, ra.preempting) == (4, 4, 1, 980, False)
    for iid, report in reports.items():
        c.report(iid, report)
    (move,) = c.plan_rebalance(now_s=0.0)
    assert (move.src_id, move.dst_id, move.request_id) == ("a", "b", "h0")  # all high: fewest blocks, then id
    assert move.reason.startswith("source slots full (4 of 4 running, 1 waiting); destination F=1000.00")
    before = core(a="m", b="m")  # the same reports without the slot limit: nothing moves
    for iid, report in reports.items():
        before.report(iid, replace(report, max_num_seqs=0))
    assert before.plan_rebalance(now_s=0.0) == []


def test_rebalancing_counts_the_prefix_a_destination_caches() -> None:
    # a: 3 requests of 32 blocks (96 of 100: F = 4/3 < 3), each prompt's 8 hash blocks of 32 tokens (16 KV blocks);
    # b: 70 used. V_a − V_b = 26 < 32 moves nothing, unless b caches the prompt: then b grows by 16 blocks only.
    prompt = tuple(range(1, 9))
    running = tuple(RequestLoad(f"a-r{k}", 32, num_tokens=512, max_blocks=64, prefix_hashes=prompt) for k in range(3))
    a = InstanceLoad("a", 100, 96, running, domain_id="d", prefix_block_tokens=32)
    for cached, moves in (((), 0), (prompt, 1)):
        c = core(a="m", b="m")
        c.report("a", a)
        c.report("b", replace(load("b", 100, 40, 30), prefix_hashes=frozenset(cached), prefix_block_tokens=32))
        planned = c.plan_rebalance(now_s=0.0)
        assert len(planned) == moves
    assert (planned[0].src_id, planned[0].dst_id) == ("a", "b")
