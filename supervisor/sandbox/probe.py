"""Attack probe, run INSIDE a sandbox: python -m supervisor.sandbox.probe ATTACK [ARGS]

Prints one JSON line {"attack", "denied", "detail"} and exits 0, so tests
judge the sandbox from what a worker could actually do. `denied` is True
when every attempt failed. "info" reports the environment instead.

Network safety: a non-loopback target is only tried when this network
namespace has no interface but `lo` (then nothing can leave the box).

Also the machine side (run OUTSIDE, by the supervisor or `check`): the kernel knobs
that stop unprivileged user namespaces, hence every sandbox (`userns_blockers`,
`userns_advice`). Read only: a knob is opened for reading, never written.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Callable

from .policy import PROJECT_ROOT

_libc = ctypes.CDLL(None, use_errno=True)
_PTRACE_ATTACH, _PTRACE_DETACH = 16, 17
_CLONE_NEWUSER = 0x10000000


def _err(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{type(exc).__name__}:{errno.errorcode.get(exc.errno, exc.errno)}"
    return f"{type(exc).__name__}:{exc}"


def _interfaces() -> list[str]:
    # /proc/self/net is this process's netns; no netlink socket needed.
    with open("/proc/self/net/dev") as f:
        return [ln.split(":")[0].strip() for ln in f.readlines()[2:]]


def _netns() -> str:
    return os.readlink("/proc/self/ns/net")  # e.g. "net:[4026531840]"


def _lock(args: list[str]) -> str:
    """What the runner does at start for a domain of this profile: the runtime filter
    (no exec) unless the profile keeps exec after start (research)."""
    from supervisor.protocol import Isolation

    from .seccomp import lock_down

    domain = args[0] if args else "control"
    iso = Isolation.for_profile(domain)
    if not iso.exec_after_start:
        lock_down(iso.seccomp)
    return domain


def tcp_connect(args: list[str]) -> tuple[bool, dict]:
    """ARGS: [port]. Connect to the host's 127.0.0.1:port (and 10.0.0.1:80)."""
    port = int(args[0]) if args else 9
    targets = [("127.0.0.1", port)]
    ifaces = _interfaces()
    if ifaces == ["lo"]:
        targets.append(("10.0.0.1", 80))  # unroutable here: fails at once
    d: dict = {"interfaces": ifaces, "netns": _netns()}
    ok = []
    for host, p in targets:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect((host, p))
            d[f"{host}:{p}"] = "connected"
            ok.append(host)
        except OSError as e:
            d[f"{host}:{p}"] = _err(e)
    return not ok, d


def udp_send(args: list[str]) -> tuple[bool, dict]:
    """ARGS: port [host_netns]. UDP has no handshake: sendto may 'succeed'
    into a dead private namespace, so it also counts as denied when our netns
    differs from the host's (the test checks nothing arrived as well)."""
    port = int(args[0]) if args else 9
    host_ns = args[1] if len(args) > 1 else None
    d: dict = {"netns": _netns(), "host_netns": host_ns, "interfaces": _interfaces()}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"probe", ("127.0.0.1", port))
        d["sendto"] = "sent"
        return host_ns is not None and d["netns"] != host_ns, d
    except OSError as e:
        d["sendto"] = _err(e)
        return True, d


def abstract_unix_connect(args: list[str]) -> tuple[bool, dict]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + args[0])
        return False, {"connect": "connected"}
    except OSError as e:
        return True, {"connect": _err(e)}


def exec_compiler(args: list[str]) -> tuple[bool, dict]:
    cands = ["gcc", "cc", "c++", "g++", "clang", "tcc", "as", "ld", "cpp", "nvcc", "ptxas"]
    cands += glob.glob("/usr/bin/*-linux-gnu*-gcc*") + glob.glob("/usr/lib/gcc/*/*/cc1")
    cands += glob.glob("/usr/lib/llvm-*/bin/clang*")
    d: dict = {}
    started = []
    for c in cands:
        try:
            subprocess.run([c, "--version"], capture_output=True, timeout=10)
            d[c] = "executed"  # any return code: exec itself succeeded
            started.append(c)
        except (OSError, subprocess.SubprocessError) as e:
            d[c] = _err(e)
    # Through a shell too: 126/127 = not executable / not found.
    try:
        rc = subprocess.run(["/bin/sh", "-c", "gcc --version"], capture_output=True, timeout=10).returncode
        d["sh -c gcc"] = rc
        if rc not in (126, 127):
            started.append("sh -c gcc")
    except (OSError, subprocess.SubprocessError) as e:
        d["sh -c gcc"] = _err(e)
    return not started, d


