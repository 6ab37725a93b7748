"""``python -m global_coord``: run one coordinator replica.

    python -m global_coord --etcd 127.0.0.1:2379 --listen 0.0.0.0:7070 --topology cluster.yaml --id coord-a

Runs until SIGTERM or SIGINT, then resigns (a standby takes over at once) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import socket
import sys
from collections.abc import Sequence

import hilum_config
from clusterstate.endpoints import address_option, endpoints_option, listen_option, parse_endpoints, require_reachable
from clusterstate.etcd import connect
from clusterstate.options import DEFAULT_PREFIX, LOG_LEVEL_HELP, log_level_option, prefix_option, ttl_option
from global_coord.actuator import CommandActuator
from global_coord.autoscaler import AutoscaleLoop
from global_coord.coordinator import Coordinator, CoordinatorConfig
from global_coord.server import start_server
from global_coord.wiring import ClusterModel, load_cluster_model
from hilum_proto.tls import advertised_address, bind_server
from policy.autoscale import pools_of
from topology.load import TopologyError
from topology.spec import Topology

__all__ = ["main", "parse_args", "serve_replica"]

_log = logging.getLogger("global_coord")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m global_coord", description="hilum global coordinator replica")
    p.add_argument(
        "--etcd",
        required=True,
        type=endpoints_option,
        metavar="HOST:PORT",
        help="etcd endpoint (comma-separated for several)",
    )
    p.add_argument(
        "--listen",
        required=True,
        type=listen_option,
        metavar="HOST:PORT",
        help="gRPC listen address (port 0 picks one)",
    )
    p.add_argument("--topology", metavar="FILE", help="topology YAML file or bundled name")
    p.add_argument("--id", default=socket.gethostname(), help="replica id, unique among coordinators")
    p.add_argument("--advertise", type=address_option, metavar="HOST:PORT", help="address others reach this replica at")
    p.add_argument("--ttl", type=ttl_option, default=10, help="session lease TTL, seconds (failover time)")
    p.add_argument(
        "--prefix", default=DEFAULT_PREFIX, type=prefix_option, help="etcd key prefix (starts and ends with /)"
    )
    p.add_argument("--log-level", default="INFO", type=log_level_option, metavar="LEVEL", help=LOG_LEVEL_HELP)
    hilum_config.add_argument(p)
    ns = p.parse_args(argv)
    if not ns.id or any(c.isspace() for c in ns.id):  # it names the replica in etcd, in logs and in hilumctl
        p.error(f"--id {ns.id!r}: the replica's name among coordinators, not empty and without spaces")
    require_reachable(p, ns.listen, ns.advertise)
    return ns


async def serve_replica(
    ns: argparse.Namespace, model: ClusterModel | None, settings: hilum_config.HilumConfig | None = None
) -> int:
    """Run one replica as configured by ``ns`` (from :func:`parse_args`) until SIGTERM/SIGINT.

    ``model`` supplies the topology, paths and judge (None: proposals are rejected, GetTopology says
    nothing is loaded). ``settings``: the configuration file (None: the defaults): its ``measured_bandwidth``
    section prices moves at measured rates, and with ``autoscale.enabled`` (checked by :func:`check_autoscale`)
    the replica runs the autoscaler while it leads. Returns the exit status.
    """
    endpoints = parse_endpoints(ns.etcd)
    client = connect(endpoints)
    await client.connect()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server, port = bind_server(ns.listen)
    cfg = CoordinatorConfig(
        coordinator_id=ns.id,
        advertise_address=advertised_address(ns.listen, port, ns.advertise),
        etcd_endpoint=ns.etcd,
        prefix=ns.prefix,
        ttl_s=ns.ttl,
    )
    coordinator = Coordinator(
        cfg,
        client,
        rng=random.Random(),
        path_of=model.path_of if model else None,
        judge=model.judge if model else None,
        topology=model.topology if model else None,
        bandwidth=settings.measured_bandwidth if settings is not None else None,
    )
    loop_task = None
    if settings is not None and settings.autoscale.enabled and model is not None:
        assert isinstance(model.topology, Topology)  # check_autoscale
        actuator = CommandActuator(settings.actuator)
        autoscale = AutoscaleLoop(coordinator, settings.autoscale, actuator, pools_of(model.topology.instances))
        loop_task = asyncio.create_task(autoscale.run(stop), name="autoscaler")
    await start_server(
        coordinator,
        server,
        settings.autoscale if settings is not None else None,
        settings.actuator if settings is not None else None,
    )
    print(f"coordinator {ns.id} serving at {cfg.advertise_address}", flush=True)  # as every hilum process says
    try:
        await coordinator.run(stop)
    finally:
        if loop_task is not None:
            stop.set()
            await loop_task
        await server.stop(grace=1.0)
        await client.close()
    return 0


def check_autoscale(settings: hilum_config.HilumConfig, has_topology: bool) -> None:
    """Raise ValueError, naming the key, when ``autoscale.enabled`` cannot be honoured: no topology (no pool of
    instances; ``has_topology`` False) or no runnable ``autoscale.command``."""
    if not settings.autoscale.enabled:
        return
    if not has_topology:
        raise ValueError("autoscale.enabled needs --topology: the autoscaler starts and stops the topology's instances")
    settings.actuator.check()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments, a bad configuration or topology file; 1 on a startup
    error)."""
    ns = parse_args(argv)
    logging.basicConfig(level=ns.log_level, format=f"%(asctime)s {ns.id} %(name)s %(levelname)s %(message)s")
    try:
        settings = hilum_config.load_config(ns.config)
    except hilum_config.ConfigError as exc:
        print(f"global_coord: error: {exc.for_flag()}", file=sys.stderr)
        return 2  # a configuration error: restarting cannot fix it
    try:
        check_autoscale(settings, bool(ns.topology))
    except ValueError as exc:
        print(f"global_coord: error: {settings.source}: {exc}", file=sys.stderr)
        return 2
    try:
        model = load_cluster_model(ns.topology, settings.cost, settings.approval) if ns.topology else None
    except TopologyError as exc:
        print(f"global_coord: error: {exc}", file=sys.stderr)
        return 2  # as a bad configuration file: restarting cannot fix it
    try:
        return asyncio.run(serve_replica(ns, model, settings))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"global_coord: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
