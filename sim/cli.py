"""`hilum sim`: replay a trace on a simulated cluster under several policies and compare them.

A bare `hilum sim` runs the embedded defaults: the bundled 2 x 8 A100-40GB topology (16 Llama-2-13B
instances, two NVLink domains), the first 5,000 requests of the Azure LLM 2023 conversation trace
compressed 2.75x (a load where the baselines preempt), and all four policies.
`hilum sim sweep CONFIG` runs a grid of simulations as Ray tasks. See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from hilum_config import CONFIG_ENV, DEFAULTS_SOURCE, ConfigError, HilumConfig, load_config
from hilum_config import add_argument as add_config_argument
from llumlet.engine.latency import scaled_latency_models, scaled_note
from topology.load import BUNDLED_NAMES

from .results import RESULTS_FILE_NAME, atomic_file
from .runner import (
    DEFAULTS,
    SimOptions,
    SimSpec,
    check_autoscale,
    check_prefix_aware,
    check_prefix_cache,
    fit_to_context,
    served_model,
)
from .schedulers import POLICY_NAMES, domain_request, policy_migrates
from .traces import DEFAULT_SYNTHETIC_RATE_PER_S, MAX_ARRIVAL_CV, MIN_ARRIVAL_CV, TRACE_NAMES

if TYPE_CHECKING:
    from topology.spec import InstanceSpec, Topology

    from .results import PolicySummary
    from .sweep import SweepConfig
    from .traces import Trace


def register(sub: Any, summary: str) -> None:
    """Add ``hilum sim`` (and ``hilum sim sweep``) to an argparse sub-parsers action; ``summary``: its help."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "sim",
        help=summary,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.register("action", None, _Once)  # an option of one value, given twice, is refused (argparse: the last)
    _add_run_arguments(parser)
    parser.set_defaults(func=run_cli)
    sims = parser.add_subparsers(dest="sim_command", metavar="{sweep,size}")
    sweep = sims.add_parser("sweep", help="run a grid of simulations as Ray tasks")
    sweep.register("action", None, _Once)
    sweep.add_argument("config", help="sweep YAML file (see docs/sim-results.md)")
    sweep.add_argument("--ray-address", default=None, help="existing Ray cluster (default: a local Ray)")
    sweep.add_argument(
        "--out", default="sweep-results", help="directory for sweep.json and plots (default sweep-results)"
    )
    # a run option before 'sweep' would be silently ignored: _SimParser lists them (before_sub), run_sweep_cli refuses
    sweep.set_defaults(func=run_sweep_cli)
    size = sims.add_parser(
        "size",
        help="the smallest static fleet meeting a P99 TTFT target, per policy (each size a real simulation)",
        description="Bisect over static fleet sizes (--initial-instances) for the smallest that meets "
        "--target-p99-ttft-ms, per policy; every size simulated is shown with its GPU-hours (sim/sizing.py). "
        "The run options may go before or after 'size' (given in both places, the one after wins). The search "
        "assumes more instances are never slower: on a few requests noise can break that (the table shows "
        "every size tried).",
    )
    size.register("action", None, _Once)
    size.add_argument("--target-p99-ttft-ms", type=float, required=True, metavar="MS", help="the P99 TTFT target")
    _add_run_arguments(size, sizing=True)
    for action in size._actions:  # what is given before 'size' counts too: only what follows it overrides it
        if action.option_strings and action.dest not in ("help", "target_p99_ttft_ms"):
            action.default = argparse.SUPPRESS
    size.set_defaults(func=run_size_cli)
    # A misspelt option (--polcy hilum) would otherwise read as an invalid {sweep,size} choice: its value is taken
    # for the sub-command. _SimParser's checks name it first; they run before the parser's own class (hilum's, which
    # names the closest of an invalid sub-command).
    parser.__class__ = type("SimParser", (_SimParser, type(parser)), {})
    assert isinstance(parser, _SimParser)
    parser.known_options = frozenset(o for p in (parser, sweep, size) for a in p._actions for o in a.option_strings)
    parser.own_options = {
        name: frozenset(o for a in p._actions for o in a.option_strings)
        for name, p in (("sim", parser), ("sweep", sweep), ("size", size))
    }
    parser.sub_parsers = {"sweep": sweep, "size": size}


class _SimParser(argparse.ArgumentParser):
    """The ``hilum sim`` parser. Before argparse parses the words it refuses, each by name:

    - an option it does not know (:func:`_unknown_options`, with the closest known one);
    - an option of ``sweep`` or ``size`` alone given before (or without) its sub-command, abbreviated or not
      (``--target-p99-ttft-ms 500`` read as the invalid sub-command ``'500'``), naming a misspelt sub-command;
    - after ``sweep`` or ``size``, an option the sub-command does not take (argparse's error named neither).

    After argparse, words left over (``hilum sim sweep a.yaml extra``) are refused with the usage of the sub-command
    they were given to (argparse's top-level parser showed ``hilum``'s). The options given before ``sweep`` are left
    in the namespace (``before_sub``, as typed): ``run_sweep_cli`` refuses them (a sweep's runs are set in its file).
    Mixed in before the class of the parser ``register`` is given (``hilum``'s names the closest of an invalid
    sub-command). ``known_options``: every option string of ``hilum sim``, ``sweep`` and ``size``; ``own_options``:
    each one's own (``sim``, ``sweep``, ``size``); ``sub_parsers``: the parsers of ``sweep`` and ``size``."""

    known_options: frozenset[str] = frozenset()
    own_options: dict[str, frozenset[str]] = {}  # noqa: RUF012 - set once per parser by register()
    sub_parsers: dict[str, argparse.ArgumentParser] = {}  # noqa: RUF012 - set once per parser by register()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        words = list(sys.argv[1:] if args is None else args)  # read once: an iterator would be spent by the check
        end = next((k for k, w in enumerate(words) if w in ("sweep", "size", "--")), len(words))
        sub = words[end] if end < len(words) and words[end] != "--" else None
        # the sub-command's usage when every unknown option follows it
        unknown, after = _unknown_options(words[:end], self.known_options), []
        if sub is not None:
            after = _unknown_options(words[end + 1 :], self.known_options)
        if unknown or after:  # exits 2, with the usage, as argparse does for its own errors
            (self if unknown or sub is None else self.sub_parsers[sub]).error(
                f"unrecognized arguments: {', '.join(unknown + after)}"
            )
        before = [w.split("=", 1)[0] for w in words[:end] if _is_option(w)]
        for name in before:
            owner = _owner(name, self.own_options)
            if owner is not None:
                hint = "" if sub is not None else _sub_command_hint(words[:end])
                self.error(f"{_resolved(name, self.own_options[owner])} is an option of 'hilum sim {owner}': give it "
                           f"after '{owner}'{hint}")  # fmt: skip
        if sub is not None:
            tail = words[end + 1 :]
            stop = tail.index("--") if "--" in tail else len(tail)
            alien = [w.split("=", 1)[0] for w in tail[:stop] if _is_option(w)]
            alien = [n for n in alien if not _matches(n, self.own_options[sub])]
            if alien:
                where = "its runs are set in its file" if sub == "sweep" else "it takes a run's options and its target"
                self.sub_parsers[sub].error(
                    f"{', '.join(alien)}: not an option of 'hilum sim {sub}' ({where}; see --help)"
                )
        parsed, extras = super().parse_known_args(words, namespace)
        if extras:  # hilum's parser would name them under its own usage
            (self if sub is None else self.sub_parsers[sub]).error(f"unrecognized arguments: {' '.join(extras)}")
        if hasattr(parsed, _Once.GIVEN):  # _Once's record, kept while parsing only
            delattr(parsed, _Once.GIVEN)
        parsed.before_sub = before if sub == "sweep" else []
        return parsed, extras


