"""The coordinator's judge over a real topology: cost model + approval rule (2x8-a100 example)."""

from __future__ import annotations

import pytest

from global_coord.approver import MoveProposal
from global_coord.wiring import load_cluster_model

pytest.importorskip("topology.cost")  # merged from the topology branch
pytest.importorskip("global_coord.approval")  # written by the lead


def _move(num_tokens: int, remaining_tokens: int) -> MoveProposal:
    return MoveProposal("node-0", "r", 0, "node-0-i0", "", num_tokens // 16, num_tokens, remaining_tokens, 0.02)


def test_cost_model_judge_on_the_two_node_example() -> None:
    model = load_cluster_model("2x8-a100")
    path = model.path_of("node-0-i0", "node-1-i0")
    assert path.links == ("nvlink:node-0-i0", "nic:node-0", "nic:node-1", "nvlink:node-1-i0")
    # Llama-2-7B, 1600 tokens = 1600 x 0.5 MiB = 839 MB over 20% of 25 GB/s = 5 GB/s: ~0.17 s of transfer,
    # KV grows 0.5 MiB per 20 ms step (26 MB/s) so pre-copy converges; 500 tokens left = 10 s of decoding.
    ok = model.judge(_move(1600, 500), "node-1-i0", path, 0)
    assert ok.approved, ok.reason
    assert 0.16 < ok.transfer_s < 0.19
    assert 0 < ok.downtime_s < 0.025
    # 5 tokens left = 0.1 s of decoding < 2 x transfer: not worth the bytes
    late = model.judge(_move(1600, 5), "node-1-i0", path, 0)
    assert not late.approved and late.reason.startswith("not worth it")
    full = model.judge(_move(1600, 500), "node-1-i0", path, 2)
    assert not full.approved and full.reason.startswith("link budget full: 2")
    assert model.topology.name == "2x8-a100"
