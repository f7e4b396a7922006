from __future__ import annotations

import json
import os
import queue
import subprocess
import textwrap
import time
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from supervisor.ipc import Channel, ChannelSpec
from supervisor.protocol import Endpoint, worker_env

PEER = Path(__file__).with_name("ipc_peer.py")
REPO = Path(__file__).resolve().parents[1]


def bwrap_unusable() -> str | None:
    """None if bubblewrap runs a sandbox with its own user and pid namespaces here, else
    why not (a sandbox test module skips itself with it)."""
    import shutil

    bw = shutil.which("bwrap")
    if bw is None:
        return "bwrap not installed"
    r = subprocess.run([bw, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "true"],
                       capture_output=True, timeout=20)
    return None if r.returncode == 0 else f"bwrap unusable: {r.stderr!r}"


class Peer:
    """A real separate process holding one end of a channel."""

    def __init__(self, role: str, handle, *args: str) -> None:
        env = dict(os.environ, PEER_HANDLE=handle.to_json())
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), role, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, pass_fds=handle.fds(), env=env)
        self.hello = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()


@pytest.fixture
def make_channel():
    made: list[Channel] = []

    def make(**kw) -> Channel:
        kw.setdefault("name", "test")
        kw.setdefault("slot_size", 1 << 16)
        ch = Channel.create(ChannelSpec(**kw))
        made.append(ch)
        return ch

    yield make
    for ch in made:
        ch.close()


@pytest.fixture
def peers():
    started: list[Peer] = []

    def start(role: str, handle, *args: str) -> Peer:
        p = Peer(role, handle, *args)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture(scope="session", autouse=True)
