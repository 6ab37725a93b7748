"""GPU check: live-migrate a request between two vLLM engines on one GPU and print downtime and bandwidth.

For a machine with an NVIDIA GPU and official vLLM (a tested version, see ``docs/vllm.md``) plus hilum
installed without dependencies (``pip install --no-deps -e .``). Not run in CI (no GPU there). Usage::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python bench/gpu_vllm_migration.py meta-llama/Llama-3.1-8B-Instruct \\
        --prompt-tokens 4000 --gpu-memory-utilization 0.4

Two engines share the GPU (each takes ``--gpu-memory-utilization``; both must fit together). A greedy
request runs once unmigrated on the source (the reference), then again with a migration after
``--decode-before`` tokens: stage 0 copies every full block while it keeps decoding, a second stage the
blocks filled meanwhile, then ``suspend`` -> last stage -> ``commit_incoming`` -> ``free_migrated``.
Blocks travel through host memory as ``KVPayload`` bytes (read_blocks: device -> host, write_blocks:
host -> device), as a llumlet transport would carry them. Printed: bytes per stage, pre-copy bandwidth,
downtime (suspend until the destination produced its first token, which includes the commit and the
destination's first step), and whether the migrated stream equals the reference (bf16 kernels may differ
between a 1-token prefill and a decode step: the first differing position is printed, not asserted).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="HF model name or local checkpoint directory")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-before", type=int, default=8, help="tokens decoded before pre-copy starts")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per engine")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="per engine; overrides the fraction")
    parser.add_argument("--allow-untested-vllm", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from llumlet.engine import EngineRequest, SamplingParams
    from llumlet.engine.vllm_engine import VllmEngine

    def engine(name: str) -> VllmEngine:
        return VllmEngine(
            name,
            args.model,
            block_size_tokens=args.block_size,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            engine_kwargs={"gpu_memory_utilization": args.gpu_memory_utilization},
            allow_untested_vllm=args.allow_untested_vllm,
        )

    src, dst = engine("src"), engine("dst")
    vocab = int(src.llm.model_config.get_vocab_size())
    prompt = tuple(random.Random(0).randrange(100, vocab - 100) for _ in range(args.prompt_tokens))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def submit(e: VllmEngine, rid: str) -> None:
        e.add_request(EngineRequest(rid, len(prompt), args.max_tokens, prompt_token_ids=prompt, sampling_params=params))

    def step(e: VllmEngine, out: list[int]) -> float:
        start = time.perf_counter()
        result = e.step()
        out.extend(result.token_ids.get("r", ()))
        return time.perf_counter() - start

    ref: list[int] = []
    submit(src, "r")
    tbt = [step(src, ref) for _ in range(args.max_tokens)][1:]
    print(f"reference: {len(ref)} tokens, mean TBT {1e3 * sum(tbt) / len(tbt):.2f} ms")

    got: list[int] = []
    submit(src, "r")
    for _ in range(args.decode_before):
        step(src, got)
    tokens, blocks = src.request_kv("r") or (0, 0)
    kv_block = src.kv_bytes_per_block
    print(f"KV: {tokens} tokens in {blocks} blocks of {kv_block} bytes ({blocks * kv_block / 2**20:.1f} MiB)")
    if not dst.reserve("m", blocks + 4):
        print("destination has no room", file=sys.stderr)
        return 1
    copied, moved_bytes, precopy_s = 0, 0, 0.0
    for stage in range(2):
        tokens, blocks = src.request_kv("r") or (0, 0)
        full = tokens // src.block_size_tokens
        start = time.perf_counter()
        payload = src.read_blocks("r", copied, full - copied)
        dst.write_blocks("m", payload)
        elapsed = time.perf_counter() - start
        precopy_s += elapsed
        moved_bytes += payload.nbytes
        print(f"stage {stage}: {payload.num_blocks} blocks, {payload.nbytes / 2**20:.1f} MiB in {1e3 * elapsed:.1f} ms")
        copied = full
        for _ in range(max(1, src.block_size_tokens // 2)):  # keep decoding between stages
            step(src, got)
    start = time.perf_counter()
    state = src.suspend("r")
    assert state is not None, src.migratable("r")
    _tokens, blocks = src.request_kv("r") or (0, 0)
    last = src.read_blocks("r", copied, blocks - copied)
    dst.write_blocks("m", last)
    assert dst.commit_incoming("m", state)
    commit_s = time.perf_counter() - start
    src.free_migrated("r")
    first_s = step(dst, got)
    downtime_s = time.perf_counter() - start
    while dst.has_work():
        step(dst, got)
    bw = moved_bytes / precopy_s if precopy_s else float("nan")
    print(f"pre-copy: {moved_bytes / 2**20:.1f} MiB at {bw / 1e9:.2f} GB/s (device -> host bytes -> device)")
    print(
        f"downtime: {1e3 * downtime_s:.1f} ms (last stage {last.num_blocks} blocks + commit {1e3 * commit_s:.1f} ms, "
        f"first destination step {1e3 * first_s:.1f} ms)"
    )
    diff = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    same = diff is None and len(ref) == len(got)
    print(f"migrated stream identical to reference: {same}" + ("" if same else f" (first difference at {diff})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
