"""The whole syscall policy of each seccomp class: killed, EPERM (or another errno),
notified to the supervisor, allowed.

Read from the code that builds the filters, not from a copy of its tables:
`sandbox.seccomp.build_filter` (launch and runtime stages) and
`build_exec_watch_filter` are run against a recorder that stands in for pyseccomp's
``SyscallFilter`` (every other name is the real pyseccomp: actions, argument
comparisons, syscall numbers), so each ``add_rule`` the real filter would get is
recorded with its action and argument conditions. Everything the filters do not name
is allowed (the filters are default-ALLOW deny-lists): the allowed list is every name
in this architecture's syscall table (libseccomp's) minus the unconditional denials.

A class is what a domain's sandboxes carry: (launch rules: its profile; runtime rules:
its ``seccomp`` class, only when ``exec_after_start`` is false; the exec watch, only when
``exec_memory_after_ready`` is false; network or not), as supervisor/sandbox/launch.py
(`launch_filter_fd(policy.rules, network)`) and supervisor/runner.py (`lock_down(
iso.seccomp, network)`, `install_exec_watch()`) install them.
"""
from __future__ import annotations

import errno
import socket
from dataclasses import dataclass, field
from typing import Any

from supervisor.config import Config

# Precedence across stacked filters (seccomp(2)): the strictest action wins.
_RANK = {"kill": 4, "trap": 3, "errno": 2, "notify": 1, "allow": 0}
_CLONE_FLAGS = {0x00010000: "CLONE_THREAD", 0x00020000: "CLONE_NEWNS",
                0x02000000: "CLONE_NEWCGROUP", 0x04000000: "CLONE_NEWUTS",
                0x08000000: "CLONE_NEWIPC", 0x10000000: "CLONE_NEWUSER",
                0x20000000: "CLONE_NEWPID", 0x40000000: "CLONE_NEWNET"}
# Argument names and values a reviewer knows them by (man pages), for the conditions.
_ARG_NAMES = {("mmap", 2): "prot", ("mprotect", 2): "prot", ("pkey_mprotect", 2): "prot",
              ("shmat", 2): "shmflg", ("futex", 1): "op", ("personality", 0): "persona",
              ("sendto", 4): "dest_addr"}
_VALUE_NAMES = {("prot", 0x4): "PROT_EXEC", ("shmflg", 0o100000): "SHM_EXEC",
                ("persona", 0xFFFFFFFF): "0xffffffff (query)", ("dest_addr", 0): "NULL",
                ("op", 6): "FUTEX_LOCK_PI", ("op", 7): "FUTEX_UNLOCK_PI",
                ("op", 8): "FUTEX_TRYLOCK_PI", ("op", 11): "FUTEX_WAIT_REQUEUE_PI",
                ("op", 12): "FUTEX_CMP_REQUEUE_PI", ("op", 13): "FUTEX_LOCK_PI2"}


@dataclass
class _Recorder:
    """Stands in for pyseccomp.SyscallFilter: keeps what would be compiled."""

    default: int
    rules: list[tuple[int, int, tuple[Any, ...]]] = field(default_factory=list)

    def set_attr(self, attr: Any, value: Any) -> None:
        pass

    def add_rule(self, action: int, nr: int, *args: Any) -> None:
        self.rules.append((action, nr, args))


