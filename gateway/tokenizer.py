"""A stand-in tokenizer: UTF-8 bytes as token ids, deterministic, no vocabulary file.

hilum's CPU reference engine (``llumlet --engine torch``) runs a tiny random Llama with a 512-token
vocabulary and no trained tokenizer, so the gateway needs *a* deterministic text <-> ids mapping, not a
linguistically good one. :class:`ByteTokenizer` is that stand-in:

- encode: each UTF-8 byte ``b`` of the text is the token id ``b + 3`` (ids 0, 1, 2 are reserved: pad,
  BOS, EOS as in the tiny Llama's config), so a text of ``n`` bytes is ``n`` tokens;
- decode: ids ``3..258`` whose byte is printable ASCII (32..126) are that character; every other id
  (the reserved ones, bytes outside printable ASCII, and ids ``>= 259`` the model may emit) is written
  ``<|id|>``. Each token decodes on its own, so streamed deltas concatenate to exactly the text of the
  non-streamed response.

A real deployment (the vLLM backend) uses the model's own tokenizer instead; the gateway only needs
``encode``, ``decode_token`` and ``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BYTE_OFFSET", "ByteTokenizer"]

BYTE_OFFSET = 3  # token id of byte 0; ids below are reserved (pad 0, BOS 1, EOS 2)


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Bytes-as-tokens stand-in (see the module docstring). ``vocab_size`` must be >= 259.

    Raises ValueError on a vocabulary too small to hold every byte.
    """

    vocab_size: int = 512

    def __post_init__(self) -> None:
        if self.vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"ByteTokenizer: vocab_size must be >= {BYTE_OFFSET + 256}, got {self.vocab_size}")

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text``: one per UTF-8 byte, ``byte + 3``."""
        return tuple(b + BYTE_OFFSET for b in text.encode("utf-8"))

    def decode_token(self, token_id: int) -> str:
        """Text of one token: a printable ASCII character, else ``<|id|>``."""
        byte = token_id - BYTE_OFFSET
        if 32 <= byte <= 126:
            return chr(byte)
        return f"<|{token_id}|>"

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of a token sequence (the concatenation of :meth:`decode_token`)."""
        return "".join(self.decode_token(t) for t in token_ids)
