"""Landlock for a sandboxed worker: write only beneath a few directories.

Why on top of bwrap's read-only binds: a worker that can open a /proc file for
writing can do harm without any syscall seccomp looks at (writing /proc/self/mem
patches executable pages without mprotect and so without the exec watch; other
/proc files tune the process). Landlock refuses every write-class open or
directory change outside `write_dirs`, whatever the mounts and permissions say.
With ABI >= 6 it also scopes signals and abstract unix sockets to the sandbox's
own Landlock domain: nothing outside it can be signalled or connected to; with
ABI >= 9 pathname unix sockets too (RESOLVE_UNIX, below).

Raw syscalls through ctypes (the numbers are the same on x86-64 and aarch64), so
it needs neither pyseccomp nor a Landlock library. Reads stay unrestricted.

Landlock applies to the calling thread only (until a kernel offers a TSYNC flag):
call restrict() while the process has a single thread; threads started later
inherit it. It refuses to run otherwise rather than leave threads unrestricted.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Sequence

from . import seccomp

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# Write-class filesystem rights, by the ABI that introduced them. Not handled:
# EXECUTE (execve is banned by seccomp), READ_* (reads are fine) and IOCTL_DEV (ABI 5;
# not a write, and the worker's device nodes live under /dev anyway).
ACCESS_FS_WRITE_FILE = 1 << 1
_FS_WRITE_BY_ABI = {
    1: (ACCESS_FS_WRITE_FILE
        | 1 << 4    # REMOVE_DIR
        | 1 << 5    # REMOVE_FILE
        | 1 << 6    # MAKE_CHAR
        | 1 << 7    # MAKE_DIR
        | 1 << 8    # MAKE_REG
        | 1 << 9    # MAKE_SOCK
        | 1 << 10   # MAKE_FIFO
        | 1 << 11   # MAKE_BLOCK
        | 1 << 12),  # MAKE_SYM
    # REFER is denied for every cross-directory link/rename once any ruleset exists,
    # handled or not; handling it lets us grant it inside write_dirs.
    2: 1 << 13,     # REFER
    3: 1 << 14,     # TRUNCATE
}
# ABI 9 (Linux 7.1): connect() and sendmsg() to a pathname unix socket. Handled and
# granted nowhere: a sandbox then reaches only sockets created inside its own Landlock
# domain, never a host service whose socket a bind made visible. Depth only: the
# denial is EACCES, which a library may swallow, so the rule that reports (a seccomp
# kill of connect / sendto with an address / datagram sockets in every domain without
# a network, seccomp.py `_deny_outside`) stays; this also covers a domain with a
# network. The kernel this project is measured on (6.18) has ABI 7.
ACCESS_FS_RESOLVE_UNIX = 1 << 16
_RESOLVE_UNIX_ABI = 9
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1
_SCOPE_ABI = 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64),
                ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _sys(nr: int, *args: object) -> int:
    ret = _libc.syscall(ctypes.c_long(nr), *args)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(ret)


def abi_version() -> int:
    """The kernel's Landlock ABI, 0 if Landlock is not built in or disabled at boot."""
    try:
        return _sys(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                    ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
            return 0
        raise


def write_rights(abi: int) -> int:
    return sum(bits for v, bits in _FS_WRITE_BY_ABI.items() if v <= abi)


def handled_rights(abi: int) -> int:
    """Everything the ruleset handles at this ABI: the write rights (granted beneath
    write_dirs) plus RESOLVE_UNIX where the kernel has it (granted nowhere)."""
    return write_rights(abi) | (ACCESS_FS_RESOLVE_UNIX if abi >= _RESOLVE_UNIX_ABI else 0)


def restrict(write_dirs: Sequence[str] = ("/tmp", "/dev"), *, scope: bool = True) -> int:
    """Allow writes only beneath `write_dirs` for this process and its future children.

    Returns the ABI used, or 0 (nothing done) when the kernel has no Landlock: the
    caller decides whether that is fatal. Directories that do not exist are skipped
    (that only restricts more). Irreversible.
    """
    abi = abi_version()
    if abi == 0:
        return 0
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"landlock.restrict() needs a single-threaded process, found {threads} "
                           "threads: the others would stay unrestricted")
    handled = handled_rights(abi)
    granted = write_rights(abi)
    attr = _RulesetAttr(handled_access_fs=handled)
    size = ctypes.sizeof(ctypes.c_uint64)  # ABI 1-5 without net rules: the first field
    if abi >= _SCOPE_ABI and scope:
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        size = ctypes.sizeof(attr)
    ruleset = _sys(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for d in write_dirs:
            try:
                fd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                rule = _PathBeneathAttr(allowed_access=granted, parent_fd=fd)
                _sys(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                     ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        seccomp.set_no_new_privs()  # required unless CAP_SYS_ADMIN; bwrap already set it
        _sys(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return abi
