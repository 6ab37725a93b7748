"""sim.sweep: sweep-file validation, grid order, and a 2 policies x 2 rate scales sweep on a local Ray."""

from __future__ import annotations

import json
import os
import re
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from sim.report import format_sweep_table
from sim.results import KvTimeline, RequestRecord, SimRun, summarize
from sim.runner import SimOptions
from sim.sweep import (
    GridPoint,
    SweepConfig,
    SweepConfigError,
    SweepPointError,
    grid_points,
    load_sweep,
    load_sweep_config,
    plot_file_name,
    plot_file_names,
    ray_runtime_env,
    run_point,
    run_sweep,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "sim-results.md"

GOOD = """\
trace: burstgpt
topologies: [2x8-a100]
policies: [round_robin, hilum]
rate_scales: [0.5, 2.0]
seeds: [3]
max_requests: 100
options: {migrate_interval_s: 0.05}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_load_good_config(tmp_path: Path) -> None:
    cfg = load_sweep_config(write(tmp_path, GOOD))
    assert cfg.policies == ["round_robin", "hilum"]
    assert cfg.rate_scales == [0.5, 2.0]
    assert (cfg.seeds, cfg.max_requests, cfg.options) == ([3], 100, {"migrate_interval_s": 0.05})


def test_defaults(tmp_path: Path) -> None:
    cfg = load_sweep_config(write(tmp_path, "trace: t\ntopologies: [a]\npolicies: [p]\nrate_scales: [1]\n"))
    assert (cfg.seeds, cfg.max_requests, cfg.options) == ([0], None, {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            GOOD.replace("policies:", "polices:"),
            "sweep.yaml: polices: unknown key; expected one of: trace, topologies, policies, rate_scales, seeds,",
        ),
        (GOOD.replace("[0.5, 2.0]", "[0.5, -2.0]"), "sweep.yaml: rate_scales[1]: must be > 0, got -2.0"),
        (GOOD.replace("[0.5, 2.0]", "[.nan]"), "sweep.yaml: rate_scales[0]: must be a finite number, got nan"),
        (GOOD.replace("[round_robin, hilum]", "[]"), "sweep.yaml: policies: must list at least one entry"),
        (GOOD.replace("[3]", "[3, 3]"), "sweep.yaml: seeds: duplicate entries: 3"),
        (GOOD.replace("[3]", "[-1]"), "sweep.yaml: seeds[0]: must be >= 0, got -1"),
        (
            GOOD.replace("max_requests: 100", "max_requests: many"),
            "sweep.yaml: max_requests: expected an integer, got 'many' (a string)",
        ),
        (GOOD.replace("max_requests: 100", "max_requests: 0"), "sweep.yaml: max_requests: must be > 0, got 0"),
        (GOOD.replace("trace: burstgpt\n", ""), "sweep.yaml: trace: missing required key"),
        (GOOD.replace("trace: burstgpt", "trace:"), "sweep.yaml: trace: expected a string, got null (no value)"),
        (GOOD.replace("trace: burstgpt", "trace: ''"), "sweep.yaml: trace: must not be empty"),
        (GOOD.replace("[2x8-a100]", "2x8-a100"), "sweep.yaml: topologies: expected a list, got '2x8-a100' (a string)"),
        (GOOD.replace("{migrate_interval_s: 0.05}", "[1]"), "sweep.yaml: options: expected a mapping of keys, got a"),
        ("- a\n- b\n", "sweep.yaml: (top level): expected a mapping of keys, got a list"),
        ("7\n", "sweep.yaml: (top level): expected a mapping of keys, got 7 (an integer)"),
        ("trace: [unclosed\n", "sweep.yaml: line 2, column 1: YAML syntax error"),
        (GOOD + "trace: sharegpt\n", "sweep.yaml: line"),  # a repeated key: refused, not the last one kept
        (GOOD + "arrival: gamma\n", "sweep.yaml: arrival_cv: missing: arrival: gamma needs the inter-arrival CV"),
        (GOOD + "rate: 8\n", "sweep.yaml: rate: needs arrival: poisson or gamma"),
        (GOOD + "arrival: trace\nrate: 8\n", "sweep.yaml: rate: needs arrival: poisson or gamma"),
        (GOOD + "arrival: poisson\narrival_cv: 2\n", "sweep.yaml: arrival_cv: applies only with arrival: gamma"),
        (GOOD + "arrival: gamma\narrival_cv: 0\n", "sweep.yaml: arrival_cv: must be >= 0.001, got 0"),
        (GOOD + "arrival: burst\n", "sweep.yaml: arrival: must be one of 'trace', 'poisson' or 'gamma', got 'burst'"),
        (GOOD + "arrival: gamma\narrival_cv: 2000\n", "sweep.yaml: arrival_cv: must be <= 1000, got 2000"),
        (GOOD + "arrival: poisson\nrate: -1\n", "sweep.yaml: rate: must be > 0, got -1"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(SweepConfigError) as exc:
        load_sweep_config(write(tmp_path, text))
    assert any(e.startswith(str(tmp_path / expected)) for e in exc.value.errors), exc.value.errors


def test_an_arrival_key_that_arrival_rules_out_is_reported_with_the_other_errors(tmp_path: Path) -> None:
    """The arrival keys' rules ran after every key was valid, under "(top level)": a missing arrival_cv was said only
    once the seeds were mended, and not as arrival_cv's fault."""
    with pytest.raises(SweepConfigError) as exc:
        load_sweep_config(write(tmp_path, GOOD.replace("[3]", "[-3]") + "arrival: gamma\n"))
    assert [e.removeprefix(f"{tmp_path / 'sweep.yaml'}: ") for e in exc.value.errors] == [
        "seeds[0]: must be >= 0, got -3",
        "arrival_cv: missing: arrival: gamma needs the inter-arrival CV (e.g. 2)",
    ]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("[3]", "[true]", "seeds[0]: expected an integer, got true (a boolean)"),
        ("[0.5, 2.0]", '["1.0"]', "rate_scales[0]: expected a number, got '1.0' (a string); write it without quotes"),
        ("[0.5, 2.0]", "[false]", "rate_scales[0]: expected a number, got false (a boolean)"),
        ("max_requests: 100", "max_requests: 50.0", "max_requests: expected an integer, got 50.0 (a decimal number)"),
        ("max_requests: 100", "max_requests: '50'", "max_requests: expected an integer, got '50' (a string); write it"),
        ("[round_robin, hilum]", "[hilum, 1]", "policies[1]: expected a string, got 1 (an integer)"),
    ],
)
def test_a_value_of_another_type_is_refused_not_converted(tmp_path: Path, old: str, new: str, expected: str) -> None:
    """Strict: ``seeds: [true]`` was seed 1, ``rate_scales: ["1.0"]`` 1.0 and ``max_requests: 50.0`` 50, silently; the
    message says what was wanted and what was given in the file's words (no "Input should be", no NoneType)."""
    assert old in GOOD
    with pytest.raises(SweepConfigError) as exc:
        load_sweep_config(write(tmp_path, GOOD.replace(old, new)))
    (error,) = exc.value.errors
    assert error.startswith(f"{tmp_path / 'sweep.yaml'}: {expected}"), error


