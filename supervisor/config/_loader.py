"""Reading a config: TOML to checked dataclasses, every problem reported at once.

`_Loader` checks each table against its key schema (types, ranges, names) and each
entry on its own; the rules that need the whole file are `_rules`'.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from supervisor.ipc._cadence import MAX_BUSY_POLL_US
from supervisor.ipc.errors import ConfigError
from supervisor.ipc.spec import DTYPES, KINDS, PIXEL_FORMATS, ChannelSpec
from supervisor.sandbox.sched import MAX_BUDGET_PCT, MAX_PRIORITY

from . import _rules
from ._model import (CONTROL, DEFAULT_SOURCE, MIN_WORKER_MEMORY, PROFILE_DEFAULTS, PROFILE_LIMITS,
                     PROFILES,
                     PROJECT_ROOT,
                     RESEARCH, SIMULATION, VEHICLE,
                     ChannelConfig, Config, ConfigFileError, DomainConfig, ModelConfig, Problem,
                     SupervisorConfig, WorkerConfig)
from ._values import (_CHANNEL_NAME, _NAME, _abs_path, _argv, _bindings, _bool, _choice,
                      _describe, _int, _ItemError, _in, _key, _module, _number, _percent,
                      _rel_path, _size, _state_dir, _str_list, _string, _suggest, _user,
                      format_size)


# Why each isolation field of a control-profile domain cannot be loosened.
_CONTROL_MUST = {
    "network": "must not have network access",
    "hide_compilers": "must not see compilers",
    "exec_after_start": "must not start processes after start-up",
    "refuse_torch": "must refuse torch",
    "exec_memory_after_ready": "must not map new executable memory after READY",
    "seccomp": "must keep the control syscall filter",
}


def _toml(v: object) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v)


# --------------------------------------------------------------------------- schemas
# key -> check; defaults come from the dataclasses of _model (no default = required).

# Every number has a range, with its unit: past it, a value is a typo or would break
# something later (1e308 overflows a cgroup file; a 1 ms watchdog kills every worker).
MS_MAX = 3_600_000           # an hour: no timeout or interval of a worker is longer
S_MAX = 86_400.0             # a day: no window or cool-down is longer
SIZE_MAX = 1 << 40           # 1 TiB: more than any vehicle computer's memory

_SUPERVISOR_KEYS: dict[str, Callable[[Any], Any]] = {
    # the live status line and its event: more often than 10 Hz is a busy loop
    "status_interval_s": _number(0.1, 3600.0, unit=" s", least=True),
    # the maps re-scan: 20 ms is the least tried under load (issue 22)
    "maps_scan_interval_s": _number(0.01, 3600.0, unit=" s", least=True),
    "log_format": _choice("json", "text"),
    "state_dir": _state_dir,
    "shm_budget": _size(1 << 20, SIZE_MAX),
    "mode": _choice(VEHICLE, SIMULATION),
    # workers starting at once: more than a machine's CPUs only queues them
    "start_parallel": _int(1, 64),
}
_DOMAIN_KEYS: dict[str, Callable[[Any], Any]] = {
    "profile": _choice(CONTROL, RESEARCH),
    "network": _bool,
    "failure_policy": _choice("restart", "fail_safe"),
    "actuates": _bool,
    "extra_ro_binds": _str_list(_abs_path),
    "python_path": _str_list(_abs_path),
    "extra_rw_binds": _str_list(_abs_path),
    "user": _user,
    "hide_compilers": _bool,
    "exec_after_start": _bool,
    "refuse_torch": _bool,
    "exec_memory_after_ready": _bool,
    "seccomp": _choice(CONTROL, RESEARCH),
    "memory_max": _size(1 << 20, SIZE_MAX),
    "pids_max": _int(8, 1 << 22),
}
_MODEL_KEYS: dict[str, Callable[[Any], Any]] = {
    "artifact": _rel_path,
    "public_key": _rel_path,
    "expect_name": _string,
    "min_version": _string,
}
_WORKER_KEYS: dict[str, Callable[[Any], Any]] = {
    "domain": _string,   # checked against the domains table later
    "module": _module,
    "command": _argv,
    "args": _str_list(unique=False),
    "publishes": _bindings,
    "subscribes": _bindings,
    "shadow_subscribes": _bindings,
    "restart": _choice("always", "on-failure", "never"),
    "backoff_initial_ms": _int(1, MS_MAX, " ms"),
    "backoff_max_ms": _int(1, MS_MAX, " ms"),
    "max_restarts": _int(0, 1_000_000),   # a soak kills workers by the thousand
    "restart_window_s": _number(0.0, S_MAX, unit=" s"),
    "cooldown_s": _number(0.0, S_MAX, unit=" s", zero_ok=True),     # 0: never again
    "warm_standby": _bool,
    # workers ping every 20-100 ms: a watchdog under 20 ms would kill a healthy one
    "watchdog_ms": _int(20, MS_MAX, " ms", zero_ok=True),           # 0: no watchdog
    # no worker (an interpreter, a sandbox) starts in under 100 ms
    "ready_timeout_ms": _int(100, MS_MAX, " ms"),
    "optional": _bool,
    "memory_max": _size(1 << 20, SIZE_MAX),
    "cpu_quota": _percent,
    "cpu_weight": _int(1, 10000),
    "realtime_priority": _int(1, MAX_PRIORITY),
    "realtime_budget_pct": _int(1, MAX_BUDGET_PCT, " %"),
    "busy_poll_us": _int(0, MAX_BUSY_POLL_US, " us"),
    "pids_max": _int(8, 1 << 22),
    "jit_kernels": _bool,
    "nofile": _int(16, 1 << 20),
    "model": _string,     # checked against the models table later
    "device": _choice("cpu", "cuda"),
}

_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ChannelSpec)}
_CHANNEL_KEYS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "slot_size": (_size(1, 1 << 30), dataclasses.MISSING),
    "slot_count": (_int(2, 1024), _SPEC_DEFAULTS["slot_count"]),
    "dtype": (_choice(*DTYPES), _SPEC_DEFAULTS["dtype"]),
    "kind": (_choice(*KINDS), _SPEC_DEFAULTS["kind"]),
    "pixel_formats": (_str_list(_in(PIXEL_FORMATS)), ()),
    "max_readers": (_int(1, 64), None),          # None: subscribers + 1 spare
    "max_leases": (_int(1, 16), _SPEC_DEFAULTS["max_leases"]),
    "lease_ms": (_int(1, MS_MAX, " ms"), _SPEC_DEFAULTS["lease_ms"]),
    "max_age_ms": (_int(0, MS_MAX, " ms"), _SPEC_DEFAULTS["max_age_ms"]),
    "crc": (_bool, None),
    "integrity": (_bool, None),                  # same switch as crc
    "shadow": (_bool, False),
    "payload": (_string, None),
}
_SECTIONS = ("supervisor", "domains", "workers", "channels", "models")


def _schema_of(cls: type, checks: dict[str, Callable[[Any], Any]]) -> dict[str, tuple]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return {k: (check, fields[k].default) for k, check in checks.items()}


# --------------------------------------------------------------------------- loading


def load(path: str | Path | None = None) -> Config:
    """Load and validate a config file; ``None`` loads the embedded default."""
    if path is None:
        text = resources.files("supervisor").joinpath("default.toml").read_text("utf-8")
        return loads(text, DEFAULT_SOURCE)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigFileError([Problem(str(path), "", f"cannot read the config: {e}")]) from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigFileError([Problem(str(path), "", f"line {line}, column {column}: byte "
                                       f"0x{data[e.start]:02x} is not valid UTF-8 (TOML is "
                                       "UTF-8)")]) from None
    return loads(text, str(path))


def loads(text: str, source: str = "<string>") -> Config:
    """Parse and validate config text; ``source`` names it in error messages."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError([Problem(source, "", f"not valid TOML: {e}")]) from e
    return _Loader(source).build(doc)


