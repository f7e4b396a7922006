"""Red team, round 8 (docs/redteam8.md): the safety core against ordinary events and a
worker that wedges instead of dying, under one real `supervisor run` (real bubblewrap
sandboxes, real cgroups, a real pseudo-terminal as its console).

Each test asserts the claim the way it should hold. A claim that fails today is an
``xfail(strict=True)`` whose reason starts with "redteam8 row N"; the lead's fix turns it
into a plain pass. ``--runxfail`` shows the evidence of each break.

The fleet's workers are the probe (workers/probe) and a small attack package written at
run time into a root-owned ``python_path`` directory (``rt8w``, below): its workers act
when the test creates a trigger file beside them (the directory is bound read-only into
the control sandboxes, so the host's new file is visible inside at once), so each test,
not a guessed delay, says when its attack starts.

Row 7 has a supervisor of its own, embedded (the test holds a reader of the actuation
channel that outlives the stop, and picks the instant of the stop signal by reading the
supervisor's state); row 8 needs none (a real full tmpfs in a private mount namespace).
"""
from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the supervisor's isolation (host uids, cgroups) needs root", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]

# The attack package: one module, its behaviour chosen by argv[1], its start by a file.
_RT8W = '''
"""Red team round 8 workers (tests/test_redteam_round8.py writes this file)."""
import os
import signal
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _go(name):
    return os.path.exists(os.path.join(HERE, name))


def _exec_requests(n, done=lambda: False):
    """Map this (read-only, admitted) file executable n times: before READY each is a
    request the supervisor's exec watch judges, the worker stopped meanwhile."""
    import ctypes
    import mmap
    # Through ctypes: the GIL is released while the call waits for its judgement (a
    # mapping made by the mmap module holds it, and the worker's other thread with it).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    with open(__file__, "rb") as f:
        for _ in range(n):
            if done():
                return
            at = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_EXEC, mmap.MAP_PRIVATE,
                           f.fileno(), 0)
            if at in (None, ctypes.c_void_p(-1).value):
                return
            libc.munmap(at, 4096)
            time.sleep(0.001)


def handover(ctx):
    """A warm standby of an actuation writer that, once the test says so, keeps the
    exec watch judging (lazy loading before its channels come: allowed); once it has
    the channels it publishes engaged commands (steer 0.3, engaged 1) at 100 Hz."""
    import threading
    have = threading.Event()
    if os.environ.get("TRIO_STANDBY_FD"):
        def lazy():
            while not _go("go-exec"):
                time.sleep(0.01)
            # Until its channels come (the flag: a mapping holds the GIL while judged).
            _exec_requests(300, have.is_set)
        threading.Thread(target=lazy, daemon=True).start()
    w = ctx.writer("cmd")             # a standby blocks here until it is handed the channels
    have.set()
    n = 0
    while True:
        w.publish_array(np.array([0.3, 1.0, 0.0, 1.0], w.spec.np_dtype))
        n += 1
        if n == 1:                     # READY after its first command: the order does not
            ctx.ready(status="rt8 handover")   # matter to the readers, only to the test
        ctx.watchdog()
        time.sleep(0.01)


def deny_exit(ctx):
    """Anonymous executable memory before READY (refused: no jit_kernels), then exit 0
    at once, before the supervisor could say anything about it."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_EXEC,
              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    os._exit(0)


def perr(ctx):
    """Research: once told, status lines of 9000 bytes (over the 4096-byte bound, so
    each one is a `protocol_error` the supervisor logs) at ~400/s for 2 s."""
    ctx.ready(status="rt8 perr")
    while not _go("go-perr"):
        ctx.watchdog()
        time.sleep(0.02)
    line = b"x" * 9000 + b"\\n"
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 2.0:
        os.write(ctx.status_fd, line)
        n += 1
        time.sleep(0.0025)
    print("rt8 perr: sent %d over-long status lines" % n, flush=True)
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def main(ctx):
    attack = sys.argv[1]
    if attack == "perr":
        return perr(ctx)
    if attack == "deny_exit":
        return deny_exit(ctx)
    if attack == "handover":
        return handover(ctx)
    if attack == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)     # stops only at the grace's SIGKILL
    w = ctx.writer("cmd2") if attack == "stop_self" else None
    ctx.ready(status="rt8 " + attack)
    print("rt8 %s: ready" % attack, flush=True)
    n = 0
    while True:
        if attack == "stop_self" and _go("go-stop"):
            # The actuation writer wedges instead of dying: it stops itself (SIGSTOP
            # cannot be caught or ignored); it never pings or publishes again.
            print("rt8 stop_self: stopping myself", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        quiet = attack == "go_quiet" and _go("go-quiet")
        if not quiet:
            ctx.watchdog()
        if w is not None:
            n += 1
            w.publish_array(np.full(4, n % 100, w.spec.np_dtype))
        time.sleep(0.01)
'''

