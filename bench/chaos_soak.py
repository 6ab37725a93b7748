"""A seeded chaos soak of a live hilum cluster (issue 11): faults while streams of two models run, then the
invariants checked.

The cluster is ``hilum up --engine sim`` (every process real, on loopback: an embedded etcd, two coordinators,
a domain scheduler per NVLink domain, a llumlet per instance with the simulated engine, two gateways sharing
one port with SO_REUSEPORT) on :data:`TOPOLOGY`: llama-2-7b on a0, a1, b0 and llama-2-13b on b1, c0, c1 in
three domains (dom-b holds both models). ``hilum up`` supervises it: a killed process is restarted.

**Load**: ``--concurrency`` clients send streamed (and some whole) ``/v1/completions`` of both models, each
on a new connection to the gateways' shared port, back to back for ``--minutes`` (at most ``--max-requests``).
Request ``k`` is a pure function of (seed, k) (:func:`request_spec`): its model, prompt and ``max_tokens``,
and whether the client goes away after some tokens (a client disconnect).

**Faults**: a schedule that is a pure function of the seed (:func:`make_schedule`), one fault after another
with a pause between them, every kind in each round of a shuffled deck:

- ``llumlet-kill``: SIGKILL of a llumlet; the supervisor restarts it;
- ``scheduler-pause``, ``leader-pause``, ``etcd-pause``: SIGSTOP, then SIGCONT, of a domain scheduler, of
  the coordinator that leads at that moment, of etcd; some pauses outlast the 10 s lease TTL
  (``--long-pause-fraction``), so registrations and the leadership are lost and taken over;
- ``link-drop``, ``link-delay``, ``link-blackhole``, ``link-oneway``: a live migration between two llumlets
  through a TCP proxy (:class:`LinkProxy`, asyncio, loopback only) in front of the destination: the soak picks
  a decoding request and commands the move itself (``MigrateOut`` with the proxy as the destination's
  address), then, a seeded delay into the move, the proxy resets every connection and refuses new ones for a
  while (drop), delays every chunk (delay), forwards nothing for a while and then resets (blackhole, a silent
  partition), or forwards the source's messages but holds the destination's answers for a while and then
  resets (one-way: the destination acts on what it hears, the source hears nothing back);
- ``client-disconnect``: per request, above.

**Invariants**, checked while it runs (where cheap) and at the end:

- every request ends exactly once: complete (token ids ``0 .. max_tokens-1``, the sim engine's numbering, in
  order, each once, one finish event, then ``[DONE]``), or with one clear error event (the tokens before it
  a prefix of those), or is refused with an OpenAI error body; never a hang (no event for ``--stall-s``), never
  a duplicated, missing or reordered token, never a cut stream;
- no request in two engines' running sets: sampled every 0.5 s on every llumlet; a request seen in two in
  three samples in a row (a sample is not atomic across llumlets: one move can show it in both once) is a
  violation; so is a request that still runs ``--orphan-grace-s`` after its client's stream ended; and right
  after each forced move answers, the request runs only on the side the answer names (the source if it was
  not committed, and not even there once its client has every token; the destination if it was), as seen
  twice, 2 s apart (a copy that lost the origin's arbitration stops at its next push);
- no KV block leaked: after the load, every instance goes idle (used == 0, nothing reserved, queued,
  suspended or migrating) within 60 s;
- the coordinators' view equals etcd: every 5 s and at the end each replica's ListDomains, ListInstances and
  ListMigrations equal the answers computed from etcd's contents at the revision the replica's view reflects
  (``ClusterView.list_at``), and at the end every replica's view catches up with etcd;
- no process is left after the cluster stops.

It prints requests served, faults injected by kind, and every violation with the seed and the faults fired in
the 30 s before it (the schedule is the seed's; the timing of real processes is not, so a rerun with the same
seed replays the same faults and load but not necessarily the same interleaving). ``--out DIR`` keeps the
cluster's logs and writes ``report.json``; without it they are kept in a temporary directory only when a
violation was found.

Usage::

    .venv/bin/python bench/chaos_soak.py [--minutes 10] [--seed 1] [--concurrency 14] [--out DIR]

Exit status: 0 no violation; 1 a violation, or the cluster did not start, or the run was interrupted; 2 a bad
option.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import enum
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from bench.link_proxy import LinkProxy  # noqa: E402
from clusterstate.etcd import Etcd3Client, connect, kv_of  # noqa: E402
from clusterstate.store import ClusterView, Keys  # noqa: E402
from global_coord.coordinator import Coordinator  # noqa: E402
from global_coord.server import CoordinatorService  # noqa: E402
from hilum_proto.v1 import coordinator_pb2 as cpb  # noqa: E402
from hilum_proto.v1 import coordinator_pb2_grpc as cpb_grpc  # noqa: E402
from hilum_proto.v1 import llumlet_pb2 as lpb  # noqa: E402
from llumlet.client import LlumletClient  # noqa: E402
from topology.load import parse_topology, parse_yaml  # noqa: E402
from topology.spec import Topology  # noqa: E402

TOPOLOGY_NAME = "chaos-two-models"
TOPOLOGY = """\
# bench/chaos_soak.py's cluster: two models in three NVLink domains; dom-b holds one instance of each.
name: chaos-two-models
models:
  - {name: llama-2-7b, num_layers: 32, num_attention_heads: 32, num_kv_heads: 32, head_dim: 128,
     hidden_size: 4096, dtype: float16, block_size_tokens: 16, num_params: 6738415616, max_context_tokens: 4096}
  - {name: llama-2-13b, num_layers: 40, num_attention_heads: 40, num_kv_heads: 40, head_dim: 128,
     hidden_size: 5120, dtype: float16, block_size_tokens: 16, num_params: 13015864320, max_context_tokens: 4096}
gpu_types:
  - {name: a100-80gb, memory_gib: 80, hbm_gbyte_per_s: 2039, nvlink_gbyte_per_s: 600}
domains:
  - id: dom-a
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-a, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: a0, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 96}
      - {id: a1, gpus: [1], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 96}
  - id: dom-b
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-b, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: b0, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 96}
      - {id: b1, gpus: [1], tensor_parallel_size: 1, model: llama-2-13b, kv_capacity_blocks: 96}
  - id: dom-c
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-c, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: c0, gpus: [0], tensor_parallel_size: 1, model: llama-2-13b, kv_capacity_blocks: 96}
      - {id: c1, gpus: [1], tensor_parallel_size: 1, model: llama-2-13b, kv_capacity_blocks: 96}
fabric:
  oversubscription: 1.0
  racks:
    - {id: rack-0, domains: [dom-a, dom-b, dom-c]}
