"""Domain summaries built the fast way (one pass, briefs and summaries reused) against the formulas written out."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_factories import CFG, inst

from policy import DomainSummary, InstanceBrief, InstanceLoad, PolicyConfig, RequestLoad, summarize, summarize_domain
from policy.summarize import DomainSummarizer, brief_of, restamped, same_content
from policy.usage import freeness_of, instance_virtual_usage, queued_blocks

FAST = settings(max_examples=200, deadline=None)


def reference_summary(
    domain_id: str, loads: Sequence[InstanceLoad], cfg: PolicyConfig, *, model: str = "", taken_s: float = 0.0
) -> DomainSummary:
    """``summarize_domain`` as it was written before its one pass: a pass per figure, every value checked."""
    for load in loads:
        if load.domain_id and load.domain_id != domain_id:
            raise ValueError(f"instance {load.instance_id!r} reports domain {load.domain_id!r}")
    active = [load for load in loads if not load.draining]
    draining = bool(loads) and not active
    num_running = sum(load.num_running for load in loads)
    capacity = sum(load.capacity_blocks for load in active)
    briefs = sorted((brief_of(load, cfg) for load in loads), key=lambda b: b.instance_id)
    if draining:
        usage = math.inf
    else:
        usage = sum(b.virtual_usage for b in briefs if not b.draining)
        usage += sum(b.used_blocks for b in briefs if b.draining)
    return DomainSummary(
        domain_id=domain_id,
        num_instances=len(loads),
        capacity_blocks=capacity,
        virtual_usage=usage,
        freeness=freeness_of(capacity, usage, num_running),
        largest_free_blocks=max((load.free_blocks for load in active), default=0),
        max_instance_capacity_blocks=max((load.capacity_blocks for load in active), default=0),
        num_running=num_running,
        num_waiting=sum(load.num_waiting for load in loads),
        draining=draining,
        queued_blocks=sum(
            queued_blocks(load) - (load.head_demand_blocks if load.num_waiting else 0) for load in active
        ),
        model=model,
        taken_s=taken_s,
        instances=tuple(briefs),
    )


@st.composite
def loads_of(draw: st.DrawFn, instance_id: str) -> InstanceLoad:
    """A brief report (as the simulator's engines send): blocks, queue, priorities, drains, warm-up, prefixes."""
    capacity = draw(st.integers(1, 300))
    waiting = draw(st.integers(0, 3))
    head = draw(st.integers(0, 60)) if waiting else 0
    running = draw(st.integers(0, 8))
    high = draw(st.integers(0, running))
    prefix = frozenset(draw(st.lists(st.integers(0, 30), max_size=4)))
    return InstanceLoad(
        instance_id,
        capacity_blocks=capacity,
        used_blocks=draw(st.integers(0, capacity)),
        num_waiting=waiting,
        head_demand_blocks=head,
        queued_demand_blocks=head + draw(st.integers(0, 40)) if waiting and draw(st.booleans()) else 0,
        draining=draw(st.integers(0, 3)) == 0,
        warming_up=draw(st.integers(0, 4)) == 0,
        domain_id=draw(st.sampled_from(["", "d"])),
        decode_step_s=draw(st.floats(0, 0.2)),
        num_running=running,
        priority_counts=((1, high),) if high else (),
        brief=True,
        max_num_seqs=draw(st.integers(0, 12)),
        prefix_hashes=prefix,
        prefix_block_tokens=16 if prefix else 0,
        prefill_s_per_token=draw(st.floats(0, 1e-3)),
    )


def domains() -> st.SearchStrategy[list[InstanceLoad]]:
    """0-6 instances, sorted by id (as a domain core lists them)."""
    return st.integers(0, 6).flatmap(lambda n: st.tuples(*(loads_of(f"i{k}") for k in range(n))).map(list))


@FAST
@given(loads=domains(), taken_s=st.floats(0, 100), shuffle=st.randoms(use_true_random=False))
def test_one_pass_summary_is_the_formulas_summary(
    loads: list[InstanceLoad], taken_s: float, shuffle: random.Random
) -> None:
    expected = reference_summary("d", loads, CFG, model="m", taken_s=taken_s)
    assert summarize_domain("d", loads, CFG, model="m", taken_s=taken_s) == expected
    mixed = list(loads)
    shuffle.shuffle(mixed)
    assert summarize_domain("d", mixed, CFG, model="m", taken_s=taken_s) == expected  # sorted, then checked


@FAST
@given(rounds=st.lists(st.tuples(domains(), st.lists(st.booleans(), min_size=6, max_size=6)), min_size=1, max_size=5))
def test_a_summarizer_reusing_briefs_and_summaries_gives_summarize_domains_summaries(
    rounds: list[tuple[list[InstanceLoad], list[bool]]],
) -> None:
    # Each round some instances keep their report object of the round before (kept[k]) and the others send a new
    # one; a drain intent replaces one report by a copy, as DomainCore.loads applies it; each round is
    # summarized twice, the second time at another instant with the same objects (a cross-domain round).
    summarizer = DomainSummarizer("d", CFG)
    previous: dict[str, InstanceLoad] = {}
    for t, (fresh, kept) in enumerate(rounds):
        loads = [previous[x.instance_id] if kept[k] and x.instance_id in previous else x for k, x in enumerate(fresh)]
        if loads and t % 2:
            loads[0] = replace(loads[0], draining=not loads[0].draining)
        previous = {x.instance_id: x for x in loads}
        for taken_s in (float(t), 0.0):
            expected = reference_summary("d", loads, CFG, model="m", taken_s=taken_s)
            assert summarizer.summarize(loads, model="m", taken_s=taken_s) == expected


def test_a_summarizer_refuses_what_summarize_domain_refuses() -> None:
    summarizer = DomainSummarizer("d", CFG)
    with pytest.raises(ValueError, match="reports domain 'other'"):
        summarizer.summarize([inst("a", 100, domain_id="other")])
    with pytest.raises(ValueError, match="instance 'b' reports domain 'x'"):  # the first in the order given
        summarizer.summarize([inst("c", 100), inst("b", 100, domain_id="x"), inst("a", 100, domain_id="y")])
    with pytest.raises(ValueError, match="sorted by id without repeats"):
        summarizer.summarize([inst("a", 100), inst("a", 50)])


def test_restamped_changes_the_stamp_alone() -> None:
    summary = summarize_domain("d", [inst("a", 100, [10], prefix_hashes={1}, prefix_block_tokens=16)], CFG, model="m")
    again = restamped(summary, 7.5)
    assert again.taken_s == 7.5
    assert replace(again, taken_s=0.0) == summary


def test_same_content_ignores_the_stamps_alone() -> None:
    loads = [inst("a", 100, [10], prefix_hashes={1}, prefix_block_tokens=16), inst("b", 100, [20])]
    one = summarize_domain("d", loads, CFG, model="m", taken_s=1.0)
    other = summarize_domain("d", loads, CFG, model="n", taken_s=1.0)
    assert same_content([one, other], [restamped(one, 2.0), summarize_domain("d", loads, CFG, model="n", taken_s=3.0)])
    assert same_content([], [])
    busier = summarize_domain("d", [loads[0], inst("b", 100, [20, 30])], CFG, model="m", taken_s=1.0)
    assert not same_content([one], [busier])  # one brief differs
    assert not same_content([one], [replace(one, domain_id="e")])
    assert not same_content([one], [one, other])
    assert not same_content([one, other], [other, one])  # in the same order


def test_a_summarizer_forgets_an_instance_that_left() -> None:
    summarizer = DomainSummarizer("d", CFG)
    a, b = inst("a", 100, [10]), inst("b", 100, [20])
    summarizer.summarize([a, b])
    summarizer.forget("b")
    summarizer.forget("b")  # idempotent
    assert summarizer.summarize([a]) == reference_summary("d", [a], CFG)
    assert summarizer.summarize([a, b]) == reference_summary("d", [a, b], CFG)  # b's brief made again


def test_the_trusted_constructors_are_called_in_field_order() -> None:
    """brief_of and the summarizer build briefs and summaries positionally: every field of a brief lands where its
    name says (distinct values, same-typed fields included), and the summaries equal the keyword-built reference
    (the tests above)."""
    assert tuple(f.name for f in fields(InstanceBrief)) == summarize._BRIEF_FIELDS
    assert tuple(f.name for f in fields(DomainSummary)) == summarize._SUMMARY_FIELDS
    running = (RequestLoad("r1", 10), RequestLoad("r2", 20))
    load = InstanceLoad(
        "a", 100, 30, running, num_waiting=3, head_demand_blocks=5, decode_step_s=0.25, max_num_seqs=7,
        prefix_hashes={1, 2}, prefix_block_tokens=16, prefill_s_per_token=0.125,
    )  # fmt: skip
    expected = InstanceBrief(
        instance_id="a", capacity_blocks=100, free_blocks=70, virtual_usage=instance_virtual_usage(load, CFG),
        num_running=2, num_waiting=3, draining=False, decode_step_s=0.25, max_num_seqs=7,
        prefix_hashes=frozenset({1, 2}), prefill_s_per_token=0.125,
    )  # fmt: skip
    assert brief_of(load, CFG) == expected
