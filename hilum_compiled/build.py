"""Building the compiled modules (``python -m hilum_compiled build``): mypyc, then the C compiler.

mypyc type-checks :data:`hilum_compiled.MODULES` with the project's own mypy configuration (``pyproject.toml``:
``strict``) and writes C; setuptools' ``build_ext`` compiles it (``-j`` jobs). The result goes to a staging
folder, then replaces :func:`hilum_compiled.build_dir` in one rename, with a manifest of every source's SHA-256.
Needs mypy (the ``test`` extra pins it) and a C compiler with Python's headers; about 4-7 minutes on a 2-core
machine (7 with a cold mypy cache), most of it mypy's analysis and ``gcc -O3``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from hilum_compiled import GROUP, MODULES, build_dir, sha256_of, source_of, source_root, stale_sources

__all__ = ["build", "remove"]


def build(jobs: int = 2, *, only_if_stale: bool = False, out: Path | None = None) -> Path:
    """Compile :data:`~hilum_compiled.MODULES` into ``out`` (default :func:`~hilum_compiled.build_dir`).
    ``only_if_stale``: do nothing when the build there matches its sources. Returns ``out``.

    Raises RuntimeError when mypyc or the C compiler fails (what they printed is above); ``out`` is then left as
    it was.
    """
    out = out or build_dir()
    if only_if_stale and not stale_sources(out):
        print(f"hilum_compiled: {out} is up to date ({len(MODULES)} modules)")
        return out
    from mypyc.build import mypycify  # only the build needs mypy
    from setuptools import setup

    root = source_root()
    sources = {m: source_of(m, root) for m in MODULES}
    digests = {m: sha256_of(p) for m, p in sources.items()}  # what is compiled is what is hashed
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hilum-compiled-") as tmp:
        staging, work = Path(tmp) / "lib", Path(tmp) / "work"
        cwd = os.getcwd()
        os.chdir(root)  # mypyc names modules by their paths relative to the current folder
        try:
            extensions = mypycify(
                [str(p.relative_to(root)) for p in sources.values()],
                opt_level="3",
                debug_level="0",
                group_name=GROUP,
                target_dir=str(work / "c"),
            )
            setup(
                name="hilum-compiled",
                ext_modules=extensions,
                script_args=[
                    "--quiet",
                    "build_ext",
                    "--build-lib",
                    str(staging),
                    "--build-temp",
                    str(work),
                    "-j",
                    str(jobs),
                ],
            )
        except SystemExit as err:  # setuptools exits on a compiler error
            raise RuntimeError(f"hilum_compiled: the build failed ({err})") from err
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
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        shutil.move(str(staging), str(out))
        shutil.rmtree(old, ignore_errors=True)
    print(f"hilum_compiled: built {len(MODULES)} modules into {out}")
    return out


def remove() -> None:
    """Remove this environment's build (everything runs as plain Python again)."""
    shutil.rmtree(build_dir(), ignore_errors=True)