"""
MODELS = {"a0": "llama-2-7b", "a1": "llama-2-7b", "b0": "llama-2-7b", "b1": "llama-2-13b"}
MODELS |= {"c0": "llama-2-13b", "c1": "llama-2-13b"}
DOMAINS = {"a0": "dom-a", "a1": "dom-a", "b0": "dom-b", "b1": "dom-b", "c0": "dom-c", "c1": "dom-c"}
LEASE_TTL_S = 10.0  # the default --ttl of every hilum process
ATTEMPT_BASE = 1 << 31  # the soak's own migration attempts (uint32), above any a domain scheduler numbers (revisions)
SAMPLE_EVERY_S = 0.5
VIEW_EVERY_S = 5.0
CONTEXT_S = 30.0  # a violation is reported with the faults fired this long before it
OWNER_RECHECK_S = 2.0  # a second look at a forced move's two sides before a two-owners violation


# ---- the fault schedule (a pure function of the seed) ----------------------------------------------------
class FaultKind(enum.StrEnum):
    """A scheduled fault (module docstring)."""

    LLUMLET_KILL = "llumlet-kill"
    SCHEDULER_PAUSE = "scheduler-pause"
    LEADER_PAUSE = "leader-pause"
    ETCD_PAUSE = "etcd-pause"
    LINK_DROP = "link-drop"
    LINK_DELAY = "link-delay"
    LINK_BLACKHOLE = "link-blackhole"
    LINK_ONEWAY = "link-oneway"


# link-oneway holds the answers from this call of the move on: mostly Commit (the destination commits, the
# source never hears: the ghost), else the first Reserve or the first pre-copy stage.
ONEWAY_CALLS = ("Commit", "Commit", "Commit", "Reserve", "WriteBlocks")
CLIENT_DISCONNECT = "client-disconnect"  # not scheduled: a property of each request (RequestSpec)


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault.

    ``target``: the llumlet (kill) or domain (scheduler pause) it hits; "" when it is chosen as it fires (the
    coordinator that leads then; for a link fault, a decoding request and its destination).
    """

    index: int
    at_s: float  # planned start, seconds after the load began (later if the previous fault is still on)
    kind: FaultKind
    target: str = ""
    duration_s: float = 0.0  # pause; refusal after a drop; how long a delay or a blackhole holds
    after_s: float = 0.0  # link faults: seconds from the MigrateOut to the fault (mid-migration)
    delay_s: float = 0.0  # link-delay: added to every chunk the proxy forwards
    cross_domain: bool = False  # link faults: the destination is in another NVLink domain
    call: str = ""  # link-oneway, link-drop: the fault hits at the source's first call of this method in the move

    def describe(self) -> str:
        """One line: ``#3 link-delay (+40 ms per chunk for 2.1 s, 60 ms into a cross-domain move) at 41.0 s``."""
        k = self.kind
        if k is FaultKind.LLUMLET_KILL:
            what = f"SIGKILL llumlet {self.target}"
        elif k in (FaultKind.SCHEDULER_PAUSE, FaultKind.LEADER_PAUSE, FaultKind.ETCD_PAUSE):
            who = {FaultKind.SCHEDULER_PAUSE: f"rack-{self.target}", FaultKind.LEADER_PAUSE: "the leader"}
            what = f"SIGSTOP {who.get(k, 'etcd')} for {self.duration_s:.1f} s"
        else:
            where = "across domains" if self.cross_domain else "inside its domain"
            move = f"{self.after_s * 1e3:.0f} ms into a move (preferably {where})"
            if k is FaultKind.LINK_DROP and self.call:
                what = (
                    f"reset every connection {self.after_s * 1e3:.1f} ms after the source's {self.call} of a move "
                    f"(preferably {where}), refuse new ones for {self.duration_s:.1f} s"
                )
            elif k is FaultKind.LINK_DROP:
                what = f"reset every connection, refuse new ones for {self.duration_s:.1f} s, {move}"
            elif k is FaultKind.LINK_DELAY:
                what = f"+{self.delay_s * 1e3:.0f} ms per chunk for {self.duration_s:.1f} s, from the start of a move"
            elif k is FaultKind.LINK_BLACKHOLE:
                what = f"forward nothing for {self.duration_s:.1f} s then reset, {move}"
            else:
                what = (
                    f"hold the destination's answers from the source's {self.call} of a move (preferably {where}) "
                    f"on, for {self.duration_s:.1f} s, then reset"
                )
        return f"#{self.index} {k.value} ({what}) at {self.at_s:.1f} s"


def make_schedule(
    seed: int,
    chaos_s: float,
    *,
    instances: Sequence[str],
    domains: Sequence[str],
    long_pause_fraction: float = 0.2,
    gap_s: tuple[float, float] = (2.0, 5.0),
) -> list[Fault]:
    """The faults of a run of ``chaos_s`` seconds, in order: a pure function of its arguments.

    Kinds come in rounds, each a seeded shuffle of every :class:`FaultKind`, so any run long enough for one
    round injects each kind. Pauses last 0.5-4 s, or 11-14 s (beyond the lease TTL) with probability
    ``long_pause_fraction``; a drop refuses new connections for 0-2 s; a blackhole lasts 0.5-12 s and a one-way
    hold 2-14 s (beyond the llumlets' 10 s RPC deadline at times), from the source's Commit (3 in 5), first
    Reserve or first pre-copy stage on; a delay adds 5-400 ms per chunk for 1-6 s; half the drops hit 0-8 ms
    after the source's Commit went out (a blip while the destination commits), the other half and every
    blackhole 0-20 ms into an intra-domain move, 0-120 ms into a cross-domain one. A gap of ``gap_s`` seconds follows
    each fault. Every fault ends before ``chaos_s``.
    """
    rng = random.Random(seed)
    out: list[Fault] = []
    deck: list[FaultKind] = []
    t = rng.uniform(*gap_s)
    while True:
        if not deck:
            deck = list(FaultKind)
            rng.shuffle(deck)
        kind = deck.pop()
        target, duration, after, delay, call = "", 0.0, 0.0, 0.0, ""
        cross = rng.random() < 0.5
        if kind is FaultKind.LLUMLET_KILL:
            target = rng.choice(sorted(instances))
        elif kind in (FaultKind.SCHEDULER_PAUSE, FaultKind.LEADER_PAUSE, FaultKind.ETCD_PAUSE):
            long = rng.random() < long_pause_fraction
            duration = rng.uniform(LEASE_TTL_S + 1, LEASE_TTL_S + 4) if long else rng.uniform(0.5, 4.0)
            if kind is FaultKind.SCHEDULER_PAUSE:
                target = rng.choice(sorted(domains))
        elif kind is FaultKind.LINK_DELAY:
            delay, duration = rng.uniform(0.005, 0.4), rng.uniform(1.0, 6.0)
        elif kind is FaultKind.LINK_ONEWAY:
            call, duration = rng.choice(ONEWAY_CALLS), rng.uniform(2.0, 14.0)
        elif kind is FaultKind.LINK_DROP and rng.random() < 0.5:  # a blip 0-8 ms after the Commit went out
            call, after, duration = "Commit", rng.uniform(0.0, 0.008), rng.uniform(0.0, 2.0)
        else:  # into the move: an intra-domain one (shared memory) takes milliseconds, a cross-domain one ~0.2 s
            after = rng.uniform(0.0, 0.12 if cross else 0.02)
            duration = rng.uniform(0.0, 2.0) if kind is FaultKind.LINK_DROP else rng.uniform(0.5, 12.0)
        if t + after + duration > chaos_s:
            return out
        out.append(Fault(len(out), round(t, 3), kind, target, duration, after, delay, cross, call))
        t += after + duration + rng.uniform(*gap_s)


