"""The bookkeeping every paged engine shares: load reports and the migration hooks that only touch blocks.

:class:`PagedEngine` holds a :class:`~llumlet.engine.blocks.BlockManager` and a
:class:`~llumlet.engine.scheduler.Scheduler`; the model engine (:class:`~llumlet.engine.core.EngineCore`) and
the CPU reference engine (:class:`~llumlet.engine.torch_engine.TorchEngine`) subclass it and add what differs:
how a step is executed and priced, and how KV data is read, written and adopted.
"""

from __future__ import annotations

from collections.abc import Sequence

from mypy_extensions import mypyc_attr

from llumlet.engine.blocks import BlockManager
from llumlet.engine.protocol import BlockRun, KVPayload
from llumlet.engine.scheduler import RequestStatus, Scheduler, SchedulerRequest
from llumlet.engine.types import (
    PREFILL_RATE_TOKENS,
    EngineLoad,
    MigrationState,
    RunningRequestLoad,
    RunningRow,
    SamplingParams,
    prefill_s_per_token_of,
)

__all__ = ["PagedEngine"]


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled for the simulator; the torch engine subclasses it
class PagedEngine:
    """Base of engines built on hilum's own block accounting and continuous batching.

    Subclasses set ``instance_id``, ``blocks``, ``scheduler``, ``_suspended`` (requests suspended for
    migration) and ``_last_step_preempted`` in their constructor, and implement :meth:`_copy_out` (the data
    of physical blocks, or none for the model engine).
    """

    instance_id: str
    blocks: BlockManager
    scheduler: Scheduler
    _suspended: dict[str, SchedulerRequest]
    _last_step_preempted: bool

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block (the subclass's)."""
        raise NotImplementedError

    @property
    def block_size_tokens(self) -> int:
        """Tokens per KV cache block."""
        return self.blocks.block_size_tokens

    def _changing(self) -> None:
        """Hook called before a migration hook here changes the engine's state (EngineCore ends its decode
        run in progress)."""

    def _changed(self) -> None:
        """Hook called after a migration hook here changed the engine's state (EngineCore keeps a load
        version)."""

    def has_work(self) -> bool:
        """True while a request waits or runs (suspended requests alone are not work)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def request_state(self, request_id: str) -> SchedulerRequest | None:
        """Live state of an unfinished request (read-only use), None if unknown."""
        return self.scheduler.requests.get(request_id)

    def load(self) -> EngineLoad:
        """Current block usage and queue state."""
        num_waiting, head_demand, queued_demand, preempting = self._queue_state()
        return EngineLoad(
            total_blocks=self.blocks.num_blocks,
            used_blocks=self.blocks.used_blocks,
            reserved_blocks=self.blocks.reserved_blocks,
            cached_blocks=self.blocks.cached_blocks,
            running=tuple([RunningRequestLoad(*row) for row in self._running_rows()]),
            num_waiting=num_waiting,
            head_demand_blocks=head_demand,
            queued_demand_blocks=queued_demand,
            preempting=preempting,
            num_suspended=len(self._suspended),
            max_num_seqs=self.scheduler.max_num_seqs,
            prefix_hashes=self.blocks.prefix_hashes,
            prefix_block_tokens=self.blocks.prefix_block_tokens,
            prefix_hit_tokens=self.blocks.prefix_hit_tokens_total,
            prefix_query_tokens=self.blocks.prefix_queries_tokens_total,
            prefill_s_per_token=prefill_s_per_token_of(self.prefill_time_s(PREFILL_RATE_TOKENS, 0)),
        )

    def _running_rows(self) -> list[RunningRow]:
        """Each running request as the load report sees it, in rank order (class, then arrival); one pass,
        fields read directly: this runs for every report."""
        blocks = self.blocks
        bs = blocks.block_size_tokens
        rows: list[RunningRow] = []
        for s in self.scheduler.running:
            req = s.request
            out = s.num_output_tokens
            num_tokens = req.prompt_tokens + out
            in_decode = out > 0 and s.num_computed_tokens == num_tokens - 1
            max_blocks = -(-(req.prompt_tokens + req.max_tokens - 1) // bs)
            rows.append(
                (
                    req.request_id,
                    blocks.num_blocks_of(req.request_id),
                    req.priority,
                    num_tokens,
                    in_decode,
                    out,
                    req.max_tokens,
                    max_blocks,
                    "",
                    req.prefix_block_hashes,
                )
            )
        return rows

    def _queue_state(self) -> tuple[int, int, int, bool]:
        """(num_waiting, head_demand_blocks, queued_demand_blocks, preempting) of the load report."""
        sched = self.scheduler
        preempting = self._last_step_preempted or any(s.num_preemptions for s in sched.waiting)
        return len(sched.waiting), sched.head_demand_blocks(), sched.queued_demand_blocks(), preempting

    def request_kv(self, request_id: str) -> tuple[int, int] | None:
        """(tokens in the KV cache, blocks held) of an unfinished request; None if unknown."""
        state = self.scheduler.requests.get(request_id)
        if state is None:
            return None
        return state.num_computed_tokens, self.blocks.num_blocks_of(request_id)

    def migratable(self, request_id: str) -> str | None:
        """None when the request is running in its decode phase (movable), else why it cannot move."""
        state = self.scheduler.requests.get(request_id)
        if state is None:
            return f"{self.instance_id}: unknown request {request_id!r}"
        if state.status is not RequestStatus.RUNNING:
            return f"{self.instance_id}: request {request_id!r} is {state.status.name.lower()}, not running"
        if not state.in_decode:
            return f"{self.instance_id}: request {request_id!r} is still in prefill"
        return None

    def read_blocks(self, request_id: str, first_block: int, num_blocks: int) -> KVPayload:
        """The data of ``num_blocks`` blocks from position ``first_block`` of the request's block table
        (layout: :meth:`_copy_out` of the subclass). Raises KeyError / IndexError as :meth:`begin_read`."""
        return self.begin_read(request_id, first_block, num_blocks).copy(first_block, num_blocks)

    def begin_read(self, request_id: str, first_block: int, num_blocks: int) -> BlockRun:
        """Pin down a run of the request's blocks; ``copy`` runs without the engine lock (``BlockRun``).

        ``still_valid`` is True while the request is known here (running or suspended), was not preempted
        since, and its block table still holds the same blocks at those positions.

        Raises KeyError for an unknown request, IndexError past its last block.
        """
        state = self.scheduler.requests.get(request_id)
        if state is None:
            raise KeyError(f"{self.instance_id}: read_blocks: unknown request {request_id!r}")
        table = self.blocks.block_table(request_id)
        if first_block < 0 or num_blocks < 0 or first_block + num_blocks > len(table):
            raise IndexError(
                f"{self.instance_id}: read_blocks({request_id!r}, {first_block}, {num_blocks}): "
                f"it holds {len(table)} blocks"
            )
        ids = table[first_block : first_block + num_blocks]
        preemptions = state.num_preemptions

        def copy(first: int, n: int) -> KVPayload:
            if first < first_block or n < 0 or first + n > first_block + len(ids):
                raise IndexError(f"copy({first}, {n}) outside the run {first_block}..{first_block + len(ids)}")
            return self._copy_out(first, ids[first - first_block : first - first_block + n])

        def still_valid() -> bool:
            now = self.scheduler.requests.get(request_id)
            return (
                now is state
                and now.num_preemptions == preemptions
                and self.blocks.block_table(request_id)[first_block : first_block + len(ids)] == ids
            )

        return BlockRun(request_id, first_block, ids, self.kv_bytes_per_block, copy, still_valid)

    def prefill_time_s(self, num_tokens: int, cached_tokens: int) -> float | None:
        """``Engine.prefill_time_s``: each engine gives its own estimate."""
        raise NotImplementedError

    def _copy_out(self, first_block: int, block_ids: Sequence[int]) -> KVPayload:
        """The data of physical blocks ``block_ids`` (block-table positions from ``first_block``). Called
        without the engine lock: it may only read the KV pool."""
        raise NotImplementedError

    def adopt_cached_prefix(
        self,
        reservation_id: str,
        prompt_token_ids: Sequence[int],
        prefix_block_hashes: Sequence[int] = (),
        prefix_hash_block_tokens: int = 0,
    ) -> int:
        """0: no prefix cache here (the CPU reference engine: every block of a moved request is sent; the model
        engine overrides this). Raises KeyError for an unknown reservation."""
        if self.blocks.reservation_size(reservation_id) is None:
            raise KeyError(f"{self.instance_id}: adopt_cached_prefix: unknown reservation {reservation_id!r}")
        return 0

    def grow_reservation(self, reservation_id: str, n_blocks: int) -> bool:
        """Destination side: make the reservation hold at least ``n_blocks`` (grow-only).

        False when the extra blocks don't fit (nothing changes). Raises KeyError for an unknown reservation.
        """
        before = self.blocks.reserved_for(reservation_id)
        if n_blocks > before:
            self._changing()
        if not self.blocks.grow_reservation(reservation_id, n_blocks):
            return False
        if self.blocks.reserved_for(reservation_id) != before:
            self._changed()
        return True

    def resume(self, request_id: str) -> bool:
        """Undo ``suspend`` (migration aborted): the request runs here again. False if not suspended."""
        if request_id not in self._suspended:
            return False
        self._changing()
        state = self._suspended.pop(request_id)
        self.scheduler.add_running(state)
        self._changed()
        return True

    def _take_suspended(
        self, state: SchedulerRequest, sampling_params: SamplingParams | None, extra: dict[str, object]
    ) -> MigrationState:
        """Take a running request out of batching (it keeps its blocks) and return its ``MigrationState``."""
        self._changing()
        self.scheduler.running.remove(state)
        state.status = RequestStatus.SUSPENDED
        self._suspended[state.request_id] = state
        self._changed()
        req = state.request
        return MigrationState(
            request_id=state.request_id,
            prompt_tokens=req.prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_computed_tokens=state.num_computed_tokens,
            max_tokens=req.max_tokens,
            priority=req.priority,
            arrival_s=req.arrival_s,
            prefix_block_hashes=req.prefix_block_hashes,
            prefix_hash_block_tokens=req.prefix_hash_block_tokens,
            num_preemptions=state.num_preemptions,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=tuple(state.output_token_ids),
            sampling_params=sampling_params,
            extra=extra,
        )
