"""Protobuf <-> dataclasses at the llumlet's gRPC edge (the rest of the llumlet works on dataclasses).

``MigrationState.extra`` (backend state such as a sampler's random-generator state) crosses the wire with a
small JSON codec: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, lists, tuples and ``str``-keyed
dicts round-trip exactly (tuples and bytes are tagged). Anything else raises :class:`UnmovableStateError`:
the request is refused for migration with that reason rather than moved wrongly.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

from hilum_proto.v1 import llumlet_pb2 as pb
from hilum_proto.v1 import token_sink_pb2 as tpb
from llumlet.engine.types import (
    EngineLoad,
    EngineRequest,
    GuidedDecoding,
    MigrationState,
    RunningRequestLoad,
    SamplingParams,
    TokenLogprobs,
)
from llumlet.migration_types import CommitCall, DestStatus

__all__ = [
    "UnmovableStateError",
    "commit_from_pb",
    "commit_to_pb",
    "decode_extra",
    "dest_status_from_pb",
    "dest_status_to_pb",
    "encode_extra",
    "load_from_pb",
    "load_to_pb",
    "logprobs_from_pb",
    "logprobs_to_pb",
    "reported_prefix",
    "request_from_submit",
    "sampling_from_pb",
    "sampling_to_pb",
    "state_from_pb",
    "state_to_pb",
]

_BYTES, _TUPLE, _FLOAT = "__bytes__", "__tuple__", "__float__"


class UnmovableStateError(ValueError):
    """A request's backend state has a value the wire codec cannot carry faithfully."""


