"""Parameter sweeps of the simulator: a YAML grid of policies x rate scales x seeds x topologies,
each grid point run as one Ray task, merged into one table, ``sweep.json`` and P99-TTFT-vs-load plots.

Example sweep file (every key documented in docs/sim-results.md)::

    trace: azure-conv
    topologies: [2x8-a100]
    policies: [round-robin, llumnix, hilum]
    rate_scales: [0.5, 1.0, 2.0]
    seeds: [0, 1]
    max_requests: 2000
    options: {migrate_interval_s: 0.05}

Ray is an optional dependency (``pip install 'hilum[sweep]'``) and is imported only by
:func:`run_sweep`. A local Ray is started when none is running and no address is given; set
``RAY_AUTH_MODE=disabled`` in the environment to opt out of Ray's token authentication.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sim.results import (
    ResultsError,
    SimRun,
    SweepRow,
    atomic_file,
    json_default,
    summarize,
    summary_from_dict,
    summary_to_dict,
)
from sim.traces import MAX_ARRIVAL_CV, MIN_ARRIVAL_CV, ArrivalKind
from topology.load import YamlFileError, pydantic_message, read_yaml_file, shown_value

__all__ = [
    "SWEEP_FILE_NAME",
    "SWEEP_SCHEMA_VERSION",
    "GridPoint",
    "RunFn",
    "SweepConfig",
    "SweepConfigError",
    "SweepOutput",
    "SweepPointError",
    "SweepRow",
    "grid_points",
    "load_sweep",
    "load_sweep_config",
    "plot_file_name",
    "run_point",
    "run_sweep",
    "write_sweep",
]

SWEEP_SCHEMA_VERSION = 1
"""Version of the ``sweep.json`` layout (docs/sim-results.md)."""

SWEEP_FILE_NAME = "sweep.json"


class SweepConfigError(ValueError):
    """A sweep file is invalid. ``errors`` holds one ``"<file>: <key.path>: <message>"`` per problem; the message is
    one per line, as a configuration file's errors are (:class:`hilum_config.ConfigError`)."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class SweepPointError(RuntimeError):
    """A grid point's simulation failed; the message names the grid point and the original error."""


_PositiveFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
_ArrivalCV = Annotated[float, Field(ge=MIN_ARRIVAL_CV, le=MAX_ARRIVAL_CV)]
_NonNegativeInt = Annotated[int, Field(ge=0)]
_Name = Annotated[str, Field(min_length=1)]


