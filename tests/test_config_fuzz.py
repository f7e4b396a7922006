"""Config files an operator could get wrong, generated: the loader answers every one
with a ConfigError (one line per problem, naming file and key) or a Config, never a
traceback. FUZZ_EXAMPLES raises the count for the long run (bench/fuzz.sh)."""
from __future__ import annotations

import os
from pathlib import Path

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


# ------------------------------------------------------------------ bounds, NULs, non-UTF-8
# Mutations of a valid vehicle config (tests/test_config_corpus.py SMALL): any key of any
# section set to a number at or past a bound, or a string with a NUL, a byte that is not
# UTF-8, a newline, an escape sequence or a path separator in it. Both `supervisor check`'s
# config part (load, check_runtime) and `supervisor run`'s (load, then Supervisor.run up to
# where it would create the channels) must answer in one-line problems, never a traceback,
# and agree: run starts exactly the configs check passes; and what an accepted config
# becomes for the kernel (cgroup values, user, argv, environment) must be valid.

from tests.test_config_corpus import BAD_UTF8, SMALL  # noqa: E402
from tests.test_config_corpus import render as render_bytes  # noqa: E402

# Every key of every section, by kind: n(umber or size), s(tring), l(ist of strings),
# b(oolean), t(able of role = channel).
_ALL_KEYS: dict[str, dict[str, str]] = {
    "supervisor": dict(status_interval_s="n", maps_scan_interval_s="n", log_format="s",
                       state_dir="s", shm_budget="n", mode="s"),
    "domains.control": dict(profile="s", network="b", failure_policy="s", actuates="b",
                            extra_ro_binds="l", extra_rw_binds="l", user="s",
                            hide_compilers="b", exec_after_start="b", refuse_torch="b",
                            exec_memory_after_ready="b", seccomp="s", memory_max="n",
                            pids_max="n"),
    "workers.src": dict(domain="s", module="s", command="l", args="l", publishes="t",
                        subscribes="t", shadow_subscribes="t", restart="s",
                        backoff_initial_ms="n", backoff_max_ms="n", max_restarts="n",
                        restart_window_s="n", cooldown_s="n", warm_standby="b",
                        watchdog_ms="n", ready_timeout_ms="n", optional="b", memory_max="n",
                        cpu_quota="n", cpu_weight="n", realtime_priority="n",
                        realtime_budget_pct="n", busy_poll_us="n", pids_max="n",
                        jit_kernels="b", nofile="n", model="s"),
    "channels.frames": dict(slot_size="n", slot_count="n", dtype="s", kind="s",
                            pixel_formats="l", max_readers="n", max_leases="n", lease_ms="n",
                            max_age_ms="n", crc="b", integrity="b", shadow="b", payload="s"),
    "models.m": dict(artifact="s", public_key="s", expect_name="s", min_version="s"),
}
# Every bound of every number (and the values either side): ms, s, %, counts, bytes.
_BOUNDS = [0, 1, 2, 7, 8, 15, 16, 19, 20, 64, 98, 99, 100, 101, 1024, 1025, 10_000, 10_001,
           100_000, 100_001, 102_400, 102_401, 3_600_000, 3_600_001, 2**20 - 1, 2**20,
           2**22, 2**22 + 1, 2**30 + 1, 2**40, 2**40 + 1, 2**50, 2**63 - 1, -1, -(2**63)]
_NUMBERS = st.one_of(
    st.sampled_from(_BOUNDS),
    st.sampled_from([0.0, 0.0099, 0.01, 0.099, 0.1, 0.5, 1.0, 3600.0, 3600.5, 86_400.0,
                     86_400.5, 1e308, -1e308, 1e-9, float("inf"), float("-inf"), float("nan")]),
    st.sampled_from(["1MiB", "1TiB", "1025GiB", "1e999%", "0.5%", "102401%", "-1"]),
    st.integers(-(2**64), 2**64), st.floats(allow_nan=True))
_EVIL = ["\0", BAD_UTF8, "\n", "\x1b[2J", "\u2028", "/", "../", "", "x" * 300]
_BASES = ["control", "workers.probe", "/usr/share", "frames", "json", "vehicle", "trio-control",
          "models/demo/lane-offset", "1.0.0", "--publish", "uint8", "model_out"]


