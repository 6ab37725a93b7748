"""Topology file, topology graph and migration cost model (imports nothing else of hilum).

* :mod:`topology.spec` — value types (models, GPU types, NVLink domains, instances, racks, ``Topology``);
* :mod:`topology.load` — ``load_topology`` / ``parse_topology`` of the YAML file, ``TopologyError``;
* :mod:`topology.graph` — :class:`TopologyGraph`: widest-path bandwidth and links between two instances;
* :mod:`topology.cost` — :func:`plan_migration`: pre-copy stages, transfer time and downtime of a migration.

The names below are exported lazily (PEP 562): ``from topology import TopologyGraph`` imports
``topology.graph`` only then, so importing one submodule (``topology.spec``) imports no other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# exported name -> the submodule that defines it
_EXPORTS: dict[str, str] = {
    "BUNDLED_NAMES": "topology.load",
    "CostConfig": "topology.cost",
    "DomainSpec": "topology.spec",
    "FabricSpec": "topology.spec",
    "GpuType": "topology.spec",
    "InstanceSpec": "topology.spec",
    "MigrationCostInput": "topology.cost",
    "MigrationPlan": "topology.cost",
    "ModelSpec": "topology.spec",
    "NodeSpec": "topology.spec",
    "PathInfo": "topology.graph",
    "RackSpec": "topology.spec",
    "Topology": "topology.spec",
    "TopologyError": "topology.load",
    "TopologyGraph": "topology.graph",
    "bytes_per_link": "topology.cost",
    "effective_bandwidth_bytes_per_s": "topology.cost",
    "load_topology": "topology.load",
    "parse_topology": "topology.load",
    "plan_migration": "topology.cost",
}

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


def __getattr__(name: str) -> Any:
    """``name`` from the submodule that defines it, imported on first use (PEP 562); AttributeError for any other."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
