"""Review round 5 (a hostile read of this session's safety-core changes): each finding
proven on the real part, as a strict xfail the fix turned green (all 7 fixed; marks gone).

1. outstream: the writer thread writes through the stream object and so holds its
   BufferedWriter lock while blocked in write(); at exit the interpreter's own flush of
   sys.stdout/sys.stderr waits on that lock for ever, so DRAIN_AT_EXIT_S bounds nothing
   (the unit's environment has no PYTHONUNBUFFERED: stderr is buffered there).
2. failsafe.latch_text cuts the *encoded* JSON at LATCH_BYTES: a reason with non-ASCII
   (escaped to 6 bytes a character) becomes invalid JSON, and the latch's reason is lost.
3. Through a long-lived broker (`run --broker`) the latch's reserve is made once, when
   the broker opens the state dir: BrokerLatch.reserve() does nothing, so after a latch
   took the reserve (a full disk) and the operator cleared it, the next run starts with
   no reserve, where the direct path makes one again or refuses to start (exit 2).
4. FailSafeLatch.read (the direct path) opens the latch's name as it finds it: a FIFO
   planted there hangs `run`'s start for ever (the broker's read_latch does not).
5. A read-only state dir holding an earlier run's reserve passes check's probe and run's
   reserve(); the fail-safe then latches nothing.
6. outstream's urgent places are shared by warnings and errors: warnings a research
   worker causes use them up while the console is stopped, and fail_safe is dropped.
7. With no room and no reserve, write_latch renames an empty file over an existing
   latch: its reason is lost.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from supervisor.failsafe import LATCH_BYTES, RESERVE_NAME, FailSafeLatch, latch_text

ROOT = Path(__file__).resolve().parents[1]

_BLOCKED_EXIT = textwrap.dedent("""
    from supervisor.events import EventLog
    log = EventLog(keep=False)              # sys.stderr, as `supervisor run` makes it
    for i in range(3000):                   # ~700 KB: far past the pipe's 64 KiB
        log.emit("worker_output", worker="camerad", line="x" * 200)
    log.emit("supervisor_exit", code=0, reason="shutdown")
    print("emitted", flush=True)            # (stdout: the test's clock starts here)
""")


def test_a_blocked_log_stream_does_not_hold_exit(tmp_path):
    """stderr a pipe nobody reads (journald stalled, `run 2>&1 | less` not scrolled): the
    process must be gone within the drain bound and a margin, not when the reader
    returns. Fix: outstream.StreamWriter._run writes the encoded text with os.write on
    the stream's fd (the stream flushed once when the writer is made), never through the
    TextIOWrapper, so no io lock is held while blocked."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_EXIT], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert proc.stdout.readline() == b"emitted\n"
        t0 = time.monotonic()
        try:
            proc.wait(timeout=4.5)           # the atexit drain is 2 s
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - t0
        assert proc.returncode is not None, f"still running {took:.1f} s after its last line"
    finally:
        proc.kill()
        proc.stderr.close()
        proc.stdout.close()
        proc.wait()


def test_a_long_non_ascii_reason_keeps_a_readable_latch(tmp_path):
    """The reason is cut to fit, the JSON never. Fix: failsafe.latch_text shortens the
    reason until json.dumps(body) fits LATCH_BYTES (the [:LATCH_BYTES] on the bytes goes)."""
    reason = "camerad: Kamera ausgefallen: " + "é" * 2048
    text = latch_text(reason)
    assert len(text) <= LATCH_BYTES
    got = json.loads(text)["reason"]
    assert got.endswith("...") and reason.startswith(got[:-3]), got   # said to be cut
    latch = FailSafeLatch(tmp_path / "failsafe.latch")
    latch.set(reason)
    assert latch.read()["reason"].startswith("camerad: Kamera ausgefallen: é"), latch.read()


@pytest.mark.skipif(os.geteuid() != 0, reason="the broker runs as root")
def test_a_run_through_a_long_lived_broker_has_a_latch_reserve(tmp_path):
    """The reserve was taken by a latch on a full disk (failsafe._into_reserve renames it
    to be the latch) and the operator cleared the latch; the broker (its own unit) stays
    up. The next run's reserve() must make the reserve again, or fail (OSError: exit 2
    as on the direct path). Fix: a ReserveLatch request the broker answers with
    reserve_latch(self.state.fd) (Refused -> OSError), sent by BrokerLatch.reserve."""
    from supervisor.broker import BrokerClient
    from supervisor.lifecycle._privsep import BrokerLatch

    state = tmp_path / "state"
    err = open(tmp_path / "broker.err", "w")
    client = BrokerClient.spawn(state_dir=state, stderr=err)
    try:
        client.ping()
        reserve = state / RESERVE_NAME
        assert reserve.is_file()                       # made when the broker opened it
        os.rename(reserve, state / "failsafe.latch")  # a full disk's latch took it
        (state / "failsafe.latch").unlink()            # the operator: clear-fail-safe
        latch = BrokerLatch(client, state / "failsafe.latch")
        assert latch.read() is None
        latch.reserve()                                # the next run's start
        assert reserve.is_file() and reserve.stat().st_size == LATCH_BYTES
    finally:
        client.close()
        err.close()