class SweepConfig(BaseModel):
    """The grid of one sweep, as written in its YAML file. Unknown keys are errors. Strict: a value of another type
    is refused, not converted (``seeds: [true]``, ``rate_scales: ["1.0"]``, ``max_requests: 50.0``); an integer is
    a number (``rate_scales: [1]``, as YAML writes 1.0)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    trace: _Name  # trace name or file, as accepted by sim.traces.load_trace
    topologies: list[_Name] = Field(min_length=1)  # topology names or files
    policies: list[_Name] = Field(min_length=1)  # scheduling policy names
    rate_scales: list[_PositiveFloat] = Field(min_length=1)  # arrival-rate multipliers (1.0 = trace)
    seeds: list[_NonNegativeInt] = Field(default_factory=lambda: [0], min_length=1)  # one run per seed
    max_requests: Annotated[int, Field(gt=0)] | None = None  # first N requests of the trace; None = all
    options: dict[str, Any] = Field(default_factory=dict)  # passed unchanged to every run (SimSpec.options)
    config: _Name | None = None  # the hilum configuration file of every run (hilum_config); None = defaults
    # The arrival process, as hilum sim's --arrival, --rate and --arrival-cv: None = the trace's timestamps where it
    # has them, else Poisson. Synthetic arrivals are drawn per seed, so a sweep over seeds samples the process.
    arrival: ArrivalKind | None = None
    rate: _PositiveFloat | None = None  # synthetic arrivals per second, before each rate scale
    # the Gamma inter-arrival CV; checked when absent too (arrival: gamma needs it)
    arrival_cv: _ArrivalCV | None = Field(default=None, validate_default=True)

    @field_validator("topologies", "policies", "rate_scales", "seeds")
    @classmethod
    def _no_duplicates(cls, values: list[Any]) -> list[Any]:
        duplicates = sorted({repr(v) for v in values if values.count(v) > 1})
        if duplicates:
            raise ValueError(f"duplicate entries: {', '.join(duplicates)}")
        return values

    # The arrival keys that depend on ``arrival`` are checked on themselves, so that an error names its key (fields
    # are validated in order: ``arrival`` before them; a wrong ``arrival`` is reported on its own).
    @field_validator("rate")
    @classmethod
    def _rate_needs_synthetic(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and "arrival" in info.data and info.data["arrival"] not in ("poisson", "gamma"):
            raise ValueError("needs arrival: poisson or gamma (a sweep names its synthetic process)")
        return value

    @field_validator("arrival_cv")
    @classmethod
    def _cv_with_gamma(cls, value: float | None, info: ValidationInfo) -> float | None:
        if "arrival" not in info.data:
            return value
        if value is None and info.data["arrival"] == "gamma":
            raise ValueError("missing: arrival: gamma needs the inter-arrival CV (e.g. 2)")
        if value is not None and info.data["arrival"] != "gamma":
            raise ValueError("applies only with arrival: gamma")
        return value


def _loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def load_sweep_config(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML file.

    Raises:
        SweepConfigError: on a file that is not UTF-8 text, unreadable YAML, a top level that is not a mapping,
            unknown keys, wrong types (none converted: ``seeds: [true]`` is refused), empty lists, duplicates or
            non-positive rate scales; each error reads ``"<file>: <key.path>: <message>"`` (e.g. ``sweep.yaml:
            rate_scales[1]: must be > 0, got -2.0``); the file unreadable, not UTF-8 or not YAML too
            (:func:`topology.load.read_yaml_file`).
        OSError: if the path is empty.
    """
    if not str(path).strip():
        raise OSError("the sweep file's path is empty: give a sweep YAML file (docs/sim-results.md)")
    p = Path(path)
    try:
        data = read_yaml_file(p, "the sweep file")
    except YamlFileError as exc:
        raise SweepConfigError([f"{p}: {exc}"]) from None
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else shown_value(data)
        raise SweepConfigError([f"{p}: (top level): expected a mapping of keys, got {got}"])
    errors: list[str] = []
    try:
        config = SweepConfig.model_validate(data)
    except ValidationError as exc:
        errors = [f"{p}: {_loc(e['loc'])}: {pydantic_message(e, SweepConfig.model_fields)}" for e in exc.errors()]
    options = data.get("options")
    if isinstance(options, Mapping):
        errors += [f"{p}: {line}" for line in _option_errors(options)]
    if errors:
        raise SweepConfigError(errors)
    return config


