"""Landlock inside real sandboxes: writes only beneath write_dirs, signals and abstract
sockets scoped to the sandbox's own domain. Nothing is ever written outside the
sandbox's private /tmp: /proc/self/mem is opened for writing and closed at once."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys

import pytest

from supervisor.sandbox import landlock
from supervisor.sandbox.launch import run
from supervisor.sandbox.policy import policy_for_domain

from .conftest import bwrap_unusable

_why = bwrap_unusable()
if _why:
    pytest.skip(_why, allow_module_level=True)
ABI = landlock.abi_version()  # host query only: never restrict the test process itself
if ABI == 0:
    pytest.skip("kernel without Landlock", allow_module_level=True)

pytestmark = pytest.mark.sandbox

PRELUDE = r"""
import errno, json, os, socket, sys, threading
from supervisor.sandbox import landlock
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    except RuntimeError as e:
        return "RuntimeError"
def open_w(path):  # open for writing, never write
    os.close(os.open(path, os.O_WRONLY))
def write(path):
    with open(path, "w") as f:
        f.write("x")
r = {}
"""


def sandboxed(domain: str, body: str, *, seccomp: bool = True) -> dict:
    """`seccomp=False`: no launch filter, so that Landlock alone answers a call the
    filter would kill first (connect, in every domain without a network)."""
    policy = dataclasses.replace(policy_for_domain(domain), seccomp_at_launch=seccomp)
    r = run(policy, [sys.executable, "-c", PRELUDE + body + "\nprint(json.dumps(r))"],
            timeout=30)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_default_restrict_in_control():
    r = sandboxed("control", r"""
r["pre_kill_init"] = attempt(lambda: os.kill(1, 0))   # bwrap's init: outside our domain
t = threading.Thread(target=threading.Event().wait, args=(0.5,)); t.start()
r["multi_thread"] = attempt(landlock.restrict)        # would leave t unrestricted
t.join()
import time
for _ in range(200):   # join() returns before the kernel task is gone (seen in CI)
    if len(os.listdir("/proc/self/task")) == 1:
        break
    time.sleep(0.01)
r["abi"] = landlock.restrict()
r["proc_self_mem"] = attempt(lambda: open_w("/proc/self/mem"))
r["proc_oom"] = attempt(lambda: open_w("/proc/self/oom_score_adj"))
r["tmp"] = attempt(lambda: write("/tmp/ok"))
r["tmp_mkdir"] = attempt(lambda: os.mkdir("/tmp/d"))
r["rename_in_tmp"] = attempt(lambda: os.rename("/tmp/ok", "/tmp/d/ok"))  # REFER granted
r["dev_null"] = attempt(lambda: open_w("/dev/null"))
r["kill_init"] = attempt(lambda: os.kill(1, 0))
r["kill_self"] = attempt(lambda: os.kill(os.getpid(), 0))
pid = os.fork()
if pid == 0:  # a child is inside our domain: signalling it stays allowed
    import time; time.sleep(5); os._exit(0)
r["kill_child"] = attempt(lambda: os.kill(pid, 0))
os.kill(pid, 9); os.waitpid(pid, 0)
""")
    assert r["pre_kill_init"] == "ok", r
    assert r["multi_thread"] == "RuntimeError", r
    assert r["abi"] == ABI, r
    # /proc may already be a read-only mount (EROFS); either way no write access.
    assert r["proc_self_mem"] in ("EACCES", "EROFS") and r["proc_oom"] in ("EACCES", "EROFS"), r
    assert r["tmp"] == r["tmp_mkdir"] == r["rename_in_tmp"] == r["dev_null"] == "ok", r
    assert r["kill_self"] == r["kill_child"] == "ok", r
    if ABI >= 6:
        assert r["kill_init"] == "EPERM", r


def test_writes_outside_write_dirs_denied_by_landlock_itself():
    # /tmp is a writable tmpfs: only Landlock can refuse these (EACCES, not EROFS).
    r = sandboxed("control", r"""
