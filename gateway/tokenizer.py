"""The gateway's tokenizer seam: text <-> token ids, chat templates, incremental detokenization.

Every served model gets one :class:`Tokenizer` (:func:`load_tokenizers`):

- :class:`HFTokenizer` — the model's own Hugging Face tokenizer, loaded offline from the directory the
  topology names (``models[].tokenizer``, ``docs/topology.md``) or ``--tokenizer MODEL=DIR``. Completion
  prompts are encoded with the tokenizer's special tokens (BOS where the model wants it); chat messages are
  rendered with the model's chat template (``apply_chat_template(..., add_generation_prompt=True)``) and that
  text is encoded without adding special tokens again (the template writes them), as vLLM's OpenAI server
  does. Output is detokenized incrementally, skipping special tokens (:class:`Detokenizer`).
- :class:`ByteTokenizer` — a stand-in for a model with no tokenizer (sim engines; the torch engine's default
  512-token tiny Llama): byte ``b`` of the UTF-8 text is id ``b + 3``.

Incremental detokenization (:class:`Detokenizer`): ``step`` returns the text that the new ids settle, and
holds back what is not settled yet — an incomplete UTF-8 sequence (a character split across tokens, shown
as U+FFFD by a plain decode) or a merge the next token may still change; ``flush`` gives the rest when the
output ends. The window algorithm is vLLM's ``detokenize_incrementally`` (prefix / read offsets into the
ids, after Hugging Face's ``TextStreamer``): decode ``ids[prefix:]`` and ``ids[prefix:read]``, emit the
difference when it does not end in U+FFFD, then move ``prefix`` to ``read`` and ``read`` to the end. The
window starts inside the prompt (its last :data:`PROMPT_CONTEXT_TOKENS` ids), so the first output token is
decoded in context (a SentencePiece word-start space stays). The streamed deltas and the whole response are
the same concatenation of ``step`` and ``flush`` results, so they are equal by construction. (The
``tokenizers`` library's ``DecodeStream`` does the same steps but cannot flush a trailing partial
sequence.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llumlet.engine.hf_tokenizer import TokenizerLoadError, load_hf_tokenizer
from topology.load import tokenizer_errors
from topology.spec import Topology

__all__ = [
    "BYTE_OFFSET",
    "PROMPT_CONTEXT_TOKENS",
    "ByteTokenizer",
    "ChatTemplateError",
    "Detokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerLoadError",
    "load_tokenizers",
]

BYTE_OFFSET = 3  # ByteTokenizer: token id of byte 0; ids below are reserved (pad 0, BOS 1, EOS 2)
PROMPT_CONTEXT_TOKENS = 6  # prompt ids the detokenizer's first window starts with (vLLM: 5 before the read offset)
_REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """The model's chat template cannot render these messages (or the model has none); the message says why."""


class Detokenizer(Protocol):
    """Incremental detokenization of one output (see the module docstring)."""

    def step(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; the text they settle ("" while held back)."""
        ...

    def flush(self) -> str:
        """The text still held back (the output ended); "" if none."""
        ...


class Tokenizer(Protocol):
    """What the gateway needs from a model's tokenizer."""

    @property
    def description(self) -> str:
        """What it is, for messages and ``/v1/models`` (a directory, or the byte stand-in)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        ...

    def encode(self, text: str) -> tuple[int, ...]:
        """Ids of a completion prompt (with the special tokens the model's tokenizer adds).

        Raises UnicodeEncodeError for text that is not valid Unicode (a lone surrogate).
        """
        ...

    def chat_prompt(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> tuple[int, ...]:
        """Ids of ``messages`` (``role``, ``content``, optional ``name``) rendered by the chat template.

        Raises ChatTemplateError.
        """
        ...

    def detokenizer(self, prompt_ids: Sequence[int]) -> Detokenizer:
        """A fresh :class:`Detokenizer` for the output of a request with ``prompt_ids``."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, special tokens included (logprobs entries)."""
        ...


# ---- the byte stand-in ---------------------------------------------------------------------------------


class _ByteDetokenizer:
    """Each id decodes on its own: nothing is ever held back."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tok = tokenizer

    def step(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(token_ids)

    def flush(self) -> str:
        return ""


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Bytes-as-tokens stand-in for a model without a tokenizer. ``vocab_size`` must be >= 259.

    - encode: each UTF-8 byte ``b`` of the text is the token id ``b + 3`` (ids 0, 1, 2 are reserved: pad,
      BOS, EOS as in the tiny Llama's config), so a text of ``n`` bytes is ``n`` tokens; no BOS is added;
    - decode: ids ``3..258`` whose byte is printable ASCII (32..126) are that character; every other id
      (the reserved ones, bytes outside printable ASCII, and ids ``>= 259`` the model may emit) is written
      ``<|id|>``. Each token decodes on its own.
    - chat: ``"<role>: <content>\\n"`` per message (``"<role> (<name>): ..."`` with a name), then
      ``"assistant: "`` (with ``add_generation_prompt``).

    Raises ValueError on a vocabulary too small to hold every byte.
    """

    vocab_size: int = 512

    def __post_init__(self) -> None:
        if self.vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"ByteTokenizer: vocab_size must be >= {BYTE_OFFSET + 256}, got {self.vocab_size}")

    @property
    def description(self) -> str:
        """``"byte stand-in"``."""
        return "byte stand-in"

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text``: one per UTF-8 byte, ``byte + 3``."""
        return tuple(b + BYTE_OFFSET for b in text.encode("utf-8"))

    def chat_prompt(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> tuple[int, ...]:
        """The stand-in template, encoded (a message's ``name``, when given, follows its role in parentheses)."""
        lines = []
        for m in messages:
            who = f"{m['role']} ({m['name']})" if m.get("name") else m["role"]
            lines.append(f"{who}: {m['content']}\n")
        text = "".join(lines)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))

    def decode_token(self, token_id: int) -> str:
        """Text of one token: a printable ASCII character, else ``<|id|>``."""
        byte = token_id - BYTE_OFFSET
        if 32 <= byte <= 126:
            return chr(byte)
        return f"<|{token_id}|>"

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of a token sequence (the concatenation of :meth:`decode_token`)."""
        return "".join(self.decode_token(t) for t in token_ids)

    def detokenizer(self, prompt_ids: Sequence[int]) -> Detokenizer:
        """Token-by-token decoding (nothing to hold back)."""
        return _ByteDetokenizer(self)

    def token_text(self, token_id: int) -> str:
        """:meth:`decode_token`."""
        return self.decode_token(token_id)


# ---- the model's own tokenizer ------------------------------------------------------------------------


class _HFDetokenizer:
    """vLLM's prefix / read offset window over ``tokenizer.decode`` (module docstring)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # window start: text before it was emitted
        self._read = len(self._ids)  # ids before it are settled (emitted, or prompt)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def step(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        # emitted: the window now starts at the old read offset (drop the ids before it)
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        return text[len(prefix_text) :] if len(text) > len(prefix_text) else ""


