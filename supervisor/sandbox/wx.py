"""W^X that the kernel enforces from READY on (strict domains: exec_memory_after_ready = false).

The exec watch (execwatch.py) judges requests for executable memory by seccomp user
notification: a judgement in the supervisor, with a window between looking and the
kernel acting. From READY on nothing may depend on such a judgement, so at READY the
worker locks itself (`lock()`, called by WorkerContext.ready before the READY line is
written):

* `prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN)` (Linux >= 6.3): no mapping may become
  executable that was not, and none may be writable and executable at once. It still
  allows a fresh mmap(PROT_READ|PROT_EXEC) of a file, hence:
* a plain seccomp filter, judged on register arguments only, that kills the process
  (SECCOMP_RET_KILL_PROCESS: SIGSYS, an `exit` event with its cause) on mmap, mprotect
  and pkey_mprotect with PROT_EXEC, and on memfd_create. KILL outranks USER_NOTIF in
  stacked filters, so the exec watch never sees these calls again; it stays, refusing
  everything after READY, as a second layer.

Other doors to executable memory are shut already at launch (seccomp.py): shmat with
SHM_EXEC, remap_file_pages, personality(READ_IMPLIES_EXEC), io_uring, execve. mremap
can move or grow an executable mapping of an admitted file (never its content); the
maps scan names that (new-exec-after-ready). Killing mremap would kill glibc's realloc.

The supervisor does not take the worker's word for it (`verify()`): from outside it
seizes every thread with ptrace, reads each thread's filters back
(PTRACE_SECCOMP_GET_FILTER; the kernel keeps the program as loaded) and requires this
exact program among them, on every thread, beyond the filters it counted when the exec
watch arrived. Without ptrace access to the filters it falls back to the count in
/proc/PID/task/*/status (Seccomp_filters) and says so. MDWE cannot be read from outside
(no /proc field): the READY line's word for it is reported next to whether this kernel
has MDWE at all (`kernel_has_mdwe`), never trusted for anything.
"""
from __future__ import annotations

import ctypes
import errno
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .procfs import DIRECT, ProcOpener
from .seccomp import _add, _Fileno, _pyseccomp, set_no_new_privs

PR_SET_MDWE, PR_GET_MDWE = 65, 66
PR_MDWE_REFUSE_EXEC_GAIN = 1
_PROT_EXEC = 0x4
KILLED = ("mmap", "mprotect", "pkey_mprotect")   # with PROT_EXEC in argument 2
# Memory files: code written to one could be mapped back executable. memfd_secret's
# (MAP_SHARED only) never is, but it is a memory file too (red team 11 row 8: symmetry).
KILLED_ANY = ("memfd_create", "memfd_secret")

# ptrace(2) requests (x86-64 and aarch64 share them) and the status of a seized stop.
_PTRACE_DETACH = 17
_PTRACE_SEIZE, _PTRACE_INTERRUPT = 0x4206, 0x4207
_PTRACE_SECCOMP_GET_FILTER = 0x420C
_WALL = 0x40000000
# Every thread must stop for the check within this. Generous: a thread waiting for a
# CPU on a loaded machine is not an attack (a 0.5 s bound refused modeld at load 16),
# and a worker that keeps a thread from stopping is refused all the same, only later.
VERIFY_WALL_S = 5.0
_MAX_ROUNDS = 16        # thread-list re-reads while seizing (threads made meanwhile)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)


@dataclass(frozen=True)
class Lock:
    """What `lock()` put in place in this process."""

    mdwe: bool
    seccomp: bool

    def line(self) -> str:
        """For the READY line: what was locked (the supervisor checks what it can)."""
        return f"wx mdwe={int(self.mdwe)} seccomp={int(self.seccomp)}"


