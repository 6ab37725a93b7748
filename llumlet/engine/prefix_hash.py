"""Prefix block hashes of a prompt, and the settings of the prefix cache every tier agrees on.

A prompt's prefix is named block by block, as vLLM's automatic prefix caching names it
(``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``): hash block ``j`` covers tokens
``[j·H, (j+1)·H)`` of the prompt (``H`` = ``prefix_block_tokens``) and its id is a hash of (the id of block
``j − 1``, the token ids of block ``j``), so an id names the whole prefix up to the end of its block, not
only the block's own tokens: two prompts share hash ``j`` exactly when they share their first ``(j+1)·H``
tokens. Only full blocks are named (a partial last block has no id). Mooncake's traces carry the same kind
of ids (``hash_ids``, one per 512 tokens).

The ids are deterministic across processes and hosts (BLAKE2b over a fixed byte encoding, never Python's
salted ``hash()``), so the gateway that tokenizes a prompt, the llumlet whose engine caches its KV, and the
domain scheduler that matches one against the other all compute the same ids. They are 64-bit: two
different prefixes share an id with probability about ``n² / 2⁶⁵`` among ``n`` distinct blocks (1e-8 for
600 000 blocks), and a collision only misplaces a request or its cache hit in the sim engine, which holds
no KV data.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PREFIX_CACHE_DEFAULTS", "PrefixCacheConfig", "prefix_block_hashes"]

_MAX_TOKEN_ID = 2**32 - 1  # token ids travel as uint32 (llumlet.proto)
_ROOT = b"hilum-prefix-v1"  # the "parent" of block 0 (vLLM: NONE_HASH); versioned with the encoding


def prefix_block_hashes(token_ids: Sequence[int], prefix_block_tokens: int) -> tuple[int, ...]:
    """The chained hash ids of the full ``prefix_block_tokens``-token blocks of ``token_ids``, in order.

    ``h_j = BLAKE2b-64(h_{j−1} as 8 bytes little-endian ‖ tokens of block j as uint32 little-endian)``, with
    ``h_{−1}`` a fixed root (the module docstring says why). Returns ``len(token_ids) // prefix_block_tokens``
    ids, each an int in ``[0, 2⁶⁴)``; ``prefix_block_hashes(a + b, H)`` starts with ``prefix_block_hashes(a, H)``
    for any ``a`` whose length is a multiple of ``H``.

    Raises ValueError when ``prefix_block_tokens`` < 1 or a token id is outside ``[0, 2³²)``.
    """
    if prefix_block_tokens < 1:
        raise ValueError(f"prefix_block_hashes: prefix_block_tokens = {prefix_block_tokens}, need >= 1")
    n_blocks = len(token_ids) // prefix_block_tokens
    if not n_blocks:
        return ()
    head = token_ids[: n_blocks * prefix_block_tokens]
    bad = next((t for t in head if not 0 <= t <= _MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"prefix_block_hashes: token id {bad} is outside [0, 2**32)")
    pack = struct.Struct(f"<{prefix_block_tokens}I").pack
    out: list[int] = []
    parent = hashlib.blake2b(_ROOT, digest_size=8).digest()
    for j in range(n_blocks):
        block = head[j * prefix_block_tokens : (j + 1) * prefix_block_tokens]
        parent = hashlib.blake2b(parent + pack(*block), digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PrefixCacheConfig:
    """The prefix cache's settings (the ``prefix_cache`` section of the configuration file).

    ``enabled``: the sim engine of a llumlet caches prompt prefixes (``EngineCore`` with
    ``enable_prefix_caching``), matched by the request's prefix hashes. Off: every prompt is computed in full
    and the llumlet reports no prefix.

    ``blocks_per_hash``: KV cache blocks one prefix hash covers: ``prefix_block_tokens`` =
    ``blocks_per_hash × the model's block_size_tokens`` (4 × 16 = 64 tokens by default). A multiple of the
    engine block by construction, so it is valid for every model. vLLM hashes every block (1); 4 cuts what
    load reports and domain summaries carry fourfold and loses at most 3 blocks of reuse per prompt (under 3%
    of a 2 000-token system prompt).

    ``report_max_hashes``: prefix hashes one load report (llumlet → domain scheduler) carries at most, most
    recently used first; the domain summary in etcd carries each instance's reported set. Each costs 8 bytes
    on the wire (fixed64) and about 11 in etcd (base64), so the default 512 is 4 KiB per report and about
    5.5 KiB per instance per summary put, and covers 512 × 64 = 32 768 tokens of the most recently used
    prefixes of an instance. A prefix an instance still caches beyond the cap is still reused there by its
    engine; the schedulers just do not prefer that instance for it. 0: report none (dispatch by load alone).

    Raises ValueError on ``blocks_per_hash`` < 1 or ``report_max_hashes`` < 0.
    """

    enabled: bool = True
    blocks_per_hash: int = 4
    report_max_hashes: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.blocks_per_hash, int) or self.blocks_per_hash < 1:
            raise ValueError(f"blocks_per_hash must be an int >= 1, got {self.blocks_per_hash!r}")
        if not isinstance(self.report_max_hashes, int) or self.report_max_hashes < 0:
            raise ValueError(f"report_max_hashes must be an int >= 0, got {self.report_max_hashes!r}")

    def block_tokens(self, block_size_tokens: int) -> int:
        """Tokens one prefix hash covers for a model with KV blocks of ``block_size_tokens`` tokens."""
        return self.blocks_per_hash * block_size_tokens


#: The defaults (a shared immutable value for argument defaults).
PREFIX_CACHE_DEFAULTS = PrefixCacheConfig()
