"""``python -m llumlet``: run one llumlet process (docs/migration.md, "Running a llumlet by hand").

Prints ``llumlet <instance_id> serving at <host:port>`` on stdout once it serves (spawners wait for it; with
``--etcd``, once its instance's registration is its own), and stops cleanly on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import sys
from collections.abc import Callable, Sequence

import hilum_config
from clusterstate.endpoints import address_option, endpoints_option, listen_option, require_reachable
from clusterstate.options import (
    DEFAULT_PREFIX,
    LOG_LEVEL_HELP,
    log_level_option,
    non_negative_option,
    positive_int_option,
    positive_option,
    prefix_option,
    seed_option,
    ttl_option,
)
from clusterstate.session import KeyTakenError
from hilum_proto.tls import ListenError
from llumlet.agent import Llumlet, LlumletConfig
from llumlet.backends import BACKEND_NAMES, Backend, BackendConfig, UnknownBackendError, make_backend
from llumlet.backends.base import parse_engine_options, time_scale_refusal
from llumlet.migration_types import MigrationConfig
from llumlet.server import serve
from topology.load import TopologyError, load_topology
from topology.spec import Topology

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="python -m llumlet", description="Run one llumlet (per-instance agent).")
    p.add_argument("--instance-id", required=True, help="instance id (as in the topology file)")
    p.add_argument("--engine", default="sim", help=f"engine backend: {', '.join(BACKEND_NAMES)} (default sim)")
    p.add_argument(
        "--listen", default="127.0.0.1:0", type=listen_option, metavar="HOST:PORT", help="serve on (port 0 picks one)"
    )
    p.add_argument("--topology", help="topology file or bundled name: domain, KV size, transports, rate caps")
    p.add_argument("--domain-id", default="", help="NVLink domain (default: from the topology)")
    p.add_argument(
        "--num-blocks", type=positive_int_option, help="KV cache capacity in blocks (default: topology / backend)"
    )
    p.add_argument(
        "--block-size", type=positive_int_option, help="tokens per KV block (default: the topology's, which it must be)"
    )
    p.add_argument("--time-scale", type=positive_option, default=1.0, help="sim: wall seconds per modelled second")
    p.add_argument(
        "--min-step-s", type=non_negative_option, default=0.0, help="every step lasts at least this long (tests)"
    )
    p.add_argument("--max-num-seqs", type=positive_int_option, default=256, help="requests per batch at most")
    p.add_argument("--seed", type=seed_option, default=0, help="backend seed (torch: model weights)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE", help="backend option")
    p.add_argument(
        "--tokenizer", metavar="DIR", help="the model's tokenizer directory (default: the topology model's tokenizer)"
    )
    p.add_argument(
        "--reservation-expiry-s", type=positive_option, default=5.0, help="release an idle reservation after"
    )
    p.add_argument(
        "--grpc-rate-cap", type=non_negative_option, default=0.0, help="grpc transport cap, bytes/s (0 = topology)"
    )
    p.add_argument(
        "--local-rate-cap", type=non_negative_option, default=0.0, help="local transport cap, bytes/s (0 = none)"
    )
    p.add_argument(
        "--link-budget-scope",
        default=None,
        metavar="NAME",
        help="llumlets on this host with the same NAME share each link's migration budget; '' shares it with no "
        "other llumlet (default: the etcd prefix with --etcd, else '')",
    )
    p.add_argument(
        "--etcd",
        type=endpoints_option,
        metavar="HOST:PORT",
        help="etcd endpoints HOST:PORT[,...]: register this instance under a lease (needs --topology)",
    )
    p.add_argument(
        "--prefix",
        default=DEFAULT_PREFIX,
        type=prefix_option,
        help="etcd key prefix (as the coordinator's; starts and ends with /)",
    )
    p.add_argument(
        "--advertise",
        default="",
        type=address_option,
        metavar="HOST:PORT",
        help="address others reach this llumlet at (default: the listen host, bound port)",
    )
    p.add_argument("--ttl", type=ttl_option, default=10, help="etcd lease TTL, seconds")
    p.add_argument("--log-level", default="WARNING", type=log_level_option, metavar="LEVEL", help=LOG_LEVEL_HELP)
    hilum_config.add_argument(p)
    return p


async def _run(ns: argparse.Namespace, topology: Topology | None) -> None:
    domain_id = ns.domain_id or (topology.instance(ns.instance_id).domain_id if topology is not None else "")
    settings = hilum_config.load_config(ns.config)
    backend = make_backend(
        ns.engine,
        BackendConfig(
            instance_id=ns.instance_id,
            topology=topology,
            num_blocks=ns.num_blocks,
            block_size_tokens=ns.block_size,
            time_scale=ns.time_scale,
            min_step_s=ns.min_step_s,
            max_num_seqs=ns.max_num_seqs,
            seed=ns.seed,
            options=parse_engine_options(ns.engine_option),
            tokenizer=ns.tokenizer,
            prefix_cache=settings.prefix_cache,
        ),
    )
    migration = MigrationConfig(
        precopy=settings.cost.precopy,  # the cost model's stop rule: a move pauses as long as it was priced to
        cost=settings.cost,  # its overheads price the copy-versus-recompute plan of a move with a prefix
        reservation_expiry_s=ns.reservation_expiry_s,
        cap_fraction=settings.cost.cap_fraction,
        grpc_rate_cap_bytes_per_s=ns.grpc_rate_cap,
        local_rate_cap_bytes_per_s=ns.local_rate_cap,
        link_budget_scope=ns.link_budget_scope if ns.link_budget_scope is not None else (ns.prefix if ns.etcd else ""),
    )
    llumlet = Llumlet(
        LlumletConfig(
            instance_id=ns.instance_id, domain_id=domain_id, migration=migration, prefix_cache=settings.prefix_cache
        ),
        backend,
        topology=topology,
        rng=random.Random(ns.seed),
    )
    server, address = await serve(llumlet, ns.listen, ns.advertise)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the claim too: a stop while it waits is clean
        loop.add_signal_handler(sig, stop.set)

    def serving() -> None:  # with --etcd once the instance's key is claimed: a spawner waiting for the line must not
        # take a llumlet whose instance another live one holds (it exits 1 after its wait) for one that serves
        print(f"llumlet {ns.instance_id} serving at {address}", flush=True)

    registration = None
    if ns.etcd:
        assert topology is not None  # main refuses --etcd without --topology
        registration = asyncio.ensure_future(_register(ns, topology, backend, address, stop, serving))
        # It ends before stop only when it failed: stop then, rather than serve unregistered and unseen.
        registration.add_done_callback(lambda _: stop.set())
    else:
        serving()
    await stop.wait()
    try:
        if registration is not None:
            await registration  # revokes the lease: the domain scheduler sees the instance leave; raises a failure
    finally:
        await server.stop(grace=1.0)
        await llumlet.stop()


async def _register(
    ns: argparse.Namespace,
    topology: Topology,
    backend: Backend,
    address: str,
    stop: asyncio.Event,
    claimed: Callable[[], None],
) -> None:
    """Keep ``<prefix>instances/<id>`` registered under this process's lease until ``stop`` (DESIGN.md, etcd);
    ``claimed`` is called once the key is this llumlet's.

    The record names the engine and the sampling features it honours: the gateway refuses (400) a request
    that needs one no instance of its model has. The key is claimed (``Registrar.claim_or_wait``): a second
    llumlet of the same instance would take it over and, stopping, leave the first unregistered; it waits up
    to 1.5 x TTL + 1 s for a crashed one's lease, then raises KeyTakenError. Losing the key later (another
    llumlet claimed it while etcd was away from this one) raises KeyTakenError too.
    """
    from clusterstate.endpoints import parse_endpoints
    from clusterstate.etcd import connect
    from clusterstate.records import InstanceRegistration, RecordError, decode, encode
    from clusterstate.session import Registrar
    from clusterstate.store import Keys

    spec = topology.instance(ns.instance_id)
    record = InstanceRegistration(
        ns.instance_id,
        spec.domain_id,
        spec.node_id,
        address,
        spec.model,
        ns.num_blocks or spec.kv_capacity_blocks,
        engine=backend.name,
        sampling_features=tuple(sorted(backend.sampling_features)),
    )
    client = connect(parse_endpoints(ns.etcd))
    await client.connect()
    name = f"llumlet {ns.instance_id}"
    registrar = Registrar(client, ns.ttl, rng=random.Random(ns.seed), name=name)
    running = asyncio.ensure_future(registrar.run(stop))
    try:
        key, value = Keys(ns.prefix).instance(ns.instance_id), encode(record)

        def holder(held: bytes) -> str:
            try:
                return decode(InstanceRegistration, held, key).address
            except RecordError:
                return "?"

        what = f"instance {ns.instance_id}"
        if await registrar.claim_or_wait(key, value, 1.5 * ns.ttl + 1, stop, holder_of=holder, what=what):
            claimed()
            lost = asyncio.ensure_future(registrar.lost_claim.wait())
            await asyncio.wait({running, lost}, return_when=asyncio.FIRST_COMPLETED)
            lost.cancel()
            if registrar.lost_claim.is_set():
                raise KeyTakenError(f"{what}: {registrar.conflict}")
    finally:
        stop.set()  # the registrar revokes its lease and ends
        await running
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a configuration error; 1 on a listen address that cannot be
    bound or an instance another live llumlet holds; the reason on stderr)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    require_reachable(parser, ns.listen, ns.advertise)
    if ns.etcd and not ns.topology:  # before anything starts (the server it made was left to a closed loop)
        parser.error("--etcd needs --topology (the registration names the node, model and KV capacity)")
    if (refusal := time_scale_refusal(ns.engine, ns.time_scale)) is not None:  # accepted and ignored, it was
        parser.error(refusal)
    logging.basicConfig(level=ns.log_level, format=f"%(asctime)s {ns.instance_id} %(name)s %(levelname)s %(message)s")
    try:
        topology = load_topology(ns.topology) if ns.topology else None
        if topology is not None:
            home = topology.instance(ns.instance_id).domain_id
            if ns.domain_id and ns.domain_id != home:  # its registration names the topology's domain anyway
                raise ValueError(
                    f"--domain-id {ns.domain_id}: instance {ns.instance_id} is in domain {home} in {ns.topology}"
                )
            model = topology.model_of(ns.instance_id)
            if ns.block_size is not None and ns.block_size != model.block_size_tokens:  # schedulers count in these
                raise ValueError(
                    f"--block-size {ns.block_size}: model {model.name} has {model.block_size_tokens}-token KV blocks "
                    f"in {ns.topology}, and the schedulers count this instance's blocks in those"
                )
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_run(ns, topology))
    except (ListenError, KeyTakenError) as exc:  # the machine's or cluster's state: its service manager restarts it
        print(f"llumlet: error: {exc}", file=sys.stderr)
        return 1
    except (TopologyError, UnknownBackendError, KeyError, ValueError, RuntimeError) as exc:
        print(f"llumlet: error: {exc}", file=sys.stderr)  # as every hilum process says it
        return 2
    return 0
