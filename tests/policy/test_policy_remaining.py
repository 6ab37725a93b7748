"""The remaining-output estimate: the request's bound, then the mean residual of what finished."""

from __future__ import annotations

import pytest

from policy.remaining import RemainingConfig, RemainingEstimator


def test_bound_until_enough_longer_requests_were_seen() -> None:
    est = RemainingEstimator(RemainingConfig(min_samples=3, default_tokens=256))
    assert est.estimate(0) == 256  # no bound, nothing seen
    assert est.estimate(40, max_tokens=100) == 60
    for n in (50, 90, 130):
        est.observe(n)
    # outlived 40: all three; mean residual (10 + 50 + 90) / 3 = 50 < 60
    assert est.estimate(40, max_tokens=100) == 50
    assert est.estimate(40) == 50
    # outlived 60: only two (90, 130) < min_samples: the bound again
    assert est.estimate(60, max_tokens=100) == 40
    assert est.estimate(99, max_tokens=100) == 1 and est.estimate(120, max_tokens=100) == 0


def test_the_window_forgets_old_requests() -> None:
    est = RemainingEstimator(RemainingConfig(window=2, min_samples=1))
    for n in (1000, 10, 20):
        est.observe(n)
    assert est.samples == 2 and est.estimate(0) == 15  # 1000 fell out


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="output_tokens must be >= 0"):
        RemainingEstimator().observe(-1)
    with pytest.raises(ValueError, match=r"RemainingConfig.window: must be >= 1, got 0"):
        RemainingConfig(window=0)
