"""Runtime check: is a forbidden library mapped into a running process?

The static checks cannot see ``ctypes.CDLL("libtorch_cpu.so")`` or an import
whose name is computed at runtime; /proc/PID/maps can. Children are not
scanned: each supervised worker is scanned by its own pid.

A mapping is judged by what it *is*, not only by what it is called. Every
executable mapping backed by a file (a regular file, a deleted one, a memfd)
is read through ``/proc/PID/map_files/<start>-<end>`` (root only; it reaches
the mapped object even when it has no name left) and its ELF headers give its
DT_SONAME, DT_NEEDED and NT_GNU_BUILD_ID. Refused when the SONAME (or a
needed library) matches the forbidden soname patterns, or when the build-id is
one of a refused distribution's shared objects on disk (torch/lib/*.so*,
torch/_C*.so; see rules.REFUSED_DISTRIBUTIONS). The file-name match of the
first version is kept. Identities are cached per (device, inode) of the mapped
object, re-read when its size/mtime/ctime change, so repeated scans cost one
stat() per executable file mapping.

After the worker's READY the supervisor takes an `exec_snapshot` of its
executable mappings; a scan given that snapshot also refuses any executable
mapping that was not there ("new-exec-after-ready": anonymous, memfd, deleted
file or file) and any writable+executable mapping ("writable-exec", also listed
by the snapshot itself so READY can be refused).

Both the snapshot and such a scan also refuse executable mappings whose content
can still change after READY without any watched syscall ("unsafe-exec"): a memfd
(pwrite into it), a deleted file (an open fd to it), shared memory (MAP_SHARED
anonymous memory or SysV shm: another view of it, e.g. made by mremap with
old_size 0, can be writable), and a file whose device is mounted writable
anywhere in the process's own mount table (/proc/PID/mountinfo; the sandbox's
/tmp and /dev/shm are tmpfs with their own devices). Only read-only files and
private anonymous memory are code that stays what it was at READY.

They also refuse a file-backed executable mapping holding a page that is not the
file's ("foreign-code-page"): a private file mapping whose page was copied on write
(patched while writable, then made executable again, or moved there by mremap) runs
code no file holds, though maps names the file. /proc/PID/pagemap says, per page,
whether it is the file's (bit 61) or a private copy; only executable private file
ranges are read (8 bytes a page: ~2.5 KiB for a 1 MiB text), once per scan.

Limits: identity is ELF metadata. A copy whose SONAME and build-id note were
both rewritten, and that needs no torch library by name, is only caught by the
post-READY accounting (if mapped after READY) -- not before READY.
"""

from __future__ import annotations

import glob
import os
import stat
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from supervisor.sandbox.procfs import DIRECT, ProcOpener

from .rules import REFUSED_DISTRIBUTIONS, forbidden_soname, is_torch_c_extension

KIND_FORBIDDEN = "forbidden-library"
KIND_NEW_EXEC = "new-exec-after-ready"
KIND_WRITABLE_EXEC = "writable-exec"
KIND_UNSAFE_EXEC = "unsafe-exec"
KIND_FOREIGN_PAGE = "foreign-code-page"

# backing of a mapping
FILE, DELETED, MEMFD, ANONYMOUS, SPECIAL = "file", "deleted", "memfd", "anonymous", "special"

_DELETED = " (deleted)"


