"""Load and check a topology file (YAML) into a :class:`topology.spec.Topology`.

Two passes: a pydantic v2 schema (unknown keys, types, positive numbers), applied item by item so one bad
item does not hide the errors of the others, then a semantic pass (duplicate ids, unknown references,
GPUs, tensor-parallel sizes, rack membership, KV capacity). Every error found is reported, each as
``"<file>: <key.path>: <what was wrong and what was expected>"``, in one :class:`TopologyError`.

The file format and its units are documented in ``docs/topology.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from topology.spec import (
    DTYPE_BYTES,
    DomainKind,
    DomainSpec,
    FabricSpec,
    GpuType,
    InstanceSpec,
    ModelSpec,
    NodeSpec,
    RackSpec,
    Topology,
)

__all__ = [
    "BUNDLED_DIR",
    "BUNDLED_NAMES",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "TOKENIZER_FILES",
    "TopologyError",
    "YamlFileError",
    "bundled_path",
    "load_topology",
    "parse_topology",
    "parse_yaml",
    "pydantic_message",
    "read_yaml_file",
    "shown_value",
    "tokenizer_dir_problem",
    "tokenizer_errors",
    "yaml_error_line",
]

#: Folder of the example topologies shipped with the package.
BUNDLED_DIR = Path(__file__).resolve().parent / "examples"
#: Names accepted by :func:`load_topology` besides a path.
BUNDLED_NAMES: tuple[str, ...] = ("1x8-a100", "2x8-a100", "2x8-a100-40gb", "64x8-h100", "nvl72-gb200")
#: Fraction of GPU memory given to weights + KV cache when a file does not say (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

_GIB = 2**30
_GBYTE = 1e9
_GBIT = 1e9 / 8


class TopologyError(ValueError):
    """A topology file is invalid. ``errors`` lists every problem as ``"<file>: <key.path>: <message>"``;
    :meth:`lines` (and ``str()``) shows each problem once with the places it repeats at."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors: list[str] = list(errors)
        super().__init__("\n".join(self.lines()))

    def lines(self, places_shown: int = 3) -> list[str]:
        """The errors for a reader: one problem made at many places (the same message at key paths that differ in
        their list indices only, e.g. every instance naming an unknown model) is one line, the first place's,
        followed by ``(and N more like it: <the next places_shown places>, ...)``; in the order first met."""
        groups: dict[str, list[str]] = {}
        for error in self.errors:
            groups.setdefault(_INDEX.sub("[*]", error), []).append(error)
        out = []
        for same in groups.values():
            line = same[0]
            if len(same) > 1:
                places = [_place_of(e) for e in same[1 : 1 + places_shown]]
                more = ", ..." if len(same) - 1 > places_shown else ""
                line += f" (and {len(same) - 1:,} more like it: {', '.join(places)}{more})"
            out.append(line)
        return out


_INDEX = re.compile(r"\[\d+\]")


def _place_of(error: str) -> str:
    """The key path of ``"<file>: <key.path>: <message>"`` (the error itself when it has no such form)."""
    parts = error.split(": ", 2)
    return parts[1] if len(parts) == 3 else error


# ---------------------------------------------------------------------------------------------- schema

_Id = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
_PosInt = Annotated[int, Field(gt=0)]
_PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
# A network or NVLink rate: 0.1 (100 Mb/s, under any data-centre link) to 10^6 (a petabit); outside, a unit slip
# (bytes for gigabits, b/s for Gb/s) rather than a link, which the cost model would have taken as given.
_LinkRate = Annotated[float, Field(ge=0.1, le=1e6, allow_inf_nan=False)]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _RootSchema(_Schema):
    name: _Id
    description: str = ""
    gpu_memory_utilization: _Fraction = DEFAULT_GPU_MEMORY_UTILIZATION
    models: Annotated[list[Any], Field(min_length=1)]
    gpu_types: Annotated[list[Any], Field(min_length=1)]
    domains: Annotated[list[Any], Field(min_length=1)]
    fabric: Any = None


