"""bench/chaos_soak.py: its seeded schedule and load, its verdict on a stream, and a short soak of a live
cluster (``make test``)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_soak import (
    ONEWAY_CALLS,
    Fault,
    FaultKind,
    RequestSpec,
    Transcript,
    judge,
    make_schedule,
    request_spec,
)

REPO = Path(__file__).resolve().parents[2]
INSTANCES = ["a0", "a1", "b0", "b1", "c0", "c1"]
DOMAINS = ["dom-a", "dom-b", "dom-c"]
PAUSES = (FaultKind.SCHEDULER_PAUSE, FaultKind.LEADER_PAUSE, FaultKind.ETCD_PAUSE)


# ---- the schedule and the load ---------------------------------------------------------------------------
def _schedule(seed: int, chaos_s: float = 600.0, **kw: Any) -> list[Fault]:
    return make_schedule(seed, chaos_s, instances=INSTANCES, domains=DOMAINS, **kw)


def test_the_schedule_is_the_seeds_and_every_round_holds_every_kind() -> None:
    a, b = _schedule(7), _schedule(7)
    assert a == b and a != _schedule(8)
    kinds = list(FaultKind)
    for k in range(len(a) // len(kinds)):  # each complete round is a permutation of every kind
        assert sorted(f.kind for f in a[k * len(kinds) : (k + 1) * len(kinds)]) == sorted(kinds)
    assert [f.index for f in a] == list(range(len(a)))
    for prev, f in itertools.pairwise(a):  # one after another, a 2-5 s gap after each (at_s rounded to ms)
        assert prev.at_s + prev.after_s + prev.duration_s + 2.0 <= f.at_s + 1e-3
        assert f.at_s <= prev.at_s + prev.after_s + prev.duration_s + 5.0 + 1e-3
    assert a[-1].at_s + a[-1].after_s + a[-1].duration_s <= 600.0


def test_fault_parameters_stay_in_their_ranges() -> None:
    faults = [f for seed in range(20) for f in _schedule(seed)]
    for f in faults:
        if f.kind is FaultKind.LLUMLET_KILL:
            assert f.target in INSTANCES and f.duration_s == 0
        elif f.kind is FaultKind.SCHEDULER_PAUSE:
            assert f.target in DOMAINS
        if f.kind in PAUSES:
            assert 0.5 <= f.duration_s <= 4.0 or 11.0 <= f.duration_s <= 14.0
        if f.kind is FaultKind.LINK_ONEWAY:
            assert f.call in ONEWAY_CALLS and 2.0 <= f.duration_s <= 14.0
        if f.kind is FaultKind.LINK_DROP and f.call:
            assert f.call == "Commit" and 0 <= f.after_s <= 0.008 and f.duration_s <= 2.0
        elif f.kind in (FaultKind.LINK_DROP, FaultKind.LINK_BLACKHOLE):
            assert 0 <= f.after_s <= (0.12 if f.cross_domain else 0.02) and f.call == ""
        if f.kind is FaultKind.LINK_DELAY:
            assert 0.005 <= f.delay_s <= 0.4 and 1.0 <= f.duration_s <= 6.0
    drops = [f for f in faults if f.kind is FaultKind.LINK_DROP]
    assert 0.3 < sum(bool(f.call) for f in drops) / len(drops) < 0.7  # half of them at a Commit
    long = [f for f in faults if f.kind in PAUSES and f.duration_s > 10]
    assert 0.1 < len(long) / sum(f.kind in PAUSES for f in faults) < 0.3  # --long-pause-fraction 0.2
    assert all(f.duration_s <= 4.0 for f in _schedule(3, long_pause_fraction=0.0) if f.kind in PAUSES)
    assert all(f.duration_s >= 11.0 for f in _schedule(3, long_pause_fraction=1.0) if f.kind in PAUSES)


def test_a_request_is_a_function_of_the_seed_and_its_index() -> None:
    models = ["llama-2-13b", "llama-2-7b"]
    specs = [request_spec(5, i, models) for i in range(400)]
    assert specs == [request_spec(5, i, models) for i in range(400)] and specs != [
        request_spec(6, i, models) for i in range(400)
    ]
    assert {s.model for s in specs} == set(models)
    assert all(16 <= s.prompt_tokens <= 400 and 16 <= s.max_tokens <= 320 for s in specs)
    leave = [s for s in specs if s.disconnect_after is not None]
    assert all(s.stream and 1 <= s.disconnect_after < s.max_tokens for s in leave if s.disconnect_after)
    assert 10 < len(leave) < 50 and 30 < sum(not s.stream for s in specs) < 100
    assert specs[0].body() == {
        "model": specs[0].model,
        "prompt": "x" * specs[0].prompt_tokens,
        "max_tokens": specs[0].max_tokens,
        "stream": specs[0].stream,
        "return_token_ids": True,
    }


# ---- the verdict on one stream -------------------------------------------------------------------------
SPEC = RequestSpec(0, "m", 10, 4, True, None)


def _chunk(ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": "", "finish_reason": finish, "token_ids": ids}], "hilum": {}}


def _error(message: str = "instance a0 stopped: request lost") -> dict[str, Any]:
    return {"error": {"message": message, "type": "upstream_error", "param": None, "code": "request_failed"}}


def _tr(events: list[dict[str, Any]], *, done: bool = True, ended: str = "eof", status: int = 200) -> Transcript:
    return Transcript(status=status, events=events, done=done, ended=ended)


@pytest.mark.parametrize(
    ("events", "kw", "outcome", "problem"),
    [
        ([_chunk([0, 1]), _chunk([2, 3]), _chunk([], "length")], {}, "complete", ""),
        ([_chunk([0, 1]), _chunk([1, 2, 3]), _chunk([], "length")], {}, "complete", "token 2 is id 1 (duplicated"),
        ([_chunk([0, 1]), _chunk([3]), _chunk([], "length")], {}, "complete", "token 2 is id 3 (missing"),
        ([_chunk([0, 1, 2]), _chunk([], "length")], {}, "complete", "3 tokens, not max_tokens = 4"),
        ([_chunk([0, 1, 2, 3], "length"), _chunk([], "length")], {}, "complete", "2 end events"),
        ([_chunk([0, 1, 2, 3])], {}, "complete", "0 end events"),
        ([_chunk([0, 1, 2, 3], "length")], {"done": False}, "complete", "without data: [DONE]"),
        ([_chunk([0, 1, 2, 3], "stop")], {}, "complete", "finish_reason 'stop'"),
        ([_chunk([0, 1]), _error()], {}, "error", ""),
        ([_chunk([0, 1]), _error(), _chunk([2])], {}, "error", "1 event(s) after the end event"),
        ([_chunk([0, 2]), _error()], {}, "error", "token 1 is id 2"),
        ([_chunk([0]), _error("")], {}, "error", "an error event without a message"),
        ([_chunk([0, 1])], {"done": False, "ended": "disconnected"}, "disconnected", ""),
        ([_chunk([0, 0])], {"done": False, "ended": "disconnected"}, "disconnected", "token 1 is id 0"),
        ([_chunk([0, 1])], {"done": False, "ended": "stalled"}, "hang", "hang: stalled after 2 tokens"),
        ([_chunk([0])], {"done": False, "ended": "broken: ClientPayloadError: x"}, "broken", "cut without an end"),
    ],
)
def test_a_stream_is_judged_by_its_tokens_and_its_one_end(
    events: list[dict[str, Any]], kw: dict[str, Any], outcome: str, problem: str
) -> None:
    got, problems = judge(SPEC, _tr(events, **kw))
    assert got == outcome
    if problem:
        assert len(problems) >= 1 and any(problem in p for p in problems), problems
    else:
        assert problems == []


def test_answers_that_are_not_streams() -> None:
    refused = Transcript(503, json.dumps(_error("no domain accepted the request")), ended="eof")
    assert judge(SPEC, refused) == ("refused", [])
    assert judge(SPEC, Transcript(502, json.dumps(_error()), ended="eof")) == ("error", [])
    outcome, problems = judge(SPEC, Transcript(500, "Internal Server Error", ended="eof"))
    assert outcome == "error" and "HTTP 500 without an OpenAI error body" in problems[0]
    whole = RequestSpec(1, "m", 10, 3, False, None)

    def body(ids: list[int], finish: str = "length") -> str:
        return json.dumps({"choices": [{"token_ids": ids, "finish_reason": finish}]})

    assert judge(whole, Transcript(200, body([0, 1, 2]), ended="eof")) == ("complete", [])
    assert judge(whole, Transcript(200, body([0, 2, 1]), ended="eof"))[1][0].startswith("token 1 is id 2")
    assert judge(whole, Transcript(200, "{}", ended="eof"))[0] == "broken"


# ---- a short soak (make test) ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_short_soak_of_a_live_cluster_breaks_no_invariant(tmp_path: Path) -> None:
    """60 s of load and faults with seed 8: every kind of fault, among them a 10.4 s hold of a Commit's answer
    (beyond the source's 10 s deadline), a reset 6.5 ms after a Commit went out, and etcd paused for 11.7 s
    (beyond the 10 s lease TTL)."""
    seed, minutes = 8, 1.0
    kinds = {f.kind for f in _schedule(seed, minutes * 60)}
    assert kinds == set(FaultKind)
    cmd = [sys.executable, str(REPO / "bench" / "chaos_soak.py"), "--minutes", str(minutes), "--seed", str(seed)]
    cmd += ["--stall-s", "45", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    report = json.loads((tmp_path / "report.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "violations: 0" in proc.stdout and report["violations"] == []
    assert report["outcomes"]["complete"] >= 80
    assert sum(report["faults"].values()) >= 6 and report["faults"]["client-disconnect"] >= 3
    assert report["samples"] >= 50 and report["view_checks"] >= 15
    injected = {k for k, n in report["faults"].items() if n}
    assert {"llumlet-kill", "scheduler-pause", "leader-pause", "etcd-pause"} <= injected
