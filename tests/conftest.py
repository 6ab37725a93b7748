"""Fixtures shared by the test packages: a real etcd on loopback (see ``etcd_server.py``), one local Ray, and a
real Hugging Face tokenizer trained locally (``bpe_tokenizer.py``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from bpe_tokenizer import build_tokenizer
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


def _reap_failed_ray_start(exc: BaseException) -> None:
    """Stop, and wait for, the processes a ``ray.init`` that raised ``exc`` left running.

    Ray raises from ``ray._private.node.Node.__init__`` when its raylet misses the start-up wait, so no one
    holds that node afterwards: its GCS, raylet and reaper keep running, and their ``Popen`` objects are
    collected later in some test as "subprocess ... is still running" ``ResourceWarning`` s, which this
    suite's ``filterwarnings = error`` turns into a failure there. The node is found in the traceback's
    frames (its ``__init__``'s ``self``); nothing is done if it is not there.
    """
    from ray._private.node import Node

    tb = exc.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            return
        tb = tb.tb_next


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole test session (2 CPUs, no dashboard, no token authentication).

    Starting Ray more than once per process is slow and, on a loaded 2-core machine, can miss Ray's own
    start-up deadline, so every test that needs Ray shares this one.
    """
    ray = pytest.importorskip("ray")
    from sim.sweep import ray_runtime_env  # its workers run the compiled simulator when built, as a sweep's do

    # no token authentication; and 120 s, not 30, for the GCS to write its port file (Ray reads this variable in
    # the process that starts the head: on a loaded 2-core machine the 30 s passed, failing every Ray test)
    settings = {"RAY_AUTH_MODE": "disabled", "RAY_gcs_server_port_wait_time_s": "120"}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=ray_runtime_env())
    except Exception as exc:  # Ray's fixed 30 s wait for its raylet, or the GCS's (ray/_private/node.py): once more
        if not any(words in str(exc) for words in ("timed out during startup", "Timed out waiting for file")):
            raise
        _reap_failed_ray_start(exc)
        ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=ray_runtime_env())
    try:
        yield
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE saved as a Hugging Face tokenizer directory with a chat template (no download)."""
    pytest.importorskip("transformers")
    return build_tokenizer(tmp_path_factory.mktemp("bpe-tokenizer"))
