"""The domain scheduler's decisions: a pure core, no I/O, no clock reads (time comes in as ``now_s``).

One :class:`DomainCore` per NVLink domain, fed its instances' load reports. It decides

- **dispatch**: which instance of the domain gets a new request — ``policy.dispatch.DispatchView`` over the
  instances serving the request's model (reservations count what was dispatched since each report), only
  instances whose KV capacity can hold what the request may grow to (prompt + ``max_tokens``). An instance
  whose load stream broke is deprioritised (it takes requests only when no instance of the model has a
  live stream: then requests are spread evenly over the instances still answering, counted in
  ``fallback_dispatches``); one that did not answer a Submit takes nothing until it answers again (a
  heartbeat) or reports; one whose engine failed (its report or Ping says so) takes nothing, is in no
  migration and in no summary, until a report says it is healthy again (a restarted llumlet);
- **rescheduling inside the domain**: ``policy.plan_migrations`` per model over the instances not busy with a
  migration. An instance is busy from the moment a move touching it is planned until the move finished *and*
  the instance sent a newer report, or ``settle_s`` passed (so a stale report cannot plan a second move from
  a state the first one already changed);
- **what to propose across domains**: when ``policy.pair_domains`` over this domain's summary and the others'
  makes it a source, the move ``rack_sched.plan.plan_cross_domain`` picks, priced with the remaining-output
  estimate (``policy.remaining``) and the source's measured step time. One cross-domain move of the domain
  at a time: none is proposed while the last one (:meth:`DomainCore.cross_domain_started`) has not ended. A
  request whose move was not approved is not proposed again for ``cool_down_s``;
- **its summaries**: one ``policy.domain.DomainSummary`` per model it serves.

The live domain scheduler (``rack_sched.scheduler``) feeds it from its llumlets' WatchLoad streams and carries
out its answers over gRPC; the simulator (``sim.schedulers``) feeds it from its simulated engines on the
virtual clock. Any difference between the two comes from timing, never from this code.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from global_coord.approver import MoveProposal
from policy.dispatch import DispatchDecision, DispatchView, reusable_prefix_hashes
from policy.domain import DomainSummary
from policy.migration import MigrationDecision, is_source_domain, plan_migrations
from policy.remaining import RemainingConfig, RemainingEstimator
from policy.summarize import DomainSummarizer
from policy.types import InstanceLoad, PolicyConfig
from rack_sched.plan import plan_cross_domain

__all__ = ["CrossDomainProposal", "DomainConfig", "DomainCore", "DomainRequest"]


@dataclass(frozen=True, slots=True)
class DomainConfig:
    """How a domain decides. Times in seconds. Raises ValueError on a bad value."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    remaining: RemainingConfig = field(default_factory=RemainingConfig)
    settle_s: float = 0.2  # after a migration, an instance waits this long at most for a fresh report
    cool_down_s: float = 2.5  # a request whose cross-domain move was not approved is not proposed again this long
    default_decode_step_s: float = 0.03  # step time when an instance has not measured one yet

    def __post_init__(self) -> None:
        for name in ("settle_s", "cool_down_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"DomainConfig.{name}: must be a finite number >= 0, got {getattr(self, name)}")
        if not self.default_decode_step_s > 0:
            raise ValueError(f"DomainConfig.default_decode_step_s: must be > 0, got {self.default_decode_step_s}")


@dataclass(frozen=True, slots=True)
class DomainRequest:
    """What dispatch needs of a new request."""

    request_id: str
    model: str  # "" = the domain's only model
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    only_if_room: bool = False  # refuse (``full``) rather than queue when no instance has room now
    # hash ids of its prompt's prefix blocks, in order (InstanceLoad.prefix_hashes' ids); each covers
    # prefix_block_tokens tokens (0 = no prefix information)
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prefix_hashes and self.prefix_block_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: prefix_hashes given but prefix_block_tokens < 1")
        if not self.request_id or self.prompt_tokens < 0 or self.max_tokens < 1 or self.priority < 0:
            raise ValueError(
                f"request {self.request_id!r}: need a request id, prompt_tokens >= 0, max_tokens >= 1 and "
                f"priority >= 0, got {self.prompt_tokens}, {self.max_tokens}, {self.priority}"
            )

    def demand_blocks(self, block_size_tokens: int) -> int:
        """KV blocks it needs to start: prompt plus the first output token, ``ceil((p + 1) / b)``."""
        return math.ceil((self.prompt_tokens + 1) / block_size_tokens)

    def need_blocks(self, block_size_tokens: int) -> int:
        """KV blocks it may grow to: ``ceil((p + max_tokens − 1) / b)`` (what an engine checks at admission)."""
        return math.ceil((self.prompt_tokens + self.max_tokens - 1) / block_size_tokens)


@dataclass(frozen=True, slots=True)
class CrossDomainProposal:
    """A move this domain proposes to the coordinator (it chooses the destination instance)."""

    src_instance_id: str
    request_id: str
    model: str
    blocks: int  # KV blocks it holds
    num_tokens: int  # tokens whose KV it holds
    max_blocks: int  # KV blocks it may grow to (0 = not known)
    remaining_tokens: int  # output tokens it is expected to still produce (policy.remaining)
    decode_step_s: float  # the source's measured step time, seconds
    dst_domain_id: str  # the domain policy.pair_domains paired it with
    reason: str
    prefix_hashes: tuple[int, ...] = ()  # hash ids of its prompt's prefix blocks (RequestLoad.prefix_hashes)
    prefix_block_tokens: int = 0  # tokens per hash block (its source's InstanceLoad.prefix_block_tokens)

    def proposal(self, proposer_domain_id: str, attempt: int) -> MoveProposal:
        """The coordinator's ``MoveProposal`` of this move (the coordinator chooses the destination instance)."""
        return MoveProposal(
            proposer_domain_id=proposer_domain_id,
            request_id=self.request_id,
            attempt=attempt,
            src_instance_id=self.src_instance_id,
            dst_instance_id="",
            blocks=self.blocks,
            num_tokens=self.num_tokens,
            remaining_tokens=self.remaining_tokens,
            decode_step_s=self.decode_step_s,
            model=self.model,
            max_blocks=self.max_blocks,
            dst_domain_id=self.dst_domain_id,
            prefix_hashes=self.prefix_hashes if self.prefix_block_tokens else (),
            prefix_block_tokens=self.prefix_block_tokens,
        )


@dataclass(slots=True)
class _Member:
    instance_id: str
    model: str
    block_size_tokens: int
    capacity_blocks: int = 0  # from its registration (used while no report is fresh)
    load: InstanceLoad | None = None  # as last reported (draining False)
    reports: int = 0  # reports received
    stream_up: bool = False  # its load stream delivers reports
    answers: bool = True  # the last Submit or heartbeat got an answer
    failure: str = ""  # why its engine failed ("" = healthy)

    @property
    def reachable(self) -> bool:
        """Fresh: reports flowing, answering calls and healthy (dispatch by load, migrations)."""
        return self.stream_up and self.answers and not self.failure


class DomainCore:
    """The decisions of one domain (see the module docstring).

    Args:
        domain_id: the domain.
        cfg: how it decides.
        rng: the seeded random source (dispatch near-ties, migration ties).
        details_of: where the detailed load of an instance comes from when it reported a brief one
            (``InstanceLoad.detailed`` False): called with the instance id when a rule picks a request from
            it, it must return the report of the same state with the batch listed. The simulator reports
            briefs and passes its engines' detailed loads here; the live scheduler's reports are detailed
            (None: a brief report is an error when a rule needs its requests).
    """

    def __init__(
        self,
        domain_id: str,
        cfg: DomainConfig,
        rng: random.Random,
        details_of: Callable[[str], InstanceLoad] | None = None,
    ) -> None:
        self.domain_id = domain_id
        self.cfg = cfg
        self._rng = rng
        self._details_of = details_of
        self._members: dict[str, _Member] = {}
        self._by_id: list[_Member] | None = None  # the members sorted by id (None: to be sorted again)
        self._models: list[str] | None = None  # models() (None: to be listed again)
        self._views: dict[str, DispatchView] = {}  # model -> dispatch view over its reachable instances
        self._stale: dict[str, set[str]] = {}  # model -> instances whose view entry awaits their latest report
        self._spread = 0  # rotation of the even spread used while no instance has a fresh report
        self.fallback_dispatches = 0  # requests placed by that spread
        self._drained: frozenset[str] = frozenset()
        self.domain_draining = False
        self._busy: dict[str, int] = {}  # instance -> migrations in flight touching it
        self._settle: dict[str, tuple[int, float]] = {}  # instance -> (reports at finish, deadline)
        self._not_approved: dict[str, float] = {}  # request -> until when it is not proposed again
        self._cross_in_flight = 0  # this domain's cross-domain moves proposed and not ended (0 or 1)
        self.remaining = RemainingEstimator(cfg.remaining)
        self.migrations_in_flight = 0
        # its summaries (published, and its own in a cross-domain round) of reports often unchanged since the last
        self._summarizer = DomainSummarizer(domain_id, cfg.policy)

    # ---- instances -----------------------------------------------------------------------------
    def add_instance(self, instance_id: str, model: str, block_size_tokens: int, capacity_blocks: int = 0) -> None:
        """An instance of this domain registered (no load yet: it takes no part until its first report, unless
        no instance of its model ever reports; ``capacity_blocks``: its KV capacity from the registration).

        Raises ValueError on a block size < 1.
        """
        if block_size_tokens < 1:
            raise ValueError(f"{self.domain_id}: {instance_id}: block_size_tokens must be >= 1")
        self._members[instance_id] = _Member(instance_id, model, block_size_tokens, capacity_blocks)
        self._by_id = self._models = None

    def remove_instance(self, instance_id: str) -> None:
        """An instance deregistered (idempotent)."""
        member = self._members.pop(instance_id, None)
        if member is not None:
            self._by_id = self._models = None
            self._view(member.model).remove(instance_id)
            self._summarizer.forget(instance_id)

    def instance_ids(self) -> list[str]:
        """Registered instances, sorted."""
        return sorted(self._members)

    def models(self) -> list[str]:
        """Models served by registered instances, sorted."""
        if self._models is None:
            self._models = sorted({m.model for m in self._members.values()})
        return list(self._models)

    def _sorted_members(self) -> list[_Member]:
        """The registered members, sorted by instance id (kept until one registers or leaves)."""
        if self._by_id is None:
            self._by_id = [m for _, m in sorted(self._members.items())]
        return self._by_id

    def report(self, instance_id: str, load: InstanceLoad, finished_output_tokens: Iterable[int] = ()) -> None:
        """A load report arrived (the instance's state replaces the last; its dispatch reservations drop).

        ``finished_output_tokens``: output lengths of the requests that finished there since its previous
        report (they teach the remaining-output estimate). Raises KeyError for an unregistered instance.
        """
        member = self._members[instance_id]
        if finished_output_tokens:
            self.finished(finished_output_tokens)
        member.load = load
        member.reports += 1
        member.stream_up = member.answers = True
        member.failure = ""
        self._refresh(member)

    def finished(self, output_tokens: Iterable[int]) -> None:
        """Requests of this domain finished with these output lengths (tokens; what a report's
        ``finished_output_tokens`` carries): they teach the remaining-output estimate, in this order."""
        for n in output_tokens:
            self.remaining.observe(n)

    def engine_failed(self, instance_id: str, reason: str) -> None:
        """The instance's engine failed (its report, Ping or a Submit said so): it takes no request, is in no
        migration and in no summary until a healthy report (see the module docstring). Unknown ids are ignored."""
        member = self._members.get(instance_id)
        if member is not None:
            member.failure = reason or "engine failed"
            self._view(member.model).remove(instance_id)

    def failure(self, instance_id: str) -> str:
        """Why the instance's engine failed, "" while healthy (or unknown)."""
        member = self._members.get(instance_id)
        return member.failure if member is not None else ""

    def stream_lost(self, instance_id: str) -> None:
        """The instance's load stream broke: deprioritised (see the module docstring) and in no migration,
        until its next report."""
        member = self._members.get(instance_id)
        if member is not None:
            member.stream_up = False
            self._view(member.model).remove(instance_id)

    def unreachable(self, instance_id: str) -> None:
        """A Submit to the instance got no answer: it takes nothing until :meth:`answered` or its next report."""
        member = self._members.get(instance_id)
        if member is not None:
            member.answers = False
            self._view(member.model).remove(instance_id)

    def answered(self, instance_id: str) -> None:
        """The instance answered again (a heartbeat): it takes requests again, also when it is idle and
        sends no report."""
        member = self._members.get(instance_id)
        if member is not None and not member.answers:
            member.answers = True
            self._refresh(member)

    def answering(self, instance_id: str) -> bool:
        """True unless the instance's last Submit or heartbeat went unanswered."""
        member = self._members.get(instance_id)
        return member is not None and member.answers

    def set_drains(self, drained: Iterable[str], domain_draining: bool) -> bool:
        """Apply drain intents: ``drained`` instances carry infinite virtual usage. True when anything changed."""
        drained_set = frozenset(drained)
        if drained_set == self._drained and domain_draining == self.domain_draining:
            return False
        self._drained, self.domain_draining = drained_set, domain_draining
        for member in self._members.values():
            self._refresh(member)
        return True

    def draining(self, instance_id: str) -> bool:
        """True when a drain applies to the instance."""
        return instance_id in self._drained

    def reachable(self, instance_id: str) -> bool:
        """True when the instance reported and was not lost since."""
        member = self._members.get(instance_id)
        return member is not None and member.reachable

    def load(self, instance_id: str) -> InstanceLoad | None:
        """The instance's last load, drains applied (None before its first report)."""
        member = self._members.get(instance_id)
        if member is None or member.load is None:
            return None
        return self._drains_applied(member.load)

    def _drains_applied(self, load: InstanceLoad) -> InstanceLoad:
        draining = load.instance_id in self._drained
        return load if load.draining == draining else replace(load, draining=draining)

    def loads(self, model: str | None = None) -> list[InstanceLoad]:
        """Every reported, healthy instance's load (of ``model``, or all), drains applied, sorted by id."""
        return [
            self._drains_applied(m.load)
            for m in self._sorted_members()
            if m.load is not None and not m.failure and (model is None or m.model == model)
        ]

    def _view(self, model: str) -> DispatchView:
        """The dispatch view of ``model``, brought up to date with the reports received since it was last read."""
        view = self._views.get(model)
        if view is None:
            view = self._views[model] = DispatchView((), self.cfg.policy, self._rng)
        stale = self._stale.pop(model, None)
        if stale:
            for iid in sorted(stale):
                member = self._members.get(iid)
                load = self.load(iid)
                if member is not None and load is not None and member.reachable:
                    view.update(load)
        return view

    def _refresh(self, member: _Member) -> None:
        """The member's state changed: its view entry is rebuilt when the view is next read (a report drops the
        instance's reservations then; several reports in between cost one rebuild)."""
        if member.load is not None and member.reachable:
            stale = self._stale.get(member.model)
            if stale is None:
                stale = self._stale[member.model] = set()
            stale.add(member.instance_id)
        else:
            self._stale.get(member.model, set()).discard(member.instance_id)
            self._view(member.model).remove(member.instance_id)

    # ---- dispatch --------------------------------------------------------------------------------
    def resolve_model(self, model: str) -> str | None:
        """The model a request names, or the domain's only model when it names none (None: not served here)."""
        models = self.models()
        if not model:
            return models[0] if len(models) == 1 else None
        return model if model in models else None

    def dispatch(self, request: DomainRequest, *, exclude: Iterable[str] = ()) -> DispatchDecision:
        """Choose the instance for a new request and reserve it in the view (target None: refused, why).

        ``exclude``: instances not to use this time (a Submit to them just failed).
        """
        excluded = frozenset(exclude)
        model = self.resolve_model(request.model)
        if model is None:
            served = ", ".join(self.models()) or "no model"
            what = f"model {request.model!r}" if request.model else "a request that names no model"
            return DispatchDecision(None, f"domain {self.domain_id} serves {served}, not {what}")
        block_size = self._block_size(model)
        if not any(m.reachable for m in self._members.values() if m.model == model):
            return self._spread_evenly(model, request, block_size, excluded)
        return self._view(model).pick(
            request.demand_blocks(block_size),
            request.priority,
            need_blocks=request.need_blocks(block_size),
            exclude=excluded,
            only_if_room=request.only_if_room,
            prefix_hashes=reusable_prefix_hashes(
                request.prefix_hashes, request.prefix_block_tokens, request.prompt_tokens
            ),
            prefix_block_tokens=request.prefix_block_tokens,
            block_size_tokens=block_size,
        )

    def _spread_evenly(
        self, model: str, request: DomainRequest, block_size: int, excluded: frozenset[str]
    ) -> DispatchDecision:
        """No instance of ``model`` has a fresh report: the next of those still answering, in turn."""
        need = request.need_blocks(block_size)
        pool = [
            m
            for _, m in sorted(self._members.items())
            if m.model == model
            and m.answers
            and not m.failure
            and m.instance_id not in excluded
            and m.instance_id not in self._drained
            and (m.load.capacity_blocks if m.load is not None else m.capacity_blocks) >= need
        ]
        if not pool:
            members = [m for m in self._members.values() if m.model == model]
            if all(m.failure for m in members):
                failures = "; ".join(
                    f"{m.instance_id}: {m.failure}" for m in sorted(members, key=lambda m: m.instance_id)
                )
                return DispatchDecision(None, f"every instance of {model} here failed ({failures})")
            return DispatchDecision(None, f"no instance of {model} has a fresh load report or answers")
        self._spread = (self._spread + 1) % len(pool)
        self.fallback_dispatches += 1
        chosen = pool[self._spread]
        return DispatchDecision(
            chosen.instance_id,
            f"no fresh load report from any {model} instance: spread evenly over {len(pool)} that answer",
        )

    # ---- rescheduling inside the domain ----------------------------------------------------------
    def is_busy(self, instance_id: str, now_s: float) -> bool:
        """True while a migration touches the instance, or it settles after one (see the module docstring)."""
        if self._busy.get(instance_id, 0) > 0:
            return True
        settle = self._settle.get(instance_id)
        if settle is None:
            return False
        reports_at, deadline = settle
        member = self._members.get(instance_id)
        if (member is not None and member.reports > reports_at) or now_s >= deadline:
            del self._settle[instance_id]
            return False
        return True

    def settled(self) -> bool:
        """True when no instance is busy with a migration or settling after one (:meth:`is_busy` is False for
        every instance whatever the reports to come). Conservative: a settle window stays until a rescheduling
        round (:meth:`plan_rebalance`) finds it over."""
        return not self._settle and not any(self._busy.values())

    def detailed(self, load: InstanceLoad) -> InstanceLoad:
        """``load`` (as :meth:`load` returns it) with its batch listed: itself when it is detailed, else the
        instance's detailed report from ``details_of``, drains applied. Raises ValueError without a source."""
        if load.detailed:
            return load
        if self._details_of is None:
            raise ValueError(f"{self.domain_id}: {load.instance_id} sent a brief load report and no details source")
        return self._drains_applied(self._details_of(load.instance_id))

    def free_loads(self, now_s: float, model: str | None = None) -> list[InstanceLoad]:
        """Loads of reachable instances (of ``model``, or all) not busy with a migration, sorted by id."""
        return [
            self._drains_applied(m.load)
            for m in self._sorted_members()
            if m.load is not None
            and (model is None or m.model == model)
            and m.reachable
            and not self.is_busy(m.instance_id, now_s)
        ]

    def _block_size(self, model: str) -> int:
        """Tokens per KV block of ``model``'s instances here (one model, one block size)."""
        return next(m.block_size_tokens for m in self._members.values() if m.model == model)

    def plan_rebalance(self, now_s: float) -> list[MigrationDecision]:
        """One rescheduling round: moves inside the domain, per model. Each move's instances are marked busy
        (call :meth:`migration_done` when it ended, whatever the outcome)."""
        moves: list[MigrationDecision] = []
        for model in self.models():
            block_size = self._block_size(model)
            for move in plan_migrations(
                self.free_loads(now_s, model),
                self.cfg.policy,
                self._rng,
                details=self.detailed,
                block_size_tokens=block_size,
            ):
                self.migration_started((move.src_id, move.dst_id))
                moves.append(move)
        return moves

    def migration_started(self, instance_ids: Sequence[str]) -> None:
        """A move touching ``instance_ids`` of this domain is in flight (they are busy)."""
        for iid in instance_ids:
            self._busy[iid] = self._busy.get(iid, 0) + 1
        self.migrations_in_flight += 1

    def migration_done(self, instance_ids: Sequence[str], now_s: float) -> None:
        """The move started by :meth:`migration_started` ended (committed, aborted or failed)."""
        deadline = now_s + self.cfg.settle_s
        for iid in instance_ids:
            self._busy[iid] = self._busy.get(iid, 1) - 1
            member = self._members.get(iid)
            self._settle[iid] = (member.reports if member else 0, deadline)
        self.migrations_in_flight -= 1

    # ---- across domains ----------------------------------------------------------------------------
    def plan_cross_domain(self, others: Iterable[DomainSummary], now_s: float) -> CrossDomainProposal | None:
        """The move to propose now, if ``policy.pair_domains`` makes this domain a source for some model, and
        None while this domain's previous cross-domain move has not ended (one at a time, module docstring).

        ``others``: the other domains' latest summaries (as received; those of other domains only), iterated
        at most once and only when this domain is a source for some model (``policy.is_source_domain``). Call
        :meth:`cross_domain_started` when proposing the move, :meth:`cross_domain_done` when it ended.
        """
        if self._cross_in_flight:
            return None
        self._not_approved = {r: t for r, t in self._not_approved.items() if t > now_s}
        by_model: dict[str, list[DomainSummary]] | None = None  # read only when this domain is a source
        for model in self.models():
            mine = self._summarizer.summarize(self.loads(model), model=model)
            if not is_source_domain(mine, self.cfg.policy):
                continue  # plan_cross_domain's first rule: not paired as a source, whatever the others
            if by_model is None:
                by_model = {}
                for summary in others:
                    if summary.domain_id != self.domain_id:
                        by_model.setdefault(summary.model, []).append(summary)
            loads = [self._holding_back(load) for load in self.free_loads(now_s, model)]
            move = plan_cross_domain(
                mine,
                by_model.get(model, []),
                loads,
                self.cfg.policy,
                self._rng,
                details=lambda load: self._holding_back(self.detailed(load)),
            )
            if move is None:
                continue
            request = move.request
            return CrossDomainProposal(
                src_instance_id=move.src_instance_id,
                request_id=request.request_id,
                model=model,
                blocks=request.blocks,
                num_tokens=request.num_tokens,
                max_blocks=request.max_blocks,
                remaining_tokens=self.remaining.estimate(request.output_tokens, request.max_tokens),
                decode_step_s=move.src_decode_step_s if move.src_decode_step_s > 0 else self.cfg.default_decode_step_s,
                dst_domain_id=move.dst_domain_id,
                reason=move.reason,
                prefix_hashes=request.prefix_hashes,
                prefix_block_tokens=move.src_prefix_block_tokens,
            )
        return None

    def _holding_back(self, load: InstanceLoad) -> InstanceLoad:
        """``load`` with the requests in their cool-down marked unmigratable (a brief load lists none)."""
        if not self._not_approved or not any(r.request_id in self._not_approved for r in load.running):
            return load
        held = tuple(replace(r, migratable=False) if r.request_id in self._not_approved else r for r in load.running)
        return replace(load, running=held)

    def cross_domain_started(self, move: CrossDomainProposal) -> None:
        """``move`` is proposed: its source is busy and the domain proposes nothing more until
        :meth:`cross_domain_done`."""
        self._cross_in_flight += 1
        self.migration_started((move.src_instance_id,))

    def cross_domain_done(self, move: CrossDomainProposal, now_s: float) -> None:
        """The move begun by :meth:`cross_domain_started` ended: refused, committed, aborted or failed."""
        self._cross_in_flight -= 1
        self.migration_done((move.src_instance_id,), now_s)

    def not_approved(self, request_id: str, now_s: float) -> None:
        """The coordinator did not approve moving ``request_id``: do not propose it again for ``cool_down_s``."""
        self._not_approved[request_id] = now_s + self.cfg.cool_down_s

    # ---- summaries ---------------------------------------------------------------------------------
    def summaries(self, taken_s: float) -> tuple[DomainSummary, ...]:
        """One summary per model served (sorted by model), stamped ``taken_s`` (the publisher's clock):
        ``policy.summarize_domain`` of its instances' loads (:meth:`loads`)."""
        summarize = self._summarizer.summarize
        return tuple(summarize(self.loads(model), model=model, taken_s=taken_s) for model in self.models())
