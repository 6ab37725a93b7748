"""Widest paths: hand-checked pairs, oversubscribed uplinks, and the tree answer against a brute force."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import networkx as nx
import pytest

from topology.graph import TopologyGraph
from topology.load import load_topology, parse_topology
from topology.synthetic import synthetic_topology_data


def brute_force_widest(graph: nx.Graph, src: str, dst: str) -> float:
    """Largest capacity c such that src and dst are connected using only edges of capacity >= c."""
    caps = sorted({float(d["capacity"]) for _, _, d in graph.edges(data=True)}, reverse=True)
    for cap in caps:  # widest first: the first that connects is the answer
        view = nx.subgraph_view(graph, filter_edge=lambda u, v, c=cap: graph[u][v]["capacity"] >= c)
        if nx.has_path(view, src, dst):
            return cap
    return 0.0


def test_2x8_same_domain_is_nvlink() -> None:
    g = TopologyGraph(load_topology("2x8-a100"))
    p = g.path("node-0-i0", "node-0-i5")
    assert p.bandwidth_bytes_per_s == 600e9
    assert p.links == ("nvlink:node-0-i0", "nvlink:node-0-i5")
    assert p.same_domain


def test_2x8_cross_node_same_rack_is_the_nic() -> None:
    g = TopologyGraph(load_topology("2x8-a100"))
    p = g.path("node-0-i0", "node-1-i3")
    assert p.bandwidth_bytes_per_s == 25e9  # 200 Gb/s
    assert p.links == ("nvlink:node-0-i0", "nic:node-0", "nic:node-1", "nvlink:node-1-i3")
    assert not p.same_domain
    assert p.bottleneck_link == "nic:node-0"
    assert g.link_capacity_bytes_per_s("nic:node-1") == 25e9
    assert g.link_capacity_bytes_per_s("nvlink:node-1-i3") == 600e9


def test_64x8_cross_rack_and_tensor_parallel_nvlink() -> None:
    g = TopologyGraph(load_topology("64x8-h100"))
    p = g.path("node-00-i0", "node-63-i0")
    # min(NIC 400 Gb/s = 50 GB/s, rack uplink 8 x 400 / 4 = 800 Gb/s = 100 GB/s)
    assert p.bandwidth_bytes_per_s == 50e9
    assert p.links == (
        "nvlink:node-00-i0",
        "nic:node-00",
        "uplink:rack-0",
        "uplink:rack-7",
        "nic:node-63",
        "nvlink:node-63-i0",
    )
    # TP2 Llama-2-13B pair in one node: each of the 2 ranks moves its shard over its own NVLink (2 x 900 GB/s)
    assert g.path("node-32-i0", "node-32-i1").bandwidth_bytes_per_s == 1800e9
    assert g.link_capacity_bytes_per_s("uplink:rack-3") == 100e9


def oversubscribed(uplink: float | None) -> dict[str, Any]:
    data = synthetic_topology_data(4, gpus_per_node=2, nodes_per_rack=2, nic_gbit_per_s=200, oversubscription=16)
    if uplink is not None:
        data["fabric"]["racks"][1]["uplink_gbit_per_s"] = uplink
    return data


def test_cross_rack_is_limited_by_an_oversubscribed_uplink() -> None:
    g = TopologyGraph(parse_topology(oversubscribed(None), "o.yaml"))
    # rack uplink = 2 x 200 Gb/s / 16 = 25 Gb/s = 3.125 GB/s < NIC 25 GB/s
    p = g.path("node-0-i0", "node-3-i1")
    assert p.bandwidth_bytes_per_s == 3.125e9
    assert p.bottleneck_link == "uplink:rack-0"
    assert g.path("node-0-i0", "node-1-i1").bandwidth_bytes_per_s == 25e9  # same rack: the NIC
    # a given uplink replaces the derived one: min(rack-0 derived 25 Gb/s, rack-1 given 10 Gb/s)
    g2 = TopologyGraph(parse_topology(oversubscribed(10), "o.yaml"))
    p2 = g2.path("node-0-i0", "node-3-i1")
    assert p2.bandwidth_bytes_per_s == 1.25e9
    assert p2.bottleneck_link == "uplink:rack-1"


def test_nvl72_island_paths_leave_through_the_instances_own_tray() -> None:
    g = TopologyGraph(load_topology("nvl72-gb200"))
    same = g.path("nvl72-0-i0", "nvl72-0-i9")
    assert same.same_domain and same.bandwidth_bytes_per_s == 1800e9  # min(8 x 1800, 1 x 1800) GB/s
    cross = g.path("nvl72-0-i3", "nvl72-1-i5")  # GPUs 24-31 (tray 6) -> GPUs 40-47 (tray 10)
    assert cross.bandwidth_bytes_per_s == 50e9
    assert cross.links == (
        "nvlink:nvl72-0-i3",
        "nic:nvl72-0-tray06",
        "uplink:rack-0",
        "uplink:rack-1",
        "nic:nvl72-1-tray10",
        "nvlink:nvl72-1-i5",
    )


@pytest.mark.parametrize("name", ["2x8-a100", "64x8-h100", "nvl72-gb200"])
def test_tree_answer_equals_brute_force_widest_path(name: str) -> None:
    topo = load_topology(name)
    g = TopologyGraph(topo)
    ids = [i.instance_id for i in topo.instances]
    rng = random.Random(7)
    for _ in range(40):
        a, b = rng.sample(ids, 2)
        p = g.path(a, b)
        assert p.bandwidth_bytes_per_s == brute_force_widest(g.graph, f"instance:{a}", f"instance:{b}")
        assert p.bandwidth_bytes_per_s == min(g.link_capacity_bytes_per_s(link) for link in p.links)


def test_tree_answer_equals_brute_force_on_random_capacities() -> None:
    """Random rack uplinks and NICs so that the widest path is not always the obvious one."""
    rng = random.Random(3)
    data = synthetic_topology_data(12, gpus_per_node=2, nodes_per_rack=3)
    for dom in data["domains"]:
        dom["nodes"][0]["nic_gbit_per_s"] = rng.choice([25, 100, 200, 400])
    for rack in data["fabric"]["racks"]:
        rack["uplink_gbit_per_s"] = rng.choice([50, 100, 800])
    topo = parse_topology(data, "r.yaml")
    g = TopologyGraph(topo)
    ids = [i.instance_id for i in topo.instances]
    for a in ids:
        for b in ids:
            if a != b:
                expected = brute_force_widest(g.graph, f"instance:{a}", f"instance:{b}")
                assert g.path(a, b).bandwidth_bytes_per_s == expected


def test_4096_gpu_fabric_builds_and_answers_quickly() -> None:
    topo = parse_topology(synthetic_topology_data(512), "s.yaml")
    g = TopologyGraph(topo)
    assert topo.num_gpus == 4096 and len(g.tree.nodes) == g.graph.number_of_nodes()
    assert nx.is_tree(g.tree)
    p = g.path("node-000-i0", "node-511-i7")
    assert p.bandwidth_bytes_per_s == 50e9 and len(p.links) == 6
    assert g.path("node-000-i0", "node-511-i7") is p  # cached


def test_bad_queries() -> None:
    g = TopologyGraph(load_topology("2x8-a100"))
    with pytest.raises(KeyError, match="no instance 'x'"):
        g.path("node-0-i0", "x")
    with pytest.raises(ValueError, match="same instance"):
        g.path("node-0-i0", "node-0-i0")
    with pytest.raises(KeyError, match="no instance 'x'"):  # unknown first, even as its own destination
        g.path("x", "x")
    with pytest.raises(KeyError, match="unknown link 'nic:x'"):
        g.link_capacity_bytes_per_s("nic:x")
    assert math.isinf(g.link_capacity_bytes_per_s("host:node-0"))


@pytest.mark.parametrize("first", ["path", "link_capacity", "link_ids", "graph", "tree"])
def test_a_lazy_graph_builds_at_its_first_use_and_answers_as_an_eager_one(first: str) -> None:
    topo = load_topology("2x8-a100")
    eager, lazy = TopologyGraph(topo), TopologyGraph(topo, lazy=True)
    assert lazy._graph is None  # nothing built yet
    uses: dict[str, Callable[[TopologyGraph], object]] = {
        "path": lambda g: g.path("node-0-i0", "node-1-i3"),
        "link_capacity": lambda g: g.link_capacity_bytes_per_s("nic:node-1"),
        "link_ids": lambda g: g.link_ids,
        "graph": lambda g: sorted(g.graph.edges),
        "tree": lambda g: sorted(g.tree.edges),
    }
    assert uses[first](lazy) == uses[first](eager)
    assert lazy._graph is not None
    for use in uses.values():  # every other query answers as the eager graph's, from the one build
        assert use(lazy) == use(eager)
    with pytest.raises(KeyError, match="nope"):
        TopologyGraph(topo, lazy=True).path("nope", "node-0-i0")
