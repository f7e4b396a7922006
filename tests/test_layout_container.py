"""A container-shaped machine: what keeps every sandbox from starting there is said once,
with what to do (`python -m supervisor.startcheck --machine`, `machine_problems`).

Each layout is made for real and only for the child: Docker's default seccomp profile as
a seccomp filter on the child (namespaces and mounts refused with EPERM, as without
CAP_SYS_ADMIN), a read-only /run in a private mount namespace, root only inside a user
namespace (`unshare -U -r`). A container's memory limit (what `check --start` says of a
worker killed there) is read from a fake cgroup tree. About a second each."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="root and unshare (the staging namespace is root's)")

# Docker's default profile without CAP_SYS_ADMIN, the part that matters here: no new
# namespace, no mount. clone3 is ENOSYS there (glibc falls back to clone).
DOCKERISH = """
import errno, os, sys
import pyseccomp as sc
f = sc.SyscallFilter(defaction=sc.ALLOW)
for name in ("unshare", "setns", "mount", "umount2", "pivot_root", "open_tree",
             "move_mount", "fsopen", "fsmount", "fsconfig", "mount_setattr"):
    f.add_rule(sc.ERRNO(errno.EPERM), name)
f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 0x10000000, 0x10000000))
f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
f.load()
os.execv(sys.argv[1], sys.argv[1:])
"""
MACHINE = [sys.executable, "-m", "supervisor.startcheck", "--machine"]
ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")


@needs_root
def test_this_machine_lets_sandboxes_start():
    p = _run(MACHINE)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr


@needs_root
def test_a_container_without_cap_sys_admin_is_one_line_saying_what_to_do():
    """Under Docker's default seccomp profile `supervisor check` said, once per worker,
    'sandbox cannot start: OSError: staging mount namespace failed: unshare: unshare
    failed: Operation not permitted', and nothing about the container."""
    pytest.importorskip("pyseccomp")
    p = _run([sys.executable, "-c", DOCKERISH, *MACHINE])
    assert p.returncode == 5, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("machine: namespaces: this machine refuses a new mount namespace"), line
    assert "Operation not permitted" in line and "--privileged" in line, line


@needs_root
@pytest.mark.parametrize("premade", [False, True])
def test_a_read_only_run_is_one_line_and_a_premade_staging_point_is_enough(premade):
    """`docker run --read-only`: /run read-only. `check` said per worker 'OSError:
    [Errno 30] Read-only file system: '/run/trio-staging'' and `run` restarted camerad
    five times, then failed safe (exit 4). The line says to give /run a tmpfs or make the
    mount point in the image; with the point made, the machine is fine (the staging
    mounts its tmpfs there inside its own namespace)."""
    from supervisor.config import load
    from supervisor.sandbox.staging import BASE
    from supervisor.startcheck import staging_needed

    if not staging_needed(load(None)):
        pytest.skip("this install's sandboxes need no staging (interpreter reachable, "
                    "nothing hidden): a read-only /run does not matter here")
    make = f"mkdir {BASE} && " if premade else ""
    script = (f"mount --make-rprivate / && mount -t tmpfs -o size=1m tmpfs /run && {make}"
              f"mount -o remount,ro /run && exec \"$@\"")
    p = _run(["unshare", "-m", "sh", "-c", script, "sh", *MACHINE])
    if premade:
        assert (p.returncode, p.stderr) == (0, ""), p.stderr
        return
    assert p.returncode == 5, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line == (f"machine: staging: /run is read-only, so the sandboxes' staging mount "
                    f"point {BASE} cannot be made: give the machine a writable /run (docker "
                    f"run --tmpfs /run), or make the empty directory {BASE} in the image"), line


