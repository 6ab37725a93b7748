"""``python -m global_coord``'s command line: options refused by name before anything starts."""

from __future__ import annotations

import pytest

from global_coord.cli import parse_args

_BASE = ["--etcd", "127.0.0.1:1", "--listen", "127.0.0.1:0"]


@pytest.mark.parametrize("replica", ["", " ", "coord a", "c\t0"])
def test_an_empty_id_or_one_with_spaces_is_refused_by_name(replica: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*_BASE, "--id", replica])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(f"error: --id {replica!r}: the replica's name among coordinators, not empty and without spaces")


def test_a_named_replica_parses() -> None:
    ns = parse_args([*_BASE, "--id", "coord-a"])
    assert (ns.id, ns.listen, ns.topology) == ("coord-a", "127.0.0.1:0", None)
