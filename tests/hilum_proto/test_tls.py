"""TLS between hilum's processes and to etcd, from the HILUM_TLS_* / HILUM_ETCD_* environment."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from etcd_server import ETCD_BIN, free_port

from clusterstate.etcd import connect, kv_of
from hilum_proto.tls import TlsError, etcd_tls_args, grpc_tls
from hilum_proto.v1 import llumlet_pb2, llumlet_pb2_grpc
from llumlet.client import LlumletClient
from llumlet.procs import LlumletProcess


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and one certificate for 127.0.0.1 / localhost, made with the openssl command."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=hilum-test-ca", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
             "-subj", "/CN=localhost", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "2", "-extfile", "san.ext", cwd=d)  # fmt: skip
    return d


def test_environment_parsing_and_errors(tmp_path: Path) -> None:
    assert grpc_tls({}) is None and etcd_tls_args({}) == {}
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"CA")
    assert grpc_tls({"HILUM_TLS_CA": str(ca)}) is not None
    assert etcd_tls_args({"HILUM_ETCD_CA": str(ca)}) == {"ca_cert": b"CA"}
    with pytest.raises(TlsError, match="HILUM_TLS_CERT and HILUM_TLS_KEY go together"):
        grpc_tls({"HILUM_TLS_CA": str(ca), "HILUM_TLS_CERT": str(ca)})
    with pytest.raises(TlsError, match=r"HILUM_TLS_CA=/nowhere/ca.pem: cannot read"):
        grpc_tls({"HILUM_TLS_CA": "/nowhere/ca.pem"})
    with pytest.raises(TlsError, match="without HILUM_ETCD_CA"):
        etcd_tls_args({"HILUM_ETCD_CERT": str(ca), "HILUM_ETCD_KEY": str(ca)})


def test_a_llumlet_serves_tls_and_refuses_plaintext_and_certless_clients(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HILUM_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("HILUM_TLS_CERT", str(pki / "node.pem"))
    monkeypatch.setenv("HILUM_TLS_KEY", str(pki / "node.key"))
    proc = LlumletProcess("node-0-i0", ["--topology", "1x8-a100"], tmp_path / "llumlet.log").start()
    host_port = proc.address

    async def calls() -> None:
        client = LlumletClient(host_port)  # TLS from the environment, with this process's certificate
        try:
            assert (await client.ping()).instance_id == "node-0-i0"
        finally:
            await client.close()
        async with grpc.aio.insecure_channel(host_port) as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await llumlet_pb2_grpc.LlumletStub(plain).Ping(llumlet_pb2.LlumletPingRequest(), timeout=3)
        creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())  # no client cert
        async with grpc.aio.secure_channel(host_port, creds) as certless:
            with pytest.raises(grpc.aio.AioRpcError):
                await llumlet_pb2_grpc.LlumletStub(certless).Ping(llumlet_pb2.LlumletPingRequest(), timeout=3)

    try:
        asyncio.run(calls())
    finally:
        proc.stop()


def test_the_etcd_client_speaks_mutual_tls(pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    cmd = [
        str(ETCD_BIN), "--data-dir", str(tmp_path / "etcd"), "--unsafe-no-fsync",
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"default=http://127.0.0.1:{peer}",
        "--cert-file", str(pki / "node.pem"), "--key-file", str(pki / "node.key"),
        "--trusted-ca-file", str(pki / "ca.pem"), "--client-cert-auth",
    ]  # fmt: skip
    with (tmp_path / "etcd.log").open("w") as log:
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    monkeypatch.setenv("HILUM_ETCD_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("HILUM_ETCD_CERT", str(pki / "node.pem"))
    monkeypatch.setenv("HILUM_ETCD_KEY", str(pki / "node.key"))

    async def roundtrip() -> bytes:
        client = connect([f"127.0.0.1:{port}"])
        await client.connect()
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    await kv_of(client).put("/tls-test", b"ok")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            reply = await kv_of(client).get("/tls-test")
            return bytes(reply.kvs[0].value)
        finally:
            await client.close()

    try:
        assert asyncio.run(roundtrip()) == b"ok"
    finally:
        server.terminate()
        server.wait()
