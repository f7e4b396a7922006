"""Review 7, finding 3, beyond its test in tests/test_review_round7.py: what a recorded
drive lacks by its recorder's own count is set aside and named, never more, and `log
info` says so. The compare path `supervisor replay LOG --ref self` runs (`edge_windows`
over the log, then `compare`) on logs the product's LogWriter writes (no pipeline)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from supervisor.replay.diff import compare, edge_windows, render_markdown, render_text
from supervisor.replay.drivelog import DriveLog

CHANS = ["model_out", "control_cmd"]
PAYLOADS = {"model_out": "model_out", "control_cmd": "control_cmd"}


def _drive(path: Path, *, frames_missing: tuple[int, ...] = (),
           commands_missing: tuple[int, ...] = (), outputs_missing: tuple[int, ...] = (),
           dropped: dict[str, int] | None = None) -> DriveLog:
    """12 small raw frames with an output and a command each, as the recorder writes
    them; `*_missing`: frames (k) with no such entry; `dropped`: the recorder's counts."""
    from schemas.payloads import CONTROL_CMD, MODEL_OUT
    from supervisor.replay.drivelog import LogWriter
    from workers.camerad.synthetic import SyntheticRoad

    road = SyntheticRoad(64, 48, seed=1)
    w = LogWriter(path, ["road_frames", *CHANS], video_codec="raw")
    for k in range(12):
        t = k * 50_000_000
        if k not in frames_missing:
            y, uv, _ = road.render(k)
            w.frame("road_frames", k + 1, t + 1, 11, k, t, 9000, 64, 48, "nv12", "road", (y, uv))
        if k not in outputs_missing:
            w.message("model_out", k + 1, t + 2, 12, k, t,
                      MODEL_OUT.encode(offset_m=0.01 * k, heading_rad=0.0, confidence=0.9))
        if k not in commands_missing and k not in outputs_missing:
            w.message("control_cmd", k + 1, t + 3, 13, k, t,
                      CONTROL_CMD.encode(steer_rad=-0.01 * k, engaged=1.0))
    for ch, n in (dropped or {}).items():
        w.drops(ch, n, 0, 0, 0)
    w.close({"frames": 12})
    return DriveLog.open(path)


def _vs_log(run: DriveLog, log: DriveLog):
    return compare(run, log, channels=CHANS, payloads=PAYLOADS, gated=set(CHANS),
                   windows=edge_windows(log, "road_frames", CHANS), model_channel="model_out",
                   p99_ratio=None, max_ratio=None)


def test_a_command_the_recorder_dropped_is_noted_and_one_more_still_differs(tmp_path):
    run = _drive(tmp_path / "run")
    lossy = _drive(tmp_path / "lossy", commands_missing=(7,), dropped={"control_cmd": 1})
    r = _vs_log(run, lossy)
    assert r.ok, render_text(r)
    text = render_text(r)
    assert "1 added not gated: the log lacks 1 control_cmd message(s) (the recorder " \
           "dropped them)" in text, text
    assert "The log's own loss, set aside" in render_markdown(r)
    # Two commands missing where the recorder counted one: a difference, as without it.
    worse = _drive(tmp_path / "worse", commands_missing=(5, 7), dropped={"control_cmd": 1})
    r = _vs_log(run, worse)
    cmd = next(c for c in r.channels if c.channel == "control_cmd")
    assert not r.ok and cmd.added == [5, 7], render_text(r)
    # No drop counted: a command the log lacks is the run's "added", as ever.
    clean = _drive(tmp_path / "clean", commands_missing=(7,))
    assert not _vs_log(run, clean).ok


def test_a_frame_the_log_lacks_is_set_aside_on_refs_side_only(tmp_path):
    log = _drive(tmp_path / "log", frames_missing=(3,), dropped={"road_frames": 1})
    played = _drive(tmp_path / "played", frames_missing=(3,), outputs_missing=(3,))
    r = _vs_log(played, log)
    assert r.ok, render_text(r)
    assert "not compared: the log lacks frames 3 (the recorder dropped 1 frame(s)); REF's " \
           "model_out for them set aside" in render_text(r)
    # A run with an output for a frame the log has no frame of: "added", never hidden.
    odd = _drive(tmp_path / "odd", frames_missing=(3,))
    r = _vs_log(odd, log)
    assert not r.ok and next(c for c in r.channels if c.channel == "model_out").added == [3]


def test_log_info_names_the_recorders_drops_as_loss(tmp_path):
    log = _drive(tmp_path / "log", frames_missing=(3,), commands_missing=(7,),
                 dropped={"road_frames": 1, "control_cmd": 2})
    assert log.full_loss().text() == ("the recorder dropped 3 message(s) (control_cmd 2, "
                                      "road_frames 1): not in the log")
    assert _drive(tmp_path / "whole").full_loss().text() == "nothing lost"
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "log", "info",
                        str(tmp_path / "log")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "nothing lost" not in r.stdout, r.stdout + r.stderr
    assert "loss: the recorder dropped 3 message(s)" in r.stdout, r.stdout
