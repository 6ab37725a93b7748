"""The ``torch`` backend: the CPU reference engine (``llumlet.engine.torch_engine.TorchEngine``).

A small seeded Llama computed for real on the CPU; steps take the time they compute (no pacing). Imported
lazily so that a llumlet without PyTorch can still run the ``sim`` backend.

Sizes: ``BackendConfig.num_blocks`` (default :data:`DEFAULT_NUM_BLOCKS` — the topology's KV capacity
describes the modelled GPU, not this tiny model) and ``block_size_tokens`` (default: the topology model's,
else 16). ``BackendConfig.seed`` seeds the model weights (engines that exchange KV need the same seed).
Options (``--engine-option KEY=VALUE``): ``eos_token_id`` (an id, or ``none``), ``threads`` (PyTorch intra-op
threads of this process, default 1: the tiny model gains nothing from more, and several llumlets share the
CPUs), ``device`` (``cpu``, the default, or a CUDA device such as ``cuda`` / ``cuda:1``: the model and the KV
pool live there, and the local transport copies blocks GPU to GPU through CUDA IPC), and ``model.<field>``
for any ``LlamaConfig`` field of the tiny model (ints, floats).

Tokenizer (``BackendConfig.tokenizer_path()``: ``--tokenizer``, else the topology model's ``tokenizer``): the
tiny Llama takes its vocabulary size (``len(tokenizer)``) and its BOS / EOS / pad ids, so the gateway's
tokens are this model's tokens and its output decodes to real text; EOS stops generation. Without one, the
512-token vocabulary of :data:`~llumlet.engine.torch_engine.TINY_LLAMA_DEFAULTS` (the gateway's byte
stand-in). Explicit ``model.*`` / ``eos_token_id`` options win over the tokenizer's.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from llumlet.backends.base import Backend, BackendConfig

__all__ = ["DEFAULT_NUM_BLOCKS", "KNOWN_OPTIONS", "OPTIONS_HELP", "make_torch_backend", "unknown_options"]

#: The torch backend's ``--engine-option`` names, besides ``model.<LlamaConfig field>``.
KNOWN_OPTIONS = ("eos_token_id", "threads", "device")
OPTIONS_HELP = f"{', '.join(KNOWN_OPTIONS)}, model.<LlamaConfig field>"  # what its errors list as known


def unknown_options(names: Iterable[str]) -> list[str]:
    """The option names of ``names`` the torch backend does not take, sorted (none: an empty list)."""
    return sorted(n for n in names if n not in KNOWN_OPTIONS and not n.startswith("model."))


DEFAULT_NUM_BLOCKS = 1024  # KV pool of the tiny model, blocks


def _number(key: str, value: str) -> int | float:
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"torch backend option {key}={value!r}: need a number") from None


def make_torch_backend(config: BackendConfig) -> Backend:
    """A ``TorchEngine`` for ``config``.

    Raises:
        RuntimeError: PyTorch or transformers is not installed.
        ValueError: an unknown option or a bad value; ``TokenizerLoadError`` (a ValueError) for a tokenizer
            directory that does not exist or cannot be loaded.
    """
    try:
        import torch

        from llumlet.engine.torch_engine import TORCH_SAMPLING_FEATURES, TorchEngine
    except ImportError as exc:
        raise RuntimeError(
            f"the torch backend needs PyTorch and transformers (pip install torch transformers): {exc}"
        ) from exc
    eos: int | None = 2
    threads = 1
    device = "cpu"
    overrides: dict[str, Any] = {}
    for key, value in config.options.items():
        if key == "threads":
            threads = int(_number(key, value))
        elif key == "eos_token_id":
            eos = None if value.lower() == "none" else int(_number(key, value))
        elif key == "device":
            if value != "cpu" and not value.startswith("cuda"):
                raise ValueError(f"torch backend option device={value!r}: need cpu, cuda or cuda:<index>")
            if value.startswith("cuda") and not torch.cuda.is_available():
                raise ValueError(f"torch backend option device={value!r}: this PyTorch has no CUDA device")
            device = value
        elif key.startswith("model."):
            overrides[key.removeprefix("model.")] = _number(key, value)
        else:
            raise ValueError(f"torch backend: unknown option {key!r} (known: {OPTIONS_HELP})")
    tokenizer = config.tokenizer_path()
    if tokenizer is not None:
        from llumlet.engine.hf_tokenizer import tokenizer_info

        info = tokenizer_info(tokenizer)
        special = {"bos_token_id": info.bos_token_id, "eos_token_id": info.eos_token_id}
        special["pad_token_id"] = info.pad_token_id
        from_tokenizer = {"vocab_size": info.vocab_size, **{k: v for k, v in special.items() if v is not None}}
        overrides = {**from_tokenizer, **overrides}
        if "eos_token_id" not in config.options:
            eos = info.eos_token_id
    torch.set_num_threads(max(1, threads))  # one engine per process: a process-wide setting is the engine's
    block_size = config.block_size_tokens
    if block_size is None:
        topo = config.topology
        block_size = topo.model_of(config.instance_id).block_size_tokens if topo is not None else 16
    engine = TorchEngine(
        config.instance_id,
        config.num_blocks or DEFAULT_NUM_BLOCKS,
        block_size,
        model_seed=config.seed,
        eos_token_id=eos,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        model_overrides=overrides,
        rng=random.Random(config.seed + 1),
        device=device,
    )
    return Backend(
        name="torch",
        engine=engine,
        time_scale=0.0,
        real_token_ids=True,
        min_step_s=config.min_step_s,
        sampling_features=TORCH_SAMPLING_FEATURES,
    )
