"""Supervisor side of the exec watch: judge a worker's requests for executable memory.

The worker (strict domain) installs `seccomp.install_exec_watch()` before its module is
imported and hands us the listener fd. From then on every mmap/mprotect/pkey_mprotect
with PROT_EXEC and every memfd_create stops in the kernel until we answer here. We run
as host root outside the sandbox and read the worker's /proc; nothing here needs
pyseccomp (plain ioctls on the listener).

Policy: before READY, code may come only from regular files on read-only mounts (the
interpreter, extension modules, shared libraries) plus, if allowed, anonymous memory
(a JIT); memfd_create is allowed. After READY, nothing: no new executable memory, no
memfd. A denied call fails with EPERM in the worker and is returned as a Verdict so
the supervisor can log it (and fail the worker if it wants to).

Known limits (why READY matters): CONTINUE lets the kernel redo the call after we
looked, so before READY another thread of the worker could swap the fd number
(dup2) or the mapping under an mprotect between our check and the call. After READY
everything is refused, so no race helps there. Memory that is already writable and
executable at READY (allowed anonymous JIT memory) needs no syscall to be rewritten:
see writable_executable_mappings(). If the supervisor closes the listener, watched
calls fail with ENOSYS in the worker; if it stops reading, they block.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import os
import platform
import select
import stat
import struct
from dataclasses import dataclass
from typing import Iterator

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
_MAP_ANONYMOUS = 0x20  # same on x86-64 and aarch64
# What the kernel calls MAP_SHARED|MAP_ANONYMOUS memory in /proc/PID/maps (a shmem
# inode): anonymous for our rules, as it was when mmap created it.
_SHARED_ANON = "/dev/zero (deleted)"

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
    # readlink(/proc/pid/fd/N) for a file mmap; the backing of the mapping(s) at addr
    # for mprotect ("[anon]" for anonymous memory); None when not applicable.
    target: str | None


@dataclass(frozen=True)
class Verdict:
    request: ExecRequest
    allowed: bool
    reason: str


class ExecWatch:
    def __init__(self, listener_fd: int, *, allow_anonymous_exec: bool = False) -> None:
        _check_sizes()
        self._fd = listener_fd  # ours now: close() closes it
        # Anonymous PROT_EXEC (a JIT) before READY; may be changed at any time.
        self.allow_anonymous_exec = allow_anonymous_exec
        self.ready = False  # set by the supervisor when it accepts the worker's READY
        self.hung_up = False  # every filtered task is gone: stop polling this fd

    def fileno(self) -> int:
        return self._fd

    def handle_pending(self) -> list[Verdict]:
        """Answer every request queued now; never blocks (RECV alone would)."""
        out: list[Verdict] = []
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while True:
            ev = poller.poll(0)
            if not ev or not ev[0][1] & select.POLLIN:
                if ev and ev[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    self.hung_up = True
                return out
            buf = bytearray(_NOTIF.size)  # RECV insists on a zeroed buffer
            try:
                fcntl.ioctl(self._fd, _IOCTL_RECV, buf, True)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):  # the caller died / was interrupted
                    continue
                raise
            req = self._parse(buf)
            allowed, reason, target = self._judge(req)
            req = dataclasses.replace(req, target=target)
            # The tid may have died and been reused while we read /proc: if the
            # request is no longer pending, what we read may describe a stranger.
            if not self._id_valid(req.id):
                continue
            self._respond(req.id, allowed)
            out.append(Verdict(req, allowed, reason))

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

    def _judge(self, req: ExecRequest) -> tuple[bool, str, str | None]:
        """(allowed, reason, target)."""
        target: list[str | None] = [None]
        try:
            allowed, reason = self._judge_inner(req, target)
        except OSError as e:  # the worker vanished under us, or /proc refused: deny
            allowed, reason = False, f"cannot inspect pid {req.pid}: {os.strerror(e.errno or 0)}"
        return allowed, reason, target[0]

    def _judge_inner(self, req: ExecRequest, target: list[str | None]) -> tuple[bool, str]:
        if req.syscall == "memfd_create":
            if self.ready:
                return False, "memfd_create after READY"
            return True, "memfd_create before READY"
        if req.syscall not in ("mmap", "mprotect", "pkey_mprotect"):
            return False, f"unexpected syscall {req.syscall}"
        if req.syscall == "mmap":
            anonymous = bool(req.flags & _MAP_ANONYMOUS) or req.fd < 0
            if not anonymous:
                target[0] = os.readlink(f"/proc/{req.pid}/fd/{req.fd}")
        else:
            maps = list(_mappings(req.pid, req.args[0], req.args[1]))
            target[0] = ", ".join(m[2] or "[anon]" for m in maps) or "[unmapped]"
            if not maps:
                return False, "no mapping at address"
            anonymous = all(not m[2] for m in maps)
            if not anonymous and any(not m[2] for m in maps):
                return False, "range mixes anonymous and file-backed memory"
        if self.ready:
            return False, "new executable memory after READY"
        if anonymous:
            if self.allow_anonymous_exec:
                return True, "anonymous executable memory (allowed for this worker)"
            return False, "anonymous executable memory"
        if req.prot & _PROT_WRITE:
            return False, "writable and executable file mapping"
        if req.syscall == "mmap":
            return _code_file(req.pid, f"/proc/{req.pid}/fd/{req.fd}")
        for start, end, path, perms, anon_kb in maps:
            # A private file mapping that was ever writable may hold copied-on-write
            # pages we never checked: only pristine read-only file pages may turn X.
            if "w" in perms or anon_kb:
                return False, f"file mapping {path} was modified or is writable"
            ok, why = _code_file(req.pid, f"/proc/{req.pid}/map_files/{start:x}-{end:x}")
            if not ok:
                return False, why
        return True, "file mapping from a read-only mount"


def _code_file(pid: int, link: str) -> tuple[bool, str]:
    """May the file behind `link` (a /proc magic link) be mapped executable?"""
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
    opts = _mount_options(pid, mnt_id)
    if opts is None:
        return False, f"{name} is on a mount the worker cannot see"
    if "ro" not in opts:
        return False, f"{name} is on a writable mount"
    return True, f"{name} on a read-only mount"


def _mount_options(pid: int, mnt_id: int) -> list[str] | None:
    with open(f"/proc/{pid}/mountinfo") as f:
        for ln in f:
            fields = ln.split()
            if int(fields[0]) == mnt_id:
                return fields[5].split(",")  # per-mount options: a ro bind shows "ro"
    return None


def _mappings(pid: int, addr: int, length: int) -> Iterator[tuple[int, int, str, str, int]]:
    """(start, end, path, perms, Anonymous kB) of every mapping overlapping the range.

    All of them: an mprotect spanning a library and an anonymous page must not be
    judged by its first page alone. path is "" for anonymous memory ([heap], [stack]...).
    """
    end = addr + max(length, 1)
    cur: list | None = None
    with open(f"/proc/{pid}/smaps") as f:
        for ln in f:
            head = ln.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping header
                if cur is not None:
                    yield tuple(cur)  # type: ignore[misc]
                    cur = None
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if lo < end and addr < hi:
                    path = head[5].rstrip("\n") if len(head) > 5 and int(head[4]) else ""
                    if path == _SHARED_ANON:
                        path = ""
                    cur = [lo, hi, path, head[1], 0]
            elif cur is not None and head[0] == "Anonymous:":
                cur[4] = int(head[1])
    if cur is not None:
        yield tuple(cur)  # type: ignore[misc]


def writable_executable_mappings(pid: int) -> list[str]:
    """The /proc/PID/maps lines of `pid` that are writable and executable at once.

    The watch only sees requests for new executable memory: code can still be
    written, without any syscall, into a W+X mapping that already exists at READY
    (tinygrad's CPU runtime maps one per kernel when anonymous exec is allowed).
    Worth checking when the supervisor accepts READY.
    """
    with open(f"/proc/{pid}/maps") as f:
        return [ln.rstrip("\n") for ln in f if ln.split()[1].startswith("rwx")]
