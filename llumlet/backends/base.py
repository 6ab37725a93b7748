"""The backend value types and the factory by name (STYLE.md: a string and a factory with a clear error)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llumlet.engine.prefix_hash import PrefixCacheConfig
from llumlet.engine.protocol import Engine
from llumlet.engine.types import SamplingFeature, SamplingParams, StepResult
from topology.load import tokenizer_errors
from topology.spec import Topology

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendConfig",
    "UnknownBackendError",
    "engine_option_refusal",
    "make_backend",
    "parse_engine_options",
]

#: Backends ``make_backend`` knows, in the order the CLI lists them.
BACKEND_NAMES: tuple[str, ...] = ("sim", "torch", "vllm")


class UnknownBackendError(ValueError):
    """No backend of that name; the message lists the known ones."""


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """What a llumlet tells its backend factory.

    With a ``topology`` the instance's spec gives the model, GPU type, tensor-parallel degree and KV capacity
    (the sim backend's latency model and sizes); ``num_blocks`` / ``block_size_tokens`` override them.
    ``options`` are backend-specific ``key=value`` settings (the CLI's ``--engine-option``). ``tokenizer``
    (the CLI's ``--tokenizer``) overrides where the model's tokenizer is (the topology's ``models[].tokenizer``).
    """

    instance_id: str
    topology: Topology | None = None
    num_blocks: int | None = None  # KV cache capacity override, blocks
    block_size_tokens: int | None = None  # tokens per block override
    time_scale: float = 1.0  # sim: wall seconds per modelled second (0 = do not wait at all)
    min_step_s: float = 0.0  # every step lasts at least this long (slows a fast engine down for tests)
    max_num_seqs: int = 256  # requests per batch at most
    max_num_batched_tokens: int = 8192  # tokens per step at most
    seed: int = 0  # backend randomness (torch: model weights)
    options: Mapping[str, str] = field(default_factory=dict)
    tokenizer: str | None = None  # the model's tokenizer directory; None = the topology model's ``tokenizer``
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)  # sim: caching on/off

    def tokenizer_path(self) -> str | None:
        """``tokenizer``, else the topology model's ``tokenizer`` (None when neither names one).

        Raises ValueError naming the topology key (``<file>: models[i].tokenizer: ...``) when the topology's
        directory is not there.
        """
        if self.tokenizer is not None:
            return self.tokenizer
        if self.topology is None:
            return None
        model = self.topology.instance(self.instance_id).model
        missing = tokenizer_errors(self.topology, [model])
        if missing:
            raise ValueError(missing[0])
        return self.topology.models[model].tokenizer

    def __post_init__(self) -> None:
        if self.time_scale < 0 or self.min_step_s < 0:
            raise ValueError(
                f"BackendConfig: time_scale = {self.time_scale}, min_step_s = {self.min_step_s}: need >= 0"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"BackendConfig.num_blocks = {self.num_blocks}: need >= 1")
        if self.block_size_tokens is not None and self.block_size_tokens < 1:
            raise ValueError(f"BackendConfig.block_size_tokens = {self.block_size_tokens}: need >= 1")


@dataclass(frozen=True, slots=True)
class Backend:
    """An engine plus how the llumlet drives it.

    ``time_scale`` > 0: the engine is a model whose ``StepResult.duration_s`` is modelled time; the llumlet
    makes each step last ``duration_s x time_scale`` of wall time. 0: steps take the time they compute.
    ``min_step_s``: every step lasts at least this long (wall time).
    ``real_token_ids``: ``StepResult.token_ids`` holds real ids; otherwise the llumlet numbers tokens by
    their position (token id = seq), which makes every sim stream ``0, 1, 2, ...``.
    ``sampling_features``: the optional sampling settings the engine honours (and carries across a
    migration); a request using any other is refused at Submit (:meth:`refuses`). The llumlet's etcd
    registration advertises them, so the gateway refuses such a request with a 400 before dispatch.
    """

    name: str
    engine: Engine
    time_scale: float = 0.0
    real_token_ids: bool = True
    min_step_s: float = 0.0
    sampling_features: frozenset[SamplingFeature] = frozenset()

    def step_wall_s(self, result: StepResult) -> float:
        """Wall time the step should take in total (0 = as fast as it computes)."""
        return max(result.duration_s * self.time_scale, self.min_step_s)

    def refuses(self, params: SamplingParams | None) -> str | None:
        """Why this engine cannot run a request with ``params`` (naming the features), or None."""
        missing = sorted((params.features() if params is not None else frozenset()) - self.sampling_features)
        if not missing:
            return None
        return (
            f"the {self.name} engine does not honour {', '.join(missing)} (it honours: "
            + (", ".join(sorted(self.sampling_features)) or "none of the optional sampling features")
            + ")"
        )


def parse_engine_options(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (the CLI's ``--engine-option``) as ``BackendConfig.options``; a later key wins.

    Raises ValueError naming an item without ``=`` or with an empty key.
    """
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option {item!r}: need KEY=VALUE")
        out[key] = value
    return out


def engine_option_refusal(name: str, options: Iterable[str]) -> str | None:
    """Why backend ``name`` would refuse the ``--engine-option`` names ``options``, before it is built (a launcher
    checks before starting anything): "NAMES: the sim engine takes no option", "NAMES: the torch engine has no such
    option (known: ...)"; None when it takes them all (their values are the backend's to check). Raises
    UnknownBackendError for an unknown ``name``."""
    if name == "sim":
        given = sorted(options)
        return f"{', '.join(given)}: the sim engine takes no option" if given else None
    if name not in ("torch", "vllm"):
        raise UnknownBackendError(f"unknown engine backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    from llumlet.backends import torch_backend, vllm_backend  # no torch or vLLM imported: their names only

    backend = torch_backend if name == "torch" else vllm_backend
    unknown = backend.unknown_options(options)
    return (
        f"{', '.join(unknown)}: the {name} engine has no such option (known: {backend.OPTIONS_HELP})"
        if unknown
        else None
    )


def time_scale_refusal(name: str, time_scale: float) -> str | None:
    """Why backend ``name`` would refuse ``--time-scale time_scale`` (a launcher checks before starting anything):
    only the sim engine is paced (``BackendConfig.time_scale``); the others' steps take the time they compute, and a
    value other than 1 would be ignored. None when it is honoured."""
    if time_scale == 1.0 or name == "sim":
        return None
    return f"--time-scale paces the sim engine only: --engine {name}'s steps take the time they compute"


def make_backend(name: str, config: BackendConfig) -> Backend:
    """Build the backend called ``name`` for ``config``.

    Raises:
        UnknownBackendError: ``name`` is not one of :data:`BACKEND_NAMES`.
        ValueError / KeyError: the backend's own configuration errors (instance not in the topology, ...).
        RuntimeError: the backend's dependencies are missing (torch without PyTorch, vllm without vLLM).
    """
    if name == "sim":
        from llumlet.backends.sim import make_sim_backend

        return make_sim_backend(config)
    if name == "torch":
        from llumlet.backends.torch_backend import make_torch_backend

        return make_torch_backend(config)
    if name == "vllm":
        from llumlet.backends.vllm_backend import make_vllm_backend

        return make_vllm_backend(config)
    raise UnknownBackendError(f"unknown engine backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
