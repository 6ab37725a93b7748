"""Wiring the coordinator to the topology and the cost model (the integration seam).

INTEGRATION POINT: ``topology/`` (load, graph, cost) and ``global_coord.approval`` are written in
parallel; this module reaches them through ``importlib`` so the control plane builds without them.
Once they are merged, replace the two ``importlib`` look-ups with plain imports and ``_judge`` with::

    plan = plan_migration(MigrationCostInput(...move.blocks, move.num_tokens, move.decode_step_s,
                                            path.bandwidth_bytes_per_s, busiest_link_flows...), cost_cfg)
    v = judge_move(plan, remaining_tokens=move.remaining_tokens, decode_step_s=move.decode_step_s,
                   busiest_link_flows=busiest_link_flows, cfg=approval_cfg)
    return Judgement(v.approved, v.reason, plan.transfer_s, plan.downtime_s)

Until then every proposal is rejected with a reason that says the cost model is not wired: the
coordinator never approves a move it has not priced.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from global_coord.approver import Judgement, MoveJudge, MoveProposal, PathLike, PathOf
from global_coord.convert import TopologyLike

__all__ = ["ClusterModel", "load_cluster_model"]


@dataclass(frozen=True, slots=True)
class ClusterModel:
    """What the coordinator needs from the topology file."""

    topology: TopologyLike
    path_of: PathOf
    judge: MoveJudge


def _judge(move: MoveProposal, dst_instance_id: str, path: PathLike, busiest_link_flows: int) -> Judgement:
    return Judgement(False, "cost model not wired into the coordinator yet (global_coord/wiring.py)")


def load_cluster_model(path: str | Path) -> ClusterModel:
    """Load a topology file (or bundled name) and build paths and the judge over it.

    Raises:
        topology.load.TopologyError: on an invalid topology file.
        RuntimeError: when the topology package is not installed.
    """
    try:
        load = importlib.import_module("topology.load")
        graph = importlib.import_module("topology.graph")
    except ImportError as exc:
        raise RuntimeError(f"the topology package is not available: {exc}") from exc
    topo = load.load_topology(path)
    paths = graph.TopologyGraph(topo)
    return ClusterModel(topology=topo, path_of=paths.path, judge=_judge)