class _Loader:
    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[Problem] = []

    def add(self, key: str, reason: str) -> None:
        self.problems.append(Problem(self.source, key, reason))

    # -- generic table reading

    def fields(self, path: str, table: dict, schema: dict[str, tuple]) -> tuple[dict, bool]:
        """Checked values of ``table`` (defaults filled in, bad values replaced by their
        default) and whether every key was fine."""
        before = len(self.problems)
        for k in table:
            if k not in schema:
                self.add(f"{path}.{_key(k)}", "unknown key" + _suggest(k, schema))
        out: dict[str, Any] = {}
        for name, (check, default) in schema.items():
            fallback = None if default is dataclasses.MISSING else default
            out[name] = fallback
            if name not in table:
                if default is dataclasses.MISSING:
                    self.add(f"{path}.{name}", "required key is missing")
                continue
            try:
                out[name] = check(table[name])
            except _ItemError as e:
                self.add(f"{path}.{name}[{e.index}]", str(e))
            except ValueError as e:
                self.add(f"{path}.{name}", str(e))
        return out, len(self.problems) == before

    def section(self, doc: dict, name: str) -> dict[str, dict]:
        """The named tables of ``[name.<entry>]``; malformed entries are reported, skipped."""
        raw = doc.get(name, {})
        if not isinstance(raw, dict):
            self.add(name, f"expected a table of [{name}.<name>] tables, got {_describe(raw)}")
            return {}
        pattern = _CHANNEL_NAME if name == "channels" else _NAME
        out = {}
        for entry, table in raw.items():
            if not isinstance(table, dict):
                self.add(_key(name, entry), f"expected a table [{name}.{entry}], got {_describe(table)}")
                continue
            if not pattern.match(entry):
                self.add(_key(name, entry), f"name {entry!r} must match {pattern.pattern}")
            out[entry] = table
        return out

    # -- the whole file

    def build(self, doc: dict) -> Config:
        for k in doc:
            if k not in _SECTIONS:
                self.add(_key(k), f"unknown section (expected {', '.join(_SECTIONS)})"
                         + _suggest(k, _SECTIONS))

        sup_raw = doc.get("supervisor", {})
        if not isinstance(sup_raw, dict):
            self.add("supervisor", f"expected a table, got {_describe(sup_raw)}")
            sup_raw = {}
        values, _ = self.fields("supervisor", sup_raw, _schema_of(SupervisorConfig, _SUPERVISOR_KEYS))
        supervisor = SupervisorConfig(**values)

        domain_tables = self.section(doc, "domains")
        channel_tables = self.section(doc, "channels")
        worker_tables = self.section(doc, "workers")
        domains = {n: self.domain(n, t) for n, t in domain_tables.items()}
        _rules.check_users(self.add, domains)
        channel_values = {}
        bad_channels = set()
        for n, t in channel_tables.items():
            channel_values[n], ok = self.channel_fields(n, t)
            if not ok:
                bad_channels.add(n)
        models = {n: self.model(n, t).resolved()
                  for n, t in self.section(doc, "models").items()}
        _rules.check_binds(self.add, domains, models,
                           supervisor.state_dir, PROJECT_ROOT)
        workers = {n: self.worker(n, t, domain_tables, channel_tables, domains)
                   for n, t in worker_tables.items()}
        for w in workers.values():
            if w.model is not None and w.model not in models:
                self.add(f"{_key('workers', w.name)}.model",
                         f"unknown model {w.model!r}" + _suggest(w.model, models))
        if not doc.get("workers"):
            self.add("workers", "no workers defined; add at least one [workers.<name>] table")

        writers = _rules.check_writers(self.add, workers, channel_tables)
        _rules.check_trust(self.add, workers, domains, writers, channel_values)
        _rules.check_cpu_weights(self.add, workers, domains)
        _rules.check_start_cpu(self.add, workers)
        _rules.check_realtime(self.add, workers, domains)
        _rules.check_devices(self.add, workers, domains)
        _rules.check_busy_poll(self.add, workers, writers)
        _rules.check_optional(self.add, workers, writers)
        _rules.check_cycles(self.add, workers)
        channels = self.channels(channel_values, bad_channels, workers)
        _rules.check_shm_budget(self.add, supervisor.shm_budget, channels)
        _rules.check_actuation_age(self.add, supervisor.mode, channels)

        if self.problems:
            raise ConfigFileError(self.problems)
        return Config(self.source, supervisor, domains, workers, channels,
                      models)

    # -- models

    def model(self, name: str, table: dict) -> ModelConfig:
        path = _key("models", name)
        values, _ = self.fields(path, table, _schema_of(ModelConfig, _MODEL_KEYS))
        if values["min_version"] is not None:
            from supervisor.model.artifact import parse_version

            try:
                parse_version(values["min_version"])
            except ValueError as e:
                self.add(f"{path}.min_version", str(e))
        model = ModelConfig(name, **{k: v or "" if k != "min_version" else v
                                     for k, v in values.items()})
        self._beside_config(path, model)
        return model

    def _beside_config(self, path: str, model: ModelConfig) -> None:
        """A relative artifact or key is read from the project root (where the bundled
        models are); one that is missing there but beside the config file is the
        operator's own, named as such (review 8 finding 6: 'public key <project
        root>/key.pub: No such file or directory', never how the path was read)."""
        here = os.path.dirname(os.path.abspath(self.source))
        if not os.path.isfile(self.source) or here == PROJECT_ROOT:
            return
        for key in ("artifact", "public_key"):
            given = getattr(model, key)
            if not given or os.path.isabs(given):
                continue
            if not os.path.exists(os.path.join(PROJECT_ROOT, given)) and \
                    os.path.exists(os.path.join(here, given)):
                self.add(f"{path}.{key}", f"{given!r} is read relative to the project root "
                         f"({PROJECT_ROOT}), not the config's directory, and is not there; "
                         f"give its absolute path: {os.path.join(here, given)!r}")

    # -- domains

    def domain(self, name: str, table: dict) -> DomainConfig:
        path = _key("domains", name)
        values, _ = self.fields(path, table, _schema_of(DomainConfig, _DOMAIN_KEYS))
        if not values["profile"]:
            if name in PROFILES:
                values["profile"] = name
            elif "profile" not in table:
                self.add(f"{path}.profile", f"domain {name!r} needs a profile: "
                         f"profile = {CONTROL!r} or {RESEARCH!r}")
                values["profile"] = CONTROL          # fail closed while reporting
        elif name in PROFILES and values["profile"] != name:
            self.add(f"{path}.profile", f"the {name!r} domain has the {name!r} profile")
        profile = values["profile"] = values["profile"] or CONTROL   # bad value: fail closed
        if profile == CONTROL and "failure_policy" not in table:
            values["failure_policy"] = "fail_safe"
        if values["actuates"] and profile != CONTROL:
            self.add(f"{path}.actuates", f"only a {CONTROL!r}-profile domain may actuate")
        for key, default in PROFILE_DEFAULTS[profile].items():
            if key not in table or values[key] in (None, ""):
                values[key] = default
            elif profile == CONTROL and values[key] != default:
                # Control may only tighten, and its defaults are already the tightest.
                self.add(f"{path}.{key}", f"a {CONTROL!r}-profile domain {_CONTROL_MUST[key]} "
                         f"({key} = {_toml(default)})")
        for key, default in PROFILE_LIMITS[profile].items():
            if values[key] is None:
                values[key] = default
        if values["extra_rw_binds"] and profile == CONTROL:
            self.add(f"{path}.extra_rw_binds", f"a {CONTROL!r}-profile domain has no writable "
                     "binds: it writes only its channels")
        return DomainConfig(name, **values)

    # -- workers

    def worker(self, name: str, table: dict, domains: dict, channels: dict,
               domains_cfg: dict[str, DomainConfig]) -> WorkerConfig:
        path = _key("workers", name)
        values, _ = self.fields(path, table, _schema_of(WorkerConfig, _WORKER_KEYS))
        roles: dict[str, str] = {}
        for key in ("publishes", "subscribes", "shadow_subscribes"):
            pairs = values[key] or ()
            for role, ch in pairs:
                if role in roles:
                    self.add(f"{path}.{key}", f"role {role!r} is bound twice "
                             f"(to {roles[role]!r} and {ch!r})")
                roles.setdefault(role, ch)
            values[key] = tuple(ch for _, ch in pairs)
        values["roles"] = tuple(roles.items())
        # Limits the worker leaves out are its domain's (from the profile): never unset.
        d = domains_cfg.get(values["domain"] or "")
        inherited = [k for k in PROFILE_LIMITS[CONTROL] if values[k] is None]
        for key in inherited:
            values[key] = getattr(d, key) if d is not None else PROFILE_LIMITS[CONTROL][key]
        w = WorkerConfig(name, **{k: v for k, v in values.items() if k != "domain"},
                         domain=values["domain"] or "")

        if values["domain"] is not None and w.domain not in domains:
            if w.domain == CONTROL:
                self.add(f"{path}.domain", f"unknown domain {CONTROL!r}: a worker in the control "
                         f"domain needs a [domains.{CONTROL}] table")
            else:
                self.add(f"{path}.domain", f"unknown domain {w.domain!r}" + _suggest(w.domain, domains))
        if "module" in table and "command" in table:
            self.add(f"{path}.command", "set only one of module (run as python -m) or command")
        elif "module" not in table and "command" not in table:
            self.add(path, "set exactly one of module (run as python -m) or command (an argv array)")
        if w.module and w.memory_max is not None and w.memory_max < MIN_WORKER_MEMORY:
            whose = (f" (domain {w.domain!r}'s memory_max, which it inherits)"
                     if "memory_max" in inherited else "")
            self.add(f"{path}.memory_max", f"{format_size(w.memory_max)}{whose} cannot host "
                     f"the interpreter (minimum {format_size(MIN_WORKER_MEMORY)})")
        if w.backoff_max_ms < w.backoff_initial_ms:
            self.add(f"{path}.backoff_max_ms", f"{w.backoff_max_ms} is below "
                     f"backoff_initial_ms ({w.backoff_initial_ms})")

        for list_name in ("publishes", "subscribes", "shadow_subscribes"):
            for i, ch in enumerate(getattr(w, list_name)):
                at = f"{path}.{list_name}[{i}]"
                if ch not in channels:
                    self.add(at, f"unknown channel {ch!r}" + _suggest(ch, channels))
                elif list_name != "publishes" and ch in w.publishes:
                    self.add(at, f"worker {name!r} subscribes to channel {ch!r}, "
                             "which it also publishes")
                elif list_name == "shadow_subscribes" and ch in w.subscribes:
                    self.add(at, f"channel {ch!r} is also in subscribes; list it once")
        return w

    # -- channels

    def channel_fields(self, name: str, table: dict) -> tuple[dict, bool]:
        path = _key("channels", name)
        values, ok = self.fields(path, table, _CHANNEL_KEYS)
        if values["crc"] is not None and values["integrity"] is not None:
            self.add(f"{path}.integrity", "crc and integrity are the same switch; set only one")
            ok = False
        if values["pixel_formats"] and values["kind"] != "frame":
            self.add(f"{path}.pixel_formats", "pixel_formats only apply to kind = 'frame'")
            ok = False
        return values, ok and bool(_CHANNEL_NAME.match(name))

    def channels(self, values: dict[str, dict], bad: set[str],
                 workers: dict[str, WorkerConfig]) -> dict[str, ChannelConfig]:
        out = {}
        for channel_id, name in enumerate(sorted(values), start=1):
            v = values[name]
            path = _key("channels", name)
            readers = [w.name for w in workers.values() if name in w.reads]
            max_readers = v["max_readers"]
            if max_readers is None:
                max_readers = len(readers) + 1
                why = f"{len(readers)} reader(s) + 1 spare for a re-attaching reader"
            else:
                why = "set by max_readers"
                if max_readers < len(readers):
                    self.add(f"{path}.max_readers", f"{max_readers} is less than the "
                             f"{len(readers)} workers that read it ({', '.join(readers)})")
                    bad.add(name)
            if name in bad:
                continue
            need = max_readers * v["max_leases"]
            if v["slot_count"] <= need:
                self.add(f"{path}.slot_count",
                         f"{v['slot_count']} must exceed max_readers * max_leases = "
                         f"{max_readers} * {v['max_leases']} ({why}), or readers could "
                         f"block the writer; use slot_count = {need + 1} or more")
                continue
            crc = bool(v["crc"] if v["crc"] is not None else v["integrity"])
            try:
                spec = ChannelSpec(
                    name=name, slot_size=v["slot_size"], slot_count=v["slot_count"],
                    dtype=v["dtype"], kind=v["kind"], pixel_formats=v["pixel_formats"],
                    max_readers=max_readers, max_leases=v["max_leases"],
                    lease_ms=v["lease_ms"], max_age_ms=v["max_age_ms"], crc=crc,
                    channel_id=channel_id)
            except ConfigError as e:
                self.add(path, str(e))
                continue
            payload = v["payload"]
            if payload is not None:
                from schemas.payloads import PAYLOADS

                if payload not in PAYLOADS:
                    self.add(f"{path}.payload", f"unknown payload {payload!r} (declared: "
                             f"{', '.join(sorted(PAYLOADS))})" + _suggest(payload, PAYLOADS))
                    continue
                if v["dtype"] != PAYLOADS[payload].dtype or v["kind"] != "tensor":
                    self.add(f"{path}.payload", f"payload {payload!r} needs a "
                             f"{PAYLOADS[payload].dtype} tensor channel")
                    continue
            out[name] = ChannelConfig(name, spec, shadow=v["shadow"], payload=payload)
        return out
