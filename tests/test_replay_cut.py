"""`supervisor log cut` and `--plot`, without a pipeline: the cut of a raw log is exact
(frames, pixels, messages, ranges in seconds or frame ids, half-open), an H.264 cut
starts at a keyframe and says so, a config the recorder could have replaced is not
laundered into the cut, bad ranges and unknown signals are one line, and plot.png
overlays REF on the chosen signals. (tests/test_replay.py replays a real cut.)"""
from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from supervisor.config import dumps, minimal_doc
from supervisor.replay.cut import CutError, cut, parse_pos
from supervisor.replay.derive import ReplayPlan, plan_of
from supervisor.replay.drivelog import DriveLog
from supervisor.replay.logtool import main as log_main
from supervisor.replay.signals import SignalError, parse_signals
from tests.test_replay_format import write_log

PLAN = ReplayPlan(camera="camerad", frames="road_frames", controls="controlsd",
                  command="control_cmd", model="modeld", model_out="model_out")


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cut") / "drive"
    write_log(p, n=12)                          # frames 0..11, 50 ms apart
    # as `record` of the one-camera pipeline leaves it (a replay plays one camera: one of
    # the default, the car, is refused: tests/test_vehicle_config.py)
    (p / "source.toml").write_text(dumps(minimal_doc()))
    os.chmod(p / "source.toml", 0o644)
    return p


def test_a_raw_cut_is_exact_in_frame_ids_or_seconds_and_half_open(raw, tmp_path):
    r = cut(raw, tmp_path / "a", parse_pos("f3", "--start"), parse_pos("f7", "--end"))
    assert (r.range.lo, r.range.hi, r.frames, r.config_copied) == (3, 6, {"road_frames": 4}, True)
    log, whole = DriveLog.open(tmp_path / "a"), DriveLog.open(raw)
    assert log.closed and not log.full_loss().any
    assert [f.frame_id for f in log.frames["road_frames"]] == [3, 4, 5, 6]
    px = {e.frame_id: d for e, d in whole.video("road_frames").frames()}
    assert {e.frame_id: d for e, d in log.video("road_frames").frames()} == {
        k: px[k] for k in (3, 4, 5, 6)}
    for ch in ("model_out", "control_cmd"):
        assert [m.array.tobytes() for m in log.messages[ch]] == [
            m.array.tobytes() for m in whole.messages[ch] if 3 <= m.frame_id <= 6]
    assert log.info["cut"]["frames"] == [3, 6] and log.summary["cut_from"] == str(raw)
    # Seconds of log time, half-open: 0.15 s is frame 3, 0.35 s (frame 7) is out; two
    # adjacent cuts share no frame.
    r = cut(raw, tmp_path / "b", parse_pos("0.15", "--start"), parse_pos("0.35", "--end"))
    assert (r.range.lo, r.range.hi) == (3, 6)
    r2 = cut(raw, tmp_path / "c", parse_pos("0.35", "--start"), None)
    assert (r2.range.lo, r2.range.hi) == (7, 11)


def test_an_h264_cut_starts_at_its_keyframe_and_says_so(tmp_path):
    pytest.importorskip("av", reason="the 'replay' extra (PyAV) is not installed")
    write_log(tmp_path / "h", n=30, video="h264")          # keyframes every 20 frames
    r = cut(tmp_path / "h", tmp_path / "c", parse_pos("f25", "--start"), None)
    assert (r.range.lo, r.range.snapped) == (20, 5)
    assert any("keyframe f20, 5 frame(s) before f25" in n for n in r.notes)
    v = DriveLog.open(tmp_path / "c").video("road_frames")
    assert [e.frame_id for e, _ in v.frames()] == list(range(20, 30))   # all decode


