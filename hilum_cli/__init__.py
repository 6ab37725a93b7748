"""Command-line entry points: ``hilum`` (simulator, topology tools, cluster) and ``hilumctl`` (admin CLI)."""

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn


def counted(n: int, noun: str) -> str:
    """``n noun``, with an s unless ``n`` is 1 (``1 domain``, ``2 domains``)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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


class Parser(argparse.ArgumentParser):
    """argparse's parser, naming the closest choice after an invalid one (``hilum simm``: did you mean 'sim'?), as
    Python 3.14's ``suggest_on_error`` does. Sub-parsers made from it (``add_subparsers``) are of its class too."""

    def error(self, message: str) -> NoReturn:
        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if wrong is not None:
            import difflib

            close = difflib.get_close_matches(wrong.group(1).lower(), re.findall(r"'([^']*)'", wrong.group(2)), n=1)
            if close:
                message += f"; did you mean '{close[0]}'?"
        super().error(message)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # argparse's signature
        """argparse's, with an option no parser took named by the sub-command it followed (``hilum up --bogus``:
        ``hilum up``'s usage and ``hilum up: error: unrecognized arguments: --bogus``; argparse gave the top level's,
        as if ``hilum`` itself had been given the option)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self._innermost(parsed).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def _innermost(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub-)parser of the deepest sub-command ``parsed`` ran (itself when none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if chosen is not None:
                    return chosen._innermost(parsed) if isinstance(chosen, Parser) else chosen
        return self

    def _print_message(self, message: str, file: Any = None) -> None:  # argparse: SupportsWrite[str] | None
        """argparse's, without dropping a failed write's error (argparse's ignores OSError: ``hilum --help >
        /dev/full`` wrote nothing and exited 0); the entry point's wrapper (``hilum_cli.broken_pipe``) says it."""
        if message:
            out = file or sys.stderr
            out.write(message)
            out.flush()
