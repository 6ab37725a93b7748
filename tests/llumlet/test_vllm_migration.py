"""Live migration between two vLLM engines: the moved request continues exactly as if it had stayed.

A request decodes on ``src``; its KV moves in pre-copy stages (full blocks while it keeps decoding, then
the rest after ``suspend``); ``dst`` re-admits it with its KV loaded by the connector (nothing recomputed)
and the sampling generator restored. Its token stream (and its logprobs) must equal those of the same
request run without migration. A negative control corrupts one moved block and sees the stream change, which
proves the destination really attends over the moved KV. What cannot move faithfully (frequency / presence
penalties, guided decoding) is refused with a reason, and the load report says so.

Runs only where vLLM is importable (``make test-vllm``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make test-vllm` builds .venv-vllm and runs these", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from llumlet.engine.vllm_engine import EXTRA_GENERATOR_STATE, VllmEngine, tiny_llama_checkpoint
    from llumlet.engine.vllm_internals import UnsupportedVllmError, check_vllm_version

from llumlet.engine import EngineRequest, KVPayload, SamplingParams
from llumlet.engine.types import GuidedDecoding, TokenLogprobs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

BLOCK = 32
PROMPT = tuple(random.Random(7).randrange(3, 512) for _ in range(60))  # 60 tokens: 1 full block + 28
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[VllmEngine, VllmEngine]:
    model = tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
    return make_engine("src", model), make_engine("dst", model)


def make_engine(name: str, model: Path, num_blocks: int = 32) -> VllmEngine:
    per_block = 2 * 2 * 2 * BLOCK * 32 * 4
    return VllmEngine(
        name,
        str(model),
        block_size_tokens=BLOCK,
        kv_cache_memory_bytes=(num_blocks + 1) * per_block,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        rng=random.Random(99),
        engine_kwargs={"enforce_eager": True},  # no torch.compile on CPU: minutes on 2 cores
    )


@pytest.fixture
def pair(engines: tuple[VllmEngine, VllmEngine]) -> Iterator[tuple[VllmEngine, VllmEngine]]:
    yield engines
    for engine in engines:
        for rid in list(engine._tracked):
            engine.abort(rid)
        for res in list(engine._reservations):
            engine.release_reservation(res)
        assert engine.load().used_blocks == 0


def request(rid: str, params: SamplingParams, prompt: tuple[int, ...] = PROMPT) -> EngineRequest:
    return EngineRequest(rid, len(prompt), params.max_tokens, prompt_token_ids=prompt, sampling_params=params)


LOGPROBS: dict[str, list[TokenLogprobs]] = {}  # request id -> logprobs of the last run/steps that saw it


def _take(engine: VllmEngine, streams: dict[str, list[int]]) -> None:
    result = engine.step()
    for rid, ids in result.token_ids.items():
        streams.setdefault(rid, []).extend(ids)
    for rid, lps in result.logprobs.items():
        LOGPROBS.setdefault(rid, []).extend(lps)


def run(engine: VllmEngine, streams: dict[str, list[int]], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        _take(engine, streams)
    raise AssertionError("did not finish")


def steps(engine: VllmEngine, n: int, streams: dict[str, list[int]]) -> None:
    for _ in range(n):
        _take(engine, streams)


def reference(engine: VllmEngine, params: SamplingParams, prompt: tuple[int, ...] = PROMPT) -> list[int]:
    streams: dict[str, list[int]] = {}
    LOGPROBS.pop("ref", None)
    engine.add_request(request("ref", params, prompt))
    run(engine, streams)
    return streams["ref"]


def migrate_mid_decode(
    src: VllmEngine,
    dst: VllmEngine,
    rid: str,
    streams: dict[str, list[int]],
    corrupt_block: int | None = None,
) -> None:
    """Pre-copy in two stages while decoding (crossing a block boundary), then suspend, last stage, commit."""
    copied = 0

    def copy_full_blocks(limit: int | None = None) -> None:
        nonlocal copied
        _tokens, blocks = src.request_kv(rid) or (0, 0)
        upto = blocks if limit is None else min(limit, blocks)
        payload = src.read_blocks(rid, copied, upto - copied)
        if corrupt_block is not None and copied <= corrupt_block < upto:
            data = bytearray(payload.data)
            start = (corrupt_block - copied) * src.kv_bytes_per_block // len(src._h.kv_caches)
            data[start : start + 4096] = bytes(4096)  # zero part of layer 0's block
            payload = KVPayload(payload.first_block, payload.num_blocks, payload.nbytes, bytes(data))
        dst.write_blocks("mig", payload)
        copied = upto

    steps(src, 3, streams)  # prefill + 2 decodes: 62 tokens cached
    tokens, blocks = src.request_kv(rid) or (0, 0)
    assert (tokens, blocks) == (62, 2)
    assert dst.reserve("mig", 4)
    copy_full_blocks(tokens // BLOCK)  # stage 0: block 0 (full)
    steps(src, 4, streams)  # the request keeps decoding: 66 tokens, a third block
    tokens, _ = src.request_kv(rid) or (0, 0)
    copy_full_blocks(tokens // BLOCK)  # stage 1: block 1 (now full)
    steps(src, 1, streams)
    state = src.suspend(rid)
    assert state is not None and state.num_output_tokens == 8 and state.num_computed_tokens == 67
    copy_full_blocks()  # last stage: the partial block 2
    assert dst.commit_incoming("mig", state)
    assert src.free_migrated(rid) == 3


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_migrated_request_continues_identically(pair: tuple[VllmEngine, VllmEngine], params: SamplingParams) -> None:
    src, dst = pair
    expected = reference(src, params)
    streams: dict[str, list[int]] = {}
    src.add_request(request("r", params))
    migrate_mid_decode(src, dst, "r", streams)
    first = dst.step()
    assert (first.num_prefill_tokens, first.token_ids.keys()) == (1, {"r"})  # nothing recomputed
    streams["r"].extend(first.token_ids["r"])
    run(dst, streams)
    assert len(streams["r"]) == 40
    assert streams["r"] == expected


def test_migrated_request_is_unaffected_by_its_new_batch(pair: tuple[VllmEngine, VllmEngine]) -> None:
    src, dst = pair
    expected = reference(src, SEEDED)
    streams: dict[str, list[int]] = {}
    src.add_request(request("r", SEEDED))
    dst.add_request(request("local", dataclasses.replace(SEEDED, seed=5), PROMPT[:33]))
    steps(dst, 2, streams)
    migrate_mid_decode(src, dst, "r", streams)
    run(dst, streams)
    assert streams["r"] == expected and len(streams["local"]) == 40


def test_unseeded_random_sampling_gets_a_seed_that_moves(pair: tuple[VllmEngine, VllmEngine]) -> None:
    src, dst = pair
    params = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True)
    streams: dict[str, list[int]] = {}
    src.add_request(request("r", params))
    steps(src, 2, streams)
    state = src.suspend("r")
    assert state is not None and state.sampling_params is not None
    seed = state.sampling_params.seed
    assert seed is not None and isinstance(state.extra[EXTRA_GENERATOR_STATE], bytes)
    assert src.resume("r")
    migrate_rest(src, dst, "r", streams)
    run(dst, streams)
    assert streams["r"] == reference(src, dataclasses.replace(params, seed=seed))


def migrate_rest(src: VllmEngine, dst: VllmEngine, rid: str, streams: dict[str, list[int]]) -> None:
    """One-stage migration: suspend, copy every block, commit."""
    state = src.suspend(rid)
    assert state is not None
    _tokens, blocks = src.request_kv(rid) or (0, 0)
    assert dst.reserve("one", blocks + 1)
    dst.write_blocks("one", src.read_blocks(rid, 0, blocks))
    assert dst.commit_incoming("one", state)
    assert src.free_migrated(rid) == blocks


def test_repetition_penalty_top_k_min_tokens_and_logprobs_are_carried(pair: tuple[VllmEngine, VllmEngine]) -> None:
    src, dst = pair
    params = dataclasses.replace(
        SEEDED, ignore_eos=False, seed=77, repetition_penalty=1.3, top_k=50, min_tokens=20, logprobs=3
    )
    expected = reference(src, params)
    expected_logprobs = LOGPROBS.pop("ref")
    streams: dict[str, list[int]] = {}
    LOGPROBS.pop("r", None)
    src.add_request(request("r", params))
    steps(src, 5, streams)
    assert src.migratable("r") is None
    migrate_rest(src, dst, "r", streams)
    run(dst, streams)
    assert streams["r"] == expected and len(expected) >= 20
    assert len(expected_logprobs) == len(expected) and all(len(lp.top) == 3 for lp in expected_logprobs)
    got = LOGPROBS.pop("r")
    assert [lp.top[0][0] for lp in got] == [lp.top[0][0] for lp in expected_logprobs]
    for a, b in zip(got, expected_logprobs, strict=True):  # the destination computes the same distribution
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (dataclasses.replace(GREEDY, frequency_penalty=0.5), "frequency/presence penalty (0.5, 0.0): vLLM counts"),
        (dataclasses.replace(GREEDY, presence_penalty=0.5), "frequency/presence penalty (0.0, 0.5): vLLM counts"),
    ],
    ids=["frequency", "presence"],
)
def test_what_cannot_move_faithfully_is_refused(
    pair: tuple[VllmEngine, VllmEngine], params: SamplingParams, reason: str
) -> None:
    src, _dst = pair
    src.add_request(request("r", params))
    steps(src, 2, {})
    refusal = src.migratable("r")
    assert refusal is not None and reason in refusal
    (running,) = src.load().running
    assert reason in running.unmigratable_reason  # no scheduler plans a move it would refuse
    assert not src.load().to_instance_load("src", "d").running[0].migratable
    assert src.suspend("r") is None
    assert src.abort("r")


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (dataclasses.replace(GREEDY, presence_penalty=0.5), "frequency/presence penalty (0.0, 0.5)"),
        (dataclasses.replace(GREEDY, guided=GuidedDecoding("json_object")), "guided decoding (json_object)"),
    ],
    ids=["presence", "guided"],
)
def test_a_destination_refuses_a_state_that_cannot_move(
    pair: tuple[VllmEngine, VllmEngine], params: SamplingParams, reason: str
) -> None:
    """A source that did not check: the destination's commit refuses it, changing nothing."""
    src, dst = pair
    src.add_request(request("g", GREEDY))
    steps(src, 2, {})
    moved = src.suspend("g")
    assert moved is not None
    assert dst.reserve("x", 4)
    with pytest.raises(ValueError, match=re.escape(reason)):
        dst.commit_incoming("x", dataclasses.replace(moved, sampling_params=params))
    assert dst.release_reservation("x") == 4
    assert src.resume("g") and src.abort("g")