def exec_after_lockdown(args: list[str]) -> tuple[bool, dict]:
    """Where the profile locks down (no exec after start), the first execve kills the
    whole process, also from a thread that existed before the lock-down (TSYNC): the
    probe prints nothing. Where it keeps exec (research), /bin/true runs."""
    from supervisor.protocol import Isolation

    d: dict = {"baseline_exec": subprocess.run(["/bin/true"]).returncode}
    go, res = threading.Event(), {}
    locked = not Isolation.for_profile(args[0] if args else "control").exec_after_start

    def old_thread() -> None:
        go.wait()
        try:
            if locked:   # no fork first: process creation itself is denied there
                os.execv("/bin/true", ["/bin/true"])   # success: exit 0, no JSON
            res["r"] = subprocess.run(["/bin/true"]).returncode
        except OSError as e:
            res["r"] = _err(e)

    t = threading.Thread(target=old_thread)
    t.start()
    d["domain"] = _lock(args)
    go.set()
    t.join()
    d["pre_existing_thread"] = res.get("r")
    return res.get("r") != 0, d


def inet_socket_after_lockdown(args: list[str]) -> tuple[bool, dict]:
    d: dict = {"domain": _lock(args)}
    opened = []
    fams = {"AF_INET": socket.AF_INET, "AF_INET6": socket.AF_INET6,
            "AF_NETLINK": socket.AF_NETLINK, "AF_PACKET": getattr(socket, "AF_PACKET", 17)}
    for name, fam in fams.items():
        try:
            socket.socket(fam, socket.SOCK_DGRAM).close()
            d[name] = "opened"
            opened.append(name)
        except OSError as e:
            d[name] = _err(e)
    return not opened, d


def unix_socket_after_lockdown(args: list[str]) -> tuple[bool, dict]:
    d: dict = {"domain": _lock(args)}
    try:
        a, b = socket.socketpair()
        a.sendall(b"ping")
        d["socketpair"] = b.recv(4).decode()
        a.close(), b.close()
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
        d["af_unix"] = "opened"
        return False, d
    except OSError as e:
        d["error"] = _err(e)
        return True, d


def threads_after_lockdown(args: list[str]) -> tuple[bool, dict]:
    """Sanity, not an attack: threads work after the lock-down (clone3 -> ENOSYS ->
    clone with CLONE_THREAD)."""
    d: dict = {"domain": _lock(args)}
    box: list[int] = []
    t = threading.Thread(target=lambda: box.append(threading.get_native_id()))
    t.start(), t.join()
    d["thread"] = bool(box)
    return not d["thread"], d


def _new_process(how: str) -> int:
    if how == "fork":
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    # posix_spawn: glibc's clone(CLONE_VM | CLONE_VFORK), then the exec
    pid = os.posix_spawn("/bin/sh", ["/bin/sh", "-c", "exit 7"], {})
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def fork_after_lockdown(args: list[str]) -> tuple[bool, dict]:
    """ARGS: [domain] [fork|spawn]. A new process after the lock-down: killed (SIGSYS,
    no JSON) where the profile does not start processes after start-up; a research
    profile forks and spawns (exit 7)."""
    d: dict = {"domain": _lock(args[:1])}
    how = args[1] if len(args) > 1 else "fork"
    try:
        d[how] = _new_process(how)
    except OSError as e:
        d[how] = _err(e)
    return d[how] != 7, d


