"""Read (or signal) a sandbox of another host user without CAP_SYS_PTRACE,
CAP_DAC_READ_SEARCH or CAP_KILL: in a thread of its own that takes the sandbox's host
uid/gid as its *effective* ids.

Why this works (measured, kernel 6.18; see tests/test_units.py): the kernel checks
/proc/PID/{maps,fd,fdinfo,ns,root,...} with ptrace_may_access(PTRACE_MODE_READ_FSCREDS):
the caller's fsuid/fsgid must equal the target's ids, and (commoncap) the caller must be
in the target's user namespace or hold CAP_SYS_PTRACE there. A process whose euid owns
the sandbox's user namespace (bwrap created it as that host user) has every capability
in it, so a thread with euid = the sandbox's host uid passes both, and /proc/PID/fd
(mode 0500, owned by that uid) opens without DAC overrides. kill() accepts a sender
whose euid equals the target's uid. Only /proc/PID/map_files needs a capability in the
initial namespace: CAP_CHECKPOINT_RESTORE (or CAP_SYS_ADMIN), which the thread raises
again from its permitted set after the switch (changing euid from 0 clears the
effective set, not the permitted one while the real and saved uids stay 0).

Credentials are per thread in the kernel; glibc's setresuid() changes every thread of
the process, so the switch uses the raw system calls, in a thread that is started for
one call and ends with it: the supervisor's other threads never change identity and
nothing has to be switched back. Needs CAP_SETUID and CAP_SETGID (which the supervisor
holds anyway to start sandboxes as their domain users).
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

CAP_SYS_PTRACE = 19
CAP_CHECKPOINT_RESTORE = 40
_CAP_V3 = 0x20080522
# System call numbers (the ones used here differ between the two vehicle ABIs).
_NR = {"x86_64": {"setresuid": 117, "setresgid": 119, "capget": 125, "capset": 126},
       "aarch64": {"setresuid": 147, "setresgid": 149, "capget": 90, "capset": 91}}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(name: str, *args: Any) -> None:
    nrs = _NR.get(platform.machine())
    if nrs is None:
        raise OSError(f"per-thread credentials: no system call table for {platform.machine()}")
    if _libc.syscall(ctypes.c_long(nrs[name]), *args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")


def effective_capabilities() -> int:
    """This thread's effective capability mask."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def can_read_any_proc() -> bool:
    """True when this thread reads every process's /proc as it is (CAP_SYS_PTRACE)."""
    return bool(effective_capabilities() >> CAP_SYS_PTRACE & 1)


def _caps() -> tuple[Any, tuple[int, ...]]:
    """(capget header, (eff0, perm0, inh0, eff1, perm1, inh1)) of this thread."""
    hdr = ctypes.create_string_buffer(struct.pack("Ii", _CAP_V3, 0))
    data = ctypes.create_string_buffer(24)
    _syscall("capget", hdr, data)
    return hdr, struct.unpack("6I", data.raw)


def _set_effective(hdr: Any, words: tuple[int, ...], eff: int) -> None:
    """This thread's effective set to ``eff`` (within its permitted set, unchanged)."""
    _eff0, perm0, inh0, _eff1, perm1, inh1 = words
    eff &= (perm1 << 32) | perm0
    _syscall("capset", hdr, ctypes.create_string_buffer(struct.pack(
        "6I", eff & 0xFFFFFFFF, perm0, inh0, eff >> 32, perm1, inh1)))


def _raise_effective(caps: tuple[int, ...]) -> None:
    """Make ``caps`` effective again in this thread, those of them still permitted."""
    hdr, words = _caps()
    _set_effective(hdr, words, (words[3] << 32) | words[0] | sum(1 << c for c in caps))


class CapsNotRestored(OSError):
    """without_effective could not give the thread its effective set back."""


def without_effective(caps: tuple[int, ...], fn: Callable[[], T]) -> T:
    """``fn()`` with ``caps`` out of this thread's effective set, then the set as it was
    (a capability the kernel reads from the opener at open, as pagemap's CAP_SYS_ADMIN).
    CapsNotRestored if the set cannot be given back."""
    hdr, words = _caps()
    old = (words[3] << 32) | words[0]
    _set_effective(hdr, words, old & ~sum(1 << c for c in caps))
    try:
        return fn()
    finally:
        try:
            _set_effective(hdr, words, old)
        except OSError as e:
            raise CapsNotRestored(e.errno, f"capset back: {e.strerror}") from None


def as_host_user(uid: int, gid: int, fn: Callable[..., T], *args: Any,
                 keep: tuple[int, ...] = (CAP_CHECKPOINT_RESTORE,)) -> T:
    """``fn(*args)`` in a new thread whose effective uid/gid are ``uid``/``gid`` (real
    and saved ids unchanged), with the capabilities in ``keep`` effective again if
    permitted. Returns its result or raises its exception; OSError if the switch is
    refused (no CAP_SETUID/CAP_SETGID)."""
    if uid == 0:
        raise ValueError("as_host_user: uid 0 is not another host user")
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            _syscall("setresgid", -1, gid, -1)    # first: it needs CAP_SETGID, effective
            _syscall("setresuid", -1, uid, -1)    # while the euid is still 0
            if keep:
                _raise_effective(keep)
            box["value"] = fn(*args)
        except BaseException as e:   # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=body, name=f"as-uid-{uid}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def host_ids(pid: int | str) -> tuple[int, int]:
    """The (euid, egid) a process runs as on the host (/proc/PID/status is readable
    without any access check)."""
    uid = gid = None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                uid = int(line.split()[2])
            elif line.startswith("Gid:"):
                gid = int(line.split()[2])
    if uid is None or gid is None:
        raise OSError(f"/proc/{pid}/status has no Uid/Gid")
    return uid, gid
