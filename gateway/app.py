"""The HTTP front door (aiohttp): an OpenAI-compatible API over a :class:`~gateway.cluster.Backend`.

Routes:

| route | what |
|---|---|
| ``POST /v1/completions`` | text completion; ``stream: true`` for server-sent events |
| ``POST /v1/chat/completions`` | chat completion (the stand-in template of ``gateway.validation.chat_prompt``) |
| ``GET /v1/models`` | served models (``max_model_len`` = the topology's context) |
| ``GET /health`` | 200 when some domain can take requests, else 503 with the reason; ``domains`` lists them |
| ``GET /metrics`` | Prometheus text format (``gateway.metrics``) |

Every request gets the gateway's own id (``cmpl-<hex>`` / ``chatcmpl-<hex>``; the llumlets see ``<hex>``): a
client's ``X-Request-Id`` is echoed back in the response header, never used to find a request, so a reused
client id cannot disturb a running request. Bad input is answered 400 before anything is dispatched, with
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``; no domain accepting the request
is 503. Extensions: request fields ``priority`` (or header ``X-Hilum-Priority``), ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (vLLM's names); each response (the last chunk of a stream) carries
``"hilum": {"request_id", "domain_id", "instance_id", "migrations"}``.

A client that disconnects (the handler is cancelled: ``handler_cancellation`` is on, or a write fails)
has its request aborted everywhere (``Backend.abort_soon``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.cluster import Backend
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.router import DispatchFailed, Placement
from gateway.sink import Move, TokenUpdate
from gateway.tokenizer import ByteTokenizer
from gateway.validation import PRIORITY_HEADER, BadRequest, GenerationRequest, parse_chat, parse_completion

__all__ = ["GatewayApp", "build_app", "error_body"]

_log = logging.getLogger(__name__)

_FINISH = {"length": "length", "stop": "stop", "abort": "abort"}


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str = "") -> Any:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code or None}}


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


@dataclass(slots=True)
class _Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    instance_id: str = ""
    migrations: int = 0
    moves: tuple[Move, ...] = ()


@dataclass(slots=True)
class GatewayApp:
    """Handlers bound to a backend, a tokenizer and metrics. :meth:`app` builds the aiohttp application."""

    backend: Backend
    metrics: GatewayMetrics
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time

    def app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    # ---- simple routes ---------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": 0,
                "owned_by": "hilum",
                "max_model_len": m.max_context_tokens,
                "hilum": {"max_request_kv_tokens": m.max_request_kv_tokens, "num_instances": m.num_instances},
            }
            for m in sorted(self.backend.limits.values(), key=lambda m: m.name)
        ]
        return _json(200, {"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        ok, detail = self.backend.health()
        body = {"status": "ok" if ok else "unavailable", "detail": detail, "domains": self.backend.ready_domains()}
        return _json(200 if ok else 503, body)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ---- generation ---------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _parse(self, request: web.Request, kind: str) -> GenerationRequest:
        try:
            raw = await request.read()
        except web.HTTPException:
            raise
        except Exception as exc:  # a body that cannot be decoded as sent (bad Content-Encoding, ...)
            raise BadRequest(f"the request body cannot be read: {exc}", code="invalid_body") from None
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise BadRequest("the request body nests JSON too deeply", code="invalid_json") from None
        parse = parse_completion if kind == "completion" else parse_chat
        try:
            return parse(
                body, self.backend.limits, self.tokenizer, priority_header=request.headers.get(PRIORITY_HEADER)
            )
        except UnicodeEncodeError as exc:  # e.g. a lone surrogate escape ("\ud800") in the prompt
            raise BadRequest(f"the text is not valid Unicode: {exc.reason} at position {exc.start}") from None

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        t0 = self.clock()
        endpoint = "completions" if kind == "completion" else "chat_completions"
        headers = {"X-Request-Id": request.headers["X-Request-Id"]} if "X-Request-Id" in request.headers else {}
        try:
            gen = await self._parse(request, kind)
        except BadRequest as exc:
            self.metrics.count_request(endpoint, "bad_request")
            return _json(400, error_body(exc.message, param=exc.param, code=exc.code), headers)
        request_id = uuid.uuid4().hex
        placing = asyncio.get_running_loop().create_task(self.backend.start(request_id, gen))
        try:
            placement = await asyncio.shield(placing)
        except asyncio.CancelledError:
            self.metrics.count_request(endpoint, "aborted")
            self.backend.abort_soon(request_id, placing)
            raise
        except DispatchFailed as exc:
            self.backend.finish(request_id)
            self.metrics.count_request(endpoint, "unavailable" if exc.unavailable else "refused")
            return _json(503, error_body(exc.message, kind="service_unavailable", code="no_capacity"), headers)
        except Exception as exc:
            self.backend.finish(request_id)
            self.metrics.count_request(endpoint, "error")
            _log.exception("dispatch of %s failed", request_id)
            return _json(500, error_body(f"dispatch failed: {exc}", kind="internal_error"), headers)
        self.metrics.running.inc()
        try:
            if gen.stream:
                return await self._stream(request, kind, request_id, gen, placement, t0, endpoint, headers)
            return await self._whole(kind, request_id, gen, placement, t0, endpoint, headers)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.count_request(endpoint, "aborted")
            self.backend.abort_soon(request_id)
            raise
        finally:
            self.metrics.running.dec()
            self.backend.finish(request_id)

    def _extension(self, request_id: str, placement: Placement, result: _Result) -> dict[str, Any]:
        moves = []
        for m in result.moves:
            src, dst = self.backend.domain_of(m.src_instance_id), self.backend.domain_of(m.dst_instance_id)
            moves.append(
                {
                    "src_instance_id": m.src_instance_id,
                    "dst_instance_id": m.dst_instance_id,
                    "src_domain_id": src,
                    "dst_domain_id": dst,
                    "cross_domain": src != dst,
                    "token_gap_s": m.token_gap_s,
                }
            )
        return {
            "request_id": request_id,
            "domain_id": placement.domain_id,
            "instance_id": result.instance_id,
            "migrations": result.migrations,
            "moves": moves,
        }

    def _observe_first(self, t0: float, result: _Result, new: tuple[int, ...]) -> None:
        if new and not result.token_ids:
            self.metrics.ttft.observe(self.clock() - t0)
        self.metrics.output_tokens.inc(len(new))

    async def _whole(
        self,
        kind: str,
        request_id: str,
        gen: GenerationRequest,
        placement: Placement,
        t0: float,
        endpoint: str,
        headers: dict[str, str],
    ) -> web.Response:
        result = _Result(instance_id=placement.instance_id)
        async for update in self.backend.updates(request_id):
            self._observe_first(t0, result, update.token_ids)
            _absorb(result, update)
            if update.done:
                result.finish_reason, result.error = update.finish_reason, update.error
        if result.error or result.finish_reason == "error":
            self.metrics.count_request(endpoint, "error")
            message = f"request {request_id} failed after {len(result.token_ids)} tokens: {result.error}"
            return _json(502, error_body(message, kind="upstream_error", code="request_failed"), headers)
        self.metrics.count_request(endpoint, "ok")
        body = self._body(kind, request_id, gen, placement, result)
        return _json(200, body, headers)

    def _body(
        self, kind: str, request_id: str, gen: GenerationRequest, placement: Placement, result: _Result
    ) -> dict[str, Any]:
        text = self.tokenizer.decode(result.token_ids)
        finish = _FINISH.get(result.finish_reason, result.finish_reason)
        choice: dict[str, Any]
        if kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        if gen.return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        return {
            "id": _public_id(kind, request_id),
            "object": "text_completion" if kind == "completion" else "chat.completion",
            "created": int(self.wall_clock()),
            "model": gen.model,
            "choices": [choice],
            "usage": _usage(gen, len(result.token_ids)),
            "hilum": self._extension(request_id, placement, result),
        }

    async def _stream(
        self,
        request: web.Request,
        kind: str,
        request_id: str,
        gen: GenerationRequest,
        placement: Placement,
        t0: float,
        endpoint: str,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        created = int(self.wall_clock())
        public_id = _public_id(kind, request_id)
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"

        def chunk(delta: str | None, finish: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if kind == "completion":
                choice.update(text=delta or "", logprobs=None)
            else:
                choice["delta"] = {} if delta is None else {"content": delta}
            out: dict[str, Any] = {"id": public_id, "object": obj, "created": created, "model": gen.model}
            out["choices"] = [choice]
            if extra:
                out.update(extra)
            return out

        async def send(data: Any) -> None:
            await resp.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

        placed = {"request_id": request_id, "domain_id": placement.domain_id, "instance_id": placement.instance_id}
        if kind == "chat":
            first = chunk(None, None, {"hilum": placed})
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await send(first)
            placed = {}
        result = _Result(instance_id=placement.instance_id)
        async for update in self.backend.updates(request_id):
            self._observe_first(t0, result, update.token_ids)
            _absorb(result, update)
            if update.token_ids:
                data = chunk(self.tokenizer.decode(update.token_ids), None, {"hilum": placed} if placed else None)
                placed = {}
                if gen.return_token_ids:
                    data["choices"][0]["token_ids"] = list(update.token_ids)
                await send(data)
            if update.done:
                result.finish_reason, result.error = update.finish_reason, update.error
        if result.error or result.finish_reason == "error":
            self.metrics.count_request(endpoint, "error")
            message = f"request {request_id} failed after {len(result.token_ids)} tokens: {result.error}"
            await send(error_body(message, kind="upstream_error", code="request_failed"))
        else:
            self.metrics.count_request(endpoint, "ok")
            finish = _FINISH.get(result.finish_reason, result.finish_reason)
            await send(
                chunk(None if kind == "chat" else "", finish, {"hilum": self._extension(request_id, placement, result)})
            )
            if gen.include_usage:
                await send(
                    {
                        "id": public_id,
                        "object": obj,
                        "created": created,
                        "model": gen.model,
                        "choices": [],
                        "usage": _usage(gen, len(result.token_ids)),
                    }
                )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _public_id(kind: str, request_id: str) -> str:
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request_id}"


def _usage(gen: GenerationRequest, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": gen.prompt_tokens + completion_tokens,
    }


def _absorb(result: _Result, update: TokenUpdate) -> None:
    result.token_ids.extend(update.token_ids)
    result.instance_id = update.instance_id or result.instance_id
    result.migrations = update.migrations
    result.moves = update.moves


def build_app(backend: Backend, metrics: GatewayMetrics, tokenizer: ByteTokenizer | None = None) -> web.Application:
    """The aiohttp application of a gateway over ``backend``."""
    return GatewayApp(backend, metrics, tokenizer or ByteTokenizer()).app()
