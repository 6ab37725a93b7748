"""The OpenAI JSON shapes the gateway answers with: error objects, usage, and the two logprobs formats.

- Errors (every error path: 400, 404, 405, 413, 415, 5xx): ``{"error": {"message", "type", "param",
  "code"}}`` (:func:`error_body`).
- ``usage``: ``prompt_tokens`` once, ``completion_tokens`` summed over the choices (OpenAI's count for
  ``n`` > 1), ``total_tokens`` their sum (:func:`usage`).
- Logprobs of ``/v1/completions`` (the legacy format, :class:`CompletionLogprobs`): ``{"tokens",
  "token_logprobs", "top_logprobs": [{token text: logprob}], "text_offset"}``; ``text_offset[i]`` is the
  character offset of token ``i`` when each token's own text is laid end to end (vLLM's rule), counted
  from the first output token and continued across stream chunks.
- Logprobs of ``/v1/chat/completions`` (:func:`chat_logprobs`): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``; ``bytes`` are the UTF-8 bytes of the
  token's text (U+FFFD for a token that is part of a multi-byte character).

Token texts come from ``Tokenizer.token_text`` (each token alone, special tokens kept). The log
probabilities are the model's raw distribution (``llumlet.engine.types.TokenLogprobs``); a token the engine
gives no probability at all (log -inf, e.g. one a guided-decoding grammar excludes) is written as
:data:`MIN_LOGPROB`, as vLLM's server writes it (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tokenizer import Tokenizer
from llumlet.engine.types import TokenLogprobs

__all__ = ["MIN_LOGPROB", "CompletionLogprobs", "chat_logprobs", "error_body", "usage"]

#: The smallest log probability written (vLLM's OpenAI server clamps to it too).
MIN_LOGPROB = -9999.0


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str = "") -> Any:
    """The OpenAI error object; ``kind`` is its ``type`` (``invalid_request_error``, ``not_found_error``, ...)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code or None}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(slots=True)
class CompletionLogprobs:
    """Builds ``/v1/completions`` logprobs objects for one choice, chunk after chunk (``text_offset`` goes on)."""

    tokenizer: Tokenizer
    offset: int = 0  # text_offset of the next token

    def chunk(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The logprobs object of ``token_ids`` (one :class:`TokenLogprobs` each)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(token_ids, logprobs, strict=True):
            text = self.tokenizer.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(_clamped(entry.logprob))
            out["top_logprobs"].append({self.tokenizer.token_text(t): _clamped(lp) for t, lp in entry.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.token_text(token)
    return {"token": text, "logprob": _clamped(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` logprobs object of ``token_ids`` (one :class:`TokenLogprobs` each)."""
    content = []
    for token, entry in zip(token_ids, logprobs, strict=True):
        item = _entry(tokenizer, token, entry.logprob)
        item["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content}
