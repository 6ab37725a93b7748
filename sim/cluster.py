"""Simulated instances: one engine model per instance, stepped on the virtual clock.

Each instance runs :class:`llumlet.engine.core.EngineCore` — the same engine model the real-time
``sim`` llumlet backend runs — and this module only decides *when* its steps happen: a step starts
as soon as the instance is idle and has work, and its results land ``duration_s`` later. Migration
hooks that must happen "between two steps" (suspending a request) are queued on the instance and run
at the next step boundary, exactly as a real engine loop would.

The cluster also keeps the per-request records the report is made from (TTFT, TBT samples,
preemptions, migrations).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from llumlet.engine.core import EngineCore
from llumlet.engine.latency import LatencyModel
from llumlet.engine.scheduler import Admission
from llumlet.engine.types import EngineRequest, StepResult
from policy.types import InstanceLoad
from topology.spec import InstanceSpec, ModelSpec, Topology

from .events import EventKind, EventQueue
from .results import RequestRecord
from .traces import TraceRequest

__all__ = ["Cluster", "EngineLimits", "RequestState", "SimInstance"]


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Continuous-batching limits of every simulated engine (vLLM's defaults for an A100-class GPU)."""

    max_num_seqs: int = 256  # running requests per step
    max_num_batched_tokens: int = 8192  # tokens (prefill chunk + decodes) per step
    admission: Admission = "chunked"  # "chunked" (vLLM v1) or "whole-prompt" (vLLM v0, Llumnix's engine)


@dataclass(slots=True)
class RequestState:
    """The simulator's running account of one request (turned into a RequestRecord at the end)."""

    trace: TraceRequest
    instance_id: str = ""
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    generated_tokens: int = 0
    token_gaps_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    preempted_s: float = 0.0
    preempted_at_s: float | None = None  # set while the request waits to be recomputed
    migrations: int = 0
    migrating: bool = False
    refused: str | None = None

    def record(self) -> RequestRecord:
        """Freeze this account into the report's RequestRecord."""
        t = self.trace
        return RequestRecord(
            request_id=t.request_id,
            priority=t.priority,
            arrival_s=t.arrival_s,
            prompt_tokens=t.prompt_tokens,
            output_tokens=t.output_tokens,
            generated_tokens=self.generated_tokens,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s,
            token_gaps_s=tuple(self.token_gaps_s),
            preemptions=self.preemptions,
            preempted_s=self.preempted_s,
            migrations=self.migrations,
            refused=self.refused,
            instance_id=self.instance_id,
        )


class SimInstance:
    """One model instance: its spec, its engine model, and its place in the schedule."""

    def __init__(self, spec: InstanceSpec, engine: EngineCore, active: bool) -> None:
        self.spec = spec
        self.engine = engine
        self.busy = False  # a step is in flight
        self.active = active  # False until a scripted scale-out adds it
        self.draining = False
        self.warm_until_s = -math.inf  # warm-up (negative fake usage) ends at this time
        self.last_step_s = 0.0  # duration of the latest step, seconds (the decode step time estimate)
        self.at_boundary: list[Callable[[], None]] = []  # hooks to run at the next step boundary

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def domain_id(self) -> str:
        return self.spec.domain_id


