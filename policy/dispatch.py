"""Dispatch: send a new request to the freest target that can hold it (Llumnix OSDI'24 §4.4.3).

A view keeps the last load report of each target plus the requests it dispatched since then
("reservations"), so a burst that arrives between two reports spreads out instead of piling onto
the target that looked freest. A fresh report replaces the target's state and drops its
reservations: the report already counts whatever arrived. A report that left its source some time
ago (a domain summary published every 100 ms and received later) only counts what arrived before it
was taken: give ``update`` its ``as_of`` stamp and the reservations made after it are kept
(stamps are any increasing number the caller chooses, e.g. seconds on its clock; the rule book reads
no clock).

Rule, per pick of a request needing `demand_blocks` to start and `need_blocks` at most (its prompt plus
max_tokens, what it may grow to; 0 = only the demand is known):
1. capable = targets not draining, not excluded, whose single-instance capacity >= max(demand, need);
   none -> refuse;
2. prefer capable targets with room now (free blocks >= demand); if none, take the capable ones
   anyway (the request will queue) and say so — or, with `only_if_room`, refuse with `full` set, so the
   caller can try elsewhere (a gateway trying the next domain);
3. take the highest freeness; targets within `tie_tolerance`·|F_best| of it are near-ties and one
   is drawn with the seeded rng. With `choices` = d > 0 (power of d choices, Mitzenmacher 2001), d
   targets of the pool are drawn first and the freest of those taken: several dispatchers sharing the
   same lagged view (a fleet of gateways) then spread a burst instead of all picking the same target;
4. reserve: add demand + priority headroom to its usage and one request to its batch.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from policy.domain import DomainSummary
from policy.types import InstanceLoad, PolicyConfig
from policy.usage import dispatch_usage, freeness_of, queued_blocks

__all__ = ["DispatchDecision", "DispatchView", "DomainDispatchView"]


@dataclass(frozen=True, slots=True)
class DispatchDecision:
    """Where a request goes: `target_id` (an instance or domain id), or None with the refusal reason."""

    target_id: str | None
    reason: str  # one line for logs and for the client on refusal
    full: bool = False  # refused only because no capable target has room now (``only_if_room``)


@dataclass(slots=True)
class _Target:
    """Mutable per-target state inside a view: the last report plus local reservations."""

    target_id: str
    capacity_blocks: int  # M
    usage: float  # ΣV as reported
    num_running: int  # B as reported (before max(1, ·))
    free_blocks: int  # blocks a new request could use now (instance: M − used − queued head)
    max_request_blocks: int  # the largest request one instance of it can ever hold
    draining: bool
    reserved_usage: float = 0.0  # Σ(demand + headroom) dispatched since the report
    reserved_blocks: int = 0  # Σ demand dispatched since the report
    reserved_count: int = 0  # requests dispatched since the report
    stamped: tuple[tuple[float, int, int], ...] = ()  # (stamp, demand, virtual) of stamped reservations

    def freeness(self) -> float:
        return freeness_of(
            self.capacity_blocks, self.usage + self.reserved_usage, self.num_running + self.reserved_count
        )

    def has_room(self, demand_blocks: int) -> bool:
        return self.free_blocks - self.reserved_blocks >= demand_blocks

    def reserve(self, demand_blocks: int, virtual_blocks: int, stamp: float | None = None) -> None:
        self.reserved_usage += virtual_blocks
        self.reserved_blocks += demand_blocks
        self.reserved_count += 1
        if stamp is not None:
            self.stamped += ((stamp, demand_blocks, virtual_blocks),)

    def keep_after(self, previous: _Target, as_of: float) -> None:
        """Carry over ``previous``'s stamped reservations made after ``as_of`` (the new report misses them)."""
        for stamp, demand, virtual in previous.stamped:
            if stamp > as_of:
                self.reserve(demand, virtual, stamp)


