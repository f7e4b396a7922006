"""The `realtime` event under `run --privsep` says what the kernel bounds the worker by.

The broker holds the cgroup tree and grants each RT worker's leaf its budget, but the
supervisor proper, holding no tree, used to report "global sched_rt_runtime_us only"
for a worker the kernel held to 5 % of a CPU. The event is checked against the
worker's cpu cgroup as the kernel has it (/proc/PID/cgroup, cpu.rt_runtime_us).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from supervisor.sandbox.cgroups import rt_budget_of
from tests.test_privsep import PrivsepRun

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("--privsep starts the broker as root", allow_module_level=True)

TOML = """
[domains.control]
failure_policy = "fail_safe"
actuates = true
[channels.out]
slot_size = "4KiB"
[workers.rt]
domain = "control"
module = "workers.probe"
publishes = ["out"]
args = ["--publish", "out"]
realtime_priority = 10
realtime_budget_pct = 5
"""


def test_realtime_event_under_privsep_names_the_cgroup_budget(tmp_path: Path) -> None:
    r = PrivsepRun(tmp_path, TOML)
    try:
        (grant,) = r.wait_for("realtime", worker="rt", timeout=60)
        kernel = rt_budget_of(grant["pid"])
        assert [e for e in r.events if e["event"] == "privsep"], r.lines[:5]
        if kernel is None:
            pytest.skip(f"no RT group scheduling here: {grant['bound']}")
        assert kernel == (5_000, 100_000), kernel           # the broker's grant
        assert grant["bound"] == "5 % of a CPU per 100 ms (cgroup)", grant
    finally:
        r.stop()
