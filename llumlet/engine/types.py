"""Value types crossing the engine boundary: requests in, step results and load out.

Plain frozen dataclasses, units in names or comments; conversion to ``policy.load.InstanceLoad`` is the
only link to the policy layer.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from policy.load import InstanceLoad, RequestLoad

__all__ = [
    "GUIDED_KINDS",
    "MAX_TOP_LOGPROBS",
    "PREFILL_RATE_TOKENS",
    "EngineLoad",
    "EngineRequest",
    "GuidedDecoding",
    "MigrationState",
    "RunningRequestLoad",
    "RunningRow",
    "SamplingFeature",
    "SamplingParams",
    "StepResult",
    "TokenLogprobs",
    "instance_load_of",
    "prefill_s_per_token_of",
]


class SamplingFeature(enum.StrEnum):
    """Optional sampling settings an engine may or may not honour (``llumlet.backends.Backend.sampling_features``).

    A request that sets one (a value other than its "off" default, :meth:`SamplingParams.features`) is
    refused by an engine that does not advertise it, by name: never run with the setting dropped. The
    settings every engine takes (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``ignore_eos``) are
    not features.
    """

    STOP_TOKEN_IDS = "stop_token_ids"  # end on one of these ids (an engine with placeholder ids cannot)

    PENALTIES = "penalties"  # repetition_penalty, frequency_penalty, presence_penalty
    TOP_K = "top_k"
    MIN_TOKENS = "min_tokens"
    LOGPROBS = "logprobs"  # per-token log probabilities (and top alternatives) returned with the tokens
    GUIDED_DECODING = "guided_decoding"  # structured output: JSON schema / object, regex, choice, grammar


#: ``GuidedDecoding.kind`` values and what ``spec`` holds for each.
GUIDED_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "json_schema": "a JSON schema, as JSON text",
        "json_object": "empty: any JSON object",
        "regex": "a regular expression",
        "choice": "a JSON list of the allowed strings",
        "grammar": "an EBNF / Lark grammar",
    }
)

#: Most top alternatives a request may ask for per token (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """A structured-output constraint on the whole output (vLLM's ``StructuredOutputsParams``, by kind).

    Raises ValueError on an unknown ``kind`` or a ``spec`` missing where the kind needs one.
    """

    kind: str  # one of GUIDED_KINDS
    spec: str = ""  # what GUIDED_KINDS says for the kind

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"GuidedDecoding.kind = {self.kind!r}: need one of {', '.join(GUIDED_KINDS)}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"GuidedDecoding({self.kind!r}): spec is empty, need {GUIDED_KINDS[self.kind]}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings carried with a request, through the wire (``hilum.v1.Sampling``) and migrations.

    The meanings are vLLM's (``vllm.SamplingParams``), which follow OpenAI's for the fields OpenAI has. The
    model engine (``sim``) has no token distribution: it ignores everything but ``max_tokens`` (docs/gateway.md
    says per field what each engine does). Raises ValueError naming the field on a value out of range.
    """

    max_tokens: int = 16  # output tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # per-request sampling seed
    ignore_eos: bool = False  # keep generating past EOS until max_tokens
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the request
    top_k: int = 0  # sample among the k most probable tokens only; 0 = all
    min_tokens: int = 0  # output tokens before EOS or a stop token may end the request
    repetition_penalty: float = 1.0  # > 0; logits of tokens in prompt or output: / p if > 0, else x p (1 = off)
    frequency_penalty: float = 0.0  # [-2, 2]; minus this x (times the token occurs in the output so far)
    presence_penalty: float = 0.0  # [-2, 2]; minus this once if the token occurs in the output so far
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's log probability and the k best
    guided: GuidedDecoding | None = None  # structured output; None = free text

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens = {self.max_tokens}: need >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature = {self.temperature}: need >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p = {self.top_p}: need 0 < top_p <= 1")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k = {self.top_k}: need >= 0 (0 = all tokens)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens = {self.min_tokens}: need 0 <= min_tokens <= max_tokens")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"SamplingParams.repetition_penalty = {self.repetition_penalty}: need > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"SamplingParams.{name} = {value}: need -2 <= {name} <= 2")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs = {self.logprobs}: need 0..{MAX_TOP_LOGPROBS} or None")

    def features(self) -> frozenset[SamplingFeature]:
        """The optional features these settings use (values other than their "off" defaults)."""
        used: set[SamplingFeature] = set()
        if self.stop_token_ids:
            used.add(SamplingFeature.STOP_TOKEN_IDS)
        if self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0:
            used.add(SamplingFeature.PENALTIES)
        if self.top_k:
            used.add(SamplingFeature.TOP_K)
        if self.min_tokens:
            used.add(SamplingFeature.MIN_TOKENS)
        if self.logprobs is not None:
            used.add(SamplingFeature.LOGPROBS)
        if self.guided is not None:
            used.add(SamplingFeature.GUIDED_DECODING)
        return frozenset(used)


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
class TokenLogprobs:
    """Log probabilities at one output position (``SamplingParams.logprobs`` set).

    Natural logarithms of the model's distribution before any sampling setting is applied (temperature,
    penalties, top-k/top-p: vLLM's default ``logprobs_mode="raw_logprobs"``), so they describe the model,
    not the sampler.
    """

    logprob: float  # of the token that was produced
    top: tuple[tuple[int, float], ...] = ()  # the k most probable (token id, logprob), most probable first


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
    logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)  # aligned with token_ids

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
    unmigratable_reason: str = ""  # why the engine cannot move it faithfully even in decode; "" = it can
    prefix_hashes: tuple[int, ...] = ()  # hash ids of its prompt's prefix blocks (EngineRequest.prefix_block_hashes)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Block usage and queue state of one engine; convertible to ``policy.load.InstanceLoad``."""

    total_blocks: int  # KV cache capacity
    used_blocks: int  # held by requests (running, suspended, referenced prefix blocks)
    reserved_blocks: int  # held for incoming migrations
    cached_blocks: int  # unreferenced prefix-cache blocks (evictable, counted as free for admission)
    running: tuple[RunningRequestLoad, ...] = ()  # running requests, the engine's order (rank: class, then arrival)
    num_waiting: int = 0  # queued requests (new and preempted)
    head_demand_blocks: int = 0  # blocks the head-of-queue request needs for its prompt + output so far
    queued_demand_blocks: int = 0  # blocks every queued request needs (head included)
    preempting: bool = False  # a preemption happened in the last step or a preempted request still waits
    num_suspended: int = 0  # requests suspended for migration (their blocks are in used_blocks)
    max_num_seqs: int = 0  # batch slots: requests per step at most (0 = not known)
    prefix_hashes: frozenset[int] = frozenset()  # hash ids of its prefix-cache entries (used or evictable)
    prefix_block_tokens: int = 0  # tokens per hash block of those (0 = no prefix cache, or nothing cached yet)
    prefix_hit_tokens: int = 0  # prompt tokens served from its prefix cache since the engine started
    prefix_query_tokens: int = 0  # prompt tokens looked up in it since then (hit rate = hits / queries)
    prefill_s_per_token: float = 0.0  # its prefill estimate per prompt token, seconds (prefill_s_per_token_of)

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
        """Convert for the policy layer (:func:`instance_load_of` says how). ``decode_step_s``: the engine's
        most recent step time, measured by whoever steps it (the llumlet, the simulator)."""
        return instance_load_of(
            instance_id,
            domain_id,
            draining,
            warming_up,
            decode_step_s,
            total_blocks=self.total_blocks,
            used_blocks=self.used_blocks,
            reserved_blocks=self.reserved_blocks,
            running=[_row_of(r) for r in self.running],
            num_waiting=self.num_waiting,
            head_demand_blocks=self.head_demand_blocks,
            queued_demand_blocks=self.queued_demand_blocks,
            preempting=self.preempting,
            max_num_seqs=self.max_num_seqs,
            prefix_hashes=self.prefix_hashes,
            prefix_block_tokens=self.prefix_block_tokens,
            prefill_s_per_token=self.prefill_s_per_token,
        )


