"""Value types of a loaded topology: models, GPU types, NVLink domains, instances and the network fabric.

Everything here is in base units: bytes, bytes per second, tokens, blocks. The YAML file uses human units
(GiB, GB/s, Gb/s); :mod:`topology.load` converts them. See ``docs/topology.md`` for the file format.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

__all__ = [
    "DTYPE_BYTES",
    "DomainKind",
    "DomainSpec",
    "FabricSpec",
    "GpuType",
    "InstanceSpec",
    "ModelSpec",
    "NodeSpec",
    "RackSpec",
    "Topology",
    "UnknownIdError",
]

#: Bytes per element of each supported KV-cache / weight dtype.
DTYPE_BYTES: Mapping[str, int] = MappingProxyType(
    {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1, "int8": 1}
)

DomainKind = Literal["node", "nvlink_island"]


class UnknownIdError(KeyError):
    """An id the topology does not have (a KeyError, as a mapping's lookup raises), its message printed as written:
    ``str()`` of a plain KeyError quotes it, so a command printing the error showed it in quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model: the shape that fixes its KV-cache footprint and its weight size.

    Attributes: ``num_layers`` transformer layers; ``num_attention_heads`` query heads; ``num_kv_heads``
    key/value heads (fewer than query heads under GQA); ``head_dim`` elements per head; ``hidden_size`` model
    width; ``dtype`` one of :data:`DTYPE_BYTES` (weights and KV cache); ``block_size_tokens`` tokens per KV
    cache block (paged attention); ``num_params`` parameter count; ``max_context_tokens`` longest sequence;
    ``tokenizer`` the directory of the model's Hugging Face tokenizer (absolute, or as the file gave it when
    parsed without a file), None when the file names none (the gateway then uses its byte stand-in).
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str
    block_size_tokens: int
    num_params: int
    max_context_tokens: int
    tokenizer: str | None = None

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of ``dtype`` (KeyError is impossible: the loader checks the dtype)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token, all layers: ``2 (K and V) · layers · kv_heads · head_dim · dtype_bytes``.

        Llama-2-7B fp16: 2·32·32·128·2 = 524,288 B (0.5 MiB). Source: the KV cache layout of vLLM's paged
        attention (Kwon et al., SOSP '23, §2) and Llumnix (OSDI '24, §2).
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_block(self) -> int:
        """KV cache bytes per block: ``kv_bytes_per_token · block_size_tokens``."""
        return self.kv_bytes_per_token * self.block_size_tokens

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights: ``num_params · dtype_bytes`` (activations and CUDA graphs not counted)."""
        return self.num_params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuType:
    """A GPU model: memory (bytes), HBM bandwidth and NVLink bandwidth per GPU (bytes/s, one direction)."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    nvlink_bandwidth_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One server (or compute tray of a rack-scale NVLink island) and its NIC.

    ``first_gpu`` is the domain-wide index of the node's GPU 0: a domain numbers its GPUs 0..N-1 across its
    nodes in file order. ``nic_bandwidth_bytes_per_s`` is the node's total NIC rate toward its rack switch.
    """

    node_id: str
    domain_id: str
    num_gpus: int
    nic_bandwidth_bytes_per_s: float
    first_gpu: int


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One serving instance (one engine) inside an NVLink domain.

    ``gpus`` are domain-wide GPU indices, one per tensor-parallel rank; ``node_id`` is the node holding the
    instance's first GPU (its NIC carries the instance's cross-domain traffic); ``kv_capacity_blocks`` is the
    KV cache size in blocks of its model's ``block_size_tokens``.
    """

    instance_id: str
    domain_id: str
    node_id: str
    gpus: tuple[int, ...]
    tensor_parallel_size: int
    model: str
    gpu_type: str
    kv_capacity_blocks: int


@dataclass(frozen=True, slots=True)
class DomainSpec:
    """An NVLink domain: one 8-GPU node (``kind="node"``) or a rack-scale NVLink island over several nodes.

    Every GPU of a domain reaches every other over NVLink at the GPU type's NVLink bandwidth.
    """

    domain_id: str
    kind: DomainKind
    gpu_type: str
    nodes: tuple[NodeSpec, ...]
    instances: tuple[InstanceSpec, ...]

    @property
    def num_gpus(self) -> int:
        """GPUs in the domain, all nodes together."""
        return sum(n.num_gpus for n in self.nodes)

    @property
    def kv_capacity_blocks(self) -> int:
        """KV cache blocks over all instances of the domain (blocks of possibly different models)."""
        return sum(i.kv_capacity_blocks for i in self.instances)


@dataclass(frozen=True, slots=True)
class RackSpec:
    """A rack (top-of-rack / leaf) switch: the nodes cabled to it and its uplink to the spine.

    ``uplink_bandwidth_bytes_per_s`` is given in the file or derived as
    ``Σ NIC bandwidth of the rack's nodes / oversubscription``; ``oversubscription`` is that ratio, the rack's own
    when the file gives the uplink (``Σ NIC / uplink``).
    """

    rack_id: str
    node_ids: tuple[str, ...]
    uplink_bandwidth_bytes_per_s: float
    oversubscription: float


