"""TLS and keepalive for the gRPC connections between hilum's processes, and TLS for their etcd client.

Every gRPC channel hilum opens (:func:`open_channel`) and every server it binds (:func:`new_server`) comes
from here. Configured by environment variables, read when a channel or server is made (never at import), so
every process — coordinator, domain scheduler, llumlet, gateway, hilumctl — picks up the same settings
from its systemd ``EnvironmentFile`` (deploy/README.md) without a flag of its own:

==========================  ==================================================================================
``HILUM_TLS_CA``            PEM file of the CA that signs hilum's certificates. Set: every gRPC server listens
                            with TLS and every client verifies the server; unset: plaintext (the default).
``HILUM_TLS_CERT``          PEM certificate of this process (needed by servers; clients present it).
``HILUM_TLS_KEY``           its private key.
``HILUM_TLS_CLIENT_AUTH``   ``1`` (default when a certificate is set): servers require and verify a client
                            certificate signed by the CA (mutual TLS); ``0``: server-side TLS only.
``HILUM_ETCD_CA`` / ``_CERT`` / ``_KEY``  the same for the etcd client (etcd often has its own PKI).
``HILUM_GRPC_KEEPALIVE_S``  seconds between HTTP/2 keepalive pings on every connection, also while idle
                            (default 5).
``HILUM_GRPC_KEEPALIVE_TIMEOUT_S``  seconds a ping may go unanswered before the connection is closed and
                            its calls fail with ``UNAVAILABLE`` (default 5).
==========================  ==================================================================================

Keepalive: both ends ping (a client its server, a server its clients), so a peer that stops answering
without closing its connections — a host that froze or lost power, a SIGSTOPped process, a cable pulled —
is noticed within ``HILUM_GRPC_KEEPALIVE_S + HILUM_GRPC_KEEPALIVE_TIMEOUT_S`` (10 s by default) rather than
when TCP gives up (minutes): a WatchLoad stream breaks (the domain scheduler stops routing to the instance,
the gateway resumes its requests elsewhere), a unary call fails. Servers accept pings as often as every half
interval, so clients are never sent away for pinging too much.

Certificates must name the host part of the addresses processes use to reach each other (a SAN of the
``--advertise`` host). Errors name the variable and the file.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = [
    "WILDCARD_HOSTS",
    "Keepalive",
    "ListenError",
    "TlsError",
    "TlsFiles",
    "add_port",
    "advertised_address",
    "bind_refusal",
    "bind_server",
    "etcd_tls_args",
    "grpc_tls",
    "keepalive",
    "listen_failure",
    "new_server",
    "open_channel",
]

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")  # listen hosts that bind every interface


class TlsError(ValueError):
    """The TLS environment is inconsistent or names a file that cannot be read."""


@dataclass(frozen=True, slots=True)
class Keepalive:
    """HTTP/2 keepalive of every connection: ping every ``time_s``, give up after ``timeout_s`` without an answer.

    A silently dead peer is noticed within ``bound_s`` = ``time_s + timeout_s``.
    """

    time_s: float = 5.0
    timeout_s: float = 5.0

    @property
    def bound_s(self) -> float:
        """Seconds within which a peer that stopped answering is noticed."""
        return self.time_s + self.timeout_s

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC channel arguments of a client."""
        return [
            ("grpc.keepalive_time_ms", round(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(self.timeout_s * 1000)),
            # gRPC core (1.85) waits for any ping's answer this long, the keepalive's too (default 60 s)
            ("grpc.http2.ping_timeout_ms", round(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging an idle stream (a quiet WatchLoad)
        ]

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC server arguments: ping the clients, and let them ping every half interval."""
        return [
            ("grpc.keepalive_time_ms", round(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(self.timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", round(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", round(self.time_s * 500)),
            ("grpc.http2.min_ping_interval_without_data_ms", round(self.time_s * 500)),
            ("grpc.http2.max_ping_strikes", 0),
        ]


def keepalive(env: Mapping[str, str] | None = None) -> Keepalive:
    """The keepalive settings from ``env`` (default: the process environment).

    Raises:
        ValueError: naming the variable, when a value is not a number of seconds > 0.
    """
    env = os.environ if env is None else env
    values = {}
    for key, name in (("time_s", "HILUM_GRPC_KEEPALIVE_S"), ("timeout_s", "HILUM_GRPC_KEEPALIVE_TIMEOUT_S")):
        raw = env.get(name, "")
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}={raw!r}: need a number of seconds > 0")
        values[key] = value
    return Keepalive(**values)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM contents: the CA bundle, and this process's certificate chain and key (both or neither)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    client_auth: bool = True  # servers require client certificates (mutual TLS)


def _read(env: Mapping[str, str], name: str) -> bytes | None:
    path = env.get(name, "")
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{name}={path}: cannot read: {exc.strerror or exc}") from None


def _files(env: Mapping[str, str], prefix: str) -> TlsFiles | None:
    ca, cert, key = (_read(env, f"{prefix}_{part}") for part in ("CA", "CERT", "KEY"))
    if (cert is None) != (key is None):
        raise TlsError(f"{prefix}_CERT and {prefix}_KEY go together: set both or neither")
    if ca is None:
        if cert is not None:
            raise TlsError(f"{prefix}_CERT is set without {prefix}_CA: set the CA that signs the certificates")
        return None
    auth = env.get(f"{prefix}_CLIENT_AUTH", "1" if cert is not None else "0").strip().lower()
    if auth not in ("0", "1", "true", "false"):
        raise TlsError(f"{prefix}_CLIENT_AUTH={auth!r}: use 1 or 0")
    return TlsFiles(ca, cert, key, client_auth=auth in ("1", "true"))


def grpc_tls(env: Mapping[str, str] | None = None) -> TlsFiles | None:
    """The gRPC TLS settings from ``env`` (default: the process environment); None for plaintext.

    Raises:
        TlsError: a file cannot be read, or the variables are inconsistent.
    """
    return _files(os.environ if env is None else env, "HILUM_TLS")


def etcd_tls_args(env: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Keyword arguments for ``etcd3aio.Etcd3Client`` (``ca_cert``, ``cert_key``, ``cert_chain``); {} for plaintext.

    Raises:
        TlsError: a file cannot be read, or the variables are inconsistent.
    """
    files = _files(os.environ if env is None else env, "HILUM_ETCD")
    if files is None:
        return {}
    args = {"ca_cert": files.ca}
    if files.cert is not None and files.key is not None:
        args |= {"cert_chain": files.cert, "cert_key": files.key}
    return args


def open_channel(address: str, options: Sequence[tuple[str, int | str]] | None = None) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address`` (``host:port``): TLS when ``HILUM_TLS_CA`` is set, else plaintext;
    with keepalive (:func:`keepalive`). ``options`` are added after (and so override) hilum's.

    Raises:
        TlsError: see :func:`grpc_tls`; ValueError: see :func:`keepalive`.
    """
    options = [*keepalive().channel_options(), *(options or ())]
    tls = grpc_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)
    return grpc.aio.secure_channel(address, creds, options=options)


def add_port(server: grpc.aio.Server, listen: str) -> int:
    """Bind ``server`` to ``listen`` (``host:port``, port 0 picks one): TLS when ``HILUM_TLS_CA`` is set.

    Returns the bound port (0 when binding failed, as gRPC reports it).

    Raises:
        TlsError: see :func:`grpc_tls`; also when TLS is on but this process has no certificate.
    """
    tls = grpc_tls()
    if tls is None:
        return server.add_insecure_port(listen)
    if tls.cert is None or tls.key is None:
        raise TlsError("HILUM_TLS_CA is set, so servers need HILUM_TLS_CERT and HILUM_TLS_KEY")
    creds = grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=tls.client_auth
    )
    return server.add_secure_port(listen, creds)


def new_server(options: Sequence[tuple[str, int | str]] = ()) -> grpc.aio.Server:
    """A ``grpc.aio`` server with keepalive (:func:`keepalive`) that cannot share its port: gRPC turns
    SO_REUSEPORT on by default, which lets a second process bind a port already in use and silently take half
    of its connections. With it off, binding a used port fails (``add_port`` returns 0) and the process says so.

    Raises:
        ValueError: see :func:`keepalive`.
    """
    return grpc.aio.server(options=[("grpc.so_reuseport", 0), *keepalive().server_options(), *options])


class ListenError(RuntimeError):
    """An address could not be bound: in use, not an address of this machine, or not permitted. A condition of
    the machine rather than of the configuration, so a daemon exits 1 for it (its service manager restarts it;
    exit 2, a bad option, is not restarted: ``deploy/systemd``)."""


def bind_refusal(address: str, *, reuse_port: bool = False) -> str:
    """Why ``address`` (``host:port``, the host bracketed when IPv6) cannot be bound, as the system says it ("" when
    it can): found by binding a plain TCP socket there and closing it at once (gRPC only reports that binding
    failed, after logging its own line). ``reuse_port``: as a server sharing the port binds (``SO_REUSEPORT``):
    other such listeners of this user do not count, a plain one does."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no use
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind((host, int(port)))
    except (OSError, ValueError) as exc:
        return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).lower()
    return ""


def listen_failure(address: str, what: str = "--listen", reason: str = "") -> str:
    """Why ``address`` cannot be bound, naming ``what`` (the option that gave it): ``reason`` when the caller has
    it, else :func:`bind_refusal`'s; a generic one when a probe binds it after all (the address was freed
    meanwhile)."""
    reason = reason or bind_refusal(address) or "the address is in use or not an address of this machine"
    return f"cannot listen on {address} ({what}): {reason}"


def bind_server(
    listen: str, options: Sequence[tuple[str, int | str]] = (), what: str = "--listen"
) -> tuple[grpc.aio.Server, int]:
    """A new server (:func:`new_server`, with ``options``) bound to ``listen`` (``host:port``; port 0 picks one);
    (server, port).

    Raises:
        ListenError: when the address cannot be bound (in use, not a local address), naming ``what`` (the option
            that gave it) and the system's reason.
        TlsError: see :func:`add_port`.
    """
    refusal = bind_refusal(listen)  # said before gRPC tries, and logs a line (port 0 too: a host not of this machine)
    if refusal:
        raise ListenError(listen_failure(listen, what, refusal))
    server = new_server(options)
    try:
        port = add_port(server, listen)
    except RuntimeError as exc:  # gRPC's "Failed to bind to address ...": the system's reason says more
        raise ListenError(listen_failure(listen, what)) from exc
    if port == 0:
        raise ListenError(listen_failure(listen, what))
    return server, port


def advertised_address(listen: str, port: int, advertise: str = "") -> str:
    """The ``host:port`` a server bound to ``listen`` (on ``port``, the one bound) is reached at by others.

    ``advertise`` when given; else the listen host with the bound port. A listen host that binds every
    interface (``0.0.0.0``, ``::``) names no address another process can reach: it needs ``advertise``.

    Raises:
        ValueError: for a wildcard listen host without ``advertise``, naming both options.
    """
    if advertise:
        return advertise
    host = listen.rpartition(":")[0]
    if host in WILDCARD_HOSTS:
        raise ValueError(
            f"--listen {listen} binds every interface, which is no address others can reach: pass --advertise "
            "HOST:PORT, the address the other processes reach this one at"
        )
    return f"{host}:{port}"
