"""``hilum topology``: ``show FILE|NAME [--json] [--instances]`` and ``path FILE|NAME SRC DST [--json]``.

Exit status: 0 ok, 1 invalid topology file (every error printed to stderr) or unknown instance, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from itertools import combinations
from typing import Any

from rich.console import Console
from rich.table import Table

from topology.graph import TopologyGraph
from topology.load import BUNDLED_NAMES, TopologyError, load_topology
from topology.spec import Topology
from topology.tables import split_to_fit

__all__ = ["path_summary", "register", "topology_summary"]

_INSTANCE_ROWS = 32  # list instances one by one up to this many unless --instances


def register(sub: Any, summary: str) -> None:
    """Add ``hilum topology`` to the sub-command set ``sub`` (an argparse sub-parsers action); ``summary``: its
    one-line help."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "topology", help=summary, description="Inspect a topology file or bundled example."
    )
    cmds = parser.add_subparsers(dest="topology_command", metavar="SUBCOMMAND")
    cmds.required = True
    show = cmds.add_parser("show", help="summary of models, domains, instances and the fabric")
    show.add_argument("topology", metavar="FILE|NAME", help=f"a YAML file or one of: {', '.join(BUNDLED_NAMES)}")
    show.add_argument("--json", action="store_true", help="print the summary as JSON")
    show.add_argument("--instances", action="store_true", help="list every instance (default: up to 32)")
    show.set_defaults(func=_cmd_show)
    path = cmds.add_parser("path", help="widest path (bandwidth and links) between two instances")
    path.add_argument("topology", metavar="FILE|NAME")
    path.add_argument("src", metavar="SRC", help="source instance id")
    path.add_argument("dst", metavar="DST", help="destination instance id")
    path.add_argument("--json", action="store_true", help="print the path as JSON")
    path.set_defaults(func=_cmd_path)


def _terminal_width() -> int | None:
    """The terminal's width in characters when stdout is one (tables are split to fit it), else None (a pipe or a
    file gets every table whole)."""
    return Console().width if sys.stdout.isatty() else None


def _console(width: int | None, tables: Sequence[Table | str] = ()) -> Console:
    """A console ``width`` characters wide; None: as wide as the widest of ``tables`` needs, at least 120."""
    if width is None:
        measure = Console(width=10_000).measure
        width = max([120, *(measure(t).maximum for t in tables if isinstance(t, Table))])
    return Console(width=width, highlight=False)


def _load(arg: str, command: str) -> Topology | None:
    """The topology ``arg`` names, or None after printing each of its errors as ``hilum topology COMMAND: error:``."""
    try:
        return load_topology(arg)
    except TopologyError as exc:
        for line in exc.lines():
            print(f"hilum topology {command}: error: {line}", file=sys.stderr)
        return None


def _gbyte(bw: float) -> str:
    """``1,555.0 GB/s``; three significant figures under 1 GB/s (``0.0125 GB/s``: it read 0.0)."""
    gbyte = bw / 1e9
    return f"{gbyte:,.1f} GB/s" if gbyte >= 1 else f"{gbyte:.3g} GB/s"


def _gbit(bw: float) -> str:
    """``400 Gb/s``; three significant figures under 10 Gb/s (``0.1 Gb/s``: it read 0)."""
    gbit = bw * 8 / 1e9
    return f"{gbit:,.0f} Gb/s" if gbit >= 10 else f"{gbit:.3g} Gb/s"


# ------------------------------------------------------------------------------------------------ show


