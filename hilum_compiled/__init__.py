"""The simulator's hot modules compiled with mypyc, used only while they match their sources.

hilum is pure Python, and every module runs as such. For speed, ``make`` (``python -m hilum_compiled build``)
also compiles the modules the simulator spends its time in (:data:`MODULES`: the engine model, the cluster
and its event queue, the load reports, the rule book's dispatch and migration rules and summaries, the domain
and gateway cores) with mypyc, the compiler that ships with mypy, which turns type-annotated Python into a C
extension. The project is checked with ``mypy --strict``, so its annotations are what mypyc needs. The compiled
modules compute exactly what the sources do (``make test`` runs the simulator's record-for-record equality tests
both ways).

The build goes to ``<sys.prefix>/hilum-compiled/`` (inside the virtual environment, never beside the sources),
with a manifest of each source's SHA-256. The simulator's entry points (``hilum sim``, its ``sweep`` and ``size``,
and the benchmarks under ``bench/``) call :func:`install` before they import anything it compiles; everything
else (the live services of ``hilum up``, the test suite in-process) runs as plain Python. :func:`install` puts a
finder in front of the import system that loads the compiled modules, and only when

- ``HILUM_PURE_PYTHON`` is unset or empty (set it to run everything as plain Python),
- the build is for this interpreter (its ``cache_tag``), and
- every compiled module's source is byte for byte the one it was built from, and is the one this interpreter
  would import (a module imported from another checkout, e.g. a benchmark's ``PYTHONPATH``, is not served), and
- none of them was imported as plain Python already (the compiled modules call each other directly: no mixing).

Otherwise nothing is compiled in, and :func:`status` says why (``python -m hilum_compiled status``); an edited
source turns the whole build off at once (the compiled modules call each other directly, so they go together)
until ``make`` builds again. This module imports nothing but the standard library and never raises at start-up.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "GROUP",
    "MODULES",
    "PURE_ENV",
    "build_dir",
    "compiled",
    "install",
    "read_manifest",
    "refused_build",
    "sha256_of",
    "source_of",
    "source_root",
    "stale_sources",
    "status",
]

#: The modules compiled (each ``package.module``, a ``.py`` file under the source root): where the simulator's
#: time goes (``bench/profile_sim.py``). A module is listed only if mypyc compiles it with no change in what
#: it computes. Modules of value types that other code introspects stay Python: the etcd records' codec and the
#: configuration loader read type hints, and mypyc keeps only their outer class (``tuple[InstanceBrief, ...]``
#: becomes ``tuple``), so ``policy.types``, ``policy.domain`` and ``policy.remaining`` are not compiled (the
#: summaries are made in ``policy.summarize``, which is). ``PagedEngine``, which the torch engine subclasses in
#: Python, is compiled with ``mypyc_attr(allow_interpreted_subclasses=True)``.
MODULES: tuple[str, ...] = (
    "llumlet.engine.blocks",
    "llumlet.engine.paged",
    "llumlet.engine.core",
    "llumlet.engine.scheduler",
    "llumlet.engine.latency",
    "sim.cluster",
    "sim.events",
    "policy.load",
    "policy.usage",
    "policy.dispatch",
    "policy.migration",
    "policy.summarize",
    "rack_sched.core",
    "gateway.core",
    "sim.schedulers",
    "rack_sched.plan",
)

#: mypyc's shared library of the group: every compiled module's code (``GROUP + "__mypyc"``, a top-level module).
GROUP = "hilum_native"

#: Set to a non-empty value to run every module as plain Python.
PURE_ENV = "HILUM_PURE_PYTHON"

_MANIFEST = "manifest.json"
_status = "pure Python: hilum_compiled.install() was not called"
_refused_build = False  # the last install() found a build directory and could not use it


def source_root() -> Path:
    """The folder holding hilum's packages (the one above this package)."""
    return Path(__file__).resolve().parent.parent


def build_dir(prefix: str | None = None) -> Path:
    """Where the build of the environment at ``prefix`` (default ``sys.prefix``) lives."""
    return Path(prefix or sys.prefix) / "hilum-compiled"


def source_of(module: str, root: Path | None = None) -> Path:
    """The ``.py`` file of ``module`` under ``root`` (default :func:`source_root`)."""
    return (root or source_root()).joinpath(*module.split(".")).with_suffix(".py")


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file's bytes. Raises OSError when it cannot be read."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(directory: Path) -> dict[str, object]:
    """The manifest of the build in ``directory``. Raises OSError or ValueError when it is missing or unreadable."""
    manifest = json.loads((directory / _MANIFEST).read_text())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("modules"), dict):
        raise ValueError(f"{directory / _MANIFEST}: not a hilum_compiled manifest")
    return manifest


