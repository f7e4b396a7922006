"""Evidence about one running process, read from /proc by a root process outside its
sandbox (the supervisor's view). Stdlib only; every reader returns plain data and raises
`Gone` when the process disappeared while it was being read."""
from __future__ import annotations

import errno
import glob
import os
import re
import stat
import sys
from typing import Any

from .promise import NAMESPACES

# Linux capability numbers -> names (capability(7)), for CapEff & co.
CAPABILITIES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid",
    "setuid", "setpcap", "linux_immutable", "net_bind_service", "net_broadcast",
    "net_admin", "net_raw", "ipc_lock", "ipc_owner", "sys_module", "sys_rawio",
    "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
    "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write",
    "audit_control", "setfcap", "mac_override", "mac_admin", "syslog", "wake_alarm",
    "block_suspend", "audit_read", "perfmon", "bpf", "checkpoint_restore",
)
_CAP_FIELDS = {"CapInh": "inheritable", "CapPrm": "permitted", "CapEff": "effective",
               "CapBnd": "bounding", "CapAmb": "ambient"}

# Compiler drivers, assemblers, linkers and JIT front ends looked up inside a sandbox,
# in the directories a worker's PATH and the toolchain use.
COMPILER_NAMES = ("cc", "c++", "gcc", "g++", "cpp", "clang", "clang++", "tcc", "as", "ld",
                  "ld.bfd", "ld.gold", "ld.lld", "rustc", "go", "nvcc", "zig")
_TOOLCHAIN_GLOBS = ("/usr/lib/gcc/*/*/cc1", "/usr/libexec/gcc/*/*/cc1",
                    "/usr/lib/llvm-*/bin/clang")

_CHANNEL_MEMFD = re.compile(r"^/memfd:trio-bridge:([a-z][a-z0-9_]*)(?::lease(\d+))?$")


class Gone(LookupError):
    """The process exited while its evidence was being read."""


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError) as e:
        raise Gone(path) from e
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise Gone(path) from e
        raise


def status(pid: int) -> dict[str, str]:
    out = {}
    for line in _read(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def capability_names(mask_hex: str) -> list[str]:
    mask = int(mask_hex, 16)
    return [CAPABILITIES[i] if i < len(CAPABILITIES) else f"cap_{i}"
            for i in range(64) if mask >> i & 1]


def namespaces(pid: int | str) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for ns in NAMESPACES:
        try:
            out[ns] = os.stat(f"/proc/{pid}/ns/{ns}").st_ino
        except FileNotFoundError:
            if isinstance(pid, int) and not os.path.exists(f"/proc/{pid}"):
                raise Gone(pid) from None
            out[ns] = None
        except PermissionError:
            out[ns] = None
    return out


def id_map(pid: int, which: str) -> list[list[int]]:
    return [[int(x) for x in line.split()]
            for line in _read(f"/proc/{pid}/{which}_map").splitlines() if line.strip()]


def interfaces(pid: int) -> list[str]:
    names = []
    for line in _read(f"/proc/{pid}/net/dev").splitlines()[2:]:
        name, sep, _ = line.partition(":")
        if sep:
            names.append(name.strip())
    return names


def scheduling(pid: int) -> dict[str, Any]:
    """The scheduling class of thread ``pid`` (the worker's main thread)."""
    from supervisor.sandbox.sched import policy_of

    try:
        policy, prio, reset = policy_of(pid)
    except ProcessLookupError as e:
        raise Gone(pid) from e
    return {"policy": policy, "priority": prio, "reset_on_fork": reset}


def nofile(pid: int) -> tuple[int | None, int | None]:
    for line in _read(f"/proc/{pid}/limits").splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            conv = (lambda v: None if v == "unlimited" else int(v))
            return conv(soft), conv(hard)
    return None, None


def maps(pid: int) -> list[tuple[str, str, str, str]]:
    """(address, perms, "DEV INODE", path) of every mapping (DEV as maps writes it,
    "00:01"); path "" for anonymous memory."""
    out = []
    for line in _read(f"/proc/{pid}/maps").splitlines():
        f = line.split(None, 5)
        if len(f) >= 5:
            out.append((f[0], f[1], f"{f[3]} {f[4]}", f[5].strip() if len(f) > 5 else ""))
    return out


# A channel segment is told by its file, (DEV INODE) as /proc/PID/maps writes it,
# never by the memfd's name, which any process chooses (red team round 6 row 5: a
# research worker's own memfd named trio-bridge:cmd made the live audit say it wrote
# control's actuation channel).
Segments = dict[str, tuple[str, str | None]]      # "DEV INODE" -> (channel, lease index)


def _file_id(st: os.stat_result) -> str:
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino}"


