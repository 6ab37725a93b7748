"""Wiring the coordinator to the topology and the cost model.

The judge prices a move with ``topology.cost.plan_migration`` at the bandwidth the move would get now
(the path's raw bandwidth, the migration cap and the flows already on its busiest link) and decides with
``global_coord.approval.judge_move`` (DESIGN.md, "Cost model"), through
:func:`global_coord.approval.price_and_judge`, which the simulator calls too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from global_coord.approval import ApprovalConfig, price_and_judge
from global_coord.approver import Judgement, MoveJudge, MoveProposal, PathLike, PathOf
from topology.cost import CostConfig, prefix_kv_blocks
from topology.graph import TopologyGraph
from topology.load import load_topology
from topology.spec import Topology

if TYPE_CHECKING:  # the coordinator's service module (etcd, gRPC) is not needed to build the cost model
    from global_coord.coordinator import TopologyLike

__all__ = ["ClusterModel", "CostModelJudge", "load_cluster_model"]


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

    def __init__(
        self, topo: Topology, cost_cfg: CostConfig | None = None, approval_cfg: ApprovalConfig | None = None
    ) -> None:
        self._topo = topo
        self._cost_cfg = cost_cfg if cost_cfg is not None else CostConfig()
        self._approval_cfg = approval_cfg if approval_cfg is not None else ApprovalConfig()

    def __call__(
        self,
        move: MoveProposal,
        dst_instance_id: str,
        path: PathLike,
        busiest_link_flows: int,
        measured_bandwidth_bytes_per_s: float | None = None,
        dst_prefix_hash_blocks: int = 0,
        dst_prefill_s_per_token: float = 0.0,
    ) -> Judgement:
        """Price and judge (with the measured rate of the path when given); a move between instances serving
        different models is never approved. The prefix blocks the destination holds
        (``dst_prefix_hash_blocks`` of the move's hash blocks) are priced as not copied; when the destination's
        report offers a prefill estimate (``dst_prefill_s_per_token`` > 0), re-prefilling the rest of the prefix
        there is priced too (their tokens x that rate), and the plan that completes first is judged (the one the
        source's llumlet carries out, priced with the destination's own estimate at the move)."""
        src_model = self._topo.model_of(move.src_instance_id)
        dst_model = self._topo.model_of(dst_instance_id)
        if src_model.name != dst_model.name:
            return Judgement(False, f"model mismatch: {src_model.name} on the source, {dst_model.name} here")
        prefix = _prefix_blocks(move, src_model.block_size_tokens, dst_prefix_hash_blocks)
        missing_tokens = (prefix.get("prefix_blocks", 0) - prefix.get("prefix_blocks_on_dst", 0)) * (
            src_model.block_size_tokens
        )
        reprefill_s = missing_tokens * dst_prefill_s_per_token if missing_tokens and dst_prefill_s_per_token else None
        verdict, plan = price_and_judge(
            src_model,
            kv_tokens=move.num_tokens,
            remaining_tokens=move.remaining_tokens,
            decode_step_s=move.decode_step_s,
            path_bandwidth_bytes_per_s=path.bandwidth_bytes_per_s,
            busiest_link_flows=busiest_link_flows,
            cost=self._cost_cfg,
            cfg=self._approval_cfg,
            measured_bandwidth_bytes_per_s=measured_bandwidth_bytes_per_s,
            prefix_reprefill_s=reprefill_s,
            **prefix,
        )
        return Judgement(verdict.approved, verdict.reason, float(plan.transfer_s), float(plan.downtime_s))


def _prefix_blocks(move: MoveProposal, block_size_tokens: int, dst_hash_blocks: int) -> dict[str, int]:
    """``prefix_blocks`` (the move's full prefix blocks) and ``prefix_blocks_on_dst`` (those the destination
    holds) of the cost model's input, in KV blocks; none when the move's hash blocks are not whole KV blocks."""
    if not move.prefix_hashes or move.prefix_block_tokens % block_size_tokens:
        return {}
    h, bs, n = move.prefix_block_tokens, block_size_tokens, move.num_tokens
    prefix = prefix_kv_blocks(len(move.prefix_hashes), h, n, bs)
    return {"prefix_blocks": prefix, "prefix_blocks_on_dst": min(prefix_kv_blocks(dst_hash_blocks, h, n, bs), prefix)}


def load_cluster_model(
    path: str | Path, cost_cfg: CostConfig | None = None, approval_cfg: ApprovalConfig | None = None
) -> ClusterModel:
    """Load a topology file (or bundled name) and build paths and the cost-model judge over it.

    ``cost_cfg`` / ``approval_cfg``: the configuration file's ``cost`` and ``approval`` (None: defaults).

    Raises:
        topology.load.TopologyError: on an invalid topology file.
    """
    topo = load_topology(path)
    paths = TopologyGraph(topo)
    return ClusterModel(topology=topo, path_of=paths.path, judge=CostModelJudge(topo, cost_cfg, approval_cfg))
