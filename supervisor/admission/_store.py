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
import tempfile
from dataclasses import dataclass
from typing import Any

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
                   "hits": [_enc_hit(h) for h in w.hits]} for w in s.walks],
        "package_roots": s.package_roots,
        "elf": {"notes": s.elf.notes, "checked": s.elf.checked,
                "hits": [[h.root, h.library, h.resolved, h.chain] for h in s.elf.hits]},
        "exe_missing": s.exe_missing, "notes": list(s.notes),
    }


def decode(d: dict[str, Any]) -> tuple[Witness, Static]:
    walks = tuple(WalkResult(str(w["entry"]), list(w["sys_path"]), [_dec_hit(h) for h in w["hits"]],
                             {}, list(w["notes"])) for w in d["walks"])
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


def _dir() -> str | None:
    d = os.environ.get(ENV)
    if not d or d == "off":
        return None
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return None
    return d if stat.S_ISDIR(st.st_mode) and _own_private(st) else None


def _path(d: str, key: list[Any]) -> str:
    name = hashlib.sha256(json.dumps([code_version(), key]).encode()).hexdigest()[:32]
    return os.path.join(d, f"{name}.json")


def load(key: list[Any]) -> tuple[Witness, Static] | None:
    """The entry for ``key`` written by this admission code, or None."""
    d = _dir()
    if d is None:
        return None
    try:
        fd = os.open(_path(d, key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
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
    d = _dir()
    if d is None:
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(encode(key, witness, s), f)
            os.replace(tmp, _path(d, key))
        except BaseException:
            os.unlink(tmp)
            raise
        _prune(d)
    except (OSError, ValueError, TypeError):
        return  # a full disk costs the next process a walk, nothing more


MAX_ENTRIES = 64  # ~0.3 MB each; entries of older admission code are never read again


def _prune(d: str) -> None:
    """Keep the MAX_ENTRIES most recently written entries."""
    entries = []
    for e in os.scandir(d):
        if e.name.endswith(".json"):
            try:
                entries.append((e.stat(follow_symlinks=False).st_mtime_ns, e.path))
            except OSError:
                continue
    for _, path in sorted(entries)[:-MAX_ENTRIES]:
        try:
            os.unlink(path)
        except OSError:
            pass
