"""The supervisor's one declarative config: domains, workers and the channels between them.

``load()`` reads a TOML file (or the embedded ``supervisor/default.toml``) and checks all
of it before anything is launched. It returns a `Config`, or raises one `ConfigFileError`
that lists every problem found as ``FILE: KEY: REASON``, e.g.::

    cars.toml: workers.modeld.subscribes[0]: unknown channel 'road_frame'; did you mean 'road_frames'?

Safety rules checked here, besides types and references:

* a channel has exactly one writer, and a worker never reads what it writes itself;
* a control (or actuating) worker never reads, other than through ``shadow_subscribes``
  (log-only), a channel written in the research domain, marked ``shadow = true``, or
  derived from either through workers of other domains;
* only the control domain may actuate, and it never gets the network;
* publisher -> subscriber dependencies form no cycle, so ``Config.start_order()`` exists;
* a required worker does not depend on an optional one (admission may refuse that one);
* a module worker's ``memory_max`` can host the interpreter (`MIN_WORKER_MEMORY`);
* all channels' shared memory fits ``[supervisor] shm_budget``.

What depends on the machine rather than the file is checked by `check_runtime(cfg)`
(``supervisor check`` runs it): worker modules exist and define ``main(ctx)``, command
executables and ``extra_ro_binds`` exist, domain users exist, channels fit MemAvailable.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import heapq
import importlib.machinery
import importlib.util
import os
import pkgutil
import re
import shutil
import sys
import tokenize
import tomllib
from dataclasses import dataclass
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from supervisor.ipc.errors import ConfigError
from supervisor.ipc.spec import DTYPES, KINDS, PIXEL_FORMATS, ChannelSpec

CONTROL = "control"
RESEARCH = "research"
DEFAULT_SOURCE = "<embedded supervisor/default.toml>"
# The checkout holding supervisor/ and workers/: on the workers' PYTHONPATH (see
# supervisor.sandbox.policy.PROJECT_ROOT), so module names are looked up here too.
PROJECT_ROOT = str(Path(__file__).resolve().parents[1])

# The smallest memory_max a module worker (python -m supervisor.runner MODULE) may have.
# Its cgroup is charged for the interpreter, the libraries it maps, its heap and the
# shared memory it writes, from the first instruction. Measured (VmRSS in
# /proc/self/status, CPython 3.11, x86-64): bare interpreter 13 MiB; + numpy 27 MiB;
# + capnp 37 MiB; + supervisor.runner/worker with the import guard, seccomp and
# Landlock modules 42 MiB, before the worker's own imports, heap, thread stacks (numpy's
# BLAS pool) and channel slots. Below 64 MiB such a worker is OOM-killed while starting,
# before it can become READY; 64 MiB leaves ~20 MiB for the worker itself.
MIN_WORKER_MEMORY = 64 * 2**20
DEFAULT_SHM_BUDGET = 2 * 2**30

# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config file."""

    file: str
    key: str      # key path such as "workers.modeld.subscribes[1]"; "" for the whole file
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.reason}" if self.key else f"{self.file}: {self.reason}"


