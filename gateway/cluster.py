"""What the HTTP side talks to: the :class:`Backend` protocol and its real implementation, :class:`LiveCluster`.

``LiveCluster`` joins the pieces of a running hilum cluster:

- a :class:`~clusterstate.store.ClusterView` of etcd (watched): domain schedulers and their summaries,
  instance registrations;
- a :class:`~gateway.router.DomainRouter` that picks a domain and submits there;
- a :class:`~gateway.sink.GatewaySink`, the origin every request names: tokens arrive there from whichever
  llumlet runs the request;
- one WatchLoad stream per registered llumlet, for the per-instance KV usage and preemption metrics;
- aborts: a client that leaves gets ``Abort`` sent to the llumlet that owns its request now (the llumlet
  forwards it if the request migrated meanwhile), and the sink forgets the request, so any later push is
  answered ``unknown`` and the llumlet drops it: the request's blocks are freed on every instance;
- resume on failure (:class:`Replayer`): a request whose instance died or whose engine failed is replayed
  on another instance as ``gateway.core.plan_resume`` decides, under a new engine request id, and its
  client's stream continues from the tokens it already has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc

from clusterstate.etcd import Etcd3Client
from clusterstate.records import InstanceRegistration
from clusterstate.store import ClusterView, Keys
from gateway.core import ResumeAction, plan_resume
from gateway.metrics import GatewayMetrics
from gateway.router import DispatchFailed, DomainRouter, GrpcSubmitter, Placement
from gateway.sink import GatewaySink, TokenUpdate
from gateway.validation import GenerationRequest, ModelLimits, model_limits
from hilum_proto.v1 import llumlet_pb2
from llumlet.client import LlumletClient
from llumlet.convert import sampling_to_pb
from llumlet.engine.prefix_hash import PREFIX_CACHE_DEFAULTS, PrefixCacheConfig, prefix_block_hashes
from policy.types import PolicyConfig
from topology.spec import Topology

__all__ = ["Backend", "LiveCluster", "MetricsObserver", "Replayer", "features_by_model", "submit_message"]

_log = logging.getLogger(__name__)


class Backend(Protocol):
    """The cluster as the HTTP handlers see it."""

    @property
    def limits(self) -> Mapping[str, ModelLimits]:
        """Served models, their limits and (when known) the sampling features their instances honour."""

    def health(self) -> tuple[bool, str]:
        """(ready to dispatch, why not / what is there)."""

    def ready_domains(self) -> list[str]:
        """Domains a request can be dispatched to now (registered and summarised), sorted."""

    def domain_of(self, instance_id: str) -> str:
        """The NVLink domain of an instance ("" if unknown)."""

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        """Dispatch; tokens then come from :meth:`updates`. Raises ``DispatchFailed``."""

    def updates(self, request_id: str) -> AsyncGenerator[TokenUpdate, None]:
        """New tokens of a started request, then its end (closed early when the gateway stops reading)."""

    async def abort(self, request_id: str) -> None:
        """Stop the request everywhere (client gone). Idempotent."""

    def abort_soon(self, request_id: str, placement: asyncio.Task[Placement] | None = None) -> None:
        """:meth:`abort` in the background (from a cancelled handler), after ``placement`` if given."""

    def finish(self, request_id: str) -> None:
        """Forget a request that ended (or was never started)."""


def submit_message(
    request_id: str, request: GenerationRequest, origin: str, prefix_block_tokens: int = 0
) -> llumlet_pb2.SubmitRequest:
    """The ``SubmitRequest`` sent to a domain scheduler (prompt as token ids, every sampling setting of
    ``request.sampling``, tokens pushed to ``origin``). Stop strings and ``n`` stay at the gateway.

    ``prefix_block_tokens`` > 0: it carries the prompt's prefix hash ids, one per full block of that many
    tokens (``llumlet.engine.prefix_hash.prefix_block_hashes``), which dispatch matches against what each
    instance reports it caches and the sim engine's prefix cache reuses; 0: none."""
    hashes = prefix_block_hashes(request.prompt_token_ids, prefix_block_tokens) if prefix_block_tokens else ()
    return llumlet_pb2.SubmitRequest(
        request_id=request_id,
        prompt_tokens=request.prompt_tokens,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_pb(request.sampling),
        priority=request.priority,
        origin=origin,
        model=request.model,
        prefix_block_hashes=hashes,
        prefix_hash_block_tokens=prefix_block_tokens if hashes else 0,
    )


