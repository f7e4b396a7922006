"""`supervisor check --start`: every sandbox started as `run` starts it, READY awaited,
stopped; whatever would make `run` fail fails here, with the cause per worker."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None or os.geteuid() != 0:
    pytest.skip("starting sandboxes needs bubblewrap and root", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[domains.control]
failure_policy = "restart"
[domains.research]
[channels.frames]
slot_size = "4KiB"
dtype = "uint8"
[workers.src]
domain = "control"
module = "workers.probe"
publishes = ["frames"]
args = ["--publish", "frames", "--period-ms", "50"]
[workers.sink]
domain = "research"
module = "workers.probe"
subscribes = ["frames"]
args = ["--read", "frames"]
"""
SILENT = """
[workers.silent]
domain = "control"
module = "workers.probe"
args = ["--ready-delay-ms", "60000"]
ready_timeout_ms = 1500
restart = "never"
"""


def _check_start(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "vehicle-state")}
    return subprocess.run([sys.executable, "-m", "supervisor.cli", "check", "--start",
                           "--config", str(cfg)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_config_that_runs_starts_every_worker_and_says_so(tmp_path):
    p = _check_start(tmp_path, CONFIG)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [x for x in p.stdout.splitlines() if "READY in" in x]
    assert {x.split()[3] for x in lines} == {"src", "sink"}, p.stdout
    assert "Traceback" not in p.stderr
    # a scratch state dir: nothing of the run reaches the vehicle's
    assert not (tmp_path / "vehicle-state").exists()


def test_a_worker_that_never_says_ready_fails_the_check_with_what_it_was_doing(tmp_path):
    p = _check_start(tmp_path, CONFIG + SILENT)
    assert p.returncode == 5, p.stdout + p.stderr           # Exit.START_FAILED, as run
    silent = [x for x in p.stderr.splitlines() if "--start: silent" in x]
    assert len(silent) == 1, p.stdout + p.stderr
    line = silent[0]
    assert "FAILED" in line and "not ready within" in line, line
    assert "no output in" in line and "last seen: pid" in line, line
    assert "Traceback" not in p.stderr
