"""Real-etcd fixtures for the domain-scheduler tests: reused from ``tests/global_coord/conftest.py``.

The fixtures (``etcd``, ``etcd_private``, ``prefix``) are defined once, in the global_coord tests; they are
moving to ``tests/conftest.py`` (same names), which serves every test package. Until then this file loads
them from their current place; once that file is gone, it defines nothing and ``tests/conftest.py`` serves.

The global_coord tests import ``EtcdServer`` and ``free_port`` with ``from conftest import ...``, and pytest
registers every ``conftest.py`` of a test directory without ``__init__.py`` under the module name
``conftest``: so this file re-exports those two names too, whichever conftest is loaded last.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SOURCE = Path(__file__).resolve().parent.parent / "global_coord" / "conftest.py"

if _SOURCE.exists():
    _spec = importlib.util.spec_from_file_location("_global_coord_fixtures", _SOURCE)
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    etcd = _module.etcd
    etcd_private = _module.etcd_private
    prefix = _module.prefix
    EtcdServer = _module.EtcdServer
    free_port = _module.free_port
