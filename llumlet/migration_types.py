"""Value types of the llumlet's migration protocol: settings, the MigrateOut command and report, and the
messages the source sends its destination (DESIGN.md "Migration"; ``proto/hilum/v1/llumlet.proto``).

Plain dataclasses: the gRPC edge (``llumlet.server`` on the destination, ``llumlet.client`` on the source)
converts them to and from protobuf; the migration code never sees a ``*_pb2`` message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from llumlet.engine.types import MigrationState
from llumlet.transport import TransportName
from topology.cost import CostConfig, PrecopyRule, prefix_kv_blocks

__all__ = [
    "TIMING_TAG",
    "CommitCall",
    "DestReply",
    "DestStatus",
    "MigrationCommand",
    "MigrationConfig",
    "MigrationHooks",
    "MigrationOutcome",
    "MigrationReport",
    "MigrationTiming",
    "PromptPrefix",
    "Released",
    "Reserved",
    "StageStats",
    "Written",
    "parse_timing_line",
    "reservation_id",
]


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """Migration settings of one llumlet (the command may override stages and the rate cap)."""

    precopy: PrecopyRule = field(default_factory=PrecopyRule)  # when to suspend (the cost model's rule)
    reservation_expiry_s: float = 5.0  # a reservation with no message for this long is released
    cap_fraction: float = 0.2  # grpc transport: share of the path bandwidth (topology.cost default)
    grpc_rate_cap_bytes_per_s: float = 0.0  # grpc transport cap; 0 = path bandwidth x cap_fraction, or none
    local_rate_cap_bytes_per_s: float = 0.0  # local transport cap; 0 = none
    chunk_bytes: int = 1 << 20  # blocks per message: this many logical bytes at most (>= 1 block)
    link_budget_scope: str = ""  # who shares the link budgets: "" = this llumlet's migrations; a name = every
    # llumlet on the host with it (llumlet.linkbudget)
    rpc_timeout_s: float = 10.0  # deadline of the control RPCs to the destination
    # the cost model's settings (``hilum_config``'s ``cost``): their fixed overheads price the copy-versus-recompute
    # plan of a move with a prefix (topology.cost.plan_migration); the move runs by ``precopy`` and ``cap_fraction``
    cost: CostConfig = field(default_factory=CostConfig)

    def __post_init__(self) -> None:
        if self.reservation_expiry_s <= 0 or self.rpc_timeout_s <= 0 or self.chunk_bytes < 1:
            raise ValueError(f"MigrationConfig: reservation_expiry_s, rpc_timeout_s, chunk_bytes must be > 0: {self}")
        if not 0 < self.cap_fraction <= 1:
            raise ValueError(f"MigrationConfig.cap_fraction = {self.cap_fraction}: need 0 < f <= 1")


class MigrationOutcome(enum.Enum):
    """How a MigrateOut ended."""

    COMMITTED = "committed"  # the request runs on the destination now
    ABORTED = "aborted"  # started, undone: the request continues here, or it ended meanwhile
    REFUSED = "refused"  # never started


@dataclass(frozen=True, slots=True)
class MigrationCommand:
    """A MigrateOut command (``hilum.v1.MigrateOutRequest``)."""

    request_id: str
    dst_address: str  # host:port of the destination llumlet
    attempt: int  # >= 1, grows with every migration try of this request (cluster-wide)
    dst_instance_id: str = ""  # "" = ask the destination
    transport: TransportName | None = None  # None = by the topology
    fencing_token: int = 0  # 0 = unfenced (intra-domain)
    rate_cap_bytes_per_s: float = 0.0  # 0 = the configured default
    stop_and_copy: bool = False  # naive baseline: suspend first, copy everything
    max_stages: int | None = None  # overrides the configured PrecopyRule for this move (benchmarks, tests)
    stop_remaining_blocks: int | None = None  # likewise


@dataclass(frozen=True, slots=True)
class StageStats:
    """One stage of a migration."""

    stage: int  # 0, 1, ...
    last: bool  # the stage copied while the request was suspended
    blocks: int
    bytes: int  # logical KV bytes
    seconds: float  # the copy: stream open -> the destination's reply (the transport's measurement)
    wall_s: float = 0.0  # the whole stage as the migration spent it: engine calls, reservation growth, the copy


@dataclass(frozen=True, slots=True)
class MigrationReport:
    """What a MigrateOut did."""

    outcome: MigrationOutcome
    reason: str = ""
    transport: str = ""  # how the bytes went: "local" (peer copies), "local-inline", "grpc" (Transport.mode)
    rate_cap_bytes_per_s: float = 0.0
    stages: tuple[StageStats, ...] = ()
    total_s: float = 0.0  # command -> committed (or given up)
    downtime_s: float = 0.0  # suspended -> destination committed
    cached_blocks: int = 0  # leading blocks the destination already held (prefix cache): not sent
    # where the time went (seconds; 0 when the migration ended before that phase), docs/migration.md "Timing"
    setup_s: float = 0.0  # command -> the first Reserve sent (checks, transport choice, engine calls)
    reserve_s: float = 0.0  # the first Reserve round trip (before stage 0)
    presuspend_s: float = 0.0  # the last live stage's end -> suspend asked (the checks, the reservation grown)
    suspend_wait_s: float = 0.0  # suspend asked -> suspended (the engine's step boundary)
    commit_s: float = 0.0  # the Commit round trip (the destination adopts the request and resumes it)
    plan: str = ""  # the plan carried out: "pre-copy", "pre-copy+recompute-prefix" (topology.cost) or "stop-and-copy"
    recomputed_blocks: int = 0  # prefix blocks the destination re-prefilled instead of receiving them
    recompute_s: float = 0.0  # the destination's estimate of that re-prefill, seconds (what the plan priced)

    @property
    def blocks(self) -> int:
        """Blocks copied in all stages."""
        return sum(s.blocks for s in self.stages)

    @property
    def bytes(self) -> int:
        """Logical bytes copied in all stages."""
        return sum(s.bytes for s in self.stages)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Bytes / seconds spent in stages (0 when nothing moved)."""
        seconds = sum(s.seconds for s in self.stages)
        return self.bytes / seconds if seconds > 0 else 0.0

    @property
    def precopy_bandwidth_bytes_per_s(self) -> float:
        """Bytes / seconds of the pre-copy stages only (0 when there were none): the bandwidth the transport
        sustained on this path while the request kept decoding — the ``B_pre`` the cost model's convergence
        condition needs (docs/cost-model.md); the last stage is left out (a few blocks: latency-bound)."""
        pre = [s for s in self.stages if not s.last]
        seconds = sum(s.seconds for s in pre)
        return sum(s.bytes for s in pre) / seconds if seconds > 0 else 0.0

    def timing_line(self) -> str:
        """Where the migration's time went, one parseable token list (milliseconds; :func:`parse_timing_line`):

        ``timing_ms setup=U reserve=R stages=S0,S1,... presuspend=P suspend_wait=W last=L commit=C downtime=D
        total=T blocks=B plan=M recomputed=K`` (``stages``: each live stage's ``wall_s``, ``-`` for none; ``last``:
        the suspended stage's ``wall_s``, the token flush included; ``blocks``: per stage, the blocks copied,
        ``,``-separated; ``plan``: :attr:`plan`, ``-`` before one was made; ``recomputed``: the prefix blocks the
        destination re-prefilled).
        """

        def ms(x: float) -> str:
            return f"{x * 1e3:.3f}"

        live = [s for s in self.stages if not s.last]
        last = next((s.wall_s for s in self.stages if s.last), 0.0)
        return (
            f"{TIMING_TAG} setup={ms(self.setup_s)} reserve={ms(self.reserve_s)} "
            f"stages={','.join(ms(s.wall_s) for s in live) or '-'} presuspend={ms(self.presuspend_s)} "
            f"suspend_wait={ms(self.suspend_wait_s)} last={ms(last)} commit={ms(self.commit_s)} "
            f"downtime={ms(self.downtime_s)} total={ms(self.total_s)} "
            f"blocks={','.join(str(s.blocks) for s in self.stages) or '-'} plan={self.plan or '-'} "
            f"recomputed={self.recomputed_blocks}"
        )


