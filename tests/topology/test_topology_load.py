"""Loading topology files: bundled examples, unit conversion, derived KV capacity and every error class."""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from topology.load import BUNDLED_NAMES, TopologyError, load_topology, parse_topology, tokenizer_errors

ROOT = Path(__file__).resolve().parents[2]

LLAMA_7B: dict[str, Any] = {
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


def base() -> dict[str, Any]:
    """Two 8-GPU A100 nodes in one rack, two TP1 instances on node-0 and one TP2 on node-1."""
    return {
        "name": "t",
        "models": [copy.deepcopy(LLAMA_7B)],
        "gpu_types": [{"name": "a100", "memory_gib": 80, "hbm_gbyte_per_s": 2039, "nvlink_gbyte_per_s": 600}],
        "domains": [
            {
                "id": "node-0",
                "kind": "node",
                "gpu_type": "a100",
                "nodes": [{"id": "node-0", "num_gpus": 8, "nic_gbit_per_s": 200}],
                "instances": [
                    {"id": "a", "gpus": [0], "tensor_parallel_size": 1, "model": "llama-2-7b"},
                    {"id": "b", "gpus": [1], "tensor_parallel_size": 1, "model": "llama-2-7b"},
                ],
            },
            {
                "id": "node-1",
                "kind": "node",
                "gpu_type": "a100",
                "nodes": [{"id": "node-1", "num_gpus": 8, "nic_gbit_per_s": 200}],
                "instances": [{"id": "c", "gpus": [2, 3], "tensor_parallel_size": 2, "model": "llama-2-7b"}],
            },
        ],
        "fabric": {"oversubscription": 2.0, "racks": [{"id": "r0", "domains": ["node-0", "node-1"]}]},
    }


def errors_of(data: Any) -> list[str]:
    with pytest.raises(TopologyError) as exc:
        parse_topology(data, "t.yaml")
    assert str(exc.value) == "\n".join(exc.value.errors)
    return exc.value.errors


# ------------------------------------------------------------------------------------------- examples

EXPECTED_COUNTS = {
    # name: (domains, nodes, GPUs, instances, racks)
    "1x8-a100": (1, 1, 8, 8, 0),
    "2x8-a100": (2, 2, 16, 16, 1),
    "2x8-a100-40gb": (2, 2, 16, 16, 1),
    "64x8-h100": (64, 64, 512, 32 * 8 + 16 * 4 + 16 * 1, 8),
    "nvl72-gb200": (2, 36, 144, 32, 2),
}


@pytest.mark.parametrize("name", BUNDLED_NAMES)
def test_bundled_examples_load_with_expected_counts(name: str) -> None:
    topo = load_topology(name)
    counts = (len(topo.domains), len(topo.nodes), topo.num_gpus, len(topo.instances), len(topo.fabric.racks))
    assert counts == EXPECTED_COUNTS[name]
    assert topo.name == name
    # the same file through the examples/topologies link and by path
    assert load_topology(ROOT / "examples" / "topologies" / f"{name}.yaml").instances == topo.instances


@pytest.mark.parametrize("name", ["mixed-tp", "two-and-eight", "mixed-gpu"])
def test_the_example_fleets_load_and_the_simulator_can_time_them(name: str) -> None:
    """examples/*.yaml besides the bundled topologies: the fleets docs/policy.md measures."""
    from llumlet.engine.latency import latency_model_problems

    topo = load_topology(ROOT / "examples" / f"{name}.yaml")
    assert topo.name == name and len(topo.instances) >= 10 and latency_model_problems(topo) == []
    if name == "mixed-gpu":  # the L40S: more KV blocks than the A100-40GB, less HBM bandwidth
        a100, l40s = topo.instance("node-0-i0"), topo.instance("node-1-i0")
        assert (a100.kv_capacity_blocks, l40s.kv_capacity_blocks) == (963, 1552)
        assert topo.gpu_of("node-1-i0").hbm_bandwidth_bytes_per_s < topo.gpu_of("node-0-i0").hbm_bandwidth_bytes_per_s


def test_2x8_a100_figures() -> None:
    topo = load_topology("2x8-a100")
    model = topo.model_of("node-1-i7")
    assert model.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert model.kv_bytes_per_block == 524_288 * 16
    assert model.weight_bytes == 13_476_831_232
    gpu = topo.gpu_of("node-0-i0")
    assert gpu.memory_bytes == 80 * 2**30
    assert gpu.nvlink_bandwidth_bytes_per_s == 600e9
    assert topo.node("node-0").nic_bandwidth_bytes_per_s == 25e9  # 200 Gb/s
    # floor((80 GiB * 0.9 - 13,476,831,232 B) / 8,388,608 B) = floor(63,832,580,096 / 8,388,608) = 7609
    assert {i.kv_capacity_blocks for i in topo.instances} == {7609}
    assert topo.kv_capacity_tokens("node-0-i3") == 7609 * 16
    rack = topo.fabric.racks[0]
    assert rack.node_ids == ("node-0", "node-1")
    assert rack.uplink_bandwidth_bytes_per_s == 50e9  # 2 x 200 Gb/s / 1.0
    assert topo.instance("node-1-i2").domain_id == "node-1"
    assert topo.instance("node-1-i2").gpus == (2,)


def test_64x8_h100_mix_and_uplinks() -> None:
    topo = load_topology("64x8-h100")
    tp = {(i.model, i.tensor_parallel_size) for i in topo.instances}
    assert tp == {("llama-2-7b", 1), ("llama-2-13b", 2), ("llama-2-70b", 8)}
    assert {r.uplink_bandwidth_bytes_per_s for r in topo.fabric.racks} == {100e9}  # 8 x 400 Gb/s / 4
    llama70 = topo.models["llama-2-70b"]
    assert llama70.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    # floor((8 * 80 GiB * 0.9 - 137,953,296,384 B) / (327,680 * 16 B)) = 91,652
    assert topo.instance("node-63-i0").kv_capacity_blocks == 91_652


def test_nvl72_instances_span_trays() -> None:
    topo = load_topology("nvl72-gb200")
    dom = topo.domain("nvl72-0")
    assert dom.kind == "nvlink_island" and dom.num_gpus == 72 and len(dom.nodes) == 18
    assert topo.instance("nvl72-0-i1").gpus == tuple(range(8, 16))
    assert topo.instance("nvl72-0-i1").node_id == "nvl72-0-tray02"  # GPU 8 is on tray 2 (4 GPUs per tray)
    assert topo.instance("nvl72-1-i15").node_id == "nvl72-1-tray17"  # GPU 71


def test_given_kv_capacity_and_utilization_override() -> None:
    data = base()
    data["domains"][0]["instances"][0]["kv_capacity_blocks"] = 1000
    data["domains"][0]["instances"][1]["gpu_memory_utilization"] = 0.5
    topo = parse_topology(data, "t.yaml")
    assert topo.instance("a").kv_capacity_blocks == 1000
    # floor((80 GiB * 0.5 - 13,476,831,232) / 8,388,608) = floor(29,472,841,728 / 8,388,608) = 3513
    assert topo.instance("b").kv_capacity_blocks == 3513
    # TP2: floor((2 * 80 GiB * 0.9 - 13,476,831,232) / 8,388,608)
    #    = floor(141,141,991,424 / 8,388,608) = 16,825
    assert topo.instance("c").kv_capacity_blocks == 16_825
    assert topo.fabric.racks[0].uplink_bandwidth_bytes_per_s == 25e9  # 2 x 25 GB/s / 2.0


def test_2x8_a100_40gb_is_memory_tight() -> None:
    topo = load_topology("2x8-a100-40gb")
    model = topo.model_of("node-0-i0")
    assert model.kv_bytes_per_token == 2 * 40 * 40 * 128 * 2 == 819_200
    assert model.weight_bytes == 2 * 13_015_864_320
    # floor((40 GiB * 0.9 - 26,031,728,640 B) / 13,107,200 B) = floor(12,622,977,024 / 13,107,200) = 963
    assert {i.kv_capacity_blocks for i in topo.instances} == {963}
    assert topo.gpu_of("node-1-i7").hbm_bandwidth_bytes_per_s == 1555e9


def test_lookup_of_unknown_ids_names_them_with_some_known_ids_and_the_closest() -> None:
    topo = load_topology("2x8-a100")
    with pytest.raises(KeyError) as exc:
        topo.instance("x")
    assert (
        exc.value.args[0]
        == str(exc.value)
        == (  # str() as written, not in quotes (UnknownIdError)
            "2x8-a100.yaml: no instance 'x'; 16 instances: node-0-i0, node-0-i1, node-0-i2, ..., node-1-i7"
        )
    )
    with pytest.raises(KeyError) as exc:
        topo.instance("node-1-i33")
    assert exc.value.args[0].endswith("..., node-1-i7; did you mean 'node-1-i3'?")
    with pytest.raises(KeyError) as exc:
        topo.domain("nod-1")
    assert exc.value.args[0] == "2x8-a100.yaml: no domain 'nod-1'; 2 domains: node-0, node-1; did you mean 'node-1'?"
    with pytest.raises(KeyError) as exc:
        load_topology("1x8-a100").node("x")
    assert exc.value.args[0] == "1x8-a100.yaml: no node 'x'; 1 node: node-0"


# ------------------------------------------------------------------------------------------- errors


def test_unknown_key_missing_key_and_bad_values_all_reported() -> None:
    data = base()
    data["domains"][0]["instances"][1]["tp"] = 1
    del data["models"][0]["num_layers"]
    data["gpu_types"][0]["nvlink_gbyte_per_s"] = -600
    data["domains"][1]["nodes"][0]["nic_gbit_per_s"] = 0
    data["domains"][1]["kind"] = "rack"
    assert errors_of(data) == [
        "t.yaml: models[0].num_layers: missing required key",
        "t.yaml: gpu_types[0].nvlink_gbyte_per_s: must be >= 0.1, got -600",
        "t.yaml: domains[0].instances[1].tp: unknown key; expected one of: id, gpus, tensor_parallel_size, "
        "model, kv_capacity_blocks, gpu_memory_utilization",
        "t.yaml: domains[1].kind: must be one of 'node' or 'nvlink_island', got 'rack' (a string)",
        "t.yaml: domains[1].nodes[0].nic_gbit_per_s: must be >= 0.1, got 0",
    ]


def test_a_link_rate_in_the_wrong_unit_is_refused() -> None:
    """1e-9 Gb/s showed as 0 Gb/s in hilum topology show, and the cost model took it as given."""
    data = base()
    data["domains"][0]["nodes"][0]["nic_gbit_per_s"] = 1e-9
    data["domains"][1]["nodes"][0]["nic_gbit_per_s"] = 2e11  # 200 Gb/s in bits per second
    data["fabric"]["racks"][0]["uplink_gbit_per_s"] = 0.05
    assert errors_of(data) == [
        "t.yaml: domains[0].nodes[0].nic_gbit_per_s: must be >= 0.1, got 1e-09",
        "t.yaml: domains[1].nodes[0].nic_gbit_per_s: must be <= 1e+06, got 200000000000.0",
        "t.yaml: fabric.racks[0].uplink_gbit_per_s: must be >= 0.1, got 0.05",
    ]


def test_wrong_types() -> None:
    data = base()
    data["models"][0]["num_params"] = "7B"
    data["gpu_types"][0]["memory_gib"] = 80.5  # a float is fine for GiB
    data["domains"][0]["instances"][0]["gpus"] = [0.5]
    assert errors_of(data) == [
        "t.yaml: models[0].num_params: expected an integer, got '7B' (a string)",
        "t.yaml: domains[0].instances[0].gpus[0]: expected an integer, got 0.5 (a decimal number)",
    ]


def test_duplicate_ids() -> None:
    data = base()
    data["models"].append(copy.deepcopy(LLAMA_7B))
    data["gpu_types"].append(copy.deepcopy(data["gpu_types"][0]))
    data["domains"][1]["id"] = "node-0"
    data["domains"][1]["nodes"][0]["id"] = "node-0"
    data["domains"][1]["instances"][0]["id"] = "a"
    data["fabric"]["racks"].append({"id": "r0", "nodes": []})
    errs = errors_of(data)
    assert errs == [
        "t.yaml: models[1].name: duplicate model id 'llama-2-7b' (first at models[0].name); ids must be unique",
        "t.yaml: gpu_types[1].name: duplicate GPU type id 'a100' (first at gpu_types[0].name); ids must be unique",
        "t.yaml: domains[1].id: duplicate domain id 'node-0' (first at domains[0].id); ids must be unique",
        "t.yaml: domains[1].nodes[0].id: duplicate node id 'node-0' (first at domains[0].nodes[0].id); "
        "ids must be unique",
        "t.yaml: domains[1].instances[0].id: duplicate instance id 'a' (first at "
        "domains[0].instances[0].id); "
        "ids must be unique",
        # node-1 was renamed above, so rack r0 now names an unknown domain
        "t.yaml: fabric.racks[0].domains[1]: unknown domain 'node-1'; known: node-0",
        "t.yaml: fabric.racks[1].id: duplicate rack id 'r0' (first at fabric.racks[0].id); ids must be unique",
        "t.yaml: fabric.racks[1]: a rack needs at least one entry in 'domains' or 'nodes'",
    ]


def test_gpu_errors() -> None:
    data = base()
    insts = data["domains"][1]["instances"]
    insts[0]["gpus"] = [9, 3]
    insts.append({"id": "d", "gpus": [3, 3], "tensor_parallel_size": 2, "model": "llama-2-7b"})
    insts.append({"id": "e", "gpus": [4, 5], "tensor_parallel_size": 1, "model": "llama-2-7b"})
    assert errors_of(data) == [
        "t.yaml: domains[1].instances[0].gpus: GPU 9 does not exist on node-1 (8 GPUs)",
        "t.yaml: domains[1].instances[1].gpus: GPU 3 is already used by instance 'c'",
        "t.yaml: domains[1].instances[1].gpus: GPU 3 is listed more than once; list each GPU once",
        "t.yaml: domains[1].instances[2].tensor_parallel_size: tensor_parallel_size is 1 but 2 GPUs listed; "
        "list one GPU per tensor-parallel rank",
    ]


def test_island_gpu_out_of_range_and_node_kind_with_two_nodes() -> None:
    data = base()
    dom = data["domains"][1]
    dom["kind"] = "nvlink_island"
    dom["nodes"] = [{"id": f"tray{k}", "num_gpus": 4, "nic_gbit_per_s": 400} for k in range(2)]
    dom["instances"][0]["gpus"] = [7, 8]
    data["domains"][0]["nodes"].append({"id": "node-0b", "num_gpus": 8, "nic_gbit_per_s": 200})
    assert errors_of(data) == [
        "t.yaml: domains[0].nodes: a domain of kind 'node' has exactly one node, got 2; use kind "
        "'nvlink_island' for an NVLink domain over several nodes",
        "t.yaml: domains[1].instances[0].gpus: GPU 8 does not exist in NVLink island node-1 (8 GPUs on 2 nodes)",
    ]


def test_unknown_model_gpu_type_and_weights_that_do_not_fit() -> None:
    data = base()
    data["domains"][0]["gpu_type"] = "h100"
    data["domains"][0]["instances"][0]["model"] = "llama-3"
    data["gpu_types"].append({"name": "t4", "memory_gib": 12, "hbm_gbyte_per_s": 320, "nvlink_gbyte_per_s": 1})
    data["domains"][1]["gpu_type"] = "t4"
    data["domains"][1]["instances"][0] = {
        "id": "c",
        "gpus": [0],
        "tensor_parallel_size": 1,
        "model": "llama-2-7b",
    }
    assert errors_of(data) == [
        "t.yaml: domains[0].gpu_type: unknown GPU type 'h100'; GPU types in this file: a100, t4",
        "t.yaml: domains[0].instances[0].model: unknown model 'llama-3'; models in this file: llama-2-7b",
        "t.yaml: domains[1].instances[0].model: weights of llama-2-7b (13.5 GB) leave no room for a KV cache "
        "block in 1 x t4 x 0.9 utilization = 11.6 GB; use more GPUs (tensor_parallel_size) or give "
        "kv_capacity_blocks",
    ]


def test_invalid_model_does_not_cascade_into_unknown_model_errors() -> None:
    data = base()
    data["models"][0]["dtype"] = "float64"
    assert errors_of(data) == [
        "t.yaml: models[0].dtype: must be one of 'float32', 'float16', 'bfloat16', "
        "'float8', 'fp8' or 'int8', "
        "got 'float64' (a string)",
    ]


def test_a_racks_given_uplink_sets_its_oversubscription() -> None:
    """``hilum topology show`` printed the file's default ratio (2:1) beside a given uplink of another (2.5:1)."""
    data = base()
    data["fabric"]["racks"][0]["uplink_gbit_per_s"] = 160  # the two NICs: 400 Gb/s
    rack = parse_topology(data, "t.yaml").fabric.racks[0]
    assert (rack.uplink_bandwidth_bytes_per_s, rack.oversubscription) == (20e9, 2.5)
    del data["fabric"]["racks"][0]["uplink_gbit_per_s"]
    rack = parse_topology(data, "t.yaml").fabric.racks[0]
    assert (rack.uplink_bandwidth_bytes_per_s, rack.oversubscription) == (25e9, 2.0)  # 400 Gb/s / the default 2
    data["fabric"]["racks"][0].update(uplink_gbit_per_s=100, oversubscription=4.0)  # the same ratio, said twice
    assert errors_of(data) == [
        "t.yaml: fabric.racks[0].oversubscription: give uplink_gbit_per_s or oversubscription, not both (the uplink "
        "sets the ratio to the NICs)"
    ]


def test_the_instances_of_a_domain_whose_node_is_invalid_are_still_schema_checked() -> None:
    """A misspelt instance key showed only once the node's was mended."""
    data = base()
    data["domains"][1]["nodes"][0]["nic_gbps"] = data["domains"][1]["nodes"][0].pop("nic_gbit_per_s")
    data["domains"][1]["instances"][0]["tensor_paralel_size"] = data["domains"][1]["instances"][0].pop(
        "tensor_parallel_size"
    )
    assert [e.split(": ")[1] for e in errors_of(data)] == [
        "domains[1].nodes[0].nic_gbit_per_s",
        "domains[1].nodes[0].nic_gbps",
        "domains[1].instances[0].tensor_parallel_size",
        "domains[1].instances[0].tensor_paralel_size",
    ]


def test_a_bad_fabric_key_hides_no_rack_error() -> None:
    """A misspelt key under fabric hid every error of its racks until it was mended."""
    data = base()
    data["fabric"]["oversubscripton"] = 2
    data["fabric"]["racks"][0]["uplink_gbps"] = 100
    assert [e.split(": ")[1] for e in errors_of(data)] == ["fabric.oversubscripton", "fabric.racks[0].uplink_gbps"]
    del data["fabric"]["racks"][0]["uplink_gbps"]  # the racks' own checks too, with the file's default ratio
    data["fabric"]["racks"] = [
        {"id": "r0", "domains": ["node-0", "node-9"], "oversubscription": 1e9},
        {"id": "r1", "domains": ["node-1"], "uplink_gbit_per_s": 100, "oversubscription": 2},
    ]
    assert [e.split(": ")[1] for e in errors_of(data)] == [
        "fabric.oversubscripton",
        "fabric.racks[0].domains[1]",
        "fabric.racks[0].oversubscription",
        "fabric.racks[1].oversubscription",
    ]
    data["fabric"] = {"oversubscription": -1, "racks": [{"id": "r0", "domains": ["node-0", "node-1"]}]}
    assert [e.split(": ")[1] for e in errors_of(data)] == ["fabric.oversubscription"]  # its uplink not judged


def test_an_oversubscription_that_makes_an_uplink_no_link_has_is_refused() -> None:
    """The bounds of a given uplink_gbit_per_s, for one derived from the NICs: 1e9 gave an uplink of 25 bytes/s."""
    data = base()
    data["fabric"]["oversubscription"] = 1e9
    assert errors_of(data) == [
        "t.yaml: fabric.oversubscription: 1e+09 gives rack 'r0' an uplink of 4e-07 Gb/s (400 Gb/s of NICs over it), "
        "outside 0.1 to 10^6: a slip of units? (give uplink_gbit_per_s instead)"
    ]
    data["fabric"]["oversubscription"] = 2.0
    data["fabric"]["racks"][0]["oversubscription"] = 1e-4
    assert [e.split(": ")[1] for e in errors_of(data)] == ["fabric.racks[0].oversubscription"]  # 4,000,000 Gb/s


def test_rack_errors() -> None:
    data = base()
    data["fabric"]["racks"] = [
        {"id": "r0", "domains": ["node-0", "node-9"], "uplink_gbit_per_s": 100},
        {"id": "r1", "nodes": ["node-0", "ghost"], "oversubscription": -1},
    ]
    # with an invalid rack the "node in no rack" check is skipped: it would guess at what the rack meant
    assert errors_of(data) == [
        "t.yaml: fabric.racks[0].domains[1]: unknown domain 'node-9'; known: node-0, node-1",
        "t.yaml: fabric.racks[1].oversubscription: must be > 0, got -1",
    ]
    del data["fabric"]["racks"][1]["oversubscription"]
    assert errors_of(data) == [
        "t.yaml: fabric.racks[0].domains[1]: unknown domain 'node-9'; known: node-0, node-1",
        "t.yaml: fabric.racks[1].nodes[1]: unknown node 'ghost'; known: node-0, node-1",
        "t.yaml: fabric.racks[1].nodes[0]: node 'node-0' is already in rack 'r0'; a node sits in one rack",
        "t.yaml: fabric.racks: node 'node-1' is in no rack; with several domains every "
        "node must sit in a rack "
        "(list its domain under a rack's 'domains' or the node under 'nodes')",
    ]


def test_root_errors() -> None:
    assert errors_of([1, 2]) == [
        "t.yaml: (root): expected a mapping with keys name, models, gpu_types, domains, got a list"
    ]
    assert errors_of({"name": "x", "models": [], "gpu_types": [], "domains": [], "racks": []}) == [
        "t.yaml: models: must list at least one entry",
        "t.yaml: gpu_types: must list at least one entry",
        "t.yaml: domains: must list at least one entry",
        "t.yaml: racks: unknown key; expected one of: name, description, gpu_memory_utilization, models, "
        "gpu_types, domains, fabric",
    ]


def test_an_empty_list_of_models_or_gpu_types_is_said_once() -> None:
    """Every instance then named an "unknown model; models in this file: " (an empty list), against the docs."""
    for key in ("models", "gpu_types"):
        data = yaml.safe_load((ROOT / "topology" / "examples" / "2x8-a100.yaml").read_text())
        data[key] = []
        assert errors_of(data) == [f"t.yaml: {key}: must list at least one entry"]


def test_one_problem_at_many_places_is_shown_once_with_its_places() -> None:
    data = yaml.safe_load((ROOT / "topology" / "examples" / "1x8-a100.yaml").read_text())
    for domain in data["domains"]:
        for instance in domain["instances"]:
            instance["model"] = "llama-2-7x"
    with pytest.raises(TopologyError) as exc:
        parse_topology(data, source="t.yaml")
    count = sum(len(d["instances"]) for d in data["domains"])
    assert len(exc.value.errors) == count > 4  # every place is kept for a program
    (line,) = exc.value.lines()
    assert line.startswith("t.yaml: domains[0].instances[0].model: unknown model 'llama-2-7x'")
    assert line.endswith(
        f" (and {count - 1:,} more like it: domains[0].instances[1].model, domains[0].instances[2].model, "
        "domains[0].instances[3].model, ...)"
    )
    assert str(exc.value) == line
    two = TopologyError(["t.yaml: a[0].b: bad", "t.yaml: a[1].b: bad", "t.yaml: c: other"])
    assert two.lines() == ["t.yaml: a[0].b: bad (and 1 more like it: a[1].b)", "t.yaml: c: other"]


def test_a_topology_is_read_from_a_pipe(tmp_path: Path) -> None:
    # --topology <(...): the shell passes a pipe's path, which is no regular file
    fifo = tmp_path / "topology.fifo"
    os.mkfifo(fifo)
    text = (ROOT / "topology" / "examples" / "1x8-a100.yaml").read_text()
    writer = threading.Thread(target=fifo.write_text, args=(text,))
    writer.start()
    try:
        topo = load_topology(fifo)
    finally:
        writer.join(timeout=10)
    assert topo.name == "1x8-a100" and len(topo.instances) == 8
    with pytest.raises(TopologyError) as exc:
        load_topology("/dev/null")
    assert exc.value.errors[0].startswith("/dev/null: (root): expected a mapping with keys name, models")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TopologyError) as exc:
        load_topology(tmp_path / "nope.yaml")
    assert exc.value.errors == [
        f"{tmp_path / 'nope.yaml'}: (file): file not found; give a path to a topology "
        "YAML file or one of the "
        "bundled names: 1x8-a100, 2x8-a100, 2x8-a100-40gb, 64x8-h100, nvl72-gb200"
    ]
    with pytest.raises(TopologyError) as exc:
        load_topology(tmp_path)
    assert exc.value.errors[0].startswith(f"{tmp_path}: (file): is a directory; give a path to a topology YAML file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels:\n  - name: a\n    layers: [1, 2\n")
    with pytest.raises(TopologyError) as exc:
        load_topology(bad)
    assert exc.value.errors == [
        f"{bad}: line 5, column 1: YAML syntax error: expected ',' or ']', but got '<stream end>'"
    ]
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: x\nname: y\n")
    with pytest.raises(TopologyError) as exc:
        load_topology(dup)
    assert exc.value.errors == [
        f"{dup}: line 2, column 1: YAML syntax error: duplicate key 'name' (first at line 1); keys must be unique"
    ]