def _fds(pid: int | str) -> list[str]:
    """The fd numbers `pid` holds (names in /proc/PID/fd); Gone once it has exited."""
    try:
        return os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError) as e:
        raise Gone(pid) from e


def segments_of(pid: int | str) -> Segments:
    """The channel segments the supervisor process `pid` holds open (it created every
    one, so its names are the channels'): file id -> (channel, lease index or None)."""
    out: Segments = {}
    base = f"/proc/{pid}/fd"
    for fd in _fds(pid):
        try:
            m = _CHANNEL_MEMFD.match(os.readlink(f"{base}/{fd}").removesuffix(" (deleted)"))
            if m:
                out[_file_id(os.stat(f"{base}/{fd}"))] = (m.group(1), m.group(2))
        except OSError:
            continue
    return out


def _backing(path: str) -> str:
    if not path or path.startswith(("[anon:", "[anon_shmem:")) or path in ("[heap]", "[stack]"):
        return "anonymous"
    if path.startswith("["):
        return "special"
    if path.startswith("/memfd:"):
        return "memfd"
    if path.startswith(("/dev/zero", "/SYSV")):
        return "anonymous"
    if path.endswith(" (deleted)"):
        return "deleted"
    return "file"


def exec_mappings(entries: list[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
    """Executable mappings grouped by what backs them (one entry per object and perms)."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for addr, perms, inode, path in entries:
        if "x" not in perms:
            continue
        backing = _backing(path)
        key = (backing, path if backing != "anonymous" else path or "", perms)
        e = seen.setdefault(key, {"path": path, "backing": backing, "perms": perms,
                                  "mappings": 0})
        e["mappings"] += 1
    return sorted(seen.values(), key=lambda e: (e["backing"] != "file", e["path"], e["perms"]))


def channel_mappings(entries: list[tuple[str, str, str, str]], known: Segments
                     ) -> dict[str, dict[str, Any]]:
    """channel -> {"data": sorted perms of its segment's mappings, "leases": {index:
    perms}} for every channel segment (`segments_of` the supervisor) mapped."""
    out: dict[str, dict[str, Any]] = {}
    for _addr, perms, file_id, _path in entries:
        seg = known.get(file_id)
        if seg is None:
            continue
        ch = out.setdefault(seg[0], {"data": [], "leases": {}})
        if seg[1] is None:
            if perms not in ch["data"]:
                ch["data"].append(perms)
        else:
            lst = ch["leases"].setdefault(seg[1], [])
            if perms not in lst:
                lst.append(perms)
    for ch in out.values():
        ch["data"].sort()
        for lst in ch["leases"].values():
            lst.sort()
    return out


def channel_fds(pid: int, known: Segments) -> dict[str, dict[str, Any]]:
    """channel -> {"data": access modes of the fds open on its segment, "leases": ...}
    (``O_RDONLY``/``O_WRONLY``/``O_RDWR`` from /proc/PID/fdinfo), segments told by file
    (`segments_of`)."""
    out: dict[str, dict[str, Any]] = {}
    base = f"/proc/{pid}/fd"
    for fd in _fds(pid):
        try:
            seg = known.get(_file_id(os.stat(f"{base}/{fd}")))
            if seg is None:
                continue
            info = _read(f"/proc/{pid}/fdinfo/{fd}")
        except (OSError, Gone):
            continue
        flags = next((int(line.split()[1], 8) for line in info.splitlines()
                      if line.startswith("flags:")), 0)
        mode = {os.O_RDONLY: "O_RDONLY", os.O_WRONLY: "O_WRONLY",
                os.O_RDWR: "O_RDWR"}.get(flags & os.O_ACCMODE, "?")
        ch = out.setdefault(seg[0], {"data": [], "leases": {}})
        if seg[1] is None:
            if mode not in ch["data"]:
                ch["data"].append(mode)
        else:
            lst = ch["leases"].setdefault(seg[1], [])
            if mode not in lst:
                lst.append(mode)
    return out


# --------------------------------------------------------------------------- paths


def resolve_in_root(root: str, path: str, max_links: int = 40) -> tuple[str, os.stat_result | None]:
    """Follow ``path`` inside the file system whose root is ``root`` (e.g.
    /proc/PID/root), symlinks included, without ever leaving it (an absolute link
    target starts again at ``root``, ``..`` stops there). Returns (the final path as
    seen inside, its lstat) or (path, None) when something on the way is missing."""
    todo = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        here = root + "/" + "/".join([*done, name])
        try:
            st = os.lstat(here)
        except (FileNotFoundError, NotADirectoryError):
            return "/" + "/".join([*done, name, *todo]), None
        except PermissionError:
            return "/" + "/".join([*done, name, *todo]), None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > max_links:
                return "/" + "/".join(done), None
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p] + todo
            continue
        done.append(name)
    final = "/" + "/".join(done)
    try:
        return final, os.lstat(root + final)
    except OSError:
        return final, None


def compiler_candidates(extra_dirs: tuple[str, ...] = ()) -> list[str]:
    """Compiler paths that exist on the host (so whether each resolves inside a sandbox
    says something): the usual names in the bin directories, plus toolchain internals."""
    dirs = list(dict.fromkeys(["/usr/bin", "/usr/local/bin", "/bin",
                               os.path.dirname(sys.executable), *extra_dirs]))
    out = []
    for d in dirs:
        for n in COMPILER_NAMES:
            p = os.path.join(d, n)
            if os.path.lexists(p) and p not in out:
                out.append(p)
    for g in _TOOLCHAIN_GLOBS:
        out += [p for p in sorted(glob.glob(g)) if p not in out]
    if not out:   # nothing installed here: still look for the classic names
        out = [f"/usr/bin/{n}" for n in ("cc", "gcc", "clang")]
    return out


def compiler_probe(pid: int, paths: list[str]) -> dict[str, str]:
    """path -> what it is inside the sandbox of ``pid``: "executable" (a compiler that
    runs), "char-device" (masked with /dev/null), "missing", "not-executable" or
    "directory"."""
    root = f"/proc/{pid}/root"
    if not os.path.exists(root):
        raise Gone(pid)
    out = {}
    for p in paths:
        _final, st = resolve_in_root(root, p)
        if st is None:
            out[p] = "missing"
        elif stat.S_ISCHR(st.st_mode):
            out[p] = "char-device"
        elif stat.S_ISDIR(st.st_mode):
            out[p] = "directory"
        elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
            out[p] = "executable"
        else:
            out[p] = "not-executable"
    return out


def file_sha256_in_root(pid: int, path: str) -> str | None:
    """sha256 of ``path`` as the process sees it (through /proc/PID/root), or None."""
    import hashlib

    _final, st = resolve_in_root(f"/proc/{pid}/root", path)
    if st is None or not stat.S_ISREG(st.st_mode):
        return None
    try:
        with open(f"/proc/{pid}/root{_final}", "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None
