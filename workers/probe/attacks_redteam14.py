"""Red team round 14 workers (tests/test_redteam_round14.py, docs/redteam14.md).

`module = "workers.probe.attacks_redteam14"`, `args = [ATTACK, ...]`. Each prints its
evidence as `RT14 {json}` lines on stdout, which the supervisor logs as `output` events.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import threading
import time


def _say(row: str, **data) -> None:
    print("RT14 " + json.dumps({"row": row, **data}), flush=True)


def _forks() -> int:
    """/proc/stat's `processes`: forks since boot, machine-wide (not per pid namespace)."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"processes "):
                return int(line.split()[1])
    return -1


def _readable(path: str) -> str:
    try:
        if os.path.isdir(path):
            return "dir:" + ",".join(sorted(os.listdir(path))[:8])
        with open(path, "rb") as f:
            return "read:" + f.read(160).decode(errors="replace").replace("\n", " | ")
    except OSError as e:
        return f"errno {e.errno}"


def _threads() -> int:
    """/proc/loadavg's 4th field's total: every thread on the machine, all sandboxes'."""
    with open("/proc/loadavg", "rb") as f:
        return int(f.read().split()[3].split(b"/")[1])


def sysobs(ctx) -> int:
    """Research: which machine-wide counters its sandbox shows, then the machine's thread
    count (/proc/loadavg) and fork count (/proc/stat) sampled every 2 ms: a control
    sandbox's start or end moves both (bwrap, its init, the worker and its threads)."""
    seen = {p: _readable(p) for p in (
        "/proc/stat", "/proc/loadavg", "/proc/pressure/cpu", "/proc/meminfo",
        "/proc/vmstat", "/proc/sys/fs/file-nr", "/proc/locks", "/dev/shm", "/sys/fs/cgroup")}
    try:
        threads, forks = _threads(), _forks()
    except (OSError, ValueError, IndexError):
        threads = forks = None
    _say("sysobs", readable=seen, threads=threads, forks=forks)
    ctx.ready(status="rt14 sysobs")
    if threads is None:
        while True:
            time.sleep(1)
    while True:
        time.sleep(0.002)
        t, f = _threads(), _forks()
        if abs(t - threads) >= 2 or f - forks >= 2:
            _say("moved", mono_ns=time.monotonic_ns(), threads=t - threads, forks=f - forks)
        threads, forks = t, f


