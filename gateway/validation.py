"""Validation of OpenAI-style request bodies, before anything is dispatched.

:func:`parse_completion` (``/v1/completions``) and :func:`parse_chat` (``/v1/chat/completions``) turn a
decoded JSON body into a :class:`GenerationRequest` or raise :class:`BadRequest` (HTTP 400) naming the
field and what was wrong. Every field of the two endpoints is either honoured or refused, never accepted
and ignored (the table of every field and what each engine does with it is in docs/gateway.md):

- **honoured** (:data:`COMPLETION_FIELDS`, :data:`CHAT_FIELDS`): parsed and range-checked here, then carried
  to the engine in ``SamplingParams`` (penalties, ``top_k``, ``min_tokens``, ``seed``, ``logprobs``, guided
  decoding ...) or applied by the gateway itself (``n``, ``stop`` strings, ``stream``, ``echo`` of nothing);
- **refused unless off** (:data:`_OFF`): known OpenAI / vLLM fields hilum does not implement (``suffix``,
  ``echo``, ``logit_bias``, tools, audio, ...) are a 400 naming them unless they hold their "off" value
  (``null``, ``false``, ``{}``, ...);
- **unknown** fields are a 400 (``Unrecognized request argument supplied: <name>``, as OpenAI answers).

An optional sampling feature (``llumlet.engine.types.SamplingFeature``: penalties, top-k, min_tokens,
logprobs, guided decoding, stop token ids) is also a 400 when the instances serving the model do not
advertise it (``ModelLimits.sampling_features``, from their etcd registrations), naming the field.

The limits come from the topology (:func:`model_limits`): the model names served, each model's context
(``max_context_tokens``), KV block size and the largest KV cache of one instance serving it
(``kv_capacity_blocks``), so a request that no instance can ever hold is refused here. Token ids are checked
against the model's tokenizer (``gateway.tokenizer``), which also renders chat messages.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from gateway.tokenizer import ChatTemplateError, Tokenizer
from llumlet.engine.types import MAX_TOP_LOGPROBS, GuidedDecoding, SamplingFeature, SamplingParams
from policy.dispatch import request_kv_blocks
from topology.spec import Topology

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "DEFAULT_MAX_TOKENS",
    "MAX_N",
    "MAX_PRIORITY",
    "PRIORITY_HEADER",
    "PRIORITY_NAMES",
    "BadRequest",
    "GenerationRequest",
    "ModelLimits",
    "ModelNotFound",
    "PriorityGrant",
    "PriorityNotAllowed",
    "model_limits",
    "parse_chat",
    "parse_completion",
    "parse_priority",
]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: up to the context, see _max_tokens)
MAX_PRIORITY = 9  # priority classes 0..9 (policy.PolicyConfig.priority_headroom_blocks keys them)
MAX_N = 128  # choices per request at most (OpenAI's limit)
PRIORITY_HEADER = "X-Hilum-Priority"
PRIORITY_NAMES: Mapping[str, int] = {"normal": 0, "low": 0, "high": 1}

# Fields honoured (parsed below), per endpoint; OpenAI's, then vLLM's extensions, then hilum's.
_SAMPLING_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "user",
    "top_k", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
    "return_token_ids", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format",
    "priority",
)  # fmt: skip
COMPLETION_FIELDS: frozenset[str] = frozenset({*_SAMPLING_FIELDS, "prompt", "logprobs"})
CHAT_FIELDS: frozenset[str] = frozenset(
    {*_SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
     "safety_identifier"}
)  # fmt: skip


def _off(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _empty(v: Any) -> bool:
    return v in ({}, [], "", False)


# Known fields hilum does not implement, with the values that mean "off" (null is always off).
_OFF: Mapping[str, Callable[[Any], bool]] = {
    "suffix": _off(""),
    "echo": _off(False),
    "logit_bias": _empty,
    "min_p": _off(0, 0.0),
    "skip_special_tokens": _off(True),
    "spaces_between_special_tokens": _off(True),
    "tools": _empty,
    "functions": _empty,
    "tool_choice": _off("none"),
    "function_call": _off("none"),
    "parallel_tool_calls": lambda v: isinstance(v, bool),  # meaningless without tools, which are refused
    "audio": _empty,
    "modalities": _off(["text"]),
    "metadata": _empty,
    "store": _off(False),
    "service_tier": _off("auto", "default"),
    "prediction": _empty,
    "reasoning_effort": _empty,
    "web_search_options": _empty,
    "verbosity": _empty,
    "prompt_cache_key": _empty,
    "continue_final_message": _off(False),
    "chat_template": _empty,
    "chat_template_kwargs": _empty,
    "documents": _empty,
}
_COMPLETION_OFF = frozenset({"suffix", "echo", "logit_bias", "min_p", "skip_special_tokens",
                             "spaces_between_special_tokens"})  # fmt: skip
_GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class BadRequest(ValueError):
    """A request the gateway refuses before dispatch (HTTP 400).

    ``param`` names the offending field (None for the body as a whole); ``code`` is a short machine
    tag (``invalid_json``, ``model_not_found``, ``context_length_exceeded``, ``too_large``, ``invalid_value``,
    ``unsupported``, ``unrecognized_argument``).
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFound(BadRequest):
    """The body names a model this gateway does not serve (HTTP 404, OpenAI's ``model_not_found``)."""


