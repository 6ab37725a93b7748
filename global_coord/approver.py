"""Choosing and judging a cross-domain move: candidates, link budgets, the judge seam. Pure, no I/O.

The coordinator asks a :class:`MoveJudge` about each candidate destination in order; the judge applies
the cost model and the approval rule (``global_coord.approval.judge_move`` over ``topology.cost``; wired
in ``global_coord.wiring``). Link budgets are counted here from the migrations recorded in etcd, so they
are rebuilt after any restart: every proposed or approved migration holds one flow on each link of its
path until it is committed or aborted.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from clusterstate.records import (
    ACTIVE_STATES,
    DrainIntent,
    DrainKind,
    InstanceRegistration,
    MigrationRecord,
    SummaryRecord,
)

__all__ = [
    "Choice",
    "Judgement",
    "MoveJudge",
    "MoveProposal",
    "PathLike",
    "PathOf",
    "busiest_link_flows",
    "candidate_destinations",
    "choose_destination",
    "link_flows",
]


@dataclass(frozen=True, slots=True)
class MoveProposal:
    """A domain scheduler's request to move one running request to another domain."""

    proposer_domain_id: str
    request_id: str
    attempt: int  # grows with each new attempt for the same request
    src_instance_id: str
    dst_instance_id: str  # "" = the coordinator chooses
    blocks: int  # KV blocks the request holds now
    num_tokens: int  # tokens whose KV it holds
    remaining_tokens: int  # output tokens still to produce (estimate)
    decode_step_s: float  # the source's current decode step time, seconds

    def __post_init__(self) -> None:
        problems = []
        for name in ("proposer_domain_id", "request_id", "src_instance_id"):
            if not getattr(self, name):
                problems.append(f"{name} is empty")
        for name in ("attempt", "blocks", "num_tokens", "remaining_tokens"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (self.decode_step_s > 0 and math.isfinite(self.decode_step_s)):
            problems.append(f"decode_step_s must be a positive number, got {self.decode_step_s}")
        if problems:
            raise ValueError("MigrationProposal: " + "; ".join(problems))


class PathLike(Protocol):
    """What the coordinator needs of a path between two instances (``topology.graph.PathInfo`` fits)."""

    @property
    def bandwidth_bytes_per_s(self) -> float: ...
    @property
    def links(self) -> tuple[str, ...]: ...
    @property
    def same_domain(self) -> bool: ...


PathOf = Callable[[str, str], PathLike]  # (src_instance_id, dst_instance_id) -> path


@dataclass(frozen=True, slots=True)
class Judgement:
    """A judge's answer for one candidate destination."""

    approved: bool
    reason: str
    transfer_s: float = 0.0  # expected transfer time, seconds
    downtime_s: float = 0.0  # expected downtime, seconds


class MoveJudge(Protocol):
    """Prices and judges moving ``move`` to ``dst_instance_id`` over ``path``."""

    def __call__(
        self, move: MoveProposal, dst_instance_id: str, path: PathLike, busiest_link_flows: int
    ) -> Judgement: ...


@dataclass(frozen=True, slots=True)
class Choice:
    """The destination chosen (or None) and the judgement that decided."""

    dst_instance_id: str | None
    path: PathLike | None
    judgement: Judgement


def link_flows(migrations: Iterable[MigrationRecord]) -> Counter[str]:
    """Flows per link held by active (proposed or approved) migrations."""
    flows: Counter[str] = Counter()
    for record in migrations:
        if record.state in ACTIVE_STATES:
            flows.update(set(record.links))
    return flows


def busiest_link_flows(links: Iterable[str], flows: Mapping[str, int]) -> int:
    """The most flows on any of ``links`` (0 for a path with no links)."""
    return max((flows.get(link, 0) for link in links), default=0)


def _draining(inst: InstanceRegistration, drains: Mapping[tuple[DrainKind, str], DrainIntent]) -> bool:
    return (DrainKind.INSTANCE, inst.instance_id) in drains or (DrainKind.DOMAIN, inst.domain_id) in drains


def candidate_destinations(
    move: MoveProposal,
    src_domain_id: str,
    instances: Mapping[str, InstanceRegistration],
    summaries: Mapping[str, SummaryRecord],
    drains: Mapping[tuple[DrainKind, str], DrainIntent],
) -> list[str]:
    """Destination instances to try, best first.

    Rules (DESIGN.md, "Cost model"; the same virtual-usage rules applied to domains): only instances in
    another domain, neither they nor their domain draining, whose domain summary (when published) has a
    single instance with ``largest_free_blocks >= move.blocks`` and is not draining; ordered by the
    domain's freeness (highest first; domains without a summary last), then by instance id. A named
    ``dst_instance_id`` is the only candidate, if it passes the same rules.
    """
    out: list[tuple[float, str]] = []
    for inst in instances.values():
        if inst.domain_id == src_domain_id or _draining(inst, drains):
            continue
        if move.dst_instance_id and inst.instance_id != move.dst_instance_id:
            continue
        summary = summaries.get(inst.domain_id)
        if summary is not None and (summary.draining or summary.largest_free_blocks < move.blocks):
            continue
        freeness = summary.freeness if summary is not None else -math.inf
        out.append((-freeness, inst.instance_id))
    return [iid for _, iid in sorted(out)]


def choose_destination(
    move: MoveProposal,
    candidates: Iterable[str],
    path_of: PathOf,
    judge: MoveJudge,
    flows: Mapping[str, int],
    *,
    max_tries: int = 16,
) -> Choice:
    """Judge candidates in order; the first approved one wins.

    A candidate ``path_of`` cannot reach (KeyError / ValueError: unknown to the topology) is skipped.

    Returns a :class:`Choice` with ``dst_instance_id=None`` and the last rejection when none is approved
    (or "no candidate" when the list is empty). At most ``max_tries`` candidates are judged.
    """
    last = Judgement(False, "no destination: every other domain is draining, full or unregistered")
    for tries, dst in enumerate(candidates):
        if tries >= max_tries:
            break
        try:
            path = path_of(move.src_instance_id, dst)
        except (KeyError, ValueError) as exc:  # not in the topology file, or no path
            last = Judgement(False, f"{dst}: no path from {move.src_instance_id}: {exc}")
            continue
        verdict = judge(move, dst, path, busiest_link_flows(path.links, flows))
        if verdict.approved:
            return Choice(dst, path, verdict)
        last = Judgement(False, f"{dst}: {verdict.reason}", verdict.transfer_s, verdict.downtime_s)
    return Choice(None, None, last)
