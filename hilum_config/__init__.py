"""hilum_config — one validated configuration file for the rule book, the cost model and the approval rule.

Every tier reads the same file (``--config FILE`` of ``python -m rack_sched``, ``python -m global_coord``,
``python -m gateway``, ``python -m llumlet``, ``hilum up`` and ``hilum sim``; ``HILUM_CONFIG`` in the systemd
config), so a simulated and a live cluster decide with the same settings. Every key is optional; a missing
key takes the default below, which is the default of the dataclass it configures (one place for defaults).
Sections and what they build:

==============  =================================================  ==========================================
section         dataclass                                           used by
==============  =================================================  ==========================================
``policy``      ``policy.types.PolicyConfig``                       every tier: virtual usage, dispatch, pairing
``remaining``   ``policy.remaining.RemainingConfig``                domain schedulers: remaining-output estimate
``domain``      ``rack_sched.core.DomainConfig`` (its own keys)     domain schedulers: settle, cool-down
``cost``        ``topology.cost.CostConfig``                        coordinator, llumlets (pre-copy rule, cap, plan)
``approval``    ``global_coord.approval.ApprovalConfig``            coordinator: cross-domain approvals
``measured_``   ``topology.bandwidth.MeasuredBandwidthConfig``      coordinator, ``hilum sim``: pricing moves
``bandwidth``                                                       with the rates moves were measured at
``intervals``   :class:`Intervals`                                  domain schedulers, gateways, ``hilum sim``
``resume``      :class:`ResumeConfig`                               gateways: replaying requests whose instance
                                                                    failed (``gateway.core.plan_resume``)
``autoscale``   ``policy.autoscale.AutoscaleConfig`` (the rule) and  coordinator leader, ``hilum sim``
                ``global_coord.actuator.ActuatorConfig`` (the hook)
``prefix_``     ``llumlet.engine.prefix_hash.PrefixCacheConfig``    gateways (prompt hashes), llumlets (the sim
``cache``                                                           engine's cache, load reports)
==============  =================================================  ==========================================

``docs/configuration.md`` lists every key with its default and unit; ``examples/hilum.yaml`` is a complete
file with the defaults. Errors name the file and the key (``hilum.yaml: policy.tie_tolerance: ...``), all at
once, in one :class:`ConfigError`; an unknown key is an error, never ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from global_coord.actuator import ActuatorConfig
from global_coord.approval import ApprovalConfig
from llumlet.engine.prefix_hash import PrefixCacheConfig
from policy.autoscale import AutoscaleConfig
from policy.remaining import RemainingConfig
from policy.types import PolicyConfig, loop_interval_problem
from rack_sched.core import DomainConfig
from topology.bandwidth import MeasuredBandwidthConfig
from topology.cost import CostConfig
from topology.load import YamlFileError, pydantic_message, read_yaml_file

__all__ = [
    "CONFIG_ENV",
    "DEFAULTS_SOURCE",
    "ConfigError",
    "HilumConfig",
    "Intervals",
    "ResumeConfig",
    "add_argument",
    "load_config",
    "parse_config",
]

#: Environment variable naming the configuration file when no ``--config`` is given.
CONFIG_ENV = "HILUM_CONFIG"
#: :attr:`HilumConfig.source` of the built-in defaults (no file).
DEFAULTS_SOURCE = "<defaults>"


class ConfigError(ValueError):
    """A configuration file is invalid. ``errors`` lists every problem as ``"<file>: <key.path>: <message>"``;
    ``named_by``: how the file was named, ``--config`` or ``$HILUM_CONFIG`` (:func:`load_config` sets it, and the
    error's text then starts each line with it, so a service that prints the error names where the file came from);
    None for :func:`parse_config`'s."""

    def __init__(self, errors: list[str], named_by: str | None = None) -> None:
        self.errors = errors
        self.named_by = named_by
        super().__init__("\n".join(errors))

    def for_flag(self, flag: str | None = None) -> str:
        """The problems for a command line that named the file with ``flag`` (None: :attr:`named_by`, else
        ``--config``): one line each, ``"--config <file>: <key.path>: <message>"``."""
        return "\n".join(f"{flag or self.named_by or '--config'} {e}" for e in self.errors)

    def __str__(self) -> str:
        return self.for_flag() if self.named_by else "\n".join(self.errors)


@dataclass(frozen=True, slots=True)
class Intervals:
    """Periods of the decision loops, seconds. Raises ValueError on a loop period below
    ``policy.types.MIN_LOOP_INTERVAL_S`` or not finite, or on a ``reservation_ttl_s`` not finite and > 0."""

    rebalance_interval_s: float = 0.05  # intra-domain rescheduling round (Llumnix: 50 ms)
    summary_interval_s: float = 0.25  # at most one domain summary put per this
    cross_interval_s: float = 0.5  # the domains' cross-domain round
    reservation_ttl_s: float = 1.0  # a gateway's dispatch reservation counts at most this long

    def __post_init__(self) -> None:
        for name in ("rebalance_interval_s", "summary_interval_s", "cross_interval_s"):
            problem = loop_interval_problem(name, getattr(self, name))
            if problem is not None:
                raise ValueError(problem)
        if not 0 < self.reservation_ttl_s < math.inf:
            raise ValueError(f"reservation_ttl_s must be a finite number of seconds > 0, got {self.reservation_ttl_s}")


@dataclass(frozen=True, slots=True)
class ResumeConfig:
    """Resuming a request whose instance failed (``gateway.core.plan_resume``). Raises ValueError on a bad value.

    ``max_replays``: times one request (one choice) may be replayed on another instance after its instance
    died or its engine failed; 0 turns resuming off (such a request ends with an error event). NVIDIA
    Dynamo's ``--migration-limit`` is the same setting; 3, its suggested value, survives transient losses
    without replaying forever.
    """

    max_replays: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.max_replays, int) or self.max_replays < 0:
            raise ValueError(f"max_replays must be an int >= 0, got {self.max_replays!r}")