# ---- the load (a pure function of the seed and the request's index) --------------------------------------
@dataclass(frozen=True, slots=True)
class RequestSpec:
    """Request ``index`` of a run."""

    index: int
    model: str
    prompt_tokens: int  # the prompt is this many bytes: one token each in the gateway's byte tokenizer
    max_tokens: int
    stream: bool
    disconnect_after: int | None  # the client goes away after this many tokens (None: it reads to the end)

    def body(self) -> dict[str, Any]:
        """The ``/v1/completions`` body."""
        return {
            "model": self.model,
            "prompt": "x" * self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "return_token_ids": True,
        }


def request_spec(seed: int, index: int, models: Sequence[str]) -> RequestSpec:
    """Request ``index`` of the run seeded ``seed``: 16-400 prompt tokens, 16-320 output tokens, 85% streamed;
    8% of the streamed ones are left by their client after a random number of tokens."""
    rng = random.Random(f"chaos-soak:{seed}:{index}")
    stream = rng.random() < 0.85
    max_tokens = rng.randint(16, 320)
    leave = stream and rng.random() < 0.08
    return RequestSpec(
        index,
        rng.choice(sorted(models)),
        rng.randint(16, 400),
        max_tokens,
        stream,
        rng.randint(1, max_tokens - 1) if leave else None,
    )


# ---- one request, as its client saw it, and the verdict -----------------------------------------------
@dataclass(slots=True)
class Transcript:
    """What the client of one request received."""

    status: int = 0  # HTTP status (0: no response)
    body: str = ""  # a non-200 or non-streamed response's body
    events: list[dict[str, Any]] = field(default_factory=list)  # the SSE events before [DONE], parsed
    done: bool = False  # ``data: [DONE]`` arrived
    after_done: int = 0  # non-empty lines after [DONE]
    ended: str = ""  # "eof" | "disconnected" | "stalled" | "timeout" | "broken: <why>"
    request_id: str = ""  # the gateway's id (the engines' request id)


def _token_problem(ids: Sequence[int], want: int | None) -> str:
    """Why ``ids`` are not ``0, 1, ...`` (of length ``want`` when given), or ""."""
    for i, t in enumerate(ids):
        if t != i:
            kind = "duplicated" if t < i else "missing or reordered"
            return f"token {i} is id {t} ({kind}; ids {list(ids[max(0, i - 3) : i + 3])} around it)"
    if want is not None and len(ids) != want:
        return f"{len(ids)} tokens, not max_tokens = {want}"
    return ""


def judge(spec: RequestSpec, tr: Transcript) -> tuple[str, list[str]]:
    """(outcome, problems) of one request: outcome ``complete`` | ``error`` (a clear error event or body) |
    ``refused`` (an error response before any token) | ``disconnected`` (its client left, by design); each
    problem breaks an invariant (module docstring)."""
    if tr.ended in ("stalled", "timeout"):
        tokens = sum(len(e["choices"][0].get("token_ids", [])) for e in tr.events if e.get("choices"))
        return "hang", [f"hang: {tr.ended} after {tokens} tokens (HTTP {tr.status or 'no response'})"]
    if tr.ended.startswith("broken"):
        return "broken", [f"the response was cut without an end: {tr.ended}"]
    if tr.status != 200:
        try:
            error = json.loads(tr.body)["error"]
            clear = isinstance(error.get("message"), str) and error["message"] != ""
        except (ValueError, KeyError, TypeError, AttributeError):
            clear = False
        if not clear:
            return "error", [f"HTTP {tr.status} without an OpenAI error body: {tr.body[:200]!r}"]
        return "refused" if tr.status == 503 else "error", []
    if not spec.stream:
        try:
            choice = json.loads(tr.body)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return "broken", [f"HTTP 200 with a body that is no completion: {tr.body[:200]!r}"]
        problem = _token_problem(choice["token_ids"], spec.max_tokens)
        if choice["finish_reason"] != "length":
            problem = problem or f"finish_reason {choice['finish_reason']!r}, not 'length'"
        return "complete", [problem] if problem else []
    ids = [t for e in tr.events if e.get("choices") for t in e["choices"][0].get("token_ids", [])]
    if tr.ended == "disconnected":
        problem = _token_problem(ids, None)
        return "disconnected", [problem] if problem else []
    problems = []
    if not tr.done:
        problems.append("the stream ended without data: [DONE]")
    if tr.after_done:
        problems.append(f"{tr.after_done} line(s) after data: [DONE]")
    ends = [
        i
        for i, e in enumerate(tr.events)
        if "error" in e or (e.get("choices") and e["choices"][0].get("finish_reason") is not None)
    ]
    if len(ends) != 1:
        problems.append(f"{len(ends)} end events (a finish or an error), not one")
    elif ends[0] != len(tr.events) - 1:
        problems.append(f"{len(tr.events) - 1 - ends[0]} event(s) after the end event")
    errors = [e for e in tr.events if "error" in e]
    if errors:
        if not isinstance(errors[0]["error"].get("message"), str) or not errors[0]["error"]["message"]:
            problems.append(f"an error event without a message: {errors[0]}")
        problem = _token_problem(ids, None)
        return "error", problems + ([problem] if problem else [])
    finish = tr.events[ends[0]]["choices"][0]["finish_reason"] if ends else None
    if finish != "length":
        problems.append(f"finish_reason {finish!r}, not 'length'")
    problem = _token_problem(ids, spec.max_tokens)
    return "complete", problems + ([problem] if problem else [])


# ---- the cluster (hilum up) -------------------------------------------------------------------------------
class ClusterFailed(RuntimeError):
    """``hilum up`` did not start, or stopped (the message has its log's tail)."""


