"""Cross-domain migration approval: the coordinator's rule, pure and clock-free.

The global coordinator and the simulator both call :func:`judge_move`; it never does I/O. A move
between two NVLink domains is approved only when (DESIGN.md, "Cost model"):

1. the pre-copy converges on the path at the rate the move would get (cost model, ``plan.converges``): the
   topology's bandwidth under the migration cap and the flows already on the path, or what moves on that path
   and transport were measured to achieve when that is lower (``topology.bandwidth``);
2. its expected downtime fits the TBT budget (``downtime_budget_s``, by default half of a 50 ms TBT SLO);
3. the link budget has room: no link on the path would carry more than ``max_flows_per_link``
   concurrent migrations (so the migration cap is never exceeded by piling flows on a shared link);
4. the benefit exceeds the cost. The benefit of a move accrues only while the request keeps running
   on the destination, so it is priced as the request's expected remaining decode time
   (``remaining_tokens x decode_step_s``); the cost is the transfer time on the network. The move must
   satisfy ``remaining_s >= min_benefit_ratio x transfer_s``: a request that would finish before the
   copy pays off is not worth the cross-domain bytes.

The imbalance itself (that the move lowers the potential Σ V_i²) is checked by ``policy`` before a move
is proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from topology.cost import CostConfig, MigrationCostInput, MigrationPlan, plan_migration
from topology.spec import ModelSpec

__all__ = ["ApprovalConfig", "Verdict", "judge_move", "price_and_judge"]


@dataclass(frozen=True, slots=True)
class ApprovalConfig:
    """Thresholds of the cross-domain approval rule."""

    downtime_budget_s: float = 0.025  # max expected downtime of one move, seconds
    min_benefit_ratio: float = 2.0  # remaining decode time must be >= this x transfer time
    max_flows_per_link: int = 2  # concurrent cross-domain migrations per link

    def __post_init__(self) -> None:
        if self.downtime_budget_s <= 0:
            raise ValueError(f"downtime_budget_s must be > 0, got {self.downtime_budget_s}")
        if self.min_benefit_ratio < 0:
            raise ValueError(f"min_benefit_ratio must be >= 0, got {self.min_benefit_ratio}")
        if self.max_flows_per_link < 1:
            raise ValueError(f"max_flows_per_link must be >= 1, got {self.max_flows_per_link}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of :func:`judge_move`: ``approved`` and, either way, the reason in words."""

    approved: bool
    reason: str


def judge_move(
    plan: MigrationPlan,
    *,
    remaining_tokens: int,
    decode_step_s: float,
    busiest_link_flows: int,
    cfg: ApprovalConfig,
) -> Verdict:
    """Judge one proposed cross-domain move.

    Args:
        plan: the cost model's plan for the move at the bandwidth it would get now.
        remaining_tokens: output tokens the request still has to produce (>= 0).
        decode_step_s: the source's current decode step time, seconds (> 0).
        busiest_link_flows: migrations already using the most loaded link of the path.
        cfg: thresholds.

    Returns:
        A Verdict; rejections name the rule that failed and the figures.

    Raises:
        ValueError: on a negative token count or a non-positive step time.
    """
    if remaining_tokens < 0:
        raise ValueError(f"remaining_tokens must be >= 0, got {remaining_tokens}")
    if decode_step_s <= 0:
        raise ValueError(f"decode_step_s must be > 0, got {decode_step_s}")
    if busiest_link_flows >= cfg.max_flows_per_link:
        return Verdict(False, f"link budget full: {busiest_link_flows} migrations on the busiest link")
    rate = f"{plan.effective_bandwidth_bytes_per_s / 1e6:.1f} MB/s ({plan.bandwidth_source})"
    if not plan.converges:
        return Verdict(False, f"pre-copy does not converge: KV grows faster than the path carries it at {rate}")
    if plan.downtime_s > cfg.downtime_budget_s:
        return Verdict(
            False,
            f"downtime {plan.downtime_s * 1e3:.1f} ms exceeds the budget of {cfg.downtime_budget_s * 1e3:.1f} ms "
            f"at {rate}",
        )
    remaining_s = remaining_tokens * decode_step_s
    if remaining_s < cfg.min_benefit_ratio * plan.transfer_s:
        return Verdict(
            False,
            f"not worth it: {remaining_s:.3f} s of decoding left < {cfg.min_benefit_ratio:g} x "
            f"{plan.transfer_s:.3f} s of transfer at {rate}",
        )
    return Verdict(
        True,
        f"approved: {plan.transfer_s * 1e3:.1f} ms transfer, {plan.downtime_s * 1e3:.2f} ms downtime at {rate}",
    )


def price_and_judge(
    model: ModelSpec,
    *,
    kv_tokens: int,
    remaining_tokens: int,
    decode_step_s: float,
    path_bandwidth_bytes_per_s: float,
    busiest_link_flows: int,
    cost: CostConfig,
    cfg: ApprovalConfig,
    measured_bandwidth_bytes_per_s: float | None = None,
    prefix_blocks: int = 0,
    prefix_blocks_on_dst: int = 0,
    prefix_reprefill_s: float | None = None,
) -> tuple[Verdict, MigrationPlan]:
    """Price a move with the cost model at the rate it would get now, then judge it.

    The one place the coordinator (``global_coord.wiring``) and the simulator (``sim.schedulers``) turn a
    proposed cross-domain move into a verdict, so both apply the same rule.

    Args:
        model: the model served on both ends (KV bytes per token, block size).
        kv_tokens: tokens in the request's KV cache now.
        remaining_tokens: output tokens it still has to produce.
        decode_step_s: the source's decode step time, seconds.
        path_bandwidth_bytes_per_s: the path's raw bottleneck bandwidth (``PathInfo.bandwidth_bytes_per_s``).
        busiest_link_flows: migrations already on the busiest link of the path.
        cost: the cost model's configuration (migration cap, stages, overheads).
        cfg: the approval thresholds.
        measured_bandwidth_bytes_per_s: what moves on this path and transport achieved
            (``topology.bandwidth``), None while unmeasured; the cost model prices with the lower of it and
            the topology's share.
        prefix_blocks: full KV blocks at the start of its KV holding its prompt's prefix hash blocks.
        prefix_blocks_on_dst: of those, the ones the destination's prefix cache holds: not copied.
        prefix_reprefill_s: the destination's estimate of re-prefilling the others, seconds (None: it offers
            none): the cost model then also prices recomputing them there and takes the plan that completes first.

    Returns:
        (verdict, plan).

    Raises:
        ValueError: on invalid inputs (see ``MigrationCostInput`` and :func:`judge_move`).
    """
    plan = plan_migration(
        MigrationCostInput(
            kv_tokens=kv_tokens,
            kv_bytes_per_token=model.kv_bytes_per_token,
            block_size_tokens=model.block_size_tokens,
            decode_step_s=decode_step_s,
            path_bandwidth_bytes_per_s=path_bandwidth_bytes_per_s,
            existing_flows=busiest_link_flows,
            measured_bandwidth_bytes_per_s=measured_bandwidth_bytes_per_s,
            prefix_blocks=prefix_blocks,
            prefix_blocks_on_dst=prefix_blocks_on_dst,
            prefix_reprefill_s=prefix_reprefill_s,
        ),
        cost,
    )
    verdict = judge_move(
        plan,
        remaining_tokens=remaining_tokens,
        decode_step_s=decode_step_s,
        busiest_link_flows=busiest_link_flows,
        cfg=cfg,
    )
    return verdict, plan
