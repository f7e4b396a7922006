"""Machines that lack what the supervisor needs say so in one line with what to do:
a container with no cgroup file system, and an open-file limit below the config's need
(deploy-layouts.md: "cgroup v1: No such file or directory: <path>", and the car's
standby failing with "[Errno 24] Too many open files" and no word of the limit)."""
from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *, pre: str = "") -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", "-c", f"{pre}\nexec {sys.executable} -c \"$0\"", code],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs in a private mount namespace")
def test_no_cgroup_file_system_is_named_as_such():
    """An empty tmpfs over /sys/fs/cgroup (a container without one), made in a private
    mount namespace: the v1 hierarchies are still listed in mountinfo, not there."""
    code = ("from supervisor.sandbox.cgroups import CgroupTree, CgroupUnavailable\n"
            "try:\n    CgroupTree.create(partial=True).close()\n"
            "except CgroupUnavailable as e:\n    print(e)\n")
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c",
                        "mount -t tmpfs none /sys/fs/cgroup && exec \"$0\" -c \"$1\"",
                        sys.executable, code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ("no cgroup file system at /sys/fs/cgroup (a container without "
                                "one? mount it, or bind the host's, read-write)"), p.stdout


def test_an_open_file_limit_too_low_for_the_car_is_a_config_problem():
    """`ulimit -n 128` (soft and hard): check and run stop before anything starts, one line
    naming the limit and the fix; 256 holds the car (all 7 READY, deploy-layouts.md)."""
    code = ("from supervisor.config import check_runtime, load\n"
            "print([str(p) for p in check_runtime(load(None)) if ': workers: ' in str(p)])\n")
    low = _python(code, pre="ulimit -n 128")
    assert low.returncode == 0, low.stderr
    assert ("workers: 7 workers and 7 channels need about 178 open files; this process may "
            "open 128 (ulimit -n; hard limit 128): raise it (ulimit -n 1024, or LimitNOFILE= "
            "in the unit)") in low.stdout, low.stdout
    enough = _python(code, pre="ulimit -n 256")
    assert enough.stdout.strip() == "[]", enough.stdout


def test_the_cli_raises_a_low_soft_limit_to_the_hard_one():
    """A shell's soft limit under a higher hard one is a default, not a decision: the CLI
    raises it before it judges anything (here a missing config: exit 2 after the raise)."""
    code = ("import resource, sys\n"
            "from supervisor.cli import main\n"
            "rc = main(['check', '--config', '/nonexistent/car.toml'])\n"
            "print(rc, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    p = _python(code, pre="ulimit -Sn 128; ulimit -Hn 4096")
    assert p.stdout.split() == ["2", "4096"], (p.stdout, p.stderr)


def test_a_start_that_runs_out_of_files_names_the_limit():
    from supervisor.fdlimit import hint

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    said = hint(OSError(errno.EMFILE, "Too many open files"))
    assert said == (f" (this process's open-file limit is {soft}: raise ulimit -n, or "
                    f"LimitNOFILE= in the unit)")
    assert hint(OSError(errno.ENOENT, "No such file")) == ""
