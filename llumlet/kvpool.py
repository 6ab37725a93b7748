"""KV pools shared between the llumlets of one host, and block copies between pools.

A :class:`KVPool` is an engine's paged KV memory as tensors with a block axis (the torch engine: one tensor
``[layers, 2, num_blocks, kv_heads, block_size, head_dim]``, block axis 2; vLLM: one tensor per attention
layer, block axis 0 or 1). The ``local`` transport moves blocks between two engines of one host without
staging: the source exports its pool once (:func:`export_pool`), the destination opens it
(:func:`open_pool`) and copies the source's blocks straight into its reservation (:func:`copy_between`) —
a GPU peer copy (over NVLink or PCIe) when the pools are CUDA tensors, a memory copy when they are host
tensors. Two exports exist:

- CUDA tensors: CUDA IPC handles, as ``torch.multiprocessing`` makes them (``UntypedStorage._share_cuda_``,
  opened with ``torch.multiprocessing.reductions.rebuild_cuda_tensor``); any CUDA tensor can be exported,
  the exporting process must keep it alive (an engine's pool lives as long as the engine);
- host tensors: only those allocated by :func:`shared_host_tensor` (a POSIX shared-memory segment, opened
  read-only by name through ``/dev/shm``).

Handles cross the wire as plain values (``llumlet.convert``'s codec: numbers, strings, bytes), never pickles.
A pool that cannot be exported (a host tensor in private memory: vLLM's CPU build) gives ``None``; the local
transport then sends the bytes inline.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from llumlet.convert import decode_extra, encode_extra

__all__ = [
    "COPY_CHUNK_BLOCKS",
    "KVPool",
    "PoolExportError",
    "copy_between",
    "export_pool",
    "open_pool",
    "pool_id",
    "shared_host_tensor",
]

COPY_CHUNK_BLOCKS = 64  # blocks per gather in copy_between: the only temporary is 64 blocks of one tensor
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory objects
_SHARED_HOST: dict[int, str] = {}  # data_ptr of a shared_host_tensor -> its segment name


class PoolExportError(ValueError):
    """A pool handle that cannot be opened here (malformed, another host's segment, no CUDA)."""


@dataclass(frozen=True, slots=True)
class KVPool:
    """An engine's KV memory: tensors of one shape and dtype, blocks along ``block_dim``."""

    tensors: tuple[torch.Tensor, ...]
    block_dim: int

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("KVPool: no tensors")
        first = self.tensors[0]
        if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in self.tensors):
            raise ValueError("KVPool: tensors of different shapes, dtypes or devices")
        if not 0 <= self.block_dim < first.dim():
            raise ValueError(f"KVPool: block_dim {self.block_dim} outside a {first.dim()}-d tensor")

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return int(self.tensors[0].shape[self.block_dim])

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all tensors."""
        first = self.tensors[0]
        return len(self.tensors) * first.numel() // self.num_blocks * first.element_size()

    def layout(self) -> tuple[int, str, tuple[int, ...], int]:
        """(tensors, dtype, shape, block_dim): what must match for two pools to exchange blocks."""
        first = self.tensors[0]
        return len(self.tensors), str(first.dtype), tuple(first.shape), self.block_dim


def shared_host_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor in a POSIX shared-memory segment, exportable by :func:`export_pool`.

    The segment is unlinked when the tensor is garbage-collected or the process exits (the mapping of a
    peer that opened it stays valid until that peer drops it). Raises OSError when ``/dev/shm`` is full.
    """
    nbytes = max(1, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
    seg = shared_memory.SharedMemory(create=True, size=nbytes)
    buf = seg.buf
    assert buf is not None
    tensor = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(tuple(shape))
    tensor.zero_()
    _SHARED_HOST[tensor.data_ptr()] = seg.name
    weakref.finalize(tensor, _unlink, seg, tensor.data_ptr())
    return tensor


def _unlink(seg: shared_memory.SharedMemory, ptr: int) -> None:
    _SHARED_HOST.pop(ptr, None)
    with contextlib.suppress(FileNotFoundError):
        seg.unlink()


def export_pool(pool: KVPool) -> bytes | None:
    """A handle peers on this host can open with :func:`open_pool`; None when the pool is not shareable.

    CUDA pools: one CUDA IPC handle per tensor. Host pools: segment names of :func:`shared_host_tensor`.
    """
    first = pool.tensors[0]
    entries: list[object] = []
    if first.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        for t in pool.tensors:
            _rebuild, args = reduce_tensor(t)  # type: ignore[no-untyped-call, unused-ignore]
            (
                _cls,
                size,
                stride,
                offset,
                _scls,
                _dtype,
                device,
                handle,
                size_b,
                off_b,
                _grad,
                rc_h,
                rc_off,
                ev,
                sync,
            ) = args
            entries.append((tuple(size), tuple(stride), offset, device, handle, size_b, off_b, rc_h, rc_off, ev, sync))
        kind = "cuda_ipc"
    elif first.device.type == "cpu":
        for t in pool.tensors:
            name = _SHARED_HOST.get(t.data_ptr())
            if name is None or not t.is_contiguous():
                return None
            entries.append((name, tuple(t.shape)))
        kind = "shm"
    else:
        return None
    msg = {"kind": kind, "dtype": str(first.dtype).removeprefix("torch."), "block_dim": pool.block_dim}
    return encode_extra({**msg, "id": uuid.uuid4().hex, "entries": tuple(entries)})


def pool_id(handle: bytes) -> str:
    """The unique id of an exported pool (peers cache opened pools by it)."""
    raw = decode_extra(handle)
    ident = raw.get("id")
    if not isinstance(ident, str):
        raise PoolExportError("pool handle without an id")
    return ident


def open_pool(handle: bytes) -> KVPool:
    """Open a pool another process of this host exported. Raises :class:`PoolExportError`."""
    try:
        raw = decode_extra(handle)
        kind, entries, block_dim = raw["kind"], raw["entries"], raw["block_dim"]
        dtype = getattr(torch, str(raw["dtype"]))
    except (KeyError, ValueError, AttributeError) as exc:
        raise PoolExportError(f"malformed pool handle: {exc}") from exc
    if not isinstance(entries, tuple) or not isinstance(block_dim, int) or not isinstance(dtype, torch.dtype):
        raise PoolExportError("malformed pool handle")
    tensors: list[torch.Tensor] = []
    if kind == "cuda_ipc":
        if not torch.cuda.is_available():
            raise PoolExportError("a CUDA IPC pool handle, and CUDA is not available in this process")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        for size, stride, offset, device, handle_b, size_b, off_b, rc_h, rc_off, ev, sync in entries:  # type: ignore[misc, unused-ignore]
            args = (size, stride, offset, dtype, device, handle_b, size_b, off_b, rc_h, rc_off, ev, sync)
            tensors.append(_rebuild(rebuild_cuda_tensor, *args))
    elif kind == "shm":
        for name, shape in entries:  # type: ignore[misc, unused-ignore]
            tensors.append(_map_segment(str(name), tuple(shape), dtype))
    else:
        raise PoolExportError(f"unknown pool handle kind {kind!r}")
    try:
        return KVPool(tuple(tensors), block_dim)
    except ValueError as exc:
        raise PoolExportError(str(exc)) from exc


def _rebuild(
    rebuild: object, size: object, stride: object, offset: object, dtype: torch.dtype, *rest: object
) -> torch.Tensor:
    """``rebuild_cuda_tensor`` with the argument order of ``reduce_tensor`` (plain tensor, untyped storage)."""
    device, handle, size_b, off_b, rc_h, rc_off, ev, sync = rest
    tensor = rebuild(  # type: ignore[operator]
        torch.Tensor, torch.Size(size), stride, offset, torch.UntypedStorage, dtype, device,  # type: ignore[arg-type]
        handle, size_b, off_b, False, rc_h, rc_off, ev, sync,
    )  # fmt: skip
    assert isinstance(tensor, torch.Tensor)
    return tensor


def _map_segment(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map a shared-memory segment read-only through ``/dev/shm`` (no resource tracker: the owner unlinks)."""
    path = os.path.join(_SHM_DIR, name.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise PoolExportError(f"shared memory segment {name!r}: {exc.strerror} (another host?)") from exc
    try:
        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(mapped) < nbytes:
        raise PoolExportError(f"shared memory segment {name!r}: {len(mapped)} bytes, need {nbytes}")
    # read-only mapping: torch warns that the buffer is not writable; the pool is only read from here
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def copy_between(src: KVPool, src_ids: Sequence[int], dst: KVPool, dst_ids: Sequence[int]) -> None:
    """Copy blocks ``src_ids[i]`` of ``src`` into blocks ``dst_ids[i]`` of ``dst``, tensor by tensor.

    :data:`COPY_CHUNK_BLOCKS` blocks at a time per tensor (the temporary of the gather); device copies run on
    the current stream and this returns when they are done. Raises ValueError when the layouts differ or
    the id lists differ in length.
    """
    if src.layout() != dst.layout():
        raise ValueError(f"KV pools of different layouts: source {src.layout()}, destination {dst.layout()}")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_between: {len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    device = dst.tensors[0].device
    for lo in range(0, len(src_ids), COPY_CHUNK_BLOCKS):
        s_idx = torch.tensor(list(src_ids[lo : lo + COPY_CHUNK_BLOCKS]), dtype=torch.long, device=src.tensors[0].device)
        d_idx = torch.tensor(list(dst_ids[lo : lo + COPY_CHUNK_BLOCKS]), dtype=torch.long, device=device)
        for s, d in zip(src.tensors, dst.tensors, strict=True):
            d.index_copy_(dst.block_dim, d_idx, s.index_select(src.block_dim, s_idx).to(device, non_blocking=True))
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
