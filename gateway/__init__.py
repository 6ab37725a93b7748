"""gateway — the front door of a hilum cluster (DESIGN.md, "Components"; docs/gateway.md).

An OpenAI-compatible HTTP API (aiohttp) with streaming, validation before dispatch, domain choice by the
rule book over the domain summaries in etcd, and the token sink that keeps each response whole and in
order across live migrations. Modules: ``app`` (routes, SSE, choices), ``validation`` (request bodies ->
400s), ``tokenizer`` (the model's Hugging Face tokenizer and chat template, incremental detokenization; the
bytes-as-tokens stand-in), ``output`` (a choice's text: stop strings, what a stream may show),
``responses`` (OpenAI's error, usage and logprobs objects), ``router`` (domain choice, Submit, retries),
``sink`` (token delivery, migrations seen), ``cluster`` (the live backend: etcd view, router, sink, aborts),
``metrics`` (Prometheus), ``cli`` (``python -m gateway``).

The names below are exported lazily (PEP 562): ``from gateway import GatewayApp`` imports ``gateway.app``
(and aiohttp) only then, so a user of the pure decision core (``gateway.core``, which the simulator runs)
imports no HTTP server, gRPC or etcd client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# exported name -> the submodule that defines it
_EXPORTS: dict[str, str] = {
    "Backend": "gateway.cluster",
    "BadRequest": "gateway.validation",
    "ByteTokenizer": "gateway.tokenizer",
    "ChoiceOutput": "gateway.output",
    "DispatchFailed": "gateway.router",
    "DomainRouter": "gateway.router",
    "GatewayApp": "gateway.app",
    "GatewayMetrics": "gateway.metrics",
    "GatewaySink": "gateway.sink",
    "GenerationRequest": "gateway.validation",
    "HFTokenizer": "gateway.tokenizer",
    "LiveCluster": "gateway.cluster",
    "ModelLimits": "gateway.validation",
    "ModelNotFound": "gateway.validation",
    "Piece": "gateway.output",
    "Placement": "gateway.router",
    "TokenUpdate": "gateway.sink",
    "Tokenizer": "gateway.tokenizer",
    "build_app": "gateway.app",
    "load_tokenizers": "gateway.tokenizer",
    "model_limits": "gateway.validation",
    "parse_chat": "gateway.validation",
    "parse_completion": "gateway.validation",
}

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


def __getattr__(name: str) -> Any:
    """``name`` from the submodule that defines it, imported on first use (PEP 562); AttributeError for any other."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