class _Once(argparse._StoreAction):
    """argparse's ``store`` action, refusing an option given twice to one parser (argparse keeps the last value:
    ``--seed 1 --seed 2`` ran seed 2 alone, ``--policy llumnix --policy hilum`` hilum alone). The default action of
    the ``hilum sim``, ``sweep`` and ``size`` parsers: a run option given before ``size`` and again after it is
    still overridden there (the two are parsed apart). The options given are kept in the namespace under ``GIVEN``
    while it is parsed."""

    GIVEN = "_given_once"

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        given: set[str] = vars(namespace).setdefault(self.GIVEN, set())
        if self.dest in given:
            before = getattr(namespace, self.dest)
            hint = (
                f"give the policies in one --policy, separated by commas (--policy {before},{values})"
                if self.dest == "policy"
                else "give it once"
            )
            raise argparse.ArgumentError(self, f"given twice ({before!r}, then {values!r}): {hint}")  # names it
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class _OnceSwitch(argparse.BooleanOptionalAction):
    """argparse's on/off pair (``--prefix-caching`` / ``--no-prefix-caching``), refusing the pair given twice in
    one parser, either way round (argparse keeps the last: ``--prefix-caching --no-prefix-caching`` ran without)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        given: set[str] = vars(namespace).setdefault(_Once.GIVEN, set())
        if self.dest in given:
            raise argparse.ArgumentError(self, f"given twice (then {option_string}): give one of the two, once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def _is_option(word: str) -> bool:
    """``word`` looks like an option (``-x``, ``--name``, ``--name=value``), not ``-`` or a negative number."""
    return word.startswith("-") and word != "-" and word != "--" and not _NUMBER.match(word)


def _matches(name: str, options: frozenset[str]) -> bool:
    """``name`` is one of ``options`` or, long, a prefix of one (argparse's abbreviations)."""
    return name in options or (name.startswith("--") and any(o.startswith(name) for o in options))


def _resolved(name: str, options: frozenset[str]) -> str:
    """The option of ``options`` that ``name`` stands for (itself, or the one it abbreviates)."""
    return name if name in options else min(o for o in options if o.startswith(name))


def _owner(name: str, own: dict[str, frozenset[str]]) -> str | None:
    """``sweep`` or ``size`` when ``name`` is (or abbreviates) an option of that sub-command alone, not of
    ``hilum sim``; else None."""
    if _matches(name, own["sim"]):
        return None
    return next((sub for sub in ("sweep", "size") if _matches(name, own[sub])), None)


def _closest_sub_command(word: str) -> str | None:
    """``sweep`` or ``size`` when ``word`` is close to it (a misspelling), else None."""
    import difflib  # only on an error: not at every start

    close = difflib.get_close_matches(word.lower(), ["sweep", "size"], n=1)
    return close[0] if close else None


def _sub_command_hint(words: list[str]) -> str:
    """``" (did you mean 'size' for 'sizing'?)"`` when a word of ``words`` that is not an option is close to a
    sub-command; else empty."""
    for word in words:
        close = None if _is_option(word) else _closest_sub_command(word)
        if close is not None:
            return f" (did you mean '{close}' for '{word}'?)"
    return ""


def _unknown_options(words: list[str], known: frozenset[str]) -> list[str]:
    """The words of ``words`` (up to a ``--``) that look like options (``-x``, ``--name``, ``--name=value``; not
    ``-`` or a negative number) and are neither in ``known`` nor a prefix of a long option there (argparse's
    abbreviations, ``--pol``), each with the closest known option when one is close (``--polcy (did you mean
    --policy?)``)."""
    longs = sorted(o for o in known if o.startswith("--"))
    out = []
    for word in words:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if not _is_option(word) or _matches(name, known):
            continue
        import difflib  # only on an error: not at every start

        # without the dashes, which every name shares (with them, --bogus is "close" to --out)
        close = difflib.get_close_matches(name.lstrip("-"), [o[2:] for o in longs], n=1)
        out.append(f"{name} (did you mean --{close[0]}?)" if close else name)
    return out


TTFT_PLOT_NAME = "ttft_cdf.png"  # hilum sim --out: the TTFT CDF of every policy
SIZING_FILE_NAME = "sizing.json"  # hilum sim size --out


def _interrupted(command: str, made: Path | None) -> int:
    """Say that ``command`` was interrupted (Ctrl-C, or SIGTERM: ``hilum_cli.main``) before it wrote its results, and
    remove ``made``, the ``--out`` folder the run made (None: it was there before, or none), if nothing was written
    into it; exit status 130."""
    if made is not None and made.is_dir() and not any(made.iterdir()):
        with contextlib.suppress(OSError):
            made.rmdir()
    print(f"{command}: interrupted; no results written", file=sys.stderr)
    return 130


class _Staged:
    """A hidden folder inside ``out`` (``.hilum-sim-XXXX``) to write one run's files into: when the ``with`` block
    ends cleanly they are moved into ``out`` together (``os.replace`` each) and the files of ``stale`` that exist
    are removed, SIGINT and SIGTERM held back meanwhile (their handlers swapped for ones that only note them: a
    signal mask would hold them back from this thread alone, and Python runs its handlers in the main thread
    whichever thread the signal reached); when it raises (an interrupt included) they are removed with the folder.
    So ``out`` holds all of this run's files or none of them, never some beside an earlier run's others. ``moved``:
    True once they are in ``out`` (an interrupt held back meanwhile is raised as KeyboardInterrupt just after);
    ``removed``: the names of ``stale`` removed then."""

    def __init__(self, out: Path, stale: Sequence[str] = ()) -> None:
        self.out = out
        self.path = out
        self.stale = stale
        self.moved = False
        self.removed: list[str] = []

    def __enter__(self) -> _Staged:
        self.path = Path(tempfile.mkdtemp(prefix=".hilum-sim-", dir=self.out))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if kind is None:
                files = sorted(self.path.iterdir())
                held: list[int] = []
                previous = {s: signal.signal(s, lambda signum, _frame: held.append(signum)) for s in _STOPS}
                try:
                    for f in files:
                        os.replace(f, self.out / f.name)
                    self.removed = [name for name in self.stale if (self.out / name).is_file()]
                    for name in self.removed:
                        (self.out / name).unlink()
                    self.moved = True
                finally:
                    for s, handler in previous.items():
                        signal.signal(s, handler)
                if held:
                    raise KeyboardInterrupt
        finally:
            shutil.rmtree(self.path, ignore_errors=True)


_STOPS = (signal.SIGINT, signal.SIGTERM)


_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # what argparse takes for a negative number, not an option


def _add_run_arguments(parser: argparse.ArgumentParser, sizing: bool = False) -> None:
    """The options of one comparison (``hilum sim`` and ``hilum sim size``). With ``sizing``, the options that
    change the fleet during a run are hidden from the help (``hilum sim size`` refuses them by name)."""
    fleet = argparse.SUPPRESS if sizing else None
    parser.add_argument(
        "--topology",
        default=DEFAULTS.topology,
        help=f"YAML file or bundled topology ({', '.join(BUNDLED_NAMES)}; default {DEFAULTS.topology})",
    )
    parser.add_argument(
        "--trace",
        default=DEFAULTS.trace,
        help=f"trace file or bundled trace ({', '.join(TRACE_NAMES)}; default {DEFAULTS.trace})",
    )
    parser.add_argument(
        "--policy",
        default=",".join(POLICY_NAMES),
        help=f"comma-separated policies to compare (from {', '.join(POLICY_NAMES)}; default all of them)",
    )
    parser.add_argument(
        "--rate-scale",
        type=float,
        default=None,
        help=f"compress arrivals X times (default {DEFAULTS.rate_scale:g} for the default trace, else 1)",
    )
    parser.add_argument(
        "--arrival",
        choices=("trace", "poisson", "gamma"),
        default=None,
        help="arrival process: the trace's timestamps (default where it has them) or synthetic Poisson/Gamma",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="synthetic arrival rate, req/s, before --rate-scale (default: the whole trace's mean rate where it has "
        f"timestamps, before --max-requests keeps its first N, else {DEFAULT_SYNTHETIC_RATE_PER_S:g})",
    )
    parser.add_argument("--arrival-cv", type=float, default=None, help="Gamma inter-arrival CV (--arrival gamma)")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=DEFAULTS.max_requests,
        help=f"first N requests only (default {DEFAULTS.max_requests}; a sweep file's max_requests defaults to the "
        "whole trace)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS.seed,
        help="seed of every random draw: synthetic arrivals, ShareGPT's order, priorities, the policies' choices "
        f"(default {DEFAULTS.seed})",
    )
    parser.add_argument("--model", default=None, help="model the requests are for (default: most instances)")
    parser.add_argument("--priority-fraction", type=float, default=0.0, help="share of high-priority requests")
    parser.add_argument(
        "--drain", action="append", default=[], metavar="INSTANCE@S", help=fleet or "drain an instance at time S"
    )
    parser.add_argument(
        "--scale-out", action="append", default=[], metavar="INSTANCE@S", help=fleet or "instance joins at time S"
    )
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help=fleet
        or "run the autoscaler (the configuration file's autoscale section) on the virtual clock; on too when "
        "that section says enabled: true",
    )
    parser.add_argument(
        "--initial-instances",
        type=int,
        default=None,
        metavar="N",
        help=fleet or "instances serving from the start, in turn from each domain (default: all)",
    )
    parser.add_argument(
        "--cold-start-s",
        type=float,
        default=None,
        metavar="S",
        help=fleet or "with --autoscale: seconds before a started instance serves (default 60)",
    )
    parser.add_argument(
        "--summary-lag-ms",
        type=float,
        default=None,
        help="delay before a domain's published summary reaches the gateways and the coordinator, hilum's policy "
        f"(default {SimOptions.model_fields['summary_lag_s'].default * 1e3:g})",
    )
    parser.add_argument(
        "--admission",
        choices=("chunked", "whole-prompt"),
        default="chunked",
        help="engine admission: vLLM v1 chunk by chunk (default) or vLLM v0 whole prompt (Llumnix's engine)",
    )
    parser.add_argument(
        "--scheduling",
        choices=("priority", "fcfs"),
        default="priority",
        help="engine scheduling: priority classes in admission and preemption (default) or fcfs (priorities "
        "ignored in the engine: arrival order only)",
    )
    parser.add_argument(
        "--prefix-caching",
        action=_OnceSwitch,
        default=None,
        help="engines reuse cached prompt prefixes by the trace's hash ids (default: the configuration's "
        "prefix_cache.enabled, true as in vLLM V1; --no-prefix-caching: every prompt is computed in full)",
    )
    parser.add_argument(
        "--prefix-aware",
        action=_OnceSwitch,
        default=None,
        help="dispatch counts the prefix blocks a target holds (default: the configuration's "
        "policy.prefix_aware_dispatch, on; --no-prefix-aware: load alone, to compare)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="directory for sizing.json (default: none written)"
        if sizing
        else "directory for results.json and plots (default: none written, the tables only)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the sizes tried as JSON instead of a table"
        if sizing
        else "print the summaries as JSON instead of a table",
    )
    add_config_argument(parser)


