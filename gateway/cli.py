"""``python -m gateway``: run one gateway (OpenAI-compatible HTTP front door of a hilum cluster).

    python -m gateway --listen 0.0.0.0:8000 --etcd 127.0.0.1:2379 --topology cluster.yaml \\
        [--sink-listen 0.0.0.0:7300 --sink-advertise gw-1.example:7300] [--prefix /hilum/v1/] \\
        [--tokenizer MODEL=DIR ...] [--reuse-port --also-listen 0.0.0.0:8001]

Each served model's tokenizer is loaded before anything listens (``gateway.tokenizer.load_tokenizers``: the
topology's ``models[].tokenizer`` or ``--tokenizer``, else the byte stand-in): a missing directory stops the
start with the topology key named.

Several gateways in front of one cluster (``hilum up --gateways N``): each is independent (its own etcd view,
token sink and reservations; ``gateway.core``); they can share one ``--listen`` address with ``--reuse-port``
(the socket option ``SO_REUSEPORT``: the kernel spreads new connections over every process bound to the
address; only processes of the same user can join it). ``--reuse-port`` is refused by name on a platform
without ``SO_REUSEPORT``. ``--also-listen HOST:PORT`` serves the same API on a second address of this gateway
alone (not shared), so a health check or a Prometheus scrape reaches this one gateway.

Prints ``gateway serving at http://<host:port> (token sink <host:port>)`` on stdout once it listens (with
``, also at http://<host:port>`` for ``--also-listen``), and runs until SIGTERM or SIGINT. Exit status 2 on a
configuration error (bad topology, ``--reuse-port`` where it is unsupported), 1 when an address cannot be bound
(in use, not this machine's: its service manager restarts it), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import socket
import sys
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from aiohttp import web

import hilum_config
from clusterstate.endpoints import (
    address_option,
    check_advertised,
    endpoints_option,
    listen_option,
    optional_listen_option,
    parse_endpoints,
    split_address,
)
from clusterstate.etcd import connect
from clusterstate.options import (
    DEFAULT_PREFIX,
    LOG_LEVEL_HELP,
    log_level_option,
    non_negative_option,
    prefix_option,
    seed_option,
)
from gateway.apikeys import ApiKeys, load_api_keys
from gateway.app import GatewayApp
from gateway.cluster import LiveCluster
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import BYTE_OFFSET, Tokenizer, load_tokenizers
from hilum_proto.tls import WILDCARD_HOSTS, ListenError, bind_refusal, listen_failure
from topology.load import TopologyError, load_topology
from topology.spec import Topology

__all__ = ["build_parser", "main", "tokenizer_overrides"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m gateway", description="hilum gateway (OpenAI-compatible HTTP)")
    p.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        type=listen_option,
        metavar="HOST:PORT",
        help="HTTP address (port 0 picks one)",
    )
    p.add_argument(
        "--etcd",
        required=True,
        type=endpoints_option,
        metavar="HOST:PORT",
        help="etcd endpoint (comma-separated for several)",
    )
    p.add_argument("--topology", required=True, metavar="FILE", help="topology YAML file or bundled name")
    p.add_argument(
        "--prefix", default=DEFAULT_PREFIX, type=prefix_option, help="etcd key prefix (starts and ends with /)"
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind --listen with SO_REUSEPORT, so several gateways share one address (the kernel spreads connections)",
    )
    p.add_argument(
        "--also-listen",
        default="",
        type=optional_listen_option,
        metavar="HOST:PORT",
        help="serve the same API on this address too, this gateway's alone (health checks, metrics scrapes)",
    )
    p.add_argument(
        "--sink-listen",
        default="",
        type=optional_listen_option,
        metavar="HOST:PORT",
        help="token sink gRPC address (default: HTTP host, port 0)",
    )
    p.add_argument(
        "--sink-advertise", default="", type=address_option, metavar="HOST:PORT", help="address llumlets push tokens to"
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=DIR",
        help="the tokenizer directory of MODEL, overriding the topology's models[].tokenizer (repeatable)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=512, help="byte stand-in tokenizer vocabulary (>= 259), models without one"
    )
    p.add_argument(
        "--unavailable-wait", type=non_negative_option, default=5.0, help="retry unavailable domains for, seconds"
    )
    p.add_argument("--seed", type=seed_option, default=None, help="random seed (dispatch ties); default: random")
    p.add_argument(
        "--api-keys",
        default="",
        metavar="FILE",
        help="YAML file of API keys and their priority classes (gateway.apikeys); without it the gateway is open",
    )
    p.add_argument("--log-level", default="WARNING", type=log_level_option, metavar="LEVEL", help=LOG_LEVEL_HELP)
    hilum_config.add_argument(p)
    return p


def tokenizer_overrides(items: Sequence[str]) -> dict[str, str]:
    """``--tokenizer MODEL=DIR`` items -> {model: dir}. Raises ValueError on a malformed or repeated item."""
    out: dict[str, str] = {}
    for item in items:
        model, sep, path = item.partition("=")
        if not sep or not model or not path:
            raise ValueError(f"--tokenizer {item!r}: expected MODEL=DIR")
        if model in out:
            raise ValueError(f"--tokenizer: model {model!r} given twice")
        out[model] = path
    return out


def _check_reuse_port() -> None:
    """Raise ValueError naming ``--reuse-port`` when the platform lacks ``SO_REUSEPORT``."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError(
            "--reuse-port: this platform has no SO_REUSEPORT, so gateways cannot share one address; give each "
            "gateway its own --listen port (hilum up --gateway-ports separate)"
        )


