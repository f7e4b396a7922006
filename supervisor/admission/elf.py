"""Native-code check: which shared libraries would the dynamic loader map?

A Python-level walk cannot see that an extension module links libtorch_cpu.so,
so every native extension in the packages the import walk reached (and the
executable of command workers) is read with pyelftools, and DT_NEEDED is
followed transitively, resolving names roughly the way ld.so does.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.machinery import EXTENSION_SUFFIXES
from typing import Any

from elftools.elf.dynamic import DynamicSegment
from elftools.elf.elffile import ELFFile

from ._witness import FileId, check_reads, file_id, read_identified, saw, see, walk_dirs
from .rules import forbidden_soname, is_torch_c_extension

_ELF_MAGIC = b"\x7fELF"

# Searched after RPATH/RUNPATH/ld.so.cache, like ld.so's built-in defaults.
DEFAULT_LIB_DIRS: tuple[str, ...] = (
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
)


class ElfUnreadable(Exception):
    """Not an ELF file, or one pyelftools cannot make sense of."""


@dataclass(frozen=True)
class ElfInfo:
    path: str
    soname: str | None
    needed: tuple[str, ...]
    rpath: tuple[str, ...]  # raw entries, $ORIGIN not yet expanded
    runpath: tuple[str, ...]
    elfclass: int  # 32 / 64
    machine: str  # e_machine, e.g. "EM_X86_64"


@dataclass(frozen=True)
class ElfHit:
    root: str  # the file we started from (extension module / executable)
    library: str  # the forbidden name as needed (or the root itself)
    resolved: str | None  # where it lives, when found
    chain: list[str]  # root, each needed name (with its path), ..., the forbidden one

    def describe(self) -> str:
        if len(self.chain) == 1:
            return f"file {self.chain[0]} is itself a forbidden library ({self.library})"
        text = f"file {self.chain[0]}"
        for link in self.chain[1:]:
            text += f" needs {link}"
        return text


@dataclass
class ElfResult:
    hits: list[ElfHit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # every object read


# --------------------------------------------------------------------------
# Reading


def _split_path_list(value: str) -> tuple[str, ...]:
    return tuple(p for p in value.split(":") if p)


_ELF_CACHE: dict[tuple[str, FileId], ElfInfo] = {}


def _read_elf_cached(path: str, ident: FileId, data: bytes) -> ElfInfo:
    # keyed on the whole identity (inode, ctime, the digest of ``data``): what is parsed
    # is the bytes the identity was taken of, as the cached walk's witness expects
    key = (path, ident)
    got = _ELF_CACHE.get(key)
    if got is None:
        if len(_ELF_CACHE) >= 4096:
            _ELF_CACHE.clear()
        got = _ELF_CACHE[key] = _parse_elf(path, data)
    return got


def _parse_elf(path: str, data: bytes) -> ElfInfo:
    with io.BytesIO(data) as f:
        if f.read(4) != _ELF_MAGIC:
            raise ElfUnreadable("not an ELF file")
        f.seek(0)
        try:
            elf = ELFFile(f)
            needed: list[str] = []
            rpath: tuple[str, ...] = ()
            runpath: tuple[str, ...] = ()
            soname = None
            dyn: Any = None  # DynamicSegment or the .dynamic section: same iter_tags()
            for seg in elf.iter_segments():
                if isinstance(seg, DynamicSegment):
                    dyn = seg
                    break
            if dyn is None:
                dyn = elf.get_section_by_name(".dynamic")
            if dyn is not None:
                for tag in dyn.iter_tags():
                    d_tag = tag.entry.d_tag
                    if d_tag == "DT_NEEDED":
                        needed.append(tag.needed)
                    elif d_tag == "DT_SONAME":
                        soname = tag.soname
                    elif d_tag == "DT_RPATH":
                        rpath = _split_path_list(tag.rpath)
                    elif d_tag == "DT_RUNPATH":
                        runpath = _split_path_list(tag.runpath)
            return ElfInfo(path, soname, tuple(needed), rpath, runpath, elf.elfclass, elf["e_machine"])
        except ElfUnreadable:
            raise
        except Exception as exc:  # pyelftools raises a zoo of types on bad input
            raise ElfUnreadable(f"corrupt ELF ({type(exc).__name__}: {exc})") from exc


def read_elf(path: str) -> ElfInfo:
    """DT_NEEDED/DT_SONAME/RPATH/RUNPATH of one file; ElfUnreadable if it is not a sane ELF.
    Within one check each path is read once (_witness.check_reads)."""
    memo = check_reads()
    if memo is not None:
        got = memo.get(("elf", path))
        if got is None:
            try:
                got = memo[("elf", path)] = _read_elf(path)
            except ElfUnreadable as e:
                got = memo[("elf", path)] = e
        if isinstance(got, ElfUnreadable):
            raise got
        return got
    return _read_elf(path)


def _read_elf(path: str) -> ElfInfo:
    ident, data = read_identified(path)   # never opens a FIFO named x.so (it would block)
    saw(path, ident)  # the witness of a cached check (see _witness)
    if data is None:
        if ident is None:
            raise ElfUnreadable("cannot stat: no such file")
        if isinstance(ident[0], str):
            raise ElfUnreadable(f"cannot read: {os.strerror(ident[1])}")
        raise ElfUnreadable("not a regular file")
    return _read_elf_cached(path, ident, data)


# --------------------------------------------------------------------------
# Resolving names the way ld.so does (close enough for a deny-list)


_LD_SO_CACHE = "/etc/ld.so.cache"


def _ldconfig_cache() -> dict[str, tuple[str, ...]]:
    """soname -> paths from ``ldconfig -p``, read again when /etc/ld.so.cache changes."""
    see(_LD_SO_CACHE)
    return _ldconfig_table(file_id(_LD_SO_CACHE))


@lru_cache(maxsize=1)
def _ldconfig_table(_cache_id: FileId) -> dict[str, tuple[str, ...]]:
    """soname -> paths from ``ldconfig -p`` (empty when ldconfig is unavailable)."""
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    table: dict[str, list[str]] = {}
    for line in out.splitlines():
        if "=>" not in line:
            continue
        left, _, path = line.partition("=>")
        name = left.strip().split(" ", 1)[0]
        table.setdefault(name, []).append(path.strip())
    return {k: tuple(v) for k, v in table.items()}


def _expand_origin(entry: str, obj_path: str) -> list[str]:
    """Expand $ORIGIN (both the path as given and through symlinks), $LIB, $PLATFORM."""
    origins = {os.path.dirname(os.path.abspath(obj_path)), os.path.dirname(os.path.realpath(obj_path))}
    out: list[str] = []
    for origin in sorted(origins):
        e = entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
        for lib in ("lib64", "lib/x86_64-linux-gnu", "lib"):
            for plat in ("x86_64",):
                v = e.replace("${LIB}", lib).replace("$LIB", lib).replace("${PLATFORM}", plat).replace("$PLATFORM", plat)
                v = os.path.normpath(v)
                if v not in out:
                    out.append(v)
    return out


def _compatible(path: str, want: ElfInfo) -> ElfInfo | None:
    """ld.so skips candidates of the wrong class/machine (e.g. /usr/lib32)."""
    try:
        info = read_elf(path)
    except ElfUnreadable:
        return None
    if info.elfclass != want.elfclass or info.machine != want.machine:
        return None
    return info


class LibraryResolver:
    def __init__(self, extra_dirs: list[str] | None = None, use_ldconfig: bool = True) -> None:
        # extra_dirs: the worker's LD_LIBRARY_PATH, if it sets one
        self.extra_dirs = list(extra_dirs or [])
        self.use_ldconfig = use_ldconfig

    def search_dirs(self, requester: ElfInfo, inherited_rpath: tuple[str, ...]) -> list[str]:
        dirs: list[str] = []
        if not requester.runpath:
            # DT_RPATH applies only without DT_RUNPATH, and is inherited by
            # the libraries it loads
            for e in requester.rpath:
                dirs += _expand_origin(e, requester.path)
            dirs += list(inherited_rpath)
        dirs += self.extra_dirs
        for e in requester.runpath:
            dirs += _expand_origin(e, requester.path)
        # not what ld.so does, but a library shipped next to the object is
        # almost certainly meant to be loaded with it
        dirs.append(os.path.dirname(os.path.abspath(requester.path)))
        return list(dict.fromkeys(dirs))

    def resolve(self, name: str, requester: ElfInfo, inherited_rpath: tuple[str, ...]) -> tuple[str, ElfInfo] | None:
        if "/" in name:
            info = _compatible(name, requester)
            return (name, info) if info else None
        for d in self.search_dirs(requester, inherited_rpath):
            see(d)  # a library added here would be found first next time
            cand = os.path.join(d, name)
            if os.path.isfile(cand):
                info = _compatible(cand, requester)
                if info:
                    return cand, info
        if self.use_ldconfig:
            for cand in _ldconfig_cache().get(name, ()):
                info = _compatible(cand, requester)
                if info:
                    return cand, info
        for d in DEFAULT_LIB_DIRS:
            see(d)
            cand = os.path.join(d, name)
            if os.path.isfile(cand):
                info = _compatible(cand, requester)
                if info:
                    return cand, info
        return None


# --------------------------------------------------------------------------
# Checking


def native_files_in(roots: list[str]) -> list[str]:
    """Every shared object (``*.so``, ``*.so.N``, extension suffixes) under the given dirs/files."""
    out: list[str] = []
    suffixes = tuple(EXTENSION_SUFFIXES)
    for root in roots:
        see(root)
        if os.path.isfile(root):
            out.append(root)
            continue
        for dirpath, filenames in walk_dirs(root, keep=lambda d: d != "__pycache__"):
            for fn in filenames:
                if fn.endswith(suffixes) or fn.endswith(".so") or ".so." in fn:
                    out.append(os.path.join(dirpath, fn))
    return sorted(set(out))


def check_elf_files(
    roots: list[str],
    *,
    resolver: LibraryResolver | None = None,
) -> ElfResult:
    """Follow DT_NEEDED from each root; a hit per root that reaches a forbidden library.

    Forbidden names are judged before resolution: a DT_NEEDED of
    libtorch_cpu.so is refused even if no such file exists on this machine.
    """
    resolver = resolver or LibraryResolver()
    result = ElfResult()
    for root in roots:
        _check_one(root, resolver, result)
    result.notes = list(dict.fromkeys(result.notes))
    return result


def _label(name: str, path: str | None) -> str:
    return f"{name} ({path})" if path else f"{name} (not found on this machine)"


def _check_one(root: str, resolver: LibraryResolver, result: ElfResult) -> None:
    root_pattern = forbidden_soname(root)
    if root_pattern or is_torch_c_extension(root):
        result.hits.append(ElfHit(root, os.path.basename(root), root, [root]))
        return
    try:
        info = read_elf(root)
    except ElfUnreadable as exc:
        result.notes.append(f"skipped {root}: {exc}")
        return
    result.checked.append(root)
    if info.soname and forbidden_soname(info.soname):
        result.hits.append(ElfHit(root, info.soname, root, [f"{root} (soname {info.soname})"]))
        return
    # BFS over (object, chain so far, inherited DT_RPATH dirs)
    queue: deque[tuple[ElfInfo, list[str], tuple[str, ...]]] = deque([(info, [root], ())])
    seen = {os.path.realpath(root)}
    while queue:
        obj, chain, inherited = queue.popleft()
        own_rpath: tuple[str, ...] = ()
        if not obj.runpath:
            own_rpath = tuple(d for e in obj.rpath for d in _expand_origin(e, obj.path))
        for name in obj.needed:
            if forbidden_soname(name):
                found = resolver.resolve(name, obj, inherited)
                path = found[0] if found else None
                result.hits.append(ElfHit(root, name, path, chain + [_label(name, path)]))
                return  # one chain per root is enough to refuse it
            found = resolver.resolve(name, obj, inherited)
            if found is None:
                result.notes.append(f"{obj.path}: needed library {name} not found (the loader would fail too)")
                continue
            path, dep = found
            if dep.soname and forbidden_soname(dep.soname):
                result.hits.append(ElfHit(root, dep.soname, path, chain + [_label(name, path), f"soname {dep.soname}"]))
                return
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            result.checked.append(path)
            queue.append((dep, chain + [_label(name, path)], inherited + own_rpath))
