"""policy — the virtual-usage rule book (Llumnix OSDI'24 §4.4), pure: no I/O, no clocks, no hilum imports.

Applied to instances by a domain scheduler and the simulator, and to domains by the coordinator and
the gateway. Rules and sources: docs/policy.md.
"""

from __future__ import annotations

from policy.dispatch import DispatchDecision, DispatchView, DomainDispatchView, leading_run, reusable_prefix_hashes
from policy.domain import DomainSummary, InstanceBrief
from policy.load import InstanceLoad, RequestLoad
from policy.migration import (
    CandidateOrder,
    MigrationDecision,
    candidate_order,
    move_lowers_potential,
    pair_domains,
    plan_migrations,
    potential,
)
from policy.ordering import freest_first, fullest_first
from policy.summarize import summarize_domain
from policy.types import CANDIDATE_POLICIES, DEFAULT_CANDIDATE_POLICY, PolicyConfig
from policy.usage import batch_size, freeness, freeness_of, instance_virtual_usage, request_virtual_usage

__all__ = [
    "CANDIDATE_POLICIES",
    "DEFAULT_CANDIDATE_POLICY",
    "CandidateOrder",
    "DispatchDecision",
    "DispatchView",
    "DomainDispatchView",
    "DomainSummary",
    "InstanceBrief",
    "InstanceLoad",
    "MigrationDecision",
    "PolicyConfig",
    "RequestLoad",
    "batch_size",
    "candidate_order",
    "freeness",
    "freeness_of",
    "freest_first",
    "fullest_first",
    "instance_virtual_usage",
    "leading_run",
    "move_lowers_potential",
    "pair_domains",
    "plan_migrations",
    "potential",
    "request_virtual_usage",
    "reusable_prefix_hashes",
    "summarize_domain",
]
