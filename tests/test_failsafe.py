"""Fail safe for real: the actuation channel's last word is SAFE, the fail-safe latches
until an operator clears it, and stop signals can never cut the ordered stop short."""
from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import trio

from schemas.payloads import CONTROL_CMD
from supervisor.config import derive, dumps, loads, minimal_doc
from supervisor.events import EventLog
from supervisor.ipc import Reader, Rejected
from supervisor.lifecycle import Exit, Supervisor
from workers.controlsd.law import SafeReason

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

def _vehicle_pipeline() -> str:
    """The vehicle's own control pipeline (the one-camera config, configs/minimal.toml:
    the car's road camera, model and controls, without the research worker), with no
    restart budget and no warm standby, so one kill -9 exhausts a worker; a deep command
    ring so the test reader misses nothing."""
    pipe = ("camerad", "modeld", "controlsd")
    return dumps(derive(minimal_doc(), drop=("workers.research", "channels.shadow_out"), set={
        **{f"workers.{w}.max_restarts": 0 for w in pipe},
        **{f"workers.{w}.warm_standby": False for w in pipe},
        "channels.control_cmd.slot_count": 64,
        "channels.control_cmd.max_readers": 2,
        # the test drains the ring after the supervisor is gone: judge the last word,
        # not its freshness, on a loaded machine
        "channels.control_cmd.max_age_ms": 2000,
    }))


PIPELINE = _vehicle_pipeline()


@pytest.mark.parametrize("victim", ["camerad", "modeld", "controlsd"])
def test_budget_exhaustion_ends_on_a_safe_command_and_latches(victim, _state_dir):
    """Each control worker in turn runs out of restarts (kill -9 with a budget of 0):
    the last control_cmd is engaged=0 reason FAIL_SAFE, published after every control
    process is gone, and the latch keeps the next `run` from starting anything."""
    cfg = loads(PIPELINE, "failsafe.toml")
    log = EventLog(stream=io.StringIO())
    status = io.StringIO()
    commands: list[dict] = []

    async def main() -> Supervisor:
        sup = Supervisor(cfg, log=log, status_out=status, status_interval_s=0.2)
        async with trio.open_nursery() as nursery:
            code_box: list[int] = []

            async def run_it() -> None:
                code_box.append(await sup.run())

            nursery.start_soon(run_it)
            while "control_cmd" not in sup.channels or not log.of("all_ready"):
                if code_box:
                    raise AssertionError(f"supervisor ended early: {log.events[-3:]}")
                await trio.sleep(0.05)
            reader = Reader(sup.channels["control_cmd"].reader_handle(1))
            with trio.fail_after(30):        # engaged before the fault
                while not (commands and commands[-1]["engaged"]):
                    with await reader.receive_async() as m:
                        commands.append(CONTROL_CMD.decode(np.array(m.array)))
            os.kill(sup.runs[victim].pid, signal.SIGKILL)
            with trio.fail_after(30):
                while not code_box:
                    await trio.sleep(0.02)
            while True:
                try:
                    m = reader.try_receive()
                except Rejected:         # counted by the reader; the last word must pass
                    continue
                if m is None:
                    break
                with m:
                    commands.append(CONTROL_CMD.decode(np.array(m.array)))
                    commands[-1]["writer_domain"] = m.stamp.writer_domain if hasattr(
                        m.stamp, "writer_domain") else None
        return sup

    sup = trio.run(main)
    assert sup.exit_code == Exit.FAIL_SAFE
    last = commands[-1]
    assert last["engaged"] == 0.0 and last["reason"] == float(SafeReason.FAIL_SAFE), commands[-5:]
    fs = log.of("fail_safe")[0]
    cmd = log.of("fail_safe_command")[0]
    assert cmd["channel"] == "control_cmd" and cmd["engaged"] == 0.0
    # the safe word comes after every control process is gone
    assert all(not os.path.exists(f"/proc/{e['pid']}") for e in log.of("start"))
    assert fs["mono_ns"] < cmd["mono_ns"]
    assert "FAIL-SAFE" in status.getvalue().splitlines()[-1]
    assert (_state_dir / "failsafe.latch").exists()

    # Latched: the next run starts nothing and says how to clear it.
    log2 = EventLog(stream=io.StringIO())
    assert trio.run(Supervisor(loads(PIPELINE, "failsafe.toml"), log=log2).run) == Exit.FAIL_SAFE
    assert not log2.of("start") and "clear-fail-safe" in log2.events[-1]["reason"]


