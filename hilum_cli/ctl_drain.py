"""``hilumctl drain``: which target a name means, and when a drained target is empty and safe to stop.

Both are pure functions of admin-API replies (``ListInstances``, ``ListDomains``, ``ListMigrations``,
``GetTopology``), so they are tested without a coordinator.

Empty means, from what the domain scheduler publishes (its summary, with each instance's load):

- an instance: its domain scheduler reports it ``draining`` (it applies the drain, so nothing new is
  dispatched there), with no running and no queued requests, and no cross-domain migration from or to it
  is proposed or approved. An instance that is not registered (its llumlet's lease is gone) is empty.
- a domain: its summary reports it ``draining`` (every instance drained; or it has no instances), with no
  running and no queued requests, and no cross-domain migration from or to it is proposed or approved.
  A domain with neither a registered scheduler nor registered instances is empty.

Without a published load the target is never called empty: the domain scheduler (rack_sched) is the only
source of exact per-instance load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hilum_proto.v1 import coordinator_pb2 as pb

__all__ = ["DrainProgress", "domain_progress", "instance_progress", "resolve_target"]

_ACTIVE = (pb.MIGRATION_STATE_PROPOSED, pb.MIGRATION_STATE_APPROVED)


@dataclass(frozen=True, slots=True)
class DrainProgress:
    """How far a drain has come, as the coordinator's view shows it."""

    empty: bool  # no running or queued requests, no migrations in flight: safe to stop
    num_running: int | None  # running requests on the target; None when no load is published
    num_waiting: int | None  # queued requests on the target; None when no load is published
    active_migrations: int  # proposed or approved cross-domain migrations from or to the target
    detail: str  # what the drain still waits for, or why it is empty, in words

    def to_json(self) -> dict[str, Any]:
        """The ``wait`` object of ``drain --wait --json`` (``waited_s`` is added by the caller)."""
        return {
            "empty": self.empty,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "active_migrations": self.active_migrations,
            "detail": self.detail,
        }


def _in_flight(migrations: Sequence[pb.Migration], *, instance: str = "", domain: str = "") -> int:
    def touches(m: pb.Migration) -> bool:
        if instance:
            return instance in (m.src_instance_id, m.dst_instance_id)
        return domain in (m.src_domain_id, m.dst_domain_id)

    return sum(1 for m in migrations if m.state in _ACTIVE and touches(m))


def _verdict(
    what: str, running: int, waiting: int, moving: int, applied: bool, scheduler: str
) -> DrainProgress:  # fmt: skip
    if not applied:
        return DrainProgress(
            False, running, waiting, moving, f"{what}: {scheduler} has not applied the drain yet"
        )  # fmt: skip
    busy = []
    if running:
        busy.append(f"{running} running")
    if waiting:
        busy.append(f"{waiting} queued")
    if moving:
        busy.append(f"{moving} cross-domain migration{'' if moving == 1 else 's'} in flight")
    if busy:
        return DrainProgress(False, running, waiting, moving, f"{what}: {', '.join(busy)}")
    return DrainProgress(True, 0, 0, 0, f"{what} is empty: no running or queued requests, no migrations in flight")


def instance_progress(
    instance_id: str, instances: Sequence[pb.InstanceInfo], migrations: Sequence[pb.Migration]
) -> DrainProgress:
    """Drain progress of one instance (see the module docstring for what empty means)."""
    info = next((i for i in instances if i.instance_id == instance_id), None)
    moving = _in_flight(migrations, instance=instance_id)
    what = f"instance {instance_id}"
    if info is None:
        if moving:
            return DrainProgress(False, None, None, moving, f"{what} is not registered but has migrations in flight")
        return DrainProgress(True, 0, 0, 0, f"{what} is not registered (its llumlet is gone): nothing runs there")
    scheduler = f"the domain scheduler of {info.domain_id}"
    if not info.has_load:
        return DrainProgress(
            False, None, None, moving, f"{what}: no load published for it yet (is {scheduler} (rack_sched) running?)"
        )
    load = info.load
    return _verdict(what, load.num_running, load.num_waiting, moving, load.draining, scheduler)


def domain_progress(
    domain_id: str,
    domains: Sequence[pb.DomainInfo],
    instances: Sequence[pb.InstanceInfo],
    migrations: Sequence[pb.Migration],
) -> DrainProgress:
    """Drain progress of a whole domain (see the module docstring for what empty means)."""
    info = next((d for d in domains if d.domain_id == domain_id), None)
    moving = _in_flight(migrations, domain=domain_id)
    members = [i for i in instances if i.domain_id == domain_id]
    what = f"domain {domain_id}"
    scheduler = f"the domain scheduler of {domain_id}"
    if info is None or not info.summaries:
        if (info is None or not info.registered) and not members and not moving:
            return DrainProgress(True, 0, 0, 0, f"{what}: no domain scheduler and no instances registered")
        return DrainProgress(
            False, None, None, moving, f"{what}: no load summary yet (is {scheduler} (rack_sched) running?)"
        )
    applied = all(s.draining or s.num_instances == 0 for s in info.summaries)
    running = sum(s.num_running for s in info.summaries)
    waiting = sum(s.num_waiting for s in info.summaries)
    return _verdict(what, running, waiting, moving, applied, scheduler)


def resolve_target(
    name: str,
    instances: Sequence[pb.InstanceInfo],
    domains: Sequence[pb.DomainInfo],
    topology: pb.TopologyReply,
) -> str:
    """What ``name`` names: ``"instance"``, ``"domain"``, ``"ambiguous"`` (both) or ``"unknown"`` (neither).

    A name is an instance when one is registered under it or the topology lists one; a domain likewise
    (registered, summarised, named by a drain intent, or in the topology).
    """
    instance_ids = {i.instance_id for i in instances}
    domain_ids = {d.domain_id for d in domains}
    for d in topology.domains:
        domain_ids.add(d.domain_id)
        instance_ids.update(i.instance_id for i in d.instances)
    is_instance, is_domain = name in instance_ids, name in domain_ids
    if is_instance and is_domain:
        return "ambiguous"
    if is_instance:
        return "instance"
    return "domain" if is_domain else "unknown"
