"""TorchEngine: real tokens on paged KV blocks, identical to transformers, to batching, preemption and migration."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from llumlet.engine import (
    EngineRequest,
    KVPayload,
    MigrationState,
    RequestTooLargeError,
    SamplingParams,
    StepResult,
)
from llumlet.engine.torch_engine import (
    EXTRA_GENERATOR_STATE,
    EXTRA_MODEL_FINGERPRINT,
    TorchEngine,
    model_fingerprint,
    sample_token,
    tiny_llama,
)

SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """2-core box: one intra-op thread (faster for this tiny model, and no oversubscription)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(name: str = "a", num_blocks: int = 64, block_size_tokens: int = 4, **kw: object) -> TorchEngine:
    kw.setdefault("eos_token_id", None)
    return TorchEngine(name, num_blocks, block_size_tokens, **kw)  # type: ignore[arg-type]


def prompt_ids(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 512) for _ in range(n))


def request(
    rid: str, prompt: Sequence[int], max_tokens: int, params: SamplingParams | None = None, arrival_s: float = 0.0
) -> EngineRequest:
    if params is not None:
        params = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
    return EngineRequest(
        rid, len(prompt), max_tokens, arrival_s=arrival_s, prompt_token_ids=tuple(prompt), sampling_params=params
    )


class Streams:
    """Collects token ids and finish reasons from step results of any number of engines."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}

    def add(self, result: StepResult) -> StepResult:
        for rid, ids in result.token_ids.items():
            assert result.new_tokens[rid] == len(ids) == 1
            self.tokens.setdefault(rid, []).extend(ids)
        for rid in result.finished:
            assert rid not in self.reasons, f"{rid} finished twice"
            self.reasons[rid] = result.finish_reasons[rid]
        return result

    def drain(self, engine: TorchEngine, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not engine.has_work():
                return
            self.add(engine.step())
            engine.blocks.check_invariants()
        raise AssertionError("engine did not finish")


def run_alone(req: EngineRequest, **kw: object) -> list[int]:
    engine = make_engine("alone", **kw)  # type: ignore[arg-type]
    engine.add_request(req)
    streams = Streams()
    streams.drain(engine)
    return streams.tokens[req.request_id]


def assert_baseline(engine: TorchEngine) -> None:
    engine.blocks.check_invariants()
    load = engine.load()
    assert (load.used_blocks, load.reserved_blocks, load.num_suspended) == (0, 0, 0)
    assert load.free_blocks == load.total_blocks
    assert not (engine._generators or engine._params or engine._written)  # per-request state not leaked


# ---- the model ---------------------------------------------------------------------------------------


def test_tiny_llama_is_seeded_small_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(7)
    expected_next = torch.rand(())
    torch.manual_seed(7)
    m0, cfg = tiny_llama(0)
    assert torch.rand(()) == expected_next  # fork_rng: the caller's RNG did not move
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (512, 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert m0.lm_head.weight.dtype == torch.float32
    assert 0.45 < float(m0.lm_head.weight.std()) < 0.55  # initializer_range 0.5
    assert model_fingerprint(m0) == model_fingerprint(tiny_llama(0)[0])
    assert model_fingerprint(m0) != model_fingerprint(tiny_llama(1)[0])
    m3, cfg3 = tiny_llama(0, num_hidden_layers=3)
    assert cfg3.num_hidden_layers == 3 and len(m3.model.layers) == 3
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        tiny_llama(0, hiden_size=32)


def test_greedy_stream_is_varied_not_one_repeated_token() -> None:
    tokens = run_alone(request("r", prompt_ids(1, 12), 40))
    assert len(tokens) == 40
    assert len(set(tokens)) >= 20  # a degenerate init would repeat one or two tokens


@pytest.mark.parametrize(
    ("prompt_len", "block_size", "budget"),
    [(1, 4, 8192), (37, 4, 8192), (37, 16, 8), (50, 16, 8192), (64, 8, 24)],
)
def test_greedy_matches_transformers_generate(prompt_len: int, block_size: int, budget: int) -> None:
    """Paged attention through the block table == transformers' own contiguous-cache greedy decoding."""
    engine = make_engine(block_size_tokens=block_size, max_num_batched_tokens=budget)
    prompt = prompt_ids(prompt_len, prompt_len)
    engine.add_request(request("r", prompt, 30))
    streams = Streams()
    streams.drain(engine)
    with torch.inference_mode():
        out = engine.model.generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert streams.tokens["r"] == out[0, prompt_len:].tolist()
    assert streams.reasons == {"r": "length"}
    assert_baseline(engine)


