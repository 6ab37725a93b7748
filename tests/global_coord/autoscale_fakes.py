"""For the autoscaler's tests: a hook script that records its calls, and a fleet published to etcd the way
domain schedulers and llumlets publish it (registrations under a lease, summaries made by the rule book)."""

from __future__ import annotations

import asyncio
import random
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from clusterstate.etcd import Etcd3Client
from clusterstate.records import DomainRegistration, InstanceRegistration, SummaryRecord, encode
from clusterstate.session import Registrar
from clusterstate.store import Keys
from policy import InstanceLoad, PolicyConfig, RequestLoad, summarize_domain

HOOK = """#!/bin/sh
# Records each call as one line "ACTION MODEL INSTANCE $HILUM_AUTOSCALE_ACTION"; fails (exit 3) while the file
# fail-ACTION-INSTANCE holds a count above 0, counting it down.
dir="{dir}"
echo "$1 $2 $3 $HILUM_AUTOSCALE_ACTION" >> "$dir/calls"
if [ -f "$dir/fail-$1-$3" ]; then
  n=$(cat "$dir/fail-$1-$3")
  if [ "$n" -gt 0 ]; then
    echo $((n - 1)) > "$dir/fail-$1-$3"
    echo "simulated failure of $1 $3" >&2
    exit 3
  fi
fi
echo "did $1 $3"
"""


class RecordingHook:
    """An executable hook script in ``folder``; :meth:`calls` reads what it was called with."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.path = folder / "hook.sh"
        self.path.write_text(HOOK.format(dir=folder))
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR)

    def fail(self, action: str, instance_id: str, times: int) -> None:
        """The next ``times`` calls of ``action`` for ``instance_id`` fail."""
        (self.folder / f"fail-{action}-{instance_id}").write_text(str(times))

    def calls(self) -> list[str]:
        """Each call as "ACTION MODEL INSTANCE ACTION-FROM-THE-ENVIRONMENT", in order."""
        log = self.folder / "calls"
        return log.read_text().splitlines() if log.exists() else []


def load(instance_id: str, domain_id: str, blocks: Sequence[int] = (), *, capacity: int = 100,
         draining: bool = False) -> InstanceLoad:  # fmt: skip
    """One instance running a request per entry of ``blocks``."""
    running = tuple(RequestLoad(f"{instance_id}-r{i}", b) for i, b in enumerate(blocks))
    return InstanceLoad(instance_id, capacity, sum(blocks), running, draining=draining, domain_id=domain_id)


class Fleet:
    """Domain schedulers and llumlets as etcd sees them: every key under one registrar's lease."""

    def __init__(self, client: Etcd3Client, keys: Keys, domains: Sequence[str], model: str = "m") -> None:
        self.keys, self.domains, self.model = keys, list(domains), model
        self.registrar = Registrar(client, 5, rng=random.Random(7), name="fleet")
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._instances: set[str] = set()

    async def __aenter__(self) -> Fleet:
        for d in self.domains:
            await self.registrar.set(self.keys.domain(d), encode(DomainRegistration(d, f"127.0.0.1:{len(d)}")))
        self._task = asyncio.create_task(self.registrar.run(self._stop))
        await self.registrar.registered.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def publish(self, loads: Sequence[InstanceLoad]) -> None:
        """Exactly these instances are registered, and each domain's summary holds its instances' loads."""
        ids = {x.instance_id for x in loads}
        for gone in sorted(self._instances - ids):
            await self.registrar.remove(self.keys.instance(gone))
        for x in loads:
            reg = InstanceRegistration(x.instance_id, x.domain_id, f"node-{x.domain_id}", "127.0.0.1:1", self.model,
                                       x.capacity_blocks, "sim")  # fmt: skip
            await self.registrar.set(self.keys.instance(x.instance_id), encode(reg))
        self._instances = ids
        for d in self.domains:
            members = [x for x in loads if x.domain_id == d]
            summary = summarize_domain(d, members, PolicyConfig(), model=self.model, taken_s=time.time())
            await self.registrar.set(self.keys.summary(d), encode(SummaryRecord(d, (summary,))))


async def until(what: str, check: Callable[[], object], timeout_s: float = 30.0) -> object:
    """Poll ``check`` until it returns something true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


def events(records: Mapping[str, object], model: str = "m") -> list[tuple[str, str, str]]:
    """(action, instance, status) of every event of ``model``'s record."""
    record = records.get(model)
    return [(e.action, e.instance_id, e.status) for e in record.events] if record is not None else []  # type: ignore[attr-defined]
