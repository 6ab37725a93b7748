"""The discrete-event core: a virtual clock and a deterministic event queue.

Events are ordered by ``(time_s, kind, seq)``: time first, then a fixed precedence between kinds
(a step that ends at the same instant as an arrival is applied first, so the arrival sees the freed
blocks), then insertion order. ``seq`` is a per-queue counter, so two simulations in one process never
share state and a run is a pure function of its inputs and seed (after vidur's layout, without its
global counters).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

__all__ = ["EventKind", "EventQueue"]


class EventKind(IntEnum):
    """Precedence of events that fall on the same instant (lower runs first)."""

    STEP_DONE = 0
    MIGRATION = 1
    SUMMARY = 2
    SCRIPTED = 3
    ARRIVAL = 4
    TICK = 5
    SAMPLE = 6


@dataclass(order=True, slots=True)
class _Entry:
    time_s: float
    kind: int
    seq: int
    action: Callable[[], None] = field(compare=False)


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

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, time_s: float, kind: EventKind, action: Callable[[], None]) -> None:
        """Run ``action()`` at virtual time ``time_s`` (seconds, >= now)."""
        if time_s < self.now_s:
            raise ValueError(f"event of kind {kind.name} scheduled at {time_s:.6f} s, before now ({self.now_s:.6f} s)")
        self._seq += 1
        heapq.heappush(self._heap, _Entry(time_s, int(kind), self._seq, action))

    def schedule_in(self, delay_s: float, kind: EventKind, action: Callable[[], None]) -> None:
        """Run ``action()`` ``delay_s`` seconds (>= 0) from now."""
        self.schedule(self.now_s + delay_s, kind, action)

    def run_next(self) -> bool:
        """Advance the clock to the next event and run it; False when the queue is empty."""
        if not self._heap:
            return False
        entry = heapq.heappop(self._heap)
        self.now_s = entry.time_s
        self.events_run += 1
        entry.action()
        return True