def _configuration(path: str | None, named: str) -> HilumConfig:
    """The configuration file at ``path`` (None: ``$HILUM_CONFIG``'s, else the built-in defaults), read, and checked
    for the ``prefix_cache`` keys the simulator cannot honour. ``named``: how the user named it (``--config``,
    ``$HILUM_CONFIG``, ``sweep.yaml: config:``), which leads each line of an error. Raises ValueError."""
    try:
        settings = load_config(path)
        check_prefix_cache(settings)
    except ConfigError as exc:
        raise ValueError(exc.for_flag(named)) from None
    except ValueError as exc:  # "<file>: prefix_cache.<key>: ...", named as the file's other errors are
        raise ValueError(f"{named} {exc}") from None
    return settings


def _described(settings: HilumConfig, named: str) -> str:
    """The configuration ``settings`` came from, in words for a message: ``named`` and its file, or the built-in
    defaults."""
    return "the built-in defaults" if settings.source == DEFAULTS_SOURCE else f"{named} {settings.source}"


def _specs(args: argparse.Namespace) -> list[SimSpec]:
    policies = [p.strip() for p in args.policy.split(",")]
    if policies == [""]:
        raise ValueError(f"--policy is empty: give one or more of {', '.join(POLICY_NAMES)}, separated by commas")
    if "" in policies and len(policies) > 1:
        raise ValueError(f"--policy {args.policy!r} has an empty name; separate policies by single commas")
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICY_NAMES)}")
    repeated = sorted({p for p in policies if policies.count(p) > 1})
    if repeated:
        raise ValueError(f"--policy names {', '.join(repeated)} more than once; name each policy once")
    if args.rate_scale is None:
        args.rate_scale = DEFAULTS.rate_scale if args.trace == DEFAULTS.trace else 1.0
    if not (math.isfinite(args.rate_scale) and args.rate_scale > 0):
        raise ValueError(f"--rate-scale must be a finite number > 0, got {args.rate_scale:g}")
    if args.summary_lag_ms is not None and not (math.isfinite(args.summary_lag_ms) and args.summary_lag_ms >= 0):
        raise ValueError(f"--summary-lag-ms must be a finite number of milliseconds >= 0, got {args.summary_lag_ms:g}")
    if args.summary_lag_ms is not None and "hilum" not in policies:
        raise ValueError(
            "--summary-lag-ms applies to the hilum policy only (the lag of its domain summaries); add it to --policy"
        )
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise ValueError(f"--rate must be a number of requests per second > 0, got {args.rate}")
    if args.arrival_cv is not None and not MIN_ARRIVAL_CV <= args.arrival_cv <= MAX_ARRIVAL_CV:  # nan too
        raise ValueError(
            f"--arrival-cv must be from {MIN_ARRIVAL_CV:g} to {MAX_ARRIVAL_CV:g} (the Gamma inter-arrival CV; 1 is "
            f"Poisson), got {args.arrival_cv:g}"
        )
    if args.arrival == "gamma" and args.arrival_cv is None:
        raise ValueError("--arrival gamma needs --arrival-cv (the inter-arrival CV, e.g. 2)")
    if args.arrival_cv is not None and args.arrival != "gamma":
        raise ValueError("--arrival-cv applies only with --arrival gamma")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.max_requests is not None and args.max_requests < 1:
        raise ValueError(f"--max-requests must be >= 1, got {args.max_requests}")
    options: dict[str, Any] = {
        "priority_fraction": args.priority_fraction,
        "drain": tuple(args.drain),
        "scale_out": tuple(args.scale_out),
        "admission": args.admission,
        "scheduling": args.scheduling,
        "model": args.model,
        "autoscale": args.autoscale,
        "initial_instances": args.initial_instances,
        "cold_start_s": args.cold_start_s,
        "prefix_caching": args.prefix_caching,
        "prefix_aware_dispatch": args.prefix_aware,
    }
    if args.summary_lag_ms is not None:
        options["summary_lag_s"] = args.summary_lag_ms / 1e3
    base = SimSpec(
        topology=args.topology,
        trace=args.trace,
        policy=policies[0],
        rate_scale=args.rate_scale,
        max_requests=args.max_requests,
        seed=args.seed,
        options=options,
        config=args.config,
    )
    where = "--config" if args.config is not None else f"${CONFIG_ENV}"  # as the user gave it
    config = _configuration(args.config, where)  # fail before any work on a bad configuration file
    if config.autoscale.enabled and not args.autoscale:  # the file's switch turns it on here too
        base = replace(base, options={**options, "autoscale": True})
    parsed = base.parsed_options()  # fail before any work on bad options
    # and on a configuration that clashes with them
    check_autoscale(parsed, config, cold_start="--cold-start-s", source=_described(config, where))
    check_prefix_aware(parsed, config, source=_described(config, where))
    return [replace(base, policy=p) for p in policies]


