"""Anonymous shared memory: memfd segments, read-only re-opens, seals, mappings.

Why memfd and not a named POSIX segment: a memfd never has a name, so a process that
was not handed the fd cannot open it, not even during a create/unlink window.

Readers get an O_RDONLY file description, so their mappings can never become writable
(no VM_MAYWRITE: mprotect and /proc/self/mem writes fail). Re-opening /proc/self/fd/N
read-write is stopped twice: the inode is mode 0400 (needs CAP_DAC_OVERRIDE, which
sandboxed workers lack), and a writer that seals (F_SEAL_FUTURE_WRITE) after mapping
stops every new writable mapping, root's included. A sealed channel cannot take a
restarted writer: the supervisor re-creates it instead.
"""
from __future__ import annotations

import fcntl
import mmap
import os

from .errors import BridgeError

# Not exported by Python 3.11's fcntl (Linux >= 5.1).
F_SEAL_FUTURE_WRITE = 0x0010
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def memfd_label(channel: str, lease: int | None = None) -> str:
    """The name a channel's segment (or its reader `lease`'s table) is created with:
    `/proc/PID/fd/N` reads "/memfd:LABEL (deleted)". One memfd has one name for life,
    so the broker can tell which channel an fd it is handed belongs to (red team 10 row
    6: two channels of one spec, the control one handed to a research writer)."""
    return f"trio-bridge:{channel}" + ("" if lease is None else f":lease{lease}")


def wake_label(channel: str, index: int, nonce: str) -> bytes:
    """The abstract address a channel's wake-up pair `index` is labelled with: the
    writer's end is bound to it (never listening: nothing can connect), the reader's end
    reads it as its peer's. One pair has one label for life, so the broker can tell whose
    wake-up end it is handed (red team 10 row 8). `nonce`: 16 hex digits, one per
    channel's creation (two supervisors on one host never collide)."""
    return b"\0" + f"trio-bridge:{channel}:wake{index}:{nonce}".encode()


def create_segment(label: str, size: int) -> int:
    """A new anonymous segment of ``size`` zero bytes whose size can never change."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
        # Owner read-only: an fd opened before this keeps its read-write access, but a
        # process without CAP_DAC_OVERRIDE cannot re-open the segment for writing.
        os.fchmod(fd, 0o400)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen_read_only(fd: int) -> int:
    """A new O_RDONLY file description of the same segment (for handing to readers)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def seals(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


def seal_writes(fd: int) -> None:
    """After this no new writable mapping of the segment can be made, by anyone."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)


def is_write_sealed(fd: int) -> bool:
    return bool(seals(fd) & F_SEAL_FUTURE_WRITE)


def segment_size(fd: int) -> int:
    return os.fstat(fd).st_size


def map_segment(fd: int, size: int, *, writable: bool) -> mmap.mmap:
    actual = segment_size(fd)
    if actual != size:
        raise BridgeError(f"segment fd {fd} is {actual} bytes, expected {size}")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
