"""The supervisor and its scripts started the way other machines start them: behind a
launcher (`sudo`, `timeout`), whose own command line is the supervisor's; from a current
directory that was removed; a script with `sh`. Seconds, no sandbox."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A stand-in named `supervisor` (what `sudo supervisor check --start` execs): it says which
# supervisors `check --start` would name beside itself, and who its parent is.
PROBE = f"""#!{sys.executable}
import os
from supervisor.startcheck import other_supervisors
print(repr((os.getppid(), other_supervisors())))
"""


@pytest.mark.skipif(shutil.which("timeout") is None, reason="no timeout(1) here")
def test_check_start_behind_a_launcher_does_not_name_its_own_launcher(tmp_path):
    """`timeout 300 supervisor check --start` (and `sudo supervisor check --start`, the
    README's command as a non-root operator) printed 'note: another supervisor runs here
    (pid 4555: timeout 300 /tmp/lay/venv/bin/supervisor check --start); this check ran a
    second pipeline beside it': the launcher, the check's own parent, was taken for a
    second supervisor. The check's ancestors are itself."""
    exe = tmp_path / "bin" / "supervisor"
    exe.parent.mkdir()
    exe.write_text(PROBE)
    exe.chmod(0o755)
    # ... beside a real other one, a sibling, which is still named
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m",
                              "supervisor.cli", "run", "--quiet"])
    try:                      # (Popen returns once the exec is done: its argv is set)
        p = subprocess.run(["timeout", "60", str(exe), "check", "--start"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        other.kill()
        other.wait()
    assert p.returncode == 0, p.stdout + p.stderr
    parent, found = ast.literal_eval(p.stdout.strip())
    launcher = [cmd for pid, cmd in found if pid == parent]
    assert launcher == [], f"the check's own launcher named as another supervisor: {launcher}"
    assert other.pid in dict(found), found
    assert os.getpid() not in dict(found)


def test_a_command_from_a_removed_directory_is_one_line_not_an_abort(tmp_path):
    """An operator's shell left in a directory that was removed (the old install after
    `rm -r /opt/trio-supervisor` and a reinstall, a CI workspace cleaned under it): every
    `supervisor` command died at `import capnp` with SIGABRT (rc 134) and a C++ stack
    ('terminate called after throwing an instance of 'kj::ExceptionImpl' ... getcwd(): No
    such file or directory'), even `supervisor check --config ABSOLUTE/bad.toml`."""
    gone = tmp_path / "gone"
    gone.mkdir()
    bad = tmp_path / "bad.toml"
    bad.write_text("x = [\n")
    p = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -m supervisor.cli '
                        'check --config "$3"', "sh", str(gone), sys.executable, str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert "terminate called" not in p.stderr and p.returncode != -6 and p.returncode != 134, \
        p.stderr[-600:]
    assert p.returncode == 2 and "not valid TOML" in p.stderr, p.stderr[-600:]


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("sh") is None or shutil.which("bash") is None,
                    reason="needs sh and bash")
def test_the_scripts_started_with_sh_run_under_bash(tmp_path):
    """`sh scripts/install.sh` (dash on Debian: the README says bash, people type sh)
    stopped with 'scripts/install.sh: 14: set: Illegal option -o pipefail'; `sh
    scripts/gpu_suite.sh` said 'Bad substitution' and went on with its steps. Both now
    run themselves again under bash (here: their own answers to a bad option and to a
    spent budget, which touch nothing)."""
    p = subprocess.run(["sh", str(ROOT / "scripts" / "install.sh"), "--bogus"],
                       capture_output=True, text=True, timeout=30, cwd="/")
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip() == "install.sh: unknown option --bogus (use --dev or --system)", \
        p.stderr
    p = subprocess.run(["sh", str(ROOT / "scripts" / "gpu_suite.sh")], capture_output=True,
                       text=True, timeout=60, cwd="/",
                       env={**os.environ, "OUT": str(tmp_path / "out"), "TOTAL_S": "0"})
    assert "Bad substitution" not in p.stderr and "skipped, budget spent" in p.stdout, \
        p.stdout + p.stderr
