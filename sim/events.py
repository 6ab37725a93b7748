"""The discrete-event core: a virtual clock and a deterministic event queue.

Events are ordered by ``(time_s, kind, scheduled_s, seq)``: time first, then a fixed precedence between
kinds (a step that ends at the same instant as an arrival is applied first, so the arrival sees the freed
blocks), then the time the event was scheduled at, then insertion order. ``scheduled_s`` is the clock
when ``schedule`` was called, so for ordinary events the last two keys are simply insertion order; a
caller that accounts several engine steps in one event (``sim.cluster``) gives it the time its last step
would have been scheduled at, so it keeps the place the step-by-step event would have had. ``seq`` is a
per-queue counter, so two simulations in one process never share state and a run is a pure function of
its inputs and seed (after vidur's layout, without its global counters).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from enum import IntEnum
from typing import final

__all__ = ["EventKey", "EventKind", "EventQueue"]


class EventKind(IntEnum):
    """Precedence of events that fall on the same instant (lower runs first)."""

    STEP_DONE = 0
    MIGRATION = 1
    SUMMARY = 2
    SCRIPTED = 3
    ARRIVAL = 4
    TICK = 5
    SAMPLE = 6


EventKey = tuple[float, int, float, int]
"""The order of an event: (time_s, kind, scheduled_s, seq); smaller runs first."""


@final
class _Entry:
    """One scheduled event: its key and its action. Ordered as its key, the tuple ``(time_s, kind, scheduled_s,
    seq)``, would be. A class, not that tuple: compiled, the heap's comparisons read the time and the rest as
    plain fields of the one object, where a tuple's comparison also reads the float object each element is (at
    thousands of instances the heap's entries are far apart in memory, and every read is a cache miss)."""

    __slots__ = ("action", "at_s", "kind", "seq", "time_s")

    def __init__(self, time_s: float, kind: int, at_s: float, seq: int, action: Callable[[], None]) -> None:
        self.time_s = time_s
        self.kind = kind
        self.at_s = at_s
        self.seq = seq
        self.action = action

    def __lt__(self, other: _Entry) -> bool:
        if self.time_s != other.time_s:
            return self.time_s < other.time_s
        if self.kind != other.kind:
            return self.kind < other.kind
        if self.at_s != other.at_s:
            return self.at_s < other.at_s
        return self.seq < other.seq


class EventQueue:
    """A virtual clock plus a priority queue of callbacks.

    ``now_s`` only moves forward, to the time of the event being run. Scheduling an event in the past
    raises ``ValueError`` (it would break causality silently otherwise).
    """

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._seq = 0
        self.now_s = 0.0
        self.events_run = 0
        self._current: _Entry | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(
        self, time_s: float, kind: EventKind, action: Callable[[], None], *, scheduled_s: float | None = None
    ) -> None:
        """Run ``action()`` at virtual time ``time_s`` (seconds, >= now).

        ``scheduled_s`` (default now, at most ``time_s``): the time the event counts as scheduled at when it
        ties with another of the same time and kind.
        """
        if time_s < self.now_s:
            raise ValueError(f"event of kind {kind.name} scheduled at {time_s:.6f} s, before now ({self.now_s:.6f} s)")
        self._seq += 1
        at_s = self.now_s if scheduled_s is None else scheduled_s
        heapq.heappush(self._heap, _Entry(time_s, int(kind), at_s, self._seq, action))

    def schedule_in(self, delay_s: float, kind: EventKind, action: Callable[[], None]) -> None:
        """Run ``action()`` ``delay_s`` seconds (>= 0) from now."""
        self.schedule(self.now_s + delay_s, kind, action)

    def next_seq(self) -> int:
        """The ``seq`` the next scheduled event will get."""
        return self._seq + 1

    def current_key(self) -> EventKey | None:
        """The key of the event being run (None between events)."""
        entry = self._current
        return None if entry is None else (entry.time_s, entry.kind, entry.at_s, entry.seq)

    def run_next(self) -> bool:
        """Advance the clock to the next event and run it; False when the queue is empty."""
        if not self._heap:
            return False
        entry = heapq.heappop(self._heap)
        self.now_s = entry.time_s
        self.events_run += 1
        self._current = entry
        try:
            entry.action()
        finally:
            self._current = None
        return True
