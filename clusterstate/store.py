"""hilum's state in etcd: the key layout, fenced and compare-and-swap writes, and the ClusterView.

Key layout (``P`` = the prefix, default ``/hilum/v1/``; every value is JSON, see ``records.py``)::

    P leader                        coordinator leader key, under the leader's session lease;
                                    its create revision is the fencing token  (election.py)
    P domains/<domain_id>           DomainRegistration, under the domain scheduler's lease
    P instances/<instance_id>       InstanceRegistration, under the llumlet's lease
    P summaries/<domain_id>         SummaryRecord, under the domain scheduler's lease; rate-limited puts
    P migrations/<migration_id>     MigrationRecord, durable; state changes only by compare-and-swap on
                                    the key's mod revision; coordinator writes also carry the leader fence
    P drains/instance/<id>          DrainIntent, durable; created / deleted by the leader, fenced
    P drains/domain/<id>
    P autoscale/<model>             AutoscaleRecord, durable; the autoscaler's state and recent decisions,
                                    put by the leader, fenced

Registrations and summaries vanish with their agent's lease; migrations, drains and the autoscaler's records
survive everything and are the only durable state. The coordinator keeps nothing else: its
:class:`ClusterView` is rebuilt by listing ``P`` and watching from the list revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from clusterstate.backoff import RECOVERED_LEVEL, Backoff, BackoffConfig, failed_attempts
from clusterstate.etcd import (
    RETRYABLE_ERRORS,
    Etcd3Client,
    compare_exists,
    compare_mod_revision,
    error_line,
    kv_of,
    prefix_range_end,
    watch,
)
from clusterstate.fencing import Fence, FencedOut
from clusterstate.options import DEFAULT_PREFIX, check_prefix
from clusterstate.records import (
    TRANSITIONS,
    AutoscaleRecord,
    DomainRegistration,
    DrainIntent,
    DrainKind,
    InstanceRegistration,
    MigrationRecord,
    MigrationState,
    RecordError,
    SummaryRecord,
    decode,
    encode,
)
from clusterstate.session import Registrar
from policy.summarize import same_content

__all__ = ["CasResult", "ClusterView", "Entry", "Keys", "Store", "SummaryPublisher"]

_log = logging.getLogger(__name__)
_EVENT_DELETE = 1  # mvccpb.Event.EventType
_RPC_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Keys:
    """The key layout under one prefix (see the module docstring)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_prefix(self.prefix)  # the rule every --prefix option applies too

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    def domain(self, domain_id: str) -> str:
        return f"{self.prefix}domains/{_check_id(domain_id)}"

    def instance(self, instance_id: str) -> str:
        return f"{self.prefix}instances/{_check_id(instance_id)}"

    def summary(self, domain_id: str) -> str:
        return f"{self.prefix}summaries/{_check_id(domain_id)}"

    def migration(self, migration_id: str) -> str:
        return f"{self.prefix}migrations/{_check_id(migration_id)}"

    def drain(self, kind: DrainKind, target_id: str) -> str:
        return f"{self.prefix}drains/{kind.value}/{_check_id(target_id)}"

    def autoscale(self, model: str) -> str:
        return f"{self.prefix}autoscale/{_check_id(model)}"


def _check_id(ident: str) -> str:
    if not ident or "/" in ident:
        raise ValueError(f"identifier {ident!r} must be non-empty and contain no '/'")
    return ident


@dataclass(frozen=True, slots=True)
class Entry:
    """One key as the view holds it."""

    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class CasResult:
    """Outcome of a compare-and-swap on a migration record."""

    ok: bool  # the write happened
    mod_revision: int  # of the record after the call (0 when it does not exist)
    current: MigrationRecord | None  # the record as it is now in etcd


