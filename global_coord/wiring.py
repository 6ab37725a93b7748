"""Wiring the coordinator to the topology and the cost model.

The judge prices a move with ``topology.cost.plan_migration`` at the bandwidth the move would get now
(the path's raw bandwidth, the migration cap and the flows already on its busiest link) and decides with
``global_coord.approval.judge_move`` (DESIGN.md, "Cost model").

INTEGRATION NOTE: ``topology.{load,graph,cost}`` and ``global_coord.approval`` are developed on other
branches; until they are merged with this one they are reached through ``importlib`` (typed ``Any``).
After the merge, replace :func:`_modules` with plain imports so mypy checks these calls too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from global_coord.approver import Judgement, MoveJudge, MoveProposal, PathLike, PathOf
from global_coord.convert import TopologyLike

__all__ = ["ClusterModel", "CostModelJudge", "load_cluster_model"]


def _modules() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    try:
        return (
            importlib.import_module("topology.load"),
            importlib.import_module("topology.graph"),
            importlib.import_module("topology.cost"),
            importlib.import_module("global_coord.approval"),
        )
    except ImportError as exc:
        raise RuntimeError(f"the topology / approval modules are not available: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ClusterModel:
    """What the coordinator needs from the topology file."""

    topology: TopologyLike
    path_of: PathOf
    judge: MoveJudge


class CostModelJudge:
    """Judge a move with the cost model and the approval rule.

    Args:
        topo: the ``topology.spec.Topology`` (for each instance's model and KV bytes per token).
        cost_cfg: ``topology.cost.CostConfig`` (None: its defaults, a 20% migration cap per link).
        approval_cfg: ``global_coord.approval.ApprovalConfig`` (None: its defaults).
    """

    def __init__(self, topo: Any, cost_cfg: Any = None, approval_cfg: Any = None) -> None:
        _, _, cost, approval = _modules()
        self._topo = topo
        self._cost = cost
        self._approval = approval
        self._cost_cfg = cost_cfg if cost_cfg is not None else cost.CostConfig()
        self._approval_cfg = approval_cfg if approval_cfg is not None else approval.ApprovalConfig()

    def __call__(
        self, move: MoveProposal, dst_instance_id: str, path: PathLike, busiest_link_flows: int
    ) -> Judgement:
        """Price and judge; a move between instances serving different models is never approved."""
        src_model = self._topo.model_of(move.src_instance_id)
        dst_model = self._topo.model_of(dst_instance_id)
        if src_model.name != dst_model.name:
            return Judgement(False, f"model mismatch: {src_model.name} on the source, {dst_model.name} here")
        plan = self._cost.plan_migration(
            self._cost.MigrationCostInput(
                kv_tokens=move.num_tokens,
                kv_bytes_per_token=src_model.kv_bytes_per_token,
                block_size_tokens=src_model.block_size_tokens,
                decode_step_s=move.decode_step_s,
                path_bandwidth_bytes_per_s=path.bandwidth_bytes_per_s,
                existing_flows=busiest_link_flows,
            ),
            self._cost_cfg,
        )
        verdict = self._approval.judge_move(
            plan,
            remaining_tokens=move.remaining_tokens,
            decode_step_s=move.decode_step_s,
            busiest_link_flows=busiest_link_flows,
            cfg=self._approval_cfg,
        )
        return Judgement(
            bool(verdict.approved), str(verdict.reason), float(plan.transfer_s), float(plan.downtime_s)
        )


def load_cluster_model(path: str | Path) -> ClusterModel:
    """Load a topology file (or bundled name) and build paths and the cost-model judge over it.

    Raises:
        topology.load.TopologyError: on an invalid topology file.
        RuntimeError: when the topology or approval modules are not installed.
    """
    load, graph, _, _ = _modules()
    topo = load.load_topology(path)
    paths = graph.TopologyGraph(topo)
    return ClusterModel(topology=topo, path_of=paths.path, judge=CostModelJudge(topo))
