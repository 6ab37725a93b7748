"""Topology file, topology graph and migration cost model (imports nothing else of hilum).

* :mod:`topology.spec` — value types (models, GPU types, NVLink domains, instances, racks, ``Topology``);
* :mod:`topology.load` — ``load_topology`` / ``parse_topology`` of the YAML file, ``TopologyError``;
* :mod:`topology.graph` — :class:`TopologyGraph`: widest-path bandwidth and links between two instances;
* :mod:`topology.cost` — :func:`plan_migration`: pre-copy stages, transfer time and downtime of a migration.
"""

from __future__ import annotations

from topology.cost import (
    CostConfig,
    MigrationCostInput,
    MigrationPlan,
    bytes_per_link,
    effective_bandwidth_bytes_per_s,
    plan_migration,
)
from topology.graph import PathInfo, TopologyGraph
from topology.load import BUNDLED_NAMES, TopologyError, load_topology, parse_topology
from topology.spec import (
    DomainSpec,
    FabricSpec,
    GpuType,
    InstanceSpec,
    ModelSpec,
    NodeSpec,
    RackSpec,
    Topology,
)

__all__ = [
    "BUNDLED_NAMES",
    "CostConfig",
    "DomainSpec",
    "FabricSpec",
    "GpuType",
    "InstanceSpec",
    "MigrationCostInput",
    "MigrationPlan",
    "ModelSpec",
    "NodeSpec",
    "PathInfo",
    "RackSpec",
    "Topology",
    "TopologyError",
    "TopologyGraph",
    "bytes_per_link",
    "effective_bandwidth_bytes_per_s",
    "load_topology",
    "parse_topology",
    "plan_migration",
]
