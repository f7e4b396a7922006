"""Which memory-ordering path a Writer or Reader runs: the native module or pure Python.

The seqlock and the lease tables need acquire/release ordering between processes
(the argument is written out at the top of `_native.c`). Python has no fences:

* ``supervisor.ipc._native`` (built from ``_native.c`` by ``pip install``) gives
  acquire loads, release stores and fences on any CPU, and runs the per-message hot
  path; it is used whenever it is built.
* The pure-Python path (8-byte memoryview words, ``struct``) is correct only where the
  hardware itself keeps stores in order and loads in order (x86-64's TSO), so it is
  allowed only there: elsewhere a bridge without the native module refuses to start.

``TRIO_BRIDGE_NATIVE=0`` (or ``native=False``) selects the pure-Python path on x86-64
(the benchmark's "before"), ``=1`` (or ``native=True``) requires the native module.
"""
from __future__ import annotations

import os
import platform
from types import ModuleType

from .errors import BridgeError

try:
    from . import _native as NATIVE
except ImportError:          # not built (a source checkout without `pip install -e`)
    NATIVE = None

ENV = "TRIO_BRIDGE_NATIVE"
# Machines whose hardware ordering (TSO) makes the pure-Python path correct.
TSO_MACHINES = frozenset({"x86_64", "amd64", "AMD64", "x86-64"})

_UNSET = object()


def _wanted(native: bool | None) -> bool | None:
    if native is not None:
        return native
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("", "auto"):
        return None
    if v in ("0", "false", "no", "off", "python"):
        return False
    if v in ("1", "true", "yes", "on", "native"):
        return True
    raise BridgeError(f"{ENV}={v!r}: use 0 (pure Python, x86-64 only), 1 (native) or auto")


def select(native: bool | None = None, *, machine: str | None = None,
           module: ModuleType | None | object = _UNSET) -> ModuleType | None:
    """The native module to use, or None for the pure-Python path; raises a one-line
    BridgeError where neither is correct. ``machine`` (default: this one) and ``module``
    (default: the built ``_native``, None if it is not) let a test ask about another
    machine or an install without the extension."""
    mod = NATIVE if module is _UNSET else module
    arch = machine or platform.machine()
    want = _wanted(native)
    if want is True and mod is None:
        raise BridgeError(f"{ENV}=1 / native=True, but supervisor.ipc._native is not built "
                          f"(reinstall with a C compiler: pip install -e .)")
    if want is not False and mod is not None:
        return mod
    if arch in TSO_MACHINES:
        return None
    why = ("native=False / TRIO_BRIDGE_NATIVE=0" if mod is not None
           else "supervisor.ipc._native is not built")
    raise BridgeError(f"IPC bridge refuses to run on {arch} without memory barriers ({why}); "
                      f"the pure-Python path is correct only on x86-64: reinstall with a C "
                      f"compiler (pip install -e .)")
