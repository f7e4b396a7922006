"""``ctypes.util.find_library`` for a process that may not start one.

On Linux the standard library answers ``find_library(name)`` by running ``ldconfig -p``
(then gcc, ld, objdump). A locked-down worker may start no process (seccomp.py: the
fork fails with EPERM), yet libraries look things up at import: trio's thread cache asks
for "pthread", and would get None. `seccomp.lock_down` therefore points
``ctypes.util.find_library`` here: the same answer (the first ``lib<name>.*`` of this
machine's ABI, in ``ldconfig -p``'s order), read from the linker's cache file itself.

The cache format is glibc's (elf/cache.c, "glibc-ld.so.cache1.1", the only one written
since glibc 2.32; Debian 12 has 2.36). Anything else: None, as when ldconfig is absent.
"""
from __future__ import annotations

import os
import struct

CACHE = "/etc/ld.so.cache"
_MAGIC = b"glibc-ld.so.cache1.1"
_HEADER = struct.Struct("<20sII B3x I 12x")       # magic, nlibs, len_strings, flags, ext
_ENTRY = struct.Struct("<iIIIQ")                   # flags, key, value, osversion, hwcap
_ELF_LIBC6 = 0x0003
# ldconfig's "(libc6,x86-64)" etc.: the ABI word of a 64-bit library on each machine
_ABI = {"x86_64": 0x0300, "aarch64": 0x0A00, "ppc64le": 0x0500, "s390x": 0x0400,
        "riscv64": 0x1000}


def sonames(path: str = CACHE) -> list[str]:
    """The cache's sonames of libc6 libraries of this machine's ABI, in cache order."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if len(data) < _HEADER.size or not data.startswith(_MAGIC):
        return []
    _magic, n, _strs, _flags, _ext = _HEADER.unpack_from(data)
    if _HEADER.size + n * _ENTRY.size > len(data):
        return []
    abi = _ABI.get(os.uname().machine)
    out = []
    for i in range(n):
        flags, key, _value, _os, _hw = _ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size)
        if flags & 0xFF != _ELF_LIBC6 or (abi is not None and flags & 0xFF00 != abi):
            continue
        end = data.find(b"\0", key)
        if 0 < key < len(data) and end > 0:
            out.append(os.fsdecode(data[key:end]))
    return out


def find_library(name: str) -> str | None:
    """What ``ctypes.util.find_library(name)`` answers on Linux (its ldconfig step),
    without a process: ``lib<name>.`` followed by anything, first in the cache."""
    prefix = f"lib{name}."
    return next((s for s in sonames() if s.startswith(prefix) and " " not in s), None)


def install() -> None:
    """Answer ``ctypes.util.find_library`` from the cache in this process from now on."""
    import ctypes.util

    ctypes.util.find_library = find_library
