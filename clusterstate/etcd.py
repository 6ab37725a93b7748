"""The etcd client used by the control plane: etcd3aio on grpc.aio, with reconnects tuned for leases.

Only one etcd client library may be imported per process (etcd3aio registers its own copies of the
``etcd/api`` and ``google/api`` descriptors); everything in hilum goes through :func:`connect`.

The two streaming calls, :func:`watch` and :func:`renew_lease`, are hilum's own rather than etcd3aio's
``WatchService.watch`` / ``LeaseService.keep_alive``: those feed the stream from an async generator, and
grpc.aio consumes such a generator in a task that it never cancels when the call fails (grpc/grpc#37355,
still so in grpcio 1.85). Every etcd restart then leaves one pending task per stream, logged later as
"Task was destroyed but it is pending!" and "aclose(): asynchronous generator is already running". Writing
the request on the call itself (grpc.aio's reader/writer style) creates no such task.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end
from etcd3aio._protobuf import Compare, LeaseKeepAliveRequest, WatchCreateRequest, WatchRequest, WatchResponse
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from etcd3aio.watch import WatchService

from clusterstate.endpoints import is_host_port
from hilum_proto.tls import etcd_tls_args

__all__ = [
    "RETRYABLE_ERRORS",
    "Etcd3Client",
    "EtcdError",
    "compare_exists",
    "compare_mod_revision",
    "connect",
    "error_line",
    "kv_of",
    "lease_of",
    "prefix_range_end",
    "renew_lease",
    "watch",
    "watch_of",
]

_log = logging.getLogger(__name__)

# Errors a retry loop treats as "etcd is (temporarily) unreachable or slow".
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (EtcdError, grpc.aio.AioRpcError, TimeoutError, OSError)


def error_line(exc: BaseException) -> str:
    """An etcd client's error in one line, for a log or an error message: a gRPC error's status and details (its
    repr spans lines), else its type and message."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# gRPC's default reconnect backoff grows to 120 s: after an etcd outage longer than a few seconds the
# channel would stay in TRANSIENT_FAILURE long after etcd is back, and every lease would expire. Keep
# reconnect attempts within a fraction of the smallest lease TTL we use.
_RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


def connect(endpoints: list[str], *, watch_max_reconnect_backoff_s: float = 1.0) -> Etcd3Client:
    """Build an etcd client for ``endpoints`` (``host:port`` strings); call ``await client.connect()``.

    TLS to etcd comes from ``HILUM_ETCD_CA`` / ``HILUM_ETCD_CERT`` / ``HILUM_ETCD_KEY`` (:mod:`hilum_proto.tls`).

    Raises:
        ValueError: when ``endpoints`` is empty or an endpoint is not ``host:port``; ``hilum_proto.tls.TlsError``
            (a ValueError) when the TLS variables are inconsistent or name unreadable files.
    """
    if not endpoints:
        raise ValueError("etcd endpoints: need at least one host:port")
    for ep in endpoints:
        if not is_host_port(ep):
            raise ValueError(f"etcd endpoint {ep!r}: expected host:port (port 1-65535)")
    targets, names = _ipv4_targets(endpoints)
    tls = etcd_tls_args()  # HILUM_ETCD_CA / _CERT / _KEY (hilum_proto.tls); plaintext when unset
    client = Etcd3Client(
        targets,
        watch_reconnect_backoff_seconds=0.1,
        watch_max_reconnect_backoff_seconds=watch_max_reconnect_backoff_s,
        ca_cert=tls.get("ca_cert"),
        cert_key=tls.get("cert_key"),
        cert_chain=tls.get("cert_chain"),
        # a name resolved here is still the name the server's certificate holds
        tls_server_name=names[0] if tls and len(names) == 1 else None,
    )
    # etcd3aio 0.3 has no public way to pass channel options; its ConnectionManager keeps them in a list
    # that get_channel() reads at connect(). Fall back to gRPC's defaults (with a warning) if that changes.
    options = getattr(getattr(client, "_manager", None), "grpc_options", None)
    if isinstance(options, list):
        options.extend(_RECONNECT_OPTIONS)
    else:
        _log.warning("etcd3aio changed: cannot shorten gRPC reconnect backoff; long etcd outages may drop leases")
    return client


