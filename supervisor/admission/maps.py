"""Runtime check: is a forbidden library mapped into a running process?

The static checks cannot see ``ctypes.CDLL("libtorch_cpu.so")`` or an import
whose name is computed at runtime; /proc/PID/maps can. Children are not
scanned: each supervised worker is scanned by its own pid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .rules import forbidden_soname, is_torch_c_extension


class ProcessGone(LookupError):
    """The process exited (or never existed) before its maps could be read."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"process {pid} is gone")
        self.pid = pid


@dataclass(frozen=True)
class MapsHit:
    pid: int
    path: str  # as the kernel reports it (" (deleted)" stripped)
    pattern: str  # the soname pattern matched, or "torch/_C"
    address: str  # first mapping's range, e.g. "7f12a0000000-7f12a1000000"
    deleted: bool  # mapped from a file that has since been removed/replaced

    def describe(self) -> str:
        gone = " (file deleted since)" if self.deleted else ""
        return f"pid {self.pid} has {self.path}{gone} mapped at {self.address} (matches {self.pattern})"


def scan_maps_text(pid: int, text: str) -> list[MapsHit]:
    """Forbidden libraries in the text of a maps file, one hit per path."""
    hits: dict[str, MapsHit] = {}
    for line in text.splitlines():
        # address perms offset dev inode [pathname]; the path may contain spaces
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if not path.startswith("/"):
            continue  # [heap], [stack], anonymous, memfd: no file name to judge
        deleted = path.endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        if path in hits:
            continue
        pattern = forbidden_soname(path) or ("torch/_C" if is_torch_c_extension(path) else None)
        if pattern:
            hits[path] = MapsHit(pid, path, pattern, fields[0], deleted)
    return list(hits.values())


def scan_pid(pid: int) -> list[MapsHit]:
    """Forbidden mappings of a live process. Raises ProcessGone if it has exited.

    A zombie has an empty maps file, so it yields no hits (nothing is mapped).
    PermissionError propagates: not being allowed to look is not "clean".
    """
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessGone(pid) from exc
    except OSError as exc:
        # ESRCH surfaces as a plain OSError when the task dies mid-read
        if exc.errno == 3:
            raise ProcessGone(pid) from exc
        raise
    return scan_maps_text(pid, text)


def scan_self() -> list[MapsHit]:
    return scan_pid(os.getpid())
