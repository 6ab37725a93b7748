"""FencingGuard: the newest token wins; older tokens are refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clusterstate.fencing import FencingGuard, StaleToken


def test_guard_accepts_equal_and_newer_rejects_older() -> None:
    guard = FencingGuard()
    guard.check(7)
    guard.check(7)  # the same leader sends many approvals
    guard.check(12)
    with pytest.raises(StaleToken, match=r"fencing token 7 is older than the newest seen \(12\)"):
        guard.check(7)
    assert guard.newest == 12
    assert not guard.accepts(11)
    assert guard.accepts(13)


def test_guard_rejects_unstamped_token() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        FencingGuard().check(0)
    with pytest.raises(ValueError, match="must be >= 0"):
        FencingGuard(-1)


@given(st.lists(st.integers(min_value=1, max_value=50), max_size=40))
def test_a_token_is_accepted_iff_no_newer_one_was_seen(tokens: list[int]) -> None:
    guard = FencingGuard()
    running_max = 0
    for t in tokens:
        assert guard.accepts(t) == (t >= running_max)
        running_max = max(running_max, t)
        assert guard.newest == running_max
