"""The HTTP front door (aiohttp): an OpenAI-compatible API over a :class:`~gateway.cluster.Backend`.

Routes:

| route | what |
|---|---|
| ``POST /v1/completions`` | text completion; ``stream: true`` for server-sent events |
| ``POST /v1/chat/completions`` | chat completion (the model's chat template, ``gateway.tokenizer``) |
| ``GET /v1/models`` | served models (``max_model_len`` = the topology's context) |
| ``GET /v1/models/{model}`` | one of them; 404 ``model_not_found`` for any other name |
| ``GET /health`` | 200 when some domain takes requests (not all drained), else 503 and why; ``domains``: all |
| ``GET /metrics`` | Prometheus text format (``gateway.metrics``) |

Every request gets the gateway's own id (``cmpl-<hex>`` / ``chatcmpl-<hex>``; the llumlets see ``<hex>``, or
``<hex>-<i>`` for choice ``i`` of ``n`` > 1): a client's ``X-Request-Id`` is echoed back in the response
header, never used to find a request, so a reused client id cannot disturb a running request. Bad input is
answered 400 before anything is dispatched (``gateway.validation``); with an API key file
(``gateway.apikeys``) a ``/v1/`` request without a valid key is a 401 and a priority above its key's ceiling a
403; every error, on any path (400, 401, 403, 404
for an unknown route or model, 405, 413 for a body over :data:`MAX_BODY_BYTES`, 415 for a body sent as a
form, multipart or text rather than JSON, 500, 502, 503), is OpenAI's error object (``gateway.responses.error_body``).

Choices: ``n`` > 1 dispatches ``n`` engine requests (placed, and possibly migrated, independently; with a
seed, choice ``i`` samples with seed + i). Each choice's text goes through its own
:class:`~gateway.output.ChoiceOutput` (incremental detokenization, stop strings); a choice ended by a stop
string has its engine request aborted at once. Streams interleave the choices' chunks, each chunk holding
one choice (its ``index``).

Extensions: request fields ``priority`` (or header ``X-Hilum-Priority``), vLLM's ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` and the others of docs/gateway.md; each response carries
``"hilum": {"request_id", "domain_id", "instance_id", "migrations", "moves"}`` (``n`` > 1: ``"hilum":
{"request_id", "choices": [one such object per choice, with its "index"]}``); in a stream the first chunk
of a choice carries where it was placed, its last chunk the whole object.

A client that disconnects (the handler is cancelled: ``handler_cancellation`` is on, or a write fails)
has its requests aborted everywhere (``Backend.abort_soon``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from gateway.apikeys import ApiKey, ApiKeys, Unauthorized
from gateway.cluster import Backend
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.output import ChoiceOutput, Piece
from gateway.responses import CompletionLogprobs, chat_logprobs, error_body, usage
from gateway.router import DispatchFailed, Placement
from gateway.sink import Move, TokenUpdate
from gateway.tokenizer import ByteTokenizer, Tokenizer
from gateway.validation import (
    PRIORITY_HEADER,
    BadRequest,
    GenerationRequest,
    ModelNotFound,
    PriorityGrant,
    PriorityNotAllowed,
    parse_chat,
    parse_completion,
)
from llumlet.engine.types import TokenLogprobs

__all__ = ["MAX_BODY_BYTES", "RETRY_AFTER_S", "GatewayApp", "build_app", "error_body"]

_log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024  # a request body larger than this is a 413
#: ``Retry-After`` (seconds) of a 503 ``no_capacity``: the domains' summaries are republished well within it
#: (``summary_interval_s``, 0.25 s by default), so a retry then sees the room that has freed up since. Clients that
#: honour the header (the ``openai`` client retries a 503 twice by default) wait this long, not their own backoff.
RETRY_AFTER_S = 1
# Content-Types a JSON body may come with: JSON itself, and the generic bytes type many HTTP clients send
# by default; anything else (a form, multipart, text) is a 415 that says what to send.
_BODY_TYPES = ("application/json", "application/octet-stream")
_MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
_CALLER = web.RequestKey("hilum_api_key", ApiKey)  # the key that authenticated the request (with a key file)

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
}
_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def _json(status: int, body: Any, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every HTTP error as OpenAI's error object (aiohttp's own 404, 405, 413 are plain text otherwise)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = f"no route {request.method} {request.path} (routes: /v1/completions, /v1/chat/completions, "
            message += "/v1/models, /v1/models/{model}, /health, /metrics)"
        elif exc.status == 405:
            message = f"{request.method} is not allowed on {request.path} (allowed: {exc.headers.get('Allow', '')})"
        elif exc.status == 413:
            message = f"the request body is larger than {request.app[_MAX_BODY_KEY]} bytes"
        else:
            message = exc.text or exc.reason
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "x-request-id")}
        kind = _ERROR_TYPES.get(exc.status, "server_error" if exc.status >= 500 else "invalid_request_error")
        return _json(exc.status, error_body(message, kind=kind, code=_ERROR_CODES.get(exc.status, "")), headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        _log.exception("%s %s failed", request.method, request.path)
        return _json(500, error_body(f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))


@dataclass(slots=True)
class _Choice:
    """One choice of a request as it runs."""

    index: int
    request_id: str  # the engine request's id
    placement: Placement
    output: ChoiceOutput
    finish_reason: str = ""
    error: str = ""
    instance_id: str = ""
    migrations: int = 0
    moves: tuple[Move, ...] = ()
    resumes: int = 0  # replays on another instance after its instance failed


@dataclass(slots=True)
class _Request:
    """One HTTP generation request: its choices and what all of them share."""

    kind: str
    request_id: str
    gen: GenerationRequest
    tokenizer: Tokenizer
    t0: float
    endpoint: str
    choices: list[_Choice] = field(default_factory=list)
    first_token_seen: bool = False

    @property
    def public_id(self) -> str:
        return f"{'cmpl' if self.kind == 'completion' else 'chatcmpl'}-{self.request_id}"

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output.token_ids) for c in self.choices)

    def error(self) -> str:
        failed = [c for c in self.choices if c.error or c.finish_reason == "error"]
        if not failed:
            return ""
        c = failed[0]
        return f"request {self.request_id} failed after {len(c.output.token_ids)} tokens: {c.error}"


_Emit = Callable[[_Choice, Piece], Awaitable[None]]


@dataclass(slots=True)
class GatewayApp:
    """Handlers bound to a backend, the models' tokenizers and metrics. :meth:`app` builds the aiohttp app.

    ``tokenizers``: one per served model (``gateway.tokenizer.load_tokenizers``); a model without one gets
    the byte stand-in.
    """

    backend: Backend
    metrics: GatewayMetrics
    tokenizers: Mapping[str, Tokenizer] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    started_s: int = 0  # wall time the models are served since (``created`` in /v1/models); 0 = at app()
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body is a 413
    api_keys: ApiKeys | None = None  # callers and their priority classes (gateway.apikeys); None = open

    def app(self) -> web.Application:
        """The aiohttp application with every route."""
        if not self.started_s:
            self.started_s = int(self.wall_clock())
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[_openai_errors, self._authenticate])
        app[_MAX_BODY_KEY] = self.max_body_bytes
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    @web.middleware
    async def _authenticate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """With a key file, every ``/v1/`` route needs a key of it (401 otherwise); /health, /metrics stay open."""
        if self.api_keys is not None and request.path.startswith("/v1/"):
            try:
                request[_CALLER] = self.api_keys.authenticate(request.headers.get("Authorization"))
            except Unauthorized as exc:
                if request.path in ("/v1/completions", "/v1/chat/completions"):
                    endpoint = request.path.removeprefix("/v1/").replace("/", "_")
                    self.metrics.count_request(endpoint, "unauthorized")
                body = error_body(str(exc), code="invalid_api_key")
                return _json(401, body, {"WWW-Authenticate": "Bearer"})
        return await handler(request)

    def tokenizer(self, model: str) -> Tokenizer:
        """The tokenizer of ``model`` (the byte stand-in when none was given)."""
        return self.tokenizers.get(model) or ByteTokenizer()

    # ---- simple routes ---------------------------------------------------------------------------
    def _model_object(self, name: str) -> dict[str, Any]:
        m = self.backend.limits[name]
        return {
            "id": m.name,
            "object": "model",
            "created": self.started_s,
            "owned_by": "hilum",
            "max_model_len": m.max_context_tokens,
            "hilum": {
                "max_request_kv_tokens": m.max_request_kv_tokens,
                "num_instances": m.num_instances,
                "tokenizer": self.tokenizer(name).description,
                "sampling_features": None if m.sampling_features is None else sorted(m.sampling_features),
            },
        }

    async def models(self, request: web.Request) -> web.Response:
        data = [self._model_object(name) for name in sorted(self.backend.limits)]
        return _json(200, {"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.backend.limits:
            served = ", ".join(sorted(self.backend.limits)) or "none"
            message = f"the model {json.dumps(name, ensure_ascii=False)} does not exist here; served: {served}"
            return _json(404, error_body(message, param="model", code="model_not_found"))
        return _json(200, self._model_object(name))

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
        ctype = request.content_type
        if request.headers.get("Content-Type") and ctype not in _BODY_TYPES and not ctype.endswith("+json"):
            raise web.HTTPUnsupportedMediaType(
                text=f"the request body must be JSON: send Content-Type: application/json (got {ctype})"
            )
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
        model = body.get("model") if isinstance(body, dict) else None
        tokenizer = self.tokenizer(model) if isinstance(model, str) else ByteTokenizer()
        caller: ApiKey | None = request.get(_CALLER)
        grant = PriorityGrant() if caller is None else PriorityGrant(caller.priority, caller.max_priority, caller.name)
        return parse(
            body, self.backend.limits, tokenizer, priority_header=request.headers.get(PRIORITY_HEADER), grant=grant
        )

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        t0 = self.clock()
        endpoint = "completions" if kind == "completion" else "chat_completions"
        headers = {"X-Request-Id": request.headers["X-Request-Id"]} if "X-Request-Id" in request.headers else {}
        try:
            gen = await self._parse(request, kind)
        except BadRequest as exc:
            self.metrics.count_request(endpoint, "bad_request")
            status = 404 if isinstance(exc, ModelNotFound) else 403 if isinstance(exc, PriorityNotAllowed) else 400
            return _json(status, error_body(exc.message, param=exc.param, code=exc.code), headers)
        req = _Request(kind, uuid.uuid4().hex, gen, self.tokenizer(gen.model), t0, endpoint)
        failed = await self._place(req, headers)
        if failed is not None:
            return failed
        self.metrics.running.inc()
        try:
            if gen.stream:
                return await self._stream(request, req, headers)
            return await self._whole(req, headers)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.count_request(endpoint, "aborted")
            for c in req.choices:
                self.backend.abort_soon(c.request_id)
            raise
        finally:
            self.metrics.running.dec()
            for c in req.choices:
                self.backend.finish(c.request_id)

    async def _place(self, req: _Request, headers: dict[str, str]) -> web.Response | None:
        """Dispatch every choice; on failure undo the placed ones and return the error response."""
        gen = req.gen
        ids = [req.request_id] if gen.n == 1 else [f"{req.request_id}-{i}" for i in range(gen.n)]
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(self.backend.start(rid, replace(gen, sampling=gen.choice_sampling(i), n=1)))
            for i, rid in enumerate(ids)
        ]
        try:
            results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            self.metrics.count_request(req.endpoint, "aborted")
            for rid, task in zip(ids, tasks, strict=True):
                self.backend.abort_soon(rid, task)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            for i, (rid, placement) in enumerate(zip(ids, results, strict=True)):
                assert isinstance(placement, Placement)
                out = ChoiceOutput(
                    req.tokenizer.detokenizer(gen.prompt_token_ids),
                    gen.stop,
                    gen.sampling.min_tokens,
                    gen.include_stop_str_in_output,
                )
                req.choices.append(_Choice(i, rid, placement, out, instance_id=placement.instance_id))
            return None
        for rid, r in zip(ids, results, strict=True):
            if isinstance(r, BaseException):
                self.backend.finish(rid)
            else:
                self.backend.abort_soon(rid)
        exc = errors[0]
        if isinstance(exc, DispatchFailed):
            self.metrics.count_request(req.endpoint, "unavailable" if exc.unavailable else "refused")
            retry = {**headers, "Retry-After": str(RETRY_AFTER_S)}
            return _json(503, error_body(exc.message, kind="service_unavailable", code="no_capacity"), retry)
        self.metrics.count_request(req.endpoint, "error")
        _log.error("dispatch of %s failed: %r", req.request_id, exc)
        return _json(500, error_body(f"dispatch failed: {exc}", kind="server_error"), headers)

    async def _run_choice(self, req: _Request, choice: _Choice, emit: _Emit) -> None:
        """Read the choice's tokens until it ends (engine finished, stop string, error), emitting each piece."""
        async with contextlib.aclosing(self.backend.updates(choice.request_id)) as updates:
            await self._follow(req, choice, updates, emit)

    async def _follow(
        self, req: _Request, choice: _Choice, updates: AsyncGenerator[TokenUpdate, None], emit: _Emit
    ) -> None:
        async for update in updates:
            if update.token_ids and not req.first_token_seen:
                req.first_token_seen = True
                self.metrics.ttft.observe(self.clock() - req.t0)
            choice.instance_id = update.instance_id or choice.instance_id
            choice.migrations, choice.moves, choice.resumes = update.migrations, update.moves, update.resumes
            piece = choice.output.push(update.token_ids, update.logprobs)
            self.metrics.output_tokens.inc(len(piece.token_ids))
            if piece.stopped is not None:
                choice.finish_reason = "stop"
                self.backend.abort_soon(choice.request_id)  # the engine would go on to max_tokens
                await emit(choice, piece)
                return
            if update.done:
                choice.finish_reason, choice.error = update.finish_reason, update.error
                if not choice.error and update.finish_reason != "error":
                    tail = choice.output.finish()
                    piece = Piece(piece.text + tail.text, piece.token_ids, piece.logprobs, tail.stopped)
                    if tail.stopped is not None:
                        choice.finish_reason = "stop"
            if piece.text or piece.token_ids:
                await emit(choice, piece)
            if update.done:
                return

    def _extension(self, req: _Request, choice: _Choice) -> dict[str, Any]:
        moves = []
        for m in choice.moves:
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
        out: dict[str, Any] = {"request_id": choice.request_id}
        if req.gen.n > 1:
            out["index"] = choice.index
        out.update(
            domain_id=self.backend.domain_of(choice.instance_id) or choice.placement.domain_id,
            instance_id=choice.instance_id,
            migrations=choice.migrations,
            moves=moves,
            resumes=choice.resumes,
        )
        return out

    @staticmethod
    def _logprobs(
        req: _Request, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], offsets: CompletionLogprobs
    ) -> dict[str, Any] | None:
        """The choice's logprobs object for these tokens in the endpoint's format (None: not asked for)."""
        if req.gen.sampling.logprobs is None:
            return None
        if req.kind == "completion":
            return offsets.chunk(token_ids, logprobs)
        return chat_logprobs(req.tokenizer, token_ids, logprobs)

    async def _whole(self, req: _Request, headers: dict[str, str]) -> web.Response:
        async def nothing(choice: _Choice, piece: Piece) -> None:
            return None

        await asyncio.gather(*(self._run_choice(req, c, nothing) for c in req.choices))
        error = req.error()
        if error:
            self.metrics.count_request(req.endpoint, "error")
            return _json(502, error_body(error, kind="upstream_error", code="request_failed"), headers)
        self.metrics.count_request(req.endpoint, "ok")
        choices = []
        for c in req.choices:
            out = c.output
            lps = self._logprobs(req, out.token_ids, out.logprobs, CompletionLogprobs(req.tokenizer))
            body: dict[str, Any] = {"index": c.index}
            if req.kind == "completion":
                body.update(text=out.text, logprobs=lps)
            else:
                body.update(message={"role": "assistant", "content": out.text}, logprobs=lps)
            body["finish_reason"] = c.finish_reason
            if req.gen.return_token_ids:
                body["token_ids"] = list(out.token_ids)
            choices.append(body)
        extension = (
            self._extension(req, req.choices[0])
            if req.gen.n == 1
            else {"request_id": req.request_id, "choices": [self._extension(req, c) for c in req.choices]}
        )
        return _json(
            200,
            {
                "id": req.public_id,
                "object": "text_completion" if req.kind == "completion" else "chat.completion",
                "created": int(self.wall_clock()),
                "model": req.gen.model,
                "choices": choices,
                "usage": usage(req.gen.prompt_tokens, req.completion_tokens),
                "hilum": extension,
            },
            headers,
        )

    async def _stream(self, request: web.Request, req: _Request, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        created = int(self.wall_clock())
        kind = req.kind
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        offsets = {c.index: CompletionLogprobs(req.tokenizer) for c in req.choices}
        announced: set[int] = set()

        def chunk(choice: _Choice, delta: str | None, finish: str | None, extra: dict[str, Any] | None) -> Any:
            body: dict[str, Any] = {"index": choice.index}
            if kind == "completion":
                body.update(text=delta or "", logprobs=None)
            else:
                body.update(delta={} if delta is None else {"content": delta}, logprobs=None)
            body["finish_reason"] = finish
            out: dict[str, Any] = {"id": req.public_id, "object": obj, "created": created, "model": req.gen.model}
            out["choices"] = [body]
            if extra:
                out.update(extra)
            return out

        def placed(choice: _Choice) -> dict[str, Any] | None:
            if choice.index in announced:
                return None
            announced.add(choice.index)
            p = choice.placement
            where = {"request_id": choice.request_id, "domain_id": p.domain_id, "instance_id": p.instance_id}
            return {"hilum": where if req.gen.n == 1 else {**where, "index": choice.index}}

        async def send(data: Any) -> None:
            await resp.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

        if kind == "chat":
            for c in req.choices:
                first = chunk(c, None, None, placed(c))
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                await send(first)

        queue: asyncio.Queue[tuple[_Choice, Piece] | _Choice] = asyncio.Queue()

        async def emit(choice: _Choice, piece: Piece) -> None:
            await queue.put((choice, piece))

        async def run(choice: _Choice) -> None:
            try:
                await self._run_choice(req, choice, emit)
            finally:
                await queue.put(choice)  # this choice is over

        tasks = [asyncio.get_running_loop().create_task(run(c)) for c in req.choices]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, _Choice):
                    running -= 1
                    if item.error or item.finish_reason == "error":
                        break
                    ext = {"hilum": self._extension(req, item)}
                    await send(chunk(item, None if kind == "chat" else "", item.finish_reason or "length", ext))
                    continue
                choice, piece = item
                data = chunk(choice, piece.text, None, placed(choice))
                if piece.token_ids:
                    lps = self._logprobs(req, piece.token_ids, piece.logprobs, offsets[choice.index])
                    data["choices"][0]["logprobs"] = lps
                    if req.gen.return_token_ids:
                        data["choices"][0]["token_ids"] = list(piece.token_ids)
                await send(data)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        error = req.error()
        if error:
            self.metrics.count_request(req.endpoint, "error")
            for c in req.choices:
                self.backend.abort_soon(c.request_id)
            await send(error_body(error, kind="upstream_error", code="request_failed"))
        else:
            self.metrics.count_request(req.endpoint, "ok")
            if req.gen.include_usage:
                await send(
                    {
                        "id": req.public_id,
                        "object": obj,
                        "created": created,
                        "model": req.gen.model,
                        "choices": [],
                        "usage": usage(req.gen.prompt_tokens, req.completion_tokens),
                    }
                )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def build_app(
    backend: Backend,
    metrics: GatewayMetrics,
    tokenizers: Mapping[str, Tokenizer] | None = None,
    api_keys: ApiKeys | None = None,
) -> web.Application:
    """The aiohttp application of a gateway over ``backend`` (``api_keys``: see ``gateway.apikeys``)."""
    return GatewayApp(backend, metrics, dict(tokenizers or {}), api_keys=api_keys).app()
