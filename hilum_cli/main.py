"""The ``hilum`` command: sub-commands are registered by each package's ``cli`` module.

Each sub-command module exposes ``register(subparsers)`` which adds its parser and sets
``func`` (a callable taking the parsed namespace and returning an exit status).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level ``hilum`` parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="hilum",
        description="hilum: topology-aware two-tier LLM request scheduler with live KV-cache migration.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from hilum_cli import bench, up
    from sim import cli as sim_cli
    from topology import cli as topology_cli

    topology_cli.register(sub)
    sim_cli.register(sub)
    up.register(sub)
    bench.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hilum``; returns the process exit status (0 ok, 1 runtime error, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
