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
  answered ``unknown`` and the llumlet drops it: the request's blocks are freed on every instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import grpc

from clusterstate.etcd import Etcd3Client
from clusterstate.store import ClusterView, Keys
from gateway.metrics import GatewayMetrics
from gateway.router import DomainRouter, GrpcSubmitter, Placement
from gateway.sink import GatewaySink, TokenUpdate
from gateway.validation import GenerationRequest, ModelLimits, model_limits
from hilum_proto.v1 import llumlet_pb2
from llumlet.client import LlumletClient
from llumlet.convert import sampling_to_pb
from llumlet.engine.types import SamplingParams
from policy.types import PolicyConfig
from topology.spec import Topology

__all__ = ["Backend", "LiveCluster", "MetricsObserver", "submit_message"]

_log = logging.getLogger(__name__)


class Backend(Protocol):
    """The cluster as the HTTP handlers see it."""

    @property
    def limits(self) -> Mapping[str, ModelLimits]:
        """Served models and their limits."""

    def health(self) -> tuple[bool, str]:
        """(ready to dispatch, why not / what is there)."""

    def ready_domains(self) -> list[str]:
        """Domains a request can be dispatched to now (registered and summarised), sorted."""

    def domain_of(self, instance_id: str) -> str:
        """The NVLink domain of an instance ("" if unknown)."""

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        """Dispatch; tokens then come from :meth:`updates`. Raises ``DispatchFailed``."""

    def updates(self, request_id: str) -> AsyncIterator[TokenUpdate]:
        """New tokens of a started request, then its end."""

    async def abort(self, request_id: str) -> None:
        """Stop the request everywhere (client gone). Idempotent."""

    def abort_soon(self, request_id: str, placement: asyncio.Task[Placement] | None = None) -> None:
        """:meth:`abort` in the background (from a cancelled handler), after ``placement`` if given."""

    def finish(self, request_id: str) -> None:
        """Forget a request that ended (or was never started)."""


def submit_message(request_id: str, request: GenerationRequest, origin: str) -> llumlet_pb2.SubmitRequest:
    """The ``SubmitRequest`` sent to a domain scheduler (prompt as token ids, tokens pushed to ``origin``)."""
    sampling = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        stop_token_ids=request.stop_token_ids,
    )
    return llumlet_pb2.SubmitRequest(
        request_id=request_id,
        prompt_tokens=request.prompt_tokens,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_pb(sampling),
        priority=request.priority,
        origin=origin,
        model=request.model,
    )


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
            llumlets push to (default: the bound one).
        policy: the rule book's configuration.
        reservation_ttl_s: how long a dispatch reservation counts at most (``intervals.reservation_ttl_s``).
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
        policy: PolicyConfig | None = None,
        reservation_ttl_s: float = 1.0,
        unavailable_wait_s: float = 5.0,
    ) -> None:
        self.topology = topology
        self._limits = model_limits(topology)
        self._domain_of = {i.instance_id: i.domain_id for i in topology.instances}
        self._capacity = {i.instance_id: i.kv_capacity_blocks for i in topology.instances}
        self.metrics = metrics
        self.view = ClusterView(etcd, Keys(prefix), rng=rng)
        self.sink = GatewaySink(sink_listen, observer=MetricsObserver(metrics, self._domain_of))
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
        self._load_watches: dict[str, asyncio.Task[None]] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        self._placed: dict[str, str] = {}  # request_id -> llumlet address it was submitted to

    @property
    def limits(self) -> Mapping[str, ModelLimits]:
        return self._limits

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
        for task in [*self._tasks, *self._load_watches.values(), *self._aborting]:
            task.cancel()
        for task in [*self._tasks, *self._load_watches.values(), *self._aborting]:
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
        domains = self.router.domains()
        if not domains:
            return False, "no domain scheduler has registered and published a summary yet"
        return True, f"{len(domains)} domain(s): {', '.join(sorted(domains))}"

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        self.sink.open(request_id)
        msg = submit_message(request_id, request, self.origin)
        placement = await self.router.dispatch(msg, request.demand_blocks, request.need_blocks)
        self._placed[request_id] = placement.instance_address
        self.sink.dispatched(request_id, placement.instance_id, placement.instance_address)
        return placement

    def updates(self, request_id: str) -> AsyncIterator[TokenUpdate]:
        return self.sink.updates(request_id)

    def _address_of(self, request_id: str) -> str:
        return self.sink.owner_address(request_id) or self._placed.get(request_id, "")

    async def abort(self, request_id: str) -> None:
        address = self._address_of(request_id)
        self.finish(request_id)
        await self._abort_at(request_id, address)

    def abort_soon(self, request_id: str, placement: asyncio.Task[Placement] | None = None) -> None:
        address = self._address_of(request_id)  # now: the handler forgets the request right after
        self.finish(request_id)

        async def run() -> None:
            where = address
            if placement is not None:
                try:
                    where = where or (await placement).instance_address
                except (Exception, asyncio.CancelledError):
                    return  # never placed: nothing to abort
                self.finish(request_id)
            await self._abort_at(request_id, where)

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
        self.sink.close(request_id)
        self._placed.pop(request_id, None)

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
                task = self._load_watches.get(iid)
                if task is None or task.done():
                    self._load_watches[iid] = asyncio.create_task(self._watch_load(iid, reg.address))
            for iid in [i for i in self._load_watches if i not in regs]:
                self._load_watches.pop(iid).cancel()

    async def _watch_load(self, instance_id: str, address: str) -> None:
        domain = self._domain_of.get(instance_id, "")
        preempting = False
        while True:
            try:
                async for report in self._client(address).watch_load(min_interval_s=0.1):
                    used = report.used_blocks
                    self.metrics.set_instance_kv(instance_id, domain, used, report.total_blocks)
                    if report.preempting and not preempting:
                        self.metrics.preemptions.labels(instance=instance_id).inc()
                    preempting = report.preempting
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1.0)
