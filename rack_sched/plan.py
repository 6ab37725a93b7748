"""The domain scheduler's decisions that are not in ``policy`` itself: pure, clock-free, no I/O.

- :func:`drained_instances`: which of the domain's instances a set of drain intents empties.
- :func:`plan_cross_domain`: the one move a domain proposes to the coordinator when ``policy.pair_domains``
  pairs it, as a source, with another domain.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from clusterstate.records import DrainKind
from policy.domain import DomainSummary
from policy.load import InstanceLoad, RequestLoad
from policy.migration import is_source_domain, pair_domains, plan_migrations
from policy.types import PolicyConfig

__all__ = ["CrossDomainMove", "drained_instances", "plan_cross_domain"]


def drained_instances(
    domain_id: str, instance_ids: Iterable[str], intents: Iterable[tuple[DrainKind, str]]
) -> frozenset[str]:
    """The instances of ``domain_id`` (among ``instance_ids``) that drain intents name.

    A domain intent for ``domain_id`` drains every instance; an instance intent drains that instance.
    Intents for other domains and unknown instances are ignored.
    """
    ids = frozenset(instance_ids)
    named: set[str] = set()
    for kind, target in intents:
        if kind is DrainKind.DOMAIN and target == domain_id:
            return ids
        if kind is DrainKind.INSTANCE and target in ids:
            named.add(target)
    return frozenset(named)


@dataclass(frozen=True, slots=True)
class CrossDomainMove:
    """A move this domain proposes: ``request`` (as its instance reported it) from ``src_instance_id``."""

    src_instance_id: str
    request: RequestLoad  # the request at planning time: blocks, tokens, output so far, limits
    src_decode_step_s: float  # the source's most recent step time, seconds (0 = not measured)
    dst_domain_id: str  # the domain pair_domains chose; the coordinator picks the instance
    reason: str
    src_prefix_block_tokens: int = 0  # tokens per hash block of the source's prefix cache (0: none)

    @property
    def request_id(self) -> str:
        """The request that moves."""
        return self.request.request_id


def _stand_in(summary: DomainSummary) -> InstanceLoad:
    """The destination domain as one instance: its freest instance (largest free space), empty batch."""
    capacity = max(1, summary.max_instance_capacity_blocks)
    free = min(capacity, max(0, summary.largest_free_blocks))
    return InstanceLoad(
        instance_id=f"domain:{summary.domain_id}", capacity_blocks=capacity, used_blocks=capacity - free
    )


def plan_cross_domain(
    mine: DomainSummary,
    others: Sequence[DomainSummary],
    loads: Sequence[InstanceLoad],
    cfg: PolicyConfig,
    rng: random.Random,
    details: Callable[[InstanceLoad], InstanceLoad] | None = None,
) -> CrossDomainMove | None:
    """The move to propose when ``pair_domains`` pairs this domain (``mine``) as a source, else None.

    The destination domain stands in as one instance, its freest (capacity ``max_instance_capacity_blocks``,
    ``largest_free_blocks`` free, no batch); ``plan_migrations`` over ``loads`` (this domain's instances that
    are not busy, drains applied) plus that stand-in chooses source and request by the same rules as inside a
    domain (candidate order, fits the free space, lowers the potential). Only a move to the stand-in is
    returned: when an instance of this domain is freer, the intra-domain loop balances instead. ``loads`` may
    be brief; ``details`` gives a brief source's detailed report (as in ``plan_migrations``).

    Raises:
        ValueError: on repeated domain or instance ids, or a brief source without ``details`` (from
            ``policy``).
    """
    if not is_source_domain(mine, cfg):  # never paired as a source: no need to look at the others
        return None
    pairs = pair_domains([mine, *others], cfg)
    dst_id = next((dst for src, dst in pairs if src == mine.domain_id), None)
    if dst_id is None:
        return None
    dst = next(s for s in others if s.domain_id == dst_id)
    stand_in = _stand_in(dst)
    looked_at: dict[str, InstanceLoad] = {}

    def detailed(load: InstanceLoad) -> InstanceLoad:
        assert details is not None
        looked_at[load.instance_id] = details(load)
        return looked_at[load.instance_id]

    # without ``details``, plan_migrations refuses a brief source itself
    for decision in plan_migrations([*loads, stand_in], cfg, rng, details=detailed if details else None):
        if decision.dst_id != stand_in.instance_id:
            continue
        src = looked_at.get(decision.src_id) or next(x for x in loads if x.instance_id == decision.src_id)
        request = next(r for r in src.running if r.request_id == decision.request_id)
        return CrossDomainMove(
            src_instance_id=decision.src_id,
            request=request,
            src_decode_step_s=src.decode_step_s,
            dst_domain_id=dst_id,
            reason=f"domains paired {mine.domain_id} -> {dst_id}; {decision.reason}",
            src_prefix_block_tokens=src.prefix_block_tokens,
        )
    return None