def features_by_model(instances: Iterable[InstanceRegistration]) -> dict[str, frozenset[str] | None]:
    """The optional sampling features every registered instance of each model honours (the intersection).

    A model with an instance whose registration does not say (``engine`` empty: an older llumlet) maps to
    None: not checked at the gateway (its llumlets still refuse what they cannot do).
    """
    out: dict[str, frozenset[str] | None] = {}
    for reg in instances:
        have = frozenset(reg.sampling_features) if reg.engine else None
        if reg.model not in out:
            out[reg.model] = have
            continue
        prev = out[reg.model]
        out[reg.model] = None if prev is None or have is None else prev & have
    return out


class MetricsObserver:
    """Turns sink events into metrics; migrations are classified by the topology's domains."""

    def __init__(self, metrics: GatewayMetrics, domain_of: Mapping[str, str]) -> None:
        self._m = metrics
        self._domain_of = domain_of

    def on_tokens(self, request_id: str, count: int, gap_s: float | None, first: bool) -> None:
        if gap_s is not None and count > 0:
            for _ in range(count):
                self._m.tbt.observe(gap_s / count)

    def on_migration(self, request_id: str, src_instance_id: str, dst_instance_id: str, gap_s: float | None) -> None:
        src = self._domain_of.get(src_instance_id, "?")
        dst = self._domain_of.get(dst_instance_id, "?")
        self._m.observe_migration(src != dst, gap_s)


#: Places a Submit on some domain: (message, demand blocks, blocks it may grow to, KV block size in tokens) ->
#: where it runs.
Dispatch = Callable[[llumlet_pb2.SubmitRequest, int, int, int], Awaitable[Placement]]


@dataclass(slots=True)
class _Run:
    """One dispatched choice: the engine request that runs it now, and its replays."""

    request: GenerationRequest  # as the client asked (one choice)
    engine_id: str  # the engine request running it now: the choice's id, then ``<id>.r1``, ``<id>.r2``, ...
    address: str = ""  # llumlet it was last submitted to
    failed: list[str] = field(default_factory=list)  # instances it failed on, in order