class PriorityNotAllowed(BadRequest):
    """The request asks for a priority class above its API key's ``max_priority`` (HTTP 403)."""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the cluster says about one served model: the topology's limits, and the optional sampling
    features the instances serving it advertise (``None``: not known here, the llumlet decides)."""

    name: str
    max_context_tokens: int  # prompt + output, tokens
    block_size_tokens: int  # tokens per KV cache block
    max_instance_capacity_blocks: int  # the largest KV cache of one instance serving the model, blocks
    num_instances: int  # instances serving the model
    sampling_features: frozenset[str] | None = None  # honoured by every registered instance of the model

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
    """A validated request, ready to dispatch (``n`` engine requests, one per choice)."""

    kind: Literal["completion", "chat"]
    model: str
    prompt_token_ids: tuple[int, ...]  # the tokenized prompt (chat: the rendered template)
    sampling: SamplingParams  # what every choice's engine request carries (choice i: seed + i)
    priority: int  # 0 normal .. MAX_PRIORITY
    stream: bool  # server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with token counts
    return_token_ids: bool  # add "token_ids" to each choice (vLLM's extension)
    block_size_tokens: int  # of the model, for the dispatch demand
    n: int = 1  # choices
    stop: tuple[str, ...] = ()  # stop strings, matched by the gateway on the detokenized text
    include_stop_str_in_output: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Prompt length, tokens."""
        return len(self.prompt_token_ids)

    @property
    def demand_blocks(self) -> int:
        """KV blocks the request needs to start (``policy.dispatch.request_kv_blocks``, the domain schedulers' rule)."""
        return request_kv_blocks(self.prompt_tokens, self.max_tokens, self.block_size_tokens)[0]

    @property
    def need_blocks(self) -> int:
        """KV blocks it may grow to: ceil((prompt + max_tokens - 1) / block size) (``request_kv_blocks``)."""
        return request_kv_blocks(self.prompt_tokens, self.max_tokens, self.block_size_tokens)[1]

    @property
    def max_tokens(self) -> int:
        """Output tokens per choice at most (``sampling.max_tokens``)."""
        return self.sampling.max_tokens

    @property
    def temperature(self) -> float:
        """``sampling.temperature``."""
        return self.sampling.temperature

    @property
    def ignore_eos(self) -> bool:
        """``sampling.ignore_eos``."""
        return self.sampling.ignore_eos

    def choice_sampling(self, index: int) -> SamplingParams:
        """The sampling settings of choice ``index``: with a seed, seed + index (vLLM's parallel sampling), so
        the choices differ and each is reproducible."""
        if self.sampling.seed is None or index == 0:
            return self.sampling
        return replace(self.sampling, seed=self.sampling.seed + index)


# ---- field parsers --------------------------------------------------------------------------------------


