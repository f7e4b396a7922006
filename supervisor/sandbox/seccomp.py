"""Seccomp filters for sandboxed workers (libseccomp via pyseccomp).

Two stages, both default-ALLOW deny-lists (no allow-list yet):

* launch  - compiled here in the supervisor, handed to bwrap (--seccomp FD)
            and active from the worker's first instruction. Everything
            except the execve ban: the interpreter still has to start.
* runtime - `lock_down(domain)`, called by the worker itself once its
            imports are done; for strict (control) domains it adds the
            execve/execveat ban. Filters stack, so the launch rules stay.

pyseccomp is imported lazily: the supervisor and the probe must be importable
without it, but a strict domain must never run unfiltered -> we raise.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
import warnings
from typing import Any

from .policy import RESEARCH

# Dangerous in any domain: debugging/tracing other processes, kernel code and
# modules, eBPF, namespace and mount manipulation (incl. the new mount API),
# keyrings, io_uring (it can open sockets behind seccomp's back), and a few
# admin calls. Most already need capabilities we drop; this is depth.
BASE_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "userfaultfd", "perf_event_open",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "acct", "swapon", "swapoff", "reboot", "syslog",
    "quotactl", "lookup_dcookie", "vhangup", "iopl", "ioperm", "uselib",
    # Inside its user namespace a worker owns the inodes of the channel memfds it was
    # handed: chmod would let a reader re-open a read-only channel for writing.
    "chmod", "fchmod", "fchmodat", "fchmodat2",
)
EXEC_DENY = ("execve", "execveat")

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

_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39

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


def _add(sc: Any, flt: Any, action: int, name: str, *args: Any) -> None:
    nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
    if nr == -1:  # __NR_SCMP_ERROR: libseccomp too old to know this name
        return
    flt.add_rule(action, nr, *args)


def build_filter(domain: str, *, stage: str, network: bool = False) -> Any:
    """Return a pyseccomp.SyscallFilter for `domain` at `stage`.

    stage: "launch" (bwrap installs it before exec) or "runtime" (lock_down).
    """
    if stage not in ("launch", "runtime"):
        raise ValueError(f"unknown seccomp stage {stage!r}")
    sc = _pyseccomp()
    strict = domain != RESEARCH
    flt = sc.SyscallFilter(sc.ALLOW)
    # Required for unprivileged seccomp; also what bwrap sets. Foreign-arch
    # syscalls (int 0x80 / x32) hit the default bad-arch action: KILL.
    flt.set_attr(sc.Attr.CTL_NNP, 1)

    eperm = sc.ERRNO(errno.EPERM)
    for name in BASE_DENY:
        _add(sc, flt, eperm, name)
    for bit in _CLONE_NS_FLAGS:
        _add(sc, flt, eperm, "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
    # clone3 takes a struct pointer seccomp cannot inspect; ENOSYS makes
    # glibc fall back to clone(), whose flags we can check (as Docker does).
    _add(sc, flt, sc.ERRNO(errno.ENOSYS), "clone3")

    if strict and not network:
        # Only AF_UNIX; EAFNOSUPPORT reads as "family not built in" to libraries.
        _add(sc, flt, sc.ERRNO(errno.EAFNOSUPPORT), "socket",
             sc.Arg(0, sc.NE, socket.AF_UNIX))
    if strict and stage == "runtime":
        for name in EXEC_DENY:
            _add(sc, flt, eperm, name)
    return flt


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
        flt.load()
        _installed.add(domain)
        return True


def installed_domains() -> frozenset[str]:
    return frozenset(_installed)
