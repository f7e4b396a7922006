"""Bytecode the import system would run instead of the source admission read.

A sandbox sets PYTHONDONTWRITEBYTECODE (it never writes a .pyc), but the interpreter
still reads one: `__pycache__/NAME.cpython-311.pyc` whose header matches the source
(a timestamp .pyc: the source's mtime and size, both known to whoever can write the
directory; an unchecked hash .pyc: always) is run in place of NAME.py, and a sourceless
NAME.pyc beside where NAME.py would be is a module of its own (red team 11 rows 1, 2, 9).
Admission reads source, and the audit digests source: a .pyc is honest only if it is
what the source compiles to. Checking that costs a compile of each such source, so it
is done for the trees whose code is vouched for (control python_paths, the audit's).
"""
from __future__ import annotations

import importlib.util
import marshal
import os
import re
import sys

from supervisor.config._model import PROJECT_PACKAGES, PROJECT_ROOT

_MAGIC = importlib.util.MAGIC_NUMBER
_HEADER = 16
# The project's own packages: the code every worker runs (runner, worker API, control
# workers), checked in admission's walk (red team 11 row 14) wherever they are installed.
# Other site-packages are the interpreter's, trusted as it is; python_paths are checked
# by the walk and, whole, by `code_dir_problem`.
OWN_TREES = tuple(os.path.realpath(os.path.join(PROJECT_ROOT, p)) + os.sep
                  for p in PROJECT_PACKAGES)


def vouched(path: str) -> bool:
    """Whether admission checks `path`'s cached bytecode (one of the project's files)."""
    return os.path.realpath(path).startswith(OWN_TREES)


def sourceless(name: str) -> bool:
    """A file name the path finder imports as a module of sourceless bytecode: NAME.pyc,
    also inside a __pycache__ directory, which imports as a namespace package (red team
    11 row 12). Any stem without a dot: importlib imports "1evil" or "x-y" by name (row
    15). A cache file (NAME.cpython-311.pyc: a dot in the stem) is never a module."""
    return name.endswith(".pyc") and "." not in name[:-4]


# The optimization levels an interpreter may run at (-O, -OO: a control `command` may
# pass them), each with a cache of its own (red team 12 row 4).
_LEVELS = (0, 1, 2)
_CACHE_NAME = re.compile(r"[^.]+\." + re.escape(sys.implementation.cache_tag or "")
                         + r"(\.opt-[12])?\.pyc")


def cache_name(name: str) -> bool:
    """A file name in __pycache__ that is a cache of a module (STEM.TAG[.opt-N].pyc)."""
    return bool(_CACHE_NAME.fullmatch(name))


def cache_path(source: str, level: int = 0) -> str:
    """Where a sandbox's interpreter at optimization `level` looks for `source`'s cache:
    beside it, whatever PYTHONPYCACHEPREFIX this process has (the sandbox's environment
    has none; with one set here, cache_from_source looked elsewhere: red team 11 row 16)."""
    head, tail = os.path.split(source)
    stem = tail.rpartition(".")[0]
    opt = f".opt-{level}" if level else ""
    return os.path.join(head, "__pycache__", f"{stem}.{sys.implementation.cache_tag}{opt}.pyc")


def loaded_instead(source: str, level: int = 0) -> str | None:
    """The cached .pyc the import system at optimization `level` would load for `source`
    (its header valid for this source and interpreter, read as the interpreter reads
    it: importlib._bootstrap_external's _classify_pyc and validators), or None when it
    would compile the source."""
    try:
        cfile = cache_path(source, level)
        with open(cfile, "rb") as f:
            head = f.read(_HEADER)
        st = os.stat(source)
    except (OSError, NotImplementedError, ValueError):
        return None
    if len(head) < _HEADER or head[:4] != _MAGIC:
        return None
    flags = int.from_bytes(head[4:8], "little")
    if flags & ~0b11:              # the interpreter refuses the cache: compiles the source
        return None
    # A hash-based cache is judged as loaded whatever its hash: an unchecked one always
    # loads, a checked one with a wrong hash too under --check-hash-based-pycs never (a
    # control command may pass it: red team 12 row 4). A timestamp one (flags 0 and 2
    # alike: row 1) loads while the source's mtime and size are the header's.
    if not flags & 0b1 and (
            int.from_bytes(head[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF
            or int.from_bytes(head[12:16], "little") != st.st_size & 0xFFFFFFFF):
        return None
    return cfile


def unfaithful(source: str) -> str | None:
    """A cached .pyc the interpreter (at any optimization level) would run instead of
    `source` that is not what `source` compiles to at that level (code objects compared:
    constants, names, bytecode, line table), or None. An honest cache (written by any
    import of this source) passes; a source this process cannot compile (nested past
    the parser: red team 12 row 2) has no faithful cache."""
    for level in _LEVELS:
        cfile = loaded_instead(source, level)
        if cfile is None:
            continue
        try:
            with open(cfile, "rb") as f:
                cached = marshal.loads(f.read()[_HEADER:])
            with open(source, "rb") as f:
                fresh = compile(f.read(), source, "exec", dont_inherit=True, optimize=level)
        except (OSError, ValueError, EOFError, TypeError, SyntaxError, MemoryError,
                RecursionError):
            return cfile           # a cache that cannot be read back is not this source
        if cached != fresh:
            return cfile
    return None