def build_filter(lib: Any = None) -> Any:
    """The W^X filter: KILL_PROCESS on every request for new executable memory.
    `lib`: as seccomp.build_filter's."""
    sc = lib or _pyseccomp()
    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.CTL_NNP, 1)
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    flt.set_attr(sc.Attr.CTL_TSYNC, 1)      # every thread, or load() fails
    for name in KILLED:
        _add(sc, flt, sc.KILL_PROCESS, name, sc.Arg(2, sc.MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
    for name in KILLED_ANY:
        _add(sc, flt, sc.KILL_PROCESS, name)
    return flt


@lru_cache(maxsize=1)
def program() -> bytes:
    """The classic BPF that `lock()` loads: what `verify()` looks for in the kernel."""
    fd = os.memfd_create("wx-filter", os.MFD_CLOEXEC)
    try:
        build_filter().export_bpf(_Fileno(fd))
        size = os.lseek(fd, 0, os.SEEK_CUR)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def kernel_has_mdwe() -> bool:
    """PR_GET_MDWE answers (with this process's flags) on a kernel that has MDWE."""
    return _libc.prctl(PR_GET_MDWE, 0, 0, 0, 0) >= 0


def set_mdwe() -> bool:
    """Refuse executable-memory gain in this process for good; False if the kernel lacks MDWE."""
    if _libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:     # no MDWE in this kernel (< 6.3): the filter still holds
        return False
    raise OSError(err, f"prctl(PR_SET_MDWE): {os.strerror(err)}")


def lock() -> Lock:
    """Lock this process: MDWE where the kernel has it, then the W^X filter on every
    thread. Irreversible. Raises (never runs unlocked) if the filter cannot be loaded."""
    mdwe = set_mdwe()
    set_no_new_privs()
    build_filter().load()
    return Lock(mdwe=mdwe, seccomp=True)


def parse_line(text: str) -> dict[str, bool]:
    """The worker's word in its READY status ("wx mdwe=1 seccomp=1"), {} if absent."""
    at = text.find("wx mdwe=")
    if at < 0:
        return {}
    out: dict[str, bool] = {}
    for word in text[at + 3:].split()[:2]:
        key, _, val = word.rstrip("]").partition("=")
        if key in ("mdwe", "seccomp") and val in ("0", "1"):
            out[key] = val == "1"
    return out


# -- the supervisor's check ------------------------------------------------------------


@dataclass(frozen=True)
class Verified:
    ok: bool
    how: str                # "ptrace" (programs read back) | "count" (Seccomp_filters only)
    reason: str = ""        # why not, naming the thread
    threads: int = 0
    ms: float = 0.0


def filter_count(pid: int, tid: int | None = None, opener: ProcOpener = DIRECT) -> int:
    """Seccomp_filters of a thread (the process's main thread by default)."""
    name = "status" if tid is None else f"task/{tid}/status"
    with os.fdopen(opener.open(pid, name)) as f:
        for ln in f:
            if ln.startswith("Seccomp_filters:"):
                return int(ln.split()[1])
    raise OSError(errno.ENOSYS, "no Seccomp_filters in /proc status")


def _tids(pid: int, opener: ProcOpener = DIRECT) -> list[int]:
    try:
        return sorted(int(t) for t in opener.listdir(pid, "task"))
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} is gone") from None


def _filters_of(tid: int, first: int, count: int, want: bytes) -> bool:
    """Is `want` one of filters first..count-1 of seized, stopped thread `tid`? (Index 0
    is the oldest filter: those the launch and the runner installed come first.)"""
    buf = ctypes.create_string_buffer(len(want))
    for index in range(first, count):
        n = _libc.ptrace(_PTRACE_SECCOMP_GET_FILTER, tid, ctypes.c_void_p(index), None)
        if n < 0:
            raise OSError(ctypes.get_errno(), f"PTRACE_SECCOMP_GET_FILTER {tid}/{index}")
        if n * 8 != len(want):
            continue
        if _libc.ptrace(_PTRACE_SECCOMP_GET_FILTER, tid, ctypes.c_void_p(index), buf) < 0:
            raise OSError(ctypes.get_errno(), f"PTRACE_SECCOMP_GET_FILTER {tid}/{index}")
        if buf.raw == want:
            return True
    return False


def _wait_stopped(pid: int, tid: int, deadline: float,
                  opener: ProcOpener = DIRECT) -> bool | None:
    """True once the seized thread is in its stop; None once it is gone or dying (the
    tracer is told of a traced thread's death too, and a killed group leader reports
    nothing until its other threads are collected: waiting for it would last until
    the deadline); False at the deadline."""
    polls = 0
    while True:
        try:
            got, status = os.waitpid(tid, os.WNOHANG | _WALL)
        except ChildProcessError:
            return None
        if got == tid:
            return True if os.WIFSTOPPED(status) else None
        if time.monotonic() > deadline:
            return False
        polls += 1
        if polls % 25 == 0 and _killed(pid, tid, opener):
            return None
        time.sleep(0.0002)


def verify(pid: int, *, baseline: int | None, wall_s: float = VERIFY_WALL_S,
           opener: ProcOpener = DIRECT) -> Verified:
    """Does every thread of `pid` hold the W^X filter? Read back by ptrace where the
    kernel allows; else (count only) every thread must hold more than the `baseline`
    filters counted when the exec watch arrived (None: unknown, refused). Run in one OS
    thread (ptrace requests must come from the thread that seized). Threads are stopped
    only for the read and let go after; a thread that is exiting is not asked.
    ProcessLookupError: the process was killed or exited during the check (its exit,
    with its own cause, is what the caller reports).
    `opener` reaches /proc (sandbox/procfs.py). An opener whose holder cannot ptrace
    (the unprivileged supervisor proper) has the read-back done by the broker
    (`opener.check_wx`: readFilters, this same function run as root there); where that
    cannot read filters back either, the count below."""
    remote = opener.check_wx(pid) if hasattr(opener, "check_wx") else None
    if remote is not None:
        return remote
    t0 = time.monotonic()
    want = program()
    seized: list[int] = []

    def result(ok: bool, reason: str = "") -> Verified:
        return Verified(ok, "ptrace", reason, len(seized), (time.monotonic() - t0) * 1e3)

    try:
        deadline = t0 + wall_s
        checked: set[int] = set()
        # Rounds: seize the threads not seized yet, wait until they are stopped, check
        # them, and list again. A thread born before its creator stopped (and perhaps
        # before that creator loaded the filter on itself alone) appears in the next
        # round; once a listing shows nothing new, every thread is stopped and none can
        # make another.
        for _ in range(_MAX_ROUNDS):
            fresh = [t for t in _tids(pid, opener) if t not in seized
                     and not _gone(pid, t, opener)]
            if not fresh:
                if not checked:         # every thread exited: nothing was verified
                    raise ProcessLookupError(errno.ESRCH, f"process {pid} exited during "
                                             "the check")
                return result(True)
            for tid in fresh:
                if _libc.ptrace(_PTRACE_SEIZE, tid, None, None) == 0:
                    seized.append(tid)
                    _libc.ptrace(_PTRACE_INTERRUPT, tid, None, None)
                    continue
                err = ctypes.get_errno()
                if err == errno.ESRCH or _gone(pid, tid, opener):
                    continue                     # exited meanwhile
                if not seized and err in (errno.EPERM, errno.EACCES):
                    return _by_count(pid, baseline, t0, f"ptrace: {os.strerror(err)}", opener)
                return result(False, f"thread {tid} cannot be checked: {os.strerror(err)}")
            for tid in seized:
                if tid in checked:
                    continue
                stopped = _wait_stopped(pid, tid, deadline, opener)
                if stopped is None:              # gone meanwhile
                    if _dying(pid, opener):      # killed: its exit is reported
                        raise ProcessLookupError(errno.ESRCH, f"process {pid} was "
                                                 "killed during the check")
                    continue                     # a thread that ended on its own
                if not stopped:
                    if _gone(pid, tid, opener):
                        continue
                    return result(False, f"thread {tid} did not stop within {wall_s * 1e3:g} "
                                  "ms to be checked")
                # Any filter may be the one: only the W^X program itself matches, and a
                # filter, once loaded, stays (the baseline matters only to the count).
                try:
                    count = filter_count(pid, tid, opener)
                    found = _filters_of(tid, 0, count, want)
                except OSError as e:
                    if not checked and e.errno in (errno.EINVAL, errno.EACCES, errno.EIO):
                        return _by_count(pid, baseline, t0, f"no filter read-back: {e}", opener)
                    # A seized thread leaves its stop only for a fatal signal: ESRCH from
                    # a stopped thread means it is dying (CI: a standby killed right at
                    # its adoption was refused "cannot be checked", then given up).
                    if e.errno == errno.ESRCH and _dying(pid, opener):
                        raise ProcessLookupError(errno.ESRCH, f"process {pid} was killed "
                                                 "during the check") from None
                    if _gone(pid, tid, opener):
                        continue
                    raise
                if not found:
                    return result(False, f"thread {tid} has {count} seccomp filter(s), none "
                                  "of them the W^X filter")
                checked.add(tid)
        return result(False, f"threads kept appearing ({len(seized)} seized)")
    finally:
        for tid in reversed(seized):     # the group leader (seized first) last
            _let_go(tid)


def _let_go(tid: int, wall_s: float = 1.0) -> None:
    """Detach a seized thread. One that is not in its stop is dying (or about to stop):
    its death is reported to us, its tracer, and until we collect it the process's exit
    waits too (a killed worker's exit would wait for this thread, cached by trio)."""
    deadline = time.monotonic() + wall_s
    while _libc.ptrace(_PTRACE_DETACH, tid, None, None) != 0:
        try:
            got, status = os.waitpid(tid, os.WNOHANG | _WALL)
        except ChildProcessError:
            return
        if got == tid and not os.WIFSTOPPED(status):
            return                        # collected: gone
        if time.monotonic() > deadline:
            return
        if got != tid:
            time.sleep(0.0005)


_PF_EXITING = 0x4      # task flags (/proc/.../stat field 9): the thread is in do_exit


def _kill_state(pid: int, tid: int, opener: ProcOpener = DIRECT) -> tuple[bool, bool] | None:
    """(SIGKILL pending for the thread or its process, the thread is exiting), None for
    a thread that is gone."""
    try:
        with os.fdopen(opener.open(pid, f"task/{tid}/status")) as f:
            pending = [int(ln.split()[1], 16) for ln in f
                       if ln.startswith(("SigPnd:", "ShdPnd:"))]
        with os.fdopen(opener.open(pid, f"task/{tid}/stat"), "rb") as f:
            data = f.read()
        flags = int(data[data.rindex(b")") + 2:].split()[6])
    except (OSError, ValueError, IndexError):
        return None
    return any(p & (1 << (9 - 1)) for p in pending), bool(flags & _PF_EXITING)


def _killed(pid: int, tid: int, opener: ProcOpener = DIRECT) -> bool:
    """The thread is dying (killed, or exiting on its own); False once it is gone."""
    st = _kill_state(pid, tid, opener)
    return st is not None and any(st)


def _dying(pid: int, opener: ProcOpener = DIRECT) -> bool:
    """The process is being killed or has exited: gone, a zombie, a SIGKILL pending on
    a thread, or every thread exiting. One thread ending on its own (exiting, while the
    others run) is not this: that is thread churn, never a reason to refuse."""
    try:
        tids = opener.listdir(pid, "task")
    except OSError:
        return True
    states = [st for t in tids if (st := _kill_state(pid, int(t), opener)) is not None
              and not _gone(pid, int(t), opener)]
    if not states:
        return True
    return any(k for k, _ in states) or all(x for _, x in states)


def _gone(pid: int, tid: int, opener: ProcOpener = DIRECT) -> bool:
    """The thread has exited (a zombie, or no longer listed)."""
    try:
        with os.fdopen(opener.open(pid, f"task/{tid}/stat"), "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rindex(b")") + 2:data.rindex(b")") + 3] in (b"Z", b"X")


def _by_count(pid: int, baseline: int | None, t0: float, why: str,
              opener: ProcOpener = DIRECT) -> Verified:
    """No filter read-back here: every thread must at least have more filters than before."""
    tids = _tids(pid, opener)
    if baseline is None:
        return Verified(False, "count", f"no filter count from before READY to compare ({why})",
                        len(tids), (time.monotonic() - t0) * 1e3)
    for tid in tids:
        try:
            count = filter_count(pid, tid, opener)
        except FileNotFoundError:
            continue
        if count <= baseline:
            return Verified(False, "count", f"thread {tid} has {count} seccomp filters, no more "
                            f"than the {baseline} it had before READY ({why})", len(tids),
                            (time.monotonic() - t0) * 1e3)
    return Verified(True, "count", why, len(tids), (time.monotonic() - t0) * 1e3)
