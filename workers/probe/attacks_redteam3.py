"""Red team, round 3: attacks no issue named, run from inside a real sandbox.

A worker module of its own (``module = "workers.probe.attacks_redteam3"``, args
``--attack NAME [--pub CH]``). Every attack that needs the test to watch it publishes
on a channel of its own and waits until the test's reader (reader index 1 of that
channel) has attached and, where it matters, taken a message: the writer sees each
reader's lease table read-only (its magic and the sequence it took, layout OFF_TAKEN),
so the test, not a guessed delay, says when the attack starts. Each attack prints one
line ``ATTACK {json}`` (``denied``: true/false/None, None when the verdict is the
supervisor's log) and, where it has a window the test measures, ``ATTACK-STEP`` lines.
tests/test_redteam_round3.py runs them under one real, embedded `Supervisor`.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from typing import Callable

import numpy as np

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import layout as L
from supervisor.ipc.writer import Writer
from supervisor.worker import WorkerContext

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine, 60)
TEST_READER = 1          # the test's reader index on every attacker's channel
MONITOR_READER = 0       # the supervisor's monitor (the spare index of a reader-less channel)
# Just below the supervisor's bound for a plausible sequence (ipc.writer PLAUSIBLE, 2**62)
BRICK_SEQ = (1 << 62) - 1


def _step(**fields: object) -> None:
    print("ATTACK-STEP " + json.dumps(fields), flush=True)


def _reader_state(w: Writer, index: int) -> tuple[bool, int]:
    """(attached, sequence taken) of reader ``index``, from its lease table (mapped
    read-only by every writer: the reader's own memory)."""
    mm = w._leases[index]
    magic = L.LEASE_HDR.unpack_from(mm, 0)[0]
    return magic == L.LEASE_MAGIC, L.U64.unpack_from(mm, L.OFF_TAKEN)[0]


def _await_reader(ctx: WorkerContext, w: Writer, index: int, *, took: bool,
                  publish: Callable[[], None] | None = None, timeout: float = 120.0) -> bool:
    """Ping and (optionally) publish every 20 ms until reader ``index`` is attached
    (and has taken a message, with ``took``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ctx.watchdog()
        if publish is not None:
            publish()
        attached, taken = _reader_state(w, index)
        if attached and (taken or not took):
            return True
        time.sleep(0.02)
    return False


def _engaged(w: Writer, steer: float = 0.25) -> Callable[[], None]:
    def publish() -> None:
        w.publish_array(CONTROL_CMD.encode(steer_rad=steer, engaged=1.0, reason=0.0,
                                           model_age_ms=5.0))
    return publish


# ---------------------------------------------------------------- the last word


def _poison_and_die(ctx: WorkerContext, w: Writer, poison: Callable[[Writer], dict]) -> dict:
    """An actuation writer (control_cmd, engaged) whose reader has taken its commands
    leaves the segment poisoned and dies: the supervisor's SAFE must still be the
    last word every reader sees, and the next writer must be able to go on."""
    pub = _engaged(w)
    if not _await_reader(ctx, w, TEST_READER, took=True, publish=pub):
        return {"denied": None, "error": "the test's reader never took a command"}
    for _ in range(5):                       # a few more the reader takes too
        pub()
        ctx.watchdog()
        time.sleep(0.02)
    time.sleep(0.3)                          # let the reader take them
    before = _reader_state(w, TEST_READER)[1]
    try:
        res = poison(w)
    except OSError as e:                     # refused (a fixed product): die all the same
        res = {"poison": "refused", "error": f"{type(e).__name__}: {e}"}
    res.update(reader_took=before, writer_last_seq=w.last_sequence)
    print("ATTACK " + json.dumps({"attack": "poisoned", "denied": None, **res}), flush=True)
    sys.stdout.flush()
    os._exit(1)                              # no close, no clean-up: a crash


def lastword_rollback(ctx: WorkerContext, w: Writer | None) -> dict:
    """The channel header's last_seq word rolled back to 0: the supervisor's Writer
    continues the sequence from that word, so its SAFE is sequence 1, below what every
    reader has taken; in-order readers never deliver it."""
    def poison(w: Writer) -> dict:
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 0)
        return {"poison": "last_seq=0"}
    return _poison_and_die(ctx, w, poison)


def lastword_unmagic(ctx: WorkerContext, w: Writer | None) -> dict:
    """The channel magic zeroed: the supervisor's Writer takes the segment for a fresh
    one (no plausibility check at all), starts at sequence 1 and generation 0."""
    def poison(w: Writer) -> dict:
        L.U64.pack_into(w._buf, 0, 0)
        return {"poison": "magic=0"}
    return _poison_and_die(ctx, w, poison)


def lastword_brick(ctx: WorkerContext, w: Writer | None) -> dict:
    """last_seq set just below the plausibility bound (2**62 - 1): the supervisor
    accepts it and publishes SAFE at 2**62; every later writer's attach then finds
    'sequence beyond any a writer reaches' and refuses: the actuation channel can never
    be written again by a restarted (clean) controlsd."""
    if _reader_state(w, TEST_READER)[1]:
        # A restarted run (the test's reader took from the first one) that could
        # attach after the poison. Publish a little: the test's reader sees it.
        for _ in range(25):
            _engaged(w, 0.125)()
            ctx.watchdog()
            time.sleep(0.02)
        return {"denied": True, "run": "restarted", "attach": "ok",
                "last_seq": w.last_sequence}

    def poison(w: Writer) -> dict:
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, BRICK_SEQ)
        return {"poison": f"last_seq={BRICK_SEQ:#x}"}
    return _poison_and_die(ctx, w, poison)


def plain_brick(ctx: WorkerContext, w: Writer) -> dict:
    """On a channel the supervisor never writes (not actuation: model_out's kind), the
    dead writer leaves last_seq at 2**62, past the plausibility bound: every restarted
    writer's attach refuses the channel ('the supervisor must re-create or repair the
    channel'), and nothing does."""
    if _reader_state(w, TEST_READER)[1]:              # a restarted run that attached
        for _ in range(25):
            _engaged(w, 0.125)()
            ctx.watchdog()
            time.sleep(0.02)
        return {"denied": True, "run": "restarted", "attach": "ok"}

    def poison(w: Writer) -> dict:
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 1 << 62)
        return {"poison": f"last_seq={1 << 62:#x}"}
    return _poison_and_die(ctx, w, poison)


def lastword_seal(ctx: WorkerContext, w: Writer) -> dict:
    """The writer holds its segment's fd read-write, and the supervisor made it with
    MFD_ALLOW_SEALING (a writer may seal its own future writes): F_SEAL_FUTURE_WRITE |
    F_SEAL_SEAL, then death. No new writable mapping of the segment can ever be made,
    root's included: not the supervisor's for SAFE, not the next writer's."""
    import fcntl

    def poison(w: Writer) -> dict:
        seals = 0x0010 | 0x0001                       # F_SEAL_FUTURE_WRITE | F_SEAL_SEAL
        fcntl.fcntl(w._handle.data_fd, fcntl.F_ADD_SEALS, seals)
        return {"poison": "F_SEAL_FUTURE_WRITE|F_SEAL_SEAL",
                "seals": fcntl.fcntl(w._handle.data_fd, fcntl.F_GET_SEALS)}
    if _reader_state(w, TEST_READER)[1]:              # a restarted run that attached
        return {"denied": True, "run": "restarted", "attach": "ok"}
    return _poison_and_die(ctx, w, poison)


def lastword_skipped_seq(ctx: WorkerContext, w: Writer) -> dict:
    """What the readers' lease tables record (OFF_TAKEN: the last sequence *delivered*)
    is not what they consumed: a rejected message consumes its sequence too. The
    writer re-stamps its last slot's control block with sequence N + 100000 (the
    header inside still says N: MalformedHeader), wakes the readers, which reject it
    and move on to N + 100000; then it puts every word back (slot and last_seq say N
    again: no trace left in the segment or in OFF_TAKEN) and dies. The supervisor's
    SAFE must still be delivered."""
    pub = _engaged(w)
    if not _await_reader(ctx, w, TEST_READER, took=True, publish=pub):
        return {"denied": None, "error": "the test's reader never took a command"}
    for _ in range(5):
        pub()
        ctx.watchdog()
        time.sleep(0.02)
    time.sleep(0.3)
    buf = w._buf
    last, slot = L.LAST.unpack_from(buf, L.OFF_LAST_SEQ)
    cb = w._ctl[slot]
    gen, seq = L.GEN_SEQ.unpack_from(buf, cb)
    jump = last + 100_000
    L.GEN_SEQ.pack_into(buf, cb, gen + 2, jump)        # a "new" message in that slot
    L.U64.pack_into(buf, L.OFF_LAST_SEQ, jump)
    for fd in w._events:                               # every reader: wake up
        try:
            os.write(fd, b"\1")
        except OSError:
            pass
    for _ in range(20):                                # 1 s for the readers to reject it
        ctx.watchdog()
        time.sleep(0.05)
    L.GEN_SEQ.pack_into(buf, cb, gen + 4, seq)         # the slot as it was (a rewrite)
    L.U64.pack_into(buf, L.OFF_LAST_SEQ, last)
    res = {"poison": f"seq {jump} rejected, then every word back to {last}",
           "reader_took": _reader_state(w, TEST_READER)[1], "writer_last_seq": last}
    print("ATTACK " + json.dumps({"attack": "poisoned", "denied": None, **res}), flush=True)
    os._exit(1)


def die_after_attach(ctx: WorkerContext, w: Writer) -> dict:
    """An actuation writer that publishes engaged commands at 100 Hz and dies (exit 1)
    1 s after the test's reader attached; it says when (CLOCK_MONOTONIC, the host's:
    a sandbox has no time namespace). The test attaches while a research worker floods
    the supervisor, or while nothing does: how long until SAFE, each way."""
    pub = _engaged(w, 0.0625)
    if not _await_reader(ctx, w, TEST_READER, took=False, publish=pub):
        return {"denied": None, "error": "the test's reader never attached"}
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pub()
        ctx.watchdog()
        time.sleep(0.01)
    pub()
    t = time.monotonic_ns()
    print("ATTACK " + json.dumps({"attack": "die_after_attach", "denied": None,
                                  "died_ns": t, "last_seq": w.last_sequence}), flush=True)
    os._exit(1)


def headless_writer(ctx: WorkerContext, w: Writer | None) -> dict:
    """The actuation writer's main thread exits (SYS_exit: the process lives on in its
    other thread) while a second thread goes on publishing engaged commands for 1.5 s,
    then ends the process. The supervisor must not say its last word while a thread of
    the writer can still publish (one writer at a time), and must say it after."""
    pub = _engaged(w, 0.5)
    if not _await_reader(ctx, w, TEST_READER, took=True, publish=pub):
        return {"denied": None, "error": "the test's reader never took a command"}

    def thread() -> None:
        time.sleep(0.1)                       # the main thread is gone by now
        end = time.monotonic() + 1.5
        n = 0
        while time.monotonic() < end:
            pub()
            ctx.watchdog()
            n += 1
            time.sleep(0.01)
        print("ATTACK " + json.dumps({"attack": "headless_writer", "denied": None,
                                      "published_headless": n,
                                      "last_seq": w.last_sequence}), flush=True)
        os._exit(1)

    threading.Thread(target=thread, daemon=False).start()
    _step(main_thread="exiting", last_seq=w.last_sequence)
    _libc.syscall(SYS_EXIT, 0)                # this thread only
    return {"denied": None, "error": "SYS_exit returned"}


# ---------------------------------------------------------------- the supervisor's CPU


def newline_flood(ctx: WorkerContext, w: Writer | None) -> dict:
    """Empty lines on stdout at pipe speed for 3 s. The output pipe is rate limited
    per line (50/s), but only after each line went through the supervisor's Python
    line splitter: 64 KiB of newlines is 65,536 lines of work on the supervisor's
    event loop (root, in no cgroup) for one write(2) of the worker."""
    if not _await_reader(ctx, w, TEST_READER, took=False):
        return {"denied": None, "error": "the test's reader never attached"}
    chunk = b"\n" * 65536
    t0, cpu0, sent = time.monotonic_ns(), time.process_time(), 0
    end = t0 + 3_000_000_000
    while time.monotonic_ns() < end:
        try:
            sent += os.write(1, chunk)
        except OSError as e:
            return {"denied": True, "sent_lines": sent, "error": str(e)}
        ctx.watchdog()
    t1 = time.monotonic_ns()
    # The lines right after the flood meet an empty bucket (50 lines/s): wait for it to
    # refill, or the result is dropped with the flood. The window is given in this
    # machine's CLOCK_MONOTONIC (a sandbox has no time namespace).
    time.sleep(1.5)
    return {"denied": None, "sent_lines": sent, "window_ns": [t0, t1],
            "own_cpu_s": round(time.process_time() - cpu0, 3)}


def status_escape_flood(ctx: WorkerContext, w: Writer) -> dict:
    """STATUS lines of 4,088 control characters (4 KiB with the key and newline: one
    read each), as fast as the pipe takes them, for 2 s. Each is well under the flood
    limit's 1,000 lines/s, but the supervisor makes the whole line printable (a Python
    escape per character, ~2 ms a line) before it keeps the first 512 characters."""
    from supervisor.worker import ENV_STATUS_FD

    if not _await_reader(ctx, w, TEST_READER, took=False):
        return {"denied": None, "error": "the test's reader never attached"}
    fd = int(os.environ[ENV_STATUS_FD])
    line = b"STATUS=" + b"\x01" * (4096 - len("STATUS=") - 1) + b"\n"
    t0, cpu0, sent = time.monotonic_ns(), time.process_time(), 0
    end = t0 + 2_000_000_000
    while time.monotonic_ns() < end:
        try:
            os.write(fd, line)
        except OSError as e:
            return {"denied": True, "lines": sent, "error": str(e)}
        sent += 1
    t1 = time.monotonic_ns()
    ctx.watchdog()
    return {"denied": None, "lines": sent, "lines_per_s": round(sent / ((t1 - t0) / 1e9)),
            "window_ns": [t0, t1], "own_cpu_s": round(time.process_time() - cpu0, 3)}


def wake_spam(ctx: WorkerContext, w: Writer | None) -> dict:
    """A research writer holds the writer's end of every reader's wake-up socket of its
    channel, the supervisor's own monitor among them (the spare reader index, read on
    the supervisor's event loop). One byte per loop for 2 s, never a message: each
    byte wakes the monitor's reader, which drains, finds nothing and sleeps again."""
    w.publish_array(np.zeros(w.spec.slot_size // 4, np.float32)[:4])
    if not _await_reader(ctx, w, TEST_READER, took=False):
        return {"denied": None, "error": "the test's reader never attached"}
    monitor_attached = _await_reader(ctx, w, MONITOR_READER, took=False, timeout=20.0)
    fds = [w._events[MONITOR_READER]]
    for fd in fds:
        os.set_blocking(fd, False)
    t0, cpu0, sent, full = time.monotonic_ns(), time.process_time(), 0, 0
    end = t0 + 2_000_000_000
    while time.monotonic_ns() < end:
        for fd in fds:
            try:
                sent += os.write(fd, b"\1")
            except BlockingIOError:
                full += 1
            except OSError as e:
                return {"denied": True, "error": str(e)}
        if sent % 512 == 0:
            ctx.watchdog()
    return {"denied": None, "wakeups_sent": sent, "socket_full": full,
            "monitor_attached": monitor_attached, "window_ns": [t0, time.monotonic_ns()],
            "own_cpu_s": round(time.process_time() - cpu0, 3)}


# ---------------------------------------------------------------- the log's word


def fake_signal_exit(ctx: WorkerContext, w: Writer | None) -> dict:
    """exit_group(128 + SIGKILL) straight from the worker's code (os._exit: the runner's
    0..127 clamp never runs). bwrap reports it as it reports a death by SIGKILL; the
    supervisor's exit event says 'killed by SIGKILL' for a worker nobody killed (the
    same with 159: 'killed by seccomp: a forbidden system call')."""
    print("ATTACK " + json.dumps({"attack": "fake_signal_exit", "denied": None,
                                  "exit_code": 128 + 9}), flush=True)
    os._exit(128 + 9)


ATTACKS: dict[str, Callable[[WorkerContext, Writer | None], dict]] = {
    f.__name__: f for f in (lastword_rollback, lastword_unmagic, lastword_brick,
                            lastword_skipped_seq, lastword_seal, plain_brick, die_after_attach,
                            headless_writer, newline_flood, wake_spam, status_escape_flood,
                            fake_signal_exit)
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.probe.attacks_redteam3")
    p.add_argument("--attack", required=True, choices=sorted(ATTACKS))
    p.add_argument("--pub", default="")
    return p.parse_args(argv)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    w = None
    if a.pub:
        try:                         # before READY: nothing new is mapped after it
            w = ctx.writer(a.pub)
        except Exception as e:       # (lastword_brick's restarted run: refused the channel)
            print("ATTACK " + json.dumps({"attack": a.attack, "denied": False,
                                          "run": "restarted",
                                          "attach": f"{type(e).__name__}: {e}"}), flush=True)
            return 3
    ctx.ready(status=f"redteam3 pid {os.getpid()}")
    try:
        res = ATTACKS[a.attack](ctx, w)
    except Exception as e:           # an attack that crashed is reported, not hidden,
        res = {"denied": None, "crashed": f"{type(e).__name__}: {e}"}
        print("ATTACK " + json.dumps({"attack": a.attack, **res}), flush=True)
        return 2                     # and ends: the test waits for the poisoners' exits
    print("ATTACK " + json.dumps({"attack": a.attack, **res}), flush=True)
    while True:
        ctx.watchdog()
        time.sleep(0.05)
