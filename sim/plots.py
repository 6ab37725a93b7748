"""PNG plots of simulation results (matplotlib, Agg canvas; no display, no pyplot global state).

Every function draws on its own :class:`matplotlib.figure.Figure`, writes ``path`` (parent folders are
created) and returns it as a :class:`~pathlib.Path`. Empty inputs give a figure that says so
instead of an error, so that a run with no finished requests still gets its plots.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sim.results import SimRun, StoredRun, SweepRow, atomic_file, request_totals

__all__ = ["KV_HEATMAP_MIN_INSTANCES", "plot_kv_usage", "plot_p99_vs_load", "plot_ttft_cdf"]

KV_HEATMAP_MIN_INSTANCES = 17
"""From this many instances on, :func:`plot_kv_usage` draws a heat map instead of one line each."""

_MIN_LOG_MS = 1e-3  # TTFT values below this (ms) are drawn at it, since a log axis cannot show 0
_DPI = 120


def _new_figure(width_in: float = 7.0, height_in: float = 4.5) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width_in, height_in), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    return fig, ax


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out, binary=True) as f:  # a plot cut short by an interrupt never replaces the last one
        fig.savefig(f, format="png")
    return out


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes)


def _run_labels(runs: Sequence[SimRun | StoredRun]) -> list[str]:
    """Policy names, qualified by topology and rate scale where a policy appears more than once."""
    policies = [r.policy for r in runs]
    return [
        r.policy if policies.count(r.policy) == 1 else f"{r.policy} ({r.topology}, x{r.rate_scale:g})" for r in runs
    ]


def plot_ttft_cdf(runs: Sequence[SimRun | StoredRun], path: str | Path) -> Path:
    """Empirical CDF of TTFT (ms, log x axis), one curve per run, labelled by policy.

    Requests without a first token are left out of each curve (the curve ends below 1.0 when some
    were refused or unfinished: the y value is the fraction of *all* requests of the run).
    """
    fig, ax = _new_figure()
    drawn = 0
    for run, label in zip(runs, _run_labels(runs), strict=True):
        ttft_s = request_totals(run.requests).ttft_s
        ttft_ms = np.sort(ttft_s[~np.isnan(ttft_s)] * 1e3)
        if ttft_ms.size == 0:
            continue
        fraction = np.arange(1, ttft_ms.size + 1, dtype=np.float64) / len(run.requests)
        ax.step(np.maximum(ttft_ms, _MIN_LOG_MS), fraction, where="post", label=label)
        drawn += 1
    if drawn:
        ax.set_xscale("log")
        ax.legend(loc="lower right")
    else:
        _no_data(ax, "TTFT samples")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0.0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("TTFT CDF")
    return _save(fig, path)


def plot_kv_usage(run: SimRun, path: str | Path) -> Path:
    """Per-instance KV-cache usage fraction over simulated time.

    Up to ``KV_HEATMAP_MIN_INSTANCES - 1`` instances: one thin line each (legend up to 8). More: a
    heat map, one row per instance (in the timeline's order), colour = usage fraction in [0, 1].
    """
    kv = run.kv
    instances = list(kv.usage_fraction)
    times = np.asarray(kv.times_s, dtype=np.float64)
    title = f"KV usage: {run.policy} on {run.topology}"
    if not instances or times.size == 0:
        fig, ax = _new_figure()
        _no_data(ax, "KV usage samples")
        ax.set_title(title)
        return _save(fig, path)
    if len(instances) < KV_HEATMAP_MIN_INSTANCES:
        fig, ax = _new_figure()
        for instance_id in instances:
            ax.plot(times, kv.usage_fraction[instance_id], linewidth=0.8, label=instance_id)
        ax.set_ylim(0.0, 1.05)
        ax.set_ylabel("KV usage fraction")
        if len(instances) <= 8:
            ax.legend(loc="upper right", fontsize="small")
    else:
        fig, ax = _new_figure(height_in=max(4.5, min(12.0, len(instances) / 24)))
        grid = np.array([kv.usage_fraction[i] for i in instances], dtype=np.float64)
        end = float(times[-1]) + (kv.interval_s if kv.interval_s > 0 else 0.0)
        image = ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            origin="lower",
            extent=(float(times[0]), max(end, float(times[0]) + 1e-9), 0.0, float(len(instances))),
            vmin=0.0,
            vmax=1.0,
            cmap="viridis",
        )
        fig.colorbar(image, ax=ax, label="KV usage fraction")
        ax.set_ylabel(f"instance (0..{len(instances) - 1})")
    ax.set_xlabel("simulated time (s)")
    ax.set_title(title)
    return _save(fig, path)


def plot_p99_vs_load(rows: Sequence[SweepRow], path: str | Path, *, title: str | None = None) -> Path:
    """P99 TTFT (ms, log y) versus rate scale, one line per policy.

    Rows with the same policy and rate scale (several seeds) are averaged; the error bar spans
    their minimum and maximum. Rows whose P99 TTFT is missing are left out. Pass the rows of one
    topology (``run_sweep`` writes one plot per topology).
    """
    by_policy: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        p99 = row.summary.ttft_p99_s
        if p99 is not None:
            by_policy[row.summary.policy][row.rate_scale].append(p99 * 1e3)
    fig, ax = _new_figure()
    for policy in sorted(by_policy):
        points = sorted(by_policy[policy].items())
        x = np.array([rate for rate, _ in points], dtype=np.float64)
        values = [np.asarray(v, dtype=np.float64) for _, v in points]
        mean = np.array([v.mean() for v in values])
        err = np.array(
            [
                [m - v.min() for m, v in zip(mean, values, strict=True)],
                [v.max() - m for m, v in zip(mean, values, strict=True)],
            ]
        )
        ax.errorbar(x, np.maximum(mean, _MIN_LOG_MS), yerr=err, marker="o", capsize=3, label=policy)
    if by_policy:
        ax.set_yscale("log")
        ax.legend(loc="upper left")
    else:
        _no_data(ax, "P99 TTFT values")
    ax.set_xlabel("rate scale (x trace arrival rate)")
    ax.set_ylabel("P99 TTFT (ms, log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or "P99 TTFT vs load")
    return _save(fig, path)
