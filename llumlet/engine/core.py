"""EngineCore: one model instance = block manager + continuous-batching scheduler + latency model.

Clock-free: ``step()`` returns how long the step takes (from the latency model) and the caller advances its
own clock (virtual in the simulator, real in the "sim" llumlet backend). Mechanism only: the engine reports
"can't" (``False`` / ``None``) and never picks migration sources, destinations or requests.

Migration hooks follow DESIGN.md "Migration (pre-copy)": the destination ``reserve``s blocks; the source keeps
decoding while stages copy; the source ``suspend``s the request between two steps (it keeps its blocks);
the destination ``commit_incoming``s the state (reserved blocks become the request's blocks, plus growth);
the source ``free_migrated``s. On any failure the destination ``release_reservation``s (idempotent) and the
source ``resume``s. A request that finishes during pre-copy is simply finished on the source.
"""

from __future__ import annotations

from collections.abc import Sequence

from llumlet.engine.blocks import BlockManager
from llumlet.engine.latency import LatencyModel
from llumlet.engine.paged import PagedEngine
from llumlet.engine.protocol import KVPayload
from llumlet.engine.scheduler import Admission, RequestStatus, Scheduler, SchedulerRequest
from llumlet.engine.types import (
    EngineRequest,
    MigrationState,
    StepResult,
)

__all__ = ["EngineCore", "RequestStats", "RequestTooLargeError"]


class RequestTooLargeError(ValueError):
    """A request whose prompt + output can never fit in this engine's KV cache."""


class RequestStats:
    """Per-request counters kept after the request leaves (finished, aborted or migrated away)."""

    __slots__ = ("num_preemptions", "prefix_hit_tokens", "recompute_time_s", "recompute_tokens")

    def __init__(self, state: SchedulerRequest) -> None:
        self.num_preemptions = state.num_preemptions  # preemptions by recompute on this engine
        self.recompute_tokens = state.recompute_tokens_total  # tokens recomputed after them
        self.recompute_time_s = state.recompute_time_s  # step time attributed to them (token share)
        self.prefix_hit_tokens = state.prefix_hit_tokens  # prompt tokens reused from the prefix cache

    def __repr__(self) -> str:
        return (
            f"RequestStats(num_preemptions={self.num_preemptions}, recompute_tokens={self.recompute_tokens}, "
            f"recompute_time_s={self.recompute_time_s:.6f}, prefix_hit_tokens={self.prefix_hit_tokens})"
        )


