"""Latency model: shipped coefficients, monotonicity, errors, and the calibration bound on measured data."""

from __future__ import annotations

import array
import json
import math
import random
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llumlet.engine.latency import (
    LatencyModel,
    UnsupportedLatencyModelError,
    load_latency_model,
    packed_doubles,
    supported_latency_models,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.exists():
    DATA = Path("/work/shared/data")
# Documented in docs/engine-model.md ("Calibration"): bound on the MuxServe MAPE of every
# (model, TP, phase) group, and on all of them together.
MUXSERVE_GROUP_MAPE_BOUND = 0.15
MUXSERVE_OVERALL_MAPE_BOUND = 0.10

REQUIRED = [
    ("llama-2-7b", "a100", 1),
    ("llama-2-13b", "a100", 1),
    ("llama-2-13b", "a100", 2),
    ("llama-2-70b", "a100", 2),
    ("llama-2-70b", "a100", 4),
    ("llama-2-70b", "a100", 8),
    ("llama-2-7b", "h100", 1),
    ("llama-2-70b", "h100", 8),
]


def test_supported_combinations_and_aliases() -> None:
    supported = supported_latency_models()
    for combo in REQUIRED:
        assert combo in supported
    a = load_latency_model("meta-llama/Llama-2-7b-hf", "A100-80GB", 1)
    b = load_latency_model("llama-2-7b", "a100", 1)
    assert a == b
    assert load_latency_model("llama2-70b", "h100-80gb", 4).model == "llama-2-70b"


def test_unsupported_combination_lists_supported() -> None:
    with pytest.raises(
        UnsupportedLatencyModelError, match=r"supported: .*llama-2-70b: a100 at TP2/4/8, h100 at TP2/4/8;"
    ):
        load_latency_model("llama-2-7b", "a100", 8)


def test_known_points_a100_7b() -> None:
    m = load_latency_model("llama-2-7b", "a100", 1)
    # MuxServe llama-7b TP1: bs1 seq128 decode 11.49 ms; bs128 seq512 decode 40.9 ms;
    # bs1 seq512 prefill 41.0 ms
    assert m.step_time_s([], [128]) == pytest.approx(0.01149, rel=0.1)
    assert m.step_time_s([], [512] * 128) == pytest.approx(0.0409, rel=0.1)
    assert m.step_time_s([(512, 0)], []) == pytest.approx(0.0410, rel=0.1)
    assert m.step_time_s([], []) == 0.0


def test_h100_faster_than_a100_and_tp_helps_large_prefill() -> None:
    a = load_latency_model("llama-2-70b", "a100", 4)
    h = load_latency_model("llama-2-70b", "h100", 4)
    batch = ([(2048, 0)], [1024] * 16)
    assert h.step_time_s(*batch) < a.step_time_s(*batch)
    assert load_latency_model("llama-2-70b", "a100", 8).step_time_s([(4096, 0)], []) < a.step_time_s([(4096, 0)], [])


def test_bad_batches_rejected() -> None:
    m = load_latency_model("llama-2-7b", "a100", 1)
    with pytest.raises(ValueError, match=r"prefill_chunks\[0\]"):
        m.step_time_s([(0, 5)], [])
    with pytest.raises(ValueError, match=r"decode_context_tokens\[1\]"):
        m.step_time_s([], [5, 0])
    with pytest.raises(ValueError, match="non-decreasing"):
        LatencyModel("x", "a100", 1, (1, 2), (2.0, 1.0), 0, 0, 0, 0, 0)


batches = st.tuples(
    st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 8192)), max_size=4),
    st.lists(st.integers(1, 8192), max_size=64),
)


@settings(max_examples=60, deadline=None)
@given(
    combo=st.sampled_from(supported_latency_models()),
    batch=batches,
    extra_ctx=st.integers(1, 4096),
    extra_chunk=st.tuples(st.integers(1, 2048), st.integers(0, 4096)),
)
def test_monotone_in_work(
    combo: tuple[str, str, int],
    batch: tuple[list[tuple[int, int]], list[int]],
    extra_ctx: int,
    extra_chunk: tuple[int, int],
) -> None:
    m = load_latency_model(*combo)
    chunks, decodes = batch
    t = m.step_time_s(chunks, decodes)
    assert t >= 0.0
    assert m.step_time_s(chunks, [*decodes, extra_ctx]) >= t  # one more decode
    assert m.step_time_s([*chunks, extra_chunk], decodes) >= t  # one more prefill chunk
    if decodes:
        longer = [decodes[0] + extra_ctx, *decodes[1:]]
        assert m.step_time_s(chunks, longer) >= t  # longer context