async def _start_site(runner: web.AppRunner, address: str, what: str, *, reuse_port: bool) -> str:
    """Listen on ``address`` (``host:port``); the URL served (with the port bound when ``address`` asked for 0).

    Raises ListenError naming ``what`` when the address cannot be bound.
    """
    host, port = split_address(address, what, listen=True)
    site = web.TCPSite(runner, host.strip("[]"), port, reuse_address=True, reuse_port=reuse_port)  # aiohttp: no []
    try:
        await site.start()
    except OSError:
        raise ListenError(listen_failure(address, what)) from None
    return f"http://{host}:{site.port}"


async def _serve(
    ns: argparse.Namespace, topology: Topology, tokenizers: Mapping[str, Tokenizer], api_keys: ApiKeys | None
) -> None:
    if ns.reuse_port:
        _check_reuse_port()
    # a port another process holds is said at once, not once etcd answers (the HTTP site starts after the cluster
    # view is synced); the site's own bind still reports one taken meanwhile. With --reuse-port, --listen's port is
    # probed as it is bound: other gateways sharing it do not count
    for address, what, shared in ((ns.listen, "--listen", ns.reuse_port), (ns.also_listen, "--also-listen", False)):
        if address and (reason := bind_refusal(address, reuse_port=shared)):
            raise ListenError(listen_failure(address, what, reason))
    sink_listen = _sink_listen(ns)
    metrics = GatewayMetrics()
    etcd = connect(parse_endpoints(ns.etcd))
    await etcd.connect()
    rng = random.Random(ns.seed)
    settings = hilum_config.load_config(ns.config)
    cluster = LiveCluster(
        topology,
        etcd,
        metrics,
        rng,
        prefix=ns.prefix,
        sink_listen=sink_listen,
        sink_advertise=ns.sink_advertise,
        # the default is the --listen host: a host that cannot be bound is --listen's, found first by the sink
        sink_what="--sink-listen" if ns.sink_listen else "--listen host, for the token sink",
        policy=settings.policy,
        reservation_ttl_s=settings.intervals.reservation_ttl_s,
        unavailable_wait_s=ns.unavailable_wait,
        max_replays=settings.resume.max_replays,
        prefix_cache=settings.prefix_cache,
    )
    runner: web.AppRunner | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before etcd answers too: a stop while waiting for it is clean
        loop.add_signal_handler(sig, stop.set)
    try:
        if not await _unless_stopped(cluster.start_services(), stop):
            return  # stopped before the cluster view was synced (etcd not answering)
        app = GatewayApp(cluster, metrics, tokenizers, api_keys=api_keys).app()
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        url = await _start_site(runner, ns.listen, "--listen", reuse_port=ns.reuse_port)
        also = ""
        if ns.also_listen:
            also = ", also at " + await _start_site(runner, ns.also_listen, "--also-listen", reuse_port=False)
        print(f"gateway serving at {url} (token sink {cluster.origin}){also}", flush=True)
        await stop.wait()
        # End every open request with an error the client sees (an SSE error event, a 502 body) before the
        # connections close; runner.cleanup() below lets the handlers send it.
        cluster.sink.fail_all("the gateway is shutting down; the request did not finish: retry it")
    finally:
        if runner is not None:
            await runner.cleanup()
        await cluster.close()
        await etcd.close()


