"""Pure parts of the llumlet: token bucket, wire codecs, backend factory, transport choice, push merging,
and the TokenCollector's exactly-once assembly."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import token_sink_pb2 as sink_pb
from llumlet.backends import BackendConfig, UnknownBackendError, make_backend
from llumlet.convert import (
    UnmovableStateError,
    decode_extra,
    encode_extra,
    load_from_pb,
    load_to_pb,
    logprobs_from_pb,
    logprobs_to_pb,
    request_from_submit,
    sampling_from_pb,
    sampling_to_pb,
    state_from_pb,
    state_to_pb,
)
from llumlet.engine.core import EngineCore
from llumlet.engine.types import (
    EngineLoad,
    GuidedDecoding,
    MigrationState,
    RunningRequestLoad,
    SamplingFeature,
    SamplingParams,
    TokenLogprobs,
)
from llumlet.sink import TokenCollector
from llumlet.tokens import PushOutcome, TokenChunkOut, _merge
from llumlet.transport import (
    GrpcStreamTransport,
    LocalTransport,
    TokenBucket,
    TransportName,
    TransportUnavailable,
    choose_transport,
    nixl_available,
)
from topology.graph import TopologyGraph
from topology.load import parse_topology

TWO_DOMAINS = {
    "name": "two-domains-test",
    "models": [
        {
            "name": "llama-2-7b",
            "num_layers": 32,
            "num_attention_heads": 32,
            "num_kv_heads": 32,
            "head_dim": 128,
            "hidden_size": 4096,
            "dtype": "float16",
            "block_size_tokens": 16,
            "num_params": 6738415616,
            "max_context_tokens": 4096,
        }
    ],
    "gpu_types": [{"name": "a100-80gb", "memory_gib": 80, "hbm_gbyte_per_s": 2039, "nvlink_gbyte_per_s": 600}],
    "domains": [
        {
            "id": dom,
            "kind": "node",
            "gpu_type": "a100-80gb",
            "nodes": [{"id": f"node-{dom}", "num_gpus": 2, "nic_gbit_per_s": 100}],
            "instances": [
                {
                    "id": f"{dom}0",
                    "gpus": [0],
                    "tensor_parallel_size": 1,
                    "model": "llama-2-7b",
                    "kv_capacity_blocks": 512,
                },
                {
                    "id": f"{dom}1",
                    "gpus": [1],
                    "tensor_parallel_size": 1,
                    "model": "llama-2-7b",
                    "kv_capacity_blocks": 512,
                },
            ],
        }
        for dom in ("a", "b")
    ],
    "fabric": {"oversubscription": 1.0, "racks": [{"id": "rack-0", "domains": ["a", "b"]}]},
}


# ---- token bucket ---------------------------------------------------------------------------------
def test_token_bucket_waits_out_its_debt_at_the_rate() -> None:
    now = [0.0]
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    async def main() -> None:
        bucket = TokenBucket(100.0, 50.0, clock=lambda: now[0], sleep=sleep)
        assert await bucket.consume(30) == 0.0  # 50 - 30 = 20 left
        assert await bucket.consume(70) == pytest.approx(0.5)  # 20 - 70 = -50 -> 0.5 s at 100 B/s
        assert await bucket.consume(10) == pytest.approx(0.1)  # refilled to 0 while waiting; -10 -> 0.1 s
        now[0] += 10.0  # idle: refills to the burst only
        assert await bucket.consume(50) == 0.0
        assert await bucket.consume(1) == pytest.approx(0.01)

        empty = TokenBucket(100.0, 50.0, clock=lambda: now[0], sleep=sleep, initial_bytes=0.0)
        assert await empty.consume(10) == pytest.approx(0.1)  # a migration's bucket starts empty

    asyncio.run(main())
    assert sum(waits) == pytest.approx(0.71)


def test_token_bucket_rejects_bad_rates() -> None:
    with pytest.raises(ValueError, match="rate_bytes_per_s = 0"):
        TokenBucket(0, 1)
    with pytest.raises(ValueError, match="burst_bytes = -1"):
        TokenBucket(1, -1)


# ---- codecs ---------------------------------------------------------------------------------------
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text().filter(lambda k: not k.startswith("__")), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(deadline=None)  # a loaded 2-core CI machine: time is no part of this property
@given(st.dictionaries(st.text(min_size=1).filter(lambda k: not k.startswith("__")), _values, max_size=4))
def test_extra_codec_round_trips_exactly(extra: dict[str, object]) -> None:
    back = decode_extra(encode_extra(extra))
    assert repr(back) == repr(extra)  # repr: nan != nan, but the round trip must keep it


def test_extra_codec_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(UnmovableStateError, match=r"extra\['rng'\]: a set cannot be migrated"):
        encode_extra({"rng": {1, 2}})
    with pytest.raises(UnmovableStateError, match="key 3 is not a plain str"):
        encode_extra({"d": {3: "x"}})


def test_state_round_trips_through_protobuf() -> None:
    state = MigrationState(
        request_id="r",
        prompt_tokens=3,
        num_output_tokens=2,
        num_computed_tokens=4,
        max_tokens=9,
        priority=1,
        arrival_s=12.5,
        prompt_token_ids=(5, 6, 7),
        output_token_ids=(8, 9),
        sampling_params=SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=42, stop_token_ids=(2,)),
        extra={"generator_state": b"\x00\x01", "eos_token_id": None, "model_fingerprint": "ab"},
    )
    assert state_from_pb(state_to_pb(state)) == state
    bare = MigrationState("s", 10, 1, 10, 5, 0, 0.0)
    assert state_from_pb(state_to_pb(bare)) == bare


def test_every_sampling_field_round_trips_through_the_wire() -> None:
    full = SamplingParams(
        max_tokens=30, temperature=0.5, top_p=0.8, seed=-7, ignore_eos=True, stop_token_ids=(3, 4), top_k=12,
        min_tokens=5, repetition_penalty=1.15, frequency_penalty=-0.5, presence_penalty=1.5, logprobs=0,
        guided=GuidedDecoding("json_schema", '{"type": "object"}'),
    )  # fmt: skip
    assert sampling_from_pb(sampling_to_pb(full)) == full
    assert sampling_from_pb(sampling_to_pb(SamplingParams())) == SamplingParams()  # "off" stays off (unset)
    assert not sampling_to_pb(SamplingParams()).HasField("logprobs")
    assert full.features() == frozenset(SamplingFeature) and SamplingParams().features() == frozenset()
    state = MigrationState("m", 4, 1, 4, 30, 0, 0.0, prompt_token_ids=(1, 2, 3, 4), output_token_ids=(9,),
                           sampling_params=full)  # fmt: skip
    assert state_from_pb(state_to_pb(state)).sampling_params == full  # and through a migration
    entry = TokenLogprobs(-0.25, ((7, -0.1), (8, -2.5)))
    assert logprobs_from_pb(logprobs_to_pb(entry)) == entry
    with pytest.raises(ValueError, match="2 top_token_ids but 1 top_logprobs"):
        logprobs_from_pb(sink_pb.TokenLogprobs(logprob=0.0, top_token_ids=[1, 2], top_logprobs=[0.0]))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"top_k": -1}, "top_k = -1: need >= 0"),
        ({"min_tokens": 20}, "min_tokens = 20: need 0 <= min_tokens <= max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty = 0.0: need > 0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty = 2.5: need -2 <= frequency_penalty <= 2"),
        ({"logprobs": 21}, "logprobs = 21: need 0..20 or None"),
    ],
)
def test_sampling_params_refuse_values_out_of_range(change: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(max_tokens=16, **change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spec is empty"):
        GuidedDecoding("regex")


def test_backends_refuse_features_they_do_not_honour_by_name() -> None:
    sim = make_backend("sim", BackendConfig(instance_id="x"))
    assert sim.sampling_features == {SamplingFeature.PENALTIES, SamplingFeature.TOP_K, SamplingFeature.MIN_TOKENS}
    assert sim.refuses(SamplingParams(top_k=3, frequency_penalty=1.0)) is None
    assert sim.refuses(None) is None
    assert sim.refuses(SamplingParams(logprobs=1, stop_token_ids=(2,))) == (
        "the sim engine does not honour logprobs, stop_token_ids (it honours: min_tokens, penalties, top_k)"
    )
    torch_backend = make_backend("torch", BackendConfig(instance_id="x", num_blocks=8))
    assert torch_backend.refuses(SamplingParams(logprobs=1, top_k=2, min_tokens=1, presence_penalty=1)) is None
    assert "does not honour guided_decoding" in (
        torch_backend.refuses(SamplingParams(guided=GuidedDecoding("json_object"))) or ""
    )


def test_an_unmigratable_request_is_not_a_migration_candidate() -> None:
    from rack_sched.convert import load_from_pb as rack_load_from_pb

    load = EngineLoad(
        total_blocks=10,
        used_blocks=4,
        reserved_blocks=0,
        cached_blocks=0,
        running=(
            RunningRequestLoad("a", 2, 0, 20, True),
            RunningRequestLoad("b", 2, 0, 20, True, unmigratable_reason="stop strings in the engine"),
        ),
    )
    report = load_to_pb(load, "i0", "d")
    assert load_from_pb(report) == load
    assert [r.migratable for r in load.to_instance_load("i0", "d").running] == [True, False]
    assert [r.migratable for r in rack_load_from_pb(report, "i0", "d").running] == [True, False]


def test_submit_is_checked_field_by_field() -> None:
    ok = pb.SubmitRequest(request_id="r", prompt_tokens=0, prompt_token_ids=[4, 5], origin="h:1")
    ok.sampling.CopyFrom(sampling_to_pb(SamplingParams(max_tokens=3, seed=1)))
    req = request_from_submit(ok, arrival_s=7.0)
    assert (req.prompt_tokens, req.prompt_token_ids, req.max_tokens, req.arrival_s) == (2, (4, 5), 3, 7.0)
    assert req.sampling_params == SamplingParams(max_tokens=3, seed=1)
    cases: list[tuple[dict[str, object], str]] = [
        ({"request_id": ""}, "request_id is empty"),
        ({"origin": ""}, "origin is empty"),
        ({"prompt_token_ids": []}, "no prompt"),
        ({"prompt_tokens": 3}, "prompt_tokens = 3 but 2 prompt_token_ids"),
    ]
    for change, message in cases:
        bad = pb.SubmitRequest()
        bad.CopyFrom(ok)
        for key, value in change.items():
            if isinstance(value, list):
                del bad.prompt_token_ids[:]
            else:
                setattr(bad, key, value)
        with pytest.raises(ValueError, match=message):
            request_from_submit(bad, 0.0)
    no_max = pb.SubmitRequest(request_id="r", prompt_tokens=4, origin="h:1")
    with pytest.raises(ValueError, match=r"sampling.max_tokens must be >= 1"):
        request_from_submit(no_max, 0.0)


# ---- backends -------------------------------------------------------------------------------------
def test_backend_factory_knows_its_names() -> None:
    with pytest.raises(UnknownBackendError, match=r"unknown engine backend 'trtllm'; known: sim, torch, vllm"):
        make_backend("trtllm", BackendConfig(instance_id="x"))
    with pytest.raises(ValueError, match="model=PATH_OR_NAME is required"):
        make_backend("vllm", BackendConfig(instance_id="x"))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['colour'\]"):
        make_backend("vllm", BackendConfig(instance_id="x", options={"model": "m", "colour": "red"}))


def test_sim_backend_takes_sizes_and_latency_from_the_topology() -> None:
    topo = parse_topology(TWO_DOMAINS, "test")
    backend = make_backend("sim", BackendConfig(instance_id="b1", topology=topo, time_scale=0.5))
    engine = backend.engine
    assert isinstance(engine, EngineCore)
    assert engine.load().total_blocks == 512
    assert engine.block_size_tokens == 16
    assert engine.kv_bytes_per_block == 16 * 524_288  # 2 x 32 layers x 32 heads x 128 x 2 bytes per token
    assert engine.latency_model.model == "llama-2-7b" and engine.latency_model.gpu == "a100"
    assert not backend.real_token_ids
    override = make_backend("sim", BackendConfig(instance_id="b1", topology=topo, num_blocks=7, block_size_tokens=4))
    assert override.engine.load().total_blocks == 7 and override.engine.block_size_tokens == 4
    with pytest.raises(KeyError):
        make_backend("sim", BackendConfig(instance_id="nope", topology=topo))
    with pytest.raises(ValueError, match="time_scale = -1"):
        BackendConfig(instance_id="x", time_scale=-1)


# ---- transport choice ------------------------------------------------------------------------------
def test_transport_follows_the_nvlink_domain_and_caps_the_network() -> None:
    graph = TopologyGraph(parse_topology(TWO_DOMAINS, "test"))
    inside = choose_transport(None, graph, "a0", "a1", cap_fraction=0.2, pool=b"handle")
    assert isinstance(inside, LocalTransport) and inside.rate_cap_bytes_per_s == 0.0
    assert (inside.pool, inside.mode) == (b"handle", "local")
    inline = choose_transport(None, graph, "a0", "a1", cap_fraction=0.2)  # the engine's pool is not shareable
    assert inline.name is TransportName.LOCAL and inline.mode == "local-inline"
    across = choose_transport(None, graph, "a0", "b1", cap_fraction=0.2)
    assert isinstance(across, GrpcStreamTransport)
    assert across.rate_cap_bytes_per_s == pytest.approx(100e9 / 8 * 0.2)  # 100 Gb/s NIC x 20%
    configured = choose_transport(None, graph, "a0", "b1", cap_fraction=0.2, grpc_rate_cap_bytes_per_s=5e6)
    assert configured.rate_cap_bytes_per_s == 5e6
    forced = choose_transport(
        TransportName.GRPC, graph, "a0", "a1", cap_fraction=0.2, override_rate_cap_bytes_per_s=1e6
    )
    assert forced.name is TransportName.GRPC and forced.rate_cap_bytes_per_s == 1e6
    no_topology = choose_transport(None, None, "x", "y", cap_fraction=0.2)
    assert no_topology.name is TransportName.GRPC and no_topology.rate_cap_bytes_per_s == 0.0
    with pytest.raises(KeyError):
        choose_transport(None, graph, "a0", "zz", cap_fraction=0.2)


def test_nixl_is_refused_by_name() -> None:
    why = "not installed here" if not nixl_available() else "does not drive NIXL transfers yet"
    with pytest.raises(TransportUnavailable, match=f"transport 'nixl'.*{why}"):
        choose_transport(TransportName.NIXL, None, "a0", "b1", cap_fraction=0.2)


# ---- pushes and the collector ---------------------------------------------------------------------
def test_push_merging_joins_contiguous_chunks_per_request() -> None:
    batch = [
        TokenChunkOut("r", 0, [10], 0),
        TokenChunkOut("s", 5, [7], 1),
        TokenChunkOut("r", 1, [11, 12], 0),
        TokenChunkOut("r", 3, [], 0, finished=True, finish_reason="length"),
        TokenChunkOut("s", 9, [8], 1),  # not contiguous: its own push
    ]
    merged = _merge(batch)
    assert list(merged) == ["r", "s"]
    (r,) = merged["r"]
    assert (r.first_seq, r.token_ids, r.finished, r.finish_reason, r.merged) == (0, [10, 11, 12], True, "length", 3)
    assert [(c.first_seq, c.token_ids) for c in merged["s"]] == [(5, [7]), (9, [8])]
    assert batch[0].token_ids == [10]  # the queued chunks are not modified


def _chunk(
    first: int, ids: list[int], *, epoch: int = 0, finished: bool = False, sender: str = "x:1"
) -> sink_pb.TokenChunk:
    return sink_pb.TokenChunk(
        request_id="r",
        first_seq=first,
        token_ids=ids,
        finished=finished,
        finish_reason="length" if finished else "",
        epoch=epoch,
        sender_address=sender,
    )


def test_collector_orders_deduplicates_and_follows_the_owner_epoch() -> None:
    async def main() -> None:
        col = TokenCollector()
        assert col._push(_chunk(0, [1])).unknown  # not expected: the sender must stop
        col.expect("r", "src:1")
        assert col._push(_chunk(2, [30, 40])).next_seq == 0  # buffered: seq 0, 1 missing
        assert col._push(_chunk(0, [10, 20])).next_seq == 4
        assert col._push(_chunk(1, [20, 30])).next_seq == 4  # duplicates, same ids
        assert col._push(_chunk(4, [], epoch=1, sender="dst:2")).next_seq == 4  # ownership moves
        assert col.get("r").owner_address == "dst:2"
        stale = col._push(_chunk(4, [99], epoch=0))
        assert stale.superseded and col.get("r").token_ids == (10, 20, 30, 40)
        col._push(_chunk(5, [60], epoch=1, finished=True, sender="dst:2"))
        assert not col.get("r").done  # seq 4 still missing
        col._push(_chunk(4, [50], epoch=1, sender="dst:2"))
        got = await col.wait("r", 1.0)
        assert got.token_ids == (10, 20, 30, 40, 50, 60) and got.done and got.finish_reason == "length"
        assert (got.duplicates, got.conflicts, got.epoch) == (2, 0, 1)
        col.expect("lp", "src:1")  # logprobs travel with their tokens, reordered and de-duplicated alike
        lp = [TokenLogprobs(-float(i), ((i, -float(i)),)) for i in range(4)]
        with_lp = _chunk(2, [30, 40], finished=True)
        with_lp.request_id = "lp"
        with_lp.logprobs.extend(logprobs_to_pb(e) for e in lp[2:])
        col._push(with_lp)
        first = _chunk(0, [10, 20])
        first.request_id = "lp"
        first.logprobs.extend(logprobs_to_pb(e) for e in lp[:2])
        col._push(first)
        col._push(first)  # a retried push
        got_lp = await col.wait("lp", 1.0)
        assert got_lp.token_ids == (10, 20, 30, 40) and got_lp.logprobs == tuple(lp)
        assert col.get("r").logprobs == ()  # a request without logprobs has none
        col.expect("q", "")
        with pytest.raises(TimeoutError, match="'q' not done"):
            await col.wait("q", 0.01)
        col.fail("q", "instance died")
        assert (await col.wait("q", 0.01)).error == "instance died"
        with pytest.raises(ValueError, match="already expected"):
            col.expect("q")

    asyncio.run(main())


def test_a_held_chunk_waits_until_due_holds_its_requests_later_chunks_and_a_flush_sends_it() -> None:
    """The sim engine's tokens exist at the end of a modelled step: pushed with ``not_before_s``, they reach the sink
    then, in order with the request's later chunks; other requests are not held; a flush (a migration) sends them."""
    import random as _random

    from llumlet.tokens import TokenPusher

    async def main() -> None:
        loop = asyncio.get_running_loop()
        col = TokenCollector()
        await col.start()
        pusher = TokenPusher("i0", "i0:1", lambda *_: None, _random.Random(0))
        try:
            for rid in ("r", "s", "m"):
                col.expect(rid, "i0:1")
            start = loop.time()
            pusher.push(col.address, TokenChunkOut("r", 0, [0], 0, not_before_s=start + 0.3))
            pusher.push(col.address, TokenChunkOut("r", 1, [1], 0, True, "length"))  # due at once, but behind seq 0
            pusher.push(col.address, TokenChunkOut("s", 0, [0], 0, True, "length"))  # another request: not held
            assert (await col.wait("s", 1.0)).token_ids == (0,) and col.get("r").token_ids == ()
            cpu = time.process_time()
            got = await col.wait("r", 2.0)
            assert time.process_time() - cpu < 0.05  # the lane slept until seq 0 was due (it spun behind it)
            assert got.token_ids == (0, 1) and loop.time() - start >= 0.3  # not before it was due, then in order
            pusher.push(col.address, TokenChunkOut("m", 0, [0, 1], 0, not_before_s=loop.time() + 30))
            flushed = loop.time()
            assert await asyncio.wait_for(pusher.flush("m"), 2.0) is PushOutcome.ACKED  # sent at once, not in 30 s
            assert col.get("m").token_ids == (0, 1) and loop.time() - flushed < 2.0
        finally:
            await pusher.close()
            await col.stop()

    asyncio.run(main())


