"""The ``vllm`` backend: a real vLLM v1 engine (``llumlet.engine.vllm_engine.VllmEngine``).

Steps take the time they compute (no pacing). Imported lazily, so a llumlet without vLLM runs the other
backends. Options (``--engine-option KEY=VALUE``): ``model`` (required: a local checkpoint directory or a
model name vLLM can load), ``kv_cache_memory_bytes`` (or ``BackendConfig.num_blocks``, the CLI's
``--num-blocks``: exactly that many KV blocks), ``gpu_memory_utilization`` (a fraction), ``dtype``
(default ``auto``), ``max_model_len`` (default: the topology model's ``max_context_tokens``, else 4096),
``enforce_eager`` and ``enable_prefix_caching`` (``true`` / ``false``; default: vLLM's, i.e. CUDA graphs
and prefix caching on), ``allow_untested_vllm`` (``true`` to run on a vLLM outside the supported range).
``BackendConfig.tokenizer_path()`` (``--tokenizer``, else the topology model's ``tokenizer``) is the tokenizer
vLLM loads (default: the checkpoint's). ``BackendConfig.block_size_tokens`` (default: the topology model's,
else 16) must suit the attention backend (the CPU build needs a multiple of 32). Engines that exchange KV must
load the same model with the same dtype and block size (docs/vllm.md).

Sampling features: all of them (``SamplingFeature``): ``VllmEngine`` maps every field of hilum's
``SamplingParams`` onto vLLM's, guided decoding through vLLM's structured-output backend (xgrammar; the CPU
build runs it too). Requests with frequency / presence penalties or guided decoding run but do not migrate
(``vllm_engine.not_migratable``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from llumlet.backends.base import Backend, BackendConfig
from llumlet.engine.types import SamplingFeature

#: What ``VllmEngine`` honours: every optional sampling feature (docs/gateway.md, "Request fields").
VLLM_SAMPLING_FEATURES = frozenset(SamplingFeature)

__all__ = ["KNOWN_OPTIONS", "OPTIONS_HELP", "VLLM_SAMPLING_FEATURES", "make_vllm_backend", "unknown_options"]

#: The vllm backend's ``--engine-option`` names.
KNOWN_OPTIONS = (
    "model",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "dtype",
    "max_model_len",
    "enforce_eager",
    "enable_prefix_caching",
    "allow_untested_vllm",
)
OPTIONS_HELP = ", ".join(KNOWN_OPTIONS)  # what its errors list as known


def unknown_options(names: Iterable[str]) -> list[str]:
    """The option names of ``names`` the vllm backend does not take, sorted (none: an empty list)."""
    return sorted(set(names) - set(KNOWN_OPTIONS))


def _parse(opts: dict[str, str], key: str, kind: type[int] | type[float], what: str) -> int | float:
    try:
        return kind(opts[key])
    except ValueError:
        raise ValueError(f"vllm backend: {key}={opts[key]!r}: need {what}") from None


def _flag(key: str, value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError(f"vllm backend: {key}={value!r}: need true or false")
    return value.lower() == "true"


def make_vllm_backend(config: BackendConfig) -> Backend:
    """A ``VllmEngine`` for ``config``.

    Raises:
        RuntimeError: vLLM is not installed, or its version is untested (see docs/vllm.md).
        ValueError: a missing ``model`` option, an unknown option or a bad value, both ``kv_cache_memory_bytes``
            and ``num_blocks``.
    """
    opts = dict(config.options)
    unknown = unknown_options(opts)
    if unknown:
        raise ValueError(f"vllm backend: unknown option(s) {unknown} (known: {OPTIONS_HELP})")
    if "model" not in opts:
        raise ValueError("vllm backend: --engine-option model=PATH_OR_NAME is required")
    try:
        from llumlet.engine.vllm_engine import VllmEngine
    except ImportError as exc:
        raise RuntimeError(f"the vllm backend needs vLLM installed (docs/vllm.md): {exc}") from exc
    topo = config.topology
    model_spec = topo.model_of(config.instance_id) if topo is not None else None
    kwargs: dict[str, Any] = {
        "block_size_tokens": config.block_size_tokens or (model_spec.block_size_tokens if model_spec else 16),
        "max_model_len": int(opts.get("max_model_len", model_spec.max_context_tokens if model_spec else 4096)),
        "dtype": opts.get("dtype", "auto"),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "seed": config.seed,
        "rng": random.Random(config.seed + 1),
        "allow_untested_vllm": _flag("allow_untested_vllm", opts.get("allow_untested_vllm", "false")),
    }
    engine_kwargs: dict[str, Any] = {
        k: _flag(k, opts[k]) for k in ("enforce_eager", "enable_prefix_caching") if k in opts
    }
    if "gpu_memory_utilization" in opts:
        engine_kwargs["gpu_memory_utilization"] = _parse(opts, "gpu_memory_utilization", float, "a fraction")
    tokenizer = config.tokenizer_path()  # --tokenizer, else the topology model's; None: the checkpoint's own
    if tokenizer is not None:
        engine_kwargs["tokenizer"] = tokenizer
    kwargs["engine_kwargs"] = engine_kwargs
    if "kv_cache_memory_bytes" in opts:
        if config.num_blocks is not None:
            raise ValueError("vllm backend: give kv_cache_memory_bytes or --num-blocks, not both")
        kwargs["kv_cache_memory_bytes"] = _parse(opts, "kv_cache_memory_bytes", int, "bytes")
    if config.num_blocks is not None:
        kwargs["num_blocks"] = config.num_blocks
    engine = VllmEngine(config.instance_id, opts["model"], **kwargs)
    return Backend(
        "vllm",
        engine,
        time_scale=0.0,
        real_token_ids=True,
        min_step_s=config.min_step_s,
        sampling_features=VLLM_SAMPLING_FEATURES,
    )
