"""gateway — the front door of a hilum cluster (DESIGN.md, "Components"; docs/gateway.md).

An OpenAI-compatible HTTP API (aiohttp) with streaming, validation before dispatch, domain choice by the
rule book over the domain summaries in etcd, and the token sink that keeps each response whole and in
order across live migrations. Modules: ``app`` (routes, SSE, choices), ``validation`` (request bodies ->
400s), ``tokenizer`` (the model's Hugging Face tokenizer and chat template, incremental detokenization; the
bytes-as-tokens stand-in), ``output`` (a choice's text: stop strings, what a stream may show),
``responses`` (OpenAI's error, usage and logprobs objects), ``router`` (domain choice, Submit, retries),
``sink`` (token delivery, migrations seen), ``cluster`` (the live backend: etcd view, router, sink, aborts),
``metrics`` (Prometheus), ``cli`` (``python -m gateway``).
"""

from gateway.app import GatewayApp, build_app
from gateway.cluster import Backend, LiveCluster
from gateway.metrics import GatewayMetrics
from gateway.output import ChoiceOutput, Piece
from gateway.router import DispatchFailed, DomainRouter, Placement
from gateway.sink import GatewaySink, TokenUpdate
from gateway.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizers
from gateway.validation import (
    BadRequest,
    GenerationRequest,
    ModelLimits,
    ModelNotFound,
    model_limits,
    parse_chat,
    parse_completion,
)

__all__ = [
    "Backend",
    "BadRequest",
    "ByteTokenizer",
    "ChoiceOutput",
    "DispatchFailed",
    "DomainRouter",
    "GatewayApp",
    "GatewayMetrics",
    "GatewaySink",
    "GenerationRequest",
    "HFTokenizer",
    "LiveCluster",
    "ModelLimits",
    "ModelNotFound",
    "Piece",
    "Placement",
    "TokenUpdate",
    "Tokenizer",
    "build_app",
    "load_tokenizers",
    "model_limits",
    "parse_chat",
    "parse_completion",
]