def _ipv4_targets(endpoints: list[str]) -> tuple[list[str], list[str]]:
    """(the endpoints as ``IPv4:port``, the distinct host names resolved to get them). etcd3aio dials one ``ipv4:``
    target list, so a host name (``etcd-0.internal:2379``) is resolved here, once, to its first IPv4 address;
    ``localhost`` and IPv4 literals pass as they are.

    Raises:
        ValueError: for an IPv6 address (etcd3aio cannot dial one) or a name that resolves to no IPv4 address,
            naming the endpoint.
    """
    targets: list[str] = []
    names: list[str] = []
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        if host == "localhost":
            targets.append(ep)
            continue
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            pass
        else:
            targets.append(ep)
            continue
        if host.startswith("[") or ":" in host:
            raise ValueError(
                f"etcd endpoint {ep!r}: an IPv6 address, which the etcd client (etcd3aio) cannot dial; give an IPv4 "
                "address or a name that resolves to one"
            )
        try:
            infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"etcd endpoint {ep!r}: cannot resolve {host!r} to an IPv4 address ({exc})") from None
        targets.append(f"{infos[0][4][0]}:{port}")
        if host not in names:
            names.append(host)
    return targets, names


_NOT_CONNECTED = "etcd client is not connected: call `await client.connect()` first"


def kv_of(client: Etcd3Client) -> KVService:
    """The client's KV service. Raises ``RuntimeError`` when the client is not connected."""
    if client.kv is None:
        raise RuntimeError(_NOT_CONNECTED)
    return client.kv


def lease_of(client: Etcd3Client) -> LeaseService:
    """The client's Lease service. Raises ``RuntimeError`` when the client is not connected."""
    if client.lease is None:
        raise RuntimeError(_NOT_CONNECTED)
    return client.lease


def watch_of(client: Etcd3Client) -> WatchService:
    """The client's Watch service. Raises ``RuntimeError`` when the client is not connected."""
    if client.watch is None:
        raise RuntimeError(_NOT_CONNECTED)
    return client.watch


def compare_mod_revision(key: str, mod_revision: int) -> Any:
    """etcd Compare: ``key``'s mod revision equals ``mod_revision`` (compare-and-swap on a record)."""
    return Compare(result=Compare.EQUAL, target=Compare.MOD, key=key.encode(), mod_revision=mod_revision)


def compare_exists(key: str) -> Any:
    """etcd Compare: ``key`` exists (its create revision is not 0)."""
    return Compare(result=Compare.NOT_EQUAL, target=Compare.CREATE, key=key.encode(), create_revision=0)


def _stub_and_metadata(service: Any) -> tuple[Any, Any]:
    """The raw gRPC stub and call metadata (auth token) of an etcd3aio service (private in etcd3aio 0.3)."""
    stub, metadata = getattr(service, "_stub", None), getattr(service, "_metadata", ())
    if stub is None:
        raise RuntimeError(f"etcd3aio changed: {type(service).__name__} has no gRPC stub; pin etcd3aio==0.3.0")
    return stub, metadata or None


async def watch(
    client: Etcd3Client, key: str, *, range_end: bytes | None = None, start_revision: int = 0
) -> AsyncGenerator[WatchResponse, None]:
    """One etcd watch stream on ``key`` (or the range ``[key, range_end)``) from ``start_revision``.

    Yields every ``WatchResponse`` (the first one has ``created`` set) until etcd ends the stream. Unlike
    etcd3aio's watch it never reconnects by itself: an etcd error ends the iteration with that error (one
    of :data:`RETRYABLE_ERRORS`), so the caller re-reads what it may have missed and watches again. See the
    module docstring for why it is not etcd3aio's.

    Raises:
        grpc.aio.AioRpcError: when the stream fails (etcd down, restarted, unreachable).
        RuntimeError: when the client is not connected.
    """
    stub, metadata = _stub_and_metadata(watch_of(client))
    call = stub.Watch(metadata=metadata)
    try:
        create = WatchCreateRequest(key=key.encode(), range_end=range_end or b"", start_revision=start_revision)
        await call.write(WatchRequest(create_request=create))
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            yield response
    finally:
        call.cancel()


async def renew_lease(client: Etcd3Client, lease_id: int) -> int:
    """Renew a lease once (one LeaseKeepAlive request and its reply); the TTL etcd reports, seconds.

    A TTL <= 0 means the lease expired or was revoked. Bound it with ``asyncio.timeout``: the call itself
    has no deadline.

    Raises:
        grpc.aio.AioRpcError: when etcd cannot be reached; EOFError when etcd closes the stream unanswered.
        RuntimeError: when the client is not connected.
    """
    stub, metadata = _stub_and_metadata(lease_of(client))
    call = stub.LeaseKeepAlive(metadata=metadata)
    try:
        await call.write(LeaseKeepAliveRequest(ID=lease_id))
        response = await call.read()
        if response is grpc.aio.EOF:
            raise EOFError("lease keep-alive stream closed without a reply")
        return int(response.TTL)
    finally:
        call.cancel()
