"""The cached static check, and its copy on disk for the next supervisor process.

A supervisor that has just started walks its workers' code cold: every source file
parsed (~640 files for a tinygrad worker, 6 s quiet, 10-16 s at load 7 on 2 cores).
With ``TRIO_ADMISSION_CACHE=DIR`` a walk is also written to DIR, and a later process
takes it while its witness holds (every file and directory it read, as in memory; see
_witness). The entry is a verdict about torch, so it is trusted only as the supervisor
trusts its own state: DIR and each entry owned by this uid and writable by no one
else; JSON, never pickle (reading it runs no code); an entry names the admission
code that wrote it (a hash of this package's sources) and its key, and anything
unexpected in it is a miss, never an error. Without the variable nothing is written;
``TRIO_ADMISSION_CACHE=off`` walks every worker afresh, in memory too (to measure
what the cache saves, or to rule it out).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass
from typing import Any

from supervisor.outdir import OutDir, OutDirError

from ._witness import FileId, Witness
from .elf import ElfHit, ElfResult
from .imports import Hop, ImportHit, WalkResult
from .rules import LAZY_IMPORT_WAIVERS, MODULE_RULES

ENV = "TRIO_ADMISSION_CACHE"


@dataclass(frozen=True)
class Static:
    """What a control worker's code reaches, whoever runs it: the walks' hits and notes,
    the native files' DT_NEEDED closure. The report (named for one worker) is built
    from it."""

    walks: tuple[WalkResult, ...]  # modules left empty: the report does not read them
    package_roots: dict[str, list[str]]
    elf: ElfResult
    exe_missing: str | None  # argv[0] when it is not on PATH
    notes: tuple[str, ...]


_CODE_VERSION: str | None = None


def code_version() -> str:
    """The admission code that judges: its sources and the interpreter (ast's output)."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        h = hashlib.sha256(sys.implementation.cache_tag.encode() + sys.version.encode())
        here = os.path.dirname(os.path.abspath(__file__))
        for fn in sorted(os.listdir(here)):
            if fn.endswith(".py"):
                with open(os.path.join(here, fn), "rb") as f:
                    h.update(fn.encode() + b"\0" + f.read())
        _CODE_VERSION = h.hexdigest()
    return _CODE_VERSION


# ---------------------------------------------------------------- encoding


def _enc_id(i: FileId) -> Any:
    return None if i is None else list(i)


def _dec_id(v: Any) -> FileId:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, (int, str)) for x in v):
        raise ValueError("bad identity")
    return tuple(v)  # type: ignore[return-value]


def _enc_hit(h: ImportHit) -> dict[str, Any]:
    return {"forbidden": h.forbidden, "rule": MODULE_RULES.index(h.rule),
            "hops": [[p.module, p.file, p.line, p.verb] for p in h.hops],
            "scope": h.scope, "lazy": h.lazy,
            "waiver": None if h.waiver is None else LAZY_IMPORT_WAIVERS.index(h.waiver)}


def _dec_hit(d: dict[str, Any]) -> ImportHit:
    waiver = d["waiver"]
    return ImportHit(str(d["forbidden"]), MODULE_RULES[int(d["rule"])],
                     [Hop(str(m), f, ln, str(v)) for m, f, ln, v in d["hops"]],
                     str(d["scope"]), bool(d["lazy"]),
                     None if waiver is None else LAZY_IMPORT_WAIVERS[int(waiver)])


def encode(key: list[Any], witness: Witness, s: Static) -> dict[str, Any]:
    return {
        "version": code_version(), "key": key,
        "witness": {p: _enc_id(i) for p, i in witness.ids.items()},
        "walks": [{"entry": w.entry, "sys_path": w.sys_path, "notes": w.notes,
                   "hits": [_enc_hit(h) for h in w.hits],
                   "unreadable": [list(u) for u in w.unreadable]} for w in s.walks],
        "package_roots": s.package_roots,
        "elf": {"notes": s.elf.notes, "checked": s.elf.checked,
                "hits": [[h.root, h.library, h.resolved, h.chain] for h in s.elf.hits]},
        "exe_missing": s.exe_missing, "notes": list(s.notes),
    }


