"""The engine protocol: what a llumlet needs from any engine backend.

Every backend implements :class:`Engine` — the model engine (:class:`llumlet.engine.core.EngineCore`,
used by the simulator and by the real-time ``sim`` backend), the CPU reference engine on PyTorch, and
vLLM. The protocol is close to what vLLM's v1 engine exposes (add / abort / step / stats) plus the
migration hooks a llumlet drives (DESIGN.md, "Migration"):

source side                              destination side
-----------                              ----------------
request_kv, migratable                   reserve(reservation_id, n_blocks) -> bool
                                         grow_reservation(reservation_id, n_blocks) -> bool
begin_read(request_id, first, n)
  -> BlockRun; .copy(first, n)     ───▶  write_blocks(reservation_id, first, payload)      (bytes)
read_blocks(request_id, first, n)  ───▶  (the same, copied under the lock)
kv_pool(), BlockRun.block_ids      ───▶  write_blocks_from(reservation_id, first, pool, ids) (one host)
                                         prefill_time_s(num_tokens, cached_tokens) -> float | None
                                         recompute_prefix(reservation_id, prompt_ids, first, n) -> s
suspend(request_id) -> MigrationState    commit_incoming(reservation_id, state) -> bool
resume(request_id)   (on abort)          release_reservation(reservation_id)  (idempotent)
free_migrated(request_id) (after commit)

Mechanism only (STYLE.md): a backend says "can't" (False / None / a reason string) and never decides
whom to move. Blocks are addressed by their position in the request's block table (block 0 holds
tokens 0 .. block_size-1), so the two ends need not share physical block ids.

Reading off the decode path: ``begin_read`` runs under the engine lock and only pins down which physical
blocks hold the run (a few microseconds); the returned :class:`BlockRun`'s ``copy`` moves the data out in
any thread, without the lock, while the engine keeps stepping (the full blocks of a running request are
never written again), and ``still_valid`` — under the lock again — says whether the request held those
blocks throughout (a preemption frees them, and a block freed mid-copy may have been reused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from llumlet.engine.types import EngineLoad, EngineRequest, MigrationState, StepResult

if TYPE_CHECKING:
    from llumlet.kvpool import KVPool

__all__ = ["BlockRun", "Engine", "KVPayload"]


@dataclass(frozen=True, slots=True)
class KVPayload:
    """A run of a request's KV cache blocks, as one backend reads them and another writes them.

    ``data`` is backend-specific (for the torch engine: the blocks' K and V tensors, all layers,
    serialized); the model engine moves no data and leaves it empty. ``nbytes`` is the size the blocks
    occupy on a GPU (``num_blocks x kv_bytes_per_block``): transports charge their rate cap by it.
    """

    first_block: int  # position of the first block in the request's block table
    num_blocks: int  # blocks in this run
    nbytes: int  # logical size, bytes (what a real GPU copy would move)
    data: bytes = b""  # the blocks' contents, backend-specific layout

    def __post_init__(self) -> None:
        if self.first_block < 0 or self.num_blocks < 0 or self.nbytes < 0:
            raise ValueError(f"KVPayload: negative field in {self.first_block}, {self.num_blocks}, {self.nbytes}")


@dataclass(frozen=True, slots=True)
class BlockRun:
    """A run of a request's blocks pinned down under the engine lock, copied out later without it.

    ``copy(first_block, num_blocks)`` (block-table positions inside the run) returns a :class:`KVPayload`
    and may run in any thread while the engine steps; ``still_valid()`` must run under the engine lock
    after the copies: True when the request still holds exactly these blocks and was not preempted since
    ``begin_read`` (else the copied data may be another request's and must be discarded).
    """

    request_id: str
    first_block: int  # block-table position of block_ids[0]
    block_ids: tuple[int, ...]  # physical block ids in the source's pool (for transports that address them)
    nbytes_per_block: int  # logical bytes of one block (kv_bytes_per_block): what rate caps charge
    copy: Callable[[int, int], KVPayload]  # (first_block, num_blocks) inside the run -> the blocks' data
    still_valid: Callable[[], bool]  # under the engine lock: the blocks were the request's throughout

    @property
    def num_blocks(self) -> int:
        """Blocks in the run."""
        return len(self.block_ids)


class Engine(Protocol):
    """One model instance's engine. Not thread-safe: one llumlet loop drives it.

    Errors: ``add_request`` raises ``llumlet.engine.core.RequestTooLargeError`` when the request can never
    fit, ``ValueError`` on a repeated id; ``write_blocks`` / ``commit_incoming`` raise ``KeyError`` for an
    unknown reservation. Everything else reports "can't" by its return value.
    """

    instance_id: str

    @property
    def block_size_tokens(self) -> int:
        """Tokens per KV cache block."""
        ...

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block occupies (all layers, K and V)."""
        ...

    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request."""
        ...

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, running, suspended) and free its blocks; False if unknown."""
        ...

    def has_work(self) -> bool:
        """True while a request is queued or running."""
        ...

    def step(self) -> StepResult:
        """Run one batch: new tokens (``token_ids`` for real engines), finished and preempted requests."""
        ...

    def load(self) -> EngineLoad:
        """Blocks total/used/reserved, running requests, queue length and head-of-line demand."""
        ...

    # ---- source side ----------------------------------------------------------------------------
    def request_kv(self, request_id: str) -> tuple[int, int] | None:
        """(tokens whose KV is cached, blocks held) of an unfinished request; None if unknown."""
        ...

    def migratable(self, request_id: str) -> str | None:
        """None when the request can be migrated faithfully now, else the reason it cannot."""
        ...

    def read_blocks(self, request_id: str, first_block: int, num_blocks: int) -> KVPayload:
        """Copy ``num_blocks`` blocks from position ``first_block`` of the request's block table.

        Raises KeyError for an unknown request, IndexError past its last block.
        """
        ...

    def begin_read(self, request_id: str, first_block: int, num_blocks: int) -> BlockRun:
        """Pin down blocks ``[first_block, first_block + num_blocks)`` to copy them without the engine lock.

        Raises KeyError for an unknown request, IndexError past its last block.
        """
        ...

    def kv_pool(self) -> KVPool | None:
        """The engine's KV memory for peer copies between llumlets of one host (``llumlet.kvpool``);
        None when the engine holds no KV data (the model engine)."""
        ...

    def suspend(self, request_id: str) -> MigrationState | None:
        """Between two steps: stop scheduling the request, keep its blocks; its state, or None if it can't."""
        ...

    def resume(self, request_id: str) -> bool:
        """Undo ``suspend`` (the migration was aborted); False if it was not suspended."""
        ...

    def free_migrated(self, request_id: str) -> int:
        """After the destination committed: forget the request, free its blocks. Idempotent."""
        ...

    # ---- destination side -----------------------------------------------------------------------
    def reserve(self, reservation_id: str, n_blocks: int) -> bool:
        """Hold ``n_blocks`` for an incoming request; False if there is no room or the id is in use."""
        ...

    def adopt_cached_prefix(
        self,
        reservation_id: str,
        prompt_token_ids: Sequence[int],
        prefix_block_hashes: Sequence[int] = (),
        prefix_hash_block_tokens: int = 0,
    ) -> int:
        """Right after ``reserve``: the leading full blocks of the request's prompt this engine already caches
        become the reservation's first positions (held, counted as written, never written to), in place of
        as many of its fresh blocks; returns how many (0 when it caches none of them). An engine matches by
        content (``prompt_token_ids``: vLLM) or by the prompt's prefix hash ids (``prefix_block_hashes``, each
        of ``prefix_hash_block_tokens`` tokens: the model engine, whose requests have no content).

        Raises KeyError for an unknown reservation.
        """
        ...

    def prefill_time_s(self, num_tokens: int, cached_tokens: int) -> float | None:
        """Estimated seconds to prefill ``num_tokens`` prompt tokens after ``cached_tokens`` whose KV is already in
        place, alone in one step, on this engine: what re-prefilling a migrated request's missing prefix here
        would take (``topology.cost.MigrationCostInput.prefix_reprefill_s``). None when this engine cannot
        re-prefill a migrated prefix (:meth:`recompute_prefix`) or has no estimate yet: then a migration here
        always copies the prefix.
        """
        ...

    def recompute_prefix(
        self, reservation_id: str, prompt_token_ids: Sequence[int], first_block: int, num_blocks: int
    ) -> float:
        """Fill the reservation's positions ``[first_block, first_block + num_blocks)`` by prefilling the prompt's
        tokens of those blocks here (positions before ``first_block`` already hold the prompt's KV: adopted from
        the prefix cache or recomputed), instead of receiving them from the source. Returns the seconds of
        modelled time the recomputation still takes after the call (the model engine, which computes nothing:
        :meth:`prefill_time_s` of those tokens; an engine that really computed them: 0).

        Raises KeyError for an unknown reservation, IndexError past it, ValueError when the engine cannot
        recompute (no estimate offered) or ``prompt_token_ids`` does not cover the blocks.
        """
        ...

    def grow_reservation(self, reservation_id: str, n_blocks: int) -> bool:
        """Make the reservation hold at least ``n_blocks`` (the request grew during pre-copy); False if no room.

        Raises KeyError for an unknown reservation.
        """
        ...

    def write_blocks(self, reservation_id: str, payload: KVPayload) -> None:
        """Store copied blocks into the reservation at their block-table positions."""
        ...

    def write_blocks_from(
        self, reservation_id: str, first_block: int, source: KVPool, src_block_ids: Sequence[int]
    ) -> None:
        """Copy blocks ``src_block_ids`` of a peer's pool (same host) into the reservation at positions
        ``first_block ..``; errors as :meth:`write_blocks` (ValueError for a pool of another layout)."""
        ...

    def commit_incoming(self, reservation_id: str, state: MigrationState) -> bool:
        """Adopt the request with its KV in place and resume it; False if its growth does not fit."""
        ...

    def release_reservation(self, reservation_id: str) -> int:
        """Give the reservation back; idempotent and safe if never reserved. Returns blocks released."""
        ...
