"""Regenerate the Python code for hilum's ``.proto`` contracts.

Usage (from anywhere)::

    python -m hilum_proto.generate            # rewrite the committed modules in hilum_proto/v1/
    python -m hilum_proto.generate --out DIR  # write them under DIR instead (the staleness test does this)

The contracts are language-neutral: they live in the top-level ``proto/`` folder as
``proto/hilum/v1/<name>.proto`` (package ``hilum.v1``), import each other as ``"hilum/v1/<name>.proto"`` and
name no Python package. They are compiled with ``proto/`` as the only include path, so their descriptors are
named ``hilum/v1/<name>.proto`` and never clash with the descriptors other libraries register (etcd3aio
registers ``etcd/api/...`` and ``google/api/...``).

protoc writes Python modules that import each other as ``hilum.v1``; the generated code lives in the package
``hilum_proto.v1`` instead, so this script rewrites those import statements (and the stubs' qualified
names) after protoc has run, and nothing else. Outputs, per source:

- ``<name>_pb2.py`` (``--python_out``: messages) and ``<name>_pb2_grpc.py`` (``--grpc_python_out``),
- ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.pyi`` from mypy-protobuf (``--mypy_out``, ``--mypy_grpc_out``):
  type stubs that pass ``mypy --strict`` (protoc's own ``--pyi_out`` stubs do not: bare ``Mapping``), so
  strict mypy type-checks every caller, including ``grpc.aio`` stubs and servicers.

Needs grpcio-tools (same version as grpcio) and mypy-protobuf installed in the running interpreter's
environment. Raises ``RuntimeError`` when protoc fails, with protoc's message.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["OUT_DIR", "PROTO_ROOT", "REPO_ROOT", "generate", "generated_files", "proto_files"]

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"  # the include root: sources are PROTO_ROOT / "hilum/v1/<name>.proto"
_PROTO_PACKAGE_DIR = Path("hilum") / "v1"
OUT_DIR = REPO_ROOT / "hilum_proto" / "v1"  # the generated package, hilum_proto.v1
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
# protoc's module path for the contracts, and the package the generated code lives in
_IMPORT_LINE = re.compile(r"^(from|import) hilum\.v1\b", flags=re.MULTILINE)
_QUALIFIED = re.compile(r"\bhilum\.v1\.(\w+_pb2)\b")
_MODULE_NAME = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'hilum\.v1\.")


def proto_files() -> list[Path]:
    """The ``.proto`` sources, sorted by name."""
    return sorted((PROTO_ROOT / _PROTO_PACKAGE_DIR).glob("*.proto"))


def generated_files(out_dir: Path = OUT_DIR) -> list[Path]:
    """The paths the generator writes in ``out_dir`` (one per source and suffix), sorted."""
    return sorted(out_dir / f"{p.stem}{suffix}" for p in proto_files() for suffix in _SUFFIXES)


def _plugin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: install mypy-protobuf into this environment")
    return found


def _relocate(text: str, stub: bool) -> str:
    """Point protoc's ``hilum.v1`` imports at ``hilum_proto.v1``.

    In ``.py`` modules only import statements and the module name given to the message builder change (the
    serialized descriptors inside must not); in ``.pyi`` stubs the qualified type names too.
    """
    text = _IMPORT_LINE.sub(lambda m: f"{m.group(1)} hilum_proto.v1", text)
    text = _MODULE_NAME.sub(r"\1'hilum_proto.v1.", text)  # the message classes' __module__
    if stub:
        text = _QUALIFIED.sub(r"hilum_proto.v1.\1", text)
    return text


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Compile every ``.proto`` source; write the modules into ``out_dir`` (the package ``hilum_proto.v1``).

    Returns:
        The generated file paths, sorted.

    Raises:
        RuntimeError: when protoc reports an error or the mypy plugins are missing.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hilum-protoc-") as tmp:
        raw = Path(tmp)
        args = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",  # adds the well-known-types include path itself
            f"-I{PROTO_ROOT}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--mypy_out={raw}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_grpc_out={raw}",
            *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),  # descriptors "hilum/v1/<name>.proto"
        ]
        proc = subprocess.run(args, capture_output=True, text=True, check=False, cwd=PROTO_ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"protoc failed (exit {proc.returncode}): {proc.stderr.strip()}")
        for target in generated_files(out_dir):
            source = raw / _PROTO_PACKAGE_DIR / target.name
            target.write_text(_relocate(source.read_text(), stub=target.suffix == ".pyi"))
    return generated_files(out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry: ``python -m hilum_proto.generate [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m hilum_proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="directory to write into (default: hilum_proto/v1)")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
