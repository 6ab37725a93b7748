"""hilum_compiled: the mypyc build of the simulator's hot modules is used by the simulator's entry points only while
it matches its sources, serves only the tree it was built from, never mixes with plain modules, and simulates
exactly as the plain-Python modules do. The compiled side runs in child interpreters (this one is plain Python)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hilum_compiled
from hilum_compiled import MODULES, build_dir, source_of, source_root, stale_sources
from llumlet.engine.types import EngineRequest
from policy.dispatch import DispatchView
from policy.load import InstanceLoad, RequestLoad
from policy.types import PolicyConfig
from sim.traces import TraceRequest

BUILT = not stale_sources(build_dir()) and not os.environ.get(hilum_compiled.PURE_ENV)
needs_build = pytest.mark.skipif(not BUILT, reason="no up-to-date build in this environment (make compiled)")

# A small run that migrates inside and across domains, drains, preempts: its records, hashed.
RUN = """
import dataclasses, hashlib, sys
import hilum_compiled
hilum_compiled.install()
import sim.cluster
from sim.runner import DEFAULTS, run_simulation
digest = hashlib.sha256()
for policy in ("llumnix", "hilum"):
    spec = dataclasses.replace(DEFAULTS, policy=policy, max_requests=700, options={"drain": ("node-0-i3@8",)})
    run = run_simulation(spec)
    digest.update(repr((list(run.requests), run.migrations, run.kv, run.engine_steps)).encode())
print(hilum_compiled.compiled(sim.cluster), digest.hexdigest())
"""


def child(code: str, cwd: Path, **env: str) -> str:
    """The last line ``python -c code`` prints in a fresh interpreter of this environment, run in ``cwd`` (first on
    its ``sys.path``)."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**{k: v for k, v in os.environ.items() if k != hilum_compiled.PURE_ENV}, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return out.stdout.strip().splitlines()[-1]


@needs_build
def test_hilum_sim_runs_the_compiled_modules_when_built() -> None:
    code = (
        "import contextlib, importlib, io, hilum_compiled\n"
        "from hilum_cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['sim', '--max-requests', '40', '--policy', 'hilum', '--json'])\n"
        f"print(all(hilum_compiled.compiled(importlib.import_module(m)) for m in {MODULES!r}),\n"
        "      hilum_compiled.compiled(importlib.import_module('sim.runner')), hilum_compiled.status())"
    )
    assert child(code, source_root()).startswith("True False compiled: ")


@needs_build
def test_no_mixing_with_modules_already_imported_as_plain_python() -> None:
    code = "import sim.cluster, hilum_compiled; print(hilum_compiled.install(), hilum_compiled.status())"
    installed, status = child(code, source_root()).split(" ", 1)
    assert (
        installed == "False"
        and status.startswith("pure Python: ")
        and status.endswith("already imported as plain Python")
    )
    assert "sim.cluster" in status and "llumlet.engine.core" in status  # and what sim.cluster imported


EVERY_MODULE = """
import importlib, pkgutil, hilum_compiled
assert hilum_compiled.install(), hilum_compiled.status()
imported = 0
packages = ("gateway", "global_coord", "hilum_cli", "hilum_config", "llumlet", "policy", "rack_sched", "sim")
for package in (*packages, "topology"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as err:  # an optional package (vLLM) not installed here
            assert "vllm" in str(err).lower(), (info.name, err)
            continue
        imported += 1
print(imported)
"""


@needs_build
def test_every_module_imports_beside_the_compiled_ones() -> None:
    """A Python class cannot inherit from a compiled one (TypeError at import): every module of the project imports
    while the compiled modules are in use (those needing an optional package that is missing aside)."""
    assert int(child(EVERY_MODULE, source_root())) > 80