def _install_would_touch_the_machine() -> str:
    """Why install.sh (development, pip stubbed) would apt-get or useradd here, or ''."""
    import pwd
    import sysconfig

    for tool in ("bwrap", "unshare", "gcc", "ldconfig"):
        if shutil.which(tool) is None:
            return f"no {tool}: the install would apt-get it"
    if not os.path.exists("/usr/include/zlib.h") or not os.path.exists(
            os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "zlib's or Python's headers missing: the install would apt-get them"
    for user in ("trio-control", "trio-research"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            return f"no user {user}: the install would create it"
    return ""


@needs_root
@pytest.mark.skipif(bool(_install_would_touch_the_machine()),
                    reason=_install_would_touch_the_machine() or "runs")
def test_the_install_in_such_a_container_says_so_and_still_installs(tmp_path):
    """`bash scripts/install.sh` in a container without CAP_SYS_ADMIN ended 'installed:'
    with nothing about a machine on which no sandbox will start. It now ends with the
    machine's line, and still installs (a container's build may be more confined than its
    run). PYTHON is this interpreter behind a stand-in that skips pip and runs the
    machine check under the Docker-like filter."""
    pytest.importorskip("pyseccomp")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "dockerish.py").write_text(DOCKERISH)
    py = tmp_path / "python"
    py.write_text(f"""#!/bin/sh
case " $* " in
    *" pip "*) exit 0 ;;
    *" --machine"*) exec {sys.executable} {tmp_path}/dockerish.py {sys.executable} "$@" ;;
esac
exec {sys.executable} "$@"
""")
    py.chmod(0o755)
    p = subprocess.run(["bash", str(root / "scripts" / "install.sh")], capture_output=True,
                       text=True, timeout=120, cwd="/", env={**os.environ, "PYTHON": str(py)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("installed: "), p.stdout
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("machine: namespaces: this machine refuses"), p.stderr
    assert lines[1] == ("install.sh: installed, but on this machine as it is now no sandbox "
                        "starts (the line above)"), p.stderr


# --- A container with a memory limit (`docker run -m 700m`), made for real here in a v1
# memory cgroup: the car default's modeld was killed by the container's limit and
# `check --start` said 'out of memory: killed by the kernel at the cgroup limit
# memory_max=4294967296'. The tests below use a fake cgroup tree (a real one costs a 40 s
# run of the car's pipeline).

def _fake(tmp_path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    (tmp_path / "fs").mkdir(parents=True)
    (tmp_path / "cgroup").write_text(proc)
    for rel, text in files.items():
        f = tmp_path / "fs" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_the_enclosing_memory_limit_is_found_on_v1_and_v2(tmp_path):
    from supervisor.startcheck import enclosing_memory_limit

    v1 = _fake(tmp_path / "v1", "4:memory:/docker/abc\n1:cpu:/\n0::/\n",
               {"memory/docker/abc/memory.stat":
                "cache 0\nhierarchical_memory_limit 734003200\ntotal_rss 1\n"})
    assert enclosing_memory_limit(*v1) == (734003200, "/docker/abc")
    free = _fake(tmp_path / "v1free", "4:memory:/\n",
                 {"memory/memory.stat": "hierarchical_memory_limit 9223372036854771712\n"})
    assert enclosing_memory_limit(*free) is None
    # v2: the smallest memory.max on the way up (the service's own says max)
    v2 = _fake(tmp_path / "v2", "0::/system.slice/car.service\n",
               {"system.slice/car.service/memory.max": "max\n",
                "system.slice/memory.max": "1073741824\n"})
    assert enclosing_memory_limit(*v2) == (1 << 30, "/system.slice")
    assert enclosing_memory_limit(str(tmp_path / "none"), str(tmp_path)) is None


def test_a_kill_at_the_containers_limit_is_said_to_be_the_containers():
    from supervisor.config import load
    from supervisor.startcheck import memory_lines

    cfg = load(None)                               # the car: modeld's memory_max 4 GiB
    limit = (700 << 20, "/docker/abc")
    (line,) = memory_lines(cfg, ["modeld"], limit)
    assert line.startswith("memory: modeld was killed at 700 MiB, the memory limit of the "
                           "supervisor's own cgroup /docker/abc"), line
    assert "below its memory_max 4096 MiB" in line, line
    # a worker killed at its own memory_max (below the enclosing limit): nothing to add
    assert memory_lines(cfg, ["modeld"], (64 << 30, "/")) == []
    assert memory_lines(cfg, ["modeld"], None) == []


def test_the_machine_check_of_a_broken_config_is_its_problems_in_lines(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("x = [\n")
    p = _run([*MACHINE, "--config", str(bad)])
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines and all(x.startswith("machine: ") for x in lines), p.stderr
    assert "Traceback" not in p.stderr


@needs_root
def test_root_only_inside_a_user_namespace_is_one_line_not_a_traceback():
    """`unshare -U -r` (a rootless container without a subordinate id range: only uid 0
    mapped): `supervisor check` died with a 30-line traceback ending 'SubprocessError:
    Exception occurred in preexec_fn.' (the switch to trio-control), and `run` failed
    safe after 5 'start failed: Exception occurred in preexec_fn.'."""
    p = _run(["unshare", "-U", "-r", *MACHINE])
    if "unshare failed" in p.stderr:
        pytest.skip(f"no user namespace here: {p.stderr.strip()}")
    assert p.returncode == 5, p.stdout + p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("machine: users: this root is root only inside a user namespace "
                           "whose id map leaves out trio-control (uid "), line
    assert "/etc/subuid" in line, line


def test_a_full_id_map_leaves_nobody_out_and_root_alone_leaves_out_each_domain_user(tmp_path):
    import pwd

    from supervisor.config import load
    from supervisor.startcheck import unmapped_domain_users

    try:
        users = [pwd.getpwnam(n) for n in ("trio-control", "trio-research")]
    except KeyError:
        pytest.skip("no domain users here (scripts/install.sh makes them)")
    cfg = load(None)
    for name, text in (("full", "0 0 4294967295\n"), ("root", "0 1000 1\n")):
        (tmp_path / name).mkdir()
        for f in ("uid_map", "gid_map"):
            (tmp_path / name / f).write_text(text)
    assert unmapped_domain_users(cfg, str(tmp_path / "full")) == []
    assert unmapped_domain_users(cfg, str(tmp_path / "root")) == [
        f"{u.pw_name} (uid {u.pw_uid}, gid {u.pw_gid})" for u in users]


NO_TMP_PROBE = """
from supervisor.config import loads
from supervisor.startcheck import start_check
code, lines = start_check(loads('''
[domains.control]
failure_policy = "restart"
[workers.one]
domain = "control"
module = "workers.probe"
'''))
print(int(code))
print(*lines, sep="\\n")
"""


@needs_root
def test_check_start_without_a_usable_temporary_directory_is_one_line():
    """TMPDIR missing, /tmp and /var/tmp read-only, an unwritable cwd (/proc): a config
    without models passed `check` and `check --start` ended in a 20-line traceback from
    mkdtemp (its scratch state dir). Now one line naming the directories, exit 2, before
    any worker starts."""
    # Read-only, not replaced: a CI checkout or venv under /tmp stays reachable.
    script = ("mount --make-rprivate / && for d in /tmp /var/tmp; do mount --bind $d $d && "
              "mount -o remount,bind,ro $d; done && cd /proc && exec \"$@\"")
    p = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-c",
                        NO_TMP_PROBE], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TMPDIR": "/nonexistent"})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    code, *lines = [x for x in p.stdout.strip().splitlines() if not x.startswith("note: ")]
    assert code == "2", p.stdout
    assert lines == ["supervisor: no scratch state dir for the check (No usable temporary "
                     "directory found in ['/nonexistent', '/tmp', '/var/tmp', '/usr/tmp', "
                     "'/proc']): set TMPDIR to a writable directory"], p.stdout


@needs_root
def test_run_in_such_a_container_starts_nothing_and_latches_nothing(tmp_path):
    """`supervisor run` under Docker's default profile: camerad failed five times, the
    control domain failed safe and the latch it wrote outlived the container's fix
    (every later run exit 4 until clear-fail-safe). Now the supervisor's preflight says
    the machine's problem and exits 5 before any worker starts."""
    pytest.importorskip("pyseccomp")
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-c", DOCKERISH, sys.executable, "-m",
                        "supervisor.cli", "run", "--quiet", "--config",
                        str(ROOT / "supervisor" / "configs" / "minimal.toml")],
                       capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert p.returncode == 5, p.stderr[-3000:]
    events = [json.loads(ln) for ln in p.stderr.splitlines() if ln.startswith("{")]
    assert not [e for e in events if e["event"] in ("start", "fail_safe")], p.stderr[-3000:]
    (end,) = [e for e in events if e["event"] == "supervisor_exit"]
    assert "refuses a new mount namespace" in end["reason"] and "--privileged" in end["reason"]
    assert not (tmp_path / "state" / "failsafe.latch").exists()