#: The token that starts :meth:`MigrationReport.timing_line` (in the llumlet's log line of each migration).
TIMING_TAG = "timing_ms"


@dataclass(frozen=True, slots=True)
class MigrationTiming:
    """One migration's :meth:`MigrationReport.timing_line`, read back (seconds)."""

    setup_s: float
    reserve_s: float
    stage_s: tuple[float, ...]  # each live stage's wall time
    presuspend_s: float
    suspend_wait_s: float
    last_s: float  # the suspended stage, token flush included
    commit_s: float
    downtime_s: float
    total_s: float
    blocks: tuple[int, ...]  # per stage, the last one last
    plan: str = ""  # the plan carried out ("" when the line has none)
    recomputed_blocks: int = 0  # prefix blocks the destination re-prefilled


def parse_timing_line(text: str) -> MigrationTiming | None:
    """The :class:`MigrationTiming` of the first ``timing_ms ...`` token list in ``text`` (a log line), or None
    when it has none. Raises ValueError naming the token when one is malformed."""
    at = text.find(TIMING_TAG + " ")
    if at < 0:
        return None
    fields: dict[str, str] = {}
    for token in text[at + len(TIMING_TAG) :].split():
        key, sep, val = token.partition("=")
        if not sep:
            break
        fields[key] = val
    try:

        def s(key: str) -> float:
            return float(fields[key]) / 1e3

        def many(key: str, kind: type[float] | type[int]) -> tuple[Any, ...]:
            raw = fields[key]
            return () if raw == "-" else tuple(kind(x) for x in raw.split(","))

        return MigrationTiming(
            setup_s=s("setup"),
            reserve_s=s("reserve"),
            stage_s=tuple(x / 1e3 for x in many("stages", float)),
            presuspend_s=s("presuspend"),
            suspend_wait_s=s("suspend_wait"),
            last_s=s("last"),
            commit_s=s("commit"),
            downtime_s=s("downtime"),
            total_s=s("total"),
            blocks=many("blocks", int),
            plan="" if fields.get("plan", "-") == "-" else fields["plan"],
            recomputed_blocks=int(fields.get("recomputed", "0")),
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(f"bad {TIMING_TAG} line ({exc}): {text[at:].strip()!r}") from None


class MigrationHooks:
    """Test seams of the source side; the defaults do nothing."""

    async def stage_copied(self, request_id: str, attempt: int, stage: int) -> None:
        """After a pre-copy stage was acknowledged (the request is still decoding)."""

    async def before_commit(self, request_id: str, attempt: int) -> None:
        """After the last stage was copied, before Commit is sent (the request is suspended)."""


def reservation_id(request_id: str, attempt: int) -> str:
    """The destination's reservation id of ``(request_id, attempt)``."""
    return f"{request_id}@{attempt}"


# ---- the destination's side of the protocol (Reserve, WriteBlocks, Commit, Release) ---------------------
class DestStatus(enum.Enum):
    """A destination's answer (``hilum.v1.DestStatus``)."""

    OK = "ok"
    STALE = "stale"  # the message is of an attempt older than the newest seen for the request: nothing changed
    REFUSED = "refused"  # not now (already here, no such reservation, bad request)
    NO_ROOM = "no_room"  # the blocks asked for do not fit
    FAILED = "failed"  # the operation broke (bad state, write error); the reservation is unchanged


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """A request's prompt as a destination's prefix cache looks it up (first Reserve of a migration): by
    content (``token_ids``: vLLM) or by hash ids (``block_hashes``, chained per ``hash_block_tokens`` tokens,
    ``llumlet.engine.prefix_hash``: the sim engine). Any part may be empty (then it matches nothing)."""

    token_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()
    hash_block_tokens: int = 0  # tokens one of block_hashes covers (0 = none)

    def prompt_blocks(self, kv_tokens: int, block_size_tokens: int) -> int:
        """Leading KV blocks of a request holding ``kv_tokens`` that hold known prompt tokens only: what a
        destination could re-prefill (``topology.cost.MigrationCostInput.prefix_blocks``). The tokens its prefix
        hash ids cover when it has them — the prefix the simulator's executor and the coordinator's judge price
        (one rule for the three) — else the prompt's tokens when ``token_ids`` are known; 0 when neither is."""
        if self.block_hashes and self.hash_block_tokens:
            return prefix_kv_blocks(len(self.block_hashes), self.hash_block_tokens, kv_tokens, block_size_tokens)
        return min(len(self.token_ids), kv_tokens) // block_size_tokens


#: The prefix of a request whose prompt is not known here (matches nothing).
NO_PREFIX = PromptPrefix()


@dataclass(frozen=True, slots=True)
class Reserved:
    """Answer to Reserve: the reservation ``reservation_id`` holds ``num_blocks`` when ``status`` is OK."""

    status: DestStatus
    reason: str = ""
    reservation_id: str = ""
    num_blocks: int = 0
    num_cached_blocks: int = 0  # leading positions the destination already caches: not to be sent
    pool_opened: bool = False  # the destination opened the source's KV pool (local transport: peer copies)
    # the destination's estimate of re-prefilling the prefix blocks it does not cache (Engine.prefill_time_s),
    # seconds; None: it offers none (or was not asked: no prefix_blocks in the first Reserve)
    prefix_reprefill_s: float | None = None


@dataclass(frozen=True, slots=True)
class Written:
    """Answer to a WriteBlocks stream: what was stored before it ended (or failed)."""

    status: DestStatus
    reason: str = ""
    blocks: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class CommitCall:
    """Commit: adopt ``state`` (the suspended request) from the reservation of ``(request_id, attempt)``."""

    request_id: str
    attempt: int
    state: MigrationState
    origin: str  # TokenSink address its tokens go to
    next_seq: int  # seq of its next token
    epoch: int  # owner epoch the destination takes (the source's + 1)
    src_instance_id: str = ""


@dataclass(frozen=True, slots=True)
class DestReply:
    """Answer to Commit."""

    status: DestStatus
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Released:
    """Answer to Release: ``committed`` when that attempt committed here (nothing was released then)."""

    status: DestStatus
    committed: bool = False
    released_blocks: int = 0