def hold(ctx) -> int:
    """Research: ignores SIGTERM and writes one never-ending line (no newline), so at
    the supervisor's stop it is blocked in a write its throttled reader does not serve."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx.ready(status="rt14 hold")
    blob = b"z" * 65536
    while True:
        os.write(1, blob)


def sbloop(ctx) -> int:
    """Control: every warm standby of this worker dies 0.4 s after it is warm (what the
    OOM killer does to a standby at its peak memory, once per model load). The active
    instance runs on untouched."""
    if os.environ.get("TRIO_STANDBY_FD"):
        def die() -> None:
            time.sleep(0.4)
            os._exit(7)
        threading.Thread(target=die, daemon=True).start()
    ctx.ready(status="rt14 sbloop")       # a standby blocks here until adopted
    while True:
        time.sleep(0.5)


MAGIC_OFF = 0


def badhdr(ctx) -> int:
    """Research, the writer of a shadow channel the recorder taps: after `delay` s it
    sets the channel's magic (the reader's "the writer is up") over a header that is
    all zeroes, never through Writer. The recorder attaches at its next look."""
    from supervisor.ipc import layout as L
    from supervisor.ipc.channel import WriterHandle

    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    h = WriterHandle.from_json(ctx._handle_json("shadow"))
    ctx.ready(status="rt14 badhdr")
    time.sleep(delay)
    mm = mmap.mmap(h.data_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    mm[:8] = struct.pack("<Q", L.MAGIC)
    _say("badhdr", mono_ns=time.monotonic_ns(), set=True)
    while True:
        time.sleep(0.5)


def lastline(ctx) -> int:
    """Research: 1.5 MiB of output with no newline (past the 1 MiB burst: the reader is
    throttled and this worker waits in its writes), then its last line on stderr,
    then it crashes (exit 3). Its last line must still be logged."""
    ctx.ready(status="rt14 lastline")
    time.sleep(0.5)
    blob = b"y" * 65536
    t0 = time.monotonic()
    for _ in range(24):
        os.write(1, blob)
    os.write(1, b"\n")                 # the over-long line ends here
    os.write(2, ("RT14 " + json.dumps({"row": "last", "blocked_s": round(
        time.monotonic() - t0, 2)}) + "\n").encode())
    os._exit(3)


def flaky(ctx) -> int:
    """Research, required: READY, then (once the test's trigger file exists) it exits 1,
    and every start after exits 1 before READY (a sensor unplugged, a disk gone)."""
    trigger = sys.argv[2]
    if os.path.exists(trigger):
        _say("flaky", ready=False)
        return 1
    ctx.ready(status="rt14 flaky")
    while not os.path.exists(trigger):
        time.sleep(0.05)
    return 1


def slow(ctx) -> int:
    """Research, required: READY after `argv[2]` seconds (imports on a loaded machine)."""
    time.sleep(float(sys.argv[2]))
    ctx.ready(status="rt14 slow")
    while True:
        time.sleep(0.5)


def sbadopt(ctx) -> int:
    """Control: every warm standby of this worker, once handed the channels (after the
    supervisor's checks: alive, not stopped, reachable), either stops itself (`stop`:
    SIGSTOP, as a process hung right after the check) or exits at once (`die`: dies
    exactly at its adoption). The active instance pings every 50 ms."""
    import signal

    mode = sys.argv[2]
    if os.environ.get("TRIO_STANDBY_FD"):
        ctx._activate()                  # blocks until the hand-over
        _say("adopted", mode=mode, mono_ns=time.monotonic_ns())
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(9)
    ctx.ready(status=f"rt14 sbadopt {mode}")
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def lagger(ctx) -> int:
    """Control, a reader of `in` (as modeld reads frames): 1 s keeping up (takes every
    message within 2 ms), 1 s taking nothing (a long model step), and so on. Each
    switch is printed: the ground truth of row 9."""
    from supervisor.ipc.errors import Rejected

    r = ctx.reader("in")
    ctx.ready(status="rt14 lagger")
    while True:
        _say("phase", keep=True, mono_ns=time.monotonic_ns())
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            for _ in range(64):
                try:
                    m = r.try_receive()
                except Rejected:            # stale after a lag: counted, passed over
                    continue
                if m is None:
                    break
                m.release()
            ctx.watchdog()
            time.sleep(0.002)
        _say("phase", keep=False, mono_ns=time.monotonic_ns())
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            ctx.watchdog()
            time.sleep(0.05)


def slotwatch(ctx) -> int:
    """Research, another reader of `in`: keeps up itself, and reads the segment's header
    (last_seq, last_slot: the writer's, in the mapping every reader has) after each
    take. The writer reuses the newest slot every reader has taken (`_choose`); while a
    reader lags it goes round the ring. Per 200 ms: how many distinct slots the writer
    used: ~1-2 while control keeps up, the whole ring while it lags."""
    from supervisor.ipc.channel import ReaderHandle
    from supervisor.ipc.errors import Rejected

    r = ctx.reader("in")
    h = ReaderHandle.from_json(ctx._handle_json("in"))
    mm = mmap.mmap(h.data_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    ctx.ready(status="rt14 slotwatch")
    last, slots, t0 = 0, [], time.monotonic()
    while True:
        for _ in range(64):
            try:
                m = r.try_receive()
            except Rejected:
                continue
            if m is None:
                break
            m.release()
        seq, slot = struct.unpack_from("<QI", mm, 48)   # last_seq, last_slot
        if seq != last:
            last = seq
            slots.append(slot)
        if time.monotonic() - t0 >= 0.2:
            if slots:
                _say("slots", mono_ns=time.monotonic_ns(), distinct=len(set(slots)),
                     n=len(slots))
            slots, t0 = [], time.monotonic()
        time.sleep(0.002)


def main(ctx) -> int:
    return {"sysobs": sysobs, "sbloop": sbloop, "badhdr": badhdr,
            "lastline": lastline, "hold": hold, "flaky": flaky, "slow": slow,
            "sbadopt": sbadopt, "lagger": lagger, "slotwatch": slotwatch}[sys.argv[1]](ctx)