def test_a_config_the_recorder_could_have_replaced_is_not_copied(raw, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(raw, src)
    os.chmod(src / "source.toml", 0o666)       # writable by the recorder's sandbox user
    r = cut(src, tmp_path / "out", None, parse_pos("f2", "--end"))
    assert not r.config_copied and not (tmp_path / "out" / "source.toml").exists()
    assert any("source.toml not copied" in n and "pass --config" in n for n in r.notes)


@pytest.mark.parametrize("args, needle", [
    (("--start", "f7", "--end", "f3"), "the start must come before the end"),
    (("--start", "0.5", "--end", "0.5"), "the start must come before the end"),
    (("--start", "9"), "no frame of"),
    (("--start", "f-1"), "expected seconds of log time (12.5) or a frame id (f120)"),
    (("--end", "abc"), "expected seconds"),
])
def test_a_bad_range_is_one_line_and_exit_2_and_writes_nothing(raw, tmp_path, capsys, args,
                                                                 needle):
    assert log_main(["cut", str(raw), str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CutError):
        cut(raw, raw, None, None)                          # never over its own source


@pytest.mark.parametrize("args, needle", [
    (("--start", "9"), "no frame of"),
    (("--end", "f0"), "no frame of"),
    (("--plot", "nope.steer_rad"), "no channel 'nope'"),
    (("--plot", "control_cmd.nope"), "has no field 'nope' (fields: steer_rad"),
])
def test_replay_refuses_a_bad_range_or_signal_before_anything_starts(raw, tmp_path, capsys,
                                                                     args, needle):
    from supervisor.cli import main

    assert main(["replay", str(raw), "--out", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_plot_names_are_checked_against_the_config():
    doc = minimal_doc()
    plan = plan_of(doc)
    sigs = parse_signals(["control_cmd.steer_rad", "model_out.latency_ms",
                          "control_cmd.steer_rad"], doc, plan)
    assert [(s.name, s.index) for s in sigs] == [("control_cmd.steer_rad", 0),
                                                ("model_out.latency_ms", None)]
    for spec, needle in (("nope.x", "no channel 'nope' in the config (channels: "),
                         ("control_cmd.nope", "has no field 'nope' (fields: steer_rad, "),
                         ("control_cmd.latency_ms", "has no field 'latency_ms'"),
                         ("road_frames.y", "is the frame channel"),
                         ("steer", "expected CHANNEL.FIELD")):
        with pytest.raises(SignalError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            parse_signals([spec], doc, plan)


def test_plot_png_draws_the_chosen_signals_with_ref_overlaid(tmp_path):
    from PIL import Image

    from supervisor.replay.run import plot

    write_log(tmp_path / "drive", n=12)
    write_log(tmp_path / "run", n=12)
    write_log(tmp_path / "ref", n=12, offset=lambda k: 0.05 * k)     # model B
    src, run, ref = (DriveLog.open(tmp_path / n) for n in ("drive", "run", "ref"))
    sigs = parse_signals(["model_out.offset_m", "control_cmd.steer_rad",
                          "model_out.latency_ms"], minimal_doc(), PLAN)
    plot(src, run, PLAN, tmp_path / "a.png", signals=sigs)
    plot(src, run, PLAN, tmp_path / "b.png", ref=ref, signals=sigs)
    a = np.asarray(Image.open(io.BytesIO((tmp_path / "a.png").read_bytes())).convert("RGB"))
    b = np.asarray(Image.open(io.BytesIO((tmp_path / "b.png").read_bytes())).convert("RGB"))
    assert a.shape == b.shape == (int(80 * (1.2 + 2.0 * 3)), 720, 3)   # one panel each
    # REF differs from the run on the two payload signals: its line is drawn there (the
    # top two panels change), the latency panel (same receipts) barely.
    rows = np.abs(a.astype(int) - b.astype(int)).sum(axis=(1, 2))
    third = a.shape[0] // 3
    assert rows[:third].sum() > 0 and rows[third:2 * third].sum() > 0


def test_a_fleet_refuses_start_and_end_in_one_line(raw, capsys):
    from supervisor.cli import main

    assert main(["replay", str(raw), str(raw), "--start", "f2"]) == 2
    err = capsys.readouterr().err
    assert "--start/--end replay a part of one log, not a fleet" in err
    assert len(err.splitlines()) == 1


def test_a_replays_summary_names_its_range_and_the_cuts_notes(capsys):
    from supervisor.replay.commands import print_summary

    note = "H.264: the cut starts at keyframe f199, 8 frame(s) before f207 (...)"
    print_summary({"mode": "lockstep", "frames": {"replayed": 28, "in_log": 28},
                   "range": {"start": "1.5", "end": "2.5", "frames": [199, 226],
                             "input": "run/input", "notes": [note]}, "run": "run"})
    out = capsys.readouterr().out
    assert "range: --start 1.5 --end 2.5: frames f199..f226 (played from run/input)" in out
    assert f"  note: {note}" in out
