"""Red team, round 2: attacks no earlier issue names, each run from inside a real
sandbox under one real `supervisor run` (workers/probe/attacks_redteam2.py). Every test
asserts the secure behaviour: the attack denied AND the supervisor's log naming the
worker. An attack that succeeds today is an `xfail(strict=True)` whose reason says what
breaks: the suite stays green, the lead sees it, and the day it is fixed the strict
xfail fails and asks for the marker to go.

The supervisor's stdout is a pseudo-terminal of 100 columns here, so that the live
status row (supervisor/monitor.py) is rendered as an operator's terminal shows it.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
import unicodedata
from pathlib import Path

import pytest

# assert_named: the attack's result from the `output` event the supervisor emitted in
# the worker's name (the supervisor's log is the evidence), and it was denied.
from tests._fleet import LoggedRun, attack_result, ended
from tests._fleet import assert_denied as assert_named
from tests._fleet import of as _of

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the supervisor's isolation (host uids, cgroups) needs root", allow_module_level=True)

MODULE = "workers.probe.attacks_redteam2"
COLUMNS = 100
PIN_MEMORY_MAX_MIB = 64
# name -> (domain, attack, extra worker TOML)
ATTACKERS = {
    "r-wide": ("research", "wide_status", ""),        # first: its status leads the row
    "r-nonl": ("research", "status_no_newline", ""),
    "r-bigpipe": ("research", "status_pipe_enlarged", ""),
    "r-smuggle": ("research", "status_tail_smuggle", ""),
    "r-pin": ("research", "socket_pin", f'memory_max = "{PIN_MEMORY_MAX_MIB}MiB"'),
    "c-pin": ("control", "socket_pin", f'memory_max = "{PIN_MEMORY_MAX_MIB}MiB"'),
    "c-knobs": ("control", "proc_knobs", ""),
    "r-knobs": ("research", "proc_knobs", ""),
    "c-fds": ("control", "inherited_fds", ""),
    "r-fds": ("research", "inherited_fds", ""),
    "r-kill": ("research", "signal_out", ""),
    "r-chfd": ("research", "channel_fd_ops", ""),
    "c-chfd": ("control", "channel_fd_ops", ""),
    "c-secrets": ("control", "fs_secrets", ""),
    "r-secrets": ("research", "fs_secrets", ""),
    "c-exflood": ("control", "exec_watch_flood", ""),
    "c-maps": ("control", "many_mappings", ""),              # last: measured alone
}
# r-chfd holds its flock from before control's reader starts; c-exflood must be judged
BEFORE_READY = ("r-chfd", "c-exflood")
READERS = ("r-chfd", "c-chfd")


def _toml() -> str:
    head = textwrap.dedent("""
    [supervisor]
    status_interval_s = 0.5
    maps_scan_interval_s = 0.5
    start_parallel = 3
    [domains.control]
    failure_policy = "restart"
    [domains.research]
    [channels.frames]
    slot_size = "4KiB"
    dtype = "uint8"
    max_readers = 4
    slot_count = 9
    """)
    src = textwrap.dedent("""
    [workers.src]
    domain = "control"
    module = "workers.probe"
    publishes = ["frames"]
    args = ["--publish", "frames", "--period-ms", "20", "--ping-ms", "20"]
    watchdog_ms = 300
    restart = "always"
    """)
    blocks = {}
    for name, (domain, attack, extra) in ATTACKERS.items():
        args = (["--attack", attack] + (["--read", "frames"] if name in READERS else [])
                + (["--attack-before-ready"] if name in BEFORE_READY else []))
        blocks[name] = textwrap.dedent(f"""
        [workers.{name}]
        domain = "{domain}"
        module = "{MODULE}"
        {'subscribes = ["frames"]' if name in READERS else ""}
        args = {json.dumps(args)}
        restart = "never"
        optional = true
        ready_timeout_ms = 60000      # a loaded machine (c-exflood floods until refused)
        pids_max = 32
        cpu_quota = 50
        {extra or 'memory_max = "256MiB"'}
        """)
    # r-wide first of all (before src): its status is the first worker segment of the
    # live row, so that the row's width is mostly its own text.
    return head + blocks.pop("r-wide") + src + "".join(blocks.values())


class Fleet(LoggedRun):
    """One `supervisor run` of every attacker, its stdout a 100-column pty."""

    def __init__(self, tmp: Path) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
        self.tty = bytearray()
        self._master = master
        super().__init__(tmp, "redteam2", _toml(), args=["--log-level", "debug"],
                         stdout=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.cpu: list[tuple[float, float]] = []    # (unix time, supervisor CPU seconds)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        """The supervisor's own CPU (all its threads), every 0.2 s: what a worker
        makes the root process spend is charged to no worker's cgroup."""
        tick = os.sysconf("SC_CLK_TCK")
        while self.proc.poll() is None:
            try:
                with open(f"/proc/{self.proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                self.cpu.append((time.time(), (int(fields[11]) + int(fields[12])) / tick))
            except (OSError, IndexError, ValueError):
                return
            time.sleep(0.2)

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.tty += chunk

    def events(self) -> list[dict]:
        return super().events(strict=False)

    def settle(self, timeout: float = 240) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ev = self.events()
            if set(ATTACKERS) <= ended(ev):
                # r-wide's 3 s of rows and socket_pin's 3 s hold end before their ATTACK
                # line (or their exit): 2 s more after the later of those, which is long
                # past when another attacker ended last (c-maps holds 6 s, after them).
                ends = [e["ts"] for e in ev if e.get("worker") in ("r-wide", "r-pin", "c-pin")
                        and "ts" in e and (e["event"] in ("exit", "refused", "gave_up") or (
                            e["event"] == "output" and e["line"].startswith("ATTACK ")))]
                time.sleep(max(0.0, 2.0 - (time.time() - max(ends, default=0.0))))
                return self.events()
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        return self.events()

    def stop(self) -> list[dict]:
        self.terminate(60)
        self._reader.join(timeout=5)
        os.close(self._master)
        return self.events()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("redteam2"))
    try:
        f.settle()
        ev = f.stop()
        yield {"events": ev, "tty": bytes(f.tty), "cpu": list(f.cpu)}
    finally:
        f.kill()