@dataclass(frozen=True, slots=True)
class HilumConfig:
    """The whole configuration (see the module docstring)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    remaining: RemainingConfig = field(default_factory=RemainingConfig)
    domain: DomainConfig = field(default_factory=DomainConfig)  # its policy and remaining are the sections above
    cost: CostConfig = field(default_factory=CostConfig)
    approval: ApprovalConfig = field(default_factory=ApprovalConfig)
    intervals: Intervals = field(default_factory=Intervals)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    measured_bandwidth: MeasuredBandwidthConfig = field(default_factory=MeasuredBandwidthConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # the rule keys of the autoscale section
    actuator: ActuatorConfig = field(default_factory=ActuatorConfig)  # its command keys (autoscale.command ...)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    source: str = DEFAULTS_SOURCE  # where it was read from

    def sections(self) -> dict[str, dict[str, Any]]:
        """Every setting in the file's layout, ``{section: {key: value}}`` (every key, defaults included): what a
        run used, for its record (``results.json``'s ``spec.config.settings``). :func:`parse_config` of it gives
        back these settings."""
        out: dict[str, dict[str, Any]] = {}
        for name, (cls, only) in _SECTIONS.items():
            section = self.domain if name == "domain" else getattr(self, name)
            out[name] = {f.name: getattr(section, f.name) for f in _keys(cls, only)}
        out["autoscale"].update({f.name: getattr(self.actuator, f.name) for f in _keys(_AUTOSCALE_ACTUATOR, None)})
        return out


# The sections: name -> (dataclass, keys of it that the file sets; None = every init field).
_DOMAIN_KEYS = ("settle_s", "cool_down_s", "default_decode_step_s")
_SECTIONS: dict[str, tuple[type[Any], tuple[str, ...] | None]] = {
    "policy": (PolicyConfig, None),
    "remaining": (RemainingConfig, None),
    "domain": (DomainConfig, _DOMAIN_KEYS),
    "cost": (CostConfig, None),
    "approval": (ApprovalConfig, None),
    "intervals": (Intervals, None),
    "resume": (ResumeConfig, None),
    "measured_bandwidth": (MeasuredBandwidthConfig, None),
    "autoscale": (AutoscaleConfig, None),  # and ActuatorConfig's keys: see _AUTOSCALE_ACTUATOR
    "prefix_cache": (PrefixCacheConfig, None),
}
_AUTOSCALE_ACTUATOR = ActuatorConfig  # the autoscale section's other keys (the hook): HilumConfig.actuator


def _keys(cls: type[Any], only: tuple[str, ...] | None) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init and (only is None or f.name in only)]


def _schema(cls: type[Any], only: tuple[str, ...] | None, *more: type[Any]) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for c in (cls, *more):
        hints = typing.get_type_hints(c)
        fields.update({f.name: (hints[f.name], None) for f in _keys(c, only if c is cls else None)})
    return create_model(f"{cls.__name__}Section", __config__=ConfigDict(extra="forbid", strict=True), **fields)


def parse_config(raw: Any, source: str = "<config>") -> HilumConfig:
    """Build a :class:`HilumConfig` from parsed YAML (a mapping of sections; None or {} = all defaults).

    Raises:
        ConfigError: listing every unknown section or key, every wrongly typed value and every value a
            dataclass refuses, each as ``"<source>: <section>.<key>: <message>"``.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            [f"{source}: expected a mapping of sections ({', '.join(_SECTIONS)}), got {type(raw).__name__}"]
        )
    errors = [
        f"{source}: {name}: unknown section (known: {', '.join(_SECTIONS)})" for name in raw if name not in _SECTIONS
    ]
    built: dict[str, Any] = {}
    for name, (cls, only) in _SECTIONS.items():
        section = raw.get(name) or {}
        if not isinstance(section, Mapping):
            errors.append(f"{source}: {name}: expected a mapping of keys, got {type(section).__name__}")
            continue
        more = (_AUTOSCALE_ACTUATOR,) if name == "autoscale" else ()
        schema = _schema(cls, only, *more)
        refused: set[int | str] = set()  # keys refused for their type (or unknown); the rest checked without them
        try:
            values = schema.model_validate(dict(section))
        except ValidationError as exc:
            refused = {e["loc"][0] for e in exc.errors() if e["loc"]}
            for e in exc.errors():  # in hilum's words, as a sweep file's (not "Input should be a valid number")
                errors.append(f"{source}: {_where(name, e['loc'])}: {pydantic_message(e, schema.model_fields)}")
            # the section's other keys are still checked, so a wrong type never hides a bad value next to it
            typed = {k: v for k, v in section.items() if k not in refused}
            try:
                values = schema.model_validate(typed)
            except ValidationError:
                continue
            section = typed
        kwargs = {k: v for k, v in values.model_dump().items() if v is not None and k in section}
        if name == "domain":
            built[name] = kwargs  # completed below with its policy and remaining
            continue
        for c in (cls, *more):
            own = {k: v for k, v in kwargs.items() if k in {f.name for f in _keys(c, None)}}
            try:
                built["actuator" if c is _AUTOSCALE_ACTUATOR else name] = _build(
                    c, own, f"{source}: {name}", refused=refused
                )
            except ConfigError as exc:
                errors += exc.errors
    policy, remaining = built.get("policy", PolicyConfig()), built.get("remaining", RemainingConfig())
    try:  # checked even when other sections failed (with the defaults in their place), so nothing is hidden
        domain = _build(
            DomainConfig, {"policy": policy, "remaining": remaining, **built.get("domain", {})}, f"{source}: domain"
        )
    except ConfigError as exc:
        errors += exc.errors
    if errors:
        raise ConfigError(errors)
    return HilumConfig(
        policy,
        remaining,
        domain,
        built["cost"],
        built["approval"],
        built["intervals"],
        built["resume"],
        built["measured_bandwidth"],
        built["autoscale"],
        built["actuator"],
        built["prefix_cache"],
        source,
    )