def run_cli(args: argparse.Namespace) -> int:
    """Run every requested policy on the same topology and trace; print and save the comparison."""
    from .report import LATENCY_COLUMNS, MIGRATION_COLUMNS, MOVE_COLUMNS, summary_tables, ttft_p99_ratios
    from .results import stored_policies, summarize, write_results
    from .runner import run_simulation

    err = Console(stderr=True, soft_wrap=True, emoji=False)
    loaded = _load(args, err, "hilum sim")
    if isinstance(loaded, int):
        return loaded
    specs, topology, trace, out, made = loaded
    runs = []
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=err,
            transient=False,
        ) as bar:
            for spec in specs:
                task = bar.add_task(f"{spec.policy:<13}", total=1.0)

                def advance(fraction: float, task_id: TaskID = task) -> None:
                    bar.update(task_id, completed=fraction)

                run = run_simulation(spec, trace=trace, topology=topology, progress=advance)
                runs.append(run)
    except KeyboardInterrupt:
        return _interrupted("hilum sim", made)
    if out is not None:  # first: the results are kept whatever becomes of stdout (| head -1 ends the printing)
        # its KV plots of policies this run did not simulate go with the results they belong to (no other file)
        earlier = stored_policies(out / RESULTS_FILE_NAME)  # the run whose results this one replaces
        simulated = {r.policy for r in runs}
        staged = _Staged(out, [f"kv_usage_{p}.png" for p in earlier if p in POLICY_NAMES and p not in simulated])
        try:
            from .plots import plot_kv_usage, plot_ttft_cdf  # matplotlib: only when plots are written

            with staged:  # all of this run's files, or none: an earlier run's are never mixed with some of them
                write_results(runs, staged.path)
                plot_ttft_cdf(runs, staged.path / TTFT_PLOT_NAME)
                for run in runs:
                    plot_kv_usage(run, staged.path / f"kv_usage_{run.policy}.png")
        except OSError as exc:  # a full disk: said, not a traceback
            err.print(f"[red]hilum sim: error:[/red] --out {out}: cannot write the results: {exc}", highlight=False)
            return 1
        except KeyboardInterrupt:
            if not staged.moved:
                return _interrupted("hilum sim", made)
            print(f"hilum sim: interrupted; the results were written: {out / RESULTS_FILE_NAME}", file=sys.stderr)
            return 130
        path = out / RESULTS_FILE_NAME
        gone = f" (removed an earlier run's {', '.join(staged.removed)})" if staged.removed else ""
        err.print(f"results: {path}; plots in {out}/{gone}", highlight=False)
    summaries = [summarize(r) for r in runs]
    if args.json:  # with the requests cut to the model's context and the scaled step times (results.json: config)
        rows = [
            {
                **asdict(s),
                "truncated_requests": r.config.get("truncated_requests", 0),
                "derived_latency_models": r.config.get("derived_latency_models", []),
            }
            for s, r in zip(summaries, runs, strict=True)
        ]
        print(json.dumps(rows, indent=2, default=str))
    else:
        model = str(runs[0].config["model"])
        served = [i for i in topology.instances if i.model == model]
        domains = {i.domain_id for i in served}
        start = runs[0].config.get("initial_instances", len(served))
        fleet = (
            f"{len(served)} {model} {_plural('instance', len(served))}"
            if start == len(served)
            else f"{start} of {len(served)} {model} instances at start"
        )
        truncated = runs[0].config.get("truncated_requests", 0)
        # no rate for requests that arrive at one instant (one request, or a span below a double's resolution)
        per_s = len(trace.requests) / trace.duration_s if trace.duration_s > 0 else math.inf
        rate = f", {per_s:.3g} req/s" if math.isfinite(per_s) else ""
        title = (
            f"{trace.name} x{args.rate_scale:g} ({_requests(len(trace.requests))}{rate}"
            f"{f', {truncated:,} cut to the {model} context' if truncated else ''}) on {topology.name} "
            f"({fleet}, {len(domains)} {_plural('domain', len(domains))}), seed {args.seed}"
        )
        baseline = "least-loaded" if "least-loaded" in {s.policy for s in summaries} else None
        idle = _idle_columns(
            [r.policy for r in runs],
            summaries,
            prefix_caching=bool(runs[0].config.get("prefix_caching", True)),
            prefix_hashes=any(r.prefix_block_hashes for r in trace.requests),
            one_domain=len(domains) == 1,
            autoscaled="autoscale" in runs[0].config,
        )
        if baseline is not None and all(r is None for r in ttft_p99_ratios(summaries, baseline).values()):
            idle["TTFT p99\n/ base"] = f"{baseline} has no P99 TTFT to divide by"  # no request got a first token
            baseline = None  # no ratio column
        latency = [c for c in LATENCY_COLUMNS if c not in idle]
        migration = [c for c in MIGRATION_COLUMNS if c not in idle]
        console = Console() if sys.stdout.isatty() else Console(width=200)  # files and pipes: no squeezing
        console.print(title, highlight=False)  # on its own line: a table's title wraps at the table's width
        moves = "migrations and " if any(c in migration for c in MOVE_COLUMNS) else ""
        for table in summary_tables(
            summaries,
            console.width,
            baseline=baseline,
            latency=latency,
            migration=migration,
            migration_title=f"{moves}simulator cost",
        ):
            console.print(table)
        derived = runs[0].config.get("derived_latency_models")
        _print_scaled(console, derived if isinstance(derived, list) else [])
        if baseline is not None:
            console.print(f"TTFT p99 / base: each policy's P99 TTFT over {baseline}'s", style="dim", highlight=False)
        if "hi-pri\nTTFT p99" in latency:  # a P99 over a few dozen requests is about their slowest: say how many
            counts = {s.policy: s.high_priority_ttft_count for s in summaries}  # refusals differ by policy
            if len(set(counts.values())) == 1:
                n = next(iter(counts.values()))
                over = f"the {n:,} high-priority {_plural('request', n)} that got a first token"
            else:
                each = ", ".join(f"{n:,} ({policy})" for policy, n in counts.items())
                over = f"the high-priority requests that got a first token, {each}"
            few = "; fewer than 100: about the slowest of them" if min(counts.values()) < 100 else ""
            console.print(f"hi-pri TTFT p99: over {over}{few}", style="dim", highlight=False)
        _print_idle(console, idle)
    return 0


def _print_scaled(console: Console, scaled: Sequence[str], where: str = "") -> None:
    """Say below a table which step times are another GPU's scaled by HBM bandwidth (``scaled``:
    ``llumlet.engine.latency.scaled_latency_models``; ``where``: `` on TOPOLOGY`` when a table covers several): an
    approximation (prefill is compute-bound), which results files also record (``derived_latency_models``)."""
    if scaled:
        console.print(
            f"step times{where}: {scaled_note(scaled)}",
            style="dim",
            highlight=False,
            soft_wrap=not console.is_terminal,
        )


def _print_idle(console: Console, idle: Mapping[str, str]) -> None:
    """The footnote naming the columns :func:`_idle_columns` left out, and why (nothing when none was)."""
    if idle:
        by_reason: dict[str, list[str]] = {}
        for header, why in idle.items():
            by_reason.setdefault(why, []).append(header.replace("\n", " "))
        notes = ", ".join(f"{', '.join(headers)} ({why})" for why, headers in by_reason.items())
        # a terminal's width at words (it broke the line mid-word); a pipe's one line
        console.print(
            f"not shown, nothing to count: {notes}", style="dim", highlight=False, soft_wrap=not console.is_terminal
        )