# ---- sampling ----------------------------------------------------------------------------------------


def test_sample_token_greedy_top_p_and_inverse_cdf() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    g = torch.Generator().manual_seed(0)
    assert sample_token(logits, 0.0, 1.0, g) == 1
    assert torch.equal(g.get_state(), torch.Generator().manual_seed(0).get_state())  # greedy draws nothing
    assert sample_token(torch.tensor([1.0, 3.0, 3.0]), 0.0, 1.0, g) == 1  # first maximum
    # top_p 0.6 keeps {1 (0.5), 2 (0.3)}: the mass before token 2 is 0.5 < 0.6, before token 3 it is 0.8.
    # Kept CDF = [0.5, 0.8]; u * 0.8 < 0.5 (u < 0.625) -> token 1, else token 2.
    seen = set()
    for seed in range(40):
        u = torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).item()
        expected = 1 if u < 0.625 else 2
        assert sample_token(logits, 1.0, 0.6, torch.Generator().manual_seed(seed)) == expected
        seen.add(expected)
    assert seen == {1, 2}
    # top_p 0.5 keeps token 1 only (mass before token 2 is exactly 0.5, not < 0.5)
    assert {sample_token(logits, 1.0, 0.5, g) for _ in range(50)} == {1}
    counts = [0, 0, 0, 0]
    for _ in range(4000):
        counts[sample_token(logits, 1.0, 1.0, g)] += 1
    assert all(abs(c / 4000 - p) < 0.03 for c, p in zip(counts, (0.05, 0.5, 0.3, 0.15), strict=True))


def test_seeded_sampling_is_deterministic_and_seed_dependent() -> None:
    prompt = prompt_ids(5, 20)
    a = run_alone(request("r", prompt, 24, SAMPLED))
    b = run_alone(request("r", prompt, 24, SAMPLED))
    other = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=99)
    c = run_alone(request("r", prompt, 24, other))
    greedy = run_alone(request("r", prompt, 24))
    assert a == b
    assert a != c and a != greedy and c != greedy


def test_unseeded_requests_draw_their_seed_from_the_injected_rng() -> None:
    prompt = prompt_ids(6, 10)
    unseeded = SamplingParams(max_tokens=16, temperature=1.0)
    runs = []
    for rng_seed in (3, 3, 4):
        engine = make_engine(rng=random.Random(rng_seed))
        engine.add_request(request("r", prompt, 16, unseeded))
        streams = Streams()
        streams.drain(engine)
        runs.append(streams.tokens["r"])
    assert runs[0] == runs[1] != runs[2]


def test_eos_stop_token_ids_ignore_eos_and_length() -> None:
    prompt = prompt_ids(8, 9)
    full = run_alone(request("r", prompt, 16))
    i = next(i for i in range(3, 16) if full[i] not in full[:i])  # first fresh token after a few
    eos = full[i]

    def run(params: SamplingParams | None, eos_token_id: int | None = eos) -> tuple[list[int], str]:
        engine = make_engine(eos_token_id=eos_token_id)
        engine.add_request(request("r", prompt, 16, params))
        streams = Streams()
        streams.drain(engine)
        assert_baseline(engine)
        return streams.tokens["r"], streams.reasons["r"]

    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    assert run(greedy) == (full[: i + 1], "stop")  # EOS included in the output, then stop
    assert run(None) == (full[: i + 1], "stop")  # no sampling params = greedy
    ignore = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert run(ignore) == (full, "length")
    j = next(j for j in range(1, 16) if full[j] not in full[:j])
    stop = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=(full[j],))
    assert run(stop) == (full[: j + 1], "stop")  # stop ids still apply with ignore_eos
    engine = make_engine()  # the stop token on the last allowed step: "stop" wins over "length"
    engine.add_request(request("r", prompt, j + 1, SamplingParams(temperature=0.0, stop_token_ids=(full[j],))))
    streams = Streams()
    streams.drain(engine)
    assert (streams.tokens["r"], streams.reasons["r"]) == (full[: j + 1], "stop")


# ---- batching and preemption -------------------------------------------------------------------------


def mixed_requests() -> list[EngineRequest]:
    specs = [(3, 23, 20, None), (17, 5, 14, SAMPLED), (40, 9, 25, None), (61, 1, 9, SAMPLED), (29, 14, 17, None)]
    return [request(f"r{k}", prompt_ids(seed, n), m, p, arrival_s=k) for k, (seed, n, m, p) in enumerate(specs)]


