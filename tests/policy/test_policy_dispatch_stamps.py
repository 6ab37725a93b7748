"""A report that took time to arrive keeps the dispatches it missed (stamped reservations)."""

from __future__ import annotations

import random

from policy.dispatch import DomainDispatchView
from policy.load import InstanceLoad
from policy.summarize import summarize_domain
from policy.types import PolicyConfig

CFG = PolicyConfig(priority_headroom_blocks={})


def _summary(domain: str, used: int) -> object:
    return summarize_domain(domain, [InstanceLoad(f"{domain}-i0", 1000, used, domain_id=domain)], CFG)


def test_update_keeps_reservations_made_after_the_summary_was_taken() -> None:
    a, b = _summary("a", 0), _summary("b", 100)
    view = DomainDispatchView([a, b], CFG, random.Random(0))  # type: ignore[list-item]
    assert view.pick(300, stamp=1.0).target_id == "a"
    loaded = view.freeness("a")
    assert loaded == 1000 - 300  # one reserved request: (1000 - 300) / 1
    view.update(a, as_of=0.5)  # taken before the pick: it cannot count that request
    assert view.freeness("a") == loaded
    assert view.pick(300, stamp=1.2).target_id == "b"  # so the next request goes elsewhere
    view.update(a, as_of=1.1)  # taken after the pick: it counts that request itself
    assert view.freeness("a") == 1000.0
    assert view.freeness("b") == 1000 - 100 - 300
    view.update(b, as_of=1.0)  # taken before the pick on b
    assert view.freeness("b") == 1000 - 100 - 300
    view.update(b)  # no stamp: a fresh report, every reservation dropped
    assert view.freeness("b") == 900.0
