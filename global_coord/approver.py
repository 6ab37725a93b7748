"""The coordinator's decisions on a cross-domain move: candidates, link budgets, the judge. Pure, no I/O.

This is the coordinator's decision core: the live coordinator (``global_coord.coordinator``) and the
simulator (``sim.schedulers``) both call :func:`decide`. Destinations are chosen from the domains'
summaries, instance by instance, by their real free space (``policy.domain.InstanceBrief``): the same
freeness rule a domain scheduler applies inside its domain. The coordinator asks a :class:`MoveJudge` about
each candidate in order; the judge applies the cost model and the approval rule
(``global_coord.approval.judge_move`` over ``topology.cost``; wired in ``global_coord.wiring``). Link budgets
are counted from the active migrations (live: the records in etcd, so they are rebuilt after any restart;
simulated: the executor's flows): every proposed or approved migration holds one flow on each link of its
path until it is committed or aborted. Moves are priced with what earlier moves on the same path and transport
were measured to achieve (:func:`measured_rates`, ``topology.bandwidth``; live: the measurements the domain
schedulers write into the records, simulated: the executor's) once there is such a measurement.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from clusterstate.records import ACTIVE_STATES, MigrationRecord
from policy.dispatch import leading_run
from policy.domain import DomainSummary
from topology.bandwidth import (
    BandwidthEstimates,
    BandwidthKey,
    BandwidthSample,
    MeasuredBandwidthConfig,
    default_transport,
    path_key,
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
    "decide",
    "link_flows",
    "measured_rates",
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
    remaining_tokens: int  # output tokens still to produce (estimate, policy.remaining)
    decode_step_s: float  # the source's current decode step time, seconds
    model: str = ""  # the model it runs; a destination must serve it ("" = the source's)
    max_blocks: int = 0  # KV blocks it may grow to; a destination's capacity must hold them (0 = not known)
    dst_domain_id: str = ""  # the domain the proposer was paired with (a preference; "" = any)
    # hash ids of its prompt's prefix blocks, each of prefix_block_tokens tokens (() / 0: none known); a
    # destination whose cache holds the leading ones needs them not copied (the judge prices that)
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.prefix_hashes and self.prefix_block_tokens < 1:
            problems.append(f"prefix_hashes given but prefix_block_tokens is {self.prefix_block_tokens}")
        for name in ("proposer_domain_id", "request_id", "src_instance_id"):
            if not getattr(self, name):
                problems.append(f"{name} is empty")
        for name in ("attempt", "blocks", "num_tokens", "remaining_tokens", "max_blocks"):
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
    """Prices and judges moving ``move`` to ``dst_instance_id`` over ``path``; ``measured_bandwidth_bytes_per_s``
    is what moves on that path and transport achieved (None: unmeasured, price with the topology);
    ``dst_prefix_hash_blocks``: how many of the move's leading ``prefix_hashes`` the destination's prefix cache
    holds (those blocks are not copied); ``dst_prefill_s_per_token``: the destination's prefill estimate per
    prompt token (``InstanceBrief.prefill_s_per_token``; 0: it offers none), which prices re-prefilling the rest
    of the prefix there instead of copying it."""

    def __call__(
        self,
        move: MoveProposal,
        dst_instance_id: str,
        path: PathLike,
        busiest_link_flows: int,
        measured_bandwidth_bytes_per_s: float | None = None,
        dst_prefix_hash_blocks: int = 0,
        dst_prefill_s_per_token: float = 0.0,
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


def measured_rates(
    migrations: Iterable[tuple[MigrationRecord, int]], cfg: MeasuredBandwidthConfig, now_s: float
) -> Mapping[BandwidthKey, float]:
    """The measured rate (bytes/s) of every (transport, path) at ``now_s`` (wall-clock seconds), from the
    migration records and their etcd mod revisions: every record with a measurement is a sample, in revision
    order (the order the domain schedulers wrote their outcomes). A read-only mapping whose rates are computed
    on lookup (``topology.bandwidth.BandwidthEstimates.at``)."""
    samples = [
        BandwidthSample(r.transport, r.links, r.measured_bandwidth_bytes_per_s, r.measured_at_s)
        for r, _ in sorted(migrations, key=lambda item: item[1])
        if r.measured_bandwidth_bytes_per_s > 0 and r.transport
    ]
    return BandwidthEstimates.of(samples, cfg).at(now_s)


def busiest_link_flows(links: Iterable[str], flows: Mapping[str, int]) -> int:
    """The most flows on any of ``links`` (0 for a path with no links)."""
    return max((flows.get(link, 0) for link in links), default=0)


def candidate_destinations(
    move: MoveProposal,
    src_domain_id: str,
    summaries: Iterable[DomainSummary],
    drained: Callable[[str, str], bool] = lambda instance_id, domain_id: False,
    registered: Collection[str] | None = None,
) -> list[str]:
    """Destination instances to try, best first.

    Rules (DESIGN.md, "Cost model"; the rule book's freeness applied to instances): instances of another
    domain's summary for the request's model; not draining (as their domain scheduler reports, or as
    ``drained(instance_id, domain_id)`` says from the drain intents); whose capacity can hold what the
    request may grow to (``move.max_blocks``) and whose real free blocks hold it now (``move.blocks``);
    registered (when ``registered`` is given); with a batch slot for the request beside the head of its own
    queue when it reports its slot limit (``InstanceBrief.takes_one_more``: a request moved into a full batch
    would not run). Ordered by the instance's freeness, highest first, instances
    of the domain the proposer was paired with first among equals, then by id. A named ``dst_instance_id``
    is the only candidate, if it passes the same rules.
    """
    out: list[tuple[float, bool, str]] = []
    for summary in summaries:
        if summary.domain_id == src_domain_id or summary.draining:
            continue
        if move.model and summary.model and summary.model != move.model:
            continue
        for b in summary.instances:
            if move.dst_instance_id and b.instance_id != move.dst_instance_id:
                continue
            if b.draining or drained(b.instance_id, summary.domain_id):
                continue
            if registered is not None and b.instance_id not in registered:
                continue
            if b.capacity_blocks < move.max_blocks or b.free_blocks < move.blocks or not b.takes_one_more:
                continue
            out.append((-b.freeness, summary.domain_id != move.dst_domain_id, b.instance_id))
    return [iid for _, _, iid in sorted(out)]


def choose_destination(
    move: MoveProposal,
    candidates: Iterable[str],
    path_of: PathOf,
    judge: MoveJudge,
    flows: Mapping[str, int],
    *,
    measured: Mapping[BandwidthKey, float] | None = None,
    max_tries: int = 16,
    prefix_held: Mapping[str, frozenset[int]] | None = None,
    prefill_s_per_token: Mapping[str, float] | None = None,
) -> Choice:
    """Judge candidates in order; the first approved one wins.

    ``prefix_held``: the prefix hash blocks each candidate's cache holds (``InstanceBrief.prefix_hashes``); the
    judge is told how many of the move's leading ``prefix_hashes`` a candidate holds (a gap ends the run).
    ``prefill_s_per_token``: each candidate's prefill estimate (``InstanceBrief.prefill_s_per_token``; missing:
    none), told to the judge with it.

    A candidate ``path_of`` cannot reach (KeyError / ValueError: unknown to the topology) is skipped. Each is
    judged with the measured rate of its path and the transport the move would take (``measured``, from
    :func:`measured_rates`; none: every path priced with the topology); only the judged candidates' paths
    are looked up in it.

    Returns a :class:`Choice` with ``dst_instance_id=None`` and the last rejection when none is approved
    (or "no candidate" when the list is empty). At most ``max_tries`` candidates are judged.
    """
    last = Judgement(False, "no destination: no instance of another domain's summary serves the model with room for it")
    for tries, dst in enumerate(candidates):
        if tries >= max_tries:
            break
        try:
            path = path_of(move.src_instance_id, dst)
        except (KeyError, ValueError) as exc:  # not in the topology file, or no path
            last = Judgement(False, f"{dst}: no path from {move.src_instance_id}: {exc}")
            continue
        # not ``measured or {}``: a lazy view (``BandwidthEstimates.at``) would compute every path's rate for bool()
        rate = None if measured is None else measured.get(path_key(default_transport(path.same_domain), path.links))
        held = prefix_held.get(dst) if prefix_held is not None and move.prefix_hashes else None
        on_dst = leading_run(move.prefix_hashes, held) if held else 0
        prefill = prefill_s_per_token.get(dst, 0.0) if prefill_s_per_token is not None else 0.0
        verdict = judge(move, dst, path, busiest_link_flows(path.links, flows), rate, on_dst, prefill)
        if verdict.approved:
            return Choice(dst, path, verdict)
        last = Judgement(False, f"{dst}: {verdict.reason}", verdict.transfer_s, verdict.downtime_s)
    return Choice(None, None, last)


def decide(
    move: MoveProposal,
    src_domain_id: str,
    summaries: Iterable[DomainSummary],
    path_of: PathOf,
    judge: MoveJudge,
    flows: Mapping[str, int],
    *,
    drained: Callable[[str, str], bool] = lambda instance_id, domain_id: False,
    registered: Collection[str] | None = None,
    measured: Mapping[BandwidthKey, float] | None = None,
) -> Choice:
    """The coordinator's whole decision on one proposed move: candidates (:func:`candidate_destinations`),
    then the first the judge approves (:func:`choose_destination`) under the link budgets ``flows``, each
    priced with its path's ``measured`` rate when there is one."""
    summaries = list(summaries)
    candidates = candidate_destinations(move, src_domain_id, summaries, drained, registered)
    held = {b.instance_id: b.prefix_hashes for s in summaries for b in s.instances if b.prefix_hashes}
    prefill = {b.instance_id: b.prefill_s_per_token for s in summaries for b in s.instances if b.prefill_s_per_token}
    return choose_destination(
        move, candidates, path_of, judge, flows, measured=measured, prefix_held=held, prefill_s_per_token=prefill
    )