def _display_width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)




# ---------------------------------------------------------------- what breaks


def test_status_bytes_without_newline_cannot_flood_the_log(fleet):
    """2 s of status bytes with no newline (68 MiB at pipe speed): each read of an
    over-long line counts as a status line, so the worker is refused for flooding as
    one sending lines is (protocol_flood), with one protocol_error, not one per read
    (before: 1,192-8,376 warning events in 2 s, no refusal). The refusal needs the reads
    to outpace the bucket: on a heavily loaded machine the supervisor reads the same
    bytes in fewer, fuller reads (a fresh-clone run beside other work: 1 protocol_error,
    no refusal) and there is nothing to refuse; the log is bounded either way."""
    ev = fleet["events"]
    errors = _of(ev, "r-nonl", "protocol_error")
    refused = [e for e in _of(ev, "r-nonl", "refused") if "flood" in e.get("kind", "")]
    assert errors or refused, _of(ev, "r-nonl")       # it was seen at all
    missed = [e for e in ev if e["event"] in ("watchdog_missed", "restart")]
    print(f"\nr-nonl: {len(errors)} protocol_error events; watchdog misses/restarts of any "
          f"worker during the run: {len(missed)}")
    assert len(errors) <= 20, f"{len(errors)} protocol_error events from one worker in 2 s"
    assert refused or len(errors) == 1, _of(ev, "r-nonl")


def test_an_enlarged_status_pipe_buys_no_deeper_burst(fleet):
    """A worker that enlarges its status pipe to 1 MiB and writes 20,000 pings at once
    is refused as a flood: the bucket's depth is a default pipe's worth (~5,958 lines),
    not its own pipe's (review of red team 8 row 5's fix). Written from a real sandbox."""
    ev = fleet["events"]
    refused = [e for e in _of(ev, "r-bigpipe", "refused") if e.get("kind") == "protocol_flood"]
    assert refused, _of(ev, "r-bigpipe")[-5:]


def test_the_live_row_is_never_wider_than_the_terminal_in_columns(fleet):
    """Was a hole (fixed in b7c92e7, monitor.py fits in wcwidth columns): the row was
    fitted with len(), and fullwidth STATUS text made it ~1.5x the terminal.
    A research worker's STATUS of printable fullwidth letters (East Asian width F,
    two columns each) on a 100-column pseudo-terminal: every rendered row must fit in
    100 columns, or the '\r ESC[2K' rewrite leaves a wrapped row behind each time."""
    rows = fleet["tty"].decode("utf-8", "replace").split("\r\x1b[2K")
    wide = [r for r in rows if "\uff37" in r]      # rows that show some of its text
    assert wide, rows[-3:]
    widths = [_display_width(r.rstrip("\r\n")) for r in wide]
    print(f"\nr-wide: rows of {min(widths)}..{max(widths)} columns ({max(len(r) for r in wide)} "
          f"characters) on a {COLUMNS}-column terminal")
    assert max(widths) <= COLUMNS, f"rows of {max(widths)} columns on a {COLUMNS}-column terminal"