def topology_summary(topo: Topology, graph: TopologyGraph | None = None) -> dict[str, Any]:
    """A JSON-ready summary of ``topo``: models, GPU types, domains, instances, racks and path figures.

    Bandwidths in bytes/s, sizes in bytes, capacities in blocks and tokens. ``paths`` gives, for each class of
    instance pair (same domain, same rack, cross rack), the least and greatest widest-path bandwidth over
    representative pairs (the first instances of each domain).
    """
    graph = graph or TopologyGraph(topo)
    models = {
        m.name: {
            "num_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "dtype": m.dtype,
            "block_size_tokens": m.block_size_tokens,
            "kv_bytes_per_token": m.kv_bytes_per_token,
            "kv_bytes_per_block": m.kv_bytes_per_block,
            "weight_bytes": m.weight_bytes,
            "max_context_tokens": m.max_context_tokens,
            "tokenizer": m.tokenizer,
        }
        for m in topo.models.values()
    }
    gpus = {
        g.name: {
            "memory_bytes": g.memory_bytes,
            "hbm_bandwidth_bytes_per_s": g.hbm_bandwidth_bytes_per_s,
            "nvlink_bandwidth_bytes_per_s": g.nvlink_bandwidth_bytes_per_s,
        }
        for g in topo.gpu_types.values()
    }
    instances = [
        {
            "instance_id": i.instance_id,
            "domain_id": i.domain_id,
            "node_id": i.node_id,
            "gpus": list(i.gpus),
            "tensor_parallel_size": i.tensor_parallel_size,
            "model": i.model,
            "kv_capacity_blocks": i.kv_capacity_blocks,
            "kv_capacity_tokens": topo.kv_capacity_tokens(i.instance_id),
        }
        for i in topo.instances
    ]
    domains = [
        {
            "domain_id": d.domain_id,
            "kind": d.kind,
            "gpu_type": d.gpu_type,
            "nodes": [n.node_id for n in d.nodes],
            "num_gpus": d.num_gpus,
            "num_instances": len(d.instances),
            "instance_mix": _mix(topo, d.domain_id),
            "kv_capacity_blocks": d.kv_capacity_blocks,
            "kv_capacity_tokens": sum(topo.kv_capacity_tokens(i.instance_id) for i in d.instances),
            "rack": topo.rack_of(d.nodes[0].node_id),  # its first node's
            "racks": list(dict.fromkeys(r for n in d.nodes if (r := topo.rack_of(n.node_id)) is not None)),
        }
        for d in topo.domains
    ]
    racks = [
        {
            "rack_id": r.rack_id,
            "num_nodes": len(r.node_ids),
            "nic_bandwidth_bytes_per_s": sum(topo.node(n).nic_bandwidth_bytes_per_s for n in r.node_ids),
            "uplink_bandwidth_bytes_per_s": r.uplink_bandwidth_bytes_per_s,
            "oversubscription": r.oversubscription,
        }
        for r in topo.fabric.racks
    ]
    return {
        "name": topo.name,
        "source": topo.source,
        "num_gpus": topo.num_gpus,
        "num_domains": len(topo.domains),
        "num_instances": len(topo.instances),
        "kv_capacity_blocks": sum(d.kv_capacity_blocks for d in topo.domains),
        "models": models,
        "gpu_types": gpus,
        "domains": domains,
        "instances": instances,
        "fabric": {
            "racks": racks,
            "spine": len(racks) > 1,
            "bisection_bandwidth_bytes_per_s": topo.bisection_bandwidth_bytes_per_s(),
        },
        "paths": _path_classes(topo, graph),
    }


def _mix(topo: Topology, domain_id: str) -> str:
    counts = Counter((i.model, i.tensor_parallel_size) for i in topo.domain(domain_id).instances)
    return ", ".join(f"{n} x {model} TP{tp}" for (model, tp), n in counts.items()) or "-"


def _path_classes(topo: Topology, graph: TopologyGraph) -> dict[str, dict[str, Any]]:
    """Least/greatest widest-path bandwidth and the bottleneck link of the least, per pair class."""
    classes: dict[str, list[tuple[float, str, str, str]]] = {
        "same_domain": [],
        "same_rack": [],
        "cross_rack": [],
    }
    for d in topo.domains:
        if len(d.instances) >= 2:
            x, y = d.instances[0].instance_id, d.instances[1].instance_id
            p = graph.path(x, y)
            classes["same_domain"].append((p.bandwidth_bytes_per_s, p.bottleneck_link, x, y))
    firsts = [d.instances[0] for d in topo.domains if d.instances]
    for a, b in combinations(firsts, 2):
        p = graph.path(a.instance_id, b.instance_id)
        same = topo.rack_of(a.node_id) == topo.rack_of(b.node_id)
        row = (p.bandwidth_bytes_per_s, p.bottleneck_link, a.instance_id, b.instance_id)
        classes["same_rack" if same else "cross_rack"].append(row)
    out: dict[str, dict[str, Any]] = {}
    for name, rows in classes.items():
        if rows:
            low = min(rows)
            out[name] = {
                "pairs": len(rows),
                "min_bandwidth_bytes_per_s": low[0],
                "max_bandwidth_bytes_per_s": max(rows)[0],
                "min_bottleneck_link": low[1],
                "example": [low[2], low[3]],
            }
    return out


