"""One choice's output as the client sees it: detokenized text, stop strings, and the tokens it stands for.

The engines produce token ids; the gateway turns them into text (``gateway.tokenizer``) and applies the
stop strings there, because the gateway is where the whole output passes whichever llumlet runs the
request — before, during and after a migration — so a stop string is matched the same way on every engine
and needs no detokenizer state inside an engine or across a move. :class:`ChoiceOutput` takes the tokens
in order (each with its logprobs when the request asked for them) and says, per push, what may be sent:

- each token's text comes from the incremental detokenizer (an incomplete UTF-8 sequence is held there);
- after each token, the new text is searched for every stop string (from ``len(stop) - 1`` characters
  before it, so a stop string split across tokens is found: vLLM's ``check_stop_strings``); the one that
  completes first wins, and of several completing at once the one that starts first (``"<"`` and ``"><"`` in
  ``"><"``: the text is cut before ``"><"``); stop strings count only once more than ``min_tokens`` tokens
  exist, as vLLM's detokenizer does. On a match the text is
  cut before the stop string (OpenAI's rule; ``include_stop_str_in_output`` keeps it, vLLM's extension), the
  output ends with ``finish_reason`` ``"stop"``, and the tokens after the one that completed the match are
  dropped (they are not in the text, the token ids, the logprobs or ``usage``);
- text that might be the start of a stop string (a suffix of the text that is a proper prefix of one) is
  held back until the next token resolves it, so a stream never shows text the final answer does not have;
- when the output ends without a match, everything held is released (:meth:`finish`).

Without stop strings nothing but incomplete characters is held. A request whose engine stopped on EOS or
a stop token id keeps that token in its ids (the engines' rule); special tokens have no text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.tokenizer import Detokenizer
from llumlet.engine.types import TokenLogprobs

__all__ = ["ChoiceOutput", "Piece"]


@dataclass(frozen=True, slots=True)
class Piece:
    """What one push releases to the client."""

    text: str  # new text, may be ""
    token_ids: tuple[int, ...]  # the tokens this push accepted (all of them, unless a stop string ended it)
    logprobs: tuple[TokenLogprobs, ...] = ()  # aligned with token_ids when the request asked for logprobs
    stopped: str | None = None  # the stop string that ended the output here, None otherwise


@dataclass(slots=True)
class ChoiceOutput:
    """The output of one choice (see the module docstring). Not thread-safe.

    Args:
        detokenizer: from the model's tokenizer, for this request's prompt.
        stop: stop strings (non-empty), in the request's order.
        min_tokens: stop strings are matched only after this many tokens (the request's ``min_tokens``).
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    detokenizer: Detokenizer
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    text: str = ""  # all text produced so far (released or held)
    released: int = 0  # characters of ``text`` already sent
    token_ids: list[int] = field(default_factory=list)  # tokens accepted so far
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stopped: str | None = None  # the stop string that ended it

    def push(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] = ()) -> Piece:
        """Take the next tokens (and their logprobs, one each, or none). Ignored once stopped."""
        if self.stopped is not None:
            return Piece("", ())
        accepted: list[int] = []
        for i, token in enumerate(token_ids):
            accepted.append(token)
            self.token_ids.append(token)
            if i < len(logprobs):
                self.logprobs.append(logprobs[i])
            new = self.detokenizer.step((token,))
            if not new:
                continue
            self.text += new
            if self.stop and len(self.token_ids) > self.min_tokens and self._match(len(new)):
                break
        end = len(self.text) if self.stopped is not None else len(self.text) - self._held()
        return self._release(end, accepted, logprobs)

    def finish(self) -> Piece:
        """The output ended (length, EOS, stop token id): release everything held."""
        if self.stopped is None:
            self.text += self.detokenizer.flush()
            if self.stop and len(self.token_ids) > self.min_tokens:
                self._match(len(self.text) - self.released)
        return self._release(len(self.text), [], ())

    def _release(self, end: int, accepted: list[int], logprobs: Sequence[TokenLogprobs]) -> Piece:
        text = self.text[self.released : max(end, self.released)]
        self.released = max(end, self.released)
        return Piece(text, tuple(accepted), tuple(logprobs[: len(accepted)]), self.stopped)

    def _match(self, new_chars: int) -> bool:
        """Find the stop string that completes earliest in the last ``new_chars`` characters (of those, the one
        that starts first: the cut leaves no stop string in the text); cut the text."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = self.text.find(stop, max(0, len(self.text) - new_chars - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return False
        end, start, stop = best
        self.text = self.text[: end if self.include_stop_str_in_output else start]
        self.stopped = stop
        return True

    def _held(self) -> int:
        """Characters at the end of the unreleased text that are a proper prefix of some stop string."""
        tail = self.text[self.released :]
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(tail)), held, -1):
                if tail.endswith(stop[:n]):
                    held = n
                    break
        return held
