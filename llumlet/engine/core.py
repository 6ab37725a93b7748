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

from collections.abc import Callable, Sequence

from llumlet.engine.blocks import BlockManager, decode_blocks_taken, decode_rounds_within
from llumlet.engine.latency import DecodeStepTimes, LatencyModel
from llumlet.engine.paged import PagedEngine
from llumlet.engine.protocol import KVPayload
from llumlet.engine.scheduler import Admission, RequestStatus, Scheduler, SchedulerRequest, SchedulingPolicy
from llumlet.engine.types import (
    PREFILL_RATE_TOKENS,
    EngineLoad,
    EngineRequest,
    MigrationState,
    StepResult,
    instance_load_of,
    prefill_s_per_token_of,
)
from policy.load import InstanceLoad, priority_counts_of

__all__ = ["DecodeRun", "EngineCore", "RequestStats", "RequestTooLargeError"]


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


class DecodeRun:
    """A run of pure decode steps planned by :meth:`EngineCore.start_decode_run`.

    Every step of the run schedules the same batch, ``request_ids``, one token each, and nothing else; step
    ``j`` (from 0) lasts ``duration_s(j)`` (``times``: the latency model's closed form, nothing kept per step). The
    engine's state holds the first ``applied`` steps (a step is
    applied when it starts, as :meth:`EngineCore.step` applies a batch when it returns it); ``steps`` is how
    many the run has: fewer than planned once the run is cut. ``finished`` names the requests that finished
    in its last step, once that step is applied (a request can only finish there).
    """

    __slots__ = ("_on_interrupt", "applied", "finished", "request_ids", "steps", "times")

    def __init__(
        self,
        request_ids: tuple[str, ...],
        times: DecodeStepTimes,
        steps: int,
        on_interrupt: Callable[[DecodeRun], None] | None,
    ) -> None:
        self.request_ids = request_ids  # the batch, in schedule order
        self.times = times  # of its steps
        self.steps = steps  # steps in the run, >= 1 (planned; shrinks when cut)
        self.applied = 0  # steps already in the engine's state, 1..steps once started
        self.finished: tuple[str, ...] = ()  # requests that finished in the last step (once applied)
        self._on_interrupt = on_interrupt

    def duration_s(self, j: int) -> float:
        """Duration of step ``j`` (from 0), seconds."""
        return self.times.step_s(j)

    @property
    def done(self) -> bool:
        """Every step of the run is applied."""
        return self.applied >= self.steps

    def __repr__(self) -> str:
        return f"DecodeRun({len(self.request_ids)} requests, applied {self.applied} of {self.steps} steps)"


def _brief_report(
    instance_id: str,
    domain_id: str,
    draining: bool,
    warming_up: bool,
    decode_step_s: float,
    capacity_blocks: int,
    used_blocks: int,
    queue: tuple[int, tuple[tuple[int, int], ...], int, int, int, bool],
    max_num_seqs: int,
    prefix_hashes: frozenset[int],
    prefix_block_tokens: int,
    prefill_s_per_token: float,
) -> InstanceLoad:
    """A brief ``InstanceLoad`` (``EngineCore.instance_load(..., brief=True)``) of these figures; ``used_blocks``
    counts reservations, ``queue`` is ``EngineCore._brief_figures()``. Raises ValueError as ``InstanceLoad`` does."""
    num_running, priority_counts, num_waiting, head_demand, queued_demand, preempting = queue
    return InstanceLoad(
        instance_id,
        capacity_blocks=capacity_blocks,
        used_blocks=used_blocks,
        num_waiting=num_waiting,
        head_demand_blocks=head_demand,
        queued_demand_blocks=queued_demand,
        preempting=preempting,
        draining=draining,
        warming_up=warming_up,
        domain_id=domain_id,
        decode_step_s=decode_step_s,
        num_running=num_running,
        priority_counts=priority_counts,
        brief=True,
        max_num_seqs=max_num_seqs,
        prefix_hashes=prefix_hashes,
        prefix_block_tokens=prefix_block_tokens,
        prefill_s_per_token=prefill_s_per_token,
    )


