"""Continuous batching with chunked prefill and preemption by recompute (after vLLM).

Each step, :meth:`Scheduler.schedule` forms a batch within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` requests:

1. decodes of running requests (arrival order), one token each; when a decode cannot get a KV slot, the
   most recently arrived running request not yet scheduled in this step is preempted by recompute (vLLM's
   policy; it may be the request itself): its blocks are freed and it goes back to the head of the waiting
   queue, to prefill prompt + generated tokens again;
2. the next prefill chunk of running requests still in prefill (arrival order), within the remaining
   token budget, shrunk to the free space; if not even one token fits, preemption as in 1 (without it
   two half-prefilled requests could block each other forever);
3. if nothing was preempted in this step: waiting requests in FCFS order, first the prefix-cache lookup,
   then a prefill chunk within the remaining budget; the first that does not fit stops admission
   (head-of-line blocking, as in vLLM).

:meth:`Scheduler.update` applies a computed batch: token counts advance, a request that computed its
last known token produces one output token (first token at the end of the last prefill chunk), finished
requests are freed. The scheduler has no clock and does not price the batch (``latency.py`` does).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from llumlet.engine.blocks import BlockManager
from llumlet.engine.types import EngineRequest

__all__ = ["RequestStatus", "ScheduledBatch", "Scheduler", "SchedulerRequest"]


class RequestStatus(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"  # held for migration: keeps its blocks, not batched
    FINISHED = "finished"


Admission = Literal["chunked", "whole-prompt"]
#: Admission modes: vLLM v1's chunk-by-chunk allocation, or vLLM v0's whole-prompt check with a watermark.
ADMISSION_MODES: tuple[str, ...] = ("chunked", "whole-prompt")


@dataclass(slots=True)
class SchedulerRequest:
    """Mutable per-request state inside the scheduler."""

    request: EngineRequest
    seq_no: int  # admission order tie-break for equal arrival_s
    num_output_tokens: int = 0  # output tokens produced so far
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    recompute_tokens_total: int = 0  # tokens recomputed because of preemptions
    recompute_time_s: float = 0.0  # share of step time spent on those tokens (by token share)
    recompute_pending: int = 0  # tokens still to recompute after the last preemption
    prefix_hit_tokens: int = 0  # prompt tokens reused from the prefix cache (all admissions)
    output_token_ids: list[int] = field(default_factory=list)  # real engines only

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return self.request.prompt_tokens + self.num_output_tokens

    @property
    def in_decode(self) -> bool:
        """All known tokens but the last output token are in the KV cache."""
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    @property
    def order_key(self) -> tuple[float, int]:
        return (self.request.arrival_s, self.seq_no)


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's batch."""

    prefill: tuple[tuple[str, int, int], ...]  # (request_id, chunk_tokens, context_tokens_before)
    decode: tuple[tuple[str, int], ...]  # (request_id, context_tokens incl. the token being decoded)
    preempted: tuple[str, ...]  # preempted by recompute while forming this batch
    prefix_hit_tokens: int = 0  # prefix-cache hits at admission in this step

    @property
    def num_seqs(self) -> int:
        return len(self.prefill) + len(self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c for _, c, _ in self.prefill)


