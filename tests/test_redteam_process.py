"""Red team, from inside a real control sandbox, against the runtime filter's ban on new
processes (fork, vfork and clone without CLONE_THREAD fail with EPERM; first written as
a kill, which broke the standard library's lookups) and against its companion,
supervisor/sandbox/ldcache.py.

Every attack runs after `lock_down("control")` (what the runner does before a control
worker's module is imported). bwrap reports a worker killed by seccomp (SIGSYS) as 159.
The holes found (a worker whose main thread exited went unscanned; an AF_UNIX SOCK_RAW
socket is a datagram socket) were strict xfails first; they pass now.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time

import pytest

from supervisor.sandbox import descendant_pids, policy_for_domain, run, spawn
from supervisor.sandbox import ldcache
from supervisor.sandbox.launch import sandbox_main_pid

from .conftest import bwrap_unusable

_why = bwrap_unusable()
if _why:
    pytest.skip(_why, allow_module_level=True)

pytestmark = pytest.mark.sandbox

PY = sys.executable
KILLED_BY_SECCOMP = 128 + int(signal.SIGSYS)
X86_64 = os.uname().machine == "x86_64"

PRE = (
    "import ctypes, json, os, sys, threading, time\n"
    "from supervisor.sandbox.seccomp import lock_down\n"
    "lock_down('control')\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "L = ctypes.c_long\n"
    "print('locked', flush=True)\n"
)


def locked(code: str, timeout: float = 30):
    return run(policy_for_domain("control"), [PY, "-c", PRE + code], timeout=timeout)


def assert_killed(r) -> None:
    assert r.returncode == KILLED_BY_SECCOMP, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.splitlines()[:1] == ["locked"], r.stdout     # it got as far as the attack
    assert "after" not in r.stdout, r.stdout                      # and no further


# --- (a) a second process by any road: the worker dies at the attempt --------------

SIGCHLD = int(signal.SIGCHLD)
CLONE_VM, CLONE_FS, CLONE_FILES, CLONE_SIGHAND = 0x100, 0x200, 0x400, 0x800
CLONE_PIDFD, CLONE_PTRACE, CLONE_VFORK, CLONE_PARENT = 0x1000, 0x2000, 0x4000, 0x8000
CLONE_THREAD, CLONE_SYSVSEM, CLONE_PARENT_SETTID = 0x10000, 0x40000, 0x100000
X32 = 0x40000000

# i386 fork through int 0x80 from 64-bit code: mov eax, 2; int 0x80; ret
I386_FORK = r"""
import mmap
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(bytes([0xb8, 2, 0, 0, 0, 0xcd, 0x80, 0xc3]))
f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
print("after", f(), flush=True)
"""

NEW_PROCESS = {
    "fork": "print('after', libc.syscall(L(57)), flush=True)",
    "vfork": "print('after', libc.syscall(L(58)), flush=True)",
    "clone-sigchld": "print('after', libc.syscall(L(56), L(%d), L(0), L(0), L(0), L(0)), flush=True)"
                     % SIGCHLD,
    "clone-parent": "print('after', libc.syscall(L(56), L(%d), L(0), L(0), L(0), L(0)), flush=True)"
                    % (CLONE_PARENT | SIGCHLD),
    "clone-ptrace": "print('after', libc.syscall(L(56), L(%d), L(0), L(0), L(0), L(0)), flush=True)"
                    % (CLONE_PTRACE | SIGCHLD),
    # the kernel uses only the low 32 bits of clone's flags: CLONE_THREAD up high is no thread
    "clone-thread-bit-in-high-word":
        "print('after', libc.syscall(L(56), L(%d), L(0), L(0), L(0), L(0)), flush=True)"
        % (SIGCHLD | (CLONE_THREAD << 32)),
    "x32-fork": "print('after', libc.syscall(L(%d)), flush=True)" % (X32 | 57),
    "x32-clone": "print('after', libc.syscall(L(%d), L(%d), L(0), L(0), L(0), L(0)), flush=True)"
                 % (X32 | 56, SIGCHLD),
    "i386-int80-fork": I386_FORK,
    "posix_spawn": "print('after', os.posix_spawn('/bin/true', ['true'], {}), flush=True)",
    "subprocess": "import subprocess; print('after', subprocess.run(['/bin/true']), flush=True)",
    "os.system": "print('after', os.system('true'), flush=True)",
    "multiprocessing": "import multiprocessing as mp; p = mp.get_context('fork').Process("
                       "target=print); p.start(); print('after', flush=True)",
    "fork-from-a-thread": "t = threading.Thread(target=os.fork); t.start(); t.join();"
                          " time.sleep(0.2); print('after', flush=True)",
    "execve-from-a-thread": "t = threading.Thread(target=os.execv, args=('/bin/true', ['true']));"
                            " t.start(); t.join(); time.sleep(0.2); print('after', flush=True)",
    "io_uring_setup": "print('after', libc.syscall(L(425), L(1), L(0)), flush=True)",
}


# Wrong-ABI entries, exec and io_uring kill; every road to a new process fails with
# EPERM (seccomp.PROCESS_DENY) and the worker goes on with no process beside it.
KILLS = ("x32-fork", "x32-clone", "i386-int80-fork", "execve-from-a-thread", "io_uring_setup")
ALONE = ("\ntime.sleep(0.2)\nprint('pids', json.dumps(sorted(int(p) for p in os.listdir('/proc')"
         " if p.isdigit())), os.getpid(), flush=True)\n")


@pytest.mark.parametrize("how", sorted(NEW_PROCESS))
def test_no_new_process_after_lock_down(how):
    if not X86_64 and how.startswith(("x32", "i386", "clone", "fork", "vfork", "io_uring")):
        pytest.skip("x86_64 syscall numbers")
    if how in KILLS:
        assert_killed(locked(NEW_PROCESS[how]))
        return
    code = ("try:\n    " + NEW_PROCESS[how].replace("\n", "\n    ") +
            "\nexcept OSError as e:\n    print('after errno', e.errno, flush=True)" + ALONE)
    r = locked(code)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("after")], r.stdout
    pids, me = r.stdout.splitlines()[-1][len("pids "):].rsplit(" ", 1)
    assert json.loads(pids) == [1, int(me)], r.stdout        # no process beside the worker


# Threads by raw clone() with odd but valid CLONE_THREAD combinations: each new task is a
# thread of the worker (same tgid) or the call fails; the sandbox never holds a process
# but bwrap's init (1) and the worker. The thread runs syscall(SYS_pause) on its own stack
# and touches nothing of the caller (no TLS of its own: CLONE_SETTLS is left out).
THREAD_COMBOS = r"""
base = %(base)d
combos = {"base": base, "parent": base | %(parent)d, "parent_settid": base | %(settid)d,
          "pidfd": base | %(pidfd)d, "no_sighand": %(thread)d, "no_vm": %(thread)d | %(sighand)d}
