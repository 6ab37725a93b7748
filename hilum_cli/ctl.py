"""``hilumctl``: the admin CLI over the global coordinator's gRPC admin API (``hilum.v1.Coordinator``).

    hilumctl --coordinator coord-a:7070 status
    hilumctl --etcd 127.0.0.1:2379 domains --json
    hilumctl instances --domain node-3
    hilumctl requests --instance node-3-i2
    hilumctl migrations --follow --state active
    hilumctl drain node-3-i2 --wait --timeout 600
    hilumctl undrain node-3-i2
    hilumctl drains
    hilumctl topology
    hilumctl autoscale --events 20

Finding the coordinator: ``--coordinator HOST:PORT[,HOST:PORT...]`` (any replica; reads are answered by
the first that answers, writes follow the leader it names) or ``--etcd HOST:PORT [--prefix P]`` (read the
leader key from etcd and talk to the leader). Defaults come from ``HILUM_COORDINATOR``, ``HILUM_ETCD``
and ``HILUM_PREFIX``, read when the command runs; an error about one of them names the variable.
``--prefix`` applies only with etcd: with a coordinator address (flag or ``HILUM_COORDINATOR``) it is
refused, while ``HILUM_PREFIX`` is then ignored. An empty entry in an address list (``a:1,,b:2``, ``a:1,``)
is refused. ``drain``'s ``--timeout`` and ``--interval`` apply only with ``--wait``. The global options may
also follow the command.

Exit status, the same for the same kind of error in every command (docs/control-plane.md, "Exit status"):
0 done; 1 runtime error (nothing answers at an address, no leader, an unknown domain, instance or drain
target, a domain scheduler that did not answer, a drain that did not empty in time), the message on stderr
says what to check; 2 usage error (caught before anything is contacted); 130 Ctrl-C (0 for ``migrations
--follow``, and when stdout's reader has gone: ``hilumctl ... | head -1`` ends quietly). ``--json`` prints
stable keys (see docs/control-plane.md, "hilumctl"); errors are never JSON and always go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from rich.console import Console

from hilum_cli import Parser, VersionAction
from hilum_cli import ctl_views as views
from hilum_cli.broken_pipe import quiet_on_broken_pipe
from hilum_cli.ctl_client import DEFAULT_PREFIX, AdminClient, CtlError, Target, UsageError, parse_addresses
from hilum_cli.ctl_drain import DrainProgress, domain_progress, instance_progress, resolve_target
from hilum_cli.ctl_requests import ask_domains
from hilum_proto.v1 import coordinator_pb2 as pb

__all__ = ["build_parser", "main", "run"]

_STATES = ("proposed", "approved", "committed", "aborted", "active")


def _add_common(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    d: Any = argparse.SUPPRESS if suppress else None
    where = p.add_argument_group("finding the coordinator (default: $HILUM_COORDINATOR, else $HILUM_ETCD)")
    ex = where.add_mutually_exclusive_group()
    ex.add_argument("--coordinator", metavar="HOST:PORT", default=d, help="any coordinator replica (comma-separated)")
    ex.add_argument("--etcd", metavar="HOST:PORT", default=d, help="etcd endpoint(s); talk to the leader it names")
    where.add_argument(
        "--prefix", default=d, help=f"etcd key prefix, with etcd only (default $HILUM_PREFIX or {DEFAULT_PREFIX})"
    )
    out = p.add_argument_group("output")
    json_default: Any = argparse.SUPPRESS if suppress else False
    out.add_argument("--json", action="store_true", default=json_default, help="print JSON (stable keys)")
    out.add_argument(
        "--rpc-timeout", type=float, metavar="S", default=d, help="deadline of each call, seconds (default 5)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``hilumctl`` parser (see the module docstring)."""
    parser = Parser(prog="hilumctl", description="Query and steer hilum's global coordinator.")
    parser.add_argument("--version", action=VersionAction)
    _add_common(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_common(p, suppress=True)
        return p

    command("status", "who leads, its fencing token, and how much the coordinator's view holds")
    command("domains", "NVLink domains with their domain schedulers and load summaries")
    p = command("instances", "registered instances with their load and drain state")
    p.add_argument("--domain", metavar="D", help="only the instances of domain D")
    p = command("requests", "running requests and waiting counts, asked of every domain scheduler")
    p.add_argument("--domain", metavar="D", help="only domain D")
    p.add_argument("--instance", metavar="I", help="only instance I")
    p = command("migrations", "cross-domain migrations recorded in etcd")
    p.add_argument("--follow", "-f", action="store_true", help="then print every change until Ctrl-C")
    p.add_argument(
        "--state", action="append", choices=_STATES, help="only these states (repeatable; active = proposed+approved)"
    )
    for name, text in (
        ("drain", "stop dispatching to a target and move its requests away"),
        ("undrain", "remove a drain intent: the target takes requests again"),
    ):
        p = command(name, f"{text} (leader only; a standby forwards to the leader)")
        p.add_argument("target", metavar="INSTANCE|DOMAIN", help="an instance id or a domain id")
        kind = p.add_mutually_exclusive_group()
        kind.add_argument(
            "--instance", dest="kind", action="store_const", const="instance", help="TARGET is an instance"
        )
        kind.add_argument("--domain", dest="kind", action="store_const", const="domain", help="TARGET is a domain")
        if name == "drain":
            p.add_argument("--reason", default="", help="why (kept in the drain intent)")
            p.add_argument("--wait", action="store_true", help="wait until the target is empty and safe to stop")
            # None = not given: refused without --wait, then filled with the defaults (_DRAIN_WAIT)
            p.add_argument("--timeout", type=float, metavar="S", help="--wait limit, seconds (300)")
            p.add_argument("--interval", type=float, metavar="S", help="--wait poll period, seconds (1)")
    command("drains", "every drain intent recorded in etcd, and whether the target it names is known")
    command("topology", "the topology file the coordinator was started with")
    p = command("autoscale", "the autoscaler: its rule, each model's fleet freeness, instances in a phase, decisions")
    p.add_argument(
        "--events", type=int, metavar="N", help="latest decisions shown per model (table: 10; --json: every one kept)"
    )
    return parser


def _target(ns: argparse.Namespace, env: Mapping[str, str]) -> Target:
    """Where to find the coordinator: the flags, else HILUM_COORDINATOR, else HILUM_ETCD (with HILUM_PREFIX).

    Raises:
        UsageError: when none is given, an address or the prefix is malformed (naming the flag or the environment
            variable it came from), or ``--prefix`` is given while the coordinator is found without etcd.
    """
    coordinator, etcd = getattr(ns, "coordinator", None), getattr(ns, "etcd", None)
    source = "--coordinator" if coordinator else "--etcd"
    if not coordinator and not etcd:
        coordinator, etcd = env.get("HILUM_COORDINATOR") or None, env.get("HILUM_ETCD") or None
        source = "HILUM_COORDINATOR" if coordinator else "HILUM_ETCD"
        if coordinator:
            etcd = None
    prefix_flag = getattr(ns, "prefix", None)
    if coordinator:
        if prefix_flag is not None:  # HILUM_PREFIX is ambient: ignored here, not refused
            how = "given by --coordinator" if source == "--coordinator" else "taken from HILUM_COORDINATOR"
            raise UsageError(
                "--prefix applies only with --etcd (it is the key prefix under which etcd holds the leader's "
                f"address), but the coordinator's address is {how}: drop --prefix, or find the leader with "
                "--etcd HOST:PORT --prefix P"
            )
        return Target(coordinators=parse_addresses(coordinator, source), source=source)
    if etcd:
        if prefix_flag is not None and not prefix_flag.strip():  # never taken for "not given" (the default)
            raise UsageError("--prefix is empty: give the coordinators' key prefix, or leave it out for the default")
        prefix, prefix_source = prefix_flag, "--prefix"
        if prefix is None and env.get("HILUM_PREFIX"):
            prefix, prefix_source = env["HILUM_PREFIX"], "HILUM_PREFIX"
        return Target(
            etcd=parse_addresses(etcd, source),
            prefix=prefix or DEFAULT_PREFIX,
            source=source,
            prefix_source=prefix_source,
        )
    raise UsageError(
        "no coordinator given: pass --coordinator HOST:PORT (any replica) or --etcd HOST:PORT (find the leader), "
        "or set HILUM_COORDINATOR / HILUM_ETCD"
    )


class _Out:
    """Where a command writes: JSON or rich tables on stdout, progress on stderr."""

    def __init__(self, as_json: bool, stdout: TextIO, stderr: TextIO) -> None:
        self.as_json = as_json
        self.stdout, self.stderr = stdout, stderr
        width = None if stdout.isatty() else 200
        self.console = Console(file=stdout, width=width, markup=False, emoji=False, highlight=False)

    def json(self, data: Any, *, line: bool = False) -> None:
        text = json.dumps(data, separators=(",", ":")) if line else json.dumps(data, indent=2)
        print(text, file=self.stdout, flush=True)

    def note(self, text: str) -> None:
        if not self.as_json:
            print(text, file=self.stderr, flush=True)


async def _status(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    reply = await c.read("Status", pb.StatusRequest())
    data = views.status_json(reply, c.address)
    out.json(data) if out.as_json else views.render_status(out.console, data)
    return 0


async def _domains(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    domains = await c.read("ListDomains", pb.ListDomainsRequest())
    data = views.domains_json(domains, await c.read("ListInstances", pb.ListInstancesRequest()))
    out.json(data) if out.as_json else views.render_domains(out.console, data)
    return 0


async def _known_domain(c: AdminClient, domain_id: str, domains: Sequence[pb.DomainInfo]) -> pb.DomainInfo:
    """``domain_id``'s entry in ``domains`` (ListDomains), or an empty one for a domain only the topology lists.

    Raises:
        CtlError: when neither names it (exit status 1, like every unknown name).
    """
    info = next((d for d in domains if d.domain_id == domain_id), None)
    if info is not None:
        return info
    topology = await c.read("GetTopology", pb.GetTopologyRequest())
    if any(d.domain_id == domain_id for d in topology.domains):
        return pb.DomainInfo(domain_id=domain_id)
    raise CtlError(
        f"domain {domain_id!r} is not known to the coordinator at {c.address}: no domain scheduler, summary or "
        "drain names it and its topology does not list it (see `hilumctl domains`)"
    )


async def _drains(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    data = views.drains_json(await c.read("ListDrains", pb.ListDrainsRequest()))
    out.json(data) if out.as_json else views.render_drains(out.console, data)
    return 0


async def _instances(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    if ns.domain:
        await _known_domain(c, ns.domain, (await c.read("ListDomains", pb.ListDomainsRequest())).domains)
    data = views.instances_json(await c.read("ListInstances", pb.ListInstancesRequest(domain_id=ns.domain)))
    out.json(data) if out.as_json else views.render_instances(out.console, data)
    return 0


async def _requests(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    domains = list((await c.read("ListDomains", pb.ListDomainsRequest())).domains)
    if ns.domain:
        domains = [await _known_domain(c, ns.domain, domains)]
    answers = await ask_domains(domains, c.rpc_timeout_s)
    data = views.requests_json(answers, ns.instance)
    errors = [a.error for a in answers if a.error]
    if ns.instance and not data["instances"] and not errors:
        where = f"domain {ns.domain}" if ns.domain else "any domain scheduler"
        raise CtlError(f"instance {ns.instance!r} is not known to {where} (see `hilumctl instances`)")
    out.json(data) if out.as_json else views.render_requests(out.console, data)
    for error in errors:
        print(f"hilumctl: error: {error}", file=out.stderr)
    return 1 if errors else 0


def _state_filter(ns: argparse.Namespace) -> frozenset[str] | None:
    if not ns.state:
        return None
    states = set(ns.state)
    if "active" in states:
        states |= {"proposed", "approved"}
    return frozenset(states - {"active"})


async def _migrations(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    states = _state_filter(ns)
    if not ns.follow:
        reply = await c.read("ListMigrations", pb.ListMigrationsRequest(active_only=ns.state == ["active"]))
        data = views.migrations_json(reply, states)
        out.json(data) if out.as_json else views.render_migrations(out.console, data)
        return 0
    out.note(f"following migrations at {c.address} (Ctrl-C to stop)")
    async for event in c.follow_migrations():
        item = views.migration_event_json(event)
        if states is not None and not item["deleted"] and item["migration"]["state"] not in states:
            continue
        if out.as_json:
            out.json(item, line=True)
        else:
            print(views.migration_line(item), file=out.stdout, flush=True)
    return 0  # pragma: no cover - follow_migrations ends only by raising


async def _kind(c: AdminClient, ns: argparse.Namespace) -> str:
    """What the drain target is: ``--instance`` / ``--domain``, else what the coordinator knows it as. Raises
    UsageError for a name of both kinds, or for ``drain --instance`` of a name known only as a domain (or the
    reverse: its intent would name nothing, and nothing would show it); CtlError for a name of neither kind."""
    if ns.kind and ns.command == "undrain":  # also an intent of the wrong kind, recorded before this was refused
        return str(ns.kind)
    instances = await c.read("ListInstances", pb.ListInstancesRequest())
    domains = await c.read("ListDomains", pb.ListDomainsRequest())
    topology = await c.read("GetTopology", pb.GetTopologyRequest())
    kind = resolve_target(ns.target, instances.instances, domains.domains, topology)
    if kind == "unknown" and ns.command == "undrain":  # an intent of a name nothing else knows: its kind
        intents = (await c.read("ListDrains", pb.ListDrainsRequest())).drains
        kinds = {d.intent.kind for d in intents if d.intent.target_id == ns.target}
        kind = kinds.pop() if len(kinds) == 1 else kind
    if ns.kind:
        if kind in ("instance", "domain") and kind != ns.kind:
            raise UsageError(
                f"{ns.target!r} is {'an instance' if kind == 'instance' else 'a domain'}, not "
                f"{'an instance' if ns.kind == 'instance' else 'a domain'}: drop --{ns.kind}"
            )
        return str(ns.kind)  # ambiguous, unknown (not started yet) or as known
    if kind == "ambiguous":
        raise UsageError(f"{ns.target!r} names both an instance and a domain: add --instance or --domain")
    if kind == "unknown":
        raise CtlError(
            f"{ns.target!r} is not a registered instance or domain, nor in the coordinator's topology "
            f"(see `hilumctl instances` and `hilumctl domains`); add --instance or --domain to {ns.command} it anyway"
        )
    return kind


def _request(kind: str, target: str, cls: Any, **extra: Any) -> Any:
    return cls(instance_id=target, **extra) if kind == "instance" else cls(domain_id=target, **extra)


async def _progress(c: AdminClient, kind: str, target: str) -> DrainProgress:
    instances = (await c.read("ListInstances", pb.ListInstancesRequest())).instances
    migrations = (await c.read("ListMigrations", pb.ListMigrationsRequest(active_only=True))).migrations
    if kind == "instance":
        return instance_progress(target, instances, migrations)
    domains = (await c.read("ListDomains", pb.ListDomainsRequest())).domains
    return domain_progress(target, domains, instances, migrations)


async def _drain(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    undrain = ns.command == "undrain"
    kind = await _kind(c, ns)
    if undrain:
        reply, leader = await c.write("Undrain", _request(kind, ns.target, pb.UndrainRequest))
    else:
        reply, leader = await c.write("Drain", _request(kind, ns.target, pb.DrainRequest, reason=ns.reason))
    data: dict[str, Any] = {
        "action": ns.command,
        "kind": kind,
        "target_id": ns.target,
        "changed": reply.changed,
        "reason": reply.intent.reason,
        "fencing_token": reply.intent.fencing_token,
        "leader_address": leader,
        "wait": None,
    }
    what = f"{kind} {ns.target}"
    if undrain:
        said = f"{what} is no longer draining" if reply.changed else f"{what} was not draining: nothing to undo"
    elif reply.changed:
        said = f"drain of {what} recorded by the leader at {leader} (fencing token {reply.intent.fencing_token})"
    else:
        said = f"{what} was already draining (recorded with fencing token {reply.intent.fencing_token})"
    if undrain or not ns.wait:
        out.json(data) if out.as_json else print(said, file=out.stdout)
        return 0
    out.note(said)
    progress, waited_s = await _wait_empty(c, kind, ns.target, ns.timeout, ns.interval, out)
    data["wait"] = {**progress.to_json(), "waited_s": round(waited_s, 3)}
    if out.as_json:
        out.json(data)
    elif progress.empty:
        print(f"{progress.detail}. It is safe to stop it.", file=out.stdout)
    if not progress.empty:
        print(f"hilumctl: error: timed out after {waited_s:.1f} s, not empty: {progress.detail}", file=out.stderr)
        return 1
    return 0


async def _wait_empty(
    c: AdminClient, kind: str, target: str, timeout_s: float, interval_s: float, out: _Out
) -> tuple[DrainProgress, float]:
    start = time.monotonic()
    said = ""
    while True:
        progress = await _progress(c, kind, target)
        waited_s = time.monotonic() - start
        if progress.empty or waited_s >= timeout_s:
            return progress, waited_s
        if progress.detail != said:
            out.note(f"[{waited_s:6.1f} s] {progress.detail}")
            said = progress.detail
        await asyncio.sleep(min(interval_s, max(0.0, timeout_s - waited_s)))


async def _topology(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    data = views.topology_json(await c.read("GetTopology", pb.GetTopologyRequest()))
    out.json(data) if out.as_json else views.render_topology(out.console, data)
    return 0


async def _autoscale(c: AdminClient, ns: argparse.Namespace, out: _Out) -> int:
    data = views.autoscale_json(await c.read("GetAutoscale", pb.GetAutoscaleRequest()), c.address)
    if out.as_json:
        if ns.events is not None:  # given: the JSON keeps the latest N too (else every decision the record holds)
            for m in data["models"]:
                m["events"] = views.latest(m["events"], ns.events)
        out.json(data)
    else:
        views.render_autoscale(out.console, data, events=10 if ns.events is None else ns.events)
    return 0


_COMMANDS = {
    "status": _status,
    "domains": _domains,
    "instances": _instances,
    "requests": _requests,
    "migrations": _migrations,
    "drain": _drain,
    "undrain": _drain,
    "drains": _drains,
    "topology": _topology,
    "autoscale": _autoscale,
}


_DRAIN_WAIT = {"timeout": 300.0, "interval": 1.0}  # drain --wait's defaults, seconds

_WANTED = {  # what each flag that takes a name or an address wants, for the error when it is given empty
    "coordinator": "HOST:PORT",
    "etcd": "HOST:PORT",
    "domain": "a domain id",
    "instance": "an instance id",
}


def _check_options(ns: argparse.Namespace) -> None:
    """Usage errors a command would otherwise find only after reaching the coordinator. Raises UsageError.

    A value given empty or blank (``drain " "``, ``--domain ""``, ``--coordinator ""``) is refused, never taken for
    no filter, for the flag not given, or sent on; a filter not given is set to "" (every one) here. ``drain``'s
    ``--timeout`` / ``--interval`` without ``--wait`` are refused (they would be ignored), else default here."""
    if ns.command in ("drain", "undrain") and not ns.target.strip():
        what = {"instance": ("INSTANCE", "an instance id"), "domain": ("DOMAIN", "a domain id")}
        name, wanted = what.get(ns.kind, ("INSTANCE|DOMAIN", "an instance id or a domain id"))
        raise UsageError(f"{name} is empty: give {wanted}")
    for name, wanted in _WANTED.items():
        value = getattr(ns, name, None)
        if value is not None and not value.strip():
            raise UsageError(f"--{name} is empty: give {wanted}")
    for name in ("domain", "instance"):  # the filters of instances and requests
        if hasattr(ns, name) and getattr(ns, name) is None:
            setattr(ns, name, "")
    if ns.command == "drain":
        for name, default_s in _DRAIN_WAIT.items():
            value = getattr(ns, name)
            if value is None:
                setattr(ns, name, default_s)
                continue
            if not ns.wait:
                raise UsageError(f"--{name} applies only with --wait: add --wait, or drop --{name}")
            if not math.isfinite(value) or value < 0 or (name == "interval" and value == 0):
                wanted = "> 0" if name == "interval" else ">= 0"
                raise UsageError(f"--{name}: must be a finite number of seconds {wanted}, got {value:g}")
    if ns.command == "autoscale" and ns.events is not None and ns.events < 0:
        raise UsageError(f"--events must be >= 0, got {ns.events}")


async def run(ns: argparse.Namespace, target: Target, out: _Out) -> int:
    """Run the parsed command against ``target``; returns the exit status. Raises CtlError / UsageError."""
    rpc_timeout_s = getattr(ns, "rpc_timeout", None)
    async with AdminClient(target, 5.0 if rpc_timeout_s is None else rpc_timeout_s) as client:
        return await _COMMANDS[ns.command](client, ns, out)


@quiet_on_broken_pipe
def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 runtime error, 2 usage error); 0 and nothing
    printed when stdout's reader has gone (``hilumctl topology | head -1``, :mod:`hilum_cli.broken_pipe`).

    ``env`` defaults to ``os.environ`` as it is when called (HILUM_COORDINATOR, HILUM_ETCD, HILUM_PREFIX).
    """
    ns = build_parser().parse_args(argv)
    env = os.environ if env is None else env
    out = _Out(bool(getattr(ns, "json", False)), sys.stdout, sys.stderr)
    try:
        _check_options(ns)
        return asyncio.run(run(ns, _target(ns, env), out))
    except UsageError as exc:
        print(f"hilumctl: error: {exc}", file=sys.stderr)
        return 2
    except CtlError as exc:
        print(f"hilumctl: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0 if ns.command == "migrations" and ns.follow else 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