def ptrace_after_lockdown(args: list[str]) -> tuple[bool, dict]:
    pid = os.fork()
    if pid == 0:  # tracee: our own child, the easiest possible target
        time.sleep(10)
        os._exit(0)
    d: dict = {}
    try:
        d["domain"] = _lock(args)
        r = _libc.ptrace(_PTRACE_ATTACH, pid, None, None)
        d["attach"] = "ok" if r == 0 else errno.errorcode.get(ctypes.get_errno(), "?")
        if r == 0:
            os.waitpid(pid, 0)
            _libc.ptrace(_PTRACE_DETACH, pid, None, None)
        return r != 0, d
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def read_unbound_path(args: list[str]) -> tuple[bool, dict]:
    d: dict = {}
    readable = []
    for p in args or ["/etc/shadow", "/root/.bash_history"]:
        try:
            with open(p, "rb") as f:
                f.read(1)
            d[p] = "read"
            readable.append(p)
        except OSError as e:
            d[p] = _err(e)
    return not readable, d


def write_ro_path(args: list[str]) -> tuple[bool, dict]:
    d: dict = {}
    written = []
    for base in args or [PROJECT_ROOT, "/usr", sys.prefix, "/etc", "/"]:
        p = os.path.join(base, f".probe-write-{os.getpid()}")
        try:
            with open(p, "w") as f:
                f.write("x")
            d[base] = "written"
            written.append(base)
            os.unlink(p)
        except OSError as e:
            d[base] = _err(e)
    return not written, d


def kill_pid(args: list[str]) -> tuple[bool, dict]:
    d: dict = {}
    reached = []
    for a in args:
        try:
            os.kill(int(a), 0)
            d[a] = "signalled"
            reached.append(a)
        except OSError as e:  # ProcessLookupError: not in our pid namespace
            d[a] = _err(e)
    return not reached, d


def see_pid(args: list[str]) -> tuple[bool, dict]:
    d = {a: os.path.exists(f"/proc/{int(a)}") for a in args}
    return not any(d.values()), d


def no_new_privs(args: list[str]) -> tuple[bool, dict]:
    with open("/proc/self/status") as f:
        st = dict(ln.split(":", 1) for ln in f if ":" in ln)
    d = {k: st[k].strip() for k in ("NoNewPrivs", "Seccomp", "CapEff", "CapBnd", "Uid") if k in st}
    return d.get("NoNewPrivs") == "1", d


def mknod_dev(args: list[str]) -> tuple[bool, dict]:
    try:
        os.mknod("/tmp/probe-null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        return False, {"mknod": "created"}
    except OSError as e:
        return True, {"mknod": _err(e)}


def unshare_userns(args: list[str]) -> tuple[bool, dict]:
    r = _libc.unshare(_CLONE_NEWUSER)
    if r == 0:
        return False, {"unshare": "ok"}
    return True, {"unshare": errno.errorcode.get(ctypes.get_errno(), "?")}


def info(args: list[str]) -> tuple[bool, dict]:
    fds = sorted(int(x) for x in os.listdir("/proc/self/fd"))
    return False, {
        "hostname": socket.gethostname(), "uid": os.getuid(), "gid": os.getgid(),
        "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
        "env": dict(os.environ), "fds": fds, "root": sorted(os.listdir("/")),
        "interfaces": _interfaces(), "sys_path": sys.path,
    }


def unix_raw_dgram_after_lockdown(args: list[str]) -> tuple[bool, dict]:
    """ARGS: [domain]. socket(AF_UNIX, SOCK_RAW): the kernel turns it into a datagram
    socket (af_unix.c: "BSD has AF_UNIX, SOCK_RAW"), which the SOCK_DGRAM rule does not
    match; sendmsg with an address (sendto's is watched, sendmsg's is not) then reaches
    any socket path the worker can see. Denied when the first call kills (no verdict)."""
    d: dict = {"domain": _lock(args[:1])}
    path = f"/tmp/redteam-{os.getpid()}.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_RAW)
    d["type"] = rx.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
    rx.bind(path)
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_RAW)
    try:
        d["sent"] = tx.sendmsg([b"hello"], [], 0, path)
        rx.settimeout(2)
        d["received"] = rx.recv(16).decode()
    except OSError as e:
        d["sent"] = _err(e)
    finally:
        tx.close(), rx.close()
        os.unlink(path)
    return d.get("received") != "hello", d


