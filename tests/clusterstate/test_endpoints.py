"""The ``--etcd HOST:PORT,...`` lists: one rule (``clusterstate.endpoints``) in every process that takes them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterstate.endpoints import endpoints_option, parse_endpoints

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("127.0.0.1:2379", ["127.0.0.1:2379"]), (" a:1 , b:2 ", ["a:1", "b:2"]), ("[::1]:2379", ["[::1]:2379"])],
)
def test_parse_endpoints_splits_and_strips(text: str, parsed: list[str]) -> None:
    assert parse_endpoints(text) == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--etcd: expected HOST:PORT, got ''"),
        (" , ", "--etcd: expected HOST:PORT, got ' , '"),
        ("a:1,,b:2", "--etcd: entry 2 of 'a:1,,b:2' is empty: drop the extra comma"),  # was dropped silently
        ("a:1,", "--etcd: entry 2 of 'a:1,' is empty: drop the extra comma"),
        ("a", "--etcd: 'a' is not HOST:PORT (port 1-65535)"),
        ("a:0", "--etcd: 'a:0' is not HOST:PORT (port 1-65535)"),
        ("a:65536", "--etcd: 'a:65536' is not HOST:PORT (port 1-65535)"),
        (":2379", "--etcd: ':2379' is not HOST:PORT (port 1-65535)"),
    ],
)
def test_parse_endpoints_refuses_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_endpoints(text)
    assert str(exc.value) == message


def test_endpoints_option_keeps_the_text_and_leaves_the_flag_to_argparse() -> None:
    assert endpoints_option("a:1,b:2") == "a:1,b:2"
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        endpoints_option("a:1,,b:2")
    assert str(exc.value) == "entry 2 of 'a:1,,b:2' is empty: drop the extra comma"


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("global_coord", ["--listen", "127.0.0.1:0"]),
        ("gateway", ["--listen", "127.0.0.1:0"]),
        ("rack_sched", ["--listen", "127.0.0.1:0", "--domain", "node-0"]),
        ("llumlet", ["--instance-id", "node-0-i0"]),
    ],
)
def test_every_process_refuses_an_empty_etcd_entry_before_it_starts(module: str, args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--etcd", "127.0.0.1:2379,,127.0.0.1:2380", "--topology", "2x8-a100", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"python -m {module}: error: argument --etcd: entry 2 of '127.0.0.1:2379,,127.0.0.1:2380' is empty: "
        "drop the extra comma"
    )
