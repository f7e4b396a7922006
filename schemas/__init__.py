"""Cap'n Proto schemas of the bridge, loaded once per process with pycapnp."""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import capnp

SCHEMA_DIR = Path(__file__).resolve().parent

capnp.remove_import_hook()


def import_dir(d: Path) -> str:
    """``d`` as pycapnp's ``imports=`` needs it: pycapnp 2.2 cuts an import directory
    by its UTF-8 bytes beyond its characters (a checkout under /tmp/capé aborted the
    process in capnp's C++), so it is padded with as many slashes, harmless where that
    is fixed."""
    s = str(d)
    return s + "/" * (len(s.encode()) - len(s))


@functools.cache
def load(name: str) -> ModuleType:
    """Load ``schemas/<name>.capnp`` (imports resolve inside this folder)."""
    return capnp.load(str(SCHEMA_DIR / f"{name}.capnp"), imports=[import_dir(SCHEMA_DIR)])