def test_a_research_readers_lock_on_a_channel_binds_nothing_of_controls(fleet):
    """flock()/lockf() on a reader's read-only channel fd act on the shared inode: a
    research reader can hold LOCK_EX and a control reader asking for one would see it
    (the architecture once said 'no locks shared across domains': it now says what
    holds). Such locks bind only processes that ask for them, so the claim is that
    nothing on control's path ever asks: no lock call in the bridge, Python or C."""
    ev = fleet["events"]
    r = assert_named(ev, "r-chfd")
    c = assert_named(ev, "c-chfd")           # and control's reader started and ran
    # The lock is one on the shared inode: whichever reader asked first holds it (the
    # fleet starts 3 at a time, so under load control's may ask first); the other's
    # non-blocking ask is refused (EAGAIN). What matters is below: the bridge never asks.
    assert sorted([r["flock_ex"], c["flock_ex"]]) == ["EAGAIN", "ok"], (r, c)
    ipc = Path(__file__).resolve().parent.parent / "supervisor" / "ipc"
    calls = re.compile(r"\b(flock|lockf|F_SETLKW?|F_OFD_SETLKW?|LOCK_EX|LOCK_SH)\b")
    found = [f"{p.name}:{n}" for p in sorted(ipc.rglob("*")) if p.suffix in (".py", ".c", ".h")
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if calls.search(line.split("#")[0].split("//")[0])]
    assert not found, f"the bridge takes locks a research reader can hold: {found}"


def test_a_workers_exec_requests_cannot_buy_unbounded_supervisor_time(fleet):
    """Allowed R|X mappings of libc before READY from one control worker, in a loop.
    Each stops the worker and is judged by the supervisor (root, in no worker's cgroup):
    one start-up's judging is bounded (execwatch's buckets: 768 requests, 1.5 s of CPU)
    and the worker is refused for flooding, named, as status lines (protocol_flood)
    are. Before: 1,709 requests in 4 s bought 1,961 ms of supervisor judging."""
    from supervisor.sandbox.execwatch import JUDGEMENTS_REFILL, MAX_JUDGEMENTS

    ev = fleet["events"]
    refused = [(e, m) for e in _of(ev, "c-exflood", "refused")
               if (m := re.search(r"exec request flood: (\d+) requests", e.get("reason", "")))]
    assert refused, _of(ev, "c-exflood")
    print(f"\nc-exflood refused: {refused[0][0]['reason']}")
    assert not _of(ev, "c-exflood", "ready")
    judged = int(refused[0][1].group(1))
    assert judged <= MAX_JUDGEMENTS + 20 * JUDGEMENTS_REFILL, refused[0][0]["reason"]


def _cpu_share(cpu: list[tuple[float, float]], t0: float, t1: float) -> float:
    """The supervisor's CPU per second of wall time between unix times t0 and t1."""
    inside = [(t, c) for t, c in cpu if t0 <= t <= t1]
    if len(inside) < 2:
        return float("nan")
    (ta, ca), (tb, cb) = inside[0], inside[-1]
    return (cb - ca) / (tb - ta)


def test_many_mappings_do_not_multiply_the_supervisors_scan_cost(fleet):
    """60,000 mappings held 6 s by one READY control worker, scanned every 0.5 s: the
    supervisor's CPU while they are held, against the 3 s before."""
    ev = fleet["events"]
    held = [e for e in _of(ev, "c-maps", "output") if e["line"].startswith("ATTACK-STEP ")]
    res = attack_result(ev, "c-maps")
    assert held and res is not None, _of(ev, "c-maps")
    t0, t1 = held[0]["ts"], [e for e in _of(ev, "c-maps", "output")
                             if e["line"].startswith("ATTACK ")][0]["ts"]
    during, before = _cpu_share(fleet["cpu"], t0, t1), _cpu_share(fleet["cpu"], t0 - 3, t0)
    refused = _of(ev, "c-maps", "refused")
    print(f"\nc-maps: {res['vmas']} mappings; supervisor CPU {during:.2f}/s held, "
          f"{before:.2f}/s before; refused: {refused}")
    assert refused or during <= before + 0.25, (during, before)