class Replayer:
    """The engine request behind each dispatched choice, replayed elsewhere when its instance fails.

    Each choice's stream (:meth:`updates`) follows its engine request in the sink. When that request fails
    *resumable* — its llumlet's stream broke (dead process, host, or a keepalive that went unanswered) or its
    engine failed — :func:`gateway.core.plan_resume` decides: replay it (a new engine request
    ``<choice id>.r<k>`` with the prompt plus the tokens already delivered, the rest of ``max_tokens``,
    numbered on from there, avoiding the instances it failed on; the sink continues the stream from the tokens
    it holds, so the client sees each token once), end it normally (every token was there), or end it with an
    error event that says why it was not resumed. Every outcome is counted in
    ``hilum_gateway_resumes_total{outcome}``.

    Args:
        sink: the gateway's token sink.
        dispatch: places a Submit (the router).
        origin: the sink address the llumlets push to.
        metrics: where to count.
        max_replays: ``resume.max_replays`` of the configuration.
        prefix_cache: how prompts are hashed (``prefix_cache.blocks_per_hash``; :func:`submit_message`).
    """

    def __init__(
        self,
        sink: GatewaySink,
        dispatch: Dispatch,
        origin: Callable[[], str],
        metrics: GatewayMetrics,
        max_replays: int,
        prefix_cache: PrefixCacheConfig = PREFIX_CACHE_DEFAULTS,
    ) -> None:
        self._prefix_cache = prefix_cache
        self._sink = sink
        self._dispatch = dispatch
        self._origin = origin
        self._metrics = metrics
        self.max_replays = max_replays
        self._runs: dict[str, _Run] = {}

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        """Dispatch a choice (its engine request has the choice's id). Raises ``DispatchFailed``."""
        run = self._runs[request_id] = _Run(request, request_id)
        self._sink.open(request_id)
        placement = await self._place(run, self._message(request_id, request), request)
        return placement

    def _message(self, engine_id: str, request: GenerationRequest) -> llumlet_pb2.SubmitRequest:
        tokens = self._prefix_cache.block_tokens(request.block_size_tokens)
        return submit_message(engine_id, request, self._origin(), tokens)

    async def _place(self, run: _Run, msg: llumlet_pb2.SubmitRequest, request: GenerationRequest) -> Placement:
        placement = await self._dispatch(msg, request.demand_blocks, request.need_blocks, request.block_size_tokens)
        run.address = placement.instance_address
        self._sink.dispatched(run.engine_id, placement.instance_id, placement.instance_address)
        return placement

    def engine_id(self, request_id: str) -> str:
        """The engine request running the choice now (the choice's id for one never dispatched)."""
        run = self._runs.get(request_id)
        return run.engine_id if run is not None else request_id

    def address(self, request_id: str) -> str:
        """The llumlet that runs the choice now as far as the gateway knows ("" before it was placed)."""
        run = self._runs.get(request_id)
        if run is None:
            return ""
        return self._sink.owner_address(run.engine_id) or run.address

    def finish(self, request_id: str) -> None:
        """Forget a choice: its engine request's later pushes are answered ``unknown``."""
        run = self._runs.pop(request_id, None)
        self._sink.close(run.engine_id if run is not None else request_id)

    async def updates(self, request_id: str) -> AsyncGenerator[TokenUpdate, None]:
        """The choice's tokens, across replays, then its end. Raises KeyError for a choice never started."""
        run = self._runs[request_id]
        delivered = 0
        while True:
            lost: TokenUpdate | None = None
            async for update in self._sink.updates(run.engine_id, delivered=delivered):
                if update.done and update.resumable:
                    lost = update
                    break
                delivered += len(update.token_ids)
                yield replace(update, resumes=len(run.failed))
                if update.done:
                    return
            assert lost is not None
            if lost.token_ids:  # the last tokens it delivered before failing
                delivered += len(lost.token_ids)
                yield replace(lost, done=False, finish_reason="", error="", resumable=False, resumes=len(run.failed))
            end = await self._resume(run, lost)
            if end is not None:
                yield end
                return

    async def _resume(self, run: _Run, lost: TokenUpdate) -> TokenUpdate | None:
        """Replay the choice after its instance failed; None when it runs again, else its last update."""
        output = self._sink.get(run.engine_id).token_ids
        run.failed.append(lost.instance_id or run.address)
        plan = plan_resume(
            run.request.prompt_token_ids,
            run.request.sampling,
            output,
            replays_done=len(run.failed) - 1,
            failed_instance_ids=run.failed,
            max_replays=self.max_replays,
        )
        self._metrics.resumes.labels(outcome=plan.action.value).inc()

        def ended(reason: str, error: str) -> TokenUpdate:
            return replace(lost, token_ids=(), logprobs=(), done=True, finish_reason=reason, error=error,
                           resumes=len(run.failed) - 1)  # fmt: skip

        if plan.action is ResumeAction.COMPLETE:
            return ended("length", "")
        if plan.action is not ResumeAction.REPLAY or plan.sampling is None:
            return ended("error", f"{lost.error}; not resumed: {plan.reason}")
        _log.warning("request %s: %s; resuming it: %s", run.engine_id, lost.error, plan.reason)
        new_id = f"{self._base_id(run.engine_id)}.r{len(run.failed)}"
        self._sink.resume(run.engine_id, new_id)
        run.engine_id = new_id  # before dispatching: a client that leaves meanwhile closes the replay's stream
        replay = replace(run.request, prompt_token_ids=plan.prompt_token_ids, sampling=plan.sampling)
        msg = self._message(new_id, replay)
        msg.first_seq = plan.first_seq
        msg.avoid_instance_ids.extend(plan.avoid_instance_ids)
        try:
            await self._place(run, msg, replay)
        except DispatchFailed as exc:
            self._metrics.resumes.labels(outcome="no_capacity").inc()
            return ended("error", f"{lost.error}; not resumed: {exc.message}")
        self._metrics.replayed_tokens.inc(plan.first_seq)
        return None

    @staticmethod
    def _base_id(engine_id: str) -> str:
        base, dot, k = engine_id.rpartition(".r")
        return base if dot and k.isdigit() else engine_id