class Cluster:
    """The simulated instances of a topology (those serving ``model``, or all), stepped on one event queue.

    ``on_finished`` listeners are told of every finished or aborted request (so a migration in
    flight can release its reservation).
    """

    def __init__(
        self,
        queue: EventQueue,
        topology: Topology,
        latency: Callable[[InstanceSpec], LatencyModel],
        limits: EngineLimits,
        inactive: Iterable[str] = (),
        model: str | None = None,
    ) -> None:
        self.queue = queue
        self.topology = topology
        self.requests: dict[str, RequestState] = {}
        self.engine_steps = 0
        self.on_finished: list[Callable[[str], None]] = []
        self._finished_lengths: dict[str, list[int]] = {}  # instance -> output lengths finished, not yet reported
        inactive_ids = set(inactive)
        self.instances: dict[str, SimInstance] = {}
        for spec in topology.instances:
            if model is not None and spec.model != model:
                continue  # the trace's requests are for one model; other instances are not simulated
            model_spec = topology.model_of(spec.instance_id)
            engine = EngineCore(
                instance_id=spec.instance_id,
                num_blocks=spec.kv_capacity_blocks,
                block_size_tokens=model_spec.block_size_tokens,
                latency_model=latency(spec),
                max_num_seqs=limits.max_num_seqs,
                max_num_batched_tokens=limits.max_num_batched_tokens,
                kv_bytes_per_block=model_spec.kv_bytes_per_block,
                admission=limits.admission,
            )
            self.instances[spec.instance_id] = SimInstance(spec, engine, spec.instance_id not in inactive_ids)

    # ------------------------------------------------------------------ views
    def model_of(self, instance_id: str) -> ModelSpec:
        return self.topology.model_of(instance_id)

    def domain_ids(self) -> list[str]:
        """Domains with at least one simulated instance, in topology order."""
        present = {i.domain_id for i in self.instances.values()}
        return [d.domain_id for d in self.topology.domains if d.domain_id in present]

    def serving(self, domain_id: str | None = None) -> list[SimInstance]:
        """Active instances (optionally of one domain), draining ones included."""
        return [i for i in self.instances.values() if i.active and (domain_id is None or i.domain_id == domain_id)]

    def load(self, inst: SimInstance) -> InstanceLoad:
        """The instance's load report, as its llumlet would push it (policy's InstanceLoad), with its most
        recent step time."""
        return inst.engine.load().to_instance_load(
            inst.instance_id,
            inst.domain_id,
            draining=inst.draining,
            warming_up=self.queue.now_s < inst.warm_until_s,
            decode_step_s=inst.last_step_s,
        )

    def take_finished(self, instance_id: str) -> list[int]:
        """Output lengths of the requests that finished on ``instance_id`` since the last call (what its
        llumlet's next load report would carry)."""
        return self._finished_lengths.pop(instance_id, [])

    # ------------------------------------------------------------------ requests
    def admit(self, req: TraceRequest) -> RequestState:
        """Start the account of a request that arrived (before dispatch)."""
        state = RequestState(trace=req)
        self.requests[req.request_id] = state
        return state

    def submit(self, req: TraceRequest, instance_id: str) -> None:
        """Queue the request on ``instance_id`` and start stepping if the instance is idle."""
        inst = self.instances[instance_id]
        self.requests[req.request_id].instance_id = instance_id
        inst.engine.add_request(
            EngineRequest(
                request_id=req.request_id,
                prompt_tokens=req.prompt_tokens,
                max_tokens=req.output_tokens,
                priority=req.priority,
                arrival_s=req.arrival_s,
                prefix_block_hashes=req.prefix_block_hashes,
                prefix_hash_block_tokens=req.prefix_block_tokens,
            )
        )
        self.kick(inst)

    def kick(self, inst: SimInstance) -> None:
        """Start the next step on an idle instance with work (no-op otherwise)."""
        if inst.busy:
            return
        self._run_boundary(inst)
        if not inst.engine.has_work():
            return
        result = inst.engine.step()
        if result.is_idle:  # nothing fits now (space held by reservations): wait for the next event
            return
        self.engine_steps += 1
        inst.last_step_s = result.duration_s
        inst.busy = True
        self.queue.schedule_in(result.duration_s, EventKind.STEP_DONE, lambda: self._step_done(inst, result))

    def at_step_boundary(self, inst: SimInstance, hook: Callable[[], None]) -> None:
        """Run ``hook`` between two steps of ``inst`` (now if it is idle)."""
        inst.at_boundary.append(hook)
        if not inst.busy:
            self._run_boundary(inst)
            self.kick(inst)

    def _run_boundary(self, inst: SimInstance) -> None:
        while inst.at_boundary:
            inst.at_boundary.pop(0)()

    def _step_done(self, inst: SimInstance, result: StepResult) -> None:
        now = self.queue.now_s
        inst.busy = False
        for request_id, count in result.new_tokens.items():
            self._tokens(self.requests[request_id], count, now)
        for request_id in result.preempted:
            state = self.requests[request_id]
            state.preemptions += 1
            state.preempted_at_s = now
        for request_id in result.finished:
            self._finish(request_id, now)
        self.kick(inst)

    def _tokens(self, state: RequestState, count: int, now: float) -> None:
        if count <= 0:
            return
        if state.first_token_s is None:
            state.first_token_s = now
        elif state.last_token_s is not None:
            state.token_gaps_s.append(now - state.last_token_s)
            state.token_gaps_s.extend([0.0] * (count - 1))
        if state.preempted_at_s is not None:
            state.preempted_s += now - state.preempted_at_s
            state.preempted_at_s = None
        state.last_token_s = now
        state.generated_tokens += count

    def _finish(self, request_id: str, now: float) -> None:
        state = self.requests[request_id]
        state.finish_s = now
        self._finished_lengths.setdefault(state.instance_id, []).append(state.generated_tokens)
        for listener in self.on_finished:
            listener(request_id)

    def refuse(self, req: TraceRequest, reason: str) -> None:
        """Record that no instance could ever hold ``req``."""
        self.requests[req.request_id].refused = reason

    def records(self) -> tuple[RequestRecord, ...]:
        """Every request's record, in arrival order."""
        return tuple(s.record() for s in self.requests.values())

    def kv_usage_fraction(self) -> dict[str, float]:
        """Per-instance KV usage (used / total blocks), for the timeline plot."""
        out: dict[str, float] = {}
        for inst in self.instances.values():
            load = inst.engine.load()
            out[inst.instance_id] = load.used_blocks / load.total_blocks if inst.active else 0.0
        return out
