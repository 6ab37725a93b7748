"""Continuous batching with chunked prefill, priority classes and preemption by recompute (after vLLM).

Requests are ranked by priority class first (higher first), then arrival (FCFS within a class): the running
set is kept in that order and the waiting queue holds the classes one after the other, each FCFS, with a
preempted request at the front of its own class. With every request in one class this is vLLM's FCFS
scheduler; with several it follows vLLM's ``priority`` policy (queue ordered by class, victims taken from
the lowest class) and adds what that policy lacks: a waiting request of a higher class than some running
one takes its batch slot or its memory at once.

Each step, :meth:`Scheduler.schedule` forms a batch within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` requests:

1. decodes of running requests (rank order), one token each; when a decode cannot get a KV slot, a running
   request is preempted by recompute (its blocks are freed and it goes back to the waiting queue, to
   prefill prompt + generated tokens again): the latest arrival of the lowest class present, taken from
   the classes below the request's own even if already in this batch (its work is taken out again), and
   within its own class only among those not yet scheduled in this step (vLLM's arrival-order recompute;
   it may be the request itself). A higher class is never preempted for a lower one, so a high-priority
   request is never the victim while a normal one runs;
2. class by class, highest first: the next prefill chunk of running requests of that class still in
   prefill, within the remaining token budget, shrunk to the free space (if not even one token fits,
   preemption as in 1: without it two half-prefilled requests could block each other forever); then the
   waiting requests of that class, FCFS: first the prefix-cache lookup, then a prefill chunk within the
   remaining budget. A waiting request that outranks some running request preempts the lowest-ranked of
   those (latest arrival of the lowest class) when the batch has no free slot or its chunk does not fit
   in memory, until it fits (never when even preempting all of them could not let its first chunk in).
   Otherwise the first that does not fit stops admission (head-of-line blocking, as in vLLM), as does any
   preemption earlier in the step. Equal classes never preempt each other at admission.

vLLM's ``priority`` policy (``vllm/v1/core/sched/scheduler.py``, 0.32) is the reference for the victim
rule: a running request that cannot get blocks preempts the lowest-priority, latest-arriving running
request, taking it out of the batch if already scheduled. vLLM orders by ascending value (0 first);
hilum's classes are the other way round (higher = more important, :class:`EngineRequest.priority`). vLLM
does not preempt at admission: a waiting high-priority request waits for a slot there.

:meth:`Scheduler.update` applies a computed batch: token counts advance, a request that computed its
last known token produces one output token (first token at the end of the last prefill chunk), finished
requests are freed. The scheduler has no clock and does not price the batch (``latency.py`` does).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from llumlet.engine.blocks import BlockManager
from llumlet.engine.types import EngineRequest

__all__ = [
    "SCHEDULING_POLICIES",
    "RequestStatus",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerRequest",
    "SchedulingPolicy",
]


class RequestStatus(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"  # held for migration: keeps its blocks, not batched
    FINISHED = "finished"


SchedulingPolicy = Literal["priority", "fcfs"]
#: Scheduling policies (vLLM's ``scheduling_policy`` names): priority classes as in the module docstring, or
#: every request in one class whatever its priority (arrival order only: vLLM's FCFS, hilum before issue 15).
SCHEDULING_POLICIES: tuple[str, ...] = ("priority", "fcfs")

Admission = Literal["chunked", "whole-prompt"]
#: Admission modes: vLLM v1's chunk-by-chunk allocation, or vLLM v0's whole-prompt check with a watermark.
ADMISSION_MODES: tuple[str, ...] = ("chunked", "whole-prompt")


# The classes below write out their __init__ instead of having dataclasses generate it: compiled
# (hilum_compiled.MODULES), a written-out __init__ is a native call, a generated one is interpreted Python.


@dataclass(init=False, slots=True)
class SchedulerRequest:
    """Mutable per-request state inside the scheduler."""

    request: EngineRequest
    seq_no: int  # admission order tie-break for equal arrival_s
    num_output_tokens: int  # output tokens produced so far
    num_computed_tokens: int  # tokens whose KV is in the cache
    status: RequestStatus
    num_preemptions: int
    recompute_tokens_total: int  # tokens recomputed because of preemptions
    recompute_time_s: float  # share of step time spent on those tokens (by token share)
    recompute_pending: int  # tokens still to recompute after the last preemption
    prefix_hit_tokens: int  # prompt tokens reused from the prefix cache (all admissions)
    output_token_ids: list[int]  # real engines only
    cls: int  # the class it is ranked by: its priority (policy "priority"), 0 for all (policy "fcfs")
    request_id: str  # request.request_id, kept as a slot: it is read per request and step

    def __init__(self, request: EngineRequest, seq_no: int, cls: int = 0) -> None:
        self.request = request
        self.seq_no = seq_no
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.recompute_tokens_total = 0
        self.recompute_time_s = 0.0
        self.recompute_pending = 0
        self.prefix_hit_tokens = 0
        self.output_token_ids = []
        self.cls = cls
        self.request_id = request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return self.request.prompt_tokens + self.num_output_tokens

    @property
    def in_decode(self) -> bool:
        """All known tokens but the last output token are in the KV cache."""
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    @property
    def priority(self) -> int:
        """The class the scheduler ranks it by (0 normal; higher = more important): its request's priority
        under the ``"priority"`` policy, 0 for every request under ``"fcfs"``."""
        return self.cls

    @property
    def order_key(self) -> tuple[float, int]:
        """Arrival order (FCFS within a class)."""
        return (self.request.arrival_s, self.seq_no)

    @property
    def rank_key(self) -> tuple[int, float, int]:
        """Scheduling order: higher class first, then arrival."""
        return (-self.cls, self.request.arrival_s, self.seq_no)


@dataclass(init=False, slots=True)
class ScheduledBatch:
    """One step's batch."""

    prefill: Final[tuple[tuple[str, int, int], ...]]  # (request_id, chunk_tokens, context_tokens_before)
    decode: Final[tuple[tuple[str, int], ...]]  # (request_id, context_tokens incl. the token being decoded)
    preempted: Final[tuple[str, ...]]  # preempted by recompute while forming this batch
    prefix_hit_tokens: Final[int]  # prefix-cache hits at admission in this step

    def __init__(
        self,
        prefill: tuple[tuple[str, int, int], ...],
        decode: tuple[tuple[str, int], ...],
        preempted: tuple[str, ...],
        prefix_hit_tokens: int = 0,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.preempted = preempted
        self.prefix_hit_tokens = prefix_hit_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.prefill) + len(self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c for _, c, _ in self.prefill)