class _Lib:
    """pyseccomp, with SyscallFilter replaced by the recorder."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def SyscallFilter(self, default: int) -> _Recorder:  # noqa: N802 (pyseccomp's name)
        return _Recorder(default)


def _libs() -> tuple[Any, _Lib]:
    """(pyseccomp, a stand-in that records): the filter builders take the latter as
    `lib`, so the audit reads the very rules the sandbox compiles."""
    from supervisor.sandbox import seccomp as sc

    real = sc._pyseccomp()          # raises SeccompUnavailableError: reported by the caller
    return real, _Lib(real)


def _wx() -> Any:
    """supervisor.sandbox.wx (W^X from READY) where this tree has it."""
    try:
        from supervisor.sandbox import wx
    except ImportError:
        return None
    return wx if hasattr(wx, "build_filter") else None


def _action(lib: Any, a: int) -> tuple[str, str]:
    if a == lib.KILL_PROCESS or a == lib.KILL:
        return "kill", "kill"
    if a == lib.ALLOW:
        return "allow", "allow"
    if a == lib.NOTIFY:
        return "notify", "notify"
    if a == lib.TRAP:
        return "trap", "trap"
    if a & 0xFFFF0000 == lib.ERRNO(0):
        e = a & 0xFFFF
        return "errno", errno.errorcode.get(e, str(e))
    return "other", hex(a)


def _flags(mask: int, names: dict[int, str]) -> str:
    return "|".join(n for b, n in names.items() if mask & b) or hex(mask)


def _condition(lib: Any, syscall: str, args: tuple[Any, ...]) -> str:
    """One argument comparison, in words a reviewer reads (names where known)."""
    parts = []
    for a in args:
        i, op, x, y = a._arg, a._op, a._data_a, a._data_b
        if syscall in ("clone",) and i == 0 and op == lib.MASKED_EQ:
            what = _flags(x, _CLONE_FLAGS)
            parts.append(f"with {what}" if x == y else f"without {what}" if y == 0
                         else f"flags & {hex(x)} == {hex(y)}")
        elif syscall in ("socket", "socketpair") and i == 0:
            fam = socket.AddressFamily(x).name if x in socket.AddressFamily._value2member_map_ \
                else str(x)
            parts.append(f"family {'==' if op == lib.EQ else '!='} {fam}")
        elif syscall in ("socket", "socketpair") and i == 1 and op == lib.MASKED_EQ:
            kind = socket.SocketKind(y).name if y in socket.SocketKind._value2member_map_ \
                else str(y)
            parts.append(f"type {kind}")
        else:
            arg = _ARG_NAMES.get((syscall, i), f"arg{i}")

            def val(v: int) -> str:
                return _VALUE_NAMES.get((arg, v), hex(v))

            if op == lib.MASKED_EQ:
                parts.append(f"{arg} has {val(x)}" if x == y else
                             f"{arg} & {hex(x)} == {val(y)}")
            elif op == lib.EQ:
                parts.append(f"{arg} == {val(x)}")
            elif op == lib.NE:
                parts.append(f"{arg} != {val(x)}")
            else:
                parts.append(f"{arg} op{op} {hex(x)}")
    return ", ".join(parts)


def _rules(lib: Any, rec: _Recorder, stage: str) -> list[dict[str, str]]:
    out = []
    for action, nr, args in rec.rules:
        name = _name(lib, nr)
        kind, detail = _action(lib, action)
        out.append({"syscall": name, "action": kind, "errno": detail if kind == "errno"
                    else None, "when": _condition(lib, name, args), "stage": stage})
    return out


def _name(lib: Any, nr: int) -> str:
    """The syscall's name; a number newer than the installed libseccomp by the
    fallback table seccomp.py numbers it with."""
    from supervisor.sandbox import seccomp as sc

    try:
        n = lib.resolve_syscall(lib.Arch.NATIVE, nr)
    except ValueError:
        n = None
    if isinstance(n, bytes) and n:
        return n.decode()
    return next((k for k, v in sc._FALLBACK_NR.items() if v == nr), f"syscall_{nr}")


def _table(lib: Any) -> list[str]:
    """Every syscall name of this architecture libseccomp knows, plus the newer ones
    seccomp.py numbers itself."""
    from supervisor.sandbox import seccomp as sc

    names = []
    for nr in range(0, 1024):
        try:
            n = lib.resolve_syscall(lib.Arch.NATIVE, nr)
        except ValueError:
            continue
        if isinstance(n, bytes) and n:
            names.append(n.decode())
    return sorted({*names, *sc._FALLBACK_NR})


def stage_lists(rules_of: str, *, stage: str, network: bool) -> dict[str, list[str]]:
    """One filter's rules as {kill, eperm, enosys}: names, with the condition in
    parentheses where there is one (for the worker rows' summary)."""
    from supervisor.sandbox import seccomp as sc

    lib, rec = _libs()
    rules = _rules(lib, sc.build_filter(rules_of, stage=stage, network=network, lib=rec),
                   stage)
    out: dict[str, list[str]] = {"kill": [], "eperm": [], "enosys": []}
    for r in rules:
        key = "kill" if r["action"] == "kill" else (r["errno"] or "").lower()
        if key in out:
            item = f"{r['syscall']}({r['when']})" if r["when"] else r["syscall"]
            if item not in out[key]:
                out[key].append(item)
    return out


@dataclass(frozen=True)
class SeccompClass:
    launch: str | None        # the profile whose launch filter bwrap installs
    runtime: str | None       # the seccomp class lock_down installs, or None
    exec_watch: bool
    network: bool

    @property
    def key(self) -> str:
        parts = [f"launch:{self.launch or 'none'}", f"runtime:{self.runtime or 'none'}"]
        if self.exec_watch:
            parts.append("exec-watch")
        if self.network:
            parts.append("network")
        return "+".join(parts)


def class_of(cfg: Config, domain: str) -> SeccompClass:
    d = cfg.domains[domain]
    return SeccompClass(launch=d.profile or domain,
                        runtime=(d.seccomp or "control") if not d.exec_after_start else None,
                        exec_watch=not d.exec_memory_after_ready, network=bool(d.network))


def policy_of(cls: SeccompClass) -> dict[str, Any]:
    """{rules: [...], killed, errno: {name: errno}, notified, conditional: [...],
    allowed: [...], default: "allow"} for one class."""
    from supervisor.sandbox import seccomp as sc

    lib, rec = _libs()
    rules: list[dict[str, str]] = []
    if cls.launch:
        rules += _rules(lib, sc.build_filter(cls.launch, stage="launch",
                                             network=cls.network, lib=rec), "launch")
    if cls.runtime:
        rules += _rules(lib, sc.build_filter(cls.runtime, stage="runtime",
                                             network=cls.network, lib=rec), "runtime")
    if cls.exec_watch:
        rules += _rules(lib, sc.build_exec_watch_filter(lib=rec), "exec watch")
    wx = _wx()
    # W^X is loaded by the worker at READY: its rules apply from then on only, so
    # they are listed apart, never merged with the start-up rules.
    after_ready = _rules(lib, wx.build_filter(lib=rec), "W^X from READY") \
        if cls.exec_watch and wx is not None else []
    table = _table(lib)
    # Unconditional rules decide a syscall outright (the strictest across filters);
    # conditional ones are listed with their condition, the call allowed otherwise.
    always: dict[str, dict[str, str]] = {}
    conditional: list[dict[str, str]] = []
    for r in rules:
        if r["when"]:
            conditional.append(r)
            continue
        old = always.get(r["syscall"])
        if old is None or _RANK[r["action"]] > _RANK[old["action"]]:
            always[r["syscall"]] = r
    # A conditional rule weaker than the call's unconditional one never matters.
    conditional = [r for r in conditional if r["syscall"] not in always
                   or _RANK[r["action"]] > _RANK[always[r["syscall"]]["action"]]]
    seen = set()
    cond = []
    for r in conditional:
        k = (r["syscall"], r["action"], r["errno"], r["when"])
        if k not in seen:
            seen.add(k)
            cond.append(r)
    killed = sorted(n for n, r in always.items() if r["action"] == "kill")
    errnos = {n: r["errno"] for n, r in sorted(always.items()) if r["action"] == "errno"}
    notified = sorted({n for n, r in always.items() if r["action"] == "notify"}
                      | {r["syscall"] for r in cond if r["action"] == "notify"})
    decided = set(always)
    return {"key": cls.key, "launch": cls.launch, "runtime": cls.runtime,
            "exec_watch": cls.exec_watch, "network": cls.network, "default": "allow",
            "killed": killed, "errno": errnos,
            "conditional": [{k: r[k] for k in ("syscall", "action", "errno", "when", "stage")}
                            for r in cond],
            "notified": notified,
            "after_ready": [{k: r[k] for k in ("syscall", "action", "errno", "when", "stage")}
                            for r in after_ready],
            "allowed": [n for n in table if n not in decided],
            "table_size": len(table)}


def policies(cfg: Config) -> dict[str, Any]:
    """{classes: {key: policy + domains}, by_domain: {domain: key}, error}."""
    by_domain: dict[str, str] = {}
    classes: dict[str, Any] = {}
    try:
        for name in cfg.domains:
            cls = class_of(cfg, name)
            by_domain[name] = cls.key
            if cls.key not in classes:
                classes[cls.key] = dict(policy_of(cls), domains=[])
            classes[cls.key]["domains"].append(name)
    except Exception as e:   # no pyseccomp / libseccomp here: the report says so
        return {"classes": {}, "by_domain": by_domain, "error": f"{type(e).__name__}: {e}"}
    return {"classes": classes, "by_domain": by_domain, "error": None}
