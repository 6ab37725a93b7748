"""Command-line entry points: ``hilum`` (simulator, topology tools, cluster) and ``hilumctl`` (admin CLI)."""

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn


def version_line(prog: str) -> str:
    """``"<prog> <version> (Python <x.y.z>)"``, the line ``--version`` prints: the installed ``hilum`` distribution's
    version (``pyproject.toml``), or ``unknown (not installed)`` when the package runs from a source tree that was
    never installed."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("hilum")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"{prog} {version} (Python {python})"


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` of the parser's ``prog`` on stdout and exit 0, as argparse's own
    ``action="version"``, with the version read only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kwargs: object) -> NoReturn:
        print(version_line(parser.prog))
        parser.exit()
