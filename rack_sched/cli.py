"""``python -m rack_sched``: run the domain scheduler of one NVLink domain.

    python -m rack_sched --domain-id node-0 --listen 0.0.0.0:7100 --etcd 127.0.0.1:2379 \\
        --topology cluster.yaml [--coordinator HOST:PORT] [--prefix /hilum/v1/] [--instance ID=HOST:PORT ...]

Prints ``rack_sched <domain> serving at <host:port>`` on stdout once it serves, then rebuilds its view from
the llumlets registered in etcd and starts dispatching. Runs until SIGTERM or SIGINT, then revokes its
lease (its registration and summary vanish) and exits 0; the llumlets keep running. Exit status 2 on a
configuration error (bad topology, unknown domain), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import sys
from collections.abc import Sequence

import hilum_config
from clusterstate.endpoints import endpoints_option, parse_endpoints
from clusterstate.etcd import Etcd3Client, connect, kv_of
from clusterstate.records import DomainRegistration, InstanceRegistration, RecordError, decode
from clusterstate.store import Keys
from hilum_proto.tls import advertised_address, bind_server
from rack_sched.scheduler import DomainScheduler
from rack_sched.server import start_server
from rack_sched.types import RackConfig
from topology.load import TopologyError, load_topology
from topology.spec import Topology

__all__ = ["build_parser", "config_from_args", "main", "static_instances"]

_log = logging.getLogger("rack_sched")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m rack_sched", description="hilum domain scheduler (one per domain)")
    p.add_argument("--domain-id", required=True, help="NVLink domain id (as in the topology file)")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="gRPC listen address (port 0 picks one)")
    p.add_argument(
        "--etcd",
        required=True,
        type=endpoints_option,
        metavar="HOST:PORT",
        help="etcd endpoint (comma-separated for several)",
    )
    p.add_argument("--topology", required=True, metavar="FILE", help="topology YAML file or bundled name")
    p.add_argument("--coordinator", default="", metavar="HOST:PORT", help="coordinator, when etcd names no leader")
    p.add_argument("--prefix", default="/hilum/v1/", help="etcd key prefix")
    p.add_argument("--advertise", metavar="HOST:PORT", help="address others reach this scheduler at")
    p.add_argument("--ttl", type=int, default=10, help="lease TTL of the registration and summary, seconds")
    hilum_config.add_argument(p)
    p.add_argument("--ready-timeout", type=float, default=5.0, help="wait for each llumlet's first load, seconds")
    p.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="ID=HOST:PORT",
        help="register this llumlet in etcd on its behalf (for llumlets that do not register themselves)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (ties, jitter); default: random")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def static_instances(items: Sequence[str], topology: Topology, domain_id: str) -> tuple[InstanceRegistration, ...]:
    """Registrations of ``--instance ID=HOST:PORT`` flags (node, model, KV capacity from the topology).

    Raises:
        ValueError: on a malformed flag, a repeated id, or an instance that is not in ``domain_id``.
    """
    out: dict[str, InstanceRegistration] = {}
    for item in items:
        iid, sep, address = item.partition("=")
        host, colon, port = address.rpartition(":")
        if not sep or not iid or not colon or not host or not port.isdigit():
            raise ValueError(f"--instance {item!r}: expected ID=HOST:PORT")
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
    client: Etcd3Client, key: str, domain_id: str, own_address: str, wait_s: float
) -> None:
    """One domain scheduler per domain: a live registration (bound to its scheduler's lease) means another one
    runs; taking over its key would hide it, and stopping this one would then unregister the domain.

    A registration at ``own_address`` is the previous run of this very scheduler (two live processes cannot
    share an address): it is taken over at once. Any other crashed scheduler's registration disappears with
    its lease, so this waits up to ``wait_s`` for the key to go, then raises RuntimeError naming the scheduler
    that still holds it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        reply = await kv_of(client).get(key)
        if not reply.kvs:
            return
        try:
            address = decode(DomainRegistration, bytes(reply.kvs[0].value), key).address
        except RecordError:
            address = "?"
        if address == own_address:
            _log.info("domain %s: taking over the registration of this scheduler's previous run", domain_id)
            return
        if loop.time() >= deadline:
            raise RuntimeError(
                f"domain {domain_id} already has a live domain scheduler at {address}; stop it first "
                "(a crashed one's registration expires with its lease TTL)"
            )
        await asyncio.sleep(0.5)


async def _serve(ns: argparse.Namespace, topology: Topology) -> None:
    server, port = bind_server(ns.listen)
    cfg = config_from_args(ns, topology, advertised_address(ns.listen, port, ns.advertise))
    client = connect(parse_endpoints(ns.etcd))
    await client.connect()
    key = Keys(ns.prefix).domain(ns.domain_id)
    await _refuse_a_second_scheduler(client, key, ns.domain_id, cfg.advertise_address, 1.5 * ns.ttl + 1)
    ids = [i.instance_id for i in topology.domain(ns.domain_id).instances]
    scheduler = DomainScheduler(cfg, client, rng=random.Random(ns.seed), topology_instance_ids=ids)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await start_server(scheduler, server)
    print(f"rack_sched {ns.domain_id} serving at {cfg.advertise_address}", flush=True)
    try:
        await scheduler.run(stop)
    finally:
        await server.stop(grace=1.0)
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a configuration error, with the reason on stderr)."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format=f"%(asctime)s {ns.domain_id} %(name)s %(levelname)s %(message)s")
    try:
        topology = load_topology(ns.topology)
        topology.domain(ns.domain_id)
        asyncio.run(_serve(ns, topology))
    except (TopologyError, KeyError, ValueError, RuntimeError, OSError) as exc:
        print(f"rack_sched: error: {exc}", file=sys.stderr)
        return 2
    return 0