@dataclass(slots=True)
class _BatchBuilder:
    prefill: list[tuple[str, int, int]] = field(default_factory=list)
    decode: list[tuple[str, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    hits: int = 0


class Scheduler:
    """FCFS waiting queue + running set over one :class:`BlockManager`.

    Raises ValueError for non-positive limits.
    """

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        admission: Admission = "chunked",
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"Scheduler: max_num_seqs = {max_num_seqs}, max_num_batched_tokens = "
                f"{max_num_batched_tokens}; both need >= 1"
            )
        if admission not in ADMISSION_MODES:
            raise ValueError(f"Scheduler: admission {admission!r} unknown; choose from {', '.join(ADMISSION_MODES)}")
        self.admission = admission
        self.watermark_blocks = max(1, blocks.num_blocks // 100) if admission == "whole-prompt" else 0
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SchedulerRequest] = deque()
        self.running: list[SchedulerRequest] = []  # kept sorted by order_key
        self.requests: dict[str, SchedulerRequest] = {}  # every unfinished request
        self._seq = 0
        self.num_preemptions_total = 0

    # ---- membership -----------------------------------------------------------------------------
    def new_state(self, request: EngineRequest) -> SchedulerRequest:
        """Register a request (not queued). Raises ValueError on a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in this engine")
        self._seq += 1
        state = SchedulerRequest(request=request, seq_no=self._seq)
        self.requests[request.request_id] = state
        return state

    def add(self, request: EngineRequest) -> SchedulerRequest:
        """Queue a new request at the tail of the waiting queue."""
        state = self.new_state(request)
        self.waiting.append(state)
        return state

    def add_running(self, state: SchedulerRequest) -> None:
        """Insert a request (blocks already held) into the running set in arrival order."""
        state.status = RequestStatus.RUNNING
        self.running.append(state)
        self.running.sort(key=lambda s: s.order_key)

    def remove(self, request_id: str) -> SchedulerRequest | None:
        """Forget a request wherever it is and free its blocks; None if unknown."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        if state.status is RequestStatus.WAITING:
            self.waiting.remove(state)
        elif state.status is RequestStatus.RUNNING:
            self.running.remove(state)
        self.blocks.free(request_id)
        state.status = RequestStatus.FINISHED
        return state

    def head_demand_blocks(self) -> int:
        """Blocks the head-of-queue request needs for all its known tokens (0 with an empty queue)."""
        if not self.waiting:
            return 0
        head = self.waiting[0]
        return self.blocks.blocks_for_tokens(head.num_tokens) - self.blocks.num_blocks_of(head.request_id)

    def queued_demand_blocks(self) -> int:
        """Blocks every queued request needs for all its known tokens (head included)."""
        blocks = self.blocks
        return sum(blocks.blocks_for_tokens(s.num_tokens) - blocks.num_blocks_of(s.request_id) for s in self.waiting)

    # ---- scheduling -----------------------------------------------------------------------------
    def _preempt(self, victim: SchedulerRequest) -> None:
        self.running.remove(victim)
        self.blocks.free(victim.request_id)
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        victim.recompute_pending = victim.num_computed_tokens
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)

    def _fit_tokens(self, state: SchedulerRequest) -> int:
        """Token slots the request could still get from its last block plus every available block."""
        rid = state.request_id
        held = self.blocks.num_blocks_of(rid) + self.blocks.available_blocks
        return held * self.blocks.block_size_tokens - self.blocks.num_tokens_of(rid)

    def _schedule_running(
        self,
        state: SchedulerRequest,
        budget: int,
        batch: _BatchBuilder,
    ) -> int:
        """Schedule a running request's next tokens (1 for a decode, a chunk for a prefill).

        A prefill chunk shrinks to the free space. When not even one token fits, the most recently arrived
        running request not yet in this batch is preempted, until it fits or ``state`` itself is the victim.
        Returns the tokens scheduled (0 if ``state`` was preempted).
        """
        while (fit := self._fit_tokens(state)) < 1:
            victim = max((s for s in self.running if s.request_id not in batch.scheduled), key=lambda s: s.order_key)
            self._preempt(victim)
            batch.preempted.append(victim.request_id)
            if victim is state:
                return 0
        n = min(state.num_tokens - state.num_computed_tokens, budget, fit)
        if self.blocks.allocate_slots(state.request_id, n) is None:  # pragma: no cover - fit guarantees it
            raise AssertionError(f"{state.request_id}: {n} tokens fit but allocation failed")
        if state.in_decode:
            batch.decode.append((state.request_id, state.num_computed_tokens + 1))
        else:
            batch.prefill.append((state.request_id, n, state.num_computed_tokens))
        batch.scheduled.add(state.request_id)
        return n

    def _admit(self, state: SchedulerRequest, budget: int, batch: _BatchBuilder) -> int:
        """Schedule a waiting request's first chunk, all or nothing; returns tokens (0: did not fit).

        With ``admission="whole-prompt"`` the request is admitted only when the blocks for all its tokens
        fit with a 1 % watermark to spare (vLLM v0's ``can_allocate``, the engine Llumnix ran on): the
        queue then blocks behind a head-of-line request that does not fit, instead of over-admitting and
        preempting later.
        """
        if self.admission == "whole-prompt":
            need = self.blocks.blocks_for_tokens(state.num_tokens) - self.blocks.num_blocks_of(state.request_id)
            if need > self.blocks.available_blocks - self.watermark_blocks:
                return 0
        chunk = min(state.num_tokens - state.num_computed_tokens, budget)
        if chunk <= 0 or self.blocks.allocate_slots(state.request_id, chunk) is None:
            return 0
        batch.prefill.append((state.request_id, chunk, state.num_computed_tokens))
        batch.scheduled.add(state.request_id)
        return chunk

    def schedule(self) -> ScheduledBatch:
        """Form the next batch (see the module docstring). May preempt; never raises for "full"."""
        batch = _BatchBuilder()
        used = 0
        limit = self.max_num_batched_tokens
        for decodes_pass in (True, False):
            for state in list(self.running):
                if state.status is not RequestStatus.RUNNING or state.in_decode is not decodes_pass:
                    continue
                if used >= limit or len(batch.scheduled) >= self.max_num_seqs:
                    break
                used += self._schedule_running(state, limit - used, batch)
        while not batch.preempted and self.waiting and used < limit and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            pending = head.recompute_pending
            hits_now = self._match_prefix(head)
            got = self._admit(head, limit - used, batch)
            if got == 0:
                if hits_now:  # undo the lookup: the request stays queued without blocks
                    self.blocks.free(head.request_id)
                    head.num_computed_tokens = 0
                    head.prefix_hit_tokens -= hits_now
                    head.recompute_pending = pending
                break
            batch.hits += hits_now
            used += got
            self.waiting.popleft()
            self.add_running(head)
        return ScheduledBatch(tuple(batch.prefill), tuple(batch.decode), tuple(batch.preempted), batch.hits)

    # ---- runs of pure decode steps ---------------------------------------------------------------
    def decode_run_length(self, max_steps: int) -> int:
        """How many of the next steps are pure decode steps of every running request; 0 if the next is not.

        A pure decode step is one in which :meth:`schedule` gives every running request (all in decode) one
        token, takes each new block from the free list (no eviction, no preemption) and admits nothing, and
        :meth:`update` finishes no request before its last step and publishes no prefix. Such steps follow
        each other with the same batch and contexts growing by one token, until a request finishes (that
        step is the last of the run), the free list would run out (that step is not in the run, it may
        preempt), or ``max_steps``. Admission stays blocked over the run once it fails in its first step:
        the batch's token count is fixed and free blocks only shrink.

        A blocked head of the queue is looked up in the prefix cache again at every step (counters, LRU
        order: :meth:`apply_decode_steps` repeats that). Conservative: 0 when a request still has tokens to
        recompute or could publish a prefix block.
        """
        running = self.running
        n = len(running)
        if max_steps < 1 or n == 0 or n > self.max_num_seqs or n > self.max_num_batched_tokens:
            return 0
        blocks = self.blocks
        caching = blocks.enable_prefix_caching
        steps = max_steps
        for s in running:
            req = s.request
            if s.recompute_pending or s.num_output_tokens == 0:
                return 0
            if s.num_computed_tokens != req.prompt_tokens + s.num_output_tokens - 1:  # not in decode
                return 0
            steps = min(steps, req.max_tokens - s.num_output_tokens)
            if (
                caching
                and req.prefix_block_hashes
                and blocks.would_publish(
                    req.request_id, req.prefix_block_hashes, req.prefix_hash_block_tokens, req.prompt_tokens
                )
            ):
                return 0
        if steps < 1:
            return 0
        ids = [s.request_id for s in running]
        steps = blocks.decode_rounds_that_fit(ids, steps)
        head = self._attempted_head()
        if steps and head is not None and self._head_fits(head, blocks.decode_rounds_new_blocks(ids, 1)):
            return 0
        return steps

    def _attempted_head(self) -> SchedulerRequest | None:
        """The waiting head :meth:`schedule` tries to admit after a pure decode step of every running request
        (None when the queue is empty or the batch is full)."""
        n = len(self.running)
        if self.waiting and n < self.max_num_batched_tokens and n < self.max_num_seqs:
            return self.waiting[0]
        return None

    def _looks_up_prefix(self, head: SchedulerRequest) -> bool:
        """Whether ``_match_prefix`` looks ``head`` up in the prefix cache (the lookup has effects)."""
        return (
            self.blocks.enable_prefix_caching
            and bool(head.request.prefix_block_hashes)
            and not head.num_computed_tokens
        )

    def _head_fits(self, head: SchedulerRequest, blocks_taken: int) -> bool:
        """Whether ``head`` would be admitted after a pure decode step whose decodes took ``blocks_taken``
        blocks: a read-only mirror of ``_match_prefix`` then ``_admit``. Once it does not fit, it does not
        over a run: the budget is fixed and available blocks only shrink."""
        blocks = self.blocks
        req = head.request
        rid = head.request_id
        held_tokens, held_blocks, computed = (
            blocks.num_tokens_of(rid),
            blocks.num_blocks_of(rid),
            head.num_computed_tokens,
        )
        available = blocks.available_blocks - blocks_taken
        if self._looks_up_prefix(head):
            matched = blocks.prefix_matching(req.prefix_block_hashes, req.prefix_hash_block_tokens, head.num_tokens - 1)
            held_tokens = computed = len(matched) * req.prefix_hash_block_tokens
            held_blocks = blocks.blocks_for_tokens(held_tokens)
            available -= blocks.cached_blocks_in(matched)
        if self.admission == "whole-prompt":
            need = blocks.blocks_for_tokens(head.num_tokens) - held_blocks
            if need > available - self.watermark_blocks:
                return False
        chunk = min(head.num_tokens - computed, self.max_num_batched_tokens - len(self.running))
        if chunk <= 0:
            return False
        return blocks.blocks_for_tokens(held_tokens + chunk) - held_blocks <= available

    def apply_decode_steps(self, steps: int, request_ids: Sequence[str] | None = None) -> list[SchedulerRequest]:
        """Apply ``steps`` pure decode steps at once, exactly as ``steps`` rounds of :meth:`schedule` +
        :meth:`update` would; returns the requests that finished (removed, blocks freed), in batch order.

        The caller makes sure :meth:`decode_run_length` allowed them (nothing changed since); a request can
        only finish in the last step of a run. ``request_ids``: the running requests' ids, if the caller
        keeps them (a run's batch).
        """
        running = self.running
        head = self._attempted_head()
        if head is not None and self._looks_up_prefix(head):  # each step looked the blocked head up again
            req = head.request
            self.blocks.repeat_unadmitted_lookups(
                req.prefix_block_hashes, req.prefix_hash_block_tokens, head.num_tokens - 1, steps
            )
        self.blocks.extend_decode_slots(request_ids or [s.request_id for s in running], steps)
        finished: list[SchedulerRequest] = []
        for s in running:
            s.num_computed_tokens += steps
            s.num_output_tokens += steps
            if s.num_output_tokens >= s.request.max_tokens:
                finished.append(s)
        for s in finished:
            self.remove(s.request_id)
        return finished

    def _match_prefix(self, state: SchedulerRequest) -> int:
        req = state.request
        if state.num_computed_tokens or not req.prefix_block_hashes:
            return 0
        match = self.blocks.match_prefix(
            req.request_id, req.prefix_block_hashes, req.prefix_hash_block_tokens, state.num_tokens - 1
        )
        state.num_computed_tokens = match.hit_tokens
        state.prefix_hit_tokens += match.hit_tokens
        if state.recompute_pending:
            state.recompute_pending = max(0, state.recompute_pending - match.hit_tokens)
        return match.hit_tokens

    # ---- applying a computed batch --------------------------------------------------------------
    def update(
        self, batch: ScheduledBatch, duration_s: float = 0.0, stopped: Collection[str] = ()
    ) -> tuple[dict[str, int], tuple[str, ...], int]:
        """Advance the requests of ``batch`` after it ran for ``duration_s``.

        ``stopped`` names requests that hit a stop condition this step (real engines: EOS / stop token);
        the model engine finishes requests at ``max_tokens`` only.
        Returns (new tokens per request, finished request ids, recomputed tokens in this batch).
        """
        new_tokens: dict[str, int] = {}
        finished: list[str] = []
        total_tokens = batch.num_prefill_tokens + len(batch.decode)
        recomputed = 0
        items = [(rid, c) for rid, c, _ in batch.prefill] + [(rid, 1) for rid, _ in batch.decode]
        for rid, n in items:
            state = self.requests.get(rid)
            if state is None:
                continue
            if state.recompute_pending:
                r = min(n, state.recompute_pending)
                state.recompute_pending -= r
                state.recompute_tokens_total += r
                recomputed += r
                if total_tokens:
                    state.recompute_time_s += duration_s * r / total_tokens
            state.num_computed_tokens += n
            self._publish(state)
            if state.num_computed_tokens < state.num_tokens:
                new_tokens[rid] = 0
                continue
            state.num_output_tokens += 1
            new_tokens[rid] = 1
            if state.num_output_tokens >= state.request.max_tokens or rid in stopped:
                finished.append(rid)
        for rid in finished:
            self.remove(rid)
        return new_tokens, tuple(finished), recomputed

    def _publish(self, state: SchedulerRequest) -> None:
        req = state.request
        if req.prefix_block_hashes:
            self.blocks.publish_prefix(
                req.request_id,
                req.prefix_block_hashes,
                req.prefix_hash_block_tokens,
                min(state.num_computed_tokens, req.prompt_tokens),
            )
