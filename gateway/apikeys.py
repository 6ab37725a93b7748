"""API keys: who may call the gateway, and the priority class each caller's requests get.

Without a key file the gateway is open (any ``Authorization`` header is ignored, as vLLM without
``--api-key``). With one (``python -m gateway --api-keys FILE``, ``hilum up --api-keys FILE``), every
``/v1/`` route needs ``Authorization: Bearer <key>`` with a key of the file (HTTP 401, OpenAI's
``invalid_api_key``, otherwise); ``/health`` and ``/metrics`` stay open for probes and scrapers.

Each key carries a priority class (Dynamo, llm-d and SGLang's gateway tie priority to the caller the same
way): ``priority`` is what its requests get when they name none, ``max_priority`` the highest they may ask
for with the ``priority`` field or ``X-Hilum-Priority`` (HTTP 403 above it), so a batch team's key cannot
jump the queue of an interactive one. The file, YAML::

    keys:
      - name: chat-frontend            # shown in errors and logs; unique
        key_sha256: 9f86d08...         # sha256 hex of the key (keeps the secret out of the file) ...
        priority: high                 # 0..9 or a name of gateway.validation.PRIORITY_NAMES; default 0
      - name: batch-jobs
        key: sk-batch-123              # ... or the key itself
        priority: 0
        max_priority: 0                # default: its priority

Keys are compared by their sha256 digest in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.validation import BadRequest, parse_priority
from topology.load import YamlFileError, read_yaml_file, shown_value

__all__ = ["ApiKey", "ApiKeys", "Unauthorized", "load_api_keys", "parse_api_keys"]

_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("name", "key", "key_sha256", "priority", "max_priority")


class Unauthorized(Exception):
    """No key, or not one of the file's (HTTP 401, OpenAI's ``invalid_api_key``)."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One caller: its name, its key's sha256 (hex), the priority class its requests get and the highest they
    may ask for."""

    name: str
    key_sha256: str
    priority: int = 0  # 0..MAX_PRIORITY: requests that name no priority get this one
    max_priority: int = 0  # priority..MAX_PRIORITY: the highest a request may ask for


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The key file's callers; :meth:`authenticate` finds the one an ``Authorization`` header names."""

    keys: tuple[ApiKey, ...]
    source: str = "<api keys>"

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The caller of ``Authorization: Bearer <key>``. Raises Unauthorized (saying what was wrong)."""
        if not authorization:
            raise Unauthorized("this gateway needs an API key: send the header Authorization: Bearer <key>")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("the Authorization header must be 'Bearer <key>'")
        digest = hashlib.sha256(token.encode()).hexdigest()
        found = None
        for key in self.keys:  # every key compared, in constant time: no early exit that times the match
            if hmac.compare_digest(digest, key.key_sha256):
                found = key
        if found is None:
            raise Unauthorized("the API key is not valid here")
        return found


def parse_api_keys(raw: Any, source: str = "<api keys>") -> ApiKeys:
    """Build :class:`ApiKeys` from parsed YAML (the module docstring's layout).

    Raises ValueError listing every problem as ``"<source>: keys[i] (name): <what>"``: not a mapping, no
    ``keys`` list, an unknown field, neither or both of ``key`` / ``key_sha256``, a digest that is not 64 hex
    digits, a bad priority, ``max_priority`` below ``priority``, a name or key given twice.
    """
    # in the words of every YAML file hilum reads (topology.load.pydantic_message)
    if not isinstance(raw, Mapping):
        got = "an empty file" if raw is None else shown_value(raw)
        raise ValueError(f"{source}: (top level): expected a mapping with one key, keys (a list of keys), got {got}")
    top = [f"{source}: {k}: unknown key; expected one of: keys" for k in raw if k != "keys"]
    if "keys" not in raw:
        top.append(f"{source}: keys: missing required key (a list of keys)")
    elif isinstance(raw["keys"], str) or not isinstance(raw["keys"], Sequence):
        top.append(f"{source}: keys: expected a list, got {shown_value(raw['keys'])}")
    if top:
        raise ValueError("\n".join(top))
    errors: list[str] = []
    keys: list[ApiKey] = []
    entries: dict[str, dict[str, list[str]]] = {"name": {}, "key": {}}  # each name's and digest's keys[i] (name)
    for i, entry in enumerate(raw["keys"]):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, Mapping):
            errors.append(f"{where}: expected a mapping with {', '.join(_FIELDS)}")
            continue
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            errors.append(f"{where}: name: a non-empty string is required")
            continue
        where = f"{where} ({name})"
        unknown = sorted(str(k) for k in entry if k not in _FIELDS)
        if unknown:
            errors.append(f"{where}: {', '.join(unknown)}: unknown key; expected one of: {', '.join(_FIELDS)}")
            continue
        digest = _digest(entry, where, errors)
        try:
            priority = parse_priority(entry.get("priority", 0), "priority")
            ceiling = parse_priority(entry.get("max_priority", priority), "max_priority")
        except BadRequest as exc:
            errors.append(f"{where}: {exc.message}")
            continue
        if ceiling < priority:
            errors.append(f"{where}: max_priority {ceiling} is below priority {priority}")
            continue
        if digest is not None:
            keys.append(ApiKey(name, digest, priority, ceiling))
            for label, value in (("name", name), ("key", digest)):
                entries[label].setdefault(value, []).append(f"keys[{i}] ({name})")
    for label, places in entries.items():
        for same in places.values():
            if len(same) > 1:  # a key's value is a secret: the entries are named, not it
                errors.append(f"{source}: {', '.join(same)}: the same {label} in {len(same)} entries")
    if not keys and not errors:
        errors.append(f"{source}: keys is empty: a key file with no key would refuse every request")
    if errors:
        raise ValueError("\n".join(errors))
    return ApiKeys(tuple(keys), source)


def _digest(entry: Mapping[str, Any], where: str, errors: list[str]) -> str | None:
    key, digest = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (digest is None):
        errors.append(f"{where}: give exactly one of key and key_sha256")
        return None
    if key is not None:
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            errors.append(f"{where}: key must be a non-empty string without surrounding spaces")
            return None
        return hashlib.sha256(key.encode()).hexdigest()
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest.lower()):
        errors.append(f"{where}: key_sha256 must be 64 hexadecimal digits (sha256sum of the key)")
        return None
    return digest.lower()


def load_api_keys(path: str | Path) -> ApiKeys:
    """Read and check a key file. Raises ValueError naming the file (unreadable, not YAML, or a bad entry)."""
    try:
        raw = read_yaml_file(Path(path), "the API key file")
    except YamlFileError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return parse_api_keys(raw, str(path))
