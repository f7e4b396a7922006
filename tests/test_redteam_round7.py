"""Red team, round 7: attacks no issue and no earlier round named (docs/redteam7.md).

Each test asserts the claim the way it should hold. An attack that succeeds today is an
``xfail(strict=True)`` whose reason starts with "round 7 row N" and says where the fix
belongs. Every attacker runs with the privileges it would have: an unprivileged local
user (``nobody``, through runuser) against real files, a real control sandbox importing
what that user wrote, the real state-dir lock the CLI takes. ``--runxfail`` shows the
evidence of each break.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


def _need_root(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the attacker is another local user: needs root to become one")
    for t in ("runuser", *tools):
        if shutil.which(t) is None:
            pytest.skip(f"needs {t}")


def _as_nobody(script: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30, **kw)


@pytest.fixture
def public_dir():
    """A directory outside any 0700 parent (pytest's tmp_path is below /tmp/pytest-of-root,
    mode 0700, which no other user crosses): what /srv/... or /opt/... is on a car."""
    d = Path(tempfile.mkdtemp(prefix="rt7-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ row 1
# domains.X.python_path: code the control domain imports at every start, bound read-only
# into its sandbox. Read-only inside; outside, whoever can write the directory chooses
# what control runs. check only asks that it exists (and overlaps no writable bind).

_PP_CONFIG = """
[domains.control]
actuates = true
python_path = ["{lib}"]
[channels.x]
slot_size = "4KiB"
[workers.w]
domain = "control"
publishes = ["x"]
module = "rt7pkg"
"""


def test_a_control_python_path_is_writable_by_no_one_but_root(public_dir):
    _need_root("bwrap")
    from supervisor.config import check_runtime, load
    from supervisor.sandbox import launch
    from supervisor.sandbox.policy import for_worker

    lib = public_dir / "lib"
    lib.mkdir()
    os.chown(lib, NOBODY, -1)              # a developer's directory, or a team's share
    # The local user (not in any sandbox, never in the config) writes the package.
    w = _as_nobody(f"mkdir {lib}/rt7pkg && printf '%s\\n' 'OWNED = \"by uid %d\" % "
                   f"__import__(\"os\").stat(__file__).st_uid' 'def main(ctx):' "
                   f"'    return 0' > {lib}/rt7pkg/__init__.py")
    assert w.returncode == 0, w.stderr
    path = public_dir / "cars.toml"
    path.write_text(_PP_CONFIG.format(lib=lib))
    cfg = load(path)
    # The control sandbox imports nobody's code.
    p = launch.spawn(for_worker(cfg, cfg.workers["w"]),
                     [sys.executable, "-c", "import rt7pkg; print(rt7pkg.OWNED)"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.decode().strip() == f"by uid {NOBODY}"
    problems = {q.key: q.reason for q in check_runtime(cfg)}
    assert "domains.control.python_path[0]" in problems, (
        f"check admits it; problems: {problems}; the control sandbox printed {out!r}")


# ------------------------------------------------------------------ row 2
# statelock: supervisor.lock is created 0644 ("the pid inside is for anyone to read"), and
# flock() needs only an fd that is open, read-only included.

def _flocked(ino: int) -> bool:
    with open("/proc/locks") as f:
        return any(f":{ino} " in line for line in f)


def test_an_unprivileged_user_never_holds_the_state_dir_lock(public_dir):
    _need_root("flock")
    from supervisor import statelock
    from supervisor.config._runtime import _state_dir_problem

    state = public_dir / "state"
    state.mkdir(mode=0o755)
    assert _state_dir_problem(str(state)) is None      # check/run accept it
    last = statelock.acquire(state)                    # an earlier run: writes its pid
    last.release()
    lock = state / statelock.LOCK_NAME
    ino = lock.stat().st_ino
    attacker = subprocess.Popen(["runuser", "-u", "nobody", "--", "flock", "-x", "-n",
                                 str(lock), "sleep", "30"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while attacker.poll() is None and not _flocked(ino) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            got = statelock.acquire(state)             # what `supervisor run` does first
        except statelock.Held as e:
            pytest.fail(f"uid {NOBODY} holds it; the car's run would say: {e}")
        got.release()
    finally:
        if attacker.poll() is None:
            os.killpg(attacker.pid, signal.SIGKILL)    # flock's sleep holds the fd too
        attacker.wait(10)


# ------------------------------------------------------------------ row 3
# install.sh --system stages the checkout with tar (symbolic links kept as links) and
# root's pip builds the stage: setuptools' build_py follows a link and copies the file it
# names into the car's venv. Whoever could leave a file in a checkout (a shared build
# machine's clone, an untracked leftover) chooses what root reads and installs.

def test_the_vehicle_install_never_hands_pip_a_symbolic_link(tmp_path):
    _need_root()
    from tests.test_install_layouts import _system_install_would_touch_the_machine

    why = _system_install_would_touch_the_machine()
    if why:
        pytest.skip(why)
    co = tmp_path / "checkout"
    for f in ("pyproject.toml", "setup.py", "README.md", "scripts/install.sh"):
        (co / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, co / f)
    for pkg in ("supervisor/configs", "schemas", "workers", "models"):
        (co / pkg).mkdir(parents=True)
    (co / "supervisor" / "__init__.py").write_text("")
    # package-data `configs/*.toml`: what the wheel carries as a file
    (co / "supervisor" / "configs" / "zz-rt7.toml").symlink_to("/etc/shadow")
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    stub = prefix / "bin" / "python3"
    stub.write_text(f"""#!/bin/sh
