"""The autoscaler's hook (global_coord/actuator.py): its arguments and environment, retries with a doubling,
jittered delay, a timeout that kills the hook, and a hook that cannot be run."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from autoscale_fakes import RecordingHook

from global_coord.actuator import ActuatorConfig, CommandActuator, HookResult


class RecordingClock:
    """A clock whose sleeps return at once and are recorded (seconds)."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def now_s(self) -> float:
        return sum(self.slept)

    def wall_s(self) -> float:
        return sum(self.slept)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await asyncio.sleep(0)


def test_a_failing_hook_is_retried_with_a_doubling_jittered_delay_until_it_succeeds(tmp_path: Path) -> None:
    hook = RecordingHook(tmp_path)
    hook.fail("scale-out", "b1", 3)
    clock = RecordingClock()
    actuator = CommandActuator(ActuatorConfig(str(hook.path), command_retry_s=5.0), random.Random(0), clock)
    seen: list[tuple[int, int | None]] = []
    result = asyncio.run(actuator.run("scale-out", "m", "b1", on_attempt=lambda n, r: seen.append((n, r.exit_code))))
    assert result == HookResult(True, 4, 0, "did scale-out b1\n")
    assert seen == [(1, 3), (2, 3), (3, 3), (4, 0)]
    assert hook.calls() == ["scale-out m b1 scale-out"] * 4
    # Delays 5, 10, 20 s, each drawn from [d / 2, d] (jitter 0.5).
    assert len(clock.slept) == 3
    for delay, base in zip(clock.slept, (5.0, 10.0, 20.0), strict=True):
        assert base / 2 <= delay <= base


def test_a_hook_that_keeps_failing_is_given_up_after_its_attempts(tmp_path: Path) -> None:
    hook = RecordingHook(tmp_path)
    hook.fail("scale-in", "a1", 10)
    clock = RecordingClock()
    cfg = ActuatorConfig(str(hook.path), command_attempts=2, command_retry_s=1.0)
    result = asyncio.run(CommandActuator(cfg, random.Random(0), clock).run("scale-in", "m", "a1"))
    assert (result.ok, result.attempts, result.exit_code) == (False, 2, 3)
    assert result.output == "simulated failure of scale-in a1\n"
    assert len(clock.slept) == 1  # no delay after the last attempt


def test_a_hook_past_its_timeout_is_killed_and_one_that_cannot_run_fails(tmp_path: Path) -> None:
    slow = tmp_path / "slow.sh"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    cfg = ActuatorConfig(str(slow), command_timeout_s=0.5, command_attempts=1)
    result = asyncio.run(CommandActuator(cfg, random.Random(0)).run("scale-out", "m", "a1"))
    assert (result.ok, result.exit_code) == (False, None)
    assert result.output.startswith("timed out after 0.5 s")
    missing = ActuatorConfig(str(tmp_path / "absent"), command_attempts=1)
    gone = asyncio.run(CommandActuator(missing, random.Random(0)).run("scale-out", "m", "a1"))
    assert (gone.ok, gone.exit_code) == (False, None) and gone.output.startswith("cannot run")
    with pytest.raises(ValueError, match="not an executable file"):
        missing.check()
    with pytest.raises(ValueError, match="command_attempts must be >= 1"):
        ActuatorConfig(str(slow), command_attempts=0)


def test_the_example_hook_under_deploy_starts_and_stops_the_llumlet_unit_on_its_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = Path(__file__).resolve().parents[2] / "deploy" / "hilum-autoscale-hook"
    hosts = tmp_path / "hosts"
    hosts.write_text("node-3-i2 10.0.0.13\n")
    monkeypatch.setenv("HILUM_AUTOSCALE_DRY_RUN", "1")
    monkeypatch.setenv("HILUM_AUTOSCALE_HOSTS", str(hosts))
    cfg = ActuatorConfig(str(hook), command_attempts=1)
    cfg.check()  # an executable file
    actuator = CommandActuator(cfg, random.Random(0))
    started = asyncio.run(actuator.run("scale-out", "llama", "node-3-i2"))
    assert started.ok and started.output == (
        "scale-out llama node-3-i2: ssh -o BatchMode=yes -o ConnectTimeout=10 hilum@10.0.0.13 "
        "sudo systemctl start hilum-llumlet@node-3-i2\n"
    )
    stopped = asyncio.run(actuator.run("scale-in", "llama", "node-1-i0"))  # not in the file: its node by name
    assert stopped.ok and stopped.output.endswith("hilum@node-1 sudo systemctl stop hilum-llumlet@node-1-i0\n")
    refused = asyncio.run(actuator.run("scale-in", "llama", "x;reboot"))
    assert (refused.ok, refused.exit_code) == (False, 64) and "refusing instance id" in refused.output
