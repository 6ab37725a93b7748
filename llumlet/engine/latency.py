"""Step-time model: prices one scheduled batch (prefill chunks + decodes) in seconds.

The model only prices a batch that the scheduler already formed; it never chooses. Its form, per
(model, GPU type, tensor-parallel degree), is (all terms in milliseconds, see docs/engine-model.md)::

    t = k · ( token_ms(T)                                   # linear ops + TP all-reduce, T = tokens in batch
              + [any prefill] · P0 + P1 · Σ c·(x + c) + P2 · Σ c    # prefill attention, chunk c, context x
              + [any decode]  · D0 + D1 · Σ kv )                  # decode attention, kv = context per request
        + a + e · n_seqs + g · [any prefill]                       # fitted CPU / framework overhead

``token_ms`` is piecewise linear in ``T`` (knots from Vidur's per-operator ``mlp.csv`` profile, all layers,
plus two all-reduces per layer from Vidur's ``all_reduce.csv``), extrapolated linearly from its last segment.
The attention terms come from Vidur's measured A100 FlashAttention profile (Llama-2-70B shape, TP2), scaled
to each model's heads per GPU and, for H100, by the HBM-bandwidth (decode) and tensor-FLOP (prefill) ratios.
``k``, ``a``, ``e``, ``g`` are fitted by ``bench/fit_latency.py`` on MuxServe full-step measurements
(Llama-7B/13B, A100) and Splitwise prompt/token times (Llama-2-70B, A100/H100).

Data attribution: Vidur (microsoft/vidur, MIT), MuxServe (hao-ai-lab/MuxServe, Apache-2.0),
Splitwise (Mutinifni/splitwise-sim, MIT).
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import itertools
import json
import math
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np
from mypy_extensions import mypyc_attr

if TYPE_CHECKING:
    from topology.spec import Topology

__all__ = [
    "CALIBRATED_HBM_BYTES_PER_S",
    "COEFFICIENTS_FILE",
    "MEASURED_SHAPES",
    "VECTOR_MIN_STEPS",
    "DecodeStepTimes",
    "LatencyModel",
    "UnsupportedLatencyModelError",
    "derive_latency_model",
    "gpu_latency_model",
    "instance_latency_model",
    "latency_model_problems",
    "load_latency_model",
    "packed_doubles",
    "packed_from_numpy",
    "scaled_latency_models",
    "scaled_note",
    "steps_ended_guess",
    "supported_latency_models",
]

COEFFICIENTS_FILE = "latency_coefficients.json"


_DOUBLES_PACKERS: dict[int, Callable[..., bytes]] = {}  # n -> struct.Struct(f"{n}d").pack, for packed_doubles

#: From this many values on, the per-step figures of a decode run are computed by numpy over packed doubles
#: (the same IEEE operations, element by element, in the same order: bit for bit the same results) rather than
#: one float object at a time; below it numpy's fixed cost of a few µs a call is more than it saves. Runs plan
#: about 270 steps on average (a ShareGPT load at 0.5 requests/s per instance), two in three 128 or more.
VECTOR_MIN_STEPS: int = 96


def packed_from_numpy(values: np.ndarray[Any, np.dtype[np.float64]]) -> array.array[float]:
    """The doubles of a 1-D float64 numpy array, shape (n,), as an ``array('d')`` of length n (one copy of the
    bytes): how the vectorized paths (``VECTOR_MIN_STEPS``) hand back what :func:`packed_doubles` would."""
    packed = array.array("d")
    packed.frombytes(values.tobytes())
    return packed


def packed_doubles(values: Sequence[float]) -> array.array[float]:
    """``array.array("d", values)``, the same doubles, at a fraction of its cost: the array's own constructor (and
    ``extend``, ``fromlist``) parses every item with ``PyArg_Parse``, where a ``struct.Struct`` of ``n`` doubles,
    kept per length ``n``, reads each float directly (a microbenchmark: 0.36 µs against 0.41 for 20 items, 1.4
    against 3.5 for 200). Raises struct.error for an item that is not a real number a double can hold (an int
    beyond a double's range included: struct then says "required argument is not a float")."""
    n = len(values)
    pack = _DOUBLES_PACKERS.get(n)
    if pack is None:
        pack = struct.Struct(f"{n}d").pack
        if n <= 4096:  # the lengths of decode runs and their segments; a longer one is rare, and not kept
            _DOUBLES_PACKERS[n] = pack
    return array.array("d", pack(*values))


@mypyc_attr(native_class=False)  # mypyc compiles no native subclass of KeyError (the simulator compiles this module)
class UnsupportedLatencyModelError(KeyError):
    """No coefficients for the requested (model, gpu, tp); the message lists the supported combinations."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unsupported latency model"


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Step-time model for one (model, GPU type, tensor-parallel degree). Pure; holds no clock.

    Fields are coefficients in milliseconds (the JSON's units); ``step_time_s`` returns seconds.
    """

    model: str  # e.g. "llama-2-7b"
    gpu: str  # "a100" | "h100"
    tensor_parallel_size: int  # GPUs per instance
    token_knots: tuple[int, ...]  # tokens in the batch, strictly increasing, first >= 1
    token_ms: tuple[float, ...]  # ms at each knot: all layers' linear ops + all-reduce (+ embedding)
    prefill_attn_fixed_ms: float  # ms per step that contains any prefill chunk
    prefill_attn_ms_per_work: float  # ms per unit of chunk·(context_before + chunk)
    prefill_attn_ms_per_token: float  # ms per prefill token
    decode_attn_fixed_ms: float  # ms per step that contains any decode
    decode_attn_ms_per_kv_token: float  # ms per KV token read by decodes
    gpu_scale: float = 1.0  # fitted k: profiled kernel time -> end-to-end GPU time
    step_overhead_ms: float = 0.0  # fitted a: per step
    per_seq_overhead_ms: float = 0.0  # fitted e: per sequence in the batch
    prefill_overhead_ms: float = 0.0  # fitted g: per step that contains any prefill

    def __post_init__(self) -> None:
        where = f"LatencyModel({self.model}, {self.gpu}, tp={self.tensor_parallel_size})"
        if len(self.token_knots) < 2 or len(self.token_knots) != len(self.token_ms):
            raise ValueError(f"{where}: token_knots and token_ms need the same length >= 2")
        if self.token_knots[0] < 1 or any(b <= a for a, b in zip(self.token_knots, self.token_knots[1:], strict=False)):
            raise ValueError(f"{where}: token_knots must be strictly increasing and start at >= 1")
        if any(b < a for a, b in zip(self.token_ms, self.token_ms[1:], strict=False)) or self.token_ms[0] < 0:
            raise ValueError(f"{where}: token_ms must be non-negative and non-decreasing")
        coeffs = (
            self.prefill_attn_fixed_ms,
            self.prefill_attn_ms_per_work,
            self.prefill_attn_ms_per_token,
            self.decode_attn_fixed_ms,
            self.decode_attn_ms_per_kv_token,
            self.gpu_scale,
            self.step_overhead_ms,
            self.per_seq_overhead_ms,
            self.prefill_overhead_ms,
        )
        if any(c < 0 for c in coeffs):
            raise ValueError(f"{where}: coefficients must be non-negative, got {coeffs}")

    def token_time_ms(self, num_tokens: int) -> float:
        """Piecewise-linear ``token_ms(T)``; linear extrapolation beyond the last knot, 0 for T <= 0."""
        if num_tokens <= 0:
            return 0.0
        knots, ms = self.token_knots, self.token_ms
        if num_tokens <= knots[0]:
            return ms[0]
        i = bisect.bisect_left(knots, num_tokens)
        if i >= len(knots):
            i = len(knots) - 1
        x0, x1, y0, y1 = knots[i - 1], knots[i], ms[i - 1], ms[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)

    def gpu_time_ms(self, prefill_chunks: Sequence[tuple[int, int]], decode_context_tokens: Sequence[int]) -> float:
        """Unscaled GPU part of a step in ms (before ``gpu_scale`` and overheads)."""
        num_tokens = len(decode_context_tokens)
        work = 0.0
        for chunk, before in prefill_chunks:
            num_tokens += chunk
            work += float(chunk) * float(before + chunk)
        t = self.token_time_ms(num_tokens)
        if prefill_chunks:
            chunk_tokens = sum(c for c, _ in prefill_chunks)
            t += (
                self.prefill_attn_fixed_ms
                + self.prefill_attn_ms_per_work * work
                + self.prefill_attn_ms_per_token * chunk_tokens
            )
        if decode_context_tokens:
            t += self.decode_attn_fixed_ms + self.decode_attn_ms_per_kv_token * sum(decode_context_tokens)
        return t

    def step_time_s(self, prefill_chunks: Sequence[tuple[int, int]], decode_context_tokens: Sequence[int]) -> float:
        """Duration of one engine step in seconds.

        Args:
            prefill_chunks: one ``(chunk_tokens, context_tokens_before)`` per request prefilled in this step;
                ``chunk_tokens >= 1``, ``context_tokens_before >= 0`` (tokens already in its KV cache).
            decode_context_tokens: one entry per decoding request: its KV context length in tokens
                (including the token being decoded), each ``>= 1``.

        Returns: seconds; 0.0 for an empty batch.
        Raises: ValueError on a non-positive chunk, negative context, or non-positive decode context.
        """
        for i, (chunk, before) in enumerate(prefill_chunks):
            if chunk < 1 or before < 0:
                raise ValueError(f"prefill_chunks[{i}] = ({chunk}, {before}): need chunk_tokens >= 1, context >= 0")
        for i, ctx in enumerate(decode_context_tokens):
            if ctx < 1:
                raise ValueError(f"decode_context_tokens[{i}] = {ctx}: need >= 1")
        n_seqs = len(prefill_chunks) + len(decode_context_tokens)
        if n_seqs == 0:
            return 0.0
        ms = self.gpu_scale * self.gpu_time_ms(prefill_chunks, decode_context_tokens)
        ms += self.step_overhead_ms + self.per_seq_overhead_ms * n_seqs
        if prefill_chunks:
            ms += self.prefill_overhead_ms
        return ms / 1000.0

    def decode_step_times(self, num_seqs: int, first_kv_tokens: int) -> DecodeStepTimes:
        """The step times of consecutive pure decode steps of the same ``num_seqs`` requests, ``first_kv_tokens``
        KV tokens read in all at the first (each request gains one token of context per step), in closed form
        (:class:`DecodeStepTimes`).

        Raises ValueError for ``num_seqs < 1`` or ``first_kv_tokens < num_seqs`` (a context is >= 1 token).
        """
        if num_seqs < 1 or first_kv_tokens < num_seqs:
            raise ValueError(
                f"decode_step_times({num_seqs}, {first_kv_tokens}): need num_seqs >= 1, first_kv_tokens >= num_seqs"
            )
        return DecodeStepTimes(
            num_seqs,
            first_kv_tokens,
            self.token_time_ms(num_seqs),
            self.step_overhead_ms + self.per_seq_overhead_ms * num_seqs,
            self.gpu_scale,
            self.decode_attn_fixed_ms,
            self.decode_attn_ms_per_kv_token,
        )

    def decode_step_times_s(self, num_seqs: int, first_kv_tokens: int, num_steps: int) -> array.array[float]:
        """Durations (seconds) of ``num_steps`` consecutive pure decode steps of the same ``num_seqs`` requests:
        ``decode_step_times(num_seqs, first_kv_tokens).durations_s(num_steps)``.

        Raises ValueError for ``num_seqs < 1``, ``first_kv_tokens < num_seqs`` (a context is >= 1 token) or
        ``num_steps < 0``.
        """
        if num_steps < 0:
            raise ValueError(f"decode_step_times_s({num_seqs}, {first_kv_tokens}, {num_steps}): need num_steps >= 0")
        return self.decode_step_times(num_seqs, first_kv_tokens).durations_s(num_steps)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LatencyModel:
        """Build from one entry of ``latency_coefficients.json`` (field names as in this class)."""
        fields = dict(data)
        fields["token_knots"] = tuple(int(x) for x in fields["token_knots"])
        fields["token_ms"] = tuple(float(x) for x in fields["token_ms"])
        fields["tensor_parallel_size"] = int(fields["tensor_parallel_size"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in fields.items() if k in known})

    def to_mapping(self) -> dict[str, Any]:
        """Inverse of :meth:`from_mapping` (JSON-ready)."""
        return {
            name: (list(getattr(self, name)) if name in ("token_knots", "token_ms") else getattr(self, name))
            for name in self.__dataclass_fields__
        }


def steps_ended_guess(a_s: float, b_s: float, elapsed_s: float) -> int:
    """About how many steps of a decode run have ended ``elapsed_s`` seconds after its first started, step ``j``
    lasting ``a_s + b_s · j`` (:meth:`DecodeStepTimes.linear_s`): the least ``n`` with ``t_0 + ... + t_n >=
    elapsed_s``, the closed form of the sum solved for ``n``. A guess, a step or so off where the rounding of the end
    times a caller holds (:meth:`DecodeStepTimes.end_times_s`, summed step by step) differs from the formula's: the
    caller checks it against them. 0 for ``elapsed_s <= 0`` or a model without a sensible root; never negative.

    The root is taken as ``2e / (A + sqrt(A² + 2be))`` (``A = a - b/2``), free of the cancellation of the textbook
    form when ``b`` is small next to ``a`` (Goldberg, "What every computer scientist should know about
    floating-point arithmetic", 1991, §1.4).
    """
    if not elapsed_s > 0.0 or not a_s > 0.0 or not b_s >= 0.0:
        return 0
    half = a_s - b_s / 2.0
    x = 2.0 * elapsed_s / (half + math.sqrt(half * half + 2.0 * b_s * elapsed_s))  # steps, with the one in flight
    if not x < 1e15:  # inf from an absurd model, or beyond any run
        return 0
    return max(0, math.ceil(x) - 1)


class DecodeStepTimes:
    """The step times of a run of pure decode steps of the same ``num_seqs`` requests
    (:meth:`LatencyModel.decode_step_times`), in closed form.

    Step ``j`` (from 0) reads ``first_kv_tokens + j · num_seqs`` KV tokens in all and lasts
    ``(k · (token_ms(B) + D0 + D1 · Σkv_j) + a + e · B) / 1000`` seconds: exactly (bit for bit, the same
    floating-point operations in the same order) ``LatencyModel.step_time_s([], contexts_j)``, with the terms that
    do not depend on ``j`` computed once. Nothing per step is kept: a simulated cluster of thousands of instances
    holds thousands of runs, most cut long before their planned end, and a step's time is read by its index
    (:meth:`step_s`). The runs' figures over many steps (:meth:`durations_s`, :meth:`end_times_s`) come as packed
    doubles (``array('d')``), from ``VECTOR_MIN_STEPS`` steps on by numpy, operation by operation in the same order
    (the same doubles).
    """

    __slots__ = ("_d0_ms", "_d1_ms", "_k", "_overhead_ms", "_token_ms", "first_kv_tokens", "num_seqs")

    def __init__(
        self, num_seqs: int, first_kv_tokens: int, token_ms: float, overhead_ms: float, k: float, d0: float, d1: float
    ) -> None:
        self.num_seqs = num_seqs  # B, the batch
        self.first_kv_tokens = first_kv_tokens  # Σkv at the first step
        self._token_ms = token_ms  # token_ms(B)
        self._overhead_ms = overhead_ms  # a + e · B
        self._k = k
        self._d0_ms = d0  # D0
        self._d1_ms = d1  # D1, per KV token

    def step_s(self, j: int) -> float:
        """Duration of step ``j`` (from 0), seconds."""
        kv = self.first_kv_tokens + j * self.num_seqs
        return (self._k * (self._token_ms + (self._d0_ms + self._d1_ms * kv)) + self._overhead_ms) / 1000.0

    def linear_s(self) -> tuple[float, float]:
        """``(a, b)``, seconds: step ``j`` lasts ``a + b · j`` (up to rounding), ``a = step_s(0)`` and
        ``b = k · D1 · B / 1000`` (the batch's KV grows by ``B`` tokens a step). For :func:`steps_ended_guess`."""
        return self.step_s(0), self._k * self._d1_ms * self.num_seqs / 1000.0

    def linear_slop_s(self, num_steps: int) -> float:
        """A bound, seconds, on how far each of steps 0 .. ``num_steps`` - 1 as computed (:meth:`step_s`) lies from
        the line of :meth:`linear_s` (``a + b · j`` for the doubles ``a``, ``b``, in exact arithmetic).

        Exactly, the formula is linear in ``j``; the doubles differ from it by their roundings alone: about ten, each
        at most half an ulp of a value no larger than the sum of the formula's terms' magnitudes ``M`` (the largest
        step's, seconds), so ``|step_s(j) - (a + b·j)| <= 10 eps M``. The bound returned is ``64 eps M``. inf (or
        nan) for a model without finite terms."""
        kv_max = self.first_kv_tokens + max(num_steps, 1) * self.num_seqs
        magnitude_ms = abs(self._k) * (abs(self._token_ms) + abs(self._d0_ms) + abs(self._d1_ms) * kv_max)
        return 64.0 * sys.float_info.epsilon * (magnitude_ms + abs(self._overhead_ms)) / 1000.0

    def durations_s(self, num_steps: int) -> array.array[float]:
        """Durations of steps 0 .. ``num_steps`` - 1, seconds (packed doubles)."""
        if num_steps >= VECTOR_MIN_STEPS:
            return packed_from_numpy(self._vector(num_steps))
        return packed_doubles(self._floats(num_steps))

    def end_times_s(self, start_s: float, num_steps: int) -> array.array[float]:
        """When steps 0 .. ``num_steps`` - 1 end when the first starts at ``start_s``: ``start_s`` plus the durations
        up to each, added one after another in step order, as one event per step advances a clock (numpy's
        cumulative sum adds in that order too, one double at a time). Packed doubles."""
        if num_steps >= VECTOR_MIN_STEPS:
            sums = np.empty(num_steps + 1)
            sums[0] = start_s
            sums[1:] = self._vector(num_steps)
            np.cumsum(sums, out=sums)
            return packed_from_numpy(sums[1:])
        ends = list(itertools.accumulate(self._floats(num_steps), initial=start_s))
        del ends[0]
        return packed_doubles(ends)

    def _floats(self, num_steps: int) -> list[float]:
        """:meth:`durations_s` one float at a time (below ``VECTOR_MIN_STEPS``)."""
        k, token_ms, d0, d1, overhead_ms = self._k, self._token_ms, self._d0_ms, self._d1_ms, self._overhead_ms
        first, b = self.first_kv_tokens, self.num_seqs
        last = first + num_steps * b
        return [(k * (token_ms + (d0 + d1 * kv)) + overhead_ms) / 1000.0 for kv in range(first, last, b)]

    def _vector(self, num_steps: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        """:meth:`durations_s` by numpy: the formula of :meth:`step_s` applied operation by operation, in place."""
        first = self.first_kv_tokens
        t = np.arange(first, first + num_steps * self.num_seqs, self.num_seqs, dtype=np.float64)  # exact below 2**53
        t *= self._d1_ms
        t += self._d0_ms
        t += self._token_ms
        t *= self._k
        t += self._overhead_ms
        t /= 1000.0
        return t

    def __repr__(self) -> str:
        return f"DecodeStepTimes(num_seqs={self.num_seqs}, first_kv_tokens={self.first_kv_tokens})"


def _model_key(model: str, gpu: str, tp: int) -> str:
    return f"{model.lower()}/{gpu.lower()}/tp{tp}"


def _normalize_model(model: str) -> str:
    m = model.lower().replace("_", "-")
    for prefix in ("meta-llama/", "llama2-", "llama-2-"):
        if m.startswith(prefix):
            m = m[len(prefix) :]
    m = m.removesuffix("-hf").removesuffix("-chat").removeprefix("llama-2-").removeprefix("llama-")  # chat: same shape
    return f"llama-2-{m}"


def _normalize_gpu(gpu: str) -> str:
    g = gpu.lower()
    for name in ("a100", "h100"):
        if g.startswith(name) or g.startswith(f"nvidia-{name}"):
            return name
    return g


def _load_table() -> dict[str, Any]:
    text = resources.files("llumlet.engine").joinpath(COEFFICIENTS_FILE).read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def supported_latency_models() -> list[tuple[str, str, int]]:
    """All shipped (model, gpu, tp) combinations, sorted."""
    out = []
    for entry in _load_table()["models"].values():
        out.append((str(entry["model"]), str(entry["gpu"]), int(entry["tensor_parallel_size"])))
    return sorted(out)


def load_latency_model(model: str, gpu: str, tp: int) -> LatencyModel:
    """Load the fitted step-time model for ``model`` on ``gpu`` at tensor-parallel degree ``tp``.

    Model names accept ``llama-2-7b``, ``Llama-2-7b-hf``, ``meta-llama/Llama-2-7b-hf``, ``llama2-70b``,
    ``7b``; GPU names accept ``a100``, ``A100-80GB``, ``h100``, ``H100-SXM``.

    Raises:
        UnsupportedLatencyModelError: no coefficients for that combination (the message lists them all).
    """
    table = _load_table()["models"]
    key = _model_key(_normalize_model(model), _normalize_gpu(gpu), tp)
    if key not in table:
        combos = _measured_combinations()
        raise UnsupportedLatencyModelError(
            f"no latency model for model={model!r} gpu={gpu!r} tp={tp} (looked up {key!r}); supported: {combos}"
        )
    return LatencyModel.from_mapping(table[key])


#: The shapes of the measured models (layers, attention heads, KV heads, head dim; Meta's Llama 2 model cards): a
#: topology's model of one of these names must have its shape, or it would be timed as another model.
MEASURED_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "llama-2-7b": (32, 32, 32, 128),
    "llama-2-13b": (40, 40, 40, 128),
    "llama-2-70b": (80, 64, 8, 128),
}

#: HBM bandwidth of the calibrated GPUs (datasheets: A100 80GB SXM, H100 SXM), bytes/s.
CALIBRATED_HBM_BYTES_PER_S: dict[str, float] = {"a100": 2.039e12, "h100": 3.35e12}


def derive_latency_model(
    model: str, gpu: str, tp: int, hbm_bytes_per_s: float, *, reference_gpu: str = "h100"
) -> LatencyModel:
    """A step-time model for a GPU with no measured data, scaled from a calibrated one.

    The reference GPU's fitted model is taken as is, and its GPU time (``gpu_scale``; the CPU overheads
    stay) is multiplied by ``reference HBM bandwidth / hbm_bytes_per_s``: decode, which dominates
    serving, is bound by reading weights and KV from HBM. Prefill is compute-bound, so this is only an
    approximation (for a GB200, HBM 8 TB/s vs 3.35 TB/s on an H100, it scales all GPU time by 0.42);
    results on such GPUs say so.

    Raises:
        UnsupportedLatencyModelError: the reference GPU has no model for (model, tp).
        ValueError: a non-positive bandwidth or an uncalibrated reference GPU.
    """
    if hbm_bytes_per_s <= 0:
        raise ValueError(f"derive_latency_model: hbm_bytes_per_s must be > 0, got {hbm_bytes_per_s}")
    if reference_gpu not in CALIBRATED_HBM_BYTES_PER_S:
        raise ValueError(
            f"derive_latency_model: reference {reference_gpu!r} is not one of {sorted(CALIBRATED_HBM_BYTES_PER_S)}"
        )
    base = load_latency_model(model, reference_gpu, tp)
    factor = CALIBRATED_HBM_BYTES_PER_S[reference_gpu] / hbm_bytes_per_s
    return dataclasses.replace(base, gpu=gpu, gpu_scale=base.gpu_scale * factor)


def _measured_combinations() -> str:
    """:func:`supported_latency_models` in words, by model: ``"llama-2-7b: a100 at TP1/2, h100 at TP1/2; ..."``."""
    by_model: dict[str, dict[str, list[int]]] = {}  # model -> GPU -> TP degrees measured
    for m, g, t in supported_latency_models():
        by_model.setdefault(m, {}).setdefault(g, []).append(t)
    return "; ".join(
        f"{m}: " + ", ".join(f"{g} at TP{'/'.join(map(str, tps))}" for g, tps in gpus.items())
        for m, gpus in by_model.items()
    )


def gpu_latency_model(model: str, gpu: str, tp: int, hbm_bytes_per_s: float) -> tuple[LatencyModel, str | None]:
    """The step-time model of ``model`` at tensor-parallel degree ``tp`` on the GPU type ``gpu``, whose HBM bandwidth
    is ``hbm_bytes_per_s`` (bytes/s): the one rule the simulator and the live sim engine (``llumlet.backends.sim``)
    both use, so that ``hilum bench --compare-sim`` compares the same modelled GPU.

    - A GPU of a measured family (``a100*``, ``h100*``) within 5 % of the measured GPU's HBM bandwidth: the measured
      model (:func:`load_latency_model`).
    - Of a measured family but further off (an A100-40GB, 1.56 TB/s, against the measured A100-80GB, 2.04 TB/s):
      the family's model scaled by HBM bandwidth (:func:`derive_latency_model`).
    - Of no measured family (an L4, a GB200): the H100's model scaled the same way.

    Returns the model and how it was derived (``"scaled from a100 by HBM"``), None when measured.

    Raises:
        UnsupportedLatencyModelError: no measured model for ``model`` at ``tp`` on the GPU it would be taken from.
    """
    try:
        measured = load_latency_model(model, gpu, tp)
    except UnsupportedLatencyModelError:
        reference = "h100"
    else:
        reference = measured.gpu
        if abs(hbm_bytes_per_s / CALIBRATED_HBM_BYTES_PER_S[reference] - 1.0) <= 0.05:
            return measured, None
    try:
        derived = derive_latency_model(model, gpu, tp, hbm_bytes_per_s, reference_gpu=reference)
    except UnsupportedLatencyModelError:
        family = _normalize_gpu(gpu)
        if family == "h100":
            why = f"none is measured for it on {family}"
        elif family in CALIBRATED_HBM_BYTES_PER_S:
            why = f"none is measured for it on {family} (the family of {gpu}), nor on h100 (scaled by HBM bandwidth)"
        else:
            why = f"{gpu} is not measured, and h100 (scaled to it by HBM bandwidth) has none for it"
        combos = _measured_combinations()
        raise UnsupportedLatencyModelError(
            f"no step-time model for {model} at TP{tp} on {gpu}: {why}; measured: {combos}"
        ) from None
    return derived, f"scaled from {reference} by HBM"


def instance_latency_model(topology: Topology, instance_id: str) -> tuple[LatencyModel, str | None]:
    """:func:`gpu_latency_model` of the instance ``instance_id`` of ``topology`` (its model, GPU type and
    tensor-parallel degree, and that GPU type's HBM bandwidth).

    Raises:
        KeyError: no such instance.
        UnsupportedLatencyModelError: as :func:`gpu_latency_model`, the instance named first; or its model bears the
            name of a measured one (:data:`MEASURED_SHAPES`) without its shape, or in a precision other than 16-bit.
    """
    spec = topology.instance(instance_id)
    model = topology.model_of(instance_id)
    shape = (model.num_layers, model.num_attention_heads, model.num_kv_heads, model.head_dim)
    measured = MEASURED_SHAPES.get(_normalize_model(spec.model))
    if measured is not None and shape != measured:
        layers, heads, kv_heads, head_dim = measured
        raise UnsupportedLatencyModelError(
            f"instance {instance_id}: model {spec.model} has {shape[0]} layers, {shape[1]} attention heads, {shape[2]} "
            f"KV heads of {shape[3]}, not the shape of the measured {_normalize_model(spec.model)} ({layers}, "
            f"{heads}, {kv_heads} of {head_dim}): it would be timed as another model"
        )
    if measured is not None and model.dtype not in ("float16", "bfloat16"):  # the profiles' (and Llama 2's) precision
        raise UnsupportedLatencyModelError(
            f"instance {instance_id}: model {spec.model} is {model.dtype}: the measured {_normalize_model(spec.model)} "
            "ran in 16-bit (float16 or bfloat16), so it would be timed at another precision"
        )
    hbm = topology.gpu_types[spec.gpu_type].hbm_bandwidth_bytes_per_s
    try:
        return gpu_latency_model(spec.model, spec.gpu_type, spec.tensor_parallel_size, hbm)
    except UnsupportedLatencyModelError as exc:
        raise UnsupportedLatencyModelError(f"instance {instance_id}: {exc}") from None


def _timings(topology: Topology, model: str | None) -> Iterator[tuple[str, tuple[LatencyModel, str | None] | str]]:
    """Per model, GPU type and TP degree of ``topology``'s instances (those serving ``model``; None: all), in the
    file's order: ``"model/gpu/tpN"`` and :func:`instance_latency_model`'s answer for its first instance, or its
    error's text, which counts the other instances of the combination (``instance a3 (and 2 more): ...``)."""
    groups: dict[tuple[str, str, int], list[str]] = {}  # combination -> its instances, in the file's order
    for spec in topology.instances:
        if model is None or spec.model == model:
            groups.setdefault((spec.model, spec.gpu_type, spec.tensor_parallel_size), []).append(spec.instance_id)
    for (name, gpu, tp), ids in groups.items():
        try:
            timed: tuple[LatencyModel, str | None] | str = instance_latency_model(topology, ids[0])
        except UnsupportedLatencyModelError as exc:
            more = f" (and {len(ids) - 1} more)" if len(ids) > 1 else ""
            timed = f"instance {ids[0]}{more}: " + str(exc).removeprefix(f"instance {ids[0]}: ")
        yield f"{name}/{gpu}/tp{tp}", timed


def latency_model_problems(topology: Topology, model: str | None = None) -> list[str]:
    """Why the instances of ``topology`` (those serving ``model``; None: all) cannot be timed: one
    :func:`instance_latency_model` error per model, GPU type and TP degree without a step-time model, naming its
    first instance; none when every one can. What ``hilum sim`` and ``hilum up --engine sim`` refuse before
    anything runs."""
    return [timed for _, timed in _timings(topology, model) if isinstance(timed, str)]


def scaled_note(scaled: Sequence[str]) -> str:
    """The words after ``step times:`` for :func:`scaled_latency_models`' list ``scaled``, as ``hilum sim``, its sweeps
    and sizings, and ``hilum up`` print them: the list, then why (one GPU type or several)."""
    gpus = {entry.split("/")[1] for entry in scaled if entry.count("/") >= 2}
    those = "that GPU type" if len(gpus) <= 1 else "those GPU types"
    return f'{", ".join(scaled)} (no step times measured on {those}: docs/simulator.md, "Model")'


def scaled_latency_models(topology: Topology, model: str | None = None) -> list[str]:
    """The step-time models of ``topology``'s instances (those serving ``model``; None: all) that are another GPU's
    scaled by HBM bandwidth, not measured (:func:`gpu_latency_model`): one per model, GPU type and TP degree, in the
    file's order, as ``"llama-2-13b/a100-40gb/tp1 scaled from a100 by HBM"``. Those without a step-time model are
    left out (:func:`latency_model_problems` names them). What the simulator's results (``derived_latency_models``),
    ``hilum sim``, its sweeps and sizings, and ``hilum up --engine sim`` report."""
    return [f"{key} {timed[1]}" for key, timed in _timings(topology, model) if not isinstance(timed, str) and timed[1]]
