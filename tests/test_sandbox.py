"""Attack tests for supervisor.sandbox: every attack is tried from INSIDE a
real bubblewrap sandbox by `python -m supervisor.sandbox.probe`.

No traffic leaves the machine: TCP/UDP targets are the host's 127.0.0.1
(listeners we own) and 10.0.0.1 only from a netns whose sole interface is lo.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
import warnings

import pytest

from supervisor.sandbox import (
    SeccompUnavailableError,
    build_bwrap_argv,
    compiler_masks,
    descendant_pids,
    lock_down,
    policy_for_domain,
    prepare,
    run,
    spawn,
)
from supervisor.sandbox.policy import PROJECT_ROOT


def _bwrap_usable() -> str | None:
    """None if bwrap + unprivileged-style user namespaces work, else why not."""
    bw = shutil.which("bwrap")
    if bw is None:
        return "bwrap not installed"
    try:
        r = subprocess.run(
            [bw, "--unshare-user", "--unshare-pid", "--unshare-net", "--die-with-parent",
             "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap failed to run: {e!r}"
    return None if r.returncode == 0 else f"bwrap --unshare-user unusable: {r.stderr.strip()}"


_why = _bwrap_usable()
if _why:
    pytest.skip(_why, allow_module_level=True)

pytestmark = pytest.mark.sandbox

PY = sys.executable
HOST_NETNS = os.readlink("/proc/self/ns/net")


def control(**kw):
    return dataclasses.replace(policy_for_domain("control"), **kw)


def research(**kw):
    return dataclasses.replace(policy_for_domain("research"), **kw)


def probe(policy, attack: str, *args: object, pass_fds=()) -> dict:
    r = run(policy, [PY, "-m", "supervisor.sandbox.probe", attack, *map(str, args)],
            pass_fds=pass_fds, timeout=30)
    assert r.returncode == 0, f"probe {attack} rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"probe {attack} printed no verdict\nstdout={r.stdout}\nstderr={r.stderr}"
    out = json.loads(lines[-1])
    assert out["denied"] is not None, out  # probe error
    return out


KILLED_BY_SECCOMP = 128 + signal.SIGSYS   # bwrap's report of a child killed by SIGSYS


def probe_killed(policy, attack: str, *args: object) -> None:
    """The attack must not return at all: the kernel kills the process (SIGSYS)."""
    r = run(policy, [PY, "-m", "supervisor.sandbox.probe", attack, *map(str, args)], timeout=30)
    assert r.returncode == KILLED_BY_SECCOMP, \
        f"probe {attack} rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    assert not [ln for ln in r.stdout.splitlines() if ln.startswith("{")], r.stdout


# --- policy / argv (no sandbox started) ------------------------------------

def test_policy_defaults():
    c = policy_for_domain("control")
    assert (c.network, c.hide_compilers, c.seccomp_after_start, c.hostname) == (False, True, True, "control")
    with pytest.raises(ValueError):
        policy_for_domain("control", network=True)
    r = policy_for_domain("research", network=True)
    assert r.network and not r.hide_compilers and not r.seccomp_after_start
    # unknown domains fail closed: control rules, no network
    o = policy_for_domain("logger")
    assert o.hide_compilers and o.seccomp_after_start and o.strict
    with pytest.raises(ValueError):
        policy_for_domain("logger", network=True)
    for p in (c, r, o):
        assert not any(k.startswith("LD_") for k in p.env)
        assert p.env["HOME"] == "/tmp" and p.env["PYTHONNOUSERSITE"] == "1"


def test_argv_shape():
    c = build_bwrap_argv(control(), ["/bin/true"], [], None)
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                 "--unshare-uts", "--die-with-parent", "--new-session", "--clearenv"):
        assert flag in c
    assert "--as-pid-1" not in c
    assert c[c.index("--hostname") + 1] == "control"
    assert c[-2:] == ["--", "/bin/true"]
    setenv_keys = [c[i + 1] for i, a in enumerate(c) if a == "--setenv"]
    assert not any(k.startswith("LD_") for k in setenv_keys)
    rn = build_bwrap_argv(research(network=True), ["/bin/true"], [], None)
    assert "--unshare-net" not in rn
    with pytest.raises(ValueError):
        build_bwrap_argv(control(), ["/bin/true"], [], None, env_extra={"LD_PRELOAD": "x.so"})
    with pytest.raises(ValueError):
        build_bwrap_argv(control(), ["/bin/true"], [1], None)  # stdio is not "passed"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on host")
def test_compiler_masks_cover_gcc_and_not_loader():
    files, dirs = compiler_masks(tuple(control().ro_binds))
    assert os.path.realpath(shutil.which("gcc")) in files
    assert not any(".so" in os.path.basename(f) for f in files)
    if os.path.isdir("/usr/lib/gcc"):
        assert "/usr/lib/gcc" in dirs


def test_missing_libseccomp_raises(monkeypatch):
    # Import fails before anything is loaded, so pytest itself stays unfiltered.
    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    with pytest.raises(SeccompUnavailableError):
        lock_down("control")
    with pytest.raises(SeccompUnavailableError):
        lock_down("research")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert lock_down("research", required=False) is False
    assert w
    with pytest.raises(SeccompUnavailableError):  # never launch control unfiltered
        prepare(control(), ["/bin/true"])


# --- attacks from inside a control sandbox ---------------------------------

def test_exec_compiler_denied():
    out = probe(control(), "exec_compiler")
    assert out["denied"], out


def test_read_unbound_paths_denied(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    root = PROJECT_ROOT
    paths = [str(secret), "/etc/shadow", os.path.expanduser("~/.bash_history"),
             os.path.expanduser("~/.bashrc"), "/var/log/syslog",
             # only the project's packages are bound, not the checkout
             f"{root}/.git/config", f"{root}/pyproject.toml", f"{root}/tests/test_sandbox.py"]
    out = probe(control(), "read_unbound_path", *paths)
    assert out["denied"], out


def test_write_ro_paths_denied():
    targets = [PROJECT_ROOT, f"{PROJECT_ROOT}/supervisor", "/usr", sys.prefix, "/etc", "/"]
    targets += [d for d in ("/usr/lib/gcc",) if os.path.isdir(d)]  # masked by an (ro) tmpfs
    out = probe(control(), "write_ro_path", *targets)
    assert out["denied"], out
    assert all("EROFS" in v for v in out["detail"].values()), out


def test_no_new_privs_caps_and_launch_seccomp():
    d = probe(control(), "no_new_privs")
    assert d["denied"] and d["detail"]["NoNewPrivs"] == "1", d
    assert d["detail"]["Seccomp"] == "2", d  # launch filter active before any worker code
    assert int(d["detail"]["CapEff"], 16) == 0 and int(d["detail"]["CapBnd"], 16) == 0
    # bwrap sets no_new_privs itself, even with no seccomp of ours
    d = probe(control(seccomp_at_launch=False), "no_new_privs")
    assert d["detail"]["NoNewPrivs"] == "1" and d["detail"]["Seccomp"] == "0", d


def test_privileged_ops_denied():
    out = probe(control(), "mknod_dev")
    assert out["denied"], out
    probe_killed(control(), "unshare_userns")


@pytest.mark.parametrize("launch_filter", [True, False], ids=["launch-filter", "lockdown-only"])
def test_exec_after_lockdown_kills(launch_filter):
    # exec works during start-up (the probe's baseline), then kills the process from
    # any thread once locked down: it never gets to print a verdict.
    probe_killed(control(seccomp_at_launch=launch_filter), "exec_after_lockdown", "control")


@pytest.mark.parametrize("attack", ["inet_socket_after_lockdown", "ptrace_after_lockdown"])
def test_dangerous_classes_kill_from_launch(attack):
    probe_killed(control(), attack, "control")


@pytest.mark.parametrize("attack", ["unix_socket_after_lockdown", "threads_after_lockdown"])
def test_lockdown_keeps_unix_sockets_and_threads(attack):
    out = probe(control(), attack, "control")
    assert out["denied"] is False, out


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_no_new_process_after_lockdown(how):
    # "Must not start processes after start-up": fork, and posix_spawn's
    # clone(CLONE_VM | CLONE_VFORK), fail with EPERM: no child exists (red team: a
    # forked child killed by seccomp died unseen, so a worker could probe its filter
    # call by call), and the worker goes on.
    out = probe(control(), "fork_after_lockdown", "control", how)
    assert out["denied"] is True and out["detail"][how] == "PermissionError:EPERM", out
    out = probe(research(), "fork_after_lockdown", "research", how)
    assert out["denied"] is False and out["detail"][how] == 7, out


def test_lockdown_idempotent_in_sandbox():
    code = ("from supervisor.sandbox.seccomp import lock_down, installed_domains;"
            "print(lock_down('control'), lock_down('control'), sorted(installed_domains()))")
    r = run(control(), [PY, "-c", code], timeout=30)
    assert r.stdout.split() == ["True", "False", "['control']"], (r.stdout, r.stderr)


# --- network: netns and seccomp each on their own --------------------------

NET_POLICIES = {
    "control": lambda: control(),
    "control-no-seccomp": lambda: control(seccomp_at_launch=False),
    "research-default": lambda: research(),
    "research-no-seccomp": lambda: research(seccomp_at_launch=False),
}
# `network = false` kills at the call in every profile (seccomp._deny_outside).
NET_KILLED = ("control", "research-default")


@pytest.fixture
def tcp_listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    yield s
    s.close()


def _net_probe(name: str, attack: str, *args: object) -> dict | None:
    """Seccomp kills the attempt (None); without it, the netns denies it."""
    if name in NET_KILLED:
        probe_killed(NET_POLICIES[name](), attack, *args)
        return None
    out = probe(NET_POLICIES[name](), attack, *args)
    assert out["denied"], out
    return out


@pytest.mark.parametrize("name", NET_POLICIES)
def test_tcp_connect_denied(name, tcp_listener):
    out = _net_probe(name, "tcp_connect", tcp_listener.getsockname()[1])
    assert out is None or out["detail"]["interfaces"] == ["lo"], out
    with pytest.raises(BlockingIOError):
        tcp_listener.accept()  # nothing reached the host


@pytest.mark.parametrize("name", NET_POLICIES)
def test_udp_send_denied(name):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.bind(("127.0.0.1", 0))
        u.setblocking(False)
        _net_probe(name, "udp_send", u.getsockname()[1], HOST_NETNS)
        assert not select.select([u], [], [], 0.2)[0], "datagram reached the host"


@pytest.mark.parametrize("name", NET_POLICIES)
def test_abstract_unix_socket_unreachable(name):
    addr = f"sandbox-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind("\0" + addr)
        s.listen(1)
        _net_probe(name, "abstract_unix_connect", addr)


# --- research domain --------------------------------------------------------

def test_research_can_exec_and_is_not_locked():
    out = probe(research(), "exec_after_lockdown", "research")
    assert out["denied"] is False, out
    r = run(research(), [PY, "-c", "import subprocess; print(subprocess.run(['/bin/echo','hi'],capture_output=True,text=True).stdout)"], timeout=30)
    assert r.stdout.strip() == "hi", r


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on host")
def test_research_sees_compilers():
    # proves the control-domain denial comes from hide_compilers, not chance
    assert probe(research(), "exec_compiler")["denied"] is False


# --- isolation between sandboxes -------------------------------------------

def test_control_cannot_see_or_kill_research_sandbox():
    p = spawn(research(), [PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
              stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        pids = descendant_pids(p.pid)  # bwrap's init + the research worker (host pids)
        assert len(pids) >= 2, pids
        targets = [*pids, p.pid, os.getpid()]
        assert min(targets) > 10
        out = probe(control(), "kill_pid", *targets)
        assert out["denied"], out
        assert all("ProcessLookupError" in v for v in out["detail"].values()), out
        out = probe(control(), "see_pid", *targets)
        assert out["denied"], out
        assert p.poll() is None  # research worker unharmed
    finally:
        p.kill()
        p.wait()
    # killing the outer bwrap takes the whole sandbox down (--die-with-parent)
    deadline = time.monotonic() + 3
    while any(_alive(q) for q in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [q for q in pids if _alive(q)], "sandbox processes survived killing bwrap"


ORPHAN = r"""
import os, time
r, w = os.pipe()                    # close-on-exec: EOF once the orphan is "sleep"
if os.fork() == 0:                  # a double-forked orphan, reparented to bwrap's init
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "60"])
    os._exit(0)
