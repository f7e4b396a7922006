"""Red team, round 2: attacks no earlier issue names, run from inside a real sandbox.

A worker module of its own (``module = "workers.probe.attacks_redteam2"``, args
``--attack NAME [--attack-before-ready] [--read CH]``): it runs each attack, prints one
line ``ATTACK {json}`` (``denied`` true/false plus what it saw) and then keeps pinging
its watchdog until it is stopped. The attacks on kernel knobs open for writing and
never write (or write back the value read), so a regression cannot change the machine.
tests/test_redteam_round2.py runs them under a real `supervisor run`.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import socket
import sys
import time
from typing import Callable

from supervisor.worker import ENV_STATUS_FD, WorkerContext
from workers.probe.attacks import _channel_fd

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _err(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, str(e.errno))
    return f"{type(e).__name__}: {e}"


def _status_fd() -> int:
    return int(os.environ[ENV_STATUS_FD])


# ---------------------------------------------------------------- the supervisor's parsers


def status_no_newline(ctx: WorkerContext) -> dict:
    """The status pipe's flood limit counts *lines*: bytes without a newline are never a
    line, and every 8 KiB of them make the supervisor emit one `protocol_error`
    (warning level: journald keeps them). 2 s of it at pipe speed."""
    fd, chunk = _status_fd(), b"X" * 65536
    t_end, sent = time.monotonic() + 2.0, 0
    try:
        while time.monotonic() < t_end:
            sent += os.write(fd, chunk)
    except OSError as e:
        return {"denied": True, "sent": sent, "error": _err(e)}
    os.write(fd, b"\n")
    return {"denied": None, "sent": sent}   # the verdict is the supervisor's log


def status_pipe_enlarged(ctx: WorkerContext) -> dict:
    """The status bucket's depth is a default pipe's worth of lines (lifecycle/_io.py):
    a worker that enlarges its end of the pipe (F_SETPIPE_SZ, 1 MiB) could otherwise
    queue 16x that and have it read as one honest backlog. Enlarge it, then write 20,000
    pings at once (fits in the big pipe: the write never blocks)."""
    import fcntl

    fd = _status_fd()
    try:
        size = fcntl.fcntl(fd, 1031, 1 << 20)          # F_SETPIPE_SZ
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    sent = os.write(fd, b"WATCHDOG=1\n" * 20_000)
    time.sleep(3.0)                                  # the supervisor's turn
    return {"denied": None, "pipe": size, "sent": sent}


def wide_status(ctx: WorkerContext) -> dict:
    """Printable but two columns wide (fullwidth forms): the live row is fitted with
    len(), so 'never wider than the terminal' holds for ASCII only. The row wraps, and
    the next '\\r ESC[2K' clears only its last line: the operator's screen scrolls."""
    # FULLWIDTH LATIN CAPITAL LETTER W (East Asian width F), in words: the row is cut
    # at whole words, so each word of 5 "fits" by len() at half its real width.
    text = " ".join(["\uff37" * 5] * 24)
    for _ in range(30):
        os.write(_status_fd(), f"STATUS={text}\n".encode())
        ctx.watchdog()
        time.sleep(0.1)
    return {"denied": None, "chars": len(text)}


def status_tail_smuggle(ctx: WorkerContext) -> dict:
    """An over-long status line is 'dropped' when the buffer passes 4096 bytes, but
    only what was read so far: the rest of the same line, up to its newline, is then
    parsed as a line of its own. An honest worker relaying text it did not choose
    (a dataset label, a file name) through ctx.status() can be made to say REFUSED=
    (the supervisor kills it for good), WATCHDOG= or READY= by that text. The line is
    8192 bytes up to the smuggled words: the supervisor's reads are 4096 bytes."""
    text = "A" * (8192 - len("STATUS=")) + "REFUSED=forged by-the-tail-of-a-status-line"
    for _ in range(3):               # 3 tries: one whose start shares a read is enough
        time.sleep(1.0)              # what was written before is read and gone
        ctx.status(text)
    time.sleep(1.0)                  # killed by now if a tail was taken for a line
    return {"denied": True, "sent": 3 * (len(text) + len("STATUS=") + 1)}


# ---------------------------------------------------------------- kernel memory


def socket_pin(ctx: WorkerContext) -> dict:
    """Memory the worker's cgroup never sees: data queued in AF_UNIX stream socket
    pairs (allowed in every domain) lives in socket buffers, kernel memory that
    memory_max does not count. Fill pairs (SO_SNDBUF raised to the kernel's maximum)
    until 256 MiB are queued or the kernel says no."""
    goal, pinned, pairs, err = 256 << 20, 0, [], ""
    chunk = b"\0" * 65536
    try:
        while pinned < goal:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pairs.append((a, b))
            for s in (a, b):
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 20)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
                except OSError:
                    pass
            a.setblocking(False)
            while pinned < goal:
                try:
                    pinned += a.send(chunk)
                except BlockingIOError:
                    break
    except OSError as e:
        err = _err(e)
    except MemoryError:
        err = "MemoryError"
    res = {"pinned_mib": round(pinned / (1 << 20), 1), "pairs": len(pairs), "error": err}
    print("ATTACK-STEP " + json.dumps(res), flush=True)
    time.sleep(3.0)                 # held while the test reads the cgroup's usage
    res["denied"] = pinned < goal
    return res


