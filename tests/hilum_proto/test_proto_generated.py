"""The committed generated code matches the .proto sources, and its descriptors never clash."""

from __future__ import annotations

from pathlib import Path

import hilum_proto
from hilum_proto.generate import OUT_DIR, PROTO_ROOT, REPO_ROOT, generate, generated_files, proto_files


def test_proto_package_is_hilums_own() -> None:
    # proto-plus (pulled in by google-api-core) installs a top-level "proto" package, which is why
    # hilum's contracts live in "hilum_proto"; make sure the import finds this checkout's.
    assert Path(hilum_proto.__file__).resolve().parent == REPO_ROOT / "hilum_proto"


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    committed = generated_files()
    assert [p.relative_to(tmp_path) for p in fresh] == [p.relative_to(OUT_DIR) for p in committed]
    pairs = zip(fresh, committed, strict=True)
    stale = [str(c.relative_to(REPO_ROOT)) for f, c in pairs if f.read_bytes() != c.read_bytes()]
    assert stale == [], f"stale generated code, run `python -m hilum_proto.generate`: {stale}"


def test_every_source_has_four_outputs() -> None:
    names = {p.stem for p in proto_files()}
    assert names == {"coordinator", "llumlet", "rack_sched", "token_sink"}
    assert len(generated_files()) == 4 * len(names)


def test_contracts_live_in_proto_and_name_no_python_package() -> None:
    assert [p.relative_to(PROTO_ROOT).as_posix() for p in proto_files()] == [
        "hilum/v1/coordinator.proto",
        "hilum/v1/llumlet.proto",
        "hilum/v1/rack_sched.proto",
        "hilum/v1/token_sink.proto",
    ]
    for source in proto_files():
        text = source.read_text()
        assert "hilum_proto" not in text, f"{source.name} names the Python package"
        assert "py_package" not in text and "option python" not in text


def test_descriptors_are_named_by_contract_path_next_to_etcd3aio() -> None:
    import etcd3aio  # registers etcd/api/... and google/api/... descriptors in the default pool

    from hilum_proto.v1 import coordinator_pb2, llumlet_pb2, rack_sched_pb2, token_sink_pb2

    assert etcd3aio.__version__
    names = [m.DESCRIPTOR.name for m in (coordinator_pb2, llumlet_pb2, rack_sched_pb2, token_sink_pb2)]
    assert names == [
        "hilum/v1/coordinator.proto",
        "hilum/v1/llumlet.proto",
        "hilum/v1/rack_sched.proto",
        "hilum/v1/token_sink.proto",
    ]
    assert coordinator_pb2.StatusReply.__module__ == "hilum_proto.v1.coordinator_pb2"
    assert coordinator_pb2.DESCRIPTOR.package == "hilum.v1"
    reply = coordinator_pb2.StatusReply(leader_id="c1", fencing_token=42)
    assert coordinator_pb2.StatusReply.FromString(reply.SerializeToString()).fencing_token == 42