def test_continuous_batching_gives_each_request_its_alone_stream() -> None:
    reqs = mixed_requests()
    alone = {r.request_id: run_alone(r) for r in reqs}
    engine = make_engine(num_blocks=64, max_num_batched_tokens=16)
    streams = Streams()
    batch_sizes, mixed_steps = [], 0
    for k, req in enumerate(reqs):  # arrivals spread over the first steps
        engine.add_request(req)
        for _ in range(k):
            result = streams.add(engine.step())
            batch_sizes.append(result.num_scheduled_seqs)
            mixed_steps += bool(result.num_prefill_tokens and result.num_decode_tokens)
    streams.drain(engine)
    assert max(batch_sizes) >= 3 and mixed_steps >= 3  # really batched, chunked prefill beside decodes
    assert streams.tokens == alone
    assert set(streams.reasons.values()) == {"length"}
    assert_baseline(engine)


def test_preemption_by_recompute_keeps_every_stream_identical() -> None:
    reqs = [request(f"p{k}", prompt_ids(100 + k, 10), 14, SAMPLED if k % 2 else None, arrival_s=k) for k in range(3)]
    alone = {r.request_id: run_alone(r) for r in reqs}
    engine = make_engine(num_blocks=12)  # 48 token slots; each request needs up to 23
    for r in reqs:
        engine.add_request(r)
    streams = Streams()
    preempted: list[str] = []
    while engine.has_work():
        result = streams.add(engine.step())
        preempted.extend(result.preempted)
        engine.blocks.check_invariants()
    assert preempted, "the pool was meant to be too small"
    assert sum(engine.stats[r.request_id].recompute_tokens for r in reqs) > 0
    assert streams.tokens == alone
    assert_baseline(engine)


# ---- migration ---------------------------------------------------------------------------------------


