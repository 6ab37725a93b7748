"""End a command quietly when its reader has gone (``hilum ... | head -1``): one wrapper for every entry point.

Python ignores SIGPIPE, so a write to a pipe whose reader has exited raises :class:`BrokenPipeError` instead of
ending the process as it ends ``cat`` or ``grep``; uncaught, it prints a traceback, and the interpreter's last
flush of ``sys.stdout`` adds "Exception ignored ... BrokenPipeError". rich's :class:`~rich.console.Console`
catches it itself and raises ``SystemExit(1)`` (``Console.on_broken_pipe``), which exits 1 with no message.
:func:`quiet_on_broken_pipe` applies the remedy of the Python docs (library/signal, "Note on SIGPIPE") to both:
it catches the error at the entry point, points the gone stream's descriptor at ``/dev/null`` with
``os.dup2`` so the final flush has somewhere to write, and returns :data:`BROKEN_PIPE_STATUS`. A write that fails
for the device's sake (a full disk, ``> /dev/full``) ends the same way, but with one line on stderr and exit 1.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TextIO

__all__ = ["BROKEN_PIPE_STATUS", "quiet_on_broken_pipe"]

#: 0, not 141 (128 + SIGPIPE, what a shell reports for a C tool that SIGPIPE ended): the reader stopping is the
#: pipeline's choice, not a failure of the command, and 141 could not be reported reliably. CPython returns a
#: short count instead of raising when the reader leaves during one large write (a rich table is written in one
#: piece), so the same ``hilumctl topology | head -1`` would exit 141 or 0 depending on which write met the closed
#: pipe; 0 is the same every time, and ``set -o pipefail`` scripts that cut hilum's output with ``head`` do not
#: fail. Not 1 either (the Python docs' example), which is hilum's status for a runtime error.
BROKEN_PIPE_STATUS = 0

_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})  # writes that fail for the device's sake

P = ParamSpec("P")


def quiet_on_broken_pipe(main: Callable[P, int]) -> Callable[P, int]:
    """Wrap an entry point returning an exit status: a write to a closed ``sys.stdout`` or ``sys.stderr``
    returns :data:`BROKEN_PIPE_STATUS` with nothing printed.

    The wrapper flushes ``sys.stdout`` before returning, so a broken pipe is met here and not in the
    interpreter's shutdown. A :class:`BrokenPipeError` from anything else (a socket, a child's stdin) is
    re-raised: only one raised while stdout or stderr has lost its reader (``poll`` reports POLLERR/POLLHUP on
    it) is taken for this case; where ``poll`` is missing, every one is. An OSError of a full or failing device
    (ENOSPC, EDQUOT, EFBIG, EIO), from whatever write, is said in one line on stderr, and the status is 1.
    """

    @functools.wraps(main)
    def run(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()
            return status
        except BrokenPipeError:
            gone = [s for s in (sys.stdout, sys.stderr) if _reader_gone(s)]
            if not gone:
                raise
        except SystemExit as exc:
            # rich's Console.on_broken_pipe: it has already sent stdout to /dev/null, raising within the except
            if not isinstance(exc.__context__, BrokenPipeError):
                raise
            gone = [s for s in (sys.stdout, sys.stderr) if _reader_gone(s)]
        except OSError as exc:  # a full disk or a failing device (`> /dev/full`): one line, not a traceback
            if exc.errno not in _NO_ROOM:
                raise
            return _no_room(exc)
        for stream in gone or [sys.stdout]:
            _to_devnull(stream)
        return BROKEN_PIPE_STATUS

    return run


def _no_room(exc: OSError) -> int:
    """Say that a write failed for the device's sake (one line on stderr, which may be on the full disk too), send
    what is still buffered in stdout nowhere (not into a second error at exit), and return 1."""
    with contextlib.suppress(OSError):
        print(f"{Path(sys.argv[0]).name or 'hilum'}: error: cannot write: {exc}", file=sys.stderr, flush=True)
    _to_devnull(sys.stdout)
    return 1


def _fd(stream: TextIO) -> int | None:
    """The descriptor under ``stream``; None for one without (``io.StringIO``, a closed stream)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both OSError and ValueError
        return None


def _reader_gone(stream: TextIO) -> bool:
    """Whether ``stream`` is a pipe or socket with no reader left; True where ``select.poll`` is missing."""
    fd = _fd(stream)
    if fd is None:
        return False
    if not hasattr(select, "poll"):  # pragma: no cover - Windows
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _to_devnull(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null, so what is still buffered in it is flushed there."""
    fd = _fd(stream)
    if fd is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