def fresh_prompt(seed: int) -> tuple[int, ...]:
    """60 tokens no engine has cached yet (the engines live for the module; prefix caching is on)."""
    return tuple(random.Random(seed).randrange(3, 512) for _ in range(60))


def test_negative_control_corrupted_blocks_change_the_output(pair: tuple[VllmEngine, VllmEngine]) -> None:
    src, dst = pair
    prompt = fresh_prompt(101)
    expected = reference(src, GREEDY, prompt=prompt)
    streams: dict[str, list[int]] = {}
    src.add_request(request("r", GREEDY, prompt))
    migrate_mid_decode(src, dst, "r", streams, corrupt_block=0)
    before = list(streams["r"])
    assert before == expected[: len(before)]  # the source's part is intact
    run(dst, streams)
    assert streams["r"] != expected  # the destination attended over the zeroed keys/values


def test_a_move_never_writes_into_blocks_shared_on_the_destination(pair: tuple[VllmEngine, VllmEngine]) -> None:
    """The issue's corruption: the destination already runs ``b``, whose first block holds the same 32 prompt
    tokens as the moved request's. A corrupted copy of that block arrives with the move; ``b``'s stream must
    not change, and the moved request gets the destination's own cached block (what the destination caches
    is used, not overwritten)."""
    src, dst = pair
    prompt = fresh_prompt(202)
    expected = reference(src, GREEDY, prompt=prompt)
    expected_b = reference(src, GREEDY, prompt=prompt[:40])
    streams: dict[str, list[int]] = {}
    dst.add_request(request("b", GREEDY, prompt[:40]))
    steps(dst, 2, streams)
    src.add_request(request("r", GREEDY, prompt))
    migrate_mid_decode(src, dst, "r", streams, corrupt_block=0)
    assert dst.load().cached_blocks == 0 and dst.load().reserved_blocks == 3  # held for "r" until it runs
    run(dst, streams)
    assert streams["b"] == expected_b
    assert streams["r"] == expected
    assert dst.load().reserved_blocks == 0


