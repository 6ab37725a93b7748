"""The etcd key prefix and the log level on the command line: one rule each (``clusterstate.options``), applied
when every process parses its options, before it starts anything."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterstate.options import DEFAULT_PREFIX, LOG_LEVELS, check_prefix, log_level_option, prefix_option
from clusterstate.store import Keys

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("prefix", [DEFAULT_PREFIX, "/", "/test/a1/"])
def test_check_prefix_accepts(prefix: str) -> None:
    assert check_prefix(prefix) == prefix == prefix_option(prefix) == Keys(prefix).prefix


@pytest.mark.parametrize("prefix", ["nope", "", "hilum/v1/", "/hilum/v1"])
def test_keys_and_the_option_refuse_a_prefix_by_the_same_rule(prefix: str) -> None:
    message = f"etcd key prefix must start and end with '/', got {prefix!r}"
    with pytest.raises(ValueError) as exc:
        check_prefix(prefix)
    assert str(exc.value) == message
    with pytest.raises(ValueError) as exc:
        Keys(prefix)
    assert str(exc.value) == message
    with pytest.raises(argparse.ArgumentTypeError) as exc_arg:
        prefix_option(prefix)
    assert str(exc_arg.value) == message


def test_log_level_option_takes_any_case_and_names_the_choices() -> None:
    assert LOG_LEVELS == ("DEBUG", "INFO", "WARNING", "ERROR")
    assert [log_level_option(x) for x in ("debug", "Info", "WARNING", "error")] == list(LOG_LEVELS)
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        log_level_option("bogus")
    assert str(exc.value) == "'bogus' is not a log level: choose one of DEBUG, INFO, WARNING, ERROR"


_DAEMONS = {
    "global_coord": ["--etcd", "127.0.0.1:2379", "--listen", "127.0.0.1:0"],
    "gateway": ["--etcd", "127.0.0.1:2379", "--topology", "2x8-a100", "--listen", "127.0.0.1:0"],
    "rack_sched": [
        "--etcd",
        "127.0.0.1:2379",
        "--topology",
        "2x8-a100",
        "--listen",
        "127.0.0.1:0",
        "--domain-id",
        "node-0",
    ],
    "llumlet": ["--etcd", "127.0.0.1:2379", "--topology", "2x8-a100", "--instance-id", "node-0-i0"],
}


def test_a_llumlet_refuses_a_time_scale_its_engine_does_not_honour() -> None:
    """``--engine torch --time-scale 0.5`` was accepted and ignored: only the sim engine is paced."""
    done = subprocess.run(
        [sys.executable, "-m", "llumlet", *_DAEMONS["llumlet"], "--engine", "torch", "--time-scale", "0.5"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1] == (
        "python -m llumlet: error: --time-scale paces the sim engine only: --engine torch's steps take the time they "
        "compute"
    )


@pytest.mark.parametrize(
    ("module", "option", "value", "message"),
    [
        # llumlet used to print "serving at" and hang; global_coord exited 1, after connecting to etcd
        *[(m, "--prefix", "nope", "etcd key prefix must start and end with '/', got 'nope'") for m in _DAEMONS],
        # llumlet used to exit 1 with a traceback (ValueError: Unknown level)
        *[
            (m, "--log-level", "bogus", "'bogus' is not a log level: choose one of DEBUG, INFO, WARNING, ERROR")
            for m in _DAEMONS
        ],
        # global_coord exited 1 naming an internal field ("ttl_s must be >= 2"), rack_sched named RackConfig's, and
        # a llumlet printed "serving at" before its session refused a TTL of 0 (and took 1, which etcd rounds up)
        *[
            (m, "--ttl", value, message)
            for m in _DAEMONS
            if m != "gateway"  # it holds no lease
            for value, message in (
                ("0", "must be at least 2 s (etcd's minimum lease TTL), got 0"),
                ("1", "must be at least 2 s (etcd's minimum lease TTL), got 1"),
                ("2.5", "expected whole seconds, got '2.5'"),
                # etcd refused the lease: rack_sched then waited for a session, past SIGTERM
                ("9000000001", "must be at most 9,000,000,000 s (etcd's maximum lease TTL), got 9,000,000,001"),
            )
        ],
        # each of these was accepted, and ignored or used as given
        ("llumlet", "--grpc-rate-cap", "-1", "expected a number >= 0, got '-1'"),
        ("llumlet", "--local-rate-cap", "inf", "expected a number >= 0, got 'inf'"),
        ("llumlet", "--min-step-s", "nan", "expected a number >= 0, got 'nan'"),
        ("llumlet", "--time-scale", "0", "expected a number > 0, got '0'"),
        # it printed the whole migration configuration's repr
        ("llumlet", "--reservation-expiry-s", "-1", "expected a number > 0, got '-1'"),
        ("gateway", "--unavailable-wait", "-5", "expected a number >= 0, got '-5'"),
        ("rack_sched", "--ready-timeout", "-1", "expected a number >= 0, got '-1'"),
        # each named an internal field (BackendConfig.num_blocks, the Scheduler's max_num_seqs), not the option
        ("llumlet", "--num-blocks", "0", "expected a whole number >= 1, got '0'"),
        ("llumlet", "--block-size", "0", "expected a whole number >= 1, got '0'"),
        ("llumlet", "--max-num-seqs", "0", "expected a whole number >= 1, got '0'"),
        ("llumlet", "--max-num-seqs", "2.5", "expected a whole number >= 1, got '2.5'"),
        # a negative seed ran, and drew what its positive counterpart draws (random.Random drops the sign)
        *[(m, "--seed", "-1", "expected a whole number >= 0, got '-1'") for m in ("llumlet", "rack_sched", "gateway")],
        # beyond torch's unsigned 64-bit seed: a torch llumlet stopped with "Overflow when unpacking long long"
        ("llumlet", "--seed", str(2**64), f"expected a whole number <= {2**64 - 1}, got '{2**64}'"),
    ],
)
def test_every_process_refuses_a_bad_option_before_it_starts(
    module: str, option: str, value: str, message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, *_DAEMONS[module], option, value],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == f"python -m {module}: error: argument {option}: {message}"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        # it was accepted, and its registration named the topology's domain anyway
        ("--domain-id", "node-7", "--domain-id node-7: instance node-0-i0 is in domain node-0 in 1x8-a100"),
        # it was accepted: the engine cut its KV cache in 7-token blocks while every scheduler counted 16-token ones
        (
            "--block-size",
            "7",
            "--block-size 7: model llama-2-7b has 16-token KV blocks in 1x8-a100, and the schedulers count this "
            "instance's blocks in those",
        ),
    ],
)
def test_a_llumlet_refuses_what_its_topology_says_otherwise(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from llumlet.cli import main as llumlet_main

    assert llumlet_main(["--instance-id", "node-0-i0", "--topology", "1x8-a100", option, value]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"llumlet: error: {message}"
