"""The ``hilum`` command: sub-commands are registered by each package's ``cli`` module.

Each sub-command module exposes ``register(subparsers, summary)`` which adds its parser (with ``summary`` as
its one-line help) and sets ``func`` (a callable taking the parsed namespace and returning an exit status).
:data:`SUBCOMMANDS` names them; a run imports only the module of the sub-command it runs, so ``hilum sim``
never imports the cluster's HTTP, gRPC or etcd clients (``hilum up``'s) and ``hilum --help`` imports none.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
from collections.abc import Collection, Sequence
from typing import NamedTuple

from hilum_cli import Parser, VersionAction
from hilum_cli.broken_pipe import quiet_on_broken_pipe


class SubCommand(NamedTuple):
    """One ``hilum`` sub-command: its name, the module whose ``register`` adds it, its one-line help."""

    name: str
    module: str
    summary: str


#: Every sub-command, in the order ``hilum --help`` lists them.
SUBCOMMANDS: tuple[SubCommand, ...] = (
    SubCommand("topology", "topology.cli", "inspect topology files"),
    SubCommand("sim", "sim.cli", "trace-driven cluster simulator: compare scheduling policies on a real trace"),
    SubCommand(
        "up",
        "hilum_cli.up",
        "start a whole hilum cluster on this machine (etcd, coordinators, schedulers, llumlets, gateway)",
    ),
    SubCommand(
        "bench",
        "hilum_cli.bench",
        "replay a trace against a live gateway; the table of `hilum sim`, optionally beside the simulator's",
    ),
)


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """Build the top-level ``hilum`` parser.

    Args:
        full: the sub-commands to register in full (importing their modules); the others get a parser with
            their name and one-line help only, which is all ``hilum --help`` and the top level's usage errors
            show. None: every sub-command in full.

    Raises:
        ValueError: a name in ``full`` is not a sub-command's.
    """
    names = [c.name for c in SUBCOMMANDS]
    unknown = sorted(set(full or ()) - set(names))
    if unknown:
        raise ValueError(f"unknown hilum sub-command {', '.join(unknown)}; choose from {', '.join(names)}")
    parser = Parser(
        prog="hilum",
        description="hilum: topology-aware two-tier LLM request scheduler with live KV-cache migration.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in SUBCOMMANDS:
        if full is None or command.name in full:
            importlib.import_module(command.module).register(sub, command.summary)
            _plain_descriptions(sub.choices[command.name])
        else:
            sub.add_parser(command.name, help=command.summary)
    return parser


# reST in the module docstrings that are the sub-commands' --help: :role:`target` and ``literal``
_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_RST_LITERAL = re.compile(r"``([^`]+)``")


def _plain_descriptions(parser: argparse.ArgumentParser) -> None:
    """Show ``parser``'s description, and its sub-commands', as text: a module docstring's reST markup
    (``:mod:`x``` and ````x````) becomes `x`, as the README writes commands."""
    if parser.description:
        parser.description = _RST_LITERAL.sub(r"`\1`", _RST_ROLE.sub(r"`\1`", parser.description))
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _plain_descriptions(child)


def _command_of(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` runs: its first word that is not an option (the top level takes only
    ``-h``), when that names one; else None (top-level help or a usage error)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in {c.name for c in SUBCOMMANDS} else None


@quiet_on_broken_pipe
def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hilum``; returns the process exit status (0 ok, 1 runtime error, 2 usage error); 0 and nothing
    printed when stdout's reader has gone (``hilum topology show 1x8-a100 | head -1``, :mod:`hilum_cli.broken_pipe`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    try:
        return _run(argv, command)
    except KeyboardInterrupt:  # where a command has not said more itself (hilum sim: whether results were written)
        print(f"hilum {command}: interrupted" if command else "hilum: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str], command: str | None) -> int:
    """:func:`main` once ``argv`` is read: the sub-command's set-up (its imports included), then the command."""
    if command == "sim":  # the simulator runs its compiled modules when built (hilum_compiled); nothing else does
        import hilum_compiled

        if not hilum_compiled.install() and hilum_compiled.refused_build():
            # a build is there but cannot be used (stale, another interpreter's): say so, the run is about 2x slower
            print(f"hilum sim: running as plain Python ({hilum_compiled.status()})", file=sys.stderr)
        # One thread, and no BLAS: numpy's OpenBLAS need not start a thread per core, which spins idle for a while
        # after start-up (about 0.1 CPU-s of every `hilum sim` process on 2 cores). A value the user set stays.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        # SIGTERM (a service manager's stop, `timeout`) ends a run as Ctrl-C does: "interrupted", exit 130, and no
        # results file half-written (sim.cli); Python's default would end the process where it stands
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.default_int_handler)
    if command == "up":  # Ctrl-C even while its modules load, also when inherited ignored (a script's `hilum up &`):
        # hilum up's own handlers take over before it starts anything (hilum_cli.up)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = build_parser(full=() if command is None else (command,))
    args = parser.parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