def _muxserve_mape() -> dict[tuple[str, int, str], float]:
    table = json.loads((DATA / "muxserve" / "llama.json").read_text())
    out = {}
    for mux_name, model in (("llama-7b", "llama-2-7b"), ("llama-13b", "llama-2-13b")):
        for tp in (1, 2):
            lm = load_latency_model(model, "a100", tp)
            errs: dict[str, list[float]] = {"prefill": [], "decode": []}
            for bs, by_seq in table[mux_name][str(tp)]["100"].items():
                for seq, entry in by_seq.items():
                    b, s = int(bs), int(seq)
                    if entry["prefill"] > 0:  # -1 = not measured (out of memory)
                        pred = lm.step_time_s([(s, 0)] * b, []) * 1000
                        errs["prefill"].append(abs(pred - entry["prefill"]) / entry["prefill"])
                    if entry["decoding"] > 0:
                        pred = lm.step_time_s([], [s] * b) * 1000
                        errs["decode"].append(abs(pred - entry["decoding"]) / entry["decoding"])
            for phase, e in errs.items():
                out[(model, tp, phase)] = sum(e) / len(e)
    return out


@pytest.mark.skipif(not (DATA / "muxserve" / "llama.json").exists(), reason=f"measured data not found at {DATA}")
def test_calibration_muxserve_mape_within_documented_bound() -> None:
    mape = _muxserve_mape()
    assert len(mape) == 8
    for key, value in mape.items():
        assert value < MUXSERVE_GROUP_MAPE_BOUND, f"{key}: MAPE {value:.1%}"
    assert sum(mape.values()) / len(mape) < MUXSERVE_OVERALL_MAPE_BOUND


def test_packed_doubles_are_the_arrays_own_doubles() -> None:
    rng = random.Random(5)
    for n in (0, 1, 7, 200, 5000):  # 5000: past the lengths whose packer is kept
        values = [rng.uniform(-1e300, 1e300) for _ in range(n)] + [math.inf, -0.0, 5e-324][: min(n, 3)]
        packed = packed_doubles(values)
        assert packed.typecode == "d" and packed.tobytes() == array.array("d", values).tobytes()
    assert packed_doubles((0.25, 1)).tolist() == [0.25, 1.0]  # any sequence; an int is a real number
    with pytest.raises(struct.error):
        packed_doubles(["0.5"])  # type: ignore[list-item]


def test_scaled_latency_models_lists_each_scaled_combination_once_in_the_files_order() -> None:
    from llumlet.engine.latency import scaled_latency_models
    from topology.load import load_topology

    assert scaled_latency_models(load_topology("2x8-a100-40gb")) == [
        "llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM"
    ]
    assert scaled_latency_models(load_topology("2x8-a100")) == []  # the measured A100-80GB
    gb200 = load_topology("nvl72-gb200")
    every = scaled_latency_models(gb200)
    assert every and all(m.endswith(" scaled from h100 by HBM") for m in every)  # a GPU of no measured family
    assert len(every) == len({(i.model, i.gpu_type, i.tensor_parallel_size) for i in gb200.instances})
    seventy = scaled_latency_models(gb200, "llama-2-70b")
    assert seventy and seventy == [m for m in every if m.startswith("llama-2-70b/")]


def test_the_scaled_step_times_line_says_one_gpu_type_or_several() -> None:
    from llumlet.engine.latency import scaled_latency_models, scaled_note
    from topology.load import load_topology

    one = scaled_latency_models(load_topology("2x8-a100-40gb"))
    assert scaled_note(one) == (
        "llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM (no step times measured on that GPU type: "
        'docs/simulator.md, "Model")'
    )
    mixed = load_topology(Path(__file__).resolve().parents[2] / "examples" / "mixed-gpu.yaml")
    two = scaled_latency_models(mixed)  # the A100-40GB scaled from the A100, the L40S from the H100
    assert [entry.split(" ")[0] for entry in two] == ["llama-2-13b/a100-40gb/tp1", "llama-2-13b/l40s/tp1"]
    assert "(no step times measured on those GPU types:" in scaled_note(two)


