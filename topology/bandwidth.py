"""Measured migration bandwidth: what moves achieved on each (transport, path), for the cost model. Pure.

Every migration reports the rate its pre-copy stages sustained while the request kept decoding — a llumlet
in ``MigrateOutReply.precopy_bandwidth_bytes_per_s`` (docs/migration.md, "Transports"), the simulator's
migration executor from its own stages. Those samples, per (transport, path), give the rate the cost model
prices the next move on that path with (``MigrationCostInput.measured_bandwidth_bytes_per_s``), so a path
or a transport slower than the topology file says makes moves on it cost what they really cost.

Estimate of one (transport, path) key: the exponentially weighted moving average of its samples younger
than ``max_age_s``, oldest first (at most :data:`MAX_SAMPLES_PER_PATH` of them)::

    e_1 = m_1,    e_k = w · m_k + (1 − w) · e_{k−1}        (w = ewma_weight)

A key with no such sample has no estimate, and the cost model prices it with the topology's bandwidth alone
(nominal). The age limit is what lets a path recover: a slow measurement makes the coordinator refuse
moves on that path, so no new sample would ever come; once the samples are older than ``max_age_s`` the
path is priced at nominal again and the next move on it measures it anew.

The path part of a key is the path's network links (NICs, rack uplinks, the spine: :func:`path_key`), so
moves between the same two nodes share one estimate whatever GPUs they run on; a path inside one NVLink
domain has no network link and is keyed by its NVLink links. The coordinator rebuilds its estimates from
the migration records in etcd at every decision (:func:`global_coord.approver.measured_rates`), the
simulator keeps one :class:`BandwidthEstimates` fed by its executor: the same rule on the same kind of
samples.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_SAMPLES_PER_PATH",
    "BandwidthEstimates",
    "BandwidthKey",
    "BandwidthSample",
    "MeasuredBandwidthConfig",
    "default_transport",
    "path_key",
]

#: Samples of one key that count at most (the newest): with the default weight 0.5 the oldest of them weighs
#: 2^-255 of the newest, so the window changes nothing a float can show.
MAX_SAMPLES_PER_PATH = 256

BandwidthKey = tuple[str, tuple[str, ...]]  # (transport name, the path's links that identify it)


def default_transport(same_domain: bool) -> str:
    """The transport a move takes when its command names none: ``"local"`` (peer copies) inside one NVLink
    domain, ``"grpc"`` across domains (``llumlet.transport.choose_transport`` applies this rule)."""
    return "local" if same_domain else "grpc"


def path_key(transport: str, links: Sequence[str]) -> BandwidthKey:
    """The key a move on ``links`` (``PathInfo.links``) with ``transport`` is measured and priced under.

    The path is identified by its links outside NVLink (``nic:*``, ``uplink:*``, ``spine``), so every pair of
    instances on the same two nodes shares one estimate; a path with only NVLink links (inside one domain)
    keeps them.
    """
    network = tuple(link for link in links if not link.startswith("nvlink:"))
    return transport, network if network else tuple(links)


@dataclass(frozen=True, slots=True)
class MeasuredBandwidthConfig:
    """How measured rates are averaged and for how long they count (module docstring).

    ``ewma_weight``: weight of the newest sample, in (0, 1] (1: the newest sample alone).
    ``max_age_s``: a sample counts for this long, seconds (>= 0; 0: never, moves are priced at the
    topology's bandwidth alone). Raises ValueError on a value out of range.
    """

    ewma_weight: float = 0.5
    max_age_s: float = 120.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ewma_weight) and 0 < self.ewma_weight <= 1):
            raise ValueError(f"ewma_weight must be in (0, 1], got {self.ewma_weight}")
        if not (math.isfinite(self.max_age_s) and self.max_age_s >= 0):
            raise ValueError(f"max_age_s must be a finite number >= 0, got {self.max_age_s}")


@dataclass(frozen=True, slots=True)
class BandwidthSample:
    """One migration's measured pre-copy rate. Raises ValueError on an empty transport or a rate <= 0."""

    transport: str  # how the bytes went: "grpc", "local", "local-inline" (MigrateOutReply.transport)
    links: tuple[str, ...]  # the path's links, source to destination (PathInfo.links, MigrationRecord.links)
    bytes_per_s: float  # KV bytes / seconds of the pre-copy stages
    at_s: float  # when it was measured: wall-clock seconds live, simulated seconds in the simulator

    def __post_init__(self) -> None:
        if not self.transport:
            raise ValueError("BandwidthSample.transport is empty")
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"BandwidthSample.bytes_per_s must be a finite number > 0, got {self.bytes_per_s}")

    @property
    def key(self) -> BandwidthKey:
        """The (transport, path) it measures (:func:`path_key`)."""
        return path_key(self.transport, self.links)