write("/tmp/before"); os.mkdir("/tmp/dir")
r["pre"] = attempt(lambda: write("/tmp/pre"))
landlock.restrict(write_dirs=("/dev", "/tmp/dir"))
r["create"] = attempt(lambda: write("/tmp/new"))
r["overwrite"] = attempt(lambda: open_w("/tmp/before"))
r["unlink"] = attempt(lambda: os.unlink("/tmp/before"))
r["mkdir"] = attempt(lambda: os.mkdir("/tmp/x"))
r["truncate"] = attempt(lambda: os.truncate("/tmp/before", 0))
r["rename_out"] = attempt(lambda: os.rename("/tmp/before", "/tmp/dir/before"))
r["inside"] = attempt(lambda: write("/tmp/dir/f"))
r["proc_self_mem"] = attempt(lambda: open_w("/proc/self/mem"))
""")
    assert r["pre"] == "ok" and r["inside"] == "ok", r
    for k in ("create", "overwrite", "unlink", "mkdir", "rename_out"):
        assert r[k] == "EACCES", (k, r)
    if ABI >= 3:
        assert r["truncate"] == "EACCES", r
    assert r["proc_self_mem"] in ("EACCES", "EROFS"), r


@pytest.mark.skipif(ABI < 6, reason="scoping needs Landlock ABI 6 (Linux 6.12)")
def test_abstract_unix_sockets_scoped():
    # Seccomp kills connect() outright in every domain without a network (and the
    # network namespace is private): without the filter, scoping alone must stand
    # between a worker and abstract sockets it did not create.
    r = sandboxed("research", seccomp=False, body=r"""
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0landlock-test"); srv.listen(4)   # created outside the Landlock domain
def connect():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect("\0landlock-test")
r["pre"] = attempt(connect)
landlock.restrict()
r["post"] = attempt(connect)
r["kill_init"] = attempt(lambda: os.kill(1, 0))
own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
own.bind("\0landlock-own"); own.listen(1)
def connect_own():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect("\0landlock-own")
r["own"] = attempt(connect_own)
""")
    assert r["pre"] == "ok" and r["own"] == "ok", r
    assert r["post"] == "EPERM" and r["kill_init"] == "EPERM", r


def test_resolve_unix_is_handled_from_abi_9_and_granted_nowhere():
    """Pathname unix sockets (LANDLOCK_ACCESS_FS_RESOLVE_UNIX, ABI 9, Linux 7.1): handled
    where the kernel has it, so only sockets created inside the sandbox's own Landlock
    domain can be reached; never part of what write_dirs grant (a writable bind may hold
    a host service's socket). Below ABI 9 the ruleset must not mention it (EINVAL)."""
    assert not landlock.handled_rights(8) & landlock.ACCESS_FS_RESOLVE_UNIX
    assert landlock.handled_rights(9) & landlock.ACCESS_FS_RESOLVE_UNIX
    for abi in (1, 7, 9, 10):
        assert not landlock.write_rights(abi) & landlock.ACCESS_FS_RESOLVE_UNIX


@pytest.mark.skipif(ABI < 9, reason=f"pathname unix sockets need Landlock ABI 9 (Linux 7.1); "
                                     f"this kernel has ABI {ABI}")
def test_pathname_unix_sockets_scoped(tmp_path):
    """A host socket in a directory bound read-write into the sandbox: unreachable after
    restrict() (EACCES) even beneath a write_dir; a socket the sandbox made: reachable.
    Seccomp off, so that Landlock alone answers (seccomp would kill at connect)."""
    os.chmod(tmp_path, 0o777)
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind(str(tmp_path / "host.sock"))
    os.chmod(tmp_path / "host.sock", 0o777)
    host.listen(4)
    try:
        policy = dataclasses.replace(policy_for_domain("research", extra_rw_binds=[str(tmp_path)]),
                                     seccomp_at_launch=False)
        body = f"""
def connect(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(path)
r["pre"] = attempt(lambda: connect("{tmp_path}/host.sock"))
landlock.restrict(("/tmp", "{tmp_path}"))
r["post"] = attempt(lambda: connect("{tmp_path}/host.sock"))
own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
own.bind("/tmp/own.sock"); own.listen(1)
r["own"] = attempt(lambda: connect("/tmp/own.sock"))
"""
        r = run(policy, [sys.executable, "-c", PRELUDE + body + "\nprint(json.dumps(r))"],
                timeout=30)
        assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out == {"pre": "ok", "post": "EACCES", "own": "ok"}, out
    finally:
        host.close()
