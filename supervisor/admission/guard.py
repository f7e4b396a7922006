"""In-process import guard for control-domain workers.

The static walk refuses workers whose code *could* import torch; this guard
makes the ones that were admitted unable to, whatever path they take at runtime
(a computed module name, a waived lazy import in tinygrad, a plugin). It is a
``sys.meta_path`` finder placed first, so ``import``, ``__import__`` and
``importlib.import_module`` all consult it before any module is loaded, plus an
audit hook that refuses ``ctypes.CDLL("libtorch...")``. Audit hooks cannot be
removed, which also makes the guard hard to undo by accident.

Install it as early as possible in the worker (before tinygrad/numpy):

    from supervisor.admission import guard
    guard.install("camerad")

The guard is a tripwire, not only a wall: a worker can catch the exception and
carry on, so before raising it reports the attempt to the supervisor on the
worker's status pipe (`report`), one line ``REFUSED=<kind> <detail>``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import FrameType
from typing import Any

from .maps import ProcessGone, identity_of, refused_build_ids, scan_self
from .rules import MODULE_RULES, ModuleRule, forbidden_module_rule, forbidden_soname, is_torch_c_extension


class ForbiddenImportError(ImportError):
    """Raised instead of loading a forbidden module."""


class ForbiddenLibraryError(OSError):
    """Raised instead of dlopen()ing a forbidden shared library through ctypes."""


class ForbiddenModuleLoaded(RuntimeError):
    """install() found a forbidden module or library already in the process."""


# Must equal supervisor.worker.ENV_STATUS_FD (not imported: supervisor.worker pulls
# in the IPC bridge, and the guard must be installable before anything else).
ENV_STATUS_FD = "TRIO_STATUS_FD"
REPORT_MAX = 1023  # bytes per line, newline included: one atomic pipe write (< PIPE_BUF)

_status_fd: list[int] = []  # the status pipe as found at install(); env is the fallback
_reported: set[bytes] = set()  # a worker retrying in a loop reports each refusal once


def _fd_from_env() -> int | None:
    try:
        fd = int(os.environ.get(ENV_STATUS_FD, ""))
    except ValueError:
        return None
    return fd if fd >= 0 else None


def report(kind: str, detail: str) -> None:
    """Tell the supervisor about a refusal: ``REFUSED=<kind> <detail>`` on the status pipe.

    ``kind`` is ``import`` or ``library``. The fd is the one named by
    TRIO_STATUS_FD when the guard was installed (else now). The line is made
    one line and cut to under 1024 bytes; the same line is written once per
    process. Never raises: no pipe, a closed or full one, is not the
    refusal's problem.
    """
    fd = _status_fd[0] if _status_fd else _fd_from_env()
    if fd is None:
        return
    text = " ".join(f"REFUSED={kind} {detail}".split())  # no newline or control whitespace inside
    data = text.encode("utf-8", "replace")
    if len(data) > REPORT_MAX - 1:
        data = data[: REPORT_MAX - 1].decode("utf-8", "ignore").encode()
    data += b"\n"
    if data in _reported:
        return
    _reported.add(data)
    try:
        os.write(fd, data)
    except OSError:
        pass


def _refuse_import(worker: str, module: str, frame: FrameType | None) -> ForbiddenImportError:
    importer = _importer(frame)
    report("import", f"{module} (importer: {importer})" if importer else module)
    return ForbiddenImportError(_message(worker, module), name=module)


def _message(worker: str, module: str) -> str:
    return f"control-domain worker {worker} may not import torch (forbidden by admission policy: {module})"


_IMPORT_MACHINERY = ("importlib", "importlib._bootstrap", "importlib._bootstrap_external", __name__)


def _importer(frame: FrameType | None) -> str | None:
    """``__name__`` of the module whose code asked for the import.

    Skips the import system's own frames; only needed for rules that allow
    one package to import the module (tinygrad.nn importing its datasets).
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        name = frame.f_globals.get("__name__")
        if not filename.startswith("<frozen importlib") and name not in _IMPORT_MACHINERY:
            return name if isinstance(name, str) else None
        frame = frame.f_back
    return None


def _rule_for(module: str, frame: FrameType | None) -> ModuleRule | None:
    rule = forbidden_module_rule(module)
    if rule is not None and rule.allowed_importer is not None:
        # only now pay for the stack walk
        rule = forbidden_module_rule(module, importer=_importer(frame))
    return rule


