"""A corpus of bad configs (issue 22: `check` knows what `run` knows).

Each entry is a small vehicle config (probe workers, or the default pipeline) with one
mistake: a number at or past its bound, a NUL or non-UTF-8 byte in a string, a bad name,
or a rule only the machine or the worker module can tell (modeld with no model, an
unwritable state_dir, a CPU quota no worker can start in). Every one must be refused by
`supervisor check` (exit 2, or 3 when admission refuses too) with one line per problem
naming the key, and by `supervisor run` before any worker starts; neither may end in a
traceback.

The tests below go through the config part in-process (cheap) and a handful through the
real CLI. Run as a script, it measures what the issue counts, for any checkout:

    python tests/test_config_corpus.py [--root /tmp/before4] [--timeout 40]

For each config: `supervisor check`; if check passes, `supervisor run` until all workers
are READY (then SIGINT) or the timeout; prints each config's verdict and the number of
configs that passed check and then failed run.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
NUL, BAD_UTF8 = "\0", "\udcff"     # BAD_UTF8 is written to the file as the raw byte 0xff

SMALL: dict[str, Any] = {
    "supervisor": {"mode": "vehicle"},
    "domains": {"control": {"actuates": True}, "research": {}},
    "channels": {"frames": {"slot_size": "4KiB", "dtype": "uint8"}},
    "workers": {
        "src": {"domain": "control", "module": "workers.probe", "publishes": ["frames"],
                "args": ["--publish", "frames", "--period-ms", "20", "--ping-ms", "20"]},
        "sink": {"domain": "control", "module": "workers.probe", "subscribes": ["frames"],
                 "args": ["--read", "frames"]},
        "lab": {"domain": "research", "module": "workers.probe", "subscribes": ["frames"],
                "args": ["--read", "frames"], "optional": True},
    },
}


def _pipeline() -> dict[str, Any]:
    """The one-camera pipeline (configs/minimal.toml: camerad -> modeld -> controlsd,
    research; the car's tables without its extra cameras), as a dict."""
    return tomllib.loads((ROOT / "supervisor" / "configs" / "minimal.toml").read_text("utf-8"))


@dataclasses.dataclass(frozen=True)
class Bad:
    name: str
    key: str                                # a problem must name this key (or one below it)
    edit: Callable[[dict], None]
    base: str = "small"                     # "small" | "pipeline"
    # the mistake is the state dir itself: run without the TRIO_STATE_DIR override
    own_state_dir: bool = False

    def doc(self) -> dict[str, Any]:
        d = copy.deepcopy(SMALL) if self.base == "small" else _pipeline()
        self.edit(d)
        return d


def _set(path: str, value: Any) -> Callable[[dict], None]:
    *tables, last = path.split(".")

    def edit(d: dict) -> None:
        for t in tables:
            d = d.setdefault(t, {})
        d[last] = value
    return edit


def _rename(section: str, old: str, new: str) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d[section] = {(new if k == old else k): v for k, v in d[section].items()}
    return edit


def _drop(path: str) -> Callable[[dict], None]:
    *tables, last = path.split(".")

    def edit(d: dict) -> None:
        for t in tables:
            d = d[t]
        d.pop(last, None)
    return edit


def _both(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        for e in edits:
            e(d)
    return edit


# Numbers past (or just at the wrong side of) every bound, with the key they belong to.
_NUMBERS: list[tuple[str, Any]] = [
    ("supervisor.status_interval_s", 1e308), ("supervisor.status_interval_s", 1e-6),
    ("supervisor.maps_scan_interval_s", 1e308), ("supervisor.maps_scan_interval_s", 1e-9),
    ("supervisor.shm_budget", 2**62), ("supervisor.shm_budget", 0),
    ("workers.src.backoff_initial_ms", 0), ("workers.src.backoff_max_ms", 2**40),
    ("workers.src.max_restarts", -1), ("workers.src.max_restarts", 10**12),
    ("workers.src.restart_window_s", 1e308), ("workers.src.restart_window_s", 0),
    ("workers.src.cooldown_s", 1e308), ("workers.src.cooldown_s", -1.0),
    ("workers.src.watchdog_ms", 1), ("workers.src.watchdog_ms", 2**40),
    ("workers.src.ready_timeout_ms", 1), ("workers.src.ready_timeout_ms", 2**40),
    ("workers.src.memory_max", 2**62), ("workers.src.memory_max", 0),
    ("workers.src.cpu_quota", 1e308), ("workers.src.cpu_quota", 0.5),
    ("workers.src.cpu_quota", "1e999%"), ("workers.src.cpu_quota", 1),
    ("workers.src.cpu_weight", 0), ("workers.src.cpu_weight", 10**6),
    ("workers.src.realtime_priority", 0), ("workers.src.realtime_priority", 99),
    ("workers.src.realtime_budget_pct", 101),
    ("workers.src.busy_poll_us", -1), ("workers.src.busy_poll_us", 10**9),
    ("workers.src.pids_max", 1), ("workers.src.pids_max", 2**40),
    ("workers.src.nofile", 1), ("workers.src.nofile", 2**40),
    ("domains.control.memory_max", 0), ("domains.research.pids_max", 1),
    ("channels.frames.slot_size", 0), ("channels.frames.slot_size", "2GiB"),
    ("channels.frames.slot_count", 1), ("channels.frames.slot_count", 10**6),
    ("channels.frames.max_readers", 0), ("channels.frames.max_leases", 100),
    ("channels.frames.lease_ms", 0), ("channels.frames.lease_ms", 2**40),
    ("channels.frames.max_age_ms", -1), ("channels.frames.max_age_ms", 2**40),
]

# A NUL, or a byte that is not UTF-8, in every kind of string.
_STRINGS: list[tuple[str, Any]] = [
    ("supervisor.state_dir", "/var/lib/trio\0x"), ("supervisor.log_format", "json\0"),
    ("supervisor.mode", "vehicle\0"),
    ("domains.control.user", "trio-control\0x"), ("domains.research.user", NUL),
    ("domains.research.extra_ro_binds", ["/usr/share\0x"]),
    ("workers.src.module", "workers.probe\0"), ("workers.src.domain", "control\0"),
    ("workers.src.args", ["--publish", "frames\0", "--period-ms", "20"]),
    ("workers.src.model", "m\0"), ("workers.src.subscribes", {"in\0": "frames"}),
    ("workers.sink.subscribes", ["frames\0"]),
    ("channels.frames.payload", "model_out\0"),
    ("supervisor.state_dir", f"/var/lib/trio{BAD_UTF8}"),
    ("domains.control.user", f"trio{BAD_UTF8}"),
    ("workers.src.args", ["--publish", f"frames{BAD_UTF8}"]),
    ("workers.src.module", f"workers.pr{BAD_UTF8}be"),
]

# Names that would become paths, users or segment names.
_NAMES: list[Bad] = [
    Bad("worker name with NUL", "workers", _rename("workers", "sink", "si\0nk")),
    Bad("worker name with /", "workers", _rename("workers", "sink", "../sink")),
    Bad("worker name not UTF-8", "workers", _rename("workers", "sink", f"s{BAD_UTF8}")),
    Bad("channel name with NUL", "channels", _rename("channels", "frames", "fr\0")),
    Bad("domain name with /", "domains", _rename("domains", "research", "re/search")),
    Bad("user with /", "domains.control.user", _set("domains.control.user", "../../etc")),
    Bad("user starting with -", "domains.research.user", _set("domains.research.user", "-rf")),
    Bad("user with a newline", "domains.research.user",
        _set("domains.research.user", "trio\nresearch")),
    Bad("key with NUL", "workers", _set("workers.src.ready\0", 5)),
    Bad("state_dir relative", "supervisor.state_dir", _set("supervisor.state_dir", "state"),
        own_state_dir=True),
]

def _no_research(d: dict) -> None:
    """The pipeline without its research worker (and the channel only it writes): the
    same control domain, started and checked without torch's import graph."""
    d["workers"].pop("research", None)
    d["channels"].pop("shadow_out", None)


# What only the machine or the worker module can tell.
_RULES: list[Bad] = [
    Bad("modeld without model =", "workers.modeld.model",
        _both(_drop("workers.modeld.model"), _no_research), base="pipeline"),
    Bad("modeld and no [models] table", "workers.modeld.model",
        _both(_drop("workers.modeld.model"), _drop("models")), base="pipeline"),
    Bad("camerad cpu_quota = 1", "workers.camerad.cpu_quota",
        _set("workers.camerad.cpu_quota", 1), base="pipeline"),
    Bad("controlsd cpu_quota = 2", "workers.controlsd.cpu_quota",
        _set("workers.controlsd.cpu_quota", 2), base="pipeline"),
    Bad("modeld cpu_quota = 1e308", "workers.modeld.cpu_quota",
        _set("workers.modeld.cpu_quota", 1e308), base="pipeline"),
    Bad("state_dir under /proc", "supervisor.state_dir",
        _set("supervisor.state_dir", "/proc/trio-supervisor"), own_state_dir=True),
    Bad("state_dir below a file", "supervisor.state_dir",
        _set("supervisor.state_dir", "/etc/hostname/trio"), own_state_dir=True),
    Bad("state_dir in /sys", "supervisor.state_dir",
        _set("supervisor.state_dir", "/sys/trio-supervisor"), own_state_dir=True),
    Bad("modeld given a model by argument", "workers.modeld.args",
        _set("workers.modeld.args", ["--artifact", "/tmp/m", "--pubkey", "/tmp/k"]),
        base="pipeline"),
]


def corpus() -> list[Bad]:
    out = [Bad(f"{k} = {v!r}", k, _set(k, v), own_state_dir=k == "supervisor.state_dir")
           for k, v in _NUMBERS + _STRINGS]
    return out + _NAMES + _RULES


# --------------------------------------------------------------------------- TOML out


def _str(s: str) -> str:
    out = []
    for c in s:
        if c == BAD_UTF8:
            out.append(c)                       # raw, encoded with surrogateescape below
        elif c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_str(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def render(doc: dict[str, Any]) -> bytes:
    lines = []
    for section, body in doc.items():
        flat = {k: v for k, v in body.items() if not isinstance(v, dict)} \
            if section == "supervisor" else {}
        if section == "supervisor":
            lines.append("[supervisor]")
            lines += [f"{_str(k)} = {_value(v)}" for k, v in flat.items()]
            continue
        for name, table in body.items():
            lines.append(f"[{_str(section)}.{_str(name)}]")
            lines += [f"{_str(k)} = {_value(v)}" for k, v in table.items()]
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")


def write(bad: Bad, d: Path) -> Path:
    path = d / f"{abs(hash(bad.name)) % 10**8:08d}.toml"
    path.write_bytes(render(bad.doc()))
    return path


# --------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Verdict:
    check_rc: int
    check_lines: list[str]
    run: str = ""            # "" (not run) | "ran" | "failed: WHY"


def _env(root: Path, bad: Bad, state: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("TRIO_STATE_DIR", None)
    if not bad.own_state_dir:
        env["TRIO_STATE_DIR"] = state
    return env


def run_outcome(root: Path, path: Path, env: dict[str, str], timeout: float) -> str:
    """'ran' when every worker became READY and SIGINT stopped it with exit 0, else
    'failed: ...'."""
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--quiet", "--config",
                          str(path)], cwd=root, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    assert p.stderr is not None
    fd = p.stderr.fileno()
    os.set_blocking(fd, False)
    raw, ready, deadline = b"", False, time.monotonic() + timeout

    def drain() -> bytes:
        out = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return out
            if not chunk:
                return out
            out += chunk

    while time.monotonic() < deadline and p.poll() is None:
        raw += drain()
        if b'"event": "all_ready"' in raw or b'"event":"all_ready"' in raw:
            ready = True
            break
        time.sleep(0.2)
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    raw += drain()
    buf = raw.decode("utf-8", "replace")
    if "Traceback" in buf:
        return f"failed: traceback (exit {p.returncode})"
    if not ready:
        last = [ln for ln in buf.splitlines() if "supervisor_exit" in ln]
        return f"failed: never all READY (exit {p.returncode}) {last[-1][:160] if last else ''}"
    if p.returncode != 0:
        return f"failed: exit {p.returncode} after READY"
    return "ran"


def check_batch(jobs_file: str) -> None:
    """Run inside the checkout measured (PYTHONPATH): `supervisor check` (cli.cmd_check,
    the very function) of each config in one process, one JSON line each; what escapes
    it is recorded as the traceback the CLI would have printed."""
    import argparse
    import contextlib
    import io
    import traceback

    from supervisor import cli

    for job in json.loads(Path(jobs_file).read_text()):
        os.environ.pop("TRIO_STATE_DIR", None)
        if job["state"]:
            os.environ["TRIO_STATE_DIR"] = job["state"]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = cli.cmd_check(argparse.Namespace(config=job["path"]))
        except Exception:    # noqa: BLE001 - what the CLI would print as a traceback
            rc = 1
            err.write("Traceback (most recent call last):\n" + traceback.format_exc())
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        print(json.dumps({"rc": rc, "stderr": err.getvalue()}), flush=True)


def measure(root: Path, timeout: float) -> int:
    """Check every config (in one process of ``root``), run those check passes."""
    both = 0
    bads = corpus()
    with tempfile.TemporaryDirectory() as tmp:
        jobs, envs = [], []
        for i, bad in enumerate(bads):
            d = Path(tmp) / str(i)
            d.mkdir()
            path = write(bad, d)
            state = str(d / "state")
            envs.append(_env(root, bad, state))
            jobs.append({"path": str(path), "state": "" if bad.own_state_dir else state})
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        c = subprocess.run([sys.executable, __file__, "--check-batch", str(Path(tmp) / "jobs.json")],
                           cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                           capture_output=True, text=True, timeout=3600)
        results = [json.loads(ln) for ln in c.stdout.splitlines() if ln.startswith("{")]
        assert len(results) == len(bads), c.stderr[-3000:]
        base = Bad("the small base config, unchanged", "", lambda d: None)
        d = Path(tmp) / "base"
        d.mkdir()
        print(json.dumps({"config": base.name, "run": run_outcome(
            root, write(base, d), _env(root, base, str(d / "state")), timeout)}), flush=True)
        for bad, job, env, res in zip(bads, jobs, envs, results):
            v = Verdict(res["rc"], res["stderr"].splitlines())
            if "Traceback" in res["stderr"]:
                v.run = "check traceback"
            elif v.check_rc == 0:
                v.run = run_outcome(root, Path(job["path"]), env, timeout)
                both += v.run.startswith("failed")
            print(json.dumps({"config": bad.name, "check": v.check_rc, "run": v.run,
                              "first": v.check_lines[:1]}), flush=True)
    passed = sum(1 for r in results if r["rc"] == 0)
    print(f"{passed} of {len(bads)} bad configs passed `supervisor check`; {both} of them then "
          f"failed `supervisor run` ({root})")
    return both


# --------------------------------------------------------------------------- tests

if "pytest" in sys.modules:
    import pytest

    from supervisor.config import ConfigFileError, check_runtime, load, loads

    CORPUS = corpus()

    def test_the_corpus_is_big_enough_and_each_entry_distinct():
        assert len(CORPUS) >= 80
        assert len({b.name for b in CORPUS}) == len(CORPUS)
        assert len({render(b.doc()) for b in CORPUS}) == len(CORPUS)

    def _problems(bad: Bad, tmp_path: Path) -> list[str]:
        """`supervisor check`'s config part, in-process: load(), then check_runtime().
        A file that is not UTF-8 is one problem naming its line; the same text decoded
        as Python would (a lone surrogate per bad byte) must then name the key."""
        path = write(bad, tmp_path)
        try:
            cfg = load(path)
        except ConfigFileError as e:
            found = [str(p) for p in e.problems]
            if BAD_UTF8 not in json.dumps(bad.doc(), ensure_ascii=False):
                return found
            assert len(found) == 1 and "is not valid UTF-8" in found[0], found
            try:
                cfg = loads(render(bad.doc()).decode("utf-8", "surrogateescape"), str(path))
            except ConfigFileError as e2:
                return [str(p) for p in e2.problems]
        return [str(p) for p in check_runtime(cfg)]

    @pytest.mark.parametrize("bad", CORPUS, ids=[b.name for b in CORPUS])
    def test_check_refuses_every_bad_config_in_one_line_naming_the_key(bad, tmp_path, monkeypatch):
        if bad.own_state_dir:
            monkeypatch.delenv("TRIO_STATE_DIR", raising=False)
        found = _problems(bad, tmp_path)
        assert found, f"{bad.name}: check found nothing"
        for line in found:
            assert "\n" not in line and "\0" not in line and len(line.splitlines()) == 1, line
        keys = [ln.split(": ", 2)[1] if ln.count(": ") >= 2 else "" for ln in found]
        assert any(k.startswith(bad.key) or k.startswith(f'{bad.key}.') for k in keys) or \
            bad.key in ("workers", "channels", "domains") and found, (bad.key, found)

    def test_run_refuses_every_bad_config_before_any_worker_starts(tmp_path, monkeypatch):
        """`supervisor run`'s config part, in-process: what load() refuses, run's `_config`
        prints and exits 2 with; the rest must stop in Supervisor.run's checks, before
        channels or workers exist (sandboxed=False: no cgroups, nothing started)."""
        import trio

        from supervisor.events import EventLog
        from supervisor.exits import Exit
        from supervisor.lifecycle import Supervisor

        def started(self) -> None:
            raise AssertionError("run went on to create channels and start workers")

        monkeypatch.setattr(Supervisor, "_make_channels", started)
        # admission judges code, not the config's values (its own tests; the real CLI
        # below runs it): skipped here, it is most of the cost. Since run's config checks
        # and admission are judged together (Supervisor.judge_before_start, for privsep)
        # stubbing `admit` alone no longer skipped the walks: 75 of this test's 77 s
        # under a profiler were admission's. Every worker is admitted, as `admit` says.
        from supervisor.admission.report import AdmissionReport
        from supervisor.lifecycle import _supervisor

        monkeypatch.setattr(_supervisor, "check_worker", lambda name, domain, *a, **kw:
                            AdmissionReport(worker=name, domain=domain, ok=True))
        monkeypatch.setattr(Supervisor, "admit", lambda self: [])
        reached = []
        for i, bad in enumerate(CORPUS):
            with monkeypatch.context() as m:
                if bad.own_state_dir:
                    m.delenv("TRIO_STATE_DIR", raising=False)
                d = tmp_path / str(i)
                d.mkdir()
                try:
                    cfg = load(write(bad, d))
                except ConfigFileError:
                    continue
                with open(os.devnull, "w") as devnull:
                    log = EventLog(stream=devnull, keep=True)
                    code = trio.run(Supervisor(cfg, log=log, sandboxed=False).run)
            exits = log.of("supervisor_exit")
            assert code != Exit.SHUTDOWN and len(exits) == 1, (bad.name, code, exits)
            assert "\n" not in exits[0]["reason"], exits
            reached.append((bad.name, int(code)))
        # what only run-time checks refuse: modeld's model (2), the state dir (3), its args
        assert len(reached) >= 6, reached

    # A handful through the real CLI: check and run, each one line per problem, exit 2.
    CLI = ["workers.src.cpu_quota = 1e+308", "domains.control.user = 'trio-control\\x00x'",
           "modeld without model ="]

    @pytest.mark.parametrize("name", CLI)
    def test_the_real_cli_refuses_them_without_a_traceback(name, tmp_path):
        bad = next(b for b in CORPUS if b.name == name)
        path = write(bad, tmp_path)
        env = _env(ROOT, bad, str(tmp_path / "state"))
        # Both at once: each pays admission of the pipeline's workers (~10 s of one CPU
        # for a run-time problem), and CI has two CPUs.
        procs = {cmd: subprocess.Popen(
                     [sys.executable, "-m", "supervisor.cli", cmd,
                      *(["--quiet"] if cmd == "run" else []), "--config", str(path)],
                     cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True, errors="replace")
                 for cmd in ("check", "run")}
        try:
            outs = {cmd: p.communicate(timeout=300) for cmd, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for cmd, (stdout, stderr) in outs.items():
            code, out = procs[cmd].returncode, stdout + stderr
            assert "Traceback" not in out and code == 2, (cmd, code, out[-3000:])
            assert f"{path}: " in out, out[-3000:]
            assert '"event": "start"' not in out and '"event":"start"' not in out

    def test_the_state_dir_probe_leaves_nothing_behind(tmp_path, monkeypatch):
        monkeypatch.delenv("TRIO_STATE_DIR", raising=False)
        target = tmp_path / "a" / "b"
        doc = copy.deepcopy(SMALL)
        doc["supervisor"]["state_dir"] = str(target)
        path = tmp_path / "c.toml"
        path.write_bytes(render(doc))
        assert [p for p in check_runtime(load(path)) if p.key == "supervisor.state_dir"] == []
        assert sorted(os.listdir(tmp_path)) == ["c.toml"]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    ap.add_argument("--timeout", type=float, default=40.0,
                    help="seconds a run may take to have every worker READY")
    ap.add_argument("--check-batch", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.check_batch:
        check_batch(a.check_batch)
    else:
        measure(a.root.resolve(), a.timeout)