# ---------------------------------------------------------------- /proc and the clock


def _open_w(path: str) -> str:
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        return _err(e)
    os.close(fd)                  # opened but never written
    return "opened"


def proc_knobs(ctx: WorkerContext) -> dict:
    """The /proc/self files that change how the kernel treats this process or its
    siblings: out-of-memory priority, timer slack, clear_refs (resets the soft-dirty
    bits the maps scan could rely on), coredump filter, LSM attributes, the user
    namespace maps; then the clock (set to the value it has) and the time namespace."""
    names = ("oom_score_adj", "oom_adj", "timerslack_ns", "clear_refs", "coredump_filter",
             "attr/current", "attr/exec", "setgroups", "uid_map", "gid_map", "comm",
             "autogroup", "sched", "loginuid", "make-it-fail", "fail-nth")
    res: dict = {f"/proc/self/{n}": _open_w(f"/proc/self/{n}") for n in names}
    opened = [k for k, v in res.items() if v == "opened"]

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    ts = Timespec()
    _libc.clock_gettime(0, ctypes.byref(ts))          # CLOCK_REALTIME, as it is
    rc = _libc.clock_settime(0, ctypes.byref(ts))
    res["clock_settime"] = "ok" if rc == 0 else errno.errorcode.get(ctypes.get_errno())
    return {"denied": not opened and res["clock_settime"] != "ok", "opened": opened, **res}


def inherited_fds(ctx: WorkerContext) -> dict:
    """Every fd the sandbox was started with, and what it is: a supervisor fd (its log,
    a cgroup directory, the staging namespace, another worker's pipe) would be a door."""
    fds = {}
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError as e:
            fds[name] = _err(e)
    return {"denied": None, "fds": fds}


def signal_out(ctx: WorkerContext) -> dict:
    """Signals beyond the sandbox: kill(-1) reaches every process the pid namespace
    shows; pid 1 is bwrap's init. Count what a guessed host pid answers."""
    res: dict = {}
    try:
        os.kill(-1, 0)
        res["kill_-1"] = "ok"
    except OSError as e:
        res["kill_-1"] = _err(e)
    visible = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    res["visible_pids"] = visible[:20]
    hits = []
    for pid in range(1, 4096):
        if pid in visible:
            continue
        try:
            os.kill(pid, 0)
            hits.append(pid)
        except OSError:
            pass
    res["host_pids_answering"] = hits[:20]
    return {"denied": not hits, **res}


def channel_fd_ops(ctx: WorkerContext) -> dict:
    """A reader's read-only channel fd, every call that acts on the shared inode rather
    than on the reader's own description: seals (F_SEAL_WRITE would stop the writer),
    truncation, hole punching, a lease, flock/OFD locks (inode-wide), and MADV_REMOVE
    on a shared mapping. Any of them working is a reader changing the writer's world."""
    import fcntl
    import mmap

    fd = _channel_fd(ctx)
    res: dict = {}

    def _try(name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            res[name] = "ok"
        except OSError as e:
            res[name] = _err(e)

    F_ADD_SEALS, F_GET_SEALS = 1033, 1034
    seals = 0x1 | 0x2 | 0x4 | 0x8 | 0x10      # SEAL, SHRINK, GROW, WRITE, FUTURE_WRITE
    _try("get_seals", lambda: fcntl.fcntl(fd, F_GET_SEALS))
    _try("add_seals", lambda: fcntl.fcntl(fd, F_ADD_SEALS, seals))
    _try("ftruncate", lambda: os.ftruncate(fd, 0))
    _try("fallocate_punch", lambda: _fallocate(fd, 0x1 | 0x2, 0, 4096))
    _try("setlease_rd", lambda: fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK))
    _try("flock_ex", lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))
    _try("lockf_ex", lambda: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))
    try:
        m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
        _try("madv_remove", lambda: m.madvise(mmap.MADV_REMOVE, 0, 4096))
        _try("madv_dontneed", lambda: m.madvise(mmap.MADV_DONTNEED, 0, 4096))
        _try("mprotect_rw", lambda: _mprotect_rw(m))
        m.close()
    except OSError as e:
        res["mmap"] = _err(e)
    ok = {"add_seals", "ftruncate", "fallocate_punch", "setlease_rd", "madv_remove",
          "mprotect_rw"}
    harmful = sorted(k for k in ok if res.get(k) == "ok")
    # flock/lockf succeed on any readable fd; they bind only processes that ask for
    # the lock (the bridge never does), so they are reported, not judged.
    return {"denied": not harmful, "harmful": harmful, **res}


def _fallocate(fd: int, mode: int, off: int, length: int) -> None:
    _libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
    if _libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _mprotect_rw(m) -> None:
    """mprotect(READ|WRITE) of the reader's shared mapping of its read-only fd."""
    import numpy as np

    arr = np.frombuffer(m, np.uint8)
    base = arr.__array_interface__["data"][0]
    del arr                       # the mapping must close later: no export left
    _libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if _libc.mprotect(base, 4096, 0x1 | 0x2) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