async def _unless_stopped(starting: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run ``starting`` until it returns (True) or ``stop`` is set first (False: it is cancelled). Raises what
    ``starting`` raises."""
    task = asyncio.ensure_future(starting)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()
    return True


def _sink_listen(ns: argparse.Namespace) -> str:
    """The token sink's listen address: ``--sink-listen``, else the ``--listen`` host with port 0."""
    return ns.sink_listen or f"{split_address(ns.listen, '--listen', listen=True)[0]}:0"  # checked by its option


def _take_one_port(a: str, b: str, dual_a: bool, dual_b: bool) -> bool:
    """Whether two listen addresses (``host:port``) take one port: the same port (not 0) on the same address, or on
    a wildcard and an address it covers (``0.0.0.0`` every IPv4 one; ``::`` every IPv6 one, and every IPv4 one too
    when bound dual-stack, ``dual_a``/``dual_b``: gRPC's servers are, asyncio's IPv6-only). Host names are resolved;
    one that does not resolve takes nothing here (binding it says why)."""
    (host_a, port_a), (host_b, port_b) = (
        split_address(a, "--listen", listen=True),
        split_address(b, "--listen", listen=True),
    )
    if port_a == 0 or port_a != port_b:
        return False
    return any(_covers(x, y, dual_a) or _covers(y, x, dual_b) for x in _addresses(host_a) for y in _addresses(host_b))


def _addresses(host: str) -> set[str]:
    """The IP addresses a listen host binds (a wildcard as itself; none for a name that does not resolve)."""
    host = host.strip("[]")
    if host in ("0.0.0.0", "::"):
        return {host}
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def _covers(a: str, b: str, dual_stack: bool) -> bool:
    """Whether binding address ``a`` (``dual_stack``: an IPv6 socket that takes IPv4 too) takes the port of address
    ``b`` too."""
    ipv4 = ":" not in b
    return a == b or (a == "::" and (dual_stack or not ipv4)) or (a == "0.0.0.0" and ipv4)


def _check_sink(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """A usage error (exit 2, before anything starts) when the token sink cannot work as given: it takes the port of
    ``--listen`` (one host, or a wildcard on either); ``--sink-advertise`` names a port the sink will not listen on
    (:func:`check_advertised`; without ``--sink-listen`` it takes a free one); or it binds every interface without
    ``--sink-advertise`` (llumlets push every token to the address the sink names, and ``0.0.0.0`` reaches this
    gateway only from its own host)."""
    listen_host = split_address(ns.listen, "--listen", listen=True)[0]
    # (option, address, bound dual-stack): the HTTP sites are asyncio's (IPv6-only), the sink gRPC's (dual-stack)
    given = [(name, value, dual) for name, value, dual in (("--listen", ns.listen, False),
             ("--sink-listen", ns.sink_listen, True), ("--also-listen", ns.also_listen, False)) if value]  # fmt: skip
    for k, (name_a, a, dual_a) in enumerate(given):  # one port for two servers: the second to bind found it taken
        for name_b, b, dual_b in given[k + 1 :]:
            if _take_one_port(a, b, dual_a, dual_b):
                parser.error(f"{name_a} {a} and {name_b} {b} take one port: each server needs its own")
    if ns.sink_advertise and not ns.sink_listen:  # the default --sink-listen, named as such
        advertised_host, advertised_port = split_address(ns.sink_advertise, "--sink-advertise")
        if advertised_host not in WILDCARD_HOSTS:  # refused below, by check_advertised
            host = listen_host if advertised_host == listen_host else "0.0.0.0"
            parser.error(
                f"--sink-advertise {ns.sink_advertise} names port {advertised_port}, but without --sink-listen the "
                f"token sink takes a free port on the --listen host when it starts: give --sink-listen "
                f"{host}:{advertised_port} too"
            )
    check_advertised(parser, _sink_listen(ns), ns.sink_advertise, ("--sink-listen", "--sink-advertise"))
    host = split_address(_sink_listen(ns), "--sink-listen", listen=True)[0]
    if ns.sink_advertise or host not in WILDCARD_HOSTS:
        return
    if ns.sink_listen:
        parser.error(
            f"--sink-listen {ns.sink_listen} binds every interface, which is no address llumlets can push tokens "
            "to: pass --sink-advertise HOST:PORT, the address they reach this gateway's token sink at"
        )
    parser.error(
        f"the token sink listens on the --listen host ({host}) when --sink-listen is not given, which is no "
        "address llumlets can push tokens to: pass --sink-listen HOST:PORT with an address they reach, or "
        "--sink-listen 0.0.0.0:PORT --sink-advertise HOST:PORT"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a configuration error, 1 on an address that cannot be bound;
    the reason on stderr)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.vocab_size < BYTE_OFFSET + 256:
        parser.error(
            f"--vocab-size: at least {BYTE_OFFSET + 256} (the byte stand-in's {BYTE_OFFSET} reserved ids and 256 "
            f"bytes), got {ns.vocab_size}"
        )
    _check_sink(parser, ns)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s gateway %(name)s %(levelname)s %(message)s")
    try:
        topology = load_topology(ns.topology)
        tokenizers = load_tokenizers(topology, tokenizer_overrides(ns.tokenizer), byte_vocab_size=ns.vocab_size)
        api_keys = load_api_keys(ns.api_keys) if ns.api_keys else None
        asyncio.run(_serve(ns, topology, tokenizers, api_keys))
    except ListenError as exc:  # the machine's, not the configuration's: restarted by its service manager
        print(f"gateway: error: {exc}", file=sys.stderr)
        return 1
    except (TopologyError, ValueError, RuntimeError, OSError) as exc:
        print(f"gateway: error: {exc}", file=sys.stderr)
        return 2
    return 0