def _pdeathsig() -> None:  # in the child, before exec: SIGTERM when the soak dies, so nothing is left behind
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Cluster:
    """``hilum up --engine sim`` on :data:`TOPOLOGY` as a child process; pids from its ``cluster.json``.

    Pausing goes through :meth:`pause` / :meth:`resume` so that :meth:`stop` resumes whatever is paused
    before it stops the cluster.
    """

    def __init__(self, work: Path, seed: int) -> None:
        self.work = work
        self.run_dir = work / "run"
        self.log = work / "hilum-up.log"
        self.seed = seed
        self.proc: subprocess.Popen[str] | None = None
        self.paused: set[int] = set()
        self.all_pids: set[int] = set()  # every pid the cluster ever had (checked at the end)

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Start and wait until it serves; returns ``cluster.json``. Raises ClusterFailed."""
        topology = self.work / "topology.yaml"
        topology.write_text(TOPOLOGY, encoding="utf-8")
        cmd = [sys.executable, "-m", "hilum_cli.main", "up", "--engine", "sim", "--topology", str(topology)]
        cmd += ["--coordinators", "2", "--gateways", "2", "--max-restarts", "1000", "--seed", str(self.seed)]
        cmd += ["--port", "0", "--etcd-port", "0", "--grpc-base-port", "0", "--run-dir", str(self.run_dir)]
        cmd += ["--start-timeout", str(timeout_s)]  # hilum up gives up by itself: the readline below returns
        env = {k: v for k, v in os.environ.items() if k != "HILUM_CONFIG"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=_pdeathsig
            )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "Ctrl-C stops everything" in line:
                info = self.info()
                self.all_pids |= set(info["pids"])
                return info
        raise ClusterFailed(f"hilum up did not come up within {timeout_s:.0f} s; {self.log} ends with:\n{self.tail()}")

    def tail(self, n_chars: int = 3000) -> str:
        """The end of ``hilum up``'s log."""
        try:
            return self.log.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "(no log)"

    def info(self) -> dict[str, Any]:
        """``cluster.json`` now (rewritten on every restart)."""
        info: dict[str, Any] = json.loads((self.run_dir / "cluster.json").read_text())
        return info

    def pid(self, name: str) -> int:
        """The pid of process ``name`` now (``llumlet-a0``, ``rack-dom-a``, ``coordinator-coord-0``, ``etcd``)."""
        pid = int(self.info()["processes"][name]["pid"])
        self.all_pids.add(pid)
        return pid

    def alive(self) -> bool:
        """Whether ``hilum up`` still runs (it exits when a child crashed more often than allowed)."""
        return self.proc is not None and self.proc.poll() is None

    def pause(self, pid: int) -> None:
        """SIGSTOP ``pid``."""
        self.paused.add(pid)
        os.kill(pid, signal.SIGSTOP)

    def resume(self, pid: int) -> None:
        """SIGCONT ``pid`` (no error if it is gone)."""
        self.paused.discard(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 90.0) -> list[int]:
        """Resume what is paused, stop the cluster as Ctrl-C does; the pids of the cluster still alive after."""
        for pid in list(self.paused):
            self.resume(pid)
        with contextlib.suppress(OSError, ValueError, KeyError):
            self.all_pids |= set(self.info()["pids"])
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return sorted(p for p in self.all_pids if _alive(p))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---- the report ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Violation:
    """A broken invariant: what, when (seconds after the load began), and the faults fired before it."""

    # stream | hang | two-engines | two-owners | orphan | leak | view | migration | process-left; and cluster,
    # interrupted, soak: the run itself did not go through (no cluster, Ctrl-C, an error of the soak)
    kind: str
    at_s: float
    detail: str
    recent_faults: tuple[str, ...] = ()