class _ModelSchema(_Schema):
    name: _Id
    num_layers: _PosInt
    num_attention_heads: _PosInt
    num_kv_heads: _PosInt
    head_dim: _PosInt
    hidden_size: _PosInt
    dtype: Literal["float32", "float16", "bfloat16", "float8", "fp8", "int8"]
    block_size_tokens: _PosInt = 16
    num_params: _PosInt
    max_context_tokens: Annotated[int, Field(ge=2)]  # a request holds at least one prompt and one output token
    tokenizer: Annotated[str, Field(min_length=1)] | None = None


class _GpuSchema(_Schema):
    name: _Id
    # bounded where a value beyond any GPU breaks the model: 1 PiB of memory overflows no count of blocks or bytes,
    # and an engine below 10 GB/s of HBM (no GPU has under 100) steps so slowly a simulation runs for days of its time
    memory_gib: Annotated[float, Field(gt=0, le=2**20, allow_inf_nan=False)]
    hbm_gbyte_per_s: Annotated[float, Field(ge=10, le=1e6, allow_inf_nan=False)]
    nvlink_gbyte_per_s: _LinkRate


class _NodeSchema(_Schema):
    id: _Id
    num_gpus: _PosInt
    nic_gbit_per_s: _LinkRate


class _InstanceSchema(_Schema):
    id: _Id
    gpus: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    tensor_parallel_size: _PosInt
    model: _Id
    kv_capacity_blocks: _PosInt | None = None
    gpu_memory_utilization: _Fraction | None = None


class _DomainSchema(_Schema):
    id: _Id
    kind: Literal["node", "nvlink_island"]
    gpu_type: _Id
    nodes: Annotated[list[Any], Field(min_length=1)]
    instances: list[Any] = []


class _FabricSchema(_Schema):
    oversubscription: _PosFloat = 1.0
    racks: list[Any] = []


class _RackSchema(_Schema):
    id: _Id
    domains: list[_Id] = []
    nodes: list[_Id] = []
    uplink_gbit_per_s: _LinkRate | None = None
    oversubscription: _PosFloat | None = None


_S = TypeVar("_S", bound=_Schema)


