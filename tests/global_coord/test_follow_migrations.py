"""FollowMigrations sends every change, also one made while it was sending the previous snapshot."""

from __future__ import annotations

import asyncio
from typing import Any

from clusterstate.records import MigrationRecord, MigrationState
from global_coord.server import CoordinatorService


class _View:
    """A view whose contents the test changes; ``wait_changed`` as ``ClusterView``'s."""

    def __init__(self) -> None:
        self.version = 1
        self._migrations: dict[str, tuple[MigrationRecord, int]] = {}
        self._changed = asyncio.Condition()

    def migrations(self) -> dict[str, tuple[MigrationRecord, int]]:
        return dict(self._migrations)

    def put(self, mid: str, state: MigrationState, rev: int) -> None:
        self._migrations[mid] = (MigrationRecord(mid, mid, 1, "a0", "b0", "a", "b", 10, state, 1), rev)
        self.version += 1  # no notification yet: the change lands while the stream is busy sending

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_changed(self, seen: int) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != seen)
            return self.version


class _Coordinator:
    def __init__(self, view: _View) -> None:
        self.view = view


def test_a_change_made_while_the_snapshot_is_sent_is_not_missed() -> None:
    async def main() -> list[tuple[str, int]]:
        view = _View()
        view.put("r#1", MigrationState.PROPOSED, 10)
        view.put("r#2", MigrationState.PROPOSED, 11)
        service = CoordinatorService(_Coordinator(view))  # type: ignore[arg-type]
        stream = service.FollowMigrations(None, None)  # type: ignore[arg-type]
        got = [await anext(stream)]  # the first of two snapshot events; the stream is paused on its send
        view.put("r#1", MigrationState.APPROVED, 12)  # changed meanwhile, before the stream waits again
        got.append(await anext(stream))
        got.append(await asyncio.wait_for(anext(stream), 2.0))  # must come without another notification
        await stream.aclose()
        return [(e.migration.migration_id, e.migration.mod_revision) for e in got]

    events: Any = asyncio.run(main())
    assert events == [("r#1", 10), ("r#2", 11), ("r#1", 12)]