def test_an_integer_is_a_number_and_options_pass_unchanged(tmp_path: Path) -> None:
    """YAML writes 1.0 as ``1``: a rate scale of 1 stays valid, and so does an option's; ``options`` is passed to
    the runs as written, once it is valid."""
    text = GOOD.replace("[0.5, 2.0]", "[1, 2.5]").replace(
        "{migrate_interval_s: 0.05}", "{priority_fraction: 1, drain: [node-0-i0@5], autoscale: true, model: null}"
    )
    cfg = load_sweep_config(write(tmp_path, text))
    assert cfg.rate_scales == [1.0, 2.5]
    assert cfg.options == {"priority_fraction": 1, "drain": ["node-0-i0@5"], "autoscale": True, "model": None}


def test_options_are_checked_as_strictly_as_the_other_keys(tmp_path: Path) -> None:
    """``options`` were converted (``summary_lag_s: "0.2"`` ran at 0.2 s) and refused in pydantic's words ("Extra
    inputs are not permitted") without their ``options.`` path; every bad one is listed, with the other keys'."""
    text = GOOD.replace("seeds: [3]", "seeds: [-1]").replace(
        "{migrate_interval_s: 0.05}",
        "{summary_lag_s: '0.2', bogus: 1, priority_fraction: 3, drain: [nope], scale_out: a@1, autoscale: 1, "
        "initial_instances: 2.0, admission: foo}",
    )
    with pytest.raises(SweepConfigError) as exc:
        load_sweep_config(write(tmp_path, text))
    path = tmp_path / "sweep.yaml"
    assert exc.value.errors == [
        f"{path}: {line}"
        for line in (
            "seeds[0]: must be >= 0, got -1",
            "options.priority_fraction: must be <= 1, got 3",
            "options.drain: 'nope': expected INSTANCE@SECONDS, e.g. node-0-i3@30",
            "options.scale_out: expected a list, got 'a@1' (a string)",
            "options.autoscale: expected true or false, got 1 (an integer)",
            "options.initial_instances: expected an integer, got 2.0 (a decimal number)",
            "options.summary_lag_s: expected a number, got '0.2' (a string); write it without quotes",
            "options.admission: must be one of 'chunked' or 'whole-prompt', got 'foo' (a string)",
            "options.bogus: unknown key; expected one of: " + ", ".join(SimOptions.model_fields),
        )
    ]