def decode(d: dict[str, Any]) -> tuple[Witness, Static]:
    walks = tuple(WalkResult(str(w["entry"]), list(w["sys_path"]), [_dec_hit(h) for h in w["hits"]],
                             {}, list(w["notes"]),
                             [(str(m), str(f)) for m, f in w["unreadable"]]) for w in d["walks"])
    elf = ElfResult([ElfHit(r, lib, res, list(chain)) for r, lib, res, chain in d["elf"]["hits"]],
                    list(d["elf"]["notes"]), list(d["elf"]["checked"]))
    witness = Witness({str(p): _dec_id(i) for p, i in d["witness"].items()})
    roots = {str(k): [str(x) for x in v] for k, v in d["package_roots"].items()}
    return witness, Static(walks, roots, elf, d["exe_missing"], tuple(d["notes"]))


# ---------------------------------------------------------------- the directory


def _own_private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def disabled() -> bool:
    return os.environ.get(ENV) == "off"


def _open_dir() -> OutDir | None:
    """The cache directory, opened once per use (``O_DIRECTORY|O_NOFOLLOW``) and judged
    by `supervisor.outdir`'s rule with no sudo user trusted: every directory on its way
    root's or ours and writable by no one else (a sticky /tmp aside), itself ours and
    private. Everything after goes through its fd: a user who can rename the cache or
    its parent cannot make root write or prune elsewhere (red team round 5 row 12).
    Anything else is a miss, never an error."""
    d = os.environ.get(ENV)
    if not d or d == "off":
        return None
    try:
        out = OutDir.open(d, what=ENV, empty=False, mode=0o700, invoker=False, parents=True)
    except (OSError, OutDirError):
        return None
    st = os.fstat(out.fd)
    if not _own_private(st):
        out.close()
        return None
    return out


def _name(key: list[Any]) -> str:
    name = hashlib.sha256(json.dumps([code_version(), key]).encode()).hexdigest()[:32]
    return f"{name}.json"


def load(key: list[Any]) -> tuple[Witness, Static] | None:
    """The entry for ``key`` written by this admission code, or None."""
    d = _open_dir()
    if d is None:
        return None
    try:
        fd = os.open(_name(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=d.fd)
    except OSError:
        d.close()
        return None
    d.close()
    try:
        with os.fdopen(fd, "rb") as f:
            if not (stat.S_ISREG(os.fstat(f.fileno()).st_mode) and _own_private(os.fstat(f.fileno()))):
                return None
            data = json.load(f)
        if data.get("version") != code_version() or data.get("key") != key:
            return None
        return decode(data)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None  # truncated, foreign or from other code: walk again


def save(key: list[Any], witness: Witness, s: Static) -> None:
    """Write the entry atomically (a reader sees the old one or the new one)."""
    d = _open_dir()
    if d is None:
        return
    with d:
        try:
            # A fresh name (O_EXCL|O_NOFOLLOW, 0600 as the entry) renamed into place,
            # all relative to the directory's fd.
            d.write_text(_name(key), json.dumps(encode(key, witness, s)), 0o600)
            _prune(d.fd)
        except (OSError, ValueError, TypeError):
            return  # a full disk costs the next process a walk, nothing more


MAX_ENTRIES = 64  # ~0.3 MB each; entries of older admission code are never read again


def _prune(dfd: int) -> None:
    """Keep the MAX_ENTRIES most recently written entries (by the directory's fd: never
    a path that could have been swapped for another directory)."""
    entries = []
    with os.scandir(dfd) as it:
        for e in it:
            if e.name.endswith(".json"):
                try:
                    entries.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
                except OSError:
                    continue
    for _, name in sorted(entries)[:-MAX_ENTRIES]:
        try:
            os.unlink(name, dir_fd=dfd)
        except OSError:
            pass
