"""``hilumctl`` output: the ``--json`` shapes (stable keys, see docs/control-plane.md) and the rich tables.

Every ``*_json`` function turns one admin-API reply into plain JSON-ready values; the human renderers
draw tables from those same dicts, so both forms always show the same data. Floats that are not finite
(a draining domain's virtual usage is +inf, its freeness -inf: policy.domain) become ``null`` in JSON; a
table shows a draining domain's state in its DRAIN column and "-" for its capacity, usage, freeness and
largest free space, which describe capacity it no longer offers.

Drain state (``drain_state`` in JSON, the DRAIN column): ``none``; ``requested`` (a drain intent names the
target, its domain scheduler has not applied it yet); ``draining`` (the scheduler applies it: nothing new is
dispatched there and its requests move away); ``undraining`` (the scheduler still applies a drain whose
intent was removed: it has not seen the undrain yet). A domain whose every instance is named by a drain intent
drains whole, with no intent of the domain too: ``draining`` (JSON ``instances_drained``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from hilum_cli import counted
from hilum_cli.ctl_requests import DomainAnswer
from hilum_proto.v1 import coordinator_pb2 as pb
from topology.tables import split_to_fit

__all__ = [
    "STATE_NAMES",
    "autoscale_json",
    "domain_json",
    "domains_json",
    "drain_state",
    "instance_json",
    "instances_json",
    "migration_event_json",
    "migration_json",
    "migration_line",
    "migrations_json",
    "render_autoscale",
    "render_domains",
    "render_instances",
    "render_migrations",
    "render_requests",
    "render_status",
    "render_topology",
    "requests_json",
    "status_json",
    "topology_json",
]

Json = dict[str, Any]

# MigrationState enum value -> the name hilum uses everywhere (records.MigrationState values).
STATE_NAMES: Mapping[int, str] = {
    pb.MIGRATION_STATE_UNSPECIFIED: "unspecified",
    pb.MIGRATION_STATE_PROPOSED: "proposed",
    pb.MIGRATION_STATE_APPROVED: "approved",
    pb.MIGRATION_STATE_COMMITTED: "committed",
    pb.MIGRATION_STATE_ABORTED: "aborted",
}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def drain_state(intent: bool, applied: bool) -> str:
    """The drain state of a target (module docstring) from its intent in etcd and its scheduler's report."""
    if applied:
        return "draining" if intent else "undraining"
    return "requested" if intent else "none"


# ---- JSON shapes ---------------------------------------------------------------------------------
def status_json(reply: pb.StatusReply, address: str) -> Json:
    """``status``: what the replica at ``address`` knows (see StatusReply)."""
    return {
        "address": address,
        "coordinator_id": reply.coordinator_id,
        "is_leader": reply.is_leader,
        "leader_id": reply.leader_id or None,
        "leader_address": reply.leader_address or None,
        "fencing_token": reply.fencing_token,
        "etcd_endpoint": reply.etcd_endpoint,
        "view_revision": reply.view_revision,
        "num_domains": reply.num_domains,
        "num_instances": reply.num_instances,
        "num_active_migrations": reply.num_active_migrations,
        "num_drains": reply.num_drains,
    }


def domain_json(info: pb.DomainInfo, instances_drained: bool = False) -> Json:
    """One domain; ``summaries`` (one per model it serves) is empty until its domain scheduler publishes.
    ``instances_drained``: a drain intent names every instance of it, its own or the domain's (``InstanceInfo.
    draining``): with instance intents alone its scheduler drains the whole domain (``draining``, not
    ``undraining``)."""
    summaries: list[Json] = []
    for s in info.summaries:
        summaries.append({
            "model": s.model,
            "num_instances": s.num_instances,
            "capacity_blocks": s.capacity_blocks,
            "virtual_usage_blocks": _finite(s.virtual_usage),
            "freeness": _finite(s.freeness),
            "largest_free_blocks": s.largest_free_blocks,
            "max_instance_capacity_blocks": s.max_instance_capacity_blocks,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "draining": s.draining,
        })  # fmt: skip
    return {
        "domain_id": info.domain_id,
        "registered": info.registered,
        "scheduler_address": info.scheduler_address or None,
        "draining": info.draining,
        "instances_drained": instances_drained,
        "drain_state": drain_state(
            info.draining or instances_drained, bool(summaries) and all(x["draining"] for x in summaries)
        ),
        "summaries": summaries,
    }