os.close(w)
os.wait()
os.read(r, 1)
print("ready", flush=True)
time.sleep(60)
"""


def test_the_worker_is_found_by_its_sandbox_pid_not_host_order():
    """The supervisor's grant, READY snapshot, audit and SIGTERM go to the sandbox's
    pid 2 (sandbox_main_pid), never to whichever process comes first by host pid: a
    worker that wraps the host pid counter can leave an orphan listed before it (red
    team). Research may fork, so the orphan is real here."""
    from supervisor.sandbox.launch import sandbox_main_pid

    p = spawn(research(), [PY, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        pids = descendant_pids(p.pid)

        def cmd(q: int) -> bytes:
            with open(f"/proc/{q}/cmdline", "rb") as f:
                return f.read()
        orphan = [q for q in pids if cmd(q).startswith(b"sleep")]
        worker = [q for q in pids if cmd(q).startswith(PY.encode())]
        assert len(orphan) == 1 and len(worker) == 1, [(q, cmd(q)) for q in pids]
        others = [q for q in pids if q not in orphan]
        assert sandbox_main_pid([*orphan, *others]) == worker[0]
        assert sandbox_main_pid([*others, *orphan]) == worker[0]
        assert sandbox_main_pid(orphan) is None
    finally:
        p.kill()
        p.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- environment, hostname, fds --------------------------------------------

def test_env_is_minimal_and_hostname_is_domain():
    """Popen the bwrap argv with a dirty parent env: --clearenv must drop it."""
    pol = control()
    spec = prepare(pol, [PY, "-m", "supervisor.sandbox.probe", "info"], env_extra={"WORKER_NAME": "cam0"})
    dirty = {**os.environ, "FOO_SECRET": "s3cret", "LD_PRELOAD": "libm.so.6", "LD_LIBRARY_PATH": "/nonexistent"}
    try:
        r = subprocess.run(spec.argv, pass_fds=spec.pass_fds, env=dirty, capture_output=True, text=True,
                           timeout=30, preexec_fn=spec.child_setup())
    finally:
        spec.close()
    info = json.loads(r.stdout.splitlines()[-1])["detail"]
    env = info["env"]
    assert "FOO_SECRET" not in env and not any(k.startswith("LD_") for k in env), env
    assert env["WORKER_NAME"] == "cam0"
    assert set(env) <= set(pol.env) | {"WORKER_NAME", "PWD"}, env
    assert info["hostname"] == "control" and info["uid"] == 1000
    assert info["pid"] == 2  # bwrap's init is pid 1
    assert not {"home", "var", "opt", "srv", "mnt", "boot"} & set(info["root"]), info["root"]
    assert probe(research(), "info")["detail"]["hostname"] == "research"


def test_passed_fds_keep_their_numbers():
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    # Unusual numbers to prove they are preserved, taken with F_DUPFD (the lowest free
    # number from there): dup2 onto a fixed number would silently close whatever this
    # process holds there (pycapnp's schema directories once: kj aborted at exit).
    IN = fcntl.fcntl(r1, fcntl.F_DUPFD_CLOEXEC, 150)
    OUT = fcntl.fcntl(w2, fcntl.F_DUPFD_CLOEXEC, IN + 7)
    for fd in (r1, w2):
        os.close(fd)
    code = (f"import os; d=os.read({IN}, 100); os.write({OUT}, d.upper()); "
            f"print(sorted(int(x) for x in os.listdir('/proc/self/fd')))")
    p = spawn(control(), [PY, "-c", code], pass_fds=[IN, OUT], stdout=subprocess.PIPE, text=True)
    os.close(IN)
    os.close(OUT)
    os.write(w1, b"hello")
    os.close(w1)
    try:
        assert os.read(r2, 100) == b"HELLO"
        fds = json.loads(p.stdout.read().strip())
        assert IN in fds and OUT in fds
        assert not [fd for fd in fds if fd not in (0, 1, 2, 3, IN, OUT)], fds  # seccomp memfd closed
    finally:
        p.wait(10)
        os.close(r2)
    assert p.returncode == 0


def test_json_status_fd_reports_child_and_exit():
    r, w = os.pipe()
    p = spawn(control(), ["/bin/sh", "-c", "exit 3"], json_status_fd=w)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read().decode()
    assert p.wait(10) == 3
    docs = [json.loads(x) for x in data.replace("}{", "}\n{").splitlines() if x.strip()]
    assert any("child-pid" in d for d in docs) and {"exit-code": 3} in docs, data


def test_spawn_from_short_lived_thread_survives():
    """PR_SET_PDEATHSIG follows the forking *thread*; spawn() must not use the caller's."""
    box = {}

    def worker():
        box["p"] = spawn(control(), ["/bin/sleep", "30"])
        time.sleep(0.3)  # let bwrap arm --die-with-parent while we still live

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    time.sleep(0.5)
    p = box["p"]
    try:
        assert p.poll() is None, "sandbox died with the thread that spawned it"
    finally:
        p.kill()
        p.wait()


