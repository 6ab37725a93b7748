"""Measured migration bandwidth: EWMA per (transport, path), ageing, keys; the cost model prices with it."""

from __future__ import annotations

import re

import pytest

from topology.bandwidth import (
    MAX_SAMPLES_PER_PATH,
    BandwidthEstimates,
    BandwidthSample,
    MeasuredBandwidthConfig,
    default_transport,
    path_key,
)
from topology.cost import CostConfig, MigrationCostInput, plan_migration

CROSS = ("nvlink:node-0-i0", "nic:node-0", "nic:node-1", "nvlink:node-1-i3")
OTHER_GPUS = ("nvlink:node-0-i5", "nic:node-0", "nic:node-1", "nvlink:node-1-i0")


def sample(
    bytes_per_s: float, at_s: float = 0.0, links: tuple[str, ...] = CROSS, transport: str = "grpc"
) -> BandwidthSample:
    return BandwidthSample(transport, links, bytes_per_s, at_s)


def test_keys_group_moves_between_the_same_two_nodes() -> None:
    assert path_key("grpc", CROSS) == ("grpc", ("nic:node-0", "nic:node-1"))
    assert path_key("grpc", OTHER_GPUS) == path_key("grpc", CROSS)  # other GPUs, the same network path
    assert path_key("local", CROSS) != path_key("grpc", CROSS)  # each transport is measured on its own
    inside = ("nvlink:node-0-i0", "nvlink:node-0-i1")
    assert path_key("local", inside) == ("local", inside)  # an NVLink-only path keeps its links
    assert (default_transport(True), default_transport(False)) == ("local", "grpc")


def test_the_estimate_is_an_ewma_of_the_samples_in_order() -> None:
    est = BandwidthEstimates(MeasuredBandwidthConfig(ewma_weight=0.25, max_age_s=100.0))
    key = path_key("grpc", CROSS)
    assert est.rate(key, 0.0) is None  # unmeasured: the cost model uses the topology
    est.observe(sample(8e9, 1.0))
    assert est.rate(key, 1.0) == 8e9  # e1 = m1
    est.observe(sample(4e9, 2.0, OTHER_GPUS))
    assert est.rate(key, 2.0) == 0.25 * 4e9 + 0.75 * 8e9  # 7e9
    est.observe(sample(1e9, 3.0))
    assert est.rate(key, 3.0) == pytest.approx(0.25 * 1e9 + 0.75 * 7e9)  # 5.5e9
    assert est.at(3.0) == {key: pytest.approx(5.5e9)}
    est.observe(sample(3e9, 3.0, transport="local-inline"))
    assert est.rate(path_key("local-inline", CROSS), 3.0) == 3e9 and est.rate(key, 3.0) == pytest.approx(5.5e9)


def test_old_samples_stop_counting_so_a_refused_path_is_measured_again() -> None:
    est = BandwidthEstimates.of([sample(1e6, 0.0), sample(9e6, 50.0)], MeasuredBandwidthConfig(0.5, max_age_s=60.0))
    key = path_key("grpc", CROSS)
    assert est.rate(key, 60.0) == 5e6  # both count
    assert est.rate(key, 60.1) == 9e6  # the first is older than max_age_s
    assert est.rate(key, 110.1) is None and est.at(110.1) == {}  # back to the topology's bandwidth
    never = BandwidthEstimates.of([sample(1e6, 0.0)], MeasuredBandwidthConfig(max_age_s=0.0))
    assert never.rate(key, 0.0) is None  # max_age_s 0: measurements are never used


def test_the_rates_at_a_time_are_a_view_computed_on_lookup() -> None:
    est = BandwidthEstimates(MeasuredBandwidthConfig(ewma_weight=0.5, max_age_s=10.0))
    key, local = path_key("grpc", CROSS), path_key("local", ("nvlink:node-0-i0", "nvlink:node-0-i1"))
    view = est.at(5.0)
    assert key not in view and view.get(key) is None and len(view) == 0
    est.observe(sample(4e6, 1.0))
    est.observe(BandwidthSample("local", local[1], 2e9, 5.0))
    assert view[key] == 4e6 and view.get(local) == 2e9 and list(view) == [key, local]  # first-observed order
    with pytest.raises(KeyError):
        est.at(11.5)[key]  # 10.5 s old
    assert est.at(11.5) == {local: 2e9} and ("grpc", ("nic:x",)) not in view


