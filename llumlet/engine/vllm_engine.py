"""VllmEngine: the engine protocol over vLLM's v1 engine, with live KV-cache migration between vLLM instances.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``, one
GPU, tensor parallel size 1; the model runner, CUDA graphs and prefix caching as vLLM sets them, async
scheduling off: :data:`REFUSED_ENGINE_ARGS` says why): ``LLMEngine`` adds, aborts and steps requests; a KV
connector of vLLM's public API (:class:`HilumMigrationConnector`, a ``KVConnectorBase_V1``) hands a migrated
request its KV when the destination re-admits it; everything else that needs vLLM's insides (queues, block
pool, paged KV tensors, the V1 sampler's generator) goes through :mod:`llumlet.engine.vllm_internals`,
which checks the vLLM version.

Migration (DESIGN.md, "Migration"; docs/vllm.md, "How a move works"): the source copies blocks of the
request's block table out of the paged KV tensors without the engine lock while the request keeps
decoding (``begin_read``); ``reserve`` takes blocks out of the destination's block pool (adopting the
prompt blocks its prefix cache already holds: ``adopt_cached_prefix``) and ``write_blocks`` /
``write_blocks_from`` fill the others; at ``suspend`` the source takes the request out of its scheduler's
running list (it keeps its blocks); ``commit_incoming`` re-admits the request on the destination with
prompt + generated tokens as its prompt, at the head of the waiting queue, with ``kv_transfer_params`` in
``SamplingParams.extra_args`` naming the reservation: the reservation's full blocks reach the request
through the prefix cache (no copy), the rest of the moved tokens are loaded by the connector into fresh
blocks (nothing is recomputed, no shared block is written), and the V1 runner's generator is restored
before the step samples.

Sampling: every field of hilum's ``SamplingParams`` maps onto vLLM's (:func:`vllm_sampling_params`): top-k,
``min_tokens``, the repetition / frequency / presence penalties, stop token ids, logprobs with top
alternatives (returned per token as :class:`~llumlet.engine.types.TokenLogprobs`, vLLM's raw logprobs) and
guided decoding (vLLM's ``StructuredOutputsParams``, its ``auto`` structured-output backend: xgrammar, which
the CPU build runs too). Stop strings are the gateway's (it matches them on the text), never the engine's.

What re-admission would lose and how it is carried (``MigrationState``: ``sampling_params`` and ``extra``):

- seeded sampling: the V1 runner's per-request ``torch.Generator`` state; the V2 runner needs none (its
  noise is a hash of seed and position). Random requests without a seed get one drawn from the engine's
  ``rng``, so every random request can move;
- ``max_tokens`` / ``min_tokens``: the destination gets what remains of each;
- repetition penalty: vLLM applies it to tokens seen in the prompt or the output alike, so output tokens
  turned into prompt tokens are penalised exactly as before;
- stop token ids, ``ignore_eos``, temperature, top-p, top-k, logprobs: unchanged.

Refused by :meth:`VllmEngine.migratable` (:func:`not_migratable`; the destination would see the output tokens
as prompt tokens): frequency and presence penalties (vLLM counts them over output tokens only) and guided
decoding (the destination's grammar would start over at the moved output). The load report marks such
requests unmigratable, so no scheduler plans a move for them.

Blocks are portable only between engines of the same model, dtype, block size, KV layout, model runner and
vLLM build: ``extra["model_fingerprint"]`` must match on commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import vllm  # type: ignore[import-not-found, unused-ignore]
from vllm import SamplingParams as VllmSamplingParams  # type: ignore[import-not-found, unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.engine.arg_utils import EngineArgs  # type: ignore[import-not-found, unused-ignore]
from vllm.exceptions import VLLMClientError  # type: ignore[import-not-found, unused-ignore]
from vllm.inputs import TokensPrompt  # type: ignore[import-not-found, unused-ignore]
from vllm.sampling_params import (  # type: ignore[import-not-found, unused-ignore]
    RequestOutputKind,
    StructuredOutputsParams,
)
from vllm.v1.engine.llm_engine import LLMEngine  # type: ignore[import-not-found, unused-ignore]

from llumlet.engine import vllm_internals as vi
from llumlet.engine.core import RequestTooLargeError
from llumlet.engine.protocol import BlockRun, KVPayload
from llumlet.engine.types import (
    EngineLoad,
    EngineRequest,
    GuidedDecoding,
    MigrationState,
    RunningRequestLoad,
    SamplingParams,
    StepResult,
    TokenLogprobs,
)
from llumlet.kvpool import KVPool, copy_between

__all__ = [
    "EXTRA_GENERATOR_STATE",
    "EXTRA_MODEL_FINGERPRINT",
    "REFUSED_ENGINE_ARGS",
    "HilumMigrationConnector",
    "VllmEngine",
    "not_migratable",
    "tiny_llama_checkpoint",
    "vllm_sampling_params",
]

#: Prefix hash ids a VllmEngine remembers for its load reports (the prompts it served most recently; each is
#: reported while vLLM still caches its block): twice the default ``prefix_cache.report_max_hashes``.
_MAX_PREFIX_IDS = 1024

EXTRA_GENERATOR_STATE = "generator_state"  # MigrationState.extra key: bytes of the sampler generator, or None
EXTRA_MODEL_FINGERPRINT = "model_fingerprint"  # MigrationState.extra key: str, VllmEngine.model_fingerprint
KV_PARAMS_KEY = "hilum_migration"  # key in kv_transfer_params: the reservation id of a re-admitted request

#: EngineArgs the backend sets itself and refuses to change, with the reason (docs/vllm.md, "How the backend
#: runs vLLM").
REFUSED_ENGINE_ARGS: Mapping[str, str] = {
    "distributed_executor_backend": (
        "the backend drives one in-process worker ('uni'): reserve, suspend and the KV copies act on the "
        "scheduler, block pool and KV tensors of this process"
    ),
    "tensor_parallel_size": (
        "tensor parallelism needs vLLM's multiprocess executor, whose workers hold the KV shards in other "
        "processes; the backend copies KV in this process (not supported yet)"
    ),
    "pipeline_parallel_size": "pipeline parallelism spreads the KV over several workers (not supported)",
    "async_scheduling": (
        "with async scheduling the scheduler runs one step ahead, so a step of every running request is in "
        "flight at any time: there is no point between two steps where suspend may take a request out"
    ),
    "kv_transfer_config": "the backend installs its own KV connector (HilumMigrationConnector)",
}
_REQUIRED_ARGS: Mapping[str, object] = {  # the one value each refused argument may take
    "distributed_executor_backend": "uni",
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "async_scheduling": False,
}


def not_migratable(params: SamplingParams) -> str | None:
    """Why a request sampling with ``params`` cannot move faithfully between vLLM engines, or None.

    The destination re-admits the request with its output so far as prompt: frequency and presence penalties
    (vLLM counts them over output tokens only) would stop counting it, a guided-decoding grammar would start
    over at it.
    """
    if params.frequency_penalty or params.presence_penalty:
        return (
            f"frequency/presence penalty ({params.frequency_penalty}, {params.presence_penalty}): vLLM counts "
            "them over output tokens only, and the destination re-admits the output as prompt"
        )
    if params.guided is not None:
        return (
            f"guided decoding ({params.guided.kind}): the destination's grammar would start over at the output "
            "moved with the request"
        )
    return None


def _structured_outputs(guided: GuidedDecoding | None) -> StructuredOutputsParams | None:
    """hilum's constraint as vLLM's ``StructuredOutputsParams`` (``GUIDED_KINDS``: what ``spec`` holds)."""
    if guided is None:
        return None
    if guided.kind == "json_schema":
        return StructuredOutputsParams(json=guided.spec)
    if guided.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if guided.kind == "regex":
        return StructuredOutputsParams(regex=guided.spec)
    if guided.kind == "choice":
        return StructuredOutputsParams(choice=[str(c) for c in json.loads(guided.spec)])
    return StructuredOutputsParams(grammar=guided.spec)  # "grammar": EBNF / Lark, vLLM's backend tells which


def vllm_sampling_params(
    params: SamplingParams, num_done: int = 0, kv_transfer_params: Mapping[str, str] | None = None
) -> VllmSamplingParams:
    """vLLM's ``SamplingParams`` for hilum's ``params`` after ``num_done`` output tokens (a re-admitted
    migrated request: what remains of ``max_tokens`` and ``min_tokens``).

    Field by field the meanings are the same (``llumlet.engine.types.SamplingParams`` follows vLLM's): top-k 0
    = all tokens in both; ``logprobs`` k = the sampled token's log probability and the k most probable;
    ``guided`` becomes ``structured_outputs``. Outputs come as deltas (``RequestOutputKind.DELTA``), without
    text (``detokenize=False``: stop strings are the gateway's). ``kv_transfer_params`` go to the KV
    connector (``extra_args``). Raises vLLM's ``VLLMValidationError`` (or ValueError) on a setting it refuses.
    """
    return VllmSamplingParams(
        n=1,
        max_tokens=params.max_tokens - num_done,
        min_tokens=max(params.min_tokens - num_done, 0),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logprobs=params.logprobs,
        structured_outputs=_structured_outputs(params.guided),
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None,
    )


def _token_logprobs(token: int, entry: Mapping[int, Any], k: int) -> TokenLogprobs:
    """vLLM's logprobs of one position (``{token id: Logprob(logprob, rank, ...)}``: the sampled token and the
    ``k`` most probable) as hilum's: the sampled token's, and the top ``k`` by rank."""
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return TokenLogprobs(float(entry[token].logprob), tuple((int(t), float(v)) for _, t, v in top[:k]))


# ---- the KV connector (vLLM's public API) ----------------------------------------------------------------


@dataclass
class _Incoming:
    """A committed migrated request waiting for admission on the destination; it holds its reservation."""

    internal_id: str  # vLLM's request id ("" until the request is submitted)
    num_computed_tokens: int  # tokens whose KV was moved (prompt + output - 1)
    blocks: list[Any]  # the reservation's KVCacheBlocks holding the moved KV, in block-table order
    generator_state: bytes | None  # V1 runner: the sampler generator's state; None on V2 or greedy
    handles: vi.EngineHandles


@dataclass
class _HilumMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Scheduler -> worker, one step: KV loads to run before the forward pass (in-process only)."""

    loads: list[Callable[[], None]] = field(default_factory=list)


class HilumMigrationConnector(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """Hands the KV of migrated requests to them when the destination re-admits them.

    Scheduler side, for a request whose ``kv_transfer_params`` carry ``{"hilum_migration": <reservation
    id>}`` registered in ``incoming`` (by :meth:`VllmEngine.commit_incoming`):

    - ``on_new_request``: with prefix caching on, the reservation's full blocks are registered in the
      prefix cache under the request's block hashes, so the scheduler finds them as a local hit and gives
      them to the request without a copy (the reservation keeps its reference until the step ran);
    - ``get_num_new_matched_tokens``: the moved tokens beyond the local hit are reported as externally
      computed, loaded synchronously;
    - ``update_state_after_alloc``: the blocks the scheduler allocated past the local hit (fresh, never
      shared) get the moved KV from the reservation's blocks at the same positions, at the next step's
      ``start_load_kv``, before the forward pass; the V1 runner's sampling generator is restored there too.

    Blocks the local hit took from the cache (possibly shared with other requests) are never written. The
    reservation's blocks go back to the pool after the step that admitted the request
    (:meth:`release_loaded`). The worker side keeps no state, so engines in one process may share vLLM's
    global worker connector. Every other request passes through untouched (0 external tokens).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.incoming: dict[str, _Incoming] = {}  # reservation id -> request (set by VllmEngine)
        self._pending: list[Callable[[], None]] = []
        self._admitted: list[_Incoming] = []  # loads issued this step; their reservations free after it

    def held_blocks(self) -> int:
        """Reservation blocks still held for committed requests (counted as reserved in the load)."""
        return sum(len(e.blocks) for e in self.incoming.values()) + sum(len(e.blocks) for e in self._admitted)

    def release_loaded(self) -> None:
        """After a step: give the reservations of the requests admitted in it back to the pool."""
        for entry in self._admitted:
            vi.free_pool_blocks(entry.handles, entry.blocks)
        self._admitted = []

    def drop(self, internal_id: str) -> None:
        """The request left before admission: give its reservation back."""
        for key, entry in list(self.incoming.items()):
            if entry.internal_id == internal_id:
                del self.incoming[key]
                vi.free_pool_blocks(entry.handles, entry.blocks)

    # scheduler side
    def _key(self, request: Any) -> str | None:
        key = (request.kv_transfer_params or {}).get(KV_PARAMS_KEY)
        return key if isinstance(key, str) and key in self.incoming else None

    def on_new_request(self, request: Any) -> None:
        key = self._key(request)
        if key is None:
            return
        entry = self.incoming[key]
        full = entry.num_computed_tokens // int(entry.handles.scheduler.block_size)
        vi.cache_moved_blocks(entry.handles, request, entry.blocks, full)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        key = self._key(request)
        if key is None:
            return 0, False
        return max(self.incoming[key].num_computed_tokens - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        key = self._key(request)
        if key is None:
            return
        entry = self.incoming.pop(key)
        self._admitted.append(entry)
        block_size = int(entry.handles.scheduler.block_size)
        local = entry.num_computed_tokens - num_external_tokens  # tokens the prefix cache gave (block-aligned)
        first = local // block_size
        end = -(-entry.num_computed_tokens // block_size)
        dst = list(blocks.get_block_ids()[0])[first:end] if num_external_tokens else []
        src = [b.block_id for b in entry.blocks[first:end]] if num_external_tokens else []

        def load() -> None:
            if src:
                vi.copy_kv_blocks(entry.handles, src, dst)
            if entry.generator_state is not None:
                vi.set_generator_state(entry.handles, entry.internal_id, entry.generator_state)

        self._pending.append(load)

    def build_connector_meta(self, scheduler_output: Any) -> _HilumMetadata:
        meta = _HilumMetadata(loads=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in getattr(meta, "loads", ()):
            load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


# ---- the engine ------------------------------------------------------------------------------------------


@dataclass
class _Tracked:
    """hilum's view of one request in this engine."""

    request: EngineRequest  # as submitted (original prompt, max_tokens, priority, arrival)
    params: SamplingParams  # effective hilum params (seed filled in for random sampling)
    internal_id: str  # vLLM's request id
    output_ids: list[int]  # every output token so far, those produced before a migration included
    num_carried: int = 0  # of output_ids, produced on other engines (the vLLM request sees them as prompt)
    suspended: bool = False
    num_preemptions_seen: int = 0
    num_loaded_tokens: int = 0  # KV tokens moved in, not yet admitted (counted as computed, not computed)


@dataclass
class _Reservation:
    blocks: list[Any]  # vLLM KVCacheBlock objects held out of the pool, in block-table position order
    written: set[int] = field(default_factory=set)  # positions written


class VllmEngine:
    """One vLLM instance (in-process v1 engine) behind ``llumlet.engine.protocol.Engine``.

    Args:
        instance_id: for messages only.
        model: HF model name or local checkpoint directory.
        block_size_tokens: vLLM block size (the CPU backend needs a multiple of 32; GPUs take 16).
        kv_cache_memory_bytes: KV cache size; the pool has ``kv_cache_memory_bytes // kv_bytes_per_block``
            blocks (one of them vLLM's null block, not usable).
        num_blocks: usable KV blocks instead: the pool holds exactly this many plus vLLM's null block
            (``num_gpu_blocks_override``) and vLLM's memory profile is skipped (on a GPU they must fit).
        dtype: model dtype ("float32" on CPU for exact comparisons, "bfloat16"/"float16" on GPUs).
        max_model_len: longest prompt + output, tokens.
        max_num_seqs, max_num_batched_tokens: the scheduler's batch limits.
        rng: draws a seed for random-sampling requests without one (default ``random.Random()``).
        clock: seconds, monotonic; ``StepResult.duration_s`` is the measured wall time of the step.
        engine_kwargs: further ``vllm.engine.arg_utils.EngineArgs`` fields (e.g. ``gpu_memory_utilization``,
            ``enforce_eager``, ``enable_prefix_caching``); those in :data:`REFUSED_ENGINE_ARGS` raise.
        allow_untested_vllm: skip the version check of :mod:`llumlet.engine.vllm_internals`.

    vLLM decides the model runner (V2 wherever Triton runs), CUDA graphs and prefix caching (on by default;
    migrated KV is handed over through it). Async scheduling is off (see :data:`REFUSED_ENGINE_ARGS`).
    vLLM's scheduler runs its ``priority`` policy (``scheduling_policy``; ``engine_kwargs`` may set
    ``"fcfs"``): a request's hilum priority class orders its queue (a higher class first, then arrival) and
    picks the preemption victim (the lowest class, latest arrival); equal classes keep vLLM's FCFS order.

    Raises:
        vllm_internals.UnsupportedVllmError: a vLLM version outside the supported range, multiprocessing on,
            or an engine layout the backend cannot drive (see :func:`vllm_internals.engine_handles`).
        ValueError: an ``engine_kwargs`` entry the backend cannot honour (named, with the reason), both
            ``kv_cache_memory_bytes`` and ``num_blocks``, or ``num_blocks`` < 1.
    """

    def __init__(
        self,
        instance_id: str,
        model: str,
        *,
        block_size_tokens: int = 16,
        kv_cache_memory_bytes: int | None = None,
        num_blocks: int | None = None,
        dtype: str = "auto",
        max_model_len: int = 4096,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.perf_counter,
        engine_kwargs: Mapping[str, Any] | None = None,
        allow_untested_vllm: bool = False,
    ) -> None:
        vi.check_vllm_version(vllm.__version__, allow_untested_vllm)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
            raise vi.UnsupportedVllmError(
                "VllmEngine drives vLLM in-process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before importing vllm"
            )
        self.instance_id = instance_id
        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": dtype,
            "block_size": block_size_tokens,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "distributed_executor_backend": "uni",
            "tensor_parallel_size": 1,
            "async_scheduling": False,
            "scheduling_policy": "priority",  # the request's class orders the queue and picks victims
            "seed": seed,
            "kv_transfer_config": {
                "kv_connector": "HilumMigrationConnector",
                "kv_connector_module_path": __name__,
                "kv_role": "kv_both",
            },
        }
        if kv_cache_memory_bytes is not None and num_blocks is not None:
            raise ValueError(f"{instance_id}: give kv_cache_memory_bytes or num_blocks, not both")
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if num_blocks is not None:
            if num_blocks < 1:
                raise ValueError(f"{instance_id}: num_blocks = {num_blocks}: need >= 1")
            kwargs["num_gpu_blocks_override"] = num_blocks + 1  # + vLLM's null block
            # an explicit size skips vLLM's memory profile (on CPU: reserving gpu_memory_utilization of the
            # node's RAM); the override then sizes the pool, whatever this says (kv_cache_utils)
            if "gpu_memory_utilization" not in (engine_kwargs or {}):
                kwargs["kv_cache_memory_bytes"] = 1
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        for key, value in (engine_kwargs or {}).items():
            if key in REFUSED_ENGINE_ARGS and (key == "kv_transfer_config" or value != _REQUIRED_ARGS.get(key)):
                raise ValueError(f"{instance_id}: engine_kwargs[{key!r}] = {value!r}: {REFUSED_ENGINE_ARGS[key]}")
            kwargs[key] = value
        self.llm = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        self._h = vi.engine_handles(self.llm)
        self.stateless_sampling = vi.stateless_sampling(self.llm)  # V2 runner: seeded noise, no generator
        connector = self._h.scheduler.connector
        if not isinstance(connector, HilumMigrationConnector):
            raise vi.UnsupportedVllmError(f"scheduler connector is {type(connector).__name__}, not hilum's")
        self._connector = connector
        self._block_size = int(self._h.scheduler.block_size)
        self._max_model_len = int(self.llm.model_config.max_model_len)
        self._dtype = self._h.kv_caches[0].dtype
        self._block_shape = vi.kv_block_shape(self._h)
        runner = "v2" if self.stateless_sampling else "v1"  # their random streams differ: no move between them
        self.model_fingerprint = _fingerprint(
            model, str(self.llm.model_config.dtype), self._block_size, self._block_shape, str(self._dtype), runner
        )
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._tracked: dict[str, _Tracked] = {}  # external request id -> state
        self._by_internal: dict[str, str] = {}  # vLLM request id -> external id
        self._reservations: dict[str, _Reservation] = {}
        self._last_step_preempted = False
        # hilum prefix hash id -> vLLM's hash of the last block of that hash block, for prompts served here,
        # least recently served first (at most _MAX_PREFIX_IDS): what load() reports, checked in vLLM's cache
        self._prefix_ids: OrderedDict[int, Any] = OrderedDict()
        self._prefix_block_tokens = 0

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def block_size_tokens(self) -> int:
        """Tokens per KV cache block."""
        return self._block_size

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block, all layers, K and V: layers x prod(per-block shape) x dtype size."""
        return len(self._h.kv_caches) * math.prod(self._block_shape) * self._dtype.itemsize

    @property
    def total_blocks(self) -> int:
        """Usable blocks in the pool (vLLM's null block excluded)."""
        return self._h.num_blocks - 1

    def max_request_tokens(self) -> int:
        """Largest prompt + output - 1 (KV tokens) one request may need: pool and ``max_model_len``."""
        return min(self.total_blocks * self._block_size, self._max_model_len)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (FCFS). ``sampling_params`` None means greedy (:func:`vllm_sampling_params`).

        Raises:
            RequestTooLargeError: prompt + max_tokens - 1 tokens exceed the pool or ``max_model_len``.
            ValueError: duplicate id, no ``prompt_token_ids``, ``sampling_params.max_tokens`` different
                from ``request.max_tokens``, or a setting vLLM refuses (e.g. a guided-decoding spec its
                structured-output backend cannot compile).
        """
        where = f"{self.instance_id}: request {request.request_id!r}"
        need = request.prompt_tokens + request.max_tokens - 1
        if need > self.max_request_tokens():
            raise RequestTooLargeError(
                f"{where} needs {need} KV tokens, this engine holds {self.max_request_tokens()} "
                f"({self.total_blocks} blocks x {self._block_size}, max_model_len {self._max_model_len})"
            )
        if request.request_id in self._tracked:
            raise ValueError(f"{where} is already in this engine")
        if request.prompt_token_ids is None:
            raise ValueError(f"{where}: the vLLM engine needs prompt_token_ids")
        params = _effective_params(where, request, self._rng)
        internal = self._submit(request.request_id, list(request.prompt_token_ids), params, request, 0)
        self._track(_Tracked(request, params, internal, []))

    def _submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        request: EngineRequest,
        num_done: int,
        kv_params: dict[str, str] | None = None,
    ) -> str:
        """Add to vLLM with what remains of max_tokens / min_tokens after ``num_done`` outputs."""
        try:
            vparams = vllm_sampling_params(params, num_done, kv_params)
            internal: str = self.llm.add_request(  # vLLM serves a lower value first; hilum a higher class
                request_id, TokensPrompt(prompt_token_ids=prompt_ids), vparams, priority=-request.priority
            )
        except (ValueError, VLLMClientError) as exc:  # vLLM's validation of the request (VLLMValidationError)
            raise ValueError(f"{self.instance_id}: request {request_id!r}: vLLM refused it: {exc}") from exc
        return internal

    def _track(self, tracked: _Tracked) -> None:
        self._tracked[tracked.request.request_id] = tracked
        self._by_internal[tracked.internal_id] = tracked.request.request_id
        self._remember_prefix(tracked.request, tracked.internal_id)

    def _remember_prefix(self, request: EngineRequest, internal_id: str) -> None:
        """Map the request's hilum prefix hash ids to vLLM's hashes of the same blocks (the last vLLM block of
        each hash block), so that :meth:`load` can report the ids whose blocks vLLM still caches. Nothing when
        prefix caching is off or a hash block is not a whole number of vLLM blocks."""
        hashes, tokens = request.prefix_block_hashes, request.prefix_hash_block_tokens
        if not hashes or tokens % self._block_size or not vi.prefix_caching_enabled(self._h):
            return
        per = tokens // self._block_size
        ours = vi.request_block_hashes(self._h, internal_id)
        for j, hid in enumerate(hashes[: len(ours) // per]):
            self._prefix_ids[hid] = ours[(j + 1) * per - 1]
            self._prefix_ids.move_to_end(hid)
        self._prefix_block_tokens = tokens
        while len(self._prefix_ids) > _MAX_PREFIX_IDS:
            self._prefix_ids.popitem(last=False)

    def _forget(self, request_id: str) -> _Tracked | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self._by_internal.pop(tracked.internal_id, None)
            self._connector.drop(tracked.internal_id)
        return tracked

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting, running, suspended); free its blocks. False if unknown."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return False
        if tracked.suspended:
            vi.unpause_request(self._h, tracked.internal_id)
        self.llm.abort_request([tracked.internal_id], internal=True)
        self._forget(request_id)
        return True

    def has_work(self) -> bool:
        """True while a request waits or runs (suspended requests alone are not work)."""
        return bool(self._h.scheduler.running) or len(self._h.scheduler.waiting) > 0

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One ``LLMEngine.step()``: new token ids per request, finished requests with their reasons.

        ``finish_reasons``: vLLM's ("stop": EOS or a stop token; "length": max_tokens). ``logprobs``, for the
        requests that asked for them: one :class:`TokenLogprobs` per new token (vLLM's raw logprobs: the
        model's distribution before temperature, penalties and top-k/p; a guided request's grammar mask is
        in it, as vLLM applies the mask to the logits). Prefill and decode token counts come from each
        request's computed-token count before and after the step.
        """
        before = {
            t.request.request_id: (r.num_computed_tokens, r.num_prompt_tokens)
            for t in self._tracked.values()
            if not t.suspended and (r := vi.scheduler_request(self._h, t.internal_id)) is not None
        }
        start = self._clock()
        outputs = self.llm.step() if self.has_work() else []
        duration_s = self._clock() - start if outputs or before else 0.0
        self._connector.release_loaded()  # the step ran: the re-admitted requests own their KV now
        token_ids: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
        finished: list[str] = []
        reasons: dict[str, str] = {}
        for out in outputs:
            rid = self._by_internal.get(out.request_id) or out.request_id
            tracked = self._tracked.get(rid)
            if tracked is None or not out.outputs:
                continue
            completion = out.outputs[0]
            ids = tuple(int(t) for t in completion.token_ids)
            if ids:
                token_ids[rid] = ids
                tracked.output_ids.extend(ids)
                k = tracked.params.logprobs
                if k is not None:
                    entries = list(completion.logprobs or ())
                    if len(entries) != len(ids):
                        raise vi.UnsupportedVllmError(
                            f"{self.instance_id}: vLLM returned {len(entries)} logprobs for {len(ids)} tokens"
                        )
                    logprobs[rid] = tuple(_token_logprobs(t, e, k) for t, e in zip(ids, entries, strict=True))
            if out.finished:
                finished.append(rid)
                reasons[rid] = str(completion.finish_reason or "stop")
        prefill = decode = scheduled = 0
        preempted: list[str] = []
        for rid, (computed, prompt) in before.items():
            tracked = self._tracked[rid]
            r = vi.scheduler_request(self._h, tracked.internal_id)
            after = r.num_computed_tokens if r is not None else computed + len(token_ids.get(rid, ()))
            if r is not None and r.num_preemptions > tracked.num_preemptions_seen:
                tracked.num_preemptions_seen = r.num_preemptions
                preempted.append(rid)
                continue
            if after > computed and tracked.num_loaded_tokens:
                computed += tracked.num_loaded_tokens  # loaded by the connector, not computed
                tracked.num_loaded_tokens = 0
            if after > computed:
                scheduled += 1
                if computed >= prompt:
                    decode += after - computed
                else:
                    prefill += after - computed
        for rid in finished:
            self._forget(rid)
        self._last_step_preempted = bool(preempted)
        return StepResult(
            duration_s=duration_s,
            new_tokens={rid: len(ids) for rid, ids in token_ids.items()},
            finished=tuple(finished),
            preempted=tuple(preempted),
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            num_scheduled_seqs=scheduled,
            token_ids=token_ids,
            finish_reasons=reasons,
            logprobs=logprobs,
        )

    def load(self) -> EngineLoad:
        """Block usage (from the block pool) and queue state (from the scheduler)."""
        sched = self._h.scheduler
        reserved = sum(len(r.blocks) for r in self._reservations.values()) + self._connector.held_blocks()
        free = int(self._h.block_pool.get_num_free_blocks())
        running = []
        for r in sched.running:
            tracked = self._tracked.get(self._by_internal.get(r.request_id, ""))
            running.append(
                RunningRequestLoad(
                    request_id=tracked.request.request_id if tracked else r.request_id,
                    blocks=len(vi.request_block_ids(self._h, r.request_id)),
                    priority=tracked.request.priority if tracked else 0,
                    num_tokens=int(r.num_tokens),
                    in_decode=r.num_computed_tokens >= r.num_prompt_tokens,
                    output_tokens=int(r.num_output_tokens),
                    max_tokens=tracked.request.max_tokens if tracked else 0,
                    max_blocks=(
                        -(-(tracked.request.prompt_tokens + tracked.request.max_tokens - 1) // self._block_size)
                        if tracked
                        else 0
                    ),
                    unmigratable_reason=(not_migratable(tracked.params) or "") if tracked else "",
                )
            )
        waiting = list(sched.waiting)
        demands = [math.ceil(int(r.num_tokens) / self._block_size) for r in waiting]
        held = frozenset(hid for hid, ours in self._prefix_ids.items() if vi.is_cached(self._h, ours))
        return EngineLoad(
            total_blocks=self.total_blocks,
            used_blocks=self.total_blocks - free - reserved,
            reserved_blocks=reserved,
            cached_blocks=0,
            running=tuple(running),
            num_waiting=len(waiting),
            head_demand_blocks=demands[0] if demands else 0,
            queued_demand_blocks=sum(demands),
            preempting=self._last_step_preempted or any(r.num_preemptions for r in waiting),
            num_suspended=sum(t.suspended for t in self._tracked.values()),
            max_num_seqs=int(getattr(sched, "max_num_running_reqs", 0)),  # vLLM's max_num_seqs, as it runs
            prefix_hashes=held,
            prefix_block_tokens=self._prefix_block_tokens if held else 0,
        )

    # ---- migration: source side -----------------------------------------------------------------
    def request_kv(self, request_id: str) -> tuple[int, int] | None:
        """(tokens whose KV is in the cache, blocks held) of an unfinished request; None if unknown."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        r = vi.scheduler_request(self._h, tracked.internal_id)
        if r is None:
            return None
        return int(r.num_computed_tokens), len(vi.request_block_ids(self._h, tracked.internal_id))

    def migratable(self, request_id: str) -> str | None:
        """None when the request can move faithfully now, else why not.

        Refused: unknown; suspended; not running (waiting, preempted); in prefill; frequency/presence
        penalties or guided decoding (:func:`not_migratable`).
        """
        where = f"{self.instance_id}: request {request_id!r}"
        tracked = self._tracked.get(request_id)
        r = vi.scheduler_request(self._h, tracked.internal_id) if tracked else None
        if tracked is None or r is None:
            return f"{self.instance_id}: unknown request {request_id!r}"
        if tracked.suspended:
            return f"{where} is suspended"
        if r not in self._h.scheduler.running:
            return f"{where} is {str(r.status).lower()}, not running (waiting)"
        if r.num_computed_tokens < r.num_prompt_tokens or r.num_computed_tokens != r.num_tokens - 1:
            return f"{where} is still in prefill"
        reason = not_migratable(tracked.params)
        return f"{where}: {reason}" if reason else None

    def read_blocks(self, request_id: str, first_block: int, num_blocks: int) -> KVPayload:
        """The KV of ``num_blocks`` blocks from position ``first_block`` of the request's block table.

        ``data`` = raw bytes (KV dtype, native order, C-contiguous) of a tensor
        ``[num_layers, num_blocks, *per-block shape]`` (per-block shape: the attention backend's, see
        ``vllm_internals.read_kv_blocks``); ``nbytes == len(data) == num_blocks x kv_bytes_per_block``.

        Raises KeyError for an unknown request, IndexError past its last block.
        """
        return self.begin_read(request_id, first_block, num_blocks).copy(first_block, num_blocks)

    def begin_read(self, request_id: str, first_block: int, num_blocks: int) -> BlockRun:
        """Pin down a run of the request's blocks (``BlockRun``); its ``copy`` gathers them on the copy stream
        into pinned host memory without the engine lock (layout of :meth:`read_blocks`).

        ``still_valid`` is True while the request is in the scheduler, was not preempted since, and its block
        table holds the same blocks at those positions. Raises KeyError / IndexError as :meth:`read_blocks`.
        """
        tracked = self._tracked.get(request_id)
        r = vi.scheduler_request(self._h, tracked.internal_id) if tracked is not None else None
        if tracked is None or r is None:
            raise KeyError(f"{self.instance_id}: read_blocks: unknown request {request_id!r}")
        internal = tracked.internal_id
        table = vi.request_block_ids(self._h, internal)
        if first_block < 0 or num_blocks < 0 or first_block + num_blocks > len(table):
            raise IndexError(
                f"{self.instance_id}: read_blocks({request_id!r}, {first_block}, {num_blocks}): "
                f"it holds {len(table)} blocks"
            )
        ids = tuple(table[first_block : first_block + num_blocks])
        preemptions = int(r.num_preemptions)
        per_block = self.kv_bytes_per_block

        def copy(first: int, n: int) -> KVPayload:
            if first < first_block or n < 0 or first + n > first_block + len(ids):
                raise IndexError(f"copy({first}, {n}) outside the run {first_block}..{first_block + len(ids)}")
            data = vi.copy_blocks_to_host(self._h, ids[first - first_block : first - first_block + n])
            return KVPayload(first, n, n * per_block, data)

        def still_valid() -> bool:
            now = vi.scheduler_request(self._h, internal)
            return (
                now is r
                and int(now.num_preemptions) == preemptions
                and tuple(vi.request_block_ids(self._h, internal)[first_block : first_block + len(ids)]) == ids
            )

        return BlockRun(request_id, first_block, ids, per_block, copy, still_valid)

    def suspend(self, request_id: str) -> MigrationState | None:
        """Between two steps: take a running decode-phase request out of the scheduler; it keeps its blocks.

        ``extra``: ``generator_state`` (bytes or None for greedy), ``model_fingerprint`` (str).
        ``sampling_params`` (every setting, :func:`vllm_sampling_params`); its ``seed`` is the seed the
        request samples with (drawn here if it had none). None when it cannot move (:meth:`migratable`).
        """
        if self.migratable(request_id) is not None:
            return None
        tracked = self._tracked[request_id]
        r = vi.scheduler_request(self._h, tracked.internal_id)
        assert r is not None  # migratable() checked it
        vi.pause_request(self._h, tracked.internal_id)
        tracked.suspended = True
        req = tracked.request
        return MigrationState(
            request_id=request_id,
            prompt_tokens=req.prompt_tokens,
            num_output_tokens=len(tracked.output_ids),
            num_computed_tokens=int(r.num_computed_tokens),
            max_tokens=req.max_tokens,
            priority=req.priority,
            arrival_s=req.arrival_s,
            prefix_block_hashes=req.prefix_block_hashes,
            prefix_hash_block_tokens=req.prefix_hash_block_tokens,
            num_preemptions=int(r.num_preemptions),
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=tuple(tracked.output_ids),
            sampling_params=tracked.params,
            extra={
                EXTRA_GENERATOR_STATE: None
                if self.stateless_sampling
                else vi.generator_state(self._h, tracked.internal_id),
                EXTRA_MODEL_FINGERPRINT: self.model_fingerprint,
            },
        )

    def resume(self, request_id: str) -> bool:
        """Undo ``suspend`` (migration aborted): the request runs here again. False if not suspended."""
        tracked = self._tracked.get(request_id)
        if tracked is None or not tracked.suspended:
            return False
        vi.unpause_request(self._h, tracked.internal_id)
        tracked.suspended = False
        return True

    def free_migrated(self, request_id: str) -> int:
        """After the destination committed: drop the suspended request, free its blocks. Idempotent."""
        tracked = self._tracked.get(request_id)
        if tracked is None or not tracked.suspended:
            return 0
        held = len(vi.request_block_ids(self._h, tracked.internal_id))
        self.abort(request_id)
        return held

    # ---- migration: destination side ------------------------------------------------------------
    def reserve(self, reservation_id: str, n_blocks: int) -> bool:
        """Take ``n_blocks`` out of the block pool for an incoming request; False if no room or id in use."""
        if reservation_id in self._reservations or n_blocks < 0:
            return False
        blocks = vi.hold_pool_blocks(self._h, n_blocks)
        if blocks is None:
            return False
        self._reservations[reservation_id] = _Reservation(blocks)
        return True

    def adopt_cached_prefix(
        self,
        reservation_id: str,
        prompt_token_ids: Sequence[int],
        prefix_block_hashes: Sequence[int] = (),
        prefix_hash_block_tokens: int = 0,
    ) -> int:
        """The leading full blocks of the prompt this engine's prefix cache holds become the reservation's
        first positions (referenced, never written; as many fresh blocks go back to the pool); returns how
        many. Matched by content with vLLM's own block hashes (hilum's ``prefix_block_hashes`` are not
        needed). 0 with prefix caching off. Raises KeyError for an unknown reservation."""
        res = self._reservations.get(reservation_id)
        if res is None:
            raise KeyError(f"{self.instance_id}: adopt_cached_prefix: unknown reservation {reservation_id!r}")
        if res.written:
            return 0  # only before any block was written: the positions would shift
        cached = vi.hold_cached_prefix(self._h, self.llm, prompt_token_ids, len(res.blocks))
        if cached:
            vi.free_pool_blocks(self._h, res.blocks[: len(cached)])
            res.blocks = [*cached, *res.blocks[len(cached) :]]
            res.written.update(range(len(cached)))
        return len(cached)

    def prefill_time_s(self, num_tokens: int, cached_tokens: int) -> float | None:
        """None: this engine offers no re-prefill of a migrated prefix (:meth:`recompute_prefix`), so a migration
        here always copies it (docs/cost-model.md, "Recomputing the prefix")."""
        return None

    def recompute_prefix(
        self, reservation_id: str, prompt_token_ids: Sequence[int], first_block: int, num_blocks: int
    ) -> float:
        """Refused: vLLM's scheduler prefills only requests it schedules itself; writing a prefill into a held
        reservation's blocks outside its step would need a forward pass vLLM does not expose (its model runner
        owns the attention metadata and the KV layout), so the missing prefix of a moved request is always copied.

        Raises ValueError.
        """
        raise ValueError(
            f"{self.instance_id}: the vLLM engine cannot re-prefill a migrated prefix into a reservation "
            f"({reservation_id!r}); it offers no prefill estimate, so migrations copy the prefix"
        )

    def grow_reservation(self, reservation_id: str, n_blocks: int) -> bool:
        """Make the reservation hold at least ``n_blocks`` (grow-only); False when the extra blocks don't fit.

        Raises KeyError for an unknown reservation.
        """
        res = self._reservations.get(reservation_id)
        if res is None:
            raise KeyError(f"{self.instance_id}: grow_reservation: unknown reservation {reservation_id!r}")
        extra = n_blocks - len(res.blocks)
        if extra <= 0:
            return True
        more = vi.hold_pool_blocks(self._h, extra)
        if more is None:
            return False
        res.blocks.extend(more)
        return True

    def release_reservation(self, reservation_id: str) -> int:
        """Give a reservation's blocks back to the pool. Idempotent, safe if never reserved; blocks released."""
        res = self._reservations.pop(reservation_id, None)
        if res is None:
            return 0
        vi.free_pool_blocks(self._h, res.blocks)
        return len(res.blocks)

    def write_blocks(self, reservation_id: str, payload: KVPayload) -> None:
        """Store ``payload`` (layout of :meth:`read_blocks`) in the reservation's blocks at its positions.

        Raises:
            KeyError: unknown reservation.
            IndexError: the blocks exceed the reservation.
            ValueError: ``data`` or ``nbytes`` is not ``num_blocks x kv_bytes_per_block`` bytes.
        """
        res = self._reservations.get(reservation_id)
        if res is None:
            raise KeyError(f"{self.instance_id}: write_blocks: unknown reservation {reservation_id!r}")
        end = payload.first_block + payload.num_blocks
        if end > len(res.blocks):
            raise IndexError(
                f"{self.instance_id}: write_blocks: blocks {payload.first_block}..{end}"
                f" exceed reservation {reservation_id!r} of {len(res.blocks)} blocks"
            )
        want = payload.num_blocks * self.kv_bytes_per_block
        if len(payload.data) != want or payload.nbytes != want:
            raise ValueError(
                f"{self.instance_id}: write_blocks({reservation_id!r}): {payload.num_blocks} blocks need {want} "
                f"bytes of {self._dtype}[{len(self._h.kv_caches)}, {payload.num_blocks}, "
                f"{', '.join(map(str, self._block_shape))}], got data of {len(payload.data)} bytes, "
                f"nbytes = {payload.nbytes}"
            )
        if payload.num_blocks == 0:
            return
        ids = [b.block_id for b in res.blocks[payload.first_block : end]]
        vi.write_kv_blocks_from_host(self._h, ids, payload.data)
        res.written.update(range(payload.first_block, end))

    def kv_pool(self) -> KVPool:
        """The paged KV tensors (one per layer) for peer copies between llumlets of one host."""
        return vi.kv_pool(self._h)

    def write_blocks_from(
        self, reservation_id: str, first_block: int, source: KVPool, src_block_ids: Sequence[int]
    ) -> None:
        """Copy blocks straight from a peer's pool (``llumlet.kvpool.open_pool``: CUDA IPC on a GPU) into the
        reservation at positions ``first_block ..``, on the copy stream.

        Raises KeyError (unknown reservation), IndexError (past the reservation), ValueError (a pool of
        another layout).
        """
        res = self._reservations.get(reservation_id)
        if res is None:
            raise KeyError(f"{self.instance_id}: write_blocks: unknown reservation {reservation_id!r}")
        end = first_block + len(src_block_ids)
        if first_block < 0 or end > len(res.blocks):
            raise IndexError(
                f"{self.instance_id}: write_blocks: blocks {first_block}..{end}"
                f" exceed reservation {reservation_id!r} of {len(res.blocks)} blocks"
            )
        ids = [b.block_id for b in res.blocks[first_block:end]]
        if self._h.copy_stream is None:
            copy_between(source, src_block_ids, self.kv_pool(), ids)
        else:
            with torch.cuda.stream(self._h.copy_stream):
                copy_between(source, src_block_ids, self.kv_pool(), ids)
        res.written.update(range(first_block, end))

    def commit_incoming(self, reservation_id: str, state: MigrationState) -> bool:
        """Re-admit a migrated request at the head of the queue; its KV is loaded, not recomputed.

        The request is vLLM-new with prompt + output tokens as its prompt; at the next step the connector
        reports its ``num_computed_tokens`` tokens as computed, the scheduler gives it blocks, the moved KV
        is copied into them and its generator state restored, and the step computes its last token and
        samples the next. The reservation's blocks go back to the pool now. ``load()`` shows the request as
        waiting until that step.

        Returns False, changing nothing, when the request's blocks (``ceil(num_tokens / block_size)``) do
        not fit in the free blocks plus the reservation.

        Raises:
            KeyError: unknown (released) reservation.
            ValueError: the request is already here; the state is not in decode phase, lacks token ids,
                comes from a different model / dtype / block size (fingerprint), asks for options that
                cannot move, or a block position the KV needs was never written. Nothing changes.
        """
        where = f"{self.instance_id}: commit_incoming({state.request_id!r})"
        if state.request_id in self._tracked:
            raise ValueError(f"{where}: the request is already here")
        if state.num_output_tokens < 1 or state.num_computed_tokens != state.num_tokens - 1:
            raise ValueError(
                f"{where}: not in decode phase (computed {state.num_computed_tokens} of {state.num_tokens} tokens)"
            )
        res = self._reservations.get(reservation_id)
        if res is None:
            raise KeyError(f"{where}: unknown reservation {reservation_id!r} (released or never made)")
        if state.prompt_token_ids is None or len(state.output_token_ids) != state.num_output_tokens:
            raise ValueError(f"{where}: needs prompt_token_ids and all {state.num_output_tokens} output_token_ids")
        if state.extra.get(EXTRA_MODEL_FINGERPRINT) != self.model_fingerprint:
            raise ValueError(
                f"{where}: model fingerprint {state.extra.get(EXTRA_MODEL_FINGERPRINT)!r} != this engine's "
                f"{self.model_fingerprint!r} (different model, dtype, block size or KV layout)"
            )
        if state.sampling_params is not None and (reason := not_migratable(state.sampling_params)) is not None:
            raise ValueError(f"{where}: {reason}")
        gen_state = state.extra.get(EXTRA_GENERATOR_STATE)
        if gen_state is not None and not isinstance(gen_state, bytes):
            raise ValueError(f"{where}: extra[{EXTRA_GENERATOR_STATE!r}] must be bytes or None")
        kv_blocks = math.ceil(state.num_computed_tokens / self._block_size)
        missing = sorted(set(range(kv_blocks)) - res.written)
        if missing:
            raise ValueError(f"{where}: block positions {missing} of reservation {reservation_id!r} were never written")
        # the request's own blocks at admission: the full moved blocks come through the prefix cache (shared
        # with the reservation, no copy); without prefix caching every block is new and the reservation is
        # held until the connector copied it (the request's KV is twice in the pool for one step)
        need = math.ceil(state.num_tokens / self._block_size)
        handed = state.num_computed_tokens // self._block_size if vi.prefix_caching_enabled(self._h) else 0
        surplus = len(res.blocks) - kv_blocks
        if need - handed > surplus + int(self._h.block_pool.get_num_free_blocks()):
            return False
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
        params = _effective_params(where, request, self._rng)
        if gen_state is None and params.temperature > 0 and not self.stateless_sampling:
            raise ValueError(f"{where}: random sampling without a generator state")
        # the reservation's blocks go to the connector, which hands them to the request at admission
        del self._reservations[reservation_id]
        blocks = res.blocks[:kv_blocks]
        vi.free_pool_blocks(self._h, res.blocks[kv_blocks:])
        entry = _Incoming("", state.num_computed_tokens, blocks, gen_state, self._h)
        self._connector.incoming[reservation_id] = entry
        prompt = [*state.prompt_token_ids, *state.output_token_ids]
        kv_params = {KV_PARAMS_KEY: reservation_id}
        try:
            entry.internal_id = self._submit(
                state.request_id, prompt, params, request, state.num_output_tokens, kv_params
            )
        except Exception:
            self._connector.incoming.pop(reservation_id, None)
            vi.free_pool_blocks(self._h, blocks)
            raise
        internal = entry.internal_id
        vi.move_to_queue_head(self._h, internal)
        tracked = _Tracked(request, params, internal, list(state.output_token_ids), state.num_output_tokens)
        tracked.num_loaded_tokens = state.num_computed_tokens
        self._track(tracked)
        return True


def _effective_params(where: str, request: EngineRequest, rng: random.Random) -> SamplingParams:
    """hilum params with defaults filled in: greedy if None; a seed drawn for unseeded random sampling."""
    params = request.sampling_params
    if params is None:
        return SamplingParams(max_tokens=request.max_tokens, temperature=0.0)
    if params.max_tokens != request.max_tokens:
        raise ValueError(
            f"{where}: sampling_params.max_tokens = {params.max_tokens} != max_tokens = {request.max_tokens}"
        )
    if params.temperature > 0 and params.seed is None:
        return dataclasses.replace(params, seed=rng.getrandbits(63))
    return params


def _fingerprint(
    model: str, dtype: str, block_size: int, block_shape: Sequence[int], kv_dtype: str, runner: str
) -> str:
    """sha256 (hex, 16 chars) of what must match for KV blocks and sampling state to be portable (the weights
    are trusted to be the same for the same model name or directory and vLLM version)."""
    path = Path(model)
    ident = str(path.resolve()) if path.exists() else model
    key = f"{ident}|{dtype}|{block_size}|{tuple(block_shape)}|{kv_dtype}|vllm {vllm.__version__}|runner {runner}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tiny_llama_checkpoint(
    directory: str | Path, seed: int = 0, vocab_size: int = 512, tokenizer: str | Path | None = None
) -> Path:
    """Write a small random-weight Llama (float32) and its tokenizer to ``directory``; nothing is downloaded.

    2 layers, hidden 128, 4 query heads and 2 KV heads of dimension 32 (the CPU attention backend supports
    head_dim 32 and up), weights drawn with ``initializer_range`` 0.5 from ``torch.manual_seed(seed)``
    (peaked logits: varied greedy streams).

    ``tokenizer``: a Hugging Face tokenizer directory (``save_pretrained``'s files, chat template included)
    copied into the checkpoint; the model takes its vocabulary (``len(tokenizer)`` ids, ``vocab_size`` is
    ignored) and its BOS / EOS / pad ids, so vLLM and the gateway both read that tokenizer from the checkpoint
    directory. None: a WordLevel tokenizer of ``vocab_size`` tokens ``t0 ..`` (id = index; ``t1`` BOS, ``t2``
    EOS). Idempotent: an existing checkpoint is kept. Returns the directory.

    Raises ``llumlet.engine.hf_tokenizer.TokenizerLoadError`` for a tokenizer directory that cannot be loaded.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from llumlet.engine.hf_tokenizer import load_hf_tokenizer

    out = Path(directory)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    special: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    hf_tokenizer = None
    if tokenizer is not None:
        hf_tokenizer = load_hf_tokenizer(tokenizer)
        vocab_size = len(hf_tokenizer)
        special = {k: getattr(hf_tokenizer, k) for k in special}
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.5,
        tie_word_embeddings=False,
        **special,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()  # type: ignore[no-untyped-call, unused-ignore]
    model.save_pretrained(out)
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(out)
        return out
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment, unused-ignore]
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(out)
    return out
