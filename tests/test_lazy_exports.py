"""Packages that re-export their submodules' names do so lazily (PEP 562) and completely."""

from __future__ import annotations

import importlib
import types

import pytest

LAZY_PACKAGES = ("gateway", "topology")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_exported_name_resolves_to_its_submodules_object(package: str) -> None:
    pkg = importlib.import_module(package)
    exports: dict[str, str] = pkg._EXPORTS
    assert sorted(exports) == sorted(pkg.__all__)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        assert value is getattr(importlib.import_module(exports[name]), name), name
        assert name in dir(pkg)
    star: dict[str, object] = {}
    exec(f"from {package} import *", star)  # the names `from package import *` binds
    assert set(star) - {"__builtins__"} == set(pkg.__all__)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_an_unknown_name_is_an_attribute_error(package: str) -> None:
    pkg = importlib.import_module(package)
    assert isinstance(pkg, types.ModuleType)
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'NoSuchName'"):
        _ = pkg.NoSuchName
