"""The one module that reaches inside vLLM (v1 engine core, in-process). Everything here is version-bound.

:class:`llumlet.engine.vllm_engine.VllmEngine` drives vLLM through ``LLMEngine`` (add / abort / step) and
the public KV connector API. What those do not offer is done here, on objects of the in-process engine
core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``, one worker):

- the scheduler's queues (``Scheduler.running``, ``.waiting``, ``.requests``): pausing a running request
  between two steps without freeing its blocks (both model runners keep the state of a request that is not
  scheduled in a step, as they do for a request skipped by the token budget: V1 in ``requests``, V2 in
  ``req_states`` until the request is finished or preempted), putting it back, and moving a re-admitted
  migrated request to the head of the waiting queue;
- the KV cache manager and block pool (the connector API hands the pool to the connector through
  ``bind_gpu_block_pool``, "for example, inc/dec ref counts"): a request's block ids, free-block counts,
  holding blocks for a reservation (``BlockPool.get_new_blocks`` / ``free_blocks``), and handing moved
  blocks to a re-admitted request through the prefix cache (``BlockPool.cache_full_blocks``);
- the model runner: the paged KV tensors (``kv_caches``, one per attention layer, in both runners) and, for
  the V1 runner only, the per-request sampling generator (``CachedRequestState.generator``). The V2 runner
  (vLLM's default wherever Triton runs, i.e. every CUDA install) keeps no generator: its sampler draws the
  Gumbel noise of a token from a hash of (request seed, token position)
  (``vllm/v1/worker/gpu/sample/gumbel.py``), so a seeded request continues identically from its seed alone.

:func:`check_vllm_version` refuses versions outside :data:`SUPPORTED_VLLM_RANGE` (the attribute paths above
were read in the sources of 0.32.0 and are tested there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llumlet.kvpool import KVPool, copy_between

__all__ = [
    "SUPPORTED_VLLM_RANGE",
    "TESTED_VLLM_VERSIONS",
    "EngineHandles",
    "UnsupportedVllmError",
    "cache_moved_blocks",
    "check_vllm_version",
    "copy_blocks_to_host",
    "copy_kv_blocks",
    "engine_handles",
    "free_pool_blocks",
    "generator_state",
    "hold_cached_prefix",
    "hold_pool_blocks",
    "is_cached",
    "kv_block_shape",
    "kv_pool",
    "move_to_queue_head",
    "pause_request",
    "prefix_caching_enabled",
    "read_kv_blocks",
    "request_block_hashes",
    "request_block_ids",
    "scheduler_request",
    "set_generator_state",
    "stateless_sampling",
    "unpause_request",
    "write_kv_blocks",
    "write_kv_blocks_from_host",
]

TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)  # vllm.__version__ values `make test-vllm` ran against
#: [lowest, highest) release supported: 0.32.x (patch releases keep the engine-core internals this module uses)
SUPPORTED_VLLM_RANGE: tuple[tuple[int, int, int], tuple[int, int, int]] = ((0, 32, 0), (0, 33, 0))


class UnsupportedVllmError(RuntimeError):
    """This vLLM (version, executor or KV layout) is not one the hilum backend was tested with."""


def _release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a ``vllm.__version__`` such as ``0.32.0``, ``0.32.1+cpu``, ``0.32.0rc1``."""
    parts = version.split("+", 1)[0].split(".")
    nums: list[int] = []
    for part in parts[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return None
        nums.append(int(digits))
    padded = [*nums, 0, 0, 0]
    return padded[0], padded[1], padded[2]


def check_vllm_version(version: str, allow_untested: bool = False) -> None:
    """Raise :class:`UnsupportedVllmError` unless ``version`` (``vllm.__version__``) is in
    :data:`SUPPORTED_VLLM_RANGE`.

    ``allow_untested`` turns the check off (at your own risk: the attribute paths of this module may have
    moved; the protocol tests in ``tests/llumlet/test_vllm_*.py`` tell).
    """
    low, high = SUPPORTED_VLLM_RANGE
    release = _release(version)
    if allow_untested or (release is not None and low <= release < high):
        return
    span = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    raise UnsupportedVllmError(
        f"vLLM {version} is outside the range the hilum vLLM backend supports ({span}; tested: "
        f"{', '.join(TESTED_VLLM_VERSIONS)}): llumlet/engine/vllm_internals.py reaches into the scheduler, "
        "block pool and model runner, whose internals change between releases. Install a supported version "
        "(pip install 'vllm>=0.32,<0.33'), or pass allow_untested_vllm=True and run `make test-vllm` against it first."
    )


@dataclass(frozen=True, slots=True)
class EngineHandles:
    """The in-process objects of one vLLM engine that this module touches."""

    scheduler: Any  # vllm.v1.core.sched.scheduler.Scheduler
    kv_cache_manager: Any  # vllm.v1.core.kv_cache_manager.KVCacheManager
    block_pool: Any  # vllm.v1.core.block_pool.BlockPool
    runner: Any  # vllm.v1.worker.gpu_model_runner.GPUModelRunner (or a subclass: CPUModelRunner)
    kv_caches: tuple[torch.Tensor, ...]  # per attention layer, in layer order; one axis indexes blocks
    block_dim: int  # the block axis of every tensor in kv_caches
    num_blocks: int  # blocks in the pool, the null block included (block 0)
    copy_stream: Any  # torch.cuda.Stream for block copies off the compute stream; None on CPU


def engine_handles(llm_engine: Any) -> EngineHandles:
    """Find the scheduler, block pool, model runner and paged KV tensors of an in-process ``LLMEngine``.

    Raises UnsupportedVllmError when the engine core runs in another process, the executor is not the
    single-process one, the KV cache has several groups (hybrid models) or the KV tensors have a layout
    this module does not know (the block axis must be axis 0 or axis 1 after a K/V axis of size 2).
    """
    core = getattr(llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise UnsupportedVllmError(
            "the vLLM engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it"
        )
    executor = core.model_executor
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    if worker is None:
        raise UnsupportedVllmError(
            f"executor {type(executor).__name__} has no in-process worker: use distributed_executor_backend='uni'"
        )
    runner = worker.model_runner
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    if len(manager.kv_cache_config.kv_cache_groups) != 1:
        raise UnsupportedVllmError(
            f"{len(manager.kv_cache_config.kv_cache_groups)} KV cache groups (hybrid or sliding-window model): "
            "the hilum backend moves a single full-attention group only"
        )
    pool = manager.block_pool
    caches = tuple(runner.kv_caches)
    if not caches:
        raise UnsupportedVllmError("the model runner has no KV cache tensors (not initialised?)")
    num_blocks = int(pool.num_gpu_blocks)
    first = caches[0]
    if first.shape[0] == num_blocks:
        block_dim = 0
    elif first.dim() > 1 and first.shape[0] == 2 and first.shape[1] == num_blocks:
        block_dim = 1
    else:
        raise UnsupportedVllmError(f"unknown KV cache layout {tuple(first.shape)} for {num_blocks} blocks")
    if any(c.shape != first.shape or c.dtype != first.dtype for c in caches):
        raise UnsupportedVllmError("KV cache tensors of different shapes or dtypes across layers")
    stream = torch.cuda.Stream(device=first.device) if first.device.type == "cuda" else None  # type: ignore[no-untyped-call, unused-ignore]
    return EngineHandles(scheduler, manager, pool, runner, caches, block_dim, num_blocks, stream)


def stateless_sampling(llm_engine: Any) -> bool:
    """True when the engine runs the V2 model runner, whose seeded sampling keeps no generator state (the
    noise of a token is a hash of seed and position); False for the V1 runner (a ``torch.Generator`` per
    request, whose state must move with the request)."""
    return bool(llm_engine.vllm_config.use_v2_model_runner)


def prefix_caching_enabled(h: EngineHandles) -> bool:
    """Whether the block pool caches full blocks by content hash (vLLM's automatic prefix caching)."""
    return bool(h.block_pool.enable_caching)


def request_block_hashes(h: EngineHandles, internal_id: str) -> list[Any]:
    """vLLM's own hashes of a scheduled request's full blocks, in order (``Request.block_hashes``: chained over
    the block's tokens and extra keys with the engine's ``prefix_caching_hash_algo``); [] when the scheduler
    does not know the request or prefix caching is off."""
    request = h.scheduler.requests.get(internal_id)
    return list(getattr(request, "block_hashes", ())) if request is not None else []


def is_cached(h: EngineHandles, block_hash: Any) -> bool:
    """Whether the prefix cache holds a block under ``block_hash`` (used or evictable; KV cache group 0)."""
    return h.block_pool.get_cached_block(block_hash, [0]) is not None


# ---- scheduler ------------------------------------------------------------------------------------------


def scheduler_request(h: EngineHandles, internal_id: str) -> Any | None:
    """The scheduler's ``vllm.v1.request.Request`` (None once finished and freed)."""
    return h.scheduler.requests.get(internal_id)


def pause_request(h: EngineHandles, internal_id: str) -> bool:
    """Take a running request out of ``Scheduler.running``; it keeps its blocks and its runner state.

    The scheduler then never schedules it; the model runner drops it from its persistent batch at the next
    step and re-adds it from its cached state when it is scheduled again. False if it is not running.
    """
    request = h.scheduler.requests.get(internal_id)
    if request is None or request not in h.scheduler.running:
        return False
    h.scheduler.running.remove(request)
    return True


def unpause_request(h: EngineHandles, internal_id: str) -> bool:
    """Undo :func:`pause_request` (appends to ``running``: it is scheduled at the next step)."""
    request = h.scheduler.requests.get(internal_id)
    if request is None or request in h.scheduler.running:
        return False
    h.scheduler.running.append(request)
    return True


def move_to_queue_head(h: EngineHandles, internal_id: str) -> None:
    """Move a waiting request to the head of the waiting queue (the next to be admitted)."""
    request = h.scheduler.requests[internal_id]
    h.scheduler.waiting.remove_request(request)
    h.scheduler.waiting.prepend_request(request)


# ---- blocks ---------------------------------------------------------------------------------------------


def request_block_ids(h: EngineHandles, internal_id: str) -> list[int]:
    """Physical block ids of a request's block table, in position order ([] if it holds none)."""
    if internal_id not in h.scheduler.requests:
        return []
    return list(h.kv_cache_manager.get_block_ids(internal_id)[0])


def hold_pool_blocks(h: EngineHandles, n_blocks: int) -> list[Any] | None:
    """Take ``n_blocks`` free blocks out of the pool (a reservation); None if fewer are free."""
    if n_blocks > h.block_pool.get_num_free_blocks():
        return None
    return list(h.block_pool.get_new_blocks(n_blocks)) if n_blocks else []


def free_pool_blocks(h: EngineHandles, blocks: Sequence[Any]) -> None:
    """Give blocks taken by :func:`hold_pool_blocks` back to the pool."""
    if blocks:
        h.block_pool.free_blocks(blocks)


def read_kv_blocks(h: EngineHandles, block_ids: Sequence[int]) -> torch.Tensor:
    """A copy of the blocks, ``[num_layers, len(block_ids), *per-block shape]`` (per-block shape as laid out by
    the attention backend; for the CPU backend ``[2, ...]``, for FlashAttention ``[2, block_size, heads, dim]``)."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=h.kv_caches[0].device)
    return torch.stack([c.index_select(h.block_dim, index).movedim(h.block_dim, 0) for c in h.kv_caches])


def write_kv_blocks(h: EngineHandles, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    """Store ``blocks`` (layout of :func:`read_kv_blocks`) into the given physical blocks."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=h.kv_caches[0].device)
    for layer, cache in enumerate(h.kv_caches):
        cache.index_copy_(h.block_dim, index, blocks[layer].to(cache.device).movedim(0, h.block_dim))


def copy_blocks_to_host(h: EngineHandles, block_ids: Sequence[int]) -> bytes:
    """The raw bytes of the blocks in the layout of :func:`read_kv_blocks`, copied to the host.

    On a GPU the gathers and the device-to-host copies run on the engine's copy stream into pinned memory
    (torch's caching host allocator), so they overlap the decode kernels of the compute stream; the only
    device temporary is one layer's gathered blocks at a time. Reads the KV tensors only: safe without the
    engine lock for blocks that are not written meanwhile (full blocks of a running request).
    """
    first = h.kv_caches[0]
    n = len(block_ids)
    shape = (len(h.kv_caches), n, *kv_block_shape(h))
    if h.copy_stream is None:
        return bytes(read_kv_blocks(h, block_ids).contiguous().view(torch.uint8).numpy().tobytes()) if n else b""
    out = torch.empty(shape, dtype=first.dtype, pin_memory=True)
    with torch.cuda.stream(h.copy_stream):
        index = torch.tensor(list(block_ids), dtype=torch.long).to(first.device, non_blocking=True)
        for layer, cache in enumerate(h.kv_caches):
            out[layer].copy_(cache.index_select(h.block_dim, index).movedim(h.block_dim, 0), non_blocking=True)
    h.copy_stream.synchronize()
    return bytes(out.view(torch.uint8).numpy().tobytes())


def write_kv_blocks_from_host(h: EngineHandles, block_ids: Sequence[int], data: bytes) -> None:
    """Store host bytes (layout of :func:`copy_blocks_to_host`) into the given physical blocks.

    On a GPU the bytes go through pinned memory and the copy stream (one host-to-device copy, then one
    scatter per layer); the call returns when the blocks are written.
    """
    first = h.kv_caches[0]
    shape = (len(h.kv_caches), len(block_ids), *kv_block_shape(h))
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(first.dtype).view(shape)
    if h.copy_stream is None:
        write_kv_blocks(h, block_ids, host)
        return
    pinned = torch.empty(shape, dtype=first.dtype, pin_memory=True)
    pinned.copy_(host)
    with torch.cuda.stream(h.copy_stream):
        write_kv_blocks(h, block_ids, pinned.to(first.device, non_blocking=True))
    h.copy_stream.synchronize()


def kv_pool(h: EngineHandles) -> KVPool:
    """The paged KV tensors as a :class:`llumlet.kvpool.KVPool` (one tensor per layer)."""
    return KVPool(h.kv_caches, h.block_dim)


def copy_kv_blocks(h: EngineHandles, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Copy physical blocks ``src_ids[i] -> dst_ids[i]`` inside the KV tensors (``kvpool.copy_between``:
    64 blocks of one layer at a time is the only temporary), on the current stream; returns when done."""
    pool = kv_pool(h)
    copy_between(pool, src_ids, pool, dst_ids)


def hold_cached_prefix(h: EngineHandles, llm_engine: Any, token_ids: Sequence[int], max_blocks: int) -> list[Any]:
    """The prefix cache's blocks for the leading full blocks of ``token_ids`` (at most ``max_blocks``), each
    referenced once more (``BlockPool.touch``: the caller frees them with :func:`free_pool_blocks`); stops at
    the first block not cached. [] with prefix caching off.

    Hashes are computed as the engine core's request block hasher does for a plain-text request (chained
    ``hash_block_tokens`` over ``block_size`` tokens, no extra keys: hilum sends no LoRA, cache salt or
    multimodal input), with the engine's ``prefix_caching_hash_algo``.
    """
    if not prefix_caching_enabled(h):
        return []
    from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.core.kv_cache_utils import hash_block_tokens  # type: ignore[import-not-found, unused-ignore]

    hash_fn = get_hash_fn_by_name(llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    block_size = int(h.scheduler.block_size)
    parent = None
    found: list[Any] = []
    for j in range(min(len(token_ids) // block_size, max_blocks)):
        block_hash = hash_block_tokens(hash_fn, parent, token_ids[j * block_size : (j + 1) * block_size], None)
        hit = h.block_pool.get_cached_block(block_hash, [0])
        if hit is None:
            break
        found.append(hit[0])
        parent = block_hash
    h.block_pool.touch(found)
    return found


def cache_moved_blocks(h: EngineHandles, request: Any, blocks: Sequence[Any], num_full_blocks: int) -> int:
    """Register the first ``num_full_blocks`` of ``blocks`` (a reservation holding a migrated request's KV, in
    block-table order) in the prefix cache under the hashes of ``request`` (the re-admitted ``Request``).

    The scheduler then finds them as a local prefix-cache hit when it admits the request and gives them to
    it without a copy. Blocks that already carry a hash are left alone. Returns the blocks registered (0
    when prefix caching is off or the request has fewer block hashes).
    """
    if not prefix_caching_enabled(h):
        return 0
    n = min(num_full_blocks, len(request.block_hashes), len(blocks))
    first = 0  # blocks adopted from this engine's cache (hold_cached_prefix) already carry their hash
    while first < n and blocks[first].block_hash is not None:
        first += 1
    end = first
    while end < n and blocks[end].block_hash is None:
        end += 1
    if end > first:
        h.block_pool.cache_full_blocks(request, list(blocks[:end]), first, end, int(h.scheduler.block_size), 0)
    return end


def kv_block_shape(h: EngineHandles) -> tuple[int, ...]:
    """Shape of one block in one layer (the KV tensor's shape without its block axis)."""
    shape = list(h.kv_caches[0].shape)
    del shape[h.block_dim]
    return tuple(shape)


# ---- sampler --------------------------------------------------------------------------------------------


def generator_state(h: EngineHandles, internal_id: str) -> bytes | None:
    """Bytes of the request's sampling generator state (seeded sampling); None if it has none."""
    state = h.runner.requests.get(internal_id)
    generator = getattr(state, "generator", None)
    if generator is None:
        return None
    return bytes(generator.get_state().cpu().numpy().tobytes())


def set_generator_state(h: EngineHandles, internal_id: str, raw: bytes) -> None:
    """Restore a generator state saved by :func:`generator_state` into the runner's request state.

    Must run after the runner created the request's state (its ``_update_states``) and before sampling:
    the KV connector's ``start_load_kv`` is such a point. Raises UnsupportedVllmError if the request has no
    generator (it is not seeded on this side), ValueError if the state does not fit this device's generator.
    """
    state = h.runner.requests.get(internal_id)
    generator = getattr(state, "generator", None)
    if generator is None:
        raise UnsupportedVllmError(f"request {internal_id!r} has no sampling generator in the model runner")
    try:
        generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    except RuntimeError as exc:
        raise ValueError(f"generator state of {len(raw)} bytes does not fit this device's generator: {exc}") from exc
