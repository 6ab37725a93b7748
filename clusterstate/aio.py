"""A service's waits that a stop ends: every long-lived loop of the control plane runs until an ``asyncio.Event``
(its ``stop``) is set, and a wait on anything else (etcd syncing, a session, a sleep) must end with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

__all__ = ["until_stopped"]


async def until_stopped(aw: Awaitable[Any], stop: asyncio.Event) -> bool:
    """Await ``aw`` unless ``stop`` is set first; then ``aw`` is cancelled.

    Returns True when ``aw`` finished and ``stop`` is not set, False once ``stop`` is set (also when both happened).
    Raises what ``aw`` raised. Pass a task (``asyncio.ensure_future``) to read its result after True.
    """
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, stopper):
            t.cancel()
        for t in (task, stopper):
            with contextlib.suppress(asyncio.CancelledError):
                await t
    return not stop.is_set()
