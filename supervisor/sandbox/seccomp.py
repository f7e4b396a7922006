"""Seccomp filters for sandboxed workers (libseccomp via pyseccomp).

Three filters, all default-ALLOW deny-lists (no allow-list yet):

* launch     - compiled here in the supervisor, handed to bwrap (--seccomp FD)
               and active from the worker's first instruction. Everything
               except the execve ban: the interpreter still has to start.
* runtime    - `lock_down(domain)`, called by the trusted runner before the
               worker module is imported; for strict domains it adds the
               execve/execveat ban and the ban on new processes (fork, vfork,
               clone without CLONE_THREAD: EPERM, see PROCESS_DENY). Filters stack,
               so the launch rules stay.
* exec watch - `install_exec_watch()`, strict domains, right after lock_down:
               every request for new executable memory (mmap/mprotect/
               pkey_mprotect with PROT_EXEC) and every memfd_create goes to the
               supervisor as a user notification (see execwatch.py), which
               allows file-backed code from read-only mounts during start-up
               and nothing once the worker is READY.

Denials kill. In a strict domain a forbidden call is an attack or a bug, and an
EPERM that a library swallows would hide it, so they end the whole process
(SECCOMP_RET_KILL_PROCESS, seen by the supervisor as SIGSYS). The research
domain keeps EPERM for the generic list, but the calls that would let a channel
reader make itself a writer (chmod/chown/xattr writes) kill there too, and so does
everything `network = false` forbids, in every profile (`_deny_outside`). One
exception: a new process after lock-down is refused with EPERM (PROCESS_DENY).

Precedence across stacked filters is KILL > TRAP > ERRNO > USER_NOTIF > ALLOW:
neither the launch nor the runtime filter may touch mmap, mprotect,
pkey_mprotect or memfd_create, or the exec watch would never see them.

pyseccomp is imported lazily: the supervisor and the probe must be importable
without it, but a strict domain must never run unfiltered -> we raise.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import socket
import threading
import warnings
from typing import Any

from . import ldcache
from .policy import RESEARCH

# Dangerous in any domain: debugging/tracing other processes, kernel code and
# modules, eBPF, namespace and mount manipulation (incl. the new mount API),
# keyrings, io_uring (it can open sockets behind seccomp's back), and a few
# admin calls. Most already need capabilities we drop; this is depth.
# modify_ldt needs no capability at all: any worker could install its own x86 code
# and data segments (16/32-bit code, the espfix and LDT bugs of the past); nothing
# we run uses it (red team: it returned 0 in both domains). Absent on aarch64.
BASE_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "userfaultfd", "perf_event_open",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "acct", "swapon", "swapoff", "reboot", "syslog",
    "quotactl", "lookup_dcookie", "vhangup", "iopl", "ioperm", "uselib", "modify_ldt",
)
# inotify and fanotify: another domain's activity, read off shared read-only files.
WATCH_DENY = ("inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
              "fanotify_mark")
# Inside its user namespace a worker owns the inodes of the channel memfds it was
# handed: a mode change, an owner change or a POSIX ACL (system.posix_acl_access is
# an xattr) would let a reader re-open a read-only channel for writing. These kill
# in strict domains. Research kills the fd-based ones (the attack on a channel fd it
# holds) and gets EPERM for the path-based ones: linkers chmod their output, and
# research may compile. Its host uid is a stranger to the channel inodes anyway.
FILE_META_FD = ("fchmod", "fchown", "fsetxattr", "fremovexattr")
FILE_META_DENY = (
    "chmod", "fchmod", "fchmodat", "fchmodat2",
    "chown", "fchown", "lchown", "fchownat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "setxattrat", "removexattrat",
)
EXEC_DENY = ("execve", "execveat")
# Process creation, with exec (the runtime filter: "must not start processes after
# start-up"): fork, vfork, and clone without CLONE_THREAD (posix_spawn, subprocess).
# Threads stay (clone with CLONE_THREAD, which needs CLONE_VM: the same process).
# Why (red team): a forked child that made a forbidden call died alone, unseen by the
# supervisor, so a hostile worker could map its filter call by call without a trace;
# with no child, every forbidden call is the worker's own and kills it, logged. A child
# would also be a process the supervisor does not watch.
# EPERM, the one denial that does not kill: a failed fork gains an attacker nothing
# (no child exists), while the standard library shells out for lookups and falls back
# when it cannot (platform.platform, platform.processor, ctypes.util.find_library: a kill
# there would end a worker for logging its platform; red team).
PROCESS_DENY = ("fork", "vfork")
_CLONE_THREAD = 0x00010000
# Strict domains, runtime: the calls that can carry a descriptor out (SCM_RIGHTS).
FD_SEND_DENY = ("sendmsg", "sendmmsg")
# Strict domains only: remap_file_pages is deprecated and only reshuffles pages
# inside an existing mapping; nothing we run needs it.
STRICT_DENY = ("remap_file_pages",)

# Watched by install_exec_watch (PROT_EXEC in arg 2 for the first three).
EXEC_WATCH_PROT = ("mmap", "mprotect", "pkey_mprotect")
EXEC_WATCH_ANY = ("memfd_create",)

# Syscalls newer than the installed libseccomp (2.5.4 knows neither). From 424
# on, x86-64 and the generic table (aarch64) share numbers.
_FALLBACK_NR = {"open_tree_attr": 467, "setxattrat": 463, "removexattrat": 466,
                "fchmodat2": 452}
_SHARED_TABLE_ARCHES = ("x86_64", "aarch64")

# clone() flags that create namespaces (CLONE_NEWTIME overlaps CSIGNAL for
# clone(), so it is only reachable via clone3/unshare, which we block).
_CLONE_NS_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
# futex(2) ops that take a priority-inheriting lock (FUTEX_CMD_MASK drops the
# private and clock flags): LOCK_PI, UNLOCK_PI, TRYLOCK_PI, WAIT_REQUEUE_PI,
# CMP_REQUEUE_PI, LOCK_PI2.
_FUTEX_CMD_MASK = 0x7F
_FUTEX_PI_OPS = (6, 7, 8, 11, 12, 13)
_PERSONALITY_QUERY = 0xFFFFFFFF  # personality(0xffffffff) only reads the persona
_SHM_EXEC = 0o100000
_SOCK_TYPE_MASK = 0xF
_UNIX_CONNECTED = (socket.SOCK_STREAM, socket.SOCK_SEQPACKET)   # the AF_UNIX types kept
_PROT_EXEC = 0x4

_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39

# seccomp(2) for the exec watch (libseccomp keeps one process-global listener fd
# and would not let us pick the flags, so we load the exported BPF ourselves).
_NR_SECCOMP = {"x86_64": 317, "aarch64": 277}
_SECCOMP_SET_MODE_FILTER = 1
_FLAG_TSYNC = 1 << 0
_FLAG_NEW_LISTENER = 1 << 3
_FLAG_TSYNC_ESRCH = 1 << 4
_FLAG_WAIT_KILLABLE_RECV = 1 << 5

_lock = threading.Lock()
_installed: set[str] = set()  # domains whose runtime filter this process holds


class SeccompUnavailableError(RuntimeError):
    """libseccomp / pyseccomp cannot be loaded: refuse to run unfiltered."""


def _pyseccomp() -> Any:
    try:
        import pyseccomp  # raises RuntimeError itself if libseccomp.so is absent
    except (ImportError, RuntimeError, OSError) as exc:
        raise SeccompUnavailableError(
            "seccomp unavailable: need libseccomp2 (apt: libseccomp2) and "
            f"pyseccomp (pip: pyseccomp>=0.1.2): {exc!r}"
        ) from exc
    return pyseccomp


def _nr(sc: Any, name: str) -> int:
    nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
    if nr < 0 and platform.machine() in _SHARED_TABLE_ARCHES:
        nr = _FALLBACK_NR.get(name, -1)
    return nr


def _add(sc: Any, flt: Any, action: int, name: str, *args: Any) -> None:
    nr = _nr(sc, name)
    if nr < 0:  # __NR_SCMP_ERROR: this arch has no such syscall (iopl on aarch64...)
        return
    flt.add_rule(action, nr, *args)


def build_filter(domain: str, *, stage: str, network: bool = False, lib: Any = None) -> Any:
    """Return a pyseccomp.SyscallFilter for `domain` at `stage`.

    stage: "launch" (bwrap installs it before exec) or "runtime" (lock_down).
    The runtime filter repeats the launch rules, so a worker launched without
    a launch filter still ends up with the full set. `lib`: pyseccomp or a stand-in
    with its API (the audit passes one that records the rules instead of compiling).
    """
    if stage not in ("launch", "runtime"):
        raise ValueError(f"unknown seccomp stage {stage!r}")
    sc = lib or _pyseccomp()
    strict = domain != RESEARCH
    flt = sc.SyscallFilter(sc.ALLOW)
    # Required for unprivileged seccomp; also what bwrap sets.
    flt.set_attr(sc.Attr.CTL_NNP, 1)
    # Foreign-arch syscalls (int 0x80, x32) skip every rule below: kill the
    # process, not just the thread (a killed thread leaves a zombie behind and
    # the rest of the worker running).
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)

    kill = sc.KILL_PROCESS
    deny = kill if strict else sc.ERRNO(errno.EPERM)
    for name in BASE_DENY:
        _add(sc, flt, deny, name)
    for bit in _CLONE_NS_FLAGS:
        _add(sc, flt, deny, "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
    # clone3 takes a struct pointer seccomp cannot inspect; ENOSYS makes
    # glibc fall back to clone(), whose flags we can check (as Docker does).
    _add(sc, flt, sc.ERRNO(errno.ENOSYS), "clone3")
    # Channel segments allow sealing (the bridge's own Writer may seal), so a worker
    # could seal its actuation segment against new writable mappings and the
    # supervisor's last word could not be written (red team round 3). No worker seals.
    _add(sc, flt, sc.ERRNO(errno.EPERM), "fcntl", sc.Arg(1, sc.EQ, fcntl.F_ADD_SEALS))
    # File-change notification on what a sandbox can read: the project's code and its
    # __pycache__, bound read-only into both domains, told research when control's
    # workers (re)started, 5 of 6 times within 0.25 s (red team 13 row 2). No worker
    # watches files; EPERM, so a library that tries goes on without.
    for name in WATCH_DENY:
        _add(sc, flt, sc.ERRNO(errno.EPERM), name)
    _add(sc, flt, sc.ERRNO(errno.EPERM), "fcntl", sc.Arg(1, sc.EQ, fcntl.F_NOTIFY))
    # The runner exits 0..127 and a sandbox's init reports a signal as 128+N: a worker
    # exiting with a status of 128 or more would forge a kill in the log (red team
    # round 3: "killed by SIGKILL" for a worker nobody killed). Such an exit is a
    # forbidden call here: killed by seccomp, which is then what the log says.
    for name in ("exit", "exit_group"):
        _add(sc, flt, kill, name, sc.Arg(0, sc.MASKED_EQ, 0x80, 0x80))
    for name in FILE_META_DENY:
        _add(sc, flt, kill if strict or name in FILE_META_FD else sc.ERRNO(errno.EPERM), name)

    if strict:
        for name in STRICT_DENY:
            _add(sc, flt, kill, name)
        # READ_IMPLIES_EXEC (or any persona change) would turn later PROT_READ
        # mappings executable behind the exec watch. Compared on all 64 bits:
        # glibc passes the query as 0xffffffff.
        _add(sc, flt, kill, "personality", sc.Arg(0, sc.NE, _PERSONALITY_QUERY))
        # What would stretch a real-time worker's RT budget (sandbox/sched.py; red
        # team): a PI futex lends the SCHED_FIFO thread's priority to a normal thread,
        # and a boosted task is never throttled (0.95 of a CPU at a 10 % budget); the
        # budget is per CPU, so a thread moving itself from CPU to CPU multiplies it
        # (0.185 at 10 % on 2 CPUs). Nothing we run takes PI locks or sets affinity.
        for op in _FUTEX_PI_OPS:
            _add(sc, flt, kill, "futex", sc.Arg(1, sc.MASKED_EQ, _FUTEX_CMD_MASK, op))
        _add(sc, flt, kill, "sched_setaffinity")
        # SysV shm attached executable = new executable memory without PROT_EXEC.
        _add(sc, flt, kill, "shmat", sc.Arg(2, sc.MASKED_EQ, _SHM_EXEC, _SHM_EXEC))
        # A strict domain never has a network (policy.py refuses it), so the
        # no-network rules below always apply; the datagram ban is kept for a
        # hand-made strict filter with network=True too.
        if network:
            _deny_unix_datagrams(sc, flt, kill)
    if not network:
        _deny_outside(sc, flt, kill)
    if stage == "runtime":
        # The runtime filter is what `exec_after_start = false` means, whatever the
        # syscall class: a research domain tightened that way loses exec and new
        # processes too.
        for name in EXEC_DENY:
            _add(sc, flt, kill, name)
        no_process = sc.ERRNO(errno.EPERM)
        for name in PROCESS_DENY:
            _add(sc, flt, no_process, name)
        _add(sc, flt, no_process, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
        if strict:
            # No descriptor leaves a strict worker: SCM_RIGHTS rides only on sendmsg
            # and sendmmsg (io_uring and pidfd_getfd are denied above), whose msghdr
            # seccomp cannot read, and nothing of ours sends with them once started
            # (the runner hands the exec watch's listener over before this filter;
            # the bridge wakes readers with send/write). Red team round 6 row 0b: a
            # control writer sent its read-write segment over a research reader's
            # wake-up socket and died; research then wrote control's actuation
            # channel after the SAFE (89 engaged commands).
            for name in FD_SEND_DENY:
                _add(sc, flt, kill, name)
    return flt


def _deny_unix_datagrams(sc: Any, flt: Any, action: int) -> None:
    """No AF_UNIX socket of a kind whose sendmsg honours an address.

    An unconnected (or even a connected) AF_UNIX datagram socket can send to any
    socket path it can see (journald, a host daemon whose directory is bound into
    the sandbox) with sendmsg, whose msghdr is a pointer seccomp cannot read. Stream
    sockets refuse an address in sendmsg (EOPNOTSUPP/EISCONN) and seqpacket ignores
    it, so those two stay (channels, status and exec-watch sockets are both kinds).
    Every other type number is refused, not just SOCK_DGRAM: the kernel makes
    AF_UNIX SOCK_RAW a datagram socket (red team)."""
    for kind in range(_SOCK_TYPE_MASK + 1):
        if kind in _UNIX_CONNECTED:
            continue
        _add(sc, flt, action, "socket", sc.Arg(0, sc.EQ, socket.AF_UNIX),
             sc.Arg(1, sc.MASKED_EQ, _SOCK_TYPE_MASK, kind))
        _add(sc, flt, action, "socketpair", sc.Arg(1, sc.MASKED_EQ, _SOCK_TYPE_MASK, kind))


def _deny_outside(sc: Any, flt: Any, action: int) -> None:
    """`network = false`, in every profile: nothing outside the sandbox can be reached.

    What can still reach out of a sandbox with its own empty network namespace is
    a socket family that is not namespaced (AF_VSOCK to the hypervisor, some netlink
    families, ...) and a pathname unix socket of the host that a bind made visible
    (a service socket inside an `extra_ro_binds` directory: a read-only mount does
    not stop connect). Abstract unix names are per network namespace and Landlock
    scopes them as well (landlock.py). So:

    * socket() of any family but AF_UNIX, and socketpair() of any family but
      AF_UNIX (AF_TIPC has one), kill.
    * connect() kills, whatever the address. Seccomp sees only the pointer, so it
      cannot tell a host socket from one the sandbox made itself; nothing we run
      connects inside its own sandbox (channels come as inherited fds and
      socketpairs), and a kill is an exit event naming the worker, where an EPERM
      or EACCES would be swallowed by a library without a trace. Landlock's
      RESOLVE_UNIX right (ABI 9, Linux 7.1) could make the finer cut (allow
      sockets created in the sandbox) but answers EACCES, unseen by the
      supervisor, and this kernel line has ABI 7: landlock.py adds it as depth
      where the kernel has it, this rule stays the one that reports.
    * sendto() with an address kills (argument 4 is a plain register).
    * sendmsg()/sendmmsg() with an address cannot be judged (the address is in a
      msghdr behind a pointer): instead no socket that would honour one can
      exist, i.e. no AF_UNIX datagram socket (`_deny_unix_datagrams`).
    glibc tries nscd's socket for passwd/group/hosts look-ups: the policy sets
    USER/LOGNAME/HOME so that Python never asks (policy.py), and research workers
    (torch, datasets) start and run under this rule (tests/test_attacks_net.py).
    """
    _add(sc, flt, action, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    _add(sc, flt, action, "socketpair", sc.Arg(0, sc.NE, socket.AF_UNIX))
    _add(sc, flt, action, "connect")
    _add(sc, flt, action, "sendto", sc.Arg(4, sc.NE, 0))
    _deny_unix_datagrams(sc, flt, action)


def launch_filter_fd(domain: str, network: bool = False) -> int:
    """Compile the launch filter to BPF in a memfd for bwrap --seccomp.

    The fd is CLOEXEC; pass it via Popen(pass_fds=...) and close it after spawn.
    """
    flt = build_filter(domain, stage="launch", network=network)
    fd = os.memfd_create(f"seccomp-{domain}", os.MFD_CLOEXEC)
    try:
        flt.export_bpf(_Fileno(fd))
        os.lseek(fd, 0, os.SEEK_SET)  # bwrap reads from the current offset
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Fileno:
    """pyseccomp's export_bpf wants an object with fileno()."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


