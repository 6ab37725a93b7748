"""Small builders for simulator tests: hand-made traces and a tiny two-domain topology."""

from __future__ import annotations

from typing import Any

from sim.traces import Trace, TraceRequest
from topology.load import parse_topology
from topology.spec import Topology


def make_trace(rows: list[tuple[float, int, int]], name: str = "hand") -> Trace:
    """A trace from (arrival_s, prompt_tokens, output_tokens) rows."""
    requests = tuple(
        TraceRequest(request_id=f"r{i}", arrival_s=a, prompt_tokens=p, output_tokens=o)
        for i, (a, p, o) in enumerate(rows)
    )
    return Trace(name=name, source="test", attribution="test", requests=requests)


def tiny_topology(kv_capacity_blocks: int = 200, nic_gbit_per_s: float = 200.0) -> Topology:
    """Two 2-GPU A100 nodes (two NVLink domains), one TP1 Llama-2-7B instance per GPU."""

    def domain(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "kind": "node",
            "gpu_type": "a100-80gb",
            "nodes": [{"id": name, "num_gpus": 2, "nic_gbit_per_s": nic_gbit_per_s}],
            "instances": [
                {
                    "id": f"{name}-i{g}",
                    "gpus": [g],
                    "tensor_parallel_size": 1,
                    "model": "llama-2-7b",
                    "kv_capacity_blocks": kv_capacity_blocks,
                }
                for g in range(2)
            ],
        }

    data = {
        "name": "tiny",
        "models": [
            {
                "name": "llama-2-7b",
                "num_layers": 32,
                "num_attention_heads": 32,
                "num_kv_heads": 32,
                "head_dim": 128,
                "hidden_size": 4096,
                "dtype": "float16",
                "block_size_tokens": 16,
                "num_params": 6738415616,
                "max_context_tokens": 4096,
            }
        ],
        "gpu_types": [{"name": "a100-80gb", "memory_gib": 80, "hbm_gbyte_per_s": 2039, "nvlink_gbyte_per_s": 600}],
        "domains": [domain("n0"), domain("n1")],
        "fabric": {"oversubscription": 1.0, "racks": [{"id": "rack-0", "domains": ["n0", "n1"]}]},
    }
    return parse_topology(data, source="tiny.yaml")
