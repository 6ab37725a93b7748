"""Running ``hilum up`` as a real process for tests: start, read ``cluster.json``, stop with SIGINT, and
check that no process is left behind (:func:`running_up`); llumlet / domain scheduler load probes; the
official ``openai`` client on its gateway (:func:`openai_client`, :func:`chat_completion`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from hilum_proto.v1 import rack_sched_pb2, rack_sched_pb2_grpc
from llumlet.client import LlumletClient

REPO = Path(__file__).resolve().parents[2]

# Two NVLink domains of two instances; 128 KV blocks x 16 tokens = 2048 KV tokens per instance, below the
# model's 4096-token context, so "larger than any instance can hold" and "beyond the context" differ.
TOPOLOGY = """\
name: up-test-2x2
models:
  - {name: llama-2-7b, num_layers: 32, num_attention_heads: 32, num_kv_heads: 32, head_dim: 128,
     hidden_size: 4096, dtype: float16, block_size_tokens: 16, num_params: 6738415616, max_context_tokens: 4096}
gpu_types:
  - {name: a100-80gb, memory_gib: 80, hbm_gbyte_per_s: 2039, nvlink_gbyte_per_s: 600}
domains:
  - id: dom-a
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-a, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: a0, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 128}
      - {id: a1, gpus: [1], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 128}
  - id: dom-b
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-b, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: b0, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 128}
      - {id: b1, gpus: [1], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 128}
fabric:
  oversubscription: 1.0
  racks:
    - {id: rack-0, domains: [dom-a, dom-b]}
"""


class UpProcess:
    """A running ``hilum up``; its stderr is collected as it comes (:meth:`stderr`, :meth:`wait_stderr`)."""

    def __init__(self, proc: subprocess.Popen[str], run_dir: Path, info: dict[str, Any], printed: str = "") -> None:
        self.proc, self.run_dir, self.info = proc, run_dir, info
        self.printed = printed  # its stdout up to "Ctrl-C stops everything": what it says once the cluster serves
        self._err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)

    @property
    def url(self) -> str:
        return str(self.info["gateway_url"])

    def stderr(self) -> str:
        return "".join(self._err)

    def wait_stderr(self, words: str, timeout_s: float = 60.0) -> str:
        """Wait until stderr contains ``words``; returns it. Raises AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while words not in (text := self.stderr()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"hilum up never said {words!r}: {text}")
            time.sleep(0.05)
        return text

    def read_info(self) -> dict[str, Any]:
        """``cluster.json`` as it is now (rewritten on every restart)."""
        return dict(json.loads((self.run_dir / "cluster.json").read_text()))

    def stop(self, timeout_s: float = 60.0, sig: int = signal.SIGINT) -> str:
        """``sig`` (SIGINT: Ctrl-C), wait; returns its stderr. Raises AssertionError if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hilum up did not stop within {timeout_s} s: {self.stderr()}") from None
        self._reader.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return self.stderr()


def start_up(
    run_dir: Path,
    engine: str,
    extra: list[str] | None = None,
    timeout_s: float = 180.0,
    *,
    kv_blocks: int = 128,
    topology: str = TOPOLOGY,
    own_run_dir: bool = True,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> UpProcess:
    """Start ``hilum up`` on free ports with ``topology`` (default :data:`TOPOLOGY`, ``kv_blocks`` per instance);
    wait until it prints that it is up.

    ``own_run_dir``: pass ``--run-dir <run_dir>/run``; otherwise hilum up makes a temporary one (under
    ``env["TMPDIR"]`` if given), found from what it prints.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    topo = run_dir / "topology.yaml"
    topo.write_text(topology.replace("kv_capacity_blocks: 128", f"kv_capacity_blocks: {kv_blocks}"))
    cmd = [
        sys.executable,
        "-m",
        "hilum_cli.main",
        "up",
        "--engine",
        engine,
        "--topology",
        str(topo),
        "--port",
        "0",
        "--etcd-port",
        "0",
        "--grpc-base-port",
        "0",
        *(["--run-dir", str(run_dir / "run")] if own_run_dir else []),
        *(extra or []),
    ]
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            where = next(w.split()[2] for w in lines if w.startswith("  run dir "))
            info = json.loads((Path(where) / "cluster.json").read_text())
            return UpProcess(proc, Path(where), info, "".join(lines))
    proc.kill()
    _, err = proc.communicate()
    raise AssertionError(f"hilum up did not come up: {''.join(lines)}\n{err}")


@contextlib.contextmanager
def running_up(run_dir: Path, engine: str, extra: list[str] | None = None, **kw: Any) -> Iterator[UpProcess]:
    """:func:`start_up` (same arguments), yield the cluster; then stop it (Ctrl-C) and check it said that no
    process was left and that none of the processes it started (as first started and as last restarted, from
    ``cluster.json``) is alive. Raises AssertionError when one is."""
    cluster = start_up(run_dir, engine, extra, **kw)
    try:
        yield cluster
    finally:
        err = cluster.stop()
        assert "no process left" in err, err
        pids = set(cluster.info["pids"]) | set(cluster.read_info()["pids"])
        assert sorted(p for p in pids if alive(p)) == []


#: A chat in three scripts (accents, an emoji, CJK): the tokenizer's byte fallback and its chat template.
CHAT_MESSAGES = [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Bonjour 🙂 你好"}]


@contextlib.contextmanager
def openai_client(cluster: UpProcess, timeout_s: float, api_key: str = "none") -> Iterator[Any]:
    """The official ``openai`` client on the cluster's gateway, without retries (a failure shows at once),
    each call given ``timeout_s`` seconds, sending ``api_key``; closed on exit."""
    import openai

    client = openai.OpenAI(api_key=api_key, base_url=f"{cluster.url}/v1", max_retries=0, timeout=timeout_s)
    try:
        yield client
    finally:
        client.close()


def chat_completion(client: Any, model: str, **kw: Any) -> Any:
    """A chat completion of :data:`CHAT_MESSAGES` on ``model`` that returns the token ids beside the text
    (``return_token_ids``, merged into the ``extra_body`` given); ``kw`` goes to ``chat.completions.create``."""
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=model, messages=CHAT_MESSAGES, extra_body=extra, **kw)


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def cluster_load(info: dict[str, Any]) -> dict[str, Any]:
    """Per llumlet: (requests owned, used blocks, reservations, waiting); per domain: running request ids."""
    out: dict[str, Any] = {}
    for iid, address in sorted(info["llumlets"].items()):
        async with LlumletClient(address) as client:
            r = await client.get_load()
        out[iid] = (r.num_requests, r.used_blocks, r.num_reservations, r.num_waiting)
    for dom, address in sorted(info["domain_schedulers"].items()):
        async with grpc.aio.insecure_channel(address) as channel:
            state = await rack_sched_pb2_grpc.RackSchedulerStub(channel).GetDomainState(
                rack_sched_pb2.GetDomainStateRequest(), timeout=5
            )
        out[dom] = sorted(rid for i in state.instances for rid in i.running_request_ids)
    return out


def idle_load(info: dict[str, Any]) -> dict[str, Any]:
    """The load of an idle cluster."""
    out: dict[str, Any] = {iid: (0, 0, 0, 0) for iid in info["llumlets"]}
    out.update({dom: [] for dom in info["domain_schedulers"]})
    return out


async def wait_load(info: dict[str, Any], want: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Poll :func:`cluster_load` until it equals ``want`` (returns the last load seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = await cluster_load(info)
        if load == want or time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.1)