class ConfigFileError(ConfigError):
    """A config file is unusable; ``problems`` lists everything found, not just the first."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        n = len(self.problems)
        where = self.problems[0].file if self.problems else "<config>"
        head = f"{where}: {n} config problem{'' if n == 1 else 's'}"
        super().__init__(head + "".join(f"\n  {p}" for p in self.problems))


# --------------------------------------------------------------------------- sizes

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes from an integer or a human size such as ``"4096"``, ``"64KiB"``, ``"3.5MiB"``
    or ``"3.5MB"``. KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB powers of 1000 (any
    case); a bare K/M/G is refused as ambiguous. Raises ``ValueError`` with the reason."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a byte count or a size like '4MiB', got {_describe(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative")
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a size; write e.g. 4096, '64KiB', '3.5MiB' or '3.5MB'")
    number, unit = m.groups()
    scale = _SIZE_UNITS.get(unit.lower())
    if scale is None:
        u = unit.upper()
        if u in ("K", "M", "G", "T"):
            raise ValueError(f"{value!r}: unit {unit!r} is ambiguous; write '{u}iB' "
                             f"(powers of 1024) or '{u}B' (powers of 1000)")
        raise ValueError(f"{value!r}: unknown unit {unit!r}; use B, kB, MB, GB, TB, "
                         "KiB, MiB, GiB or TiB")
    exact = Fraction(number) * scale
    if exact.denominator != 1:
        raise ValueError(f"{value!r} is {float(exact)} bytes, not a whole number")
    return int(exact)


def format_size(n: int) -> str:
    """The shortest binary-unit spelling of ``n`` bytes that `parse_size` reads back
    exactly, with at most three decimals (``3670016`` -> ``"3.5MiB"``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            thousandths = Fraction(n * 1000, scale)
            if thousandths.denominator == 1:
                whole, frac = divmod(int(thousandths), 1000)
                return f"{whole}.{frac:03d}".rstrip("0").rstrip(".") + unit
    return str(n)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class SupervisorConfig:
    status_interval_s: float = 5.0
    maps_scan_interval_s: float = 1.0   # admission re-scan of /proc/PID/maps
    log_format: str = "json"            # "json" | "text"
    # Where the fail-safe latch lives (it must survive a restart of the supervisor);
    # the environment variable TRIO_STATE_DIR overrides it (tests, development).
    state_dir: str = "/var/lib/trio-supervisor"
    # Upper bound on the shared memory of all channels together (segments + lease
    # tables); check_runtime() also compares the total with the machine's MemAvailable.
    shm_budget: int = DEFAULT_SHM_BUDGET


# Built-in domain profiles: supervisor/sandbox/policy.py derives every isolation knob of
# a domain's sandboxes from its profile (and the domain's own network/user/binds).
PROFILES = (CONTROL, RESEARCH)


@dataclass(frozen=True)
class DomainConfig:
    name: str
    # "control": no network ever, compilers hidden, no exec after start, no new
    # executable memory after READY, torch refused, actuation allowed; "research":
    # torch allowed, exec and compilers allowed, never actuates, its outputs are shadow.
    # A domain named control or research has that profile; any other name must say.
    profile: str = ""
    network: bool = False
    # What to do when a worker exhausts its restart budget: "restart" keeps the domain
    # going without it, "fail_safe" stops the whole domain safe. Defaults to
    # "fail_safe" for the control domain when the key is absent.
    failure_policy: str = "restart"
    actuates: bool = False
    extra_ro_binds: tuple[str, ...] = ()
    # Host user the domain's sandboxes run as (never root); default trio-research for
    # research, trio-control for every other domain (scripts/install.sh creates both).
    # Distinct domains must use distinct users: the kernel then treats one domain's
    # processes and files as a stranger's to the other.
    user: str | None = None


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    domain: str
    module: str | None = None               # run as ``python -m module``
    command: tuple[str, ...] | None = None  # or this argv
    args: tuple[str, ...] = ()
    publishes: tuple[str, ...] = ()
    subscribes: tuple[str, ...] = ()
    shadow_subscribes: tuple[str, ...] = ()  # read for logging only, never for actuation
    restart: str = "on-failure"             # "always" | "on-failure" | "never"
    backoff_initial_ms: int = 100
    backoff_max_ms: int = 5000
    max_restarts: int = 5                   # at most this many restarts ...
    restart_window_s: float = 60.0          # ... within this window, else the budget is spent
    # A worker that gave up (out of restarts) outside a failed-safe domain is tried
    # again after this cool-down, under its restart policy; 0 = never again.
    cooldown_s: float = 30.0
    # Keep a second instance started, imports done, model loaded, waiting in its own
    # sandbox (pre-READY, under every rule a fresh worker has) to be handed the
    # channels when this one dies: recovery without the cold start.
    warm_standby: bool = False
    watchdog_ms: int = 0                    # 0: no watchdog
    ready_timeout_ms: int = 5000
    optional: bool = False                  # if admission refuses it, the rest still starts
    # cgroup limits of the worker's sandbox (v2, or v1 memory/pids/cpu controllers):
    memory_max: int | None = None           # bytes: heap, page cache, shared memory and tmpfs
    cpu_quota: float | None = None          # percent of one CPU (200 = two CPUs)
    pids_max: int | None = 64               # processes + threads (a fork storm stops here)
    # Control-grade domains: may the worker create anonymous executable memory before
    # READY (modeld: tinygrad maps the signed artifact's kernels)? Never after READY.
    jit_kernels: bool = False
    nofile: int | None = None

    @property
    def reads(self) -> tuple[str, ...]:
        """Every channel the worker attaches to as a reader, shadow or not."""
        return self.subscribes + self.shadow_subscribes

    def argv(self, python: str = sys.executable) -> list[str]:
        base = [python, "-m", self.module] if self.module else list(self.command or ())
        return base + list(self.args)


@dataclass(frozen=True)
class ChannelConfig:
    name: str
    spec: ChannelSpec
    shadow: bool = False   # research/shadow output: must never drive actuation
    # A declared payload (schemas/payloads.py) for float32 tensor channels; an
    # actuation payload (control_cmd) makes this an actuation channel: on fail-safe its
    # last message is the payload's safe value.
    payload: str | None = None

    @property
    def actuation(self) -> bool:
        from schemas.payloads import PAYLOADS

        return self.payload is not None and PAYLOADS[self.payload].safe is not None


@dataclass(frozen=True)
class Config:
    source: str
    supervisor: SupervisorConfig
    domains: dict[str, DomainConfig]
    workers: dict[str, WorkerConfig]      # in declaration order
    channels: dict[str, ChannelConfig]    # sorted by name; channel_id is 1-based in that order

    def channel_specs(self) -> dict[str, ChannelSpec]:
        return {name: ch.spec for name, ch in self.channels.items()}

    def writer_of(self, channel: str) -> str:
        if channel not in self.channels:
            raise KeyError(channel)
        return next(w.name for w in self.workers.values() if channel in w.publishes)

    def readers_of(self, channel: str) -> list[str]:
        """Workers that read ``channel`` (``subscribes`` or ``shadow_subscribes``)."""
        if channel not in self.channels:
            raise KeyError(channel)
        return [w.name for w in self.workers.values() if channel in w.reads]

    def profile_of(self, worker: str) -> str:
        """The profile (control or research) of a worker's domain: what its sandbox is."""
        return self.domains[self.workers[worker].domain].profile

    def workers_in(self, domain: str) -> list[str]:
        return [w.name for w in self.workers.values() if w.domain == domain]

    def start_order(self) -> list[str]:
        """Publishers before their subscribers; ties keep declaration order. Shadow
        subscriptions impose no order (a log-only reader attaches when it can)."""
        order, _ = _topo_sort(self.workers)
        return order


# --------------------------------------------------------------------------- value checks
# Each check returns the converted value or raises ValueError(reason);
# _ItemError points the reason at one element of an array.


class _ItemError(ValueError):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


def _describe(v: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "float", str: "string",
            list: "array", dict: "table"}.get(type(v), type(v).__name__)
    return f"{kind} {v!r}" if kind != "table" else "a table"


def _suggest(word: str, options: Any) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _string(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {_describe(v)}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {_describe(v)}")
    return v


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {_describe(v)}")
        return _in_range(v, lo, hi)
    return check


def _number(lo: float = 0.0) -> Callable[[Any], float]:
    """A number strictly above ``lo``."""
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a number, got {_describe(v)}")
        if not lo < v < float("inf"):
            raise ValueError(f"{v} must be greater than {lo:g} and finite")
        return float(v)
    return check


def _in_range(v: Any, lo: Any, hi: Any, show: Callable[[Any], str] = str) -> Any:
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = (f"in {show(lo)}..{show(hi)}" if lo is not None and hi is not None
                  else f">= {show(lo)}" if lo is not None else f"<= {show(hi)}")
        raise ValueError(f"{show(v)} is out of range; must be {bounds}")
    return v


def _size(lo: int = 1, hi: int | None = None) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        return _in_range(parse_size(v), lo, hi, show=format_size)
    return check


def _choice(*options: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str):
            raise ValueError(f"expected a string, got {_describe(v)}")
        if v not in options:
            listed = ", ".join(repr(o) for o in options)
            raise ValueError(f"{v!r} is not one of {listed}" + _suggest(v, options))
        return v
    return check


def _str_list(item: Callable[[str], None] | None = None,
              unique: bool = True) -> Callable[[Any], tuple[str, ...]]:
    def check(v: Any) -> tuple[str, ...]:
        if not isinstance(v, list):
            raise ValueError(f"expected an array of strings, got {_describe(v)}")
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise _ItemError(i, f"expected a string, got {_describe(s)}")
            if unique and s in v[:i]:
                raise _ItemError(i, f"{s!r} is listed twice")
            if item is not None:
                try:
                    item(s)
                except ValueError as e:
                    raise _ItemError(i, str(e)) from None
        return tuple(v)
    return check


def _in(options: Any) -> Callable[[str], None]:
    def check(s: str) -> None:
        if s not in options:
            raise ValueError(f"{s!r} is not one of {', '.join(options)}" + _suggest(s, options))
    return check


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _module(v: Any) -> str:
    if not isinstance(v, str) or not _MODULE.match(v):
        raise ValueError(f"expected a dotted python module name, got {_describe(v)}")
    return v


def _argv(v: Any) -> tuple[str, ...]:
    argv = _str_list(unique=False)(v)
    if not argv or not argv[0]:
        raise ValueError("expected a non-empty argv array such as ['/usr/bin/prog', '--flag']")
    return argv


def _abs_path(s: str) -> None:
    if not s.startswith("/") or ".." in s.split("/"):
        raise ValueError(f"{s!r} must be an absolute path without '..'")
    if s.rstrip("/") == "":
        raise ValueError("binding '/' would expose the whole host file system")


def _percent(v: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip().removesuffix("%"))
        except ValueError:
            raise ValueError(f"{v!r} is not a percentage such as 200 or '200%'") from None
    return _number(0.0)(v)


# Worker, domain and channel names end up in unit names, paths and segment names.
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,47}$")
_CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")   # as supervisor.ipc.spec requires
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(*parts: str) -> str:
    return ".".join(p if _BARE_KEY.match(p) else f'"{p}"' for p in parts)


# --------------------------------------------------------------------------- schemas
# key -> check; defaults come from the dataclasses above (no default = required).

_SUPERVISOR_KEYS: dict[str, Callable[[Any], Any]] = {
    "status_interval_s": _number(),
    "maps_scan_interval_s": _number(),
    "log_format": _choice("json", "text"),
    "state_dir": _string,
    "shm_budget": _size(1 << 20, 1 << 50),
}
_DOMAIN_KEYS: dict[str, Callable[[Any], Any]] = {
    "profile": _choice(CONTROL, RESEARCH),
    "network": _bool,
    "failure_policy": _choice("restart", "fail_safe"),
    "actuates": _bool,
    "extra_ro_binds": _str_list(_abs_path),
    "user": _string,
}
_WORKER_KEYS: dict[str, Callable[[Any], Any]] = {
    "domain": _string,   # checked against the domains table later
    "module": _module,
    "command": _argv,
    "args": _str_list(unique=False),
    "publishes": _str_list(),
    "subscribes": _str_list(),
    "shadow_subscribes": _str_list(),
    "restart": _choice("always", "on-failure", "never"),
    "backoff_initial_ms": _int(1, 3_600_000),
    "backoff_max_ms": _int(1, 3_600_000),
    "max_restarts": _int(0, 1_000_000),
    "restart_window_s": _number(),
    "cooldown_s": _number(),
    "warm_standby": _bool,
    "watchdog_ms": _int(0, 3_600_000),
    "ready_timeout_ms": _int(1, 3_600_000),
    "optional": _bool,
    "memory_max": _size(1 << 20, 1 << 50),
    "cpu_quota": _percent,
    "pids_max": _int(8, 1 << 22),
    "jit_kernels": _bool,
    "nofile": _int(16, 1 << 20),
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
    "lease_ms": (_int(1, 3_600_000), _SPEC_DEFAULTS["lease_ms"]),
    "max_age_ms": (_int(0, 3_600_000), _SPEC_DEFAULTS["max_age_ms"]),
    "crc": (_bool, None),
    "integrity": (_bool, None),                  # same switch as crc
    "shadow": (_bool, False),
    "payload": (_string, None),
}
_SECTIONS = ("supervisor", "domains", "workers", "channels")


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
        text = Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError([Problem(str(path), "", f"cannot read the config: {e}")]) from e
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
        self.check_users(domains)
        channel_values = {}
        bad_channels = set()
        for n, t in channel_tables.items():
            channel_values[n], ok = self.channel_fields(n, t)
            if not ok:
                bad_channels.add(n)
        workers = {n: self.worker(n, t, domain_tables, channel_tables)
                   for n, t in worker_tables.items()}
        if not doc.get("workers"):
            self.add("workers", "no workers defined; add at least one [workers.<name>] table")

        writers = self.check_writers(workers, channel_tables)
        self.check_trust(workers, domains, writers, channel_values)
        self.check_optional(workers, writers)
        self.check_cycles(workers)
        channels = self.channels(channel_values, bad_channels, workers)
        self.check_shm_budget(supervisor.shm_budget, channels)

        if self.problems:
            raise ConfigFileError(self.problems)
        return Config(self.source, supervisor, domains, workers, channels)

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
        profile = values["profile"]
        if profile == CONTROL and "failure_policy" not in table:
            values["failure_policy"] = "fail_safe"
        if values["actuates"] and profile != CONTROL:
            self.add(f"{path}.actuates", f"only a {CONTROL!r}-profile domain may actuate")
        if values["network"] and profile == CONTROL:
            self.add(f"{path}.network", f"a {CONTROL!r}-profile domain must not have network access")
        return DomainConfig(name, **values)

    def check_users(self, domains: dict[str, DomainConfig]) -> None:
        from supervisor.sandbox.policy import default_user

        seen: dict[str, str] = {}
        for name, d in domains.items():
            user = d.user or default_user(d.profile)
            if user == "root":
                self.add(f"{_key('domains', name)}.user", "sandboxes never run as root")
            rules = "research" if d.profile == RESEARCH else "strict"
            other = seen.setdefault(user, f"{name}:{rules}")
            # Strict domains may share the control user; research never shares with them.
            if other.split(":")[1] != rules:
                self.add(f"{_key('domains', name)}.user",
                         f"user {user!r} is also used by domain {other.split(':')[0]!r}; "
                         f"research and control-grade domains need distinct host users")

    # -- workers

    def worker(self, name: str, table: dict, domains: dict, channels: dict) -> WorkerConfig:
        path = _key("workers", name)
        values, _ = self.fields(path, table, _schema_of(WorkerConfig, _WORKER_KEYS))
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
            self.add(f"{path}.memory_max", f"{format_size(w.memory_max)} cannot host the "
                     f"interpreter (minimum {format_size(MIN_WORKER_MEMORY)})")
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

    def check_writers(self, workers: dict[str, WorkerConfig], channels: dict) -> dict[str, str]:
        writers: dict[str, str] = {}
        for w in workers.values():
            for i, ch in enumerate(w.publishes):
                if ch not in channels:
                    continue
                if ch in writers:
                    self.add(f"{_key('workers', w.name)}.publishes[{i}]",
                             f"channel {ch!r} is already published by worker {writers[ch]!r}; "
                             "a channel has exactly one writer")
                else:
                    writers[ch] = w.name
        for ch in channels:
            if ch not in writers:
                self.add(_key("channels", ch), f"no worker publishes channel {ch!r}; "
                         "every channel needs exactly one writer")
        return writers

    def check_trust(self, workers: dict[str, WorkerConfig], domains: dict[str, DomainConfig],
                    writers: dict[str, str], channels: dict[str, dict]) -> None:
        """No research or shadow data reaches a control/actuating worker except through
        shadow_subscribes, not even laundered through workers of a third domain."""
        def profile(w: WorkerConfig) -> str:
            d = domains.get(w.domain)
            return d.profile if d else CONTROL

        def protected(w: WorkerConfig) -> bool:
            d = domains.get(w.domain)
            return profile(w) == CONTROL or bool(d and d.actuates)

        # channel -> (root channel, chain of workers it passed through) for tainted data
        taint: dict[str, tuple[str, list[str]]] = {}
        for ch, writer in writers.items():
            if profile(workers[writer]) == RESEARCH or channels.get(ch, {}).get("shadow"):
                taint[ch] = (ch, [])
        changed = True
        while changed:
            changed = False
            for w in workers.values():
                if protected(w):
                    continue
                src = next((c for c in w.subscribes if c in taint), None)
                for out in w.publishes:
                    if src is not None and out not in taint and out in writers:
                        root, via = taint[src]
                        taint[out] = (root, via + [w.name])
                        changed = True

        for w in workers.values():
            if not protected(w):
                continue
            who = (f"control worker {w.name!r}" if profile(w) == CONTROL
                   else f"worker {w.name!r} of actuating domain {w.domain!r}")
            fix = "mark it shadow_subscribes (log-only) or move it"
            for i, ch in enumerate(w.subscribes):
                if ch not in taint:
                    continue
                root, via = taint[ch]
                at = f"{_key('workers', w.name)}.subscribes[{i}]"
                root_is_research = profile(workers[writers[root]]) == RESEARCH
                if via:
                    kind = "research" if root_is_research else "shadow"
                    self.add(at, f"{who} subscribes to channel {ch!r}, which is derived from "
                             f"{kind} channel {root!r} via {' -> '.join(via)}; {fix}")
                elif root_is_research:
                    self.add(at, f"{who} subscribes to research channel {ch!r}; {fix}")
                else:
                    self.add(at, f"{who} subscribes to shadow channel {ch!r}, which must never "
                             f"drive actuation; {fix}")

    def check_optional(self, workers: dict[str, WorkerConfig], writers: dict[str, str]) -> None:
        for w in workers.values():
            if w.optional:
                continue
            for i, ch in enumerate(w.subscribes):
                pub = writers.get(ch)
                if pub is not None and pub != w.name and workers[pub].optional:
                    self.add(f"{_key('workers', w.name)}.subscribes[{i}]",
                             f"channel {ch!r} is published by optional worker {pub!r}; if "
                             f"admission refuses {pub!r}, {w.name!r} cannot run: make "
                             f"{w.name!r} optional too or {pub!r} required")

    def check_cycles(self, workers: dict[str, WorkerConfig]) -> None:
        _, stuck = _topo_sort(workers)
        reported: set[str] = set()
        for start in stuck:
            if start in reported:
                continue
            cycle = _cycle_through(start, workers, stuck)
            if cycle is None:       # downstream of a cycle, not on one
                continue
            reported.update(name for name, _ in cycle)
            hops = "".join(f" -[{ch}]-> {name}" for name, ch in cycle[1:])
            closing = cycle[-1][1]
            index = workers[start].subscribes.index(closing)
            self.add(f"{_key('workers', start)}.subscribes[{index}]",
                     f"dependency cycle {start}{hops}: publishers must start before their "
                     "subscribers; break the cycle (a log-only read can use shadow_subscribes)")

    # -- channels

    def check_shm_budget(self, budget: int, channels: dict[str, ChannelConfig]) -> None:
        total = sum(channel_shm_bytes(c.spec) for c in channels.values())
        if total > budget:
            self.add("channels", f"{_shm_overview(channels)} exceeds shm_budget "
                     f"{format_size(budget)}; shrink slot_size or slot_count, or raise "
                     "[supervisor] shm_budget")

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


# --------------------------------------------------------------------------- graph


def _edges(workers: dict[str, WorkerConfig]) -> dict[str, dict[str, str]]:
    """publisher -> {subscriber: channel} over normal (non-shadow) subscriptions."""
    writer = {ch: w.name for w in workers.values() for ch in w.publishes}
    edges: dict[str, dict[str, str]] = {name: {} for name in workers}
    for w in workers.values():
        for ch in w.subscribes:
            pub = writer.get(ch)
            if pub is not None and pub != w.name:
                edges[pub].setdefault(w.name, ch)
    return edges


def _topo_sort(workers: dict[str, WorkerConfig]) -> tuple[list[str], list[str]]:
    """Kahn's algorithm, ties broken by declaration order. Returns (order, the workers
    that could not be placed because they are on or behind a cycle)."""
    edges = _edges(workers)
    rank = {name: i for i, name in enumerate(workers)}
    indegree = {name: 0 for name in workers}
    for subs in edges.values():
        for s in subs:
            indegree[s] += 1
    ready = [(rank[n], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for s in edges[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, (rank[s], s))
    placed = set(order)
    return order, [n for n in workers if n not in placed]


def _cycle_through(start: str, workers: dict[str, WorkerConfig],
                   among: list[str]) -> list[tuple[str, str]] | None:
    """Shortest cycle from ``start`` back to itself as ``[(start, ""), (next, via channel),
    ..., (start, closing channel)]``, or None when ``start`` is on no cycle."""
    edges = _edges(workers)
    allowed = set(among)
    parent: dict[str, tuple[str, str]] = {}   # node -> (predecessor, channel between)
    frontier = [start]
    while frontier:
        following = []
        for n in frontier:
            for s, ch in edges[n].items():
                if s == start:
                    chain = [(start, ch)]
                    while n != start:
                        prev, via = parent[n]
                        chain.append((n, via))
                        n = prev
                    return [(start, "")] + chain[::-1]
                if s in allowed and s not in parent:
                    parent[s] = (n, ch)
                    following.append(s)
        frontier = following
    return None


# --------------------------------------------------------------------------- shared memory


def channel_shm_bytes(spec: ChannelSpec) -> int:
    """Shared memory one channel holds, as `supervisor.ipc.Channel.create` makes it: the
    data segment plus one lease table per possible reader."""
    return spec.segment_size + spec.max_readers * spec.lease_size


def _approx_size(n: int) -> str:
    """``n`` bytes to one decimal in the largest binary unit (for totals, not input)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _shm_overview(channels: dict[str, ChannelConfig], biggest: int = 3) -> str:
    """``total 1.0TiB of shared memory for 2 channels (biggest: ...)``."""
    sizes = sorted(((channel_shm_bytes(c.spec), name) for name, c in channels.items()),
                   key=lambda t: (-t[0], t[1]))
    total = sum(n for n, _ in sizes)
    top = ", ".join(f"{name} {channels[name].spec.slot_count} slots of "
                    f"{format_size(channels[name].spec.slot_size)} = {_approx_size(n)}"
                    for n, name in sizes[:biggest])
    n = len(sizes)
    return (f"total {_approx_size(total)} of shared memory for {n} channel"
            f"{'' if n == 1 else 's'} (biggest: {top})")


# --------------------------------------------------------------------------- the machine


def check_runtime(cfg: Config, *, sandboxed: bool = True) -> list[Problem]:
    """What `load()` cannot know from the file alone, checked against this machine
    before anything starts; every problem found, as `Problem` lines (``FILE: KEY:
    REASON``). Never imports a worker module (nor its parent packages).

    * each worker ``module`` exists on the workers' path (the project root plus
      ``sys.path``) and is a worker: its source defines a top-level ``main(ctx)``;
    * each ``command`` executable exists;
    * sandboxed: each ``extra_ro_binds`` path exists and each domain's host user exists
      (`supervisor.sandbox.policy.host_ids`, which only checks when running as root);
    * the channels' shared memory fits the machine's MemAvailable.
    """
    problems: list[Problem] = []

    def add(key: str, reason: str) -> None:
        problems.append(Problem(cfg.source, key, reason))

    search = _module_search_path()
    verdicts: dict[str, str | None] = {}
    for w in cfg.workers.values():
        path = _key("workers", w.name)
        if w.module:
            if w.module not in verdicts:
                verdicts[w.module] = _module_problem(w.module, search)
            if verdicts[w.module]:
                add(f"{path}.module", verdicts[w.module])
        elif w.command:
            reason = _executable_problem(w.command[0])
            if reason:
                add(f"{path}.command[0]", reason)

    if sandboxed:
        from supervisor.sandbox.policy import host_ids

        for name, d in cfg.domains.items():
            path = _key("domains", name)
            for i, bind in enumerate(d.extra_ro_binds):
                try:
                    os.stat(bind)
                except OSError as e:
                    add(f"{path}.extra_ro_binds[{i}]", f"{bind}: {_strerror(e)}")
            try:
                host_ids(d.profile, d.user)
            except LookupError as e:
                add(f"{path}.user", str(e.args[0] if e.args else e))

    available = _mem_available()
    total = sum(channel_shm_bytes(c.spec) for c in cfg.channels.values())
    if available is not None and total > available:
        add("channels", f"{_shm_overview(cfg.channels)} exceeds this machine's available "
            f"memory ({_approx_size(available)} MemAvailable in /proc/meminfo)")
    return problems


def _strerror(e: OSError) -> str:
    return (e.strerror or str(e)).lower()


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _executable_problem(prog: str) -> str | None:
    if "/" not in prog:
        return None if shutil.which(prog) else f"{prog!r}: not found on PATH"
    try:
        st = os.stat(prog)
    except OSError as e:
        return f"{prog}: {_strerror(e)}"
    if not os.path.isfile(prog) or not st.st_mode & 0o111:
        return f"{prog}: not an executable file"
    return None


# -- worker modules, located without importing anything


def _module_search_path() -> list[str]:
    out = [PROJECT_ROOT]
    for p in sys.path:
        if p not in out:
            out.append(p)
    return out


def _locate(name: str, search: list[str]) -> tuple[Any, str]:
    """(spec, "") for a dotted module name, or (None, why not). Each package along the
    way is looked up by path, never imported (find_spec of a submodule would import
    its parents, and a worker package may import anything)."""
    parts = name.split(".")
    locations: Any = search
    spec = None
    for i in range(len(parts)):
        full = ".".join(parts[:i + 1])
        if locations is None:
            return None, f"no module named {full!r}; {spec.name!r} is not a package"
        try:
            spec = importlib.machinery.PathFinder.find_spec(full, list(locations))
            if spec is None and i == 0:
                # builtin, frozen, or an import hook (editable installs); for a
                # top-level name this imports nothing
                spec = importlib.util.find_spec(full)
        except (ImportError, ValueError, OSError):
            spec = None
        if spec is None:
            return None, f"no module named {full!r}"
        locations = spec.submodule_search_locations
    return spec, ""


def _worker_modules(search: list[str]) -> list[str]:
    """Every module under the ``workers`` package (the suggestions for a typo)."""
    spec, _ = _locate("workers", search)
    if spec is None or not spec.submodule_search_locations:
        return []
    out: list[str] = []
    todo = [("workers", list(spec.submodule_search_locations))]
    while todo and len(out) < 1000:
        prefix, paths = todo.pop()
        for info in pkgutil.iter_modules(paths):
            if info.name.startswith("_"):
                continue
            name = f"{prefix}.{info.name}"
            out.append(name)
            if info.ispkg:
                todo.append((name, [os.path.join(p, info.name) for p in paths]))
    return sorted(out)


def _entry_problem(name: str, spec: Any) -> str | None:
    """Why the module is not a worker (the runner calls ``module.main(ctx)``), or None.
    Checked on the source, statically; modules without Python source are not judged."""
    origin = spec.origin
    if spec.submodule_search_locations is not None and origin in (None, "namespace"):
        return f"{name} is not a worker (a namespace package, no __init__.py with main(ctx))"
    if not isinstance(origin, str) or not origin.endswith(".py"):
        return None
    try:
        with tokenize.open(origin) as f:
            tree = ast.parse(f.read(), origin)
    except SyntaxError as e:
        return f"cannot parse {origin}: {e.msg} (line {e.lineno})"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"cannot read {origin}: {_strerror(e) if isinstance(e, OSError) else e}"
    main = _top_level_main(tree.body)
    if main is None:
        return f"{name} is not a worker (no top-level main(ctx))"
    if isinstance(main, ast.AsyncFunctionDef):
        return (f"{name} is not a worker (main is 'async def'; the runner calls main(ctx) "
                "and uses its return value as the exit status)")
    if isinstance(main, ast.FunctionDef):
        a = main.args
        positional = len(a.posonlyargs) + len(a.args)
        required = positional - len(a.defaults)
        if positional == 0 and a.vararg is None:
            return f"{name} is not a worker (main() takes no argument; the runner calls main(ctx))"
        if required > 1:
            return (f"{name} is not a worker (main() requires {required} arguments; the "
                    "runner calls main(ctx))")
        missing = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
        if missing:
            return (f"{name} is not a worker (main() requires keyword argument "
                    f"{missing[0]!r}; the runner calls main(ctx))")
    return None


def _top_level_main(body: list[ast.stmt]) -> ast.AST | None:
    """The last module-level binding of ``main`` (a def, an import or an assignment,
    also under a module-level if/try/with), or None."""
    found: ast.AST | None = None
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "main":
                found = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == "main":
                    found = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "main" for t in targets):
                found = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                inner = _top_level_main(block)
                if inner is not None:
                    found = inner
    return found


def _module_problem(name: str, search: list[str]) -> str | None:
    spec, missing = _locate(name, search)
    if spec is None:
        return missing + _suggest(name, _worker_modules(search))
    reason = _entry_problem(name, spec)
    if reason is None or not reason.startswith(f"{name} is not a worker"):
        return reason
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):      # an enclosing package that is a worker?
        parent = ".".join(parts[:i])
        pspec, _ = _locate(parent, search)
        if pspec is not None and _entry_problem(parent, pspec) is None and \
                isinstance(pspec.origin, str) and pspec.origin.endswith(".py"):
            return f"{reason}; did you mean {parent!r}?"
    return reason
