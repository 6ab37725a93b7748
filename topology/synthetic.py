"""Generated topologies for benchmarks and tests: 8-GPU H100 nodes, a TP1 Llama-2-7B on every GPU."""

from __future__ import annotations

from typing import Any

__all__ = ["synthetic_topology_data"]


def synthetic_topology_data(
    num_nodes: int,
    *,
    gpus_per_node: int = 8,
    nodes_per_rack: int = 8,
    nic_gbit_per_s: float = 400.0,
    oversubscription: float = 4.0,
) -> dict[str, Any]:
    """A topology document (the YAML structure, ready for ``parse_topology``) of ``num_nodes`` node domains.

    Every GPU runs one tensor-parallel-1 Llama-2-7B instance (``node-<n>-i<g>``); racks hold
    ``nodes_per_rack`` consecutive nodes; rack uplinks are derived from ``oversubscription``.
    512 nodes give the 4096-GPU fabric of ``bench/bench_topology_paths.py``.
    """
    if num_nodes < 1 or gpus_per_node < 1 or nodes_per_rack < 1:
        raise ValueError(
            f"num_nodes, gpus_per_node and nodes_per_rack must be >= 1, got "
            f"{num_nodes}, {gpus_per_node}, {nodes_per_rack}"
        )
    width = len(str(num_nodes - 1))
    names = [f"node-{n:0{width}d}" for n in range(num_nodes)]
    domains = [
        {
            "id": name,
            "kind": "node",
            "gpu_type": "h100-80gb",
            "nodes": [{"id": name, "num_gpus": gpus_per_node, "nic_gbit_per_s": nic_gbit_per_s}],
            "instances": [
                {"id": f"{name}-i{g}", "gpus": [g], "tensor_parallel_size": 1, "model": "llama-2-7b"}
                for g in range(gpus_per_node)
            ],
        }
        for name in names
    ]
    racks = [
        {"id": f"rack-{r}", "domains": names[start : start + nodes_per_rack]}
        for r, start in enumerate(range(0, num_nodes, nodes_per_rack))
    ]
    return {
        "name": f"synthetic-{num_nodes}x{gpus_per_node}",
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
        "gpu_types": [{"name": "h100-80gb", "memory_gib": 80, "hbm_gbyte_per_s": 3350, "nvlink_gbyte_per_s": 900}],
        "domains": domains,
        "fabric": {"oversubscription": oversubscription, "racks": racks},
    }