def _compiled_sources():
    """The project's own modules byte-compiled once, before any process the suite starts.
    Without it every `supervisor` CLI run and every sandboxed worker compiled supervisor/,
    workers/ and schemas/ from source at start-up (PYTHONDONTWRITEBYTECODE=1 here, and a
    sandbox's tree is read-only): 0.1-0.3 s of CPU for each process the suite starts
    (`supervisor check` of one worker: 1.06-1.27 s CPU without them, 0.95-1.03 s with). An
    installed vehicle has them compiled too (pip compiles at install). Checked-hash pycs:
    every import compares the source's hash, never its mtime, so an edit made during the
    session (several engineers share this checkout) is never run stale. umask 022: a
    control domain's python_path must be writable by no one but root (check refuses it)."""
    import compileall
    import py_compile

    old = os.umask(0o022)
    try:
        for pkg in ("supervisor", "workers", "schemas"):
            compileall.compile_dir(REPO / pkg, quiet=2, workers=1,
                                   invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    finally:
        os.umask(old)
    yield


@pytest.fixture(scope="session", autouse=True)
def _session_state_dir(tmp_path_factory):
    """A floor under `_state_dir`: fixtures wider than one test (a module's supervisor
    fleet, a module's stress run) are set up before any function fixture, and would
    otherwise latch in the machine's /var/lib/trio-supervisor."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRIO_STATE_DIR", str(tmp_path_factory.mktemp("session-state")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _admission_cache(tmp_path_factory):
    """One admission cache for the session's supervisors (`supervisor.admission._store`):
    each `supervisor run`/`check` the suite starts walked its workers' code cold (~640
    files for a tinygrad worker, 6-16 s on 2 cores); the next one takes the walk while
    every file it read is unchanged. Per session, so no run inherits another's; one set
    outside is kept ("off": every admission walks, as before the cache, to measure it;
    a directory: kept across runs)."""
    if "TRIO_ADMISSION_CACHE" in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRIO_ADMISSION_CACHE", str(tmp_path_factory.mktemp("admission") / "cache"))
        yield


@pytest.fixture(autouse=True)
def _state_dir(tmp_path_factory, monkeypatch):
    """Each test latches its fail-safes in its own directory, never the machine's
    /var/lib/trio-supervisor: a test that fails safe must not stop the next one. Set in
    os.environ, so every `supervisor` the test starts as a subprocess (Run, Worker,
    subprocess.run with or without env=dict(os.environ, ...)) inherits it."""
    d = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("TRIO_STATE_DIR", str(d))
    return d


# ---------------------------------------------------------------- a worker process


class Worker:
    """``python -m supervisor.runner MODULE ARGS`` with the env and fds the supervisor
    gives a worker (the supervisor's own `protocol.worker_env`), its status pipe drained."""

    def __init__(self, module: str, args: list[str], *, writes: dict[str, Channel] = {},
                 reads: dict[str, Channel] = {}, domain: str = "control",
                 mode: str = "vehicle") -> None:
        """`writes` / `reads` map the worker's roles to channels, as the config binds them."""
        handles = {ch.spec.name: ch.writer_handle() for ch in writes.values()}
        handles.update({ch.spec.name: ch.reader_handle(0) for ch in reads.values()})
        roles = tuple((role, ch.spec.name) for role, ch in (*writes.items(), *reads.items()))
        r, w = os.pipe2(os.O_CLOEXEC)
        ep = Endpoint(name=module.rsplit(".", 1)[-1], domain=domain, roles=roles, mode=mode)
        env_extra, fds = worker_env(ep, w, handles)
        env = dict(os.environ, **env_extra)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                          env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.runner", module, *args],
                                     pass_fds=[*fds, w], env=env, cwd=REPO,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        os.close(w)
        self.lines: list[str] = []
        self._r = r
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        buf = b""
        while chunk := os.read(self._r, 65536):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            self.lines += [ln.decode() for ln in lines if ln != b"WATCHDOG=1"]
        os.close(self._r)

    def statuses(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith("STATUS=")]

    def wait(self, timeout: float = 20) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self._t.join(5)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def workers():
    started: list[Worker] = []

    def start(*a, **kw) -> Worker:
        w = Worker(*a, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


# ---------------------------------------------------------------- a supervisor run


# How long a supervisor's admission (static checks of every worker's code, before any
# channel exists) may take before a wait's own clock starts. ~5-10 s on a quiet 2-core
# machine, 55 s at load 20, over 60 s under two CPU hogs on a shared machine: a
# wait_for(..., 30) then failed on a supervisor that had not started a worker yet.
ADMISSION_S = 300
_PAST_ADMISSION = ("channels_created", "supervisor_exit")


class Run:
    """`supervisor run` as a child process, its JSON event lines parsed as they come.
    A wait's timeout counts from the end of admission (or from the call, if later): it
    is about what the test waits for, not about how loaded the machine is."""

    def __init__(self, tmp_path: Path, toml: str, env: dict | None = None,
                 cmd: str = "run") -> None:
        self.path = tmp_path / "sup.toml"
        self.path.write_text(textwrap.dedent(toml))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", cmd, "--config", str(self.path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, **(env or {})))
        self.events: list[dict] = []
        self.lines: list[str] = []       # every stderr line, events or not
        self.admitted_at: float | None = None   # monotonic time admission was over
        # Lines arrive on a thread: a quiet supervisor must fail a wait at its deadline,
        # not block a blocking readline forever.
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self._lines.put(line)
        self._lines.put(None)            # EOF: the supervisor is gone

    def _take(self, timeout: float) -> bool:
        """One line into `events` (JSON ones); False at EOF or when none came in time."""
        try:
            line = self._lines.get(timeout=max(timeout, 0))
        except queue.Empty:
            return False
        if line is None:
            self._lines.put(None)        # stays at EOF
            return False
        self.lines.append(line)
        if line.startswith("{"):
            self.events.append(json.loads(line))
            if self.admitted_at is None and self.events[-1].get("event") in _PAST_ADMISSION:
                self.admitted_at = time.monotonic()
        return True

    def _deadline(self, called: float, timeout: float) -> float:
        if self.admitted_at is None:
            return called + ADMISSION_S + timeout
        return max(called, self.admitted_at) + timeout

    def wait_for(self, event: str, count: int = 1, timeout: float = 30, **match) -> list[dict]:
        called = time.monotonic()
        while True:
            hits = [e for e in self.events if e["event"] == event
                    and all(e.get(k) == v for k, v in match.items())]
            if len(hits) >= count:
                return hits
            if not self._take(self._deadline(called, timeout) - time.monotonic()) and (
                    time.monotonic() >= self._deadline(called, timeout)
                    or self.proc.poll() is not None):
                break
        raise AssertionError(f"no {count}x {event} {match}; got "
                             f"{[e['event'] for e in self.events]}")

    def wait_until(self, pred, timeout: float = 30) -> list[dict]:
        """Events until ``pred(events)`` holds (AssertionError at the deadline or EOF)."""
        called = time.monotonic()
        while not pred(self.events):
            if not self._take(self._deadline(called, timeout) - time.monotonic()) and (
                    time.monotonic() >= self._deadline(called, timeout)
                    or self.proc.poll() is not None):
                raise AssertionError(f"condition not met; got "
                                     f"{[e['event'] for e in self.events]}")
        return self.events

    def finish(self, timeout: float = 20) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        while self._take(0):
            pass
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def sup(tmp_path):
    runs = []

    def start(toml: str, **kw) -> Run:
        r = Run(tmp_path, toml, **kw)
        runs.append(r)
        return r

    yield start
    for r in runs:
        r.stop()


# ---------------------------------------------------------------- leftovers (hygiene)

# A file: each leftover is also appended there as one JSON line (the summary prints them).
LEFTOVERS_ENV = "TRIO_TEST_LEFTOVERS"
LEFTOVER_GRACE_S = 2.0        # a killed process or a thread at EOF gets this long to go
# Daemon threads that live as long as the process by design, never a test's leftover:
# launch._SpawnerThread forks every sandbox from one stable thread (PDEATHSIG follows
# the forking thread), and trio's thread cache keeps an idle worker ~10 s for reuse.
# outstream's writer threads (one per terminal/stream, ending 0.5 s after their last
# line) and the orphan reaper (ending when a killed sandbox's init is reaped) are the
# supervisor's own too.
_SHARED_THREADS = ("sandbox-spawner", "orphan-reaper")
_SHARED_PREFIXES = ("outstream-",)
_IDLE_TRIO = os.sep + os.path.join("trio", "_core", "_thread_cache.py")
_OWN_CODE = (str(REPO / "supervisor") + os.sep, str(REPO / "workers") + os.sep)


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    uid: int
    start: int                # clock ticks after boot: (pid, start) names one process


def _bwraps() -> dict[tuple[int, int], _Proc]:
    """Every live bubblewrap process on the machine (zombies left out): one read of
    /proc/PID/stat each, ~1-2 ms for the ~100 processes here."""
    found: dict[tuple[int, int], _Proc] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
            if b"(bwrap) " not in stat:
                continue
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue                     # gone meanwhile
        comm, _, rest = stat.partition(b" (")[2].rpartition(b") ")
        fields = rest.split()
        if comm != b"bwrap" or fields[0] == b"Z":
            continue
        p = _Proc(int(name), int(fields[1]), uid, int(fields[19]))
        found[(p.pid, p.start)] = p
    return found


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    for _ in range(64):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rpartition(b") ")[2].split()[1])
        except OSError:
            return False
        if pid == me:
            return True
        if pid <= 1:
            return False
    return False


def _where(t: threading.Thread) -> str:
    """The innermost frame of `t` in the project's own code (else its innermost frame)."""
    frame = sys._current_frames().get(t.ident or -1)
    first = frame
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OWN_CODE):
            break
        frame = frame.f_back
    frame = frame or first
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    if path.startswith(str(REPO) + os.sep):
        path = os.path.relpath(path, REPO)
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


