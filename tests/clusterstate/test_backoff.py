"""Backoff: bounded jittered delays; a retry loop's log lines warn at the first failure of a run and then once
every WARN_EVERY_S seconds (an etcd outage wrote a warning every second or two per loop), debug between."""

from __future__ import annotations

import logging
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from etcd_server import EtcdServer

from clusterstate.backoff import WARN_EVERY_S, Backoff, BackoffConfig, RepeatedFailures, failed_attempts


def test_delays_grow_to_the_cap_with_jitter_and_start_again_after_a_reset() -> None:
    backoff = Backoff(BackoffConfig(initial_s=0.1, max_s=0.4, multiplier=2.0, jitter=0.5), random.Random(3))
    delays = [backoff.next_s() for _ in range(5)]
    for delay, ceiling in zip(delays, [0.1, 0.2, 0.4, 0.4, 0.4], strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert backoff.failures == 5
    assert backoff.reset() == 5  # what it cleared: a loop that had failures says it recovered
    assert backoff.failures == 0 and 0.05 <= backoff.next_s() <= 0.1


def test_a_run_of_failures_warns_at_its_first_then_once_every_period() -> None:
    now = [100.0]
    repeats = RepeatedFailures(every_s=30.0, clock=lambda: now[0])
    levels = []
    for _ in range(40):  # a failure a second for 40 s
        levels.append(repeats.failed())
        now[0] += 1.0
    warned = [k for k, level in enumerate(levels) if level == logging.WARNING]
    assert warned == [0, 30] and set(levels) == {logging.WARNING, logging.DEBUG}
    assert repeats.failures == 40
    repeats.reset()  # a success: the next failure starts a new run, and says so
    assert repeats.failed() == logging.WARNING and repeats.failures == 1


def test_a_recovery_line_counts_one_failed_attempt_in_the_singular() -> None:
    assert [failed_attempts(n) for n in (1, 2, 21)] == ["1 failed attempt", "2 failed attempts", "21 failed attempts"]


def test_backoff_gives_the_level_of_the_failure_it_counted() -> None:
    backoff = Backoff(BackoffConfig(), random.Random(1))
    backoff.next_s()
    assert backoff.level() == logging.WARNING
    backoff.next_s()
    assert backoff.level() == logging.DEBUG  # the second within WARN_EVERY_S
    backoff.reset()
    backoff.next_s()
    assert backoff.level() == logging.WARNING
    assert WARN_EVERY_S == 30.0


def test_a_coordinator_without_etcd_warns_once_per_retry_loop_then_says_when_it_answers(tmp_path: Path) -> None:
    # three loops (the leader watch, the etcd session, the cluster view) each retried every 0.1-2 s: two warnings a
    # second for the whole outage; now each warns at its first failure and then every WARN_EVERY_S seconds
    etcd = EtcdServer(tmp_path / "etcd")  # its port is chosen; nothing listens there until start()
    log = tmp_path / "coordinator.log"
    cmd = [sys.executable, "-m", "global_coord", "--listen", "127.0.0.1:0", "--etcd", etcd.endpoint,
           "--topology", "1x8-a100", "--id", "c1"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60  # each loop's first failure (a slow start under load)
        while sum(" WARNING " in line for line in log.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        time.sleep(6.0)  # past the backoff's 2-s cap: a few more retries of each loop, at debug level
        warnings = [line for line in log.read_text().splitlines() if " WARNING " in line]
        assert len(warnings) == 3, log.read_text()
        for words in ("observing the leader failed", "cannot open an etcd session", "cluster view: etcd error"):
            assert sum(words in w and "attempt 1;" in w and "check that etcd runs" in w for w in warnings) == 1
        etcd.start()
        recovered = [  # each loop says it recovered, at its next retry (up to 2 s apart), at its warnings' level
            r" INFO c1 leads with fencing token ",
            r" WARNING c1: etcd answers again after \d+ failed attempts?",
            r" WARNING cluster view: etcd answers again after \d+ failed attempts?",
            r" WARNING observing the leader again after \d+ failed attempts?",
        ]
        deadline = time.monotonic() + 30
        while not all(re.search(line, log.read_text()) for line in recovered):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        etcd.stop()