def test_startup_time(capsys):
    def once(argv_fn) -> float:
        t0 = time.perf_counter()
        p = argv_fn()
        line = p.stdout.readline()
        dt = time.perf_counter() - t0
        p.wait(10)
        assert line.strip() == "up"
        return dt

    cmd = [PY, "-c", "print('up', flush=True)"]
    boxed = [once(lambda: spawn(control(), cmd, stdout=subprocess.PIPE, text=True)) for _ in range(5)]
    bare = [once(lambda: subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)) for _ in range(3)]
    with capsys.disabled():
        print(f"\n[sandbox] control start-to-first-output: median {statistics.median(boxed)*1e3:.0f} ms "
              f"(min {min(boxed)*1e3:.0f}, max {max(boxed)*1e3:.0f}); bare python median "
              f"{statistics.median(bare)*1e3:.0f} ms")
    assert statistics.median(boxed) < 2.0


def test_ro_binds_under_tmp_leave_no_writable_parent():
    """A checkout (or venv) under /tmp: its packages are bound read-only into the private
    /tmp, and the directory holding them must not be a writable stand-in either."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        os.mkdir(os.path.join(root, "pkg"))
        pol = policy_for_domain("control", extra_ro_binds=[os.path.join(root, "pkg")])
        out = probe(pol, "write_ro_path", root, os.path.join(root, "pkg"))
        assert out["denied"], out
        assert all("EROFS" in v for v in out["detail"].values()), out


# --- library lookups without a process (supervisor/sandbox/ldcache.py) -----------

def test_library_lookups_answer_as_ldconfig_does():
    """Locked down, ctypes.util.find_library reads the linker's cache instead of running
    ldconfig: the same answer for every library name in the cache (and a miss)."""
    import ctypes.util

    from supervisor.sandbox import ldcache

    names = sorted({s[3:].split(".so")[0] for s in ldcache.sonames() if s.startswith("lib")})
    assert len(names) > 20, names
    wrong = [(n, ctypes.util.find_library(n), ldcache.find_library(n)) for n in names[::3]
             + ["no-such-library-here"]
             if ctypes.util.find_library(n) != ldcache.find_library(n)]
    assert not wrong, wrong


def test_a_locked_down_worker_imports_trio_and_finds_libraries():
    """trio's import asks find_library("pthread"), which runs ldconfig: locked down,
    that fork fails and the answer would be None. It comes from the cache instead."""
    code = ("from supervisor.sandbox.seccomp import lock_down; lock_down('control');"
            "import ctypes.util, trio; print(ctypes.util.find_library('pthread'))")
    r = run(control(), [PY, "-c", code], timeout=60)
    assert r.returncode == 0 and r.stdout.strip().startswith("libpthread.so"), \
        (r.returncode, r.stdout, r.stderr[-2000:])
