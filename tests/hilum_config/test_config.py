"""One configuration file for every tier: defaults in one place, every key documented, errors that name it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hilum_config import CONFIG_ENV, ConfigError, HilumConfig, Intervals, load_config, parse_config
from policy.types import PolicyConfig
from rack_sched.cli import build_parser, config_from_args
from topology.load import load_topology

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hilum.yaml"
DOC = REPO / "docs" / "configuration.md"


def test_the_example_file_holds_exactly_the_defaults() -> None:
    cfg = load_config(EXAMPLE)
    assert dataclasses.replace(cfg, source="<defaults>") == HilumConfig()
    assert (REPO / "deploy" / "config" / "hilum.yaml").read_text() == EXAMPLE.read_text()  # what systemd installs
    assert cfg.domain.policy is cfg.policy and cfg.domain.remaining is cfg.remaining


def test_every_key_is_documented_with_its_default() -> None:
    doc = DOC.read_text()
    cfg = HilumConfig()
    # every field is a section of its own, but the actuator's keys, which are the autoscale section's too
    fields = [f.name for f in dataclasses.fields(HilumConfig) if f.name != "source"]
    assert "measured_bandwidth" in fields and "autoscale" in fields
    example = EXAMPLE.read_text()
    for name in fields:
        section = "autoscale" if name == "actuator" else name
        assert re.search(rf"^{section}:", example, flags=re.MULTILINE), f"examples/hilum.yaml lacks {section}"
        value = getattr(cfg, name)
        for f in dataclasses.fields(value):
            if f.init and f.name not in ("policy", "remaining"):
                row = re.search(rf"^\| `{section}\.{f.name}` \|[^\n]*", doc, flags=re.MULTILINE)
                assert row is not None, f"docs/configuration.md lacks {section}.{f.name}"


def test_a_yaml_syntax_error_is_one_line_naming_where(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("intervals:\n  report_interval_s: 0.05\npolicy: [1\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    (line,) = err.value.errors
    assert line.startswith(f"{bad}: line 4, column 1: YAML syntax error: expected ',' or ']'"), line
    assert "\n" not in line


def test_errors_name_the_file_and_the_key_all_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "policy: {tie_tolerance: 2.0, no_such_key: 1}\n"
        "cost: {cap_fraction: fast}\n"
        "approval: {downtime_budget_s: -1}\n"
        "intervals: {cross_interval_s: 0}\n"
        "extras: {}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert err.value.errors == [
        f"{bad}: extras: unknown section (known: policy, remaining, domain, cost, approval, intervals, resume, "
        "measured_bandwidth, autoscale, prefix_cache)",
        f"{bad}: policy.no_such_key: unknown key; expected one of: priority_headroom_blocks, warmup_usage_blocks, "
        "tie_tolerance, migrate_out_freeness_below, migrate_in_freeness_above, candidate_policy, "
        "max_migrations_per_round, domain_choices, prefix_aware_dispatch, prefix_affinity_margin",
        f"{bad}: policy.tie_tolerance: must be in [0, 1), got 2.0",  # checked too: an unknown key hides nothing
        f"{bad}: cost.cap_fraction: expected a number, got 'fast' (a string)",  # in hilum's words, not pydantic's
        f"{bad}: approval.downtime_budget_s: must be > 0, got -1.0",
        f"{bad}: intervals.cross_interval_s: must be a finite number of seconds, at least 0.001 (no decision loop "
        "runs more often than every millisecond), got 0.0",
    ]
    with pytest.raises(ConfigError, match=r"policy.tie_tolerance: must be in \[0, 1\), got 2.0"):
        parse_config({"policy": {"tie_tolerance": 2.0}}, "f")


@pytest.mark.parametrize(
    ("intervals", "message"),
    [
        (
            {"rebalance_interval_s": 1e-7},
            "intervals.rebalance_interval_s: must be a finite number of seconds, at least",
        ),
        ({"summary_interval_s": float("inf")}, "intervals.summary_interval_s: must be a finite number of seconds"),
        ({"reservation_ttl_s": float("inf")}, "intervals.reservation_ttl_s: must be a finite number of seconds > 0"),
    ],
)
def test_decision_loops_run_at_most_every_millisecond(intervals: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"intervals": intervals}, "f")
    assert parse_config({"intervals": {"rebalance_interval_s": 0.001}}, "f").intervals.rebalance_interval_s == 0.001


def test_sections_checked_as_a_whole_name_their_keys_too() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "remaining": {"window": 0, "min_samples": -1, "default_tokens": -1},
                "policy": {"priority_headroom_blocks": {"x": 3}, "candidate_policy": "longest"},
            },
            "f",
        )
    assert err.value.errors == [
        "f: policy.priority_headroom_blocks: key 'x': expected an integer, got 'x' (a string)",
        "f: remaining.window: must be >= 1, got 0",
        "f: remaining.min_samples: must be >= 1, got -1",
        "f: remaining.default_tokens: must be >= 0, got -1",
    ]
    with pytest.raises(ConfigError) as err:
        parse_config({"domain": {"settle_s": -1, "cool_down_s": -2}}, "f")
    assert err.value.errors == [
        "f: domain.settle_s: must be a finite number >= 0, got -1.0",
        "f: domain.cool_down_s: must be a finite number >= 0, got -2.0",
    ]
    with pytest.raises(ConfigError) as err:  # the domain section is checked even when another section failed
        parse_config(
            {"policy": {"priority_headroom_blocks": {2: -4}, "tie_tolerance": -1}, "domain": {"settle_s": -1}}, "f"
        )
    assert err.value.errors == [
        "f: policy.priority_headroom_blocks[2]: blocks must be an int >= 0, got -4",
        "f: policy.tie_tolerance: must be in [0, 1), got -1.0",
        "f: domain.settle_s: must be a finite number >= 0, got -1.0",
    ]
    with pytest.raises(ConfigError) as err:  # a rule between keys names the section, without the class
        parse_config({"policy": {"migrate_in_freeness_above": -5}}, "f")
    assert err.value.errors == [
        "f: policy: the migration thresholds cross: migrate_out_freeness_below (3.0, the default) must be <= "
        "migrate_in_freeness_above (-5.0), or an instance could be both source and destination"
    ]
    with pytest.raises(ConfigError) as err:  # a threshold of the wrong type: its default is not weighed against
        parse_config({"policy": {"migrate_in_freeness_above": "x", "migrate_out_freeness_below": 50}}, "f")
    assert err.value.errors == ["f: policy.migrate_in_freeness_above: expected a number, got 'x' (a string)"]
    with pytest.raises(ConfigError) as err:  # another key's mistake hides the crossing no more
        crossed = {"migrate_out_freeness_below": 10, "migrate_in_freeness_above": 2}
        parse_config({"policy": {"tie_tolerance": "x", **crossed}}, "f")
    assert err.value.errors == [
        "f: policy.tie_tolerance: expected a number, got 'x' (a string)",
        "f: policy: the migration thresholds cross: migrate_out_freeness_below (10.0) must be <= "
        "migrate_in_freeness_above (2.0), or an instance could be both source and destination",
    ]
    with pytest.raises(ConfigError) as err:  # reported once (it was twice: the second time with the default)
        parse_config({"policy": {"migrate_in_freeness_above": -5, "migrate_out_freeness_below": 1}}, "f")
    assert err.value.errors == [
        "f: policy: the migration thresholds cross: migrate_out_freeness_below (1.0) must be <= "
        "migrate_in_freeness_above (-5.0), or an instance could be both source and destination"
    ]


def test_every_refused_value_of_a_section_is_listed_by_key_and_exponents_are_numbers(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "policy: {tie_tolerance: 1.0e9, prefix_affinity_margin: 3}\n"
        "cost: {cap_fraction: 2.0, setup_overhead_s: -1e-3}\n"
        "intervals: {cross_interval_s: 2e-1}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert err.value.errors == [
        f"{bad}: policy.tie_tolerance: must be in [0, 1), got 1000000000.0",
        f"{bad}: policy.prefix_affinity_margin: must be in [0, 1), got 3.0",
        f"{bad}: cost.cap_fraction: must be in (0, 1], got 2.0",
        f"{bad}: cost.setup_overhead_s: must be a finite number >= 0, got -0.001",
    ]
    bad.write_text("intervals: {cross_interval_s: 2e-1}\ncost: {}\ncost: {cap_fraction: 0.5}\n")
    with pytest.raises(ConfigError, match="line 3, column 1: YAML syntax error: duplicate key 'cost'"):
        load_config(bad)
    bad.write_text("intervals: {cross_interval_s: 2e-1}\n")
    assert load_config(bad).intervals.cross_interval_s == 0.2
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load_config(tmp_path / "missing.yaml")
    bad.write_bytes(b"\xff\xfe\x00intervals: {}\n")  # UTF-16 bytes, say
    with pytest.raises(ConfigError) as exc:
        load_config(bad)
    assert exc.value.errors == [f"{bad}: (file): not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"]
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        parse_config([1, 2], "f")


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "y", "N", "Yes"])
def test_only_true_and_false_are_booleans_as_in_yaml_1_2(tmp_path: Path, word: str) -> None:
    """YAML 1.1's other booleans are strings, refused by a boolean key (PyYAML read ``yes`` as true, and it passed
    where ``"false"`` and ``0`` were refused)."""
    f = tmp_path / "h.yaml"
    f.write_text(f"policy: {{prefix_aware_dispatch: {word}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert err.value.errors == [f"{f}: policy.prefix_aware_dispatch: expected true or false, got '{word}' (a string)"]
    for given, value in (("true", True), ("False", False), ("TRUE", True)):
        f.write_text(f"policy: {{prefix_aware_dispatch: {given}}}\n")
        assert load_config(f).policy.prefix_aware_dispatch is value


def test_the_fixed_overheads_of_a_move_are_read_and_checked_by_name(tmp_path: Path) -> None:
    cfg = parse_config({"cost": {"stage_overhead_s": 0.02, "setup_overhead_s": 0.05}}, "f")
    assert cfg.cost.stage_overhead_s == 0.02 and cfg.cost.setup_overhead_s == 0.05
    assert cfg.cost.suspend_resume_overhead_s == 0.001  # the default of the key not set
    bad = tmp_path / "bad.yaml"
    bad.write_text("cost: {stage_overhead_s: -0.01, setup_overhead_s: slow}\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert err.value.errors == [
        f"{bad}: cost.setup_overhead_s: expected a number, got 'slow' (a string)",
        f"{bad}: cost.stage_overhead_s: must be a finite number >= 0, got -0.01",  # not hidden by the other
    ]
    with pytest.raises(ConfigError) as err:
        parse_config({"cost": {"stage_overhead_s": -0.01}}, "f")
    assert err.value.errors == ["f: cost.stage_overhead_s: must be a finite number >= 0, got -0.01"]


def test_the_environment_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "h.yaml"
    f.write_text("policy: {priority_headroom_blocks: {1: 64, 2: 256}}\nintervals: {rebalance_interval_s: 0.1}\n")
    monkeypatch.setenv(CONFIG_ENV, str(f))
    cfg = load_config()
    assert dict(cfg.policy.priority_headroom_blocks) == {1: 64, 2: 256}
    assert cfg.intervals == Intervals(rebalance_interval_s=0.1)
    monkeypatch.delenv(CONFIG_ENV)
    assert load_config().policy == PolicyConfig()


def test_an_error_names_how_the_file_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a service prints (the error's text) names the flag or the variable that named the file."""
    f = tmp_path / "h.yaml"
    f.write_text("policy: {tie_tolerance: 2.0}\n")
    monkeypatch.setenv(CONFIG_ENV, str(f))
    with pytest.raises(ConfigError) as from_env:
        load_config()
    assert str(from_env.value) == f"$HILUM_CONFIG {f}: policy.tie_tolerance: must be in [0, 1), got 2.0"
    with pytest.raises(ConfigError) as from_flag:
        load_config(f)
    assert str(from_flag.value) == f"--config {f}: policy.tie_tolerance: must be in [0, 1), got 2.0"
    assert from_flag.value.errors == [f"{f}: policy.tie_tolerance: must be in [0, 1), got 2.0"]
    with pytest.raises(ConfigError, match=r"^--config is empty: give a configuration file, or leave it out"):
        load_config(" ")  # not the current directory
    monkeypatch.setenv(CONFIG_ENV, "")  # an empty variable is an unset one
    assert load_config() == HilumConfig()


