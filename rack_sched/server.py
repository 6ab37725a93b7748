"""The domain scheduler's gRPC server (grpc.aio): ``hilum.v1.RackScheduler`` (rack_sched.proto).

A refusal is an answer (``DispatchReply.outcome``); bad input is ``INVALID_ARGUMENT`` with the field named.
"""

from __future__ import annotations

import logging
from typing import Any, TypeAlias

import grpc

from hilum_proto.v1 import llumlet_pb2
from hilum_proto.v1 import rack_sched_pb2 as pb
from hilum_proto.v1 import rack_sched_pb2_grpc as pb_grpc
from rack_sched import convert
from rack_sched.core import DomainRequest
from rack_sched.scheduler import DomainScheduler

__all__ = ["RackSchedulerService", "start_server"]

_log = logging.getLogger(__name__)

_Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class RackSchedulerService(pb_grpc.RackSchedulerServicer):
    """Implements ``hilum.v1.RackScheduler`` over one :class:`DomainScheduler`."""

    def __init__(self, scheduler: DomainScheduler) -> None:
        self._s = scheduler

    async def Ping(self, request: pb.RackPingRequest, context: _Ctx) -> pb.RackPingReply:
        return pb.RackPingReply(
            domain_id=self._s.cfg.domain_id,
            num_instances=len(self._s.core.loads()),
            ready=self._s.ready.is_set(),
        )

    async def Submit(self, request: llumlet_pb2.SubmitRequest, context: _Ctx) -> pb.DispatchReply:
        try:
            prompt = convert.prompt_length(request)
            spec = DomainRequest(
                request.request_id,
                request.model,
                prompt,
                request.sampling.max_tokens,
                request.priority,
                only_if_room=request.only_if_room,
                prefix_hashes=tuple(request.prefix_block_hashes),
                prefix_block_tokens=request.prefix_hash_block_tokens,
            )
            block = self._s.cfg.block_size_tokens
            if spec.prefix_hashes and spec.prefix_block_tokens % block:
                raise ValueError(
                    f"SubmitRequest {request.request_id!r}: prefix_hash_block_tokens {spec.prefix_block_tokens} is "
                    f"not a multiple of this domain's KV block size {block}"
                )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return convert.dispatch_reply(await self._s.submit(spec, request))

    async def GetDomainState(self, request: pb.GetDomainStateRequest, context: _Ctx) -> pb.DomainState:
        return convert.domain_state(self._s.state())


async def start_server(scheduler: DomainScheduler, server: grpc.aio.Server) -> None:
    """Add the RackScheduler service for ``scheduler`` to a bound ``server`` and start it."""
    pb_grpc.add_RackSchedulerServicer_to_server(RackSchedulerService(scheduler), server)
    await server.start()
    _log.debug("domain scheduler %s serving at %s", scheduler.cfg.domain_id, scheduler.cfg.advertise_address)
