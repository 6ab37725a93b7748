"""Addresses as hilum's command lines take them, each checked by one rule everywhere: the etcd lists
(``--etcd a:2379,b:2379``), the addresses a daemon listens on (``--listen``, port 0 picks a free one) and the
ones others reach (``--advertise``, ``--coordinator``).

Imports nothing heavy: ``hilumctl`` parses its options before it knows whether it will need the etcd client.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = [
    "address_option",
    "check_advertised",
    "checked_option",
    "endpoints_option",
    "is_host_port",
    "listen_option",
    "optional_listen_option",
    "parse_endpoints",
    "require_reachable",
    "split_address",
]


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


def checked_option(check: Callable[[str], object], text: str) -> str:
    """``text`` once ``check(text)`` returns: the body of every argparse ``type=`` here and in
    ``clusterstate.options``, so that a bad value is a usage error (exit 2) before the process starts anything.

    Raises argparse.ArgumentTypeError with ``check``'s ValueError message (argparse names the option)."""
    try:
        check(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def endpoints_option(text: str) -> str:
    """argparse ``type=`` of an ``--etcd`` option: ``text`` as given, once :func:`parse_endpoints` accepts it.

    Raises argparse.ArgumentTypeError (argparse names the option)."""
    return checked_option(lambda t: parse_endpoints(t, ""), text)


def split_address(address: str, what: str = "", *, listen: bool = False) -> tuple[str, int]:
    """(host, port) of one ``host:port`` address: a non-empty host (an IPv6 address in brackets, ``[::1]``, returned
    with them) and a port of 1-65535, or of 0-65535 when ``listen`` (an address to listen on, where port 0 picks a
    free one).

    Raises:
        ValueError: led by ``what`` (the flag it came from; nothing when empty) when ``address`` is a list or not
            ``host:port`` with a port in range (a port above 65535 is refused, never wrapped round).
    """
    lead = f"{what}: " if what else ""
    if "," in address:
        raise ValueError(f"{lead}{address!r} is not one HOST:PORT: this option takes a single address")
    lowest = 0 if listen else 1
    if "://" in address:  # "http://10.0.0.5:8000": read as an unbracketed IPv6 address below
        bare = address.split("://", 1)[1].rstrip("/")
        raise ValueError(f"{lead}{address!r} is a URL: give HOST:PORT ({bare})")
    host, sep, port = address.rpartition(":")
    if sep and not host and port.isdigit():  # ":7100"
        every = f" (0.0.0.0:{port} for every interface)" if listen else ""
        raise ValueError(f"{lead}{address!r}: the host is missing{every}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):  # "::1:0": gRPC read it as [::0.1.0.0]:443
        raise ValueError(f"{lead}{address!r}: an IPv6 address goes in brackets ([::1]:{port or 'PORT'})")
    if not (sep and host and not any(c.isspace() for c in host) and port.isascii() and port.isdigit()) or not (
        lowest <= int(port) <= 65535
    ):
        raise ValueError(f"{lead}{address!r} is not HOST:PORT (port {lowest}-65535)")
    return host, int(port)


def is_host_port(address: str) -> bool:
    """``address`` is ``host:port`` with a non-empty host and a port of 1-65535 (:func:`split_address`)."""
    try:
        split_address(address)
    except ValueError:
        return False
    return True


def listen_option(text: str) -> str:
    """argparse ``type=`` of a ``--listen HOST:PORT`` option: ``text`` once :func:`split_address` accepts it as an
    address to listen on (port 0-65535, 0 picks a free one).

    Raises argparse.ArgumentTypeError (argparse names the option)."""
    return checked_option(lambda t: split_address(t, listen=True), text)


def optional_listen_option(text: str) -> str:
    """:func:`listen_option` of an option whose empty value means "not given" (its default)."""
    return listen_option(text) if text else text


def address_option(text: str) -> str:
    """argparse ``type=`` of an option naming the one ``HOST:PORT`` others reach (``--advertise``, a process's
    ``--coordinator``): ``text`` once :func:`split_address` accepts it with a real port (1-65535). Empty means
    "not given" (its default: the listen host with the bound port, no coordinator).

    Raises argparse.ArgumentTypeError (argparse names the option)."""
    return checked_option(split_address, text) if text else text


def require_reachable(parser: argparse.ArgumentParser, listen: str, advertise: str) -> None:
    """Refuse, as a usage error (``parser.error``: exit 2, before anything starts), a ``--listen`` host that binds
    every interface without ``--advertise``: the address others reach the process at would be unknown
    (``hilum_proto.tls.advertised_address``'s rule, its message)."""
    from hilum_proto.tls import advertised_address  # grpc: imported by the daemons, which bind a server next

    try:
        advertised_address(listen, 0, advertise)
    except ValueError as exc:
        parser.error(str(exc))
    check_advertised(parser, listen, advertise)


def check_advertised(
    parser: argparse.ArgumentParser,
    listen: str,
    advertise: str,
    names: tuple[str, str] = ("--listen", "--advertise"),
) -> None:
    """Refuse, as a usage error, an advertised address (``advertise``, given) that cannot be the one others reach:
    a host that binds every interface (``0.0.0.0``, ``::``: no address), or a port named while ``listen`` asks for
    port 0 (a free one, known only once bound). ``names``: the two options, for the message."""
    if not advertise:
        return
    host, port = split_address(advertise, names[1])
    if host in ("0.0.0.0", "::", "[::]"):  # hilum_proto.tls.WILDCARD_HOSTS, less the empty host split refuses
        parser.error(f"{names[1]} {advertise}: {host} is no address others can reach: give the host they reach it at")
    if split_address(listen, names[0], listen=True)[1] == 0:
        parser.error(
            f"{names[1]} {advertise} names port {port}, but {names[0]} {listen} takes a free port when it starts: "
            f"give {names[0]} {split_address(listen, names[0], listen=True)[0]}:{port}"
        )