def _json_text(value: Any) -> str:
    """``value``, parsed from JSON, as JSON writes it (``true``, ``null``, ``"abc"``, ``[1, 2]``: not Python's
    ``True``, ``None`` or ``'abc'``), cut to 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not from JSON (a caller's own value): Python's words
        text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


def _json_type(value: Any) -> str:
    """What ``value``, parsed from JSON, was in the request: ``null``, a boolean, a number, a string, an array or an
    object (errors name JSON's types, not Python's ``NoneType`` or ``list``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return (
        "an array" if isinstance(value, list) else "an object" if isinstance(value, Mapping) else type(value).__name__
    )


def _require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest(f"the request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise BadRequest(f"{name} must be an integer, got {_json_text(value)}", param=name)
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    return int(value)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        finite = "" if isinstance(value, bool) or not isinstance(value, int | float) else "finite "
        raise BadRequest(f"{name} must be a {finite}number, got {_json_text(value)}", param=name)
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise BadRequest(f"{name} must be in {interval}, got {_json_text(value)}", param=name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {_json_text(value)}", param=name)
    return value


def _model(body: Mapping[str, Any], limits: Mapping[str, ModelLimits]) -> ModelLimits:
    name = body.get("model")
    if name is None:
        raise BadRequest(f"model is required; served: {', '.join(sorted(limits))}", param="model")
    if not isinstance(name, str):  # a 400 for the type, not a 404 for a model named 5
        raise BadRequest(f"model must be a string (a model's name), got {_json_type(name)}", param="model")
    if name not in limits:
        served = ", ".join(sorted(limits)) or "none"
        raise ModelNotFound(
            f"the model {_json_text(name)} does not exist here; served: {served}", param="model", code="model_not_found"
        )
    return limits[name]


def _check_fields(body: Mapping[str, Any], honoured: frozenset[str], refusable: frozenset[str] | None) -> None:
    """Every field is honoured, or refusable and off; anything else is a 400 naming it."""
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        if name in _OFF and (refusable is None or name in refusable):
            if not _OFF[name](value):
                raise BadRequest(
                    f"{name} is not supported by hilum (got {_json_text(value)}); docs/gateway.md lists "
                    "every request field",
                    param=name,
                    code="unsupported",
                )
            continue
        raise BadRequest(f"Unrecognized request argument supplied: {name}", param=name, code="unrecognized_argument")


def _token_ids(name: str, value: Sequence[Any], vocab_size: int) -> tuple[int, ...]:
    for i, t in enumerate(value):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise BadRequest(f"{name}[{i}] = {_json_text(t)} is not a token id in [0, {vocab_size})", param=name)
    return tuple(int(t) for t in value)


def _completion_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise BadRequest("prompt is required", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty", param="prompt")
        return _encode(tokenizer.encode, prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt is empty", param="prompt")
        if any(isinstance(p, str | list) for p in prompt):
            raise BadRequest("batched prompts are not supported: send one prompt per request", param="prompt")
        return _token_ids("prompt", prompt, tokenizer.vocab_size)
    raise BadRequest(f"prompt must be a string or a list of token ids, got {_json_type(prompt)}", param="prompt")


def _encode(fn: Callable[[Any], tuple[int, ...]], arg: Any) -> tuple[int, ...]:
    try:
        return fn(arg)
    except UnicodeEncodeError as exc:  # e.g. a lone surrogate escape ("\ud800") in the prompt
        raise BadRequest(f"the text is not valid Unicode: {exc.reason} at position {exc.start}") from None


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
            got = "it is missing" if "role" not in msg else f"got {_json_text(role)}"
            raise BadRequest(f"{where}.role must be system, developer, user or assistant; {got}", param=where)
        extra = sorted(k for k, v in msg.items() if k not in ("role", "content", "name") and v not in (None, [], ""))
        if extra:
            raise BadRequest(f"{where}: {', '.join(extra)} is not supported by hilum", param=where, code="unsupported")
        content = msg.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for j, part in enumerate(content):
                at = f"{where}.content[{j}]"
                if not isinstance(part, Mapping):
                    raise BadRequest(f"{at} must be an object with type and text, got {_json_text(part)}", param=where)
                if "type" not in part:
                    raise BadRequest(f"{at}.type must be text; it is missing", param=where)
                if part["type"] != "text":  # an image, audio or file part: a model of text alone here
                    raise BadRequest(
                        f"{at}.type must be text (hilum serves text parts only); got {_json_text(part['type'])}",
                        param=where,
                        code="unsupported",
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    got = "it is missing" if "text" not in part else f"got {_json_text(text)}"
                    raise BadRequest(f"{at}.text must be a string; {got}", param=where)
                parts.append(text)
            content = "".join(parts)
        if content is None:
            raise BadRequest(f"{where}.content is missing (a string, or a list of text parts)", param=where)
        if not isinstance(content, str):
            raise BadRequest(
                f"{where}.content must be a string or a list of text parts, got {_json_type(content)}", param=where
            )
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"{where}.name must be a string, got {_json_text(name)}", param=where)
        out.append({"role": str(role), "content": content, **({"name": name} if name else {})})
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
        got = _json_text(value)
        raise BadRequest(f"{where} must be an integer 0..{MAX_PRIORITY} or one of {names}, got {got}", param=where)
    return int(value)


@dataclass(frozen=True, slots=True)
class PriorityGrant:
    """The priority classes a caller may use: ``default`` when a request names none, ``ceiling`` the highest
    it may ask for (``gateway.apikeys``; without keys: 0 and :data:`MAX_PRIORITY`)."""

    default: int = 0
    ceiling: int = MAX_PRIORITY
    caller: str = ""  # the API key's name, for the refusal ("" = no keys)


def _priority(body: Mapping[str, Any], header: str | None, grant: PriorityGrant) -> int:
    if body.get("priority") is not None:
        raw, where = body["priority"], "priority"
    elif header is not None:
        raw, where = header, PRIORITY_HEADER
    else:
        return grant.default
    asked = parse_priority(raw, where)
    if asked > grant.ceiling:
        by_name = isinstance(raw, str) and not raw.strip().isdigit()
        named = f"{_json_text(raw)} (class {asked})" if by_name else str(asked)
        raise PriorityNotAllowed(
            f"{where} {named} is above {grant.ceiling}, the highest the API key {grant.caller!r} may ask for",
            param=where,
            code="priority_not_allowed",
        )
    return asked


def _max_tokens(
    body: Mapping[str, Any], names: Sequence[str], limits: ModelLimits, prompt_tokens: int, kind: str
) -> int:
    """The output limit: the body's, else 16 for completions (OpenAI's default) and, for chat (where OpenAI
    has no limit), as many tokens as the context and the largest instance allow (vLLM's default)."""
    name, value = next(((n, body[n]) for n in names if body.get(n) is not None), (names[0], None))
    ctx = limits.max_context_tokens
    if value is None:
        room = min(ctx - prompt_tokens, limits.max_request_kv_tokens - prompt_tokens + 1)
        value = max(1, room if kind == "chat" else min(DEFAULT_MAX_TOKENS, ctx - prompt_tokens))
    if not _is_int(value):
        raise BadRequest(f"{name} must be an integer, got {_json_text(value)}", param=name)
    if value < 1:
        raise BadRequest(f"{name} must be >= 1, got {value}", param=name)
    if value > ctx:
        raise BadRequest(
            f"{name} = {value} is larger than the whole context of {limits.name} ({ctx} tokens)",
            param=name,
            code="context_length_exceeded",
        )
    return int(value)


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


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None or value == "":
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise BadRequest(f"stop must be a string or a list of strings, got {_json_text(value)}", param="stop")
    for i, s in enumerate(items):
        if not s:
            raise BadRequest(f"stop[{i}] is empty (it would match everywhere)", param="stop")
    return tuple(dict.fromkeys(items))


def _seed(body: Mapping[str, Any], n: int) -> int | None:
    seed = body.get("seed")
    if seed is None:
        return None
    if not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {_json_text(seed)}", param="seed")
    if not -(2**63) <= seed <= 2**63 - n:
        raise BadRequest(
            f"seed must fit in a signed 64-bit integer (with n = {n}: seed + n - 1), got {seed}", param="seed"
        )
    return int(seed)


def _guided(body: Mapping[str, Any]) -> tuple[GuidedDecoding | None, str]:
    """The structured-output constraint and the field that set it ("" for none)."""
    given = [name for name in _GUIDED_FIELDS if body.get(name) is not None]
    if given == ["response_format"] or not given:
        fmt = body.get("response_format")
        if fmt is None:
            return None, ""
        kind = fmt.get("type") if isinstance(fmt, Mapping) else None
        if kind == "text":
            return None, ""
        if kind == "json_object":
            return GuidedDecoding("json_object"), "response_format"
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if not isinstance(schema, Mapping):
                message = "response_format.json_schema.schema must be a JSON schema object"
                raise BadRequest(message, param="response_format")
            return GuidedDecoding("json_schema", json.dumps(schema)), "response_format"
        raise BadRequest(
            f"response_format.type must be text, json_object or json_schema, got {_json_text(kind)}",
            param="response_format",
        )
    if len(given) > 1:
        raise BadRequest(f"give one structured-output field, not {', '.join(given)}", param=given[1])
    name = given[0]
    value = body[name]
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise BadRequest(f"guided_json is not valid JSON: {exc}", param=name) from None
        if not isinstance(value, Mapping):
            raise BadRequest("guided_json must be a JSON schema (an object, or its JSON text)", param=name)
        return GuidedDecoding("json_schema", json.dumps(value)), name
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadRequest("guided_choice must be a non-empty list of strings", param=name)
        return GuidedDecoding("choice", json.dumps(value)), name
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string", param=name)
    return GuidedDecoding("regex" if name == "guided_regex" else "grammar", value), name


def _logprobs(body: Mapping[str, Any], kind: str) -> tuple[int | None, str]:
    """(top alternatives per token or None, the field that asked)."""
    if kind == "completion":
        k = body.get("logprobs")
        if k is None:
            return None, ""
        return _int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS), "logprobs"
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if body.get("top_logprobs") is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top, "logprobs") if wanted else (None, "")


def _sampling(
    body: Mapping[str, Any], kind: str, max_tokens: int, n: int, vocab_size: int
) -> tuple[SamplingParams, dict[str, str]]:
    """The sampling settings and, for each optional feature used, the body field that asked for it."""
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's older spelling of "all tokens"
        top_k = 0
    top_k = _int({"top_k": top_k}, "top_k", 0, 0, 2**31 - 1)
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise BadRequest("stop_token_ids must be a list of token ids", param="stop_token_ids")
    logprobs, logprobs_field = _logprobs(body, kind)
    guided, guided_field = _guided(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=_seed(body, n),
        ignore_eos=_bool(body, "ignore_eos"),
        stop_token_ids=_token_ids("stop_token_ids", stop_ids, vocab_size),
        top_k=top_k,
        min_tokens=min_tokens,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, math.inf, lo_open=True),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        logprobs=logprobs,
        guided=guided,
    )
    off = {"repetition_penalty": 1, "frequency_penalty": 0, "presence_penalty": 0}
    penalty = next((f for f, v in off.items() if body.get(f) not in (None, v)), "frequency_penalty")
    asked = {
        SamplingFeature.STOP_TOKEN_IDS: "stop_token_ids",
        SamplingFeature.PENALTIES: penalty,
        SamplingFeature.TOP_K: "top_k",
        SamplingFeature.MIN_TOKENS: "min_tokens",
        SamplingFeature.LOGPROBS: logprobs_field,
        SamplingFeature.GUIDED_DECODING: guided_field,
    }
    return params, {str(f): asked[f] for f in params.features()}


def _check_features(limits: ModelLimits, params: SamplingParams, feature_params: Mapping[str, str]) -> None:
    have = limits.sampling_features
    if have is None:
        return
    for feature in sorted(str(f) for f in params.features()):
        if feature not in have:
            field_name = feature_params[feature]
            offered = ", ".join(sorted(have)) or "none"
            raise BadRequest(
                f"{field_name} is not supported by the engines serving {limits.name} (they lack the {feature} "
                f"feature; they offer: {offered})",
                param=field_name,
                code="unsupported",
            )


def _finish(
    kind: Literal["completion", "chat"],
    body: Mapping[str, Any],
    limits: ModelLimits,
    prompt: tuple[int, ...],
    max_names: Sequence[str],
    tokenizer: Tokenizer,
    priority_header: str | None,
    grant: PriorityGrant,
) -> GenerationRequest:
    max_tokens = _max_tokens(body, max_names, limits, len(prompt), kind)
    used = next((n for n in max_names if body.get(n) is not None), max_names[0])
    _limits_check(limits, len(prompt), max_tokens, used)
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = body.get("best_of")
    if kind == "completion" and best_of is not None and best_of != n:
        raise BadRequest(
            f"best_of must equal n ({n}) when given: hilum does not rank choices", param="best_of", code="unsupported"
        )
    sampling, feature_params = _sampling(body, kind, max_tokens, n, tokenizer.vocab_size)
    _check_features(limits, sampling, feature_params)
    stream, include_usage = _stream(body)
    for name in ("user", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"{name} must be a string", param=name)
    return GenerationRequest(
        kind=kind,
        model=limits.name,
        prompt_token_ids=prompt,
        sampling=sampling,
        priority=_priority(body, priority_header, grant),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
        block_size_tokens=limits.block_size_tokens,
        n=n,
        stop=_stop(body),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
    )


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``); options without a stream, or unknown ones: 400."""
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, Mapping):
        raise BadRequest("stream_options must be an object", param="stream_options")
    if not stream:
        raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
    extra = sorted(k for k in options if k != "include_usage")
    if extra:
        raise BadRequest(f"stream_options.{extra[0]} is not supported (only include_usage)", param="stream_options")
    return stream, _bool(options, "include_usage")


def parse_completion(
    body: Any,
    limits: Mapping[str, ModelLimits],
    tokenizer: Tokenizer,
    *,
    priority_header: str | None = None,
    grant: PriorityGrant = PriorityGrant(),
) -> GenerationRequest:
    """Validate a ``/v1/completions`` body; ``grant``: the priority classes the caller may use. Raises
    :class:`BadRequest` (see the module docstring); :class:`ModelNotFound` (a BadRequest) for a model not
    served; :class:`PriorityNotAllowed` (a BadRequest) for a priority above ``grant.ceiling``."""
    obj = _require_object(body)
    model = _model(obj, limits)
    _check_fields(obj, COMPLETION_FIELDS | {"best_of"}, _COMPLETION_OFF)
    prompt = _completion_prompt(obj, tokenizer)
    return _finish("completion", obj, model, prompt, ("max_tokens",), tokenizer, priority_header, grant)


def parse_chat(
    body: Any,
    limits: Mapping[str, ModelLimits],
    tokenizer: Tokenizer,
    *,
    priority_header: str | None = None,
    grant: PriorityGrant = PriorityGrant(),
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body (prompt = the model's chat template over ``messages``).

    Raises :class:`BadRequest`; :class:`ModelNotFound` for a model not served; :class:`PriorityNotAllowed`
    for a priority above ``grant.ceiling`` (the caller's API key).
    """
    obj = _require_object(body)
    model = _model(obj, limits)
    _check_fields(obj, CHAT_FIELDS, None)
    messages = _chat_messages(obj)
    add_generation_prompt = _bool(obj, "add_generation_prompt", True)
    try:
        prompt = _encode(lambda m: tokenizer.chat_prompt(m, add_generation_prompt), messages)
    except ChatTemplateError as exc:
        raise BadRequest(str(exc), param="messages", code="chat_template") from None
    if not prompt:
        raise BadRequest("the chat template rendered these messages to an empty prompt", param="messages")
    names = ("max_completion_tokens", "max_tokens")
    return _finish("chat", obj, model, prompt, names, tokenizer, priority_header, grant)