def fake_build(tmp_path: Path) -> Path:
    """A build folder whose manifest names copies of the sources (under tmp_path/src) and empty extension files."""
    out = tmp_path / "build"
    modules = {}
    for name in MODULES:
        copy = source_of(name, tmp_path / "src")
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_of(name), copy)
        so = f"{name}.so"
        (out / so).parent.mkdir(parents=True, exist_ok=True)
        (out / so).write_bytes(b"")
        modules[name] = {"source": str(copy), "sha256": hilum_compiled.sha256_of(copy), "so": so}
    manifest = {"cache_tag": sys.implementation.cache_tag, "group_so": "group.so", "modules": modules}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_an_edited_source_another_interpreter_or_no_build_turn_the_build_off(tmp_path: Path) -> None:
    out = fake_build(tmp_path)
    assert stale_sources(out) == []
    edited = source_of("sim.cluster", tmp_path / "src")
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert stale_sources(out) == [f"{edited} changed since the build"]
    edited.unlink()
    assert stale_sources(out) == [f"{edited} is missing"]

    out = fake_build(tmp_path / "again")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["cache_tag"] = "cpython-39"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert stale_sources(out) == [f"built for cpython-39, this interpreter is {sys.implementation.cache_tag}"]

    assert stale_sources(tmp_path / "nowhere")[0].startswith(f"no usable build in {tmp_path / 'nowhere'}")
    assert not hilum_compiled.install(tmp_path / "nowhere")  # never raises: plain Python
    assert hilum_compiled.status().startswith("pure Python: ")


def test_hilum_sim_says_when_a_build_is_there_but_unusable(tmp_path: Path) -> None:
    """A stale build is not used, and ``hilum sim`` says so on stderr (the run is about 2x slower); with no build, or
    with HILUM_PURE_PYTHON set, it says nothing."""
    out = fake_build(tmp_path)
    edited = source_of("sim.cluster", tmp_path / "src")
    edited.write_text(edited.read_text() + "\n# edited\n")
    code = (
        "import contextlib, io, pathlib, hilum_compiled\n"
        "hilum_compiled.build_dir = lambda prefix=None: pathlib.Path({where!r})\n"
        "from hilum_cli.main import main\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
        "    assert main(['sim', '--max-requests', '5', '--policy', 'round-robin']) == 0\n"
        "print(repr([line for line in err.getvalue().splitlines() if line.startswith('hilum sim:')]))"
    )
    said = child(code.format(where=str(out)), source_root())
    assert said.startswith("['hilum sim: running as plain Python (pure Python: ")
    assert f"{edited} changed since the build" in said
    assert child(code.format(where=str(tmp_path / "nowhere")), source_root()) == "[]"
    assert child(code.format(where=str(out)), source_root(), **{hilum_compiled.PURE_ENV: "1"}) == "[]"