SECRET_PATHS = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/root", "/home",
                "/var/lib/trio-supervisor", "/run/trio-staging", "/sys/fs/cgroup",
                "/proc/kcore", "/proc/kallsyms", "/sys/kernel/debug", "/dev/mem",
                "/var/log", "/etc/ssh")


def fs_secrets(ctx: WorkerContext) -> dict:
    """What of the host a worker can read: credentials, the supervisor's state
    directory (the fail-safe latch), the staging tree, cgroups, kernel memory."""
    readable = []
    res: dict = {}
    for path in SECRET_PATHS:
        try:
            if os.path.isdir(path):
                names = sorted(os.listdir(path))
                res[path] = names[:8]
                found = bool(names)
            else:
                with open(path, "rb") as f:
                    head = f.read(256)
                res[path] = head[:64].decode("ascii", "replace")
                # kallsyms shows every address as 0 to whoever may not see them
                found = (bool(head) if path != "/proc/kallsyms"
                         else head.split(b" ", 1)[0].strip(b"0") != b"")
        except OSError as e:
            res[path] = _err(e)
            continue
        if found:
            readable.append(path)
    return {"denied": not readable, "readable": readable, **res}


def _libc_path() -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "/libc.so" in parts[5]:
                return parts[5]
    raise LookupError("libc not mapped")


def exec_watch_flood(ctx: WorkerContext) -> dict:
    """Before READY: allowed requests, each a read+execute mapping of libc (a read-only
    file: allowed every time), until one is refused (or 20 s). Every one stops the
    whole worker and has the supervisor, as root and outside any cgroup, judge it: the
    supervisor must bound how many (execwatch's buckets) and refuse the worker."""
    import mmap

    fd = os.open(_libc_path(), os.O_RDONLY)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long)
    _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    prot = mmap.PROT_READ | mmap.PROT_EXEC
    ok = denied = 0
    cpu0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < 20.0 and not denied:
        addr = _libc.mmap(None, 4096, prot, mmap.MAP_PRIVATE, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            denied += 1
            continue
        ok += 1
        _libc.munmap(addr, 4096)
    os.close(fd)
    wall = time.monotonic() - t0
    return {"denied": None, "allowed": ok, "refused": denied, "wall_s": round(wall, 2),
            "own_cpu_s": round(time.process_time() - cpu0, 3)}


def many_mappings(ctx: WorkerContext) -> dict:
    """After READY: 60,000 mappings (one PROT_NONE region, every other page made
    readable: neighbours of different protection never merge), held 6 s. The periodic
    maps scan reads every control process's whole /proc/PID/maps as root, outside any
    cgroup: the worker pays a few kernel structures once, the supervisor every scan."""
    import mmap

    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long)
    _libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    pages, page = 60000, mmap.PAGESIZE
    base = _libc.mmap(None, pages * page, 0,                      # PROT_NONE
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)   # NORESERVE
    if base in (None, ctypes.c_void_p(-1).value):
        return {"denied": True, "error": errno.errorcode.get(ctypes.get_errno())}
    made = 0
    for i in range(0, pages, 2):
        if _libc.mprotect(base + i * page, page, mmap.PROT_READ) != 0:
            break
        made += 1
    with open("/proc/self/maps") as f:
        vmas = sum(1 for _ in f)
    print("ATTACK-STEP " + json.dumps({"held": vmas}), flush=True)
    t_end = time.monotonic() + 6.0
    while time.monotonic() < t_end:
        ctx.watchdog()
        time.sleep(0.05)
    _libc.munmap(base, pages * page)
    return {"denied": None, "vmas": vmas, "mprotects": made}


ATTACKS: dict[str, Callable[[WorkerContext], dict]] = {
    f.__name__: f for f in (status_no_newline, status_pipe_enlarged, status_tail_smuggle, wide_status, socket_pin, proc_knobs,
                            inherited_fds, signal_out, channel_fd_ops, fs_secrets, exec_watch_flood,
                            many_mappings)
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.probe.attacks_redteam2")
    p.add_argument("--attack", action="append", default=[])
    p.add_argument("--attack-before-ready", action="store_true")
    p.add_argument("--read", action="append", default=[])
    return p.parse_args(argv)


def _run(ctx: WorkerContext, names: list[str]) -> None:
    for name in names:
        try:
            res = ATTACKS[name](ctx)
        except Exception as e:       # an attack that crashed is reported, not hidden
            res = {"denied": None, "crashed": f"{type(e).__name__}: {e}"}
        print("ATTACK " + json.dumps({"attack": name, **res}), flush=True)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    readers = [ctx.reader(ch) for ch in a.read]
    if a.attack_before_ready:
        _run(ctx, a.attack)
    ctx.ready(status=f"redteam2 pid {os.getpid()}")
    if not a.attack_before_ready:
        _run(ctx, a.attack)
    while True:
        ctx.watchdog()
        for r in readers:
            while (m := r.try_receive()) is not None:
                m.release()
        time.sleep(0.05)