@dataclass(init=False, slots=True)
class _BatchBuilder:
    limit: int  # token budget of the step
    prefill: list[tuple[str, int, int]]
    decode: list[tuple[str, int]]
    preempted: list[str]
    scheduled: dict[str, int]  # request id -> tokens scheduled this step
    used: int  # tokens scheduled
    hits: int

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.prefill = []
        self.decode = []
        self.preempted = []
        self.scheduled = {}
        self.used = 0
        self.hits = 0

    @property
    def budget(self) -> int:
        """Tokens still free in this step."""
        return self.limit - self.used

    def add(self, request_id: str, tokens: int) -> None:
        self.scheduled[request_id] = tokens
        self.used += tokens

    def take_out(self, request_id: str) -> None:
        """Remove a request scheduled in this step (it is being preempted): its tokens go back to the budget."""
        tokens = self.scheduled.pop(request_id)
        self.used -= tokens
        self.decode = [d for d in self.decode if d[0] != request_id]
        self.prefill = [p for p in self.prefill if p[0] != request_id]


class Scheduler:
    """Waiting queue (by class, FCFS within) + running set (rank order) over one :class:`BlockManager`.

    ``policy``: ``"priority"`` (default) ranks requests by their priority class; ``"fcfs"`` puts every request
    in one class (arrival order only). Raises ValueError for non-positive limits or an unknown mode.
    """

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        admission: Admission = "chunked",
        policy: SchedulingPolicy = "priority",
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"Scheduler: max_num_seqs = {max_num_seqs}, max_num_batched_tokens = "
                f"{max_num_batched_tokens}; both need >= 1"
            )
        if admission not in ADMISSION_MODES:
            raise ValueError(f"Scheduler: admission {admission!r} unknown; choose from {', '.join(ADMISSION_MODES)}")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Scheduler: policy {policy!r} unknown; choose from {', '.join(SCHEDULING_POLICIES)}")
        self.policy = policy
        self.admission = admission
        self.watermark_blocks = max(1, blocks.num_blocks // 100) if admission == "whole-prompt" else 0
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SchedulerRequest] = deque()  # classes highest first, each FCFS
        self.running: list[SchedulerRequest] = []  # kept sorted by rank_key
        self.requests: dict[str, SchedulerRequest] = {}  # every unfinished request
        self._seq = 0
        self.num_preemptions_total = 0

    # ---- membership -----------------------------------------------------------------------------
    def new_state(self, request: EngineRequest) -> SchedulerRequest:
        """Register a request (not queued). Raises ValueError on a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in this engine")
        self._seq += 1
        cls = request.priority if self.policy == "priority" else 0
        state = SchedulerRequest(request=request, seq_no=self._seq, cls=cls)
        self.requests[request.request_id] = state
        return state

    def add(self, request: EngineRequest) -> SchedulerRequest:
        """Queue a new request at the tail of its class in the waiting queue."""
        state = self.new_state(request)
        waiting = self.waiting
        p = state.priority
        if not waiting or waiting[-1].priority >= p:
            waiting.append(state)
        else:
            waiting.insert(next(i for i, s in enumerate(waiting) if s.priority < p), state)
        return state

    def _requeue(self, state: SchedulerRequest) -> None:
        """Put a preempted request back at the front of its class in the waiting queue."""
        waiting = self.waiting
        p = state.priority
        if not waiting or waiting[0].priority <= p:
            waiting.appendleft(state)
        else:
            waiting.insert(next((i for i, s in enumerate(waiting) if s.priority <= p), len(waiting)), state)

    def add_running(self, state: SchedulerRequest) -> None:
        """Insert a request (blocks already held) into the running set in rank order."""
        state.status = RequestStatus.RUNNING
        self.running.append(state)
        self.running.sort(key=lambda s: s.rank_key)

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
    def _preempt(self, victim: SchedulerRequest, batch: _BatchBuilder) -> None:
        """Preempt ``victim`` by recompute (taking its work out of ``batch`` if it is in it)."""
        if victim.request_id in batch.scheduled:
            batch.take_out(victim.request_id)
        self.running.remove(victim)
        self.blocks.free(victim.request_id)
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        victim.recompute_pending = victim.num_computed_tokens
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self._requeue(victim)
        batch.preempted.append(victim.request_id)

    def _victim_for(self, state: SchedulerRequest, batch: _BatchBuilder) -> SchedulerRequest:
        """Whom a running ``state`` that cannot get a KV slot preempts (module docstring, 1): the lowest-ranked
        of the lower classes' requests and its own class's requests not yet in ``batch`` (``state`` included)."""
        p = state.priority
        return max(
            (s for s in self.running if s.priority < p or (s.priority == p and s.request_id not in batch.scheduled)),
            key=lambda s: (-s.priority, s.order_key),
        )

    def _lower_victim(self, state: SchedulerRequest) -> SchedulerRequest | None:
        """The running request a waiting ``state`` may preempt: the lowest-ranked one of a lower class."""
        running = self.running
        if not running or running[-1].priority >= state.priority:
            return None
        lowest = running[-1].priority
        return max((s for s in running if s.priority == lowest), key=lambda s: s.order_key)

    def outranks_running(self, state: SchedulerRequest) -> bool:
        """Whether ``state`` is of a higher class than some running request (it may preempt one)."""
        return bool(self.running) and self.running[-1].priority < state.priority

    def _fit_tokens(self, state: SchedulerRequest) -> int:
        """Token slots the request could still get from its last block plus every available block."""
        rid = state.request_id
        held = self.blocks.num_blocks_of(rid) + self.blocks.available_blocks
        return held * self.blocks.block_size_tokens - self.blocks.num_tokens_of(rid)

    def _schedule_running(self, state: SchedulerRequest, batch: _BatchBuilder) -> int:
        """Schedule a running request's next tokens (1 for a decode, a chunk for a prefill) within the budget.

        A prefill chunk shrinks to the free space. When not even one token fits, a running request is
        preempted (``_victim_for``), until it fits or ``state`` itself is the victim. Returns the tokens
        scheduled (0 if ``state`` was preempted).
        """
        while (fit := self._fit_tokens(state)) < 1:
            victim = self._victim_for(state, batch)
            self._preempt(victim, batch)
            if victim is state:
                return 0
        n = min(state.num_tokens - state.num_computed_tokens, batch.budget, fit)
        if self.blocks.allocate_slots(state.request_id, n) is None:  # pragma: no cover - fit guarantees it
            raise AssertionError(f"{state.request_id}: {n} tokens fit but allocation failed")
        if state.in_decode:
            batch.decode.append((state.request_id, state.num_computed_tokens + 1))
        else:
            batch.prefill.append((state.request_id, n, state.num_computed_tokens))
        batch.add(state.request_id, n)
        return n

    def _admit(self, state: SchedulerRequest, batch: _BatchBuilder) -> int:
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
        chunk = min(state.num_tokens - state.num_computed_tokens, batch.budget)
        if chunk <= 0 or self.blocks.allocate_slots(state.request_id, chunk) is None:
            return 0
        batch.prefill.append((state.request_id, chunk, state.num_computed_tokens))
        batch.add(state.request_id, chunk)
        return chunk

    def schedule(self) -> ScheduledBatch:
        """Form the next batch (see the module docstring). May preempt; never raises for "full"."""
        batch = _BatchBuilder(limit=self.max_num_batched_tokens)
        for state in list(self.running):
            if state.status is RequestStatus.RUNNING and state.in_decode:
                if batch.used >= batch.limit or len(batch.scheduled) >= self.max_num_seqs:
                    break
                self._schedule_running(state, batch)
        prefills = [s for s in self.running if not s.in_decode]  # rank order: classes highest first
        admitting = True
        i = 0
        while batch.used < batch.limit:
            head_class = self.waiting[0].priority if admitting and self.waiting else -1
            running_class = prefills[i].priority if i < len(prefills) else -1
            cls = max(head_class, running_class)
            if cls < 0:
                break
            while i < len(prefills) and prefills[i].priority == cls:
                state = prefills[i]
                i += 1
                if state.status is not RequestStatus.RUNNING or state.request_id in batch.scheduled:
                    continue
                if batch.used >= batch.limit or len(batch.scheduled) >= self.max_num_seqs:
                    break
                self._schedule_running(state, batch)
            if admitting and head_class == cls:
                admitting = self._admit_class(cls, batch)
        return ScheduledBatch(tuple(batch.prefill), tuple(batch.decode), tuple(batch.preempted), batch.hits)

    def _admit_class(self, cls: int, batch: _BatchBuilder) -> bool:
        """Admit waiting requests of class ``cls`` (the head's) in FCFS order (module docstring, 2).

        Returns False when admission stops for this step (a request did not fit: head-of-line blocking).
        """
        while self.waiting and self.waiting[0].priority == cls and batch.used < batch.limit:
            head = self.waiting[0]
            may_preempt = self.outranks_running(head)
            if batch.preempted and not may_preempt:
                return False
            while len(self.running) >= self.max_num_seqs:  # no free batch slot: only a lower class gives one
                victim = self._lower_victim(head) if may_preempt else None
                if victim is None or not self._lower_could_fit(head, batch):  # no preemption that cannot help
                    return False
                self._preempt(victim, batch)
            if not self._admit_head(head, batch):
                return False
        return True

    def _admit_head(self, head: SchedulerRequest, batch: _BatchBuilder) -> bool:
        """Admit the waiting ``head`` (prefix lookup, first chunk), preempting lower classes for memory when it
        outranks them and they could free enough; False (nothing changed for ``head``) when it does not fit."""
        pending = head.recompute_pending
        hits_now = self._match_prefix(head)
        while (got := self._admit(head, batch)) == 0:
            victim = self._lower_victim(head)
            if victim is None or not self._lower_could_fit(head, batch):
                break
            self._preempt(victim, batch)
        if got == 0:
            if hits_now:  # undo the lookup: the request stays queued without blocks
                self.blocks.free(head.request_id)
                head.num_computed_tokens = 0
                head.prefix_hit_tokens -= hits_now
                head.recompute_pending = pending
            return False
        batch.hits += hits_now
        self.waiting.popleft()
        self.add_running(head)
        return True

    def _lower_could_fit(self, head: SchedulerRequest, batch: _BatchBuilder) -> bool:
        """Whether preempting every running request of a lower class than ``head`` could let its first chunk
        in (budget and blocks, counting every block they hold as freed: an upper bound)."""
        lower = [s for s in self.running if s.priority < head.priority]
        budget = batch.budget + sum(batch.scheduled.get(s.request_id, 0) for s in lower)
        chunk = min(head.num_tokens - head.num_computed_tokens, budget)
        if chunk <= 0:
            return False
        blocks = self.blocks
        rid = head.request_id
        held = blocks.num_blocks_of(rid)
        need = blocks.blocks_for_tokens(blocks.num_tokens_of(rid) + chunk) - held
        if self.admission == "whole-prompt":
            need = max(need, blocks.blocks_for_tokens(head.num_tokens) - held + self.watermark_blocks)
        return need <= blocks.available_blocks + sum(blocks.num_blocks_of(s.request_id) for s in lower)

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
        recompute or could publish a prefix block, or when the head of the queue outranks a running request
        (the next step admits it by preemption).
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
        if steps < 1 or (self.waiting and self.outranks_running(self.waiting[0])):  # the next step preempts
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
