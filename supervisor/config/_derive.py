"""Configs derived from another config: the embedded default (or the minimal one-camera
pipeline) as a dict, dotted-key edits, and TOML out again. Tests, benchmarks and replays
start from the vehicle's own config and say only what they change, instead of keeping
copies of it."""
from __future__ import annotations

import copy
import json
import tomllib
from importlib import resources
from typing import Any

from supervisor.ipc.errors import ConfigError


MINIMAL = "configs/minimal.toml"       # under the supervisor package


def default_doc() -> dict[str, Any]:
    """The embedded ``supervisor/default.toml`` (the car: three cameras, two models,
    100 Hz control) as a plain dict (a fresh copy)."""
    return _doc("default.toml")


def minimal_doc() -> dict[str, Any]:
    """``supervisor/configs/minimal.toml`` as a plain dict (a fresh copy): the car's
    control pipeline with one camera and one model (camerad -> modeld -> controlsd, and
    research). For tests and benchmarks of the supervisor's mechanics, which need a real
    pipeline but not the car's load on two shared cores."""
    return _doc(MINIMAL)


def _doc(name: str) -> dict[str, Any]:
    return tomllib.loads(resources.files("supervisor").joinpath(name).read_text("utf-8"))


def derive(doc: dict[str, Any], *, drop: tuple[str, ...] | list[str] = (),
           set: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of `doc` without the dotted keys in `drop` (``"workers.research"``) and
    with each dotted key of `set` assigned (``{"workers.camerad.args": ["--fps", "15"]}``);
    tables on the way are created. A dropped key that does not exist is an error (a
    typo would silently derive the wrong system)."""
    out = copy.deepcopy(doc)
    for key in drop:
        *path, last = key.split(".")
        table = _walk(out, path, create=False, key=key)
        if last not in table:
            raise ConfigError(f"derive: no {key!r} to drop")
        del table[last]
    for key, value in (set or {}).items():
        *path, last = key.split(".")
        _walk(out, path, create=True, key=key)[last] = value
    return out


def _walk(doc: dict[str, Any], path: list[str], *, create: bool, key: str) -> dict[str, Any]:
    cur = doc
    for part in path:
        if part not in cur and create:
            cur[part] = {}
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            raise ConfigError(f"derive: {key!r}: {part!r} is not a table")
        cur = nxt
    return cur


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)          # a TOML basic string is a JSON string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def dumps(doc: dict[str, Any]) -> str:
    """TOML for a config: top-level tables of tables (``[workers.x]``), plain values
    and inline tables below them (role bindings)."""
    lines: list[str] = []
    for k, v in doc.items():
        if not isinstance(v, dict):
            lines.append(f"{_key(k)} = {_value(v)}")
    for section, body in doc.items():
        if not isinstance(body, dict):
            continue
        leaf = {k: v for k, v in body.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in body.items() if isinstance(v, dict)}
        if leaf or not nested:
            lines.append(f"\n[{_key(section)}]")
            lines += [f"{_key(k)} = {_value(v)}" for k, v in leaf.items()]
        for name, table in nested.items():
            lines.append(f"\n[{_key(section)}.{_key(name)}]")
            lines += [f"{_key(k)} = {_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