def _option_errors(options: Mapping[Any, Any]) -> list[str]:
    """The errors of a sweep file's ``options`` against ``sim.runner.SimOptions``, each ``options.<key>: <message>``,
    as strict as the file's other keys (``summary_lag_s: "0.2"`` is refused, not converted)."""
    from sim.runner import SimOptions  # lazy: the simulator core is not needed to plan a sweep

    # a YAML list is what a tuple option takes (strict, pydantic would refuse it)
    lists = {name for name, f in SimOptions.model_fields.items() if get_origin(f.annotation) is tuple}
    given = {k: tuple(v) if k in lists and isinstance(v, list) else v for k, v in options.items()}
    try:
        SimOptions.model_validate(given, strict=True)
    except ValidationError as exc:
        return [f"{_loc(('options', *e['loc']))}: {pydantic_message(e, SimOptions.model_fields)}" for e in exc.errors()]
    return []


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One simulation of a sweep; the same fields as ``sim.runner.SimSpec``."""

    topology: str  # topology name or file
    trace: str  # trace name or file
    policy: str  # scheduling policy name
    rate_scale: float  # arrival-rate multiplier
    max_requests: int | None  # first N requests of the trace; None = all
    seed: int  # seed of the run's random sources
    options: Mapping[str, object] = field(default_factory=dict)  # extra runner options
    config: str | None = None  # the hilum configuration file (hilum_config); None = defaults
    arrival: ArrivalKind | None = None  # arrival process (SweepConfig.arrival); None = the trace's own, or Poisson
    rate_per_s: float | None = None  # synthetic arrivals per second, before the rate scale
    arrival_cv: float | None = None  # Gamma inter-arrival CV

    def label(self) -> str:
        """A short human-readable name, e.g. ``2x8-a100/hilum/x1.5/seed0``."""
        return f"{self.topology}/{self.policy}/x{self.rate_scale:g}/seed{self.seed}"


RunFn = Callable[[GridPoint], SimRun]
"""Runs one grid point. Must be picklable (a module-level function) to travel to Ray workers."""


@dataclass(frozen=True, slots=True)
class SweepOutput:
    """Files written by :func:`write_sweep`."""

    json_path: Path  # sweep.json
    plot_paths: Mapping[str, Path]  # topology -> its P99-TTFT-vs-load PNG


def grid_points(config: SweepConfig) -> list[GridPoint]:
    """All grid points, in the order topology, policy, rate scale, seed (outermost first)."""
    return [
        GridPoint(
            topology=topology,
            trace=config.trace,
            policy=policy,
            rate_scale=rate_scale,
            max_requests=config.max_requests,
            seed=seed,
            options=dict(config.options),
            config=config.config,
            arrival=config.arrival,
            rate_per_s=config.rate,
            arrival_cv=config.arrival_cv,
        )
        for topology in config.topologies
        for policy in config.policies
        for rate_scale in config.rate_scales
        for seed in config.seeds
    ]


def _run_with_simulator(point: GridPoint) -> SimRun:
    """Default :data:`RunFn`: ``sim.runner.run_simulation`` on the point's ``SimSpec`` (and its trace loaded with the
    point's arrival process, as ``hilum sim`` loads it)."""
    from sim.runner import SimSpec, run_simulation  # lazy: the simulator core is not needed to plan a sweep
    from sim.traces import load_trace

    spec = SimSpec(
        topology=point.topology,
        trace=point.trace,
        policy=point.policy,
        rate_scale=point.rate_scale,
        max_requests=point.max_requests,
        seed=point.seed,
        options=dict(point.options),
        config=point.config,
    )
    trace = None
    if point.arrival is not None:
        trace = load_trace(
            point.trace,
            rate_scale=point.rate_scale,
            max_requests=point.max_requests,
            seed=point.seed,
            arrival=point.arrival,
            rate_per_s=point.rate_per_s,
            arrival_cv=point.arrival_cv,
        )
    run: SimRun = run_simulation(spec, trace=trace)
    return run


def run_point(point: GridPoint, run_fn: RunFn | None = None) -> SweepRow:
    """Run one grid point with ``run_fn`` (default: the simulator) and summarise it.

    This is the function each Ray task executes; it is module-level so Ray can pickle it.

    Raises:
        SweepPointError: if the run fails; the message names the grid point.
    """
    fn = run_fn if run_fn is not None else _run_with_simulator
    try:
        run = fn(point)
    except Exception as exc:
        raise SweepPointError(f"grid point {point.label()}: {type(exc).__name__}: {exc}") from exc
    scaled = run.config.get("derived_latency_models")  # the run's step times scaled from another GPU's
    return SweepRow(
        topology=point.topology,
        trace=point.trace,
        policy=point.policy,
        rate_scale=point.rate_scale,
        seed=point.seed,
        max_requests=point.max_requests,
        summary=summarize(run),
        derived_latency_models=tuple(map(str, scaled)) if isinstance(scaled, list) else (),
    )


