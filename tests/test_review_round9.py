"""Review round 9: the second machine, as the units' owner installing there and the
person at the console meet it. Each layout is made for real and only for the command
under test: a private mount namespace (`unshare --mount --propagation private`) binds
over /usr/bin/bwrap, remounts the cgroup file systems or /tmp, hides an interpreter's
headers; user namespaces are refused by a seccomp filter on the command's own process
tree, with the kernel's own errno (ENOSPC as user.max_user_namespaces=0 gives, EPERM as
kernel.unprivileged_userns_clone=0 gives). No kernel knob is written; the one host
cgroup made (an RT-less cpu cgroup, as systemd makes a service's on cgroup v1) is
removed. A finding still broken is a strict xfail; docs/review9.md has the evidence,
root causes and fixes.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None
                          or shutil.which("bwrap") is None,
                          reason="root, unshare and bwrap, as the car's supervisor runs")
pytestmark = ROOT

# One control worker with a real-time class (controlsd's settings), its own state dir.
ONE_CONTROL = """
[supervisor]
state_dir = "{state}"
[domains.control]
user = "trio-control"
network = false
actuates = true
failure_policy = "fail_safe"
[channels.out]
kind = "tensor"
dtype = "float32"
slot_size = "4KiB"
[workers.one]
domain = "control"
module = "workers.probe"
publishes = {{ out = "out" }}
realtime_priority = 50
realtime_budget_pct = 10
"""

# A research worker whose code is its own (research's python_path is not vouched for):
# its last words before it dies are terminal control sequences.
PAINT_CONFIG = """
[supervisor]
state_dir = "{state}"
[domains.research]
user = "trio-research"
network = false
actuates = false
failure_policy = "restart"
python_path = ["{code}"]
[workers.paint]
domain = "research"
module = "paint"
"""
PAINT_CODE = '''"""Hostile research worker: paints the operator's terminal, then dies."""
import sys


def main(ctx):
    # window title, clipboard write (OSC 52), clear screen, a fake verdict, hide the rest
    sys.stderr.write("\\x1b]0;PWNED\\x07\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2J\\x1b[H"
                     "all 7 workers READY\\x1b[8m\\n")
    sys.stderr.flush()
    sys.exit(3)
