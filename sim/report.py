"""Side-by-side tables of :class:`sim.results.PolicySummary` rows (rich), for the terminal and tests.

Units in the table: latencies (TTFT, TBT, end-to-end, downtime) in milliseconds, bytes in GB
(10^9 bytes), preemption loss, simulated and wall time in seconds. A missing value (no sample) is
shown as ``-``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from sim.results import PolicySummary, SweepRow
from topology.tables import split_to_fit

__all__ = [
    "LATENCY_COLUMNS",
    "MIGRATION_COLUMNS",
    "MISSING",
    "MOVE_COLUMNS",
    "format_sweep_table",
    "format_table",
    "render_by_metric",
    "render_sweep_table",
    "render_table",
    "summary_tables",
    "ttft_p99_ratios",
]

MISSING = "-"
"""Cell text for a value with no sample (e.g. no high-priority requests)."""

_DEFAULT_WIDTH = 260  # characters; wide enough that no number is wrapped or cut


def _ms(value: float | None) -> str:
    return MISSING if value is None else f"{value * 1e3:.1f}"


def _s(value: float | None) -> str:
    return MISSING if value is None else f"{value:.1f}"


def _wall_s(value: float | None) -> str:
    """Seconds: two significant digits below 0.1 s, two decimals below 10 s (a short run's wall time is not 0.0)."""
    if value is None:
        return MISSING
    return f"{value:.2g}" if value < 0.1 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _gb(value_bytes: int | None) -> str:
    return MISSING if value_bytes is None else f"{value_bytes / 1e9:.2f}"


# (header, cell) for every summary column after the leading label columns; headers are short and
# broken over two lines so that 20+ columns fit a wide terminal.
_SUMMARY_COLUMNS: tuple[tuple[str, Callable[[PolicySummary], str]], ...] = (
    ("reqs", lambda s: str(s.requests)),
    ("done", lambda s: str(s.finished)),
    ("refused", lambda s: str(s.refused)),
    ("TTFT\np50 ms", lambda s: _ms(s.ttft_p50_s)),
    ("TTFT\np99 ms", lambda s: _ms(s.ttft_p99_s)),
    ("TBT\np50 ms", lambda s: _ms(s.tbt_p50_s)),
    ("TBT\np99 ms", lambda s: _ms(s.tbt_p99_s)),
    ("decode\np99 ms", lambda s: _ms(s.decode_p99_s)),
    ("E2E\np99 ms", lambda s: _ms(s.e2e_p99_s)),
    ("hi-pri\nTTFT p99", lambda s: _ms(s.high_priority_ttft_p99_s)),
    ("preempt", lambda s: str(s.preemptions)),
    ("preempt\nlost s", lambda s: _s(s.preempted_s)),
    ("prefix\nhit %", lambda s: MISSING if s.prefix_hit_rate is None else f"{100 * s.prefix_hit_rate:.1f}"),
    ("mig\nintra", lambda s: str(s.migrations_intra_domain)),
    ("mig\ncross", lambda s: str(s.migrations_cross_domain)),
    ("mig\naborted", lambda s: str(s.migrations_aborted)),
    ("cross\nGB", lambda s: _gb(s.cross_domain_bytes)),
    ("downtime\nmean ms", lambda s: _ms(s.downtime_mean_s)),
    ("downtime\np99 ms", lambda s: _ms(s.downtime_p99_s)),
    ("sim s", lambda s: _s(s.sim_duration_s)),
    ("engine\nsteps", lambda s: MISSING if s.engine_steps is None else str(s.engine_steps)),
    ("wall s", lambda s: _wall_s(s.wall_s)),
    ("req per\nwall s", lambda s: _s(s.requests_per_wall_s)),
    ("GPU-h", lambda s: _s(s.gpu_hours)),
    ("scale\nout/in", lambda s: f"{s.scale_outs}/{s.scale_ins}"),
)


#: The columns of the two tables ``hilum sim`` prints (each fits a 120-column terminal).
LATENCY_COLUMNS: tuple[str, ...] = (
    "done", "refused", "TTFT\np50 ms", "TTFT\np99 ms", "TBT\np50 ms", "TBT\np99 ms", "decode\np99 ms",
    "E2E\np99 ms", "hi-pri\nTTFT p99", "preempt", "preempt\nlost s", "prefix\nhit %",
)  # fmt: skip
MOVE_COLUMNS: tuple[str, ...] = (
    "mig\nintra", "mig\ncross", "mig\naborted", "cross\nGB", "downtime\nmean ms", "downtime\np99 ms",
)  # fmt: skip
MIGRATION_COLUMNS: tuple[str, ...] = (
    *MOVE_COLUMNS,
    "sim s", "engine\nsteps", "wall s", "req per\nwall s", "GPU-h", "scale\nout/in",
)  # fmt: skip


def ttft_p99_ratios(summaries: Sequence[PolicySummary], baseline: str) -> dict[str, float | None]:
    """P99 TTFT of each policy divided by that of the policy named ``baseline``.

    Returns policy -> ratio (1.0 for the baseline itself); None where either P99 is missing or the
    baseline's P99 is 0. When a policy appears more than once, the first row with that name is used.

    Raises:
        ValueError: if no summary has policy ``baseline``.
    """
    by_policy: dict[str, PolicySummary] = {}
    for s in summaries:
        by_policy.setdefault(s.policy, s)
    if baseline not in by_policy:
        raise ValueError(f"baseline policy {baseline!r} not among {sorted(by_policy)}")
    base = by_policy[baseline].ttft_p99_s
    out: dict[str, float | None] = {}
    for policy, s in by_policy.items():
        value = s.ttft_p99_s
        out[policy] = None if value is None or base is None or base == 0.0 else value / base
    return out


def _build(
    title: str,
    label_headers: Sequence[str],
    rows: Sequence[tuple[Sequence[str], PolicySummary]],
    ratios: Mapping[str, float | None] | None,
    baseline: str | None,
    only: Sequence[str] | None = None,
    compact: bool = False,
) -> Table:
    columns = [c for c in _SUMMARY_COLUMNS if only is None or c[0] in only]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD)
    for header in label_headers:
        table.add_column(header, no_wrap=True)
    for header, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    if ratios is not None:
        table.add_column(
            f"TTFT p99\n/ {baseline}" if not compact else "TTFT p99\n/ base", justify="right", no_wrap=True
        )
    for labels, summary in rows:
        cells = [*labels, *(cell(summary) for _, cell in columns)]
        if ratios is not None:
            ratio = ratios.get(summary.policy)
            cells.append(MISSING if ratio is None else f"{ratio:.2f}x")
        table.add_row(*cells)
    return table


