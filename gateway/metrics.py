"""The gateway's Prometheus metrics (prometheus-client), on a registry of their own (no global state).

Every metric is named ``hilum_gateway_*`` and measured where the gateway stands: at the front door.

Counters: ``requests_total{endpoint, outcome}`` (outcome ``ok``, ``bad_request``, ``unauthorized``, ``refused``,
``unavailable``, ``aborted`` = the client left, ``error``), ``output_tokens_total``,
``migrations_total{scope}`` (committed migrations of this gateway's requests, ``intra_domain`` or
``cross_domain``, seen as owner changes in the token stream), ``preemptions_total{instance}`` (preemption
episodes: load reports where the instance turned ``preempting``), ``dispatch_retries_total{reason}``.
Gauges: ``requests_running``, ``instance_kv_used_blocks{instance, domain}``,
``instance_kv_usage_ratio{instance, domain}``, ``instance_prefix_hit_tokens{instance, domain}`` and
``instance_prefix_query_tokens{instance, domain}`` (the instance's prefix-cache counters since its engine
started: hit rate = hits / queries) (from each llumlet's WatchLoad stream; an instance's series leave
when it deregisters). ``resumes_total{outcome}`` and ``replayed_tokens_total``: requests whose instance failed
(``gateway.core.plan_resume``).
Histograms: ``ttft_seconds`` (request received -> first token received), ``tbt_seconds`` (between tokens
as received; a push of k tokens counts k gaps of dt/k), ``migration_downtime_seconds{scope}`` (the token
gap across an owner change: the old owner's last token -> the new owner's first; an upper bound of the
real downtime, about one decode step more). Full table: docs/gateway.md.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "GatewayMetrics", "Outcome"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TBT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_DOWNTIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

Outcome = str  # "ok" | "bad_request" | "unauthorized" | "refused" | "unavailable" | "aborted" | "error"


class GatewayMetrics:
    """The metrics of one gateway (see the module docstring), on ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "hilum_gateway_"
        self.requests = Counter(
            p + "requests", "HTTP requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.running = Gauge(p + "requests_running", "requests dispatched and not yet done", registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "time to first token, s", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tbt = Histogram(
            p + "tbt_seconds", "time between tokens as received, s", buckets=_TBT_BUCKETS_S, registry=r
        )
        self.output_tokens = Counter(p + "output_tokens", "output tokens delivered to clients", registry=r)
        self.migrations = Counter(
            p + "migrations", "committed migrations of this gateway's requests", ["scope"], registry=r
        )
        self.downtime = Histogram(
            p + "migration_downtime_seconds",
            "token gap across a migration (old owner's last token -> new owner's first), s",
            ["scope"],
            buckets=_DOWNTIME_BUCKETS_S,
            registry=r,
        )
        self.preemptions = Counter(
            p + "preemptions", "preemption episodes seen in load reports", ["instance"], registry=r
        )
        self.kv_used = Gauge(p + "instance_kv_used_blocks", "KV blocks in use", ["instance", "domain"], registry=r)
        self.kv_ratio = Gauge(
            p + "instance_kv_usage_ratio", "KV blocks used / capacity", ["instance", "domain"], registry=r
        )
        self.prefix_hits = Gauge(
            p + "instance_prefix_hit_tokens",
            "prompt tokens the instance served from its prefix cache since its engine started",
            ["instance", "domain"],
            registry=r,
        )
        self.prefix_queries = Gauge(
            p + "instance_prefix_query_tokens",
            "prompt tokens the instance looked up in its prefix cache since its engine started",
            ["instance", "domain"],
            registry=r,
        )
        self.retries = Counter(p + "dispatch_retries", "dispatch retried on another domain", ["reason"], registry=r)
        self.resumes = Counter(
            p + "resumes", "requests whose instance failed, by what was done (gateway.core.plan_resume)", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.replayed_tokens = Counter(
            p + "replayed_tokens", "delivered output tokens sent again as prompt by replays", registry=r
        )
        for outcome in ("replayed", "completed", "not_replayable", "limit", "no_capacity"):
            self.resumes.labels(outcome=outcome)
        for scope in ("intra_domain", "cross_domain"):  # export zeros from the start
            self.migrations.labels(scope=scope)
            self.downtime.labels(scope=scope)

    def count_request(self, endpoint: str, outcome: Outcome) -> None:
        """Count one finished HTTP request."""
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def observe_migration(self, cross_domain: bool, gap_s: float | None) -> None:
        """Count one committed migration; ``gap_s``: the token gap across it, None when unknown."""
        scope = "cross_domain" if cross_domain else "intra_domain"
        self.migrations.labels(scope=scope).inc()
        if gap_s is not None:
            self.downtime.labels(scope=scope).observe(gap_s)

    def set_instance_kv(self, instance_id: str, domain_id: str, used_blocks: int, capacity_blocks: int) -> None:
        """Per-instance KV usage (capacity 0: the ratio is not set)."""
        self.kv_used.labels(instance=instance_id, domain=domain_id).set(used_blocks)
        if capacity_blocks > 0:
            self.kv_ratio.labels(instance=instance_id, domain=domain_id).set(used_blocks / capacity_blocks)

    def set_instance_prefix(self, instance_id: str, domain_id: str, hit_tokens: int, query_tokens: int) -> None:
        """Per-instance prefix-cache counters, tokens since its engine started (``LoadReport.prefix_hit_tokens``,
        ``prefix_query_tokens``)."""
        self.prefix_hits.labels(instance=instance_id, domain=domain_id).set(hit_tokens)
        self.prefix_queries.labels(instance=instance_id, domain=domain_id).set(query_tokens)

    def remove_instance(self, instance_id: str, domain_id: str) -> None:
        """An instance deregistered: its series leave the page (a dead instance's gauges do not linger)."""
        for metric, labels in (
            (self.kv_used, (instance_id, domain_id)),
            (self.kv_ratio, (instance_id, domain_id)),
            (self.prefix_hits, (instance_id, domain_id)),
            (self.prefix_queries, (instance_id, domain_id)),
            (self.preemptions, (instance_id,)),
        ):
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