def _idle_columns(
    policies: Sequence[str],
    summaries: Sequence[PolicySummary],
    *,
    prefix_caching: bool,
    prefix_hashes: bool,
    one_domain: bool,
    autoscaled: bool,
    autoscale_off: str = "no --autoscale",
) -> dict[str, str]:
    """The columns of ``hilum sim``'s (or a sweep's) tables with nothing to count in runs of ``policies`` (header ->
    why):
    - the prefix hit rate when prefix caching was off or no request of the trace carries prefix hashes;
    - the high-priority TTFT when no high-priority request got a first token (``summaries``: none has the figure);
    - the migration columns when no policy of the runs migrates, the cross-domain ones on one domain;
    - the scale-outs and -ins without the autoscaler (``autoscale_off`` says how it was left off).
    A count that could have been non-zero is shown, zero or not. ``--json``, results.json and sweep.json keep every
    figure."""
    from .report import MOVE_COLUMNS

    idle = {}
    if not prefix_caching:
        idle["prefix\nhit %"] = "prefix caching off"
    elif not prefix_hashes:
        idle["prefix\nhit %"] = "the trace has no prefix hashes"
    if all(s.high_priority_ttft_p99_s is None for s in summaries):
        idle["hi-pri\nTTFT p99"] = "no high-priority request got a first token"
    if not any(policy_migrates(p) for p in policies):
        idle.update(dict.fromkeys(MOVE_COLUMNS, "no policy of the run migrates"))
    elif one_domain:
        idle["mig\ncross"] = idle["cross\nGB"] = "one domain"
    if not autoscaled:
        idle["scale\nout/in"] = autoscale_off
    return idle


def run_size_cli(args: argparse.Namespace) -> int:
    """``hilum sim size``: per policy, the smallest static fleet meeting the P99 TTFT target (sim/sizing.py).

    Exit status 0 when every policy met it with some fleet size, 1 when one missed it even with the whole pool
    (the table says which), 2 on bad options."""
    from rich import box
    from rich.table import Table

    from topology.tables import split_to_fit

    from .results import summarize, summary_to_dict
    from .runner import run_simulation
    from .sizing import size_fleet

    err = Console(stderr=True, soft_wrap=True, emoji=False)
    refused = None
    if not 0 < args.target_p99_ttft_ms < math.inf:
        refused = f"--target-p99-ttft-ms must be a finite number of milliseconds > 0, got {args.target_p99_ttft_ms:g}"
    elif args.autoscale:
        refused = "--autoscale cannot be combined with sim size: it sizes static fleets"
    elif args.initial_instances is not None:
        refused = "--initial-instances cannot be combined with sim size: it chooses the sizes itself"
    elif args.scale_out:
        refused = "--scale-out cannot be combined with sim size: it sizes static fleets"
    elif args.drain:  # a smaller fleet may leave the drained instance out: its drain would mean nothing there
        refused = "--drain cannot be combined with sim size: it sizes static fleets, most without the drained instance"
    elif args.cold_start_s is not None:
        refused = "--cold-start-s cannot be combined with sim size: it sizes static fleets (no instance starts)"
    if refused is not None:
        err.print(f"[red]hilum sim size: error:[/red] {refused}", highlight=False)
        return 2
    loaded = _load(args, err, "hilum sim size")
    if isinstance(loaded, int):
        return loaded
    specs, topology, trace, out, made = loaded
    if specs[0].parsed_options().autoscale:  # not from the command line (refused above): the file's switch
        err.print(
            "[red]hilum sim size: error:[/red] the configuration's autoscale.enabled is true: sim size sizes static "
            "fleets; use a configuration with it false",
            highlight=False,
        )
        return 2
    model = served_model(topology, specs[0].parsed_options().model)
    pool_size = sum(1 for i in topology.instances if i.model == model)
    scaled = scaled_latency_models(topology, model)  # as each run's derived_latency_models
    target_s = args.target_p99_ttft_ms / 1e3
    sizings = []
    truncated: list[object] = [0]  # requests cut to the model's context: the same trace and model at every size
    for spec in specs:

        def simulate(n: int, spec: SimSpec = spec) -> PolicySummary:
            sized = replace(spec, options={**spec.options, "initial_instances": n})
            run = run_simulation(sized, trace=trace, topology=topology)
            truncated[0] = run.config.get("truncated_requests", 0)
            summary = summarize(run)
            p99 = "-" if summary.ttft_p99_s is None else f"{summary.ttft_p99_s * 1e3:,.0f} ms"
            refused = f", refused {_requests(summary.refused)}" if summary.refused else ""
            err.print(f"{spec.policy}: {n} {_plural('instance', n)}: P99 TTFT {p99}{refused}", highlight=False)
            return summary

        try:
            sizings.append(size_fleet(spec.policy, pool_size, target_s, simulate))
        except KeyboardInterrupt:
            return _interrupted("hilum sim size", made)
    rows = [
        {
            "policy": s.policy,
            "instances": t.instances,
            "meets": t.meets,
            "miss": t.miss,
            "chosen": t.instances == s.chosen,
            "summary": {
                **summary_to_dict(t.summary),
                "truncated_requests": truncated[0],
                "derived_latency_models": scaled,
            },
        }
        for s in sizings
        for t in s.trials
    ]
    if out is not None:  # first: kept whatever becomes of stdout (| head -1 ends the printing)
        path = out / SIZING_FILE_NAME
        sized = {  # what was sized, so that the file stands alone
            "target_p99_ttft_ms": args.target_p99_ttft_ms,
            "topology": topology.name,
            "trace": trace.name,
            "requests": len(trace.requests),
            "rate_scale": specs[0].rate_scale,
            "seed": specs[0].seed,
            "model": model,
            "derived_latency_models": scaled,
            "rows": rows,
        }
        try:
            with atomic_file(path) as f:  # whole or not at all
                f.write(json.dumps(sized, indent=1))
        except OSError as exc:
            err.print(f"[red]hilum sim size: error:[/red] --out {out}: cannot write: {exc}", highlight=False)
            return 1
        err.print(f"sizing: {path}", highlight=False)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        title = (
            f"smallest static fleet with P99 TTFT <= {args.target_p99_ttft_ms:,.10g} ms ({trace.name} "
            f"x{args.rate_scale:g}, {_requests(len(trace.requests))}, on {topology.name}: "
            f"{pool_size} {model} {_plural('instance', pool_size)})"
        )
        headers = ("policy", "instances", "GPU-h", "TTFT p99 ms", "refused", "meets", "")
        cells: list[dict[str, str]] = []  # a row per fleet size tried, by header
        for s in sizings:
            for t in s.trials:
                p99 = "-" if t.summary.ttft_p99_s is None else f"{t.summary.ttft_p99_s * 1e3:,.0f}"
                gpu_h = "-" if t.summary.gpu_hours is None else f"{t.summary.gpu_hours:.2f}"
                mark = "<- smallest found" if t.instances == s.chosen else (t.miss or "")
                if s.chosen is None and t.instances == pool_size:  # said on that row, not on one of dashes below
                    mark = f"{mark}: not met even by all {pool_size}"
                meets = "yes" if t.meets else "no"
                row = (s.policy, str(t.instances), gpu_h, p99, f"{t.summary.refused:,}", meets, mark)
                cells.append(dict(zip(headers, row, strict=True)))

        def build(shown: Sequence[str], caption: str) -> Table:  # each row named by its policy and fleet size
            table = Table(title=caption or None, title_justify="left", box=box.SIMPLE_HEAD)
            for header in (*headers[:2], *shown):
                table.add_column(header, justify="left" if header in ("policy", "") else "right", no_wrap=True)
            for named in cells:
                table.add_row(*(named[h] for h in (*headers[:2], *shown)))
            return table

        if sys.stdout.isatty():  # a terminal too narrow for the table: its columns over several, none cut to '…'
            console = Console()
            tables = split_to_fit(build, headers[2:], title, console.width)
        else:  # files and pipes: no squeezing
            console, tables = Console(width=200), [build(headers[2:], title)]
        for table in tables:
            console.print(table)
        _print_scaled(console, scaled)
    unmet = [s for s in sizings if s.chosen is None]
    if unmet:  # a script asking "which fleet meets the target" must not read success here
        why = "; ".join(f"{s.policy}: {s.trial(pool_size).miss}" for s in unmet)
        err.print(
            f"hilum sim size: target not met by {', '.join(s.policy for s in unmet)} even with all {pool_size} "
            f"{_plural('instance', pool_size)} ({why})",
            highlight=False,
        )
        return 1
    return 0