class EngineCore(PagedEngine):
    """A modelled LLM engine instance.

    Args:
        instance_id: for messages only.
        num_blocks: KV cache capacity in blocks.
        block_size_tokens: tokens per KV block (vLLM default 16).
        latency_model: prices each scheduled batch.
        max_num_seqs: requests per batch at most (vLLM default 256).
        max_num_batched_tokens: tokens per step at most (chunked-prefill budget).
        enable_prefix_caching: share prompt prefixes by hash id (see ``blocks.py``).
        kv_bytes_per_block: bytes one block occupies on the modelled GPU (reported in ``KVPayload.nbytes``).
        admission: "chunked" (vLLM v1, default) or "whole-prompt" (vLLM v0, see ``Scheduler._admit``).

    Raises ValueError for non-positive sizes.
    """

    def __init__(
        self,
        instance_id: str,
        num_blocks: int,
        block_size_tokens: int,
        latency_model: LatencyModel,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enable_prefix_caching: bool = False,
        kv_bytes_per_block: int = 0,
        admission: Admission = "chunked",
    ) -> None:
        self.instance_id = instance_id
        self._kv_bytes_per_block = kv_bytes_per_block
        self.latency_model = latency_model
        self.blocks = BlockManager(num_blocks, block_size_tokens, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, admission)
        self._suspended: dict[str, SchedulerRequest] = {}
        self._last_step_preempted = False
        self.stats: dict[str, RequestStats] = {}  # request_id -> counters of requests that left

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block would occupy on the modelled GPU (0 when not given)."""
        return self._kv_bytes_per_block

    # ---- requests -------------------------------------------------------------------------------
    def max_request_tokens(self) -> int:
        """Largest prompt + output (tokens) one request may have here."""
        return self.blocks.num_blocks * self.blocks.block_size_tokens

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (FCFS).

        Raises:
            RequestTooLargeError: its KV (prompt + max_tokens - 1 tokens) exceeds the whole cache.
            ValueError: duplicate request id, or prefix hash blocks not a multiple of the block size while
                prefix caching is on.
        """
        need = request.prompt_tokens + request.max_tokens - 1
        if need > self.max_request_tokens():
            raise RequestTooLargeError(
                f"{self.instance_id}: request {request.request_id!r} needs {need} KV tokens, the cache "
                f"holds {self.max_request_tokens()} ({self.blocks.num_blocks} blocks x "
                f"{self.blocks.block_size_tokens})"
            )
        if (
            self.blocks.enable_prefix_caching
            and request.prefix_block_hashes
            and request.prefix_hash_block_tokens % self.blocks.block_size_tokens
        ):
            raise ValueError(
                f"{self.instance_id}: request {request.request_id!r}: prefix_hash_block_tokens "
                f"{request.prefix_hash_block_tokens} is not a multiple of block size "
                f"{self.blocks.block_size_tokens}"
            )
        if request.request_id in self._suspended:
            raise ValueError(f"request {request.request_id!r} is already in this engine (suspended)")
        self.scheduler.add(request)

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
        self.stats[request_id] = RequestStats(state)
        return True

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule one batch, price it and apply it. An idle result (nothing fit) has duration 0."""
        batch = self.scheduler.schedule()
        self._last_step_preempted = bool(batch.preempted)
        duration_s = self.latency_model.step_time_s(
            [(c, before) for _, c, before in batch.prefill], [ctx for _, ctx in batch.decode]
        )
        departing = {rid: self.scheduler.requests[rid] for rid, _, _ in batch.prefill}
        departing.update({rid: self.scheduler.requests[rid] for rid, _ in batch.decode})
        new_tokens, finished, recomputed = self.scheduler.update(batch, duration_s)
        for rid in finished:
            self.stats[rid] = RequestStats(departing[rid])
        return StepResult(
            duration_s=duration_s,
            new_tokens=new_tokens,
            finished=finished,
            preempted=batch.preempted,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=len(batch.decode),
            num_scheduled_seqs=batch.num_seqs,
            num_recompute_tokens=recomputed,
            num_prefix_hit_tokens=batch.prefix_hit_tokens,
        )

    # ---- migration hooks ------------------------------------------------------------------------
    def _copy_out(self, first_block: int, block_ids: Sequence[int]) -> KVPayload:
        """The model engine moves no data: a payload with the logical size only."""
        return KVPayload(first_block, len(block_ids), len(block_ids) * self._kv_bytes_per_block)

    def kv_pool(self) -> None:
        """The model engine holds no KV data."""
        return None

    def write_blocks_from(self, reservation_id: str, first_block: int, source: object, src_block_ids: object) -> None:
        """Refused: the model engine holds no KV data (a peer copy means the source is a real engine).

        Raises ValueError.
        """
        raise ValueError(f"{self.instance_id}: the model engine stores no KV data; a peer copy cannot land here")

    def write_blocks(self, reservation_id: str, payload: KVPayload) -> None:
        """Check the reservation exists and is large enough; the model engine stores no data.

        Raises KeyError for an unknown reservation, IndexError when the payload does not fit in it.
        """
        size = self.blocks.reservation_size(reservation_id)
        if size is None:
            raise KeyError(f"{self.instance_id}: write_blocks: unknown reservation {reservation_id!r}")
        end = payload.first_block + payload.num_blocks
        if end > size:
            raise IndexError(
                f"{self.instance_id}: write_blocks: blocks {payload.first_block}..{end}"
                f" exceed reservation {reservation_id!r} of {size} blocks"
            )

    def reserve(self, reservation_id: str, n_blocks: int) -> bool:
        """Destination side: hold ``n_blocks`` for an incoming request. False if no room or id in use."""
        return self.blocks.reserve(reservation_id, n_blocks)

    def release_reservation(self, reservation_id: str) -> int:
        """Give a reservation back. Idempotent and safe if never reserved; returns blocks released."""
        return self.blocks.release(reservation_id)

    def suspend(self, request_id: str) -> MigrationState | None:
        """Source side, between two steps: take a running decode-phase request out of batching.

        It keeps its blocks (the last copy stage reads them). Returns its state, or None when it cannot be
        suspended: unknown, finished, waiting, still in prefill, or already suspended.
        """
        state = self.scheduler.requests.get(request_id)
        if state is None or state.status is not RequestStatus.RUNNING or not state.in_decode:
            return None
        return self._take_suspended(state, state.request.sampling_params, {})

    def free_migrated(self, request_id: str) -> int:
        """Source side after the destination committed: forget the suspended request, free its blocks.

        Idempotent: returns the blocks freed, 0 if the request is not suspended here.
        """
        state = self._suspended.pop(request_id, None)
        if state is None:
            return 0
        self.scheduler.requests.pop(request_id, None)
        self.stats[request_id] = RequestStats(state)
        return self.blocks.free(request_id)

    def commit_incoming(self, reservation_id: str, state: MigrationState) -> bool:
        """Destination side: add the migrated request as running with its KV in place.

        The reservation's blocks become the request's blocks for ``state.num_computed_tokens`` tokens (surplus
        returned, growth since ``reserve`` allocated). Returns False when the growth does not fit (nothing
        changes; the reservation stays, the caller releases it).

        Raises:
            KeyError: unknown (released) reservation.
            ValueError: the request id is already here, or the state is not in decode phase.
        """
        if state.request_id in self.scheduler.requests:
            raise ValueError(f"{self.instance_id}: commit_incoming: request {state.request_id!r} already here")
        if state.num_output_tokens < 1 or state.num_computed_tokens != state.num_tokens - 1:
            raise ValueError(
                f"{self.instance_id}: commit_incoming({state.request_id!r}): not in decode phase "
                f"(computed {state.num_computed_tokens} of {state.num_tokens} tokens)"
            )
        if self.blocks.commit(reservation_id, state.request_id, state.num_computed_tokens) is None:
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
        sched_state = self.scheduler.new_state(request)
        sched_state.num_output_tokens = state.num_output_tokens
        sched_state.num_computed_tokens = state.num_computed_tokens
        sched_state.output_token_ids = list(state.output_token_ids)
        self.scheduler.add_running(sched_state)
        return True
