"""Recording under faults, for real: a disk that fills up while the sandboxed pipeline
records (a small tmpfs mounted for the test), and a recorder killed with SIGKILL in the
middle of encoding. A full disk is one line and exit 8, the control domain runs on
untouched, no temporary file stays; a log that was never closed, and frames whose pixels
never reached the video, are reported as loss (never "nothing lost")."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.replay.drivelog import DriveLog
from supervisor.replay.logfmt import MESSAGES

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRIO_STATE_DIR": str(cwd / "state")}  # never the machine's latch
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: room for the config and a few 320x240 raw frames (115 KB each)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.sandbox
def test_disk_full_while_recording_is_one_line_exit_8_and_control_runs_on(tmp_path,
                                                                            small_disk):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    from tests.test_replay import config

    cfg = config(tmp_path / "drive.toml")
    out = small_disk / "drive"
    r = _cli("record", str(out), "--config", str(cfg), "--seconds", "60", "--video", "raw",
             cwd=tmp_path)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 8, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    # One line, the last one (lifecycle events are JSON lines before it), saying where.
    assert err[-1].startswith("supervisor record: disk full: ") and str(out) in err[-1], err[-3:]
    assert "the log is whole up to here" in err[-1]
    events = [json.loads(ln) for ln in err if ln.startswith("{")]
    # Stopped at once, in order: long before --seconds 60, nothing restarted, nothing
    # refused, no fail-safe; every worker stopped by the supervisor, none exited itself.
    bad = [e for e in events if e["event"] in ("restart", "gave_up", "fail_safe", "refused",
                                               "watchdog_missed", "exit", "ready_timeout")]
    assert bad == []
    assert [e["code"] for e in events if e["event"] == "supervisor_exit"] == [0]
    ready = next(e["mono_ns"] for e in events if e["event"] == "all_ready")
    end = next(e["mono_ns"] for e in events if e["event"] == "supervisor_exit")
    assert (end - ready) / 1e9 < 30
    # No temporary file, and what is there is whole records only: it replays.
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    log = DriveLog.open(out)
    loss = log.full_loss()
    assert loss.truncated_bytes == 0 and loss.corrupt_records == 0, loss.problems
    assert len(log.video("road_frames")) >= 1
    assert "recorded " in r.stdout and "lost: " in r.stdout or not loss.any


def test_a_disk_already_full_is_one_line_exit_8_and_leaves_nothing(tmp_path, small_disk):
    with open(small_disk / "fill", "wb", buffering=0) as f:   # the whole tmpfs, to the end
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    r = _cli("record", str(small_disk / "drive"), "--seconds", "1", "--video", "raw",
             cwd=tmp_path, timeout=60)
    assert r.returncode == 8, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"supervisor record: {small_disk / 'drive'}/source.toml: No space left on device; "
        "nothing recorded"]
    assert sorted(p.name for p in small_disk.iterdir()) == ["fill"]


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from supervisor.replay.drivelog import LogWriter
    w = LogWriter(sys.argv[1], ["road_frames"], info={"video": "h264"}, video_codec="h264",
                  encode_queue=8)
    W, H = 1280, 720         # slow enough to encode that frames wait in the queue
    y = np.random.default_rng(1).integers(0, 255, (H, W), np.uint8)
    uv = np.full((H // 2, W), 128, np.uint8)
    for k in range(40):
        w.frame("road_frames", k + 1, k, 11, k, k * 50_000_000, None, W, H, "nv12", "road",
                (y, uv))
    os.kill(os.getpid(), signal.SIGKILL)       # mid-encode, before close()
""")


def test_a_log_killed_mid_record_reports_the_unclosed_log_and_frames_without_video(tmp_path):
    pytest.importorskip("av", reason="the 'replay' extra (PyAV) is not installed")
    p = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "log")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    log = DriveLog.open(tmp_path / "log")
    assert not log.closed and len(log.frames["road_frames"]) == 40
    loss = log.full_loss()
    assert loss.any and loss.not_closed
    in_video = len(log.video("road_frames"))
    assert loss.frames == 40 and loss.frames_without_video == 40 - in_video > 0
    text = loss.text()
    assert "never closed" in text and f"{40 - in_video} of 40 frames have no video" in text
    assert text != "nothing lost" and (tmp_path / "log" / MESSAGES).is_file()
