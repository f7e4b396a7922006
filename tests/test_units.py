"""The generated systemd unit passes systemd's own offline checks."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from supervisor.config import load
from supervisor.units import write_units

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze not installed")


def test_unit_verifies_and_is_hardened(tmp_path):
    (unit,) = write_units(load(), tmp_path, config_path=None)
    text = unit.read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text
    assert "RestartPreventExitStatus=2 3" in text          # config error, refusal
    assert "PrivateNetwork=yes" in text                     # no domain has a network
    v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True)
    assert v.returncode == 0, v.stderr
    s = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)],
                       capture_output=True, text=True)
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", s.stdout).group(1))
    assert score <= 4.0, s.stdout[-2000:]
