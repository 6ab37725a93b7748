"""Sort keys for freeness: a strict total order that stays correct with ±inf and ties.

Freeness can be −inf (draining) and equal for many instances; sorting by freeness alone is then
not a total order and the result depends on input order. Every key here ends with the unique id,
so two distinct instances never compare equal. NaN is refused: it compares false with everything
and would silently break the order.
"""

from __future__ import annotations

import math

__all__ = ["freest_first", "fullest_first"]

SortKey = tuple[float, float, str]


def _check(freeness: float, item_id: str) -> None:
    if math.isnan(freeness):
        raise ValueError(f"{item_id}: freeness is NaN; it cannot be ordered")


def fullest_first(freeness: float, item_id: str, tiebreak: float = 0.0) -> SortKey:
    """Key ordering lowest freeness first; ties by `tiebreak` (a seeded draw), then by id."""
    _check(freeness, item_id)
    return (freeness, tiebreak, item_id)


def freest_first(freeness: float, item_id: str, tiebreak: float = 0.0) -> SortKey:
    """Key ordering highest freeness first; ties by `tiebreak` (a seeded draw), then by id."""
    _check(freeness, item_id)
    return (-freeness, tiebreak, item_id)
