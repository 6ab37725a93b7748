"""Priority classes in the engine's scheduler: admission, queue order and preemption victims.

A high-priority arrival gets a batch slot within one step (by preempting a normal request), a high-priority
request is never the victim while normal ones run, and requests of one class never preempt each other at
admission (arrival-order recompute stays within a class).
"""

from __future__ import annotations

import random

import pytest

from llumlet.engine import EngineCore, EngineRequest, StepResult
from llumlet.engine.scheduler import SchedulingPolicy
from tests.llumlet.test_engine_core import engine


def req(rid: str, prompt: int, output: int, arrival_s: float, priority: int = 0) -> EngineRequest:
    return EngineRequest(rid, prompt_tokens=prompt, max_tokens=output, priority=priority, arrival_s=arrival_s)


def steps(e: EngineCore, n: int) -> list[StepResult]:
    out = []
    for _ in range(n):
        out.append(e.step())
        e.blocks.check_invariants()
    return out


def running_ids(e: EngineCore) -> list[str]:
    return [s.request_id for s in e.scheduler.running]


def test_high_priority_arrival_takes_a_full_batchs_slot_within_one_step() -> None:
    e = engine(seqs=4)  # 100 blocks: memory is plentiful, the batch slots are not
    for i in range(4):
        e.add_request(req(f"n{i}", 8, 200, arrival_s=float(i)))
    steps(e, 3)  # all four prefill and decode
    assert running_ids(e) == ["n0", "n1", "n2", "n3"] and e.blocks.free_blocks > 80
    e.add_request(req("h", 8, 10, arrival_s=10.0, priority=1))
    result = e.step()
    # the next step: h is admitted (its whole prompt in one chunk, first token), n3 (the latest normal) makes room
    assert result.preempted == ("n3",)
    assert result.new_tokens["h"] == 1 and result.num_prefill_tokens == 8
    assert running_ids(e) == ["h", "n0", "n1", "n2"]
    assert [s.request_id for s in e.scheduler.waiting] == ["n3"]
    assert result.num_decode_tokens == 3  # n3's decode was taken out of the batch again


def high_behind_a_full_batch(scheduling: SchedulingPolicy) -> tuple[EngineCore, int]:
    """Issue 15's case: 4 of 4 slots hold long normal decodes (memory is never short: 4 x 52 blocks at most
    of 1000) when h arrives. Returns the engine and the steps h waited for its first token after arriving."""
    e = engine(num_blocks=1000, seqs=4, scheduling=scheduling)
    for i in range(4):
        e.add_request(req(f"n{i}", 8, 200, arrival_s=float(i)))
    steps(e, 3)
    e.add_request(req("h", 8, 10, arrival_s=10.0, priority=1))
    waited = 0
    while not e.step().new_tokens.get("h"):
        waited += 1
    return e, waited


def test_steps_a_high_priority_arrival_waits_for_its_first_token_behind_a_full_batch() -> None:
    # before, h waited for the normals to finish (197 steps: the fcfs test below); now its first token comes in
    # the step after it arrives, and only one normal request is preempted (once)
    e, waited = high_behind_a_full_batch("priority")
    assert waited == 0
    while e.has_work():
        e.step()
    assert [(rid, e.stats[rid].num_preemptions) for rid in ("h", "n0", "n1", "n2", "n3")] == [
        ("h", 0),
        ("n0", 0),
        ("n1", 0),
        ("n2", 0),
        ("n3", 1),
    ]


def test_whole_prompt_admission_preempts_a_normal_request_for_a_high_priority_prompt() -> None:
    # vLLM v0's whole-prompt check (1 block watermark of 100): two normal requests hold 2 x 44 blocks and
    # decode, 12 are free; a 64-token prompt needs 16 blocks + the watermark
    e = engine(num_blocks=100, block=4, seqs=16, admission="whole-prompt")
    e.add_request(req("n0", 170, 100, arrival_s=0.0))
    e.add_request(req("n1", 170, 100, arrival_s=1.0))
    steps(e, 2)
    e.add_request(req("n2", 64, 5, arrival_s=2.0))
    steps(e, 3)
    load = e.load()
    assert (load.used_blocks, load.num_waiting) == (88, 1)  # n2 does not fit, and preempts no one of its class
    e.add_request(req("h", 64, 5, arrival_s=3.0, priority=1))
    result = e.step()
    assert result.preempted == ("n1",) and result.new_tokens["h"] == 1
    assert [s.request_id for s in e.scheduler.waiting] == ["n1", "n2"]


def test_a_normal_arrival_never_preempts_a_normal_request() -> None:
    e = engine(seqs=4)
    for i in range(4):
        e.add_request(req(f"n{i}", 8, 30, arrival_s=float(i)))
    steps(e, 2)
    e.add_request(req("late", 8, 10, arrival_s=10.0))
    waited = steps(e, 20)
    assert all(not s.preempted for s in waited)
    assert "late" not in e.scheduler.running and e.scheduler.waiting[0].request_id == "late"
    assert e.load().num_waiting == 1


