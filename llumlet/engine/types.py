"""Value types crossing the engine boundary: requests in, step results and load out.

Plain frozen dataclasses, units in names or comments; conversion to ``policy.types.InstanceLoad`` is the
only link to the policy layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policy.types import InstanceLoad  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "EngineLoad",
    "EngineRequest",
    "MigrationState",
    "RunningRequestLoad",
    "SamplingParams",
    "StepResult",
]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings carried with a request (used by real engines; the model engine ignores all but
    ``max_tokens``)."""

    max_tokens: int = 16  # output tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # per-request sampling seed
    ignore_eos: bool = False  # keep generating past EOS until max_tokens
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the request

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens = {self.max_tokens}: need >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature = {self.temperature}: need >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p = {self.top_p}: need 0 < top_p <= 1")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request submitted to an engine.

    Raises ValueError (naming the request and field) on non-positive token counts or inconsistent prefix
    hashes.
    """

    request_id: str
    prompt_tokens: int  # prompt length in tokens, >= 1
    max_tokens: int  # output tokens to generate (the model engine generates exactly this many), >= 1
    priority: int = 0  # 0 = normal; higher = more important
    arrival_s: float = 0.0  # arrival time (caller's clock); orders FCFS and preemption victims
    prefix_block_hashes: tuple[int, ...] = ()  # one id per hash block of the prompt (Mooncake: 512 tokens)
    prefix_hash_block_tokens: int = 0  # tokens per hash block; 0 = no prefix information
    prompt_token_ids: tuple[int, ...] | None = None  # real engines only; len == prompt_tokens
    sampling_params: SamplingParams | None = None  # real engines only

    def __post_init__(self) -> None:
        where = f"EngineRequest {self.request_id!r}"
        if self.prompt_tokens < 1:
            raise ValueError(f"{where}: prompt_tokens = {self.prompt_tokens}, need >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"{where}: max_tokens = {self.max_tokens}, need >= 1")
        if self.prefix_block_hashes and self.prefix_hash_block_tokens < 1:
            raise ValueError(f"{where}: prefix_block_hashes given but prefix_hash_block_tokens < 1")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_tokens:
            raise ValueError(
                f"{where}: len(prompt_token_ids) = {len(self.prompt_token_ids)} != prompt_tokens = {self.prompt_tokens}"
            )


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step did. ``duration_s`` comes from the latency model (0.0 if nothing ran)."""

    duration_s: float  # modelled wall time of the step
    new_tokens: dict[str, int]  # request_id -> output tokens produced this step (0 or 1)
    finished: tuple[str, ...]  # requests that produced their last token; their blocks are freed
    preempted: tuple[str, ...]  # requests preempted by recompute this step (blocks freed, re-queued)
    num_prefill_tokens: int  # prefill (and recompute) tokens computed this step
    num_decode_tokens: int  # decode tokens computed this step (one per decoding request)
    num_scheduled_seqs: int = 0  # requests in the batch
    num_recompute_tokens: int = 0  # of num_prefill_tokens, tokens recomputed after a preemption
    num_prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache at admission this step
    token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)  # real engines: request_id -> new ids
    finish_reasons: dict[str, str] = field(default_factory=dict)  # request_id -> "length" | "stop"

    @property
    def is_idle(self) -> bool:
        """True when nothing was scheduled (the caller should wait for an event, not step again)."""
        return self.num_scheduled_seqs == 0


@dataclass(frozen=True, slots=True)
class RunningRequestLoad:
    """One running request as the load report sees it."""

    request_id: str
    blocks: int  # KV cache blocks it holds (shared prefix blocks included)
    priority: int
    num_tokens: int  # prompt + output tokens so far
    in_decode: bool  # prefill finished (only these are migratable)
    output_tokens: int = 0  # output tokens so far
    max_tokens: int = 0  # its output limit (0 = not known)
    max_blocks: int = 0  # KV blocks it may grow to: prompt + max_tokens - 1 tokens (0 = not known)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Block usage and queue state of one engine; convertible to ``policy.types.InstanceLoad``."""

    total_blocks: int  # KV cache capacity
    used_blocks: int  # held by requests (running, suspended, referenced prefix blocks)
    reserved_blocks: int  # held for incoming migrations
    cached_blocks: int  # unreferenced prefix-cache blocks (evictable, counted as free for admission)
    running: tuple[RunningRequestLoad, ...] = ()  # running requests, arrival order
    num_waiting: int = 0  # queued requests (new and preempted)
    head_demand_blocks: int = 0  # blocks the head-of-queue request needs for its prompt + output so far
    queued_demand_blocks: int = 0  # blocks every queued request needs (head included)
    preempting: bool = False  # a preemption happened in the last step or a preempted request still waits
    num_suspended: int = 0  # requests suspended for migration (their blocks are in used_blocks)

    @property
    def free_blocks(self) -> int:
        """Blocks neither used, reserved nor cached."""
        return self.total_blocks - self.used_blocks - self.reserved_blocks - self.cached_blocks

    def to_instance_load(
        self,
        instance_id: str,
        domain_id: str,
        draining: bool = False,
        warming_up: bool = False,
        decode_step_s: float = 0.0,
    ) -> InstanceLoad:
        """Convert for the policy layer.

        ``used_blocks`` of the result counts reservations too (they hold capacity); evictable cached prefix
        blocks count as free. Suspended requests are not in ``running`` (they are leaving). ``decode_step_s``:
        the engine's most recent step time, measured by whoever steps it (the llumlet, the simulator).
        """
        from policy.types import InstanceLoad, RequestLoad

        return InstanceLoad(
            instance_id=instance_id,
            capacity_blocks=self.total_blocks,
            used_blocks=self.used_blocks + self.reserved_blocks,
            running=tuple(
                RequestLoad(
                    request_id=r.request_id,
                    blocks=r.blocks,
                    priority=r.priority,
                    num_tokens=r.num_tokens,
                    migratable=r.in_decode,
                    output_tokens=r.output_tokens,
                    max_tokens=r.max_tokens,
                    max_blocks=r.max_blocks,
                )
                for r in self.running
            ),
            num_waiting=self.num_waiting,
            head_demand_blocks=self.head_demand_blocks,
            queued_demand_blocks=self.queued_demand_blocks,
            preempting=self.preempting,
            draining=draining,
            warming_up=warming_up,
            domain_id=domain_id,
            decode_step_s=decode_step_s,
        )


@dataclass(frozen=True, slots=True)
class MigrationState:
    """A suspended request's state, enough for another engine to continue it (``commit_incoming``)."""

    request_id: str
    prompt_tokens: int
    num_output_tokens: int  # output tokens produced so far
    num_computed_tokens: int  # tokens whose KV is in the cache (prompt + output - 1 in decode)
    max_tokens: int  # the request's original output budget
    priority: int
    arrival_s: float
    prefix_block_hashes: tuple[int, ...] = ()
    prefix_hash_block_tokens: int = 0
    num_preemptions: int = 0
    prompt_token_ids: tuple[int, ...] | None = None
    output_token_ids: tuple[int, ...] = ()  # real engines only
    sampling_params: SamplingParams | None = None
    extra: dict[str, object] = field(default_factory=dict)  # backend-specific (e.g. RNG state)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return self.prompt_tokens + self.num_output_tokens

    @property
    def remaining_tokens(self) -> int:
        """Output tokens still to generate."""
        return self.max_tokens - self.num_output_tokens