@dataclass(slots=True)
class Report:
    """Everything a run counts; printed by :meth:`render`."""

    seed: int
    minutes: float
    schedule: list[Fault]
    t0: float = 0.0  # monotonic time the load began
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)  # non-200 answers
    faults: collections.Counter[str] = field(default_factory=collections.Counter)  # injected, by kind
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)  # could not be injected
    moves: collections.Counter[str] = field(default_factory=collections.Counter)  # forced migrations' outcomes
    client_migrations: collections.Counter[str] = field(default_factory=collections.Counter)  # "intra" | "cross"
    fired: list[tuple[float, str]] = field(default_factory=list)  # (at_s, Fault.describe() and what happened)
    violations: list[Violation] = field(default_factory=list)
    ended_at: dict[str, float] = field(default_factory=dict)  # request id -> when its client's stream ended
    completed: set[str] = field(default_factory=set)  # request ids whose client received every token
    samples: int = 0  # running-set samples taken
    view_checks: int = 0  # replica answers compared with etcd
    error_examples: dict[str, int] = field(default_factory=dict)  # first words of error messages -> count

    def now_s(self) -> float:
        """Seconds since the load began."""
        return time.monotonic() - self.t0

    def violate(self, kind: str, detail: str) -> None:
        """Record a violation with the faults fired in the :data:`CONTEXT_S` before it."""
        at = self.now_s()
        recent = tuple(d for t, d in self.fired if at - CONTEXT_S <= t <= at)
        self.violations.append(Violation(kind, round(at, 2), detail, recent))
        print(f"chaos soak: VIOLATION at {at:.1f} s: {kind}: {detail}", file=sys.stderr, flush=True)

    def note_error(self, message: str) -> None:
        """Count an error event's message by its kind: request ids, addresses and numbers blanked out."""
        key = message.split(" tokens: ", 1)[-1]  # "request <id> failed after <n> tokens: <why>"
        key = re.sub(r"[0-9a-f]{32}|\d+(\.\d+)*(:\d+)?", "#", key)[:90]
        self.error_examples[key] = self.error_examples.get(key, 0) + 1

    def render(self) -> str:
        """The lines printed at the end."""
        sent = sum(self.outcomes.values())
        lines = [
            f"chaos soak: seed {self.seed}, {self.minutes:g} min of load and faults on {TOPOLOGY_NAME} "
            f"({len(MODELS)} llumlets in {len(set(DOMAINS.values()))} domains, 2 models, 2 coordinators, "
            "2 gateways on one port)",
            f"requests: {sent} sent: {self.outcomes['complete']} complete, {self.outcomes['error']} ended with a "
            f"clear error, {self.outcomes['refused']} refused (503), {self.outcomes['disconnected']} left by their "
            f"client" + "".join(f", {self.outcomes[k]} {k}" for k in ("hang", "broken") if self.outcomes[k]),
            f"  migrations seen by the clients: {self.client_migrations['intra']} inside a domain, "
            f"{self.client_migrations['cross']} across domains",
            "faults injected: " + ", ".join(f"{k} {self.faults[k]}" for k in [*FaultKind, CLIENT_DISCONNECT]),
        ]
        if self.skipped:
            lines.append("  not injected (no target then): " + ", ".join(f"{k} {n}" for k, n in self.skipped.items()))
        if self.moves:
            lines.append(
                "  forced migrations through the proxy: " + ", ".join(f"{n} {k}" for k, n in self.moves.items())
            )
        if self.statuses:
            lines.append(
                "  error answers by status: " + ", ".join(f"{k}: {n}" for k, n in sorted(self.statuses.items()))
            )
        if self.error_examples:
            top = sorted(self.error_examples.items(), key=lambda kv: -kv[1])[:5]
            lines.append("  errors seen: " + "; ".join(f"{n}x {m!r}" for m, n in top))
        lines.append(f"checks: {self.samples} running-set samples, {self.view_checks} coordinator answers vs etcd")
        lines.append(f"violations: {len(self.violations)}")
        for v in self.violations:
            lines.append(f"  at {v.at_s:.1f} s: {v.kind}: {v.detail}")
            lines.append(f"    reproduce: python bench/chaos_soak.py --seed {self.seed} --minutes {self.minutes:g}")
            for d in v.recent_faults:
                lines.append(f"    after fault {d}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """``report.json``."""
        return {
            "seed": self.seed,
            "minutes": self.minutes,
            "outcomes": dict(self.outcomes),
            "statuses": {str(k): n for k, n in self.statuses.items()},
            "faults": dict(self.faults),
            "skipped": dict(self.skipped),
            "forced_migrations": dict(self.moves),
            "client_migrations": dict(self.client_migrations),
            "schedule": [{**asdict(f), "kind": f.kind.value} for f in self.schedule],
            "fired": [{"at_s": round(t, 3), "what": d} for t, d in self.fired],
            "violations": [asdict(v) for v in self.violations],
            "samples": self.samples,
            "view_checks": self.view_checks,
        }


# ---- clients ---------------------------------------------------------------------------------------------
async def run_request(session: aiohttp.ClientSession, url: str, spec: RequestSpec, stall_s: float) -> Transcript:
    """Send ``spec``; read what comes back (a line at most ``stall_s`` apart) until the end, or until the client
    leaves as ``spec`` says."""
    tr = Transcript()
    tokens = 0
    try:
        async with asyncio.timeout(stall_s if not spec.stream else None):
            resp = await session.post(url + "/v1/completions", json=spec.body())
        async with resp:
            tr.status = resp.status
            if resp.status != 200 or not spec.stream:
                async with asyncio.timeout(stall_s):
                    tr.body = await resp.text()
                tr.ended = "eof"
                return tr
            while True:
                try:
                    raw = await asyncio.wait_for(resp.content.readline(), stall_s)
                except TimeoutError:
                    tr.ended = "stalled"
                    return tr
                if not raw:
                    tr.ended = "eof"
                    return tr
                line = raw.decode().strip()
                if not line:
                    continue
                if tr.done:
                    tr.after_done += 1
                    continue
                if line == "data: [DONE]":
                    tr.done = True
                    continue
                event = json.loads(line.removeprefix("data: "))
                tr.events.append(event)
                tr.request_id = tr.request_id or event.get("hilum", {}).get("request_id", "")
                if event.get("choices"):
                    tokens += len(event["choices"][0].get("token_ids", []))
                if spec.disconnect_after is not None and tokens >= spec.disconnect_after:
                    tr.ended = "disconnected"
                    resp.close()
                    return tr
    except TimeoutError:
        tr.ended = "timeout"
    except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
        tr.ended = f"broken: {type(exc).__name__}: {exc}"
    return tr


def _moves(tr: Transcript, spec: RequestSpec) -> list[dict[str, Any]]:
    """The committed migrations the response reports (its last ``hilum`` object)."""
    if not spec.stream:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return list(json.loads(tr.body)["hilum"]["moves"])
        return []
    for event in reversed(tr.events):
        if "moves" in event.get("hilum", {}):
            return list(event["hilum"]["moves"])
    return []


async def client_loop(
    url: str, seed: int, counter: Iterator[int], until_s: float, report: Report, stall_s: float
) -> None:
    """Send requests back to back (each on a new connection) until the load's end or the count is used up."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection each: the kernel spreads them
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        while time.monotonic() < until_s:
            index = next(counter, None)
            if index is None:
                return
            spec = request_spec(seed, index, sorted(set(MODELS.values())))
            tr = await run_request(session, url, spec, stall_s)
            outcome, problems = judge(spec, tr)
            report.outcomes[outcome] += 1
            if tr.status and tr.status != 200:
                report.statuses[tr.status] += 1
            if outcome == "disconnected":
                report.faults[CLIENT_DISCONNECT] += 1
            for e in tr.events:
                if "error" in e:
                    report.note_error(str(e["error"].get("message", "")))
            for m in _moves(tr, spec):
                report.client_migrations["cross" if m.get("cross_domain") else "intra"] += 1
            if tr.request_id:
                report.ended_at[tr.request_id] = report.now_s()
                if outcome == "complete":
                    report.completed.add(tr.request_id)
            for problem in problems:
                kind = "hang" if problem.startswith("hang") else "stream"
                report.violate(kind, f"request {index} ({tr.request_id or 'no id'}, {spec.model}, "
                                     f"max_tokens {spec.max_tokens}): {problem}")  # fmt: skip


# ---- invariant monitors -----------------------------------------------------------------------------------
async def _loads(clients: dict[str, LlumletClient]) -> dict[str, lpb.LoadReport]:
    """Every answering llumlet's load (those that do not answer within their timeout are left out)."""
    ids = sorted(clients)
    replies = await asyncio.gather(*(clients[i].get_load() for i in ids), return_exceptions=True)
    return {i: r for i, r in zip(ids, replies, strict=True) if isinstance(r, lpb.LoadReport)}


async def sample_running(
    clients: dict[str, LlumletClient], report: Report, stop: asyncio.Event, orphan_grace_s: float
) -> None:
    """Every :data:`SAMPLE_EVERY_S`: no request in two running sets three samples in a row; none running
    ``orphan_grace_s`` after its client's stream ended."""
    streak: dict[str, int] = {}
    reported: set[str] = set()  # requests already reported in two engines
    orphans: set[str] = set()  # requests already reported running after their end
    while not stop.is_set():
        loads = await _loads(clients)
        report.samples += 1
        holders: dict[str, list[str]] = {}
        for iid, load in loads.items():
            for r in load.running:
                holders.setdefault(r.request_id, []).append(iid)
        now = report.now_s()
        for rid, on in holders.items():
            streak[rid] = streak.get(rid, 0) + 1 if len(on) > 1 else 0
            if streak[rid] == 3 and rid not in reported:
                reported.add(rid)
                report.violate("two-engines", f"request {rid} in the running sets of {', '.join(sorted(on))} in "
                                              "3 samples in a row")  # fmt: skip
            ended = report.ended_at.get(rid)
            if ended is not None and now - ended > orphan_grace_s and rid not in orphans:
                orphans.add(rid)
                report.violate("orphan", f"request {rid} still runs on {', '.join(sorted(on))} {now - ended:.1f} s "
                                         "after its client's stream ended")  # fmt: skip
        for rid in [r for r in streak if r not in holders]:
            del streak[rid]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)


