"""Domain (group) summaries: the same virtual-usage rule applied to a group of instances.

A domain scheduler publishes one `DomainSummary` per NVLink domain; the gateway and the
coordinator apply dispatch and pairing to these exactly as a domain scheduler does to instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policy.types import InstanceLoad, PolicyConfig
from policy.usage import freeness_of, instance_virtual_usage, queued_blocks

__all__ = ["DomainSummary", "summarize_domain"]


@dataclass(frozen=True, slots=True)
class DomainSummary:
    """Load of one domain as one number plus the two figures a sum would hide.

    Raises ValueError on a negative count or a NaN usage/freeness.
    """

    domain_id: str
    num_instances: int  # all instances, draining ones included
    capacity_blocks: int  # Σ M over non-draining instances
    virtual_usage: float  # ΣV over non-draining instances + real blocks on draining ones; inf if draining
    freeness: float  # (capacity_blocks − virtual_usage) / max(1, num_running); −inf if draining
    largest_free_blocks: int  # max real free blocks (M − used) of one non-draining instance
    max_instance_capacity_blocks: int  # max M of one non-draining instance: the largest request it can hold
    num_running: int  # running requests in the domain, draining instances included
    num_waiting: int  # queued requests in the domain
    draining: bool  # every instance is draining (and there is at least one)
    queued_blocks: int = 0  # demand of queued requests behind each head of line (dispatch adds it to ΣV)

    def __post_init__(self) -> None:
        where = f"DomainSummary({self.domain_id!r})"
        counts = [
            "num_instances",
            "capacity_blocks",
            "largest_free_blocks",
            "max_instance_capacity_blocks",
            "queued_blocks",
        ]
        for name in [*counts, "num_running", "num_waiting"]:
            if getattr(self, name) < 0:
                raise ValueError(f"{where}: {name} must be >= 0, got {getattr(self, name)}")
        if math.isnan(self.virtual_usage) or math.isnan(self.freeness):
            raise ValueError(f"{where}: virtual_usage and freeness must not be NaN")


def summarize_domain(domain_id: str, loads: Sequence[InstanceLoad], cfg: PolicyConfig) -> DomainSummary:
    """Summarize the instances of one domain.

    F_domain = (Σ_active M − ΣV) / max(1, Σ running) — Llumnix's freeness (OSDI'24 §4.4.2) over the
    group. Draining instances add no capacity, and their real blocks (not +inf) count as usage,
    since those requests must find room elsewhere in the domain. A domain whose instances all drain
    is draining (ΣV = +inf, F = −inf). An empty domain is not draining and has no capacity.
    Raises ValueError when a load names another domain.
    """
    for load in loads:
        if load.domain_id and load.domain_id != domain_id:
            raise ValueError(
                f"summarize_domain({domain_id!r}): instance {load.instance_id!r} reports domain {load.domain_id!r}"
            )
    active = [load for load in loads if not load.draining]
    draining = bool(loads) and not active
    num_running = sum(len(load.running) for load in loads)
    capacity = sum(load.capacity_blocks for load in active)
    if draining:
        usage = math.inf
    else:
        usage = sum(instance_virtual_usage(load, cfg) for load in active)
        usage += sum(load.used_blocks for load in loads if load.draining)
    return DomainSummary(
        domain_id=domain_id,
        num_instances=len(loads),
        capacity_blocks=capacity,
        virtual_usage=usage,
        freeness=freeness_of(capacity, usage, num_running),
        largest_free_blocks=max((load.free_blocks for load in active), default=0),
        max_instance_capacity_blocks=max((load.capacity_blocks for load in active), default=0),
        num_running=num_running,
        num_waiting=sum(load.num_waiting for load in loads),
        draining=draining,
        queued_blocks=sum(
            queued_blocks(load) - (load.head_demand_blocks if load.num_waiting else 0) for load in active
        ),
    )
