"""Regenerate the Python code for hilum's ``.proto`` files.

Usage (from anywhere)::

    python -m hilum_proto.generate            # rewrite the committed files next to the .proto files
    python -m hilum_proto.generate --out DIR  # write the tree under DIR instead (the staleness test does this)

The ``.proto`` files live in ``hilum_proto/hilum/v1/`` and are compiled with the repository root as the only
include path (``-I .``), so their descriptors are named ``hilum_proto/hilum/v1/<name>.proto`` (package
``hilum.v1``) and never clash with the descriptors other libraries register (etcd3aio registers
``etcd/api/...`` and ``google/api/...``). Outputs, per file:

- ``<name>_pb2.py`` (``--python_out``: messages) and ``<name>_pb2_grpc.py`` (``--grpc_python_out``),
- ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.pyi`` from mypy-protobuf (``--mypy_out``, ``--mypy_grpc_out``):
  type stubs that pass ``mypy --strict`` (protoc's own ``--pyi_out`` stubs do not: bare ``Mapping``), so
  strict mypy type-checks every caller, including ``grpc.aio`` stubs and servicers.

Needs grpcio-tools (same version as grpcio) and mypy-protobuf installed in the running interpreter's
environment. Raises ``RuntimeError`` when protoc fails, with protoc's message.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PROTO_DIR", "REPO_ROOT", "generate", "generated_files", "proto_files"]

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "hilum_proto" / "hilum" / "v1"
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    """The ``.proto`` sources, sorted by name."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_files(root: Path = REPO_ROOT) -> list[Path]:
    """The paths the generator writes under ``root`` (one per source and suffix), sorted."""
    rel = PROTO_DIR.relative_to(REPO_ROOT)
    return sorted(root / rel / f"{p.stem}{suffix}" for p in proto_files() for suffix in _SUFFIXES)


def _plugin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: install mypy-protobuf into this environment")
    return found


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compile every ``.proto`` file; write the outputs under ``out_dir`` (mirroring ``hilum_proto/hilum/v1``).

    Returns:
        The generated file paths, sorted.

    Raises:
        RuntimeError: when protoc reports an error or the mypy_grpc plugin is missing.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(p) for p in proto_files()]
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",  # adds the well-known-types include path itself
        f"-I{REPO_ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--mypy_out={out_dir}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--mypy_grpc_out={out_dir}",
        *sources,  # absolute paths under the -I root, so descriptors are "hilum_proto/hilum/v1/<name>.proto"
    ]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"protoc failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return generated_files(out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry: ``python -m hilum_proto.generate [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m hilum_proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write under (default: repo)")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