class ProcessGone(LookupError):
    """The process exited (or never existed) before its maps could be read."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"process {pid} is gone")
        self.pid = pid


# --------------------------------------------------------------------------
# ELF identity: a small reader of the ELF header, program headers, PT_DYNAMIC
# and PT_NOTE. Deliberately not pyelftools: guard.install() runs this in every
# control worker before anything else is imported.


@dataclass(frozen=True)
class ElfIdentity:
    soname: str | None
    build_id: str | None  # lowercase hex of NT_GNU_BUILD_ID
    needed: tuple[str, ...] = ()


_PT_LOAD, _PT_DYNAMIC, _PT_NOTE = 1, 2, 4
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_SONAME = 0, 1, 5, 10, 14
_NT_GNU_BUILD_ID = 3
_MAX_PHNUM = 512
_MAX_SEGMENT_READ = 1 << 16  # dynamic and note segments are a few hundred bytes
_MAX_NAME = 256


def read_elf_identity(fd: int) -> ElfIdentity | None:
    """SONAME, DT_NEEDED and build-id of the ELF object open at ``fd``; None if not ELF.

    Reads with pread (the fd's offset is untouched); garbage yields None or a
    partial identity, never an exception other than OSError from the reads.
    """
    try:
        return _read_identity(fd)
    except (struct.error, ValueError, IndexError, OverflowError):
        return None


def _read_identity(fd: int) -> ElfIdentity | None:
    head = os.pread(fd, 64, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return None
    e = "<" if head[5] == 1 else ">"
    if head[4] == 2:
        if len(head) < 64:
            return None
        (phoff,) = struct.unpack_from(e + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(e + "HH", head, 54)
        ph_fmt, dyn_fmt = e + "IIQQQQQQ", e + "qQ"
    else:
        (phoff,) = struct.unpack_from(e + "I", head, 28)
        phentsize, phnum = struct.unpack_from(e + "HH", head, 42)
        ph_fmt, dyn_fmt = e + "IIIIIIII", e + "iI"
    ph_size = struct.calcsize(ph_fmt)
    if phentsize < ph_size or phnum == 0 or phnum > _MAX_PHNUM:
        return ElfIdentity(None, None)
    table = os.pread(fd, phentsize * phnum, phoff)
    loads: list[tuple[int, int, int]] = []  # vaddr, filesz, offset
    dynamic: tuple[int, int] | None = None
    notes: list[tuple[int, int, int]] = []  # offset, filesz, align
    for i in range(phnum):
        if (i + 1) * phentsize > len(table):
            break
        f = struct.unpack_from(ph_fmt, table, i * phentsize)
        if head[4] == 2:
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, p_align = f
        else:
            p_type, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _flags, p_align = f
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_filesz, p_offset))
        elif p_type == _PT_DYNAMIC and dynamic is None:
            dynamic = (p_offset, p_filesz)
        elif p_type == _PT_NOTE:
            notes.append((p_offset, p_filesz, p_align))

    build_id = None
    for off, size, align in notes:
        build_id = _build_id(os.pread(fd, min(size, _MAX_SEGMENT_READ), off), e, 8 if align == 8 else 4)
        if build_id:
            break

    soname, needed = None, []
    if dynamic is not None:
        data = os.pread(fd, min(dynamic[1], _MAX_SEGMENT_READ), dynamic[0])
        step = struct.calcsize(dyn_fmt)
        strtab = strsz = None
        soname_at: int | None = None
        needed_at: list[int] = []
        for pos in range(0, len(data) - step + 1, step):
            tag, val = struct.unpack_from(dyn_fmt, data, pos)
            if tag == _DT_NULL:
                break
            if tag == _DT_STRTAB:
                strtab = val
            elif tag == _DT_STRSZ:
                strsz = val
            elif tag == _DT_SONAME:
                soname_at = val
            elif tag == _DT_NEEDED and len(needed_at) < 64:
                needed_at.append(val)
        base = _file_offset(loads, strtab) if strtab is not None else None
        if base is not None:
            if soname_at is not None:
                soname = _string(fd, base, soname_at, strsz)
            needed = [n for n in (_string(fd, base, at, strsz) for at in needed_at) if n]
    return ElfIdentity(soname, build_id, tuple(needed))


def _file_offset(loads: list[tuple[int, int, int]], vaddr: int) -> int | None:
    for p_vaddr, p_filesz, p_offset in loads:
        if p_vaddr <= vaddr < p_vaddr + p_filesz:
            return vaddr - p_vaddr + p_offset
    return None


def _string(fd: int, base: int, index: int, strsz: int | None) -> str | None:
    if strsz is not None and index >= strsz:
        return None
    raw = os.pread(fd, _MAX_NAME, base + index)
    end = raw.find(b"\0")
    return raw[: end if end >= 0 else len(raw)].decode("utf-8", "replace") or None


def _build_id(data: bytes, e: str, align: int) -> str | None:
    pos = 0
    while pos + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from(e + "III", data, pos)
        name_at = pos + 12
        desc_at = name_at + (-(-namesz // align) * align)
        if desc_at + descsz > len(data):
            return None
        if ntype == _NT_GNU_BUILD_ID and data[name_at : name_at + namesz] == b"GNU\0" and descsz:
            return data[desc_at : desc_at + descsz].hex()
        pos = desc_at + (-(-descsz // align) * align)
    return None


# Identity cache: (st_dev, st_ino) -> ((size, mtime_ns, ctime_ns), identity).
# The stamp makes a rewritten memfd or file (same inode, new content) be read again.
_IDENTITIES: dict[tuple[int, int], tuple[tuple[int, int, int], ElfIdentity | None]] = {}
_IDENTITY_CACHE_MAX = 8192


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def identity_of(path: str) -> tuple[tuple[int, int], ElfIdentity | None] | None:
    """((st_dev, st_ino), ELF identity) of the regular file reached through ``path``.

    ``path`` may be a /proc/PID/map_files entry (followed like a symlink). None
    if it is gone or not a regular file (a device is never opened). Identity is
    None for a regular file that is not ELF. PermissionError propagates.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    key = (st.st_dev, st.st_ino)
    cached = _IDENTITIES.get(key)
    if cached is not None and cached[0] == _stamp(st):
        return key, cached[1]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    try:
        fst = os.fstat(fd)  # what we actually read: the mapping may have changed since stat()
        if not stat.S_ISREG(fst.st_mode):
            return None
        ident = read_elf_identity(fd)
    finally:
        os.close(fd)
    key = (fst.st_dev, fst.st_ino)
    if len(_IDENTITIES) >= _IDENTITY_CACHE_MAX:
        _IDENTITIES.clear()  # crude, but bounded: a scan refills it cheaply
    _IDENTITIES[key] = (_stamp(fst), ident)
    return key, ident


# --------------------------------------------------------------------------
# The refused distributions' shared objects, found on disk without importing


@dataclass(frozen=True)
class RefusedObject:
    distribution: str
    path: str
    soname: str | None


_REFUSED: dict[tuple[str, ...], dict[str, RefusedObject]] = {}


def refused_package_dirs(search_path: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(distribution, site directory) pairs where a refused distribution is installed.

    Found with the path-based finder (not sys.meta_path, so an installed import
    guard is not consulted) and importlib.metadata; nothing is imported.
    """
    from importlib.machinery import PathFinder

    paths = list(sys.path if search_path is None else search_path)
    found: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()

    def add(dist: str, pkg_dir: str) -> None:
        site = os.path.realpath(os.path.dirname(pkg_dir.rstrip(os.sep)))
        if (dist, site) not in seen:
            seen.add((dist, site))
            found.append((dist, site))

    for dist in REFUSED_DISTRIBUTIONS:
        for pkg in dist.packages:
            try:
                spec = PathFinder.find_spec(pkg, paths)
            except (ImportError, OSError, ValueError):
                spec = None
            for loc in (spec.submodule_search_locations or []) if spec is not None else []:
                add(dist.name, str(loc))
        if any(d == dist.name for d, _ in found):
            continue
        # not importable by name from these paths: its installed metadata may still
        # say where it is (importlib.metadata costs ~20 ms to import, hence only now)
        try:
            from importlib import metadata

            for d in metadata.distributions(name=dist.name, path=paths):
                for pkg in dist.packages:
                    add(dist.name, str(d.locate_file(pkg)))
        except Exception:  # broken metadata must not break the scan
            pass
    return found


def refused_build_ids(search_path: Sequence[str] | None = None) -> dict[str, RefusedObject]:
    """build-id -> the refused distribution's shared object on disk that has it.

    Computed once per search path (only headers and notes are read, so even
    libtorch_cpu.so costs a few kilobytes), then cached for the process.
    """
    key = tuple(sys.path if search_path is None else search_path)
    cached = _REFUSED.get(key)
    if cached is not None:
        return cached
    out: dict[str, RefusedObject] = {}
    globs = {d.name: d.globs for d in REFUSED_DISTRIBUTIONS}
    for dist, site in refused_package_dirs(key):
        for pattern in globs[dist]:
            for path in sorted(glob.glob(os.path.join(glob.escape(site), pattern))):
                try:
                    got = identity_of(path)
                except OSError:
                    continue
                if got is None or got[1] is None or not got[1].build_id:
                    continue
                out.setdefault(got[1].build_id, RefusedObject(dist, path, got[1].soname))
    _REFUSED[key] = out
    return out


# --------------------------------------------------------------------------
# Mappings


@dataclass(frozen=True)
class ExecMapping:
    """One executable mapping and what backs it."""

    start: int
    end: int
    perms: str  # e.g. "r-xp"
    offset: int
    dev: str  # "major:minor" as the kernel prints it
    inode: int
    path: str  # as the kernel prints it, " (deleted)" stripped; "" for anonymous
    backing: str  # file | deleted | memfd | anonymous | special

    @property
    def address(self) -> str:
        return f"{self.start:x}-{self.end:x}"

    @property
    def writable(self) -> bool:
        return "w" in self.perms

    @property
    def object_key(self) -> tuple[object, ...]:
        """What backs it, independent of where it is mapped."""
        if self.backing == ANONYMOUS:
            return (ANONYMOUS,)  # [anon:NAME] can be renamed with prctl; still anonymous
        if self.backing == SPECIAL:
            return (SPECIAL, self.path)
        return ("object", self.dev, self.inode)

    def within(self, other: ExecMapping) -> bool:
        """This mapping is (part of) ``other``: same object, same addresses and file offsets."""
        if not (other.start <= self.start and self.end <= other.end) or self.object_key != other.object_key:
            return False
        if self.backing in (FILE, DELETED, MEMFD):
            return self.offset - other.offset == self.start - other.start
        return True


class _Line(NamedTuple):
    address: str  # as printed in maps
    perms: str
    path: str  # " (deleted)" stripped
    backing: str
    deleted: bool
    dev: str
    inode: int
    mapping: ExecMapping | None  # executable lines only


def _classify(raw_path: str) -> tuple[str, str, bool]:
    """(path without " (deleted)", backing, deleted)."""
    if not raw_path:
        return "", ANONYMOUS, False
    if raw_path[0] == "[":
        if raw_path.startswith(("[anon:", "[anon_shmem:")) or raw_path in ("[heap]", "[stack]"):
            return raw_path, ANONYMOUS, False
        return raw_path, SPECIAL, False  # [vdso], [vsyscall], [uprobes], [vvar]
    deleted = raw_path.endswith(_DELETED)
    path = raw_path[: -len(_DELETED)] if deleted else raw_path
    if path.startswith("/memfd:"):
        return path, MEMFD, True
    if path == "/dev/zero" or path.startswith("/SYSV"):
        # MAP_SHARED|MAP_ANONYMOUS and SysV shm: shmem with a made-up name
        return path, ANONYMOUS, deleted
    if deleted:
        return path, DELETED, True
    return path, FILE, False


def _parse(text: str) -> list[_Line]:
    """The lines that matter: executable ones, and file-backed ones (for the name rule)."""
    out: list[_Line] = []
    for line in text.splitlines():
        # address perms offset dev inode [pathname]; the path may contain spaces
        fields = line.split(None, 5)
        if len(fields) < 5:
            continue
        perms = fields[1]
        raw = fields[5].strip() if len(fields) > 5 else ""
        executable = "x" in perms
        if not raw and not executable:
            continue  # plain anonymous data: nothing to judge
        path, backing, deleted = _classify(raw)
        try:
            inode = int(fields[4])
            mapping = None
            if executable:
                lo, hi = fields[0].split("-", 1)
                mapping = ExecMapping(int(lo, 16), int(hi, 16), perms, int(fields[2], 16),
                                      fields[3], inode, path, backing)
        except ValueError:
            continue
        out.append(_Line(fields[0], perms, path, backing, deleted, fields[3], inode, mapping))
    return out


# --------------------------------------------------------------------------
# Hits


@dataclass(frozen=True)
class MapsHit:
    pid: int
    path: str  # as the kernel reports it (" (deleted)" stripped); "" for anonymous memory
    pattern: str  # soname pattern matched, "torch/_C", "build-id", or the kind for non-library hits
    address: str  # the mapping's range, e.g. "7f12a0000000-7f12a1000000"
    deleted: bool  # mapped from a file that has since been removed/replaced (memfds always are)
    kind: str = KIND_FORBIDDEN  # forbidden-library | new-exec-after-ready | writable-exec | unsafe-exec
    backing: str = FILE  # file | deleted | memfd | anonymous | special
    perms: str = ""
    soname: str | None = None  # ELF DT_SONAME of the mapped object, when read
    build_id: str | None = None
    distribution: str | None = None  # refused distribution whose file has this build-id
    reasons: tuple[str, ...] = field(default=())  # why, one clause each

    def describe(self) -> str:
        what = _display(self.path, self.backing, self.deleted)
        exe = "executable " if "x" in self.perms else ""
        if self.kind == KIND_WRITABLE_EXEC:
            return (f"pid {self.pid} maps {what} writable and executable ({self.perms}) at {self.address}: "
                    "W^X violated")
        if self.kind == KIND_UNSAFE_EXEC:
            why = "; ".join(self.reasons) or self.backing
            return (f"pid {self.pid} maps {what} executable ({self.perms}) at {self.address}: "
                    f"code that can still change after READY ({why})")
        if self.kind == KIND_FOREIGN_PAGE:
            return (f"pid {self.pid} maps {what} executable ({self.perms}) at {self.address}: "
                    f"code no file holds ({'; '.join(self.reasons)})")
        if self.kind == KIND_NEW_EXEC:
            return (f"pid {self.pid} maps {what} executable ({self.perms}) at {self.address}: "
                    f"new {self.backing} executable mapping after READY (not in the READY snapshot)")
        why = ", ".join(self.reasons) if self.reasons else f"matches {self.pattern}"
        return f"pid {self.pid} maps {what} {exe}at {self.address}: {why}"

    def __str__(self) -> str:
        return self.describe()


def _display(path: str, backing: str, deleted: bool) -> str:
    if backing == ANONYMOUS:
        return f"anonymous memory {path}".rstrip() if path else "anonymous memory"
    if backing == MEMFD:
        return path.lstrip("/") + _DELETED
    return path + (_DELETED if deleted else "")


def _name_pattern(path: str, backing: str) -> str | None:
    if backing not in (FILE, DELETED) or not path.startswith("/"):
        return None  # [heap], [stack], anonymous, memfd: no file name to judge
    return _path_pattern(path)


@lru_cache(maxsize=4096)
def _path_pattern(path: str) -> str | None:
    return forbidden_soname(path) or ("torch/_C" if is_torch_c_extension(path) else None)


def _identity_reasons(
    ident: ElfIdentity, refused: dict[str, RefusedObject]
) -> tuple[str | None, RefusedObject | None, list[str]]:
    """(pattern, refused object, reasons) for an ELF identity; no reasons = not refused."""
    pattern = None
    reasons: list[str] = []
    if ident.soname and (p := forbidden_soname(ident.soname)):
        pattern = p
        reasons.append(f"ELF SONAME {ident.soname}")
    obj = refused.get(ident.build_id) if ident.build_id else None
    if obj is not None and ident.build_id:
        pattern = pattern or "build-id"
        reasons.append(f"refused distribution {obj.distribution} (same build-id {ident.build_id[:16]} as {obj.path})")
    bad_needed = [n for n in ident.needed if forbidden_soname(n)]
    if bad_needed:
        pattern = pattern or forbidden_soname(bad_needed[0])
        reasons.append("ELF needs " + ", ".join(bad_needed))
    return pattern, obj, reasons


def _identify(
    pid: int, ln: _Line, m: ExecMapping, fd_cache: dict[int, dict[str, list[str]]],
    opener: ProcOpener = DIRECT,
) -> ElfIdentity | None:
    """ELF identity of the object behind an executable mapping of ``pid``.

    /proc/PID/map_files reaches every mapped object but needs CAP_SYS_ADMIN or
    CAP_CHECKPOINT_RESTORE in the initial user namespace. Without it (a
    supervisor with an empty capability bounding set), ptrace-level access is
    enough for /proc/PID/root/<path> (a named file) and /proc/PID/fd/N (a memfd
    or deleted file the process still holds open); either is used only if its
    (device, inode) is the one the maps line shows. An object reachable by
    neither (a memfd closed after mmap) is not identified. Through the broker's
    opener, map_files is opened by the broker (root) and followed here.
    """
    try:
        with opener.link(pid, f"map_files/{m.address}") as path:
            got = identity_of(path)
        return got[1] if got is not None else None
    except PermissionError:
        pass
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None  # the broker's open of a mapping gone since (identity_of's own None)
    try:
        major, minor = ln.dev.split(":", 1)
        expected = (os.makedev(int(major, 16), int(minor, 16)), ln.inode)
    except ValueError:
        return None
    if ln.backing == FILE:
        candidates = [f"root{ln.path}"]
    else:
        if pid not in fd_cache:
            fd_cache[pid] = _fd_links(pid, opener)  # once per scan, and only when needed
        candidates = fd_cache[pid].get(ln.path + _DELETED, [])
    for cand in candidates:
        try:
            with opener.link(pid, cand) as path:
                got = identity_of(path)
        except OSError:
            continue
        if got is not None and got[0] == expected:
            return got[1]
    return None


def _fd_links(pid: int, opener: ProcOpener = DIRECT) -> dict[str, list[str]]:
    """readlink text -> fd/N names (under /proc/PID), for the process's open files."""
    out: dict[str, list[str]] = {}
    try:
        names = opener.listdir(pid, "fd")
    except OSError:
        return out
    for n in names:
        try:
            with opener.link(pid, f"fd/{n}") as path:
                out.setdefault(os.readlink(path), []).append(f"fd/{n}")
        except OSError:
            continue
    return out


def _scan(pid: int, lines: list[_Line], *, identify: bool,
          search_path: Sequence[str] | None = None,
          opener: ProcOpener = DIRECT) -> list[MapsHit]:
    """Forbidden-library hits, one per mapped object, in maps order."""
    hits: dict[tuple[object, ...], MapsHit] = {}
    refused: dict[str, RefusedObject] | None = None
    identified: set[tuple[object, ...]] = set()
    fd_cache: dict[int, dict[str, list[str]]] = {}
    for ln in lines:
        if ln.backing in (ANONYMOUS, SPECIAL):
            continue
        key: tuple[object, ...] = ("path", ln.path) if ln.backing == FILE else ("object", ln.dev, ln.inode)
        if key not in hits:
            pattern = _name_pattern(ln.path, ln.backing)
            if pattern:
                hits[key] = MapsHit(pid, ln.path, pattern, ln.address, ln.deleted, backing=ln.backing,
                                    perms=ln.perms, reasons=(f"file name matches {pattern}",))
        m = ln.mapping
        if not identify or m is None or m.object_key in identified:
            continue
        identified.add(m.object_key)
        ident = _identify(pid, ln, m, fd_cache, opener)
        if ident is None:
            continue
        if refused is None and ident.build_id:
            refused = refused_build_ids(search_path)  # only once something has a build-id to compare
        pattern, obj, reasons = _identity_reasons(ident, refused or {})
        if not reasons:
            continue
        prev = hits.get(key)
        hits[key] = MapsHit(
            pid, ln.path, prev.pattern if prev else pattern or "build-id", ln.address, ln.deleted,
            backing=ln.backing, perms=ln.perms, soname=ident.soname, build_id=ident.build_id,
            distribution=obj.distribution if obj else None,
            reasons=(*(prev.reasons if prev else ()), *reasons),
        )
    return list(hits.values())


@dataclass(frozen=True)
class MountTable:
    """What a process's own /proc/PID/mountinfo says about devices, for unsafe-exec."""

    known: frozenset[tuple[int, int]]  # (major, minor) of every mount
    writable: dict[tuple[int, int], str]  # device -> a mount point it is writable at

    @classmethod
    def parse(cls, text: str) -> MountTable:
        known: set[tuple[int, int]] = set()
        writable: dict[tuple[int, int], str] = {}
        for ln in text.splitlines():
            fields = ln.split()
            try:
                sep = fields.index("-", 6)
                major, _, minor = fields[2].partition(":")
                dev = (int(major), int(minor))
            except (ValueError, IndexError):
                continue
            known.add(dev)
            per_sb = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
            if "ro" not in fields[5].split(",") and "ro" not in per_sb:
                writable.setdefault(dev, fields[4])
        return cls(frozenset(known), writable)


def read_mounts(pid: int, opener: ProcOpener = DIRECT) -> MountTable:
    try:
        with os.fdopen(opener.open(pid, "mountinfo"), encoding="utf-8",
                       errors="surrogateescape") as f:
            return MountTable.parse(f.read())
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessGone(pid) from exc
    except OSError as exc:
        if exc.errno == 3:
            raise ProcessGone(pid) from exc
        raise


def _maps_dev(dev: str) -> tuple[int, int] | None:
    major, _, minor = dev.partition(":")  # hex in maps, decimal in mountinfo
    try:
        return int(major, 16), int(minor, 16)
    except ValueError:
        return None


def unsafe_exec_reason(m: ExecMapping, mounts: MountTable | None) -> str | None:
    """Why the content of executable mapping ``m`` can still change, or None.

    Without ``mounts`` the file-on-a-writable-device rule is not applied.
    """
    if m.backing == MEMFD:
        return "a memfd: it can be written through its fd"
    if m.backing == DELETED and mounts is None:
        return "a deleted file: it can be written through an open fd"
    if m.backing == ANONYMOUS and (m.path in ("/dev/zero", "[anon_shmem]") or m.path.startswith(
            ("/SYSV", "[anon_shmem:")) or m.perms[3:4] == "s"):
        return "shared memory: another view of it can be writable"
    if m.backing == SPECIAL:
        return None  # [vdso], [vsyscall]: the kernel's
    # A deleted file counts by its device like any file: a library replaced by a host
    # package upgrade (read-only in the sandbox) is no risk; one deleted from /tmp is.
    if m.backing in (FILE, DELETED) and mounts is not None:
        dev = _maps_dev(m.dev)
        if dev is None or dev not in mounts.known:
            return f"a file on device {m.dev}, which no mount of the process shows"
        if dev in mounts.writable:
            return f"a file on a writable mount (device {m.dev} is writable at {mounts.writable[dev]})"
    return None


# /proc/PID/pagemap, one 64-bit entry per page: bit 63 present, 62 swapped, 61 a file
# page (or shared anonymous). Indexed by the top byte of each little-endian entry: 1 for
# a page of a private mapping that is not the file's own (a copy made on write, or
# swapped out, which only anonymous pages are).
NOT_THE_FILES = bytes(1 if (b & 0x40) or (b & 0xA0) == 0x80 else 0 for b in range(256))
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PAGEMAP_CHUNK = 1 << 16  # entries per read


def first_foreign_page(fd: int, start: int, end: int,
                       check: Callable[[], object] | None = None) -> int | None:
    """First page in [start, end) that is not the file's, read from the pagemap open at
    ``fd``; ``check`` runs between chunks (a budget may raise there)."""
    page, last = start // _PAGE, -(-end // _PAGE)
    while page < last:
        n = min(last - page, _PAGEMAP_CHUNK)
        data = os.pread(fd, n * 8, page * 8)
        if len(data) != n * 8:
            raise OSError(5, "short read of pagemap")
        at = data[7::8].translate(NOT_THE_FILES).find(1)
        if at >= 0:
            return (page + at) * _PAGE
        page += n
        if check is not None:
            check()
    return None


def foreign_pages(pid: int, mappings: Iterable[ExecMapping],
                  opener: ProcOpener = DIRECT) -> dict[int, int]:
    """start of mapping -> its first page that is not the file's, for each executable
    private file mapping of ``pid`` that holds one."""
    wanted = [m for m in mappings if m.backing == FILE and m.perms[3:4] == "p"]
    if not wanted:
        return {}
    try:
        fd = opener.open(pid, "pagemap")
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessGone(pid) from exc
    out: dict[int, int] = {}
    try:
        for m in wanted:
            page = first_foreign_page(fd, m.start, m.end)
            if page is not None:
                out[m.start] = page
    finally:
        os.close(fd)
    return out


def _exec_hits(pid: int, lines: Iterable[_Line], snapshot: ExecSnapshot | None, *,
               unsafe: bool = False, mounts: MountTable | None = None,
               pages: dict[int, int] | None = None) -> list[MapsHit]:
    """Writable+executable, then (``unsafe``) unsafe-exec and (``pages``, from
    `foreign_pages`) code pages no file holds, then (``snapshot``) new mappings."""
    wx: list[MapsHit] = []
    bad: list[MapsHit] = []
    new: list[MapsHit] = []
    for ln in lines:
        m = ln.mapping
        if m is None:
            continue
        if pages and m.start in pages:
            bad.append(MapsHit(pid, m.path, KIND_FOREIGN_PAGE, ln.address, ln.deleted,
                               kind=KIND_FOREIGN_PAGE, backing=m.backing, perms=m.perms,
                               reasons=(f"page {pages[m.start]:#x} is not the file's (a private "
                                        "copy: patched, or moved there)",)))
        if m.writable:
            wx.append(MapsHit(pid, m.path, KIND_WRITABLE_EXEC, ln.address, ln.deleted,
                              kind=KIND_WRITABLE_EXEC, backing=m.backing, perms=m.perms))
        why = unsafe_exec_reason(m, mounts) if unsafe else None
        if why is not None:
            bad.append(MapsHit(pid, m.path, KIND_UNSAFE_EXEC, ln.address, ln.deleted,
                               kind=KIND_UNSAFE_EXEC, backing=m.backing, perms=m.perms,
                               reasons=(why,)))
        if snapshot is not None and not snapshot.covers(m):
            new.append(MapsHit(pid, m.path, KIND_NEW_EXEC, ln.address, ln.deleted,
                               kind=KIND_NEW_EXEC, backing=m.backing, perms=m.perms))
    return wx + bad + new


@dataclass(frozen=True)
class ExecSnapshot:
    """The executable mappings of a process at one moment (READY)."""

    pid: int
    start_time: int  # /proc/PID/stat field 22: tells a reused pid apart
    mappings: frozenset[ExecMapping]
    # refusals found while taking it: forbidden libraries and writable+executable mappings
    hits: tuple[MapsHit, ...] = ()

    def __post_init__(self) -> None:
        index: dict[tuple[object, ...], list[ExecMapping]] = {}
        for s in self.mappings:
            index.setdefault(s.object_key, []).append(s)
        object.__setattr__(self, "_index", index)

    def covers(self, m: ExecMapping) -> bool:
        """``m`` is (part of) an executable mapping of the same object at READY."""
        return any(m.within(s) for s in self._index.get(m.object_key, ()))  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.mappings)


# --------------------------------------------------------------------------
# Entry points


def scan_maps_text(pid: int, text: str, *, snapshot: ExecSnapshot | None = None,
                   identify: bool = False, immutable_code: bool | None = None,
                   mounts: MountTable | None = None, pagemap: bool = False,
                   opener: ProcOpener = DIRECT) -> list[MapsHit]:
    """Refusals in the text of ``pid``'s maps file.

    Forbidden libraries first (one hit per mapped object), then, given a
    snapshot (or ``immutable_code=True``), writable+executable mappings and
    executable mappings whose content can still change (unsafe-exec; the
    writable-device rule only with ``mounts``), then, given a snapshot,
    executable mappings it does not cover. By default only the text is judged
    (file names); ``identify=True`` also reads each executable mapping through
    /proc/PID/map_files (root; a mapping gone since is skipped), which is what
    `scan_pid` does: the text must then be ``pid``'s own, just read. ``pagemap=True``
    (with immutable code) also reads ``pid``'s pagemap for code pages no file holds.
    """
    lines = _parse(text)
    hits = _scan(pid, lines, identify=identify, opener=opener)
    if immutable_code is None:
        immutable_code = snapshot is not None
    if snapshot is not None or immutable_code:
        pages = foreign_pages(pid, (ln.mapping for ln in lines if ln.mapping is not None),
                              opener) if pagemap and immutable_code else None
        hits += _exec_hits(pid, lines, snapshot, unsafe=immutable_code, mounts=mounts,
                           pages=pages)
    return hits


def _read_maps(pid: int, opener: ProcOpener = DIRECT) -> str:
    try:
        with os.fdopen(opener.open(pid, "maps"), encoding="utf-8",
                       errors="surrogateescape") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessGone(pid) from exc
    except OSError as exc:
        # ESRCH surfaces as a plain OSError when the task dies mid-read
        if exc.errno == 3:
            raise ProcessGone(pid) from exc
        raise


def start_time(pid: int, opener: ProcOpener = DIRECT) -> int:
    """Start time of ``pid`` in clock ticks since boot (ProcessGone if there is none)."""
    try:
        with os.fdopen(opener.open(pid, "stat"), "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessGone(pid) from exc
    except OSError as exc:
        if exc.errno == 3:
            raise ProcessGone(pid) from exc
        raise
    # comm may hold spaces and parentheses: fields resume after the last ")"
    rest = data[data.rindex(b")") + 2 :].split()
    return int(rest[19])  # field 22 overall; rest[0] is field 3


def task_exited(pid: int, tid: int | None = None, opener: ProcOpener = DIRECT) -> bool:
    """True once process ``pid`` (thread ``tid`` of it, if given) has exited: a zombie
    not yet reaped, or gone. Reads /proc only, reaps nothing."""
    name = "stat" if tid is None else f"task/{tid}/stat"
    try:
        with os.fdopen(opener.open(pid, name), "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rindex(b")") + 2:data.rindex(b")") + 3] in (b"Z", b"X")


def live_task(pid: int, opener: ProcOpener = DIRECT) -> int:
    """Which /proc/<id> shows process ``pid`` to a scan: ``pid`` itself, unless its main
    thread has exited while other threads run on (red team: a control worker that
    called exit(2), not exit_group(2), on its main thread went on with an empty
    /proc/PID/maps and an unreadable /proc/PID/mountinfo, and the scans skipped it as
    gone); then a live thread's id, whose /proc files show the same process."""
    if not task_exited(pid, opener=opener):
        return pid
    try:
        tids = sorted(int(t) for t in opener.listdir(pid, "task"))
    except OSError:
        return pid
    return next((t for t in tids if t != pid and not task_exited(pid, t, opener)), pid)


def scan_pid(pid: int, *, snapshot: ExecSnapshot | None = None, identify: bool = True,
             immutable_code: bool | None = None,
             opener: ProcOpener = DIRECT) -> list[MapsHit]:
    """Refusals for a live process. Raises ProcessGone if it has exited.

    A zombie has an empty maps file, so it yields no hits (nothing is mapped).
    PermissionError propagates: not being allowed to look is not "clean".
    With a snapshot (taken at READY) it must be of this same process
    (ProcessGone if the pid now names another one). With a snapshot, or with
    ``immutable_code=True`` (e.g. a control worker's child, which has no
    snapshot of its own), writable+executable and unsafe-exec mappings are
    refusals too. ``opener``: how /proc is reached (sandbox/procfs.py; the broker's for
    an unprivileged supervisor).
    """
    if snapshot is not None and snapshot.pid != pid:
        raise ValueError(f"snapshot of pid {snapshot.pid} used to scan pid {pid}")
    if immutable_code is None:
        immutable_code = snapshot is not None

    def scan(view: int) -> list[MapsHit]:
        text = _read_maps(view, opener)
        mounts = read_mounts(view, opener) if immutable_code else None
        if snapshot is not None and start_time(pid, opener) != snapshot.start_time:
            raise ProcessGone(pid)  # the pid was reused: the worker we snapshot is gone
        return scan_maps_text(view, text, snapshot=snapshot, identify=identify,
                              immutable_code=immutable_code, mounts=mounts, pagemap=True,
                              opener=opener)

    return _on_a_live_view(pid, opener, scan)


# A headless worker's threads may come and go while one is read (red team: churning
# threads); the view is chosen again this many times before the process counts as gone.
_VIEW_TRIES = 16


def _on_a_live_view(pid: int, opener: ProcOpener, fn):
    """``fn(view)`` on a live thread's view of ``pid`` (live_task); if that thread (not
    the process) exits meanwhile, a view is chosen again: a worker churning threads
    must not slip out of a scan (seen under load in the full suite: 30 of 30 scans
    "gone")."""
    for _ in range(_VIEW_TRIES):
        view = live_task(pid, opener)
        try:
            return fn(view)
        except ProcessGone as e:
            if view == pid or e.pid != view:
                raise
    raise ProcessGone(pid)


def exec_snapshot(pid: int, *, identify: bool = True,
                  opener: ProcOpener = DIRECT) -> ExecSnapshot:
    """Executable mappings of ``pid`` now, with the refusals already visible.

    ``hits`` lists forbidden libraries, writable+executable mappings and
    executable mappings whose content can still change (unsafe-exec: memfd,
    deleted file, shared memory, file on a device the process can write): the
    supervisor refuses READY if it is not empty.
    """
    begun = start_time(pid, opener)

    def snap(view: int) -> ExecSnapshot:
        text = _read_maps(view, opener)
        mounts = read_mounts(view, opener)
        if start_time(pid, opener) != begun:
            raise ProcessGone(pid)
        lines = _parse(text)
        mappings = frozenset(ln.mapping for ln in lines if ln.mapping is not None)
        pages = foreign_pages(view, mappings, opener)
        hits = _scan(view, lines, identify=identify, opener=opener) + _exec_hits(
            view, lines, None, unsafe=True, mounts=mounts, pages=pages)
        return ExecSnapshot(pid, begun, mappings, tuple(hits))

    return _on_a_live_view(pid, opener, snap)


def scan_self(*, identify: bool = True) -> list[MapsHit]:
    return scan_pid(os.getpid(), identify=identify)


__all__ = [
    "KIND_FOREIGN_PAGE",
    "KIND_FORBIDDEN",
    "KIND_NEW_EXEC",
    "KIND_UNSAFE_EXEC",
    "KIND_WRITABLE_EXEC",
    "ElfIdentity",
    "ExecMapping",
    "ExecSnapshot",
    "MapsHit",
    "MountTable",
    "ProcessGone",
    "RefusedObject",
    "exec_snapshot",
    "first_foreign_page",
    "foreign_pages",
    "identity_of",
    "read_elf_identity",
    "read_mounts",
    "refused_build_ids",
    "refused_package_dirs",
    "scan_maps_text",
    "scan_pid",
    "scan_self",
    "start_time",
    "unsafe_exec_reason",
]