def test_a_domain_scheduler_and_the_simulator_read_the_same_settings(tmp_path: Path) -> None:
    from sim.runner import SimSpec, configured

    f = tmp_path / "h.yaml"
    f.write_text("domain: {cool_down_s: 9.0}\ncost: {max_stages: 3}\nintervals: {summary_interval_s: 0.5}\n")
    topo = load_topology("2x8-a100")
    ns = build_parser().parse_args(
        [
            "--domain-id",
            "node-0",
            "--listen",
            "127.0.0.1:0",
            "--etcd",
            "e:1",
            "--topology",
            "2x8-a100",
            "--config",
            str(f),
        ]
    )
    rack = config_from_args(ns, topo, "127.0.0.1:1")
    sim = configured(str(f), SimSpec("2x8-a100", "azure-conv", "hilum").parsed_options())
    assert rack.decide == sim.domain and rack.decide.cool_down_s == 9.0
    assert rack.summary_interval_s == sim.intervals.summary_interval_s == 0.5
    assert sim.cost.precopy.max_stages == 3


_PROCESSES = [  # each daemon's command line, etcd unreachable: a refused file must stop it before it is ever asked
    ["-m", "rack_sched", "--domain-id", "node-0", "--listen", "127.0.0.1:0", "--etcd", "127.0.0.1:1",
     "--topology", "2x8-a100"],
    ["-m", "global_coord", "--etcd", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--topology", "2x8-a100"],
    ["-m", "llumlet", "--instance-id", "node-0-i0", "--topology", "2x8-a100"],
    ["-m", "gateway", "--etcd", "127.0.0.1:1", "--topology", "2x8-a100", "--listen", "127.0.0.1:0"],
]  # fmt: skip
_PROCESS_IDS = ["rack_sched", "global_coord", "llumlet", "gateway"]


@pytest.mark.parametrize("argv", _PROCESSES, ids=_PROCESS_IDS)
def test_every_process_refuses_a_missing_topology_file(argv: list[str], tmp_path: Path) -> None:
    """Exit status 2 (a configuration error: a restart cannot fix it), naming the file, from every daemon."""
    import subprocess
    import sys

    missing = tmp_path / "nope.yaml"
    argv = [str(missing) if a == "2x8-a100" else a for a in argv]
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{missing}: (file): file not found" in proc.stderr


@pytest.mark.parametrize("argv", _PROCESSES, ids=_PROCESS_IDS)
def test_every_process_refuses_a_bad_file_naming_the_key(argv: list[str], tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("cost: {max_stages: many}\n")
    proc = subprocess.run(
        [sys.executable, *argv, "--config", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}: cost.max_stages: expected an integer, got 'many' (a string)" in proc.stderr


def test_the_autoscale_section_builds_the_rule_and_the_hook(tmp_path: Path) -> None:
    f = tmp_path / "h.yaml"
    f.write_text(
        "autoscale: {enabled: true, min_instances: 2, scale_in_hold_s: 120.0, command: '/bin/hook --dry-run',"
        " command_attempts: 2}\n"
    )
    cfg = load_config(f)
    assert (cfg.autoscale.enabled, cfg.autoscale.min_instances, cfg.autoscale.scale_in_hold_s) == (True, 2, 120.0)
    assert (cfg.actuator.argv(), cfg.actuator.command_attempts) == (["/bin/hook", "--dry-run"], 2)
    assert cfg.actuator.command_timeout_s == 120.0  # not set: the default
    with pytest.raises(ConfigError) as err:
        parse_config({"autoscale": {"min_instances": 0, "command": 5, "no_such": 1, "command_attempts": 0}}, "f.yaml")
    assert err.value.errors == [  # the wrong types and unknown keys, then the values of the others
        "f.yaml: autoscale.command: expected a string, got 5 (an integer)",
        "f.yaml: autoscale.no_such: unknown key; expected one of: enabled, interval_s, scale_out_freeness_below, "
        "scale_in_freeness_above, scale_out_hold_s, scale_in_hold_s, cool_down_s, min_instances, max_instances, "
        "start_timeout_s, command, command_timeout_s, command_attempts, command_retry_s",
        "f.yaml: autoscale.min_instances: must be >= 1, got 0",
        "f.yaml: autoscale.command_attempts: must be >= 1, got 0",
    ]
    with pytest.raises(ConfigError) as err:
        parse_config({"autoscale": {"min_instances": 0, "command_attempts": 0}}, "f.yaml")
    assert err.value.errors == [
        "f.yaml: autoscale.min_instances: must be >= 1, got 0",
        "f.yaml: autoscale.command_attempts: must be >= 1, got 0",
    ]


def test_prefix_cache_section_builds_its_config_and_names_bad_values() -> None:
    cfg = parse_config({"prefix_cache": {"enabled": False, "blocks_per_hash": 2, "report_max_hashes": 64}}, "f")
    assert (cfg.prefix_cache.enabled, cfg.prefix_cache.block_tokens(16), cfg.prefix_cache.report_max_hashes) == (
        False,
        32,
        64,
    )
    with pytest.raises(ConfigError, match=r"f: prefix_cache.blocks_per_hash: must be an int >= 1, got 0"):
        parse_config({"prefix_cache": {"blocks_per_hash": 0}}, "f")


def test_the_rule_books_fields_are_in_docs_policy_md() -> None:
    """docs/policy.md's PolicyConfig table lists every field with its default (domain_choices was missing)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "policy.md").read_text()
    for f in dataclasses.fields(PolicyConfig):
        row = re.search(rf"^\| `{f.name}` \| `([^`]*)` \|", doc, flags=re.MULTILINE)
        assert row is not None, f"docs/policy.md lacks PolicyConfig.{f.name}"
        default = getattr(PolicyConfig(), f.name)
        assert row.group(1) in (repr(default), str(default), f'"{default}"', str(dict(default)) if f.name ==
                                "priority_headroom_blocks" else ""), (f.name, row.group(1), default)  # fmt: skip