def _cmd_show(args: argparse.Namespace) -> int:
    topo = _load(args.topology, "show")
    if topo is None:
        return 2  # bad input, as for every hilum command
    summary = topology_summary(topo)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    width = _terminal_width()
    tables = _show_tables(summary, width, args.instances)
    con = _console(width, tables)
    con.print(
        f"[bold]{summary['name']}[/bold] ({summary['source']}): {_count(summary['num_gpus'], 'GPU')}, "
        f"{_count(summary['num_domains'], 'NVLink domain')}, {_count(summary['num_instances'], 'instance')}, "
        f"{_count(len(summary['fabric']['racks']), 'rack')}"
    )
    for table in tables:
        con.print(table)
    return 0


def _show_tables(summary: dict[str, Any], width: int | None, instances: bool) -> list[Table | str]:
    """What ``hilum topology show`` prints below its first line, in order: tables (each split over several when
    wider than ``width`` characters; None: whole) and lines; ``instances``: list every instance."""
    out: list[Table | str] = []

    def table(title: str, columns: Sequence[str], rows: list[list[str]], *, left: Sequence[str] = ()) -> None:
        out.extend(_fitted(title, columns, rows, width, left=left))

    table(
        "Models",
        (
            "model",
            "layers",
            "heads / kv",
            "head dim",
            "dtype",
            "block",
            "KV B/token",
            "KV/block",
            "weights GB",
            "max ctx",
        ),
        [
            [
                name,
                str(m["num_layers"]),
                f"{m['num_attention_heads']} / {m['num_kv_heads']}",
                str(m["head_dim"]),
                m["dtype"],
                str(m["block_size_tokens"]),
                f"{m['kv_bytes_per_token']:,}",
                f"{m['kv_bytes_per_block'] / 2**20:g} MiB",
                f"{m['weight_bytes'] / 1e9:.1f}",
                f"{m['max_context_tokens']:,}",
            ]
            for name, m in summary["models"].items()
        ],
        left=("dtype",),
    )
    table(
        "GPU types",
        ("GPU", "memory GiB", "HBM", "NVLink per GPU"),
        [
            [
                name,
                f"{g['memory_bytes'] / 2**30:g}",
                _gbyte(g["hbm_bandwidth_bytes_per_s"]),
                _gbyte(g["nvlink_bandwidth_bytes_per_s"]),
            ]
            for name, g in summary["gpu_types"].items()
        ],
    )
    table(
        "NVLink domains",
        ("domain", "kind", "GPU", "nodes", "GPUs", "instances", "KV blocks", "KV tokens", "rack"),
        [
            [
                d["domain_id"],
                d["kind"],
                d["gpu_type"],
                str(len(d["nodes"])),
                str(d["num_gpus"]),
                d["instance_mix"],
                f"{d['kv_capacity_blocks']:,}",
                f"{d['kv_capacity_tokens']:,}",
                ", ".join(d["racks"]) or "-",  # an island may span racks
            ]
            for d in summary["domains"]
        ],
        left=("kind", "GPU", "instances", "rack"),
    )
    if instances or summary["num_instances"] <= _INSTANCE_ROWS:
        table(
            "Instances",
            ("instance", "domain", "node", "GPUs", "TP", "model", "KV blocks", "KV tokens"),
            [
                [
                    i["instance_id"],
                    i["domain_id"],
                    i["node_id"],
                    ",".join(map(str, i["gpus"])),
                    str(i["tensor_parallel_size"]),
                    i["model"],
                    f"{i['kv_capacity_blocks']:,}",
                    f"{i['kv_capacity_tokens']:,}",
                ]
                for i in summary["instances"]
            ],
            left=("domain", "node", "GPUs", "model"),
        )
    else:
        out.append(f"({summary['num_instances']} instances; --instances lists them)")
    fab = summary["fabric"]
    if fab["racks"]:
        table(
            "Racks",
            ("rack", "nodes", "NIC total", "uplink", "oversubscription"),
            [
                [
                    r["rack_id"],
                    str(r["num_nodes"]),
                    _gbit(r["nic_bandwidth_bytes_per_s"]),
                    _gbit(r["uplink_bandwidth_bytes_per_s"]) + ("" if fab["spine"] else " (no spine)"),
                    f"{r['oversubscription']:g}:1",
                ]
                for r in fab["racks"]
            ],
        )
    if len({n for d in summary["domains"] for n in d["nodes"]}) > 1:
        bisection = fab["bisection_bandwidth_bytes_per_s"]
        out.append(f"bisection bandwidth: {_gbit(bisection)} ({_gbyte(bisection)})")
    else:  # 0 would read as a fault
        out.append("bisection bandwidth: none to measure (one node: no network path between nodes)")
    table(
        "Widest-path bandwidth by pair class (first instances of each domain)",
        ("class", "pairs", "min", "max", "bottleneck of min"),
        [
            [
                name.replace("_", " "),
                f"{c['pairs']:,}",
                _gbyte(c["min_bandwidth_bytes_per_s"]),
                _gbyte(c["max_bandwidth_bytes_per_s"]),
                c["min_bottleneck_link"],
            ]
            for name, c in summary["paths"].items()
        ],
        left=("bottleneck of min",),
    )
    return out


