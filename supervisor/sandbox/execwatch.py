"""Supervisor side of the exec watch: judge a worker's requests for executable memory.

The worker (strict domain) installs `seccomp.install_exec_watch()` before its module is
imported and hands us the listener fd. From then on every mmap/mprotect/pkey_mprotect
with PROT_EXEC and every memfd_create stops in the kernel until we answer here. We run
as host root outside the sandbox and read the worker's /proc; nothing here needs
pyseccomp (plain ioctls on the listener).

Policy: before READY, code may come only from regular files on read-only mounts (the
interpreter, extension modules, shared libraries) whose device no mount of the worker
can write, plus, if allowed, *private* anonymous memory (a JIT); memfd_create is
allowed. Shared anonymous memory is never code: another view of it (mremap with
old_size 0, a second mmap of the same shmem) can stay writable. An mprotect must
cover mapped memory only, every page of it judged. After READY, nothing: no new
executable memory, no memfd. A denied call fails with EPERM in the worker and is
returned as a Verdict so the supervisor can log it (and fail the worker if it wants
to).

Cost: a judgement reads only the range it is about (the PROCMAP_QUERY ioctl on
/proc/PID/maps, Linux >= 6.11; else /proc/PID/maps, stopped at the end of the range;
/proc/PID/pagemap for that range only) and is refused when it takes longer than
`judge_budget_s` of CPU or `judge_wall_s` of wall time ("too slow to judge"): a worker
with 60,000 mappings costs what one with 60 does. `handle_pending` answers at most
`max_requests` per call, so the caller can yield between calls.

No race to win (issue 21). CONTINUE lets the kernel make the call after we looked;
a second thread used to swap the fd number (dup2) or mremap a patched copy onto the
range between our look and the kernel's act (bench/wx_race.py: 46 and 32 wins in 200
tries each). Now, before READY, the whole worker is stopped while a request is judged
(_Frozen: SIGSTOP to each thread and to any process that could share its memory;
the caller's own wait is killable only, SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV, so it
stays where it is). Judging starts only once every other thread is stopped in two
passes that agree (a thread read as stopped could otherwise be woken by one read
after it). Where another thread exists, the caller is let go alone (CONTINUE), and
once it has made the call and stopped too, what the kernel did is checked: every
mapping the call made executable is the file judged by the kernel's own (device,
inode), with only the file's pages (/proc/PID/pagemap), or anonymous memory where
that was judged; a mismatch kills the worker before any of its code runs again, and
is a refusal naming the mapping and the page. A worker whose threads do not stop
within the judgement's wall budget is refused ("too slow to judge"). Cost: a stop and
a look at each thread per judgement (~0.5 ms here), plus the wait for the call's
result when another thread exists (a few ms on a loaded machine).

mremap, remap_file_pages, madvise: none is watched and none needs to be. mremap moves
or grows a mapping with its own protection: a patched copy moved onto code is not
executable unless an mprotect asks (judged: the page is seen), and a patched page
that got into an executable mapping anyway is refused at READY and by every maps
scan (maps.KIND_FOREIGN_PAGE). remap_file_pages kills in strict domains (seccomp);
madvise can only drop private copies (MADV_DONTNEED: the file's pages come back) or
hint. After READY the worker's own W^X lock (wx.py: MDWE and a filter that kills any
PROT_EXEC request and memfd_create) means no judgement is needed at all; the watch
refuses everything after READY as a second layer. Memory that is already writable
and executable at READY needs no syscall to be rewritten: see
writable_executable_mappings(). If the supervisor closes the listener, watched calls
fail with ENOSYS in the worker; if it stops reading, they block.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import gc
import os
import platform
import select
import signal
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from supervisor.admission.maps import first_foreign_page
from supervisor.ratelimit import TokenBucket
from supervisor.sandbox.procfs import DIRECT, ProcOpener

# <linux/seccomp.h>. The ioctl numbers encode the struct sizes, so a kernel whose
# structs differ would reject them; we check the sizes once instead of guessing.
_NOTIF = struct.Struct("=QIIiIQ6Q")  # id, pid, flags, data{nr, arch, ip, args[6]}
_RESP = struct.Struct("=QqiI")  # id, val, error, flags
_IOCTL_RECV = 0xC0502100  # _IOWR('!', 0, struct seccomp_notif)      80 bytes
_IOCTL_SEND = 0xC0182101  # _IOWR('!', 1, struct seccomp_notif_resp) 24 bytes
_IOCTL_ID_VALID = 0x40082102  # _IOW('!', 2, __u64)
_FLAG_CONTINUE = 1  # SECCOMP_USER_NOTIF_FLAG_CONTINUE
_GET_NOTIF_SIZES = 3
_NR_SECCOMP = {"x86_64": 317, "aarch64": 277}

_PROT_WRITE, _PROT_EXEC = 0x2, 0x4
_MAP_FIXED, _MAP_FIXED_NOREPLACE = 0x10, 0x100000
_MAP_TYPE, _MAP_PRIVATE = 0x03, 0x02  # MAP_SHARED 1, MAP_PRIVATE 2, MAP_SHARED_VALIDATE 3
_MAP_ANONYMOUS = 0x20  # same on x86-64 and aarch64
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_ADDR_LIMIT = 1 << 64

# <linux/fs.h> (6.11): struct procmap_query, PROCMAP_QUERY = _IOWR('f', 17, ...).
_PMQ = struct.Struct("=9Q4I2Q")  # size, flags, addr, start, end, vma_flags, page_size,
#                                  offset, inode, dev_major, dev_minor, name_size,
#                                  build_id_size, name_addr, build_id_addr  (104 bytes)
_PROCMAP_QUERY = (3 << 30) | (_PMQ.size << 16) | (ord("f") << 8) | 17
_PMQ_COVERING_OR_NEXT = 0x10
_PMQ_R, _PMQ_W, _PMQ_X, _PMQ_SHARED = 0x1, 0x2, 0x4, 0x8
_NAME_MAX = 4096 + 16  # PATH_MAX + " (deleted)"
_procmap_query_works: bool | None = None  # None: not tried yet


# How long one judgement may take before it is refused instead ("too slow to judge"),
# and how many mappings one mprotect may span.
# Bounds on a hostile worker's cost to us, not deadlines for an honest one: a loaded
# 2-core machine took 61 ms of CPU for camerad's judgement once (refused at 50 ms). Our
# own garbage collections are not counted (`_own_cpu`): one in a full test run's pytest
# process was charged to numpy's mmap (334 ms, refused at 250 ms: an honest control
# worker refused, the domain failed safe).
JUDGE_BUDGET_S = 0.6  # CPU time of this thread (system time: reading /proc)
JUDGE_WALL_S = 2.0  # wall time (a lock held by the worker; a descheduled supervisor)
MAX_RANGE_MAPPINGS = 1024
# What all of one worker's requests may cost us (one listener: one incarnation): a
# bucket of CPU and of requests, refilled slowly (a JIT worker maps now and then for
# its whole life). Each judgement is bounded above, their number was not: a worker
# mapping libc R|X in a loop before READY bought ~0.4 s of root CPU, outside every
# cgroup, per second (red team round 2). Honest start-ups, load 14: camerad 29
# requests, modeld 49; importing numpy, capnp, tinygrad and trio under the watch (the
# end-to-end test's worker) 263 requests, 0.54 s of our CPU. About 3x that:
JUDGE_TOTAL_CPU_S = 1.5        # the CPU bucket
JUDGE_CPU_REFILL = 0.02        # CPU seconds given back per second (2 % of a CPU)
MAX_JUDGEMENTS = 768           # the request bucket
JUDGEMENTS_REFILL = 5.0        # requests given back per second
# How long the worker's threads may take to stop, and the caller to make an allowed call
# and stop. Scheduling, not our work: longer than a judgement's budget on a loaded
# machine, and off the event loop (one thread per worker), so it holds no one else.
FREEZE_WALL_S = 2.0
_TARGET_NAMES = 6  # names listed in ExecRequest.target
_NAP_S = 30e-6  # between looks at a stopping worker (then 1 ms after 200 looks)
MAX_SHARERS = 64  # other processes stopped with the worker (strict domains: none)
_STOPPED = ("T", "t", "Z", "X")  # a thread in these states runs none of the worker's code
# SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV (5.19): without it SIGSTOP would cancel the
# caller's pending notification and the kernel would re-issue it, for ever.
_KILLABLE_RECV = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit()) >= (5, 19)

# (AUDIT_ARCH, nr) -> name. Only what the filter watches; anything else is refused.
_SYSCALLS = {
    (0xC000003E, 9): "mmap", (0xC000003E, 10): "mprotect",
    (0xC000003E, 329): "pkey_mprotect", (0xC000003E, 319): "memfd_create",
    (0xC00000B7, 222): "mmap", (0xC00000B7, 226): "mprotect",
    (0xC00000B7, 288): "pkey_mprotect", (0xC00000B7, 279): "memfd_create",
}


def _check_sizes() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    nr = _NR_SECCOMP.get(platform.machine())
    sizes = (ctypes.c_uint16 * 3)()
    if nr is None or libc.syscall(ctypes.c_long(nr), ctypes.c_long(_GET_NOTIF_SIZES),
                                  ctypes.c_long(0), sizes) != 0:
        raise OSError(ctypes.get_errno() or errno.ENOSYS, "seccomp(GET_NOTIF_SIZES) failed")
    if tuple(sizes) != (_NOTIF.size, _RESP.size, 64):
        raise OSError(errno.EINVAL, f"unexpected seccomp notif sizes {tuple(sizes)}")


@dataclass(frozen=True)
class ExecRequest:
    id: int
    pid: int  # host tid of the calling thread (our pid namespace)
    syscall: str
    nr: int
    args: tuple[int, ...]
    prot: int
    flags: int  # mmap flags, else 0
    fd: int  # mmap fd, else -1
    # readlink(/proc/pid/fd/N) for a file mmap; the backing of the mapping(s) in the
    # range for mprotect ("[anon]" for anonymous memory); None when not applicable.
    target: str | None


@dataclass(frozen=True)
class Verdict:
    request: ExecRequest
    allowed: bool
    reason: str


class TooSlow(Exception):
    """A judgement ran over its budget: the request is refused, not waved through.
    `wall_only`: its wall budget, with CPU to spare (`ExecWatch._within_budget`)."""

    def __init__(self, message: str, wall_only: bool = False) -> None:
        super().__init__(message)
        self.wall_only = wall_only


class _GcClock(threading.local):
    """What the garbage collector has cost this thread (CPU, wall), for `_own_*`."""

    cpu = wall = 0.0
    at: tuple[float, float] | None = None


_gc_clock = _GcClock()


def _on_gc(phase: str, info: dict) -> None:
    # Runs in the thread that collects, whichever allocation set it off.
    c = _gc_clock
    if phase == "start":
        c.at = (time.thread_time(), time.monotonic())
    elif c.at is not None:
        c.cpu += time.thread_time() - c.at[0]
        c.wall += time.monotonic() - c.at[1]
        c.at = None


gc.callbacks.append(_on_gc)


def _own_cpu() -> float:
    """This thread's CPU time, less what our own garbage collections took in it: a full
    collection of the supervisor's heap is our cost, not the worker's. (A CI run's
    embedded supervisor, in a pytest process holding torch and 1,300 tests' objects,
    charged one to numpy's mmap: 334 ms, refused; the domain failed safe.)"""
    return time.thread_time() - _gc_clock.cpu


def _own_wall() -> float:
    return time.monotonic() - _gc_clock.wall


class _Budget:
    def __init__(self, cpu_s: float, wall_s: float) -> None:
        self.cpu_s, self.wall_s = cpu_s, wall_s
        self.cpu0, self.wall0 = _own_cpu(), _own_wall()

    def check(self) -> None:
        cpu, wall = _own_cpu() - self.cpu0, _own_wall() - self.wall0
        if cpu > self.cpu_s or wall > self.wall_s:
            raise TooSlow(f"too slow to judge ({cpu * 1e3:.1f} ms CPU, {wall * 1e3:.1f} ms; "
                          f"budget {self.cpu_s * 1e3:g} ms CPU, {self.wall_s * 1e3:g} ms)",
                          wall_only=cpu <= self.cpu_s)


class Vma(NamedTuple):
    """One mapping as the kernel reports it (/proc/PID/maps or PROCMAP_QUERY)."""

    start: int
    end: int
    perms: str  # "r-xp", "rw-s", ...
    offset: int
    dev: tuple[int, int]  # (major, minor)
    inode: int
    name: str  # path (with " (deleted)"), "[heap]", "[anon:x]", "" for anonymous

    @property
    def shared(self) -> bool:
        return self.perms[3:4] == "s"

    @property
    def kind(self) -> str:
        """anon (private anonymous) | shared-anon | special | file."""
        n = self.name
        if not n or n in ("[heap]", "[stack]") or n.startswith("[anon:"):
            return "shared-anon" if self.shared else "anon"
        if n.startswith("[anon_shmem:") or n.startswith("/SYSV") or n == "/dev/zero (deleted)":
            return "shared-anon"  # MAP_SHARED|MAP_ANONYMOUS, SysV shm: shmem
        if n.startswith("/") and self.inode:
            return "file"
        return "special"  # [vdso], [vvar], [vsyscall], [uprobes], anything unknown

    @property
    def label(self) -> str:
        return "[anon]" if self.kind == "anon" and not self.name else self.name


class Hole(Exception):
    """Part of the range is not mapped (the kernel's mprotect would fail with ENOMEM)."""

    def __init__(self, addr: int) -> None:
        super().__init__(f"nothing is mapped at {addr:#x}")
        self.addr = addr


class ExecWatch:
    def __init__(self, listener_fd: int, *, allow_anonymous_exec: bool = False,
                 opener: ProcOpener = DIRECT) -> None:
        _check_sizes()
        self._fd = listener_fd  # ours now: close() closes it
        # How the worker's /proc is read and its threads stopped (sandbox/procfs.py):
        # directly as root, or through the broker for an unprivileged supervisor.
        self.opener = opener
        # Private anonymous PROT_EXEC (a JIT) before READY; may be changed at any time.
        self.allow_anonymous_exec = allow_anonymous_exec
        self.ready = False  # set by the supervisor when it accepts the worker's READY
        self.hung_up = False  # every filtered task is gone: stop polling this fd
        self.judge_budget_s = JUDGE_BUDGET_S
        self.judge_wall_s = JUDGE_WALL_S
        self.freeze_wall_s = FREEZE_WALL_S
        # Seccomp_filters of the worker when its listener arrived (wx.verify's fallback).
        self.filters_at_listener: int | None = None
        # Stop the worker while judging and check the result (see _Frozen). Off only to
        # measure the race it closes (bench/wx_race.py), or where the kernel cannot keep
        # a received notification from being interrupted by SIGSTOP (< 5.19).
        self.freeze = _KILLABLE_RECV
        self.mismatches = 0     # calls whose result was not what was judged
        self.stops = 0          # judgements made with the worker stopped
        self.busy_s = 0.0       # wall time spent answering (judging, stopping, checking)
        self.cpu_s = 0.0        # our CPU time spent answering, in all
        self.judged = 0         # requests answered, in all
        # What all of this worker's requests may cost us (see JUDGE_TOTAL_CPU_S).
        self.cpu_bucket = TokenBucket(JUDGE_CPU_REFILL, JUDGE_TOTAL_CPU_S)
        self.request_bucket = TokenBucket(JUDGEMENTS_REFILL, float(MAX_JUDGEMENTS))
        # What the request being judged may make executable (_mismatch): (dev, inode)
        # of the judged files, and whether private anonymous memory was judged.
        self._judged: set[tuple[tuple[int, int], int]] = set()
        self._judged_anon = False
        self._judged_link: str | None = None   # the /proc fd link of a judged mmap
        self._init: int | None = None          # the sandbox's init above the worker
        self._init_known = False

    def fileno(self) -> int:
        return self._fd

    def handle_pending(self, max_requests: int = 16, *,
                       before_judging: Callable[[], object] | None = None) -> list[Verdict]:
        """Answer at most `max_requests` of the requests queued now; never blocks.

        More may be left queued: the listener stays readable, so call again (after
        letting others run). A request refused as too slow to judge ends the call.
        `before_judging` runs after each request is received and before it is judged:
        the place to read the worker's status pipe, since a READY it wrote before the
        syscall is in the pipe by then (and may set `ready`).
        """
        out: list[Verdict] = []
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        received = 0
        while received < max_requests:
            ev = poller.poll(0)
            if not ev or not ev[0][1] & select.POLLIN:
                if ev and ev[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    self.hung_up = True
                return out
            buf = bytearray(_NOTIF.size)  # RECV insists on a zeroed buffer
            received += 1
            try:
                fcntl.ioctl(self._fd, _IOCTL_RECV, buf, True)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):  # the caller died / was interrupted
                    continue
                raise
            req = self._parse(buf)
            if before_judging is not None:
                try:
                    before_judging()
                except BaseException:
                    self._respond(req.id, False)  # never leave a received request unanswered
                    raise
            if (flood := self._flood()) is not None:
                self._respond(req.id, False)
                out.append(Verdict(req, False, flood))
                break
            t0, c0 = time.perf_counter(), _own_cpu()
            verdict, slow = self._answer(req)
            self.busy_s += time.perf_counter() - t0
            cpu = _own_cpu() - c0
            self.cpu_s += cpu
            self.judged += 1
            now = time.monotonic()
            self.cpu_bucket.charge(now, cpu)        # what it cost, known only now
            self.request_bucket.charge(now, 1)
            if verdict is not None:
                out.append(verdict)
            if slow:
                break
        return out

    def _flood(self) -> str | None:
        """Why the next request is refused unjudged: this worker's requests have cost
        more than their buckets hold (a flood), else None."""
        now = time.monotonic()
        if self.request_bucket.level(now) < 1:
            return (f"exec request flood: {self.judged} requests to judge (bucket "
                    f"{self.request_bucket.depth:g}, {JUDGEMENTS_REFILL:g}/s)")
        if self.cpu_bucket.level(now) <= 0:
            return (f"exec request flood: {self.judged} requests took {self.cpu_s:.2f} s "
                    f"of supervisor CPU (bucket {self.cpu_bucket.depth:.1f} s, "
                    f"{JUDGE_CPU_REFILL:g} s/s)")
        return None

    def _answer(self, req: ExecRequest) -> tuple[Verdict | None, bool]:
        """Judge and answer one received request: (verdict, too slow); None if the
        request was gone by the time it was judged. Before READY the whole worker is
        stopped while it is judged and until the kernel's result has been checked."""
        frozen: _Frozen | None = None
        if self.freeze and not self.ready and req.syscall != "memfd_create" \
                and not _alone(req.pid, self._init_of(req.pid), self.opener):
            try:
                frozen = _Frozen.stop(req.pid, time.monotonic() + self.freeze_wall_s,
                                      self._init_of(req.pid), self.opener)
                self.stops += 1
            except (TooSlow, OSError) as e:
                if isinstance(e, OSError) and not self._id_valid(req.id):
                    return None, False            # the caller died: nothing to answer
                self._respond(req.id, False)
                why = str(e) if isinstance(e, TooSlow) else f"cannot stop pid {req.pid}: {e}"
                return Verdict(req, False, why), isinstance(e, TooSlow)
        try:
            allowed, reason, target, slow = self._judge(req)
            req = dataclasses.replace(req, target=target)
            # The tid may have died and been reused while we read /proc: if the
            # request is no longer pending, what we read may describe a stranger.
            if not self._id_valid(req.id):
                return None, False
            if allowed and frozen is not None:
                return self._continue_and_check(req, reason, frozen), False
            self._respond(req.id, allowed)
            return Verdict(req, allowed, reason), slow
        finally:
            if frozen is not None:
                frozen.resume()

    def _init_of(self, tid: int) -> int | None:
        """The sandbox init above the worker (cached: one worker per listener)."""
        if not self._init_known:
            try:
                tgid = int(_status_field(tid, "Tgid", self.opener))
            except (OSError, ValueError):
                return None
            self._init, self._init_known = _sandbox_init(tgid, self.opener), True
        return self._init

    def _continue_and_check(self, req: ExecRequest, reason: str, frozen: _Frozen) -> Verdict:
        """Let the kernel make the call (the rest of the worker is stopped), wait until the
        caller has made it and stopped too, then check what the kernel did: every
        mapping the call made executable is of the file judged (device + inode, never
        the fd number) with only the file's own pages, or anonymous memory where that
        was judged. A mismatch kills the worker while it is still stopped."""
        region = _region(req)
        try:
            if self._judged_link is not None:    # the worker is stopped: still the same file
                with self.opener.link(req.pid, self._judged_link) as link:
                    self._judged.add(_mapped_identity(link))
            before = self._within_budget(lambda budget: set(vmas_between(
                req.pid, *(region or (0, _ADDR_LIMIT)), exec_only=region is None,
                budget=budget, opener=self.opener)))
        except (TooSlow, OSError) as e:
            self._respond(req.id, False)
            return Verdict(req, False, f"cannot read the mappings before the call: {e}")
        self._respond(req.id, True)
        if not frozen.wait_caller(time.monotonic() + self.freeze_wall_s):
            if frozen.caller_gone():
                return Verdict(req, True, reason)
            frozen.kill()
            return Verdict(req, False, f"after the call: pid {frozen.tgid} did not finish it "
                           f"within {self.freeze_wall_s * 1e3:g} ms to be checked (killed)")
        def check(budget: _Budget) -> str | None:       # (the wait is not judging)
            after = vmas_between(req.pid, *(region or (0, _ADDR_LIMIT)),
                                 exec_only=region is None, budget=budget, opener=self.opener)
            return self._mismatch(req.pid, before, after, region, budget)

        try:
            problem = self._within_budget(check)
        except (TooSlow, OSError) as e:
            if frozen.caller_gone():
                return Verdict(req, True, reason)
            problem = f"its result cannot be checked ({e})"
        if problem is None:
            return Verdict(req, True, reason)
        frozen.kill()
        self.mismatches += 1
        return Verdict(req, False, f"after the call: {problem} (killed)")

    def _mismatch(self, pid: int, before: set[Vma], after: list[Vma],
                  region: tuple[int, int] | None, budget: _Budget) -> str | None:
        """What the call made executable that was not what we judged, or None."""
        for v in after:
            if "x" not in v.perms or v in before:
                continue
            where = f"{v.label} at {v.start:#x}-{v.end:#x}"
            if v.kind == "anon" and self._judged_anon and not v.shared:
                continue
            if v.kind != "file":
                return f"{where} became executable, but a file was judged"
            if (v.dev, v.inode) not in self._judged:
                return (f"{where} (device {v.dev[0]}:{v.dev[1]}, inode {v.inode}) became "
                        "executable, not the file judged")
            if "w" in v.perms:
                return f"{where} is writable and executable"
            if not v.shared:
                lo, hi = (max(v.start, region[0]), min(v.end, region[1])) if region else \
                    (v.start, v.end)
                page = _modified_page(pid, lo, hi, budget, self.opener)
                if page is not None:
                    return f"{where}: page {page:#x} is not the file's"
        return None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ExecWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- kernel plumbing --------------------------------------------------------

    def _id_valid(self, nid: int) -> bool:
        try:
            fcntl.ioctl(self._fd, _IOCTL_ID_VALID, struct.pack("=Q", nid))
            return True
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise

    def _respond(self, nid: int, allowed: bool) -> None:
        # CONTINUE is safe here: every watched argument is a plain integer, so the
        # kernel re-reads nothing we could not see (the fd/mapping race is in the
        # module docstring).
        resp = _RESP.pack(nid, 0, 0, _FLAG_CONTINUE) if allowed else _RESP.pack(nid, 0, -errno.EPERM, 0)
        try:
            fcntl.ioctl(self._fd, _IOCTL_SEND, bytearray(resp), True)
        except OSError as e:
            if e.errno != errno.ENOENT:  # died or was interrupted meanwhile
                raise

    @staticmethod
    def _parse(buf: bytearray) -> ExecRequest:
        nid, pid, _flags, nr, arch, _ip, *args = _NOTIF.unpack(buf)
        name = _SYSCALLS.get((arch, nr), f"unknown({arch:#x}:{nr})")
        prot = args[2] if name != "memfd_create" else 0
        mflags, fd = (args[3], ctypes.c_int32(args[4]).value) if name == "mmap" else (0, -1)
        return ExecRequest(nid, pid, name, nr, tuple(args), prot, mflags, fd, None)

    # -- judgement ----------------------------------------------------------------

    def _judge(self, req: ExecRequest) -> tuple[bool, str, str | None, bool]:
        """(allowed, reason, target, too slow)."""
        target: list[str | None] = [None]
        slow = False
        self._judged, self._judged_anon, self._judged_link = set(), False, None

        def judge(budget: _Budget) -> tuple[bool, str]:
            allowed, reason = self._judge_inner(req, target, budget)
            if allowed:
                budget.check()  # an answer that came too late is no answer
            return allowed, reason

        try:
            allowed, reason = self._within_budget(judge)
        except TooSlow as e:
            allowed, reason, slow = False, str(e), True
        except OSError as e:  # the worker vanished under us, or /proc refused: deny
            allowed, reason = False, f"cannot inspect pid {req.pid}: {os.strerror(e.errno or 0)}"
        except (ValueError, struct.error) as e:  # something we cannot parse: deny
            allowed, reason = False, f"cannot judge: {e}"
        return allowed, reason, target[0], slow

    def _within_budget(self, fn: Callable[[_Budget], Any]) -> Any:
        """`fn(budget)`; once more with a fresh budget when only the wall budget ran out,
        with CPU to spare: our own stall (the supervisor stopped or starved while the
        worker waits frozen: red team 10 row 14, an honest control worker refused at
        start), not the worker's doing. A worker holding a lock we wait on meets the
        wall budget again: refused then, after twice the wall budget at most."""
        try:
            return fn(_Budget(self.judge_budget_s, self.judge_wall_s))
        except TooSlow as e:
            if not e.wall_only:
                raise
        return fn(_Budget(self.judge_budget_s, self.judge_wall_s))

    def _judge_inner(self, req: ExecRequest, target: list[str | None],
                     budget: _Budget) -> tuple[bool, str]:
        if req.syscall == "memfd_create":
            if self.ready:
                return False, "memfd_create after READY"
            return True, "memfd_create before READY"
        if req.syscall == "mmap":
            return self._judge_mmap(req, target)
        if req.syscall in ("mprotect", "pkey_mprotect"):
            return self._judge_protect(req, target, budget)
        return False, f"unexpected syscall {req.syscall}"

    def _judge_mmap(self, req: ExecRequest, target: list[str | None]) -> tuple[bool, str]:
        anonymous = bool(req.flags & _MAP_ANONYMOUS) or req.fd < 0
        if not anonymous:
            with self.opener.link(req.pid, f"fd/{req.fd}") as link:
                target[0] = os.readlink(link)
        if self.ready:
            return False, "new executable memory after READY"
        if anonymous:
            if req.flags & _MAP_TYPE != _MAP_PRIVATE:
                return False, "shared anonymous executable memory (another view of it can be writable)"
            if self.allow_anonymous_exec:
                self._judged_anon = True
                return True, "private anonymous executable memory (allowed for this worker)"
            return False, "anonymous executable memory"
        if req.prot & _PROT_WRITE:
            return False, "writable and executable file mapping"
        link = f"fd/{req.fd}"
        ok, why = _code_file(req.pid, link, opener=self.opener)
        if ok:
            self._judged_link = link      # identified only if the result is checked
        return ok, why

    def _judge_protect(self, req: ExecRequest, target: list[str | None],
                       budget: _Budget) -> tuple[bool, str]:
        addr, length = req.args[0], req.args[1]
        if addr % _PAGE:
            return False, f"unaligned address {addr:#x}"
        if length == 0:  # the kernel returns 0 and changes nothing
            target[0] = "[empty]"
            if self.ready:
                return False, "new executable memory after READY"
            return True, "empty range: nothing changes"
        end = addr + -(-length // _PAGE) * _PAGE
        if end >= _ADDR_LIMIT:
            return False, "range beyond the address space"
        try:
            vmas = mappings_in_range(req.pid, addr, end, budget, self.opener)
        except Hole as e:
            target[0] = "[unmapped]"
            if self.ready:
                return False, "new executable memory after READY"
            return False, f"range {addr:#x}-{end:#x} is not entirely mapped ({e})"
        except TooSlow:
            if self.ready:  # the target is only for the log: refused either way
                return False, "new executable memory after READY"
            raise
        names = list(dict.fromkeys(v.label for v in vmas))
        target[0] = ", ".join(names[:_TARGET_NAMES]) + (
            f", ... ({len(names) - _TARGET_NAMES} more)" if len(names) > _TARGET_NAMES else "")
        if self.ready:
            return False, "new executable memory after READY"
        kinds = {v.kind for v in vmas}
        if "shared-anon" in kinds:
            return False, "shared anonymous memory (another view of it can be writable)"
        if "special" in kinds:
            return False, "special mapping " + ", ".join(v.name for v in vmas if v.kind == "special")
        if kinds == {"anon"}:
            if self.allow_anonymous_exec:
                self._judged_anon = True
                return True, "private anonymous executable memory (allowed for this worker)"
            return False, "anonymous executable memory"
        if "anon" in kinds:
            return False, "range mixes anonymous and file-backed memory"
        if req.prot & _PROT_WRITE:
            return False, "writable and executable file mapping"
        mounts = _Mounts(req.pid, self.opener)
        checked: dict[tuple[tuple[int, int], int], tuple[bool, str]] = {}
        for v in vmas:
            # A private file mapping that was ever written may hold copied-on-write
            # pages we never checked: only pristine read-only file pages may turn X.
            if "w" in v.perms:
                return False, f"file mapping {v.name} was modified or is writable"
            if not v.shared:
                cow = _modified_page(req.pid, max(v.start, addr), min(v.end, end), budget,
                                     self.opener)
                if cow is not None:
                    return False, f"file mapping {v.name} was modified or is writable (page {cow:#x})"
            key = (v.dev, v.inode)
            if key not in checked:
                checked[key] = _code_file(req.pid, f"map_files/{v.start:x}-{v.end:x}",
                                          mounts, self.opener)
            ok, why = checked[key]
            if not ok:
                return False, why
            self._judged.add(key)
            budget.check()
        return True, "file mapping from a read-only mount"


# -- /proc readers -------------------------------------------------------------------


def mappings_in_range(pid: int, start: int, end: int, budget: _Budget | None = None,
                      opener: ProcOpener = DIRECT) -> list[Vma]:
    """The mappings of `pid` that cover [start, end), in order; Hole if any page is not mapped.

    Reads only that range (PROCMAP_QUERY) when the kernel can, else /proc/PID/maps up
    to the end of the range. Raises TooSlow past the budget, and for a range spanning
    more than MAX_RANGE_MAPPINGS mappings.
    """
    global _procmap_query_works
    if _procmap_query_works is not False:
        try:
            got = _query(pid, start, end, budget, holes=False, opener=opener)
            _procmap_query_works = True
            return got
        except OSError as e:
            if e.errno not in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP) or _procmap_query_works:
                raise
            _procmap_query_works = False  # an older kernel: read the text instead
    return _maps_range(pid, start, end, budget, opener)


def _too_many(n: int) -> None:
    if n > MAX_RANGE_MAPPINGS:
        raise TooSlow(f"too slow to judge: the range spans more than {MAX_RANGE_MAPPINGS} mappings")


def _query(pid: int, start: int, end: int, budget: _Budget | None, *,
           holes: bool, exec_only: bool = False, opener: ProcOpener = DIRECT) -> list[Vma]:
    """PROCMAP_QUERY over [start, end): one ioctl per mapping. `holes`: a gap ends the
    walk quietly (vmas_between); else it raises Hole (mappings_in_range, a whole range)."""
    name = ctypes.create_string_buffer(_NAME_MAX)
    name_addr = ctypes.addressof(name)
    flags = _PMQ_COVERING_OR_NEXT | (_PMQ_X if exec_only else 0)
    out: list[Vma] = []
    fd = opener.open(pid, "maps")
    try:
        cur = start
        while cur < end:
            buf = bytearray(_PMQ.pack(_PMQ.size, flags, cur, 0, 0, 0, 0, 0, 0,
                                      0, 0, _NAME_MAX, 0, name_addr, 0))
            try:
                fcntl.ioctl(fd, _PROCMAP_QUERY, buf, True)
            except OSError as e:
                if e.errno != errno.ENOENT:  # ENOENT: nothing at or after cur
                    raise
                if holes:
                    break
                raise Hole(cur) from None
            (_sz, _fl, _a, lo, hi, vflags, _psz, offset, inode, major, minor, name_size,
             _bsz, _na, _ba) = _PMQ.unpack(buf)
            if lo >= end and holes:
                break
            if lo > cur and not holes:
                raise Hole(cur)
            perms = ("r" if vflags & _PMQ_R else "-") + ("w" if vflags & _PMQ_W else "-") + \
                    ("x" if vflags & _PMQ_X else "-") + ("s" if vflags & _PMQ_SHARED else "p")
            text = name.raw[: max(name_size - 1, 0)].decode("utf-8", "surrogateescape")
            out.append(Vma(lo, hi, perms, offset, (major, minor), inode, text))
            _too_many(len(out))
            if budget is not None:
                budget.check()
            cur = hi
    finally:
        os.close(fd)
    return out


def _maps_lines(pid: int, budget: _Budget | None, opener: ProcOpener = DIRECT):
    """Each mapping of /proc/PID/maps as a Vma, in order (the text, for older kernels)."""
    with os.fdopen(opener.open(pid, "maps"), encoding="utf-8", errors="surrogateescape") as f:
        for n, line in enumerate(f):
            if budget is not None and n % 256 == 0:
                budget.check()
            fields = line.rstrip("\n").split(None, 5)
            lo_s, _, hi_s = fields[0].partition("-")
            major, _, minor = fields[3].partition(":")
            yield Vma(int(lo_s, 16), int(hi_s, 16), fields[1], int(fields[2], 16),
                      (int(major, 16), int(minor, 16)), int(fields[4]),
                      fields[5] if len(fields) > 5 else "")


def _maps_range(pid: int, start: int, end: int, budget: _Budget | None,
                opener: ProcOpener = DIRECT) -> list[Vma]:
    out: list[Vma] = []
    cur = start
    for v in _maps_lines(pid, budget, opener):
        if v.end <= cur:
            continue
        if v.start > cur:
            raise Hole(cur)
        out.append(v)
        _too_many(len(out))
        cur = v.end
        if cur >= end:
            return out
    raise Hole(cur)


def _modified_page(pid: int, start: int, end: int, budget: _Budget | None = None,
                   opener: ProcOpener = DIRECT) -> int | None:
    """First page in [start, end) of a private file mapping that is not the file's own."""
    fd = opener.open(pid, "pagemap")
    try:
        return first_foreign_page(fd, start, end, budget.check if budget is not None else None)
    finally:
        os.close(fd)


def vmas_between(pid: int, start: int, end: int, *, exec_only: bool = False,
                 budget: _Budget | None = None, opener: ProcOpener = DIRECT) -> list[Vma]:
    """The mappings of `pid` that overlap [start, end), holes allowed (executable ones
    only with `exec_only`): PROCMAP_QUERY where the kernel has it, else the maps text."""
    if _procmap_query_works is not False:
        try:
            return _query(pid, start, end, budget, holes=True, exec_only=exec_only,
                          opener=opener)
        except OSError as e:
            if e.errno not in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                raise
    out = []
    for v in _maps_lines(pid, budget, opener):
        if v.end <= start or (exec_only and "x" not in v.perms):
            continue
        if v.start >= end:
            break
        out.append(v)
        _too_many(len(out))
    return out


def _region(req: ExecRequest) -> tuple[int, int] | None:
    """The addresses a call can change, if its arguments say (mprotect, MAP_FIXED); None
    for an mmap the kernel places: then every executable mapping is compared."""
    addr, length = req.args[0], req.args[1]
    if req.syscall == "mmap" and not req.flags & (_MAP_FIXED | _MAP_FIXED_NOREPLACE):
        return None
    end = addr + -(-length // _PAGE) * _PAGE
    return (addr - addr % _PAGE, min(end, _ADDR_LIMIT - _PAGE)) if length else None


# -- stopping the worker while it is judged ------------------------------------------


def _stat_state(pid: int, tid: int, opener: ProcOpener = DIRECT) -> str | None:
    """The thread's state letter (R, S, D, T, t, Z, X...), None if it is gone."""
    try:
        with os.fdopen(opener.open(pid, f"task/{tid}/stat"), "rb") as f:
            data = f.read()
    except OSError:
        return None
    at = data.rindex(b")") + 2
    return chr(data[at])


def _tasks(pid: int, opener: ProcOpener = DIRECT) -> list[int]:
    try:
        return [int(t) for t in opener.listdir(pid, "task")]
    except OSError:
        return []


def _status_field(pid: int, key: str, opener: ProcOpener = DIRECT) -> str:
    with os.fdopen(opener.open(pid, "status")) as f:
        for ln in f:
            if ln.startswith(key):
                return ln.split(":", 1)[1].strip()
    raise OSError(errno.ENOENT, f"no {key} for pid {pid}")


def _children(pid: int, opener: ProcOpener = DIRECT) -> list[int]:
    out: list[int] = []
    for tid in _tasks(pid, opener):
        try:
            with os.fdopen(opener.open(pid, f"task/{tid}/children")) as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _sandbox_init(tgid: int, opener: ProcOpener = DIRECT) -> int | None:
    """The worker's parent if it is its pid namespace's init (bwrap's): its other
    children could share the worker's memory too (CLONE_PARENT). None otherwise."""
    try:
        parent = int(_status_field(tgid, "PPid", opener))
        with opener.link(parent, "ns/pid") as theirs, opener.link(tgid, "ns/pid") as mine:
            same_ns = os.stat(theirs).st_ino == os.stat(mine).st_ino
        if parent > 1 and same_ns and _status_field(parent, "NSpid", opener).split()[-1] == "1":
            return parent
    except (OSError, ValueError):
        pass
    return None


def _sharers(tgid: int, init: int | None, opener: ProcOpener = DIRECT) -> list[int]:
    """Every other process that could share the worker's memory or files (a clone with
    CLONE_VM or CLONE_FILES but not CLONE_THREAD): its descendants and, in a sandbox,
    its siblings under the sandbox's `init`. Strict domains have none (no new process)."""
    todo = _children(tgid, opener)
    if init is not None:
        todo += [c for c in _children(init, opener) if c != tgid]
    seen: list[int] = []
    while todo and len(seen) < MAX_SHARERS:
        p = todo.pop()
        if p != tgid and p not in seen:
            seen.append(p)
            todo += _children(p, opener)
    return seen


def _alone(caller: int, init: int | None, opener: ProcOpener = DIRECT) -> bool:
    """The caller is the only thread of its process, and no other process could share
    its memory: nothing of the worker can run while the caller waits for our answer (a
    new thread needs a running one), so the kernel acts on exactly what we judge, and
    there is nothing to stop (most of start-up: the interpreter's imports)."""
    return _tasks(caller, opener) == [caller] and not _sharers(caller, init, opener)


class _Frozen:
    """The worker stopped (SIGSTOP to its thread group and any process that could share
    its memory) while one request of it is judged. Every thread but the caller must be
    in stopped state before the judgement starts: the caller itself waits in the
    kernel, killably (SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV), so SIGSTOP cannot end
    its wait; a thread the kernel creates meanwhile joins the stop. Nothing of the
    worker runs between our look and the kernel's act, and after CONTINUE the caller
    stops on its way back to user space, so its result is read before any of the
    worker's code runs again."""

    def __init__(self, tgid: int, caller: int, procs: list[int],
                 opener: ProcOpener = DIRECT) -> None:
        self.tgid, self.caller, self.procs = tgid, caller, procs
        self.opener = opener
        self.killed = False

    @classmethod
    def stop(cls, caller: int, deadline: float, init: int | None,
             opener: ProcOpener = DIRECT) -> _Frozen:
        tgid = int(_status_field(caller, "Tgid", opener))
        procs = [tgid, *_sharers(tgid, init, opener)]
        for p in procs:
            # To each thread: a process-directed SIGSTOP wakes one thread to start the
            # group stop, and that may be the caller, whose killable wait ignores it.
            for tid in _tasks(p, opener) or [p]:
                opener.tgkill(p, tid, signal.SIGSTOP)
        frozen = cls(tgid, caller, procs, opener)
        try:
            frozen._wait(lambda: frozen._running(), deadline,
                         lambda t: f"too slow to judge: thread {t} of pid {tgid} did not stop "
                         f"(state {_stat_state(tgid, t, opener)}, caller {caller})")
        except BaseException:
            frozen.resume()
            raise
        return frozen

    def _running(self) -> int | None:
        """A thread that is not (provably) stopped, or None once every one is.

        Two passes: every thread stopped in both, with the same CPU time and slice
        count (/proc/.../schedstat) and no thread more or less. A thread stopped when we
        read it may be woken later by one we read after it (SIGCONT, then SIGSTOP to
        itself: red team); if none ran between the passes, there was an instant when
        all were stopped, and from then on nothing of the worker can wake any of it."""
        first = self._fingerprint()
        if isinstance(first, int):
            return first
        second = self._fingerprint()
        if isinstance(second, int):
            return second
        if first != second:
            return next((t for t in set(first) ^ set(second)), None) or next(
                t for t in first if first[t] != second.get(t))
        return None

    def _fingerprint(self) -> dict[int, str] | int:
        """tid -> its schedstat, if every thread but the caller is stopped; else a tid
        that is not."""
        out: dict[int, str] = {}
        for p in self.procs:
            for tid in _tasks(p, self.opener):
                if tid == self.caller:
                    continue
                state = _stat_state(p, tid, self.opener)
                if state is None or state in ("Z", "X"):
                    continue
                if state not in _STOPPED:
                    return tid
                try:
                    with os.fdopen(self.opener.open(p, f"task/{tid}/schedstat")) as f:
                        out[tid] = f.read()
                except OSError:
                    continue
        return out

    @staticmethod
    def _wait(running: Callable[[], int | None], deadline: float,
              why: Callable[[int], str]) -> None:
        # Short, even naps: a stop takes the worker's threads a scheduling round or
        # two; doubling naps waited out milliseconds after it (start-up: 2.8 -> 0.x ms
        # per judgement).
        polls = 0
        while (tid := running()) is not None:
            if time.monotonic() > deadline:
                raise TooSlow(why(tid))
            polls += 1
            time.sleep(_NAP_S if polls < 200 else 1e-3)

    def wait_caller(self, deadline: float) -> bool:
        """Until the caller has made the call and stopped (or died); False past deadline."""
        def running() -> int | None:
            state = _stat_state(self.tgid, self.caller, self.opener)
            return None if state is None or state in _STOPPED else self.caller
        try:
            self._wait(running, deadline, str)
        except TooSlow:
            return False
        return True

    def caller_gone(self) -> bool:
        return _stat_state(self.tgid, self.caller, self.opener) in (None, "Z", "X")

    def kill(self) -> None:
        self.killed = True
        for p in self.procs:
            try:
                self.opener.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def resume(self) -> None:
        if self.killed:
            return                 # stays stopped until the kill lands: its code never runs
        for p in self.procs:
            try:
                self.opener.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


class _Mounts:
    """The worker's mount table (its own /proc/PID/mountinfo), read once per judgement."""

    def __init__(self, pid: int, opener: ProcOpener = DIRECT) -> None:
        self.pid = pid
        self.opener = opener
        self._rows: list[tuple[int, tuple[int, int], str, bool]] | None = None

    @property
    def rows(self) -> list[tuple[int, tuple[int, int], str, bool]]:
        """(mount id, (major, minor), mount point, writable)."""
        if self._rows is None:
            rows = []
            with os.fdopen(self.opener.open(self.pid, "mountinfo")) as f:
                for ln in f:
                    fields = ln.split()
                    sep = fields.index("-", 6)
                    major, _, minor = fields[2].partition(":")
                    per_mount = fields[5].split(",")
                    per_sb = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
                    rows.append((int(fields[0]), (int(major), int(minor)), fields[4],
                                 "ro" not in per_mount and "ro" not in per_sb))
            self._rows = rows
        return self._rows


_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _mapped_identity(link: str) -> tuple[tuple[int, int], int]:
    """(device, inode) that a mapping of the file behind `link` shows in maps: the
    kernel's identity of it, which is not always what fstat says (an overlay maps its
    lower file). Found by mapping one page of it here, read-only, for a moment."""
    fd = os.open(link, os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = _libc.mmap(None, _PAGE, 0x1, _MAP_PRIVATE, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {link} to identify it")
    finally:
        os.close(fd)
    try:
        [v] = vmas_between(os.getpid(), addr, addr + _PAGE)
        return v.dev, v.inode
    finally:
        _libc.munmap(addr, _PAGE)


def _code_file(pid: int, name: str, mounts: _Mounts | None = None,
               opener: ProcOpener = DIRECT) -> tuple[bool, str]:
    """May the file behind /proc/PID/<name> (a magic link: fd/N, map_files/A-B) be
    mapped executable?

    Only a regular file with a name, reached through a read-only mount of the worker,
    on a device that no mount of the worker can write (a writable bind of the same
    filesystem elsewhere would reach the same file).
    """
    with opener.link(pid, name) as link:
        fd = os.open(link, os.O_PATH | os.O_CLOEXEC)  # follows the magic link to the file
        try:
            st = os.fstat(fd)
            name = os.readlink(link)
            if not stat.S_ISREG(st.st_mode):
                return False, f"{name} is not a regular file"
            if name.startswith("/memfd:"):
                return False, f"{name} is a memfd"
            if st.st_nlink == 0:
                return False, f"{name} is deleted"
            # Our own fdinfo for this O_PATH fd names the mount the worker reached it by.
            with open(f"/proc/self/fdinfo/{fd}") as f:
                mnt_id = next(int(ln.split()[1]) for ln in f if ln.startswith("mnt_id:"))
        finally:
            os.close(fd)
    rows = (mounts or _Mounts(pid, opener)).rows
    mine = next((r for r in rows if r[0] == mnt_id), None)
    if mine is None:
        return False, f"{name} is on a mount the worker cannot see"
    if mine[3]:
        return False, f"{name} is on a writable mount"
    also = [r[2] for r in rows if r[1] == mine[1] and r[3]]
    if also:
        return False, f"{name} is on a device the worker can write through {also[0]}"
    return True, f"{name} on a read-only mount"


def writable_executable_mappings(pid: int, opener: ProcOpener = DIRECT) -> list[str]:
    """The /proc/PID/maps lines of `pid` that are writable and executable at once.

    The watch only sees requests for new executable memory: code can still be
    written, without any syscall, into a W+X mapping that already exists at READY
    (tinygrad's CPU runtime maps one per kernel when anonymous exec is allowed).
    Worth checking when the supervisor accepts READY.
    """
    with os.fdopen(opener.open(pid, "maps")) as f:
        return [ln.rstrip("\n") for ln in f if ln.split()[1].startswith("rwx")]