@dataclass(frozen=True, slots=True)
class FabricSpec:
    """The network between NVLink domains: rack switches joined by one spine (if there are several racks)."""

    racks: tuple[RackSpec, ...]

    @property
    def bisection_bandwidth_bytes_per_s(self) -> float:
        """Spine bisection bandwidth: the least total uplink of half of the racks (``⌊racks/2⌋`` smallest).

        For one rack (no spine) it is the least total NIC bandwidth of half of its nodes; that case is
        computed by :meth:`Topology.bisection_bandwidth_bytes_per_s`, which knows the nodes.
        """
        uplinks = sorted(r.uplink_bandwidth_bytes_per_s for r in self.racks)
        return float(sum(uplinks[: len(uplinks) // 2]))


@dataclass(frozen=True, slots=True)
class Topology:
    """A loaded topology file. Build it with :func:`topology.load.load_topology` or ``parse_topology``.

    ``models`` and ``gpu_types`` are keyed by name; ``domains`` and ``instances`` keep file order.
    Lookups raise ``KeyError`` naming the unknown id.
    """

    name: str
    source: str
    models: Mapping[str, ModelSpec]
    gpu_types: Mapping[str, GpuType]
    domains: tuple[DomainSpec, ...]
    fabric: FabricSpec
    _instances: dict[str, InstanceSpec] = field(init=False, repr=False, compare=False)
    _domains: dict[str, DomainSpec] = field(init=False, repr=False, compare=False)
    _nodes: dict[str, NodeSpec] = field(init=False, repr=False, compare=False)
    _rack_of_node: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        object.__setattr__(self, "gpu_types", MappingProxyType(dict(self.gpu_types)))
        object.__setattr__(self, "_instances", {i.instance_id: i for d in self.domains for i in d.instances})
        object.__setattr__(self, "_domains", {d.domain_id: d for d in self.domains})
        object.__setattr__(self, "_nodes", {n.node_id: n for d in self.domains for n in d.nodes})
        object.__setattr__(self, "_rack_of_node", {n: r.rack_id for r in self.fabric.racks for n in r.node_ids})

    @property
    def instances(self) -> tuple[InstanceSpec, ...]:
        """All instances, in file order."""
        return tuple(self._instances.values())

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        """All nodes, in file order."""
        return tuple(self._nodes.values())

    @property
    def num_gpus(self) -> int:
        """GPUs over all domains."""
        return sum(d.num_gpus for d in self.domains)

    def instance(self, instance_id: str) -> InstanceSpec:
        """The instance ``instance_id``; KeyError if there is none (naming the closest ids, or some)."""
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownIdError(
                f"{self.source}: no instance {instance_id!r}; {_known(instance_id, self._instances, 'instance')}"
            ) from None

    def domain(self, domain_id: str) -> DomainSpec:
        """The NVLink domain ``domain_id``; KeyError if there is none (naming the closest ids, or some)."""
        try:
            return self._domains[domain_id]
        except KeyError:
            raise UnknownIdError(
                f"{self.source}: no domain {domain_id!r}; {_known(domain_id, self._domains, 'domain')}"
            ) from None

    def node(self, node_id: str) -> NodeSpec:
        """The node ``node_id``; KeyError if there is none (naming the closest ids, or some)."""
        try:
            return self._nodes[node_id]
        except KeyError:
            known = _known(node_id, self._nodes, "node")
            raise UnknownIdError(f"{self.source}: no node {node_id!r}; {known}") from None

    def rack_of(self, node_id: str) -> str | None:
        """The rack holding ``node_id``, or None when the file has no racks (a single domain)."""
        self.node(node_id)
        return self._rack_of_node.get(node_id)

    def model_of(self, instance_id: str) -> ModelSpec:
        """The model served by ``instance_id``."""
        return self.models[self.instance(instance_id).model]

    def gpu_of(self, instance_id: str) -> GpuType:
        """The GPU type of ``instance_id``."""
        return self.gpu_types[self.instance(instance_id).gpu_type]

    def kv_capacity_tokens(self, instance_id: str) -> int:
        """KV cache capacity of ``instance_id`` in tokens: ``kv_capacity_blocks · block_size_tokens``."""
        inst = self.instance(instance_id)
        return inst.kv_capacity_blocks * self.models[inst.model].block_size_tokens

    def bisection_bandwidth_bytes_per_s(self) -> float:
        """Network bisection bandwidth (bytes/s): the spine's with several racks, else half the NICs'.

        Half of the racks (or nodes) with the least total uplink (or NIC) bandwidth; 0 for a single node.
        """
        if len(self.fabric.racks) > 1:
            return self.fabric.bisection_bandwidth_bytes_per_s
        nics = sorted(n.nic_bandwidth_bytes_per_s for n in self.nodes)
        return float(sum(nics[: len(nics) // 2]))


def _known(wanted: str, ids: Collection[str], noun: str) -> str:
    """What to say after "no <noun> <wanted>": how many there are, some of them, and the closest (``difflib``)."""
    listed = list(ids)
    if not listed:
        return f"the topology has no {noun}s"
    shown = ", ".join(listed) if len(listed) <= 6 else f"{', '.join(listed[:3])}, ..., {listed[-1]}"
    close = difflib.get_close_matches(wanted, listed, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return f"{len(listed)} {noun}{'s' if len(listed) != 1 else ''}: {shown}{guess}"