def domains_json(reply: pb.ListDomainsReply, instances: pb.ListInstancesReply | None = None) -> Json:
    """``domains``; ``instances`` (ListInstances, every domain's): their drain intents, for the state of a domain
    whose every instance is drained one by one."""
    intents: dict[str, list[bool]] = {}
    for i in instances.instances if instances is not None else ():
        intents.setdefault(i.domain_id, []).append(i.draining)
    drained = {d: bool(flags) and all(flags) for d, flags in intents.items()}
    return {
        "view_revision": reply.view_revision,
        "domains": [domain_json(d, drained.get(d.domain_id, False)) for d in reply.domains],
    }


def instance_json(info: pb.InstanceInfo) -> Json:
    """One instance; ``load`` is null until its domain scheduler publishes its load."""
    load: Json | None = None
    if info.has_load:
        load = {
            "used_blocks": info.load.capacity_blocks - info.load.free_blocks,
            "free_blocks": info.load.free_blocks,
            "num_running": info.load.num_running,
            "num_waiting": info.load.num_waiting,
            "draining": info.load.draining,
        }
    return {
        "instance_id": info.instance_id,
        "domain_id": info.domain_id,
        "node_id": info.node_id,
        "address": info.address,
        "model": info.model,
        "capacity_blocks": info.capacity_blocks,
        "draining": info.draining,
        "drain_state": drain_state(info.draining, info.has_load and info.load.draining),
        "load": load,
    }


def instances_json(reply: pb.ListInstancesReply) -> Json:
    """``instances``."""
    return {"view_revision": reply.view_revision, "instances": [instance_json(i) for i in reply.instances]}


def drains_json(reply: pb.ListDrainsReply) -> Json:
    """``drains``: every drain intent recorded in etcd."""
    return {
        "view_revision": reply.view_revision,
        "drains": [
            {
                "kind": e.intent.kind,
                "target_id": e.intent.target_id,
                "reason": e.intent.reason,
                "fencing_token": e.intent.fencing_token,
                "target_known": e.target_known,
            }
            for e in reply.drains
        ],
    }


def migration_json(m: pb.Migration) -> Json:
    """One cross-domain migration record."""
    return {
        "migration_id": m.migration_id,
        "request_id": m.request_id,
        "attempt": m.attempt,
        "state": STATE_NAMES.get(m.state, "unspecified"),
        "src_instance_id": m.src_instance_id,
        "dst_instance_id": m.dst_instance_id,
        "src_domain_id": m.src_domain_id,
        "dst_domain_id": m.dst_domain_id,
        "blocks": m.blocks,
        "fencing_token": m.fencing_token,
        "links": list(m.links),
        "expected_transfer_s": m.expected_transfer_s,
        "expected_downtime_s": m.expected_downtime_s,
        "reason": m.reason,
        "mod_revision": m.mod_revision,
        "transport": m.transport or None,
        "measured_bandwidth_bytes_per_s": m.measured_bandwidth_bytes_per_s or None,
        "plan": m.plan or None,
        "measured_downtime_s": m.measured_downtime_s if m.plan else None,
    }


def migrations_json(reply: pb.ListMigrationsReply, states: frozenset[str] | None) -> Json:
    """``migrations`` (only the given states when ``states`` is not None)."""
    items = [migration_json(m) for m in reply.migrations]
    if states is not None:
        items = [m for m in items if m["state"] in states]
    return {"view_revision": reply.view_revision, "migrations": items}


def migration_event_json(event: pb.MigrationEvent) -> Json:
    """One ``migrations --follow`` line: a record as it is now, or ``deleted`` with only its id."""
    if event.deleted:
        return {"deleted": True, "migration_id": event.migration.migration_id, "migration": None}
    return {
        "deleted": False,
        "migration_id": event.migration.migration_id,
        "migration": migration_json(event.migration),
    }