def _load(
    args: argparse.Namespace, err: Console, command: str
) -> tuple[list[SimSpec], Topology, Trace, Path | None, Path | None] | int:
    """The runs' specs, the topology, the trace, the output folder of ``args`` and that folder again if this run made
    it (None if it was there before); or, after printing why on ``err``, exit status 2 (bad options, topology, trace,
    configuration or output folder)."""
    from topology.load import TopologyError, load_topology

    from .runner import SimCheckError, check_options
    from .traces import load_trace

    try:
        specs = _specs(args)
        for flag, value in (("--topology", args.topology), ("--trace", args.trace)):
            if not value.strip():
                raise ValueError(f"{flag} is empty: give a bundled name or a file")
        topology = load_topology(args.topology)
        drains, scale_outs = check_options(topology, specs[0].parsed_options())
        trace = load_trace(
            args.trace,
            rate_scale=args.rate_scale,
            max_requests=args.max_requests,
            seed=args.seed,
            arrival=args.arrival,
            rate_per_s=args.rate,
            arrival_cv=args.arrival_cv,
        )
    except TopologyError as exc:
        err.print(
            f"[red]{command}: error: invalid topology (--topology {escape(args.topology)})[/red]\n"
            + escape("\n".join(exc.lines())),
            highlight=False,
        )
        return 2
    except SimCheckError as exc:  # every problem of the options and the topology, one a line
        for line in exc.lines():
            err.print(f"[red]{command}: error:[/red] {escape(line)}", highlight=False)
        return 2
    except (ValueError, OSError) as exc:
        err.print(f"[red]{command}: error:[/red] {escape(str(exc))}", highlight=False)
        return 2
    options = specs[0].parsed_options()
    try:
        model = served_model(topology, options.model)
        fleet = _fleet(topology, model, options, scale_outs)
        fit = _fit_warnings(topology, trace, model, fleet, scale_outs)
    except ValueError as exc:
        err.print(f"[red]{command}: error:[/red] {escape(str(exc))}", highlight=False)
        return 2
    last_s = trace.requests[-1].arrival_s if trace.requests else 0.0
    late = [
        f"{flag} {iid}@{at_s:.10g} comes after the trace's last arrival ({last_s:.1f} s): it happens only if "
        "requests are still running then"
        for flag, events in (("--drain", drains), ("--scale-out", scale_outs))
        for iid, at_s in events
        if at_s > last_s
    ]
    drained = None if options.autoscale else _all_drained(fleet, drains, last_s)  # the autoscaler may start others
    made = args.out is not None and not Path(args.out).exists()
    try:  # made once everything else is known good (a refused run leaves no empty folder), before any simulation
        if command == "hilum sim size":
            out = _output_dir(args.out, "sizing.json", [SIZING_FILE_NAME])
        else:
            names = [RESULTS_FILE_NAME, TTFT_PLOT_NAME, *(f"kv_usage_{spec.policy}.png" for spec in specs)]
            out = _output_dir(args.out, "results.json and the plots", names)
    except (ValueError, OSError) as exc:
        err.print(f"[red]{command}: error:[/red] {escape(str(exc))}", highlight=False)
        return 2
    for warning in fit + ([drained] if drained else []) + late:
        err.print(f"[yellow]{command}: warning:[/yellow] {escape(warning)}", highlight=False)
    return specs, topology, trace, out, out if made else None


def _all_drained(fleet: _Fleet, drains: list[tuple[str, float]], last_arrival_s: float) -> str | None:
    """A warning when the scripted ``drains`` (instance, time s) take every instance of ``fleet`` (:func:`_fleet`)
    out of service by ``last_arrival_s`` (the trace's last arrival: the requests from the last drain on are
    refused); None otherwise."""
    start, later, _ = fleet
    when = dict(drains)
    if any(i.instance_id not in when for i in start + later):
        return None
    last_s = max(when[i.instance_id] for i in start + later)
    if last_s > last_arrival_s:  # every request has arrived before: the late-drain warnings say the rest
        return None
    count = len(start) + len(later)
    return (
        f"--drain takes every instance that serves out of service ({count} {_plural('instance', count)}, the "
        f"last at {last_s:.10g} s): requests arriving from then on are refused"
    )


def _plural(noun: str, count: int) -> str:
    """``noun``, with an s unless ``count`` is 1."""
    return noun if count == 1 else f"{noun}s"


def _requests(count: int) -> str:
    return f"{count:,} {_plural('request', count)}"


def _fit_warnings(
    topology: Topology, trace: Trace, model: str, fleet: _Fleet, scale_outs: list[tuple[str, float]]
) -> list[str]:
    """Why requests of ``trace`` will be refused, or instances of the simulated model stay idle, for want of KV cache
    blocks; empty when every request fits every instance that serves.

    A request is sized as dispatch and the engine's admission check size it (``DomainRequest.need_blocks``: prompt
    plus output, in blocks of the model's ``block_size_tokens``), once cut to the model's context as the run cuts it
    (``fit_to_context``). The instances counted are those that serve in the run (:func:`_fleet`): the ones serving
    at the start, and those that may join later (``--scale-out``, or the autoscaler's pool). The warnings: instances
    too small for the smallest request (they stay idle); no instance at the start large enough for any request (all
    are refused until a larger one joins); requests larger than every instance that ever serves (refused), or than
    every instance at the start (refused until a larger one joins).

    Args:
        topology, trace: the run's.
        model: the model simulated (``served_model``).
        fleet: its instances as the run puts them in service (:func:`_fleet`).
        scale_outs: its scripted scale-outs, (instance, time s), as ``check_options`` parsed them.

    Raises:
        ValueError: no instance that ever serves can hold even the smallest request: every request would be refused.
    """
    if not trace.requests:
        return []
    spec = topology.models[model]
    block_tokens = spec.block_size_tokens
    cut, _ = fit_to_context(trace, spec.max_context_tokens)
    needs = [domain_request(r, model).need_blocks(block_tokens) for r in cut.requests]
    smallest, largest = min(needs), max(needs)
    blocks = f"blocks of {block_tokens} tokens"
    start, later, kept_off = fleet
    ever = start + later
    cap_start = max((i.kv_capacity_blocks for i in start), default=0)
    cap_ever = max(i.kv_capacity_blocks for i in ever)
    joins = "joining by --scale-out" if scale_outs else "if the autoscaler starts one"
    when = {iid: at_s for iid, at_s in scale_outs}

    def shown(instances: list[InstanceSpec]) -> str:
        def one(i: InstanceSpec) -> str:
            at = f", at {when[i.instance_id]:g} s" if i.instance_id in when else ""
            return f"{i.instance_id} ({i.kv_capacity_blocks:,}{at})"

        return ", ".join(one(i) for i in instances[:4]) + (", ..." if len(instances) > 4 else "")

    rank = {i.instance_id: n for n, i in enumerate(topology.instances)}
    small = sorted((i for i in ever if i.kv_capacity_blocks < smallest), key=lambda i: rank[i.instance_id])
    what = (
        f"fewer KV cache blocks than the trace's smallest request needs (prompt plus output, cut to the model's "
        f"context: {smallest:,} {blocks}): {shown(small)}"
    )
    if len(small) == len(ever):
        bigger = [i for i in kept_off if i.kv_capacity_blocks >= smallest]
        if bigger:  # --initial-instances keeps off every instance that could serve a request
            need = len(start) + 1 + kept_off.index(bigger[0])  # kept_off: in the order more would be taken
            raise ValueError(
                f"every {model} instance that --initial-instances {len(start)} puts in service holds {what}; no "
                f"request could run: --initial-instances {need} would include {shown(bigger[:1])}"
            )
        raise ValueError(
            f"every {model} instance of {topology.name} holds {what}; no request could run: give the instances more "
            "memory (kv_capacity_blocks, the GPU's memory_gib) or use a trace of shorter requests"
        )
    warnings = []
    if small:
        count = f"{len(small)} {model} {_plural('instance', len(small))}"
        warnings.append(
            f"{count} of {topology.name} hold{'' if len(small) > 1 else 's'} {what}; no request will run there"
        )
    if cap_start < smallest:  # some instance that joins later holds it (else refused above)
        at_start = f"the largest there holds {cap_start:,}" if start else "none serves then"
        holders = [i for i in later if i.kv_capacity_blocks >= smallest]
        warnings.append(
            f"no {model} instance serving at the start holds the trace's smallest request ({smallest:,} {blocks}; "
            f"{at_start}): only {shown(holders)} can ({joins}); every request is refused until one of them serves"
        )
    oversized = [n for n in needs if n > cap_ever]
    if oversized:
        off = max(kept_off, key=lambda i: i.kv_capacity_blocks, default=None)
        keeps = (
            f"; --initial-instances {len(start)} keeps off {shown([off])}"
            if off is not None and off.kv_capacity_blocks > cap_ever
            else ""
        )
        warnings.append(
            f"{len(oversized):,} of {_requests(len(needs))} need{'s' if len(oversized) == 1 else ''} more KV cache "
            f"blocks than the largest {model} instance {'that serves ' if kept_off else ''}holds (prompt plus "
            f"output, cut to the model's context: up to {largest:,} {blocks}; the largest instance holds "
            f"{cap_ever:,}){keeps}; they will be refused"
        )
    waiting = [n for n in needs if cap_start < n <= cap_ever]
    if waiting and cap_start >= smallest:  # (else warned above: every request waits for a later instance)
        holders = [i for i in later if i.kv_capacity_blocks > cap_start]
        warnings.append(
            f"{len(waiting):,} of {_requests(len(needs))} need{'s' if len(waiting) == 1 else ''} more KV cache blocks "
            f"than the largest {model} instance serving at the start holds (up to {max(waiting):,} {blocks}; the "
            f"largest there holds {cap_start:,}): they are refused until one of {shown(holders)} serves ({joins})"
        )
    return warnings