def set_no_new_privs() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(e)}")
    if libc.prctl(_PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1:
        raise OSError(errno.EPERM, "no_new_privs did not stick")


def lock_down(domain: str, *, network: bool = False, required: bool = True) -> bool:
    """Install the runtime filter for `domain` in this (worker) process.

    Call once start-up is finished (imports done, threads may exist: the
    filter is synchronised to all threads). Returns True if a filter was
    installed now, False if this domain's filter was already in place.
    Raises SeccompUnavailableError if libseccomp is missing; for research
    workers `required=False` downgrades that to a warning. Strict domains
    always raise.
    """
    strict = domain != RESEARCH
    with _lock:
        if domain in _installed:
            return False
        try:
            flt = build_filter(domain, stage="runtime", network=network)
        except SeccompUnavailableError:
            if strict or required:
                raise
            warnings.warn(f"seccomp unavailable; research worker {domain!r} runs unfiltered")
            return False
        sc = _pyseccomp()
        # Apply to every thread (BLAS pools, trio's thread cache...), not
        # only the caller; load() fails rather than partially applying.
        flt.set_attr(sc.Attr.CTL_TSYNC, 1)
        set_no_new_privs()
        # Library lookups that would run ldconfig (trio's import does) are answered
        # from the linker's cache: no process can be started from here on.
        ldcache.install()
        flt.load()
        _installed.add(domain)
        return True


def installed_domains() -> frozenset[str]:
    return frozenset(_installed)


def build_exec_watch_filter(lib: Any = None) -> Any:
    """The exec-watch filter: USER_NOTIF for new executable memory and memfds. `lib`: as
    build_filter's."""
    sc = lib or _pyseccomp()
    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in EXEC_WATCH_PROT:
        _add(sc, flt, sc.NOTIFY, name, sc.Arg(2, sc.MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
    for name in EXEC_WATCH_ANY:
        _add(sc, flt, sc.NOTIFY, name)
    return flt


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_exec_watch() -> int:
    """Load the exec-watch filter on every thread; return its listener fd (CLOEXEC).

    Send the fd to the supervisor (socket.send_fds) and close this copy at once:
    whoever holds the listener answers the notifications, and a worker that kept
    it could approve its own requests. Until the supervisor answers, a watched
    call blocks; if every copy of the listener is closed, watched calls fail with
    ENOSYS. Raises OSError if the kernel lacks user notification / TSYNC_ESRCH
    (Linux < 5.7) rather than running unwatched.
    """
    flt = build_exec_watch_filter()
    fd = os.memfd_create("seccomp-exec-watch", os.MFD_CLOEXEC)
    try:
        flt.export_bpf(_Fileno(fd))
        size = os.lseek(fd, 0, os.SEEK_CUR)
        os.lseek(fd, 0, os.SEEK_SET)
        prog = os.read(fd, size)
    finally:
        os.close(fd)
    if not prog or len(prog) % 8:
        raise OSError(errno.EINVAL, f"exported BPF has odd size {len(prog)}")
    nr = _NR_SECCOMP.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"no seccomp syscall number for {platform.machine()}")
    set_no_new_privs()
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # TSYNC with NEW_LISTENER needs TSYNC_ESRCH (otherwise the return value
    # would be ambiguous: a listener fd or a thread id that failed to sync).
    # WAIT_KILLABLE_RECV (5.19+): once the supervisor has read a request, only
    # a fatal signal interrupts the waiting thread, so a signal cannot make it
    # re-issue (and the supervisor re-judge) the same call.
    base = _FLAG_TSYNC | _FLAG_TSYNC_ESRCH | _FLAG_NEW_LISTENER
    for flags in (base | _FLAG_WAIT_KILLABLE_RECV, base):
        ret = libc.syscall(ctypes.c_long(nr), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                           ctypes.c_long(flags), ctypes.byref(fprog))
        if ret >= 0:
            return int(ret)
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            break
    raise OSError(err, f"seccomp(SET_MODE_FILTER, NEW_LISTENER|TSYNC): {os.strerror(err)}")
