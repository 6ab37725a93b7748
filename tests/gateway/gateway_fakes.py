"""Fakes for the gateway's HTTP tests: backends that generate known tokens (bytes, or a real tokenizer's), and
model limits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from clusterstate.records import DomainRegistration, SummaryRecord
from gateway.app import GatewayApp
from gateway.metrics import GatewayMetrics
from gateway.router import DispatchFailed, Placement
from gateway.sink import Move, TokenUpdate
from gateway.tokenizer import Tokenizer
from gateway.validation import GenerationRequest, ModelLimits
from llumlet.engine.types import TokenLogprobs

# context 64 tokens; the largest instance holds 12 x 4 = 48 KV tokens
LIMITS = {
    "tiny": ModelLimits(
        "tiny", max_context_tokens=64, block_size_tokens=4, max_instance_capacity_blocks=12, num_instances=2
    )
}


def expected_tokens(request: GenerationRequest) -> list[int]:
    """The fake's output: ids 68, 69, ... (bytes "A", "B", ... + 3), max_tokens of them."""
    return [68 + (i % 26) for i in range(request.max_tokens)]


@dataclass
class FakeBackend:
    """Records dispatches; each request yields its tokens one by one, ``step_s`` apart."""

    step_s: float = 0.0
    fail_dispatch: str = ""
    started: list[tuple[str, GenerationRequest]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    migrate_at: int = -1  # token index at which the fake reports one migration
    limits: Mapping[str, ModelLimits] = field(default_factory=lambda: LIMITS)

    def health(self) -> tuple[bool, str]:
        return True, "fake"

    def ready_domains(self) -> list[str]:
        return ["dom-a"]

    def domain_of(self, instance_id: str) -> str:
        return {"a0": "dom-a", "b0": "dom-b"}.get(instance_id, "")

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        if self.fail_dispatch:
            raise DispatchFailed(self.fail_dispatch, unavailable=True)
        self.started.append((request_id, request))
        return Placement("dom-a", "a0", "127.0.0.1:1", "fake", 1)

    async def updates(self, request_id: str) -> AsyncIterator[TokenUpdate]:
        request = dict(self.started)[request_id]
        tokens = expected_tokens(request)
        migrations = 0
        for i, token in enumerate(tokens):
            if self.step_s:
                await asyncio.sleep(self.step_s)
            if i == self.migrate_at:
                migrations += 1
            last = i == len(tokens) - 1
            moves = (Move("a0", "b0", 0.01),) if migrations else ()
            owner = "b0" if migrations else "a0"
            yield TokenUpdate((token,), last, "length" if last else "", "", owner, migrations, moves)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def abort_soon(self, request_id: str, placement: Any = None) -> None:
        self.aborted.append(request_id)

    def finish(self, request_id: str) -> None:
        self.finished.append(request_id)


@contextlib.asynccontextmanager
async def serve(
    backend: Any, tokenizers: Mapping[str, Tokenizer] | None = None
) -> AsyncIterator[tuple[TestClient[Any, Any], GatewayMetrics]]:
    """An in-process HTTP server over ``backend`` (with these models' tokenizers) and a client to it."""
    metrics = GatewayMetrics()
    app = GatewayApp(backend, metrics, dict(tokenizers or {}), wall_clock=lambda: 1_700_000_000.0).app()
    server = TestServer(app)
    client: TestClient[Any, Any] = TestClient(server)
    await client.start_server()
    try:
        yield client, metrics
    finally:
        await client.close()


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run an async test body."""
    asyncio.run(main())


@dataclass
class ScriptedBackend(FakeBackend):
    """A cluster whose "model" answers with known text in the model's own tokens: for a request with seed
    ``s`` (None: 0) the answer is ``answers[s % len(answers)]``, encoded by ``tokenizer`` (its BOS dropped),
    cut at ``max_tokens`` (finish "length"), else ended by EOS (finish "stop", EOS kept as the last token, as
    engines do). Tokens come ``chunk`` at a time; with ``sampling.logprobs`` = k each token carries a made-up
    but checkable :class:`TokenLogprobs` (logprob ``-0.5 * position``; top k: the token itself with that
    logprob, then ids 3, 4, ... at -10, -11, ...). Records dispatches, aborts and ends like FakeBackend.
    """

    tokenizer: Any = None
    answers: tuple[str, ...] = ()
    eos_token_id: int = 2
    chunk: int = 2

    async def start(self, request_id: str, request: GenerationRequest) -> Placement:
        self.started.append((request_id, request))
        return Placement("dom-a", "a0", "127.0.0.1:1", "scripted", 1)

    def output_of(self, request: GenerationRequest) -> tuple[list[int], str]:
        """The tokens and finish reason the fake produces for ``request``."""
        answer = self.answers[(request.sampling.seed or 0) % len(self.answers)]
        tokens = [*self.tokenizer.encode(answer)[1:], self.eos_token_id]
        if len(tokens) > request.max_tokens:
            return tokens[: request.max_tokens], "length"
        return tokens, "stop"

    async def updates(self, request_id: str) -> AsyncIterator[TokenUpdate]:
        request = dict(self.started)[request_id]
        tokens, reason = self.output_of(request)
        k = request.sampling.logprobs
        for i in range(0, len(tokens), self.chunk):
            part = tuple(tokens[i : i + self.chunk])
            lps: tuple[TokenLogprobs, ...] = ()
            if k is not None:
                lps = tuple(
                    TokenLogprobs(-0.5 * (i + j), ((t, -0.5 * (i + j)), *((3 + m, -10.0 - m) for m in range(k)))[:k])
                    for j, t in enumerate(part)
                )
            last = i + self.chunk >= len(tokens)
            await asyncio.sleep(0)
            yield TokenUpdate(part, last, reason if last else "", "", "a0", 0, (), lps)


@dataclass
class Source:
    """What DomainRouter reads of the cluster view: fixed domain registrations and summaries."""

    regs: dict[str, DomainRegistration]
    sums: dict[str, SummaryRecord]
    version: int = 1

    def domains(self) -> dict[str, DomainRegistration]:
        return self.regs

    def summaries(self) -> dict[str, SummaryRecord]:
        return self.sums