def _key_path(loc: Sequence[str | int]) -> str:
    """``("domains", 3, "gpus")`` → ``"domains[3].gpus"``; the empty path is ``"(root)"``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"


#: What a type error wanted, in the words of the docs (docs/topology.md, docs/configuration.md, docs/sim-results.md).
_WANTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping of keys",
    "model_type": "a mapping of keys",
    "bool_type": "true or false",
}


def shown_value(value: Any) -> str:
    """``value`` as a YAML file wrote it, with its kind in YAML's words: ``true (a boolean)``, ``'1.0' (a string)``,
    ``null (no value)``, ``a list``."""
    if value is None:
        return "null (no value)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int):
        return f"{value} (an integer)"
    if isinstance(value, float):
        return f"{value!r} (a decimal number)"
    if isinstance(value, str):
        text = repr(value) if len(value) <= 40 else repr(value[:37] + "...")
        return f"{text} (a string)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"{value} (a {type(value).__name__})"  # a YAML date or timestamp


def pydantic_message(err: Mapping[str, Any], keys: Iterable[str]) -> str:
    """One error of pydantic's ``ValidationError.errors()`` in hilum's words, for every YAML file hilum reads (a
    topology, the configuration file, a sweep file and its run options): what was wanted and what the file wrote,
    in YAML's terms (``expected an integer, got 2.5 (a decimal number)``), not pydantic's ("Input should be a valid
    integer", "Extra inputs are not permitted", "Value error, ..."). ``keys``: the keys the mapping knows, which an
    unknown one is told. Its place (the key path) is the caller's to write."""
    kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    if kind in _WANTED:
        quoted = kind in ("int_type", "float_type") and isinstance(given, str) and _is_number(given)
        return f"expected {_WANTED[kind]}, got {shown_value(given)}" + ("; write it without quotes" if quoted else "")
    if kind == "value_error":  # a validator's own message
        return str(ctx.get("error", err["msg"])).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return f"unknown key; expected one of: {', '.join(keys)}"
    if kind == "missing":
        return "missing required key"
    if kind in ("greater_than", "greater_than_equal"):
        bound = f"> {ctx['gt']:g}" if kind == "greater_than" else f">= {ctx['ge']:g}"
        return f"must be {bound}, got {given!r}"
    if kind in ("less_than", "less_than_equal"):
        bound = f"< {ctx['lt']:g}" if kind == "less_than" else f"<= {ctx['le']:g}"
        return f"must be {bound}, got {given!r}"
    if kind == "finite_number":
        return f"must be a finite number, got {given!r}"
    if kind == "too_short":
        least = ctx.get("min_length", 1)
        return "must list at least one entry" if least == 1 else f"must list at least {least} entries"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "literal_error":  # ctx["expected"]: "'trace', 'poisson' or 'gamma'"
        return f"must be one of {ctx['expected']}, got {shown_value(given)}"
    return f"{err['msg']}, got {shown_value(given)}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _pydantic_message(err: Mapping[str, Any], schema: type[_Schema]) -> str:
    if err["type"] == "string_pattern_mismatch":  # the one pattern of the schemas: an id (_ID)
        return f"expected an id of letters, digits, '.', '_', '-' (not starting with a sign), got {err.get('input')!r}"
    return pydantic_message(err, schema.model_fields)


class _Collector:
    """Collects error lines for one file; validates items against a schema."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.errors: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.errors.append(f"{self.source}: {path}: {message}")

    def validate(self, schema: type[_S], data: Any, loc: tuple[str | int, ...]) -> _S | None:
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            for err in exc.errors():
                self.add(_key_path(loc + tuple(err["loc"])), _pydantic_message(err, schema))
            return None


def _raw_names(items: Sequence[Any], key: str) -> set[str]:
    """Names declared by ``items`` even when the item is otherwise invalid (avoids cascading errors)."""
    return {item[key] for item in items if isinstance(item, Mapping) and isinstance(item.get(key), str)}


def _check_unique(col: _Collector, what: str, seen: dict[str, str], key: str, path: str) -> bool:
    if key in seen:
        col.add(path, f"duplicate {what} id {key!r} (first at {seen[key]}); ids must be unique")
        return False
    seen[key] = path
    return True


# ---------------------------------------------------------------------------------------------- loading


def parse_topology(data: Any, source: str, *, base_dir: Path | None = None) -> Topology:
    """Check ``data`` (a parsed YAML document) and build the :class:`Topology`; ``source`` names it in errors.

    ``base_dir``: the file's folder; relative paths in the file (``models[].tokenizer``) are taken from it.
    Raises :class:`TopologyError` listing every problem found.
    """
    col = _Collector(source)
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else shown_value(data)
        col.add("(root)", f"expected a mapping with keys name, models, gpu_types, domains, got {got}")
        raise TopologyError(col.errors)
    root = col.validate(_RootSchema, data, ())
    if root is None:
        # Still check the items of the lists that are present, so every error is reported at once.
        root = _RootSchema.model_construct(
            name=str(data.get("name", "")),
            gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION,
            models=_as_list(data.get("models")),
            gpu_types=_as_list(data.get("gpu_types")),
            domains=_as_list(data.get("domains")),
            fabric=data.get("fabric"),
        )
    models = _parse_models(col, root.models, base_dir)
    gpu_types = _parse_gpu_types(col, root.gpu_types)
    declared_models = _raw_names(root.models, "name")
    declared_gpus = _raw_names(root.gpu_types, "name")
    domains = _parse_domains(col, root, models, gpu_types, declared_models, declared_gpus)
    fabric = _parse_fabric(col, root, domains)
    if col.errors:
        raise TopologyError(col.errors)
    return Topology(
        name=root.name,
        source=source,
        models=models,
        gpu_types=gpu_types,
        domains=tuple(domains),
        fabric=fabric,
    )


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _parse_models(col: _Collector, items: Sequence[Any], base_dir: Path | None) -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    seen: dict[str, str] = {}
    for i, item in enumerate(items):
        m = col.validate(_ModelSchema, item, ("models", i))
        if m is None or not _check_unique(col, "model", seen, m.name, f"models[{i}].name"):
            continue
        if m.num_kv_heads > m.num_attention_heads or m.num_attention_heads % m.num_kv_heads:
            col.add(
                f"models[{i}].num_kv_heads",
                f"num_kv_heads ({m.num_kv_heads}) must divide num_attention_heads ({m.num_attention_heads})",
            )
            continue
        out[m.name] = ModelSpec(
            name=m.name,
            num_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            hidden_size=m.hidden_size,
            dtype=m.dtype,
            block_size_tokens=m.block_size_tokens,
            num_params=m.num_params,
            max_context_tokens=m.max_context_tokens,
            tokenizer=_resolve(m.tokenizer, base_dir),
        )
    assert set(DTYPE_BYTES) >= {m.dtype for m in out.values()}
    return out


def _resolve(path: str | None, base_dir: Path | None) -> str | None:
    """A path of the file: ``~`` expanded, relative ones taken from the file's folder (when known)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return str(p)


#: The files a Hugging Face tokenizer directory (``save_pretrained``) holds at least one of.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def tokenizer_dir_problem(path: str | Path) -> str | None:
    """What keeps ``path`` from being a tokenizer directory, as words after it ("does not exist", "is not a
    directory", "holds no tokenizer file (...)"); None when it is a directory holding one of
    :data:`TOKENIZER_FILES`. Only the file system is read (loading one takes transformers and seconds)."""
    where = Path(path)
    if not where.is_dir():
        return "is not a directory" if where.exists() else "does not exist"
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        return f"holds no tokenizer file ({', '.join(TOKENIZER_FILES)})"
    return None


def tokenizer_errors(topology: Topology, models: Sequence[str] | None = None) -> list[str]:
    """Every ``models[].tokenizer`` of ``models`` (default: all) that is not a tokenizer directory on this machine
    (:func:`tokenizer_dir_problem`), as ``"<file>: models[i].tokenizer: <path> does not exist"``; empty when all
    are there.

    The loader does not check this (the coordinator and the simulator never read a tokenizer, and need not
    run where it is): the processes that load one — the gateway and the llumlets — call this at start.
    """
    errors = []
    for i, (name, model) in enumerate(topology.models.items()):
        if model.tokenizer is None or (models is not None and name not in models):
            continue
        what = tokenizer_dir_problem(model.tokenizer)
        if what is not None:
            errors.append(
                f"{topology.source}: models[{i}].tokenizer: {model.tokenizer} {what} "
                f"(model {name}: need the directory of its Hugging Face tokenizer)"
            )
    return errors


def _parse_gpu_types(col: _Collector, items: Sequence[Any]) -> dict[str, GpuType]:
    out: dict[str, GpuType] = {}
    seen: dict[str, str] = {}
    for i, item in enumerate(items):
        g = col.validate(_GpuSchema, item, ("gpu_types", i))
        if g is None or not _check_unique(col, "GPU type", seen, g.name, f"gpu_types[{i}].name"):
            continue
        out[g.name] = GpuType(
            name=g.name,
            memory_bytes=int(g.memory_gib * _GIB),
            hbm_bandwidth_bytes_per_s=g.hbm_gbyte_per_s * _GBYTE,
            nvlink_bandwidth_bytes_per_s=g.nvlink_gbyte_per_s * _GBYTE,
        )
    return out


class _Seen:
    """Ids seen so far across the whole file (domains, nodes, instances) with the key path of the first."""

    def __init__(self) -> None:
        self.domains: dict[str, str] = {}
        self.nodes: dict[str, str] = {}
        self.instances: dict[str, str] = {}


def _parse_domains(
    col: _Collector,
    root: _RootSchema,
    models: Mapping[str, ModelSpec],
    gpu_types: Mapping[str, GpuType],
    declared_models: set[str],
    declared_gpus: set[str],
) -> list[DomainSpec]:
    out: list[DomainSpec] = []
    seen = _Seen()
    for d_idx, item in enumerate(root.domains):
        loc = f"domains[{d_idx}]"
        d = col.validate(_DomainSchema, item, ("domains", d_idx))
        if d is None:
            _check_items_only(col, item, d_idx)
            continue
        _check_unique(col, "domain", seen.domains, d.id, f"{loc}.id")
        gpu = gpu_types.get(d.gpu_type)
        if gpu is None and d.gpu_type not in declared_gpus and declared_gpus:  # none declared: said once already
            col.add(
                f"{loc}.gpu_type",
                f"unknown GPU type {d.gpu_type!r}; GPU types in this file: " + ", ".join(sorted(declared_gpus)),
            )
        nodes = _parse_nodes(col, d, d_idx, seen)
        if d.kind == "node" and len(d.nodes) != 1:
            col.add(
                f"{loc}.nodes",
                f"a domain of kind 'node' has exactly one node, got {len(d.nodes)}; "
                "use kind 'nvlink_island' for an NVLink domain over several nodes",
            )
        if nodes is None:  # its instances' GPUs cannot be checked, their own keys still are (report everything)
            for k, sub in enumerate(d.instances):
                col.validate(_InstanceSchema, sub, ("domains", d_idx, "instances", k))
            continue
        instances = _parse_instances(col, root, d, d_idx, nodes, gpu, models, declared_models, seen)
        kind: DomainKind = d.kind
        out.append(DomainSpec(domain_id=d.id, kind=kind, gpu_type=d.gpu_type, nodes=nodes, instances=instances))
    return out


def _check_items_only(col: _Collector, item: Any, d_idx: int) -> None:
    """Schema-check the nodes and instances of a domain that failed its own schema (report everything)."""
    if not isinstance(item, Mapping):
        return
    for key, schema in (("nodes", _NodeSchema), ("instances", _InstanceSchema)):
        raw = item.get(key)
        if isinstance(raw, list):
            for k, sub in enumerate(raw):
                col.validate(schema, sub, ("domains", d_idx, key, k))


def _parse_nodes(col: _Collector, d: _DomainSchema, d_idx: int, seen: _Seen) -> tuple[NodeSpec, ...] | None:
    loc = f"domains[{d_idx}]"
    nodes: list[NodeSpec] = []
    ok = True
    first_gpu = 0
    for n_idx, raw in enumerate(d.nodes):
        n = col.validate(_NodeSchema, raw, ("domains", d_idx, "nodes", n_idx))
        if n is None:
            ok = False
            continue
        _check_unique(col, "node", seen.nodes, n.id, f"{loc}.nodes[{n_idx}].id")
        nodes.append(
            NodeSpec(
                node_id=n.id,
                domain_id=d.id,
                num_gpus=n.num_gpus,
                nic_bandwidth_bytes_per_s=n.nic_gbit_per_s * _GBIT,
                first_gpu=first_gpu,
            )
        )
        first_gpu += n.num_gpus
    return tuple(nodes) if ok else None


def _where(d: _DomainSchema, nodes: Sequence[NodeSpec]) -> str:
    total = sum(n.num_gpus for n in nodes)
    if d.kind == "node":
        return f"on {nodes[0].node_id} ({total} GPU{'' if total == 1 else 's'})"
    return f"in NVLink island {d.id} ({total} GPUs on {len(nodes)} nodes)"


def _parse_instances(
    col: _Collector,
    root: _RootSchema,
    d: _DomainSchema,
    d_idx: int,
    nodes: Sequence[NodeSpec],
    gpu: GpuType | None,
    models: Mapping[str, ModelSpec],
    declared_models: set[str],
    seen: _Seen,
) -> tuple[InstanceSpec, ...]:
    loc = f"domains[{d_idx}]"
    total_gpus = sum(n.num_gpus for n in nodes)
    gpu_owner: dict[int, str] = {}
    out: list[InstanceSpec] = []
    for i_idx, raw in enumerate(d.instances):
        iloc = f"{loc}.instances[{i_idx}]"
        inst = col.validate(_InstanceSchema, raw, ("domains", d_idx, "instances", i_idx))
        if inst is None:
            continue
        ok = _check_unique(col, "instance", seen.instances, inst.id, f"{iloc}.id")
        for g in dict.fromkeys(inst.gpus):
            if g >= total_gpus:
                col.add(f"{iloc}.gpus", f"GPU {g} does not exist {_where(d, nodes)}")
                ok = False
            elif g in gpu_owner:
                col.add(f"{iloc}.gpus", f"GPU {g} is already used by instance {gpu_owner[g]!r}")
                ok = False
            else:
                gpu_owner[g] = inst.id
        dupes = sorted({g for g in inst.gpus if inst.gpus.count(g) > 1})
        if dupes:
            col.add(f"{iloc}.gpus", f"GPU {dupes[0]} is listed more than once; list each GPU once")
            ok = False
        if inst.tensor_parallel_size != len(inst.gpus):
            n = len(inst.gpus)
            col.add(
                f"{iloc}.tensor_parallel_size",
                f"tensor_parallel_size is {inst.tensor_parallel_size} but {n} GPU{'s' if n != 1 else ''} "
                "listed; list one GPU per tensor-parallel rank",
            )
            ok = False
        model = models.get(inst.model)
        if model is None:
            if inst.model not in declared_models and declared_models:  # none declared: said once already
                col.add(
                    f"{iloc}.model",
                    f"unknown model {inst.model!r}; models in this file: " + ", ".join(sorted(declared_models)),
                )
            continue
        if model.num_attention_heads % inst.tensor_parallel_size:
            col.add(
                f"{iloc}.tensor_parallel_size",
                f"{model.name} has {model.num_attention_heads} attention heads, not divisible by "
                f"tensor_parallel_size {inst.tensor_parallel_size}",
            )
            ok = False
        if gpu is None or not ok:
            continue
        util = inst.gpu_memory_utilization or root.gpu_memory_utilization
        blocks = inst.kv_capacity_blocks
        if blocks is None:
            blocks = _derive_kv_blocks(col, iloc, inst, model, gpu, util)
            if blocks is None:
                continue
        first = min(inst.gpus)
        node = next(n for n in nodes if n.first_gpu <= first < n.first_gpu + n.num_gpus)
        out.append(
            InstanceSpec(
                instance_id=inst.id,
                domain_id=d.id,
                node_id=node.node_id,
                gpus=tuple(inst.gpus),
                tensor_parallel_size=inst.tensor_parallel_size,
                model=model.name,
                gpu_type=gpu.name,
                kv_capacity_blocks=blocks,
            )
        )
    return tuple(out)


def _derive_kv_blocks(
    col: _Collector, iloc: str, inst: _InstanceSchema, model: ModelSpec, gpu: GpuType, util: float
) -> int | None:
    """``⌊(tp · GPU memory · utilization − weights) / kv_bytes_per_block⌋``; None (and an error) if < 1."""
    usable = inst.tensor_parallel_size * gpu.memory_bytes * util
    blocks = math.floor((usable - model.weight_bytes) / model.kv_bytes_per_block)
    if blocks >= 1:
        return blocks
    col.add(
        f"{iloc}.model",
        f"weights of {model.name} ({model.weight_bytes / 1e9:.1f} GB) leave no room for a KV cache block in "
        f"{inst.tensor_parallel_size} x {gpu.name} x {util:g} utilization = {usable / 1e9:.1f} GB; "
        "use more GPUs (tensor_parallel_size) or give kv_capacity_blocks",
    )
    return None


def _parse_fabric(col: _Collector, root: _RootSchema, domains: Sequence[DomainSpec]) -> FabricSpec:
    fab = col.validate(_FabricSchema, root.fabric if root.fabric is not None else {}, ("fabric",))
    schema_ok = default_ok = fab is not None  # default_ok: the default oversubscription is the file's (else 1)
    if fab is None:  # a bad key beside the racks: they are still checked, to report everything at once
        raw = root.fabric if isinstance(root.fabric, Mapping) else {}
        over = raw.get("oversubscription", 1.0)
        default_ok = type(over) in (int, float) and math.isfinite(over) and over > 0
        raw_racks = raw.get("racks")
        fab = _FabricSchema.model_construct(
            oversubscription=float(over) if default_ok else 1.0, racks=raw_racks if isinstance(raw_racks, list) else []
        )
    nodes = {n.node_id: n for d in domains for n in d.nodes}
    by_domain = {d.domain_id: d for d in domains}
    declared_domains = _raw_names(root.domains, "id")
    rack_of: dict[str, str] = {}
    seen: dict[str, str] = {}
    racks: list[RackSpec] = []
    all_racks_valid = True
    for r_idx, raw in enumerate(fab.racks):
        rloc = f"fabric.racks[{r_idx}]"
        r = col.validate(_RackSchema, raw, ("fabric", "racks", r_idx))
        if r is None:
            all_racks_valid = False
            continue
        _check_unique(col, "rack", seen, r.id, f"{rloc}.id")
        members: list[tuple[str, str]] = []
        for k, dom in enumerate(r.domains):
            if dom in by_domain:
                members += [(n.node_id, f"{rloc}.domains[{k}]") for n in by_domain[dom].nodes]
            elif dom not in declared_domains:
                col.add(f"{rloc}.domains[{k}]", f"unknown domain {dom!r}; {_known(by_domain)}")
        for k, node_id in enumerate(r.nodes):
            if node_id in nodes:
                members.append((node_id, f"{rloc}.nodes[{k}]"))
            else:
                col.add(f"{rloc}.nodes[{k}]", f"unknown node {node_id!r}; {_known(nodes)}")
        if not r.domains and not r.nodes:
            col.add(rloc, "a rack needs at least one entry in 'domains' or 'nodes'")
        for node_id, path in members:
            if node_id in rack_of and rack_of[node_id] != r.id:
                col.add(path, f"node {node_id!r} is already in rack {rack_of[node_id]!r}; a node sits in one rack")
            rack_of.setdefault(node_id, r.id)
        node_ids = tuple(dict.fromkeys(n for n, _ in members if rack_of.get(n) == r.id))
        nic_total = sum(nodes[n].nic_bandwidth_bytes_per_s for n in node_ids)
        if r.uplink_gbit_per_s is not None:
            if r.oversubscription is not None:
                col.add(
                    f"{rloc}.oversubscription",
                    "give uplink_gbit_per_s or oversubscription, not both (the uplink sets the ratio to the NICs)",
                )
            uplink = r.uplink_gbit_per_s * _GBIT
            over = nic_total / uplink  # what the rack has, not the file's default ratio
        else:
            over = r.oversubscription or fab.oversubscription
            uplink = nic_total / over
            if node_ids and (r.oversubscription or default_ok) and not 0.1 <= uplink / _GBIT <= 1e6:  # as a given one
                where = f"{rloc}.oversubscription" if r.oversubscription else "fabric.oversubscription"
                col.add(
                    where,
                    f"{over:g} gives rack {r.id!r} an uplink of {uplink / _GBIT:.3g} Gb/s ({nic_total / _GBIT:g} Gb/s "
                    "of NICs over it), outside 0.1 to 10^6: a slip of units? (give uplink_gbit_per_s instead)",
                )
        racks.append(
            RackSpec(rack_id=r.id, node_ids=node_ids, uplink_bandwidth_bytes_per_s=uplink, oversubscription=over)
        )
    if (len(root.domains) > 1 or fab.racks) and all_racks_valid and schema_ok:  # else a guess at what was meant
        missing = [n for n in nodes if n not in rack_of]
        for node_id in missing:
            col.add(
                "fabric.racks",
                f"node {node_id!r} is in no rack; with several domains every node must sit in a rack "
                "(list its domain under a rack's 'domains' or the node under 'nodes')",
            )
    return FabricSpec(racks=tuple(racks))


def _known(ids: Mapping[str, Any]) -> str:
    names = sorted(ids)
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return f"known: {shown}" if names else "none are defined"


# ---------------------------------------------------------------------------------------------- YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects a key repeated in one mapping (PyYAML keeps the last silently) and reads
    ``1.0e9`` and ``1e-3`` as numbers, as YAML 1.2 does (PyYAML's YAML 1.1 wants a dot and a sign, ``1.0e+9``;
    without them they were strings), and only ``true`` and ``false`` as booleans, as YAML 1.2 does (YAML 1.1's
    ``yes``, ``no``, ``on``, ``off``, ``y`` and ``n`` are strings, which a boolean key refuses by name: PyYAML
    read them as booleans, so ``prefix_aware_dispatch: yes`` passed where ``"false"`` and ``0`` are refused)."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen[key] + 1}); keys must be unique",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        except TypeError:
            continue
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def not_utf8(exc: UnicodeDecodeError) -> str:
    """What to say of a file that is not UTF-8 text, every file hilum reads (topology, configuration, sweep, API
    keys, traces): ``not UTF-8 text (byte 0xe9 at offset 111); save it as UTF-8``."""
    return f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); save it as UTF-8"


