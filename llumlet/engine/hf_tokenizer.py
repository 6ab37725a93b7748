"""Loading a model's Hugging Face tokenizer from a local directory, offline, with errors that say what is wrong.

Used by the gateway (``gateway.tokenizer.HFTokenizer``: encode, chat template, detokenize) and by the torch
engine's backend (its tiny Llama takes the tokenizer's vocabulary size and special ids), so both read the
same directory the same way. The directory is what ``save_pretrained`` writes (``tokenizer.json``,
``tokenizer_config.json``, optionally ``chat_template.jinja``), usually the model's checkpoint directory.
Nothing is downloaded: ``local_files_only=True``.

transformers is imported on the first call only (an optional dependency: ``pip install 'hilum[tokenizer]'``,
or ``'hilum[torch]'`` which has it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topology.load import tokenizer_dir_problem

__all__ = ["TokenizerInfo", "TokenizerLoadError", "load_hf_tokenizer", "tokenizer_info"]


class TokenizerLoadError(ValueError):
    """A tokenizer directory that cannot be loaded; the message names the directory and the reason."""


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """What an engine needs to know of a tokenizer: its id space and special ids (None when it has none)."""

    path: str
    vocab_size: int  # ids are in [0, vocab_size): the base vocabulary plus added tokens (len(tokenizer))
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def load_hf_tokenizer(path: str | Path) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``.

    Raises:
        TokenizerLoadError: ``path`` is not a directory, holds no tokenizer file
            (``topology.load.tokenizer_dir_problem``) or none transformers can load, or
            transformers is not installed; the message names ``path``.
    """
    where = Path(path)
    what = tokenizer_dir_problem(where)
    if what is not None:  # before transformers, whose message for a folder without one blames missing packages
        raise TokenizerLoadError(f"tokenizer {str(path)!r} {what} (need a directory saved by save_pretrained)")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - the test environment has transformers
        raise TokenizerLoadError(
            f"tokenizer {str(path)!r}: loading it needs transformers (pip install 'hilum[tokenizer]'): {exc}"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenizerLoadError(f"tokenizer {str(path)!r} cannot be loaded: {exc}") from None


def tokenizer_info(path: str | Path) -> TokenizerInfo:
    """:class:`TokenizerInfo` of the tokenizer in ``path``. Raises :class:`TokenizerLoadError`."""
    tok = load_hf_tokenizer(path)
    return TokenizerInfo(str(path), len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