class ControlImportGuard(MetaPathFinder):
    def __init__(self, worker: str) -> None:
        self.worker = worker

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: Any = None
    ) -> ModuleSpec | None:
        frame = sys._getframe(1)
        rule = _rule_for(fullname, frame)
        if rule is not None:
            raise _refuse_import(self.worker, fullname, frame)
        return None  # not ours to judge: let the next finder load it

    def invalidate_caches(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<ControlImportGuard worker={self.worker!r}>"


_audit_worker: list[str] = []  # the hook cannot be removed, so it reads the current name here


def _library_identity_refusal(path: str) -> str | None:
    """Why the ELF file at ``path`` is refused by what it is (SONAME, needs, build-id), or None.

    Catches a renamed or memfd copy (``/proc/self/fd/N``) before dlopen maps
    it. Best effort: anything unreadable is left to dlopen and to the
    supervisor's maps scan, which judges the same way from outside.
    """
    try:
        got = identity_of(path)
        ident = got[1] if got is not None else None
        if ident is None:
            return None
        reasons = []
        if ident.soname and forbidden_soname(ident.soname):
            reasons.append(f"ELF SONAME {ident.soname}")
        bad = [n for n in ident.needed if forbidden_soname(n)]
        if bad:
            reasons.append("ELF needs " + ", ".join(bad))
        obj = refused_build_ids().get(ident.build_id) if ident.build_id else None
        if obj is not None:
            reasons.append(f"refused distribution {obj.distribution} (same build-id as {obj.path})")
        return ", ".join(reasons) or None
    except Exception:
        return None


def _audit_hook(event: str, args: tuple[Any, ...]) -> None:
    if not _audit_worker:
        return
    if event == "ctypes.dlopen":
        name = args[0] if args else None
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if isinstance(name, str) and (forbidden_soname(name) or is_torch_c_extension(name)):
            report("library", name)
            raise ForbiddenLibraryError(
                f"control-domain worker {_audit_worker[0]} may not load {name} (forbidden by admission policy)"
            )
        why = _library_identity_refusal(name) if isinstance(name, str) and "/" in name else None
        if why is not None:
            report("library", f"{name} ({why})")
            raise ForbiddenLibraryError(
                f"control-domain worker {_audit_worker[0]} may not load {name}: {why} "
                "(forbidden by admission policy)"
            )
    elif event == "import":
        # raised by the import statement / __import__ before the finders run:
        # a backstop in case someone reorders sys.meta_path
        module = args[0] if args else None
        frame = sys._getframe(1)
        if isinstance(module, str) and _rule_for(module, frame) is not None:
            raise _refuse_import(_audit_worker[0], module, frame)


def already_loaded() -> list[str]:
    """Forbidden modules and libraries present in this process right now."""
    found: list[str] = []
    loaded = set(sys.modules)
    for mod in sorted(loaded):
        rule = forbidden_module_rule(mod)
        if rule is None:
            continue
        if rule.allowed_importer is not None and rule.allowed_importer in loaded:
            continue  # who imported it is unknowable now; its owner package is there to explain it
        found.append(f"module {mod}")
    try:
        try:
            # by identity: map_files, or in a sandbox (no CAP_SYS_ADMIN in the initial
            # user namespace) /proc/self/root and /proc/self/fd
            hits = scan_self()
        except PermissionError:
            hits = scan_self(identify=False)  # by name; the supervisor judges identity from outside
        found += [f"library {h.path}" + (f" ({', '.join(h.reasons)})" if h.soname or h.build_id else "")
                  for h in hits]
    except (ProcessGone, OSError):
        pass  # no /proc (not Linux, or hidepid): the module check still stands
    return found


def install(worker_name: str, *, audit: bool = True) -> ControlImportGuard:
    """Put the guard first on sys.meta_path for this (control-domain) process.

    Refuses (ForbiddenModuleLoaded) if torch & co. are already imported or
    mapped: then it is too late to keep them out. Idempotent.
    """
    fd = _fd_from_env()
    _status_fd[:] = [] if fd is None else [fd]
    present = already_loaded()
    if present:
        libs_only = all(p.startswith("library ") for p in present)
        report("library" if libs_only else "import", "already loaded before the guard: " + ", ".join(present))
        raise ForbiddenModuleLoaded(
            f"control-domain worker {worker_name} already has forbidden code loaded: " + ", ".join(present)
        )
    existing = [f for f in sys.meta_path if isinstance(f, ControlImportGuard)]
    guard = existing[0] if existing else ControlImportGuard(worker_name)
    guard.worker = worker_name
    for f in existing:
        sys.meta_path.remove(f)
    sys.meta_path.insert(0, guard)
    if audit:
        if not _audit_worker:
            sys.addaudithook(_audit_hook)
            _audit_worker.append(worker_name)
        else:
            _audit_worker[0] = worker_name
    return guard


def installed() -> ControlImportGuard | None:
    for f in sys.meta_path:
        if isinstance(f, ControlImportGuard):
            return f
    return None


__all__ = [
    "ENV_STATUS_FD",
    "MODULE_RULES",
    "ControlImportGuard",
    "ForbiddenImportError",
    "ForbiddenLibraryError",
    "ForbiddenModuleLoaded",
    "already_loaded",
    "install",
    "installed",
    "report",
]