WATCHDOG_MS = 500
READY_TIMEOUT_MS = 30_000
# How late a watchdog may fire on this loaded 2-core machine and still be "on time":
# the limit itself plus a second of scheduling (test_attacks' CONTROL_WATCHDOG_MS reasoning).
WATCHDOG_SLACK_MS = 1000
STALL_S = 6.0


def _toml(pp: Path) -> str:
    return textwrap.dedent(f"""
    [supervisor]
    status_interval_s = 0.5
    maps_scan_interval_s = 1.0
    [domains.control]
    actuates = true
    python_path = ["{pp}"]
    [domains.research]
    python_path = ["{pp}"]
    [channels.cmd]
    slot_size = "4KiB"
    dtype = "float32"
    payload = "control_cmd"
    max_age_ms = 50
    [channels.cmd3]
    slot_size = "4KiB"
    dtype = "float32"
    payload = "control_cmd"
    max_age_ms = 50
    [channels.cmd4]
    slot_size = "4KiB"
    dtype = "float32"
    payload = "control_cmd"
    max_age_ms = 50
    [channels.cmd2]
    slot_size = "4KiB"
    dtype = "float32"
    payload = "control_cmd"
    max_age_ms = 50
    [workers.c]
    domain = "control"
    module = "workers.probe"
    publishes = ["cmd"]
    args = ["--publish", "cmd", "--period-ms", "10", "--ping-ms", "20"]
    watchdog_ms = 1000
    restart = "always"
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.c-stop]
    domain = "control"
    module = "rt8w"
    publishes = ["cmd2"]
    args = ["stop_self"]
    watchdog_ms = {WATCHDOG_MS}
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.c-quiet]
    domain = "control"
    module = "rt8w"
    args = ["go_quiet"]
    watchdog_ms = {WATCHDOG_MS}
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.c-victim]
    domain = "control"
    module = "workers.probe"
    publishes = ["cmd3"]
    args = ["--publish", "cmd3", "--period-ms", "10", "--ping-ms", "20"]
    watchdog_ms = 1000
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.c-tstp]
    domain = "control"
    module = "workers.probe"
    publishes = ["cmd4"]
    args = ["--publish", "cmd4", "--period-ms", "10", "--ping-ms", "20"]
    watchdog_ms = 1000
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.c-fast]
    domain = "control"
    module = "workers.probe"
    args = ["--ping-ms", "2", "--period-ms", "2"]
    watchdog_ms = 1000
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.c-deny]
    domain = "control"
    module = "rt8w"
    args = ["deny_exit"]
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.r-perr]
    domain = "research"
    module = "rt8w"
    args = ["perr"]
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    [workers.r-oom]
    domain = "research"
    module = "workers.probe"
    args = ["--alloc-mb", "400", "--ping-ms", "50"]
    memory_max = "128MiB"
    restart = "never"
    optional = true
    ready_timeout_ms = {READY_TIMEOUT_MS}
    """)