class _ViewOf:
    """A coordinator as CoordinatorService's read methods use it: a view (here, etcd at one revision) and the
    topology it serves (ListDomains names every domain it lists, registered or not)."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.topology = _soak_topology()


@functools.cache
def _soak_topology() -> Topology:
    """:data:`TOPOLOGY`, parsed (once)."""
    return parse_topology(parse_yaml(TOPOLOGY), "chaos soak topology")


_LISTS: tuple[tuple[str, Any], ...] = (
    ("ListDomains", cpb.ListDomainsRequest()),
    ("ListInstances", cpb.ListInstancesRequest()),
    ("ListMigrations", cpb.ListMigrationsRequest()),
)


def _differences(method: str, got: Any, want: Any) -> str:
    """Which items of two List replies differ, named."""
    field_name = {"ListDomains": "domains", "ListInstances": "instances", "ListMigrations": "migrations"}[method]
    key = {"domains": "domain_id", "instances": "instance_id", "migrations": "migration_id"}[field_name]
    a = {getattr(x, key): x for x in getattr(got, field_name)}
    b = {getattr(x, key): x for x in getattr(want, field_name)}
    parts = []
    if set(a) - set(b):
        parts.append(f"only in the coordinator: {sorted(set(a) - set(b))}")
    if set(b) - set(a):
        parts.append(f"only in etcd: {sorted(set(b) - set(a))}")
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    if changed:
        parts.append(f"different: {changed}")
    return "; ".join(parts) or "the replies differ"


async def check_views(
    coordinators: dict[str, str], etcd: Etcd3Client, skip: set[str], report: Report, *, final: bool
) -> int:
    """Compare each replica's List answers with etcd at the revision its view reflects; how many answered.

    A replica in ``skip`` (paused by a fault) is not asked; one that does not answer is skipped unless
    ``final`` (then it is a violation: every replica must answer at the end).
    """
    answered = 0
    for cid, address in sorted(coordinators.items()):
        if cid in skip:
            continue
        async with grpc.aio.insecure_channel(address) as channel:
            stub = cpb_grpc.CoordinatorStub(channel)
            for method, request in _LISTS:
                try:
                    got = await getattr(stub, method)(request, timeout=5.0)
                    if got.view_revision < 1:
                        continue
                    view = ClusterView(etcd, Keys(), rng=random.Random(0))
                    await view.list_at(int(got.view_revision))
                except Exception as exc:  # an RPC error, a timeout, etcd unreachable
                    if final:
                        report.violate("view", f"coordinator {cid} at {address}: {method} not checked: {exc!r}")
                    continue
                service = CoordinatorService(cast(Coordinator, _ViewOf(view)))
                want = await getattr(service, method)(request, None)
                report.view_checks += 1
                answered += 1
                if got != want:
                    report.violate("view", f"coordinator {cid}'s {method} at revision {got.view_revision} is not "
                                           f"etcd's: {_differences(method, got, want)}")  # fmt: skip
    return answered


async def watch_views(
    coordinators: dict[str, str], etcd: Etcd3Client, injector: Injector, report: Report, stop: asyncio.Event
) -> None:
    """:func:`check_views` every :data:`VIEW_EVERY_S` (not while etcd is paused; never a paused replica)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), VIEW_EVERY_S)
        if stop.is_set() or injector.etcd_paused:
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(20):
                await check_views(coordinators, etcd, set(injector.paused_coordinators), report, final=False)


async def wait_idle(clients: dict[str, LlumletClient], report: Report, timeout_s: float) -> None:
    """After the load: every instance idle within ``timeout_s`` (else a leak violation per instance)."""
    deadline = time.monotonic() + timeout_s
    busy: dict[str, str] = {}
    while True:
        loads = await _loads(clients)
        busy = {}
        for iid in sorted(clients):
            load = loads.get(iid)
            if load is None:
                busy[iid] = "does not answer"
                continue
            held = {
                "requests": load.num_requests,
                "used_blocks": load.used_blocks,
                "reserved_blocks": load.reserved_blocks,
                "reservations": load.num_reservations,
                "waiting": load.num_waiting,
                "suspended": load.num_suspended,
                "migrations_out": load.num_migrations_out,
            }
            if any(held.values()):
                running = [r.request_id for r in load.running]
                busy[iid] = ", ".join(f"{k} {v}" for k, v in held.items() if v) + f" (running {running})"
        if not busy or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    for iid, what in busy.items():
        report.violate("leak", f"instance {iid} is not idle {timeout_s:g} s after the load: {what}")


async def final_views(coordinators: dict[str, str], etcd: Etcd3Client, report: Report, timeout_s: float) -> None:
    """At the end: every replica's view catches up with etcd, then equals it."""
    now = int((await kv_of(etcd).get("/hilum-chaos-probe", timeout=10)).header.revision)
    deadline = time.monotonic() + timeout_s
    for cid, address in sorted(coordinators.items()):
        seen = 0
        async with grpc.aio.insecure_channel(address) as channel:
            stub = cpb_grpc.CoordinatorStub(channel)
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    seen = int((await stub.Status(cpb.StatusRequest(), timeout=5.0)).view_revision)
                if seen >= now:
                    break
                await asyncio.sleep(0.5)
        if seen < now:
            report.violate("view", f"coordinator {cid}'s view is at revision {seen}, etcd at {now}, {timeout_s:g} s on")
    await check_views(coordinators, etcd, set(), report, final=True)