libc.clone.restype = ctypes.c_int
libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
fn = ctypes.cast(libc.syscall, ctypes.c_void_p)
stacks, out = [], {}
for name, flags in combos.items():
    stack = ctypes.create_string_buffer(1 << 16)
    stacks.append(stack)
    top = (ctypes.addressof(stack) + (1 << 16) - 64) & ~0xF
    ptid = ctypes.c_int(0)
    tid = libc.clone(fn, top, flags, 34, ctypes.byref(ptid), None, None)
    if tid < 0:
        out[name] = "errno:%%d" %% ctypes.get_errno()
        continue
    time.sleep(0.05)
    with open("/proc/self/task/%%d/status" %% tid) as f:
        tgid = [ln.split()[1] for ln in f if ln.startswith("Tgid:")][0]
    out[name] = "thread" if int(tgid) == os.getpid() else "process:%%s" %% tgid
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["self"] = os.getpid()
print(json.dumps(out), flush=True)
os._exit(0)
""" % dict(base=CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM,
           parent=CLONE_PARENT, settid=CLONE_PARENT_SETTID, pidfd=CLONE_PIDFD,
           thread=CLONE_THREAD, sighand=CLONE_SIGHAND)


def test_clone_thread_combinations_make_threads_or_fail():
    r = locked(THREAD_COMBOS)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["pids"] == [1, out["self"]], out              # no other process in the box
    for name in ("base", "parent", "parent_settid"):
        assert out[name] == "thread", out
    assert out["pidfd"] in ("thread", "errno:22"), out       # EINVAL before Linux 6.9
    assert out["no_sighand"] == "errno:22" and out["no_vm"] == "errno:22", out


# --- (b) silent probing: nothing forbidden dies alone -------------------------------

def test_a_forbidden_call_in_a_thread_ends_the_whole_worker():
    # KILL_PROCESS, not KILL_THREAD: a probing thread takes the worker (and its verdict) along
    r = locked("t = threading.Thread(target=lambda: libc.syscall(L(101), L(0), L(0), L(0), L(0)))\n"
               "t.start(); t.join(); time.sleep(0.2); print('after', flush=True)")   # ptrace
    assert_killed(r)


# --- (a') a worker the supervisor cannot see into ----------------------------------

# The main thread leaves with exit(2) (not exit_group): the worker runs on in its other
# threads, but the leader is a zombie whose /proc/PID/maps is empty. Everything the
# supervisor reads by the worker's pid (exec_snapshot at READY, scan_pid after) then
# sees nothing mapped at all; the live maps are only under /proc/PID/task/TID/maps.
LEADER_EXIT = r"""
import mmap
def body():
    global m
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    print("ready", flush=True)
    time.sleep(20)
    os._exit(0)