class BandwidthEstimates:
    """Samples per (transport, path) key, in the order observed; :meth:`rate` folds them (module docstring).

    ``observe`` in time order (the coordinator: records by etcd mod revision; the simulator: as its moves
    end). Keeps at most :data:`MAX_SAMPLES_PER_PATH` samples per key.
    """

    def __init__(self, cfg: MeasuredBandwidthConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else MeasuredBandwidthConfig()
        self._samples: dict[BandwidthKey, deque[BandwidthSample]] = {}

    @classmethod
    def of(cls, samples: Iterable[BandwidthSample], cfg: MeasuredBandwidthConfig | None = None) -> BandwidthEstimates:
        """Estimates that observed ``samples`` in order."""
        out = cls(cfg)
        for sample in samples:
            out.observe(sample)
        return out

    def observe(self, sample: BandwidthSample) -> None:
        """Record one measurement."""
        queue = self._samples.get(sample.key)
        if queue is None:
            queue = self._samples[sample.key] = deque(maxlen=MAX_SAMPLES_PER_PATH)
        queue.append(sample)

    def rate(self, key: BandwidthKey, now_s: float) -> float | None:
        """The estimate of ``key`` at ``now_s`` (bytes/s), None when no sample is younger than ``max_age_s``."""
        if self.cfg.max_age_s == 0:
            return None
        estimate: float | None = None
        w = self.cfg.ewma_weight
        for sample in self._samples.get(key, ()):
            if now_s - sample.at_s > self.cfg.max_age_s:
                continue
            estimate = sample.bytes_per_s if estimate is None else w * sample.bytes_per_s + (1 - w) * estimate
        return estimate

    def at(self, now_s: float) -> Mapping[BandwidthKey, float]:
        """The estimates at ``now_s`` (bytes/s) as a read-only mapping, what ``global_coord.approver.decide``
        takes as ``measured``: keys without a sample younger than ``max_age_s`` are absent.

        A view, not a copy: each estimate is computed (:meth:`rate`) when it is looked up, so a decision pays
        for the few paths it judges, not for every path ever measured, and samples observed later show in it.
        Iterating it (``len``, ``dict(...)``, ``==``) computes every key's estimate.
        """
        return _RatesAt(self, now_s)


class _RatesAt(Mapping[BandwidthKey, float]):
    """:meth:`BandwidthEstimates.at`: the estimates of ``estimates`` at ``now_s``, computed on lookup."""

    __slots__ = ("_estimates", "_now_s")

    def __init__(self, estimates: BandwidthEstimates, now_s: float) -> None:
        self._estimates = estimates
        self._now_s = now_s

    def __getitem__(self, key: BandwidthKey) -> float:
        rate = self._estimates.rate(key, self._now_s)
        if rate is None:
            raise KeyError(key)
        return rate

    def __iter__(self) -> Iterator[BandwidthKey]:
        """The keys with an estimate at ``now_s``, in first-observed order."""
        keys = list(self._estimates._samples)  # a copy: observing a new key while iterating is allowed
        return (key for key in keys if self._estimates.rate(key, self._now_s) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)
