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
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import FrameType
from typing import Any

from .maps import ProcessGone, scan_self
from .rules import MODULE_RULES, ModuleRule, forbidden_module_rule, forbidden_soname, is_torch_c_extension


class ForbiddenImportError(ImportError):
    """Raised instead of loading a forbidden module."""


class ForbiddenLibraryError(OSError):
    """Raised instead of dlopen()ing a forbidden shared library through ctypes."""


class ForbiddenModuleLoaded(RuntimeError):
    """install() found a forbidden module or library already in the process."""


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
        rule = _rule_for(fullname, sys._getframe(1))
        if rule is not None:
            raise ForbiddenImportError(_message(self.worker, fullname), name=fullname)
        return None  # not ours to judge: let the next finder load it

    def invalidate_caches(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<ControlImportGuard worker={self.worker!r}>"


_audit_worker: list[str] = []  # the hook cannot be removed, so it reads the current name here


def _audit_hook(event: str, args: tuple[Any, ...]) -> None:
    if not _audit_worker:
        return
    if event == "ctypes.dlopen":
        name = args[0] if args else None
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if isinstance(name, str) and (forbidden_soname(name) or is_torch_c_extension(name)):
            raise ForbiddenLibraryError(
                f"control-domain worker {_audit_worker[0]} may not load {name} (forbidden by admission policy)"
            )
    elif event == "import":
        # raised by the import statement / __import__ before the finders run:
        # a backstop in case someone reorders sys.meta_path
        module = args[0] if args else None
        if isinstance(module, str) and _rule_for(module, sys._getframe(1)) is not None:
            raise ForbiddenImportError(_message(_audit_worker[0], module), name=module)


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
        found += [f"library {h.path}" for h in scan_self()]
    except (ProcessGone, OSError):
        pass  # no /proc (not Linux, or hidepid): the module check still stands
    return found


def install(worker_name: str, *, audit: bool = True) -> ControlImportGuard:
    """Put the guard first on sys.meta_path for this (control-domain) process.

    Refuses (ForbiddenModuleLoaded) if torch & co. are already imported or
    mapped: then it is too late to keep them out. Idempotent.
    """
    present = already_loaded()
    if present:
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
    "MODULE_RULES",
    "ControlImportGuard",
    "ForbiddenImportError",
    "ForbiddenLibraryError",
    "ForbiddenModuleLoaded",
    "already_loaded",
    "install",
    "installed",
]
