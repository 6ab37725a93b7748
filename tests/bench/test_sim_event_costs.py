"""bench/sim_event_costs.py: a run's cost split by the kind of event it was spent in, the wrapper undone after."""

from __future__ import annotations

import math

from bench.sim_event_costs import OUTSIDE, measure
from sim.events import EventQueue


def test_a_run_is_split_by_event_kind_and_the_queue_is_left_as_it_was() -> None:
    run_next = EventQueue.run_next
    split = measure(16, "hilum")
    assert EventQueue.run_next is run_next  # unwrapped after the run
    kinds = set(split) - {OUTSIDE, "total", "CPU"}
    # the two-tier policy's run: arrivals, engine steps and runs, rescheduling rounds, summaries, KV samples
    assert {"ARRIVAL", "STEP_DONE", "TICK", "SUMMARY", "SAMPLE"} <= kinds <= {"MIGRATION", "SCRIPTED"} | {
        "ARRIVAL", "STEP_DONE", "TICK", "SUMMARY", "SAMPLE",
    }  # fmt: skip
    assert all(split[k] > 0 for k in kinds) and split[OUTSIDE] > 0 and split["CPU"] > 0
    assert math.isclose(sum(split[k] for k in kinds) + split[OUTSIDE], split["total"], rel_tol=1e-9)
