"""KV pools shared between llumlets of one host (``llumlet.kvpool``): export, open in another process, copy.

CUDA IPC handles need a GPU (``bench/gpu_migration.py`` exercises them); the host-memory export runs here,
across a real process boundary.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from llumlet.convert import encode_extra
from llumlet.kvpool import KVPool, PoolExportError, copy_between, export_pool, open_pool, pool_id, shared_host_tensor


def _pool(num_blocks: int = 6, seed: int = 0) -> KVPool:
    t = shared_host_tensor((2, 2, num_blocks, 3, 4), torch.float32)  # [layers, K/V, blocks, heads, dim]
    t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
    return KVPool((t,), 2)


def test_a_shared_host_pool_is_opened_in_another_process_and_copied_from() -> None:
    src = _pool()
    handle = export_pool(src)
    assert handle is not None and pool_id(handle) == pool_id(handle)
    script = textwrap.dedent(
        f"""
        import sys, torch
        from llumlet.kvpool import KVPool, copy_between, open_pool
        src = open_pool(bytes.fromhex({handle.hex()!r}))
        dst = KVPool((torch.zeros(src.tensors[0].shape),), 2)
        copy_between(src, [4, 1], dst, [0, 5])
        sys.stdout.write(dst.tensors[0].numpy().tobytes().hex())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    got = torch.frombuffer(bytearray(bytes.fromhex(out.stdout)), dtype=torch.float32).view(src.tensors[0].shape)
    want = torch.zeros_like(got)
    want[:, :, 0] = src.tensors[0][:, :, 4]
    want[:, :, 5] = src.tensors[0][:, :, 1]
    assert torch.equal(got, want)


def test_copy_between_moves_exactly_the_named_blocks_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llumlet.kvpool.COPY_CHUNK_BLOCKS", 2)  # several chunks
    src, dst = _pool(8, seed=1), KVPool((torch.zeros(2, 2, 8, 3, 4),), 2)
    copy_between(src, [7, 0, 3, 5, 2], dst, [1, 2, 3, 4, 6])
    for s, d in zip([7, 0, 3, 5, 2], [1, 2, 3, 4, 6], strict=True):
        assert torch.equal(dst.tensors[0][:, :, d], src.tensors[0][:, :, s])
    assert not dst.tensors[0][:, :, [0, 5, 7]].any()  # untouched


def test_pools_that_cannot_meet_are_refused() -> None:
    with pytest.raises(ValueError, match="different layouts"):
        copy_between(_pool(6), [0], KVPool((torch.zeros(2, 2, 7, 3, 4),), 2), [0])
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        copy_between(_pool(6), [0, 1], _pool(6), [0])
    assert export_pool(KVPool((torch.zeros(2, 3),), 0)) is None  # private host memory: bytes go inline
    with pytest.raises(PoolExportError, match="malformed"):
        open_pool(b"{}")
    gone = encode_extra({"kind": "shm", "dtype": "float32", "block_dim": 0, "id": "x", "entries": (("nope", (2,)),)})
    with pytest.raises(PoolExportError, match=r"'nope'.*another host"):
        open_pool(gone)
    with pytest.raises(PoolExportError, match="CUDA is not available"):
        cuda = {"kind": "cuda_ipc", "dtype": "float32", "block_dim": 0, "id": "y", "entries": ()}
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        open_pool(encode_extra(cuda))