#: (serving at the start, may join later, never serve): :func:`_fleet`
_Fleet = tuple[list["InstanceSpec"], list["InstanceSpec"], list["InstanceSpec"]]


def _fleet(topology: Topology, model: str, options: SimOptions, scale_outs: list[tuple[str, float]]) -> _Fleet:
    """The instances of ``model`` as the run puts them in service: (serving at the start, those that may join later,
    those that never serve), each in the order ``sim.autoscale.initial_fleet`` takes them.

    At the start: the ``initial_instances`` taken in turn from each domain (``initial_fleet``, as the runner takes
    them; every instance without it), less the scripted scale-outs. Later: the scripted scale-outs, or with the
    autoscaler every instance not serving at the start (which it starts is its decision). Never: the instances
    ``initial_instances`` keeps off without the autoscaler (a larger ``initial_instances`` takes them in this order).
    """
    from policy.autoscale import pools_of

    from .autoscale import initial_fleet

    by_id = {i.instance_id: i for i in topology.instances if i.model == model}
    pool = pools_of(by_id.values())[model]
    order = [by_id[iid] for iid in initial_fleet(pool, len(pool))]
    count = options.initial_instances or len(pool)
    joining = {iid for iid, _ in scale_outs}
    start = [i for i in order[:count] if i.instance_id not in joining]
    rest = order[count:]
    later = [i for i in order if i.instance_id in joining] + (rest if options.autoscale else [])
    return start, later, [] if options.autoscale else rest


def _output_dir(out: str | None, files: str, names: Sequence[str] = ()) -> Path | None:
    """Create ``--out`` (after the options are checked, before any simulation: results are never lost to a bad
    path, and a refused run leaves no empty folder behind); None without ``--out``. ``files``: what the command
    writes there (``"sweep.json and the plots"``), for the error on an empty ``--out``; ``names``: files it will
    write, none of which may be there as something other than a file (a folder).

    Raises ValueError when ``out`` is empty or blank; OSError (with the path) when it cannot be created or written,
    or one of ``names`` is there and is not a file.
    """
    if out is None:
        return None
    if not out.strip():
        raise ValueError(f"--out is empty: give a folder for {files}")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"--out {out}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"--out {out}: cannot create the folder: {exc.strerror or exc}") from None
    probe = path / ".hilum-write-test"
    try:
        probe.write_text("")
    except OSError as exc:
        raise OSError(f"--out {out}: cannot write there: {exc.strerror or exc}") from None
    probe.unlink()
    taken = [name for name in names if (path / name).exists() and not (path / name).is_file()]
    if taken:
        raise IsADirectoryError(
            f"--out {out}: {', '.join(taken)} there {'is' if len(taken) == 1 else 'are'} not a file but a folder (the "
            "results would be written there): move it away, or choose another --out"
        )
    return path