class _View:
    """Mechanics shared by instance and domain views; subclasses turn reports into `_Target`s."""

    _noun = "target"

    def __init__(self, cfg: PolicyConfig, rng: random.Random, choices: int = 0) -> None:
        if choices < 0:
            raise ValueError(f"choices must be >= 0 (0: every target), got {choices}")
        self._cfg = cfg
        self._rng = rng
        self._choices = choices
        self._targets: dict[str, _Target] = {}

    def remove(self, target_id: str) -> None:
        """Forget a target (gone, deregistered). Idempotent: an unknown id is ignored."""
        self._targets.pop(target_id, None)

    def freeness(self, target_id: str) -> float:
        """Freeness of a target as this view sees it, reservations included. KeyError if unknown."""
        return self._targets[target_id].freeness()

    def pick(
        self,
        demand_blocks: int,
        priority: int = 0,
        stamp: float | None = None,
        *,
        need_blocks: int = 0,
        exclude: Collection[str] = (),
        only_if_room: bool = False,
        prefix_hashes: Sequence[int] = (),
        prefix_block_tokens: int = 0,
        block_size_tokens: int = 0,
    ) -> DispatchDecision:
        """Choose a target for a request and reserve it there.

        Args:
            demand_blocks: KV blocks it needs to start (its prompt).
            priority: its priority class (the headroom it carries).
            stamp: marks the reservation so that a later `update(..., as_of=...)` with an older report
                keeps it.
            need_blocks: KV blocks it may grow to (prompt + max_tokens); a target must be able to hold
                that many on one instance. 0: not known, only the demand counts.
            exclude: targets not to choose this time (tried already); their state is kept.
            only_if_room: refuse (``full=True``) rather than queue when no capable target has room now.
            prefix_hashes: hash ids of the prompt's prefix blocks an engine may reuse, in order (the full hash
                blocks before the prompt's last token: vLLM always computes that one).
            prefix_block_tokens: tokens each hash covers (a multiple of ``block_size_tokens``).
            block_size_tokens: tokens per KV block of the targets (``demand_blocks``' unit); with
                ``prefix_block_tokens`` it gives the blocks one hash stands for. 0 (either): no prefix.

        Returns target_id None, with the reason, only when no target (not excluded) can ever hold the
        request. Raises ValueError if demand_blocks or need_blocks < 0.
        """
        for name, value in (("demand_blocks", demand_blocks), ("need_blocks", need_blocks)):
            if value < 0:
                raise ValueError(f"pick: {name} must be >= 0, got {value}")
        size = max(demand_blocks, need_blocks)
        capable = [
            t
            for t in self._targets.values()
            if not t.draining and t.max_request_blocks >= size and t.target_id not in exclude
        ]
        if not capable:
            return DispatchDecision(None, self._refusal(size, exclude))
        roomy = [t for t in capable if t.has_room(demand_blocks)]
        if not roomy and only_if_room:
            noun = self._noun
            why = f"no {noun} has {demand_blocks} free blocks now ({len(capable)} could hold the request later)"
            return DispatchDecision(None, why, full=True)
        chosen, num_near = self._choose(roomy or capable)
        chosen.reserve(demand_blocks, demand_blocks + self._cfg.headroom_blocks(priority), stamp)
        return DispatchDecision(chosen.target_id, self._reason(chosen, demand_blocks, num_near, bool(roomy)))

    def _set(self, target: _Target, as_of: float | None = None) -> None:
        previous = self._targets.get(target.target_id)
        if previous is not None and as_of is not None:
            target.keep_after(previous, as_of)
        self._targets[target.target_id] = target

    def _choose(self, pool: list[_Target]) -> tuple[_Target, int]:
        """The freest of `pool` (of `choices` targets drawn from it, when set); near-ties (within
        tie_tolerance of the best) drawn with the rng."""
        if 0 < self._choices < len(pool):
            pool = self._rng.sample(sorted(pool, key=lambda t: t.target_id), self._choices)
        scored = [(t.freeness(), t.target_id, t) for t in pool]
        best = max(f for f, _, _ in scored)
        floor = best - self._cfg.tie_tolerance * abs(best)
        near = sorted((tid, t) for f, tid, t in scored if f >= floor)
        return self._rng.choice(near)[1], len(near)

    def _reason(self, chosen: _Target, demand_blocks: int, num_near: int, has_room: bool) -> str:
        noun = self._noun
        where = f"freest {noun} (F={chosen.freeness():.2f} after reserving, {num_near} near-tied)"
        if has_room:
            return f"{where} with room for {demand_blocks} blocks"
        return f"no {noun} has {demand_blocks} free blocks now; the request will queue on the {where}"

    def _refusal(self, demand_blocks: int, exclude: Collection[str] = ()) -> str:
        noun = self._noun
        if not self._targets:
            return f"no {noun}s to dispatch to"
        active = [t for t in self._targets.values() if not t.draining]
        if not active:
            return f"all {len(self._targets)} {noun}s are draining"
        left = [t for t in active if t.target_id not in exclude]
        if not left:
            return f"every {noun} that is not draining was tried"
        active = left
        largest = max(t.max_request_blocks for t in active)
        return (
            f"request needs {demand_blocks} blocks but the largest non-draining {noun} "
            f"can hold {largest} blocks; no {noun} can ever hold it"
        )


