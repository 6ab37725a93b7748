"""Building the compiled modules (``python -m hilum_compiled build``): mypyc, then the C compiler.

mypyc type-checks :data:`hilum_compiled.MODULES` with the project's own mypy configuration (``pyproject.toml``:
``strict``) and writes C; setuptools' ``build_ext`` compiles it (``-j`` jobs). The result goes to a staging
folder, then replaces :func:`hilum_compiled.build_dir` in one rename, with a manifest of every source's SHA-256.
Needs mypy (the ``test`` extra pins it) and a C compiler with Python's headers; about 4-7 minutes on a 2-core
machine (7 with a cold mypy cache), most of it mypy's analysis and ``gcc -O3``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hilum_compiled import GROUP, MODULES, build_dir, sha256_of, source_of, source_root, stale_sources

__all__ = ["build", "remove"]


def build(jobs: int = 2, *, only_if_stale: bool = False, out: Path | None = None) -> Path:
    """Compile :data:`~hilum_compiled.MODULES` into ``out`` (default :func:`~hilum_compiled.build_dir`).
    ``only_if_stale``: do nothing when the build there matches its sources. Returns ``out``.

    What mypyc and the C compiler print (notes such as "Treating generator comprehension as list", compiler
    warnings) goes to ``build.log`` in ``out``, and on a failure to stderr. Raises RuntimeError when mypyc or the C
    compiler fails; ``out`` is then left as it was.
    """
    out = out or build_dir()
    if only_if_stale and not stale_sources(out):
        print(f"hilum_compiled: {out} is up to date ({len(MODULES)} modules)")
        return out
    root = source_root()
    sources = {m: source_of(m, root) for m in MODULES}
    digests = {m: sha256_of(p) for m, p in sources.items()}  # what is compiled is what is hashed
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hilum-compiled-") as tmp:
        staging, work, log = Path(tmp) / "lib", Path(tmp) / "work", Path(tmp) / "build.log"
        cwd = os.getcwd()
        os.chdir(root)  # mypyc names modules by their paths relative to the current folder
        try:
            with _output_to(log):  # file descriptors 1 and 2: the C compiler's processes print there too
                _compile([str(p.relative_to(root)) for p in sources.values()], staging, work, jobs)
        except (SystemExit, Exception) as err:  # setuptools exits on a compiler error
            sys.stderr.write(log.read_text(errors="replace"))
            raise RuntimeError(f"hilum_compiled: the build failed ({err}); what it printed is above") from err
        finally:
            os.chdir(cwd)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        modules = {}
        for name in MODULES:
            so = Path(*name.split(".")).with_name(name.rsplit(".", 1)[-1] + suffix)
            if not (staging / so).is_file():
                raise RuntimeError(f"hilum_compiled: the build made no {so}")
            modules[name] = {"source": str(sources[name]), "sha256": digests[name], "so": str(so)}
        group_so = f"{GROUP}__mypyc{suffix}"
        if not (staging / group_so).is_file():
            raise RuntimeError(f"hilum_compiled: the build made no {group_so}")
        manifest = {"cache_tag": sys.implementation.cache_tag, "group_so": group_so, "modules": modules}
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.copy(log, staging / "build.log")
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        shutil.move(str(staging), str(out))
        shutil.rmtree(old, ignore_errors=True)
    print(f"hilum_compiled: built {len(MODULES)} modules into {out} (the compilers' notes: {out / 'build.log'})")
    return out


def _compile(paths: list[str], staging: Path, work: Path, jobs: int) -> None:
    """mypyc, then setuptools' ``build_ext`` (``jobs`` compilers at once), of the sources at ``paths`` (relative to
    the current folder) into ``staging``; ``work``: mypyc's C and the objects. Raises SystemExit on a compiler
    error."""
    from mypyc.build import mypycify  # only the build needs mypy
    from setuptools import setup

    extensions = mypycify(paths, opt_level="3", debug_level="0", group_name=GROUP, target_dir=str(work / "c"))
    setup(
        name="hilum-compiled",
        ext_modules=extensions,
        script_args=["--quiet", "build_ext", "--build-lib", str(staging), "--build-temp", str(work), "-j", str(jobs)],
    )


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Send what is printed in the block to ``path``: ``sys.stdout`` and ``sys.stderr``, and file descriptors 1 and 2
    (the C compiler's processes inherit them)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with path.open("w", buffering=1) as log:  # line-buffered: its lines and the children's stay in order
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def remove() -> None:
    """Remove this environment's build (everything runs as plain Python again)."""
    shutil.rmtree(build_dir(), ignore_errors=True)