threading.Thread(target=body).start()
def churn():
    while True:                        # threads born and gone all the time
        t = threading.Thread(target=int)
        t.start()
        t.join()
if os.environ.get("CHURN") == "1":
    threading.Thread(target=churn, daemon=True).start()
time.sleep(0.2)
if os.environ.get("LEADER_EXITS") == "1":
    libc.syscall(L(60), L(0))          # SYS_exit: this thread only
time.sleep(20)
"""


def _scan_worker(leader_exits: bool, churn: bool = False, scans: int = 1):
    """(leader state, bytes in /proc/PID/maps, scan_pid's hits or the exception it raised),
    scanned as the supervisor's _scan_maps does a control worker (immutable code); with
    ``scans`` > 1, the last item is the list of each scan's result."""
    from supervisor.admission import maps

    p = spawn(policy_for_domain("control"), [PY, "-c", PRE + LEADER_EXIT],
              env_extra={"LEADER_EXITS": "1" if leader_exits else "0",
                         "CHURN": "1" if churn else "0"},
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        pid = sandbox_main_pid(descendant_pids(p.pid))
        assert pid is not None
        with open(f"/proc/{pid}/status") as f:
            state = [ln.split()[1] for ln in f if ln.startswith("State:")][0]
        with open(f"/proc/{pid}/maps") as f:
            size = len(f.read())
        results = []
        for _ in range(scans):
            try:
                results.append(maps.scan_pid(pid, immutable_code=True))
            except Exception as e:      # _scan_maps: "went away", skipped without a word
                results.append(e)
        return state, size, results[0] if scans == 1 else results
    finally:
        p.kill()
        p.wait()


def test_a_writable_exec_mapping_is_seen_in_a_live_worker():
    state, size, hits = _scan_worker(leader_exits=False)
    assert state != "Z" and size > 0, (state, size)
    assert any(h.kind == "writable-exec" for h in hits), hits


def test_a_worker_without_its_main_thread_is_still_scanned():
    """Was a hole: a control worker whose main thread calls exit(2) runs on in its other
    threads, but its leader is a zombie: /proc/PID/maps is empty and mountinfo fails
    with EINVAL, so scan_pid raised and _scan_maps skipped it as gone, every interval.
    The scan now reads a live thread's view (maps.live_task)."""
    state, size, hits = _scan_worker(leader_exits=True)
    assert state == "Z" and size == 0, (state, size)        # what the supervisor reads by pid
    assert not isinstance(hits, Exception), repr(hits)
    assert any(h.kind == "writable-exec" for h in hits), hits


def test_a_headless_worker_churning_threads_is_scanned_every_time():
    """The same worker, its main thread gone, while other threads are born and exit all
    the time: the live thread whose view the scan reads must not vanish under it (a
    scan that raised would be skipped, and a worker that churned could hide between
    scans). Every one of 30 back-to-back scans sees the writable code."""
    state, _size, results = _scan_worker(leader_exits=True, churn=True, scans=30)
    assert state == "Z", state
    bad = [r for r in results if isinstance(r, Exception)
           or not any(h.kind == "writable-exec" for h in r)]
    assert not bad, bad[:3]


# --- the AF_UNIX datagram ban, by another name --------------------------------------

def test_control_gets_no_unconnected_unix_datagram_socket():
    """Was a hole: socket(AF_UNIX, SOCK_RAW) is a datagram socket (af_unix.c maps it to
    SOCK_DGRAM) that the SOCK_DGRAM rule missed, and sendmsg's address is out of reach;
    every AF_UNIX type but stream and seqpacket kills now."""
    r = run(policy_for_domain("control"),
            [PY, "-m", "supervisor.sandbox.probe", "unix_raw_dgram_after_lockdown", "control"],
            timeout=30)
    assert r.returncode == KILLED_BY_SECCOMP, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "{" not in r.stdout, r.stdout


# --- (c) ldcache.py: the cache cannot be touched, and no cache makes it raise --------

def test_the_linker_cache_is_read_only_in_the_sandbox():
    r = locked(
        "out = {}\n"
        "for what, f in (('write', lambda: open('/etc/ld.so.cache', 'r+b')),\n"
        "                ('replace', lambda: os.rename('/tmp/x', '/etc/ld.so.cache')),\n"
        "                ('unlink', lambda: os.unlink('/etc/ld.so.cache'))):\n"
        "    open('/tmp/x', 'wb').close()\n"
        "    try:\n"
        "        f(); out[what] = 'ok'\n"
        "    except OSError as e:\n"
        "        out[what] = e.errno\n"
        "print(json.dumps(out), flush=True)\n")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    out = json.loads(r.stdout.splitlines()[-1])
    assert "ok" not in out.values(), out


def _entry(flags: int, key: int) -> bytes:
    return struct.pack("<iIIIQ", flags, key, key, 0, 0)


def _cache(entries: list[bytes], strings: bytes, n: int | None = None) -> bytes:
    head = struct.pack("<20sII B3x I 12x", b"glibc-ld.so.cache1.1",
                       len(entries) if n is None else n, len(strings), 0, 0)
    return head + b"".join(entries) + strings


def test_ldcache_parser_survives_hostile_and_truncated_caches(tmp_path):
    real = open(ldcache.CACHE, "rb").read()
    abi = 0x0300 | 0x0003 if X86_64 else 0x0003
    hdr = 48
    cases = [b"", b"glibc", real[:20], real[:hdr], real[: hdr + 7], real[:-1], real[: len(real) // 2],
             _cache([], b"", n=0xFFFFFFFF),
             _cache([_entry(abi, 0xFFFFFFFF)], b""),                        # key past the end
             _cache([_entry(abi, hdr + 24)], b"libnul.so"),                  # no NUL at all
             _cache([_entry(abi, 0)], b"libzero.so\0"),                      # key 0: the magic
             _cache([_entry(-1, hdr + 24)], b"libneg.so\0"),                 # negative flags
             _cache([_entry(abi, hdr + 24)], b"lib\xff\xfe.so.1\0"),         # not UTF-8
             _cache([_entry(abi, hdr + 24)] * 50000, b"libmany.so.1\0")]     # many entries
    rng = random.Random(1234)
    for _ in range(60):
        b = bytearray(real[: rng.randrange(len(real) + 1)])
        for _ in range(rng.randrange(1, 64)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        b[:20] = real[:20]
        cases.append(bytes(b))
    t0 = time.monotonic()
    for i, data in enumerate(cases):
        path = tmp_path / f"c{i}"
        path.write_bytes(data)
        names = ldcache.sonames(str(path))
        assert isinstance(names, list) and all(isinstance(s, str) for s in names)
    assert time.monotonic() - t0 < 10
    assert ldcache.sonames(str(tmp_path)) == []                             # a directory
    assert ldcache.sonames(str(tmp_path / "missing")) == []


# --- (d) what a control worker legitimately does after the lock-down -----------------

LEGIT = r"""
import numpy as np, capnp, trio, av, tinygrad, uuid, platform
async def main():
    return await trio.to_thread.run_sync(lambda: 42)
t = threading.Thread(target=lambda: None); t.start(); t.join()
import ctypes.util
print(json.dumps({"numpy": float(np.ones(3).sum()), "trio": trio.run(main), "av": av.__version__,
                  "uuid4": len(str(uuid.uuid4())), "machine": platform.machine(),
                  "libc": ctypes.util.find_library("c"), "none": ctypes.util.find_library("zzz")}),
      flush=True)
"""


def test_the_control_stack_imports_and_runs_after_lock_down():
    r = locked(LEGIT, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["trio"] == 42 and out["libc"] == "libc.so.6" and out["none"] is None, out


# Standard-library calls that answered through a subprocess, which used to fail quietly
# in the child (its exec was killed) and now kill the worker at the fork.
STDLIB_FORKS = {
    "platform.platform": "import platform; print('after', platform.platform(), flush=True)",
    "platform.architecture": "import platform; print('after', platform.architecture(), flush=True)",
    "platform.processor": "import platform; print('after', platform.processor(), flush=True)",
    # not uuid.getnode(): its last fallback opens an AF_INET socket, which kills in control
    # with or without the process ban (as before it: no network)
}


@pytest.mark.parametrize("call", sorted(STDLIB_FORKS))
def test_stdlib_lookups_do_not_kill_a_locked_down_worker(call):
    """Red team (legit breakage of a42ec29, where a fork killed): the standard library
    shells out (uname -p, file, ip link) and falls back when it cannot: EPERM."""
    r = locked(STDLIB_FORKS[call])
    assert r.returncode == 0 and "after" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
