"""What a worker module imports whenever it starts: read from its source, never imported.

`supervisor check` names a dependency the workers' interpreter lacks before anything
starts (a `pip install .` without the ``[research]`` extra: the research worker
otherwise died at its first frame with "No module named 'torch'", five times, then
cooled down and tried again, for ever). Only imports that always run count: at module
level or directly in ``main``'s body, outside any ``if``/``try`` (an ``except
ImportError`` fallback is the module's own business).
"""
from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass

_PROJECT = "supervisor"         # the distribution whose extras name the optional parts


@dataclass(frozen=True)
class StartupImport:
    top: str        # the top-level package the import needs ("torch")
    line: int
    where: str      # "module level" or "main"


def startup_imports(tree: ast.Module) -> list[StartupImport]:
    """Absolute imports that run every time the module is imported or its main(ctx)
    is called, first occurrence of each top-level name, standard library left out."""
    found: dict[str, StartupImport] = {}

    def take(stmts: list[ast.stmt], where: str) -> None:
        for st in stmts:
            if isinstance(st, ast.Import):
                names = [a.name for a in st.names]
            elif isinstance(st, ast.ImportFrom) and st.level == 0 and st.module:
                names = [st.module]
            else:
                continue
            for name in names:
                top = name.split(".", 1)[0]
                if top in sys.stdlib_module_names or top in sys.builtin_module_names \
                        or top == "__future__":
                    continue
                found.setdefault(top, StartupImport(top, st.lineno, where))

    take(tree.body, "module level")
    for st in tree.body:
        if isinstance(st, ast.FunctionDef) and st.name == "main":
            take(st.body, "main")
    return sorted(found.values(), key=lambda i: i.line)


def install_hint(top: str) -> str:
    """How to install a missing top-level package: the project's extra that pins it,
    else the package itself."""
    extra = _extras().get(_norm(top))
    if extra:
        return f"pip install '{_PROJECT}[{extra}]'"
    return f"install {top!r} into the workers' interpreter"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _extras() -> dict[str, str]:
    """Requirement name -> the extra of this project that brings it (from the
    installed metadata: pyproject's [project.optional-dependencies])."""
    from importlib import metadata

    try:
        reqs = metadata.requires(_PROJECT) or []
    except metadata.PackageNotFoundError:
        return {}
    out: dict[str, str] = {}
    for req in reqs:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        if name and extra:
            out.setdefault(_norm(name.group(1)), extra.group(1))
    return out
