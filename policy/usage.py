"""Virtual usage and freeness (Llumnix OSDI'24 §4.4.2, Algorithm 1).

Virtual usage expresses every scheduling goal as memory load, so one number drives dispatch and
migration: load balancing (real blocks), de-fragmentation (the head-of-line queued request's
demand), priorities (headroom), drain (infinite usage) and scale-out (negative warm-up usage).
"""

from __future__ import annotations

import math

from policy.load import InstanceLoad, RequestLoad
from policy.types import PolicyConfig

__all__ = [
    "batch_size",
    "dispatch_freeness",
    "dispatch_usage",
    "freeness",
    "freeness_of",
    "instance_virtual_usage",
    "queued_blocks",
    "request_virtual_usage",
]


def request_virtual_usage(request: RequestLoad, cfg: PolicyConfig) -> int:
    """V(r) = blocks held + headroom of its priority class, in blocks (Llumnix Alg. 1, GetHeadroom).

    Hilum charges the headroom per request; Llumnix divides a per-class headroom among the
    instance's requests of that class (see docs/policy.md).
    """
    return request.blocks + cfg.headroom_blocks(request.priority)


def instance_virtual_usage(load: InstanceLoad, cfg: PolicyConfig) -> float:
    """ΣV of an instance, in blocks; +inf when draining.

    ΣV = used_blocks + Σ_running headroom + head-of-line demand (if a request waits)
         + warmup_usage_blocks (if warming up, <= 0).
    Σ_running headroom = Σ_p headroom(p) × (running requests of priority p): ``load.priority_counts``.
    used_blocks stands for Σ real blocks so blocks reserved for incoming migrations count too.
    Source: Llumnix OSDI'24 §4.4.2 and Algorithm 1 (CalcVirtualUsage, fake requests).
    """
    if load.draining:
        return math.inf
    counts = load.priority_counts  # usually none: no generator then (a dispatch view rebuilds per report)
    headroom = sum(cfg.headroom_blocks(p) * n for p, n in counts) if counts else 0
    queued = load.head_demand_blocks if load.num_waiting > 0 else 0
    warmup = cfg.warmup_usage_blocks if load.warming_up else 0
    return float(load.used_blocks + headroom + queued + warmup)


def batch_size(load: InstanceLoad) -> int:
    """B = max(1, number of running requests): the divisor of freeness."""
    return max(1, load.num_running)


def freeness_of(capacity_blocks: float, virtual_usage_blocks: float, num_running: int) -> float:
    """F = (M − ΣV) / B with B = max(1, num_running); −inf when ΣV is +inf.

    Units: blocks per running request — roughly the decode steps the batch can still run before
    memory runs out (Llumnix OSDI'24 §4.4.2, CalcFreeness).
    """
    return (capacity_blocks - virtual_usage_blocks) / max(1, num_running)


def freeness(load: InstanceLoad, cfg: PolicyConfig) -> float:
    """Freeness F of one instance: (M − ΣV) / B. Never NaN; −inf when draining."""
    return freeness_of(load.capacity_blocks, instance_virtual_usage(load, cfg), load.num_running)


def queued_blocks(load: InstanceLoad) -> int:
    """Blocks every queued request of the instance needs (head included); 0 with an empty queue."""
    if load.num_waiting == 0:
        return 0
    return max(load.queued_demand_blocks, load.head_demand_blocks)


def dispatch_usage(load: InstanceLoad, cfg: PolicyConfig) -> float:
    """ΣV as dispatch sees it: the virtual usage with the demand of *every* queued request, not just the head.

    For migration only the head-of-line request counts (it is the one a move can make room for), but a
    new request joins the back of the queue, so dispatch must see the whole queue; otherwise an
    instance with a long queue of small requests looks free and attracts more. This is Llumnix's
    dispatch load (llumnix/instance_info.py: available blocks minus the blocks of all waiting requests,
    divided by running + waiting requests). +inf when draining.
    """
    if load.draining:
        return math.inf
    head = load.head_demand_blocks if load.num_waiting > 0 else 0
    return instance_virtual_usage(load, cfg) + (queued_blocks(load) - head)


def dispatch_freeness(load: InstanceLoad, cfg: PolicyConfig) -> float:
    """F for dispatch: (M − dispatch ΣV) / max(1, running + waiting)."""
    return freeness_of(load.capacity_blocks, dispatch_usage(load, cfg), load.num_running + load.num_waiting)
