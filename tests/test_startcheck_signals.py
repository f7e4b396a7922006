"""`supervisor check --start` stopped the way systemd or an operator stops it (SIGTERM,
then a second one): the ordered stop runs, the check does not pass, and what the operator
sees is one line per worker plus who stopped it, never a traceback. (Seen: SIGTERM during
the start ended in a 40-line ExceptionGroup traceback from the stop.)"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None or os.geteuid() != 0:
    pytest.skip("starting sandboxes needs bubblewrap and root", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
# One worker that says READY late: the check is still waiting when the signal comes.
CONFIG = """
[domains.control]
failure_policy = "restart"
[workers.slow]
domain = "control"
module = "workers.probe"
args = ["--ready-delay-ms", "60000"]
ready_timeout_ms = 60000
restart = "never"
"""


# `check --start` past its static part (admission, the sandbox rehearsal: ~4 s here, and
# covered by test_check_start.py): the CLI's signal handling, then start_check itself.
DRIVER = """
import sys
import supervisor.cli                      # installs the CLI's SIGINT/SIGTERM handling
from supervisor.config import load
from supervisor.startcheck import start_check
cfg = load(sys.argv[1])
print("starting", flush=True)
code, lines = start_check(cfg)
print("\\n".join(lines), file=sys.stderr)
sys.exit(int(code))
"""


def test_sigterm_twice_stops_the_check_in_order_and_it_does_not_pass(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "vehicle-state")}
    p = subprocess.Popen([sys.executable, "-c", DRIVER, str(cfg)], cwd=ROOT, env=env,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == "starting\n"
        time.sleep(0.7)                    # the worker is started, in its ready delay
        p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert "Traceback" not in err, err
    assert p.returncode == 5, out + err                    # Exit.START_FAILED: not a pass
    # (a supervisor of another test on this machine adds a "note:" line: not ours)
    lines = [x for x in err.strip().splitlines() if not x.startswith("note: ")]
    assert lines[-1] == "supervisor: stopped by SIGTERM before the check ended", err
    assert len(lines) == 2 and lines[0].startswith("slow (control): "), err
    assert not (tmp_path / "vehicle-state").exists()


def test_another_supervisor_running_here_is_named():
    """`check --start` beside a live `supervisor run` (the car's unit) starts a second
    pipeline next to it: the check's lines name the other one."""
    from supervisor.startcheck import other_supervisors

    # a process whose command line is a supervisor's: `python ... -m supervisor.cli run`
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m",
                          "supervisor.cli", "run", "--quiet"])
    try:
        for _ in range(50):                # until its command line is readable
            found = dict(other_supervisors())
            if p.pid in found:
                break
            time.sleep(0.02)
        assert "supervisor.cli run --quiet" in found.get(p.pid, ""), found
        assert os.getpid() not in dict(other_supervisors(me=os.getpid()))
    finally:
        p.kill()
        p.wait()
    assert p.pid not in dict(other_supervisors())

