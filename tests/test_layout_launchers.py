"""The supervisor started the way other machines start it: behind a launcher (`sudo`,
`timeout`, `nice`), whose own command line is the supervisor's. Seconds, no sandbox."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

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
    p = subprocess.run(["timeout", "60", str(exe), "check", "--start"], capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert p.returncode == 0, p.stdout + p.stderr
    parent, found = ast.literal_eval(p.stdout.strip())
    launcher = [cmd for pid, cmd in found if pid == parent]
    assert launcher == [], f"the check's own launcher named as another supervisor: {launcher}"
    # ... and a real other one is still named (a sibling, not an ancestor)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m",
                              "supervisor.cli", "run", "--quiet"])
    try:                      # (Popen returns once the exec is done: its argv is set)
        p = subprocess.run(["timeout", "60", str(exe), "check", "--start"],
                           capture_output=True, text=True, timeout=60, cwd="/")
        _, found = ast.literal_eval(p.stdout.strip())
        assert other.pid in dict(found), found
    finally:
        other.kill()
        other.wait()
    assert os.getpid() not in dict(found)
