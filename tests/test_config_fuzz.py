"""Config files an operator could get wrong, generated: the loader answers every one
with a ConfigError (one line per problem, naming file and key) or a Config, never a
traceback. FUZZ_EXAMPLES raises the count for the long run (bench/fuzz.sh)."""
from __future__ import annotations

import os

import tomllib
from hypothesis import HealthCheck, given, settings, strategies as st

from supervisor.config import ConfigError, loads

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "400"))

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                     st.floats(allow_nan=True), st.text(max_size=12),
                     st.sampled_from(["4KiB", "1GiB", "200%", "nv12", "control", "research",
                                      "workers.probe", "fail_safe", "always", "float32"]))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
_KEYS = {
    "domains": ["profile", "network", "failure_policy", "actuates", "extra_ro_binds", "user"],
    "channels": ["slot_size", "slot_count", "dtype", "kind", "pixel_formats", "max_readers",
                 "max_leases", "lease_ms", "max_age_ms", "crc", "shadow", "payload"],
    "workers": ["domain", "module", "command", "args", "publishes", "subscribes",
                "shadow_subscribes", "restart", "max_restarts", "watchdog_ms", "memory_max",
                "cpu_quota", "pids_max", "jit_kernels", "warm_standby", "optional", "nofile"],
}


@st.composite
def documents(draw) -> dict:
    doc: dict = {}
    for section, keys in _KEYS.items():
        names = draw(st.lists(st.sampled_from(["control", "research", "a", "b", "x", "Bad!"]),
                              max_size=3, unique=True))
        doc[section] = {n: {k: draw(_values) for k in draw(st.lists(st.sampled_from(keys),
                                                                    max_size=5, unique=True))}
                        for n in names}
    if draw(st.booleans()):
        doc["supervisor"] = {draw(st.sampled_from(["status_interval_s", "shm_budget", "log_format",
                                                   "nope"])): draw(_values)}
    return doc


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and abs(value) != float("inf") else "nan"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return '""'


def render(doc: dict) -> str:
    out = []
    for section, tables in doc.items():
        if section == "supervisor":
            out.append("[supervisor]")
            out += [f"{k} = {_toml(v)}" for k, v in tables.items() if v is not None]
            continue
        for name, table in tables.items():
            out.append(f'[{section}."{name}"]')
            out += [f"{k} = {_toml(v)}" for k, v in table.items() if v is not None]
    return "\n".join(out) + "\n"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents())
def test_any_config_is_a_config_or_one_line_problems(doc):
    text = render(doc)
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return                              # not TOML at all: a different (tested) path
    try:
        cfg = loads(text, "fuzz.toml")
    except ConfigError as e:
        lines = str(e).splitlines()
        assert lines and all(ln.strip() for ln in lines)
        assert all("fuzz.toml" in ln for ln in lines[1:]), lines
        return
    assert cfg.workers, "a config without workers must not load"


@settings(max_examples=max(EXAMPLES // 4, 50), deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_are_a_config_error(data):
    try:
        loads(data.decode("utf-8", "replace"), "junk.toml")
    except ConfigError as e:
        assert str(e).startswith("junk.toml")