class LiveCluster:
    """The real :class:`Backend` (see the module docstring). ``await start_services()``, then serve;
    ``await close()`` at the end.

    Args:
        topology: served models, their limits, instance -> domain.
        etcd: a connected etcd client (not closed here).
        metrics: where to count.
        rng: dispatch near-ties and backoff jitter.
        prefix: etcd key prefix.
        sink_listen: ``host:port`` of the token sink (port 0 picks one); ``sink_advertise`` the address
            llumlets push to (default: the bound one); ``sink_what``: the option that gave ``sink_listen`` (the
            error when it cannot be bound names it).
        policy: the rule book's configuration.
        reservation_ttl_s: how long a dispatch reservation counts at most (``intervals.reservation_ttl_s``).
        max_replays: replays of a request whose instance failed (``resume.max_replays``; :class:`Replayer`).
    """

    def __init__(
        self,
        topology: Topology,
        etcd: Etcd3Client,
        metrics: GatewayMetrics,
        rng: random.Random,
        *,
        prefix: str = "/hilum/v1/",
        sink_listen: str = "127.0.0.1:0",
        sink_advertise: str = "",
        sink_what: str = "token sink",
        policy: PolicyConfig | None = None,
        reservation_ttl_s: float = 1.0,
        unavailable_wait_s: float = 5.0,
        max_replays: int = 3,
        prefix_cache: PrefixCacheConfig = PREFIX_CACHE_DEFAULTS,
    ) -> None:
        self.topology = topology
        self._limits = model_limits(topology)
        self._limits_live = self._limits
        self._limits_version = -1
        self._domain_of = {i.instance_id: i.domain_id for i in topology.instances}
        self._capacity = {i.instance_id: i.kv_capacity_blocks for i in topology.instances}
        self.metrics = metrics
        self.view = ClusterView(etcd, Keys(prefix), rng=rng)
        self.sink = GatewaySink(sink_listen, what=sink_what, observer=MetricsObserver(metrics, self._domain_of))
        self._sink_advertise = sink_advertise
        self._submitter = GrpcSubmitter()
        self.router = DomainRouter(
            self.view,
            self._submitter,
            policy or PolicyConfig(),
            rng,
            unavailable_wait_s=unavailable_wait_s,
            on_retry=lambda reason: metrics.retries.labels(reason=reason).inc(),
            reservation_ttl_s=reservation_ttl_s,
        )
        self._clients: dict[str, LlumletClient] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._load_watches: dict[str, tuple[asyncio.Task[None], str]] = {}  # instance -> (its watch, address)
        self._aborting: set[asyncio.Task[None]] = set()
        self.replayer = Replayer(
            self.sink, self.router.dispatch, lambda: self.origin, metrics, max_replays, prefix_cache
        )

    @property
    def limits(self) -> Mapping[str, ModelLimits]:
        """The topology's limits, with the sampling features the registered instances advertise (recomputed
        when the etcd view changed)."""
        if self._limits_version != self.view.version:
            features = features_by_model(self.view.instances().values())
            self._limits_live = {
                name: replace(lim, sampling_features=features.get(name)) for name, lim in self._limits.items()
            }
            self._limits_version = self.view.version
        return self._limits_live

    @property
    def origin(self) -> str:
        """The sink address llumlets push tokens to."""
        return self._sink_advertise or self.sink.address

    async def start_services(self) -> None:
        """Start the sink and the etcd view (waits for the first listing)."""
        await self.sink.start()
        self._tasks.append(asyncio.create_task(self.view.run(), name="gateway-cluster-view"))
        self._tasks.append(asyncio.create_task(self._follow_instances(), name="gateway-instances"))
        await self.view.synced.wait()

    async def close(self) -> None:
        """Stop everything started here."""
        watches = [task for task, _ in self._load_watches.values()]
        for task in [*self._tasks, *watches, *self._aborting]:
            task.cancel()
        for task in [*self._tasks, *watches, *self._aborting]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.sink.stop()
        await self._submitter.close()
        for client in self._clients.values():
            await client.close()

    def domain_of(self, instance_id: str) -> str:
        return self._domain_of.get(instance_id, "")

    def ready_domains(self) -> list[str]:
        return sorted(self.router.domains())

    def health(self) -> tuple[bool, str]:
        return self.router.health(expected=[d.domain_id for d in self.topology.domains])

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        return await self.replayer.start(request_id, request)

    def updates(self, request_id: str) -> AsyncGenerator[TokenUpdate, None]:
        return self.replayer.updates(request_id)

    async def abort(self, request_id: str) -> None:
        engine_id, address = self.replayer.engine_id(request_id), self.replayer.address(request_id)
        self.finish(request_id)
        await self._abort_at(engine_id, address)

    def abort_soon(self, request_id: str, placement: asyncio.Task[Placement] | None = None) -> None:
        # now: the handler forgets the request right after
        engine_id, address = self.replayer.engine_id(request_id), self.replayer.address(request_id)
        self.finish(request_id)

        async def run() -> None:
            where = address
            if placement is not None:
                try:
                    where = where or (await placement).instance_address
                except (Exception, asyncio.CancelledError):
                    return  # never placed: nothing to abort
                self.finish(request_id)
            await self._abort_at(engine_id, where)

        task = asyncio.get_running_loop().create_task(run(), name=f"abort-{request_id}")
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _abort_at(self, request_id: str, address: str) -> None:
        if not address:
            return
        try:
            await self._client(address).abort(request_id)
        except grpc.aio.AioRpcError as exc:
            _log.warning(
                "abort of %s at %s failed (%s); the llumlet drops it on its next push", request_id, address, exc
            )

    def finish(self, request_id: str) -> None:
        self.replayer.finish(request_id)

    def _client(self, address: str) -> LlumletClient:
        if address not in self._clients:
            self._clients[address] = LlumletClient(address, timeout_s=5.0)
        return self._clients[address]

    # ---- per-instance load (metrics) ------------------------------------------------------------
    async def _follow_instances(self) -> None:
        seen = -1
        while True:
            seen = await self.view.wait_changed(seen)
            regs = self.view.instances()
            for iid, reg in regs.items():
                task, address = self._load_watches.get(iid, (None, ""))
                if task is None or task.done() or address != reg.address:  # new, or restarted elsewhere
                    if task is not None:
                        task.cancel()
                    self._load_watches[iid] = (asyncio.create_task(self._watch_load(iid, reg.address)), reg.address)
            for iid in [i for i in self._load_watches if i not in regs]:  # deregistered: its series go too
                self._load_watches.pop(iid)[0].cancel()
                self.metrics.remove_instance(iid, self._domain_of.get(iid, ""))

    async def _watch_load(self, instance_id: str, address: str) -> None:
        domain = self._domain_of.get(instance_id, "")
        preempting = False
        while True:
            try:
                async for report in self._client(address).watch_load(min_interval_s=0.1):
                    used = report.used_blocks
                    self.metrics.set_instance_kv(instance_id, domain, used, report.total_blocks)
                    self.metrics.set_instance_prefix(
                        instance_id, domain, report.prefix_hit_tokens, report.prefix_query_tokens
                    )
                    if report.preempting and not preempting:
                        self.metrics.preemptions.labels(instance=instance_id).inc()
                    preempting = report.preempting
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1.0)
