"""The prefix block hashes every tier computes alike (llumlet.engine.prefix_hash)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llumlet.engine.prefix_hash import PrefixCacheConfig, prefix_block_hashes

PROMPT = list(range(1000, 1000 + 200))  # 200 tokens: 3 full 64-token blocks and a partial one


def test_one_id_per_full_block_the_partial_block_has_none() -> None:
    ids = prefix_block_hashes(PROMPT, 64)
    assert len(ids) == 3
    assert len(set(ids)) == 3
    assert all(0 <= h < 2**64 for h in ids)
    assert prefix_block_hashes(PROMPT[:63], 64) == ()
    assert prefix_block_hashes(PROMPT[:191], 64) == ids[:2]


def test_prefix_property_a_longer_prompt_starts_with_the_shorter_ones_ids() -> None:
    short = prefix_block_hashes(PROMPT[:128], 64)
    long = prefix_block_hashes([*PROMPT[:128], 7, 8, 9] * 3, 64)
    assert long[:2] == short
    assert len(long) == 6


def test_chained_an_id_names_the_whole_prefix_not_only_its_block() -> None:
    base = prefix_block_hashes(PROMPT, 64)
    first_changed = prefix_block_hashes([PROMPT[0] + 1, *PROMPT[1:]], 64)
    assert all(a != b for a, b in zip(base, first_changed, strict=True))  # every later id differs
    second_changed = list(PROMPT)
    second_changed[64] += 1
    got = prefix_block_hashes(second_changed, 64)
    assert got[0] == base[0]
    assert got[1] != base[1] and got[2] != base[2]
    # the same block of tokens after different prefixes has different ids
    block = PROMPT[64:128]
    assert prefix_block_hashes([*PROMPT[:64], *block], 64)[1] != prefix_block_hashes([*PROMPT[64:128], *block], 64)[1]


def test_block_size_changes_the_ids() -> None:
    assert prefix_block_hashes(PROMPT, 16)[:1] != prefix_block_hashes(PROMPT, 64)[:1]
    assert len(prefix_block_hashes(PROMPT, 16)) == 12


def test_the_same_ids_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from llumlet.engine.prefix_hash import prefix_block_hashes;"
        "print(list(prefix_block_hashes(list(range(1000, 1200)), 64)))"
    )
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.append(done.stdout.strip())
    assert outs[0] == outs[1] == str(list(prefix_block_hashes(PROMPT, 64)))


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="prefix_block_tokens = 0"):
        prefix_block_hashes(PROMPT, 0)
    with pytest.raises(ValueError, match="token id -1"):
        prefix_block_hashes([-1] * 64, 64)
    with pytest.raises(ValueError, match="token id 4294967296"):
        prefix_block_hashes([2**32] * 64, 64)


def test_config_gives_the_hash_block_per_model_and_refuses_bad_values() -> None:
    cfg = PrefixCacheConfig()
    assert cfg.enabled and cfg.blocks_per_hash == 4 and cfg.report_max_hashes == 512
    assert cfg.block_tokens(16) == 64
    assert PrefixCacheConfig(blocks_per_hash=1).block_tokens(32) == 32
    with pytest.raises(ValueError, match="blocks_per_hash"):
        PrefixCacheConfig(blocks_per_hash=0)
    with pytest.raises(ValueError, match="report_max_hashes"):
        PrefixCacheConfig(report_max_hashes=-1)