class HFTokenizer:
    """A model's Hugging Face tokenizer (see the module docstring).

    Args:
        path: the tokenizer directory (``save_pretrained`` output), read offline.
        model: the served model's name (messages only).

    Raises:
        TokenizerLoadError: the directory is missing or holds no loadable tokenizer.
    """

    def __init__(self, path: str | Path, model: str = "") -> None:
        self.path = str(path)
        self.model = model
        self._tok = load_hf_tokenizer(path)
        self._vocab_size = len(self._tok)
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    @property
    def description(self) -> str:
        """The directory it was loaded from."""
        return self.path

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: the base vocabulary plus added tokens."""
        return self._vocab_size

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id (None when it has none)."""
        eos = self._tok.eos_token_id
        return int(eos) if eos is not None else None

    def encode(self, text: str) -> tuple[int, ...]:
        """``tokenizer.encode(text)`` with its special tokens (BOS where the model wants one)."""
        text.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError here, as for the stand-in
        return tuple(int(t) for t in self._tok.encode(text, add_special_tokens=True))

    def chat_prompt(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> tuple[int, ...]:
        """Render ``messages`` with the model's chat template, then encode that text without adding special tokens.

        Raises ChatTemplateError: the tokenizer has no chat template, or the template refuses the messages
        (e.g. roles that do not alternate), with the template's own message.
        """
        name = self.model or self.path
        if not self.has_chat_template:
            raise ChatTemplateError(
                f"model {name}'s tokenizer ({self.path}) has no chat template: use /v1/completions, or add a "
                "chat_template to its tokenizer_config.json (or chat_template.jinja)"
            )
        for m in messages:
            m["content"].encode("utf-8")  # lone surrogates: UnicodeEncodeError, as for completions
        try:
            text = self._tok.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja2.TemplateError, or raise_exception() in the template
            raise ChatTemplateError(f"the chat template of {name} cannot render these messages: {exc}") from None
        return tuple(int(t) for t in self._tok.encode(str(text), add_special_tokens=False))

    def detokenizer(self, prompt_ids: Sequence[int]) -> Detokenizer:
        """A window detokenizer that starts in the prompt's last :data:`PROMPT_CONTEXT_TOKENS` ids."""
        return _HFDetokenizer(self._tok, prompt_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=True)`` (the whole-output reference of tests)."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """``tokenizer.decode([id])`` with special tokens kept (U+FFFD for part of a multi-byte character)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))


def load_tokenizers(
    topology: Topology, overrides: Mapping[str, str] | None = None, *, byte_vocab_size: int = 512
) -> dict[str, Tokenizer]:
    """One tokenizer per model of ``topology`` that has instances: ``overrides[model]`` (a directory), else the
    model's ``tokenizer``, else a :class:`ByteTokenizer` of ``byte_vocab_size``.

    Raises:
        TokenizerLoadError: every missing directory (naming the topology key or the override), an override
            for a model not served, or a directory that cannot be loaded.
    """
    overrides = dict(overrides or {})
    served = sorted({i.model for i in topology.instances})
    unknown = sorted(set(overrides) - set(served))
    if unknown:
        raise TokenizerLoadError(
            f"--tokenizer for {', '.join(unknown)}: not a model served by {topology.source} (served: "
            f"{', '.join(served)})"
        )
    errors = tokenizer_errors(topology, [m for m in served if m not in overrides])
    if errors:
        raise TokenizerLoadError("\n".join(errors))
    out: dict[str, Tokenizer] = {}
    for model in served:
        path = overrides.get(model) or topology.models[model].tokenizer
        out[model] = HFTokenizer(path, model) if path is not None else ByteTokenizer(byte_vocab_size)
    return out
