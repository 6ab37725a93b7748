"""Value types of the domain scheduler: its configuration, Submit outcomes and its state snapshot."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from clusterstate.backoff import BackoffConfig
from clusterstate.records import InstanceRegistration
from policy.load import InstanceLoad
from rack_sched.core import DomainConfig

__all__ = [
    "DispatchOutcome",
    "DispatchResult",
    "DomainStateInfo",
    "DomainTakenError",
    "InstanceStateInfo",
    "RackConfig",
]


class DomainTakenError(RuntimeError):
    """Another live domain scheduler holds the domain's registration. A state of the cluster, not a bad
    configuration: the daemon exits 1 for it, not 2, so its service manager restarts it (a crashed scheduler's
    registration goes with its lease)."""


@dataclass(frozen=True, slots=True)
class RackConfig:
    """How one domain scheduler runs. Times in seconds."""

    domain_id: str
    advertise_address: str  # host:port the gateway and tools reach its gRPC server at
    block_size_tokens: int  # KV block size of the domain's model (from the topology)
    prefix: str = "/hilum/v1/"  # etcd key prefix (clusterstate.store)
    ttl_s: int = 10  # lease TTL of its registration and summary
    decide: DomainConfig = field(default_factory=DomainConfig)  # the rule book and the domain's decision settings
    rebalance_interval_s: float = 0.05  # intra-domain rescheduling period (Llumnix: 50 ms)
    summary_interval_s: float = 0.25  # at most one summary put per this
    cross_interval_s: float = 0.5  # cross-domain round period
    watch_min_interval_s: float = 0.01  # asked of each llumlet's WatchLoad (coalescing)
    ready_timeout_s: float = 5.0  # longest wait for the first report of each instance after a start
    rpc_timeout_s: float = 5.0  # Submit, GetLoad, Release, ProposeMigration deadlines
    migrate_timeout_s: float = 120.0  # MigrateOut deadline
    coordinator_address: str = ""  # used when etcd names no leader
    backoff: BackoffConfig = field(default_factory=BackoffConfig)
    # Instances this scheduler registers in etcd itself, under its own lease, for llumlets that do not
    # register themselves (``--instance ID=HOST:PORT``). Each must name this domain.
    static_instances: tuple[InstanceRegistration, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if not self.domain_id or "/" in self.domain_id:
            problems.append(f"domain_id {self.domain_id!r} must be non-empty without '/'")
        if self.block_size_tokens < 1:
            problems.append(f"block_size_tokens must be >= 1, got {self.block_size_tokens}")
        if self.ttl_s < 2:
            problems.append(f"ttl_s must be >= 2 (etcd's minimum lease TTL), got {self.ttl_s}")
        for name in ("rebalance_interval_s", "summary_interval_s", "cross_interval_s", "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for reg in self.static_instances:
            if reg.domain_id != self.domain_id:
                problems.append(f"static instance {reg.instance_id} is in domain {reg.domain_id!r}, not this one")
        if problems:
            raise ValueError("RackConfig: " + "; ".join(problems))


class DispatchOutcome(enum.StrEnum):
    """Typed outcome of a Submit (rack_sched.proto DispatchOutcome)."""

    ACCEPTED = "accepted"  # submitted; the llumlet accepted it
    REFUSED = "refused"  # no instance of the domain can ever hold it, or the llumlet refused it
    UNAVAILABLE = "unavailable"  # not now (view rebuilding, no reachable instance): retry or go elsewhere
    FULL = "full"  # only_if_room, and no instance has room now: try another domain


@dataclass(frozen=True, slots=True)
class DispatchResult:
    """The answer to one Submit."""

    outcome: DispatchOutcome
    reason: str
    instance_id: str = ""
    instance_address: str = ""
    demand_blocks: int = 0


@dataclass(frozen=True, slots=True)
class InstanceStateInfo:
    """One instance as the scheduler sees it."""

    instance_id: str
    address: str
    connected: bool
    draining: bool
    load: InstanceLoad | None  # last report, drains applied; None before the first
    freeness: float  # F of that load (-inf while draining; nan without a load)
    load_version: int
    failure: str = ""  # why its engine failed ("" = healthy)


@dataclass(frozen=True, slots=True)
class DomainStateInfo:
    """The scheduler's state (GetDomainState)."""

    domain_id: str
    ready: bool
    domain_draining: bool
    instances: tuple[InstanceStateInfo, ...]
    migrations_in_flight: int
    migrations_committed: int
    migrations_aborted: int
    cross_domain_proposed: int
    cross_domain_approved: int
    summaries_published: int
    newest_fencing_token: int
    fallback_dispatches: int = 0  # requests spread evenly while no instance had a fresh load report
