"""Cap'n Proto schemas of the bridge, loaded once per process with pycapnp."""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import capnp

SCHEMA_DIR = Path(__file__).resolve().parent

capnp.remove_import_hook()


@functools.cache
def load(name: str) -> ModuleType:
    """Load ``schemas/<name>.capnp`` (imports resolve inside this folder)."""
    return capnp.load(str(SCHEMA_DIR / f"{name}.capnp"), imports=[str(SCHEMA_DIR)])