def test_high_priority_arrival_preempts_for_memory_and_jumps_the_queue() -> None:
    e = engine(num_blocks=12, block=4, seqs=16)  # 48 token slots
    e.add_request(req("n0", 16, 20, arrival_s=0.0))
    e.add_request(req("n1", 16, 20, arrival_s=1.0))
    steps(e, 1)  # both prefill: 2 x 4 blocks held, 4 free
    e.add_request(req("n2", 20, 5, arrival_s=2.0))  # a normal request queued first: 5 blocks
    e.add_request(req("h", 20, 5, arrival_s=3.0, priority=1))
    result = e.step()
    # the decodes take a 5th block each (2 left); h goes before n2 (its class first) and takes n1's memory (the
    # latest normal, whose decode leaves the batch again); n2 stays queued
    assert result.preempted == ("n1",)
    assert result.new_tokens.get("h") == 1 and "n2" not in result.new_tokens
    assert [s.request_id for s in e.scheduler.waiting] == ["n1", "n2"]  # the victim at the front of its class


def test_high_priority_request_is_never_the_victim_while_normal_ones_run() -> None:
    # h arrived last; when a decode runs out of blocks the victim is the latest normal request, not h
    e = engine(num_blocks=9, block=4, seqs=16)
    e.add_request(req("n0", 4, 24, arrival_s=0.0))
    e.add_request(req("n1", 4, 24, arrival_s=1.0))
    e.add_request(req("h", 4, 24, arrival_s=2.0, priority=1))
    victims: list[str] = []
    while e.has_work():
        victims.extend(e.step().preempted)
        e.blocks.check_invariants()
    assert victims and "h" not in victims and e.stats["h"].num_preemptions == 0
    assert victims[0] == "n1"  # the latest normal request first
    assert e.stats["n1"].num_preemptions >= 1


def test_a_high_priority_prefill_takes_blocks_from_a_normal_decode_already_in_the_batch() -> None:
    # 6 blocks of 4 tokens, 5 tokens a step: n0 prefills in 3 steps and decodes; h (12 prompt tokens) arrives
    # and prefills 4 tokens a step beside n0's decode. Its third chunk needs a block none is free for; the
    # decode pass already gave n0 its token in this batch, but n0 is normal: its decode is taken out again
    # and it is preempted (before, h itself was the victim: the only request not yet in the batch)
    e = engine(num_blocks=6, block=4, seqs=16, budget=5)
    e.add_request(req("n0", 12, 12, arrival_s=0.0))
    steps(e, 4)  # 3 prefill chunks, 1 decode: n0 holds 13 tokens in 4 blocks
    e.add_request(req("h", 12, 4, arrival_s=1.0, priority=1))
    first, second, third = steps(e, 3)
    assert (first.preempted, second.preempted) == ((), ())
    assert third.preempted == ("n0",)
    assert third.num_decode_tokens == 0 and third.num_prefill_tokens == 4 and third.new_tokens["h"] == 1
    assert running_ids(e) == ["h"] and e.stats.get("h") is None


def test_equal_classes_keep_arrival_order_recompute() -> None:
    # every request high priority: the latest arrival is the victim, as with a single class
    e = engine(num_blocks=9, block=4, seqs=16)
    for i in range(3):
        e.add_request(req(f"h{i}", 4, 24, arrival_s=float(i), priority=1))
    victims: list[str] = []
    while e.has_work():
        victims.extend(e.step().preempted)
    assert victims[0] == "h2"


def test_random_mixed_classes_conserve_tokens_and_never_preempt_high_while_normal_run() -> None:
    rng = random.Random(7)
    e = engine(num_blocks=40, block=4, seqs=6, budget=32)
    outputs = {}
    for i in range(60):
        prio = 1 if rng.random() < 0.2 else 0
        out = rng.randint(1, 30)
        outputs[f"r{i}"] = out
        e.add_request(req(f"r{i}", rng.randint(1, 30), out, arrival_s=float(i), priority=prio))
    produced: dict[str, int] = {}
    while e.has_work():
        running_before = [(s.request_id, s.request.priority) for s in e.scheduler.running]
        result = e.step()
        e.blocks.check_invariants()
        for rid, n in result.new_tokens.items():
            produced[rid] = produced.get(rid, 0) + n
        normals_left = any(p == 0 for rid, p in running_before if rid not in result.preempted)
        for rid in result.preempted:
            victim = e.scheduler.requests[rid]
            assert victim.request.priority == 0 or not normals_left, (rid, running_before, result.preempted)
    assert produced == outputs


def test_fcfs_scheduling_ignores_priorities_as_before() -> None:
    # scheduling="fcfs" (vLLM's default policy name), the engine as it was: h runs once the normals are done
    e, waited = high_behind_a_full_batch("fcfs")
    assert waited == 197  # the normals' 200 tokens, 3 of them before h came
    assert running_ids(e) == ["h"] and all(e.stats[f"n{i}"].num_preemptions == 0 for i in range(4))


def test_an_unknown_scheduling_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy 'lifo' unknown; choose from priority, fcfs"):
        engine(scheduling="lifo")  # type: ignore[arg-type]
