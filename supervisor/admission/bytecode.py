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
import sys

_MAGIC = importlib.util.MAGIC_NUMBER
_HEADER = 16
# The project's own packages: the code every worker runs (runner, worker API, control
# workers), checked in admission's walk (red team 11 row 14) wherever they are installed.
# Other site-packages are the interpreter's, trusted as it is; python_paths are checked
# by the walk and, whole, by `code_dir_problem`.
_OWN = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", p)
             for p in ("supervisor", "workers", "schemas"))
OWN_TREES = tuple(os.path.realpath(p) + os.sep for p in _OWN)


def vouched(path: str) -> bool:
    """Whether admission checks `path`'s cached bytecode (one of the project's files)."""
    return os.path.realpath(path).startswith(OWN_TREES)


def sourceless(name: str) -> bool:
    """A file name the path finder imports as a module of sourceless bytecode: NAME.pyc,
    also inside a __pycache__ directory, which imports as a namespace package (red team
    11 row 12). Any stem without a dot: importlib imports "1evil" or "x-y" by name (row
    15). A cache file (NAME.cpython-311.pyc: a dot in the stem) is never a module."""
    return name.endswith(".pyc") and "." not in name[:-4]


def cache_path(source: str) -> str:
    """Where a sandbox's interpreter looks for `source`'s cache: beside it, whatever
    PYTHONPYCACHEPREFIX this process has (the sandbox's environment has none; with one
    set here, cache_from_source looked elsewhere: red team 11 row 16)."""
    head, tail = os.path.split(source)
    stem = tail.rpartition(".")[0]
    return os.path.join(head, "__pycache__", f"{stem}.{sys.implementation.cache_tag}.pyc")


def loaded_instead(source: str) -> str | None:
    """The cached .pyc the import system would load for `source` (its header valid for
    this source and interpreter), or None when it would compile the source."""
    try:
        cfile = cache_path(source)
        with open(cfile, "rb") as f:
            head = f.read(_HEADER)
        with open(source, "rb") as f:
            data = f.read()
        st = os.stat(source)
    except (OSError, NotImplementedError, ValueError):
        return None
    if len(head) < _HEADER or head[:4] != _MAGIC:
        return None
    flags = int.from_bytes(head[4:8], "little")
    if flags == 0:                 # timestamp: mtime and size as the interpreter compares them
        if (int.from_bytes(head[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF
                or int.from_bytes(head[12:16], "little") != len(data) & 0xFFFFFFFF):
            return None
    elif flags & 1:                # hash-based: checked ones must match, unchecked always load
        if flags & 2 and head[8:16] != importlib.util.source_hash(data):
            return None
    else:
        return None
    return cfile


def unfaithful(source: str) -> str | None:
    """The cached .pyc the interpreter would run instead of `source` when it is not
    what `source` compiles to (code objects compared: constants, names, bytecode, line
    table), or None. An honest cache (written by any import of this source) passes."""
    cfile = loaded_instead(source)
    if cfile is None:
        return None
    try:
        with open(cfile, "rb") as f:
            cached = marshal.loads(f.read()[_HEADER:])
        with open(source, "rb") as f:
            fresh = compile(f.read(), source, "exec", dont_inherit=True)
    except (OSError, ValueError, EOFError, TypeError, SyntaxError):
        return cfile               # a cache that cannot be read back is not this source
    return None if cached == fresh else cfile
