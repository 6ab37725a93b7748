"""Engine model: KV block accounting, continuous batching, step latency (clock-free).

Shared by the discrete-event simulator (virtual clock) and the real-time "sim" llumlet backend.
"""

from llumlet.engine.blocks import BlockManager, PrefixMatch
from llumlet.engine.core import EngineCore, RequestStats, RequestTooLargeError
from llumlet.engine.latency import (
    LatencyModel,
    UnsupportedLatencyModelError,
    load_latency_model,
    supported_latency_models,
)
from llumlet.engine.protocol import BlockRun, Engine, KVPayload
from llumlet.engine.scheduler import RequestStatus, ScheduledBatch, Scheduler, SchedulerRequest
from llumlet.engine.types import (
    EngineLoad,
    EngineRequest,
    MigrationState,
    RunningRequestLoad,
    SamplingParams,
    StepResult,
)

__all__ = [
    "BlockManager",
    "BlockRun",
    "Engine",
    "EngineCore",
    "EngineLoad",
    "EngineRequest",
    "KVPayload",
    "LatencyModel",
    "MigrationState",
    "PrefixMatch",
    "RequestStats",
    "RequestStatus",
    "RequestTooLargeError",
    "RunningRequestLoad",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerRequest",
    "StepResult",
    "UnsupportedLatencyModelError",
    "load_latency_model",
    "supported_latency_models",
]
