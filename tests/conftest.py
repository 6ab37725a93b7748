"""Fixtures shared by the test packages: a real etcd on loopback (see ``etcd_server.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import EtcdServer


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd shared by the tests that never stop it; isolate with :func:`prefix`."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_private(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd for a test that stops, restarts or compacts it."""
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix of its own for each test on the shared etcd."""
    return f"/t-{uuid.uuid4().hex[:8]}/"