# ---- the faults ------------------------------------------------------------------------------------------
class Injector:
    """Fires the schedule against the cluster (module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        info: dict[str, Any],
        proxies: dict[str, LinkProxy],
        clients: dict[str, LlumletClient],
        report: Report,
        seed: int,
    ) -> None:
        self.cluster = cluster
        self.info = info
        self.proxies = proxies
        self.clients = clients
        self.report = report
        self.rng = random.Random(f"chaos-soak-runtime:{seed}")
        self.attempt = ATTEMPT_BASE
        self.etcd_paused = False
        self.paused_coordinators: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Fire every fault at its time (or after the previous one ended), until ``stop``."""
        for fault in self.report.schedule:
            wait = self.report.t0 + fault.at_s - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set():
                return
            at = self.report.now_s()
            try:
                what = await self.fire(fault)
            except Exception as exc:  # a fault that cannot be injected is reported, never ends the soak
                what = f"not injected: {type(exc).__name__}: {exc}"
            if what.startswith("not injected"):
                self.report.skipped[fault.kind.value] += 1
            else:
                self.report.faults[fault.kind.value] += 1
            self.report.fired.append((at, f"{fault.describe()}: {what}"))
            print(f"chaos soak: {at:6.1f} s {fault.describe()}: {what}", file=sys.stderr, flush=True)

    async def fire(self, fault: Fault) -> str:
        """Inject one fault; what happened, in words."""
        kind = fault.kind
        if kind is FaultKind.LLUMLET_KILL:
            pid = self.cluster.pid(f"llumlet-{fault.target}")
            os.kill(pid, signal.SIGKILL)
            return f"killed pid {pid}"
        if kind is FaultKind.SCHEDULER_PAUSE:
            return await self._pause(f"rack-{fault.target}", fault.duration_s)
        if kind is FaultKind.ETCD_PAUSE:
            self.etcd_paused = True
            try:
                return await self._pause("etcd", fault.duration_s)
            finally:
                self.etcd_paused = False
        if kind is FaultKind.LEADER_PAUSE:
            leader = await self._leader()
            if not leader:
                return "not injected: no coordinator leads now"
            self.paused_coordinators.add(leader)
            try:
                return await self._pause(f"coordinator-{leader}", fault.duration_s)
            finally:
                self.paused_coordinators.discard(leader)
        return await self._link_fault(fault)

    async def _pause(self, name: str, duration_s: float) -> str:
        pid = self.cluster.pid(name)
        self.cluster.pause(pid)
        try:
            await asyncio.sleep(duration_s)
        finally:
            self.cluster.resume(pid)
        return f"{name} (pid {pid}) stopped {duration_s:.1f} s, continued"

    async def _leader(self) -> str:
        for address in self.info["coordinators"].values():
            async with grpc.aio.insecure_channel(address) as channel:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    status = await cpb_grpc.CoordinatorStub(channel).Status(cpb.StatusRequest(), timeout=3.0)
                    if status.leader_id:
                        return str(status.leader_id)
        return ""

    async def _pick_move(self, cross: bool) -> tuple[str, str, str] | None:
        """(request id, source, destination) of a decoding request with output left to run and a destination of
        its model with room for it (across domains or inside one, as ``cross`` prefers), or None."""
        order = sorted(self.clients)
        self.rng.shuffle(order)
        loads = await _loads(self.clients)
        for src in order:
            load = loads.get(src)
            if load is None:
                continue
            for r in load.running:
                if not r.in_decode or r.unmigratable_reason or r.max_tokens - r.output_tokens < 40:
                    continue
                room = [
                    i
                    for i in sorted(loads)
                    if i != src
                    and MODELS[i] == MODELS[src]
                    and loads[i].total_blocks - loads[i].used_blocks - loads[i].reserved_blocks >= r.max_blocks
                ]
                wanted = [i for i in room if (DOMAINS[i] != DOMAINS[src]) == cross] or room
                if wanted:
                    return r.request_id, src, self.rng.choice(wanted)
        return None

    async def _check_owner(self, rid: str, src: str, dst: str, outcome: str, what: str) -> None:
        """After a forced move answered: the request runs on one side only, the side the answer names.

        Committed: the source must not run it. Not committed: the destination must not run it, and the source
        must not run it once its client has received every token (it then resumed a request served elsewhere).
        A copy that loses the origin's arbitration stops at its next push, so what is seen is checked again
        :data:`OWNER_RECHECK_S` later and reported only if it lasted.
        """
        problem = ""
        for check in range(2):
            if check:
                await asyncio.sleep(OWNER_RECHECK_S)
            loads = await _loads({i: self.clients[i] for i in (src, dst)})
            on = {i for i, load in loads.items() if any(r.request_id == rid for r in load.running)}
            if outcome == "committed" and src in on:
                problem = f"{src} still runs {rid} after its move committed"
            elif outcome != "committed" and dst in on:
                problem = f"{dst} runs {rid}{f' (and so does {src})' if src in on else ''} though not moved there"
            elif outcome != "committed" and src in on and rid in self.report.completed:
                problem = f"{src} resumed {rid} after its client had received every token (from {dst}?)"
            else:
                return
        self.report.violate("two-owners", f"{problem}, {OWNER_RECHECK_S:g} s after the move answered: {what}")

    @staticmethod
    async def _called(proxy: LinkProxy, move: asyncio.Task[Any]) -> bool:
        """Wait until the proxy's armed call came (True) or the move ended without it (False)."""
        called = asyncio.create_task(proxy.called.wait())
        await asyncio.wait([move, called], return_when=asyncio.FIRST_COMPLETED)
        called.cancel()
        return proxy.called.is_set()

    async def _link_fault(self, fault: Fault) -> str:
        deadline = time.monotonic() + 5.0
        while (move := await self._pick_move(fault.cross_domain)) is None:
            if time.monotonic() > deadline:
                return "not injected: no decoding request to move"
            await asyncio.sleep(0.2)
        rid, src, dst = move
        proxy = self.proxies[dst]
        self.attempt += 1
        call = asyncio.create_task(
            self.clients[src].migrate_out(rid, proxy.address, self.attempt, dst_instance_id=dst),
            name=f"forced-move-{rid}",
        )
        before = proxy.resets
        mid = True
        if fault.kind is FaultKind.LINK_ONEWAY:
            proxy.when_called(fault.call, lambda: proxy.hold(answers_only=True))
            if mid := await self._called(proxy, call):
                await asyncio.sleep(fault.duration_s)
                proxy.reset_all()
            proxy.release()
        elif fault.kind is FaultKind.LINK_DROP and fault.call:
            hit: list[bool] = []

            def drop() -> None:
                hit.append(not call.done())
                proxy.reset_all()
                proxy.refuse = True

            proxy.when_called(fault.call, lambda: asyncio.get_running_loop().call_later(fault.after_s, drop))
            if await self._called(proxy, call):
                await asyncio.sleep(fault.after_s + fault.duration_s)
            proxy.refuse = False
            proxy.release()
            mid = hit == [True]
        elif fault.kind is FaultKind.LINK_DELAY:
            proxy.delay_s = fault.delay_s
            await asyncio.sleep(fault.duration_s)
            proxy.delay_s = 0.0
        else:
            await asyncio.sleep(fault.after_s)
            mid = not call.done()
            if fault.kind is FaultKind.LINK_DROP:
                proxy.reset_all()
                proxy.refuse = True
                await asyncio.sleep(fault.duration_s)
                proxy.refuse = False
            else:
                proxy.hold()
                await asyncio.sleep(fault.duration_s)
                proxy.reset_all()
                proxy.release()
        try:
            reply = await asyncio.wait_for(call, 120.0)
        except TimeoutError:
            self.report.violate("migration", f"MigrateOut of {rid} {src} -> {dst} did not answer within 120 s")
            return f"moving {rid} {src} -> {dst}: MigrateOut did not answer"
        except grpc.aio.AioRpcError as exc:
            outcome, reason = "rpc-error", f" ({exc.code().name}: {exc.details()})"
        else:
            outcome = lpb.MigrationOutcome.Name(reply.outcome).removeprefix("MIGRATION_").lower()
            reason = f"{reply.reason}, " if reply.reason else ""
            reason = f" ({reason}{reply.total_s * 1e3:.0f} ms)"
        self.report.moves[outcome] += 1
        resets = proxy.resets - before
        where = "across domains" if DOMAINS[src] != DOMAINS[dst] else "inside a domain"
        what = f"moving {rid} {src} -> {dst} ({where}): {outcome}{reason}; {resets} connection(s) reset"
        await self._check_owner(rid, src, dst, outcome, what)
        if outcome == "refused" or not mid:
            return f"not injected: {'the move ended before the fault' if not mid else 'the move was refused'}; {what}"
        return what


