"""TorchEngine: the CPU reference engine. A tiny Llama that really computes, on hilum's paged KV blocks.

It implements :class:`llumlet.engine.protocol.Engine` with real data: the scheduler and block accounting
are the engine model's own (:class:`~llumlet.engine.scheduler.Scheduler`,
:class:`~llumlet.engine.blocks.BlockManager`: continuous batching, chunked prefill, preemption by
recompute), and every scheduled prefill chunk and decode runs through a small transformers Llama whose K/V
live in one paged pool tensor::

    kv_cache: float32[num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size_tokens, head_dim]

A request's token at position p has its K/V in physical block ``block_table[p // block_size]`` at offset
``p % block_size`` (K after rotary embedding, as transformers caches it).

Faithfulness rules (docs/engine-model.md, "CPU reference engine"):

- Each scheduled request runs through the model on its own inside a step (a "batch" is the set of requests
  scheduled in one step), so its outputs never depend on which other requests share the step.
- Sampling follows vLLM's v1 sampler: ``min_tokens`` and the repetition / frequency / presence penalties
  on the logits (:func:`apply_penalties`), then greedy, or temperature, top-k, top-p and one draw
  (:func:`sample_token`); logprobs are the raw model distribution's (:func:`token_logprobs`). One
  ``torch.Generator`` per request, seeded from ``SamplingParams.seed``; a token costs exactly one uniform
  draw (none when greedy). A token is sampled once, at the step that computes the request's last known
  token, so recompute after a preemption never re-samples produced tokens.
- Migration moves the K/V bytes themselves (``read_blocks`` / ``write_blocks``) and the generator state
  (``MigrationState.extra``), so a migrated request continues bit-for-bit as if it had stayed; or, when the
  cost model says so, the destination re-prefills the prompt's blocks from their token ids
  (``recompute_prefix``, estimated by ``prefill_time_s`` from the measured prefill rate).

Import cost: importing this module imports torch and transformers (~3 s); ``llumlet.engine`` does not
re-export it for that reason.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llumlet.engine.blocks import BlockManager
from llumlet.engine.core import RequestStats, RequestTooLargeError
from llumlet.engine.paged import PagedEngine
from llumlet.engine.protocol import KVPayload
from llumlet.engine.scheduler import ScheduledBatch, Scheduler, SchedulerRequest
from llumlet.engine.types import (
    EngineRequest,
    MigrationState,
    SamplingFeature,
    SamplingParams,
    StepResult,
    TokenLogprobs,
)
from llumlet.kvpool import KVPool, copy_between, shared_host_tensor

__all__ = [
    "EXTRA_EOS_TOKEN_ID",
    "EXTRA_GENERATOR_STATE",
    "EXTRA_MODEL_FINGERPRINT",
    "TINY_LLAMA_DEFAULTS",
    "TORCH_SAMPLING_FEATURES",
    "TorchEngine",
    "apply_penalties",
    "model_fingerprint",
    "sample_token",
    "tiny_llama",
    "token_logprobs",
]

EXTRA_GENERATOR_STATE = "generator_state"  # MigrationState.extra key: bytes of torch.Generator.get_state()
EXTRA_MODEL_FINGERPRINT = "model_fingerprint"  # MigrationState.extra key: str, see model_fingerprint()
EXTRA_EOS_TOKEN_ID = "eos_token_id"  # MigrationState.extra key: int | None, the source engine's EOS id

#: Every optional sampling feature but guided decoding: each is computed here for real, and each depends only
#: on what a migration carries (prompt and output ids, the sampling settings, the generator state), so a moved
#: request continues exactly as if it had stayed.
TORCH_SAMPLING_FEATURES = frozenset(SamplingFeature) - {SamplingFeature.GUIDED_DECODING}

TINY_LLAMA_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA: 2 query heads per KV head
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "initializer_range": 0.5,  # large on purpose: peaked logits, varied greedy streams (tests check)
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
)


def tiny_llama(seed: int = 0, **overrides: Any) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """A small random Llama, identical for equal ``seed`` and overrides; nothing is downloaded.

    ``overrides`` replace entries of :data:`TINY_LLAMA_DEFAULTS` (any ``LlamaConfig`` field). Weights are
    drawn by transformers' initializer (normal, std = ``initializer_range``) from ``torch.manual_seed(seed)``
    inside ``torch.random.fork_rng``, so the caller's global RNG is left as it was. The model is float32,
    in eval mode, without gradients, with the ``sdpa`` attention (the reference path the tests compare to).

    Raises ValueError for an override that is not a ``LlamaConfig`` field.
    """
    known = LlamaConfig()
    unknown = sorted(k for k in overrides if k not in TINY_LLAMA_DEFAULTS and not hasattr(known, k))
    if unknown:
        raise ValueError(f"tiny_llama: unknown LlamaConfig field(s) {unknown}")
    kwargs = {**TINY_LLAMA_DEFAULTS, **overrides}
    dtype = kwargs.pop("torch_dtype")
    config = LlamaConfig(**kwargs)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, str(dtype))).eval().requires_grad_(False)
    return model, config


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (hex, 16 chars) over every parameter's name, shape and float bytes, in name order.

    Two engines can exchange KV blocks only when their fingerprints are equal.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(repr(tuple(tensor.shape)).encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, *, top_k: int = 0
) -> int:
    """One token from ``logits`` (float[vocab], already through :func:`apply_penalties`).

    temperature 0: argmax (first maximum), no random draw. Otherwise softmax(logits / temperature) sorted in
    descending order (stable sort); keep the ``top_k`` most probable (0 = all) and renormalize; keep the
    smallest set of most probable tokens whose mass reaches ``top_p`` (a token is kept when the mass of the
    tokens before it is < top_p; the first is always kept), then invert the CDF of the kept tokens at
    ``u ~ U[0, 1)`` drawn from ``generator``: exactly one draw per token, so the generator state fully
    determines the continuation. Top-k before top-p on the renormalized top-k mass is vLLM's order
    (``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p``).
    """
    if temperature == 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.to(torch.float32) / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    if 0 < top_k < sorted_probs.numel():
        sorted_probs = sorted_probs[:top_k] / sorted_probs[:top_k].sum()
    if top_p < 1:
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = int((before < top_p).sum().item())
        sorted_probs = sorted_probs[: max(keep, 1)]
    cdf = torch.cumsum(sorted_probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    j = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=cdf.dtype), right=True).item())
    return int(order[min(j, cdf.numel() - 1)].item())


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Sequence[int],
) -> torch.Tensor:
    """The logits (float[vocab]) after ``min_tokens`` and the three penalties, as vLLM's v1 sampler applies them.

    - ``min_tokens``: while fewer than ``min_tokens`` outputs exist, the ``stop_ids`` (EOS unless
      ``ignore_eos``, and ``stop_token_ids``) get -inf (vLLM's ``MinTokensLogitsProcessor``);
    - repetition penalty ``r`` on every token in the prompt or the output: ``l / r`` if ``l > 0`` else
      ``l * r`` (Keskar et al. 2019, CTRL §4.1, as HF and vLLM apply it);
    - frequency ``f`` and presence ``p`` penalties over the output tokens only: ``l - f * count - p * (count >
      0)`` (OpenAI's definition, counted over generated tokens as vLLM does:
      ``vllm.model_executor.layers.utils.apply_penalties``).

    Returns ``logits`` itself when nothing applies, else a new float32 tensor.
    """
    out = logits
    if len(output_ids) < params.min_tokens and stop_ids:
        out = out.to(torch.float32, copy=True)
        out[torch.tensor(list(stop_ids), dtype=torch.long)] = -math.inf
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        if out is logits:
            out = out.to(torch.float32, copy=True)
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), dtype=torch.long)
        values = out[seen]
        r = params.repetition_penalty
        out[seen] = torch.where(values > 0, values / r, values * r)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        if out is logits:
            out = out.to(torch.float32, copy=True)
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=out.numel())
        counts = counts.to(torch.float32)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float32)
    return out


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The raw log probabilities (log-softmax of the model's ``logits``, float[vocab]) of ``token`` and the ``k``
    most probable tokens (descending, ties by id), before any sampling setting: vLLM's default
    ``logprobs_mode="raw_logprobs"``."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, order = torch.sort(logprobs, descending=True, stable=True)
        top = tuple((int(i), float(v)) for i, v in zip(order[:k].tolist(), values[:k].tolist(), strict=True))
    return TokenLogprobs(float(logprobs[token].item()), top)


def _generator_state(g: torch.Generator) -> bytes:
    return bytes(g.get_state().numpy().tobytes())


class TorchEngine(PagedEngine):
    """A CPU Llama engine on a paged KV pool; implements ``llumlet.engine.protocol.Engine``.

    Args:
        instance_id: for messages only.
        num_blocks: KV cache capacity in blocks (the pool tensor is allocated up front:
            ``num_blocks x kv_bytes_per_block`` bytes).
        block_size_tokens: tokens per KV block.
        model_seed: seed of :func:`tiny_llama`; engines that exchange KV need the same seed and overrides.
        eos_token_id: generation stops on it unless ``SamplingParams.ignore_eos``; None = no EOS.
        max_num_seqs, max_num_batched_tokens: the scheduler's batch limits (requests, tokens per step).
        model_overrides: ``LlamaConfig`` fields replacing :data:`TINY_LLAMA_DEFAULTS`.
        rng: draws the generator seed of requests whose ``SamplingParams.seed`` is None (default: a
            ``random.Random()`` seeded by the OS).
        clock: seconds, monotonic; ``StepResult.duration_s`` is the measured compute time of the step.
        device: where the model and the KV pool live ("cpu", "cuda", "cuda:1"); sampling runs on the host
            either way, so a request continues identically on engines of different devices.

    Prefix caching is off (prefix hashes in requests are accepted and ignored). Raises ValueError for
    non-positive sizes or an ``eos_token_id`` outside the vocabulary.
    """

    def __init__(
        self,
        instance_id: str,
        num_blocks: int,
        block_size_tokens: int = 16,
        model_seed: int = 0,
        eos_token_id: int | None = 2,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        *,
        model_overrides: Mapping[str, Any] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.perf_counter,
        device: str = "cpu",
    ) -> None:
        self.instance_id = instance_id
        self.device = torch.device(device)
        self.model, self.config = tiny_llama(model_seed, **dict(model_overrides or {}))
        self.model_fingerprint = model_fingerprint(self.model)  # on the host, before the move to the device
        self.model = self.model.to(self.device)  # type: ignore[arg-type, unused-ignore]
        vocab = int(self.config.vocab_size)
        if eos_token_id is not None and not 0 <= eos_token_id < vocab:
            raise ValueError(f"{instance_id}: eos_token_id = {eos_token_id} outside the vocabulary [0, {vocab})")
        self.eos_token_id = eos_token_id
        self._vocab_size = vocab  # read once: a transformers config attribute costs ~8 us per access
        self.blocks = BlockManager(num_blocks, block_size_tokens, enable_prefix_caching=False)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
        self.num_layers = int(self.config.num_hidden_layers)
        heads = int(self.config.num_attention_heads)
        self.num_kv_heads = int(self.config.num_key_value_heads or heads)
        self.head_dim = int(self.config.head_dim or int(self.config.hidden_size) // heads)
        shape = (self.num_layers, 2, num_blocks, self.num_kv_heads, block_size_tokens, self.head_dim)
        # a host pool lives in shared memory so that a llumlet of this host can copy blocks out of it
        # directly (the local transport); a CUDA pool is exported with CUDA IPC (llumlet.kvpool)
        self.kv_cache = (
            shared_host_tensor(shape, torch.float32)
            if self.device.type == "cpu"
            else torch.zeros(shape, dtype=torch.float32, device=self.device)
        )
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._generators: dict[str, torch.Generator] = {}
        self._params: dict[str, SamplingParams] = {}
        self._suspended: dict[str, SchedulerRequest] = {}
        self._written: dict[str, set[int]] = {}  # reservation id -> block positions written
        self._last_step_preempted = False
        self._prefill_tokens = 0  # prompt tokens prefilled so far (steps and recomputed prefixes)
        self._prefill_s = 0.0  # the compute time they took, seconds (prefill_time_s's measured rate)
        self.stats: dict[str, RequestStats] = {}  # request_id -> counters of requests that left

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block in the pool: layers x 2 x kv_heads x block_size x head_dim x 4 (float32)."""
        return self.num_layers * 2 * self.num_kv_heads * self.block_size_tokens * self.head_dim * 4

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return self._vocab_size

    def max_request_tokens(self) -> int:
        """Largest prompt + output (tokens) one request may have: the pool and the model's positions."""
        return min(self.blocks.num_blocks * self.block_size_tokens, int(self.config.max_position_embeddings))

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (FCFS). ``sampling_params`` None means greedy.

        Raises:
            RequestTooLargeError: prompt + max_tokens - 1 tokens exceed the pool or the model's positions.
            ValueError: duplicate id, no ``prompt_token_ids``, a token id outside the vocabulary, or
                ``sampling_params.max_tokens`` different from ``request.max_tokens``.
        """
        where = f"{self.instance_id}: request {request.request_id!r}"
        need = request.prompt_tokens + request.max_tokens - 1
        if need > self.max_request_tokens():
            raise RequestTooLargeError(
                f"{where} needs {need} KV tokens, this engine holds {self.max_request_tokens()} "
                f"({self.blocks.num_blocks} blocks x {self.block_size_tokens}, "
                f"{self.config.max_position_embeddings} positions)"
            )
        params = self._check_request(where, request.prompt_token_ids, request.max_tokens, request.sampling_params)
        if request.request_id in self._suspended:
            raise ValueError(f"{where} is already in this engine (suspended)")
        self.scheduler.add(request)
        self._params[request.request_id] = params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self._generators[request.request_id] = torch.Generator().manual_seed(seed)

    def _check_request(
        self, where: str, prompt: Sequence[int] | None, max_tokens: int, params: SamplingParams | None
    ) -> SamplingParams:
        if prompt is None:
            raise ValueError(f"{where}: the torch engine needs prompt_token_ids")
        vocab = self._vocab_size
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab):  # C-speed scan: a commit runs this too
            bad = [t for t in prompt if not 0 <= t < vocab]
            raise ValueError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if params is None:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0)
        if params.max_tokens != max_tokens:
            raise ValueError(f"{where}: sampling_params.max_tokens = {params.max_tokens} != max_tokens = {max_tokens}")
        return params

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting, running, suspended); free its blocks. False if unknown."""
        state = self._suspended.pop(request_id, None)
        if state is not None:
            self.scheduler.requests.pop(request_id, None)
            self.blocks.free(request_id)
        else:
            state = self.scheduler.remove(request_id)
        if state is None:
            return False
        self._forget(request_id, state)
        return True

    def _forget(self, request_id: str, state: SchedulerRequest) -> None:
        self.stats[request_id] = RequestStats(state)
        self._generators.pop(request_id, None)
        self._params.pop(request_id, None)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule one batch, run each scheduled request through the model, sample, apply.

        A request produces a token when this step computes its last known token (the end of its last
        prefill chunk, or a decode). ``finish_reasons``: "stop" (EOS or a stop token, which is included in
        ``token_ids``), else "length" (``max_tokens`` reached).
        """
        batch = self.scheduler.schedule()
        self._last_step_preempted = bool(batch.preempted)
        if batch.num_seqs == 0:
            return StepResult(0.0, {}, (), batch.preempted, 0, 0)
        start_s = self._clock()
        produced = self._compute(batch)
        stopped: set[str] = set()
        reasons: dict[str, str] = {}
        for rid, (token, _) in produced.items():
            state = self.scheduler.requests[rid]
            state.output_token_ids.append(token)
            params = self._params[rid]
            if token in params.stop_token_ids or (token == self.eos_token_id and not params.ignore_eos):
                stopped.add(rid)
                reasons[rid] = "stop"
            elif state.num_output_tokens + 1 >= state.request.max_tokens:
                reasons[rid] = "length"
        duration_s = self._clock() - start_s
        departing = {rid: self.scheduler.requests[rid] for rid in produced}
        new_tokens, finished, recomputed = self.scheduler.update(batch, duration_s, stopped)
        for rid in finished:
            self._forget(rid, departing[rid])
        return StepResult(
            duration_s=duration_s,
            new_tokens=new_tokens,
            finished=finished,
            preempted=batch.preempted,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=len(batch.decode),
            num_scheduled_seqs=batch.num_seqs,
            num_recompute_tokens=recomputed,
            token_ids={rid: (tok,) for rid, (tok, _) in produced.items()},
            finish_reasons={rid: reasons[rid] for rid in finished},
            logprobs={rid: (lp,) for rid, (_, lp) in produced.items() if lp is not None},
        )

    def _compute(self, batch: ScheduledBatch) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Run the batch's chunks and decodes; returns the token sampled (and its logprobs, when asked) for each
        request that produced one."""
        work = [(rid, chunk, before) for rid, chunk, before in batch.prefill]
        work += [(rid, 1, ctx - 1) for rid, ctx in batch.decode]
        produced: dict[str, tuple[int, TokenLogprobs | None]] = {}
        with torch.inference_mode():
            for rid, n, start in work:
                state = self.scheduler.requests[rid]
                tokens = state.request.prompt_token_ids or ()
                ids = [*tokens, *state.output_token_ids][start : start + n]
                last = start + n == state.num_tokens
                t0 = self._clock()
                logits = self._forward(self.blocks.block_table(rid), ids, start, want_logits=last)
                if start + n <= len(tokens):  # a prefill chunk of prompt tokens: measures the prefill rate
                    self._count_prefill(n, self._clock() - t0)
                if logits is not None:
                    logits = logits.cpu()  # sampling on the host with the request's CPU generator, any device
                    produced[rid] = self._sample(rid, logits, tokens, state.output_token_ids)
        return produced

    def _sample(
        self, rid: str, logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int]
    ) -> tuple[int, TokenLogprobs | None]:
        params = self._params[rid]
        stop_ids = [*params.stop_token_ids]
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(self.eos_token_id)
        processed = apply_penalties(logits, params, prompt, output, stop_ids)
        token = sample_token(processed, params.temperature, params.top_p, self._generators[rid], top_k=params.top_k)
        logprobs = None if params.logprobs is None else token_logprobs(logits, token, params.logprobs)
        return token, logprobs

    def _forward(
        self, block_table: Sequence[int], token_ids: Sequence[int], start: int, want_logits: bool
    ) -> torch.Tensor | None:
        """Tokens at positions ``start .. start+n-1`` of one request through the model.

        Writes their K/V into the pool through ``block_table``, attends over positions ``0 .. start+n-1``
        gathered from the pool (causal), returns the last position's logits (float[vocab]) if asked.
        """
        n = len(token_ids)
        end = start + n
        bs = self.block_size_tokens
        llama: Any = self.model.model  # transformers modules: untyped attribute access
        dev = self.device
        positions = torch.arange(start, end, device=dev)
        table = torch.tensor(block_table[: -(-end // bs)], dtype=torch.long, device=dev)
        slot_blocks = table[positions // bs]
        slot_offsets = positions % bs
        mask = torch.arange(end, device=dev)[None, :] <= positions[:, None]  # [n, end] query i sees keys <= start+i
        hidden = llama.embed_tokens(torch.tensor([list(token_ids)], dtype=torch.long, device=dev))
        cos, sin = llama.rotary_emb(hidden, positions[None, :])
        for i, layer in enumerate(llama.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, n, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, n, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, n, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.kv_cache[i, 0, slot_blocks, :, slot_offsets, :] = k[0].transpose(0, 1)
            self.kv_cache[i, 1, slot_blocks, :, slot_offsets, :] = v[0].transpose(0, 1)
            keys = self._gather(i, 0, table, end)
            values = self._gather(i, 1, table, end)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if not want_logits:
            return None
        logits: torch.Tensor = self.model.lm_head(llama.norm(hidden[:, -1:, :]))
        return logits[0, -1]

    def _gather(self, layer: int, kv: int, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """K (kv=0) or V (kv=1) of positions 0 .. num_tokens-1 as float[1, kv_heads, num_tokens, head_dim]."""
        blocks = self.kv_cache[layer, kv, table]  # [nb, kv_heads, bs, head_dim]
        flat = blocks.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)
        return flat[None, :, :num_tokens, :]

    # ---- migration: source side -----------------------------------------------------------------
    def _copy_out(self, first_block: int, block_ids: Sequence[int]) -> KVPayload:
        """The K/V of physical blocks ``block_ids``.

        ``data`` = raw float32 bytes (native order, C-contiguous) of a tensor
        ``[num_layers, 2, len(block_ids), num_kv_heads, block_size_tokens, head_dim]`` and nothing else;
        ``nbytes == len(data) == len(block_ids) x kv_bytes_per_block``. Slots of the last block past the
        request's tokens hold stale values (never read: attention masks them). Reads the pool only, so it
        may run while another thread steps the engine.
        """
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        data = self.kv_cache[:, :, index].cpu().contiguous().numpy().tobytes()
        return KVPayload(first_block, len(block_ids), len(block_ids) * self.kv_bytes_per_block, data)

    def suspend(self, request_id: str) -> MigrationState | None:
        """Between two steps: take a running decode-phase request out of batching; it keeps its blocks.

        ``extra`` carries ``generator_state`` (bytes of its ``torch.Generator`` state),
        ``model_fingerprint`` (str) and ``eos_token_id`` (int or None). None when it cannot be suspended
        (see :meth:`migratable`).
        """
        if self.migratable(request_id) is not None:
            return None
        state = self.scheduler.requests[request_id]
        return self._take_suspended(
            state,
            self._params[request_id],
            {
                EXTRA_GENERATOR_STATE: _generator_state(self._generators[request_id]),
                EXTRA_MODEL_FINGERPRINT: self.model_fingerprint,
                EXTRA_EOS_TOKEN_ID: self.eos_token_id,
            },
        )

    def free_migrated(self, request_id: str) -> int:
        """After the destination committed: forget the suspended request, free its blocks. Idempotent."""
        state = self._suspended.pop(request_id, None)
        if state is None:
            return 0
        self.scheduler.requests.pop(request_id, None)
        self._forget(request_id, state)
        return self.blocks.free(request_id)

    # ---- migration: destination side ------------------------------------------------------------
    def reserve(self, reservation_id: str, n_blocks: int) -> bool:
        """Hold ``n_blocks`` for an incoming request. False if no room or the id is in use."""
        if not self.blocks.reserve(reservation_id, n_blocks):
            return False
        self._written[reservation_id] = set()
        return True

    def release_reservation(self, reservation_id: str) -> int:
        """Give a reservation back. Idempotent and safe if never reserved; returns blocks released."""
        self._written.pop(reservation_id, None)
        return self.blocks.release(reservation_id)

    def write_blocks(self, reservation_id: str, payload: KVPayload) -> None:
        """Copy ``payload`` (layout of :meth:`read_blocks`) into the reservation at its block positions.

        Raises:
            KeyError: unknown reservation.
            IndexError: the blocks exceed the reservation.
            ValueError: ``data`` or ``nbytes`` is not ``num_blocks x kv_bytes_per_block`` bytes.
        """
        held = self.blocks.reservation_blocks(reservation_id)
        if held is None:
            raise KeyError(f"{self.instance_id}: write_blocks: unknown reservation {reservation_id!r}")
        end = payload.first_block + payload.num_blocks
        if end > len(held):
            raise IndexError(
                f"{self.instance_id}: write_blocks: blocks {payload.first_block}..{end}"
                f" exceed reservation {reservation_id!r} of {len(held)} blocks"
            )
        want = payload.num_blocks * self.kv_bytes_per_block
        if len(payload.data) != want or payload.nbytes != want:
            raise ValueError(
                f"{self.instance_id}: write_blocks({reservation_id!r}): {payload.num_blocks} blocks need "
                f"{want} bytes of float32[{self.num_layers}, 2, {payload.num_blocks}, {self.num_kv_heads}, "
                f"{self.block_size_tokens}, {self.head_dim}], got data of {len(payload.data)} bytes, "
                f"nbytes = {payload.nbytes}"
            )
        if payload.num_blocks == 0:
            return
        shape = (self.num_layers, 2, payload.num_blocks, self.num_kv_heads, self.block_size_tokens, self.head_dim)
        blocks = torch.frombuffer(bytearray(payload.data), dtype=torch.float32).view(shape)
        index = torch.tensor(held[payload.first_block : end], dtype=torch.long, device=self.device)
        self.kv_cache[:, :, index] = blocks.to(self.device)
        self._written[reservation_id].update(range(payload.first_block, end))

    def kv_pool(self) -> KVPool:
        """The KV pool (one tensor, blocks on axis 2) for peer copies between llumlets of one host."""
        return KVPool((self.kv_cache,), 2)

    def write_blocks_from(
        self, reservation_id: str, first_block: int, source: KVPool, src_block_ids: Sequence[int]
    ) -> None:
        """Copy blocks straight from a peer's pool (opened with ``llumlet.kvpool.open_pool``) into the
        reservation at positions ``first_block ..``.

        Raises KeyError (unknown reservation), IndexError (past the reservation), ValueError (a pool of
        another layout).
        """
        held = self.blocks.reservation_blocks(reservation_id)
        if held is None:
            raise KeyError(f"{self.instance_id}: write_blocks: unknown reservation {reservation_id!r}")
        end = first_block + len(src_block_ids)
        if first_block < 0 or end > len(held):
            raise IndexError(
                f"{self.instance_id}: write_blocks: blocks {first_block}..{end}"
                f" exceed reservation {reservation_id!r} of {len(held)} blocks"
            )
        copy_between(source, src_block_ids, self.kv_pool(), held[first_block:end])
        self._written[reservation_id].update(range(first_block, end))

    def _count_prefill(self, num_tokens: int, seconds: float) -> None:
        self._prefill_tokens += num_tokens
        self._prefill_s += seconds

    def prefill_time_s(self, num_tokens: int, cached_tokens: int) -> float | None:
        """``num_tokens`` x the measured prefill time per token: the compute time of every prompt-token chunk
        this engine ran so far (prefill chunks of its steps and recomputed prefixes) over their tokens, seconds.
        A linear estimate (attention's share grows with the context, ``cached_tokens``, which it ignores: on this
        engine's small models the linear layers dominate). None before the first prefill was measured: no
        estimate, so a migration here copies the prefix."""
        if self._prefill_tokens == 0:
            return None
        return num_tokens * self._prefill_s / self._prefill_tokens

    def recompute_prefix(
        self, reservation_id: str, prompt_token_ids: Sequence[int], first_block: int, num_blocks: int
    ) -> float:
        """Compute the K/V of the prompt's tokens at positions ``[first_block·bs, (first_block + num_blocks)·bs)``
        through the model into the reservation's blocks, attending over the positions before them (which must
        hold the prompt's KV already); the positions count as written. Returns 0 (the time was spent here).

        Raises:
            KeyError: unknown reservation.
            IndexError: the blocks exceed the reservation.
            ValueError: ``prompt_token_ids`` has fewer than ``(first_block + num_blocks)·bs`` tokens, or the
                positions before ``first_block`` were never written.
        """
        where = f"{self.instance_id}: recompute_prefix({reservation_id!r})"
        held = self.blocks.reservation_blocks(reservation_id)
        written = self._written.get(reservation_id)
        if held is None or written is None:
            raise KeyError(f"{where}: unknown reservation")
        end = first_block + num_blocks
        if first_block < 0 or num_blocks < 0 or end > len(held):
            raise IndexError(f"{where}: blocks {first_block}..{end} exceed the reservation of {len(held)} blocks")
        bs = self.block_size_tokens
        if len(prompt_token_ids) < end * bs:
            raise ValueError(f"{where}: blocks ..{end} need {end * bs} prompt tokens, got {len(prompt_token_ids)}")
        if not set(range(first_block)) <= written:
            raise ValueError(f"{where}: positions before block {first_block} hold no KV to attend over")
        if num_blocks == 0:
            return 0.0
        t0 = self._clock()
        with torch.inference_mode():
            self._forward(held[:end], prompt_token_ids[first_block * bs : end * bs], first_block * bs, False)
        self._count_prefill(num_blocks * bs, self._clock() - t0)
        written.update(range(first_block, end))
        return 0.0

    def commit_incoming(self, reservation_id: str, state: MigrationState) -> bool:
        """Adopt a migrated request with its KV in place and its generator state; it runs from the next step.

        Returns True. (The protocol's False, "its growth does not fit", cannot arise here: every block the
        KV needs must already lie in the reservation and be written, since growth past the reservation
        would carry no data. The llumlet reserves with a margin for the blocks added during pre-copy.)

        Raises:
            KeyError: unknown (released) reservation.
            ValueError: the request is already here; the state is not in decode phase, lacks token ids,
                comes from a different model (fingerprint) or from an engine with another EOS id, or has no
                valid generator state; or a block position the KV needs was never written. Nothing changes.
        """
        where = f"{self.instance_id}: commit_incoming({state.request_id!r})"
        if state.request_id in self.scheduler.requests:
            raise ValueError(f"{where}: the request is already here")
        if state.num_output_tokens < 1 or state.num_computed_tokens != state.num_tokens - 1:
            raise ValueError(
                f"{where}: not in decode phase (computed {state.num_computed_tokens} of {state.num_tokens} tokens)"
            )
        written = self._written.get(reservation_id)
        if written is None:
            raise KeyError(f"{where}: unknown reservation {reservation_id!r} (released or never made)")
        params = self._check_request(where, state.prompt_token_ids, state.max_tokens, state.sampling_params)
        if len(state.output_token_ids) != state.num_output_tokens:
            raise ValueError(
                f"{where}: {len(state.output_token_ids)} output_token_ids for {state.num_output_tokens} outputs"
            )
        if state.extra.get(EXTRA_MODEL_FINGERPRINT) != self.model_fingerprint:
            raise ValueError(
                f"{where}: model fingerprint {state.extra.get(EXTRA_MODEL_FINGERPRINT)!r} != this engine's "
                f"{self.model_fingerprint!r} (different model or not from a torch engine)"
            )
        if state.extra.get(EXTRA_EOS_TOKEN_ID, -1) != self.eos_token_id:
            raise ValueError(
                f"{where}: the source stops on eos_token_id {state.extra.get(EXTRA_EOS_TOKEN_ID, '(missing)')!r}, "
                f"this engine on {self.eos_token_id!r}: the continuation would differ"
            )
        generator = self._restore_generator(where, state.extra.get(EXTRA_GENERATOR_STATE))
        missing = sorted(set(range(self.blocks.blocks_for_tokens(state.num_computed_tokens))) - written)
        if missing:
            raise ValueError(f"{where}: block positions {missing} of reservation {reservation_id!r} were never written")
        if self.blocks.commit(reservation_id, state.request_id, state.num_computed_tokens) is None:
            return False
        del self._written[reservation_id]
        request = EngineRequest(
            request_id=state.request_id,
            prompt_tokens=state.prompt_tokens,
            max_tokens=state.max_tokens,
            priority=state.priority,
            arrival_s=state.arrival_s,
            prefix_block_hashes=state.prefix_block_hashes,
            prefix_hash_block_tokens=state.prefix_hash_block_tokens,
            prompt_token_ids=state.prompt_token_ids,
            sampling_params=state.sampling_params,
        )
        sched_state = self.scheduler.new_state(request)
        sched_state.num_output_tokens = state.num_output_tokens
        sched_state.num_computed_tokens = state.num_computed_tokens
        sched_state.output_token_ids = list(state.output_token_ids)
        self.scheduler.add_running(sched_state)
        self._params[state.request_id] = params
        self._generators[state.request_id] = generator
        return True

    def _restore_generator(self, where: str, raw: object) -> torch.Generator:
        generator = torch.Generator()
        expected = len(_generator_state(generator))
        if not isinstance(raw, bytes) or len(raw) != expected:
            size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
            raise ValueError(f"{where}: extra[{EXTRA_GENERATOR_STATE!r}] must be {expected} bytes, got {size}")
        try:
            generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        except RuntimeError as exc:
            raise ValueError(f"{where}: invalid generator state: {exc}") from exc
        return generator
