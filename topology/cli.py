"""``hilum topology`` sub-commands."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Add ``hilum topology`` to the sub-command set ``sub`` (an argparse sub-parsers action)."""
    parser: argparse.ArgumentParser = sub.add_parser("topology", help="inspect topology files")
    parser.set_defaults(func=_not_built)


def _not_built(args: argparse.Namespace) -> int:
    del args
    print("hilum topology: not built yet")
    return 2