class _RunFigures:
    """What a brief report reads of a decode run in progress, taken once per run (see ``_brief_load``).

    Over the run's steps the batch and the queue stay as they are (a change from outside cuts the run: a request
    added or aborted, a reservation, a migration hook), the first step cleared the preemption flag, and the new
    blocks come from the free list (the run ends before a block it lacks: no prefix-cache entry is evicted), so
    every figure but the blocks held is constant while steps are left. Those are kept here, in one object: a
    report of an instance in a run reads this and nothing else of the engine's state (on a large cluster each
    other object read is a cache miss). The blocks follow the run's rounds of one slot per request, in closed
    form from each request's first new-block round (``BlockManager.decode_first_rounds``, the state when the
    figures were taken): O(batch) a read, nothing built per step of the run (most runs are cut long before their
    planned end).
    """

    __slots__ = (
        "_base", "_block_size", "_capacity", "_firsts", "_max_num_seqs", "_prefill_s", "_prefix", "_prefix_tokens",
        "_reserved", "_rounds", "_used", "queue", "run",
    )  # fmt: skip

    def __init__(
        self,
        run: DecodeRun,
        queue: tuple[int, tuple[tuple[int, int], ...], int, int, int, bool],
        blocks: BlockManager,
        max_num_seqs: int,
        prefill_s_per_token: float,
    ) -> None:
        self.run = run
        self.queue = queue  # EngineCore._brief_figures() while the run has steps left
        self._base = run.applied  # steps applied when taken
        self._rounds = run.steps - 1 - run.applied  # the rounds before the run's last step
        self._firsts = blocks.decode_first_rounds(run.request_ids)  # each >= 1: round 0 takes no block
        self._block_size = blocks.block_size_tokens
        self._used = blocks.used_blocks  # held by requests after _base steps
        self._reserved = blocks.reserved_blocks
        self._capacity = blocks.num_blocks
        self._prefix = blocks.prefix_hashes
        self._prefix_tokens = blocks.prefix_block_tokens if self._prefix else 0
        self._max_num_seqs = max_num_seqs
        self._prefill_s = prefill_s_per_token

    def used_blocks(self, steps: int) -> int:
        """Blocks held by requests (reservations not counted) once ``steps`` of the run are applied (at least those
        applied when taken, before the last)."""
        return self._used + decode_blocks_taken(self._firsts, self._block_size, steps - self._base)

    def report(
        self, instance_id: str, domain_id: str, draining: bool, warming_up: bool, decode_step_s: float, steps: int
    ) -> InstanceLoad:
        """The brief report once ``steps`` of the run are applied (at least those applied when taken, before
        the last)."""
        return _brief_report(
            instance_id,
            domain_id,
            draining,
            warming_up,
            decode_step_s,
            self._capacity,
            self.used_blocks(steps) + self._reserved,
            self.queue,
            self._max_num_seqs,
            self._prefix,
            self._prefix_tokens,
            self._prefill_s,
        )

    def steps_within(self, steps: int, extra_blocks: int) -> int:
        """The most steps (>= ``steps``, before the last) after which the run took <= ``extra_blocks`` more
        blocks than after ``steps`` (see ``EngineCore.decode_run_steps_within``); ``steps - 1`` for a negative
        ``extra_blocks``."""
        firsts, bs, base = self._firsts, self._block_size, self._base
        limit = decode_blocks_taken(firsts, bs, steps - base) + extra_blocks
        return max(steps - 1, base + decode_rounds_within(firsts, bs, limit, self._rounds))


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
        decode_runs: let :meth:`step` apply pure decode steps in runs (``Scheduler.decode_run_length``,
            O(batch + new blocks) per step) instead of forming each batch with ``Scheduler.schedule``; the
            results are the same. False keeps the step-by-step reference, for tests.
        scheduling: ``"priority"`` (default: priority classes in admission and preemption) or ``"fcfs"``
            (arrival order only, priorities ignored), see ``Scheduler``.

    Raises ValueError for non-positive sizes.

    Runs of decode steps: :meth:`start_decode_run` plans the steps until the next event that matters (a
    finish, a block the free list cannot supply, a budget) and applies the first; the caller applies the
    others as their time comes (:meth:`advance_decode_run`). Before any change from outside (a request
    added or aborted, a reservation, a migration hook) the caller is told (``on_interrupt``), applies the
    steps that have started by then, and the run ends after them: the rest was planned on the old state.
    :attr:`load_version` changes whenever :meth:`load` would report something new (every applied step
    changes token counts) and :meth:`load` is rebuilt only then.
    """

    #: steps :meth:`step` plans at most per run (a run is cut by any change from outside anyway)
    STEP_RUN_STEPS = 64

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
        decode_runs: bool = True,
        scheduling: SchedulingPolicy = "priority",
    ) -> None:
        self.instance_id = instance_id
        self.decode_runs = decode_runs
        self._kv_bytes_per_block = kv_bytes_per_block
        self.latency_model = latency_model
        # the per-token prefill estimate its load reports carry (the latency model is fixed: computed once)
        self._prefill_s_per_token = prefill_s_per_token_of(latency_model.step_time_s([(PREFILL_RATE_TOKENS, 0)], []))
        self.blocks = BlockManager(num_blocks, block_size_tokens, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, admission, scheduling)
        self._suspended: dict[str, SchedulerRequest] = {}
        self._last_step_preempted = False
        self.stats: dict[str, RequestStats] = {}  # request_id -> counters of requests that left
        self._run: DecodeRun | None = None  # the decode run in progress (applied < steps), if any
        self._run_figures: _RunFigures | None = None  # a brief report's figures of that run
        #: a counter that moves whenever :meth:`load` would report something new, and only when the engine changed:
        #: calls that change nothing (a refused reservation, an idle step) leave it where it was (a plain attribute:
        #: the simulator reads it for every instance at every report loop; only the engine moves it)
        self.load_version = 0
        self._load: EngineLoad | None = None  # load() of _load_at_version
        self._load_at_version = -1
        #: called after every change from outside (:meth:`_changed`: a request added or aborted, a reservation,
        #: a migration hook), never for the engine's own steps; the simulator watches instances with it
        self.on_change: Callable[[], None] | None = None
        #: called before every change from outside (:meth:`_changing`, before the run in progress is interrupted):
        #: the simulator reads what it still needs of the state as it was (its KV usage timeline)
        self.on_changing: Callable[[], None] | None = None

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block would occupy on the modelled GPU (0 when not given)."""
        return self._kv_bytes_per_block

    # ---- load -----------------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """Current block usage and queue state (rebuilt only when :attr:`load_version` moved)."""
        if self._load is None or self._load_at_version != self.load_version:
            self._load = super().load()
            self._load_at_version = self.load_version
        return self._load

    def instance_load(
        self,
        instance_id: str,
        domain_id: str,
        draining: bool = False,
        warming_up: bool = False,
        decode_step_s: float = 0.0,
        steps_ahead: int = 0,
        brief: bool = False,
    ) -> InstanceLoad:
        """``load().to_instance_load(...)``, built straight from the engine's state: no ``EngineLoad`` in
        between (the simulator asks for it at every step of a busy instance).

        ``steps_ahead``: the load as it will be once that many more steps of the decode run in progress are
        applied, computed without applying them (a caller that only looks need not move the engine); the
        run's last step, where requests finish, must not be among them. Raises ValueError otherwise.

        ``brief``: the brief report (``InstanceLoad.detailed`` False for a busy instance): every figure but the
        list of running requests, in O(1) per request with no object built per request.
        """
        if brief:
            return self._brief_load(instance_id, domain_id, draining, warming_up, decode_step_s, steps_ahead)
        num_waiting, head_demand, queued_demand, preempting = self._queue_state()
        blocks = self.blocks
        rows = self._running_rows()
        used = blocks.used_blocks
        if steps_ahead:
            run = self._run_ahead(steps_ahead)
            grown = blocks.decode_new_blocks_each(run.request_ids, steps_ahead)
            rows = [  # every request of the run is in decode: one more token a step
                (rid, n + g, prio, tokens + steps_ahead, True, out + steps_ahead, max_tokens, max_blocks, why, hashes)
                for (rid, n, prio, tokens, _, out, max_tokens, max_blocks, why, hashes), g in zip(
                    rows, grown, strict=True
                )
            ]
            used += sum(grown)
        return instance_load_of(
            instance_id,
            domain_id,
            draining,
            warming_up,
            decode_step_s,
            total_blocks=blocks.num_blocks,
            used_blocks=used,
            reserved_blocks=blocks.reserved_blocks,
            running=rows,
            num_waiting=num_waiting,
            head_demand_blocks=head_demand,
            queued_demand_blocks=queued_demand,
            preempting=preempting,
            max_num_seqs=self.scheduler.max_num_seqs,
            prefix_hashes=blocks.prefix_hashes,
            prefix_block_tokens=blocks.prefix_block_tokens,
            prefill_s_per_token=self._prefill_s_per_token,
        )

    def _run_ahead(self, steps_ahead: int) -> DecodeRun:
        """The decode run in flight, when ``steps_ahead`` of its steps can be read ahead of the applied ones.
        Raises ValueError otherwise."""
        run = self._run
        if steps_ahead < 0 or run is None or run.applied + steps_ahead >= run.steps:
            raise ValueError(f"{self.instance_id}: instance_load(steps_ahead={steps_ahead}) with {run!r}")
        return run

    def _brief_load(
        self, instance_id: str, domain_id: str, draining: bool, warming_up: bool, decode_step_s: float, steps_ahead: int
    ) -> InstanceLoad:
        run = self._run
        if steps_ahead and (steps_ahead < 0 or run is None or run.applied + steps_ahead >= run.steps):
            self._run_ahead(steps_ahead)  # raises: a read-ahead stays before the run's last step
        figures = self._figures_of_run()  # taken once per run: O(batch)
        if figures is not None:
            steps = figures.run.applied + steps_ahead
            return figures.report(instance_id, domain_id, draining, warming_up, decode_step_s, steps)
        blocks = self.blocks
        held = blocks.prefix_hashes  # the same frozenset until the prefix cache changes
        return _brief_report(
            instance_id,
            domain_id,
            draining,
            warming_up,
            decode_step_s,
            blocks.num_blocks,
            blocks.used_blocks + blocks.reserved_blocks,
            self._brief_figures(),
            self.scheduler.max_num_seqs,
            held,
            blocks.prefix_block_tokens if held else 0,
            self._prefill_s_per_token,
        )

    def decode_run_steps_within(self, steps: int, extra_blocks: int) -> int:
        """The most steps of the decode run in progress (counted from its start, as ``DecodeRun.applied``), at
        least ``steps``, after which the requests hold at most ``extra_blocks`` KV blocks more than after
        ``steps``; the run's last step (requests finish in it) is never counted unless ``steps`` is it. Nothing
        else of the state changes over those steps (a change from outside cuts the run). ``steps`` itself
        without a run with steps left. ``steps``: applied or read ahead (:meth:`instance_load`'s
        ``steps_ahead``), before the run's last step."""
        figures = self._figures_of_run()
        return steps if figures is None else figures.steps_within(steps, extra_blocks)

    def decode_run_used_blocks(self, steps: int) -> int:
        """KV blocks held by requests (reservations not counted: ``blocks.used_blocks``) once ``steps`` steps of the
        decode run in progress are applied, without applying them: O(batch). ``steps``: at least those applied,
        before the run's last step (its requests finish in it). Raises ValueError otherwise."""
        run = self._run
        figures = self._figures_of_run()
        if run is None or figures is None or not run.applied <= steps < run.steps:
            raise ValueError(f"{self.instance_id}: decode_run_used_blocks({steps}) with {run!r}")
        return figures.used_blocks(steps)

    def _figures_of_run(self) -> _RunFigures | None:
        """The figures of the decode run in progress while it has steps left (None otherwise)."""
        run = self._run
        if run is None or run.done:
            return None
        figures = self._run_figures
        if figures is None or figures.run is not run:
            figures = self._run_figures = self._new_figures(run)
        return figures

    def _new_figures(self, run: DecodeRun) -> _RunFigures:
        """The figures of ``run``, the decode run in progress, from the state now."""
        return _RunFigures(
            run, self._brief_figures(), self.blocks, self.scheduler.max_num_seqs, self._prefill_s_per_token
        )

    def _brief_figures(self) -> tuple[int, tuple[tuple[int, int], ...], int, int, int, bool]:
        """(num_running, priority_counts, num_waiting, head_demand_blocks, queued_demand_blocks, preempting) of
        a brief report, from the state now."""
        running = self.scheduler.running
        counts = priority_counts_of([s.request.priority for s in running])
        return (len(running), counts, *self._queue_state())

    def _changing(self) -> None:
        """A change from outside is about to happen: the run in progress ends after the steps its driver
        applies now (``on_interrupt``); :attr:`on_changing` told first."""
        if self.on_changing is not None:
            self.on_changing()
        run = self._run
        if run is not None and run.applied < run.steps and run._on_interrupt is not None:
            run._on_interrupt(run)
        self.cut_decode_run()

    def _changed(self) -> None:
        """The state changed from outside (what :meth:`load` reports may differ): a new load version, and
        :attr:`on_change` told."""
        self.load_version += 1
        if self.on_change is not None:
            self.on_change()

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
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request {request.request_id!r} is already in this engine")
        self._changing()
        self.scheduler.add(request)
        self._changed()

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting, running, suspended); free its blocks. False if unknown."""
        if request_id not in self.scheduler.requests and request_id not in self._suspended:
            return False
        self._changing()
        state = self._suspended.pop(request_id, None)
        if state is not None:
            self.scheduler.requests.pop(request_id, None)
            self.blocks.free(request_id)
        else:
            state = self.scheduler.remove(request_id)
        if state is None:
            return False
        self.stats[request_id] = RequestStats(state)
        self._changed()
        return True

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule one batch, price it and apply it. An idle result (nothing fit) has duration 0.

        With ``decode_runs`` a pure decode step comes from the run in progress (or a new one), at
        O(batch) cost; the result is the one ``Scheduler.schedule`` would have given.
        """
        if self.decode_runs:
            run = self._run
            if run is None or run.done:
                run = self.start_decode_run(self.STEP_RUN_STEPS)
                if run is not None:
                    return self._run_step_result(run)
            else:
                self.advance_decode_run(run.applied + 1)
                return self._run_step_result(run)
        self.cut_decode_run()
        return self._schedule_step()

    def _run_step_result(self, run: DecodeRun) -> StepResult:
        """The StepResult of the run's latest applied step."""
        return StepResult(
            duration_s=run.duration_s(run.applied - 1),
            new_tokens=dict.fromkeys(run.request_ids, 1),
            finished=run.finished if run.done else (),
            preempted=(),
            num_prefill_tokens=0,
            num_decode_tokens=len(run.request_ids),
            num_scheduled_seqs=len(run.request_ids),
        )

    def start_decode_run(
        self, max_steps: int, on_interrupt: Callable[[DecodeRun], None] | None = None
    ) -> DecodeRun | None:
        """Plan the next steps as a run of pure decode steps (at most ``max_steps``) and apply the first.

        Returns None (nothing changed) when the next step is not a pure decode step of every running
        request (``Scheduler.decode_run_length``); :meth:`step` then forms it. ``on_interrupt(run)`` is
        called before a change from outside while steps are left: apply the steps that have started
        (:meth:`advance_decode_run`); the run then ends after them (``steps`` becomes ``applied``).

        Raises RuntimeError while another run has steps left to apply.
        """
        if self._run is not None and not self._run.done:
            raise RuntimeError(f"{self.instance_id}: start_decode_run: {self._run!r} is in progress")
        self._run = None
        sched = self.scheduler
        steps = sched.decode_run_length(max_steps)
        if steps < 1:
            return None
        running = sched.running
        first_kv = sum([s.num_computed_tokens for s in running]) + len(running)
        times = self.latency_model.decode_step_times(len(running), first_kv)
        run = DecodeRun(tuple([s.request_id for s in running]), times, steps, on_interrupt)
        self._run = run
        self.advance_decode_run(1)
        return run

    def advance_decode_run(self, applied: int) -> None:
        """Apply the run's steps up to ``applied`` (of ``steps``); steps already applied stay. The last step
        removes the requests that finish in it (``DecodeRun.finished``).

        Raises RuntimeError when no run is in progress, ValueError when ``applied`` exceeds its steps.
        """
        run = self._run
        if run is None:
            raise RuntimeError(f"{self.instance_id}: advance_decode_run: no decode run in progress")
        if applied > run.steps:
            raise ValueError(f"{self.instance_id}: advance_decode_run({applied}): {run!r}")
        if applied <= run.applied:
            return
        finished = self.scheduler.apply_decode_steps(applied - run.applied, run.request_ids)
        self.load_version += applied - run.applied  # one version per step, as step-by-step stepping
        run.applied = applied
        self._last_step_preempted = False
        if finished:
            for state in finished:
                self.stats[state.request_id] = RequestStats(state)
            run.finished = tuple(s.request_id for s in finished)

    def cut_decode_run(self) -> None:
        """End the run in progress after its applied steps (no-op without one)."""
        run = self._run
        if run is not None:
            self._run = None
            run.steps = run.applied

    def _schedule_step(self) -> StepResult:
        """One step the step-by-step way: ``Scheduler.schedule``, the latency model, ``Scheduler.update``."""
        batch = self.scheduler.schedule()
        preempted_before = self._last_step_preempted
        self._last_step_preempted = bool(batch.preempted)
        duration_s = self.latency_model.step_time_s(
            [(c, before) for _, c, before in batch.prefill], [ctx for _, ctx in batch.decode]
        )
        departing = {rid: self.scheduler.requests[rid] for rid, _, _ in batch.prefill}
        departing.update({rid: self.scheduler.requests[rid] for rid, _ in batch.decode})
        new_tokens, finished, recomputed = self.scheduler.update(batch, duration_s)
        for rid in finished:
            self.stats[rid] = RequestStats(departing[rid])
        if batch.num_seqs or batch.preempted or preempted_before:
            self.load_version += 1
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
        self._changing()
        if not self.blocks.reserve(reservation_id, n_blocks):
            return False
        self._changed()
        return True

    def adopt_prefix(
        self, reservation_id: str, prefix_block_hashes: Sequence[int], hash_block_tokens: int, kv_tokens: int
    ) -> int:
        """Destination side, right after :meth:`reserve`: the incoming request's leading prefix hash blocks this
        engine's prefix cache holds become its first blocks at :meth:`commit_incoming`, shared with the cache,
        never copied nor allocated twice (``BlockManager.adopt_prefix``). ``kv_tokens``: tokens whose KV the
        request holds (only its full blocks can match). Returns the blocks adopted (0 without prefix caching).
        Raises KeyError for an unknown reservation."""
        full_tokens = kv_tokens - kv_tokens % self.blocks.block_size_tokens
        if self.blocks.reservation_size(reservation_id) is None:
            raise KeyError(f"{self.instance_id}: adopt_prefix: unknown reservation {reservation_id!r}")
        if not self.blocks.prefix_matching(prefix_block_hashes, hash_block_tokens, full_tokens):
            return 0  # nothing to share: no change (a decode run in progress goes on)
        self._changing()
        adopted = self.blocks.adopt_prefix(reservation_id, prefix_block_hashes, hash_block_tokens, full_tokens)
        self._changed()
        return adopted

    def adopt_cached_prefix(
        self,
        reservation_id: str,
        prompt_token_ids: Sequence[int],
        prefix_block_hashes: Sequence[int] = (),
        prefix_hash_block_tokens: int = 0,
    ) -> int:
        """The llumlet's Reserve (``Engine.adopt_cached_prefix``): :meth:`adopt_prefix` by the prompt's prefix hash
        ids, which cover full prompt blocks only, all of them in the KV of a request in decode (this engine has
        no content to match ``prompt_token_ids`` by). 0 for hash blocks that are not whole blocks here (hashed for
        another block size: they name nothing this cache holds). Raises KeyError for an unknown reservation."""
        if (
            not prefix_block_hashes
            or prefix_hash_block_tokens < 1
            or prefix_hash_block_tokens % self.blocks.block_size_tokens
        ):
            if self.blocks.reservation_size(reservation_id) is None:
                raise KeyError(f"{self.instance_id}: adopt_cached_prefix: unknown reservation {reservation_id!r}")
            return 0
        kv_tokens = len(prefix_block_hashes) * prefix_hash_block_tokens
        return self.adopt_prefix(reservation_id, prefix_block_hashes, prefix_hash_block_tokens, kv_tokens)

    def prefill_time_s(self, num_tokens: int, cached_tokens: int) -> float | None:
        """The latency model's time of one step prefilling ``num_tokens`` after ``cached_tokens`` of context,
        alone (``LatencyModel.step_time_s``), seconds; 0 for no token. The simulator's migration executor and the
        sim llumlet's Reserve both price re-prefilling a moved prefix with it."""
        if num_tokens <= 0:
            return 0.0
        return self.latency_model.step_time_s([(num_tokens, cached_tokens)], [])

    def recompute_prefix(
        self, reservation_id: str, prompt_token_ids: Sequence[int], first_block: int, num_blocks: int
    ) -> float:
        """The model engine holds no KV data: the positions need nothing written; returns the modelled time of
        prefilling them (:meth:`prefill_time_s`), which the caller waits out. It is charged as a delay of the
        move, not to this engine's batch (an approximation the simulator's executor shares: it calls this too).

        Raises KeyError for an unknown reservation, IndexError past it.
        """
        fresh = self.blocks.reservation_size(reservation_id)
        if fresh is None:
            raise KeyError(f"{self.instance_id}: recompute_prefix: unknown reservation {reservation_id!r}")
        size = self.blocks.adopted_blocks(reservation_id) + fresh  # positions: the adopted prefix, then the rest
        if first_block < 0 or num_blocks < 0 or first_block + num_blocks > size:
            raise IndexError(
                f"{self.instance_id}: recompute_prefix: blocks {first_block}..{first_block + num_blocks}"
                f" exceed reservation {reservation_id!r} of {size} blocks"
            )
        bs = self.blocks.block_size_tokens
        return self.prefill_time_s(num_blocks * bs, first_block * bs) or 0.0

    def release_reservation(self, reservation_id: str) -> int:
        """Give a reservation back. Idempotent and safe if never reserved; returns blocks released."""
        if self.blocks.reservation_size(reservation_id) is None:
            return 0
        self._changing()
        released = self.blocks.release(reservation_id)
        if released:
            self._changed()
        return released

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
        if request_id not in self._suspended:
            return 0
        self._changing()
        state = self._suspended.pop(request_id)
        self.scheduler.requests.pop(request_id, None)
        self.stats[request_id] = RequestStats(state)
        self._changed()
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
        self._changing()
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
        self._changed()
        return True
