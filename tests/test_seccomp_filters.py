"""Seccomp filters, judged from inside real bubblewrap sandboxes.

Every dangerous call is made for real in a forked child inside the sandbox (so one
sandbox covers a whole list) and the child's fate is reported: "signal:31" means
SIGSYS, i.e. SECCOMP_RET_KILL_PROCESS. Arguments are invalid pointers/fds, so a call
that slipped through would only fail with an errno (and the test with it).
"""

from __future__ import annotations

import errno
import json
import platform
import signal
import sys

import pytest

from supervisor.ipc import shm
from supervisor.sandbox import seccomp
from supervisor.sandbox.launch import run
from supervisor.sandbox.policy import policy_for_domain

from .conftest import bwrap_unusable

_why = bwrap_unusable()
if _why:
    pytest.skip(_why, allow_module_level=True)

pytestmark = pytest.mark.sandbox

PY = sys.executable
SIGSYS = f"signal:{int(signal.SIGSYS)}"
KILLED_BY_SIGSYS = 128 + int(signal.SIGSYS)  # how bwrap reports a signal-killed worker

# Forks one child per case; the child optionally locks down first, then makes the raw
# syscall. Prints {label: "signal:N" | "errno:N" (0 = success) | "unknown"}.
HARNESS = r"""
import ctypes, json, os, sys
import pyseccomp as sc
from supervisor.sandbox import seccomp
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def arg(a):
    return ctypes.c_char_p(bytes.fromhex(a)) if isinstance(a, str) else ctypes.c_long(a)
out = {}
for label, name, args, lock, *thread in json.loads(sys.argv[1]):
    nr = name if isinstance(name, int) else seccomp._nr(sc, name)
    if nr < 0:
        out[label] = "unknown"
        continue
    pid = os.fork()
    if pid == 0:
        if lock:
            seccomp.lock_down(lock)
        call = lambda: os._exit(0 if libc.syscall(ctypes.c_long(nr), *map(arg, args)) >= 0
                                else min(ctypes.get_errno(), 255))
        if thread:  # from a second thread: a kill that ends only the thread shows as 99
            import threading, time
            threading.Thread(target=call).start()
            time.sleep(1)
            os._exit(99)
        call()
    st = os.waitpid(pid, 0)[1]
    out[label] = f"signal:{os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else f"errno:{os.WEXITSTATUS(st)}"
print(json.dumps(out))
"""

BAD = [-1] * 6  # invalid fd / pointer / flags everywhere
AF_UNIX, AF_INET, AF_NETLINK = 1, 2, 16
SIGCHLD = int(signal.SIGCHLD)
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET, SOCK_CLOEXEC = 1, 2, 3, 5, 0o2000000
CLONE_SIGHAND = 0x800  # without CLONE_VM: EINVAL before anything is created
SHM_EXEC = 0o100000
X32_GETPID = 0x40000000 | 39


