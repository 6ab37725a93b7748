"""The gateway's decision: which domain gets a request. A pure core, no I/O, no clock reads.

:class:`GatewayCore` keeps one ``policy.dispatch.DomainDispatchView`` per model over the domains' published
summaries (``policy.domain.DomainSummary``): the same freeness rule a domain scheduler applies to its
instances (DESIGN.md, "Virtual usage") — the freest domain that can hold the request, near-ties drawn at
random. Each pick reserves the request's demand in the view, stamped with the time of the pick:

- a summary replaces the domain's state but keeps the reservations stamped after it was taken
  (``summary.taken_s``): a summary that was published 100 ms ago, and took a while to arrive, does not count
  the requests sent since, so the next burst does not go to the same domain again;
- a reservation older than ``reservation_ttl_s`` is dropped: the domain has long since counted (or finished)
  that request, and a domain publishes a summary only when its load changes.

Candidates are drawn by the power of d choices (``PolicyConfig.domain_choices``), so a fleet of gateways
reading the same summaries spreads a burst rather than all sending it to the same freest domain.

A request's way through the domains is a :class:`PlacementAttempt`: first every domain is asked to take it
only if one of its instances has room now (``only_if_room``: a domain that is full answers so instead of
queueing it, and the next domain is tried); when every domain was full, the freest one is asked again to
queue it. A domain that refuses (it can never hold the request, or every instance drains) is not asked
again; one that is unavailable (restarting, unreachable) is asked again after the shell's backoff.

A request whose instance died or whose engine failed is resumed by :func:`plan_resume` (after NVIDIA
Dynamo's request migration): token replay — the original prompt plus the tokens the client already has, the
rest of ``max_tokens`` — on another instance, so the client's stream continues with no token repeated or
missing, at most ``resume.max_replays`` times; a request that cannot be replayed faithfully ends with an
error event that says why.

The live gateway (``gateway.router``) feeds it from etcd and submits over gRPC; the simulator
(``sim.schedulers``) feeds it the summaries it delivers on the virtual clock. Stamps are wall-clock seconds
live (the publishers' and the gateways' clocks agree to NTP precision), virtual seconds simulated.
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from llumlet.engine.types import SamplingParams
from policy.dispatch import DispatchDecision, DomainDispatchView
from policy.domain import DomainSummary
from policy.types import PolicyConfig

__all__ = ["GatewayCore", "PlacementAttempt", "ResumeAction", "ResumePlan", "plan_resume"]


class GatewayCore:
    """Domain choice per model (see the module docstring).

    Args:
        cfg: the rule book (priority headroom, tie tolerance).
        rng: near-tie draws.
        reservation_ttl_s: how long a reservation counts at most, seconds.

    Raises ValueError on a negative or NaN ``reservation_ttl_s`` (inf: reservations count until a summary drops them).
    """

    def __init__(self, cfg: PolicyConfig, rng: random.Random, *, reservation_ttl_s: float = 1.0) -> None:
        if not reservation_ttl_s >= 0:  # NaN too: no reservation would ever expire
            raise ValueError(f"reservation_ttl_s must be >= 0, got {reservation_ttl_s}")
        self._cfg = cfg
        self._rng = rng
        self.reservation_ttl_s = reservation_ttl_s
        self._choices = cfg.domain_choices
        self._views: dict[str, DomainDispatchView] = {}  # model -> view over the domains serving it
        # domain -> model -> its latest summary (a dict per domain, no (domain, model) tuple made and hashed at every
        # look-up: an update is O(the domain's models))
        self._summaries: dict[str, dict[str, DomainSummary]] = {}
        self._serving: dict[str, int] = {}  # model -> domains with a summary of it (read at every pick)
        self._stamps: dict[str, _Stamps] = {}  # model -> the stamps of every reservation its picks made (_expire)
        self._early: dict[str, set[str]] = {}  # model -> domains picked at or before their summary was taken

    def models(self) -> list[str]:
        """Models some domain serves, sorted."""
        return sorted(self._serving)

    def domains(self, model: str | None = None) -> list[str]:
        """Domains with a summary (for ``model``, or any), sorted."""
        return sorted(d for d, held in self._summaries.items() if model is None or model in held)

    def summary(self, domain_id: str, model: str) -> DomainSummary | None:
        """The latest summary of ``domain_id`` for ``model``."""
        held = self._summaries.get(domain_id)
        return held.get(model) if held is not None else None

    def update(self, domain_id: str, summaries: Iterable[DomainSummary]) -> None:
        """A domain published ``summaries`` (one per model it serves); models it no longer serves are dropped.

        Raises ValueError when a summary names another domain.
        """
        fresh = {s.model: s for s in summaries}
        for s in fresh.values():
            if s.domain_id != domain_id:
                raise ValueError(f"update({domain_id!r}): a summary names domain {s.domain_id!r}")
        held = self._summaries.get(domain_id)
        if held is not None:
            for model in [m for m in held if m not in fresh]:
                self._drop(domain_id, model)
            held = self._summaries.get(domain_id)  # (none left once every model it had was dropped)
        for model, s in fresh.items():
            last = held.get(model) if held is not None else None
            # nothing new: keep the reservations (a summary taken at another time differs by its stamp at least;
            # compared by stamp first, it is not compared field by field)
            if last is s or (last is not None and last.taken_s == s.taken_s and last == s):
                continue
            if held is None:
                held = self._summaries[domain_id] = {}
            if last is None:
                self._serving[model] = self._serving.get(model, 0) + 1
            held[model] = s
            self._view(model).update(s, as_of=s.taken_s)

    def remove(self, domain_id: str) -> None:
        """A domain deregistered (idempotent)."""
        for model in list(self._summaries.get(domain_id, ())):
            self._drop(domain_id, model)

    def _drop(self, domain_id: str, model: str) -> None:
        held = self._summaries[domain_id]
        del held[model]
        if not held:
            del self._summaries[domain_id]
        self._serving[model] -= 1
        if not self._serving[model]:
            del self._serving[model]
        self._view(model).remove(domain_id)

    def _view(self, model: str) -> DomainDispatchView:
        view = self._views.get(model)
        if view is None:
            view = self._views[model] = DomainDispatchView((), self._cfg, self._rng, self._choices)
        return view

    def resolve_model(self, model: str) -> str | None:
        """The model a request names, or the only model served when it names none (None: not served)."""
        if not model:
            return next(iter(self._serving)) if len(self._serving) == 1 else None
        return model if model in self._serving else None

    def pick(
        self,
        model: str,
        demand_blocks: int,
        now_s: float,
        *,
        need_blocks: int = 0,
        priority: int = 0,
        exclude: Collection[str] = (),
        prefix_hashes: Sequence[int] = (),
        prefix_block_tokens: int = 0,
        block_size_tokens: int = 0,
    ) -> DispatchDecision:
        """Choose a domain for a request of ``model`` (``demand_blocks`` to start, ``need_blocks`` at most) and
        reserve it there, stamped ``now_s``. ``exclude``: domains already tried for this request.
        ``prefix_hashes``, ``prefix_block_tokens``, ``block_size_tokens``: its reusable prompt prefix, as
        ``policy.dispatch.DomainDispatchView.pick`` takes it (a domain holding it is preferred within the margin).

        Raises ValueError on negative block counts.
        """
        resolved = self.resolve_model(model)
        if resolved is None:
            served = ", ".join(self.models())
            if not served:  # at start, or once every domain's scheduler has gone
                return DispatchDecision(None, f"model {model!r} is not served: no domain scheduler has a summary now")
            return DispatchDecision(None, f"model {model!r} is not served (served: {served})")
        view = self._view(resolved)
        self._expire(resolved, view, now_s - self.reservation_ttl_s)
        decision = view.pick(
            demand_blocks,
            priority,
            stamp=now_s,
            need_blocks=need_blocks,
            exclude=exclude,
            prefix_hashes=prefix_hashes,
            prefix_block_tokens=prefix_block_tokens,
            block_size_tokens=block_size_tokens,
        )
        chosen = decision.target_id
        if chosen is not None:
            stamps = self._stamps.get(resolved)
            if stamps is None:
                stamps = self._stamps[resolved] = _Stamps()
            stamps.push(now_s, chosen)
            if now_s <= self._summaries[chosen][resolved].taken_s:  # its summary's clock is ahead of ours
                self._early.setdefault(resolved, set()).add(chosen)
        return decision

    def _expire(self, model: str, view: DomainDispatchView, horizon_s: float) -> None:
        """Before a pick: every domain of ``model`` counts only the reservations stamped after ``horizon_s``
        (``reservation_ttl_s``) and after its summary was taken, as if each were rebuilt from its summary with
        ``as_of = max(taken_s, horizon_s)``. Only the domains that may hold a reservation that rule drops are looked
        at (the others would not change): those whose oldest stamps fell behind the horizon (popped from the model's
        :class:`_Stamps`) and those picked at or before their summary was taken; and of those only the ones that
        still hold one are rebuilt (most often a newer summary dropped it already). O(reservations expired), not
        O(domains), per pick."""
        due = self._early.pop(model, set())
        stamps = self._stamps.get(model)
        if stamps is not None:
            stamps.pop_through(horizon_s, due)
        for domain_id in sorted(due):
            held = self._summaries.get(domain_id)
            summary = held.get(model) if held is not None else None
            if summary is None:  # dropped since, with its reservations
                continue
            as_of = max(summary.taken_s, horizon_s)
            if view.drops_reservations(domain_id, as_of):
                view.update(summary, as_of=as_of)


class _Stamps:
    """(stamp, domain) of every reservation of a model's picks not expired yet, to pop the oldest: kept in the order
    they were pushed while their stamps never decrease (a simulated clock; a wall clock that does not step back),
    each push and pop O(1), else in a heap (O(log reservations) each) until it empties. Either way a pop takes every
    stamp at or before a horizon."""

    __slots__ = ("_heap", "_queue")

    def __init__(self) -> None:
        self._queue: deque[tuple[float, str]] = deque()  # in push order, stamps not decreasing
        self._heap: list[tuple[float, str]] | None = None  # once a stamp came before the last one pushed

    def push(self, stamp_s: float, domain_id: str) -> None:
        """A reservation on ``domain_id`` stamped ``stamp_s``."""
        heap, queue = self._heap, self._queue
        if heap is None and queue and stamp_s < queue[-1][0]:
            heap = self._heap = list(queue)  # sorted: a heap already
            queue.clear()
        if heap is None:
            queue.append((stamp_s, domain_id))
        else:
            heapq.heappush(heap, (stamp_s, domain_id))

    def pop_through(self, horizon_s: float, into: set[str]) -> None:
        """Remove every reservation stamped at or before ``horizon_s``; add their domains to ``into``."""
        heap = self._heap
        if heap is None:
            queue = self._queue
            while queue and queue[0][0] <= horizon_s:
                into.add(queue.popleft()[1])
            return
        while heap and heap[0][0] <= horizon_s:
            into.add(heapq.heappop(heap)[1])
        if not heap:
            self._heap = None


class PlacementAttempt:
    """One request's way through the domains (see the module docstring). Pure: the shell submits each choice
    and reports the domain's answer.

    Args:
        core: the gateway's view of the domains.
        model, demand_blocks, need_blocks, priority: the request (``need_blocks``: what it may grow to).
        prefix_hashes, prefix_block_tokens, block_size_tokens: its reusable prompt prefix (``GatewayCore.pick``).
    """

    def __init__(
        self,
        core: GatewayCore,
        model: str,
        demand_blocks: int,
        need_blocks: int = 0,
        priority: int = 0,
        *,
        prefix_hashes: Sequence[int] = (),
        prefix_block_tokens: int = 0,
        block_size_tokens: int = 0,
    ):
        self._core = core
        self.model = model
        self.demand_blocks = demand_blocks
        self.need_blocks = need_blocks
        self.priority = priority
        self.prefix_hashes = prefix_hashes
        self.prefix_block_tokens = prefix_block_tokens
        self.block_size_tokens = block_size_tokens
        self.only_if_room = True  # the first pass asks each domain to take it only if it has room now
        self.refused: set[str] = set()  # never again for this request
        self.unavailable: set[str] = set()  # again after a backoff (:meth:`retry_unavailable`)
        self.full: set[str] = set()  # had no room in the first pass
        self.reasons: dict[str, str] = {}  # domain -> its last answer, for the error message
        self._last: DispatchDecision | None = None  # the last pick (its reason is written only when read)

    def next(self, now_s: float) -> str | None:
        """The domain to submit to now (with :attr:`only_if_room`), or None when none is left to try."""
        if self.only_if_room:
            decision = self._pick(now_s, self.refused | self.unavailable | self.full)
            if decision.target_id is not None or not self.full:
                return decision.target_id
            self.only_if_room = False  # every domain was full: queue on the freest of them
        decision = self._pick(now_s, self.refused | self.unavailable)
        return decision.target_id

    def _pick(self, now_s: float, exclude: set[str]) -> DispatchDecision:
        decision = self._core.pick(
            self.model,
            self.demand_blocks,
            now_s,
            need_blocks=self.need_blocks,
            priority=self.priority,
            exclude=exclude,
            prefix_hashes=self.prefix_hashes,
            prefix_block_tokens=self.prefix_block_tokens,
            block_size_tokens=self.block_size_tokens,
        )
        self._last = decision
        return decision

    @property
    def last_reason(self) -> str:
        """The reason of the last pick ("" before the first)."""
        return "" if self._last is None else self._last.reason

    def answered_full(self, domain_id: str, reason: str) -> None:
        """The domain has no room now (first pass)."""
        self.full.add(domain_id)
        self.reasons[domain_id] = reason

    def answered_refused(self, domain_id: str, reason: str) -> None:
        """The domain can never take the request."""
        self.refused.add(domain_id)
        self.reasons[domain_id] = reason

    def answered_unavailable(self, domain_id: str, reason: str) -> None:
        """The domain cannot answer now."""
        self.unavailable.add(domain_id)
        self.reasons[domain_id] = reason

    def retry_unavailable(self) -> None:
        """After a backoff: ask the unavailable domains again."""
        self.unavailable.clear()

    def explain(self) -> str:
        """Why no domain took the request: each domain's answer, or why none could be chosen."""
        return "; ".join(f"{d}: {r}" for d, r in sorted(self.reasons.items())) or self.last_reason


