"""rack_sched — the domain scheduler: one per NVLink domain (DESIGN.md; docs/control-plane.md, "Domain scheduler").

Dispatch, the intra-domain rescheduling loop, domain summaries, cross-domain proposals and drains over the
exact, pushed loads of the domain's llumlets. ``python -m rack_sched`` runs one (``rack_sched.cli``).
"""

from __future__ import annotations

from rack_sched.core import DomainScheduler
from rack_sched.plan import CrossDomainMove, demand_blocks, drained_instances, plan_cross_domain
from rack_sched.types import (
    DispatchOutcome,
    DispatchResult,
    DomainStateInfo,
    InstanceStateInfo,
    RackConfig,
    SubmitSpec,
)

__all__ = [
    "CrossDomainMove",
    "DispatchOutcome",
    "DispatchResult",
    "DomainScheduler",
    "DomainStateInfo",
    "InstanceStateInfo",
    "RackConfig",
    "SubmitSpec",
    "demand_blocks",
    "drained_instances",
    "plan_cross_domain",
]