def _shared(t: threading.Thread) -> bool:
    if not t.daemon:
        return False
    if t.name in _SHARED_THREADS or t.name.startswith(_SHARED_PREFIXES):
        return True
    frame = sys._current_frames().get(t.ident or -1)      # innermost: idle in trio's cache
    return frame is not None and frame.f_code.co_filename.endswith(_IDLE_TRIO) \
        and not _runs_own_code(t)


def _runs_own_code(t: threading.Thread) -> bool:
    frame = sys._current_frames().get(t.ident or -1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OWN_CODE):
            return True
        frame = frame.f_back
    return False


@dataclass
class Leftovers:
    """Names the test after which a thread or a bubblewrap sandbox appeared that is still
    there when its module is over (every fixture of the module torn down). A thread that
    outlives its test kept running bridge code in CI and inflated a later test's
    allocation count; a research sandbox with PPID 1 was found after full suites, origin
    unknown. Report-only: the summary lists them (and `TRIO_TEST_LEFTOVERS`, a file, gets
    one JSON line each); no test fails for them.

    A thread counts when it is not a daemon or runs supervisor/ or workers/ code; any other
    daemon thread is listed as `daemon` (e.g. a `Run` reader whose pipe someone still
    holds), except those that live as long as the process by design (`_shared`). A bwrap counts when it was first seen as this session's descendant or as an
    orphan (PPID 1): another engineer's fleet on the same machine is neither."""
    module: object = None
    threads: dict[threading.Thread, str] = field(default_factory=dict)   # -> nodeid first seen
    procs: dict[tuple[int, int], tuple[str, bool]] = field(default_factory=dict)
    known_threads: set[threading.Thread] = field(default_factory=set)
    known_procs: set[tuple[int, int]] = field(default_factory=set)
    found: list[dict] = field(default_factory=list)

    def begin(self) -> None:
        self.known_threads = set(threading.enumerate())
        self.known_procs = set(_bwraps())

    def after_test(self, nodeid: str) -> None:
        for t in threading.enumerate():
            if t not in self.known_threads:
                self.known_threads.add(t)
                self.threads[t] = nodeid
        for key, p in _bwraps().items():
            if key not in self.known_procs:
                self.known_procs.add(key)
                ours = _descends_from_us(p.pid)
                if ours or p.ppid == 1:
                    self.procs[key] = (nodeid, ours)

    def end_module(self) -> None:
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        # Still at work when the module ended, gone within the grace: it ran on into the
        # next module's first test (a leak test counting allocations would see it).
        late = {t: (_where(t), "non-daemon" if not t.daemon else "bridge")
                for t in self.threads if t.is_alive() and not _shared(t)
                and (not t.daemon or _runs_own_code(t))}
        for t in list(self.threads):
            if not _shared(t):           # an idle cache thread would cost the whole grace
                t.join(max(0.0, deadline - time.monotonic()))
        for t, (where, kind) in late.items():
            if not t.is_alive():
                self._add(dict(test=self.threads[t], what="thread", kind=kind + " (ended late)",
                               name=t.name, where=where))
        while self.procs and time.monotonic() < deadline:
            if not set(self.procs) & set(_bwraps()):
                break
            time.sleep(0.05)
        for t, nodeid in self.threads.items():
            if not t.is_alive() or _shared(t):
                continue
            kind = ("bridge" if _runs_own_code(t) else "daemon") if t.daemon else "non-daemon"
            self._add(dict(test=nodeid, what="thread", kind=kind, name=t.name, where=_where(t)))
        live = _bwraps()
        for key, (nodeid, ours) in self.procs.items():
            if key in live:
                p = live[key]
                self._add(dict(test=nodeid, what="bwrap", pid=p.pid, ppid=p.ppid, uid=p.uid,
                               ours=ours))
        self.threads.clear()
        self.procs.clear()

    def _add(self, rec: dict) -> None:
        self.found.append(rec)
        if path := os.environ.get(LEFTOVERS_ENV):
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def lines(self) -> list[str]:
        return [f"{r['test']}: left {r['what']} " + ", ".join(
            f"{k}={v}" for k, v in r.items() if k not in ("test", "what")) for r in self.found]


_leftovers = Leftovers()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    module = getattr(item, "module", None)        # a non-Python item counts as its own
    if _leftovers.module is not module or module is None:
        _leftovers.module = module
        _leftovers.begin()
    yield
    _leftovers.after_test(item.nodeid)
    if nextitem is None or module is None or getattr(nextitem, "module", None) is not module:
        _leftovers.end_module()


def pytest_terminal_summary(terminalreporter):
    if _leftovers.found:
        terminalreporter.section("leftovers (threads and sandboxes a module left running)")
        for line in _leftovers.lines():
            terminalreporter.write_line(line)