class Store:
    """Writes to hilum's keys: fenced by the leader key where the leader writes, CAS everywhere else."""

    def __init__(self, client: Etcd3Client, keys: Keys) -> None:
        self._client = client
        self.keys = keys

    async def _txn(self, compare: list[Any], success: list[Any], failure: list[Any]) -> Any:
        return await kv_of(self._client).txn(compare, success, failure, timeout=_RPC_TIMEOUT_S)

    async def get_migration(self, migration_id: str) -> tuple[MigrationRecord, int] | None:
        """The record and its mod revision, or None."""
        key = self.keys.migration(migration_id)
        resp = await kv_of(self._client).get(key, timeout=_RPC_TIMEOUT_S)
        if not resp.kvs:
            return None
        return decode(MigrationRecord, bytes(resp.kvs[0].value), key), int(resp.kvs[0].mod_revision)

    async def create_migration(self, record: MigrationRecord, fence: Fence) -> CasResult:
        """Create the record if absent, only while ``fence`` holds.

        Returns ``CasResult(ok=False, current=existing)`` when a record with that id exists already (a
        retried proposal: it is never approved twice).

        Raises:
            FencedOut: when the writer no longer leads.
        """
        kv = kv_of(self._client)
        key = self.keys.migration(record.migration_id)
        resp = await self._txn(
            [kv.txn_compare_create_revision(key, 0), fence.compare()],
            [kv.txn_op_put(key, encode(record))],
            [kv.txn_op_get(key), kv.txn_op_get(fence.leader_key)],
        )
        if resp.succeeded:
            return CasResult(True, int(resp.header.revision), record)
        return self._failed(resp, key, fence)

    async def transition(
        self,
        migration_id: str,
        expected_mod_revision: int,
        new_state: MigrationState,
        *,
        reason: str | None = None,
        fence: Fence | None = None,
        update: Mapping[str, Any] | None = None,
    ) -> CasResult:
        """Move a migration to ``new_state`` iff its mod revision is still ``expected_mod_revision``.

        Domain schedulers commit or abort without a fence; the leader approves with its fence.

        Returns:
            ``ok=False`` (with the current record) when someone else changed it first: no transition
            is ever applied twice.

        Raises:
            ValueError: when the record is not in a state that may move to ``new_state``.
            KeyError: when the record does not exist.
            FencedOut: when ``fence`` is given and the writer no longer leads.
        """
        current = await self.get_migration(migration_id)
        if current is None:
            raise KeyError(f"migration {migration_id!r} does not exist")
        record, mod_revision = current
        if mod_revision != expected_mod_revision:
            return CasResult(False, mod_revision, record)
        if new_state not in TRANSITIONS[record.state]:
            raise ValueError(f"migration {migration_id}: illegal transition {record.state} -> {new_state}")
        changed = replace(record, state=new_state, reason=record.reason if reason is None else reason)
        if update:
            changed = replace(changed, **dict(update))
        kv = kv_of(self._client)
        key = self.keys.migration(migration_id)
        compare = [compare_mod_revision(key, expected_mod_revision)]
        failure = [kv.txn_op_get(key)]
        if fence is not None:
            compare.append(fence.compare())
            failure.append(kv.txn_op_get(fence.leader_key))
        resp = await self._txn(compare, [kv.txn_op_put(key, encode(changed))], failure)
        if resp.succeeded:
            return CasResult(True, int(resp.header.revision), changed)
        return self._failed(resp, key, fence)

    def _failed(self, resp: Any, key: str, fence: Fence | None) -> CasResult:
        if fence is not None:
            leader_kvs = list(resp.responses[1].response_range.kvs)
            if not leader_kvs or int(leader_kvs[0].create_revision) != fence.token:
                raise FencedOut(f"leader key {fence.leader_key} no longer has fencing token {fence.token}")
        kvs = list(resp.responses[0].response_range.kvs)
        if not kvs:
            return CasResult(False, 0, None)
        return CasResult(False, int(kvs[0].mod_revision), decode(MigrationRecord, bytes(kvs[0].value), key))

    async def put_drain(self, intent: DrainIntent, fence: Fence) -> bool:
        """Create a drain intent if absent (fenced). True when created, False when it existed.

        Raises:
            FencedOut: when the writer no longer leads.
        """
        kv = kv_of(self._client)
        key = self.keys.drain(intent.kind, intent.target_id)
        resp = await self._txn(
            [kv.txn_compare_create_revision(key, 0), fence.compare()],
            [kv.txn_op_put(key, encode(intent))],
            [kv.txn_op_get(key), kv.txn_op_get(fence.leader_key)],
        )
        if resp.succeeded:
            return True
        self._check_fence(resp, fence)
        return False

    async def delete_drain(self, kind: DrainKind, target_id: str, fence: Fence) -> bool:
        """Delete a drain intent (fenced). True when it existed.

        Raises:
            FencedOut: when the writer no longer leads.
        """
        kv = kv_of(self._client)
        key = self.keys.drain(kind, target_id)
        resp = await self._txn(
            [compare_exists(key), fence.compare()],
            [kv.txn_op_delete(key)],
            [kv.txn_op_get(key), kv.txn_op_get(fence.leader_key)],
        )
        if resp.succeeded:
            return True
        self._check_fence(resp, fence)
        return False

    async def put_autoscale(self, record: AutoscaleRecord, fence: Fence) -> None:
        """Write the autoscaler's record of one model, only while ``fence`` holds.

        Raises:
            FencedOut: when the writer no longer leads.
        """
        kv = kv_of(self._client)
        resp = await self._txn(
            [fence.compare()], [kv.txn_op_put(self.keys.autoscale(record.model), encode(record))], []
        )
        if not resp.succeeded:  # the only comparison is the fence
            raise FencedOut(f"leader key {fence.leader_key} no longer has fencing token {fence.token}")

    @staticmethod
    def _check_fence(resp: Any, fence: Fence) -> None:
        leader_kvs = list(resp.responses[1].response_range.kvs)
        if not leader_kvs or int(leader_kvs[0].create_revision) != fence.token:
            raise FencedOut(f"leader key {fence.leader_key} no longer has fencing token {fence.token}")