def test_a_topology_file_that_is_not_utf8_or_empty_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(TopologyError) as exc:
        load_topology(bad)
    assert exc.value.errors == [f"{bad}: (file): not UTF-8 text (byte 0xe9 at offset 9); save it as UTF-8"]
    bad.write_text("")
    with pytest.raises(TopologyError) as exc:
        load_topology(bad)
    assert exc.value.errors == [
        f"{bad}: (root): expected a mapping with keys name, models, gpu_types, domains, got an empty file"
    ]


@pytest.mark.parametrize(
    "text",
    ["name: " + "[" * 5000 + "]" * 5000, "name:\n" + "".join("  " * i + "k:\n" for i in range(1, 3000))],
    ids=["flow", "block"],
)
def test_a_document_nested_too_deeply_is_a_topology_error_not_a_crash(tmp_path: Path, text: str) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text(text)
    with pytest.raises(TopologyError) as exc:  # PyYAML itself raises RecursionError
        load_topology(deep)
    assert exc.value.errors == [
        f"{deep}: (file): lists and mappings nested too deeply to read (hilum's files need a few levels)"
    ]


def test_file_and_bundled_name_give_the_same_topology(tmp_path: Path) -> None:
    src = (ROOT / "topology" / "examples" / "2x8-a100.yaml").read_text()
    path = tmp_path / "mine.yaml"
    path.write_text(src)
    assert load_topology(path).instances == load_topology("2x8-a100").instances
    assert load_topology(str(path)).source == str(path)


