"""What CPU the compiled objects may run on: architecture and x86-64 feature levels."""
from __future__ import annotations

import platform
import sys

# x86-64 micro-architecture levels (psABI), as /proc/cpuinfo flag names. Each level
# includes the previous ones. clang accepts the names as -march values.
X86_LEVELS: dict[str, tuple[str, ...]] = {
    "x86-64": ("cmov", "cx8", "fpu", "fxsr", "mmx", "sse", "sse2"),
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"),
    "x86-64-v4": ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"),
}


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(m, m)


def cpu_flags() -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo (empty if unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(val.split())
    except OSError:
        pass
    return frozenset()


def level_flags(level: str) -> tuple[str, ...]:
    """All flags a level needs (cumulative)."""
    if level not in X86_LEVELS:
        raise ValueError(f"unknown x86-64 level {level!r} (known: {', '.join(X86_LEVELS)})")
    out: list[str] = []
    for name, flags in X86_LEVELS.items():
        out += flags
        if name == level:
            break
    return tuple(sorted(out))


def best_level(flags: frozenset[str] | None = None, cap: str = "x86-64-v3") -> str:
    """Highest level (up to ``cap``) this host supports."""
    flags = cpu_flags() if flags is None else flags
    best = "x86-64"
    for name in X86_LEVELS:
        if set(level_flags(name)) <= flags:
            best = name
        if name == cap:
            break
    return best


def describe() -> dict:
    return {"machine": machine(), "byteorder": sys.byteorder, "system": platform.system().lower()}