class _TooDeepError(yaml.YAMLError):
    """A document nested deeper than PyYAML's recursion can follow (valid YAML, not one hilum can read)."""


def parse_yaml(text: str) -> Any:
    """The YAML document ``text`` as hilum reads every file it is given (topology, configuration, sweep, API
    keys): safe, a repeated key refused, ``1e9`` a number. Raises yaml.YAMLError (:func:`yaml_error_line`
    words it), also for a document nested deeper than the reader's recursion can follow (a couple of hundred
    levels of lists or mappings, where PyYAML raises RecursionError)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise _TooDeepError("lists and mappings nested too deeply to read (hilum's files need a few levels)") from None


class YamlFileError(ValueError):
    """A file hilum was given could not be read as a YAML document (:func:`read_yaml_file`). ``place``: where, as
    every file error of hilum names it (``(file)``, or ``line L, column C``); ``problem``: what. Its text is
    ``"<place>: <problem>"``, which the caller leads with the file's name."""

    def __init__(self, place: str, problem: str) -> None:
        self.place, self.problem = place, problem
        super().__init__(f"{place}: {problem}")


def read_yaml_file(path: Path, what: str) -> Any:
    """The YAML document (:func:`parse_yaml`) in the file at ``path``, as hilum reads every file it is given
    (topology, configuration, sweep, API keys); None for an empty file. ``what``: the kind of file, for the
    message (``"the configuration file"``).

    Raises :class:`YamlFileError`: the file cannot be read (``(file): cannot read the configuration file: No such
    file or directory``), is not UTF-8 text (:func:`not_utf8`), or is not YAML (:func:`yaml_error_line`).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise YamlFileError("(file)", f"cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise YamlFileError("(file)", not_utf8(exc)) from None
    try:
        return parse_yaml(text)
    except yaml.YAMLError as exc:
        place, problem = yaml_error_line(exc).split(": ", 1)
        raise YamlFileError(place, problem) from None


def bundled_path(name: str) -> Path | None:
    """Path of the bundled example ``name`` (with or without ``.yaml``), or None if there is none."""
    stem = name.removesuffix(".yaml")
    path = BUNDLED_DIR / f"{stem}.yaml"
    return path if stem in BUNDLED_NAMES and path.is_file() else None


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: ``line L, column C: YAML syntax error: PROBLEM`` (1-based, where
    PyYAML marks it), or ``(file): YAML syntax error: ...`` when it marks no place; ``(file): lists and mappings
    nested too deeply ...`` for a document :func:`parse_yaml` could not follow."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(file)"
        return f"{where}: YAML syntax error: {exc.problem or exc.context or 'invalid YAML'}"
    if isinstance(exc, _TooDeepError):
        return f"(file): {exc}"
    return f"(file): YAML syntax error: {exc}"


def load_topology(path_or_name: str | Path) -> Topology:
    """Load a topology file, or a bundled example by name (:data:`BUNDLED_NAMES`: ``1x8-a100``, ``2x8-a100``,
    ``2x8-a100-40gb``, ``64x8-h100``, ``nvl72-gb200``). An existing file wins over a bundled name.

    Raises :class:`TopologyError` (every problem, ``"<file>: <key.path>: <message>"``) when the file is
    missing, is not valid YAML (line and column given) or describes an invalid topology.
    """
    hint = f"give a path to a topology YAML file or one of the bundled names: {', '.join(BUNDLED_NAMES)}"
    if not str(path_or_name).strip():  # not the folder "." that Path("") is
        raise TopologyError([f"the topology is empty: {hint}"])
    path = Path(path_or_name)
    shown = str(path_or_name)
    if path.is_dir() or not path.exists():  # anything else is read: a file, a pipe (--topology <(...))
        bundled = bundled_path(str(path_or_name))
        if bundled is None:
            raise TopologyError([f"{shown}: (file): {'is a directory' if path.is_dir() else 'file not found'}; {hint}"])
        path, shown = bundled, bundled.name
    try:
        data = read_yaml_file(path, "the topology file")
    except YamlFileError as exc:
        raise TopologyError([f"{shown}: {exc}"]) from None
    return parse_topology(data, shown, base_dir=path.resolve().parent)