def stale_sources(directory: Path) -> list[str]:
    """Why the build in ``directory`` cannot be used as it is: one line per problem (a source changed or missing,
    another interpreter, another module list), empty when it can. Raises nothing."""
    try:
        return _problems(directory, read_manifest(directory))
    except (OSError, ValueError) as err:
        return [f"no usable build in {directory} ({err.__class__.__name__}: {err})"]


def _problems(directory: Path, manifest: dict[str, object]) -> list[str]:
    """:func:`stale_sources` of the build in ``directory`` whose manifest is ``manifest``."""
    problems = []
    if manifest.get("cache_tag") != sys.implementation.cache_tag:
        problems.append(f"built for {manifest.get('cache_tag')}, this interpreter is {sys.implementation.cache_tag}")
    modules = manifest["modules"]
    assert isinstance(modules, dict)
    if sorted(modules) != sorted(MODULES):
        problems.append("built from another module list")
    for entry in modules.values():
        source = Path(entry["source"])
        try:
            if sha256_of(source) != entry["sha256"]:
                problems.append(f"{source} changed since the build")
        except OSError:
            problems.append(f"{source} is missing")
        if not (directory / entry["so"]).is_file():
            problems.append(f"{directory / entry['so']} is missing")
    return problems


class _Finder(importlib.abc.MetaPathFinder):
    """Serves each compiled module from its extension file, when the module would come from the sources built."""

    def __init__(self, extensions: dict[str, tuple[Path, Path | None]]) -> None:
        self._extensions = extensions  # module -> (its extension file, the folder its source is in: None for GROUP)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        entry = self._extensions.get(fullname)
        if entry is None:
            return None
        extension, folder = entry
        if folder is not None and (path is None or str(folder) not in path):
            return None  # its package comes from another tree: that tree's own source is imported
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(extension))
        return importlib.util.spec_from_file_location(fullname, extension, loader=loader)


def install(directory: Path | None = None) -> bool:
    """Load the compiled modules from now on, if the build in ``directory`` (default :func:`build_dir`) matches
    its sources (see the module docstring). True when installed; :func:`status` says what happened. Call it
    before any compiled module is imported (the simulator's entry points do). Never raises."""
    global _status, _refused_build
    _refused_build = False
    try:
        if os.environ.get(PURE_ENV):
            _status = f"pure Python: {PURE_ENV} is set"
            return False
        imported = sorted(name for name in MODULES if name in sys.modules and not compiled(sys.modules[name]))
        if imported:
            _status = f"pure Python: {', '.join(imported)} already imported as plain Python"
            return False
        directory = directory or build_dir()
        try:
            manifest = read_manifest(directory)
            problems = _problems(directory, manifest)
        except (OSError, ValueError) as err:
            problems = [f"no usable build in {directory} ({err.__class__.__name__}: {err})"]
        if problems:
            _status = "pure Python: " + "; ".join(problems)
            _refused_build = directory.exists()
            return False
        modules = manifest["modules"]
        assert isinstance(modules, dict)
        extensions: dict[str, tuple[Path, Path | None]] = {
            name: (directory / entry["so"], Path(entry["source"]).parent) for name, entry in modules.items()
        }
        extensions[f"{GROUP}__mypyc"] = (directory / str(manifest["group_so"]), None)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]  # one build at a time
        sys.meta_path.insert(0, _Finder(extensions))
        _status = f"compiled: {len(modules)} modules from {directory}"
        return True
    except Exception as err:  # start-up must never fail because of an optional build
        _status = f"pure Python: the build could not be read ({err.__class__.__name__}: {err})"
        _refused_build = True
        return False


def status() -> str:
    """What :func:`install` found: ``"compiled: ..."`` or ``"pure Python: <why>"``."""
    return _status


def refused_build() -> bool:
    """True when the last :func:`install` found a build and could not use it (stale, another interpreter's,
    unreadable); False when it installed one, found none, or was not asked to (``HILUM_PURE_PYTHON``, modules
    already imported as plain Python). What a user who ran ``make`` should be told."""
    return _refused_build


def compiled(module: ModuleType) -> bool:
    """True when ``module`` was loaded from a compiled extension (not from its ``.py`` source)."""
    spec = getattr(module, "__spec__", None)
    return spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)