def test_the_tail_of_an_overlong_status_line_is_not_a_line(fleet):
    """ctx.status() of 8185 bytes of text ending in 'REFUSED=forged ...': the line is
    over the limit and must be dropped whole (protocol_error), not cut at the 8 KiB the
    supervisor had read, its tail parsed as a refusal that kills the worker for good."""
    ev = fleet["events"]
    forged = [e for e in _of(ev, "r-smuggle", "refused") if "forged" in e.get("kind", "")]
    print(f"\nr-smuggle: {_of(ev, 'r-smuggle', 'protocol_error')[:1]} {forged}")
    assert _of(ev, "r-smuggle", "protocol_error"), _of(ev, "r-smuggle")   # seen, named
    assert not forged, forged[0]
    assert_named(ev, "r-smuggle")


# ---------------------------------------------------------------- what holds


@pytest.mark.parametrize("worker", ["r-pin", "c-pin"])
def test_socket_buffers_are_charged_to_the_workers_memory_limit(fleet, worker):
    """256 MiB queued in AF_UNIX socket pairs by a worker with memory_max = 64 MiB:
    kernel memory, but charged to its cgroup (v1 kmem here), so the OOM killer ends it
    at its own limit and the supervisor names the cause."""
    ev = fleet["events"]
    res = attack_result(ev, worker)
    ex = _of(ev, worker, "exit")
    if res is not None:           # it lived: then it must not have pinned its goal
        assert res["denied"] is True, res
        assert res["pinned_mib"] <= 2 * PIN_MEMORY_MAX_MIB, res
    else:
        assert ex and ex[0]["signal"] == "SIGKILL" and "memory" in ex[0]["cause"], _of(ev, worker)


@pytest.mark.parametrize("worker", ["c-knobs", "r-knobs"])
def test_proc_self_knobs_and_the_clock_are_read_only(fleet, worker):
    """oom_score_adj, timerslack_ns, clear_refs, coredump_filter, LSM attrs, id maps,
    setgroups: all EROFS (proc is mounted read-only); clock_settime: EPERM. Denied
    without an event of its own (the kernel answers an error, nothing dies)."""
    res = assert_named(fleet["events"], worker)
    assert res["opened"] == [] and res["clock_settime"] == "EPERM", res


@pytest.mark.parametrize("worker", ["c-fds", "r-fds"])
def test_a_sandbox_inherits_no_supervisor_fd(fleet, worker):
    """Every fd a worker has: /dev/null, its output and status pipes, and what its own
    start-up opened (Landlock's O_PATH rule fds, pycapnp's schema files). No socket,
    no cgroup, namespace, log or state file of the supervisor's."""
    res = attack_result(fleet["events"], worker)
    assert res is not None, _of(fleet["events"], worker)
    bad = {fd: what for fd, what in res["fds"].items()
           if what.startswith(("socket:", "anon_inode:", "mnt:", "net:", "user:", "pid:"))
           or "cgroup" in what or what.endswith((".log", ".latch", ".toml"))}
    assert not bad, res["fds"]
    pipes = [w for w in res["fds"].values() if w.startswith("pipe:")]
    assert len(set(pipes)) == 2, res["fds"]     # output (1 and 2) and status


def test_signals_reach_no_process_outside_the_sandbox(fleet):
    """kill(-1) and kill(pid, 0) for pids 1..4095 from research: only the sandbox's
    own two processes exist (bwrap's init and the worker)."""
    res = assert_named(fleet["events"], "r-kill")
    assert res["host_pids_answering"] == [] and res["visible_pids"] == [1, 2], res


@pytest.mark.parametrize("worker", ["r-chfd", "c-chfd"])
def test_a_reader_cannot_seal_truncate_punch_or_remap_its_channel(fleet, worker):
    """F_ADD_SEALS (EPERM), ftruncate (EINVAL), fallocate punch-hole (EBADF),
    F_SETLEASE (EACCES), MADV_REMOVE and mprotect(RW) of the shared mapping (EACCES)."""
    res = assert_named(fleet["events"], worker)
    assert res["harmful"] == [], res


@pytest.mark.parametrize("worker", ["c-secrets", "r-secrets"])
def test_no_host_secret_or_supervisor_state_is_readable(fleet, worker):
    """/etc/shadow, /home, the state dir (latch), the staging tree, cgroups, kernel
    memory, /var/log: absent from the sandbox. /root shows only the interpreter's
    directory the staging namespace binds (/root/.pyenv here); /proc/kallsyms is there
    but every address reads 0 to the domain's uid."""
    res = attack_result(fleet["events"], worker)
    assert res is not None, _of(fleet["events"], worker)
    readable = [p for p in res["readable"] if not (p == "/root" and res[p] == [".pyenv"])]
    assert readable == [], res


