"""bench/sim_fingerprint.py: a run's fingerprint is the same run after run, and names what differs."""

from __future__ import annotations

import dataclasses

from bench.sim_fingerprint import differences, fingerprint
from sim.runner import DEFAULTS, run_simulation


def test_a_fingerprint_repeats_and_a_changed_run_is_named() -> None:
    spec = dataclasses.replace(DEFAULTS, policy="llumnix", max_requests=60, rate_scale=8.0)
    first, again = fingerprint(run_simulation(spec)), fingerprint(run_simulation(spec))
    assert first == again and len(first["requests"]) == 60 and differences(first, again) == []  # type: ignore[arg-type]
    other = fingerprint(run_simulation(dataclasses.replace(spec, policy="round-robin")))
    diff = differences(first, other)
    assert any(d.startswith("engine_steps") or "request records differ" in d for d in diff), diff
    shorter = dict(first, requests=first["requests"][:-1])  # type: ignore[index]
    assert differences(first, shorter)[0] == "59 requests, want 60"