class SummaryPublisher:
    """Rate-limited publication of one domain's summary under its registrar's lease.

    ``offer()`` keeps only the latest summary; the ``run()`` loop writes it at most once per
    ``min_interval_s`` (latest wins, unchanged summaries are not re-written).
    """

    def __init__(
        self,
        registrar: Registrar,
        keys: Keys,
        domain_id: str,
        *,
        min_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_interval_s <= 0:
            raise ValueError(f"min_interval_s must be > 0, got {min_interval_s}")
        self._registrar = registrar
        self._key = keys.summary(domain_id)
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._latest: SummaryRecord | None = None
        self._written: SummaryRecord | None = None
        self._wake = asyncio.Event()
        self.puts = 0  # summaries written so far

    def offer(self, summary: SummaryRecord) -> None:
        """Hand over the newest summary; it is written within ``min_interval_s``."""
        self._latest = summary
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Publish until ``stop`` is set."""
        last_put = -float("inf")
        while not stop.is_set():
            waiter = asyncio.ensure_future(self._wake.wait())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                stopper.cancel()
            if stop.is_set():
                return
            await asyncio.sleep(max(0.0, last_put + self._min_interval_s - self._clock()))
            self._wake.clear()
            latest = self._latest
            if latest is None or (self._written is not None and _same_content(latest, self._written)):
                continue
            await self._registrar.set(self._key, encode(latest))
            self._written = latest
            last_put = self._clock()
            self.puts += 1


def _same_content(a: SummaryRecord, b: SummaryRecord) -> bool:
    """Equal but for when each summary was taken (``policy.summarize.same_content``: not written again, so readers
    keep the earlier one; the simulator delivers the earlier one too)."""
    return a.domain_id == b.domain_id and same_content(a.summaries, b.summaries)


def _entry(kv: Any) -> Entry:  # kv: mvccpb.KeyValue
    return Entry(bytes(kv.value), int(kv.mod_revision), int(kv.create_revision), int(kv.lease))


class ClusterView:
    """A local copy of every key under the prefix that converges to etcd's contents.

    ``run()`` lists the prefix, then watches from the list revision + 1. After a watch that ends or fails
    (etcd restarted or unreachable), a compaction that overtook the watch, a cancelled watch or an etcd error, it
    lists again (retrying with jittered backoff) and watches from the new revision. Changes are applied
    in revision order; readers see a consistent snapshot at :attr:`revision`.
    """

    def __init__(
        self,
        client: Etcd3Client,
        keys: Keys,
        *,
        rng: random.Random,
        backoff: BackoffConfig | None = None,
        on_listed: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """``on_listed(revision)`` is awaited after each list, before the watch starts (metrics, tests)."""
        self._client = client
        self.keys = keys
        self._on_listed = on_listed
        self._backoff = Backoff(backoff or BackoffConfig(), rng)
        self._entries: dict[str, Entry] = {}
        self.revision = 0  # etcd revision the view reflects
        self.synced = asyncio.Event()  # set after the first successful list
        self.relists: dict[str, int] = {}  # cause -> count ("initial", "compacted", "canceled", "ended", "error")
        self._changed = asyncio.Condition()
        self.version = 0  # bumped on every change the view applies

    # ---- reading -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, bytes]:
        """Every key and value the view holds."""
        return {k: e.value for k, e in self._entries.items()}

    def entries(self, sub: str) -> dict[str, Entry]:
        """Entries whose key starts with ``prefix + sub``."""
        start = self.keys.prefix + sub
        return {k: e for k, e in self._entries.items() if k.startswith(start)}

    def _decoded(self, sub: str, cls: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, entry in self.entries(sub).items():
            try:
                out[key] = decode(cls, entry.value, key)
            except RecordError as exc:
                _log.warning("ignoring bad record: %s", exc)
        return out

    def domains(self) -> dict[str, DomainRegistration]:
        return {r.domain_id: r for r in self._decoded("domains/", DomainRegistration).values()}

    def instances(self) -> dict[str, InstanceRegistration]:
        return {r.instance_id: r for r in self._decoded("instances/", InstanceRegistration).values()}

    def summaries(self) -> dict[str, SummaryRecord]:
        return {r.domain_id: r for r in self._decoded("summaries/", SummaryRecord).values()}

    def migrations(self) -> dict[str, tuple[MigrationRecord, int]]:
        """migration_id -> (record, mod revision)."""
        out: dict[str, tuple[MigrationRecord, int]] = {}
        for key, record in self._decoded("migrations/", MigrationRecord).items():
            out[record.migration_id] = (record, self._entries[key].mod_revision)
        return out

    def drains(self) -> dict[tuple[DrainKind, str], DrainIntent]:
        return {(r.kind, r.target_id): r for r in self._decoded("drains/", DrainIntent).values()}

    def autoscale(self) -> dict[str, AutoscaleRecord]:
        """model -> the autoscaler's record."""
        return {r.model: r for r in self._decoded("autoscale/", AutoscaleRecord).values()}

    async def wait_changed(self, seen_version: int) -> int:
        """Wait until :attr:`version` differs from ``seen_version``; return the new version."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != seen_version)
            return self.version

    async def wait_revision(self, revision: int) -> None:
        """Wait until the view reflects at least ``revision``."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.revision >= revision)

    # ---- maintaining -----------------------------------------------------------------------------
    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def list_at(self, revision: int) -> None:
        """Hold the prefix's contents as etcd had them at ``revision`` (a past one; nothing is watched): what
        any view that reflects ``revision`` holds, so a checker can compare a replica's answers, stamped with
        their view's revision, against etcd itself.

        Raises:
            ValueError: ``revision`` < 1.
            etcd3aio.EtcdError: ``revision`` was compacted away or is in the future; or a RETRYABLE_ERRORS one.
        """
        if revision < 1:
            raise ValueError(f"list_at: revision must be >= 1, got {revision}")
        await self._read(revision)
        self.revision = revision
        await self._bump()

    async def _read(self, revision: int = 0) -> int:
        """Replace the entries by the prefix's contents at ``revision`` (0: now); the revision read."""
        prefix = self.keys.prefix
        kv = kv_of(self._client)
        resp = await kv.get(prefix, range_end=prefix_range_end(prefix), revision=revision, timeout=_RPC_TIMEOUT_S)
        self._entries = {bytes(item.key).decode(): _entry(item) for item in resp.kvs}
        return int(resp.header.revision)

    async def _list(self, cause: str) -> int:
        self.revision = await self._read()
        self.relists[cause] = self.relists.get(cause, 0) + 1
        self.synced.set()
        await self._bump()
        return self.revision

    async def _watch(self, start_revision: int) -> str:
        """Apply watch events until the view must re-list; return why."""
        prefix = self.keys.prefix
        stream = watch(self._client, prefix, range_end=prefix_range_end(prefix), start_revision=start_revision)
        async with contextlib.aclosing(stream):
            async for resp in stream:
                if resp.compact_revision > 0:
                    return "compacted"
                if resp.canceled:
                    return "canceled"
                for ev in resp.events:
                    key = bytes(ev.kv.key).decode()
                    if ev.type == _EVENT_DELETE:
                        self._entries.pop(key, None)
                    else:
                        self._entries[key] = _entry(ev.kv)
                revision = int(resp.header.revision)
                if resp.events or revision > self.revision:
                    self.revision = max(self.revision, revision)
                    await self._bump()
        return "ended"

    async def run(self) -> None:
        """Keep the view converged until cancelled."""
        cause = "initial"
        while True:
            try:
                revision = await self._list(cause)
                if failures := self._backoff.reset():
                    _log.log(RECOVERED_LEVEL, "cluster view: etcd answers again after %s", failed_attempts(failures))
                if self._on_listed is not None:
                    await self._on_listed(revision)
                cause = await self._watch(revision + 1)
                _log.info("cluster view: re-listing after watch %s at revision %d", cause, self.revision)
            except asyncio.CancelledError:
                raise
            except RETRYABLE_ERRORS as exc:
                delay = self._backoff.next_s()
                _log.log(
                    self._backoff.level(),
                    "cluster view: etcd error (%s), attempt %d; re-listing in %.2f s: check that etcd runs and "
                    "that --etcd names its client address",
                    error_line(exc),
                    self._backoff.failures,
                    delay,
                )
                cause = "error"
                await asyncio.sleep(delay)

    @contextlib.asynccontextmanager
    async def running(self) -> Any:
        """``async with view.running():`` runs the view in a task for the block, synced on entry."""
        task = asyncio.create_task(self.run(), name="cluster-view")
        try:
            await self.synced.wait()
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
