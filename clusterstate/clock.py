"""The clock seam: every service reads time and sleeps through a :class:`Clock`, so its shell can be driven
by a test without wall-clock sleeps.

- :class:`SystemClock` (:data:`SYSTEM_CLOCK`): ``time.monotonic`` for durations and deadlines, ``time.time``
  for stamps compared across hosts (summary ``taken_s``, arrival times), ``asyncio.sleep``.
- :class:`ManualClock`: time moves only when the test calls :meth:`ManualClock.advance`; a ``sleep`` returns
  once the clock has reached its deadline (a sleep of 0 or less yields once, like ``asyncio.sleep(0)``).

The decision cores (``rack_sched.core``, ``global_coord.approver``, ``gateway.core``) read no clock at all:
their shells pass ``now_s`` in.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncio

# asyncio is imported where a clock sleeps, not here: the configuration (``hilum_config``, which ``hilum sim`` reads)
# imports this module through the autoscaler's actuator and runs no event loop (asyncio and ssl: ~30 ms a start).

__all__ = ["SYSTEM_CLOCK", "Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """Time as a service sees it."""

    def now_s(self) -> float:
        """Monotonic seconds (durations, deadlines)."""

    def wall_s(self) -> float:
        """Seconds since the epoch (stamps compared across hosts; assumes NTP-synchronised hosts)."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock."""


class SystemClock:
    """The real clock."""

    def now_s(self) -> float:
        return time.monotonic()

    def wall_s(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        import asyncio

        await asyncio.sleep(max(0.0, seconds))


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only by :meth:`advance` (tests). ``wall_s`` is ``now_s`` plus ``wall_offset_s``.

    Sleepers are woken in deadline order; ``advance`` lets each woken task run before waking the next.
    """

    def __init__(self, start_s: float = 0.0, wall_offset_s: float = 1_700_000_000.0) -> None:
        self._now = start_s
        self._wall_offset = wall_offset_s
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_s(self) -> float:
        return self._now

    def wall_s(self) -> float:
        return self._now + self._wall_offset

    async def sleep(self, seconds: float) -> None:
        import asyncio

        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> int:
        """Tasks sleeping on this clock now."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, waking (in order) every sleeper whose deadline is reached.

        Raises ValueError on a negative step.
        """
        import asyncio

        if seconds < 0:
            raise ValueError(f"advance: seconds must be >= 0, got {seconds}")
        target = self._now + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
            for _ in range(5):  # let the woken task (and what it starts) run up to its next await
                await asyncio.sleep(0)
        self._now = target
        await asyncio.sleep(0)
