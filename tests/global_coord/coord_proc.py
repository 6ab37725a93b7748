"""A coordinator replica for the process tests: the real CLI and server, with a test judge.

Same arguments as ``python -m global_coord`` (``--topology`` is ignored): every cross-domain move over
the single link "spine" is approved while the link carries no other migration.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass

from global_coord.approver import Judgement, MoveProposal, PathLike
from global_coord.cli import parse_args, serve_replica
from global_coord.wiring import ClusterModel


@dataclass(frozen=True)
class _Path:
    bandwidth_bytes_per_s: float
    links: tuple[str, ...]
    same_domain: bool


@dataclass(frozen=True)
class _Topo:
    name: str
    source: str
    domains: tuple[()]


def _path_of(src: str, dst: str) -> PathLike:
    return _Path(12.5e9, ("spine",), False)


def _judge(
    move: MoveProposal,
    dst: str,
    path: PathLike,
    busiest_link_flows: int,
    measured: float | None = None,
    dst_prefix_hash_blocks: int = 0,
    dst_prefill_s_per_token: float = 0.0,
) -> Judgement:
    if busiest_link_flows >= 1:
        return Judgement(False, "link budget full")
    return Judgement(True, "approved: test judge", 0.1, 0.005)


if __name__ == "__main__":
    ns = parse_args(sys.argv[1:])
    logging.basicConfig(level=ns.log_level, format=f"%(asctime)s {ns.id} %(name)s %(levelname)s %(message)s")
    model = ClusterModel(topology=_Topo("test", "coord_proc", ()), path_of=_path_of, judge=_judge)
    raise SystemExit(asyncio.run(serve_replica(ns, model)))
