"""``python -m rack_sched``: run the domain scheduler of one NVLink domain.

    python -m rack_sched --domain-id node-0 --listen 0.0.0.0:7100 --etcd 127.0.0.1:2379 \\
        --topology cluster.yaml [--coordinator HOST:PORT] [--prefix /hilum/v1/] [--instance ID=HOST:PORT ...]

Prints ``rack_sched <domain> serving at <host:port>`` on stdout once it serves, then rebuilds its view from
the llumlets registered in etcd and starts dispatching. Runs until SIGTERM or SIGINT, then revokes its
lease (its registration and summary vanish) and exits 0; the llumlets keep running. Exit status 2 on a
configuration error (bad topology, unknown domain); 1 when the listen address cannot be bound, another live
domain scheduler holds the domain, or etcd stops answering while the domain is claimed (conditions its service
manager's restart can outlast); the reason on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import sys
from collections.abc import Sequence

import grpc

import hilum_config
from clusterstate.backoff import Backoff, BackoffConfig
from clusterstate.endpoints import (
    address_option,
    endpoints_option,
    is_host_port,
    listen_option,
    parse_endpoints,
    require_reachable,
)
from clusterstate.etcd import RETRYABLE_ERRORS, Etcd3Client, EtcdError, connect, error_line, kv_of
from clusterstate.options import (
    DEFAULT_PREFIX,
    LOG_LEVEL_HELP,
    log_level_option,
    non_negative_option,
    prefix_option,
    seed_option,
    ttl_option,
)
from clusterstate.records import DomainRegistration, InstanceRegistration, RecordError, decode
from clusterstate.store import Keys
from hilum_proto.tls import ListenError, advertised_address, bind_server
from rack_sched.scheduler import DomainScheduler
from rack_sched.server import start_server
from rack_sched.types import DomainTakenError, RackConfig
from topology.load import TopologyError, load_topology
from topology.spec import Topology

__all__ = ["build_parser", "config_from_args", "main", "static_instances"]

_log = logging.getLogger("rack_sched")
_ETCD_TIMEOUT_S = 5.0  # one etcd read before the scheduler starts
_ETCD_RETRY = BackoffConfig(initial_s=0.5, max_s=5.0)  # while etcd does not answer at start


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m rack_sched", description="hilum domain scheduler (one per domain)")
    p.add_argument("--domain-id", required=True, help="NVLink domain id (as in the topology file)")
    p.add_argument(
        "--listen",
        required=True,
        type=listen_option,
        metavar="HOST:PORT",
        help="gRPC listen address (port 0 picks one)",
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
        "--coordinator",
        default="",
        type=address_option,
        metavar="HOST:PORT",
        help="a coordinator (one address), used while etcd names no leader",
    )
    p.add_argument(
        "--prefix", default=DEFAULT_PREFIX, type=prefix_option, help="etcd key prefix (starts and ends with /)"
    )
    p.add_argument(
        "--advertise", type=address_option, metavar="HOST:PORT", help="address others reach this scheduler at"
    )
    p.add_argument("--ttl", type=ttl_option, default=10, help="lease TTL of the registration and summary, seconds")
    hilum_config.add_argument(p)
    p.add_argument(
        "--ready-timeout", type=non_negative_option, default=5.0, help="wait for each llumlet's first load, seconds"
    )
    p.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="ID=HOST:PORT",
        help="register this llumlet in etcd on its behalf (for llumlets that do not register themselves)",
    )
    p.add_argument("--seed", type=seed_option, default=None, help="random seed (ties, jitter); default: random")
    p.add_argument("--log-level", default="INFO", type=log_level_option, metavar="LEVEL", help=LOG_LEVEL_HELP)
    return p


def static_instances(items: Sequence[str], topology: Topology, domain_id: str) -> tuple[InstanceRegistration, ...]:
    """Registrations of ``--instance ID=HOST:PORT`` flags (node, model, KV capacity from the topology).

    Raises:
        ValueError: on a malformed flag, a repeated id, or an instance that is not in ``domain_id``.
    """
    out: dict[str, InstanceRegistration] = {}
    for item in items:
        iid, sep, address = item.partition("=")
        if not sep or not iid or not is_host_port(address):
            raise ValueError(f"--instance {item!r}: expected ID=HOST:PORT (port 1-65535)")
        if iid in out:
            raise ValueError(f"--instance {iid}: given twice")
        try:
            spec = topology.instance(iid)
        except KeyError:
            raise ValueError(f"--instance {iid}: not in topology {topology.name}") from None
        if spec.domain_id != domain_id:
            raise ValueError(f"--instance {iid}: in domain {spec.domain_id}, not {domain_id}")
        out[iid] = InstanceRegistration(iid, domain_id, spec.node_id, address, spec.model, spec.kv_capacity_blocks)
    return tuple(out.values())


def config_from_args(ns: argparse.Namespace, topology: Topology, advertise: str) -> RackConfig:
    """The :class:`RackConfig` of parsed arguments and the configuration file (``--config``).

    Raises:
        KeyError: when the topology has no domain ``--domain-id``.
        ValueError: when the domain's instances use different KV block sizes, or on a bad ``--instance``.
        hilum_config.ConfigError: an invalid configuration file (a ValueError).
    """
    settings = hilum_config.load_config(ns.config)
    domain = topology.domain(ns.domain_id)
    sizes = {topology.model_of(i.instance_id).block_size_tokens for i in domain.instances}
    if len(sizes) != 1:
        raise ValueError(f"domain {ns.domain_id}: need instances of one KV block size, found {sorted(sizes)}")
    return RackConfig(
        static_instances=static_instances(ns.instance, topology, ns.domain_id),
        domain_id=ns.domain_id,
        advertise_address=advertise,
        block_size_tokens=sizes.pop(),
        prefix=ns.prefix,
        ttl_s=ns.ttl,
        decide=settings.domain,
        rebalance_interval_s=settings.intervals.rebalance_interval_s,
        summary_interval_s=settings.intervals.summary_interval_s,
        cross_interval_s=settings.intervals.cross_interval_s,
        ready_timeout_s=ns.ready_timeout,
        coordinator_address=ns.coordinator,
    )


async def _refuse_a_second_scheduler(
    client: Etcd3Client,
    key: str,
    domain_id: str,
    own_address: str,
    wait_s: float,
    *,
    etcd: str,
    stop: asyncio.Event,
    rng: random.Random,
) -> bool:
    """One domain scheduler per domain: a live registration (bound to its scheduler's lease) means another one
    runs; taking over its key would hide it, and stopping this one would then unregister the domain.

    A registration at ``own_address`` is the previous run of this very scheduler (two live processes cannot
    share an address): it is taken over at once. Any other crashed scheduler's registration disappears with
    its lease, so this waits up to ``wait_s`` (from when it first sees the key) for the key to go, then raises
    DomainTakenError naming the scheduler that still holds it.

    While etcd (``etcd``, the ``--etcd`` list) does not answer, it logs a warning naming the address and retries
    with jittered backoff, like every other etcd client of hilum: a scheduler may start before etcd (systemd
    starts the units in any order). Returns False when ``stop`` is set before the check is done, else True.
    """
    loop = asyncio.get_running_loop()
    backoff = Backoff(_ETCD_RETRY, rng)
    deadline: float | None = None
    while not stop.is_set():
        try:
            reply = await kv_of(client).get(key, timeout=_ETCD_TIMEOUT_S)
        except RETRYABLE_ERRORS as exc:
            delay = backoff.next_s()
            _log.log(
                backoff.level(),
                "domain %s: etcd at %s does not answer (%s), attempt %d; retrying in %.1f s: check that etcd runs "
                "and that --etcd names its client address",
                domain_id,
                etcd,
                error_line(exc),
                backoff.failures,
                delay,
            )
            await _sleep_unless(stop, delay)
            continue
        backoff.reset()
        if not reply.kvs:
            return True
        try:
            address = decode(DomainRegistration, bytes(reply.kvs[0].value), key).address
        except RecordError:
            address = "?"
        if address == own_address:
            _log.info("domain %s: taking over the registration of this scheduler's previous run", domain_id)
            return True
        if deadline is None:
            deadline = loop.time() + wait_s
            _log.warning(
                "domain %s: a domain scheduler at %s holds its registration; waiting up to %.0f s for it to expire "
                "(a crashed one's goes with its lease)",
                domain_id,
                address,
                wait_s,
            )
        if loop.time() >= deadline:
            raise DomainTakenError(
                f"domain {domain_id} already has a live domain scheduler at {address}; stop it first "
                "(a crashed one's registration expires with its lease TTL)"
            )
        await _sleep_unless(stop, 0.5)
    return False


async def _sleep_unless(stop: asyncio.Event, delay_s: float) -> None:
    """Sleep ``delay_s`` seconds, or less when ``stop`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay_s)


async def _serve(ns: argparse.Namespace, topology: Topology) -> None:
    server, port = bind_server(ns.listen)
    cfg = config_from_args(ns, topology, advertised_address(ns.listen, port, ns.advertise))
    client = connect(parse_endpoints(ns.etcd))
    await client.connect()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        key = Keys(ns.prefix).domain(ns.domain_id)
        wait_s = 1.5 * ns.ttl + 1
        rng = random.Random(ns.seed)
        if not await _refuse_a_second_scheduler(
            client, key, ns.domain_id, cfg.advertise_address, wait_s, etcd=ns.etcd, stop=stop, rng=rng
        ):
            return  # stopped before etcd answered
        ids = [i.instance_id for i in topology.domain(ns.domain_id).instances]
        scheduler = DomainScheduler(cfg, client, rng=random.Random(ns.seed), topology_instance_ids=ids)
        await start_server(scheduler, server)
        print(f"rack_sched {ns.domain_id} serving at {cfg.advertise_address}", flush=True)
        await scheduler.run(stop)
    finally:
        await server.stop(grace=1.0)
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a configuration error; 1 on an address that cannot be bound, a
    domain another live scheduler holds or etcd lost while the domain was claimed; the reason on stderr)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    require_reachable(parser, ns.listen, ns.advertise)
    logging.basicConfig(level=ns.log_level, format=f"%(asctime)s {ns.domain_id} %(name)s %(levelname)s %(message)s")
    try:
        topology = load_topology(ns.topology)
        topology.domain(ns.domain_id)
        asyncio.run(_serve(ns, topology))
    except (ListenError, DomainTakenError) as exc:  # the machine's state, not the configuration: restart may fix it
        print(f"rack_sched: error: {exc}", file=sys.stderr)
        return 1
    except (EtcdError, grpc.aio.AioRpcError, TimeoutError) as exc:  # etcd went away while the domain was claimed
        why = f"etcd at {ns.etcd} stopped answering while the domain was claimed ({error_line(exc)})"
        print(f"rack_sched: error: {why}", file=sys.stderr)
        return 1
    except (TopologyError, KeyError, ValueError, RuntimeError, OSError) as exc:
        print(f"rack_sched: error: {exc}", file=sys.stderr)
        return 2
    return 0
