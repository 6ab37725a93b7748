"""Domain (group) summaries: the same virtual-usage rule applied to a group of instances.

A domain scheduler publishes one `DomainSummary` per model its NVLink domain serves; the gateway and the
coordinator apply dispatch and pairing to these exactly as a domain scheduler does to instances. It is the
one summary type from the rule book to etcd, to the wire and back (no near-copies): it carries a brief of
every instance, so the coordinator can choose a destination instance by its real free space.

The summaries are made from load reports by :mod:`policy.summarize` (kept apart: the simulator compiles it,
while these value types stay plain Python for the codecs that read their type hints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policy.usage import freeness_of

__all__ = ["DomainSummary", "InstanceBrief"]


@dataclass(frozen=True, slots=True)
class InstanceBrief:
    """One instance inside its domain's summary, as its domain scheduler sees it (exact, fresh).

    Raises ValueError on a negative count or free space above capacity.
    """

    instance_id: str
    capacity_blocks: int  # M: its KV cache capacity, blocks
    free_blocks: int  # real free blocks now (M − used, reservations counted as used)
    virtual_usage: float  # its ΣV (policy.usage.instance_virtual_usage); +inf while draining
    num_running: int  # requests in its running batch
    num_waiting: int  # requests queued on it
    draining: bool  # its domain scheduler applies a drain intent to it
    decode_step_s: float = 0.0  # its most recent step time, seconds (0 = not measured)
    max_num_seqs: int = 0  # its batch slots (InstanceLoad.max_num_seqs; 0 = not known)
    prefix_hashes: frozenset[int] = frozenset()  # prefix blocks it holds (InstanceLoad.prefix_hashes, shared)
    prefill_s_per_token: float = 0.0  # its engine's prefill estimate per token, s (InstanceLoad's; 0 = none)

    def __post_init__(self) -> None:
        where = f"InstanceBrief({self.instance_id!r})"
        if not isinstance(self.prefix_hashes, frozenset):
            object.__setattr__(self, "prefix_hashes", frozenset(self.prefix_hashes))
        for name in ("capacity_blocks", "num_running", "num_waiting", "max_num_seqs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{where}: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.free_blocks <= self.capacity_blocks:
            raise ValueError(f"{where}: free_blocks {self.free_blocks} outside [0, {self.capacity_blocks}]")
        if math.isnan(self.virtual_usage):
            raise ValueError(f"{where}: virtual_usage must not be NaN")
        if not (math.isfinite(self.prefill_s_per_token) and self.prefill_s_per_token >= 0):
            raise ValueError(f"{where}: prefill_s_per_token must be finite and >= 0, got {self.prefill_s_per_token}")

    @property
    def used_blocks(self) -> int:
        """Blocks held now (M − free)."""
        return self.capacity_blocks - self.free_blocks

    @property
    def takes_one_more(self) -> bool:
        """A slot for one more running request beside the head of its own queue (``InstanceLoad.takes_one_more``,
        the same rule): always True when its slot limit is not known."""
        return self.max_num_seqs == 0 or self.num_running + 1 + (self.num_waiting > 0) <= self.max_num_seqs

    @property
    def freeness(self) -> float:
        """Its freeness F = (M − ΣV) / max(1, running) (−inf while draining)."""
        return -math.inf if self.draining else freeness_of(self.capacity_blocks, self.virtual_usage, self.num_running)


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
    model: str = ""  # the model these instances serve ("" = not known)
    taken_s: float = 0.0  # when it was computed, on the publisher's clock (a gateway keeps later reservations)
    instances: tuple[InstanceBrief, ...] = ()  # every instance of the group, sorted by instance_id
    # prefix blocks some non-draining instance of the group holds: the union of their briefs' prefix_hashes,
    # derived from ``instances`` whenever they list any (what is given is then ignored; a codec stores it only
    # without them: its ``derived_from`` metadata); a gateway prefers the domain holding a request's prefix
    prefix_hashes: frozenset[int] = field(default=frozenset(), metadata={"derived_from": "instances"})

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
        if not math.isfinite(self.taken_s):
            raise ValueError(f"{where}: taken_s must be a finite time in seconds, got {self.taken_s}")
        object.__setattr__(self, "instances", tuple(self.instances))
        ids = [i.instance_id for i in self.instances]
        if ids != sorted(set(ids)):
            raise ValueError(f"{where}: instances must be sorted by id without repeats, got {ids}")
        held = [i.prefix_hashes for i in self.instances if i.prefix_hashes and not i.draining]
        if self.instances:
            union = frozenset().union(*held) if len(held) > 1 else (held[0] if held else frozenset())
            object.__setattr__(self, "prefix_hashes", union)
        elif not isinstance(self.prefix_hashes, frozenset):
            object.__setattr__(self, "prefix_hashes", frozenset(self.prefix_hashes))