def _enc(value: object, where: str) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return {_FLOAT: repr(value)} if not math.isfinite(value) else value
    if isinstance(value, bytes | bytearray | memoryview):
        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {_TUPLE: [_enc(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_enc(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str) or k in (_BYTES, _TUPLE, _FLOAT):
                raise UnmovableStateError(f"MigrationState.extra{where}: key {k!r} is not a plain str")
            out[k] = _enc(v, f"{where}[{k!r}]")
        return out
    raise UnmovableStateError(
        f"MigrationState.extra{where}: a {type(value).__name__} cannot be migrated (use bytes, numbers, str, "
        "lists, tuples or dicts)"
    )


def _dec(value: Any) -> object:
    if isinstance(value, list):
        return [_dec(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _BYTES in value:
            return base64.b64decode(value[_BYTES])
        if len(value) == 1 and _TUPLE in value:
            return tuple(_dec(v) for v in value[_TUPLE])
        if len(value) == 1 and _FLOAT in value:
            return float(value[_FLOAT])
        return {k: _dec(v) for k, v in value.items()}
    return value


def encode_extra(extra: Mapping[str, object]) -> bytes:
    """Encode ``MigrationState.extra``; ``b""`` for an empty dict. Raises :class:`UnmovableStateError`."""
    if not extra:
        return b""
    return json.dumps(_enc(dict(extra), ""), separators=(",", ":"), allow_nan=False).encode()


def decode_extra(data: bytes) -> dict[str, object]:
    """Inverse of :func:`encode_extra`. Raises ValueError on malformed data."""
    if not data:
        return {}
    value = _dec(json.loads(data))
    if not isinstance(value, dict):
        raise ValueError("MigrationState.extra: not an object")
    return value


def sampling_to_pb(params: SamplingParams) -> pb.Sampling:
    """``SamplingParams`` -> ``hilum.v1.Sampling`` (every field; "off" values stay unset or 0)."""
    msg = pb.Sampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        top_k=params.top_k,
        min_tokens=params.min_tokens,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.guided is not None:
        msg.guided.CopyFrom(pb.GuidedDecoding(kind=params.guided.kind, spec=params.guided.spec))
    return msg


def sampling_from_pb(msg: pb.Sampling) -> SamplingParams:
    """``hilum.v1.Sampling`` -> ``SamplingParams`` (``top_p`` 0 on the wire means 1). Raises ValueError."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(msg.stop_token_ids),
        top_k=msg.top_k,
        min_tokens=msg.min_tokens,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        guided=GuidedDecoding(msg.guided.kind, msg.guided.spec) if msg.HasField("guided") else None,
    )


def logprobs_to_pb(entry: TokenLogprobs) -> tpb.TokenLogprobs:
    """``TokenLogprobs`` -> ``hilum.v1.TokenLogprobs``."""
    return tpb.TokenLogprobs(
        logprob=entry.logprob,
        top_token_ids=[t for t, _ in entry.top],
        top_logprobs=[lp for _, lp in entry.top],
    )


def logprobs_from_pb(msg: tpb.TokenLogprobs) -> TokenLogprobs:
    """``hilum.v1.TokenLogprobs`` -> ``TokenLogprobs``. Raises ValueError when the two top lists differ in length."""
    if len(msg.top_token_ids) != len(msg.top_logprobs):
        raise ValueError(
            f"TokenLogprobs: {len(msg.top_token_ids)} top_token_ids but {len(msg.top_logprobs)} top_logprobs"
        )
    return TokenLogprobs(msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs, strict=True)))


def request_from_submit(msg: pb.SubmitRequest, arrival_s: float) -> EngineRequest:
    """The engine request of a Submit.

    Raises:
        ValueError: naming the field: empty id or origin, no prompt, a prompt length that disagrees with the
            ids, ``sampling.max_tokens`` < 1, bad sampling values.
    """
    rid = msg.request_id
    if not rid:
        raise ValueError("Submit: request_id is empty")
    if not msg.origin:
        raise ValueError(f"Submit {rid!r}: origin is empty (the TokenSink address that receives the tokens)")
    ids = tuple(msg.prompt_token_ids)
    n_prompt = msg.prompt_tokens or len(ids)
    if n_prompt < 1:
        raise ValueError(f"Submit {rid!r}: no prompt (prompt_tokens = 0 and no prompt_token_ids)")
    if ids and len(ids) != n_prompt:
        raise ValueError(f"Submit {rid!r}: prompt_tokens = {n_prompt} but {len(ids)} prompt_token_ids")
    if not msg.HasField("sampling") or msg.sampling.max_tokens < 1:
        raise ValueError(f"Submit {rid!r}: sampling.max_tokens must be >= 1")
    try:
        sampling = sampling_from_pb(msg.sampling)
    except ValueError as exc:
        raise ValueError(f"Submit {rid!r}: {exc}") from None
    return EngineRequest(
        request_id=rid,
        prompt_tokens=n_prompt,
        max_tokens=sampling.max_tokens,
        priority=msg.priority,
        arrival_s=arrival_s,
        prefix_block_hashes=tuple(msg.prefix_block_hashes),
        prefix_hash_block_tokens=msg.prefix_hash_block_tokens,
        prompt_token_ids=ids or None,
        sampling_params=sampling,
    )


def load_to_pb(load: EngineLoad, instance_id: str, domain_id: str, max_hashes: int | None = None) -> pb.LoadReport:
    """``EngineLoad`` -> ``hilum.v1.LoadReport`` (the llumlet's counters are filled by the caller).

    ``max_hashes``: prefix hash ids the report carries at most (``prefix_cache.report_max_hashes``; None = all),
    for the instance (:func:`reported_prefix`) and for each running request (its leading ones)."""
    held = reported_prefix(load, max_hashes)
    return pb.LoadReport(
        instance_id=instance_id,
        domain_id=domain_id,
        total_blocks=load.total_blocks,
        used_blocks=load.used_blocks,
        reserved_blocks=load.reserved_blocks,
        cached_blocks=load.cached_blocks,
        running=[
            pb.RunningRequest(
                request_id=r.request_id,
                blocks=r.blocks,
                priority=r.priority,
                num_tokens=r.num_tokens,
                in_decode=r.in_decode,
                output_tokens=r.output_tokens,
                max_tokens=r.max_tokens,
                max_blocks=r.max_blocks,
                unmigratable_reason=r.unmigratable_reason,
                prefix_hashes=r.prefix_hashes if max_hashes is None else r.prefix_hashes[:max_hashes],
            )
            for r in load.running
        ],
        num_waiting=load.num_waiting,
        head_demand_blocks=load.head_demand_blocks,
        queued_demand_blocks=load.queued_demand_blocks,
        preempting=load.preempting,
        num_suspended=load.num_suspended,
        max_num_seqs=load.max_num_seqs,
        prefix_hashes=held,
        prefix_block_tokens=load.prefix_block_tokens if held else 0,
        prefill_s_per_token=load.prefill_s_per_token,
        prefix_hit_tokens=load.prefix_hit_tokens,
        prefix_query_tokens=load.prefix_query_tokens,
    )


def reported_prefix(load: EngineLoad, max_hashes: int | None) -> list[int]:
    """The prefix hash ids a load report carries of ``load.prefix_hashes``: all of them while they are at most
    ``max_hashes`` (None: no cap); else the ones its running requests use (those requests' prefixes, in their
    order: in use now, so the most recently used), then others, up to ``max_hashes``."""
    held = load.prefix_hashes
    if max_hashes is None or len(held) <= max_hashes:
        return list(held)
    out: dict[int, None] = {}
    for r in load.running:
        for h in r.prefix_hashes:
            if h in held:
                out[h] = None
    for h in held:
        if len(out) >= max_hashes:
            break
        out[h] = None
    return list(out)[:max_hashes]


def load_from_pb(msg: pb.LoadReport) -> EngineLoad:
    """``hilum.v1.LoadReport`` -> ``EngineLoad``, unchecked (a domain scheduler turns a report into its
    ``InstanceLoad`` with ``rack_sched.convert.load_from_pb``, which checks it; ``to_instance_load`` trusts
    its input)."""
    return EngineLoad(
        total_blocks=msg.total_blocks,
        used_blocks=msg.used_blocks,
        reserved_blocks=msg.reserved_blocks,
        cached_blocks=msg.cached_blocks,
        running=tuple(
            RunningRequestLoad(
                r.request_id,
                r.blocks,
                r.priority,
                r.num_tokens,
                r.in_decode,
                r.output_tokens,
                r.max_tokens,
                r.max_blocks,
                r.unmigratable_reason,
                tuple(r.prefix_hashes),
            )
            for r in msg.running
        ),
        num_waiting=msg.num_waiting,
        head_demand_blocks=msg.head_demand_blocks,
        queued_demand_blocks=msg.queued_demand_blocks,
        preempting=msg.preempting,
        num_suspended=msg.num_suspended,
        max_num_seqs=msg.max_num_seqs,
        prefix_hashes=frozenset(msg.prefix_hashes),
        prefix_block_tokens=msg.prefix_block_tokens,
        prefix_hit_tokens=msg.prefix_hit_tokens,
        prefix_query_tokens=msg.prefix_query_tokens,
        prefill_s_per_token=msg.prefill_s_per_token,
    )


def state_to_pb(state: MigrationState) -> pb.SuspendedRequest:
    """``MigrationState`` -> ``hilum.v1.SuspendedRequest``. Raises :class:`UnmovableStateError` (``extra``)."""
    msg = pb.SuspendedRequest(
        request_id=state.request_id,
        prompt_tokens=state.prompt_tokens,
        num_output_tokens=state.num_output_tokens,
        num_computed_tokens=state.num_computed_tokens,
        max_tokens=state.max_tokens,
        priority=state.priority,
        arrival_s=state.arrival_s,
        prefix_block_hashes=list(state.prefix_block_hashes),
        prefix_hash_block_tokens=state.prefix_hash_block_tokens,
        num_preemptions=state.num_preemptions,
        has_prompt_token_ids=state.prompt_token_ids is not None,
        prompt_token_ids=list(state.prompt_token_ids or ()),
        output_token_ids=list(state.output_token_ids),
        has_sampling=state.sampling_params is not None,
        extra=encode_extra(state.extra),
    )
    if state.sampling_params is not None:
        msg.sampling.CopyFrom(sampling_to_pb(state.sampling_params))
    return msg


def state_from_pb(msg: pb.SuspendedRequest) -> MigrationState:
    """``hilum.v1.SuspendedRequest`` -> ``MigrationState``. Raises ValueError on malformed fields."""
    return MigrationState(
        request_id=msg.request_id,
        prompt_tokens=msg.prompt_tokens,
        num_output_tokens=msg.num_output_tokens,
        num_computed_tokens=msg.num_computed_tokens,
        max_tokens=msg.max_tokens,
        priority=msg.priority,
        arrival_s=msg.arrival_s,
        prefix_block_hashes=tuple(msg.prefix_block_hashes),
        prefix_hash_block_tokens=msg.prefix_hash_block_tokens,
        num_preemptions=msg.num_preemptions,
        prompt_token_ids=tuple(msg.prompt_token_ids) if msg.has_prompt_token_ids else None,
        output_token_ids=tuple(msg.output_token_ids),
        sampling_params=sampling_from_pb(msg.sampling) if msg.has_sampling else None,
        extra=decode_extra(msg.extra),
    )


_DEST_TO_PB = {
    DestStatus.OK: pb.DEST_OK,
    DestStatus.STALE: pb.DEST_STALE,
    DestStatus.REFUSED: pb.DEST_REFUSED,
    DestStatus.NO_ROOM: pb.DEST_NO_ROOM,
    DestStatus.FAILED: pb.DEST_FAILED,
}
_DEST_FROM_PB = {v: k for k, v in _DEST_TO_PB.items()}


def dest_status_to_pb(status: DestStatus) -> pb.DestStatus.ValueType:
    """:class:`DestStatus` -> ``hilum.v1.DestStatus``."""
    return _DEST_TO_PB[status]


def dest_status_from_pb(value: pb.DestStatus.ValueType) -> DestStatus:
    """``hilum.v1.DestStatus`` -> :class:`DestStatus`; an unknown value (a newer peer) reads as FAILED."""
    return _DEST_FROM_PB.get(value, DestStatus.FAILED)


def commit_to_pb(call: CommitCall) -> pb.CommitRequest:
    """:class:`CommitCall` -> ``hilum.v1.CommitRequest``. Raises :class:`UnmovableStateError` (``extra``)."""
    return pb.CommitRequest(
        request_id=call.request_id,
        attempt=call.attempt,
        state=state_to_pb(call.state),
        origin=call.origin,
        next_seq=call.next_seq,
        epoch=call.epoch,
        src_instance_id=call.src_instance_id,
    )


def commit_from_pb(msg: pb.CommitRequest) -> CommitCall:
    """``hilum.v1.CommitRequest`` -> :class:`CommitCall`. Raises ValueError on a malformed state."""
    return CommitCall(
        request_id=msg.request_id,
        attempt=msg.attempt,
        state=state_from_pb(msg.state),
        origin=msg.origin,
        next_seq=msg.next_seq,
        epoch=msg.epoch,
        src_instance_id=msg.src_instance_id,
    )
