"""Small factories for hand-built policy states (imported by the tests in this folder)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from policy import InstanceLoad, MigrationDecision, PolicyConfig, RequestLoad

#: Small round numbers so every expected value in the tests can be computed by hand.
CFG = PolicyConfig(
    priority_headroom_blocks={1: 20},
    warmup_usage_blocks=-50,
    tie_tolerance=0.0,
    migrate_out_freeness_below=3.0,
    migrate_in_freeness_above=3.0,
)


def inst(
    instance_id: str,
    capacity_blocks: int,
    blocks: Sequence[int] = (),
    *,
    priorities: Sequence[int] = (),
    **kwargs: object,
) -> InstanceLoad:
    """An instance running one request per entry of `blocks` (ids `<instance>-r<i>`), used = Σ blocks."""
    prios = list(priorities) + [0] * (len(blocks) - len(priorities))
    pairs = enumerate(zip(blocks, prios, strict=True))
    running = tuple(RequestLoad(f"{instance_id}-r{i}", b, priority=p) for i, (b, p) in pairs)
    return InstanceLoad(instance_id, capacity_blocks, sum(blocks), running, **kwargs)  # type: ignore[arg-type]


def apply_move(loads: Sequence[InstanceLoad], move: MigrationDecision) -> list[InstanceLoad]:
    """The state after `move` completes: the request's blocks leave src and arrive at dst."""
    src = next(x for x in loads if x.instance_id == move.src_id)
    request = next(r for r in src.running if r.request_id == move.request_id)
    out = []
    for load in loads:
        if load.instance_id == move.src_id:
            kept = tuple(r for r in load.running if r.request_id != move.request_id)
            load = replace(load, used_blocks=load.used_blocks - request.blocks, running=kept)
        elif load.instance_id == move.dst_id:
            grown = (*load.running, request)
            load = replace(load, used_blocks=load.used_blocks + request.blocks, running=grown)
        out.append(load)
    return out
