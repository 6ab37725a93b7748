"""Every YAML file hilum is given (topology, configuration, sweep, API keys) is read by one reader
(``topology.load.read_yaml_file``), so a file it cannot read is named the same way whichever it is."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.apikeys import load_api_keys
from hilum_config import ConfigError, load_config
from sim.sweep import SweepConfigError, load_sweep_config
from topology.load import TopologyError, YamlFileError, load_topology, read_yaml_file


def _errors(load: Callable[[Path], object], path: Path) -> list[str]:
    with pytest.raises(ValueError) as exc:
        load(path)
    if isinstance(exc.value, (TopologyError, ConfigError, SweepConfigError)):
        return exc.value.errors  # their text leads with how the file was given (--config FILE: ...)
    return str(exc.value).splitlines()


@pytest.mark.parametrize(
    ("load", "what"),
    [
        (load_topology, "topology"),
        (load_config, "configuration"),
        (load_sweep_config, "sweep"),
        (load_api_keys, "API key"),
    ],
)
def test_each_file_kind_names_a_file_it_cannot_read_the_same_way(
    load: Callable[[Path], object], what: str, tmp_path: Path
) -> None:
    unreadable = tmp_path / "folder.yaml"
    unreadable.mkdir()
    if load is not load_topology:  # a folder: the topology reader names it first, then its bundled names
        assert _errors(load, unreadable) == [f"{unreadable}: (file): cannot read the {what} file: Is a directory"]
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: caf\xe9\n")
    assert _errors(load, latin) == [f"{latin}: (file): not UTF-8 text (byte 0xe9 at offset 9); save it as UTF-8"]
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    assert _errors(load, broken) == [
        f"{broken}: line 2, column 1: YAML syntax error: expected ',' or ']', but got '<stream end>'"
    ]


def test_read_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text("a: {b: 1e9, c: yes}\n")
    assert read_yaml_file(path, "the file") == {"a": {"b": 1e9, "c": "yes"}}  # YAML 1.2: a number, a string
    path.write_text("")
    assert read_yaml_file(path, "the file") is None
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(YamlFileError) as exc:
        read_yaml_file(path, "the file")
    assert (exc.value.place, exc.value.problem) == (
        "line 2, column 1",
        "YAML syntax error: duplicate key 'a' (first at line 1); keys must be unique",
    )
    with pytest.raises(YamlFileError, match=r"^\(file\): cannot read the file: No such file or directory$"):
        read_yaml_file(tmp_path / "none.yaml", "the file")
