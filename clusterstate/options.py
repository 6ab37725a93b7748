"""The options every hilum daemon shares besides its addresses (those are ``clusterstate.endpoints``): the etcd key
prefix, the log level, the lease TTL and the numbers that must be >= 0 or > 0, each checked by one rule, as argparse
``type=`` functions so that a bad value is a usage error (exit 2, the option named) before the process starts
anything.

Imports nothing heavy (see ``clusterstate.endpoints``).
"""

from __future__ import annotations

import argparse
import math

from clusterstate.endpoints import checked_option

__all__ = [
    "DEFAULT_PREFIX",
    "LOG_LEVELS",
    "LOG_LEVEL_HELP",
    "MAX_SEED",
    "MAX_TTL_S",
    "MIN_TTL_S",
    "check_prefix",
    "log_level_option",
    "non_negative_option",
    "positive_int_option",
    "positive_option",
    "prefix_option",
    "seed_option",
    "ttl_option",
]

DEFAULT_PREFIX = "/hilum/v1/"  # every daemon's --prefix default (clusterstate.store.Keys)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # what --log-level takes (any case)
LOG_LEVEL_HELP = f"logging level: {', '.join(LOG_LEVELS)} (default %(default)s)"  # argparse fills in the default
MIN_TTL_S = 2  # etcd's minimum lease TTL, seconds: the shortest --ttl a daemon's registration lease may have
MAX_SEED = 2**64 - 1  # the largest --seed: torch.manual_seed takes an unsigned 64-bit integer
MAX_TTL_S = 9_000_000_000  # etcd's maximum lease TTL, seconds (``MaxLeaseTTL``): it refuses to grant a longer one


def check_prefix(prefix: str) -> str:
    """``prefix`` once it is an etcd key prefix hilum can use: it starts and ends with ``/`` (``/hilum/v1/``).

    The one rule: :class:`clusterstate.store.Keys` and every ``--prefix`` option apply it.

    Raises:
        ValueError: naming the prefix.
    """
    if not prefix.startswith("/") or not prefix.endswith("/"):
        raise ValueError(f"etcd key prefix must start and end with '/', got {prefix!r}")
    return prefix


def prefix_option(text: str) -> str:
    """argparse ``type=`` of a ``--prefix`` option: ``text`` once :func:`check_prefix` accepts it.

    Raises argparse.ArgumentTypeError (argparse names the option)."""
    return checked_option(check_prefix, text)


def log_level_option(text: str) -> str:
    """argparse ``type=`` of a ``--log-level`` option: one of :data:`LOG_LEVELS`, in any case; returns it upper-case
    (as ``logging.basicConfig(level=...)`` takes it).

    Raises argparse.ArgumentTypeError (argparse names the option)."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: choose one of {', '.join(LOG_LEVELS)}")
    return level


def ttl_option(text: str) -> int:
    """argparse ``type=`` of a daemon's ``--ttl`` (its etcd lease, whole seconds): an integer of at least
    :data:`MIN_TTL_S`, etcd's minimum, and at most :data:`MAX_TTL_S`, its maximum. Raises argparse.ArgumentTypeError
    (argparse names the option)."""
    try:
        ttl_s = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole seconds, got {text!r}") from None
    if ttl_s < MIN_TTL_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_TTL_S} s (etcd's minimum lease TTL), got {ttl_s}")
    if ttl_s > MAX_TTL_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TTL_S:,} s (etcd's maximum lease TTL), got {ttl_s:,}")
    return ttl_s


def _number(text: str, above: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number {above}, got {text!r}")
    return value


def non_negative_option(text: str) -> float:
    """argparse ``type=`` of an option that takes a finite number >= 0 (seconds, a rate where 0 means "none").
    Raises argparse.ArgumentTypeError (argparse names the option)."""
    value = _number(text, ">= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _whole_number(text: str, least: int, most: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    if most is not None and value > most:
        raise argparse.ArgumentTypeError(f"expected a whole number <= {most}, got {text!r}")
    return value


def positive_int_option(text: str) -> int:
    """argparse ``type=`` of an option that takes a whole number >= 1 (a count or a size). Raises
    argparse.ArgumentTypeError (argparse names the option)."""
    return _whole_number(text, 1)


def seed_option(text: str) -> int:
    """argparse ``type=`` of a ``--seed``: a whole number from 0 to :data:`MAX_SEED`, as ``hilum sim`` and ``hilum
    bench`` take it (a negative one ran; ``random.Random`` hashes away its sign, so -1 and 1 drew the same; one
    beyond torch's 64-bit seed stopped a torch llumlet after the cluster had started). Raises
    argparse.ArgumentTypeError (argparse names the option)."""
    return _whole_number(text, 0, MAX_SEED)


def positive_option(text: str) -> float:
    """argparse ``type=`` of an option that takes a finite number > 0. Raises argparse.ArgumentTypeError."""
    value = _number(text, "> 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value