def _build(cls: type[Any], values: dict[str, Any], where: str, *, refused: Collection[int | str] = ()) -> Any:
    """``cls(**values)``, or ConfigError with every value it refuses: each refusal names its key when the
    dataclass's message does (``"cap_fraction must be ..."``, ``"PolicyConfig.tie_tolerance: must be ..."``) as
    ``"<where>.<key>: <message>"``; that key is set aside and the rest tried again, so one bad value never hides
    another. A refusal naming no key (a rule between keys) is reported at ``where`` and ends the search, unless it
    names a key of ``refused`` (already refused for its type: the rule would weigh its default, which the file did
    not choose); then it only ends the search."""
    errors: list[str] = []
    left = dict(values)
    for _ in range(len(values) + 1):  # each try sets one key aside, or ends
        try:
            built = cls(**left)
        except ValueError as exc:
            key, message = _blamed(str(exc), left, cls.__name__)
            if key is None:
                if not any(str(key) in message for key in refused):
                    errors.append(f"{where}: {message}")
                break
            errors.append(f"{where}.{key}{message}" if message.startswith("[") else f"{where}.{key}: {message}")
            del left[key]
        else:
            if not errors:
                return built
            break
    raise ConfigError(errors)


def _blamed(message: str, keys: Mapping[str, Any], class_name: str) -> tuple[str | None, str]:
    """The key a dataclass's refusal names at its start (the longest that matches) and the rest of the message;
    (None, message) when it names none."""
    text = message.removeprefix(f"{class_name}.").removeprefix(f"{class_name}: ")
    for key in sorted(keys, key=len, reverse=True):
        if text.startswith(f"{key}: "):
            return key, text[len(key) + 2 :]
        if text.startswith(f"{key} ("):  # "key (value) must be ...": the sentence needs its subject
            return key, text
        if text.startswith(f"{key}["):  # "key[2]: ..." (an entry of a mapping): the entry stays in the path
            return key, text[len(key) :]
        if text.startswith(f"{key} "):
            return key, text[len(key) + 1 :]
    return None, text


