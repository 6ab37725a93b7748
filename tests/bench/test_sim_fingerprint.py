"""bench/sim_fingerprint.py: a run's fingerprint is the same run after run, and names what differs."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from sim.runner import DEFAULTS, run_simulation

_PATH = Path(__file__).resolve().parents[2] / "bench" / "sim_fingerprint.py"


def _fingerprints() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sim_fingerprint_bench", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_fingerprint_repeats_and_a_changed_run_is_named() -> None:
    fp = _fingerprints()
    spec = dataclasses.replace(DEFAULTS, policy="llumnix", max_requests=60, rate_scale=8.0)
    first, again = fp.fingerprint(run_simulation(spec)), fp.fingerprint(run_simulation(spec))
    assert first == again and len(first["requests"]) == 60 and fp.differences(first, again) == []
    other = fp.fingerprint(run_simulation(dataclasses.replace(spec, policy="round-robin")))
    diff = fp.differences(first, other)
    assert any(d.startswith("engine_steps") or "request records differ" in d for d in diff), diff
    shorter = dict(first, requests=first["requests"][:-1])
    assert fp.differences(first, shorter)[0] == "59 requests, want 60"
