"""check_worker: the admission decision for one worker, before it is started."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

from dataclasses import dataclass

from . import _store
from ._store import Static
from ._witness import RACY_NS, Witness, recording, see
from .elf import ElfHit, LibraryResolver, check_elf_files, native_files_in
from .imports import ImportHit, PathDisplay, WalkResult, walk_code, walk_module, walk_script
from .maps import scan_pid
from .report import AdmissionReport, Finding

DOMAINS = ("control", "research")

_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?([a-z]|-dbg)?$")
# interpreter options that consume the next argument
_PY_OPTS_WITH_ARG = {"-W", "-X", "--check-hash-based-pycs"}


def _is_python(path: str) -> bool:
    if _PYTHON_NAME.match(os.path.basename(path)):
        return True
    try:
        return os.path.realpath(path) == os.path.realpath(sys.executable)
    except OSError:
        return False


def _shebang_python(path: str) -> bool:
    """A script whose ``#!`` line runs Python (console_scripts wrappers, etc.)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    if not first.startswith(b"#!"):
        return False
    words = first[2:].decode(errors="replace").split()
    if not words:
        return False
    interp = words[0]
    if os.path.basename(interp) == "env" and len(words) > 1:
        interp = next((w for w in words[1:] if not w.startswith("-")), "")
    return bool(_PYTHON_NAME.match(os.path.basename(interp)))


def _python_target(args: list[str]) -> tuple[str, str, list[str]] | None:
    """What ``python ARGS`` runs, read as CPython reads its options (a short option
    may be combined with others: ``-Bm MOD``, red team 12 row 14): ("module", m, rest) /
    ("code", c, rest) / ("script", path, rest) / None; `rest`: the arguments after it."""
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-" or a == "--":
            return None
        if a.startswith("--"):
            i += 2 if a in _PY_OPTS_WITH_ARG else 1
            continue
        if a.startswith("-") and len(a) > 1:
            j, step = 1, 1
            while j < len(a):
                ch, tail = a[j], a[j + 1:]
                if ch in "mc":
                    value = tail or (args[i + 1] if i + 1 < len(args) else None)
                    if value is None:
                        return None
                    rest = args[i + 1:] if tail else args[i + 2:]
                    return ("module" if ch == "m" else "code", value, rest)
                if ch in "WX":          # takes the rest of the token, or the next one
                    step = 1 if tail else 2
                    break
                j += 1
            i += step
            continue
        return ("script", a, args[i + 1:])
    return None


# Modules that run another named by their arguments: the one they run is walked too
# (red team 12 row 8: `python -m supervisor.runner MOD` was admitted from the runner's
# own imports, MOD's `import torch` never walked). value: whether the first positional
# argument is a module (else a script); a "-m NAME" among the arguments always is.
_LAUNCHERS = {"supervisor.runner": True, "runpy": True, "cProfile": False,
              "profile": False, "pdb": False, "trace": False}


def _launched(module: str, rest: list[str]) -> tuple[str, str] | None:
    """("module", m) / ("script", path) that launcher `module` runs, or None."""
    if module not in _LAUNCHERS:
        return None
    if module == "supervisor.runner":       # runner.main: its first argument, whatever
        return ("module", rest[0]) if rest else None
    for k, a in enumerate(rest):
        if a == "-m" and k + 1 < len(rest):
            return ("module", rest[k + 1])
        if a.startswith("-m") and len(a) > 2 and not _LAUNCHERS[module]:
            return ("module", a[2:])
    positional = [a for a in rest if not a.startswith("-")]
    if not positional:
        return None
    return ("module" if _LAUNCHERS[module] else "script", positional[0])


def _package_of(path: str, roots: dict[str, list[str]]) -> str | None:
    for top, locations in roots.items():
        for loc in locations:
            if path == loc or path.startswith(loc.rstrip(os.sep) + os.sep):
                return top
    return None