def test_gpu_latency_model_takes_the_measured_model_or_scales_one_by_hbm() -> None:
    from llumlet.engine.latency import (
        CALIBRATED_HBM_BYTES_PER_S,
        UnsupportedLatencyModelError,
        gpu_latency_model,
        load_latency_model,
    )

    measured = load_latency_model("llama-2-13b", "a100", 1)
    assert gpu_latency_model("llama-2-13b", "a100-80gb", 1, 2.0e12) == (measured, None)  # within 5 % of 2.039
    forty, how = gpu_latency_model("llama-2-13b", "a100-40gb", 1, 1.555e12)
    assert how == "scaled from a100 by HBM" and forty.gpu == "a100-40gb"
    assert forty.gpu_scale == pytest.approx(measured.gpu_scale * CALIBRATED_HBM_BYTES_PER_S["a100"] / 1.555e12)
    l4, how = gpu_latency_model("llama-2-7b", "l4", 1, 0.3e12)
    assert how == "scaled from h100 by HBM"
    assert l4.gpu_scale == pytest.approx(load_latency_model("llama-2-7b", "h100", 1).gpu_scale * 3.35e12 / 0.3e12)
    with pytest.raises(UnsupportedLatencyModelError) as exc:
        gpu_latency_model("llama-2-7b", "a100-80gb", 4, 2.039e12)  # neither A100 nor H100 measured at TP4
    assert str(exc.value) == (
        "no step-time model for llama-2-7b at TP4 on a100-80gb: none is measured for it on a100 (the family of "
        "a100-80gb), nor on h100 (scaled by HBM bandwidth); measured: llama-2-13b: a100 at TP1/2/4, h100 at TP1/2; "
        "llama-2-70b: a100 at TP2/4/8, h100 at TP2/4/8; llama-2-7b: a100 at TP1/2, h100 at TP1/2"
    )
    with pytest.raises(UnsupportedLatencyModelError, match=r"^no step-time model for mistral-7b at TP1 on l4: l4 is"):
        gpu_latency_model("mistral-7b", "l4", 1, 0.3e12)


def test_the_live_sim_engine_models_the_gpu_the_simulator_does() -> None:
    """hilum bench --compare-sim sets the two side by side: on the simulator's default topology (A100-40GB) the
    llumlet took the measured A100-80GB model (29.4 ms a step where the simulator said 37.9 ms)."""
    from llumlet.backends.base import BackendConfig
    from llumlet.backends.sim import make_sim_backend
    from llumlet.engine.latency import scaled_latency_models
    from sim.runner import _latency_for
    from topology.load import load_topology

    for name in ("2x8-a100-40gb", "2x8-a100", "nvl72-gb200"):
        topology = load_topology(name)
        simulated = _latency_for(topology)
        for spec in topology.instances[:2]:
            live = make_sim_backend(BackendConfig(instance_id=spec.instance_id, topology=topology))
            assert live.engine.latency_model == simulated(spec), (name, spec.instance_id)
        scaled = scaled_latency_models(topology)
        assert bool(scaled) == (name != "2x8-a100"), scaled  # the A100-80GB of 2x8-a100 is the measured one
    forty = load_topology("2x8-a100-40gb")
    live = make_sim_backend(BackendConfig(instance_id=forty.instances[0].instance_id, topology=forty))
    assert live.engine.latency_model.step_time_s([], [1000] * 16) == pytest.approx(0.0379, abs=5e-4)


def test_a_model_is_timed_only_if_it_has_the_measured_shape_of_its_name() -> None:
    """A model named llama-2-7b with 80 layers ran, silently, on the 7B's step times; Llama-2-7b-chat-hf (the 7B's
    shape) was refused."""
    import copy

    from llumlet.engine.latency import UnsupportedLatencyModelError, instance_latency_model, load_latency_model
    from topology.load import parse_topology
    from topology.synthetic import synthetic_topology_data

    data = synthetic_topology_data(1)  # one 8-GPU H100 node of TP1 Llama-2-7B instances
    chat = copy.deepcopy(data)
    chat["models"][0]["name"] = "Llama-2-7b-chat-hf"
    for domain in chat["domains"]:
        for instance in domain["instances"]:
            instance["model"] = "Llama-2-7b-chat-hf"
    topology = parse_topology(chat, "chat.yaml")
    first = topology.instances[0].instance_id
    assert instance_latency_model(topology, first) == (load_latency_model("llama-2-7b", "h100", 1), None)
    fp8 = copy.deepcopy(data)
    fp8["models"][0]["dtype"] = "float8"  # timed as fp16 (the same TTFT and TBT), silently
    with pytest.raises(UnsupportedLatencyModelError, match=r"is float8: the measured llama-2-7b ran in 16-bit"):
        instance_latency_model(parse_topology(fp8, "fp8.yaml"), first)
    data["models"][0]["num_layers"] = 80
    topology = parse_topology(data, "fake.yaml")
    with pytest.raises(UnsupportedLatencyModelError) as exc:
        instance_latency_model(topology, first)
    assert str(exc.value) == (
        f"instance {first}: model llama-2-7b has 80 layers, 32 attention heads, 32 KV heads of 128, not the shape of "
        "the measured llama-2-7b (32, 32, 32 of 128): it would be timed as another model"
    )
