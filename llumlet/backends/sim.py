"""The ``sim`` backend: the model engine (``EngineCore`` + latency model) on a real clock.

The llumlet makes each step last its modelled duration (``StepResult.duration_s x time_scale`` of wall
time), so a control plane sees the timing of the modelled GPU without any model. With a topology the
instance's model, GPU type and tensor-parallel degree choose the latency model (docs/engine-model.md) and its
KV capacity and block size come from the topology; without one, a Llama-2-7B on one A100 with
``DEFAULT_NUM_BLOCKS`` blocks. Prefix caching is on unless the configuration's ``prefix_cache.enabled`` is
false: a request's prefix hash ids (``SubmitRequest.prefix_block_hashes``, which the gateway computes from the
prompt's tokens) name the blocks it may share, as vLLM's block hashes do.
"""

from __future__ import annotations

from llumlet.backends.base import Backend, BackendConfig
from llumlet.engine.core import EngineCore
from llumlet.engine.latency import instance_latency_model, load_latency_model
from llumlet.engine.types import SamplingFeature

__all__ = ["DEFAULT_KV_BYTES_PER_TOKEN", "DEFAULT_NUM_BLOCKS", "SIM_SAMPLING_FEATURES", "make_sim_backend"]

#: What the sim engine takes (docs/gateway.md, "Request fields"): its output is placeholder tokens (ids
#: 0, 1, 2, ...: the positions) with no distribution behind them, so settings that only reshape a
#: distribution (penalties, top-k, like temperature and top-p) cannot change it, and min_tokens holds by
#: construction (it never emits EOS: every request runs to max_tokens). They are validated, carried and
#: migrated like on any engine. Stop token ids (its ids are positions), logprobs and guided decoding would
#: need tokens, numbers and text it does not have: refused.
SIM_SAMPLING_FEATURES = frozenset({SamplingFeature.PENALTIES, SamplingFeature.TOP_K, SamplingFeature.MIN_TOKENS})

DEFAULT_NUM_BLOCKS = 1000  # KV capacity without a topology, blocks
DEFAULT_KV_BYTES_PER_TOKEN = 524_288  # Llama-2-7B fp16: 2 x 32 layers x 32 heads x 128 x 2 bytes


def make_sim_backend(config: BackendConfig) -> Backend:
    """An ``EngineCore`` for ``config.instance_id``, paced at ``config.time_scale``.

    Raises:
        KeyError: the instance is not in ``config.topology``.
        UnsupportedLatencyModelError: no latency model for the instance's (model, GPU, TP)
            (``llumlet.engine.latency.gpu_latency_model``: a GPU without measured data is scaled by HBM bandwidth).
        ValueError: ``config.options`` is not empty (the sim backend takes no ``--engine-option``), or
            ``config.tokenizer`` is set (it reads none).
    """
    if config.options:
        raise ValueError(f"sim backend: unknown option(s) {', '.join(sorted(config.options))} (it takes none)")
    if config.tokenizer is not None:  # accepted and ignored before
        raise ValueError(
            f"--tokenizer {config.tokenizer}: the sim engine reads no tokenizer (its tokens are the ids the gateway's "
            "tokenizer made): give it to the gateway"
        )
    topo = config.topology
    if topo is not None:
        spec = topo.instance(config.instance_id)
        model = topo.model_of(config.instance_id)
        latency, _ = instance_latency_model(topo, config.instance_id)  # as the simulator's (hilum bench --compare-sim)
        num_blocks = spec.kv_capacity_blocks
        block_size = model.block_size_tokens
        kv_bytes_per_token = model.kv_bytes_per_token
    else:
        latency = load_latency_model("llama-2-7b", "a100", 1)
        num_blocks = DEFAULT_NUM_BLOCKS
        block_size = 16
        kv_bytes_per_token = DEFAULT_KV_BYTES_PER_TOKEN
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    if config.block_size_tokens is not None:
        block_size = config.block_size_tokens
    engine = EngineCore(
        config.instance_id,
        num_blocks=num_blocks,
        block_size_tokens=block_size,
        latency_model=latency,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_bytes_per_block=kv_bytes_per_token * block_size,
        enable_prefix_caching=config.prefix_cache.enabled,
    )
    return Backend(
        name="sim",
        engine=engine,
        time_scale=config.time_scale,
        real_token_ids=False,
        min_step_s=config.min_step_s,
        sampling_features=SIM_SAMPLING_FEATURES,
    )