def precopy_migrate(
    src: TorchEngine,
    dst: TorchEngine,
    rid: str,
    streams: Streams,
    steps_per_stage: Sequence[int],
    reservation_id: str,
    corrupt: bool = False,
) -> None:
    """Multi-stage pre-copy as a llumlet drives it; ``corrupt`` negates block 0's K/V in stage 0."""
    bs = src.block_size_tokens
    tokens, blocks = src.request_kv(rid) or (0, 0)
    assert dst.reserve(reservation_id, blocks + sum(steps_per_stage) // bs + 1)
    copied = 0
    for steps in steps_per_stage:  # stage: copy the full blocks, while the source keeps decoding
        full = tokens // bs
        payload = src.read_blocks(rid, copied, full - copied)
        if corrupt and copied == 0 and full > 0:
            data = torch.frombuffer(bytearray(payload.data), dtype=torch.float32).view(
                src.num_layers, 2, full, src.num_kv_heads, bs, src.head_dim
            )
            data[:, :, 0] *= -1.0
            payload = KVPayload(payload.first_block, payload.num_blocks, payload.nbytes, data.numpy().tobytes())
        dst.write_blocks(reservation_id, payload)
        copied = full
        for _ in range(steps):
            streams.add(src.step())
            streams.add(dst.step())
        tokens, blocks = src.request_kv(rid) or (0, 0)
    state = src.suspend(rid)
    assert state is not None
    assert streams.add(src.step()).new_tokens.get(rid) is None  # suspended: not batched
    dst.write_blocks(reservation_id, src.read_blocks(rid, copied, blocks - copied))  # the rest, partial included
    assert dst.commit_incoming(reservation_id, state)
    assert dst.release_reservation(reservation_id) == 0
    assert src.free_migrated(rid) == blocks and src.free_migrated(rid) == 0


@pytest.mark.parametrize("params", [None, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("start_after_steps", [1, 4, 9])
def test_migration_round_trip_gives_the_unmigrated_stream(
    params: SamplingParams | None, start_after_steps: int
) -> None:
    target = request("m", prompt_ids(77, 13), 24, params)
    expected = run_alone(target)
    src, dst = make_engine("src"), make_engine("dst")
    neighbours = mixed_requests()
    src.add_request(neighbours[0])
    dst.add_request(neighbours[1])
    src.add_request(target)
    streams = Streams()
    for _ in range(start_after_steps):
        streams.add(src.step())
        streams.add(dst.step())
    precopy_migrate(src, dst, "m", streams, steps_per_stage=(3, 2), reservation_id="m#1")
    # and back again, with a single stage
    precopy_migrate(dst, src, "m", streams, steps_per_stage=(2,), reservation_id="m#2")
    streams.drain(src)
    streams.drain(dst)
    assert streams.tokens["m"] == expected
    assert streams.reasons["m"] == "length"
    assert streams.tokens[neighbours[0].request_id] == run_alone(neighbours[0])
    assert_baseline(src)
    assert_baseline(dst)


def test_corrupted_block_changes_the_stream() -> None:
    """Negative control: the destination really computes from the copied K/V."""
    target = request("m", prompt_ids(77, 13), 24)
    expected = run_alone(target)
    src, dst = make_engine("src"), make_engine("dst")
    src.add_request(target)
    streams = Streams()
    for _ in range(2):
        streams.add(src.step())
    precopy_migrate(src, dst, "m", streams, steps_per_stage=(2,), reservation_id="m#1", corrupt=True)
    streams.drain(dst)
    assert len(streams.tokens["m"]) == 24
    assert streams.tokens["m"][:4] == expected[:4]  # produced on the source before the copy mattered
    assert streams.tokens["m"] != expected


def test_payload_layout_is_the_pool_tensor_of_the_blocks() -> None:
    engine = make_engine()
    engine.add_request(request("r", prompt_ids(4, 10), 5))
    engine.step()
    assert engine.kv_bytes_per_block == 2 * 2 * 2 * 4 * 16 * 4  # layers x K,V x kv_heads x block x head_dim x 4
    payload = engine.read_blocks("r", 1, 2)
    assert payload.nbytes == len(payload.data) == 2 * engine.kv_bytes_per_block
    table = engine.blocks.block_table("r")
    expected = engine.kv_cache[:, :, list(table[1:3])]
    got = torch.frombuffer(bytearray(payload.data), dtype=torch.float32).view(2, 2, 2, 2, 4, 16)
    assert torch.equal(got, expected)
    assert bool(got[:, :, 1, :, :2].abs().sum() > 0)  # positions 8, 9 hold real K/V


def test_write_and_commit_validate_incoming_data() -> None:
    src, dst = make_engine("src"), make_engine("dst")
    src.add_request(request("r", prompt_ids(4, 10), 8, SAMPLED))
    src.step()
    payload = src.read_blocks("r", 0, 3)
    assert dst.reserve("m", 3)
    with pytest.raises(ValueError, match=r"3 blocks need 6144 bytes of float32\[2, 2, 3, 2, 4, 16\], got data of 6140"):
        dst.write_blocks("m", KVPayload(0, 3, payload.nbytes, payload.data[:-4]))
    with pytest.raises(ValueError, match="nbytes = 5"):
        dst.write_blocks("m", KVPayload(0, 3, 5, payload.data))
    dst.write_blocks("m", KVPayload(0, 2, 2 * src.kv_bytes_per_block, payload.data[: 2 * src.kv_bytes_per_block]))
    state = src.suspend("r")
    assert state is not None
    with pytest.raises(ValueError, match=r"block positions \[2\] .* never written"):
        dst.commit_incoming("m", state)
    dst.write_blocks("m", src.read_blocks("r", 2, 1))
    other = make_engine("other", model_seed=1)
    assert other.reserve("m", 3)
    other.write_blocks("m", payload)
    with pytest.raises(ValueError, match="model fingerprint"):
        other.commit_incoming("m", state)
    other_eos = make_engine("other_eos", eos_token_id=2)
    assert other_eos.reserve("m", 3)
    other_eos.write_blocks("m", payload)
    with pytest.raises(ValueError, match="source stops on eos_token_id None, this engine on 2"):
        other_eos.commit_incoming("m", state)
    bad_gen = {**state.extra, EXTRA_GENERATOR_STATE: b"xx"}
    with pytest.raises(ValueError, match="generator_state"):
        dst.commit_incoming("m", _with_extra(state, bad_gen))
    with pytest.raises(ValueError, match="model fingerprint"):
        dst.commit_incoming("m", _with_extra(state, {EXTRA_GENERATOR_STATE: state.extra[EXTRA_GENERATOR_STATE]}))
    assert state.extra[EXTRA_MODEL_FINGERPRINT] == dst.model_fingerprint
    assert dst.load().used_blocks == 0 and dst.load().reserved_blocks == 3  # failed commits changed nothing
    assert dst.commit_incoming("m", state)
    assert src.free_migrated("r") == 3
    assert other.release_reservation("m") == 3
    streams = Streams()
    streams.drain(dst)
    assert len(streams.tokens["r"]) == 7
    assert_baseline(dst)


def _with_extra(state: MigrationState, extra: dict[str, object]) -> MigrationState:
    return dataclasses.replace(state, extra=extra)


def test_migratable_refuses_queued_and_prefilling_requests() -> None:
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request(request("long", prompt_ids(1, 20), 4))
    engine.add_request(request("queued", prompt_ids(2, 4), 4, arrival_s=1.0))
    assert engine.migratable("nope") == "a: unknown request 'nope'"
    assert engine.migratable("long") == "a: request 'long' is waiting, not running"
    engine.step()  # 8 of 20 prompt tokens
    assert engine.migratable("long") == "a: request 'long' is still in prefill"
    assert engine.suspend("long") is None
    assert engine.migratable("queued") == "a: request 'queued' is waiting, not running"
    while engine.request_kv("long") != (20, 5):
        engine.step()
    assert engine.migratable("long") is None


def test_add_request_validates_token_ids_and_sizes() -> None:
    engine = make_engine(num_blocks=4)  # 16 token slots
    with pytest.raises(ValueError, match="needs prompt_token_ids"):
        engine.add_request(EngineRequest("r", 3, 2))
    with pytest.raises(ValueError, match=r"token ids \[512\] outside the vocabulary"):
        engine.add_request(request("r", (1, 512), 2))
    with pytest.raises(ValueError, match=r"sampling_params\.max_tokens = 16 != max_tokens = 2"):
        engine.add_request(EngineRequest("r", 1, 2, prompt_token_ids=(5,), sampling_params=SamplingParams()))
    with pytest.raises(RequestTooLargeError, match="needs 17 KV tokens"):
        engine.add_request(request("r", prompt_ids(1, 10), 8))
    with pytest.raises(ValueError, match="eos_token_id = 600 outside"):
        make_engine(eos_token_id=600)
    engine.add_request(request("r", prompt_ids(1, 10), 7))
    with pytest.raises(ValueError, match="already in this engine"):
        engine.add_request(request("r", prompt_ids(1, 10), 7))


def test_recomputed_prefix_blocks_hold_the_sources_kv_and_give_the_unmigrated_stream() -> None:
    # 13 prompt tokens, blocks of 4: blocks 0-2 hold prompt tokens only. The destination re-prefills them from the
    # prompt's ids instead of receiving them; the rest is copied. The KV matches the source's, the stream too.
    target = request("m", prompt_ids(77, 13), 24)
    expected = run_alone(target)
    src, dst = make_engine("src"), make_engine("dst")
    assert dst.prefill_time_s(64, 0) is None  # nothing prefilled yet: no estimate, a migration here copies
    src.add_request(target)
    streams = Streams()
    for _ in range(3):
        streams.add(src.step())
    _, blocks = src.request_kv("m") or (0, 0)
    assert dst.reserve("m#1", blocks + 2)
    with pytest.raises(ValueError, match="need 16 prompt tokens, got 13"):
        dst.recompute_prefix("m#1", prompt_ids(77, 13), 0, 4)
    with pytest.raises(ValueError, match="positions before block 1 hold no KV"):
        dst.recompute_prefix("m#1", prompt_ids(77, 13), 1, 2)
    with pytest.raises(IndexError, match="exceed the reservation"):
        dst.recompute_prefix("m#1", prompt_ids(77, 13), 0, blocks + 3)
    with pytest.raises(KeyError, match="unknown reservation"):
        dst.recompute_prefix("nope", prompt_ids(77, 13), 0, 1)
    assert dst.recompute_prefix("m#1", prompt_ids(77, 13), 0, 3) == 0.0  # computed here: nothing left to wait
    held = dst.blocks.reservation_blocks("m#1") or ()
    source = src.kv_cache[:, :, list(src.blocks.block_table("m")[:3])]
    assert torch.allclose(dst.kv_cache[:, :, list(held[:3])], source, atol=1e-5)
    estimate = dst.prefill_time_s(120, 0)
    assert estimate is not None and estimate > 0  # measured on that re-prefill: 120 tokens at its rate
    assert dst.prefill_time_s(240, 0) == pytest.approx(2 * estimate)
    assert dst.load().prefill_s_per_token == pytest.approx(estimate / 120)
    state = src.suspend("m")
    assert state is not None
    dst.write_blocks("m#1", src.read_blocks("m", 3, blocks - 3))
    assert dst.commit_incoming("m#1", state)
    assert src.free_migrated("m") == blocks
    streams.drain(dst)
    assert streams.tokens["m"] == expected
