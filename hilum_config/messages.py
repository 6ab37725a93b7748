"""Pydantic's validation errors of a YAML file hilum reads (the configuration file, a sweep file and its run options)
in hilum's words: what was wanted and what the file wrote, in YAML's terms (``expected an integer, got 2.5 (a decimal
number)``), not pydantic's ("Input should be a valid integer", "Extra inputs are not permitted", "Value error, ...").

Imports nothing of hilum's (``sim.sweep`` and ``hilum_config`` use it; ``topology.load``, which imports nothing of
ours, words its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["pydantic_message", "shown_value"]

#: What a strict type error wanted, in the words of the docs (docs/sim-results.md, docs/configuration.md).
_WANTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping of keys",
    "bool_type": "true or false",
}


def shown_value(value: Any) -> str:
    """``value`` as a YAML file wrote it, with its kind in YAML's words: ``true (a boolean)``, ``'1.0' (a string)``,
    ``null (no value)``, ``a list``."""
    if value is None:
        return "null (no value)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int):
        return f"{value} (an integer)"
    if isinstance(value, float):
        return f"{value!r} (a decimal number)"
    if isinstance(value, str):
        text = repr(value) if len(value) <= 40 else repr(value[:37] + "...")
        return f"{text} (a string)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"{value} (a {type(value).__name__})"  # a YAML date or timestamp


def pydantic_message(err: Mapping[str, Any], keys: Iterable[str]) -> str:
    """One error of pydantic's ``ValidationError.errors()`` in hilum's words; ``keys``: the keys the mapping knows,
    which an unknown one is told. Its place (the key path) is the caller's to write."""
    kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    if kind in _WANTED:
        quoted = kind in ("int_type", "float_type") and isinstance(given, str) and _is_number(given)
        return f"expected {_WANTED[kind]}, got {shown_value(given)}" + ("; write it without quotes" if quoted else "")
    if kind == "value_error":  # a validator's own message
        return str(ctx.get("error", err["msg"])).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return f"unknown key; expected one of: {', '.join(keys)}"
    if kind == "missing":
        return "missing required key"
    if kind in ("greater_than", "greater_than_equal"):
        bound = f"> {ctx['gt']:g}" if kind == "greater_than" else f">= {ctx['ge']:g}"
        return f"must be {bound}, got {given!r}"
    if kind == "finite_number":
        return f"must be a finite number, got {given!r}"
    if kind == "too_short":
        return "must list at least one entry"
    if kind == "string_too_short":
        return "must not be empty"
    if kind in ("less_than", "less_than_equal"):
        bound = f"< {ctx['lt']:g}" if kind == "less_than" else f"<= {ctx['le']:g}"
        return f"must be {bound}, got {given!r}"
    if kind == "literal_error":  # ctx["expected"]: "'trace', 'poisson' or 'gamma'"
        return f"must be one of {ctx['expected']}, got {shown_value(given)}"
    return str(err["msg"])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
