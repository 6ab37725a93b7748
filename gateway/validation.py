"""Validation of OpenAI-style request bodies, before anything is dispatched.

:func:`parse_completion` (``/v1/completions``) and :func:`parse_chat` (``/v1/chat/completions``) turn a
decoded JSON body into a :class:`GenerationRequest` or raise :class:`BadRequest` (HTTP 400) naming the
field and what was wrong. The limits come from the topology (:func:`model_limits`): the model names
served, each model's context (``max_context_tokens``), KV block size and the largest KV cache of one
instance serving it (``kv_capacity_blocks``), so a request that no instance can ever hold is refused here.

Checks, in order: body is a JSON object; ``model`` is served; unsupported options (``n`` != 1,
``best_of``, ``logprobs``, ``echo``, ``stop`` strings, ``suffix``); the prompt (non-empty text, or token
ids inside the vocabulary; chat: a non-empty ``messages`` list with text); ``max_tokens`` (an integer,
>= 1, not above the model's context); prompt + ``max_tokens`` within the context; the prompt, then prompt +
output, within the largest instance's KV cache (the engine's rule: prompt + max_tokens - 1 KV tokens);
sampling fields (``temperature`` in [0, 2], ``top_p`` in (0, 1], ``seed`` an integer, ``ignore_eos`` and
``stream`` booleans, ``stop_token_ids`` ids in the vocabulary); ``priority``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.tokenizer import ByteTokenizer
from topology.spec import Topology

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_PRIORITY",
    "PRIORITY_HEADER",
    "PRIORITY_NAMES",
    "BadRequest",
    "GenerationRequest",
    "ModelLimits",
    "chat_prompt",
    "model_limits",
    "parse_chat",
    "parse_completion",
    "parse_priority",
]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses the same when none is given
MAX_PRIORITY = 9  # priority classes 0..9 (policy.PolicyConfig.priority_headroom_blocks keys them)
PRIORITY_HEADER = "X-Hilum-Priority"
PRIORITY_NAMES: Mapping[str, int] = {"normal": 0, "low": 0, "high": 1}

_UNSUPPORTED = ("best_of", "logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools", "functions")


class BadRequest(ValueError):
    """A request the gateway refuses before dispatch (HTTP 400).

    ``param`` names the offending field (None for the body as a whole); ``code`` is a short machine
    tag (``invalid_json``, ``model_not_found``, ``context_length_exceeded``, ``too_large``, ``invalid_value``,
    ``unsupported``).
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the topology says about one served model."""

    name: str
    max_context_tokens: int  # prompt + output, tokens
    block_size_tokens: int  # tokens per KV cache block
    max_instance_capacity_blocks: int  # the largest KV cache of one instance serving the model, blocks
    num_instances: int  # instances serving the model

    @property
    def max_request_kv_tokens(self) -> int:
        """KV tokens one request can hold at most (the largest instance's whole cache)."""
        return self.max_instance_capacity_blocks * self.block_size_tokens


def model_limits(topology: Topology) -> dict[str, ModelLimits]:
    """The served models of ``topology`` (those with at least one instance), by name."""
    out: dict[str, ModelLimits] = {}
    for inst in topology.instances:
        spec = topology.models[inst.model]
        prev = out.get(inst.model)
        out[inst.model] = ModelLimits(
            name=inst.model,
            max_context_tokens=spec.max_context_tokens,
            block_size_tokens=spec.block_size_tokens,
            max_instance_capacity_blocks=max(inst.kv_capacity_blocks, prev.max_instance_capacity_blocks if prev else 0),
            num_instances=(prev.num_instances if prev else 0) + 1,
        )
    return out


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request, ready to dispatch."""

    kind: Literal["completion", "chat"]
    model: str
    prompt_token_ids: tuple[int, ...]  # the tokenized prompt (chat: the rendered template)
    max_tokens: int  # output tokens at most, >= 1
    temperature: float  # 0 = greedy
    top_p: float  # (0, 1]
    seed: int | None  # per-request sampling seed
    ignore_eos: bool  # keep generating past EOS (benchmarks)
    stop_token_ids: tuple[int, ...]
    priority: int  # 0 normal .. MAX_PRIORITY
    stream: bool  # server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with token counts
    return_token_ids: bool  # add "token_ids" to each choice (vLLM's extension)
    block_size_tokens: int  # of the model, for the dispatch demand

    @property
    def prompt_tokens(self) -> int:
        """Prompt length, tokens."""
        return len(self.prompt_token_ids)

    @property
    def demand_blocks(self) -> int:
        """KV blocks the request needs to start: ceil((prompt + 1) / block size) (rack_sched's count)."""
        return -(-(self.prompt_tokens + 1) // self.block_size_tokens)

    @property
    def need_blocks(self) -> int:
        """KV blocks it may grow to: ceil((prompt + max_tokens - 1) / block size) (what an engine admits)."""
        return -(-(self.prompt_tokens + self.max_tokens - 1) // self.block_size_tokens)


def _require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: Mapping[str, Any], name: str, value: Any) -> int:
    if not _is_int(value):
        raise BadRequest(f"{name} must be an integer, got {value!r}", param=name)
    return int(value)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a number, got {value!r}", param=name)
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise BadRequest(f"{name} must be in {interval}, got {value!r}", param=name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _model(body: Mapping[str, Any], limits: Mapping[str, ModelLimits]) -> ModelLimits:
    name = body.get("model")
    if name is None:
        raise BadRequest(f"model is required; served: {', '.join(sorted(limits))}", param="model")
    if not isinstance(name, str) or name not in limits:
        served = ", ".join(sorted(limits)) or "none"
        raise BadRequest(f"model {name!r} is not served here; served: {served}", param="model", code="model_not_found")
    return limits[name]


def _check_unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest(f"n must be 1 (one choice per request), got {n!r}", param="n", code="unsupported")
    for name in _UNSUPPORTED:
        value = body.get(name)
        harmless = value is None or value is False or value == {} or value == [] or (name == "best_of" and value == 1)
        if not harmless:
            raise BadRequest(f"{name} is not supported by this gateway", param=name, code="unsupported")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise BadRequest("stop strings are not supported; use stop_token_ids", param="stop", code="unsupported")


def _token_ids(name: str, value: Sequence[Any], vocab_size: int) -> tuple[int, ...]:
    for i, t in enumerate(value):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise BadRequest(f"{name}[{i}] = {t!r} is not a token id in [0, {vocab_size})", param=name)
    return tuple(int(t) for t in value)


def _completion_prompt(body: Mapping[str, Any], tokenizer: ByteTokenizer) -> tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise BadRequest("prompt is required", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt is empty", param="prompt")
        if any(isinstance(p, str | list) for p in prompt):
            raise BadRequest("batched prompts are not supported: send one prompt per request", param="prompt")
        return _token_ids("prompt", prompt, tokenizer.vocab_size)
    raise BadRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt")


def chat_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The stand-in chat template: ``"<role>: <content>\\n"`` per message, then ``"assistant: "``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise BadRequest(f"{where} must be an object with role and content", param=where)
        role = msg.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise BadRequest(f"{where}.role must be system, developer, user or assistant, got {role!r}", param=where)
        content = msg.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"{where}.content[{j}] must be a text part", param=where, code="unsupported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string, got {type(content).__name__}", param=where)
        out.append({"role": str(role), "content": content})
    if not any(m["content"] for m in out):
        raise BadRequest("prompt is empty: every message's content is empty", param="messages")
    return out


def parse_priority(value: Any, where: str) -> int:
    """A priority class from a body field or header value: an integer 0..MAX_PRIORITY or a name.

    Raises BadRequest naming ``where``.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in PRIORITY_NAMES:
            return PRIORITY_NAMES[text]
        if text.lstrip("-").isdigit():
            value = int(text)
    if not _is_int(value) or not 0 <= value <= MAX_PRIORITY:
        names = ", ".join(PRIORITY_NAMES)
        raise BadRequest(f"{where} must be an integer 0..{MAX_PRIORITY} or one of {names}, got {value!r}", param=where)
    return int(value)


def _priority(body: Mapping[str, Any], header: str | None) -> int:
    if body.get("priority") is not None:
        return parse_priority(body["priority"], "priority")
    if header is not None:
        return parse_priority(header, PRIORITY_HEADER)
    return 0


def _max_tokens(body: Mapping[str, Any], names: Sequence[str], limits: ModelLimits, prompt_tokens: int) -> int:
    name, value = next(((n, body[n]) for n in names if body.get(n) is not None), (names[0], None))
    ctx = limits.max_context_tokens
    if value is None:
        value = min(DEFAULT_MAX_TOKENS, max(1, ctx - prompt_tokens))
    value = _int_field(body, name, value)
    if value < 1:
        raise BadRequest(f"{name} must be >= 1, got {value}", param=name)
    if value > ctx:
        raise BadRequest(
            f"{name} = {value} is larger than the whole context of {limits.name} ({ctx} tokens)",
            param=name,
            code="context_length_exceeded",
        )
    return value


def _limits_check(limits: ModelLimits, prompt_tokens: int, max_tokens: int, max_name: str) -> None:
    ctx = limits.max_context_tokens
    if prompt_tokens + max_tokens > ctx:
        raise BadRequest(
            f"prompt ({prompt_tokens} tokens) + {max_name} ({max_tokens}) = {prompt_tokens + max_tokens} tokens "
            f"exceeds the context of {limits.name} ({ctx} tokens)",
            param=max_name,
            code="context_length_exceeded",
        )
    cap = limits.max_request_kv_tokens
    where = f"{limits.max_instance_capacity_blocks} blocks x {limits.block_size_tokens} tokens"
    if prompt_tokens > cap:
        raise BadRequest(
            f"prompt of {prompt_tokens} tokens is larger than any instance of {limits.name} can ever hold "
            f"(the largest KV cache holds {cap} tokens: {where})",
            param="prompt",
            code="too_large",
        )
    need = prompt_tokens + max_tokens - 1
    if need > cap:
        raise BadRequest(
            f"prompt ({prompt_tokens} tokens) + {max_name} ({max_tokens}) needs {need} KV tokens, more than any "
            f"instance of {limits.name} can ever hold ({cap} tokens: {where})",
            param=max_name,
            code="too_large",
        )


def _finish(
    kind: Literal["completion", "chat"],
    body: Mapping[str, Any],
    limits: ModelLimits,
    prompt: tuple[int, ...],
    max_names: Sequence[str],
    tokenizer: ByteTokenizer,
    priority_header: str | None,
) -> GenerationRequest:
    max_tokens = _max_tokens(body, max_names, limits, len(prompt))
    used = next((n for n in max_names if body.get(n) is not None), max_names[0])
    _limits_check(limits, len(prompt), max_tokens, used)
    seed = body.get("seed")
    if seed is not None:
        seed = _int_field(body, "seed", seed)
        if not -(2**63) <= seed < 2**63:
            raise BadRequest(f"seed must fit in a signed 64-bit integer, got {seed}", param="seed")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise BadRequest("stop_token_ids must be a list of token ids", param="stop_token_ids")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, Mapping):
        raise BadRequest("stream_options must be an object", param="stream_options")
    stream = _bool(body, "stream")
    return GenerationRequest(
        kind=kind,
        model=limits.name,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0, lo_open=False),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        ignore_eos=_bool(body, "ignore_eos"),
        stop_token_ids=_token_ids("stop_token_ids", stop_ids, tokenizer.vocab_size),
        priority=_priority(body, priority_header),
        stream=stream,
        include_usage=stream and _bool(stream_options, "include_usage"),
        return_token_ids=_bool(body, "return_token_ids"),
        block_size_tokens=limits.block_size_tokens,
    )


def parse_completion(
    body: Any, limits: Mapping[str, ModelLimits], tokenizer: ByteTokenizer, *, priority_header: str | None = None
) -> GenerationRequest:
    """Validate a ``/v1/completions`` body. Raises :class:`BadRequest` (see the module docstring)."""
    obj = _require_object(body)
    model = _model(obj, limits)
    _check_unsupported(obj)
    prompt = _completion_prompt(obj, tokenizer)
    return _finish("completion", obj, model, prompt, ("max_tokens",), tokenizer, priority_header)


def parse_chat(
    body: Any, limits: Mapping[str, ModelLimits], tokenizer: ByteTokenizer, *, priority_header: str | None = None
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body (prompt = :func:`chat_prompt`). Raises :class:`BadRequest`."""
    obj = _require_object(body)
    model = _model(obj, limits)
    _check_unsupported(obj)
    prompt = tokenizer.encode(chat_prompt(_chat_messages(obj)))
    names = ("max_completion_tokens", "max_tokens")
    return _finish("chat", obj, model, prompt, names, tokenizer, priority_header)
