"""Fit the engine step-time model on the measured timing data and write latency_coefficients.json.

Usage::

    PYTHONPATH=. python bench/fit_latency.py [--data-dir shared/data] [--report]
        [--out llumlet/engine/latency_coefficients.json]

Inputs (all under ``--data-dir``, see its README.md):

- ``vidur_profiling/compute/{a100,h100}/Llama-2-{7b,70b}-hf/mlp.csv`` (Vidur, MIT): per-layer non-attention
  operator times vs tokens in the batch, per TP degree. Llama-2-13B is the 7B table scaled by the ratio of
  per-layer linear FLOPs (= weight bytes) 13B/7B = 1.567.
- ``vidur_profiling/network/{a100,h100}_dgx/all_reduce.csv`` (Vidur, MIT): two all-reduces per layer of
  ``T · hidden · 2`` (Vidur predictor's convention: ``size`` in bytes).
- ``vidur_profiling/legacy/a100_attention_llama2-70b-shape_tp2.csv.gz`` (Vidur, MIT): FlashAttention prefill
  and decode kernels for 32 query heads / 4 KV heads per GPU (head dim 128). Prefill scales with query heads
  per GPU, decode with KV heads per GPU; H100 scales prefill by the dense fp16 tensor-FLOP ratio
  312/989 TFLOP/s and decode by the HBM bandwidth ratio 2.039/3.35 TB/s (A100-80GB SXM / H100 SXM).
- ``muxserve/llama.json`` (MuxServe, Apache-2.0): full prefill / decode steps, LLaMA-7B/13B on A100.
- ``splitwise_sim/perf_model.csv`` (Splitwise, MIT): Llama-2-70B prompt and per-token times, A100/H100.

The fit: per (model, gpu, tp) with targets, non-negative least squares on relative error for
``t = k·gpu_ms + a + e·n_seqs + g·[prefill]`` (see ``llumlet/engine/latency.py``). H100 7B/13B have no
end-to-end targets: they reuse the A100 (k, a, e, g) of the same model and TP.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median

import numpy as np
from scipy.optimize import nnls

from llumlet.engine.latency import LatencyModel

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "llumlet" / "engine" / "latency_coefficients.json"

# Model shapes (Llama-2 configs on Hugging Face).
MODELS: dict[str, dict[str, int | str]] = {
    "llama-2-7b": {"layers": 32, "hidden": 4096, "q_heads": 32, "kv_heads": 32, "ffn": 11008},
    "llama-2-13b": {"layers": 40, "hidden": 5120, "q_heads": 40, "kv_heads": 40, "ffn": 13824},
    "llama-2-70b": {"layers": 80, "hidden": 8192, "q_heads": 64, "kv_heads": 8, "ffn": 28672},
}
VIDUR_DIR = {"llama-2-7b": "Llama-2-7b-hf", "llama-2-13b": "Llama-2-7b-hf", "llama-2-70b": "Llama-2-70b-hf"}
COMBOS: list[tuple[str, str, int]] = [
    ("llama-2-7b", "a100", 1),
    ("llama-2-7b", "a100", 2),
    ("llama-2-7b", "h100", 1),
    ("llama-2-7b", "h100", 2),
    ("llama-2-13b", "a100", 1),
    ("llama-2-13b", "a100", 2),
    ("llama-2-13b", "a100", 4),
    ("llama-2-13b", "h100", 1),
    ("llama-2-13b", "h100", 2),
    ("llama-2-70b", "a100", 2),
    ("llama-2-70b", "a100", 4),
    ("llama-2-70b", "a100", 8),
    ("llama-2-70b", "h100", 2),
    ("llama-2-70b", "h100", 4),
    ("llama-2-70b", "h100", 8),
]
# GPU scaling of the A100 attention profile (datasheet values, dense fp16 tensor / HBM).
PREFILL_FLOP_RATIO = {"a100": 1.0, "h100": 312.0 / 989.0}
DECODE_BW_RATIO = {"a100": 1.0, "h100": 2.039 / 3.35}
REF_Q_HEADS, REF_KV_HEADS = 32, 4  # per GPU in the legacy attention file (70B shape, TP2)
LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
)
EXTRAPOLATE_TO_TOKENS = 131072  # extra knot: line fitted to knots >= 1024 tokens
MUXSERVE_NAMES = {"llama-2-7b": "llama-7b", "llama-2-13b": "llama-13b"}
SPLITWISE_HW = {"a100": "a100-80gb", "h100": "h100-80gb"}


@dataclass(frozen=True, slots=True)
class Target:
    """One measured step: batch shape and measured time in ms."""

    source: str  # "muxserve" | "splitwise"
    phase: str  # "prefill" | "decode"
    prefill_chunks: tuple[tuple[int, int], ...]
    decode_context_tokens: tuple[int, ...]
    measured_ms: float
    label: str


def _flops_per_layer(m: dict[str, int | str]) -> float:
    h, f = int(m["hidden"]), int(m["ffn"])
    return 4.0 * h * h + 3.0 * h * f


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    if x <= xs[0]:
        return ys[0] * x / xs[0] if x > 0 else 0.0
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])
    return float(np.interp(x, xs, ys))


def load_vidur_linear(data: Path, gpu: str, model: str, tp: int) -> tuple[list[int], list[float], list[float]]:
    """Per-layer linear-op ms and embedding ms vs num_tokens (median over duplicate rows)."""
    path = data / "vidur_profiling" / "compute" / gpu / VIDUR_DIR[model] / "mlp.csv"
    per_layer: dict[int, list[float]] = defaultdict(list)
    emb: dict[int, list[float]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            if int(row["num_tensor_parallel_workers"]) != tp:
                continue
            n = int(row["num_tokens"])
            ops = sum(float(row[f"time_stats.{op}.median"]) for op in LAYER_OPS)
            ops += 2.0 * float(row["time_stats.add.median"])  # two residual adds per layer
            per_layer[n].append(ops)
            emb[n].append(float(row["time_stats.emb.median"]))
    if not per_layer:
        raise SystemExit(f"{path}: no rows for TP {tp}")
    tokens = sorted(per_layer)
    return tokens, [median(per_layer[n]) for n in tokens], [median(emb[n]) for n in tokens]


def load_all_reduce(data: Path, gpu: str, tp: int) -> tuple[list[float], list[float]]:
    """All-reduce ms vs size in bytes (Vidur predictor convention), within one DGX node."""
    path = data / "vidur_profiling" / "network" / f"{gpu}_dgx" / "all_reduce.csv"
    by_size: dict[int, list[float]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            if int(row["num_workers"]) == tp and int(row["devices_per_node"]) == tp:
                by_size[int(row["size"])].append(float(row["time_stats.all_reduce.median"]))
    if not by_size:
        raise SystemExit(f"{path}: no rows for {tp} workers in one node")
    sizes = sorted(by_size)
    return [float(s) for s in sizes], [median(by_size[s]) for s in sizes]


def fit_reference_attention(data: Path) -> dict[str, float]:
    """Fit the legacy A100 attention profile (per layer, 32 q heads / 4 KV heads per GPU).

    prefill_ms = P0 + P1·c·(x + c) + P2·c      (c chunk tokens, x tokens already cached; batch 1)
    decode_ms  = D0 + D1·bs·kv                 (bs requests with kv context tokens each)
    Least squares on relative error, non-negative. Reshape kernels are included in both.
    """
    path = data / "vidur_profiling" / "legacy" / "a100_attention_llama2-70b-shape_tp2.csv.gz"
    pre_a, pre_y, dec_a, dec_y = [], [], [], []
    with gzip.open(path, "rt") as f:
        for row in csv.DictReader(f):
            reshape = sum(
                float(row[f"time_stats.{k}.median"] or 0.0) for k in ("attn_input_reshape", "attn_output_reshape")
            )
            if row["is_prefill"] == "True":
                c, x = float(row["prefill_chunk_size"]), float(row["kv_cache_size"])
                pre_a.append([1.0, c * (x + c), c])
                pre_y.append(float(row["time_stats.attn_prefill.median"]) + reshape)
            else:
                bs, kv = float(row["batch_size"]), float(row["kv_cache_size"])
                dec_a.append([1.0, bs * kv])
                dec_y.append(float(row["time_stats.attn_decode.median"]) + reshape)
    pa, py = np.array(pre_a), np.array(pre_y)
    da, dy = np.array(dec_a), np.array(dec_y)
    p, _ = nnls(pa / py[:, None], np.ones_like(py))
    d, _ = nnls(da / dy[:, None], np.ones_like(dy))
    pre_err = float(np.mean(np.abs(pa @ p - py) / py))
    dec_err = float(np.mean(np.abs(da @ d - dy) / dy))
    return {
        "P0": float(p[0]),
        "P1": float(p[1]),
        "P2": float(p[2]),
        "D0": float(d[0]),
        "D1": float(d[1]),
        "prefill_mape": pre_err,
        "decode_mape": dec_err,
    }


def build_gpu_model(data: Path, model: str, gpu: str, tp: int, attn: dict[str, float]) -> LatencyModel:
    """The unfitted composition (k = 1, no overheads) for one combination."""
    shape = MODELS[model]
    layers, hidden = int(shape["layers"]), int(shape["hidden"])
    tokens, per_layer, emb = load_vidur_linear(data, gpu, model, tp)
    scale = _flops_per_layer(shape) / _flops_per_layer(MODELS["llama-2-7b"]) if model == "llama-2-13b" else 1.0
    if tp > 1:
        ar_sizes, ar_ms = load_all_reduce(data, gpu, tp)
    token_ms = []
    for n, op_ms, e_ms in zip(tokens, per_layer, emb, strict=True):
        ar = 2.0 * _interp(n * hidden * 2.0, ar_sizes, ar_ms) if tp > 1 else 0.0
        token_ms.append(layers * (scale * op_ms + ar) + e_ms)
    # Extrapolation knot from a line through the large-batch knots (the last segment alone is noisy).
    big = [(n, t) for n, t in zip(tokens, token_ms, strict=True) if n >= 1024]
    slope, icpt = np.polyfit([n for n, _ in big], [t for _, t in big], 1)
    tokens.append(EXTRAPOLATE_TO_TOKENS)
    token_ms.append(float(slope * EXTRAPOLATE_TO_TOKENS + icpt))
    mono = list(np.maximum.accumulate(token_ms))
    q_scale = (int(shape["q_heads"]) / tp) / REF_Q_HEADS
    kv_scale = (int(shape["kv_heads"]) / tp) / REF_KV_HEADS
    return LatencyModel(
        model=model,
        gpu=gpu,
        tensor_parallel_size=tp,
        token_knots=tuple(tokens),
        token_ms=tuple(round(float(t), 5) for t in mono),
        prefill_attn_fixed_ms=layers * attn["P0"],
        prefill_attn_ms_per_work=layers * attn["P1"] * q_scale * PREFILL_FLOP_RATIO[gpu],
        prefill_attn_ms_per_token=layers * attn["P2"] * q_scale * PREFILL_FLOP_RATIO[gpu],
        decode_attn_fixed_ms=layers * attn["D0"],
        decode_attn_ms_per_kv_token=layers * attn["D1"] * kv_scale * DECODE_BW_RATIO[gpu],
    )


def muxserve_targets(data: Path, model: str, tp: int) -> list[Target]:
    """MuxServe full steps at 100% SM: prefill of bs×seq and one decode step of bs at context seq."""
    name = MUXSERVE_NAMES.get(model)
    if name is None:
        return []
    table = json.loads((data / "muxserve" / "llama.json").read_text())
    grid = table.get(name, {}).get(str(tp), {}).get("100", {})
    out: list[Target] = []
    for bs_s, by_seq in grid.items():
        for seq_s, entry in by_seq.items():
            bs, seq = int(bs_s), int(seq_s)
            label = f"{name} tp{tp} bs{bs} seq{seq}"
            # -1 marks a point MuxServe could not run (out of memory): skipped.
            if float(entry["prefill"]) > 0:
                out.append(Target("muxserve", "prefill", ((seq, 0),) * bs, (), float(entry["prefill"]), label))
            if float(entry["decoding"]) > 0:
                out.append(Target("muxserve", "decode", (), (seq,) * bs, float(entry["decoding"]), label))
    return out


def splitwise_targets(data: Path, model: str, gpu: str, tp: int) -> list[Target]:
    """Splitwise Llama-2-70B: prompt_time (prefill of bs prompts) and token_time (mean decode iteration,
    context taken as prompt + output/2), averaged over the 5 repeats of each grid point."""
    if model != "llama-2-70b":
        return []
    prompt: dict[tuple[int, int], list[float]] = defaultdict(list)
    token: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    with (data / "splitwise_sim" / "perf_model.csv").open() as f:
        for row in csv.DictReader(f):
            if (row["model"], row["hardware"], int(row["tensor_parallel"])) != (
                "llama2-70b",
                SPLITWISE_HW[gpu],
                tp,
            ):
                continue
            p, b, o = int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"])
            prompt[(p, b)].append(float(row["prompt_time"]))
            token[(p, b, o)].append(float(row["token_time"]))
    out = []
    best_smaller: dict[int, float] = {}
    for (p, b), ts in sorted(prompt.items()):
        t = float(np.mean(ts))
        # A prompt batch faster than a smaller batch of the same prompts is not a consistent measurement
        # (Llama-2-70B TP2, prompt 512, bs 64 on A100 and H100: below bs 8): skipped.
        if t < best_smaller.get(p, 0.0):
            continue
        best_smaller[p] = max(best_smaller.get(p, 0.0), t)
        out.append(Target("splitwise", "prefill", ((p, 0),) * b, (), t, f"p{p} bs{b}"))
    for (p, b, o), ts in sorted(token.items()):
        ctx = p + o // 2
        out.append(Target("splitwise", "decode", (), (ctx,) * b, float(np.mean(ts)), f"p{p} bs{b} out{o}"))
    return out


def fit_overheads(base: LatencyModel, targets: Iterable[Target]) -> LatencyModel:
    """NNLS on relative error for (k, a, e, g) in t = k·gpu + a + e·n_seqs + g·[prefill]."""
    rows, ys = [], []
    for t in targets:
        gpu = base.gpu_time_ms(t.prefill_chunks, t.decode_context_tokens)
        n = len(t.prefill_chunks) + len(t.decode_context_tokens)
        rows.append([gpu, 1.0, float(n), 1.0 if t.prefill_chunks else 0.0])
        ys.append(t.measured_ms)
    a, y = np.array(rows), np.array(ys)
    x, _ = nnls(a / y[:, None], np.ones_like(y))
    return replace(
        base,
        gpu_scale=round(float(x[0]), 6),
        step_overhead_ms=round(float(x[1]), 6),
        per_seq_overhead_ms=round(float(x[2]), 6),
        prefill_overhead_ms=round(float(x[3]), 6),
    )


def mape(model: LatencyModel, targets: Sequence[Target]) -> float:
    """Mean absolute percentage error (fraction) of ``model`` on ``targets``."""
    errs = [
        abs(model.step_time_s(t.prefill_chunks, t.decode_context_tokens) * 1000.0 - t.measured_ms) / t.measured_ms
        for t in targets
    ]
    return float(np.mean(errs)) if errs else float("nan")


def _coeffs(m: LatencyModel) -> str:
    return f"{m.gpu_scale:.3f} | {m.step_overhead_ms:.2f} | {m.per_seq_overhead_ms:.3f} | {m.prefill_overhead_ms:.2f}"


def fit_all(data: Path) -> tuple[dict[str, LatencyModel], list[str]]:
    """Fit every combination; returns the models by key and markdown report lines."""
    attn = fit_reference_attention(data)
    report = [
        f"Reference attention fit (A100, per layer): prefill MAPE {attn['prefill_mape']:.1%}, "
        f"decode MAPE {attn['decode_mape']:.1%}",
        "",
        "| model | gpu | tp | source | phase | n | MAPE unfitted | MAPE fitted | k | a ms | e ms | g ms |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fitted: dict[tuple[str, int], LatencyModel] = {}
    models: dict[str, LatencyModel] = {}
    for model, gpu, tp in COMBOS:
        base = build_gpu_model(data, model, gpu, tp, attn)
        targets = muxserve_targets(data, model, tp) if gpu == "a100" else []
        targets += splitwise_targets(data, model, gpu, tp)
        if targets:
            final = fit_overheads(base, targets)
            fitted[(model, tp)] = final
        elif (model, tp) in fitted:
            src = fitted[(model, tp)]
            final = replace(
                base,
                gpu_scale=src.gpu_scale,
                step_overhead_ms=src.step_overhead_ms,
                per_seq_overhead_ms=src.per_seq_overhead_ms,
                prefill_overhead_ms=src.prefill_overhead_ms,
            )
        else:
            raise SystemExit(f"{model}/{gpu}/tp{tp}: no targets and no A100 fit to borrow")
        models[f"{model}/{gpu}/tp{tp}"] = final
        for source in ("muxserve", "splitwise"):
            for phase in ("prefill", "decode"):
                sel = [t for t in targets if t.source == source and t.phase == phase]
                if sel:
                    report.append(
                        f"| {model} | {gpu} | {tp} | {source} | {phase} | {len(sel)} | "
                        f"{mape(base, sel):.1%} | {mape(final, sel):.1%} | {_coeffs(final)} |"
                    )
        if not targets:
            report.append(f"| {model} | {gpu} | {tp} | (none: A100 k,a,e,g) | | | | | {_coeffs(final)} |")
    return models, report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_data = REPO / "shared" / "data"
    if not default_data.exists():
        default_data = Path("/work/shared/data")
    parser.add_argument("--data-dir", type=Path, default=default_data)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report", action="store_true", help="print the calibration table (markdown)")
    args = parser.parse_args(argv)
    models, report = fit_all(args.data_dir)
    doc = {
        "description": "Step-time coefficients for llumlet.engine.latency.LatencyModel (ms); "
        "written by bench/fit_latency.py. See docs/engine-model.md.",
        "attribution": [
            "Vidur profiling data (microsoft/vidur), MIT License",
            "MuxServe examples/placement/llama.json (hao-ai-lab/MuxServe), Apache-2.0 (setup.py)",
            "Splitwise data/perf_model.csv (Mutinifni/splitwise-sim), MIT License",
        ],
        "models": {key: m.to_mapping() for key, m in models.items()},
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.report:
        print("\n".join(report))
    print(f"wrote {len(models)} models to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
