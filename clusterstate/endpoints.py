"""Address lists as hilum's command lines take them (``--etcd a:2379,b:2379``): parsed by one rule everywhere.

Imports nothing heavy: ``hilumctl`` parses its options before it knows whether it will need the etcd client.
"""

from __future__ import annotations

import argparse

__all__ = ["endpoints_option", "is_host_port", "parse_endpoints"]


def parse_endpoints(text: str, what: str = "--etcd") -> list[str]:
    """The ``host:port`` entries of a comma-separated list, as a command line or an environment variable gives
    them (blanks around an entry dropped): every hilum process's ``--etcd``, and ``hilumctl --coordinator``.

    Raises:
        ValueError: led by ``what`` (the flag or variable it came from; nothing when empty) when the list is
            empty or blank, an entry is empty (``a:1,,b:2``, a trailing comma; never dropped silently) or is not
            ``host:port`` with a port of 1-65535.
    """
    lead = f"{what}: " if what else ""
    out = [a.strip() for a in text.split(",")]
    if not any(out):
        raise ValueError(f"{lead}expected HOST:PORT, got {text!r}")
    for k, address in enumerate(out, 1):
        if not address:
            raise ValueError(f"{lead}entry {k} of {text!r} is empty: drop the extra comma")
        if not is_host_port(address):
            raise ValueError(f"{lead}{address!r} is not HOST:PORT (port 1-65535)")
    return out


def endpoints_option(text: str) -> str:
    """argparse ``type=`` of an ``--etcd`` option: ``text`` as given, once :func:`parse_endpoints` accepts it, so
    that a malformed list is a usage error (exit 2) before the process starts anything.

    Raises argparse.ArgumentTypeError (argparse names the option)."""
    try:
        parse_endpoints(text, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def is_host_port(address: str) -> bool:
    """``address`` is ``host:port`` with a non-empty host and a port of 1-65535."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