def test_operator_clears_the_latch(tmp_path, _state_dir):
    (_state_dir / "failsafe.latch").write_text(json.dumps({"time": "t", "reason": "r"}))
    cfg = tmp_path / "x.toml"
    cfg.write_text(PIPELINE)
    run = [sys.executable, "-m", "supervisor.cli"]
    r = subprocess.run([*run, "run", "--config", str(cfg), "--quiet"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 4 and "clear-fail-safe" in r.stderr
    r = subprocess.run([*run, "clear-fail-safe", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "cleared" in r.stdout
    assert not (_state_dir / "failsafe.latch").exists()


SMALL = """
[domains.control]
actuates = true
[channels.x]
slot_size = "4KiB"
[workers.a]
domain = "control"
module = "workers.probe"
publishes = ["x"]
args = ["--publish", "x"]
[workers.b]
domain = "control"
module = "workers.probe"
subscribes = ["x"]
args = ["--read", "x"]
"""


# Every stop signal is an ordered stop: Ctrl-C, systemd's SIGTERM, a terminal's hang-up
# (an ssh session dropped), Ctrl-\ (red team 8 row 4: SIGHUP ended the supervisor).
_PAIRS = [(signal.SIGINT, signal.SIGTERM), (signal.SIGHUP, signal.SIGTERM),
          (signal.SIGQUIT, signal.SIGINT), (signal.SIGTERM, signal.SIGHUP)]


@pytest.mark.parametrize("trial", range(8))
def test_two_signals_at_any_moment_still_stop_in_order(tmp_path, trial):
    """Two stop signals ~1 ms apart, at a random moment from start-up on: exit 0, the
    ordered stop logged to its end, never a traceback."""
    cfg = tmp_path / "small.toml"
    cfg.write_text(textwrap.dedent(SMALL))
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg),
                          "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(random.Random(trial).uniform(0.0, 2.5))
    first, second = _PAIRS[trial % len(_PAIRS)]
    p.send_signal(first)
    time.sleep(0.001)
    p.send_signal(second)
    _, err = p.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    events = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert p.returncode == 0, err[-2000:]
    assert events[-1]["event"] == "supervisor_exit" and events[-1]["reason"] == "shutdown"
    started = {e["worker"] for e in events if e["event"] == "start"}
    stopped = {e["worker"] for e in events if e["event"] == "stopped"}
    assert started == stopped or started - stopped <= {
        e["worker"] for e in events if e["event"] == "exit"}


def test_other_signals_are_logged_and_ignored_and_a_hang_up_stops_in_order(tmp_path):
    """SIGUSR1, SIGUSR2, SIGALRM, SIGPROF, SIGXFSZ, SIGTSTP (Ctrl-Z) (whose default
    actions end or stop a process) change nothing once it runs: each is one `signal_ignored` event; the workers stay
    up. Then SIGHUP: the ordered stop, exit 0, its `signal` event naming SIGHUP."""
    cfg = tmp_path / "small.toml"
    cfg.write_text(textwrap.dedent(SMALL))
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg),
                          "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in p.stderr:
            lines.append(line)
            if '"all_ready"' in line:
                break
        others = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPROF,
                  signal.SIGXFSZ, signal.SIGTSTP]
        for s in others:
            p.send_signal(s)
        ignored = 0
        for line in p.stderr:
            lines.append(line)
            ignored += '"signal_ignored"' in line
            if ignored == len(others):
                break
        assert p.poll() is None
        p.send_signal(signal.SIGHUP)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    err = "".join(lines) + err
    events = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert p.returncode == 0, err[-2000:]
    assert sorted(e["signal"] for e in events if e["event"] == "signal_ignored") == sorted(
        s.name for s in others)
    assert not [e for e in events if e["event"] in ("exit", "fail_safe", "restart")], err
    assert [e["signal"] for e in events if e["event"] == "signal"] == ["SIGHUP"]
    assert events[-1]["event"] == "supervisor_exit" and events[-1]["reason"] == "shutdown"
    assert {e["worker"] for e in events if e["event"] == "stopped"} == {"a", "b"}


@pytest.mark.parametrize("poison", ["layout", "last_seq", "generation"])
def test_safe_word_lands_whatever_the_dead_writer_left(make_channel, poison):
    """A hostile control writer may poison the segment before it dies (red team): a
    header that does not match the spec, sequence or generation words near 2**64. The
    supervisor takes the segment back and its safe value is still the last word."""
    import mmap as _mmap
    import struct

    from supervisor.failsafe import publish_safe
    from supervisor.ipc import Writer
    from supervisor.ipc import _geometry as G
    from supervisor.ipc import layout as L

    ch = make_channel(name="control_cmd", slot_size=4096, dtype="float32", max_readers=2,
                      slot_count=8)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    reader = Reader(ch.reader_handle(0))
    for _ in range(3):
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.1, engaged=1.0))
    w.close()
    seen = []
    while (m := reader.try_receive()) is not None:
        with m:
            seen.append(CONTROL_CMD.decode(np.array(m.array)))
    with _mmap.mmap(ch.writer_handle().data_fd, ch.spec.segment_size) as buf:
        if poison == "layout":
            struct.pack_into("<I", buf, 12, 999)                 # slot count
        elif poison == "last_seq":
            L.U64.pack_into(buf, L.OFF_LAST_SEQ, 2**64 - 1)
        else:
            L.GEN_SEQ.pack_into(buf, G.control_offset(3), 2**64 - 2, 2**64 - 1)
    publish_safe(ch, "control_cmd")
    while (m := reader.try_receive()) is not None:
        with m:
            seen.append(CONTROL_CMD.decode(np.array(m.array)))
    assert seen[-1]["engaged"] == 0.0 and seen[-1]["reason"] == float(SafeReason.FAIL_SAFE), seen