def _fitted(
    title: str, columns: Sequence[str], rows: list[list[str]], width: int | None, *, left: Sequence[str] = ()
) -> list[Table]:
    """``rows`` under ``columns`` as a table titled ``title``, or, wider than ``width`` characters, as several
    (:func:`topology.tables.split_to_fit`), each with the first column (the row's name) and as many of the others as
    fit. The first column and those in ``left`` are left-aligned, the others (figures) right-aligned."""
    label = columns[0]
    where = {column: k for k, column in enumerate(columns)}

    def build(shown: Sequence[str], caption: str) -> Table:
        t = Table(title=caption or None)
        for column in (label, *shown):
            t.add_column(column, justify="left" if column == label or column in left else "right", no_wrap=True)
        picks = [0, *(where[column] for column in shown)]
        for row in rows:
            t.add_row(*(row[k] for k in picks))
        return t

    if width is None:
        return [build(columns[1:], title)]
    return split_to_fit(build, columns[1:], title, width)


# ------------------------------------------------------------------------------------------------ path


def path_summary(graph: TopologyGraph, src: str, dst: str) -> dict[str, Any]:
    """JSON-ready widest path between instances ``src`` and ``dst`` with each link's capacity (bytes/s)."""
    p = graph.path(src, dst)
    return {
        "src": src,
        "dst": dst,
        "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s,
        "same_domain": p.same_domain,
        "bottleneck_link": p.bottleneck_link,
        "links": [{"link": link, "capacity_bytes_per_s": graph.link_capacity_bytes_per_s(link)} for link in p.links],
    }


def _cmd_path(args: argparse.Namespace) -> int:
    topo = _load(args.topology, "path")
    if topo is None:
        return 2
    graph = TopologyGraph(topo)
    try:
        summary = path_summary(graph, args.src, args.dst)
    except (KeyError, ValueError) as exc:
        print(f"hilum topology path: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    bw = summary["bandwidth_bytes_per_s"]
    where = "same NVLink domain" if summary["same_domain"] else "across domains"
    rows = []
    for link in summary["links"]:  # in the path's order
        cap = link["capacity_bytes_per_s"]
        rows.append([link["link"], f"{_gbyte(cap)} ({_gbit(cap)})", "yes" if cap == bw else ""])
    width = _terminal_width()
    tables = _fitted("", ("link", "capacity", "bottleneck"), rows, width, left=("bottleneck",))
    con = _console(width, tables)
    con.print(
        f"{args.src} -> {args.dst} ({where}): {_gbyte(bw)} = {_gbit(bw)}, bottleneck {summary['bottleneck_link']}"
    )
    for table in tables:
        con.print(table)
    return 0


def _count(n: int, noun: str) -> str:
    """``1 rack``, ``2 racks``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
