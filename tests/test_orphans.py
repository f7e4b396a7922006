"""No sandbox outlives its bwrap: SIGKILL of the outer bwrap (launch.spawn's Popen) at
random points in its first milliseconds, many times, and not one process of those
sandboxes may be left alive.

Why it could: bwrap's init arms --die-with-parent (PR_SET_PDEATHSIG) only after its
mounts, so a kill before that left it running the worker with PPID 1 (5-8 of 10 with
/tmp/h3/orphan_launch.py before the fix). No cgroup here (as on a machine with
limits_not_enforced): the subreaper sweep in `launch.SandboxPopen` is all that catches
it. Real bwrap, real kills; each round asserts the attack landed in the window at least
once, so a run that never hit it cannot pass for a fixed one.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

from supervisor.lifecycle._incarnation import PopenIncarnation
from supervisor.sandbox import launch
from supervisor.sandbox.policy import policy_for_domain
from tests.conftest import bwrap_unusable

_why = bwrap_unusable()
if _why:
    pytest.skip(_why, allow_module_level=True)

ROUNDS = 40


def _alive_with(marker: bytes) -> list[int]:
    """Live (not zombie) processes whose command line carries `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker not in f.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rpartition(b") ")[2].split()[0]
        except OSError:
            continue
        if state != b"Z":
            found.append(int(name))
    return found


def _spawn(marker: str) -> subprocess.Popen:
    pol = policy_for_domain("research", profile="research")
    return launch.spawn(pol, [sys.executable, "-c", f"import time; time.sleep(30)  # {marker}"],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, start_new_session=True)


def test_kill_of_bwrap_in_its_first_milliseconds_leaves_no_sandbox() -> None:
    marker = f"orphan-{uuid.uuid4().hex}"
    rng = random.Random(0x0F1)
    caught = 0
    try:
        for i in range(ROUNDS):
            p = _spawn(marker)
            delay = rng.choice([0.0, 0.0, rng.uniform(0, 0.004)])
            if delay:
                time.sleep(delay)
            if i % 2:
                # The lifecycle's way: Incarnation.kill, then the exit seen through wait.
                inc = PopenIncarnation(number=i, pid=p.pid, popen=p)
                inc.kill()
                inc.wait()
            else:
                p.kill()
                p.wait()
            caught += bool(p.orphans_killed)
        deadline = time.monotonic() + 5.0
        while _alive_with(marker.encode()) and time.monotonic() < deadline:
            launch.reap_orphans(timeout=0.2)
        left = _alive_with(marker.encode())
        assert left == [], f"{len(left)} sandbox processes outlived their bwrap: {left}"
        assert caught > 0, f"no kill of {ROUNDS} landed before bwrap's init armed PDEATHSIG"
    finally:
        for pid in _alive_with(marker.encode()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launch.reap_orphans(timeout=1.0)


def test_the_sweep_leaves_our_own_children_alone() -> None:
    """Only the init of a pid namespace below ours that was reparented to us is killed:
    a plain child, and a live sandbox's bwrap, are not."""
    marker = f"orphan-{uuid.uuid4().hex}"
    plain = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(30)  # {marker}"])
    box = _spawn(marker)
    try:
        time.sleep(0.3)                           # set up: its init has armed PDEATHSIG
        assert launch.reap_orphans() == []
        assert plain.poll() is None and box.poll() is None
        assert len(_alive_with(marker.encode())) >= 3      # plain, bwrap's init, worker
    finally:
        for q in (plain, box):
            q.kill()
            q.wait()
        launch.reap_orphans(timeout=1.0)
    assert not _alive_with(marker.encode())