#: Prompt tokens an engine's per-token prefill estimate is taken over (a mid-size prompt): load reports carry
#: ``Engine.prefill_time_s(PREFILL_RATE_TOKENS, 0) / PREFILL_RATE_TOKENS``.
PREFILL_RATE_TOKENS = 1024


def prefill_s_per_token_of(prefill_time_s: float | None) -> float:
    """The per-token prefill estimate a load report carries, from ``Engine.prefill_time_s(PREFILL_RATE_TOKENS,
    0)``: that over :data:`PREFILL_RATE_TOKENS`, seconds per token; 0 when the engine offers none (None)."""
    return 0.0 if prefill_time_s is None else prefill_time_s / PREFILL_RATE_TOKENS


RunningRow = tuple[str, int, int, int, bool, int, int, int, str, tuple[int, ...]]
"""One running request as the load report sees it: the fields of :class:`RunningRequestLoad`, in its order
(``RunningRequestLoad(*row)`` is the request's entry; an engine builds rows where it would build many)."""

_row_of = operator.attrgetter(*(f.name for f in dataclasses.fields(RunningRequestLoad)))


def instance_load_of(
    instance_id: str,
    domain_id: str,
    draining: bool,
    warming_up: bool,
    decode_step_s: float,
    *,
    total_blocks: int,
    used_blocks: int,
    reserved_blocks: int,
    running: Iterable[RunningRow],
    num_waiting: int,
    head_demand_blocks: int,
    queued_demand_blocks: int,
    preempting: bool,
    max_num_seqs: int = 0,
    prefix_hashes: frozenset[int] = frozenset(),
    prefix_block_tokens: int = 0,
    prefill_s_per_token: float = 0.0,
) -> InstanceLoad:
    """An engine's load as the policy layer's ``InstanceLoad`` (the fields as in :class:`EngineLoad`).

    ``used_blocks`` of the result counts reservations too (they hold capacity); evictable cached prefix
    blocks count as free; suspended requests are not running (they are leaving); a request is migratable
    once in decode unless the engine names a reason it cannot move. Checked as every ``InstanceLoad`` is (an
    engine's counts are consistent by construction; a check that fails here is a bug in the engine).
    """
    requests = tuple(
        [
            RequestLoad(rid, blocks, prio, tokens, in_decode and not why, out, max_tokens, max_blocks, hashes)
            for rid, blocks, prio, tokens, in_decode, out, max_tokens, max_blocks, why, hashes in running
        ]
    )
    return InstanceLoad(
        instance_id=instance_id,
        capacity_blocks=total_blocks,
        used_blocks=used_blocks + reserved_blocks,
        running=requests,
        num_waiting=num_waiting,
        head_demand_blocks=head_demand_blocks,
        queued_demand_blocks=queued_demand_blocks,
        preempting=preempting,
        draining=draining,
        warming_up=warming_up,
        domain_id=domain_id,
        decode_step_s=decode_step_s,
        max_num_seqs=max_num_seqs,
        prefix_hashes=prefix_hashes,
        prefix_block_tokens=prefix_block_tokens if prefix_hashes else 0,
        prefill_s_per_token=prefill_s_per_token,
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