# ---------------------------------------------------------------- hostile drive logs


def _hostile_logs(d: Path) -> dict[str, Path]:
    """Drive logs whose every record is well framed (magic, length, CRC) and a valid
    Cap'n Proto `Entry`, but whose contents lie: a log is hostile input (it comes from
    a developer's laptop, a fleet, a recorder of a compromised car)."""
    from supervisor.replay.logfmt import MESSAGES, Entry, frame_record

    def start(info: str = "{}"):
        e = Entry.new_message(monoNs=1)
        s = e.init("start")
        s.version, s.writer, s.channels, s.info = 1, "recorder", ["x"], info
        return e

    def msg(dtype: str = "float32", shape=(1,), data: bytes = b"\0" * 4):
        e = Entry.new_message(monoNs=2)
        m = e.init("message")
        m.channel, m.dtype, m.shape, m.data = "x", dtype, list(shape), data
        return e

    def named(channel: str):
        e = Entry.new_message(monoNs=2)
        m = e.init("message")
        m.channel, m.dtype, m.shape, m.data = channel, "float32", [1], b"\0" * 4
        return e

    def stop(text: str = "{}"):
        e = Entry.new_message(monoNs=3)
        e.stop = text
        return e

    cases = {
        "info-not-json": [start("not json"), stop()],
        "info-a-list": [start("[1, 2]"), stop()],
        "dtype-object": [start(), msg(dtype="O", data=b"\0" * 8), stop()],
        "dtype-unknown": [start(), msg(dtype="nonsense"), stop()],
        "shape-lies": [start(), msg(shape=(1000, 1000)), stop()],
        "stop-not-json": [start(), stop("{{{")],
        # a channel name that retitles the terminal and clears the screen
        "escape-name": [start(), named(ESCAPE_NAME), stop()],
    }
    out = {}
    for name, entries in cases.items():
        p = d / name
        p.mkdir()
        (p / MESSAGES).write_bytes(b"".join(frame_record(e.to_bytes()) for e in entries))
        out[name] = p
    return out


ESCAPE_NAME = "x\x1b]0;PWNED\x07\x1b[2J\x1b[31mred"
HOSTILE_LOGS = ("info-not-json", "info-a-list", "dtype-object", "dtype-unknown",
                "shape-lies", "stop-not-json")


@pytest.mark.parametrize("case", HOSTILE_LOGS)
def test_supervisor_log_info_answers_a_hostile_log_in_one_line(tmp_path, case, capsys):
    """In-process (the CLI's own main): an exception escaping it is the traceback a
    developer would see. A record whose contents lie is a corrupt record: counted as
    loss and skipped (the rest of the log is still read), or, when it was the start
    record, the log is refused in one line (exit 2). Before: a traceback each time."""
    from supervisor.cli import main

    log = _hostile_logs(tmp_path)[case]
    try:
        rc = main(["log", "info", str(log)])
    except Exception as e:          # what `supervisor log info` prints as a traceback
        pytest.fail(f"traceback: {type(e).__name__}: {e}")
    out, err = capsys.readouterr()
    if rc == 2:
        assert len(err.strip().splitlines()) == 1 and "no start entry" in err, err
        assert case.startswith("info-"), (case, err)     # only a lying start refuses it
    else:
        assert rc == 0 and "corrupt" in out, (rc, out, err)


def test_supervisor_replay_refuses_a_hostile_log_as_input_not_as_a_bug(tmp_path):
    log = _hostile_logs(tmp_path)["dtype-object"]
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "replay", str(log),
                        "--ref", "self"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr[-600:]
    assert r.returncode != 1 and "internal error" not in r.stderr, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) >= 1


def test_supervisor_log_info_writes_no_terminal_control_from_a_log(tmp_path, capsys):
    """Channel names are text the log chose; the supervisor shows a worker's words
    through protocol.printable for the same reason (they reach a terminal)."""
    from supervisor.cli import main

    log = _hostile_logs(tmp_path)["escape-name"]
    rc = main(["log", "info", str(log)])
    out = capsys.readouterr().out
    assert rc == 0 and "messages" in out, out
    controls = sorted({repr(c) for c in out if not c.isprintable() and c != "\n"})
    assert not controls, f"control characters reach the terminal: {controls}"