def check_worker(
    name: str,
    domain: str,
    module: str | None,
    argv: list[str] | None,
    sys_path: list[str],
    *,
    ld_library_path: list[str] | None = None,
) -> AdmissionReport:
    """Admit or refuse a worker before it starts.

    Control-domain workers are refused if torch (or another forbidden module
    or library) is statically reachable from their entry module, script or
    executable. Research-domain workers are always admitted.

    module: entry module run as ``python -m module`` with ``sys_path``.
    argv: for command workers; the executable's ELF dependencies are checked,
    and ``python -m mod`` / ``python script.py`` / ``python -c code`` /
    Python shebang scripts are walked as well.
    ld_library_path: the worker's LD_LIBRARY_PATH entries, if it sets any.
    """
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r} for worker {name!r} (expected one of {DOMAINS})")
    if module is None and not argv:
        raise ValueError(f"worker {name!r} has neither a module nor an argv")
    report = AdmissionReport(worker=name, domain=domain, ok=True)
    if domain == "research":
        return report

    static = _static_check(module, argv, sys_path, ld_library_path)
    if static.exe_missing is not None:
        # fail closed: what cannot be found cannot be shown torch-free
        report.findings.append(
            Finding("elf", name, domain, [static.exe_missing],
                    f"control-domain worker {name}: executable {static.exe_missing!r} not found, cannot verify it")
        )
    if module is not None and any(n.startswith(f"entry module {module} not found")
                                  for w in static.walks for n in w.notes):
        # fail closed: a module the walk cannot find is code no one has read
        report.findings.append(
            Finding("import", name, domain, [module],
                    f"control-domain worker {name}: module {module!r} not found on its "
                    f"sys.path, cannot verify it"))
    report.notes.extend(static.notes)
    for walk in static.walks:
        display = walk.display
        for import_hit in walk.hits:
            _add_import_hit(report, import_hit, display)
        for module, file in walk.unreadable:
            # fail closed: bytecode without source (or code in an archive), or a cache
            # the interpreter would run instead of the source, is code this walk did
            # not read, so cannot show torch-free (red team 11 rows 9, 14)
            what = ("bytecode the interpreter would run instead of its source, not what "
                    "the source compiles to: remove it" if f"{os.sep}__pycache__{os.sep}" in file
                    else "code admission cannot read (no source): ship its source")
            report.findings.append(Finding(
                "import", name, domain, [walk.entry, module],
                f"control-domain worker {name}: {module} ({display(file)}) is {what}"))
        report.notes.extend(walk.notes)
    for elf_hit in static.elf.hits:
        _add_elf_hit(report, elf_hit, static.package_roots)
    report.notes.extend(static.elf.notes)

    report.notes = list(dict.fromkeys(report.notes))
    report.ok = not report.findings
    return report


# key -> (witness, result). A fleet of one module (the attack fleet: 62 workers) pays
# for one walk; a hit is taken only while every file and directory the walk read is
# what it was (see _witness), so a module edited between two admissions is walked again.
_CACHE: dict[str, tuple[Witness, Static]] = {}
_CACHE_MAX = 64


@dataclass
class CacheStats:
    hits: int = 0
    walks: int = 0  # checks run from scratch (first sight, or something changed)


CACHE_STATS = CacheStats()


def _static_check(module: str | None, argv: list[str] | None, sys_path: list[str],
                  ld_library_path: list[str] | None) -> Static:
    relative = any(not os.path.isabs(p) for p in (*sys_path, *(ld_library_path or ())))
    key = [module, list(argv or ()), list(sys_path), list(ld_library_path or ()),
           os.getcwd() if relative else None,  # relative entries ("" is the cwd)
           os.environ.get("PATH", os.defpath) if argv else None]
    if _store.disabled():
        CACHE_STATS.walks += 1
        with recording():           # its memo: each file read once per walk
            return _static_uncached(module, argv, sys_path, ld_library_path)
    mkey = json.dumps(key)
    hit = _CACHE.get(mkey) or _store.load(key)  # memory, else a previous process's
    if hit is not None and hit[0].still_holds():
        CACHE_STATS.hits += 1
        _remember(mkey, hit)
        return hit[1]
    CACHE_STATS.walks += 1
    started_ns = time.time_ns()
    with recording() as witness:
        static = _static_uncached(module, argv, sys_path, ld_library_path)
    if witness.settled_before(started_ns - RACY_NS):
        _remember(mkey, (witness, static))
        _store.save(key, witness, static)
    else:
        _CACHE.pop(mkey, None)  # something it read was just changed: walk again next time
    return static


