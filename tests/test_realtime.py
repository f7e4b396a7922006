"""Real-time control workers (``realtime_priority``): who may have it, what it costs the
unit, and the kernel side. The attacks on it (raise it, pass it on, run away with it,
research entering it) run from inside real sandboxes in tests/test_attacks.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from supervisor.config import ConfigFileError, loads
from supervisor.sandbox.sched import Realtime, RealtimeUnavailable, make_fifo, policy_of

BASE = """
[domains.control]
[domains.research]
[workers.cam]
domain = "control"
module = "workers.camerad"
{cam}
[workers.lab]
domain = "research"
module = "workers.research"
{lab}
"""


def _problems(cam: str = "", lab: str = "", template: str = BASE, **more: str) -> list[str]:
    try:
        loads(template.format(cam=cam, lab=lab, **more), "rt.toml")
    except ConfigFileError as e:
        return [str(p) for p in e.problems]
    return []


def test_only_control_workers_may_run_realtime():
    assert _problems(cam="realtime_priority = 53") == []
    (p,) = _problems(lab="realtime_priority = 1")
    assert "workers.lab.realtime_priority" in p and "research worker may not run real-time" in p


def test_realtime_settings_that_cannot_work_are_refused_in_one_line():
    (p,) = _problems(cam="realtime_budget_pct = 20")
    assert "workers.cam.realtime_budget_pct: has no effect without realtime_priority" in p
    (p,) = _problems(cam="realtime_priority = 99")       # the kernel's own class
    assert "workers.cam.realtime_priority" in p
    (p,) = _problems(cam="realtime_priority = 50\nrealtime_budget_pct = 85")
    assert "real-time budgets add up to 85 %" in p


PIPE = """
[domains.control]
[channels.frames]
slot_size = "64KiB"
[workers.cam]
domain = "control"
module = "workers.camerad"
publishes = {{ frames = "frames" }}
{cam}
[workers.model]
domain = "control"
module = "workers.modeld"
subscribes = {{ frames = "frames" }}
busy_poll_us = 1000
{model}
"""


@pytest.mark.parametrize("cam,model,refused", [
    ("realtime_priority = 52", "realtime_priority = 51", False),
    ("realtime_priority = 51", "realtime_priority = 53", True),    # spins above its writer
    ("realtime_priority = 51", "realtime_priority = 51", True),    # level: no better
    ("", "realtime_priority = 51", True),                           # writer in normal class
    ("", "", False),                                                # nobody real-time
])
def test_a_busy_polling_realtime_reader_ranks_below_its_writer(cam, model, refused):
    """Measured: controlsd at FIFO 53 spinning for modeld's output at 51 on 2 CPUs took
    the CPU modeld needed to publish (14 windows of 108 hit). Refused in one line."""
    problems = _problems(cam, template=PIPE, model=model)
    if not refused:
        assert problems == []
        return
    (p,) = problems
    assert "workers.model.busy_poll_us" in p and "its writer 'cam'" in p
    assert "rank the reader below its writers" in p


def test_realtime_record():
    assert Realtime(53, 10).runtime_us == 10_000
    for bad in ((0, 10), (99, 10), (50, 0), (50, 91), (50.5, 10)):
        with pytest.raises(ValueError):
            Realtime(*bad)


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs CAP_SYS_NICE")
def test_make_fifo_sets_the_main_thread_only_and_not_inherited():
    """The grant is SCHED_FIFO with SCHED_RESET_ON_FORK for the one thread named: a
    thread or child the process starts later runs in the normal class."""
    child = subprocess.Popen([sys.executable, "-c", textwrap_child], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        make_fifo(child.pid, 10, lambda: True)
        assert policy_of(child.pid) == ("fifo", 10, True)
        out, _ = child.communicate("go\n", timeout=30)
        assert out.split() == ["fifo", "other", "other"], out
    finally:
        child.kill()


textwrap_child = """
import os, sys, threading
sys.stdin.readline()
me = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK
seen = []
t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(0 if os.sched_getscheduler(0) == os.SCHED_OTHER else 1)
_, st = os.waitpid(pid, 0)
name = {os.SCHED_FIFO: "fifo", os.SCHED_OTHER: "other"}
print(name.get(me), name.get(seen[0]), "other" if os.waitstatus_to_exitcode(st) == 0 else "rt")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs CAP_SYS_NICE")
def test_make_fifo_refuses_a_pid_that_is_no_longer_the_worker():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RealtimeUnavailable, match="no longer the worker"):
            make_fifo(child.pid, 10, lambda: False)
        assert policy_of(child.pid)[0] == "other"
    finally:
        child.kill()
        child.wait()
    with pytest.raises(RealtimeUnavailable, match="gone"):
        make_fifo(child.pid, 10, lambda: True)


RT_FLEET = """
[domains.control]
failure_policy = "restart"
actuates = true
[channels.x]
slot_size = "4KiB"
dtype = "uint8"
max_readers = 3
""" + "".join(f"""
[workers.{name}]
domain = "control"
module = "workers.probe"
{'publishes' if name == 'a' else 'subscribes'} = ["x"]
args = [{'"--publish", "x", "--period-ms", "20"' if name == 'a' else '"--read", "x"'}]
realtime_priority = {40 + i}
realtime_budget_pct = 10
""" for i, name in enumerate(("a", "b", "c")))


@pytest.mark.sandbox
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None,
                    reason="needs root and bubblewrap")
def test_without_per_cgroup_budgets_one_cpu_stays_outside_the_realtime_class(monkeypatch):
    """Where nothing bounds a runaway but the kernel's global 95 % (cgroup v2, or no RT
    groups), real-time workers never hold every CPU: on N CPUs at most N - 1 are granted,
    the others run on in the normal class with an event saying why (review)."""
    import io

    import trio

    from supervisor.events import EventLog
    from supervisor.lifecycle import Supervisor
    from supervisor.sandbox.cgroups import CgroupTree

    from supervisor.sandbox import sched

    # This kernel has RT groups (v1), where a cgroup without RT runtime refuses
    # SCHED_FIFO: the machine without them is stood in for, the kernel call recorded.
    monkeypatch.setattr(CgroupTree, "reserve_rt", lambda self, *a: False)   # as on v2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})        # two CPUs
    monkeypatch.setattr(sched, "make_fifo", lambda pid, prio, still_ours: None)
    out = io.StringIO()

    async def main() -> None:
        sup = Supervisor(loads(RT_FLEET, "rt.toml"), log=EventLog(stream=out))
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            with trio.fail_after(30):
                while out.getvalue().count('"realtime') < 3:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)
    ev = [json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")]
    granted = [e for e in ev if e["event"] == "realtime"]
    refused = [e for e in ev if e["event"] == "realtime_unavailable"]
    assert len(granted) == 1 and granted[0]["bound"].startswith("global"), granted
    assert len(refused) == 2 and all("one CPU always stays outside" in e["reason"]
                                     for e in refused), refused