def test_topology_fixture_file_matches(tmp_path: Path) -> None:
    # the process tests write TWO_DOMAINS as YAML; it must load the same
    import yaml

    from topology.load import load_topology

    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(TWO_DOMAINS))
    assert [i.instance_id for i in load_topology(path).instances] == ["a0", "a1", "b0", "b1"]


def test_a_timing_line_reads_back_and_a_bad_one_is_named() -> None:
    from llumlet.migration_types import MigrationOutcome, MigrationReport, StageStats, parse_timing_line

    rep = MigrationReport(
        MigrationOutcome.COMMITTED,
        stages=(StageStats(0, False, 19, 0, 0.004, 0.0215), StageStats(1, True, 1, 0, 0.001, 0.006)),
        total_s=0.09,
        downtime_s=0.0167,
        setup_s=0.002,
        reserve_s=0.0039,
        presuspend_s=0.008,
        suspend_wait_s=0.0006,
        commit_s=0.0122,
        plan="pre-copy+recompute-prefix",
        recomputed_blocks=4,
    )
    line = rep.timing_line()
    assert line == (
        "timing_ms setup=2.000 reserve=3.900 stages=21.500 presuspend=8.000 suspend_wait=0.600 last=6.000 "
        "commit=12.200 downtime=16.700 total=90.000 blocks=19,1 plan=pre-copy+recompute-prefix recomputed=4"
    )
    got = parse_timing_line(f"2026-12-01 llumlet.migration_out INFO a: migrate r@1 -> x:1: committed  (..) {line}")
    assert got is not None
    assert (got.setup_s, got.reserve_s, got.presuspend_s) == pytest.approx((0.002, 0.0039, 0.008))
    assert got.stage_s == pytest.approx((0.0215,))
    assert (got.suspend_wait_s, got.last_s, got.commit_s) == pytest.approx((0.0006, 0.006, 0.0122))
    assert (got.downtime_s, got.total_s, got.blocks) == (pytest.approx(0.0167), pytest.approx(0.09), (19, 1))
    assert (got.plan, got.recomputed_blocks) == ("pre-copy+recompute-prefix", 4)
    none = MigrationReport(MigrationOutcome.REFUSED).timing_line()
    assert "stages=- " in none and none.endswith("blocks=- plan=- recomputed=0")
    assert parse_timing_line(none).plan == ""  # type: ignore[union-attr]
    assert parse_timing_line(none) is not None and parse_timing_line(none).stage_s == ()  # type: ignore[union-attr]
    assert parse_timing_line("a: migrate r@1 -> x:1: refused") is None
    with pytest.raises(ValueError, match=r"bad timing_ms line .*'commit'"):
        parse_timing_line("timing_ms setup=1 reserve=1 stages=- presuspend=1 suspend_wait=1 last=1 downtime=1")
    with pytest.raises(ValueError, match=r"bad timing_ms line .*fast"):
        parse_timing_line(line.replace("reserve=3.900", "reserve=fast"))