[ "$1 $2 $3" = "-m pip install" ] || exit 4
for a; do src=$a; done
(cd "${{src%\\[*\\]}}" && find . -type l -printf '%p -> %l\\n') > {tmp_path}/links
exit 3
""")
    stub.chmod(0o755)
    p = subprocess.run(["sh", "-c", 'cd "$0" && bash scripts/install.sh --system; '
                        'echo "install exit $?"', str(co)],
                       capture_output=True, text=True, timeout=60, cwd="/",
                       env={**os.environ, "TRIO_PREFIX": str(prefix),
                            "TRIO_UNIT_DIR": str(tmp_path / "units")})
    assert "install exit" in p.stdout, p.stdout + p.stderr
    links = (tmp_path / "links").read_text() if (tmp_path / "links").exists() else ""
    assert links == "", f"root's pip was given: {links.strip()}"
    assert not (tmp_path / "units").exists()
    # Refused before pip, in one line naming the link.
    assert "install exit 2" in p.stdout, p.stdout + p.stderr
    assert "supervisor/configs/zz-rt7.toml is a symbolic link or a special file" in p.stderr


# ------------------------------------------------------------------ row 0
# A domain's read-only binds (extra_ro_binds, and the new python_path) are bound after the
# sandbox's own /proc and /dev: naming /proc or /dev there puts the host's in their place.
# load() refuses only "/"; check says "all admitted".

_VIEW_CONFIG = """
[domains.control]
actuates = true
[domains.research]
python_path = ["/proc"]
extra_ro_binds = ["/dev"]
[channels.x]
slot_size = "4KiB"
[workers.w]
domain = "control"
publishes = ["x"]
module = "workers.probe"
[workers.r]
domain = "research"
module = "workers.probe"
"""


def test_a_domains_read_only_binds_never_replace_the_sandbox_proc_and_dev(tmp_path):
    _need_root("bwrap")
    from supervisor.config import ConfigError, check_runtime, load
    from supervisor.sandbox import launch
    from supervisor.sandbox.policy import for_worker

    path = tmp_path / "cars.toml"
    path.write_text(_VIEW_CONFIG)
    try:
        cfg = load(path)
    except ConfigError:
        return                                         # refused before start: holds
    if any(p.key.startswith("domains.research.") for p in check_runtime(cfg)):
        return
    me = os.getpid()                                   # a host pid: not in its namespace
    p = launch.spawn(for_worker(cfg, cfg.workers["r"]),
                     ["/bin/sh", "-c", f"echo procs $(ls /proc | grep -c '^[0-9]'); "
                      f"test -e /proc/{me}/cmdline && echo sees-host-pid; "
                      "test -e /dev/kmsg && echo host-dev"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=60)
    assert p.returncode in (0, 1), err
    seen = out.decode().split("\n")
    assert "sees-host-pid" not in seen and "host-dev" not in seen, (
        f"admitted; the research sandbox: {out.decode().strip()!r}")
