"""Admission: keep torch out of control-domain workers' address space.

Four layers, each catching what the previous cannot:
  imports -- static import-graph walk of the worker's Python code (no importing)
  elf     -- DT_NEEDED closure of native extensions / executables
  guard   -- in-process sys.meta_path finder + audit hook (runtime imports, ctypes)
  maps    -- /proc/PID/maps scan of the running worker

The static layers (imports, elf) run once per (module or argv, sys.path): the result is
reused for every worker of that code while nothing the walk read has changed
(_witness: each file and directory's identity, taken before it was read), and, with
TRIO_ADMISSION_CACHE=DIR, by the next supervisor process too (_store).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> submodule. Resolved lazily (PEP 562) so that a control worker
# doing ``from supervisor.admission import guard; guard.install(...)`` first
# thing loads only rules/maps/guard, not pyelftools and the static walker.
_EXPORTS: dict[str, str] = {
    "DOMAINS": "check",
    "check_running": "check",
    "check_worker": "check",
    "one_pass": "_witness",
    "ElfHit": "elf",
    "ElfInfo": "elf",
    "ElfResult": "elf",
    "ElfUnreadable": "elf",
    "LibraryResolver": "elf",
    "check_elf_files": "elf",
    "native_files_in": "elf",
    "read_elf": "elf",
    "ControlImportGuard": "guard",
    "ForbiddenImportError": "guard",
    "ForbiddenLibraryError": "guard",
    "ForbiddenModuleLoaded": "guard",
    "install": "guard",
    "Hop": "imports",
    "ImportHit": "imports",
    "ImportSite": "imports",
    "ImportWalker": "imports",
    "WalkResult": "imports",
    "scan_source": "imports",
    "walk_code": "imports",
    "walk_module": "imports",
    "walk_script": "imports",
    "ElfIdentity": "maps",
    "ExecMapping": "maps",
    "ExecSnapshot": "maps",
    "MapsHit": "maps",
    "ProcessGone": "maps",
    "exec_snapshot": "maps",
    "refused_build_ids": "maps",
    "scan_maps_text": "maps",
    "scan_pid": "maps",
    "AdmissionReport": "report",
    "Finding": "report",
    "LAZY_IMPORT_WAIVERS": "rules",
    "MODULE_RULES": "rules",
    "REFUSED_DISTRIBUTIONS": "rules",
    "SONAME_PATTERNS": "rules",
    "LazyImportWaiver": "rules",
    "ModuleRule": "rules",
    "forbidden_module_rule": "rules",
    "forbidden_soname": "rules",
    "is_forbidden_module": "rules",
}

__all__ = [
    "DOMAINS",
    "LAZY_IMPORT_WAIVERS",
    "MODULE_RULES",
    "REFUSED_DISTRIBUTIONS",
    "SONAME_PATTERNS",
    "AdmissionReport",
    "ControlImportGuard",
    "ElfHit",
    "ElfIdentity",
    "ElfInfo",
    "ElfResult",
    "ElfUnreadable",
    "ExecMapping",
    "ExecSnapshot",
    "Finding",
    "ForbiddenImportError",
    "ForbiddenLibraryError",
    "ForbiddenModuleLoaded",
    "Hop",
    "ImportHit",
    "ImportSite",
    "ImportWalker",
    "LazyImportWaiver",
    "LibraryResolver",
    "MapsHit",
    "ModuleRule",
    "ProcessGone",
    "WalkResult",
    "check_elf_files",
    "check_running",
    "check_worker",
    "exec_snapshot",
    "forbidden_module_rule",
    "forbidden_soname",
    "install",
    "is_forbidden_module",
    "native_files_in",
    "one_pass",
    "read_elf",
    "refused_build_ids",
    "scan_maps_text",
    "scan_pid",
    "scan_source",
    "walk_code",
    "walk_module",
    "walk_script",
]


def __getattr__(name: str) -> Any:
    sub = _EXPORTS.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{sub}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from ._witness import one_pass
    from .check import DOMAINS, check_running, check_worker
    from .elf import (
        ElfHit,
        ElfInfo,
        ElfResult,
        ElfUnreadable,
        LibraryResolver,
        check_elf_files,
        native_files_in,
        read_elf,
    )
    from .guard import ControlImportGuard, ForbiddenImportError, ForbiddenLibraryError, ForbiddenModuleLoaded, install
    from .imports import (
        Hop,
        ImportHit,
        ImportSite,
        ImportWalker,
        WalkResult,
        scan_source,
        walk_code,
        walk_module,
        walk_script,
    )
    from .maps import (
        ElfIdentity,
        ExecMapping,
        ExecSnapshot,
        MapsHit,
        ProcessGone,
        exec_snapshot,
        refused_build_ids,
        scan_maps_text,
        scan_pid,
    )
    from .report import AdmissionReport, Finding
    from .rules import (
        LAZY_IMPORT_WAIVERS,
        MODULE_RULES,
        REFUSED_DISTRIBUTIONS,
        SONAME_PATTERNS,
        LazyImportWaiver,
        ModuleRule,
        forbidden_module_rule,
        forbidden_soname,
        is_forbidden_module,
    )
