"""Live migration on the virtual clock: multi-stage pre-copy over shared, capped links.

The protocol is the one in DESIGN.md (after Llumnix §4.2) and the one the llumlets run:

1. the destination reserves blocks for the request (its blocks now plus the growth expected while
   the copy runs); no room -> the migration is aborted before anything moves;
2. stage 0 copies every full block while the request keeps decoding on the source;
3. each further stage copies the blocks that filled meanwhile; when to stop is
   :class:`topology.cost.PrecopyRule` (the cost model's and the llumlets' rule, from ``CostConfig``): the
   source then suspends the request at its next step boundary;
4. the last stage copies the remainder (with the partial last block) and the request state; the
   destination commits and the request resumes there; downtime = suspend -> resume;
5. the source frees its blocks. A request that finishes (or is aborted) before commit releases the
   reservation and stays where it was.

Prefix blocks (prefix caching): the destination first adopts the leading prefix hash blocks of the request
its prefix cache already holds (``EngineCore.adopt_prefix``: shared with its cache, never allocated twice,
never copied) and reserves the rest. The move is priced with the cost model (:func:`topology.cost.plan_migration`,
with ``prefix_blocks`` = the request's full prompt hash blocks, ``prefix_blocks_on_dst`` = those adopted and
``prefix_reprefill_s`` = ``EngineCore.prefill_time_s`` of the destination, its latency model prefilling the
missing ones alone: the estimate a sim llumlet's Reserve reply carries); when its plan is
``"pre-copy+recompute-prefix"`` the missing prefix blocks are not copied either: the destination recomputes
them while the rest is copied (``EngineCore.recompute_prefix``, which a sim llumlet destination calls too), and
the request resumes when both are done (the recomputation is charged as a delay only, not to the destination's
batch: an approximation, the same in the sim llumlet).

Stage durations come from the same effective bandwidth the cost model uses
(:func:`topology.cost.effective_bandwidth_bytes_per_s`): the path's bottleneck bandwidth times the
migration cap, shared fairly among the flows on the busiest link of the path; the cost model's fixed
control-plane times (``CostConfig``) are charged where it charges them: ``setup_overhead_s`` before stage 0,
``stage_overhead_s`` to every live stage that sends blocks, ``suspend_resume_overhead_s`` to the downtime.
The share is sampled when a stage starts and held for the stage (piecewise-constant fair sharing). Each
record carries the rate its pre-copy stages achieved (``precopy_bandwidth_bytes_per_s``, as a llumlet's
MigrateOutReply does): the sample the two-tier policy prices later moves with (``topology.bandwidth``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from llumlet.engine.types import MigrationState
from topology.cost import (
    DEFAULT_DECODE_STEP_S,
    CostConfig,
    MigrationCostInput,
    effective_bandwidth_bytes_per_s,
    plan_migration,
    prefix_kv_blocks,
)
from topology.graph import PathInfo, TopologyGraph

from .cluster import Cluster, SimInstance
from .events import EventKind
from .results import MigrationRecord

__all__ = ["LinkFlows", "MigrationExecutor"]


class LinkFlows:
    """Number of migration flows on each link (for the fair share and for link budgets)."""

    def __init__(self) -> None:
        self._flows: Counter[str] = Counter()

    def add(self, links: tuple[str, ...]) -> None:
        self._flows.update(links)

    def remove(self, links: tuple[str, ...]) -> None:
        self._flows.subtract(links)

    def counts(self) -> Mapping[str, int]:
        """Flows per link now (a read-only view; links with none may be missing)."""
        return MappingProxyType(self._flows)

    def busiest(self, links: tuple[str, ...]) -> int:
        """Flows on the most loaded link of ``links`` (0 for an empty path)."""
        return max((self._flows[link] for link in links), default=0)

    def count(self, link: str) -> int:
        return self._flows[link]


@dataclass(slots=True)
class _Move:
    request_id: str
    src: SimInstance
    dst: SimInstance
    path: PathInfo
    reservation_id: str
    start_s: float
    stage: int = 0
    copied_blocks: int = 0
    bytes_moved: int = 0
    suspended_at_s: float | None = None
    done: bool = False
    why: str = ""  # the decision that started it (recorded as the committed move's reason)
    stage_in_flight: tuple[int, float] = (0, 0.0)  # (bytes, seconds) of the live stage being copied
    precopy_bytes: int = 0  # bytes of the live stages completed
    precopy_s: float = 0.0  # their time
    skipped_blocks: int = 0  # leading prefix blocks the destination held (adopted, not copied)
    recomputed_blocks: int = 0  # prefix blocks the destination recomputes instead of receiving them
    recompute_done_s: float = 0.0  # when that recomputation ends (0: none)


class MigrationExecutor:
    """Runs migrations between simulated instances and records their outcome.

    ``start()`` returns False (and records nothing) when the request cannot move now: it is unknown,
    already migrating, finished, or the destination cannot reserve room.
    """

    def __init__(
        self,
        cluster: Cluster,
        graph: TopologyGraph,
        cost: CostConfig,
        flows: LinkFlows,
        reserve_margin_blocks: int = 2,
    ) -> None:
        self.cluster = cluster
        self.graph = graph
        self.cost = cost
        self.flows = flows
        self.reserve_margin_blocks = reserve_margin_blocks
        self.records: list[MigrationRecord] = []
        self.active: dict[str, _Move] = {}
        self.busy_instances: Counter[str] = Counter()
        self._attempts = 0
        self.on_done: list[Callable[[MigrationRecord], None]] = []
        # (path bandwidth, flows beside this one) -> the rate one flow gets (the cost model computes it exactly,
        # in fractions: worth keeping, as a run prices its few paths at a few flow counts again and again)
        self._rates: dict[tuple[float, int], float] = {}
        cluster.on_finished.append(self._request_finished)

    def bandwidth_bytes_per_s(self, path: PathInfo, *, own_flow: bool = False) -> float:
        """The rate a flow on ``path`` gets now: cap x bottleneck / (flows on its busiest link).

        ``own_flow``: the flow asking is already counted in :attr:`flows` (a running migration).
        """
        others = self.flows.busiest(path.links) - (1 if own_flow else 0)
        key = (path.bandwidth_bytes_per_s, others)
        rate = self._rates.get(key)
        if rate is None:
            rate = self._rates[key] = effective_bandwidth_bytes_per_s(key[0], self.cost.cap_fraction, others)
        return rate

    def start(self, request_id: str, src_id: str, dst_id: str, why: str = "") -> bool:
        """Begin migrating ``request_id`` from ``src_id`` to ``dst_id``; False if it cannot start.

        ``why``: the decision behind the move, kept as the reason of its record when it commits.
        """
        state = self.cluster.requests.get(request_id)
        if state is None or state.migrating or state.finish_s is not None or src_id == dst_id:
            return False
        src, dst = self.cluster.instances[src_id], self.cluster.instances[dst_id]
        kv = src.engine.request_kv(request_id)
        if kv is None:
            return False
        tokens, blocks = kv
        self._attempts += 1
        reservation_id = f"{request_id}#m{self._attempts}"
        request = src.engine.request_state(request_id)
        hashes, hash_tokens = (
            (request.request.prefix_block_hashes, request.request.prefix_hash_block_tokens) if request else ((), 0)
        )
        adopted = self._reserve(dst, reservation_id, blocks, tokens, hashes, hash_tokens)
        if adopted is None:
            return False
        path = self.graph.path(src_id, dst_id)
        move = _Move(request_id, src, dst, path, reservation_id, start_s=self.cluster.queue.now_s, why=why)
        if hashes:
            self._plan_prefix(
                move, tokens, hashes, hash_tokens, request.request.prompt_tokens if request else 0, adopted
            )
        state.migrating = True
        self.active[request_id] = move
        self.busy_instances.update((src_id, dst_id))
        self.flows.add(path.links)
        if self.cost.setup_overhead_s > 0:  # the command and the reservation's round trip: it decodes meanwhile
            self.cluster.queue.schedule_in(self.cost.setup_overhead_s, EventKind.MIGRATION, lambda: self._begin(move))
        else:
            self._next_stage(move)
        return True

    def _begin(self, move: _Move) -> None:
        if not move.done:
            self._next_stage(move)

    def _reserve(
        self, dst: SimInstance, reservation_id: str, blocks: int, tokens: int, hashes: tuple[int, ...], hash_tokens: int
    ) -> int | None:
        """Reserve room on ``dst`` for a request holding ``blocks`` (``tokens`` of KV): the prefix blocks its cache
        holds adopted first, the rest reserved (plus the margin). Returns the blocks adopted, None: no room."""
        engine = dst.engine
        full = tokens - tokens % engine.blocks.block_size_tokens
        if not hashes or not engine.blocks.prefix_matching(hashes, hash_tokens, full):
            return 0 if engine.reserve(reservation_id, blocks + self.reserve_margin_blocks) else None
        if not engine.reserve(reservation_id, 0):
            return None
        adopted = engine.adopt_prefix(reservation_id, hashes, hash_tokens, tokens)
        if not engine.grow_reservation(reservation_id, blocks - adopted + self.reserve_margin_blocks):
            engine.release_reservation(reservation_id)
            return None
        return adopted

    def _plan_prefix(
        self, move: _Move, tokens: int, hashes: tuple[int, ...], hash_tokens: int, prompt_tokens: int, adopted: int
    ) -> None:
        """Price the move with its prefix (module docstring) and follow the plan: skip the adopted blocks, and
        the rest of the prefix too when recomputing it on the destination finishes sooner."""
        model = self.cluster.model_of(move.src.instance_id)
        bs = model.block_size_tokens
        prefix_blocks = prefix_kv_blocks(min(len(hashes), prompt_tokens // hash_tokens), hash_tokens, tokens, bs)
        move.skipped_blocks = move.copied_blocks = adopted = min(adopted, prefix_blocks)
        missing = prefix_blocks - adopted
        if missing <= 0:
            return
        plan = plan_migration(
            MigrationCostInput(
                kv_tokens=tokens,
                kv_bytes_per_token=model.kv_bytes_per_token,
                block_size_tokens=bs,
                decode_step_s=move.src.last_step_s or DEFAULT_DECODE_STEP_S,
                path_bandwidth_bytes_per_s=move.path.bandwidth_bytes_per_s,
                existing_flows=self.flows.busiest(move.path.links),
                prefix_blocks=prefix_blocks,
                prefix_blocks_on_dst=adopted,
                prefix_reprefill_s=move.dst.engine.prefill_time_s(missing * bs, adopted * bs),
            ),
            self.cost,
        )
        if plan.mode == "pre-copy+recompute-prefix":
            move.recomputed_blocks = missing
            move.copied_blocks = prefix_blocks
            # the destination engine charges the re-prefill as a sim llumlet's does (EngineCore.recompute_prefix)
            recompute_s = move.dst.engine.recompute_prefix(move.reservation_id, (), adopted, missing)
            move.recompute_done_s = move.start_s + self.cost.setup_overhead_s + recompute_s  # after the set-up

    # ------------------------------------------------------------------ stages
    def _block_bytes(self, move: _Move) -> int:
        return self.cluster.model_of(move.src.instance_id).kv_bytes_per_block

    def _next_stage(self, move: _Move) -> None:
        kv = move.src.engine.request_kv(move.request_id)
        if kv is None:  # finished or preempted away meanwhile
            self._abort(move, "request left the source before the copy finished")
            return
        tokens, blocks = kv
        block_size = self.cluster.model_of(move.src.instance_id).block_size_tokens
        full_blocks = tokens // block_size
        if blocks == 0 or full_blocks < move.copied_blocks:  # preempted (recompute) on the source: KV gone
            self._abort(move, "request was preempted on the source during pre-copy")
            return
        remaining = self.cost.precopy.next_live_stage(tokens, move.copied_blocks, move.stage, block_size)
        if remaining is None:
            self.cluster.at_step_boundary(move.src, lambda: self._suspend(move))
            return
        duration = self._copy_s(move, remaining) + self.cost.live_stage_overhead_s(remaining)
        move.stage_in_flight = (remaining * self._block_bytes(move), duration)
        move.copied_blocks += remaining
        move.stage += 1
        self.cluster.queue.schedule_in(duration, EventKind.MIGRATION, lambda: self._stage_done(move))

    def _copy_s(self, move: _Move, blocks: int) -> float:
        nbytes = blocks * self._block_bytes(move)
        move.bytes_moved += nbytes
        if nbytes == 0:
            return 0.0
        return nbytes / self.bandwidth_bytes_per_s(move.path, own_flow=True)

    def _stage_done(self, move: _Move) -> None:
        if move.done:
            return
        nbytes, seconds = move.stage_in_flight
        move.precopy_bytes += nbytes
        move.precopy_s += seconds
        self._next_stage(move)

    def _suspend(self, move: _Move) -> None:
        if move.done:
            return
        kv = move.src.engine.request_kv(move.request_id)
        if kv is None:
            self._abort(move, "request left the source before the last stage")
            return
        tokens, blocks = kv
        state = move.src.engine.suspend(move.request_id)
        if state is None or blocks < move.copied_blocks:
            self._abort(move, "request could not be suspended (preempted back to the queue)")
            return
        move.suspended_at_s = self.cluster.queue.now_s
        block_size = self.cluster.model_of(move.src.instance_id).block_size_tokens
        last_blocks = -(-tokens // block_size) - move.copied_blocks  # the remainder, partial last block included
        copy_s = self._copy_s(move, last_blocks)
        recompute_left_s = move.recompute_done_s - self.cluster.queue.now_s  # the destination's, in parallel
        duration = max(copy_s, recompute_left_s) + self.cost.suspend_resume_overhead_s
        self.cluster.queue.schedule_in(duration, EventKind.MIGRATION, lambda: self._commit(move, state))

    def _commit(self, move: _Move, suspended: MigrationState) -> None:
        if move.done:
            return
        if not move.dst.engine.commit_incoming(move.reservation_id, suspended):
            move.src.engine.resume(move.request_id)
            self.cluster.kick(move.src)
            self._abort(move, "destination could not commit (no room for the growth)")
            return
        move.src.engine.free_migrated(move.request_id)
        state = self.cluster.requests[move.request_id]
        self.cluster.count_prefix_hits(state, move.src)
        state.instance_id = move.dst.instance_id
        state.migrations += 1
        self._finish(move, "committed", move.why)
        self.cluster.kick(move.dst)
        self.cluster.kick(move.src)

    # ------------------------------------------------------------------ endings
    def _request_finished(self, request_id: str) -> None:
        move = self.active.get(request_id)
        if move is not None and move.suspended_at_s is None:
            self._abort(move, "request finished during pre-copy")

    def _abort(self, move: _Move, reason: str) -> None:
        move.dst.engine.release_reservation(move.reservation_id)
        self._finish(move, "aborted", reason)
        self.cluster.kick(move.dst)

    def _finish(self, move: _Move, outcome: Literal["committed", "aborted"], reason: str) -> None:
        move.done = True
        now = self.cluster.queue.now_s
        del self.active[move.request_id]
        self.busy_instances.subtract((move.src.instance_id, move.dst.instance_id))
        self.flows.remove(move.path.links)
        self.cluster.requests[move.request_id].migrating = False
        downtime = now - move.suspended_at_s if (outcome == "committed" and move.suspended_at_s) else 0.0
        record = MigrationRecord(
            request_id=move.request_id,
            src_instance_id=move.src.instance_id,
            dst_instance_id=move.dst.instance_id,
            src_domain_id=move.src.domain_id,
            dst_domain_id=move.dst.domain_id,
            start_s=move.start_s,
            end_s=now,
            downtime_s=downtime,
            bytes_transferred=move.bytes_moved,
            stages=move.stage + (1 if move.suspended_at_s is not None else 0),
            outcome=outcome,
            reason=reason,
            precopy_bandwidth_bytes_per_s=move.precopy_bytes / move.precopy_s if move.precopy_s > 0 else 0.0,
            skipped_prefix_blocks=move.skipped_blocks,
            recomputed_prefix_blocks=move.recomputed_blocks,
        )
        self.records.append(record)
        for listener in self.on_done:
            listener(record)

    def is_busy(self, instance_id: str) -> bool:
        """True while ``instance_id`` is the source or destination of a migration."""
        return self.busy_instances[instance_id] > 0
