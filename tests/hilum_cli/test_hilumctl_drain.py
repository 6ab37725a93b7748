"""When `hilumctl drain --wait` calls a target empty, and what a drain target name means (no coordinator)."""

from __future__ import annotations

import pytest

from hilum_cli.ctl_drain import DrainProgress, domain_progress, instance_progress, resolve_target
from hilum_proto.v1 import coordinator_pb2 as pb

APPROVED, COMMITTED, PROPOSED = pb.MIGRATION_STATE_APPROVED, pb.MIGRATION_STATE_COMMITTED, pb.MIGRATION_STATE_PROPOSED


def inst(iid: str, domain: str = "d0", load: tuple[int, int, bool] | None = None) -> pb.InstanceInfo:
    """An instance; ``load`` = (running, waiting, drain applied by its scheduler)."""
    msg = pb.InstanceInfo(instance_id=iid, domain_id=domain, has_load=load is not None)
    if load is not None:
        msg.load.CopyFrom(pb.InstanceBrief(capacity_blocks=100, free_blocks=100 - 10 * load[0], num_running=load[0],
                                           num_waiting=load[1], draining=load[2]))  # fmt: skip
    return msg


def dom(did: str, summary: tuple[int, int, int, bool] | None = None, registered: bool = True) -> pb.DomainInfo:
    """A domain; ``summary`` = (instances, running, waiting, draining)."""
    msg = pb.DomainInfo(domain_id=did, registered=registered)
    if summary is not None:
        n, running, waiting, draining = summary
        msg.summaries.append(
            pb.DomainSummary(
                domain_id=did, num_instances=n, num_running=running, num_waiting=waiting, draining=draining
            )
        )
    return msg


def mig(src: str, dst: str, state: int = APPROVED) -> pb.Migration:
    return pb.Migration(
        migration_id=f"{src}>{dst}", src_instance_id=src, dst_instance_id=dst, src_domain_id=src[:2],
        dst_domain_id=dst[:2], state=state,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("instances", "migrations", "expected"),
    [
        # not registered: gone, nothing runs there
        ([], [], (True, 0, 0, 0)),
        # registered, but no load published: never empty
        ([inst("d0-a")], [], (False, None, None, 0)),
        # idle but the scheduler has not applied the drain: something may still be dispatched there
        ([inst("d0-a", load=(0, 0, False))], [], (False, 0, 0, 0)),
        ([inst("d0-a", load=(2, 1, True))], [], (False, 2, 1, 0)),
        ([inst("d0-a", load=(0, 0, True))], [mig("d0-a", "d1-b")], (False, 0, 0, 1)),
        ([inst("d0-a", load=(0, 0, True))], [mig("d1-b", "d0-a", PROPOSED)], (False, 0, 0, 1)),
        # terminal migrations and other instances' migrations do not count
        ([inst("d0-a", load=(0, 0, True))], [mig("d0-a", "d1-b", COMMITTED), mig("d0-c", "d1-b")], (True, 0, 0, 0)),
    ],
)
def test_instance_progress(
    instances: list[pb.InstanceInfo], migrations: list[pb.Migration], expected: tuple[object, ...]
) -> None:
    p = instance_progress("d0-a", instances, migrations)
    assert (p.empty, p.num_running, p.num_waiting, p.active_migrations) == expected


def test_instance_progress_says_what_it_waits_for() -> None:
    busy = instance_progress("d0-a", [inst("d0-a", load=(2, 1, True))], [mig("d0-a", "d1-b")])
    assert busy.detail == "instance d0-a: 2 running, 1 queued, 1 cross-domain migration in flight"
    assert instance_progress("d0-a", [inst("d0-a")], []).detail == (
        "instance d0-a: no load published for it yet (is the domain scheduler of d0 (rack_sched) running?)"
    )
    done = instance_progress("d0-a", [inst("d0-a", load=(0, 0, True))], [])
    assert done == DrainProgress(
        True, 0, 0, 0, "instance d0-a is empty: no running or queued requests, no migrations in flight"
    )
    assert done.to_json() == {
        "empty": True, "num_running": 0, "num_waiting": 0, "active_migrations": 0, "detail": done.detail,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("domains", "instances", "migrations", "expected"),
    [
        ([], [], [], (True, 0, 0, 0)),  # nothing registered
        ([dom("d0", registered=True)], [], [], (False, None, None, 0)),  # a scheduler, no summary yet
        ([dom("d0", registered=False)], [inst("d0-a")], [], (False, None, None, 0)),  # instances, no summary
        ([dom("d0", (2, 3, 1, False))], [], [], (False, 3, 1, 0)),  # drain not applied
        ([dom("d0", (2, 3, 1, True))], [], [], (False, 3, 1, 0)),
        ([dom("d0", (2, 0, 0, True))], [], [mig("d1-b", "d0-a")], (False, 0, 0, 1)),
        ([dom("d0", (2, 0, 0, True))], [], [mig("d1-b", "d2-a")], (True, 0, 0, 0)),
        ([dom("d0", (0, 0, 0, False))], [], [], (True, 0, 0, 0)),  # no instances: nothing to drain
    ],
)
def test_domain_progress(
    domains: list[pb.DomainInfo],
    instances: list[pb.InstanceInfo],
    migrations: list[pb.Migration],
    expected: tuple[object, ...],
) -> None:
    p = domain_progress("d0", domains, instances, migrations)
    assert (p.empty, p.num_running, p.num_waiting, p.active_migrations) == expected


def test_resolve_target() -> None:
    topo = pb.TopologyReply(
        loaded=True,
        domains=[pb.TopologyDomain(domain_id="t0", instances=[pb.TopologyInstance(instance_id="t0-i0")])],
    )
    instances, domains = [inst("d0-a"), inst("x")], [dom("d0"), dom("x")]
    assert resolve_target("d0-a", instances, domains, topo) == "instance"
    assert resolve_target("t0-i0", instances, domains, topo) == "instance"  # only in the topology
    assert resolve_target("d0", instances, domains, topo) == "domain"
    assert resolve_target("t0", instances, domains, topo) == "domain"
    assert resolve_target("x", instances, domains, topo) == "ambiguous"
    assert resolve_target("nope", instances, domains, topo) == "unknown"
