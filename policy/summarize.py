"""Domain summaries made from load reports: ``summarize_domain`` and the ``DomainSummarizer`` a domain
scheduler keeps (the value types, ``DomainSummary`` and ``InstanceBrief``, are :mod:`policy.domain`'s).

Kept apart from the value types because the simulator compiles this module (``hilum_compiled``), while the
types stay plain Python: the etcd records' codec and the configuration loader read their type hints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from operator import attrgetter

from policy.domain import DomainSummary, InstanceBrief
from policy.load import InstanceLoad
from policy.types import PolicyConfig, _trusted_constructor
from policy.usage import freeness_of, instance_virtual_usage, queued_blocks

__all__ = ["DomainSummarizer", "brief_of", "restamped", "same_content", "summarize_domain"]

_trusted_instance_brief: Callable[..., InstanceBrief] = _trusted_constructor(InstanceBrief)
_trusted_domain_summary: Callable[..., DomainSummary] = _trusted_constructor(DomainSummary)
# The field orders the trusted constructors are called in, positionally (tests/policy pins them to the classes')
_BRIEF_FIELDS = (
    "instance_id", "capacity_blocks", "free_blocks", "virtual_usage", "num_running", "num_waiting", "draining",
    "decode_step_s", "max_num_seqs", "prefix_hashes", "prefill_s_per_token",
)  # fmt: skip
_SUMMARY_FIELDS = (
    "domain_id", "num_instances", "capacity_blocks", "virtual_usage", "freeness", "largest_free_blocks",
    "max_instance_capacity_blocks", "num_running", "num_waiting", "draining", "queued_blocks", "model", "taken_s",
    "instances", "prefix_hashes",
)  # fmt: skip
_TAKEN_AT = _SUMMARY_FIELDS.index("taken_s")
_summary_values: Callable[[DomainSummary], tuple[object, ...]] = attrgetter(*_SUMMARY_FIELDS)
_content_values: Callable[[DomainSummary], tuple[object, ...]] = attrgetter(
    *(f for f in _SUMMARY_FIELDS if f != "taken_s")
)


def brief_of(load: InstanceLoad, cfg: PolicyConfig) -> InstanceBrief:
    """The brief of one instance's load report under the rule book ``cfg`` (a valid report makes a valid brief:
    no checks again)."""
    return _trusted_instance_brief(  # positional, in field order (_BRIEF_FIELDS): a third cheaper than by keyword
        load.instance_id,
        load.capacity_blocks,
        load.capacity_blocks - load.used_blocks,
        instance_virtual_usage(load, cfg),
        load.num_running,
        load.num_waiting,
        load.draining,
        load.decode_step_s,
        load.max_num_seqs,
        load.prefix_hashes,
        load.prefill_s_per_token,
    )


def summarize_domain(
    domain_id: str,
    loads: Sequence[InstanceLoad],
    cfg: PolicyConfig,
    *,
    model: str = "",
    taken_s: float = 0.0,
) -> DomainSummary:
    """Summarize the instances of one domain (those serving ``model``: the caller groups them).

    F_domain = (Σ_active M − ΣV) / max(1, Σ running) — Llumnix's freeness (OSDI'24 §4.4.2) over the
    group. Draining instances add no capacity, and their real blocks (not +inf) count as usage,
    since those requests must find room elsewhere in the domain. A domain whose instances all drain
    is draining (ΣV = +inf, F = −inf). An empty domain is not draining and has no capacity.
    Raises ValueError when a load names another domain, two loads the same instance, or ``taken_s`` is not finite.
    """
    _check_taken(domain_id, taken_s)
    return _summarize(domain_id, loads, cfg, model, taken_s, None)


def _check_taken(domain_id: str, taken_s: float) -> None:
    """Raises ValueError unless ``taken_s`` is a finite time (a summary's stamp orders it against reservations)."""
    if not math.isfinite(taken_s):
        raise ValueError(f"summarize_domain({domain_id!r}): taken_s must be a finite time in seconds, got {taken_s}")


class _KeptBrief:
    """An instance's last report summarized and the brief of it (:class:`DomainSummarizer`), updated in place: a
    new (report, brief) pair at every changed report was a tuple made, and the one before freed, each time."""

    __slots__ = ("brief", "load")

    def __init__(self, load: InstanceLoad, brief: InstanceBrief) -> None:
        self.load = load
        self.brief = brief


#: A brief remembered per instance id with the report it was made of.
BriefCache = dict[str, _KeptBrief]


def _summarize(
    domain_id: str,
    loads: Sequence[InstanceLoad],
    cfg: PolicyConfig,
    model: str,
    taken_s: float,
    briefs: BriefCache | None,
) -> DomainSummary:
    """:func:`summarize_domain` in one pass over the loads; ``briefs``: each instance's brief, kept from an
    earlier call while its report is the same object (None: every brief made anew).

    The loads are valid reports (``InstanceLoad`` checks every one when it is built), so the briefs are made without
    checks (:func:`brief_of`), and so is the summary when the loads come sorted by instance id without repeats, as a
    domain core lists them: every count is a sum or a maximum of non-negative counts, ΣV is finite or +inf and never
    NaN. Loads in another order are sorted, and the summary goes through ``DomainSummary``'s checks (two loads of
    one instance are refused there). The figures are those of the formulas in :func:`summarize_domain`, summed in
    instance-id order (ΣV by ``sum`` over the same floats in the same order: the same value to the last bit).
    """
    summary = _summary_of_sorted(domain_id, loads, cfg, model, taken_s, briefs, trusted=True)
    if summary is None:  # not sorted by id without repeats
        for load in loads:  # the first load of another domain in the caller's order is the one named
            _check_domain(domain_id, load)
        ordered = sorted(loads, key=lambda load: load.instance_id)
        summary = _summary_of_sorted(domain_id, ordered, cfg, model, taken_s, briefs, trusted=False)
    assert summary is not None
    return summary


def _check_domain(domain_id: str, load: InstanceLoad) -> None:
    """Raises ValueError when ``load`` names a domain other than ``domain_id``."""
    if load.domain_id and load.domain_id != domain_id:
        raise ValueError(
            f"summarize_domain({domain_id!r}): instance {load.instance_id!r} reports domain {load.domain_id!r}"
        )


def _summary_of_sorted(
    domain_id: str,
    loads: Sequence[InstanceLoad],
    cfg: PolicyConfig,
    model: str,
    taken_s: float,
    briefs: BriefCache | None,
    *,
    trusted: bool,
) -> DomainSummary | None:
    """The summary of ``loads`` (:func:`_summarize`'s arguments), in their order. ``trusted``: built without checks,
    and None as soon as two loads are not in increasing id order; else checked by ``DomainSummary``."""
    instances: list[InstanceBrief] = []
    usages: list[float] = []  # ΣV of each non-draining instance, in id order
    held: list[frozenset[int]] = []  # prefix blocks of each non-draining instance holding any
    num_running = num_waiting = capacity = drained_used = queued = 0
    largest_free = largest_capacity = 0  # max(..., default=0) of non-negative counts
    previous = ""  # the last instance id (every id is longer)
    for load in loads:
        iid = load.instance_id
        if trusted and iid <= previous:
            return None
        previous = iid
        _check_domain(domain_id, load)
        cached = briefs.get(iid) if briefs is not None else None
        if cached is not None and cached.load is load:
            brief = cached.brief
        else:
            brief = brief_of(load, cfg)
            if cached is not None:
                cached.load, cached.brief = load, brief
            elif briefs is not None:
                briefs[iid] = _KeptBrief(load, brief)
        instances.append(brief)
        num_running += load.num_running
        num_waiting += load.num_waiting
        if load.draining:
            drained_used += load.used_blocks
            continue
        usages.append(brief.virtual_usage)
        capacity += load.capacity_blocks
        free = load.capacity_blocks - load.used_blocks
        if free > largest_free:
            largest_free = free
        if load.capacity_blocks > largest_capacity:
            largest_capacity = load.capacity_blocks
        if load.num_waiting:  # the queue's demand behind its head
            queued += queued_blocks(load) - load.head_demand_blocks
        if brief.prefix_hashes:
            held.append(brief.prefix_hashes)
    draining = bool(instances) and not usages
    usage = math.inf if draining else float(sum(usages) + drained_used)  # a float when no usage is summed too
    if len(held) > 1:  # DomainSummary.__post_init__'s union of the non-draining instances' prefix blocks
        prefix_hashes: frozenset[int] = frozenset().union(*held)
    else:
        prefix_hashes = held[0] if held else frozenset()
    return (_trusted_domain_summary if trusted else DomainSummary)(  # positional, in _SUMMARY_FIELDS' order
        domain_id,
        len(instances),  # num_instances
        capacity,
        usage,
        freeness_of(capacity, usage, num_running),
        largest_free,
        largest_capacity,  # max_instance_capacity_blocks
        num_running,
        num_waiting,
        draining,
        queued,  # queued_blocks
        model,
        taken_s,
        tuple(instances),
        prefix_hashes,
    )


def restamped(summary: DomainSummary, taken_s: float) -> DomainSummary:
    """``summary`` stamped ``taken_s`` instead (``dataclasses.replace`` without checking the valid figures
    again)."""
    values = _summary_values(summary)
    return _trusted_domain_summary(*values[:_TAKEN_AT], taken_s, *values[_TAKEN_AT + 1 :])


def same_content(a: Sequence[DomainSummary], b: Sequence[DomainSummary]) -> bool:
    """Whether two publications of a domain (its summaries, one per model, in the same order) are equal but for
    when each summary was taken: a domain scheduler does not write such a one again (``SummaryPublisher``), so its
    readers keep the earlier one, stamp included; the simulator delivers the earlier one too. Compared field by
    field (the briefs too), without building copies."""
    return len(a) == len(b) and all(
        x is y or _content_values(x) == _content_values(y) for x, y in zip(a, b, strict=True)
    )


class DomainSummarizer:
    """:func:`summarize_domain` of one domain, call after call, redoing only what changed.

    A domain scheduler summarizes the same instances again and again (each publication, each cross-domain
    round), and between two calls many reports are the very same objects (an idle instance sends none; two
    calls at one instant read the same ones). Reports are frozen, so the same report object has the same
    brief (kept per instance with the report it came from), and the same report objects in the same order
    make the same summary (kept per model, with its reports; only the stamp ``taken_s`` is set anew). The
    figures are :func:`summarize_domain`'s for the same arguments.

    Args:
        domain_id: the domain summarized.
        cfg: the rule book (it sets the virtual usages; fixed for the summarizer's life).
    """

    def __init__(self, domain_id: str, cfg: PolicyConfig) -> None:
        self.domain_id = domain_id
        self.cfg = cfg
        self._briefs: BriefCache = {}  # instance -> (its last report summarized, the brief of it)
        self._last: dict[str, tuple[tuple[InstanceLoad, ...], DomainSummary]] = {}  # model -> (reports, summary)

    def summarize(self, loads: Sequence[InstanceLoad], *, model: str = "", taken_s: float = 0.0) -> DomainSummary:
        """``summarize_domain(domain_id, loads, cfg, model=model, taken_s=taken_s)``; raises as it does."""
        _check_taken(self.domain_id, taken_s)
        last = self._last.get(model)
        if last is not None and len(last[0]) == len(loads) and all(a is b for a, b in zip(last[0], loads, strict=True)):
            summary = last[1]
            return summary if summary.taken_s == taken_s else restamped(summary, taken_s)
        summary = _summarize(self.domain_id, loads, self.cfg, model, taken_s, self._briefs)
        self._last[model] = (tuple(loads), summary)
        return summary

    def forget(self, instance_id: str) -> None:
        """The instance left the domain: its brief is no longer kept (idempotent)."""
        self._briefs.pop(instance_id, None)