def ray_runtime_env() -> dict[str, Any]:
    """The runtime environment of the Ray ``run_sweep`` starts or connects to (a new dict each call: ``ray.init``
    adds to the one it is given). Every worker installs the simulator's compiled modules (``hilum_compiled.install``,
    when built and current) as it starts, as ``hilum sim`` does before it imports the simulator: a worker imports
    the simulator when it unpickles its first task, too late to install them then, and would run every grid point
    as plain Python (about 3x slower)."""
    return {"worker_process_setup_hook": "hilum_compiled.install"}


#: How long :func:`_probe_ray` waits for a TCP connection to a Ray address, seconds.
RAY_PROBE_TIMEOUT_S = 5.0


def _probe_ray(address: str, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Refuse at once a ``HOST:PORT`` (or ``ray://HOST:PORT``) where nothing accepts a TCP connection within
    ``timeout_s``: ``ray.init`` retries such an address for minutes (Ray 2.60: over two and a half) with nothing
    but its own log lines. Other forms (``auto``, ``local``, an address Ray cannot read) are left to Ray.

    Raises ValueError for a port outside 1-65535 (a usage error), ConnectionError naming the address and what to
    do.
    """
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    if not 0 < int(port) < 65536:
        raise ValueError(f"--ray-address {address}: port {port} is outside 1-65535")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else exc.strerror or exc
        raise ConnectionError(
            f"--ray-address {address}: nothing accepts a connection there ({why}): start Ray on that host "
            "(`ray start --head`) and give the address it prints, or leave --ray-address out for a local Ray"
        ) from None


def run_sweep(
    config: SweepConfig,
    *,
    ray_address: str | None = None,
    run_fn: RunFn | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> list[SweepRow]:
    """Run every grid point of ``config`` as a Ray task (1 CPU each) and return the rows in grid order.

    Uses the running Ray if ``ray.is_initialized()``; otherwise connects to ``ray_address``, or
    starts a local Ray with one CPU slot per core (``os.cpu_count()``) and no dashboard, and shuts
    it down at the end; either with :func:`ray_runtime_env` (its workers run the compiled simulator when built;
    a Ray started elsewhere should be given it too). A rich progress bar on stderr counts finished points
    (``progress=False`` turns it off). With ``out_dir``, :func:`write_sweep` writes ``sweep.json`` and one plot per
    topology there.

    Raises:
        ImportError: if Ray is not installed (install the ``sweep`` extra).
        ValueError: ``ray_address`` is not an address Ray can read.
        ConnectionError: nothing accepts a connection at ``ray_address`` (within ``RAY_PROBE_TIMEOUT_S``), or no
            Ray cluster answers there.
        SweepPointError: (as Ray's task error) if a grid point's run fails.
    """
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("hilum sim sweep needs Ray: pip install 'hilum[sweep]'") from exc

    points = grid_points(config)
    started = False
    on_sigterm = signal.getsignal(signal.SIGTERM)  # Ray's init replaces it; the caller's (hilum sim: Ctrl-C's) stays
    if not ray.is_initialized():
        if ray_address is None:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, runtime_env=ray_runtime_env())
        else:
            _probe_ray(ray_address)
            try:
                ray.init(address=ray_address, runtime_env=ray_runtime_env())
            except ValueError as exc:  # Ray's word for an address it cannot parse
                raise ValueError(f"--ray-address {ray_address}: {exc}") from None
            except (ConnectionError, RuntimeError) as exc:  # no Ray cluster answers there
                raise ConnectionError(f"--ray-address {ray_address}: cannot connect to Ray: {exc}") from None
        started = True
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    try:
        remote_run: Any = ray.remote(num_cpus=1)(run_point)  # Ray's stubs type only positional calls
        index_of = {remote_run.remote(p, run_fn): i for i, p in enumerate(points)}
        rows: list[SweepRow | None] = [None] * len(points)
        pending = list(index_of)
        console = Console(stderr=True)
        with Progress(
            TextColumn("sweep"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not progress,
        ) as bar:
            task = bar.add_task("sweep", total=len(points))
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    rows[index_of[ref]] = ray.get(ref)
                    bar.advance(task)
    finally:
        if started:
            ray.shutdown()
    result = [r for r in rows if r is not None]
    if out_dir is not None:
        write_sweep(result, out_dir, config=config)
    return result


def plot_file_name(topology: str) -> str:
    """File name of a topology's P99-TTFT-vs-load plot: ``p99_ttft_vs_load_<topology>.png``.

    A topology given as a file contributes its stem; characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``_``.
    """
    name = Path(topology).stem if topology.endswith((".yaml", ".yml")) else topology
    return f"p99_ttft_vs_load_{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.png"


def _row_dict(row: SweepRow) -> dict[str, Any]:
    return {
        "topology": row.topology,
        "trace": row.trace,
        "policy": row.policy,
        "rate_scale": row.rate_scale,
        "seed": row.seed,
        "max_requests": row.max_requests,
        "derived_latency_models": list(row.derived_latency_models),
        "summary": summary_to_dict(row.summary),
    }


def write_sweep(rows: Sequence[SweepRow], out_dir: str | Path, *, config: SweepConfig | None = None) -> SweepOutput:
    """Write ``sweep.json`` and one P99-TTFT-vs-load PNG per topology into ``out_dir``.

    Raises:
        OSError: if the files cannot be written.
    """
    from sim.plots import plot_p99_vs_load  # lazy: keeps matplotlib out of the Ray workers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema_version": SWEEP_SCHEMA_VERSION,
        "config": config.model_dump(mode="json") if config is not None else None,
        "rows": [_row_dict(r) for r in rows],
    }
    json_path = out / SWEEP_FILE_NAME
    text = json.dumps(doc, indent=1, allow_nan=False, default=json_default) + "\n"
    with atomic_file(json_path) as f:  # whole or not at all
        f.write(text)
    plots: dict[str, Path] = {}
    for topology, name in plot_file_names(r.topology for r in rows).items():
        plots[topology] = plot_p99_vs_load(
            [r for r in rows if r.topology == topology], out / name, title=f"P99 TTFT vs load: {topology}"
        )
    return SweepOutput(json_path=json_path, plot_paths=plots)


def plot_file_names(topologies: Iterable[str]) -> dict[str, str]:
    """The plot file name of each topology (in first-seen order), as :func:`write_sweep` writes them:
    :func:`plot_file_name`, with ``_<k>`` before ``.png`` where two topology files share a stem."""
    names: dict[str, str] = {}
    for topology in dict.fromkeys(topologies):
        name = plot_file_name(topology)
        if name in names.values():
            name = name.removesuffix(".png") + f"_{len(names)}.png"
        names[topology] = name
    return names


def load_sweep(path: str | Path) -> list[SweepRow]:
    """Read the rows of a ``sweep.json`` written by :func:`write_sweep`.

    Raises:
        ResultsError: on invalid JSON, another schema version or a missing key (names file and key).
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{p}: not valid JSON: {exc}") from exc
    if not isinstance(doc, Mapping) or doc.get("schema_version") != SWEEP_SCHEMA_VERSION:
        raise ResultsError(f"{p}: schema_version: expected {SWEEP_SCHEMA_VERSION}")
    rows = doc.get("rows")
    if not isinstance(rows, list):
        raise ResultsError(f"{p}: rows: expected a list")
    out: list[SweepRow] = []
    for i, obj in enumerate(rows):
        where = f"{p}: rows[{i}]"
        if not isinstance(obj, Mapping):
            raise ResultsError(f"{where}: expected an object")
        try:
            out.append(
                SweepRow(
                    topology=obj["topology"],
                    trace=obj["trace"],
                    policy=obj["policy"],
                    rate_scale=obj["rate_scale"],
                    seed=obj["seed"],
                    max_requests=obj["max_requests"],
                    summary=summary_from_dict(obj["summary"], f"{where}.summary"),
                    derived_latency_models=tuple(obj.get("derived_latency_models", ())),
                )
            )
        except KeyError as exc:
            raise ResultsError(f"{where}: missing key {exc.args[0]!r}") from exc
    return out