def test_a_llumlet_that_stops_before_its_first_load_report_is_named_by_the_instance_it_was_given() -> None:
    # Its failure message named the instance only once the watch had its first load report: a llumlet killed
    # before that was "the llumlet at HOST:PORT", so the same failure read two ways depending on timing.
    from hilum_proto.tls import bind_server
    from hilum_proto.v1 import llumlet_pb2_grpc

    class Stopping(llumlet_pb2_grpc.LlumletServicer):
        async def WatchLoad(self, request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")

    async def main() -> tuple[str, str]:
        server, port = bind_server("127.0.0.1:0")
        llumlet_pb2_grpc.add_LlumletServicer_to_server(Stopping(), server)
        await server.start()
        address = f"127.0.0.1:{port}"
        col = TokenCollector()
        try:
            for rid in ("named", "unnamed"):
                col.expect(rid, address)
            col.watch(address, "a0")
            named = await col.wait("named", 10)
            col.expect("unnamed-2", address)  # the same llumlet watched again, this time with no name given
            col.watch(address)
            unnamed = await col.wait("unnamed-2", 10)
            return named.error, unnamed.error
        finally:
            await col.stop()
            await server.stop(None)

    named, unnamed = asyncio.run(main())
    stopped = r"127\.0\.0\.1:\d+ stopped \(UNAVAILABLE: going away\)"
    assert re.fullmatch(rf"instance a0 at {stopped}: the request is lost", named)
    assert re.fullmatch(rf"the llumlet at {stopped}: the request is lost", unnamed)