def test_what_the_destination_caches_is_not_sent_again(pair: tuple[VllmEngine, VllmEngine]) -> None:
    """The destination ran the same prompt before: its first block is in its prefix cache. The reservation
    adopts it (held, never written), the source sends only the blocks after it, and the stream is the same."""
    src, dst = pair
    prompt = fresh_prompt(303)
    expected = reference(dst, GREEDY, prompt=prompt)  # leaves the prompt's full block cached on dst
    streams: dict[str, list[int]] = {}
    src.add_request(request("r", GREEDY, prompt))
    steps(src, 5, streams)
    tokens, blocks = src.request_kv("r") or (0, 0)
    assert (tokens, blocks) == (64, 2)
    assert dst.reserve("pc", blocks + 1)
    assert dst.adopt_cached_prefix("pc", prompt) == 1  # 60 prompt tokens: one full block of 32
    assert dst.adopt_cached_prefix("pc", prompt) == 0  # once only (it would shift written positions)
    state = src.suspend("r")
    assert state is not None
    _tokens, blocks = src.request_kv("r") or (0, 0)
    dst.write_blocks("pc", src.read_blocks("r", 1, blocks - 1))  # block 0 is not sent
    assert dst.commit_incoming("pc", state)
    src.free_migrated("r")
    run(dst, streams)
    assert streams["r"] == expected


def test_refused_engine_args_are_named() -> None:
    with pytest.raises(ValueError, match="engine_kwargs\\['async_scheduling'\\] = True: with async scheduling"):
        VllmEngine("x", "unused", engine_kwargs={"async_scheduling": True})
    with pytest.raises(ValueError, match="tensor_parallel_size'\\] = 2: tensor parallelism needs"):
        VllmEngine("x", "unused", engine_kwargs={"tensor_parallel_size": 2})


def test_version_check_names_the_supported_range() -> None:
    for ok in ("0.32.0", "0.32.0+cpu", "0.32.3", "0.32.1rc1"):
        check_vllm_version(ok)
    for bad in ("0.31.9", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(
            UnsupportedVllmError, match=rf"vLLM {bad} is outside .* \(>=0\.32\.0,<0\.33\.0; tested: 0\.32\.0\)"
        ):
            check_vllm_version(bad)
    check_vllm_version("0.31.0", allow_untested=True)
