"""What the broker checks before it acts, as pure functions of its own config (no
request data reaches a decision without passing one of these).

* `check_plan`: the sandbox a start would build: never host uid 0 (nor the broker's own
  uid when it is root), never "/" or the state dir bound, read-write and device binds
  exactly those the config names for the domain.
* `check_channel_fds`: the fds a start hands the worker are the channel's own kind and
  size: memfds of the spec's segment and lease sizes, and AF_UNIX sockets for wake-ups.
  Never a directory, a device, a pipe or a file of the host (an fd of a host directory
  in a sandbox is a way out of its mount namespace).
* `StateDir`: the latch is written only inside the state directory the broker opened at
  start (by dir fd, O_NOFOLLOW, O_EXCL): a symlink planted there by anyone cannot make
  it write elsewhere.
"""
from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass

from supervisor.failsafe import (LATCH_NAME, latch_text, read_latch_text, reserve_latch,
                                 write_latch)

from ._errors import BadFds, Failed, Refused

# ---------------------------------------------------------------- the sandbox plan


def _covers(bind: str, path: str) -> bool:
    """`bind` is `path` or one of its ancestors (binding it shows `path`)."""
    b = bind.rstrip("/") or "/"
    return b == "/" or path == b or path.startswith(b + "/")


def check_plan(policy, *, domain_rw: tuple[str, ...], domain_dev: tuple[str, ...],
               state_dir: str, root: bool) -> None:
    """Refuse a sandbox policy the broker would not start (see the module doc)."""
    if root:
        if policy.host_uid is None or policy.host_gid is None:
            raise Refused(f"domain {policy.domain}: no host user to run as (never as root)")
        if policy.host_uid == 0 or policy.host_gid == 0:
            raise Refused(f"domain {policy.domain}: host uid/gid 0 (never as root)")
    for kind, binds in (("ro", policy.ro_binds), ("rw", policy.rw_binds),
                        ("dev", policy.dev_binds)):
        for b in binds:
            if os.path.abspath(b) == "/":
                raise Refused(f"domain {policy.domain}: {kind} bind of / (never the whole host)")
            if _covers(os.path.abspath(b), state_dir):
                raise Refused(f"domain {policy.domain}: {kind} bind {b} shows the "
                              f"broker's state dir {state_dir}")
    rw_named = {os.path.abspath(p) for p in domain_rw}
    extra = [b for b in policy.rw_binds if os.path.abspath(b) not in rw_named]
    if extra:
        raise Refused(f"domain {policy.domain}: rw binds not named by the config: {extra}")
    dev_named = {os.path.abspath(p) for p in domain_dev}
    extra = [b for b in policy.dev_binds if os.path.abspath(b) not in dev_named]
    if extra:
        raise Refused(f"domain {policy.domain}: device binds not named by the config: {extra}")


# ---------------------------------------------------------------- channel fds


def _fd_kind(fd: int) -> tuple[str, int]:
    """("memfd" | "socket" | what else, size) of an fd received from the client."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise BadFds(f"fd {fd}: {e.strerror}") from None
    if stat.S_ISSOCK(st.st_mode):
        s = socket.socket(fileno=os.dup(fd))
        try:
            fam = s.family
        finally:
            s.close()
        return ("socket" if fam == socket.AF_UNIX else f"socket family {int(fam)}"), 0
    if stat.S_ISREG(st.st_mode):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "?"
        # A memfd (also one reopened read-only through /proc/self/fd) reads "/memfd:NAME".
        return ("memfd" if target.startswith("/memfd:") else f"file {target[:80]}"), st.st_size
    kinds = {stat.S_IFDIR: "directory", stat.S_IFCHR: "character device",
             stat.S_IFBLK: "block device", stat.S_IFIFO: "pipe", stat.S_IFLNK: "symlink"}
    return kinds.get(stat.S_IFMT(st.st_mode), "unknown"), 0


def expected_fds(spec, role: str) -> list[tuple[str, int]]:
    """(kind, size) of each fd of a channel handle, in WriterHandle.fds() /
    ReaderHandle.fds() order; size 0: not checked."""
    if role == "writer":
        return ([("memfd", spec.segment_size)] + [("memfd", spec.lease_size)] * spec.max_readers
                + [("socket", 0)] * spec.max_readers)
    return [("memfd", spec.segment_size), ("memfd", spec.lease_size), ("socket", 0)]


def check_channel_fds(channel: str, spec, role: str, fds: list[int]) -> None:
    want = expected_fds(spec, role)
    if len(fds) != len(want):
        raise BadFds(f"channel {channel} ({role}): {len(fds)} fds, its handle has {len(want)}")
    for i, (fd, (kind, size)) in enumerate(zip(fds, want)):
        got, got_size = _fd_kind(fd)
        if got != kind:
            raise BadFds(f"channel {channel} ({role}) fd #{i}: a {got}, not a {kind}")
        if size and got_size != size:
            raise BadFds(f"channel {channel} ({role}) fd #{i}: {got_size} bytes, "
                         f"the spec says {size}")


# ---------------------------------------------------------------- the state dir


@dataclass
class StateDir:
    """The state directory, held open by fd from the broker's start: every latch
    operation is relative to it and follows no symlink."""

    path: str
    fd: int

    @classmethod
    def open(cls, path: str) -> StateDir:
        """Made 0700 if missing; refused if it (the last component) is a symlink or not
        a directory."""
        path = os.path.abspath(path)
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise Refused(f"state dir {path}: {e.strerror}") from None
        # Only the broker's own, written by no one else: another owner, or a group or
        # world that may write it, could replace or remove the latch (red team round 4).
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise Refused(f"state dir {path}: owned by uid {st.st_uid} with mode "
                          f"{st.st_mode & 0o777:o}; it must be the broker's own "
                          f"(uid {os.geteuid()}) and writable by no one else")
        try:
            reserve_latch(fd)        # the latch's blocks, before anything can fail safe
        except OSError as e:
            os.close(fd)
            raise Refused(f"state dir {path}: cannot hold the fail-safe latch: "
                          f"{e.strerror}") from None
        return cls(path, fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def set_latch(self, reason: str) -> None:
        """failsafe.write_latch in the held directory (fresh tmp file, fsync, rename;
        the reserve's blocks on a full file system)."""
        try:
            write_latch(self.fd, latch_text(reason, by="broker"))
        except OSError as e:
            raise Failed(f"latch in {self.path}: {e.strerror}") from None

    def reserve_latch(self) -> None:
        """failsafe.reserve_latch in the held directory; no room is `failed`."""
        try:
            reserve_latch(self.fd)
        except OSError as e:
            raise Failed(f"latch reserve in {self.path}: {e.strerror}", e.errno) from None

    def clear_latch(self) -> None:
        try:
            os.unlink(LATCH_NAME, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise Failed(f"latch in {self.path}: {e.strerror}") from None

    def read_latch(self) -> str:
        """The latch file's text ("" when there is none): failsafe.read_latch_text in the
        held directory. Not parsed here: the broker hands the bytes on."""
        return read_latch_text(self.fd)
