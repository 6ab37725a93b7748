"""Two llumlet processes on real vLLM engines (``--engine vllm``): serve, then migrate mid-decode.

Each process loads the same tiny random-weight Llama checkpoint (written offline, no download). A greedy
and a seeded-sampling request start on ``v0``; each is moved to ``v1`` while it decodes (pre-copy over the
gRPC transport, with a local shared-memory move the other way for the greedy one), and its token stream
must equal that of the same request served without migration on the other engine. Runs only where vLLM
is importable (``make test-vllm``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import warnings
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make test-vllm` builds .venv-vllm and runs these", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # inherited by the llumlet processes
os.environ.setdefault("OMP_NUM_THREADS", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from llumlet.engine.vllm_engine import tiny_llama_checkpoint

from hilum_proto.v1 import llumlet_pb2 as pb
from llumlet.client import LlumletClient
from llumlet.engine.types import SamplingParams
from llumlet.procs import LlumletProcess
from llumlet.sink import TokenCollector

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

BLOCK = 32
KV_BYTES = 65 * 2 * 2 * 2 * BLOCK * 32 * 4  # 64 blocks (+1 spare) of the tiny model's float32 KV
PROMPT = [(17 * i + 5) % 500 + 3 for i in range(70)]


@pytest.fixture(scope="module")
def llumlets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LlumletProcess]]:
    tmp = tmp_path_factory.mktemp("vllm-llumlets")
    model = tiny_llama_checkpoint(tmp / "tiny-llama")
    args = ["--block-size", str(BLOCK), "--min-step-s", "0.01", "--engine-option", f"model={model}"]
    args += ["--engine-option", "dtype=float32", "--engine-option", f"kv_cache_memory_bytes={KV_BYTES}"]
    args += ["--engine-option", "max_model_len=512", "--max-num-seqs", "8", "--engine-option", "enforce_eager=true"]
    procs = {i: LlumletProcess(i, args, tmp / f"{i}.log", engine="vllm") for i in ("v0", "v1")}
    try:
        for proc in procs.values():
            proc.spawn()
        for proc in procs.values():
            proc.wait_serving(timeout_s=240)
        yield procs
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.stop()


def test_a_vllm_llumlet_serves_and_migrates_requests_exactly(llumlets: dict[str, LlumletProcess]) -> None:
    cases = {
        "greedy": SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=60, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True),
    }

    async def main() -> list[pb.MigrateOutReply]:
        col = TokenCollector()
        await col.start()
        v0, v1 = LlumletClient(llumlets["v0"].address), LlumletClient(llumlets["v1"].address)
        reports = []
        try:
            for name, sampling in cases.items():
                for rid, client in ((f"ref-{name}", v1), (name, v0)):
                    col.expect(rid, client.address)
                    reply = await client.submit(rid, col.address, sampling, prompt_token_ids=PROMPT)
                    assert reply.accepted, reply.reason
            for name in cases:
                while len(col.get(name).token_ids) < 10:  # mid-decode, KV spans several blocks
                    await asyncio.sleep(0.01)
                rep = await v0.migrate_out(name, v1.address, 1, dst_instance_id="v1", transport=pb.TRANSPORT_GRPC)
                reports.append(rep)
            for name in cases:
                got, ref = await col.wait(name, 120), await col.wait(f"ref-{name}", 120)
                assert got.error == "" and ref.error == "", (got.error, ref.error)
                assert len(got.token_ids) == 60
                assert got.token_ids == ref.token_ids, f"{name}: the migrated stream differs"
            for client in (v0, v1):
                load = await client.get_load()
                assert (load.used_blocks, load.reserved_blocks, load.num_requests) == (0, 0, 0)
        finally:
            await v0.close()
            await v1.close()
            await col.stop()
        return reports

    reports = asyncio.run(main())
    assert [r.outcome for r in reports] == [pb.MIGRATION_COMMITTED] * 2, [r.reason for r in reports]
    assert all(r.transport == "grpc" and r.downtime_s > 0 for r in reports)
    # the references ran on v1 with the same 70-token prompt: its 2 full blocks were in v1's prefix cache,
    # adopted by the reservation and not sent again
    assert [r.cached_blocks for r in reports] == [2, 2]
