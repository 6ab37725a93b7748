"""Per-link migration budgets, shared by every migration on a link (DESIGN.md, "Cost model").

The cost model and the simulator give a migration ``B = bottleneck · cap_fraction / (flows + 1)``: each link
carries at most ``capacity · cap_fraction`` of migration traffic, split fairly among the migrations on it
(``topology.cost.effective_bandwidth_bytes_per_s``; ``sim.migration.LinkFlows``). The live llumlets honour the
same budget here: a migration's bytes are paced by every link of its path, and the migrations that share a
link share its budget instead of each taking all of it.

Each link is a FIFO server of ``rate_bytes_per_s``: a chunk of ``n`` bytes occupies it for ``n / rate``
seconds from when it is free (``free_at_s``), so concurrent migrations interleave chunk by chunk and each gets
an equal share; a chunk is through when every link of its path carried it, and its sender waits until then.
A link idle for a moment may be used for at most ``burst_s`` (10 ms) in arrears — the slack a sender's late
wake-up and its work between two chunks leave — so over any window ``w`` a link carries at most
``rate · (w + burst_s)``; a link never used before is busy from now, so the budget holds from the first byte.

Who shares: a :class:`LinkBudgets` with ``scope=""`` is shared by the migrations of one process (one llumlet);
with a scope name, by every llumlet process on the host with that scope — each link's ``free_at_s`` is a small
file in ``/dev/shm`` updated under an exclusive ``fcntl`` lock, and the clock is ``CLOCK_MONOTONIC``, common to
the host's processes. ``python -m llumlet`` uses the etcd prefix as its scope, so the llumlets of one cluster
on one node share the node's links (its NIC above all). Links shared with migrations of *other* hosts (a spine
link, a destination's NIC) are kept within budget by the coordinator's admission (``max_flows_per_link``),
not by pacing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

__all__ = ["LinkBudgets", "LinkPacer", "Pacer"]

_SHM_DIR = "/dev/shm"
_SLOT = struct.Struct("<d")  # the link's free_at_s, seconds of CLOCK_MONOTONIC


class Pacer(Protocol):
    """Paces one migration's bytes (a transport calls it before sending each chunk)."""

    async def consume(self, n_bytes: int) -> float:
        """Return once ``n_bytes`` may go (logical KV bytes); the seconds waited."""
        ...


def _through(free_at_s: float | None, now_s: float, busy_s: float, burst_s: float) -> float:
    """When a chunk occupying a link for ``busy_s`` is through (the link is busy until then)."""
    start = now_s if free_at_s is None else max(now_s - burst_s, free_at_s)
    return start + busy_s


class _Store(Protocol):
    def take(self, link: str, now_s: float, busy_s: float, burst_s: float) -> float:
        """Occupy ``link`` for ``busy_s`` (see :func:`_through`); the time it is through."""
        ...


class _MemoryStore:
    def __init__(self) -> None:
        self._free_at: dict[str, float] = {}

    def take(self, link: str, now_s: float, busy_s: float, burst_s: float) -> float:
        done = self._free_at[link] = _through(self._free_at.get(link), now_s, busy_s, burst_s)
        return done


def _scope_prefix(scope: str, directory: str) -> str:
    return os.path.join(directory, f"hilum-link-{hashlib.sha1(scope.encode()).hexdigest()[:12]}-")


class _HostStore:
    """One file per link under ``directory``, read-modified-written under an exclusive lock."""

    def __init__(self, scope: str, directory: str) -> None:
        self._prefix = _scope_prefix(scope, directory)
        self._fds: dict[str, int] = {}

    def _fd(self, link: str) -> int:
        fd = self._fds.get(link)
        if fd is None:
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", link)
            fd = self._fds[link] = os.open(self._prefix + name, os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def take(self, link: str, now_s: float, busy_s: float, burst_s: float) -> float:
        fd = self._fd(link)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(fd, _SLOT.size, 0)
            done = _through(_SLOT.unpack(raw)[0] if len(raw) == _SLOT.size else None, now_s, busy_s, burst_s)
            os.pwrite(fd, _SLOT.pack(done), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return done

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class LinkPacer:
    """One migration's pacing over the links of its path: every link's budget, shared (see the module doc).

    ``rate_cap_bytes_per_s`` is the tightest budget on the path (what the migration gets alone).
    """

    def __init__(
        self,
        store: _Store,
        budgets: Mapping[str, float],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        burst_s: float,
    ) -> None:
        self._store = store
        self.budgets = dict(budgets)
        self._clock = clock
        self._sleep = sleep
        self._burst_s = burst_s
        self.rate_cap_bytes_per_s = min(self.budgets.values())

    async def consume(self, n_bytes: int) -> float:
        """Take ``n_bytes`` of every link's budget; returns the seconds waited until all of them carried it."""
        now = self._clock()
        burst = self._burst_s
        through = max(self._store.take(link, now, n_bytes / rate, burst) for link, rate in self.budgets.items())
        wait_s = through - now
        if wait_s > 0:
            await self._sleep(wait_s)
        return max(0.0, wait_s)


class LinkBudgets:
    """The migration budgets of the links this llumlet's migrations use (see the module docstring).

    Args:
        scope: "" = shared by this process's migrations; a name = by every process on the host with it.
        clock: monotonic seconds (``time.monotonic``: CLOCK_MONOTONIC, the same in every process of a host).
        sleep: how to wait.
        directory: where the shared slots live (POSIX shared memory).
        burst_s: how far in arrears an idle link may be used (see the module docstring), seconds.
    """

    def __init__(
        self,
        scope: str = "",
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        directory: str = _SHM_DIR,
        burst_s: float = 0.01,
    ) -> None:
        if burst_s < 0:
            raise ValueError(f"LinkBudgets: burst_s = {burst_s}, need >= 0")
        self.scope = scope
        self._burst_s = burst_s
        self._clock = clock
        self._sleep = sleep
        self._store: _MemoryStore | _HostStore = _HostStore(scope, directory) if scope else _MemoryStore()

    def pacer(self, budgets: Mapping[str, float]) -> LinkPacer:
        """A migration's pacer over ``budgets`` (link id -> its migration budget, bytes/s).

        Raises ValueError for no link or a budget <= 0.
        """
        if not budgets or any(not rate > 0 for rate in budgets.values()):
            raise ValueError(f"LinkBudgets.pacer: need at least one link, every budget > 0, got {dict(budgets)}")
        return LinkPacer(self._store, budgets, self._clock, self._sleep, self._burst_s)

    def close(self) -> None:
        """Close the shared slots (the files stay for the other processes of the scope)."""
        if isinstance(self._store, _HostStore):
            self._store.close()

    @staticmethod
    def remove_scope(scope: str, directory: str = _SHM_DIR) -> int:
        """Delete the shared slots of ``scope`` (once no llumlet of it runs: ``hilum up`` at exit); how many."""
        prefix = _scope_prefix(scope, directory)
        base = os.path.basename(prefix)
        names = [n for n in os.listdir(directory) if n.startswith(base)] if os.path.isdir(directory) else []
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        return len(names)
