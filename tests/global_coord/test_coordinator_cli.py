"""``python -m global_coord``'s command line: options refused by name before anything starts."""

from __future__ import annotations

import pytest

from global_coord.cli import parse_args

_BASE = ["--etcd", "127.0.0.1:1", "--listen", "127.0.0.1:0"]


def test_an_empty_id_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*_BASE, "--id", ""])
    assert exit_.value.code == 2
    assert "error: --id: must not be empty" in capsys.readouterr().err


def test_a_named_replica_parses() -> None:
    ns = parse_args([*_BASE, "--id", "coord-a"])
    assert (ns.id, ns.listen, ns.topology) == ("coord-a", "127.0.0.1:0", None)
