"""The topology as a graph of instances (their GPUs), NVLink switches, nodes/NICs and network switches.

Vertices (``kind`` attribute): ``instance:<id>`` (the instance's GPUs), ``nvswitch:<domain>`` (the NVLink
switch fabric of a domain), ``node:<node>`` (a server or compute tray with its NIC), ``rack:<rack>`` (a rack
switch) and ``spine`` (only when there are several racks). Edges carry ``link`` (an id) and ``capacity``
(bytes/s, one direction):

=====================  ==============================  ==================================================
link id                between                         capacity
=====================  ==============================  ==================================================
``nvlink:<instance>``  instance — nvswitch             tp · NVLink bandwidth per GPU (each rank moves its
                                                       own KV shard over its own NVLink ports)
``host:<node>``        nvswitch — node                 unbounded: the GPU → NIC host path is not a
                                                       bottleneck in this model; never listed in a path
``nic:<node>``         node — rack                     the node's NIC bandwidth
``uplink:<rack>``      rack — spine                    given, or Σ NIC in the rack / oversubscription
=====================  ==============================  ==================================================

:meth:`TopologyGraph.path` returns the *widest path* (the path whose narrowest link is widest) between two
instances. Every path of a maximum spanning tree is a widest path of the graph (Hu, "The maximum capacity
route problem", Operations Research 9(6), 1961), so the tree is built once with networkx and each query
walks it to the lowest common ancestor: O(tree depth) per query, cached per instance pair.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from topology.spec import Topology

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["PathInfo", "TopologyGraph"]


@dataclass(frozen=True, slots=True)
class PathInfo:
    """A widest path between two instances.

    ``bandwidth_bytes_per_s``: the narrowest link's capacity (raw, before any migration cap or sharing);
    ``links``: link ids from source to destination (``host:*`` links omitted); ``same_domain``: both
    instances in one NVLink domain (the path is NVLink only); ``bottleneck_link``: the id of the narrowest
    link (the first one on the path when several tie).
    """

    bandwidth_bytes_per_s: float
    links: tuple[str, ...]
    same_domain: bool
    bottleneck_link: str = ""


def _instance_vertex(instance_id: str) -> str:
    return f"instance:{instance_id}"


class TopologyGraph:
    """Graph and widest-path queries over a :class:`Topology`.

    Build cost: importing networkx, then one maximum spanning tree (Kruskal), O(E log E). ``path``
    answers from the tree; ``cache_max_entries`` bounds the per-pair answer cache (cleared when full).
    ``lazy``: build on the first query (or read of :attr:`graph`, :attr:`tree`) instead of here; the simulator
    does, since a run with no cross-domain move asks for no path. Building cannot fail for a topology that loaded.
    """

    def __init__(self, topo: Topology, *, cache_max_entries: int = 1_000_000, lazy: bool = False) -> None:
        self.topology = topo
        self._graph: nx.Graph | None = None  # with the tree and the index below, made by _build
        self._cache: dict[tuple[str, str], PathInfo] = {}
        self._cache_max = cache_max_entries
        if not lazy:
            self._build()

    def _build(self) -> None:
        """The graph, its maximum spanning tree, the link capacities and the tree's index."""
        import networkx as nx  # here, not at the top: importing PathInfo (the cost model does) needs no graph

        graph = _build_graph(self.topology)
        self._tree: nx.Graph = nx.maximum_spanning_tree(graph, weight="capacity", algorithm="kruskal")
        self._capacity: dict[str, float] = {
            str(data["link"]): float(data["capacity"]) for _, _, data in graph.edges(data=True)
        }
        self._index_tree()
        self._graph = graph

    def _ensure_built(self) -> None:
        """Build the graph now if it was not yet (a lazy graph's first query)."""
        if self._graph is None:
            self._build()

    @property
    def graph(self) -> nx.Graph:
        """The whole graph (module docstring)."""
        self._ensure_built()
        assert self._graph is not None
        return self._graph

    @property
    def tree(self) -> nx.Graph:
        """A maximum spanning tree of :attr:`graph` by link capacity (its paths are widest paths)."""
        self._ensure_built()
        return self._tree

    # ------------------------------------------------------------------------------------------ queries

    def link_capacity_bytes_per_s(self, link_id: str) -> float:
        """Capacity (bytes/s) of ``link_id``; KeyError naming the link if there is none."""
        self._ensure_built()
        try:
            return self._capacity[link_id]
        except KeyError:
            raise KeyError(f"unknown link {link_id!r} in topology {self.topology.name!r}") from None

    @property
    def link_ids(self) -> tuple[str, ...]:
        """Every link id of the graph (including the unbounded ``host:*`` links)."""
        self._ensure_built()
        return tuple(self._capacity)

    def path(self, src_instance_id: str, dst_instance_id: str) -> PathInfo:
        """Widest path from ``src_instance_id`` to ``dst_instance_id``.

        Raises KeyError for an unknown instance and ValueError if the two are the same instance or are not
        connected (cannot happen for a topology that loaded: several domains need racks).
        """
        key = (src_instance_id, dst_instance_id)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        info = self._compute_path(src_instance_id, dst_instance_id)
        if len(self._cache) >= self._cache_max:
            self._cache.clear()
        self._cache[key] = info
        return info

    # ------------------------------------------------------------------------------------------ internals

    def _index_tree(self) -> None:
        """Root every tree component; store parent, depth, the edge to the parent (link id, capacity)."""
        names = list(self._tree.nodes)
        self._vid: dict[str, int] = {name: i for i, name in enumerate(names)}
        n = len(names)
        self._names = names
        self._parent = [-1] * n
        self._depth = [0] * n
        self._up_link = [""] * n
        self._up_cap = [math.inf] * n
        self._component = [-1] * n
        adj = self._tree.adj
        for comp, root in enumerate(v for v in names if self._component[self._vid[v]] < 0):
            if self._component[self._vid[root]] >= 0:
                continue
            self._component[self._vid[root]] = comp
            queue = deque([root])
            while queue:
                u = queue.popleft()
                ui = self._vid[u]
                for w, data in adj[u].items():
                    wi = self._vid[w]
                    if self._component[wi] >= 0:
                        continue
                    self._component[wi] = comp
                    self._parent[wi] = ui
                    self._depth[wi] = self._depth[ui] + 1
                    self._up_link[wi] = str(data["link"])
                    self._up_cap[wi] = float(data["capacity"])
                    queue.append(w)

    def _vertex(self, instance_id: str) -> int:
        self.topology.instance(instance_id)  # KeyError with the file name if unknown
        return self._vid[_instance_vertex(instance_id)]

    def _compute_path(self, src_id: str, dst_id: str) -> PathInfo:
        self._ensure_built()
        a, b = self._vertex(src_id), self._vertex(dst_id)  # an unknown instance is named first (KeyError)
        if src_id == dst_id:
            raise ValueError(f"source and destination are the same instance {src_id!r}")
        if self._component[a] != self._component[b]:
            raise ValueError(f"no network path between instances {src_id!r} and {dst_id!r}")
        up_a: list[int] = []
        up_b: list[int] = []
        depth, parent = self._depth, self._parent
        while depth[a] > depth[b]:
            up_a.append(a)
            a = parent[a]
        while depth[b] > depth[a]:
            up_b.append(b)
            b = parent[b]
        while a != b:
            up_a.append(a)
            up_b.append(b)
            a, b = parent[a], parent[b]
        hops = [(self._up_link[v], self._up_cap[v]) for v in up_a]
        hops += [(self._up_link[v], self._up_cap[v]) for v in reversed(up_b)]
        src, dst = self.topology.instance(src_id), self.topology.instance(dst_id)
        hops = self._own_nic(hops, src.node_id, first=True)
        hops = self._own_nic(hops, dst.node_id, first=False)
        links = tuple(link for link, cap in hops if cap != math.inf)
        bottleneck_link, bandwidth = min(hops, key=lambda h: h[1])
        return PathInfo(
            bandwidth_bytes_per_s=bandwidth,
            links=links,
            same_domain=src.domain_id == dst.domain_id,
            bottleneck_link=bottleneck_link,
        )

    def _own_nic(self, hops: list[tuple[str, float]], node_id: str, *, first: bool) -> list[tuple[str, float]]:
        """Leave a multi-node NVLink island through the instance's own node's NIC.

        The tree keeps one NIC per island and rack (all of them close a cycle through the NVLink switch), so
        a tree path may leave through another node's NIC. When the instance's own NIC reaches the same
        rack at no less capacity the bandwidth is the same and the own NIC is the physical route.
        """
        nics = [i for i, (link, _) in enumerate(hops) if link.startswith("nic:")]
        if not nics:
            return hops
        i = nics[0] if first else nics[-1]
        link, cap = hops[i]
        own = f"nic:{node_id}"
        if link == own:
            return hops
        rack_now = self.topology.rack_of(link.removeprefix("nic:"))
        own_cap = self._capacity[own]
        if self.topology.rack_of(node_id) != rack_now or own_cap < cap:
            return hops
        out = list(hops)
        out[i] = (own, own_cap)
        return out


