"""Rich tables that fit a terminal: ``hilum topology show``'s, and those of the commands above it (``hilum sim
sweep``). Imports nothing of hilum."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

__all__ = ["split_to_fit"]


def split_to_fit(
    build: Callable[[Sequence[str], str], Table], columns: Sequence[str], title: str, width: int
) -> list[Table]:
    """``build(columns, title)`` as one table when it fits ``width`` characters, else as several, each with as many of
    ``columns`` (in order) as fit beside the label columns, the later ones titled ``(continued)``: rich would cut
    every cell to ``…`` to squeeze one table into a narrow terminal. A column too wide alone gets a table alone; a table
    still wider than ``width`` has the cells of its ``columns`` wrapped (folded), and the label columns' but the first
    (the row's name) only when they alone are too wide."""
    measure = Console(width=10_000).measure
    tables: list[Table] = []
    chunk: list[str] = []
    for column in columns:
        if chunk and measure(build([*chunk, column], "")).maximum > width:
            tables.append(build(chunk, title if not tables else f"{title} (continued)".strip()))
            chunk = []
        chunk.append(column)
    if chunk or not tables:
        tables.append(build(chunk, title if not tables else f"{title} (continued)".strip()))
    labels = len(build([], "").columns)  # what build adds before the columns it is given
    for table in tables:  # still too wide (a column wider than the width beside the labels): wrapped, not cut
        if measure(table).maximum > width:
            for col in table.columns[labels:]:
                col.no_wrap, col.overflow = False, "fold"
            for col in table.columns[:labels]:  # whole (rich would wrap one that may: least-/loaded) ...
                col.no_wrap = True
            if measure(table).minimum > width:  # ... unless they alone are too wide: them too, but the row's name
                for col in table.columns[1:labels]:
                    col.no_wrap, col.overflow = False, "fold"
    return tables