def harness(policy, cases, pass_fds=()) -> dict[str, str]:
    r = run(policy, [PY, "-c", HARNESS, json.dumps(cases)], pass_fds=pass_fds, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def control_cases() -> tuple[list, dict[str, str]]:
    """(cases, expected outcome per label) for the strict domain."""
    cases: list = []
    want: dict[str, str] = {}

    def case(label, name, args, expect, lock="", *thread):
        cases.append([label, name, args, lock, *thread])
        want[label] = expect

    for name in (*seccomp.BASE_DENY, *seccomp.FILE_META_DENY, *seccomp.STRICT_DENY):
        case(name, name, BAD, SIGSYS)
    for bit in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        case(f"clone:{bit:#x}", "clone", [bit | CLONE_SIGHAND, 0, 0, 0, 0], SIGSYS)
    case("personality:READ_IMPLIES_EXEC", "personality", [0x0400000], SIGSYS)
    case("personality:0", "personality", [0], SIGSYS)
    case("personality:query", "personality", [0xFFFFFFFF], "errno:0")
    case("shmat:SHM_EXEC", "shmat", [-1, 0, SHM_EXEC], SIGSYS)
    case("shmat:plain", "shmat", [-1, 0, 0], f"errno:{errno.EINVAL}")
    case("socket:inet", "socket", [AF_INET, SOCK_STREAM, 0], SIGSYS)
    case("socket:netlink", "socket", [AF_NETLINK, SOCK_RAW, 0], SIGSYS)
    case("socket:unix-dgram", "socket", [AF_UNIX, SOCK_DGRAM, 0], SIGSYS)
    case("socket:unix-dgram-cloexec", "socket", [AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0], SIGSYS)
    case("socket:unix-stream", "socket", [AF_UNIX, SOCK_STREAM, 0], "errno:0")
    case("socketpair:dgram", "socketpair", [AF_UNIX, SOCK_DGRAM, 0, -1], SIGSYS)
    # red team: the kernel makes an AF_UNIX SOCK_RAW socket a datagram socket
    case("socket:unix-raw", "socket", [AF_UNIX, SOCK_RAW, 0], SIGSYS)
    case("socketpair:raw", "socketpair", [AF_UNIX, SOCK_RAW, 0, -1], SIGSYS)
    case("socketpair:seqpacket", "socketpair", [AF_UNIX, SOCK_SEQPACKET, 0, -1], f"errno:{errno.EFAULT}")
    case("connect", "connect", [-1, 0, 0], SIGSYS)
    case("sendto:addr", "sendto", [-1, 0, 0, 0, 1, 16], SIGSYS)
    case("sendto:no-addr", "sendto", [-1, 0, 0, 0, 0, 0], f"errno:{errno.EBADF}")
    case("clone3", "clone3", [0, 0], f"errno:{errno.ENOSYS}")
    case("execve:after-lock_down", "execve", BAD, SIGSYS, lock="control")
    case("execveat:after-lock_down", "execveat", BAD, SIGSYS, lock="control")
    case("execve:before-lock_down", "execve", BAD, f"errno:{errno.EFAULT}")
    # No new process after the lock-down, by any call: EPERM (the forked child exits
    # at once if one slips through: "errno:0"); start-up may fork.
    no_process = f"errno:{errno.EPERM}"
    case("clone:process:after-lock_down", "clone", [SIGCHLD, 0, 0, 0, 0], no_process,
         lock="control")
    case("fork:after-lock_down", "fork", [], no_process, lock="control")
    case("vfork:after-lock_down", "vfork", [], no_process, lock="control")
    case("clone:process:before-lock_down", "clone", [SIGCHLD, 0, 0, 0, 0], "errno:0")
    # No descriptor leaves a started control worker (round 6 row 0b: SCM_RIGHTS rides
    # only on sendmsg/sendmmsg); research keeps them, and so does start-up.
    case("sendmsg:after-lock_down", "sendmsg", [-1, 0, 0], SIGSYS, lock="control")
    case("sendmmsg:after-lock_down", "sendmmsg", [-1, 0, 0, 0], SIGSYS, lock="control")
    case("sendmsg:before-lock_down", "sendmsg", [-1, 0, 0], f"errno:{errno.EBADF}")
    case("sendmsg:research", "sendmsg", [-1, 0, 0], f"errno:{errno.EBADF}", lock="research")
    if platform.machine() == "x86_64":
        # bad-arch action, from a second thread: the whole process must die
        case("x32-abi", X32_GETPID, [], SIGSYS, "", True)
    case("ptrace:thread", "ptrace", BAD, SIGSYS, "", True)
    return cases, want


def test_control_dangerous_classes_kill_with_sigsys():
    cases, want = control_cases()
    got = harness(policy_for_domain("control"), cases)
    got = {k: v for k, v in got.items() if v != "unknown"}  # syscall absent on this arch
    assert len(got) > 70, got
    wrong = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    assert not wrong, wrong


def test_control_attack_kills_the_whole_sandbox():
    # No fork here: the worker itself dies and bwrap reports 128 + SIGSYS.
    code = "import ctypes; ctypes.CDLL(None).ptrace(16, 1, 0, 0); print('survived')"
    r = run(policy_for_domain("control"), [PY, "-c", code], timeout=30)
    assert r.returncode == KILLED_BY_SIGSYS and "survived" not in r.stdout, (r.returncode, r.stdout, r.stderr)
    code = ("import os; from supervisor.sandbox.seccomp import lock_down; lock_down('control');"
            "os.execv('/bin/true', ['/bin/true'])")
    r = run(policy_for_domain("control"), [PY, "-c", code], timeout=30)
    assert r.returncode == KILLED_BY_SIGSYS, (r.returncode, r.stdout, r.stderr)


def _posix_acl_rw(uid: int) -> str:
    """system.posix_acl_access value granting `uid` read-write (hex, for the harness)."""
    import struct
    ents = [(0x01, 6, 0xFFFFFFFF), (0x02, 6, uid), (0x04, 4, 0xFFFFFFFF),
            (0x10, 6, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)]  # USER_OBJ USER GROUP_OBJ MASK OTHER
    return (struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in ents)).hex()


