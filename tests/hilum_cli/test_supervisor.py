"""The supervisor under ``hilum up``: the restart rule (a table) and real child processes that crash."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from hilum_cli.supervisor import ChildSpec, RestartPolicy, StartFailed, Supervisor, decide, describe_exit

POLICY = RestartPolicy(max_restarts=3, window_s=60.0, delay_s=0.5, max_delay_s=1.5)


@pytest.mark.parametrize(
    ("returncode", "crashes", "action", "delay_s", "words"),
    [
        (0, [], "stay_down", 0.0, "stopped cleanly"),
        (-signal.SIGTERM, [], "stay_down", 0.0, "stopped cleanly"),
        (-signal.SIGINT, [], "stay_down", 0.0, "stopped cleanly"),
        (2, [], "stay_down", 0.0, "configuration error"),
        (1, [], "restart", 0.5, "restart 1 of at most 3 within 60 s"),
        (-signal.SIGKILL, [90.0], "restart", 1.0, "restart 2 of at most 3"),  # one crash 10 s ago: delay doubles
        (-signal.SIGSEGV, [80.0, 90.0], "restart", 1.5, "restart 3 of at most 3"),  # 2.0 capped at 1.5
        (1, [10.0, 20.0, 30.0], "restart", 0.5, "restart 1 of"),  # those crashes are older than the window
        (1, [50.0, 60.0, 90.0], "give_up", 0.0, "crashed 4 times within 60 s (at most 3 restarts"),
    ],
)
def test_decide(returncode: int, crashes: list[float], action: str, delay_s: float, words: str) -> None:
    decision = decide(returncode, crashes, 100.0, POLICY)
    assert (decision.action, decision.delay_s) == (action, delay_s)
    assert words in decision.reason


def test_no_restarts_means_a_crash_gives_up() -> None:
    decision = decide(1, [], 0.0, RestartPolicy(max_restarts=0))
    assert (decision.action, decision.reason) == ("give_up", "restarts are off (--max-restarts 0)")


def test_describe_exit() -> None:
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


def _script(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


READY_THEN_CRASH = "import sys, time; print('ready', flush=True); time.sleep(0.3); sys.exit(7)"


def _supervisor(tmp_path: Path, lines: list[str], policy: RestartPolicy) -> Supervisor:
    return Supervisor(tmp_path, env={}, cwd=tmp_path, policy=policy, say=lines.append)


def test_a_crashing_child_is_restarted_with_backoff_then_given_up_on(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = _supervisor(tmp_path, lines, RestartPolicy(max_restarts=2, window_s=60.0, delay_s=0.2, max_delay_s=5.0))
    child = sup.spawn(ChildSpec("crashy", _script(READY_THEN_CRASH), ready_marker="ready"))
    sup.add_stage([child])
    sup.wait_ready([child], 30)
    first_pid = child.pid
    deadline = time.monotonic() + 60
    while (why := sup.tick()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    sup.stop_all(5)
    assert why is not None and why.startswith("crashy (pid ") and "exited with status 7; giving up" in why
    assert "crashed 3 times within 60 s (at most 2 restarts" in why
    assert child.restarts == 2 and child.pid != first_pid
    restarting = [line for line in lines if "restarting it in" in line]
    assert [line.split("restarting it in ")[1][:5] for line in restarting] == ["0.2 s", "0.4 s"]  # doubled
    assert "restart 1 of at most 2 within 60 s" in restarting[0]
    assert sum("serves again" in line for line in lines) == 2
    log = (tmp_path / "crashy.log").read_text()  # appended across restarts, each one marked
    assert log.count("ready\n") == 3 and "---- hilum up: restart 1 at " in log and "---- hilum up: restart 2" in log


def test_a_clean_exit_and_a_configuration_error_stay_down(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = _supervisor(tmp_path, lines, POLICY)
    changed: list[tuple[str, str]] = []  # what cluster.json is rewritten with (hilum up: RunningCluster.write_info)
    sup.on_change = lambda child: changed.append((child.name, child.state()))
    clean = sup.spawn(ChildSpec("clean", _script("print('ready', flush=True)"), ready_marker="ready"))
    config = sup.spawn(ChildSpec("config", _script("import sys; print('ready', flush=True); sys.exit(2)"),
                                 ready_marker="ready"))  # fmt: skip
    sup.add_stage([clean, config])
    deadline = time.monotonic() + 30
    while not (clean.down and config.down) and time.monotonic() < deadline:
        assert sup.tick() is None
        time.sleep(0.02)
    sup.stop_all(5)
    assert (clean.restarts, config.restarts) == (0, 0)
    # cluster.json listed a stopped process as it was when it ran: now it is rewritten, saying "down"
    assert sorted(changed) == [("clean", "down"), ("config", "down")]
    assert any(line.startswith("clean (pid ") and "exited with status 0: it stopped cleanly" in line for line in lines)
    assert any("exited with status 2: status 2 is a configuration error" in line for line in lines)


def test_a_child_that_exits_while_starting_fails_the_start_with_its_log(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, [], POLICY)
    child = sup.spawn(ChildSpec("broken", _script("import sys; print('no such option', file=sys.stderr); sys.exit(2)"),
                                ready_marker="ready"))  # fmt: skip
    sup.add_stage([child])
    with pytest.raises(StartFailed, match=r"(?s)broken exited with status 2 while starting; its log .*no such option"):
        sup.wait_ready([child], 30)
    sup.stop_all(5)


def test_a_child_that_said_nothing_before_the_start_timeout_is_said_so(tmp_path: Path) -> None:
    """Its empty log was quoted as nothing at all: the message ended on "ends with:"."""
    sup = _supervisor(tmp_path, [], POLICY)
    child = sup.spawn(ChildSpec("mute", _script("import time; time.sleep(60)"), ready_marker="ready"))
    sup.add_stage([child])
    with pytest.raises(StartFailed) as failed:
        sup.wait_ready([child], 0.5)
    sup.stop_all(5)
    assert str(failed.value).endswith("ends with:\n(nothing: the log is empty)"), str(failed.value)


def test_stop_all_leaves_no_process(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, [], POLICY)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(60)"  # fmt: skip
    child = sup.spawn(ChildSpec("stubborn", _script(stubborn), ready_marker="ready"))
    sup.add_stage([child])
    sup.wait_ready([child], 30)
    t0 = time.monotonic()
    sup.stop_all(0.5)  # SIGTERM is ignored: SIGKILL after 0.5 s
    assert child.proc is not None and child.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    assert sup.tick() is None and child.restarts == 0  # nothing is restarted after stop_all


def test_a_restarted_child_that_never_serves_is_killed_as_a_crash(tmp_path: Path) -> None:
    lines: list[str] = []
    policy = RestartPolicy(max_restarts=1, window_s=60.0, delay_s=0.1, max_delay_s=0.1)
    sup = Supervisor(tmp_path, env={}, cwd=tmp_path, policy=policy, say=lines.append, ready_timeout_s=0.5)
    flag = tmp_path / "started-once"
    code = (
        "import pathlib, sys, time\n"
        f"flag = pathlib.Path({str(flag)!r})\n"
        "if flag.exists():\n    time.sleep(60)\n"  # the restart hangs before it serves
        "flag.touch(); print('ready', flush=True); time.sleep(0.2); sys.exit(1)\n"
    )
    child = sup.spawn(ChildSpec("hangs", _script(code), ready_marker="ready"))
    sup.add_stage([child])
    sup.wait_ready([child], 30)
    deadline = time.monotonic() + 60
    while (why := sup.tick()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    sup.stop_all(5)
    assert any("hangs (pid " in line and "did not serve within 0.5 s of its restart; killing it" in line
               for line in lines), lines  # fmt: skip
    assert why is not None and "was killed by SIGKILL; giving up: it crashed 2 times within 60 s" in why