@needs_build
def test_a_module_from_another_tree_is_not_served_compiled(tmp_path: Path) -> None:
    """A benchmark that puts another checkout first on PYTHONPATH imports that checkout's sources."""
    for package in {name.split(".")[0] for name in MODULES} | {"topology", "hilum_config", "llumlet", "global_coord"}:
        shutil.copytree(source_root() / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import hilum_compiled; hilum_compiled.install(); import sim.cluster; "
        "print(hilum_compiled.compiled(sim.cluster), sim.cluster.__file__)"
    )
    assert child(code, source_root()).startswith("True ")
    other = tmp_path / "other"
    other.mkdir()
    assert child(code, other, PYTHONPATH=str(tmp_path)) == f"False {tmp_path / 'sim' / 'cluster.py'}"
    status = subprocess.run(
        [sys.executable, "-m", "hilum_compiled", "status"],
        cwd=other,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert status.returncode == 1  # says what `hilum sim` run from there would do
    first = MODULES[0]
    where = source_of(first, tmp_path)
    assert status.stdout.strip() == (
        f"pure Python: {first} would be imported from {where}, not the tree the build was made from"
    )


@needs_build
@pytest.mark.slow
def test_compiled_and_plain_python_simulate_alike() -> None:
    compiled = child(RUN, source_root())
    pure = child(RUN, source_root(), **{hilum_compiled.PURE_ENV: "1"})
    assert compiled.split()[0] == "True" and pure.split()[0] == "False"
    assert compiled.split()[1] == pure.split()[1]


# The dataclasses of the compiled modules whose __init__ is written out (``init=False``: compiled, a written-out one
# is a native call, the one dataclasses generates is interpreted), each with the arguments of one value.
WRITTEN_OUT: dict[str, tuple[object, ...]] = {
    "llumlet.engine.blocks._Table": (),
    "llumlet.engine.scheduler.SchedulerRequest": (EngineRequest("r", 4, 2), 0),
    "llumlet.engine.scheduler.ScheduledBatch": ((("r", 4, 0),), (), ()),
    "llumlet.engine.scheduler._BatchBuilder": (64,),
    "sim.cluster.RequestState": (TraceRequest("t-0", 0.0, 4, 2),),
    "sim.cluster.GrowthMark": (-1, 3, 0),
    "policy.load.RequestLoad": ("r", 2),
    "policy.load.InstanceLoad": ("i", 10, 2),
    "policy.dispatch._Target": ("i", 10, 2.0, 1, 0, 8, 10, False),
    "rack_sched.core.DomainRequest": ("r", "", 4, 2),
}


def test_written_out_inits_set_every_field_in_order() -> None:
    """Every such class is listed; its ``__init__`` sets every field (an unset slot raises AttributeError when read),
    and one that takes every field takes them in the order they are declared (as a generated one would)."""
    found = set()
    for name in MODULES:
        for obj in vars(importlib.import_module(name)).values():
            ours = isinstance(obj, type) and obj.__module__ == name and dataclasses.is_dataclass(obj)
            if ours and not obj.__dataclass_params__.init:  # type: ignore[attr-defined]
                found.add(f"{name}.{obj.__qualname__}")
    assert found == set(WRITTEN_OUT)
    for path, args in WRITTEN_OUT.items():
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        value = cls(*args)
        fields = [f.name for f in dataclasses.fields(cls)]
        for field in fields:
            getattr(value, field)  # AttributeError when __init__ left it unset
        params = list(inspect.signature(cls.__init__).parameters)[1:]
        if set(params) == set(fields):  # it takes every field: in their order, and dataclasses.replace works
            assert params == fields, path
            assert dataclasses.replace(value) == value, path
        else:  # it sets the others itself
            assert set(params) < set(fields), (path, params)


@needs_build
def test_compiled_values_are_read_only_and_equal_to_their_plain_python_twins() -> None:
    code = (
        "import hilum_compiled\n"
        "hilum_compiled.install()\n"
        "import dataclasses, policy.load as m\n"
        "load = m.InstanceLoad('i', 10, 2, (m.RequestLoad('r', 2, priority=1),), decode_step_s=0.5)\n"
        "try:\n"
        "    load.used_blocks = 3\n"
        "    print(hilum_compiled.compiled(m), 'writable')\n"
        "except AttributeError:\n"
        "    import copy, pickle\n"
        "    same = pickle.loads(pickle.dumps(load)) == load == copy.deepcopy(load) == copy.copy(load)\n"
        "    print(hilum_compiled.compiled(m), same, repr(dataclasses.replace(load, draining=True)))\n"
    )
    compiled, same, shown = child(code, source_root()).split(" ", 2)
    assert compiled == "True" and same == "True"  # pickled and copied through the constructor
    assert shown == repr(
        dataclasses.replace(
            InstanceLoad("i", 10, 2, (RequestLoad("r", 2, priority=1),), decode_step_s=0.5), draining=True
        )
    )


@needs_build
def test_a_compiled_decision_pickles_and_copies_with_its_reason() -> None:
    code = (
        "import hilum_compiled\n"
        "hilum_compiled.install()\n"
        "import copy, pickle, random\n"
        "import policy.dispatch as m\n"
        "from policy.load import InstanceLoad\n"
        "from policy.types import PolicyConfig\n"
        "view = m.DispatchView([InstanceLoad('a', 100, 30)], PolicyConfig(), random.Random(0))\n"
        "placed, refused = view.pick(10), m.DispatchDecision(None, 'no room', full=True)\n"
        "back = [pickle.loads(pickle.dumps(d)) for d in (placed, refused)]\n"
        "back += [copy.copy(placed), copy.deepcopy(refused)]\n"
        "print(hilum_compiled.compiled(m), back == [placed, refused, placed, refused], repr(back[0]))\n"
    )
    compiled, same, shown = child(code, source_root()).split(" ", 2)
    assert compiled == "True" and same == "True"
    view = DispatchView([InstanceLoad("a", 100, 30)], PolicyConfig(), random.Random(0))
    assert shown == repr(view.pick(10))  # the same reason as plain Python writes


# What a domain's proposal is handed of the other domains: read only if its core reads it. The delivered summaries are
# swapped for none after the iterator is made: a lazy one then reads none. (mypyc builds the whole list of a generator
# expression at once, which made every domain's proposal O(domains), read or not: 4% of a run at 4,096 instances.)
OTHERS = """
import dataclasses, hilum_compiled
if MODE == "compiled":
    hilum_compiled.install()
import sim.runner, sim.schedulers as m
made = []
sim.runner.make_scheduler = lambda name, ctx: made.append(m.make_scheduler(name, ctx)) or made[-1]
sim.runner.run_simulation(dataclasses.replace(sim.runner.DEFAULTS, policy="hilum", max_requests=20))
sched = made[0]
mine, other = sorted(sched.delivered)[:2]
before = len(list(sched._others(mine)))
others = sched._others(mine)
sched.delivered = {mine: sched.delivered[mine], other: ()}
print(hilum_compiled.compiled(m), before, len(list(others)))
"""


@pytest.mark.parametrize("mode", ["plain", pytest.param("compiled", marks=needs_build)])
def test_the_other_domains_summaries_are_read_only_when_a_proposal_reads_them(mode: str) -> None:
    compiled, before, after = child(OTHERS.replace("MODE", repr(mode)), source_root()).split()
    assert (compiled, after) == (str(mode == "compiled"), "0")
    assert int(before) >= 1  # the other domain's summaries, read when they are read


def test_the_compilers_output_goes_to_the_builds_log_and_to_stderr_on_a_failure(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What mypyc and gcc print (a page of notes such as "Treating generator comprehension as list") went to `make
    demo`'s output; it goes to build.log beside the build, and is printed only when the build fails, which leaves
    the previous build as it was. Here the compile step is a stand-in that prints as they do, through the file
    descriptors (gcc runs as a child process), then makes the files or fails."""
    import sysconfig

    import hilum_compiled.build as build

    def compiles(paths: list[str], staging: Path, work: Path, jobs: int) -> None:
        print("policy/load.py:237: warning: Treating generator comprehension as list", flush=True)
        os.write(2, b"gcc: note: a compiler warning\n")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for name in MODULES:
            so = staging / Path(*name.split(".")).with_name(name.rsplit(".", 1)[-1] + suffix)
            so.parent.mkdir(parents=True, exist_ok=True)
            so.write_bytes(b"")
        (staging / f"{hilum_compiled.GROUP}__mypyc{suffix}").write_bytes(b"")

    def fails(paths: list[str], staging: Path, work: Path, jobs: int) -> None:
        os.write(2, b"x.c:1: error: broken\n")
        raise SystemExit("error: command 'gcc' failed with exit code 1")

    out = tmp_path / "built"
    monkeypatch.setattr(build, "_compile", compiles)
    assert build.build(out=out) == out
    printed = capfd.readouterr()
    notes = f"(the compilers' notes: {out}/build.log)"
    assert printed.out == f"hilum_compiled: built {len(MODULES)} modules into {out} {notes}\n"
    assert printed.err == ""
    assert (out / "build.log").read_text() == (
        "policy/load.py:237: warning: Treating generator comprehension as list\ngcc: note: a compiler warning\n"
    )
    assert json.loads((out / "manifest.json").read_text())["modules"].keys() == set(MODULES)

    monkeypatch.setattr(build, "_compile", fails)
    with pytest.raises(RuntimeError, match=r"the build failed \(error: command 'gcc' failed with exit code 1\)"):
        build.build(out=out)
    assert capfd.readouterr().err == "x.c:1: error: broken\n"
    assert (out / "build.log").read_text().startswith("policy/load.py:237")  # the build before is left