def _build_graph(topo: Topology) -> nx.Graph:
    """The networkx graph described in the module docstring."""
    import networkx as nx

    g = nx.Graph(name=topo.name)
    multi_rack = len(topo.fabric.racks) > 1
    if multi_rack:
        g.add_node("spine", kind="spine")
    for rack in topo.fabric.racks:
        g.add_node(f"rack:{rack.rack_id}", kind="rack")
        if multi_rack:
            g.add_edge(
                f"rack:{rack.rack_id}",
                "spine",
                link=f"uplink:{rack.rack_id}",
                capacity=rack.uplink_bandwidth_bytes_per_s,
            )
    for dom in topo.domains:
        switch = f"nvswitch:{dom.domain_id}"
        g.add_node(switch, kind="nvswitch", domain=dom.domain_id)
        nvlink = topo.gpu_types[dom.gpu_type].nvlink_bandwidth_bytes_per_s
        for node in dom.nodes:
            vertex = f"node:{node.node_id}"
            g.add_node(vertex, kind="node", domain=dom.domain_id)
            g.add_edge(switch, vertex, link=f"host:{node.node_id}", capacity=math.inf)
            rack_id = topo.rack_of(node.node_id)
            if rack_id is not None:
                g.add_edge(
                    vertex,
                    f"rack:{rack_id}",
                    link=f"nic:{node.node_id}",
                    capacity=node.nic_bandwidth_bytes_per_s,
                )
        for inst in dom.instances:
            vertex = _instance_vertex(inst.instance_id)
            g.add_node(vertex, kind="instance", domain=dom.domain_id, gpus=inst.gpus)
            g.add_edge(
                vertex,
                switch,
                link=f"nvlink:{inst.instance_id}",
                capacity=inst.tensor_parallel_size * nvlink,
            )
    return g