class DispatchView(_View):
    """Dispatch over the instances of one domain (used by a domain scheduler and the simulator).

    `loads`: the latest report of each instance; instance ids must be unique (ValueError otherwise).
    `rng`: the seeded random source for near-ties. Not thread-safe; one view per scheduler loop.
    `choices`: power-of-d-choices sampling (0: every instance; the default, with exact, fresh state).
    """

    _noun = "instance"

    def __init__(self, loads: Iterable[InstanceLoad], cfg: PolicyConfig, rng: random.Random, choices: int = 0) -> None:
        super().__init__(cfg, rng, choices)
        for load in loads:
            if load.instance_id in self._targets:
                raise ValueError(f"DispatchView: instance {load.instance_id!r} appears twice")
            self.update(load)

    def update(self, load: InstanceLoad, as_of: float | None = None) -> None:
        """Replace an instance's state with a report (or add it).

        Drops its reservations, or with `as_of` (the report's stamp) only those stamped at or before it.
        """
        self._set(
            _Target(
                target_id=load.instance_id,
                capacity_blocks=load.capacity_blocks,
                usage=dispatch_usage(load, self._cfg),
                num_running=load.num_running + load.num_waiting,
                free_blocks=load.free_blocks - queued_blocks(load),
                max_request_blocks=load.capacity_blocks,
                draining=load.draining,
            ),
            as_of,
        )


class DomainDispatchView(_View):
    """Dispatch over domains (used by the gateway and the coordinator), from `DomainSummary` values.

    The capacity check uses max_instance_capacity_blocks, the room check largest_free_blocks (a
    reservation lowers it by the demand: conservative, the request may land elsewhere).
    `choices`: power-of-d-choices sampling (0: every domain). Raises ValueError on a repeated domain id.
    """

    _noun = "domain"

    def __init__(
        self, summaries: Iterable[DomainSummary], cfg: PolicyConfig, rng: random.Random, choices: int = 0
    ) -> None:
        super().__init__(cfg, rng, choices)
        for summary in summaries:
            if summary.domain_id in self._targets:
                raise ValueError(f"DomainDispatchView: domain {summary.domain_id!r} appears twice")
            self.update(summary)

    def update(self, summary: DomainSummary, as_of: float | None = None) -> None:
        """Replace a domain's state with a summary (or add it).

        Drops its reservations, or with `as_of` (when the summary was taken, on the stamps' clock) only
        those stamped at or before it: a summary that took time to arrive misses the later dispatches.
        """
        self._set(
            _Target(
                target_id=summary.domain_id,
                capacity_blocks=summary.capacity_blocks,
                usage=summary.virtual_usage + summary.queued_blocks,
                num_running=summary.num_running + summary.num_waiting,
                free_blocks=summary.largest_free_blocks,
                max_request_blocks=summary.max_instance_capacity_blocks,
                draining=summary.draining,
            ),
            as_of,
        )
