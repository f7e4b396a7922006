"""Value checks of the config loader, and the size syntax (``"64KiB"``, ``"3.5MB"``).

Each check returns the converted value or raises ValueError(reason); _ItemError
points the reason at one element of an array.
"""
from __future__ import annotations

import difflib
import json
import os
import re
from fractions import Fraction
from typing import Any, Callable

# --------------------------------------------------------------------------- sizes

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes from an integer or a human size such as ``"4096"``, ``"64KiB"``, ``"3.5MiB"``
    or ``"3.5MB"``. KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB powers of 1000 (any
    case); a bare K/M/G is refused as ambiguous. Raises ``ValueError`` with the reason."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a byte count or a size like '4MiB', got {_describe(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative")
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a size; write e.g. 4096, '64KiB', '3.5MiB' or '3.5MB'")
    number, unit = m.groups()
    scale = _SIZE_UNITS.get(unit.lower())
    if scale is None:
        u = unit.upper()
        if u in ("K", "M", "G", "T"):
            raise ValueError(f"{value!r}: unit {unit!r} is ambiguous; write '{u}iB' "
                             f"(powers of 1024) or '{u}B' (powers of 1000)")
        raise ValueError(f"{value!r}: unknown unit {unit!r}; use B, kB, MB, GB, TB, "
                         "KiB, MiB, GiB or TiB")
    exact = Fraction(number) * scale
    if exact.denominator != 1:
        raise ValueError(f"{value!r} is {float(exact)} bytes, not a whole number")
    return int(exact)


