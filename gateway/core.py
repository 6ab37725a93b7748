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

The live gateway (``gateway.router``) feeds it from etcd and submits over gRPC; the simulator
(``sim.schedulers``) feeds it the summaries it delivers on the virtual clock. Stamps are wall-clock seconds
live (the publishers' and the gateways' clocks agree to NTP precision), virtual seconds simulated.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable

from policy.dispatch import DispatchDecision, DomainDispatchView
from policy.domain import DomainSummary
from policy.types import PolicyConfig

__all__ = ["GatewayCore"]


class GatewayCore:
    """Domain choice per model (see the module docstring).

    Args:
        cfg: the rule book (priority headroom, tie tolerance).
        rng: near-tie draws.
        reservation_ttl_s: how long a reservation counts at most, seconds.

    Raises ValueError on a negative ``reservation_ttl_s``.
    """

    def __init__(self, cfg: PolicyConfig, rng: random.Random, *, reservation_ttl_s: float = 1.0) -> None:
        if reservation_ttl_s < 0:
            raise ValueError(f"reservation_ttl_s must be >= 0, got {reservation_ttl_s}")
        self._cfg = cfg
        self._rng = rng
        self.reservation_ttl_s = reservation_ttl_s
        self._views: dict[str, DomainDispatchView] = {}  # model -> view over the domains serving it
        self._summaries: dict[tuple[str, str], DomainSummary] = {}  # (domain, model) -> latest summary

    def models(self) -> list[str]:
        """Models some domain serves, sorted."""
        return sorted({model for _, model in self._summaries})

    def domains(self, model: str | None = None) -> list[str]:
        """Domains with a summary (for ``model``, or any), sorted."""
        return sorted({d for d, m in self._summaries if model is None or m == model})

    def summary(self, domain_id: str, model: str) -> DomainSummary | None:
        """The latest summary of ``domain_id`` for ``model``."""
        return self._summaries.get((domain_id, model))

    def update(self, domain_id: str, summaries: Iterable[DomainSummary]) -> None:
        """A domain published ``summaries`` (one per model it serves); models it no longer serves are dropped.

        Raises ValueError when a summary names another domain.
        """
        fresh = {s.model: s for s in summaries}
        for s in fresh.values():
            if s.domain_id != domain_id:
                raise ValueError(f"update({domain_id!r}): a summary names domain {s.domain_id!r}")
        for d, model in [k for k in self._summaries if k[0] == domain_id and k[1] not in fresh]:
            self._drop(d, model)
        for model, s in fresh.items():
            if self._summaries.get((domain_id, model)) == s:
                continue  # nothing new: keep the reservations
            self._summaries[(domain_id, model)] = s
            self._view(model).update(s, as_of=s.taken_s)

    def remove(self, domain_id: str) -> None:
        """A domain deregistered (idempotent)."""
        for d, model in [k for k in self._summaries if k[0] == domain_id]:
            self._drop(d, model)

    def _drop(self, domain_id: str, model: str) -> None:
        del self._summaries[(domain_id, model)]
        self._view(model).remove(domain_id)

    def _view(self, model: str) -> DomainDispatchView:
        view = self._views.get(model)
        if view is None:
            view = self._views[model] = DomainDispatchView((), self._cfg, self._rng)
        return view

    def resolve_model(self, model: str) -> str | None:
        """The model a request names, or the only model served when it names none (None: not served)."""
        models = self.models()
        if not model:
            return models[0] if len(models) == 1 else None
        return model if model in models else None

    def pick(
        self,
        model: str,
        demand_blocks: int,
        now_s: float,
        *,
        need_blocks: int = 0,
        priority: int = 0,
        exclude: Collection[str] = (),
    ) -> DispatchDecision:
        """Choose a domain for a request of ``model`` (``demand_blocks`` to start, ``need_blocks`` at most) and
        reserve it there, stamped ``now_s``. ``exclude``: domains already tried for this request.

        Raises ValueError on negative block counts.
        """
        resolved = self.resolve_model(model)
        if resolved is None:
            served = ", ".join(self.models()) or "nothing yet"
            return DispatchDecision(None, f"model {model!r} is not served (served: {served})")
        view = self._view(resolved)
        horizon = now_s - self.reservation_ttl_s
        for (_, m), s in self._summaries.items():  # expire old reservations (see reservation_ttl_s)
            if m == resolved:
                view.update(s, as_of=max(s.taken_s, horizon))
        return view.pick(demand_blocks, priority, stamp=now_s, need_blocks=need_blocks, exclude=exclude)