def test_a_sweep_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_bytes(GOOD.replace("burstgpt", "caf\xe9").encode("latin-1"))
    with pytest.raises(SweepConfigError) as exc:
        load_sweep_config(path)
    assert exc.value.errors == [f"{path}: (file): not UTF-8 text (byte 0xe9 at offset 10); save it as UTF-8"]


def test_an_empty_sweep_file_says_so(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(SweepConfigError) as exc:
        load_sweep_config(path)
    assert exc.value.errors == [f"{path}: (top level): expected a mapping of keys, got an empty file"]


def test_grid_order_topology_policy_rate_seed() -> None:
    cfg = SweepConfig(trace="t", topologies=["a", "b"], policies=["p", "q"], rate_scales=[1.0], seeds=[0, 1])
    labels = [p.label() for p in grid_points(cfg)]
    assert labels == [
        "a/p/x1/seed0",
        "a/p/x1/seed1",
        "a/q/x1/seed0",
        "a/q/x1/seed1",
        "b/p/x1/seed0",
        "b/p/x1/seed1",
        "b/q/x1/seed0",
        "b/q/x1/seed1",
    ]


def test_plot_file_names_are_unique_per_topology() -> None:
    topologies = ["2x8-a100", "a/x.yaml", "b/x.yaml", "a/x.yaml", "c/x.yml"]
    assert plot_file_names(topologies) == {
        "2x8-a100": "p99_ttft_vs_load_2x8-a100.png",
        "a/x.yaml": "p99_ttft_vs_load_x.png",
        "b/x.yaml": "p99_ttft_vs_load_x_2.png",
        "c/x.yml": "p99_ttft_vs_load_x_3.png",
    }


def test_plot_file_name() -> None:
    assert plot_file_name("2x8-a100") == "p99_ttft_vs_load_2x8-a100.png"
    assert plot_file_name("conf/my cluster.yaml") == "p99_ttft_vs_load_my_cluster.png"


# ------------------------------------------------------------------------------- fake simulations
# Module-level so that Ray can ship them to its workers (pickled by value, see the fixture).


def fake_run(point: GridPoint) -> SimRun:
    """Ten requests with TTFT = base x rate_scale s, base 0.1 for hilum and 0.4 otherwise."""
    ttft_s = (0.1 if point.policy == "hilum" else 0.4) * point.rate_scale
    requests = tuple(
        RequestRecord(
            request_id=f"r{i}",
            priority=0,
            arrival_s=float(i),
            prompt_tokens=10,
            output_tokens=2,
            generated_tokens=2,
            first_token_s=i + ttft_s,
            finish_s=i + ttft_s + 0.05,
            token_gaps_s=(0.05,),
            preemptions=0,
            preempted_s=0.0,
            migrations=0,
            refused=None,
            instance_id="i0",
        )
        for i in range(10)
    )
    return SimRun(
        policy=point.policy,
        topology=point.topology,
        trace=point.trace,
        seed=point.seed,
        rate_scale=point.rate_scale,
        sim_duration_s=10.0,
        wall_s=0.5,
        engine_steps=20,
        requests=requests,
        migrations=(),
        kv=KvTimeline.empty(),
        config=dict(point.options),
    )


def failing_run(point: GridPoint) -> SimRun:
    raise RuntimeError(f"no such topology {point.topology!r}")


def test_run_point_summarises_and_names_failures() -> None:
    point = GridPoint("a", "t", "hilum", 2.0, None, 0, {})
    row = run_point(point, fake_run)
    assert (row.topology, row.policy, row.rate_scale, row.seed) == ("a", "hilum", 2.0, 0)
    assert row.summary.ttft_p99_s == pytest.approx(0.2)
    with pytest.raises(SweepPointError, match=r"grid point a/hilum/x2/seed0: RuntimeError: no such topology 'a'"):
        run_point(point, failing_run)


def test_default_run_fn_builds_the_runner_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without run_fn, a grid point becomes sim.runner.SimSpec (here a stand-in) for run_simulation."""
    seen: list[Mapping[str, object]] = []

    class SimSpec:
        def __init__(self, **fields: object) -> None:
            self.fields = fields

    def run_simulation(spec: SimSpec, trace: object = None) -> SimRun:
        seen.append({**spec.fields, "trace given": trace is not None})
        return fake_run(GridPoint("a", "t", "hilum", 1.0, 5, 2, {}))

    stand_in = types.ModuleType("sim.runner")
    stand_in.SimSpec = SimSpec  # type: ignore[attr-defined]
    stand_in.run_simulation = run_simulation  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sim.runner", stand_in)
    row = run_point(GridPoint("a", "t", "hilum", 1.0, 5, 2, {"k": 1}))
    assert seen == [
        {
            "topology": "a",
            "trace": "t",
            "policy": "hilum",
            "rate_scale": 1.0,
            "max_requests": 5,
            "seed": 2,
            "options": {"k": 1},
            "config": None,
            "trace given": False,  # the runner loads it from the spec
        }
    ]
    assert row.summary.requests == 10


def test_a_sweep_with_synthetic_arrivals_runs_what_hilum_sim_runs(tmp_path: Path) -> None:
    """``arrival``, ``rate`` and ``arrival_cv`` draw the arrivals per seed, as ``hilum sim --arrival gamma --rate R
    --arrival-cv C --seed S`` does: each grid point's figures are that command's (it could not sweep them before)."""
    from sim.runner import SimSpec, run_simulation
    from sim.traces import load_trace

    text = "trace: sharegpt\ntopologies: [2x8-a100-40gb]\npolicies: [least-loaded]\nrate_scales: [1, 2]\n"
    text += "seeds: [0, 1]\nmax_requests: 60\narrival: gamma\nrate: 4\narrival_cv: 3\n"
    config = load_sweep_config(write(tmp_path, text))
    points = grid_points(config)
    assert [(p.arrival, p.rate_per_s, p.arrival_cv) for p in points] == [("gamma", 4.0, 3.0)] * 4
    rows = [run_point(p) for p in points]
    for point, row in zip(points, rows, strict=True):
        trace = load_trace(
            "sharegpt",
            rate_scale=point.rate_scale,
            max_requests=60,
            seed=point.seed,
            arrival="gamma",
            rate_per_s=4.0,
            arrival_cv=3.0,
        )
        spec = SimSpec("2x8-a100-40gb", "sharegpt", "least-loaded", point.rate_scale, 60, point.seed)
        alone = summarize(run_simulation(spec, trace=trace))
        assert (row.summary.ttft_p99_s, row.summary.sim_duration_s) == (alone.ttft_p99_s, alone.sim_duration_s)
    durations = {(p.rate_scale, p.seed): r.summary.sim_duration_s for p, r in zip(points, rows, strict=True)}
    assert durations[(1.0, 0)] != durations[(1.0, 1)]  # the seed draws other arrivals
    assert durations[(2.0, 0)] < durations[(1.0, 0)]  # twice the rate: the same requests sooner


# ------------------------------------------------------------------------------------------ on Ray


def test_sweep_starts_and_stops_its_own_local_ray(local_ray: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Ray running: run_sweep starts a local one (all cores, no dashboard) and shuts it down.

    The session's Ray does the work; ``ray.is_initialized``, ``ray.init`` and ``ray.shutdown`` are watched, so
    no second Ray is started in this process.
    """
    import ray

    calls: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(calls))  # "not running" until run_sweep starts it
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("shutdown", {})))
    cfg = SweepConfig(trace="t", topologies=["a"], policies=["hilum"], rate_scales=[1.0])
    rows = run_sweep(cfg, run_fn=fake_run, progress=False)
    assert [r.summary.ttft_p99_s for r in rows] == pytest.approx([0.1])
    hook = {"worker_process_setup_hook": "hilum_compiled.install"}
    started = {"num_cpus": os.cpu_count() or 1, "include_dashboard": False, "runtime_env": hook}
    assert calls == [("init", started), ("shutdown", {})]
    assert ray_runtime_env() == hook and ray_runtime_env() is not ray_runtime_env()  # ray.init adds to its dict