def format_size(n: int) -> str:
    """The shortest binary-unit spelling of ``n`` bytes that `parse_size` reads back
    exactly, with at most three decimals (``3670016`` -> ``"3.5MiB"``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            thousandths = Fraction(n * 1000, scale)
            if thousandths.denominator == 1:
                whole, frac = divmod(int(thousandths), 1000)
                return f"{whole}.{frac:03d}".rstrip("0").rstrip(".") + unit
    return str(n)


# --------------------------------------------------------------------------- value checks


class _ItemError(ValueError):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


def _describe(v: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "float", str: "string",
            list: "array", dict: "table"}.get(type(v), type(v).__name__)
    return f"{kind} {v!r}" if kind != "table" else "a table"


def _suggest(word: str, options: Any) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _text_problem(s: str) -> str | None:
    """Why a config string cannot be used as given: a NUL byte (no path, argument or
    user name can hold one: the kernel or libc refuses it later, mid-start) or something
    that is not UTF-8 (a lone surrogate: what a non-UTF-8 byte decodes to)."""
    if "\0" in s:
        return f"{s!r} contains a NUL byte"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return f"{s!r} is not valid UTF-8"
    return None


def _string(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {_describe(v)}")
    why = _text_problem(v)
    if why:
        raise ValueError(why)
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {_describe(v)}")
    return v


def _int(lo: int | None = None, hi: int | None = None, unit: str = "",
         zero_ok: bool = False) -> Callable[[Any], int]:
    """An integer in lo..hi (``unit`` named in the reason); ``zero_ok``: 0 too (the
    knob's "off"), below ``lo``."""
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {_describe(v)}")
        if zero_ok and v == 0:
            return v
        try:
            return _in_range(v, lo, hi, unit=unit)
        except ValueError as e:
            raise ValueError(f"{e} (or 0: off)" if zero_ok else str(e)) from None
    return check


def _number(lo: float = 0.0, hi: float = float("inf"), unit: str = "",
            zero_ok: bool = False, least: bool = False) -> Callable[[Any], float]:
    """A finite number above ``lo`` (``least``: or equal to it) and at most ``hi``
    (``zero_ok``: or exactly 0, the knob's "off")."""
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a number, got {_describe(v)}")
        if zero_ok and v == 0:
            return 0.0
        if not (lo <= v if least else lo < v) or not v < float("inf"):
            off = " (or 0: off)" if zero_ok else ""
            bound = "at least" if least else "greater than"
            raise ValueError(f"{v} must be {bound} {lo:g}{unit} and finite{off}")
        if v > hi:
            raise ValueError(f"{v:g}{unit} is out of range; must be at most {hi:g}{unit}")
        return float(v)
    return check


def _in_range(v: Any, lo: Any, hi: Any, show: Callable[[Any], str] = str,
              unit: str = "") -> Any:
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = (f"in {show(lo)}..{show(hi)}" if lo is not None and hi is not None
                  else f">= {show(lo)}" if lo is not None else f"<= {show(hi)}")
        raise ValueError(f"{show(v)} is out of range; must be {bounds}{unit}")
    return v


def _size(lo: int = 1, hi: int | None = None) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        return _in_range(parse_size(v), lo, hi, show=format_size)
    return check


def _choice(*options: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str):
            raise ValueError(f"expected a string, got {_describe(v)}")
        if v not in options:
            listed = ", ".join(repr(o) for o in options)
            raise ValueError(f"{v!r} is not one of {listed}" + _suggest(v, options))
        return v
    return check


def _str_list(item: Callable[[str], None] | None = None,
              unique: bool = True) -> Callable[[Any], tuple[str, ...]]:
    def check(v: Any) -> tuple[str, ...]:
        if not isinstance(v, list):
            raise ValueError(f"expected an array of strings, got {_describe(v)}")
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise _ItemError(i, f"expected a string, got {_describe(s)}")
            why = _text_problem(s)
            if why:
                raise _ItemError(i, why)
            if unique and s in v[:i]:
                raise _ItemError(i, f"{s!r} is listed twice")
            if item is not None:
                try:
                    item(s)
                except ValueError as e:
                    raise _ItemError(i, str(e)) from None
        return tuple(v)
    return check


def _bindings(v: Any) -> tuple[tuple[str, str], ...]:
    """Channels a worker uses, bound to the roles its code asks for: a table
    ``{frames = "road_frames"}`` (role -> channel), or an array of channel names (each
    channel's name is then its role). Returns (role, channel) pairs."""
    if isinstance(v, list):
        channels = _str_list()(v)
        return tuple((c, c) for c in channels)
    if not isinstance(v, dict):
        raise ValueError(f"expected a table of role = \"channel\" (or an array of channel "
                         f"names), got {_describe(v)}")
    out = []
    for role, ch in v.items():
        if not _NAME.match(role):
            raise ValueError(f"role {role!r} is not a valid name (letters, digits, _ and -)")
        if not isinstance(ch, str):
            raise ValueError(f"role {role!r}: expected a channel name, got {_describe(ch)}")
        why = _text_problem(ch)
        if why:
            raise ValueError(f"role {role!r}: {why}")
        if any(c == ch for _, c in out):
            raise ValueError(f"channel {ch!r} is bound to two roles")
        out.append((role, ch))
    return tuple(out)


def _in(options: Any) -> Callable[[str], None]:
    def check(s: str) -> None:
        if s not in options:
            raise ValueError(f"{s!r} is not one of {', '.join(options)}" + _suggest(s, options))
    return check


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _module(v: Any) -> str:
    if not isinstance(v, str) or not _MODULE.match(v):
        raise ValueError(f"expected a dotted python module name, got {_describe(v)}")
    return v


def _argv(v: Any) -> tuple[str, ...]:
    argv = _str_list(unique=False)(v)
    if not argv or not argv[0]:
        raise ValueError("expected a non-empty argv array such as ['/usr/bin/prog', '--flag']")
    return argv


def _abs_path(s: str) -> None:
    why = _text_problem(s)
    if why:
        raise ValueError(why)
    if not s.startswith("/") or ".." in s.split("/"):
        raise ValueError(f"{s!r} must be an absolute path without '..'")
    if os.path.normpath(s) in ("/", "//"):      # "/.", "//" and "/./" are "/" too
        raise ValueError("binding '/' would expose the whole host file system")


def _rel_path(v: Any) -> str:
    """A file or directory: absolute, or relative to the project root; no '..'."""
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a path, got {_describe(v)}")
    why = _text_problem(v)
    if why:
        raise ValueError(why)
    if ".." in v.split("/"):
        raise ValueError(f"{v!r} must not contain '..'")
    return v


def _state_dir(v: Any) -> str:
    """The fail-safe latch's directory: absolute (a run must not depend on its working
    directory), no '..', not '/'. Whether it can be written is `_runtime`'s question."""
    s = _string(v)
    if not s.startswith("/") or ".." in s.split("/") or s.rstrip("/") == "":
        raise ValueError(f"{s!r} must be an absolute directory without '..', not '/'")
    return s


# Host user names as Debian's adduser takes them (NAME_REGEX, at most 32 bytes): a user
# name reaches getpwnam() and, through it, the sandbox's uid; never a path or an option.
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


def _user(v: Any) -> str:
    s = _string(v)
    if not _USER.match(s):
        raise ValueError(f"{s!r} is not a user name (lower-case letters, digits, _ and -, "
                         "starting with a letter or _, at most 32)")
    return s


# cpu_quota, in percent of one CPU: CFS refuses a quota under 1 ms per 100 ms period
# (1 %), and 1024 CPUs is more than any machine this runs on (a number past it is a
# typo, e.g. 1e308, which would overflow the cgroup's microseconds).
CPU_QUOTA_MIN_PCT, CPU_QUOTA_MAX_PCT = 1.0, 102_400.0


def _percent(v: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip().removesuffix("%"))
        except ValueError:
            raise ValueError(f"{v!r} is not a percentage such as 200 or '200%'") from None
    pct = _number(0.0)(v)
    if not CPU_QUOTA_MIN_PCT <= pct <= CPU_QUOTA_MAX_PCT:
        raise ValueError(f"{pct:g} % is out of range; must be in {CPU_QUOTA_MIN_PCT:g}.."
                         f"{CPU_QUOTA_MAX_PCT:g} % of one CPU (1 % is the kernel's least "
                         "quota, 100 per CPU)")
    return pct


# Worker, domain and channel names end up in unit names, paths and segment names.
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,47}$")
_CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")   # as supervisor.ipc.spec requires
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(*parts: str) -> str:
    """A key path as TOML writes it; a part that is not a bare key is quoted with every
    control character escaped, so that a problem stays one printable line."""
    return ".".join(p if _BARE_KEY.match(p) else json.dumps(p) for p in parts)
