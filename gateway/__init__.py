"""gateway — the front door of a hilum cluster (DESIGN.md, "Components"; docs/gateway.md).

An OpenAI-compatible HTTP API (aiohttp) with streaming, validation before dispatch, domain choice by the
rule book over the domain summaries in etcd, and the token sink that keeps each response whole and in
order across live migrations. Modules: ``app`` (routes, SSE), ``validation`` (request bodies -> 400s),
``tokenizer`` (the bytes-as-tokens stand-in), ``router`` (domain choice, Submit, retries), ``sink``
(token delivery, migrations seen), ``cluster`` (the live backend: etcd view, router, sink, aborts),
``metrics`` (Prometheus), ``cli`` (``python -m gateway``).
"""

from gateway.app import GatewayApp, build_app
from gateway.cluster import Backend, LiveCluster
from gateway.metrics import GatewayMetrics
from gateway.router import DispatchFailed, DomainRouter, Placement
from gateway.sink import GatewaySink, TokenUpdate
from gateway.tokenizer import ByteTokenizer
from gateway.validation import BadRequest, GenerationRequest, ModelLimits, model_limits, parse_chat, parse_completion

__all__ = [
    "Backend",
    "BadRequest",
    "ByteTokenizer",
    "DispatchFailed",
    "DomainRouter",
    "GatewayApp",
    "GatewayMetrics",
    "GatewaySink",
    "GenerationRequest",
    "LiveCluster",
    "ModelLimits",
    "Placement",
    "TokenUpdate",
    "build_app",
    "model_limits",
    "parse_chat",
    "parse_completion",
]
