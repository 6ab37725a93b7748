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
    "dispatch_freeness_of",
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


def dispatch_freeness_of(capacity_blocks: float, usage_blocks: float, num_running: int, num_waiting: int) -> float:
    """F for dispatch: (M − ΣV) / max(1, running + waiting) when M >= ΣV, (M − ΣV) / max(1, M) below zero; −inf
    when ΣV is +inf. ΣV is the dispatch ΣV (:func:`dispatch_usage`: every queued request's demand counts).

    At or above zero this is Llumnix's dispatch load (``llumnix/instance_info.py``): the room per request, running
    or queued, blocks per request. Below zero it is the share of its KV capacity the target is short (−0.1: a
    deficit of a tenth of M), whatever the number of requests. Llumnix divides the deficit by running + waiting
    there too, which ranks a target freer the more requests queue on it (40 blocks short with 10 running is −1.3
    behind 20 queued requests, −3.3 behind 2), so under a long overload dispatch kept feeding the longest queue
    (docs/policy.md, "Freeness"). A count in either direction misleads below zero: dividing rewards a long queue
    or a long batch, multiplying holds a larger instance's longer batch against it; the queue's demand is in the
    deficit already. F stays decreasing in ΣV and continuous at zero, and every F >= 0 ranks above every F < 0.
    """
    free = capacity_blocks - usage_blocks
    if free >= 0:
        return free / max(1, num_running + num_waiting)
    return free / max(1.0, capacity_blocks)


def dispatch_freeness(load: InstanceLoad, cfg: PolicyConfig) -> float:
    """F for dispatch (:func:`dispatch_freeness_of`) of one instance."""
    return dispatch_freeness_of(load.capacity_blocks, dispatch_usage(load, cfg), load.num_running, load.num_waiting)