def _where(section: str, loc: tuple[int | str, ...]) -> str:
    """``policy.tie_tolerance``: the key path of a pydantic error; a mapping's bad key as ``…: key 'x'``."""
    if loc and loc[-1] == "[key]":
        return ".".join(str(p) for p in (section, *loc[:-2])) + f": key {loc[-2]!r}"
    return ".".join(str(p) for p in (section, *loc))


def load_config(path: str | Path | None = None) -> HilumConfig:
    """Read the configuration file at ``path``, else the one ``HILUM_CONFIG`` names, else the defaults.

    Raises:
        ConfigError: the path is empty, or the file cannot be read, is not YAML, or is invalid (every problem
            listed).
    """
    named_by = "--config"
    if path is None:
        path, named_by = os.environ.get(CONFIG_ENV) or None, f"${CONFIG_ENV}"
    if path is None:
        return HilumConfig()
    p = Path(path)
    try:
        if not str(path).strip():  # Path("") is the current directory
            raise ConfigError(["is empty: give a configuration file, or leave it out for the defaults"])
        try:
            raw = read_yaml_file(p, "the configuration file")
        except YamlFileError as exc:
            raise ConfigError([f"{p}: {exc}"]) from None
        return parse_config(raw, str(p))
    except ConfigError as exc:
        exc.named_by = named_by
        raise


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Add the ``--config FILE`` option every hilum command takes (read with :func:`load_config`)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"hilum configuration file (default: ${CONFIG_ENV}, else the built-in defaults; docs/configuration.md)",
    )
