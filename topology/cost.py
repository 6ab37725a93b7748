"""Migration cost model: what it takes to move one running request's KV cache to another instance.

Multi-stage pre-copy after Llumnix (Sun et al., OSDI '24, §4.2 "Live migration"): stage 0 copies every
*full* KV cache block while the request keeps decoding on the source; each further stage copies the blocks
that filled up meanwhile (one new token per decode step); when the remainder is small (or after a maximum
number of stages) the source suspends the request and the last stage copies the rest, including the partial
last block. The downtime is the last stage only.

Formulas (units: bytes, seconds, bytes/s; ``Bt`` = KV bytes per token, ``bs`` = block size in tokens,
``Bb = Bt·bs`` bytes per block, ``d`` = decode step time, ``n0`` = tokens at the start):

* effective bandwidth ``B = path_bottleneck · cap_fraction / (existing_flows + 1)``: a migration may use at
  most ``cap_fraction`` of a link and shares it fairly with the flows already on the bottleneck link; once
  moves on that path and transport were measured (``measured_bandwidth_bytes_per_s``, the estimate of
  :mod:`topology.bandwidth`), ``B = min(that, measured)``: a move never goes faster than what moves on the
  path achieved, nor than the cap allows;
* fixed control-plane times (:class:`CostConfig`, calibrated from measured moves, docs/cost-model.md):
  ``setup_overhead_s`` before stage 0 (the request decodes meanwhile), ``stage_overhead_s`` added to every
  live stage that sends blocks, ``suspend_resume_overhead_s`` added to the downtime;
* tokens at time ``T`` after the start: ``n(T) = n0 + ⌊T / d⌋``; stage 0, at ``T = setup_overhead_s``,
  copies ``⌊n(T)/bs⌋`` blocks (minus the prefix blocks already on the destination), taking
  ``blocks·Bb / B + stage_overhead_s``;
* after each live stage the remainder is ``⌈n(T)/bs⌉ − blocks copied so far``; a further live stage copies
  the newly full blocks ``⌊n(T)/bs⌋ − copied``; the loop stops when the remainder ``≤ stop_remaining_blocks``,
  after ``max_stages`` live stages, or when no block filled meanwhile. This stop rule is
  :class:`PrecopyRule`, the one the simulator's migration executor and the llumlets run too;
* downtime ``= remainder·Bb / B + suspend_resume_overhead_s``;
* convergence (closed form): pre-copy shrinks the remainder only if the request produces KV more slowly than
  the path carries it, ``Bt / d < B``. Otherwise the plan is a blocking stop-and-copy of everything that
  must move: downtime ``= blocks·Bb / B + overhead``, ``converges=False``;
* ``transfer_s`` = Σ stage times (what the approval weighs against the benefit); ``completion_s`` =
  ``setup_overhead_s`` + the stages + ``suspend_resume_overhead_s``.

Since ``Bt/d < B`` means a stage of ``k`` blocks lasts less than ``k·bs`` decode steps, the remainder never
grows from stage to stage, so a converging plan's downtime is at most the blocking downtime.

Shared prefix: prefix blocks already present on the destination (matched by block hash) are never copied.
When the caller gives the time to re-prefill the missing prefix on the destination, a second plan is priced:
copy only the non-prefix blocks while the destination recomputes the prefix in parallel; the request resumes
when both are done. That plan wins when it completes first (then: the lower downtime) and its downtime is no
longer than the copy's: a re-prefill that outlasts the copy would keep the suspended request waiting, and the
downtime a move was approved for (``approval.downtime_budget_s``, judged on this same plan) must hold.

Arithmetic is exact (``fractions.Fraction`` of the decimal values given), so hand-computed cases are
reproduced exactly, including block boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Literal

from topology.graph import PathInfo

__all__ = [
    "DEFAULT_DECODE_STEP_S",
    "BandwidthSource",
    "CostConfig",
    "MigrationCostInput",
    "MigrationPlan",
    "PlanMode",
    "PrecopyRule",
    "bytes_per_link",
    "effective_bandwidth_bytes_per_s",
    "plan_migration",
    "prefix_kv_blocks",
]

PlanMode = Literal["pre-copy", "pre-copy+recompute-prefix", "blocking"]

#: Decode step time a move is priced with while its source has not stepped yet, seconds (``DomainConfig``'s
#: default); the simulator's executor and a llumlet's source both use it.
DEFAULT_DECODE_STEP_S = 0.03
BandwidthSource = Literal["topology", "measured"]


def _exact(x: float | int) -> Fraction:
    """The decimal value the caller wrote: ``Fraction(repr(0.02)) == 1/50`` (not the binary float)."""
    return Fraction(x) if isinstance(x, int) else Fraction(repr(float(x)))


def _check(ok: bool, what: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{what} must be {expected}, got {value!r}")


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class PrecopyRule:
    """When multi-stage pre-copy suspends the request (module docstring): one rule, one configuration.

    The cost model prices with it, the simulator's migration executor and every llumlet run it, so a move
    approved against a downtime budget pauses as long as it was priced to.

    ``max_stages``: live stages at most before the request is suspended (0: stop-and-copy, suspend at once).
    ``stop_remaining_blocks``: suspend when at most this many blocks, the partial last block included, are
    left to copy. Raises ValueError on a negative value.
    """

    max_stages: int = 8
    stop_remaining_blocks: int = 1

    def __post_init__(self) -> None:
        for name in ("max_stages", "stop_remaining_blocks"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, name, value, "an int >= 0")

    def next_live_stage(self, tokens: int, copied_blocks: int, stages_done: int, block_size_tokens: int) -> int | None:
        """Blocks the next live stage copies (the full blocks ``[copied_blocks, tokens // bs)``), or None: suspend.

        Args:
            tokens: tokens whose KV the request holds now.
            copied_blocks: leading blocks already at the destination.
            stages_done: live stages copied so far.
            block_size_tokens: tokens per KV block (``bs``).

        Stage 0 copies every full block (possibly none); a later stage runs only while more than
        ``stop_remaining_blocks`` blocks (``⌈tokens/bs⌉ − copied``) remain, fewer than ``max_stages`` stages ran
        and a block filled since the last stage.
        """
        full = tokens // block_size_tokens
        if stages_done >= self.max_stages:
            return None
        if stages_done == 0:
            return full - copied_blocks
        remainder = -(-tokens // block_size_tokens) - copied_blocks
        if remainder <= self.stop_remaining_blocks or full == copied_blocks:
            return None
        return full - copied_blocks


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Knobs of the cost model.

    ``cap_fraction``: share of each link's capacity a migration may use (0, 1], default 0.2.
    ``max_stages``: most live (pre-copy) stages before the request is suspended anyway (≥ 1).
    ``stop_remaining_blocks``: suspend when at most this many blocks are left to copy (≥ 0).
    ``suspend_resume_overhead_s``: fixed downtime added to the last stage (suspending on the source,
    committing and resuming on the destination). Default 1 ms is an assumption, not a measurement:
    calibrate it (docs/cost-model.md, "Calibrating the fixed overheads").
    ``stage_overhead_s``: fixed time of one live pre-copy stage that sends blocks, besides its bytes (the
    control-plane round trip: engine calls, pinning the blocks, the destination's acknowledgment). Default 0:
    on real hardware it is a sub-millisecond local RPC, small next to a stage's copy; calibrate it the same way.
    ``setup_overhead_s``: fixed time of a move outside its stages and its downtime (the command, the
    destination's reservation before stage 0, the checks and the reservation's growth before the suspension),
    charged before stage 0: the request decodes meanwhile. Default 0, for the same reason.
    Raises ValueError on an out-of-range value.
    """

    cap_fraction: float = 0.2
    max_stages: int = 8
    stop_remaining_blocks: int = 1
    suspend_resume_overhead_s: float = 0.001
    stage_overhead_s: float = 0.0
    setup_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _check(
            _finite(self.cap_fraction) and 0 < self.cap_fraction <= 1,
            "cap_fraction",
            self.cap_fraction,
            "in (0, 1]",
        )
        _check(
            isinstance(self.max_stages, int) and self.max_stages >= 1,
            "max_stages",
            self.max_stages,
            "an int >= 1",
        )
        _check(
            isinstance(self.stop_remaining_blocks, int) and self.stop_remaining_blocks >= 0,
            "stop_remaining_blocks",
            self.stop_remaining_blocks,
            "an int >= 0",
        )
        for name in ("suspend_resume_overhead_s", "stage_overhead_s", "setup_overhead_s"):
            value = getattr(self, name)
            _check(_finite(value) and value >= 0, name, value, "a finite number >= 0")

    def live_stage_overhead_s(self, blocks_sent: int) -> float:
        """The fixed time a live pre-copy stage adds to its copy: ``stage_overhead_s`` when it sends any block,
        0 for a stage with nothing to send (no round trip). The cost model and the simulator's executor both
        charge it (module docstring)."""
        return self.stage_overhead_s if blocks_sent > 0 else 0.0

    @property
    def precopy(self) -> PrecopyRule:
        """The pre-copy stop rule of these settings."""
        return PrecopyRule(self.max_stages, self.stop_remaining_blocks)


@dataclass(frozen=True, slots=True)
class MigrationCostInput:
    """One request to move over one path. Raises ValueError naming the bad field.

    * ``kv_tokens``: tokens whose KV the request holds now (prompt + generated);
    * ``kv_bytes_per_token``: KV bytes per token, all layers (``ModelSpec.kv_bytes_per_token``);
    * ``block_size_tokens``: tokens per KV cache block;
    * ``decode_step_s``: time of one decode step of the source's batch (one new token per step);
    * ``path_bandwidth_bytes_per_s``: raw widest-path bottleneck (``PathInfo.bandwidth_bytes_per_s``);
    * ``existing_flows``: migrations already on the bottleneck link;
    * ``prefix_blocks``: full blocks at the start of the sequence that hold a shared prefix;
    * ``prefix_blocks_on_dst``: of those, how many the destination already holds (matched by block hash);
    * ``prefix_reprefill_s``: time to re-prefill the missing prefix blocks on the destination, or None to not
      price recomputation;
    * ``measured_bandwidth_bytes_per_s``: what moves on this path and transport achieved
      (``topology.bandwidth.BandwidthEstimates``), or None while unmeasured (the topology's bandwidth alone).
    """

    kv_tokens: int
    kv_bytes_per_token: int
    block_size_tokens: int
    decode_step_s: float
    path_bandwidth_bytes_per_s: float
    existing_flows: int = 0
    prefix_blocks: int = 0
    prefix_blocks_on_dst: int = 0
    prefix_reprefill_s: float | None = None
    measured_bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("kv_tokens", "existing_flows", "prefix_blocks", "prefix_blocks_on_dst"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, name, value, "an int >= 0")
        for name in ("kv_bytes_per_token", "block_size_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, name, value, "an int > 0")
        for name in ("decode_step_s", "path_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            _check(_finite(value) and value > 0, name, value, "a finite number > 0")
        full = self.kv_tokens // self.block_size_tokens
        _check(self.prefix_blocks <= full, "prefix_blocks", self.prefix_blocks, f"<= the {full} full blocks held")
        _check(
            self.prefix_blocks_on_dst <= self.prefix_blocks,
            "prefix_blocks_on_dst",
            self.prefix_blocks_on_dst,
            f"<= prefix_blocks ({self.prefix_blocks})",
        )
        if self.prefix_reprefill_s is not None:
            _check(
                _finite(self.prefix_reprefill_s) and self.prefix_reprefill_s >= 0,
                "prefix_reprefill_s",
                self.prefix_reprefill_s,
                "a finite number >= 0 or None",
            )
        if self.measured_bandwidth_bytes_per_s is not None:
            _check(
                _finite(self.measured_bandwidth_bytes_per_s) and self.measured_bandwidth_bytes_per_s > 0,
                "measured_bandwidth_bytes_per_s",
                self.measured_bandwidth_bytes_per_s,
                "a finite number > 0 or None",
            )


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """The priced migration.

    * ``converges``: pre-copy converges (``Bt/d < B``);
    * ``mode``: ``"pre-copy"``, ``"pre-copy+recompute-prefix"`` or ``"blocking"`` (stop-and-copy, only when
      pre-copy does not converge);
    * ``stage_bytes`` / ``stage_s``: per stage, live stages first, the last (suspended) stage last;
    * ``transfer_s``: total copy time (Σ stage_s); ``downtime_s``: time the request is stopped;
    * ``total_bytes``: bytes sent (Σ stage_bytes);
    * ``completion_s``: from the start until the request runs on the destination;
    * ``effective_bandwidth_bytes_per_s``: B in the module docstring; ``bandwidth_source``: ``"topology"`` when
      B is the topology's share, ``"measured"`` when the measured rate was lower and set it;
    * ``skipped_prefix_blocks``: prefix blocks not copied because the destination has them;
    * ``recomputed_prefix_blocks`` / ``recompute_s``: prefix blocks re-prefilled on the destination and
      the time that takes.
    """

    converges: bool
    mode: PlanMode
    stage_bytes: tuple[int, ...]
    stage_s: tuple[float, ...]
    transfer_s: float
    downtime_s: float
    total_bytes: int
    completion_s: float
    effective_bandwidth_bytes_per_s: float
    bandwidth_source: BandwidthSource = "topology"
    skipped_prefix_blocks: int = 0
    recomputed_prefix_blocks: int = 0
    recompute_s: float = 0.0

    @property
    def num_stages(self) -> int:
        """Stages including the last (suspended) one."""
        return len(self.stage_bytes)


def effective_bandwidth_bytes_per_s(path_bw: float, cap_fraction: float, existing_flows: int) -> float:
    """Bandwidth one migration gets: ``path_bw · cap_fraction / (existing_flows + 1)`` (bytes/s).

    The migration cap reserves most of each link for serving traffic; the capped share is split fairly among
    the flows on the bottleneck link, this one included. Raises ValueError on a bad argument.
    """
    return float(_effective(path_bw, cap_fraction, existing_flows))


def _effective(path_bw: float, cap_fraction: float, existing_flows: int) -> Fraction:
    _check(_finite(path_bw) and path_bw > 0, "path_bw", path_bw, "a finite number > 0")
    _check(_finite(cap_fraction) and 0 < cap_fraction <= 1, "cap_fraction", cap_fraction, "in (0, 1]")
    _check(
        isinstance(existing_flows, int) and existing_flows >= 0,
        "existing_flows",
        existing_flows,
        "an int >= 0",
    )
    return _exact(path_bw) * _exact(cap_fraction) / (existing_flows + 1)


@dataclass(frozen=True, slots=True)
class _Stages:
    blocks: tuple[int, ...]  # per stage, the last one suspended
    live_s: Fraction  # time until the request is suspended
    last_s: Fraction  # the suspended stage's copy time


def _precopy(inp: MigrationCostInput, cfg: CostConfig, bw: Fraction, skip_blocks: int) -> _Stages:
    """Block-granular pre-copy loop (module docstring); ``skip_blocks`` leading full blocks are not sent."""
    bs = inp.block_size_tokens
    block_s = Fraction(inp.kv_bytes_per_token * bs) / bw
    step_s = _exact(inp.decode_step_s)
    rule = cfg.precopy
    copied = 0
    blocks: list[int] = []
    elapsed = _exact(cfg.setup_overhead_s)  # the request decodes while the move is set up
    tokens = inp.kv_tokens + math.floor(elapsed / step_s)
    while (stage := rule.next_live_stage(tokens, copied, len(blocks), bs)) is not None:
        sent = stage - (skip_blocks if not blocks else 0)  # the prefix the destination holds is not sent
        blocks.append(sent)
        elapsed += _stage_s(sent, block_s, cfg, live=True)
        copied += stage
        tokens = inp.kv_tokens + math.floor(elapsed / step_s)
    remainder = -(-tokens // bs) - copied
    blocks.append(remainder)
    return _Stages(blocks=tuple(blocks), live_s=elapsed, last_s=remainder * block_s)


def _stage_s(blocks: int, block_s: Fraction, cfg: CostConfig, *, live: bool) -> Fraction:
    """One stage's time: its blocks' copy, plus :meth:`CostConfig.live_stage_overhead_s` for a live stage."""
    return blocks * block_s + (_exact(cfg.live_stage_overhead_s(blocks)) if live else 0)


def _plan_from_stages(
    inp: MigrationCostInput,
    cfg: CostConfig,
    bw: Fraction,
    stages: _Stages,
    mode: PlanMode,
    recompute_blocks: int,
) -> MigrationPlan:
    block_bytes = inp.kv_bytes_per_token * inp.block_size_tokens
    block_s = Fraction(block_bytes) / bw
    overhead = _exact(cfg.suspend_resume_overhead_s)
    recompute = (
        _exact(inp.prefix_reprefill_s) if recompute_blocks and inp.prefix_reprefill_s is not None else Fraction(0)
    )
    setup = _exact(cfg.setup_overhead_s)
    copy_done = stages.live_s + stages.last_s
    resume = max(copy_done, setup + recompute) + overhead
    last = len(stages.blocks) - 1
    return MigrationPlan(
        converges=True,
        mode=mode,
        stage_bytes=tuple(b * block_bytes for b in stages.blocks),
        stage_s=tuple(float(_stage_s(b, block_s, cfg, live=i < last)) for i, b in enumerate(stages.blocks)),
        transfer_s=float(copy_done - setup),
        downtime_s=float(resume - stages.live_s),
        total_bytes=sum(stages.blocks) * block_bytes,
        completion_s=float(resume),
        effective_bandwidth_bytes_per_s=float(bw),
        skipped_prefix_blocks=inp.prefix_blocks_on_dst,
        recomputed_prefix_blocks=recompute_blocks,
        recompute_s=float(recompute),
    )


def _blocking(inp: MigrationCostInput, cfg: CostConfig, bw: Fraction) -> MigrationPlan:
    block_bytes = inp.kv_bytes_per_token * inp.block_size_tokens
    setup = _exact(cfg.setup_overhead_s)
    tokens = inp.kv_tokens + math.floor(setup / _exact(inp.decode_step_s))  # decoded while the move is set up
    blocks = -(-tokens // inp.block_size_tokens) - inp.prefix_blocks_on_dst
    copy_s = blocks * Fraction(block_bytes) / bw
    stopped = copy_s + _exact(cfg.suspend_resume_overhead_s)
    return MigrationPlan(
        converges=False,
        mode="blocking",
        stage_bytes=(blocks * block_bytes,),
        stage_s=(float(copy_s),),
        transfer_s=float(copy_s),
        downtime_s=float(stopped),
        total_bytes=blocks * block_bytes,
        completion_s=float(setup + stopped),
        effective_bandwidth_bytes_per_s=float(bw),
        skipped_prefix_blocks=inp.prefix_blocks_on_dst,
    )


def plan_migration(inp: MigrationCostInput, cfg: CostConfig | None = None) -> MigrationPlan:
    """Price moving one request (see the module docstring for every formula).

    Returns the pre-copy plan, or the pre-copy plan that recomputes the missing prefix on the destination when
    that one completes sooner (ties: lower downtime) without a longer downtime, or — when pre-copy cannot
    converge — a blocking stop-and-copy plan with ``converges=False``. Its ``bandwidth_source`` says whether
    the measured rate set B.
    """
    cfg = cfg or CostConfig()
    bw = _effective(inp.path_bandwidth_bytes_per_s, cfg.cap_fraction, inp.existing_flows)
    measured = inp.measured_bandwidth_bytes_per_s
    source: BandwidthSource = "topology"
    if measured is not None and _exact(measured) < bw:
        bw, source = _exact(measured), "measured"
    return replace(_plan(inp, cfg, bw), bandwidth_source=source)


def _plan(inp: MigrationCostInput, cfg: CostConfig, bw: Fraction) -> MigrationPlan:
    growth = Fraction(inp.kv_bytes_per_token) / _exact(inp.decode_step_s)
    if growth >= bw:
        return _blocking(inp, cfg, bw)
    plan = _plan_from_stages(inp, cfg, bw, _precopy(inp, cfg, bw, inp.prefix_blocks_on_dst), "pre-copy", 0)
    missing_prefix = inp.prefix_blocks - inp.prefix_blocks_on_dst
    if inp.prefix_reprefill_s is None or missing_prefix == 0:
        return plan
    alt = _plan_from_stages(
        inp, cfg, bw, _precopy(inp, cfg, bw, inp.prefix_blocks), "pre-copy+recompute-prefix", missing_prefix
    )
    # never trade downtime (a stall the user sees) for completion: recompute only when it is hidden by the copy
    if alt.downtime_s <= plan.downtime_s and (alt.completion_s, alt.downtime_s) < (plan.completion_s, plan.downtime_s):
        return alt
    return plan


def prefix_kv_blocks(num_hash_blocks: int, hash_block_tokens: int, kv_tokens: int, block_size_tokens: int) -> int:
    """The leading full KV blocks of a request holding ``kv_tokens`` tokens that ``num_hash_blocks`` prefix hash
    blocks of ``hash_block_tokens`` tokens each cover: ``min(n · ⌊H / bs⌋, ⌊kv_tokens / bs⌋)`` (H is a multiple of
    bs wherever a prefix cache matches it: ``llumlet.engine.blocks``). ``MigrationCostInput``'s ``prefix_blocks``,
    and its ``prefix_blocks_on_dst`` with the hash blocks the destination holds: the one count the simulator's
    executor, the llumlet's source and the coordinator's judge price a prefix with. Raises ValueError when
    ``block_size_tokens`` < 1 or a count is negative."""
    if block_size_tokens < 1 or min(num_hash_blocks, hash_block_tokens, kv_tokens) < 0:
        raise ValueError(
            f"prefix_kv_blocks: need block_size_tokens >= 1 and counts >= 0, got {num_hash_blocks} hash blocks of "
            f"{hash_block_tokens} tokens, {kv_tokens} KV tokens, blocks of {block_size_tokens}"
        )
    return min(num_hash_blocks * (hash_block_tokens // block_size_tokens), kv_tokens // block_size_tokens)


def bytes_per_link(plan: MigrationPlan, path: PathInfo) -> dict[str, int]:
    """Bytes the plan sends over each link of ``path``: every link carries all of ``plan.total_bytes``."""
    return dict.fromkeys(path.links, plan.total_bytes)
