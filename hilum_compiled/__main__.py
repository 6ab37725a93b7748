"""python -m hilum_compiled build [--if-stale] [-j N] | status | remove: the simulator's compiled modules (mypyc)."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys

import hilum_compiled


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (``status``: 0 when the compiled modules are in use, 1 if not)."""
    parser = argparse.ArgumentParser(prog="python -m hilum_compiled", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile the hot modules with mypyc into this environment")
    build.add_argument("--if-stale", action="store_true", help="only when the build does not match its sources")
    build.add_argument("-j", "--jobs", type=int, default=2, help="C compiler jobs (default 2)")
    sub.add_parser("status", help="say whether this interpreter runs the compiled modules, and why not")
    sub.add_parser("remove", help="remove the build: everything runs as plain Python")
    args = parser.parse_args(argv)
    if args.command == "build":
        from hilum_compiled.build import build as run_build

        try:
            run_build(args.jobs, only_if_stale=args.if_stale)
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
        # mypy's analysis leaves gigabytes of objects whose teardown takes minutes at exit: skip it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.command == "remove":
        from hilum_compiled.build import remove

        remove()
        return 0
    status = hilum_compiled.status() if not hilum_compiled.install() else _served()
    if "changed since the build" in status or "is missing" in status or "another module list" in status:
        status += "; `make` (python -m hilum_compiled build --if-stale) builds it again"
    print(status)
    return 0 if status.startswith("compiled") else 1


def _served() -> str:
    """The status of an installed build, unless a compiled module would be imported from another tree (a checkout
    first on ``sys.path``, served its own sources: the finder passes it by), as ``hilum sim`` would find it."""
    for name in hilum_compiled.MODULES:
        spec = importlib.util.find_spec(name)  # imports the parent packages, none of them compiled
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            origin = spec.origin if spec is not None else "nowhere"
            return f"pure Python: {name} would be imported from {origin}, not the tree the build was made from"
    return hilum_compiled.status()


if __name__ == "__main__":
    sys.exit(main())