class Fleet:
    """`supervisor run` with its console (stdout: the live status line) on a real
    pseudo-terminal the test holds, its events (stderr) in a file."""

    def __init__(self) -> None:
        # python_path of a control domain: root's, writable by no one else, every parent
        # too (/tmp is sticky): a fresh directory, removed at the end.
        self.tmp = Path(tempfile.mkdtemp(prefix="rt8-", dir="/tmp"))
        self.tmp.chmod(0o755)
        self.pp = self.tmp / "lib"
        (self.pp / "rt8w").mkdir(parents=True)
        self.pp.chmod(0o755)
        (self.pp / "rt8w").chmod(0o755)
        (self.pp / "rt8w" / "__init__.py").write_text(_RT8W)
        (self.pp / "rt8w" / "__init__.py").chmod(0o644)
        state = self.tmp / "state"
        state.mkdir(mode=0o700)
        cfg = self.tmp / "rt8.toml"
        cfg.write_text(_toml(self.pp))
        self.log_path = self.tmp / "supervisor.log"
        self.log = open(self.log_path, "w")
        self.master, self.slave = pty.openpty()
        self._drained = 0
        self.victim_killed_ns = 0       # row 6: when the test killed c-victim (stalled)
        self._drain_stop = False
        # The console is read all the time (a person watching it), except when the test
        # stops its output as Ctrl-S would.
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg),
             "--log-level", "debug"],
            stdin=subprocess.DEVNULL, stdout=self.slave, stderr=self.log, cwd=REPO,
            # A job of its own, as a shell starts one: its own process group in our
            # session (not an orphaned group, whose SIGTSTP the kernel would discard).
            process_group=0, env=dict(os.environ, TRIO_STATE_DIR=str(state)))

    def _drain(self) -> None:
        while not self._drain_stop:
            try:
                got = os.read(self.master, 4096)
            except OSError:
                return
            if not got:
                return
            self._drained += len(got)

    def events(self) -> list[dict]:
        out = []
        with open(self.log_path) as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass          # a line being written right now
        return out

    def of(self, event: str, worker: str | None = None) -> list[dict]:
        return [e for e in self.events() if e.get("event") == event
                and (worker is None or e.get("worker") == worker)]

    def wait_for(self, pred, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = [e for e in self.events() if pred(e)]
            if got:
                return got
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        return [e for e in self.events() if pred(e)]

    def trigger(self, name: str) -> None:
        p = self.pp / name
        p.write_text("go")
        p.chmod(0o644)

    def tail(self, n: int = 40) -> str:
        return "\n".join(json.dumps(e)[:400] for e in self.events()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                termios.tcflow(self.slave, termios.TCOON)   # never leave it blocked
            except OSError:
                pass
            self.proc.send_signal(signal.SIGCONT)             # nor stopped
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode is not None and self.proc.returncode < 0:
            _remove_cgroups_of(self.proc.pid)     # a supervisor killed by a signal
        self._drain_stop = True
        for fd in (self.slave, self.master):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _remove_cgroups_of(pid: int) -> None:
    """The cgroup trees of a supervisor that died without its own clean-up (the next
    supervisor's start would sweep them; a test leaves nothing behind). rmdir only:
    a tree still holding a process stays."""
    if os.path.exists(f"/proc/{pid}"):
        return                # the number is someone else's now: never touch their tree
    ns = os.stat("/proc/self/ns/pid").st_ino
    for root in Path("/sys/fs/cgroup").glob(f"*/trio-supervisor-{ns}-{pid}"):
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            root.rmdir()
        except OSError:
            pass


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    try:
        got = f.wait_for(lambda e: e.get("event") in ("all_ready", "supervisor_exit"), 240)
        if not got or got[0]["event"] != "all_ready":
            pytest.fail("the fleet never became ready:\n" + f.tail())
        yield f
    finally:
        f.close()


# ------------------------------------------------------------------ row 1 (held)
def test_an_actuation_writer_that_stops_itself_gets_the_watchdog_and_the_last_word(fleet):
    """A control actuation writer wedges instead of dying: SIGSTOP to itself. The
    watchdog must kill it within its limit and the supervisor must then say SAFE on
    its channel (the last word), and nothing else may fail safe (it is optional)."""
    fleet.trigger("go-stop")
    said = fleet.wait_for(lambda e: e.get("event") == "last_word"
                          and e.get("worker") == "c-stop", 10)
    missed = fleet.of("watchdog_missed", "c-stop")
    assert missed, "the stopped writer was never found silent:\n" + fleet.tail()
    assert missed[0]["silent_ms"] <= WATCHDOG_MS + WATCHDOG_SLACK_MS, missed[0]
    assert said, "no last word for the stopped writer:\n" + fleet.tail()
    assert said[0]["channel"] == "cmd2" and said[0]["engaged"] == 0.0, said[0]
    print(f"c-stop: silent {missed[0]['silent_ms']} ms at the watchdog (limit {WATCHDOG_MS}); "
          f"last word {said[0]['waited_ms']} ms after its death was seen, by {said[0]['by']}")
    # The last word is said the moment the death is seen; the exit is logged once the
    # sandbox is reaped, a few ms later: waited for, not read at once (a fresh-clone run
    # read the log between the two).
    ex = fleet.wait_for(lambda e: e.get("event") == "exit" and e.get("worker") == "c-stop", 10)
    assert ex and ex[0]["cause"] == "watchdog", ex
    assert not fleet.of("fail_safe")


# ------------------------------------------------------------------ row 2 (held)
def test_a_research_worker_killed_by_oom_never_trips_the_fail_safe(fleet):
    """An ordinary research fault (the kernel's OOM kill at its cgroup limit) is an
    exit naming the worker and the limit; control keeps running, nothing fails safe."""
    ex = fleet.wait_for(lambda e: e.get("event") == "exit" and e.get("worker") == "r-oom", 20)
    assert ex, "r-oom never exited:\n" + fleet.tail()
    cause = ex[0].get("cause") or ""
    if "out of memory" not in cause:
        pytest.skip(f"no memory cgroup enforced here (r-oom: {cause or ex[0]})")
    assert "memory_max=" in cause, cause
    assert not fleet.of("fail_safe")
    assert not fleet.of("exit", "c"), "the control writer was affected"
    assert fleet.proc.poll() is None


# ------------------------------------------------------------------ row 12 (closed: a race)
def test_a_denied_exec_request_is_refused_even_if_the_worker_exits_at_once(fleet):
    """c-deny asks for anonymous executable memory before READY (denied: it is not
    declared jit_kernels) and exits 0 at once. The denial must still be a `refused`
    event naming it (every denial is visible), not an ordinary exit: the verdict is
    reported before the exit's cancellation can drop it (_exec._watch_exec)."""
    ex = fleet.wait_for(lambda e: e.get("event") == "exit" and e.get("worker") == "c-deny", 20)
    assert ex, "c-deny never exited:\n" + fleet.tail()
    refused = [e for e in fleet.of("refused", "c-deny") if e.get("kind") == "exec_memory"]
    assert refused, f"an exit without the refusal: {ex[0]}"
    assert "mmap" in refused[0].get("reason", "") or refused[0].get("syscall") == "mmap"


# ------------------------------------------------------------------ row 15 (fixed: 76c7fc7)
PERR_EVENTS_PER_S = 10      # what a worker's protocol errors may cost the log, at most


def test_a_research_worker_cannot_flood_the_supervisors_log_with_protocol_errors(fleet):
    """r-perr writes 9000-byte status lines at ~400/s for 2 s (under the flood limit's
    cost per line). What that costs the supervisor's log must be bounded like its
    output (`output_dropped`, once a second): journald's default limit is 10,000
    messages per 30 s per unit, and past it journald drops the unit's own lines."""
    t0 = time.monotonic_ns()
    fleet.trigger("go-perr")
    # Either it sent them all (its own line says so) or the supervisor refused it as a
    # flood (a fix may charge an over-long line its bytes): both end the attack.
    done = fleet.wait_for(lambda e: e.get("worker") == "r-perr" and (
        e.get("event") == "refused" or (e.get("event") == "output"
                                        and "sent" in e.get("line", ""))), 15)
    time.sleep(0.3)
    perr = [e for e in fleet.of("protocol_error", "r-perr") if e["mono_ns"] >= t0]
    span_s = max((perr[-1]["mono_ns"] - perr[0]["mono_ns"]) / 1e9, 1.0) if perr else 1.0
    print(f"r-perr: {done[0].get('line') or done[0].get('reason') if done else '?'}; "
          f"{len(perr)} protocol_error events "
          f"in {span_s:.1f} s ({len(perr) / span_s:.0f}/s); refused: "
          f"{bool(fleet.of('refused', 'r-perr'))}")
    assert done, "r-perr never flooded:\n" + fleet.tail()
    assert len(perr) <= PERR_EVENTS_PER_S * (span_s + 1), f"{len(perr)} in {span_s:.1f} s"


# ------------------------------------------------------------------ row 3 (fixed: 0142b51)
def test_a_stopped_console_never_stops_the_watchdog(fleet):
    """The operator presses Ctrl-S on the console `supervisor run` writes to (here:
    TCOOFF on a real pseudo-terminal, the kernel's own flow control) while a control
    worker goes silent. The watchdog must still find it within its limit."""
    termios.tcflow(fleet.slave, termios.TCOOFF)
    t_off = time.monotonic()
    try:
        fleet.trigger("go-quiet")
        time.sleep(1.0)
        # Row 6 rides on this stall: an actuation writer killed while the loop is held.
        started = fleet.of("start", "c-victim")
        if started and fleet.proc.poll() is None:
            fleet.victim_killed_ns = time.monotonic_ns()
            os.kill(started[-1]["pid"], signal.SIGKILL)      # its bwrap: the sandbox dies
        time.sleep(STALL_S - 1.0)
    finally:
        termios.tcflow(fleet.slave, termios.TCOON)
    t_on = time.monotonic()
    missed = fleet.wait_for(lambda e: e.get("event") == "watchdog_missed"
                            and e.get("worker") == "c-quiet", 10)
    assert missed, "c-quiet was never found silent:\n" + fleet.tail()
    print(f"console stopped {t_on - t_off:.1f} s; c-quiet silent "
          f"{missed[0]['silent_ms']} ms when the watchdog fired (limit {WATCHDOG_MS} ms)")
    assert missed[0]["silent_ms"] <= WATCHDOG_MS + WATCHDOG_SLACK_MS, missed[0]


# ------------------------------------------------------------------ row 6 (held)
def test_a_writer_killed_while_the_loop_is_held_still_gets_its_last_word_at_once(fleet):
    """During row 3's stall the test kills the sandbox of the actuation writer
    c-victim. The last-word thread, not the loop, says SAFE: it must be published
    within milliseconds of the death, though its event is written only once the
    console runs again."""
    if not fleet.victim_killed_ns:
        pytest.skip("needs row 3's stall (run the module, not this test alone)")
    said = fleet.wait_for(lambda e: e.get("event") == "last_word"
                          and e.get("worker") == "c-victim", 10)
    assert said, "no last word for c-victim:\n" + fleet.tail()
    logged_after_ms = (said[0]["mono_ns"] - fleet.victim_killed_ns) / 1e6
    print(f"c-victim: SAFE {said[0]['waited_ms']} ms after its death was seen (by "
          f"{said[0]['by']}); the event written {logged_after_ms:.0f} ms after the kill")
    assert said[0]["by"] == "thread" and said[0]["waited_ms"] < 200, said[0]
    assert said[0]["engaged"] == 0.0


# ------------------------------------------------------------------ row 5 (fixed: 0142b51)
def test_the_supervisors_own_stall_is_never_charged_to_a_worker_as_a_flood(fleet):
    """c-fast pings every 2 ms (~500 lines/s, half the 1000/s limit) through row 3's
    stall. The pings it wrote while the supervisor could not read are its own honest
    rate: reading them afterwards must never refuse it (a refused required control
    worker fails the car safe, latched). Runs after row 3's stall."""
    refused = [e for e in fleet.of("refused", "c-fast") if e.get("kind") == "protocol_flood"]
    ex = fleet.of("exit", "c-fast")
    print(f"c-fast after the {STALL_S:g} s stall: refused {refused[:1]}, exit {ex[:1]}")
    assert not refused, refused[0]
    assert not ex, ex[0]


# ------------------------------------------------------------------ row 11 (Ctrl-Z fixed: 0142b51)
def test_ctrl_z_on_the_console_never_holds_the_last_word(fleet):
    """The operator presses Ctrl-Z where `supervisor run` runs (SIGTSTP to its job);
    the actuation writer c-tstp (cmd4) dies 0.3 s later. SAFE must still be its last
    word within milliseconds: the last-word thread exists so that nothing the event
    loop does can hold it up."""
    started = fleet.of("start", "c-tstp")
    assert started and fleet.proc.poll() is None, fleet.tail()
    os.kill(fleet.proc.pid, signal.SIGTSTP)
    try:
        time.sleep(0.3)
        with open(f"/proc/{fleet.proc.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        killed_ns = time.monotonic_ns()
        os.kill(started[-1]["pid"], signal.SIGKILL)       # its bwrap: the sandbox dies
        time.sleep(1.5)
    finally:
        os.kill(fleet.proc.pid, signal.SIGCONT)
    said = fleet.wait_for(lambda e: e.get("event") == "last_word"
                          and e.get("worker") == "c-tstp", 10)
    assert said, "no last word for c-tstp:\n" + fleet.tail()
    after_ms = (said[0]["mono_ns"] - killed_ns) / 1e6
    print(f"c-tstp: supervisor state after SIGTSTP {state!r}; SAFE {after_ms:.0f} ms "
          f"after its death (the thread's own waited_ms {said[0]['waited_ms']})")
    assert after_ms < 500, said[0]


# ------------------------------------------------------------------ row 4 (fixed: f287629)
def test_sighup_never_ends_the_supervisor_without_an_ordered_stop(fleet):
    """SIGHUP either changes nothing or stops in order (the actuation writer stopped,
    SAFE said as its last word, supervisor_exit logged), as SIGTERM does. Last in the
    module: it may end the fleet."""
    assert fleet.proc.poll() is None, "the fleet ended before the test:\n" + fleet.tail()
    fleet.proc.send_signal(signal.SIGHUP)
    try:
        code = fleet.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None                                  # ignored: it runs on (allowed)
    if code is None:
        assert fleet.proc.poll() is None
        return
    ev = fleet.events()
    print(f"supervisor run after SIGHUP: returncode {code}; last events:\n"
          + "\n".join(json.dumps(e)[:200] for e in ev[-3:]))
    assert any(e["event"] == "supervisor_exit" for e in ev), \
        f"returncode {code}, no supervisor_exit"
    assert any(e["event"] == "last_word" and e.get("worker") == "c" for e in ev)


# ------------------------------------------------------------------ row 7 (fixed: 723e7f3)
# Its own embedded Supervisor (the test holds a reader of the actuation channel that
# outlives the supervisor's stop, and chooses the moment of the stop signal).
_HANDOVER_TOML = """
[domains.control]
actuates = true
python_path = ["{pp}"]
[channels.cmd]
slot_size = "4KiB"
dtype = "float32"
payload = "control_cmd"
max_age_ms = 50
max_readers = 2
[workers.w]
domain = "control"
module = "rt8w"
publishes = ["cmd"]
args = ["handover"]
warm_standby = true
restart = "always"
watchdog_ms = 1000
ready_timeout_ms = {ready}
[workers.deaf]
domain = "control"
module = "rt8w"
args = ["deaf"]
restart = "never"
optional = true
ready_timeout_ms = {ready}
"""
TEST_READER = 1                # the monitor's spare is index 0 (no subscriber)


def test_a_stop_during_a_standby_hand_over_never_leaves_a_writer_after_the_last_word():
    """The actuation writer w (warm standbys) is killed; SAFE is said; the supervisor
    hands the channels to a standby, and a SIGTERM comes while it waits for the
    standby's tasks to hand over (widened here: the standby's exec watch is busy
    judging, as a standby still loading code is). The ordered stop must end with SAFE
    as the channel's last word: no engaged command after it."""
    import numpy as np
    import trio

    from schemas.payloads import CONTROL_CMD
    from supervisor.config import loads
    from supervisor.events import EventLog
    from supervisor.ipc import LeaseLost, Reader, Rejected
    from supervisor.lifecycle import Supervisor

    tmp = Path(tempfile.mkdtemp(prefix="rt8-", dir="/tmp"))
    tmp.chmod(0o755)
    pp = tmp / "lib"
    (pp / "rt8w").mkdir(parents=True)
    for d in (pp, pp / "rt8w"):
        d.chmod(0o755)
    (pp / "rt8w" / "__init__.py").write_text(_RT8W)
    (pp / "rt8w" / "__init__.py").chmod(0o644)
    cfg = loads(_HANDOVER_TOML.format(pp=pp, ready=READY_TIMEOUT_MS), str(tmp / "h.toml"))
    me = os.getpid()
    logf = open(tmp / "supervisor.log", "w")
    log = EventLog(stream=logf, keep=True)
    sup = Supervisor(cfg, log=log, grace_s=1.5)
    seen: list[tuple[int, int, float]] = []        # (sequence, writer pid, engaged)

    def drain(reader: Reader) -> None:
        while True:
            try:
                m = reader.try_receive()
            except Rejected:
                continue
            if m is None:
                return
            try:
                with m:
                    cmd = CONTROL_CMD.decode(np.array(m.array))
                    seen.append((m.sequence, m.stamp.writer_pid, float(cmd["engaged"])))
            except LeaseLost:
                continue

    def of(event: str, worker: str = "w") -> list[dict]:
        return [e for e in log.events if e["event"] == event and e.get("worker") == worker]

    async def until(pred, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            while not pred():
                await trio.sleep(0.02)
            return True
        return False

    reader_box: list[Reader] = []
    hit: list[int] = []                  # the standby's sandbox pid, when the signal came

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            h = sup.channels["cmd"].reader_handle(TEST_READER)
            reader = await trio.to_thread.run_sync(lambda: Reader(h))
            reader_box.append(reader)

            async def poll() -> None:
                while True:
                    drain(reader)
                    await trio.sleep(0.001)

            n.start_soon(poll)
            if not await until(lambda: len(of("standby_warm")) >= 2, 90):
                pytest.fail("no two warm standbys:\n" + "\n".join(map(str, log.events[-20:])))
            await until(lambda: len(seen) > 5, 10)
            (pp / "go-exec").write_text("go")
            await trio.sleep(0.3)                    # their exec watches are busy now
            # The active w's sandbox dies; the moment the supervisor has sent a standby
            # the channels and waits for it to be handed over, a stop signal comes (an
            # operator's, systemd's; or a fail-safe raised by another worker, the same
            # cancellation). The test only picks the instant: it reads, never changes.
            run = sup.runs["w"]
            known = list(run.standbys)
            os.kill(of("start")[-1]["pid"], signal.SIGKILL)
            with trio.move_on_after(20):
                while not hit:
                    known += [sb for sb in run.standbys if sb not in known]
                    taking = [sb for sb in known if sb.adopted]
                    if taking and run.current is not taking[0].current:
                        os.kill(me, signal.SIGTERM)
                        hit.append(taking[0].pid)
                    elif taking:
                        break                    # handed over before we looked: no race
                    await trio.sleep(0)
            await until(lambda: sup.exit_code is not None and any(
                e["event"] == "supervisor_exit" for e in log.events), 60)
            n.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        logf.close()
    if reader_box:
        drain(reader_box[0])                        # what was published to the end
    ev = log.events
    safe_at = next((i for i, x in enumerate(seen) if x[2] == 0.0), None)
    shutil.rmtree(tmp, ignore_errors=True)
    assert safe_at is not None, f"no SAFE seen; last events: {ev[-10:]}"
    after = seen[safe_at + 1:]
    adopted = of("standby_adopted")
    print(f"hand-over race: {len(seen)} commands read; SAFE at #{safe_at} "
          f"(seq {seen[safe_at][0]}); after it {len(after)} commands, "
          f"{sum(1 for x in after if x[2] != 0.0)} engaged, writer pids "
          f"{sorted({x[1] for x in after})}; standby_adopted {len(adopted)}; "
          f"last {seen[-1]}")
    t0 = next((e["mono_ns"] for e in ev if e["event"] == "restart" and e.get("worker") == "w"), 0)
    print("events from w's restart (ms): " + ", ".join(
        f"{e['event']}:{e.get('worker', '')}@{(e['mono_ns'] - t0) / 1e6:.1f}" for e in ev
        if t0 and e["mono_ns"] >= t0 - 50e6 and e["event"] not in ("output", "status"))[:1500])
    if not hit:
        pytest.skip("the hand-over was over before the test could look (no race this time)")
    assert seen[-1][2] == 0.0, f"the channel's last word is engaged: {seen[-1]}"


# ------------------------------------------------------------------ row 8 (fixed: 60c1cea)
_LATCH_PROBE = """
import json, os, sys
from supervisor.config import check_runtime, load
from supervisor.failsafe import FailSafeLatch
d = sys.argv[1]
cfg = load(sys.argv[2])
problems = [str(p) for p in check_runtime(cfg, sandboxed=False) if "state_dir" in p.key]
latch = FailSafeLatch.for_config(cfg)
try:
    latch.set("control lost (redteam8 row 8)")
    err = None
except OSError as e:
    err = f"{type(e).__name__}: {e}"
print(json.dumps({"problems": problems, "set_error": err, "latched": latch.read(),
                  "left": sorted(os.listdir(d))}))
"""



def _probe_in_a_small_state_dir(probe: str, size: str, fill: str = "") -> dict:
    """`probe` (python source; argv: the state dir, the minimal config) run with
    TRIO_STATE_DIR on a real tmpfs of `size`, after the shell command `fill` (its
    {state} the dir), in a private mount namespace: the host's mounts are never
    touched. Its last stdout line, parsed."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    d = Path(tempfile.mkdtemp(prefix="rt8-full-", dir="/tmp"))
    try:
        state = d / "state"
        state.mkdir(mode=0o700)
        script = (f"mount -t tmpfs -o size={size},mode=0700 rt8full {state} && "
                  + fill.format(state=state)
                  + f"exec {sys.executable} -c \"$PROBE\" {state} "
                  f"{REPO / 'supervisor' / 'configs' / 'minimal.toml'}")
        got = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env=dict(os.environ, PROBE=probe, TRIO_STATE_DIR=str(state)))
        assert got.returncode == 0 and got.stdout.strip(), got.stderr[-2000:]
        return json.loads(got.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(d, ignore_errors=True)

def test_a_full_state_dir_never_loses_the_fail_safe_latch():
    """The state dir's file system is full (the recorder's logs, a journal, anything
    sharing /var/lib): a real tmpfs of one page, filled, in a private mount namespace.
    Either `check`/`run` refuse that state dir up front (it cannot hold the latch), or
    a fail-safe still leaves the car latched."""
    res = _probe_in_a_small_state_dir(_LATCH_PROBE, "4k", "dd if=/dev/zero of={state}/fill "
                                      "bs=4096 count=4 2>/dev/null; ")
    print(f"full state dir: check problems {res['problems']}; latch set: "
          f"{res['set_error'] or 'ok'}; latched after: {res['latched']}; files {res['left']}")
    assert res["problems"] or res["latched"] is not None, res


# ------------------------------------------------------------------ row 13 (fixed: 76c7fc7)
_RESERVED_PROBE = """
import json, os, subprocess, sys
from supervisor.config import check_runtime, load
from supervisor.failsafe import FailSafeLatch
d, cfg = sys.argv[1], load(sys.argv[2])
latch = FailSafeLatch.for_config(cfg)
latch.reserve()                        # what the last vehicle start left in place
subprocess.run(["dd", "if=/dev/zero", f"of={d}/fill", "bs=4096", "count=8"],
               capture_output=True)   # then the disk fills up (the recorder's logs)
problems = [str(p) for p in check_runtime(cfg, sandboxed=False) if "state_dir" in p.key]
try:
    latch.set("control lost (redteam8 row 13)")
    err = None
except OSError as e:
    err = f"{type(e).__name__}: {e}"
print(json.dumps({"problems": problems, "set_error": err, "latched": latch.read(),
                  "left": sorted(os.listdir(d))}))
"""


def test_a_full_disk_with_the_latch_reserved_never_keeps_the_car_from_starting():
    """After row 8's fix a vehicle start reserves the latch's blocks. The file system
    fills later (the recorder's logs). The next start must not be refused for want of
    room the reserve already holds: the latch can still be written."""
    from supervisor import failsafe
    if not hasattr(failsafe.FailSafeLatch, "reserve"):
        pytest.skip("no latch reserve in this tree (row 8's fix)")
    res = _probe_in_a_small_state_dir(_RESERVED_PROBE, "16k")
    print(f"full disk, reserve in place: check problems {res['problems']}; latch set: "
          f"{res['set_error'] or 'ok'}; latched after: {res['latched']}; files {res['left']}")
    assert res["latched"] is not None, res       # the reserve does its job
    assert not res["problems"], res["problems"]  # so the start must not be refused


# ------------------------------------------------------------------ row 11, second part (fixed: SIGTTOU is SIG_IGN)
_TTOU_PROBE = r"""
import os, pty, signal, sys, termios, time
sys.path.insert(0, sys.argv[1])
pid, master = pty.fork()
if pid == 0:                       # a session whose terminal is the pty, `stty tostop`
    a = termios.tcgetattr(1)
    a[3] |= termios.TOSTOP
    termios.tcsetattr(1, termios.TCSANOW, a)
    r, w = os.pipe()
    c = os.fork()
    if c == 0:                     # `supervisor run &`: a background job of it
        os.close(r)
        os.setpgid(0, 0)
        from supervisor import signals
        signals.install()          # the supervisor's own dispositions, from its CLI
        class Late(Exception):
            pass
        def late(*_):
            raise Late()
        signal.signal(signal.SIGALRM, late)     # (SIGALRM is the supervisor's too: ours here)
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        try:
            os.write(1, b"ENGAGED +0.000 rad | ...\n")
            res = "wrote"
        except Late:
            res = "still in write() after 1 s"
        except OSError as e:
            res = f"write failed: {e.strerror}"
        signal.setitimer(signal.ITIMER_REAL, 0)
        os.write(w, res.encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 5
    res = b""
    while time.monotonic() < deadline:
        got, status = os.waitpid(c, os.WUNTRACED | os.WNOHANG)
        if got and os.WIFSTOPPED(status):
            res = f"stopped by {signal.Signals(os.WSTOPSIG(status)).name}".encode()
            os.kill(c, signal.SIGKILL)
            os.waitpid(c, 0)
            break
        if got:
            res = os.read(r, 200)
            break
        time.sleep(0.01)
    else:
        os.kill(c, signal.SIGKILL)
        res = b"no answer in 5 s"
    os.write(2, b"RESULT " + res + b"\n")
    os._exit(0)
out = b""
while True:
    try:
        chunk = os.read(master, 4096)
    except OSError:
        break
    if not chunk:
        break
    out += chunk
os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors="replace"))
"""


def test_a_background_supervisor_writing_to_its_terminal_neither_stops_nor_spins():
    """`supervisor run &` in a terminal with `stty tostop`: its live line is a background
    write. With the dispositions the supervisor installs (supervisor.signals.install,
    as its CLI does at import), that write must go through: not stop the process
    (every thread, the last-word thread too) nor loop in the kernel's SIGTTOU retry."""
    got = subprocess.run([sys.executable, "-c", _TTOU_PROBE, str(REPO)], capture_output=True,
                         text=True, timeout=30, cwd=REPO)
    line = next((x for x in got.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, (got.stdout[-1000:], got.stderr[-1000:])
    print(f"background write to a tostop terminal: {line[7:]}")
    assert line == "RESULT wrote", line


# ------------------------------------------------------------------ row 14 (fixed: 08a763b)
def test_a_full_output_queue_never_drops_the_fail_safe_event():
    """The console is stopped (a real pty, TCOOFF) while events keep coming: output
    lines of a chatty worker, protocol errors of a research worker writing newline-free
    status bytes (up to the flood bucket's depth, ~6000, then 1000/s), status events.
    Then control fails safe. Lines may be dropped, but the `fail_safe` event (error
    level) must reach the console once it runs again: it is what the operator reads."""
    from supervisor import outstream
    from supervisor.events import EventLog

    master, slave = pty.openpty()
    got = bytearray()
    stream = open(slave, "w", buffering=1, closefd=False)
    try:
        termios.tcflow(slave, termios.TCOOFF)
        log = EventLog(stream=stream, keep=False, fmt="json")
        # The writer thread holds the batch it is blocked writing, the queue up to
        # MAX_PENDING more: twice that is sure to overflow the queue.
        n = 2 * getattr(outstream, "MAX_PENDING", 10_000) + 100
        for i in range(n):
            log.emit("output", source="r-chatty", worker="r-chatty", domain="research",
                     line=f"line {i}")
        log.emit("fail_safe", reason="control worker c gave up (redteam8 row 14)")
        termios.tcflow(slave, termios.TCOON)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                got += os.read(master, 65536)
            elif b'"log_dropped"' in got or b'"fail_safe"' in got:
                if not select.select([master], [], [], 0.5)[0]:
                    break
    finally:
        try:
            termios.tcflow(slave, termios.TCOON)
        except OSError:
            pass
        stream.close()
        os.close(slave)
        os.close(master)
    text = got.decode(errors="replace")
    dropped = [ln for ln in text.splitlines() if '"log_dropped"' in ln]
    said = '"fail_safe"' in text
    print(f"{n} lines queued while stopped; console got {text.count(chr(10))} lines; "
          f"log_dropped: {dropped[:1]}; fail_safe there: {said}")
    assert said, "the fail_safe event never reached the console"