@pytest.mark.skipif(os.geteuid() != 0, reason="reads root's state dir as another user")
def test_a_latch_another_user_cannot_read_stays_latched_and_says_why(tmp_path):
    """A developer's non-root `run` against the vehicle's state dir (root's, 0700): the
    latch cannot be read, so it counts as latched (fail closed), and the line says it
    is a permission problem and what to do, not "latched at ?"."""
    from supervisor.failsafe import FailSafeLatch

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    latch = FailSafeLatch(state / "failsafe.latch")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.setresuid(65534, 65534, 65534)
        os.write(w, json.dumps(latch.read()).encode())
        os._exit(0)
    os.close(w)
    got = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    os.close(r)
    assert got and got.get("unreadable") and "TRIO_STATE_DIR" in got["reason"], got


_FULL = """
import json, os, sys
from pathlib import Path
from supervisor.failsafe import LATCH_NAME, FailSafeLatch
d = sys.argv[1]
latch = FailSafeLatch(Path(d) / LATCH_NAME)
latch.reserve()                                   # what `run` does at its start
fd = os.open(os.path.join(d, "fill"), os.O_WRONLY | os.O_CREAT)   # then the disk fills
try:
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    os.close(fd)
try:
    latch.set("controlsd failed: the disk is full")
    err = None
except OSError as e:
    err = str(e)
print(json.dumps({"set_error": err, "latched": latch.read(), "left": sorted(os.listdir(d))}))
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs root and unshare (a tmpfs in a private mount namespace)")
def test_a_full_state_dir_still_latches_with_its_reason(tmp_path):
    """The state dir's file system filled up after `run` started (red team 8 row 8: the
    latch's write failed with ENOSPC and nothing was latched). The blocks reserved at the
    start take the latch's text; the reserve becomes the latch."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    script = (f"mount -t tmpfs -o size=64k,mode=0700 full {state} && "
              f"exec {sys.executable} -c \"$PROBE\" {state}")
    got = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env=dict(os.environ, PROBE=_FULL))
    assert got.returncode == 0, got.stderr[-2000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    assert res["set_error"] is None, res
    assert res["latched"]["reason"] == "controlsd failed: the disk is full", res
    assert res["left"] == ["failsafe.latch", "fill"], res
