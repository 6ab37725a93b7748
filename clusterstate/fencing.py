"""Fencing tokens: reject orders from a leader that has already been replaced.

The coordinator's fencing token is the create revision of its leader key in etcd (DESIGN.md, "State in
etcd"): etcd revisions only grow, so a later leader always holds a larger token. Whoever carries out an
approval (a domain scheduler, a llumlet) keeps a :class:`FencingGuard` and refuses an approval whose token
is older than the newest it has seen: a leader that was paused past its lease and wakes up cannot act.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcd3aio.kv import KVService

__all__ = ["Fence", "FencedOut", "FencingGuard", "StaleToken"]


class StaleToken(Exception):
    """An approval carried a token older than the newest one seen."""

    def __init__(self, token: int, newest: int) -> None:
        super().__init__(f"fencing token {token} is older than the newest seen ({newest}): stale leader")
        self.token = token
        self.newest = newest


class FencedOut(Exception):
    """A fenced etcd write failed: the writer's leader key is gone or was re-created by someone else."""


class FencingGuard:
    """Remembers the newest fencing token seen and rejects older ones. Pure, no I/O, no clock.

    Equal tokens are accepted (the same leader sends many approvals); ``0`` is never a valid token.
    """

    def __init__(self, newest: int = 0) -> None:
        if newest < 0:
            raise ValueError(f"fencing token must be >= 0, got {newest}")
        self._newest = newest

    @property
    def newest(self) -> int:
        """The newest token accepted so far (0 before any)."""
        return self._newest

    def check(self, token: int) -> None:
        """Accept ``token`` (remembering it when newer) or raise.

        Raises:
            ValueError: when ``token <= 0`` (no leader stamped it).
            StaleToken: when ``token`` is older than the newest seen.
        """
        if token <= 0:
            raise ValueError(f"fencing token must be > 0, got {token}")
        if token < self._newest:
            raise StaleToken(token, self._newest)
        self._newest = token

    def accepts(self, token: int) -> bool:
        """Like :meth:`check` but answers ``False`` instead of raising."""
        try:
            self.check(token)
        except (ValueError, StaleToken):
            return False
        return True


@dataclass(frozen=True, slots=True)
class Fence:
    """The leader's fence in etcd: its leader key still has the create revision ``token``.

    Added to a transaction's comparisons, it makes the write succeed only while this leader leads.
    """

    leader_key: str
    token: int  # create revision of the leader key when this leader won

    def compare(self) -> object:
        """The etcd ``Compare`` (create revision of ``leader_key`` == ``token``)."""
        return KVService.txn_compare_create_revision(self.leader_key, self.token)