def _remember(mkey: str, entry: tuple[Witness, Static]) -> None:
    _CACHE.pop(mkey, None)
    while len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[mkey] = entry


def clear_cache() -> None:
    """Forget every cached walk (tests that count walks)."""
    _CACHE.clear()


def _static_uncached(module: str | None, argv: list[str] | None, sys_path: list[str],
                     ld_library_path: list[str] | None) -> Static:
    walks: list[WalkResult] = []
    executables: list[str] = []
    notes: list[str] = []
    exe_missing = None
    if module is not None:
        walks.append(walk_module(module, sys_path))
    if argv:
        for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
            see(d or os.curdir)  # shutil.which's search: an executable added earlier wins
        exe = shutil.which(argv[0])
        if exe is None:
            exe_missing = argv[0]
        else:
            exe = os.path.abspath(exe)
            see(exe)
            executables.append(exe)
            if _is_python(exe):
                target = _python_target(argv[1:])
                if target is None:
                    notes.append(f"{argv!r}: no module/script/code to walk (interactive or stdin)")
                elif target[0] == "module":
                    walks.append(walk_module(target[1], sys_path))
                    launched = _launched(target[1], target[2])
                    if launched is None and target[1] in _LAUNCHERS:
                        notes.append(f"{argv!r}: {target[1]} runs nothing named")
                    elif launched is not None and launched[0] == "module":
                        walks.append(walk_module(launched[1], sys_path))
                    elif launched is not None:
                        walks.append(walk_script(launched[1], sys_path))
                elif target[0] == "code":
                    walks.append(walk_code(target[1], sys_path))
                else:
                    walks.append(walk_script(target[1], sys_path))
            elif _shebang_python(exe):
                walks.append(walk_script(exe, sys_path))

    package_roots: dict[str, list[str]] = {}
    for walk in walks:
        for top, locs in walk.reached_package_roots().items():
            package_roots.setdefault(top, locs)
    roots = native_files_in([loc for locs in package_roots.values() for loc in locs]) + executables
    elf = check_elf_files(roots, resolver=LibraryResolver(ld_library_path))
    # the module graph (thousands of nodes) has served: keep what the report reads
    kept = tuple(WalkResult(w.entry, w.sys_path, w.hits, {}, w.notes, w.unreadable) for w in walks)
    return Static(kept, package_roots, elf, exe_missing, tuple(notes))


def _add_import_hit(report: AdmissionReport, hit: ImportHit, display: PathDisplay) -> None:
    chain = hit.chain(display)
    text = hit.describe(display)
    if hit.waiver is not None:
        report.notes.append(
            f"waived lazy import (guard.install() must run in the worker): {text} -- {hit.waiver.reason}"
        )
        return
    report.findings.append(
        Finding(
            "import", report.worker, report.domain, chain,
            f"control-domain worker {report.worker} imports {hit.forbidden} "
            f"(forbidden: {hit.rule.name}, {hit.rule.reason}): {text}",
        )
    )


def _add_elf_hit(report: AdmissionReport, hit: ElfHit, package_roots: dict[str, list[str]]) -> None:
    pkg = _package_of(hit.root, package_roots)
    where = f" (in package {pkg}, reached by the import walk)" if pkg else ""
    report.findings.append(
        Finding(
            "elf", report.worker, report.domain, list(hit.chain),
            f"control-domain worker {report.worker} loads native code needing {hit.library}: "
            f"{hit.describe()}{where}",
        )
    )


def check_running(name: str, domain: str, pid: int) -> AdmissionReport:
    """Post-start check: forbidden libraries mapped into the worker's process.

    Raises maps.ProcessGone if the process has exited.
    """
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r} for worker {name!r}")
    report = AdmissionReport(worker=name, domain=domain, ok=True)
    if domain == "research":
        return report
    for hit in scan_pid(pid):
        report.findings.append(
            Finding("maps", name, domain, [f"pid {pid}", hit.path],
                    f"control-domain worker {name} has forbidden library mapped: {hit.describe()}")
        )
    report.ok = not report.findings
    return report