@pytest.fixture
def readonly_memfd():
    fd = shm.create_segment("seccomp-test", 4096)
    ro = shm.reopen_read_only(fd)
    yield ro
    import os
    os.close(ro)
    os.close(fd)


def test_research_reader_cannot_make_itself_a_writer(readonly_memfd):
    pol = policy_for_domain("research")
    fd = readonly_memfd
    name = b"system.posix_acl_access\0".hex()
    acl = _posix_acl_rw(pol.uid)
    cases = [
        ["fsetxattr:acl", "fsetxattr", [fd, name, acl, len(acl) // 2, 0], ""],
        ["fchmod:memfd", "fchmod", [fd, 0o600], ""],
        ["fchown:memfd", "fchown", [fd, pol.uid, pol.gid], ""],
        ["fremovexattr:acl", "fremovexattr", [fd, name], ""],
        *[[n, n, BAD, ""] for n in seccomp.FILE_META_DENY],
        # the rest of the generic list stays EPERM in research
        ["ptrace", "ptrace", BAD, ""],
        ["unshare", "unshare", [0x10000000], ""],
        ["clone:newuser", "clone", [0x10000000 | CLONE_SIGHAND, 0, 0, 0, 0], ""],
        ["clone3", "clone3", [0, 0], ""],
    ]
    if platform.machine() == "x86_64":
        cases.append(["x32-abi", X32_GETPID, [], "", True])
    got = harness(pol, cases, pass_fds=[fd])
    got = {k: v for k, v in got.items() if v != "unknown"}
    # fd-based: the attack on a channel fd it holds; path-based calls stay EPERM in
    # research (linkers chmod their output)
    meta = {"fsetxattr:acl", "fchmod:memfd", "fchown:memfd", "fremovexattr:acl", "x32-abi",
            *seccomp.FILE_META_FD}
    wrong = {k: v for k, v in got.items() if (v != SIGSYS) == (k in meta)}
    assert not wrong, got
    assert got["ptrace"] == got["unshare"] == got["clone:newuser"] == f"errno:{errno.EPERM}", got
    assert got["clone3"] == f"errno:{errno.ENOSYS}", got

    # And without the fork: the reader's fchmod takes the whole research sandbox down.
    code = f"import os; os.fchmod({fd}, 0o600); print('survived')"
    r = run(pol, [PY, "-c", code], pass_fds=[fd], timeout=30)
    assert r.returncode == KILLED_BY_SIGSYS and "survived" not in r.stdout, (r.returncode, r.stderr)


STARTUP = r"""
import json, os, socket, threading
import numpy, capnp, tinygrad, trio
from tinygrad import Tensor
from supervisor.sandbox import seccomp
pid = os.fork()                  # start-up may fork (the launch filter); not after
if pid == 0:
    os._exit(7)
seccomp.lock_down(os.environ.get("DOMAIN_UNDER_TEST", "control"), required=False)
a, b = socket.socketpair()
a.sendall(b"ping")
box = []
ts = [threading.Thread(target=lambda: box.append(float(numpy.ones(8).sum()))) for _ in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
async def main():
    s1, s2 = trio.socket.socketpair()
    await s1.send(b"x")
    return (await s2.recv(1)).decode() + str(await trio.to_thread.run_sync(lambda: 42))
trio_ok = trio.run(main)
extra = {}
if os.environ.get("WITH_TORCH"):
    import torch
    extra["torch"] = float(torch.ones(16).sum())
with open("/proc/self/status") as f:
    filters = next(int(ln.split()[1]) for ln in f if ln.startswith("Seccomp_filters:"))
print(json.dumps({"recv": b.recv(4).decode(), "threads": box, "trio": trio_ok,
                  "fork": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "filters": filters, **extra}))
"""


def _torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


@pytest.mark.parametrize("domain", ["control", "research"])
def test_normal_startup_survives_the_filters(domain):
    env = {"DOMAIN_UNDER_TEST": domain}
    if domain == "research" and _torch_available():
        env["WITH_TORCH"] = "1"  # research is where torch runs
    r = run(policy_for_domain(domain), [PY, "-c", STARTUP], env_extra=env, timeout=90)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["recv"] == "ping" and out["threads"] == [8.0] * 4 and out["trio"] == "x42"
    assert out["fork"] == 7
    assert out["filters"] >= 2, out  # launch filter (bwrap) + runtime filter (lock_down)
    if "WITH_TORCH" in env:
        assert out["torch"] == 16.0