class ResumeAction(enum.Enum):
    """What :func:`plan_resume` decided."""

    REPLAY = "replayed"  # submit the replay it describes
    COMPLETE = "completed"  # the client already has every token: end the stream normally ("length")
    NOT_REPLAYABLE = "not_replayable"  # a replay would not continue the same sampling: end with an error
    LIMIT = "limit"  # replayed resume.max_replays times already: end with an error


@dataclass(frozen=True, slots=True)
class ResumePlan:
    """How to resume a request whose instance failed (:func:`plan_resume`).

    For :attr:`ResumeAction.REPLAY`: submit ``prompt_token_ids`` (the original prompt, then the tokens already
    delivered) with ``sampling`` (``max_tokens`` and ``min_tokens`` less those tokens), numbered from
    ``first_seq`` (the tokens already delivered), on any instance but ``avoid_instance_ids``.
    """

    action: ResumeAction
    reason: str  # in words: what is replayed, or why not
    prompt_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams | None = None
    first_seq: int = 0
    avoid_instance_ids: tuple[str, ...] = ()


def plan_resume(
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    output_token_ids: Sequence[int],
    *,
    replays_done: int,
    failed_instance_ids: Sequence[str],
    max_replays: int,
) -> ResumePlan:
    """Decide how to resume one request (one choice) whose instance died or whose engine failed.

    Args:
        prompt_token_ids: the request's original prompt.
        sampling: its original sampling settings.
        output_token_ids: the tokens its client already has (the sink's contiguous tokens), in order.
        replays_done: replays of it so far.
        failed_instance_ids: the instances it failed on, the latest last (the replay avoids them).
        max_replays: ``resume.max_replays`` of the configuration.

    Token replay after NVIDIA Dynamo's request migration: the prompt plus the output so far, the rest of
    ``max_tokens``; that continues a greedy request exactly and an unseeded sampled one as a fresh sample of
    the same distribution. Not replayable faithfully (ended with an error that says which and why): seeded
    sampling (temperature > 0 and a seed: the generator's state after those tokens is lost with the instance,
    a replay would sample a different continuation than the seed promises), structured output (the grammar's
    state over the output is lost; a replay would constrain the output as if it started at the replayed
    tokens) and frequency / presence penalties (they count the output so far, which a replay turns into
    prompt). A request with no token yet is replayed whatever its sampling (a plain re-dispatch).

    Raises ValueError on a negative count.
    """
    n = len(output_token_ids)
    if replays_done < 0 or max_replays < 0:
        raise ValueError(f"plan_resume: replays_done = {replays_done}, max_replays = {max_replays}: need >= 0")
    avoid = tuple(dict.fromkeys(failed_instance_ids))
    if n >= sampling.max_tokens:
        return ResumePlan(ResumeAction.COMPLETE, f"all {sampling.max_tokens} tokens were delivered before it failed")
    if replays_done >= max_replays:
        why = (
            "resuming is off (resume.max_replays = 0)"
            if max_replays == 0
            else (f"replayed {replays_done} times already (resume.max_replays = {max_replays})")
        )
        return ResumePlan(ResumeAction.LIMIT, why)
    if n > 0:
        refused = _unfaithful(sampling, n)
        if refused:
            return ResumePlan(ResumeAction.NOT_REPLAYABLE, refused)
    rest = replace(sampling, max_tokens=sampling.max_tokens - n, min_tokens=max(0, sampling.min_tokens - n))
    return ResumePlan(
        ResumeAction.REPLAY,
        f"replay {n} delivered tokens after the prompt, {rest.max_tokens} more to generate",
        tuple(prompt_token_ids) + tuple(output_token_ids),
        rest,
        n,
        avoid,
    )


def _unfaithful(sampling: SamplingParams, n: int) -> str:
    """Why a replay after ``n`` tokens would not continue these settings' sampling ("" if it would)."""
    if sampling.seed is not None and sampling.temperature > 0:
        return (
            f"seeded sampling (seed {sampling.seed}, temperature {sampling.temperature:g}) cannot be replayed "
            f"faithfully: its random generator's state after {n} tokens was lost with the instance"
        )
    if sampling.guided is not None:
        return (
            f"structured output ({sampling.guided.kind}) cannot be replayed faithfully: the constraint's state "
            f"after {n} tokens was lost with the instance"
        )
    if sampling.frequency_penalty or sampling.presence_penalty:
        return (
            "frequency and presence penalties cannot be replayed faithfully: they count the output so far, "
            "which a replay would send as prompt"
        )
    return ""