def topology_json(reply: pb.TopologyReply) -> Json:
    """``topology``: the file the coordinator was started with (``loaded`` false without one)."""
    return {
        "loaded": reply.loaded,
        "name": reply.name or None,
        "source": reply.source or None,
        "domains": [
            {
                "domain_id": d.domain_id,
                "kind": d.kind,
                "gpu_type": d.gpu_type,
                "instances": [
                    {
                        "instance_id": i.instance_id,
                        "node_id": i.node_id,
                        "gpus": list(i.gpus),
                        "tensor_parallel_size": i.tensor_parallel_size,
                        "model": i.model,
                        "gpu_type": i.gpu_type,
                        "kv_capacity_blocks": i.kv_capacity_blocks,
                    }
                    for i in d.instances
                ],
            }
            for d in reply.domains
        ],
    }


def requests_json(answers: Sequence[DomainAnswer], instance_id: str = "") -> Json:
    """``requests``: per domain its scheduler's answer, per instance its counts, one row per running request.

    ``instance_id`` (non-empty) keeps only that instance and its requests. Instances and requests are sorted
    by domain, then instance, then request id.
    """
    domains: list[Json] = []
    instances: list[Json] = []
    requests: list[Json] = []
    for a in answers:
        st = a.state
        domains.append({
            "domain_id": a.domain_id,
            "scheduler_address": a.scheduler_address,
            "answered": st is not None,
            "ready": None if st is None else st.ready,
            "draining": None if st is None else st.domain_draining,
            "migrations_in_flight": None if st is None else st.migrations_in_flight,
            "error": a.error,
        })  # fmt: skip
        if st is None:
            continue
        for i in sorted(st.instances, key=lambda i: i.instance_id):
            if instance_id and i.instance_id != instance_id:
                continue
            instances.append({
                "instance_id": i.instance_id,
                "domain_id": a.domain_id,
                "address": i.address,
                "connected": i.connected,
                "failure": i.failure,
                "draining": i.draining,
                "num_running": i.num_running if i.has_load else None,
                "num_waiting": i.num_waiting if i.has_load else None,
            })  # fmt: skip
            requests.extend(
                {"request_id": rid, "domain_id": a.domain_id, "instance_id": i.instance_id}
                for rid in sorted(i.running_request_ids)
            )
    return {"domains": domains, "instances": instances, "requests": requests}


def _opt(msg: Any, name: str) -> Any:
    """An ``optional`` field of a message: its value, or None when absent."""
    return getattr(msg, name) if msg.HasField(name) else None


def autoscale_json(reply: pb.AutoscaleReply, address: str) -> Json:
    """``autoscale --json``: the rule, and per model its last round, its instances in a phase and its decisions.

    Times are wall clock, seconds since the epoch (``*_s``); a value that is absent is null.
    """
    r = reply.rule
    rule = {
        "enabled": r.enabled, "interval_s": r.interval_s, "scale_out_freeness_below": r.scale_out_freeness_below,
        "scale_in_freeness_above": r.scale_in_freeness_above, "scale_out_hold_s": r.scale_out_hold_s,
        "scale_in_hold_s": r.scale_in_hold_s, "cool_down_s": r.cool_down_s, "min_instances": r.min_instances,
        "max_instances": r.max_instances, "start_timeout_s": r.start_timeout_s, "command": r.command,
    }  # fmt: skip
    models = []
    for m in reply.models:
        models.append(
            {
                "model": m.model,
                "evaluated_at_s": _opt(m, "evaluated_at_s"),
                "freeness": _opt(m, "freeness"),
                "freeness_without_candidate": _opt(m, "freeness_without_candidate"),
                "candidate": m.candidate,
                "live": m.live,
                "coming": m.coming,
                "draining": m.draining,
                "requests": m.requests,
                "min_instances": m.min_instances,
                "max_instances": m.max_instances,
                "last_action_s": _opt(m, "last_action_s"),
                "fencing_token": m.fencing_token,
                "instances": [
                    {"instance_id": i.instance_id, "phase": i.phase, "since_s": i.since_s} for i in m.instances
                ],
                "events": [
                    {
                        "action": e.action,
                        "instance_id": e.instance_id,
                        "at_s": e.at_s,
                        "reason": e.reason,
                        "status": e.status,
                        "attempts": e.attempts,
                        "exit_code": _opt(e, "exit_code"),
                        "output": e.output,
                        "finished_s": _opt(e, "finished_s"),
                    }
                    for e in m.events
                ],
            }
        )
    return {"address": address, "rule": rule, "models": models, "view_revision": reply.view_revision}