def test_a_fifo_at_the_latchs_name_is_a_latch_not_a_hang(tmp_path):
    """Someone who can write the state dir plants a FIFO as failsafe.latch: `run`'s
    _latched() (and clear-fail-safe) must not hang in open(). The broker's
    StateDir.read_latch already opens O_NOFOLLOW|O_NONBLOCK, checks S_ISREG and reads at
    most 4096 bytes (a symlink to /dev/zero is read without bound by the direct path too).
    Fix: one reader of the latch's bytes in failsafe.py, used by FailSafeLatch.read and
    StateDir.read_latch alike."""
    import threading

    path = tmp_path / "failsafe.latch"
    os.mkfifo(path)
    got: list = []
    t = threading.Thread(target=lambda: got.append(FailSafeLatch(path).read()), daemon=True)
    t.start()
    t.join(2.0)
    hung = t.is_alive()
    if hung:                          # let the blocked open() go: a writer comes and goes
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(2.0)
    assert not hung, "FailSafeLatch.read() still in open() after 2 s"
    assert got and got[0] is not None          # a latch all the same, said so


_READ_ONLY = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    from supervisor.failsafe import FailSafeLatch
    from supervisor.config._runtime import _state_dir_problem
    d = Path(sys.argv[1])
    latch = FailSafeLatch(d / "failsafe.latch")
    latch.reserve()                                      # an earlier run's reserve
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
    out = {"probe": _state_dir_problem(str(d))}
    try:
        latch.reserve()
        out["reserve"] = None
    except OSError as e:
        out["reserve"] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root and unshare (a private tmpfs)")
def test_a_read_only_state_dir_with_a_reserve_is_a_config_problem(tmp_path):
    """ext4 remounts read-only after an I/O error (errors=remount-ro): the reserve an
    earlier run made is still a whole regular file, so has_reserve() answers check's
    probe (76c7fc7) and reserve_latch() returns at once (60c1cea); a fail-safe then
    latches nothing (EROFS on the tmp file and on the reserve: read() is None). Before,
    check's mkstemp said EROFS. Fix: failsafe._whole_reserve (hence has_reserve and
    reserve_latch) also requires a writable file system (os.statvfs(...).f_flag &
    os.ST_RDONLY == 0, or the reserve opened O_WRONLY), else OSError EROFS."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    script = (f"mount -t tmpfs -o size=256k,mode=0700 st {state} && "
              f"exec {sys.executable} -c \"$PROBE\" {state}")
    got = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(os.environ, PROBE=_READ_ONLY, PYTHONPATH=str(ROOT)))
    assert got.returncode == 0, got.stderr[-2000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    assert res["probe"] is not None and res["reserve"] is not None, res


def test_warnings_of_a_worker_cannot_use_up_the_fail_safe_events_place():
    """Round 8 row 14's set-up (a stopped pty, a chatty worker's output past the queue),
    plus the warnings a hostile research worker can cause while the console stays
    stopped: protocol_error and output_dropped (each at most 1/s per worker since
    76c7fc7), restart/exit of a crash loop. At ~6/s from a few workers the 2,000 urgent
    places are gone in ~6 minutes, and the one ERROR line that matters is dropped.
    Fix: outstream.StreamWriter.put: an ERROR line (level <= Level.ERROR, the fail-safe,
    gave_up, latch errors: rare by nature) is never dropped for room: it takes the place
    of the oldest queued line that is not an error (or has places warnings cannot use)."""
    import pty
    import select
    import termios

    from supervisor import outstream
    from supervisor.events import EventLog

    master, slave = pty.openpty()
    got = bytearray()
    stream = open(slave, "w", buffering=1, closefd=False)
    try:
        termios.tcflow(slave, termios.TCOOFF)
        log = EventLog(stream=stream, keep=False, fmt="json")
        for i in range(2 * outstream.MAX_PENDING + 100):
            log.emit("output", source="r-chatty", worker="r-chatty", domain="research",
                     line=f"line {i}")
        for i in range(outstream.MAX_URGENT + 10):
            log.emit("protocol_error", worker="r-chatty", reason="status line over 4096 bytes")
        log.emit("fail_safe", reason="control worker c gave up (review5 finding 6)")
        termios.tcflow(slave, termios.TCOON)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                got += os.read(master, 65536)
            elif b'"log_dropped"' in got and not select.select([master], [], [], 0.5)[0]:
                break
    finally:
        try:
            termios.tcflow(slave, termios.TCOON)
        except OSError:
            pass
        stream.close()
        os.close(slave)
        os.close(master)
    assert b'"fail_safe"' in got, "the fail_safe event never reached the console"


_SECOND_LATCH = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from supervisor.failsafe import FailSafeLatch
    d = Path(sys.argv[1])
    latch = FailSafeLatch(d / "failsafe.latch")
    latch.reserve()
    try:
        with open(d / "fill", "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError:
        pass
    latch.set("first: controlsd watchdog")          # the reserve takes it
    try:
        latch.set("second: through the broker")       # no reserve, no room
    except OSError:
        pass
    print(json.dumps(latch.read()))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root and unshare (a private tmpfs)")
def test_a_second_latch_on_a_full_disk_keeps_the_first_ones_reason(tmp_path):
    """The reserve went into the first latch; a second set (the broker's SetLatch may be
    sent again by the supervisor proper) finds no room: the empty fallback must not
    replace a latch that exists. Fix: failsafe.write_latch's fallback renames the empty
    file only where no latch exists (else unlinks it and raises, the latch kept)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    script = (f"mount -t tmpfs -o size=64k,mode=0700 st {state} && "
              f"exec {sys.executable} -c \"$PROBE\" {state}")
    got = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(os.environ, PROBE=_SECOND_LATCH, PYTHONPATH=str(ROOT)))
    assert got.returncode == 0, got.stderr[-2000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    assert res.get("reason") == "first: controlsd watchdog", res
