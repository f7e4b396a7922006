"""The supervisor's own signals (supervisor/signals.py) at the two ends of its life:
a stop that comes before any worker has started, and one that comes while the
process is already ending. Both must keep the exit code the operator (systemd, a
script) reads, and neither may start or leave anything."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[domains.control]
failure_policy = "restart"
[workers.cam]
domain = "control"
module = "workers.probe"
"""
# `supervisor run` as the CLI runs it, with systemd's SIGTERM already received when the
# supervisor's checks end (it came during them: admission takes seconds on the car).
EARLY_STOP = """
import os, signal, sys
import supervisor.cli                      # the CLI's signal handling, first of all
from supervisor.config import load
from supervisor.events import EventLog
from supervisor.lifecycle import Supervisor
import trio
os.kill(os.getpid(), signal.SIGTERM)       # recorded on the signal pipe, not obeyed yet
sup = Supervisor(load(sys.argv[1]), log=EventLog(fmt="json"), sandboxed=sys.argv[2] == "1")
code = trio.run(sup.run)
print("admission cut short:", sup._admission is None)   # not judged worker by worker
sys.exit(int(code))
"""


@pytest.mark.parametrize("sandboxed", [
    False,
    pytest.param(True, marks=[pytest.mark.sandbox, pytest.mark.skipif(
        shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bwrap and root")]),
])
def test_a_stop_before_the_first_start_starts_no_worker(tmp_path, sandboxed):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-c", EARLY_STOP, str(cfg), "1" if sandboxed else "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr                      # Exit.SHUTDOWN: an ordered stop
    assert "admission cut short: True" in p.stdout, p.stdout
    events = [json.loads(ln) for ln in p.stderr.splitlines() if ln.startswith("{")]
    kinds = [e["event"] for e in events]
    assert "start" not in kinds and "refused" not in kinds, kinds   # no camera opened
    assert [e["signal"] for e in events if e["event"] == "signal"] == ["SIGTERM"], kinds
    [end] = [e for e in events if e["event"] == "supervisor_exit"]
    assert end == events[-1] and (end["code"], end["reason"]) == (0, "shutdown"), end


# The CLI's process at its very end: the exit code is decided and Python is tearing
# down (past atexit it resets every handled signal to its default). A second SIGTERM
# there killed the process: CI saw the check above end -15 after it had printed its lines.
LATE_KILL = """
import builtins, os, signal, sys, time
import supervisor.cli                      # installs the CLI's signal handling
class LateKill:                            # freed in the interpreter's last teardown
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)                    # delivered by now
builtins.late_kill = LateKill()
sys.exit(5)
"""


def test_a_stop_signal_during_the_interpreters_teardown_keeps_the_exit_code():
    p = subprocess.run([sys.executable, "-c", LATE_KILL], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 5, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