# ---- the run ---------------------------------------------------------------------------------------------
async def soak(ns: argparse.Namespace, cluster: Cluster, info: dict[str, Any], report: Report) -> None:
    """Proxies, monitors, clients and faults for ``ns.minutes``; then the end checks."""
    proxies = {iid: LinkProxy(addr) for iid, addr in info["llumlets"].items()}
    for proxy in proxies.values():
        await proxy.start()
    clients = {
        iid: LlumletClient(addr, timeout_s=3.0, migrate_timeout_s=110.0) for iid, addr in info["llumlets"].items()
    }
    etcd = connect([info["etcd"]])
    await etcd.connect()
    stop = asyncio.Event()
    injector = Injector(cluster, info, proxies, clients, report, ns.seed)
    try:
        report.t0 = time.monotonic()
        until = report.t0 + ns.minutes * 60.0
        counter = iter(range(ns.max_requests))
        workers = [
            asyncio.create_task(client_loop(info["gateway_url"], ns.seed, counter, until, report, ns.stall_s))
            for _ in range(ns.concurrency)
        ]
        monitors = [
            asyncio.create_task(sample_running(clients, report, stop, ns.orphan_grace_s)),
            asyncio.create_task(watch_views(info["coordinators"], etcd, injector, report, stop)),
        ]
        faults = asyncio.create_task(injector.run(stop))
        alive = asyncio.create_task(_watch_cluster(cluster, report, stop))
        await asyncio.gather(*workers)
        print(f"chaos soak: load done at {report.now_s():.1f} s; checking the end state ...", file=sys.stderr)
        stop.set()
        await faults
        await wait_idle(clients, report, ns.idle_timeout_s)
        await asyncio.gather(*monitors)
        alive.cancel()
        await final_views(info["coordinators"], etcd, report, 30.0)
    finally:
        stop.set()
        for proxy in proxies.values():
            await proxy.close()
        for client in clients.values():
            await client.close()
        await etcd.close()


async def _watch_cluster(cluster: Cluster, report: Report, stop: asyncio.Event) -> None:
    """``hilum up`` must keep running (it gives up after too many crashes of one process)."""
    while not stop.is_set():
        if not cluster.alive():
            report.violate("process-left", f"hilum up exited during the soak; its log ends with:\n{cluster.tail()}")
            return
        await asyncio.sleep(1.0)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/chaos_soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="load and faults for this long (default 10)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and the load (default 1)")
    p.add_argument("--concurrency", type=int, default=14, help="clients sending requests at once (default 14)")
    p.add_argument("--max-requests", type=int, default=100_000, help="requests at most (default 100000)")
    p.add_argument("--stall-s", type=float, default=60.0, help="no event for this long is a hang (default 60)")
    p.add_argument("--orphan-grace-s", type=float, default=10.0, help="an ended request may run this long")
    p.add_argument("--idle-timeout-s", type=float, default=60.0, help="after the load, idle within this")
    p.add_argument(
        "--long-pause-fraction", type=float, default=0.2, help="share of pauses beyond the lease TTL (default 0.2)"
    )
    p.add_argument("--start-timeout-s", type=float, default=180.0, help="hilum up must serve within this")
    p.add_argument("--out", default="", metavar="DIR", help="keep the cluster's logs here and write report.json")
    p.add_argument("--schedule-only", action="store_true", help="print the fault schedule of --seed and exit")
    ns = p.parse_args(argv)
    problems = []
    if not ns.minutes > 0:
        problems.append(f"--minutes must be > 0, got {ns.minutes:g}")
    if ns.concurrency < 1 or ns.max_requests < 1:
        problems.append(f"--concurrency and --max-requests must be >= 1, got {ns.concurrency}, {ns.max_requests}")
    if not 0.0 <= ns.long_pause_fraction <= 1.0:
        problems.append(f"--long-pause-fraction must be in [0, 1], got {ns.long_pause_fraction:g}")
    for name in ("stall_s", "orphan_grace_s", "idle_timeout_s", "start_timeout_s"):
        if not getattr(ns, name) > 0:
            problems.append(f"--{name.replace('_', '-')} must be > 0, got {getattr(ns, name):g}")
    for problem in problems:
        p.error(problem)
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (module docstring); returns the exit status."""
    ns = _parse(argv)
    schedule = make_schedule(
        ns.seed, ns.minutes * 60.0, instances=sorted(MODELS), domains=sorted(set(DOMAINS.values())),
        long_pause_fraction=ns.long_pause_fraction,
    )  # fmt: skip
    report = Report(ns.seed, ns.minutes, schedule)
    if ns.schedule_only:
        print("\n".join(f.describe() for f in schedule))
        return 0
    work = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="hilum-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"chaos soak: seed {ns.seed}, {len(schedule)} faults over {ns.minutes:g} min; logs in {work}", file=sys.stderr
    )
    cluster = Cluster(work, ns.seed)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        info = cluster.start(ns.start_timeout_s)
        asyncio.run(soak(ns, cluster, info, report))
    except ClusterFailed as exc:
        report.violate("cluster", str(exc))
    except KeyboardInterrupt:
        report.violate("interrupted", "the soak was interrupted (SIGINT or SIGTERM) before its end checks")
    except Exception as exc:  # a failure of the soak itself still stops the cluster and reports
        report.violate("soak", f"the soak failed: {type(exc).__name__}: {exc}")
    finally:
        left = cluster.stop()
        signal.signal(signal.SIGTERM, previous)
    if left:
        report.violate("process-left", f"processes still alive after the cluster stopped: {left}")
    print(report.render())
    if ns.out:
        (work / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    elif report.violations:
        print(f"chaos soak: kept {work} (the cluster's logs)", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