def render_table(
    summaries: Sequence[PolicySummary],
    *,
    title: str = "hilum sim",
    baseline: str | None = None,
    columns: Sequence[str] | None = None,
    compact: bool = False,
) -> Table:
    """A rich table with one row per summary (policy) and the columns of :class:`PolicySummary`.

    With ``baseline`` set, a last column gives each policy's P99 TTFT relative to that policy's
    (see :func:`ttft_p99_ratios`). ``columns`` keeps only the named column headers (for example
    :data:`LATENCY_COLUMNS` or :data:`MIGRATION_COLUMNS`); None keeps all. ``compact`` drops the
    vertical rules so a dozen columns fit a 120-column terminal.

    Raises:
        ValueError: if ``baseline`` names no policy among ``summaries``.
    """
    ratios = ttft_p99_ratios(summaries, baseline) if baseline is not None else None
    rows = [((s.policy,), s) for s in summaries]
    return _build(title, ("policy",), rows, ratios, baseline, columns, compact)


def render_by_metric(
    summaries: Sequence[PolicySummary],
    *,
    title: str = "hilum sim",
    baseline: str | None = None,
    columns: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
) -> Table:
    """:func:`render_table` turned a quarter: one row per metric (``columns`` as there), one column per policy, so
    that a dozen metrics of a few policies fit an 80-column terminal (the table by policy is about 120 wide).
    ``policies``: the policies shown (None: all; the P99 TTFT ratio is to ``baseline`` whether shown or not).

    Raises:
        ValueError: if ``baseline`` names no policy among ``summaries``.
    """
    ratios = ttft_p99_ratios(summaries, baseline) if baseline is not None else None
    shown = [s for s in summaries if policies is None or s.policy in policies]
    table = Table(title=title or None, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("", no_wrap=True)
    for s in shown:
        table.add_column(s.policy, justify="right", no_wrap=True)
    for header, cell in _SUMMARY_COLUMNS:
        if columns is None or header in columns:
            table.add_row(header.replace("\n", " "), *(cell(s) for s in shown))
    if ratios is not None:
        cells = [MISSING if (r := ratios.get(s.policy)) is None else f"{r:.2f}x" for s in shown]
        table.add_row("TTFT p99 / base", *cells)
    return table


def summary_tables(
    summaries: Sequence[PolicySummary],
    width: int,
    *,
    baseline: str | None,
    latency: Sequence[str],
    migration: Sequence[str],
    migration_title: str,
) -> list[Table]:
    """``hilum sim``'s two tables (``latency`` and ``migration`` columns, the first with the P99 TTFT ratio to
    ``baseline``), one row per policy when both fit ``width`` characters, else one row per metric
    (:func:`render_by_metric`): rich would cut every cell to ``…`` to squeeze a table into a narrow terminal. A
    table by metric still too wide (many policies, or under 80 columns) has its policies over several tables that
    fit (:func:`topology.tables.split_to_fit`).

    Raises:
        ValueError: if ``baseline`` names no policy among ``summaries``.
    """
    by_policy = [
        render_table(summaries, title="", baseline=baseline, columns=latency, compact=True),
        render_table(summaries, title=migration_title, columns=migration, compact=True),
    ]
    measure = Console(width=10_000).measure
    if all(measure(t).maximum <= width for t in by_policy):
        return by_policy
    names = [s.policy for s in summaries]
    tables: list[Table] = []
    for title, columns, base in (("", latency, baseline), (migration_title, migration, None)):

        def build(
            policies: Sequence[str], caption: str, columns: Sequence[str] = columns, base: str | None = base
        ) -> Table:
            return render_by_metric(summaries, title=caption, baseline=base, columns=columns, policies=policies)

        tables += split_to_fit(build, names, title, width)
    return tables


def render_sweep_table(
    rows: Sequence[SweepRow],
    *,
    title: str = "hilum sim sweep",
    columns: Sequence[str] | None = None,
    compact: bool = False,
) -> Table:
    """A rich table with one row per sweep grid point: topology, policy, rate scale, seed + summary. ``columns``
    and ``compact`` as :func:`render_table`'s (``hilum sim sweep`` prints its two tables)."""
    labelled = [((r.topology, r.policy, f"{r.rate_scale:g}", str(r.seed)), r.summary) for r in rows]
    return _build(title, ("topology", "policy", "rate\nscale", "seed"), labelled, None, None, columns, compact)


def _to_text(table: Table, width: int) -> str:
    console = Console(file=io.StringIO(), record=True, width=width, color_system=None, soft_wrap=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def format_table(
    summaries: Sequence[PolicySummary],
    *,
    title: str = "hilum sim",
    baseline: str | None = None,
    width: int = _DEFAULT_WIDTH,
    columns: Sequence[str] | None = None,
) -> str:
    """:func:`render_table` as plain text (no colour), ``width`` characters wide; ``columns`` as there."""
    return _to_text(render_table(summaries, title=title, baseline=baseline, columns=columns), width)


def format_sweep_table(rows: Sequence[SweepRow], *, title: str = "hilum sim sweep", width: int = _DEFAULT_WIDTH) -> str:
    """:func:`render_sweep_table` as plain text (no colour), ``width`` characters wide."""
    return _to_text(render_sweep_table(rows, title=title), width)