# ---- tables --------------------------------------------------------------------------------------
def _table(*columns: str, title: str | None = None) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    for col in columns:
        numeric = col in {"CAPACITY", "USED", "RUNNING", "WAITING", "USAGE", "FREENESS", "LARGEST FREE", "BLOCKS"}
        table.add_column(col, justify="right" if numeric else "left", no_wrap=col not in {"REASON"})
    return table


def _print_rows(console: Console, table: Table) -> None:
    """Print ``table`` if it has rows: with none, the count line after it says so (a header alone read as a blank
    row)."""
    if table.row_count:
        console.print(table)


def render_status(console: Console, st: Json) -> None:
    """``status`` as a two-column grid."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    role = "leader" if st["is_leader"] else "standby"
    grid.add_row("coordinator", f"{st['coordinator_id']} at {st['address']} ({role})")
    if st["leader_id"]:
        grid.add_row("leader", f"{st['leader_id']} at {st['leader_address']}, fencing token {st['fencing_token']}")
    else:
        grid.add_row("leader", "none elected (writes are refused until one is)")
    grid.add_row("etcd", f"{st['etcd_endpoint']}, view at revision {st['view_revision']}")
    grid.add_row("domains", f"{st['num_domains']} registered")
    grid.add_row("instances", f"{st['num_instances']} registered")
    grid.add_row("migrations", f"{st['num_active_migrations']} active (proposed or approved)")
    drains = st["num_drains"]
    grid.add_row("drains", f"{drains} intent{'' if drains == 1 else 's'}")
    console.print(grid)


def _cell(x: str) -> str:
    return "-" if x == "none" else x


def _blocks(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def render_domains(console: Console, data: Json) -> None:
    """``domains`` as a table (a draining domain: its state, no capacity figures)."""
    table = _table(
        "DOMAIN", "SCHEDULER", "DRAIN", "MODEL", "INSTANCES", "CAPACITY", "USAGE", "FREENESS", "LARGEST FREE",
        "RUNNING", "WAITING",
    )  # fmt: skip
    for d in data["domains"]:
        scheduler = d["scheduler_address"] or "not registered"
        if not d["summaries"]:
            table.add_row(d["domain_id"], scheduler, _cell(d["drain_state"]), "no summary", "", "", "", "", "", "", "")
            continue
        for summary in d["summaries"]:
            _domain_row(table, d, scheduler, summary)
    _print_rows(console, table)
    console.print(f"{counted(len(data['domains']), 'domain')} (view at revision {data['view_revision']})")


def _domain_row(table: Table, d: Json, scheduler: str, s: Json) -> None:
    """One row of ``domains``: a domain's summary of one model (draining: its state, no capacity figures)."""
    if s["draining"]:
        capacity = ["-", "-", "-", "-"]
    else:
        capacity = [
            str(s["capacity_blocks"]),
            _blocks(s["virtual_usage_blocks"]),
            _blocks(s["freeness"]),
            str(s["largest_free_blocks"]),
        ]
    state = drain_state(d["draining"] or d["instances_drained"], s["draining"])
    table.add_row(
        d["domain_id"], scheduler, _cell(state), s["model"] or "-",
        str(s["num_instances"]), *capacity, str(s["num_running"]), str(s["num_waiting"]),
    )  # fmt: skip


def render_instances(console: Console, data: Json) -> None:
    """``instances`` as a table."""
    table = _table("INSTANCE", "DOMAIN", "NODE", "ADDRESS", "MODEL", "CAPACITY", "USED", "RUNNING", "WAITING", "DRAIN")
    for i in data["instances"]:
        load = i["load"]
        drain = _cell(i["drain_state"])
        cells = (
            ["-", "-", "-"] if load is None else [str(load[k]) for k in ("used_blocks", "num_running", "num_waiting")]
        )
        table.add_row(
            i["instance_id"], i["domain_id"], i["node_id"], i["address"], i["model"], str(i["capacity_blocks"]), *cells,
            drain,
        )  # fmt: skip
    _print_rows(console, table)
    unit = "; USED in KV blocks" if data["instances"] else ""
    console.print(f"{counted(len(data['instances']), 'instance')} (view at revision {data['view_revision']}){unit}")


