"""``hilum sim`` sub-command."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Add ``hilum sim`` to the sub-command set ``sub`` (an argparse sub-parsers action)."""
    parser: argparse.ArgumentParser = sub.add_parser("sim", help="trace-driven cluster simulator")
    parser.add_argument("--out", default=None)
    parser.set_defaults(func=_not_built)


def _not_built(args: argparse.Namespace) -> int:
    del args
    print("hilum sim: the simulator is not built yet (see the simulator issue)")
    return 0
