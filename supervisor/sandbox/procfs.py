"""How the exec watch, the maps scan and the W^X check reach a sandboxed process's /proc
(issue 27): a small `ProcOpener` they are handed instead of building /proc paths
themselves.

`DIRECT` does what they always did, as the root supervisor: `/proc/PID/<name>` opened,
listed and followed by this process, signals sent by it. Phase 2 of the broker split
passes `supervisor.broker.BrokerProcOpener` instead: the files that need privilege
(maps, mem, pagemap, mountinfo, fd/N, map_files/A-B) are opened by the root broker and
handed over as fds, and the signals go through the broker's checked requests.

`name` is always relative to /proc/PID (``"maps"``, ``"fd/7"``, ``"task/12/stat"``)."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING, ContextManager, Protocol

if TYPE_CHECKING:
    from .wx import Verified


class ProcOpener(Protocol):
    def open(self, pid: int, name: str, flags: int = os.O_RDONLY) -> int:
        """An fd of /proc/PID/<name> (a plain /proc file; O_CLOEXEC is added)."""

    def link(self, pid: int, name: str) -> ContextManager[str]:
        """A path that os.stat, os.open and os.readlink follow to what the magic link
        /proc/PID/<name> (fd/N, map_files/A-B) leads to, valid inside the `with`."""

    def listdir(self, pid: int, name: str) -> list[str]:
        """The entries of /proc/PID/<name> (task, fd)."""

    def tgkill(self, pid: int, tid: int, sig: int) -> None:
        """Signal one thread; a thread that is gone is not an error."""

    def kill(self, pid: int, sig: int) -> None:
        """Signal a process; ProcessLookupError if it is gone."""

    def check_wx(self, pid: int) -> Verified | None:
        """The W^X check (wx.verify) done where ptrace is allowed, for an opener whose
        holder has none (the broker's readFilters); None: verify does it here."""


_NR_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine(), -1)
_libc = ctypes.CDLL(None, use_errno=True)


def tgkill(pid: int, tid: int, sig: int) -> None:
    """tgkill(2); ESRCH (the thread is gone) is not an error."""
    if _libc.syscall(ctypes.c_long(_NR_TGKILL), ctypes.c_long(pid), ctypes.c_long(tid),
                     ctypes.c_long(sig)) != 0 and ctypes.get_errno() != errno.ESRCH:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig})")


class DirectOpener:
    """This process opens and signals by itself (the root supervisor of today)."""

    def open(self, pid: int, name: str, flags: int = os.O_RDONLY) -> int:
        return os.open(f"/proc/{pid}/{name}", flags | os.O_CLOEXEC)

    @contextlib.contextmanager
    def link(self, pid: int, name: str) -> Iterator[str]:
        yield f"/proc/{pid}/{name}"

    def listdir(self, pid: int, name: str) -> list[str]:
        return os.listdir(f"/proc/{pid}/{name}")

    def tgkill(self, pid: int, tid: int, sig: int) -> None:
        tgkill(pid, tid, sig)

    def kill(self, pid: int, sig: int) -> None:
        os.kill(pid, sig)

    def check_wx(self, pid: int) -> None:
        return None                 # this process seizes and reads back itself

    def __repr__(self) -> str:
        return "DIRECT"


DIRECT: ProcOpener = DirectOpener()


def read_text(opener: ProcOpener, pid: int, name: str) -> str:
    """The whole of /proc/PID/<name> as text (as `open(path).read()` decodes it)."""
    with os.fdopen(opener.open(pid, name), encoding="utf-8",
                   errors="surrogateescape") as f:
        return f.read()


def read_bytes(opener: ProcOpener, pid: int, name: str) -> bytes:
    with os.fdopen(opener.open(pid, name), "rb") as f:
        return f.read()