# --- machine side: what stops bwrap's user namespace --------------------------------

_BWRAP_PROFILE = ("abi <abi/4.0>, include <tunables/global> "
                  "profile bwrap /usr/bin/bwrap flags=(unconfined) { userns, }")
# (knob under <proc>/sys, value that blocks, one line saying what to do). bwrap runs as
# the domain's unprivileged host user, so every one of these applies even to a root
# supervisor.
_USERNS_KNOBS: tuple[tuple[str, str, str], ...] = (
    ("kernel/apparmor_restrict_unprivileged_userns", "1",
     "AppArmor (Ubuntu 23.10+/24.04) refuses unprivileged user namespaces: give bwrap a "
     f"profile that allows them: write '{_BWRAP_PROFILE}' to /etc/apparmor.d/bwrap and run "
     "`apparmor_parser -r /etc/apparmor.d/bwrap` (or set the sysctl to 0: every program "
     "then gets them)"),
    ("kernel/unprivileged_userns_clone", "0",
     "unprivileged user namespaces are off (Debian <= 10 knob): sysctl -w "
     "kernel.unprivileged_userns_clone=1 (persist it in /etc/sysctl.d/)"),
    ("user/max_user_namespaces", "0",
     "no user namespaces allowed: sysctl -w user.max_user_namespaces=15000 "
     "(persist it in /etc/sysctl.d/)"),
)


def _read_knob(path: str) -> str | None:
    try:
        with open(path) as f:          # read only: a kernel knob is never written here
            return f.read().strip()
    except OSError:
        return None                    # absent: this kernel has no such knob


def userns_blockers(proc_root: str = "/proc") -> list[tuple[str, str, str]]:
    """(sysctl name, value, what to do) for each knob under `proc_root` that stops an
    unprivileged user namespace. `proc_root` is a fake tree in tests."""
    out = []
    for rel, bad, advice in _USERNS_KNOBS:
        value = _read_knob(os.path.join(proc_root, "sys", rel))
        if value == bad:
            out.append((rel.replace("/", "."), value, advice))
    return out


def userns_advice(proc_root: str = "/proc") -> str | None:
    """One line naming the knob(s) that would make every sandbox fail, and the fix;
    None when nothing here stops bwrap. A knob set is not proof of failure (an AppArmor
    profile may already allow bwrap): whether a sandbox starts is what
    `launch.rehearse` finds; this says why when it does not."""
    found = userns_blockers(proc_root)
    if not found:
        return None
    return "; ".join(f"{name} = {value}: {advice}" for name, value, advice in found)


# How bwrap words a refused user namespace: AppArmor (uid map write refused), the
# Debian knob / max_user_namespaces (clone refused).
_USERNS_ERRORS = ("setting up uid map", "No permissions to create new namespace",
                  "Creating new namespace failed", "unshare", "uid_map")


def explain_bwrap_error(line: str, proc_root: str = "/proc") -> str:
    """bwrap's error line, with what to do appended when it is a refused user namespace
    and a knob here explains it."""
    if any(k in line for k in _USERNS_ERRORS):
        advice = userns_advice(proc_root)
        if advice:
            return f"{line} -> {advice}"
    return line


ATTACKS: dict[str, Callable[[list[str]], tuple[bool, dict]]] = {
    f.__name__: f
    for f in (
        tcp_connect, udp_send, abstract_unix_connect, exec_compiler, exec_after_lockdown,
        inet_socket_after_lockdown, unix_socket_after_lockdown, threads_after_lockdown,
        fork_after_lockdown,
        ptrace_after_lockdown, read_unbound_path, write_ro_path, kill_pid, see_pid,
        no_new_privs, mknod_dev, unshare_userns, info, unix_raw_dgram_after_lockdown,
    )
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ATTACKS:
        print(f"usage: probe {{{','.join(ATTACKS)}}} [args]", file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    try:
        denied, detail = ATTACKS[name](args)
        out = {"attack": name, "denied": bool(denied), "detail": detail}
    except Exception as e:  # report, never crash without a verdict
        out = {"attack": name, "denied": None, "detail": {"probe_error": _err(e)}}
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