def run_sweep_cli(args: argparse.Namespace) -> int:
    """``hilum sim sweep CONFIG``: run the grid as Ray tasks and merge the results."""
    from pydantic import ValidationError
    from rich.table import Table

    from topology.tables import split_to_fit

    from .report import LATENCY_COLUMNS, MIGRATION_COLUMNS, MOVE_COLUMNS, render_sweep_table
    from .sweep import (
        SWEEP_FILE_NAME,
        SweepConfigError,
        SweepPointError,
        load_sweep_config,
        plot_file_names,
        run_sweep,
    )

    before = getattr(args, "before_sub", [])  # what _SimParser found before 'sweep', as typed
    if before:
        # --out is hilum sim's before 'sweep', the sweep's own after it
        out_first = any("--out".startswith(w.split("=", 1)[0]) and len(w) > 3 for w in before)  # --ou: argparse's too
        hint = "; give --out after 'sweep' for the sweep's folder" if out_first else ""
        print(
            f"hilum sim sweep: error: {', '.join(before)} before 'sweep' would be ignored: a sweep's runs are set in "
            f"its file (docs/sim-results.md){hint}",
            file=sys.stderr,
        )
        return 2
    try:
        config, settings = _with_config_file(load_sweep_config(args.config), args.config)
        try:
            facts = _check_sweep(config, settings)
        except SweepConfigError as exc:  # the file's content: named with the file, as load_sweep_config's errors are
            raise SweepConfigError([f"{args.config}: {error}" for error in exc.errors]) from None
        if args.ray_address is not None and not args.ray_address.strip():
            raise ValueError("--ray-address is empty: give HOST:PORT, or leave the flag out for a local Ray")
        made = not Path(args.out).exists()
        names = [SWEEP_FILE_NAME, *plot_file_names(config.topologies).values()]
        out = _output_dir(args.out, "sweep.json and the plots", names)
    except (ValueError, OSError, ValidationError) as exc:
        print(f"hilum sim sweep: error: {exc}", file=sys.stderr)
        return 2
    assert out is not None
    try:
        rows = run_sweep(config, ray_address=args.ray_address, out_dir=out)
    except KeyboardInterrupt:
        return _interrupted("hilum sim sweep", out if made else None)
    except (SweepPointError, ValueError, ConnectionError) as exc:
        if made and not any(out.iterdir()):
            out.rmdir()  # made for this sweep, and nothing written into it
        print(f"hilum sim sweep: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    # two tables, as hilum sim prints (all 30 columns in one were 278 characters wide), without the columns with
    # nothing to count (as hilum sim's); every figure is in sweep.json
    idle = _sweep_idle_columns(config, settings, facts, [r.summary for r in rows])
    moves = "migrations and " if any(c not in idle for c in MOVE_COLUMNS) else ""

    def build(columns: Sequence[str], title: str) -> Table:
        return render_sweep_table(rows, title=title, columns=columns, compact=True)

    latency = [c for c in LATENCY_COLUMNS if c not in idle]
    migration = [c for c in MIGRATION_COLUMNS if c not in idle]
    console = Console()
    if sys.stdout.isatty():  # a terminal too narrow for a table: its columns over several tables, none cut to '…'
        tables = [
            *split_to_fit(build, latency, "hilum sim sweep", console.width),
            *split_to_fit(build, migration, f"{moves}simulator cost", console.width),
        ]
    else:  # files and pipes: the two tables at their natural width
        tables = [build(latency, "hilum sim sweep"), build(migration, f"{moves}simulator cost")]
        console = Console(width=max(200, *(Console(width=10_000).measure(t).maximum for t in tables)))
    for table in tables:
        console.print(table)
    scaled: dict[str, list[str]] = {}  # by topology, in grid order (each run records its own)
    for row in rows:
        known = scaled.setdefault(row.topology, [])
        known += [m for m in row.derived_latency_models if m not in known]
    for topology, models in scaled.items():
        _print_scaled(console, models, f" on {topology}" if len(scaled) > 1 else "")
    _print_idle(console, idle)
    print(f"sweep results and plots in {out}/", file=sys.stderr)
    return 0


def _sweep_idle_columns(
    config: SweepConfig, settings: HilumConfig, facts: _SweepFacts, summaries: Sequence[PolicySummary]
) -> dict[str, str]:
    """:func:`_idle_columns` of a sweep's runs (``facts``: what :func:`_check_sweep` read; the one-domain rule when
    every topology has one domain)."""
    caching = facts.options.prefix_caching
    return _idle_columns(
        config.policies,
        summaries,
        prefix_caching=settings.prefix_cache.enabled if caching is None else caching,
        prefix_hashes=facts.prefix_hashes,
        one_domain=facts.one_domain,
        autoscaled=facts.options.autoscale,
        autoscale_off="the autoscaler off",
    )


def _with_config_file(config: SweepConfig, path: str) -> tuple[SweepConfig, HilumConfig]:
    """The sweep with its configuration file as its runs take it, and that file's settings, as ``hilum sim`` takes
    ``--config``: the file is ``config``, else ``$HILUM_CONFIG``'s (named in the runs, so that every Ray worker reads
    the same file whatever its environment), read and checked here rather than in every task; its
    ``autoscale.enabled`` turns the autoscaler on unless ``options.autoscale`` is given (a sweep ignored it).
    ``path``: the sweep file, for errors. Raises ValueError."""
    resolved = config.config if config.config is not None else os.environ.get(CONFIG_ENV) or None
    settings = _configuration(resolved, f"{path}: config:" if config.config is not None else f"${CONFIG_ENV}")
    options = dict(config.options)
    if settings.autoscale.enabled and "autoscale" not in options:
        options["autoscale"] = True
    return config.model_copy(update={"config": resolved, "options": options}), settings


@dataclass(frozen=True, slots=True)
class _SweepFacts:
    """What :func:`_check_sweep` found that the sweep's tables need (:func:`_sweep_idle_columns`)."""

    options: SimOptions  # the runs' options, parsed
    prefix_hashes: bool  # some request of the trace carries prefix hashes
    one_domain: bool  # every topology has one domain


def _check_sweep(config: SweepConfig, settings: HilumConfig | None = None) -> _SweepFacts:
    """Fail before starting Ray on a grid that cannot run: unknown topology, trace, policy or option, a topology the
    simulator cannot run (``sim.runner.simulable_problems``), a rate scale (with a seed) whose arrivals span more than
    ``sim.traces.MAX_SPAN_S``, options that do not fit a topology (``sim.runner.check_options``), or options that
    clash with the configuration's ``settings`` (``sim.runner.check_autoscale``; None: not checked). Returns what it
    read that the tables need.

    Raises :class:`sim.sweep.SweepConfigError` with every problem found (``"<key>: <message>"``: a topology's own
    problems under ``topologies[i]``, the options' on it under ``options, on topologies[i] (name)``; a check that
    needs what an earlier one refused is skipped: the options on each topology when the options are invalid, the
    rate scales when the trace is).
    """
    from topology.load import TopologyError, load_topology

    from .runner import SimCheckError, check_options
    from .sweep import SweepConfigError
    from .traces import load_trace

    problems: list[str] = []
    unknown = [f"policies[{i}]: unknown policy {p!r}" for i, p in enumerate(config.policies) if p not in POLICY_NAMES]
    # one line per problem, as every other (quoted: a space in a name shows; names are not stripped)
    problems += [f"{problem}; choose from {', '.join(POLICY_NAMES)}" for problem in unknown]
    parsed: SimOptions | None = None
    try:
        parsed = SimSpec(topology="", trace=config.trace, policy="hilum", options=config.options).parsed_options()
    except SimCheckError as exc:  # load_sweep_config checked the keys: a rule across them
        problems += [f"options.{line}" for line in exc.lines()]
    if parsed is not None:  # the options against the configuration, as hilum sim checks its flags
        source = _described(settings, "the configuration") if settings is not None else "the configuration"
        if settings is not None:
            try:
                check_autoscale(parsed, settings, cold_start="options.cold_start_s", source=source)
            except ValueError as exc:
                problems.append(str(exc))
        try:
            check_prefix_aware(parsed, settings if settings is not None else HilumConfig(), source=source)
        except ValueError as exc:  # "prefix_aware_dispatch (--prefix-aware) needs ...": the key in the file
            problems.append(f"options.{exc}")
    prefix_hashes: list[bool] = []  # of the first trace loaded (the same requests in each: only arrivals differ)

    def check(where: str, rate_scale: float = 1.0, seed: int = 0) -> bool:
        """False when the trace itself cannot be read (said once, as ``trace: ...``)."""
        try:
            trace = load_trace(
                config.trace,
                rate_scale=rate_scale,
                max_requests=config.max_requests,
                seed=seed,
                arrival=config.arrival,
                rate_per_s=config.rate,
                arrival_cv=config.arrival_cv,
            )
        except ValueError as exc:
            try:  # an unknown or broken trace is named as such, not as the fault of a key or a grid point
                load_trace(config.trace, max_requests=config.max_requests)
            except ValueError as plain:
                problems.append(f"trace: {plain}")
                return False
            problems.append(f"{where}: {exc}")
            return True
        if not prefix_hashes:
            prefix_hashes.append(any(r.prefix_block_hashes for r in trace.requests))
        return True

    said = len(problems)
    readable = check("arrival") and len(problems) == said if config.arrival is not None else True  # said once
    points = [(i, rate_scale, seed) for i, rate_scale in enumerate(config.rate_scales) for seed in config.seeds]
    for i, rate_scale, seed in points:
        if not (readable and check(f"rate_scales[{i}] = {rate_scale:g}, seed {seed}", rate_scale, seed)):
            break
    domains = []
    on: dict[str, list[int]] = {}  # a problem of the options -> the topologies it was found on
    for i, name in enumerate(config.topologies):
        try:
            topology = load_topology(name)
        except TopologyError as exc:  # a line per error, led by the file's name as every sweep-file error is
            problems += [f"topologies[{i}]: invalid topology: {line}" for line in exc.lines()]
            continue
        if not topology.instances:  # not the options' fault
            problems.append(f"topologies[{i}]: {name} has no instances: there is nothing to simulate")
            continue
        domains.append(len(topology.domains))
        if parsed is not None:
            try:
                check_options(topology, parsed)
            except SimCheckError as exc:  # the topology's own problems under its key, the options' under theirs
                problems += [f"topologies[{i}]: {line}" for line in exc.topology_problems]
                for line in exc.option_problems:
                    on.setdefault(line, []).append(i)
            except ValueError as exc:  # the options' model is not one of the topology's
                on.setdefault(str(exc), []).append(i)
    for line, indices in on.items():
        if len(domains) > 1 and len(indices) == len(domains):  # whatever the topology: said once
            problems.append(f"options: {line}")
        else:
            problems += [f"options, on topologies[{i}] ({config.topologies[i]}): {line}" for i in indices]
    if problems:  # a sweep takes no hilum sim flags: its messages name the file's keys alone
        raise SweepConfigError([re.sub(r" \(--[a-z][a-z-]*(, in ms there)?\)", "", line) for line in problems])
    assert parsed is not None and prefix_hashes
    return _SweepFacts(parsed, prefix_hashes[0], all(n == 1 for n in domains))