@st.composite
def _evil_strings(draw) -> str:
    base = draw(st.sampled_from(_BASES))
    at = draw(st.integers(0, len(base)))
    return base[:at] + draw(st.sampled_from(_EVIL)) + base[at:]


_BY_KIND = {
    "n": _NUMBERS, "s": _evil_strings(), "l": st.lists(_evil_strings(), min_size=1, max_size=3),
    "t": st.dictionaries(_evil_strings(), _evil_strings(), min_size=1, max_size=2),
    "b": st.booleans(),
}


def _base() -> dict:
    import copy

    doc = copy.deepcopy(SMALL)
    doc["models"] = {"m": {"artifact": "models/demo/lane-offset",
                           "public_key": "models/demo/demo_ed25519.pub",
                           "expect_name": "lane-offset-demo"}}
    return doc


def _put(doc: dict, table: str, key: str, value) -> dict:
    where = doc
    for part in table.split("."):
        where = where.setdefault(part, {})
    where[key] = value
    return doc


@st.composite
def mutated(draw) -> dict:
    doc = _base()
    for _ in range(draw(st.integers(1, 3))):
        table = draw(st.sampled_from(sorted(_ALL_KEYS)))
        key, kind = draw(st.sampled_from(sorted(_ALL_KEYS[table].items())))
        # mostly a value of the key's own kind (the checks worth reaching), else any
        _put(doc, table, key, draw(st.one_of(_BY_KIND[kind], *_BY_KIND.values())
                                   if draw(st.integers(0, 4)) == 0 else _BY_KIND[kind]))
    return doc


class _Started(Exception):
    """Supervisor.run got as far as creating the channels: the config was accepted."""


def _refuse_to_start(self) -> None:
    raise _Started()


def _admitted(name: str, domain: str, *args, **kw):
    """check_worker's verdict without the walk: every worker admitted, as `admit` says."""
    from supervisor.admission.report import AdmissionReport

    return AdmissionReport(worker=name, domain=domain, ok=True)


def _one_line(problems) -> list[str]:
    lines = [str(p) for p in problems]
    for ln in lines:
        assert len(ln.splitlines()) == 1 and ln.isprintable(), repr(ln)
    return lines


def _run_config_part(cfg) -> tuple[bool, dict | None]:
    """Supervisor.run up to the channels (admission, which judges code and not the
    config's values, is skipped: it has its own tests). (started, supervisor_exit)."""
    import trio

    from supervisor.events import EventLog
    from supervisor.lifecycle import Supervisor

    with open(os.devnull, "w") as devnull:
        log = EventLog(stream=devnull, keep=True)
        sup = Supervisor(cfg, log=log, sandboxed=False)
        try:
            trio.run(sup.run)
        except _Started:
            return True, None
    exits = log.of("supervisor_exit")
    assert len(exits) == 1 and len(str(exits[0]["reason"]).splitlines()) == 1, exits
    return False, exits[0]


def _check_part(source) -> tuple[object, list[str]]:
    """`supervisor check`'s config part: (Config or None, one-line problems)."""
    from supervisor.config import ConfigFileError, check_runtime, load

    try:
        cfg = load(source) if isinstance(source, Path) else loads(source, "fuzz.toml")
    except ConfigFileError as e:
        return None, _one_line(e.problems)
    return cfg, _one_line(check_runtime(cfg))


# Every number key at and past every bound, every string key with every evil character:
# exhaustively (in-process, the config part of check plus what an accepted config becomes
# for the kernel); the random test below combines them and drives run too.
_EXHAUSTIVE = (
    [(t, k, v) for t, keys in _ALL_KEYS.items() for k, kind in keys.items() if kind == "n"
     for v in _BOUNDS + [0.0099, 0.099, 0.5, 3600.5, 86_400.5, 1e308, 1e-9, float("inf"),
                         float("nan"), "1TiB", "1025GiB", "1e999%", "102401%"]]
    + [(t, k, ([v] if kind == "l" else {"frames": v} if kind == "t" else v))
       for t, keys in _ALL_KEYS.items() for k, kind in keys.items() if kind in "slt"
       for v in ("x\0", f"x{BAD_UTF8}", "x\n/y", "../x", "\x1b[2J")])


