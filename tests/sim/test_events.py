import random

import pytest

from sim.events import EventKind, EventQueue


def test_events_run_in_time_then_kind_then_insertion_order() -> None:
    q = EventQueue()
    seen: list[str] = []
    q.schedule(2.0, EventKind.ARRIVAL, lambda: seen.append("arrival@2"))
    q.schedule(1.0, EventKind.TICK, lambda: seen.append("tick@1"))
    q.schedule(1.0, EventKind.ARRIVAL, lambda: seen.append("arrival@1-a"))
    q.schedule(1.0, EventKind.STEP_DONE, lambda: seen.append("step@1"))
    q.schedule(1.0, EventKind.ARRIVAL, lambda: seen.append("arrival@1-b"))
    while q.run_next():
        pass
    assert seen == ["step@1", "arrival@1-a", "arrival@1-b", "tick@1", "arrival@2"]
    assert q.now_s == 2.0
    assert q.events_run == 5


def test_an_event_can_schedule_more_events_and_the_clock_follows() -> None:
    q = EventQueue()
    times: list[float] = []

    def ping() -> None:
        times.append(q.now_s)
        if len(times) < 3:
            q.schedule_in(0.5, EventKind.TICK, ping)

    q.schedule(1.0, EventKind.TICK, ping)
    while q.run_next():
        pass
    assert times == [1.0, 1.5, 2.0]


def test_scheduling_in_the_past_is_an_error() -> None:
    q = EventQueue()
    q.schedule(1.0, EventKind.TICK, lambda: None)
    q.run_next()
    with pytest.raises(ValueError, match="before now"):
        q.schedule(0.5, EventKind.ARRIVAL, lambda: None)


def test_two_queues_do_not_share_state() -> None:
    a, b = EventQueue(), EventQueue()
    order: list[str] = []
    a.schedule(1.0, EventKind.TICK, lambda: order.append("a"))
    b.schedule(1.0, EventKind.TICK, lambda: order.append("b"))
    b.run_next()
    assert a.now_s == 0.0 and b.now_s == 1.0 and len(a) == 1 and order == ["b"]


def test_scheduled_at_orders_same_time_events_and_the_running_key_is_visible() -> None:
    q = EventQueue()
    seen: list[tuple[str, object]] = []
    q.schedule(1.0, EventKind.TICK, lambda: None)
    q.run_next()  # now 1.0
    q.schedule(3.0, EventKind.STEP_DONE, lambda: seen.append(("late", q.current_key())))
    # a step end that step-by-step stepping would have scheduled at 0.5 goes first, though scheduled last
    q.schedule(3.0, EventKind.STEP_DONE, lambda: seen.append(("early", q.current_key())), scheduled_s=0.5)
    while q.run_next():
        pass
    assert [name for name, _ in seen] == ["early", "late"]
    assert seen[0][1] == (3.0, int(EventKind.STEP_DONE), 0.5, 3) and seen[1][1] == (3.0, 0, 1.0, 2)
    assert q.current_key() is None


def test_the_run_order_is_the_key_order_with_ties_in_every_part_of_the_key() -> None:
    # Few distinct times, kinds and scheduled times: most events tie on a part of (time_s, kind, scheduled_s, seq),
    # and the queue must run them in the order of those tuples (the order its entries stand for).
    rng = random.Random(5)
    q = EventQueue()
    q.schedule(0.25, EventKind.TICK, lambda: None)
    q.run_next()  # now 0.25: a scheduled_s of 0.0 is earlier than the default
    ran: list[tuple[float, int, float, int]] = []
    for _ in range(2000):
        time_s, kind = rng.choice((1.0, 1.5, 2.0)), rng.choice(list(EventKind))
        scheduled_s = rng.choice((None, 0.0, 0.5))
        q.schedule(time_s, kind, lambda: ran.append(q.current_key()), scheduled_s=scheduled_s)  # type: ignore[arg-type]
    while q.run_next():
        pass
    assert len(ran) == 2000 and ran == sorted(ran)
    assert len({k[:3] for k in ran}) == 3 * len(EventKind) * 3  # every combination drawn: ties everywhere