def test_tokenizer_key_paths_and_errors(tmp_path: Path) -> None:
    data = base()
    data["models"][0]["tokenizer"] = "models/llama-tok"
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(data))
    topo = load_topology(tmp_path / "cluster.yaml")
    assert topo.models["llama-2-7b"].tokenizer == str(tmp_path / "models" / "llama-tok")  # the file's folder
    assert tokenizer_errors(topo) == [
        f"{tmp_path / 'cluster.yaml'}: models[0].tokenizer: {tmp_path / 'models' / 'llama-tok'} does not exist "
        "(model llama-2-7b: need the directory of its Hugging Face tokenizer)"
    ]
    (tmp_path / "models" / "llama-tok").mkdir(parents=True)
    assert tokenizer_errors(topo) == [  # transformers then blamed packages not installed (sentencepiece, tiktoken)
        f"{tmp_path / 'cluster.yaml'}: models[0].tokenizer: {tmp_path / 'models' / 'llama-tok'} holds no tokenizer "
        "file (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, spiece.model) (model llama-2-7b: "
        "need the directory of its Hugging Face tokenizer)"
    ]
    (tmp_path / "models" / "llama-tok" / "tokenizer.json").write_text("{}")
    assert tokenizer_errors(topo) == []
    assert load_topology("1x8-a100").models["llama-2-7b"].tokenizer is None
    data["models"][0]["tokenizer"] = "/abs/tok"
    assert parse_topology(data, "t.yaml", base_dir=tmp_path).models["llama-2-7b"].tokenizer == "/abs/tok"
    for bad, message in [(7, "expected a string, got 7 (an integer)"), ("", "must not be empty")]:
        data["models"][0]["tokenizer"] = bad
        assert any(e.startswith("t.yaml: models[0].tokenizer: ") and message in e for e in errors_of(data)), bad