def test_ray_workers_run_the_compiled_simulator_when_it_is_built(local_ray: None) -> None:
    """The session's Ray has ray_runtime_env(), as the one a sweep starts: its workers install the compiled modules
    before the first task imports the simulator."""
    import ray

    import hilum_compiled
    from hilum_compiled import build_dir, stale_sources

    def probe() -> tuple[bool, str]:
        import sim.cluster  # as a grid point's run imports it

        return hilum_compiled.compiled(sim.cluster), hilum_compiled.status()

    compiled, status = ray.get(ray.remote(num_cpus=0)(probe).remote())
    built = not stale_sources(build_dir()) and not os.environ.get(hilum_compiled.PURE_ENV)
    assert compiled is built, status


@pytest.fixture(scope="module")
def local_ray(ray_session: None) -> Iterator[None]:
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    # pytest imports this file as a top-level module that Ray's workers cannot import; ship the
    # fake run functions by value instead.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_sweep_on_ray_merges_table_json_and_plot(local_ray: None, tmp_path: Path) -> None:
    cfg = load_sweep_config(write(tmp_path, GOOD))
    rows = run_sweep(cfg, run_fn=fake_run, out_dir=tmp_path / "out", progress=False)
    assert [(r.policy, r.rate_scale, r.seed) for r in rows] == [
        ("round_robin", 0.5, 3),
        ("round_robin", 2.0, 3),
        ("hilum", 0.5, 3),
        ("hilum", 2.0, 3),
    ]
    assert [r.summary.ttft_p99_s for r in rows] == pytest.approx([0.2, 0.8, 0.05, 0.2])
    assert load_sweep(tmp_path / "out" / "sweep.json") == rows
    doc = json.loads((tmp_path / "out" / "sweep.json").read_text())
    documented = set(re.findall(r"^\| `([a-z_0-9]+)`", DOC.read_text(), flags=re.MULTILINE))
    assert (set(doc) | set(doc["rows"][0]) | set(doc["config"])) - documented == set()
    assert doc["config"]["options"] == {"migrate_interval_s": 0.05}
    plot = tmp_path / "out" / "p99_ttft_vs_load_2x8-a100.png"
    assert plot.read_bytes()[:4] == b"\x89PNG" and plot.stat().st_size > 5000
    table = format_sweep_table(rows)
    lines = [line for line in table.splitlines() if line.startswith("│ 2x8-a100")]
    assert [[c.strip() for c in line.strip("│").split("│")][8] for line in lines] == [
        "200.0",
        "800.0",
        "50.0",
        "200.0",
    ]


def test_sweep_on_ray_reports_the_failing_point(local_ray: None, tmp_path: Path) -> None:
    cfg = SweepConfig(trace="t", topologies=["bad"], policies=["p"], rate_scales=[1.0])
    with pytest.raises(SweepPointError, match="grid point bad/p/x1/seed0"):
        run_sweep(cfg, run_fn=failing_run, progress=False)
    assert os.environ.get("RAY_AUTH_MODE") == "disabled"  # still inside the module's Ray session