def render_drains(console: Console, data: Json) -> None:
    """``drains`` as a table; a target the coordinator does not know is marked (and counted below it)."""
    table = _table("KIND", "TARGET", "TOKEN", "TARGET KNOWN", "REASON")
    for d in data["drains"]:
        known = "yes" if d["target_known"] else "no: not registered, not in the topology"
        table.add_row(d["kind"], d["target_id"], str(d["fencing_token"]), known, d["reason"] or "-")
    _print_rows(console, table)
    unknown = sum(1 for d in data["drains"] if not d["target_known"])
    note = ""
    if unknown:
        verb = "names" if unknown == 1 else "name"
        note = f"; {unknown} {verb} nothing known (`hilumctl undrain --instance|--domain NAME` removes one)"
    console.print(f"{counted(len(data['drains']), 'drain intent')} (view at revision {data['view_revision']}){note}")


def render_migrations(console: Console, data: Json) -> None:
    """``migrations`` as a table; when it is wider than the console, its columns over several tables that fit, each
    led by the migration's id (``topology.tables.split_to_fit``): the reason (a rule's and the coordinator's words,
    a hundred characters or more) then has a table of its own, wrapped (squeezed beside ten columns, it took a
    dozen characters a line)."""
    columns = ("STATE", "FROM", "TO", "BLOCKS", "TOKEN", "TRANSFER", "DOWNTIME", "PLAN", "MEASURED", "REASON")
    rows = []
    for m in data["migrations"]:
        rate = m["measured_bandwidth_bytes_per_s"]
        measured = f"{rate / 1e6:.1f} MB/s ({m['transport']})" if rate else "-"
        paused = m["measured_downtime_s"]
        downtime = f"{m['expected_downtime_s'] * 1e3:.1f} ms" + (f" (paused {paused * 1e3:.1f} ms)" if paused else "")
        rows.append(
            {
                "MIGRATION": m["migration_id"],
                "STATE": m["state"],
                "FROM": f"{m['src_instance_id']} ({m['src_domain_id']})",
                "TO": f"{m['dst_instance_id']} ({m['dst_domain_id']})",
                "BLOCKS": str(m["blocks"]),
                "TOKEN": str(m["fencing_token"]),
                "TRANSFER": f"{m['expected_transfer_s']:.3f} s",
                "DOWNTIME": downtime,
                "PLAN": m["plan"] or "-",
                "MEASURED": measured,
                "REASON": m["reason"] or "-",
            }
        )

    def build(shown: Sequence[str], title: str) -> Table:
        table = _table("MIGRATION", *shown, title=title or None)
        for row in rows:
            table.add_row(*(row[c] for c in ("MIGRATION", *shown)))
        return table

    if rows:
        for table in split_to_fit(build, columns, "", console.width):
            console.print(table)
    console.print(f"{counted(len(data['migrations']), 'migration')} (view at revision {data['view_revision']})")


def migration_line(event: Json) -> str:
    """One human line of ``migrations --follow``."""
    if event["deleted"]:
        return f"deleted    {event['migration_id']}"
    m = event["migration"]
    return (
        f"{m['state']:<10} {m['migration_id']}  {m['src_instance_id']} ({m['src_domain_id']}) -> "
        f"{m['dst_instance_id']} ({m['dst_domain_id']})  {m['blocks']} blocks  token {m['fencing_token']}"
        + (f"  {m['plan']}, paused {m['measured_downtime_s'] * 1e3:.1f} ms" if m["plan"] else "")
        + (f"  {m['reason']}" if m["reason"] else "")
    )


def render_topology(console: Console, data: Json) -> None:
    """``topology`` as one table of instances grouped by domain."""
    if not data["loaded"]:
        console.print("the coordinator runs without a topology file (start it with --topology FILE)")
        return
    domains: Sequence[Json] = data["domains"]
    n_instances = sum(len(d["instances"]) for d in domains)
    table = _table(
        "DOMAIN", "KIND", "INSTANCE", "NODE", "GPUS", "TP", "MODEL", "GPU", "CAPACITY",
        title=f"topology {data['name']} ({data['source']}): {counted(len(domains), 'domain')}, "
        f"{counted(n_instances, 'instance')}",
    )  # fmt: skip
    for d in domains:
        for k, i in enumerate(d["instances"]):
            table.add_row(
                d["domain_id"] if k == 0 else "",
                d["kind"] if k == 0 else "",
                i["instance_id"],
                i["node_id"],
                ",".join(str(g) for g in i["gpus"]),
                str(i["tensor_parallel_size"]),
                i["model"],
                i["gpu_type"],
                str(i["kv_capacity_blocks"]),
            )
    console.print(table)