def test_only_the_newest_samples_of_a_path_are_kept() -> None:
    est = BandwidthEstimates.of(
        [sample(1.0)] * MAX_SAMPLES_PER_PATH + [sample(2.0)], MeasuredBandwidthConfig(ewma_weight=1.0)
    )
    assert est.rate(path_key("grpc", CROSS), 0.0) == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ewma_weight": 0.0}, "ewma_weight must be in (0, 1], got 0.0"),
        ({"ewma_weight": 1.5}, "ewma_weight must be in (0, 1], got 1.5"),
        ({"max_age_s": -1.0}, "max_age_s must be a finite number >= 0, got -1.0"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        MeasuredBandwidthConfig(**kwargs)


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("bytes_per_s must be a finite number > 0, got 0.0")):
        sample(0.0)
    with pytest.raises(ValueError, match="transport is empty"):
        sample(1.0, transport="")


# ---- the cost model with a measured rate ---------------------------------------------------------------
# 1000 B/token, 16-token blocks, 160 tokens, 20 ms steps (the worked example of docs/cost-model.md): at
# 160,000 B/s (cap 1.0) stages of 10, 3, 1 blocks then a suspended 1-block stage.
BASE = {"kv_tokens": 160, "kv_bytes_per_token": 1000, "block_size_tokens": 16, "decode_step_s": 0.02}
FULL_CAP = CostConfig(cap_fraction=1.0)


def test_a_measured_rate_below_the_topologys_share_sets_the_bandwidth() -> None:
    nominal = plan_migration(MigrationCostInput(**BASE, path_bandwidth_bytes_per_s=1_600_000), FULL_CAP)
    slow = plan_migration(
        MigrationCostInput(**BASE, path_bandwidth_bytes_per_s=1_600_000, measured_bandwidth_bytes_per_s=160_000),
        FULL_CAP,
    )
    assert (nominal.bandwidth_source, nominal.effective_bandwidth_bytes_per_s) == ("topology", 1_600_000)
    assert (slow.bandwidth_source, slow.effective_bandwidth_bytes_per_s) == ("measured", 160_000)
    # exactly the worked example priced at 160,000 B/s from the topology
    assert slow.stage_bytes == (160_000, 48_000, 16_000, 16_000)
    assert slow.transfer_s == pytest.approx(1.5) and slow.downtime_s == pytest.approx(0.1 + 0.001)


def test_a_measured_rate_never_prices_a_move_faster_than_the_cap() -> None:
    capped = CostConfig(cap_fraction=0.2)
    plan = plan_migration(
        MigrationCostInput(**BASE, path_bandwidth_bytes_per_s=1_600_000, measured_bandwidth_bytes_per_s=9e9),
        capped,
    )
    assert (plan.bandwidth_source, plan.effective_bandwidth_bytes_per_s) == ("topology", 320_000)
    shared = plan_migration(
        MigrationCostInput(
            **BASE, path_bandwidth_bytes_per_s=1_600_000, existing_flows=1, measured_bandwidth_bytes_per_s=200_000
        ),
        capped,
    )
    assert (shared.bandwidth_source, shared.effective_bandwidth_bytes_per_s) == ("topology", 160_000)  # 320k / 2


def test_a_measured_rate_below_the_kv_growth_does_not_converge() -> None:
    # KV grows at 1000 B / 20 ms = 50,000 B/s: measured 40,000 B/s cannot keep up
    plan = plan_migration(
        MigrationCostInput(**BASE, path_bandwidth_bytes_per_s=1_600_000, measured_bandwidth_bytes_per_s=40_000),
        FULL_CAP,
    )
    assert not plan.converges and plan.mode == "blocking" and plan.bandwidth_source == "measured"
    with pytest.raises(ValueError, match="measured_bandwidth_bytes_per_s must be a finite number > 0 or None"):
        MigrationCostInput(**BASE, path_bandwidth_bytes_per_s=1e6, measured_bandwidth_bytes_per_s=0.0)
