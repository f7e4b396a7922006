"""Red team round 17 workers (tests/test_redteam_round17.py, docs/redteam17.md).

`module = "workers.probe.attacks_redteam17"`, `args = [ROLE, ...]`. Evidence is printed
as `RT17 {json}` lines on stdout (logged by the supervisor as `output` events, stamped
with its CLOCK_MONOTONIC, which every sandbox shares), an attack's verdict as one
`ATTACK {json}` line (tests/_fleet.py reads those).

    poke    an actuation writer (role `out`, control_cmd): engaged commands every 10 ms
            for N s, then its main loop wedges while a thread pings the watchdog and adds
            1 to the channel header's last_seq every 20 ms, publishing no message at all
            (the header is in its own writable mapping: it is the writer)
    model   a model_out writer (role `out`): a good output every 20 ms, fresh capture time
    spy     a control reader (roles `a`, `b`, `c`): per 0.5 s, per role, messages taken, their
            newest sequence, rejections by reason, engaged flags and reasons seen
    stopsup research: tries to stop, freeze or trace anything outside its sandbox
            (the supervisor above all), so that the supervisor would look paused
    two     an actuation writer of two channels (`a`, `b`) whose `b` goes silent after
            N s while `a` and its pings go on
    fat     research: pings until SIGUSR1, then holds M MiB in small pages, forks K
            children sharing them, and stops pinging (its watchdog kills it; the kernel
            unmaps them K + 1 times after bwrap has exited)
    victim  control: pings every 20 ms, nothing else
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import signal
import sys
import threading
import time

import numpy as np


def _say(row: str, **data) -> None:
    print("RT17 " + json.dumps({"row": row, **data}), flush=True)


def poke(ctx) -> int:
    from supervisor.ipc import layout

    w = ctx.writer("out")
    ctx.ready(status="rt17 poke")
    cmd = np.array([0.03, 1.0, 0.0, 0.0], np.float32)     # engaged, reason OK
    until = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 1.5)
    while time.monotonic() < until:
        ctx.watchdog()
        w.publish_array(cmd)
        time.sleep(0.01)
    word = layout.OFF_LAST_SEQ // 8
    words = w._words                 # the writer's own mapping of the segment, writable

    def bump() -> None:              # pings, and a header that says "published"
        while True:
            ctx.watchdog()
            words[word] = words[word] + 1
            time.sleep(0.02)
    _say("poked", mono_ns=time.monotonic_ns(), seq=int(words[word]))
    threading.Thread(target=bump, daemon=True).start()
    threading.Event().wait()         # the main loop never publishes again
    return 0


def model(ctx) -> int:
    from schemas.payloads import MODEL_OUT

    w = ctx.writer("out")
    ctx.ready(status="rt17 model")
    out = MODEL_OUT.encode(offset_m=0.05, heading_rad=0.0, confidence=0.9)
    fid = 0
    while True:
        ctx.watchdog()
        fid += 1
        w.publish_array(out, frame_id=fid, capture_ts_ns=time.monotonic_ns())
        time.sleep(0.02)


def spy(ctx) -> int:
    from supervisor.ipc import Rejected

    roles = [r for r in ("a", "b", "c") if ctx.has(r)]
    readers = {r: ctx.reader(r) for r in roles}
    ctx.ready(status="rt17 spy")
    zero = lambda: {"n": 0, "seq": None, "rejected": {}, "engaged": set(), "reasons": set(),
                    "pub": None}
    win = {r: zero() for r in roles}
    t0 = time.monotonic_ns()
    next_ping = 0
    while True:
        now = time.monotonic_ns()
        if now >= next_ping:
            ctx.watchdog()
            next_ping = now + 20_000_000
        for r, rd in readers.items():
            for _ in range(256):
                try:
                    m = rd.try_receive()
                except Rejected as e:
                    win[r]["rejected"][e.reason] = win[r]["rejected"].get(e.reason, 0) + 1
                    continue
                if m is None:
                    break
                with m:
                    st, vals = m.stamp, m.tolist()
                d = win[r]
                d["n"] += 1
                d["seq"], d["pub"] = st.sequence, st.publish_ts_ns
                d["engaged"].add(int(vals[1]))
                d["reasons"].add(int(vals[2]))
        now = time.monotonic_ns()
        if now - t0 >= 500_000_000:
            for r in roles:
                d = win[r]
                _say("win", role=r, t0=t0, t1=now, n=d["n"], seq=d["seq"], pub=d["pub"],
                     rejected=d["rejected"], engaged=sorted(d["engaged"]),
                     reasons=sorted(d["reasons"]))
                win[r] = zero()
            t0 = now
        time.sleep(0.002)


def _ptrace_attach(pid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    PTRACE_ATTACH, PTRACE_DETACH = 16, 17
    rc = libc.ptrace(PTRACE_ATTACH, pid, None, None)
    err = ctypes.get_errno()
    if rc == 0:
        libc.ptrace(PTRACE_DETACH, pid, None, None)
    return 0 if rc == 0 else err


def stopsup(ctx) -> int:
    """Every way this sandbox might stop or freeze a process outside it. The supervisor's
    own-pause rule forgives every worker's silence over a gap in which the supervisor's
    thread neither ran nor waited runnable: a worker that could cause one would shield a
    wedged control worker."""
    ctx.ready(status="rt17 stopsup")
    me, got = os.getpid(), {}
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    got["visible_pids"] = pids
    stopped, traced = [], []
    for pid in pids:
        if pid == me:
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            os.kill(pid, signal.SIGCONT)
        except OSError as e:
            got.setdefault("kill_errors", []).append(f"{pid}: {e.strerror}")
        err = _ptrace_attach(pid)
        if err == 0:
            traced.append(pid)
        else:
            got.setdefault("ptrace_errors", []).append(f"{pid}: {os.strerror(err)}")
    # Beyond the pid namespace: a pidfd or a signal by a host pid (the supervisor's
    # is usually small; try a range), and kill(-1).
    libc = ctypes.CDLL(None, use_errno=True)
    outside = []
    mine = {int(t) for t in os.listdir("/proc/self/task")}     # our threads' ids answer too
    for pid in range(2, 4096):
        if pid in pids or pid in mine:
            continue
        if libc.kill(pid, 0) == 0:
            outside.append(pid)
    got["outside_signalable"] = outside[:20]
    # Freezers: any cgroup.freeze or freezer.state this sandbox can open for writing.
    # Opened, never written: being able to open it is the break.
    freezable = []
    for f in (glob.glob("/sys/fs/cgroup/**/cgroup.freeze", recursive=True)
              + glob.glob("/sys/fs/cgroup/**/freezer.state", recursive=True)):
        try:
            fd = os.open(f, os.O_WRONLY)
            os.close(fd)
            freezable.append(f)
        except OSError as e:
            got.setdefault("freeze_errors", []).append(f"{f}: {e.strerror}")
    got["cgroup_files_seen"] = len(glob.glob("/sys/fs/cgroup/*"))
    got.update(stopped=stopped, traced=traced, freezable=freezable)
    # Its own sandbox's processes are its own to stop; anything outside is the break.
    got["denied"] = not (outside or freezable)
    for k in ("kill_errors", "ptrace_errors", "freeze_errors"):
        if k in got:
            got[k] = got[k][:5]
    print("ATTACK " + json.dumps(got), flush=True)
    while True:
        time.sleep(1)


def fat(ctx) -> int:
    """Pings until SIGUSR1 (the test's cue: its timing is then known), then holds MB MiB
    in small pages, forks KIDS children sharing them and stops pinging: the watchdog
    kills it, and its sandbox's processes unmap all of it after bwrap is gone, while
    the supervisor's loop waits for its cgroup to be empty."""
    mb, kids = int(sys.argv[2]), int(sys.argv[3])
    cue = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: cue.set())
    ctx.ready(status="rt17 fat")
    while not cue.wait(0.1):
        ctx.watchdog()
    import mmap

    # Small pages: 4 KiB each to free at the kill (transparent huge pages free 512 at a
    # time: 3 GiB of them were gone in 0.3 ms here, 3 GiB of small ones in 113 ms).
    m = mmap.mmap(-1, mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    blob = np.frombuffer(m, np.uint8)
    for i in range(0, len(blob), 256 << 20):      # pinging: the kill is the watchdog's, later
        blob[i:i + (256 << 20):4096] = 1
        ctx.watchdog()
    # Children share those pages (copy on write: no more memory), and each must unmap
    # all of them when the sandbox is killed: the kernel's work at the kill, times kids.
    forked = 0
    for _ in range(kids):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            while True:
                time.sleep(10)
        forked += 1
        ctx.watchdog()
    _say("fat", mono_ns=time.monotonic_ns(), mb=mb, kids=forked, sum=int(blob[::4096].sum()))
    threading.Event().wait()         # no more pings
    return 0


def two(ctx) -> int:
    """An actuation writer of two channels (roles `a`, `b`: steering and, say, braking):
    both every 10 ms for N s, then `b`'s half of its loop is gone (a thread wedged, an
    exception swallowed) while `a` and the pings go on."""
    wa, wb = ctx.writer("a"), ctx.writer("b")
    ctx.ready(status="rt17 two")
    cmd = np.array([0.04, 1.0, 0.0, 0.0], np.float32)
    until = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 1.5)
    said = False
    while True:
        ctx.watchdog()
        wa.publish_array(cmd)
        if time.monotonic() < until:
            wb.publish_array(cmd)
        elif not said:
            _say("b_silent", mono_ns=time.monotonic_ns(), seq_b=wb.last_sequence)
            said = True
        time.sleep(0.01)


def victim(ctx) -> int:
    """A control worker that pings every 20 ms and does nothing else (the test stops it)."""
    ctx.ready(status="rt17 victim")
    while True:
        ctx.watchdog()
        time.sleep(0.02)


def main(ctx) -> int:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    fn = {"poke": poke, "model": model, "spy": spy, "stopsup": stopsup, "fat": fat,
          "two": two, "victim": victim}.get(role)
    if fn is None:
        print(f"attacks_redteam17: unknown role {role!r}", file=sys.stderr)
        return 2
    return fn(ctx)