def render_requests(console: Console, data: Json) -> None:
    """``requests``: a table of running requests, then one of instances with running/waiting counts."""
    table = _table("REQUEST", "DOMAIN", "INSTANCE", title="running requests")
    for r in data["requests"]:
        table.add_row(r["request_id"], r["domain_id"], r["instance_id"])
    console.print(table)
    table = _table("INSTANCE", "DOMAIN", "RUNNING", "WAITING", "DRAIN", "LLUMLET")
    for i in data["instances"]:
        counts = ["-", "-"] if i["num_running"] is None else [str(i["num_running"]), str(i["num_waiting"])]
        llumlet = i["address"] + ("" if i["connected"] else " (not connected)")
        if i.get("failure"):
            llumlet += f" (failed: {i['failure']})"
        table.add_row(i["instance_id"], i["domain_id"], *counts, "draining" if i["draining"] else "-", llumlet)
    console.print(table)
    answered = [d for d in data["domains"] if d["answered"]]
    waiting = sum(i["num_waiting"] or 0 for i in data["instances"])
    console.print(
        f"{len(data['requests'])} running, {waiting} waiting on {counted(len(data['instances']), 'instance')} "
        f"({len(answered)} of {counted(len(data['domains']), 'domain scheduler')} answered)"
    )


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def latest(items: list[Any], count: int) -> list[Any]:
    """The last ``count`` (>= 0) of ``items``: none for 0 (where ``items[-0:]`` is every one)."""
    return items[len(items) - count :] if count < len(items) else list(items)


def render_autoscale(console: Console, data: Json, *, events: int = 10) -> None:
    """``autoscale``: the rule, per model its last round and instances in a phase, then its latest decisions."""
    r = data["rule"]
    state = "enabled" if r["enabled"] else "disabled on this replica"
    console.print(
        f"autoscaler {state}: every {r['interval_s']:g} s; out below freeness {r['scale_out_freeness_below']:g} "
        f"for {r['scale_out_hold_s']:g} s, in above {r['scale_in_freeness_above']:g} for {r['scale_in_hold_s']:g} s; "
        f"cool-down {r['cool_down_s']:g} s; hook {r['command'] or '(none)'}"
    )
    if not data["models"]:
        console.print("no autoscaler record yet (it runs on the coordinator leader when autoscale.enabled is true)")
        return
    table = _table("MODEL", "FREENESS", "WITHOUT", "CANDIDATE", "LIVE", "COMING", "LEAVING", "MIN", "MAX", "EVALUATED")
    for m in data["models"]:
        table.add_row(
            m["model"], _blocks(m["freeness"]), _blocks(m["freeness_without_candidate"]), m["candidate"] or "-",
            str(m["live"]), str(m["coming"]), str(m["draining"]), str(m["min_instances"]), str(m["max_instances"]),
            _clock(m["evaluated_at_s"]),
        )  # fmt: skip
    console.print(table)
    console.print("FREENESS: the fleet's, coming capacity counted; WITHOUT: without the scale-in candidate")
    for m in data["models"]:
        if m["instances"]:
            phases = ", ".join(f"{i['instance_id']} {i['phase']} since {_clock(i['since_s'])}" for i in m["instances"])
            console.print(f"{m['model']}: {phases}")
        shown = latest(m["events"], events)
        if not shown:
            continue
        table = _table(
            "AT", "ACTION", "INSTANCE", "STATUS", "TRIES", "EXIT", "REASON", title=f"{m['model']}: decisions"
        )
        for e in shown:
            exit_code = "-" if e["exit_code"] is None else str(e["exit_code"])
            reason = e["reason"] + (f" [{e['output'].strip().splitlines()[-1]}]" if e["output"].strip() else "")
            table.add_row(
                _clock(e["at_s"]), e["action"], e["instance_id"], e["status"], str(e["attempts"]), exit_code, reason
            )
        console.print(table)