def test_every_key_at_and_past_its_bounds_and_with_every_evil_string(tmp_path, monkeypatch):
    monkeypatch.delenv("TRIO_STATE_DIR", raising=False)
    monkeypatch.setenv("TRIO_STATE_DIR", str(tmp_path / "state"))
    accepted = 0
    for i, (table, key, value) in enumerate(_EXHAUSTIVE):
        path = tmp_path / f"{i}.toml"
        data = render_bytes(_put(_base(), table, key, value))
        path.write_bytes(data)
        sources = [path] + ([data.decode("utf-8", "surrogateescape")] if b"\xff" in data else [])
        for source in sources:
            try:
                cfg, problems = _check_part(source)
            except Exception as e:       # noqa: BLE001 - the point: name the config
                raise AssertionError(f"{table}.{key} = {value!r}: {type(e).__name__}: {e}")
            if cfg is not None and not problems:
                accepted += 1
                try:
                    _kernel_inputs(cfg)
                except Exception as e:   # noqa: BLE001
                    raise AssertionError(f"{table}.{key} = {value!r} passed check, then "
                                         f"{type(e).__name__}: {e}")
    assert accepted > 50        # values within range are accepted, not everything refused


def _kernel_inputs(cfg) -> None:
    """What run hands the kernel for each worker of an accepted config, built as
    lifecycle does it from the config: its cgroup limits (cpu.max in microseconds), its
    host user, its argv and environment (no NUL, all UTF-8: execve takes C strings).
    A config mistake must be refused before any of this can raise."""
    import dataclasses

    from supervisor.protocol import Endpoint, worker_env
    from supervisor.sandbox.cgroups import CPU_PERIOD_US, Limits
    from supervisor.sandbox.policy import host_ids

    for d in cfg.domains.values():
        try:
            host_ids(d.profile, d.user)
        except LookupError:
            pass                                  # a missing user: check says so, run exits 2
    for w in cfg.workers.values():
        lim = Limits(memory_max=w.memory_max, pids_max=w.pids_max, cpu_quota_pct=w.cpu_quota,
                     cpu_weight=cfg.cpu_weight_of(w.name))
        assert lim.cpu_quota_us is None or 1000 <= lim.cpu_quota_us <= 1024 * CPU_PERIOD_US
        d = cfg.domain_of(w.name)
        m = cfg.models.get(w.model or "")
        ep = Endpoint(name=w.name, domain=w.domain, profile=d.profile, isolation=d.isolation(),
                      network=d.network, sandboxed=True, roles=w.roles,
                      writable=d.extra_rw_binds, model=dataclasses.asdict(m) if m else None,
                      mode=cfg.supervisor.mode, busy_poll_us=w.busy_poll_us)
        env, _ = worker_env(ep, None, {})
        for text in [*w.argv(), *env.values(), *d.extra_ro_binds, *d.extra_rw_binds]:
            assert "\0" not in text, (w.name, text)
            text.encode("utf-8")


@settings(max_examples=max(EXAMPLES // 2, 100), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(doc=mutated())
def test_bounds_nuls_and_bad_utf8_in_check_and_run(doc, tmp_path_factory):
    from supervisor.config import check_runtime
    from supervisor.lifecycle import Supervisor, _supervisor

    path = tmp_path_factory.mktemp("fuzz") / "fuzz.toml"
    data = render_bytes(doc)
    path.write_bytes(data)
    texts = [path]
    if b"\xff" in data:          # also the text a str-based caller could hand in
        texts.append(data.decode("utf-8", "surrogateescape"))
    for source in texts:
        cfg, problems = _check_part(source)
        if cfg is None:
            continue
        # run's own pre-start checks are check_runtime(sandboxed=False) when unsandboxed
        problems = _one_line(check_runtime(cfg, sandboxed=False))
        # Admission skipped where run judges it (judge_before_start, with the runtime
        # checks), not only in `admit`: else each example's workers were walked.
        saved = Supervisor._make_channels, Supervisor.admit, _supervisor.check_worker
        Supervisor._make_channels = _refuse_to_start
        Supervisor.admit = lambda self: []
        _supervisor.check_worker = _admitted
        try:
            started, exit_event = _run_config_part(cfg)
        finally:
            Supervisor._make_channels, Supervisor.admit, _supervisor.check_worker = saved
        assert started == (not problems), (problems, exit_event)
        if started:
            _kernel_inputs(cfg)
