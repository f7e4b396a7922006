"""One supervisor per state dir (supervisor/statelock.py), with real processes: a second
`supervisor run` on a held state dir says who holds it in one line and exits 9, having
touched nothing; a holder killed with SIGKILL lets go at once (the kernel drops the
flock), even while a child it started without closing fds lives on (O_CLOEXEC)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from supervisor import statelock
from supervisor.exits import Exit

# Holds the lock, starts a child that keeps every inheritable fd (close_fds=False), says
# both pids, then waits to be killed.
HOLDER = textwrap.dedent("""
    import subprocess, sys, time
    from supervisor.statelock import hold
    hold(sys.argv[1])
    child = subprocess.Popen(["sleep", "60"], close_fds=False)
    print(child.pid, flush=True)
    time.sleep(60)
""")

CONFIG = """
[domains.research]
profile = "research"

[workers.idle]
domain = "research"
command = ["/bin/sleep", "60"]
"""


def _holder(state: Path) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(state)], stdout=subprocess.PIPE,
                         text=True)
    line = p.stdout.readline()
    assert line.strip().isdigit(), f"holder did not start: {line!r}"
    return p, int(line)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_second_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder, child = _holder(state)
    try:
        cfg = tmp_path / "run.toml"
        cfg.write_text(CONFIG)
        r = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg)],
                           env=dict(os.environ, TRIO_STATE_DIR=str(state)),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == Exit.LOCKED == 9, r.stderr
        assert r.stderr.splitlines() == [
            f"supervisor run: another supervisor (pid {holder.pid}) holds {state}; stop it "
            "first, or give this run a state dir of its own (TRIO_STATE_DIR)"], r.stderr
        assert r.stdout == ""
        assert sorted(os.listdir(state)) == [statelock.LOCK_NAME]   # no latch, nothing else
    finally:
        holder.kill()
        holder.wait()
        _kill(child)


def test_sigkill_of_the_holder_releases_the_lock_its_child_does_not_keep_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder, child = _holder(state)
    try:
        with pytest.raises(statelock.Held) as held:
            statelock.acquire(state)
        assert held.value.pid == holder.pid
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)                       # the child lives on, with the holder's fds
        t0 = time.monotonic()
        lock = statelock.acquire(state)         # and still the lock is free
        try:
            assert time.monotonic() - t0 < 1.0
            assert statelock.holder(state) == os.getpid()
            assert not os.get_inheritable(lock.fd)
        finally:
            lock.release()
    finally:
        holder.kill()
        holder.wait()
        _kill(child)


def test_run_holds_its_state_dir_for_its_life(sup, tmp_path: Path, _state_dir: Path) -> None:
    """A real `supervisor run` takes the lock first thing and the kernel gives it back
    when that run is SIGKILLed (no stale lock to clear)."""
    r = sup(CONFIG)
    deadline = time.monotonic() + 60
    while statelock.holder(_state_dir) != r.proc.pid:
        assert r.proc.poll() is None, f"run exited {r.proc.returncode}: {r.lines}"
        assert time.monotonic() < deadline, "run never took the state dir's lock"
        time.sleep(0.05)
    with pytest.raises(statelock.Held):
        statelock.acquire(_state_dir)
    r.proc.send_signal(signal.SIGKILL)
    r.proc.wait()
    statelock.acquire(_state_dir).release()


def test_a_simulation_run_takes_no_lock(tmp_path: Path) -> None:
    """Simulations latch per run (failsafe.FailSafeLatch.per_run): side by side is fine."""
    from supervisor.config import load

    cfg = tmp_path / "sim.toml"
    cfg.write_text(CONFIG + '\n[supervisor]\nmode = "simulation"\n')
    assert statelock.hold_for_run(load(str(cfg))) is None
    assert not (Path(os.environ["TRIO_STATE_DIR"]) / statelock.LOCK_NAME).exists()