'''

# Refuses user namespaces to the command and everything it starts, as the kernel does
# with user.max_user_namespaces=0 (ENOSPC) or kernel.unprivileged_userns_clone=0 (EPERM,
# `-e`); clone3 is ENOSYS so libc falls back to clone, whose flags a filter can read.
NOUSERNS_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int err = ENOSPC;
    if (argc > 2 && argv[1][0] == '-' && argv[1][1] == 'e') { err = EPERM; argv++; argc--; }
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_unshare, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NEWUSER, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (err & 0xffff)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp"); return 126;
    }
    execvp(argv[1], argv + 1);
    perror(argv[1]); return 127;
}
"""

CLI = [sys.executable, "-m", "supervisor.cli"]


def _env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.pop("TRIO_STATE_DIR", None)        # each config names its own state dir
    e.update(extra)
    return e


def _in_ns(setup: str, argv: list[str], *, timeout: float = 120,
           env: dict[str, str] | None = None, cwd: str = "/") -> subprocess.CompletedProcess:
    """`argv` in a private mount namespace after the shell lines `setup`."""
    script = f'{setup}\ncd {cwd}\nexec "$@"\n'
    return subprocess.run(["unshare", "--mount", "--propagation", "private",
                           "bash", "-euc", script, "ns", *argv],
                          capture_output=True, text=True, errors="replace",
                          timeout=timeout, env=env or _env())


def _check_start(argv: list[str], *, preexec=None, setup: str | None = None,
                 timeout: float = 150) -> subprocess.CompletedProcess:
    """`check --start` as the operator runs it; another suite's vehicle-mode supervisor
    on this shared machine refuses it (exit 2, review 7 finding 10): wait that out."""
    deadline = time.monotonic() + 90
    while True:
        if setup is None:
            r = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                               timeout=timeout, env=_env(), cwd="/", preexec_fn=preexec)
        else:
            r = _in_ns(setup, argv, timeout=timeout)
        if "refused: a vehicle supervisor runs" not in r.stderr:
            return r
        if time.monotonic() > deadline:
            pytest.skip("another suite's vehicle supervisor ran for 90 s: check --start refused")
        time.sleep(3)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rv9")
    os.chmod(d, 0o755)
    (d / "state").mkdir()
    (d / "one.toml").write_text(ONE_CONTROL.format(state=d / "state"))
    code = d / "code" / "paint"
    code.mkdir(parents=True)
    (code / "__init__.py").write_text(PAINT_CODE)
    for p in (d / "code", code, code / "__init__.py"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    (d / "paint.toml").write_text(PAINT_CONFIG.format(state=d / "state", code=d / "code"))
    return d


@pytest.fixture(scope="module")
def nouserns(work: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the user-namespace refusal")
    src, exe = work / "nouserns.c", work / "nouserns"
    src.write_text(NOUSERNS_C)
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
    probe = subprocess.run([str(exe), "unshare", "--user", "true"], capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "No space left" in probe.stderr, probe.stderr
    return exe


# ------------------------------------------------------------------ 1. user namespaces


def test_user_namespaces_off_is_one_machine_line_and_no_fail_safe(work, nouserns):
    """Debian's kernel.unprivileged_userns_clone=0 (EPERM) and any kernel's
    user.max_user_namespaces=0 (ENOSPC): every sandbox's bwrap runs as the domain user
    and needs one. The machine check, which install.sh ends with and `run` consults
    before starting anything, must say so once with the knob to set; `run` must stop
    there (exit 5) instead of restarting camerad six times and latching the fail-safe
    that then needs `clear-fail-safe` after the machine is fixed."""
    cfg = str(work / "one.toml")
    for flag in (["-e"], []):
        r = subprocess.run([str(nouserns), *flag, sys.executable, "-m", "supervisor.startcheck",
                            "--machine", "--config", cfg], capture_output=True, text=True,
                           timeout=60, env=_env(), cwd="/")
        assert r.returncode == 5, (flag, r.returncode, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if "namespace" in ln]
        assert len(lines) == 1 and re.search(r"max_user_namespaces|unprivileged_userns_clone",
                                             lines[0]), r.stderr
    state = work / "state-userns"
    state.mkdir(exist_ok=True)
    run = subprocess.run([str(nouserns), "-e", *CLI, "run", "--quiet", "--config", cfg],
                         capture_output=True, text=True, timeout=90,
                         env=_env(TRIO_STATE_DIR=str(state)), cwd="/")
    assert not (state / "failsafe.latch").exists(), run.stderr[-1500:]
    assert run.returncode == 5, (run.returncode, run.stderr[-1500:])


# ------------------------------------------------------------------ 2. bwrap missing


def test_check_without_bwrap_is_not_all_admitted(work):
    bwrap = os.path.realpath(shutil.which("bwrap"))
    r = _in_ns(f"mount --bind /dev/null {bwrap}", [*CLI, "check", "--config",
                                                    str(work / "one.toml")])
    assert "all admitted" not in r.stdout, r.stdout
    assert r.returncode == 5, (r.returncode, r.stdout[-500:], r.stderr[-800:])
    said = [ln for ln in r.stderr.splitlines() if "bwrap" in ln or "bubblewrap" in ln]
    # one line with what to do (the apt package, or the install that brings it)
    assert said and re.search(r"apt-get install bubblewrap|install\.sh", " ".join(said)), \
        r.stderr


# ------------------------------------------------------------------ 3. setuid bwrap


def test_a_setuid_bwrap_is_named_with_the_fix(work):
    """Older distributions (and admins on kernels without unprivileged user namespaces)
    install bwrap setuid root. Either the sandboxes work with it, or `check` says once
    that it is setuid and what to do."""
    bwrap = os.path.realpath(shutil.which("bwrap"))
    suid = work / "bwrap-setuid"
    shutil.copy2(bwrap, suid)
    os.chmod(suid, 0o4755)
    try:
        assert os.stat(suid).st_mode & stat.S_ISUID
        r = _in_ns(f"mount --bind {suid} {bwrap}", [*CLI, "check", "--config",
                                                     str(work / "one.toml")])
    finally:
        suid.unlink()                  # no setuid-root copy left behind in pytest's tmp
    if r.returncode == 0:
        assert "sandbox ok" in r.stdout
        return
    said = [ln for ln in r.stderr.splitlines() if "setuid" in ln]
    assert len(said) == 1 and re.search(r"chmod u-s|non-setuid|unprivileged", said[0]), \
        r.stderr


# ------------------------------------------------------------------ 4. the console


def test_check_start_never_writes_a_workers_control_characters(work):
    r = _check_start([*CLI, "check", "--start", "--config", str(work / "paint.toml")])
    assert r.returncode == 5, (r.returncode, r.stderr[-800:])
    assert "paint (research): FAILED" in r.stderr, r.stderr
    for text in (r.stdout, r.stderr):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), repr(text[-600:])


# ------------------------------------------------------------------ 10-11. other users


ESCAPES = "\x1b]0;PWNED\x07\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\x1b[Hno other supervisor\x1b[8m"


def _lookalike(env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """Any local user's process whose command line reads like `supervisor.cli run`
    (an unprivileged account, nothing installed: /usr/bin/python3 sleeping)."""
    if shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("setpriv and /usr/bin/python3 make another user's process")
    env = {"PATH": "/usr/bin:/bin", **(env_extra or {})}
    p = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                          "/usr/bin/python3", "-c", "import time; time.sleep(120)",
                          "supervisor.cli", "run", ESCAPES], env=env, cwd="/")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:           # setpriv has exec'd python3
        try:
            if b"supervisor.cli" in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                return p
        except OSError:
            pass
        time.sleep(0.05)
    p.kill()
    pytest.fail("the look-alike process did not start")


def test_check_start_never_prints_another_users_command_line_raw(work):
    """`nobody` runs a process whose argv holds 'supervisor.cli run' and escape
    sequences (TRIO_STATE_DIR set, so it is not taken for the vehicle's)."""
    p = _lookalike({"TRIO_STATE_DIR": "/nonexistent"})
    try:
        r = _check_start([*CLI, "check", "--start", "--config", str(work / "one.toml")])
    finally:
        p.kill()
        p.wait()
    # Named escaped, or not named at all (it is no supervisor): never written raw.
    for text in (r.stdout, r.stderr):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), repr(text[-600:])


def test_another_users_lookalike_does_not_block_check_start(work):
    """The vehicle supervisor is root's (or trio-supervisor's, split) and holds its state
    dir's lock; `nobody`'s sleeping python3 is neither."""
    p = _lookalike()
    try:
        deadline = time.monotonic() + 90
        while True:
            r = subprocess.run([*CLI, "check", "--start", "--config", str(work / "one.toml")],
                               capture_output=True, text=True, errors="replace", timeout=150,
                               env=_env(), cwd="/")
            m = re.search(r"refused: a vehicle supervisor runs \(pid ([\d, ]+)\)", r.stderr)
            if m is None or str(p.pid) in m.group(1).replace(",", " ").split():
                break
            if time.monotonic() > deadline:      # only another suite's vehicle run
                pytest.skip("another suite's vehicle supervisor ran for 90 s")
            time.sleep(3)
    finally:
        p.kill()
        p.wait()
    assert m is None, r.stderr[-800:]
    assert r.returncode == 0, (r.returncode, r.stderr[-800:])


# ------------------------------------------------------------------ 12. TERM=dumb


def test_the_live_row_on_a_dumb_terminal_has_no_escape(monkeypatch):
    """Emacs' shell, a serial console set to dumb, some CI runners' ptys: the row is
    redrawn with a carriage return and padding, never an escape sequence."""
    import pty
    import select

    from supervisor.monitor import Monitor

    monkeypatch.setenv("TERM", "dumb")
    master, slave = pty.openpty()
    try:
        out = open(slave, "w", buffering=1, closefd=False)
        mon = Monitor({}, {}, out=out)
        mon.print_line()
        mon.finish()
        got = b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and b"\n" not in got:
            if select.select([master], [], [], 0.2)[0]:
                got += os.read(master, 4096)
        assert b"drop" in got, got                 # the row was drawn
        assert b"\x1b" not in got, got
    finally:
        os.close(master)
        os.close(slave)


# ------------------------------------------------------------------ 5. realtime


@pytest.fixture
def rt_less_cpu_cgroup():
    """A cpu cgroup with no RT runtime, as systemd makes a service's on cgroup v1 with
    RT group scheduling (the car's kernel config here): SCHED_FIFO there is refused."""
    base = "/sys/fs/cgroup/cpu"
    if not os.path.exists(f"{base}/cpu.rt_runtime_us"):
        pytest.skip("no cgroup v1 cpu controller with RT group scheduling here")
    d = f"{base}/rv9-unit-{os.getpid()}.service"
    os.mkdir(d)
    try:
        assert Path(f"{d}/cpu.rt_runtime_us").read_text().strip() == "0"
        yield d
    finally:
        for sub, _dirs, _files in sorted(os.walk(d), key=lambda t: -t[0].count("/")):
            try:
                os.rmdir(sub)
            except OSError:
                pass


def test_check_start_says_when_a_worker_cannot_be_real_time(work, rt_less_cpu_cgroup):
    procs = f"{rt_less_cpu_cgroup}/cgroup.procs"

    def into_cgroup() -> None:
        with open(procs, "w") as f:
            f.write("0")

    r = _check_start([*CLI, "check", "--start", "--config", str(work / "one.toml")],
                     preexec=into_cgroup)
    assert r.returncode == 0, (r.returncode, r.stderr[-800:])
    out = r.stdout + r.stderr
    assert re.search(r"(?i)real-?time|SCHED_FIFO", out), out[-1500:]


# ------------------------------------------------------------------ 6. the units on v1


def _v1_mounts() -> dict[str, str]:
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for ln in f:
            pre, _, post = ln.partition(" - ")
            p = post.split()
            if len(p) >= 3 and p[0] == "cgroup":
                for c in p[2].split(","):
                    out.setdefault(c, pre.split()[4])
    return out


def test_the_unit_gives_back_its_own_cgroups_on_a_v1_machine(tmp_path):
    """ProtectControlGroups=yes makes /sys/fs/cgroup read-only; the unit gives back its
    own cgroup with ReadWritePaths=. On cgroup v1 (a hybrid or legacy systemd, this
    machine's layout) systemd puts the unit in system.slice/trio-supervisor.service of
    every hierarchy; the supervisor writes its tree below the memory, pids and cpu ones.
    (Evidence in docs/review9.md: the unit's view made by hand, every hierarchy
    read-only: `limits: cgroup v1 memory hierarchy ... is mounted read-only; ... pids
    ...; ... cpu ...`, every limit off, and controlsd refused SCHED_FIFO.)"""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("a cgroup v2 machine")
    mounts = _v1_mounts()
    if not all(c in mounts for c in ("memory", "pids", "cpu")):
        pytest.skip("not every v1 controller the supervisor uses is mounted here")
    r = subprocess.run([*CLI, "units", "--out", str(tmp_path), "--python", "/usr/bin/python3"],
                       capture_output=True, text=True, timeout=60, env=_env(), cwd="/")
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "trio-supervisor.service").read_text()
    given = [w.lstrip("-") for ln in text.splitlines() if ln.startswith("ReadWritePaths=")
             for w in ln.split("=", 1)[1].split()]
    for c in ("memory", "pids", "cpu"):
        want = f"{mounts[c]}/system.slice/trio-supervisor.service"
        assert any(want == g or want.startswith(g.rstrip("/") + "/") for g in given), \
            (c, want, given)


# ------------------------------------------------------------------ 7. limits line


def test_check_start_names_the_limits_it_cannot_enforce(work):
    """cgroup v1 without the cpu controller mounted: `check` says `limits not enforced:
    cpu_quota, cpu_weight (...); workers run without them`; `check --start`, the
    command the car's owner is told to run, only the cause."""
    r = _check_start([*CLI, "check", "--start", "--config", str(work / "one.toml")],
                     setup="umount /sys/fs/cgroup/cpu")
    assert r.returncode == 0, (r.returncode, r.stderr[-800:])
    line = next((ln for ln in r.stdout.splitlines() + r.stderr.splitlines()
                 if "cpu" in ln and "mounted" in ln), "")
    assert "cpu_quota" in line and "without" in line, r.stdout[-800:] + r.stderr[-800:]


# ------------------------------------------------------------------ 8-9. install.sh


def test_install_system_repairs_the_venv_a_failed_run_left():
    """A first `--system` run dies inside `python3 -m venv` (here: /tmp too small for
    ensurepip's copy of pip; equally a Ctrl-C): PREFIX/bin/python3 exists, pip does not.
    The second run, /tmp fixed, must make the venv whole (pip then fails fast here:
    no package index, so the test never installs anything)."""
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("the vehicle install's interpreter is /usr/bin/python3")
    setup = (
        "mount -t tmpfs tmpfs /srv\n"
        # apt-get never runs for real (nothing is missing here; elsewhere a stand-in)
        "mkdir /srv/stub && printf '#!/bin/sh\\nexit 0\\n' > /srv/stub/apt-get\n"
        "chmod 755 /srv/stub/apt-get && export PATH=/srv/stub:$PATH\n"
        "mount -t tmpfs -o size=1m tmpfs /tmp\n"
        "export TRIO_PREFIX=/srv/p TRIO_UNIT_DIR=/srv/u TMPDIR=/tmp\n"
        f"bash {REPO}/scripts/install.sh --system > /srv/run1.log 2>&1 && exit 99 || true\n"
        "umount /tmp\n"
        "export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1\n"
        f"bash {REPO}/scripts/install.sh --system > /srv/run2.log 2>&1 || true\n"
        "echo '--- run 1'; cat /srv/run1.log; echo '--- run 2'; cat /srv/run2.log\n"
        "/srv/p/bin/python3 -m pip --version >/dev/null 2>&1 && echo PIP-OK || echo PIP-MISSING\n"
    )
    r = _in_ns(setup, ["true"], timeout=240)
    assert r.returncode == 0, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    run2 = r.stdout.split("--- run 2", 1)[1]
    assert "No module named pip" not in run2, r.stdout[-1500:]
    assert "PIP-OK" in r.stdout, r.stdout[-1500:]


def test_install_system_can_use_a_named_python_when_the_systems_is_too_old():
    """Ubuntu 22.04 (Jetson's L4T 36 too) has Python 3.10 as /usr/bin/python3 and 3.11
    beside it (/usr/bin/python3.11, deadsnakes or universe). Made here by binding pyenv's
    real 3.10.13 over /usr/bin/python3; Debian's 3.11 stays at /usr/bin/python3.11. The
    owner names it (PYTHON=, as the development install takes it): the venv must be made
    from it (pip then fails fast: no package index, nothing installed)."""
    py310 = "/root/.pyenv/versions/3.10.13/bin/python3.10"
    if not (os.path.exists(py310) and os.path.exists("/usr/bin/python3.11")):
        pytest.skip("a real Python 3.10 and /usr/bin/python3.11 make the layout")
    setup = (
        "mount -t tmpfs tmpfs /srv\n"
        "mkdir /srv/stub && printf '#!/bin/sh\\nexit 0\\n' > /srv/stub/apt-get\n"
        "chmod 755 /srv/stub/apt-get && export PATH=/srv/stub:$PATH\n"
        # /usr/bin/python3 is a symlink to python3.11 on Debian, and a bind mount follows
        # it (it covered Debian's 3.11 too): the 3.10 goes in through an overlay of
        # /usr/bin whose python3 link is replaced.
        "mkdir /srv/up /srv/work\n"
        "mount -t overlay overlay -o lowerdir=/usr/bin,upperdir=/srv/up,workdir=/srv/work /usr/bin\n"
        f"rm /usr/bin/python3 && ln -s {py310} /usr/bin/python3\n"
        "/usr/bin/python3 -c 'import sys; assert sys.version_info[:2] == (3, 10)'\n"
        "/usr/bin/python3.11 -c 'import sys; assert sys.version_info[:2] == (3, 11)'\n"
        "export TRIO_PREFIX=/srv/p TRIO_UNIT_DIR=/srv/u PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1\n"
        f"PYTHON=/usr/bin/python3.11 bash {REPO}/scripts/install.sh --system || true\n"
        "/srv/p/bin/python3 -c 'import sys; print(\"VENV\", sys.version_info[:2])' || true\n"
    )
    r = _in_ns(setup, ["true"], timeout=180)
    assert "is not Python 3.11" not in r.stderr, r.stderr[-800:]
    assert "VENV (3, 11)" in r.stdout, (r.stdout[-800:], r.stderr[-800:])


def test_the_development_install_names_a_python_too_old(clone, tmp_path):
    """`python` is Python 2.7 on PATH (Ubuntu 20.04's python-is-python2, CentOS 7, a
    pyenv global), or the active venv is 3.9: one line naming the version and the range
    (pyproject's requires-python), exit 2, before apt and pip."""
    py27 = "/root/.pyenv/versions/2.7.18/bin/python2.7"
    py39 = "/root/.pyenv/versions/3.9.18/bin/python3.9"
    if not (os.path.exists(py27) and os.path.exists(py39)):
        pytest.skip("pyenv's 2.7 and 3.9 make the layouts")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(py27)
    (bindir / "apt-get").write_text('#!/bin/sh\necho "apt-get(stub) $*" >&2\nexit 0\n')
    os.chmod(bindir / "apt-get", 0o755)
    env = _env(PATH=f"{bindir}:/usr/bin:/bin")
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHON", None)

    def one_line(r: subprocess.CompletedProcess, version: str) -> None:
        assert r.returncode == 2, (version, r.returncode, r.stderr[-800:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and version in lines[0] and "3.11" in lines[0], \
            (version, r.stderr[-800:])

    one_line(subprocess.run(["bash", "scripts/install.sh"], cwd=clone, env=env,
                            capture_output=True, text=True, timeout=60), "2.7")
    setup = (
        "mount -t tmpfs tmpfs /srv\n"
        f"{py39} -m venv /srv/v39\n"
        f"export PATH={bindir}:$PATH PYTHON=/srv/v39/bin/python\n"
    )
    one_line(_in_ns(setup, ["bash", "scripts/install.sh"], timeout=180, cwd=str(clone)), "3.9")


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rv9clone") / "c"
    subprocess.run(["git", "clone", "-q", str(REPO), str(d)], check=True, timeout=120)
    return d


def test_install_names_the_headers_this_interpreter_lacks(clone, tmp_path):
    """A Python not from Debian's packages (pyenv here, /usr/local from source, a venv
    under /opt made from either) whose headers are missing: Debian's python3-dev holds
    /usr/include/python3.X, not this interpreter's include dir, so the install's advice
    ('apt-get install gcc python3-dev zlib1g-dev, then install again') loops for ever."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    include = sysconfig.get_paths()["include"]
    if include.startswith("/usr/include") or not os.path.exists(f"{include}/Python.h"):
        pytest.skip("this interpreter's headers are Debian's python3-dev (or absent)")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "apt-get").write_text('#!/bin/sh\necho "apt-get(stub) $*" >&2\nexit 0\n')
    os.chmod(stub / "apt-get", 0o755)
    setup = (
        "mount -t tmpfs tmpfs /srv\n"
        f"mkdir /srv/empty && mount --bind /srv/empty {include}\n"
        f"{base} -m venv --system-site-packages /srv/v\n"
        f"export PATH={stub}:$PATH PYTHON=/srv/v/bin/python\n"
    )
    r = _in_ns(setup, ["bash", "scripts/install.sh"], timeout=240, cwd=str(clone))
    assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
    assert "native module" in r.stderr, r.stderr[-1500:]
    assert include in r.stderr, r.stderr[-1500:]
