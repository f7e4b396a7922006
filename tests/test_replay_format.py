"""The drive log format, the diff and the derived configs, without a pipeline: round
trips, reading while written, crash and corruption losses (reported, never fatal),
per-field comparison with tolerances, and the CLI's one-line refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas.payloads import CONTROL_CMD, MODEL_OUT
from supervisor.config import minimal_doc
from supervisor.ipc.receipt import Receipt
from supervisor.replay import derive
from supervisor.replay.diff import (
    compare,
    parse_tolerances,
    render_json,
    render_markdown,
    render_text,
)
from supervisor.replay.drivelog import DriveLog, LogWriter
from supervisor.replay.logfmt import (
    MESSAGES,
    Entry,
    LogError,
    frame_record,
    frame_times,
)
from workers.camerad.synthetic import SyntheticRoad

W, H = 160, 120
ROOT = Path(__file__).resolve().parents[1]


def _receipt(fid: int, latency_ms: float) -> Receipt:
    return Receipt(frame_id=fid, capture_ts_ns=fid * 50_000_000, infer_start_ns=1,
                   infer_end_ns=1 + int(latency_ms * 1e6), device="CPU", bytes_in=10,
                   bytes_out=16, latency_ns=int(latency_ms * 1e6), deadline_ns=50_000_000,
                   artifact_sha256=b"\x01" * 32, kernels_run=3)


def write_log(path: Path, n: int = 12, *, video: str = "raw", offset=lambda k: 0.01 * k,
              latency_ms: float = 5.0, skip: tuple[int, ...] = (), close: bool = True):
    road = SyntheticRoad(W, H, seed=1)
    w = LogWriter(path, ["road_frames", "model_out", "control_cmd"], video_codec=video)
    for k in range(n):
        y, uv, _ = road.render(k)
        w.frame("road_frames", k + 1, k * 50_000_000 + 1, 11, k, k * 50_000_000, 9000, W, H,
                "nv12", "road", (y, uv))
        if k in skip:
            continue
        w.message("model_out", k + 1, k * 50_000_000 + 2, 12, k, k * 50_000_000,
                  MODEL_OUT.encode(offset_m=offset(k), heading_rad=0.001 * k, confidence=0.9),
                  _receipt(k, latency_ms))
        w.message("control_cmd", k + 1, k * 50_000_000 + 3, 13, k, k * 50_000_000,
                  CONTROL_CMD.encode(steer_rad=-offset(k), engaged=1.0))
    if close:
        w.close({"frames": n})
    return w


def test_round_trip_raw_video_is_bit_exact_and_metadata_survives(tmp_path):
    write_log(tmp_path / "log", video="raw")
    log = DriveLog.open(tmp_path / "log")
    assert log.closed and not log.full_loss().any
    assert [m.frame_id for m in log.messages["model_out"]] == list(range(12))
    r = log.messages["model_out"][3].receipt
    assert r.frame_id == 3 and r.latency_ns == 5_000_000 and r.device == "CPU"
    assert log.frames["road_frames"][5].exposure_us == 9000
    road = SyntheticRoad(W, H, seed=1)
    frames = list(log.video("road_frames").frames())
    assert len(frames) == 12
    for e, data in frames:
        y, uv, _ = road.render(e.frame_id)
        assert data == y.tobytes() + uv.tobytes()
        assert e.capture_ts_ns == e.frame_id * 50_000_000          # from the index
    assert frame_times(tmp_path / "log", "road_frames")[7] == 7 * 50_000_000


def test_h264_video_decodes_close_to_the_source_and_seeks_from_a_keyframe(tmp_path):
    write_log(tmp_path / "log", n=30, video="h264")
    v = DriveLog.open(tmp_path / "log").video("road_frames")
    assert v.info.codec == "h264" and v.index[0].keyframe and v.index[20].keyframe
    allf = list(v.frames())
    road = SyntheticRoad(W, H, seed=1)
    y, uv, _ = road.render(10)
    ref = np.frombuffer(y.tobytes() + uv.tobytes(), np.uint8).astype(int)
    got = np.frombuffer(allf[10][1], np.uint8).astype(int)
    assert np.abs(ref - got).mean() < 6                         # lossy, but the same scene
    tail = list(v.frames(25))                                    # starts decoding at 20
    assert [e.frame_id for e, _ in tail] == list(range(25, 30))
    assert tail[0][1] == allf[25][1]                             # same decoder, same bytes


def test_log_is_readable_while_written_and_appendable(tmp_path):
    w = write_log(tmp_path / "log", n=5, close=False)
    live = DriveLog.open(tmp_path / "log", final=False)
    assert len(live.messages["model_out"]) == 5 and not live.closed
    w.message("model_out", 6, 1, 12, 5, 1, MODEL_OUT.encode(offset_m=1.0))
    w.close()
    again = DriveLog.open(tmp_path / "log")
    assert len(again.messages["model_out"]) == 6 and again.closed
    # A second session appends to the same log: its frames continue the video.
    w2 = LogWriter(tmp_path / "log", ["road_frames"], video_codec="raw")
    y, uv, _ = SyntheticRoad(W, H, seed=1).render(99)
    w2.frame("road_frames", 1, 1, 11, 99, 99, None, W, H, "nv12", "road", (y, uv))
    w2.close()
    both = DriveLog.open(tmp_path / "log")
    v = both.video("road_frames")
    assert len(v) == 6 and v.index[-1].frame_id == 99 and both.frames["road_frames"][-1].video_index == 5
    assert list(v.frames(5))[0][1] == y.tobytes() + uv.tobytes()
    assert len(both.messages["model_out"]) == 6 and not both.full_loss().any


def test_a_crash_mid_write_loses_only_the_last_message_and_says_so(tmp_path):
    write_log(tmp_path / "log", n=10, close=False)
    msgs = tmp_path / "log" / MESSAGES
    # What a crash in the middle of one write(2) leaves: the start of a record.
    whole = msgs.read_bytes()
    rec = frame_record(Entry.new_message(monoNs=1, event='{"x": 1}').to_bytes())
    msgs.write_bytes(whole + rec[: len(rec) // 2])
    vid = tmp_path / "log" / "road_frames.nv12"
    os.truncate(vid, vid.stat().st_size - 100)   # and the last frame's pixels cut short
    log = DriveLog.open(tmp_path / "log")
    assert len(log.messages["model_out"]) == 10  # everything before the cut
    loss = log.full_loss()
    assert loss.truncated_records == 2           # the partial entry and the cut frame
    assert loss.truncated_bytes == len(rec) // 2 + W * H * 3 // 2 - 100
    assert "partial record" in loss.text()
    assert len(log.video("road_frames")) == 9


def test_a_corrupt_record_is_skipped_and_counted_and_reading_goes_on(tmp_path):
    write_log(tmp_path / "log", n=10)
    msgs = tmp_path / "log" / MESSAGES
    data = bytearray(msgs.read_bytes())
    data[len(data) // 2] ^= 0xFF
    msgs.write_bytes(bytes(data))
    log = DriveLog.open(tmp_path / "log")
    loss = log.full_loss()
    assert loss.corrupt_records == 1 and log.closed
    total = sum(len(v) for v in log.messages.values()) + len(log.frames["road_frames"])
    assert total == 10 + 10 + 10 - 1


def test_not_a_log_is_one_error(tmp_path):
    with pytest.raises(LogError, match="no messages.tlog"):
        DriveLog.open(tmp_path)
    (tmp_path / MESSAGES).write_bytes(b"garbage")
    with pytest.raises(LogError, match="no start entry"):
        DriveLog.open(tmp_path)


def test_diff_names_added_removed_changed_fields_and_the_first_divergent_frame(tmp_path):
    write_log(tmp_path / "ref", n=12)
    write_log(tmp_path / "same", n=12)
    write_log(tmp_path / "new", n=12, offset=lambda k: 0.01 * k + (0.5 if k >= 7 else 0.0),
              skip=(3,))
    ref, same, new = (DriveLog.open(tmp_path / n) for n in ("ref", "same", "new"))
    payloads = {"model_out": "model_out", "control_cmd": "control_cmd"}
    kw = dict(channels=["model_out", "control_cmd"], payloads=payloads,
              model_channel="model_out")
    assert compare(same, ref, **kw).ok
    r = compare(new, ref, **kw)
    assert not r.ok and r.first_divergent_frame == 3
    mo = next(c for c in r.channels if c.channel == "model_out")
    assert mo.removed == [3] and mo.added == [] and mo.changed == list(range(7, 12))
    off = next(f for f in mo.fields if f.name == "offset_m")
    assert off.changed == 5 and off.max_abs == pytest.approx(0.5, abs=1e-6)
    assert next(f for f in mo.fields if f.name == "heading_rad").changed == 0
    text, md = render_text(r), render_markdown(r)
    assert "first divergent frame 3" in text and "offset_m: 5 over tolerance" in text
    assert "| `model_out.offset_m` | 5 |" in md and "| `model_out` | 11 | 0 | 1 | 5 |" in md
    # A tolerance per field: the offset change passes, the missing frame still does not.
    r2 = compare(new, ref, **kw, tolerances=parse_tolerances(["model_out.offset_m=0.6",
                                                              "control_cmd=1"]))
    assert [c.changed for c in r2.channels] == [[], []] and not r2.ok


def test_model_time_gate_compares_p99_and_max_with_the_reference(tmp_path):
    write_log(tmp_path / "ref", latency_ms=5.0)
    write_log(tmp_path / "slow", latency_ms=12.0)
    ref, slow = DriveLog.open(tmp_path / "ref"), DriveLog.open(tmp_path / "slow")
    kw = dict(channels=["model_out"], payloads={"model_out": "model_out"},
              model_channel="model_out")
    r = compare(slow, ref, **kw)
    assert not r.gate.ok and "p99 12.00 ms > 1.5 x REF 5.00 ms" in r.gate.why
    assert r.channels[0].ok and not r.ok
    assert compare(slow, ref, **kw, p99_ratio=3, max_ratio=3).ok


def test_only_gated_channels_decide_and_presence_has_a_tolerance_and_values_are_shown(tmp_path):
    write_log(tmp_path / "ref", n=12)
    write_log(tmp_path / "new", n=12, offset=lambda k: 0.01 * k + (0.5 if k >= 7 else 0.0),
              skip=(3,))
    ref, new = DriveLog.open(tmp_path / "ref"), DriveLog.open(tmp_path / "new")
    kw = dict(channels=["model_out", "control_cmd"],
              payloads={"model_out": "model_out", "control_cmd": "control_cmd"},
              model_channel="model_out")
    # Not gated: compared and reported, never the verdict (research, shadow channels).
    r = compare(new, ref, **kw, gated={"model_out"}, ignore=["model_out.offset_m"],
                tolerances=parse_tolerances(["model_out.removed=1"]))
    mo, cc = r.channels
    assert r.ok and mo.ok and mo.removed == [3] and not cc.ok and not cc.gated
    assert mo.ignored_fields == ["offset_m"] and "offset_m" not in [f.name for f in mo.fields]
    assert "control_cmd (not gated: reported only)" in render_text(r)
    assert compare(new, ref, **kw, gated={"model_out"}).ok is False   # offset_m counts again
    # A whole channel ignored; presence tolerances are counts per channel.
    r = compare(new, ref, **kw, ignore=["model_out"],
                tolerances=parse_tolerances(["control_cmd.removed=1",
                                             "control_cmd.steer_rad=0.6"]))
    assert r.ok and [c.channel for c in r.channels] == ["control_cmd"] and r.ignored == ["model_out"]
    assert not compare(new, ref, **kw, ignore=["model_out"],
                       tolerances=parse_tolerances(["control_cmd.steer_rad=0.6"])).ok
    # Values, not only counts: the first divergent messages of each field, every id.
    r = compare(new, ref, **kw)
    off = next(f for f in r.channels[0].fields if f.name == "offset_m")
    assert [x["frame"] for x in off.examples] == list(range(7, 12))
    assert off.examples[0]["ref"] == pytest.approx(0.07) and off.examples[0]["run"] == pytest.approx(0.57)
    d = json.loads(render_json(r))
    assert d["channels"][0]["removed"] == [3] and d["channels"][0]["changed_count"] == 5
    assert d["channels"][0]["fields"][0]["examples"][0]["frame"] == 7
    assert "frame 7: ref 0.07 -> run 0.57" in render_text(r)
    assert "| `model_out.offset_m` | 7 | 0.07 | 0.57 |" in render_markdown(r)


def test_report_html_is_self_contained_with_the_verdict_the_channels_and_a_scrubber(tmp_path):
    """report.html parses, fetches nothing (every src/href a data: URI or an anchor),
    holds the verdict, the per-channel table and the divergent values; its scrubber has
    a frame per position and the signals' values at those frames; a hostile string (an
    error a worker printed) is escaped, never markup."""
    from html.parser import HTMLParser

    from supervisor.replay.derive import ReplayPlan
    from supervisor.replay.report import collect, render

    write_log(tmp_path / "ref", n=12)
    write_log(tmp_path / "new", n=12, offset=lambda k: 0.01 * k + (0.5 if k >= 7 else 0.0),
              skip=(3,))
    ref, new = DriveLog.open(tmp_path / "ref"), DriveLog.open(tmp_path / "new")
    payloads = {"model_out": "model_out", "control_cmd": "control_cmd"}
    r = compare(new, ref, channels=["model_out", "control_cmd"], payloads=payloads,
                model_channel="model_out")
    plan = ReplayPlan("camerad", "road_frames", "controlsd", "control_cmd", "modeld",
                      "model_out")
    summary = {"log": str(tmp_path / "ref"), "mode": "lockstep", "exit_code": 6,
               "frames": {"in_log": 12, "replayed": 12}, "model_latency_ms": {"p50": 5.0},
               "input_log_loss": {"text": "nothing lost <b>bold</b>"}}
    page = collect(tmp_path / "run", ref, new, ref, plan, summary, r, payloads)
    text = render(page)

    class Walk(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags, self.refs, self.text, self.ids = [], [], [], {}
            self._in = None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            self.tags.append(tag)
            self.refs += [v for k, v in attrs if k in ("src", "href", "action", "data") and v]
            if "id" in a:
                self.ids[a["id"]] = a
                self._in = a["id"]

        def handle_endtag(self, tag):
            self._in = None

        def handle_data(self, data):
            self.text.append((self._in, data))

    w = Walk()
    w.feed(text)
    w.close()
    assert w.tags.count("html") == 1 and w.tags.count("script") == 2
    assert w.refs and all(v.startswith("data:image/png;base64,") for v in w.refs), w.refs
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text and "<link" not in text
    verdict = "".join(t for i, t in w.text if i == "verdict")
    assert "DIFFERS (exit 6), first divergent frame 3" in verdict
    body = " ".join(t for _, t in w.text)
    for needle in ("model_out", "control_cmd", "model_out.offset_m", "DIFFERS",
                   "nothing lost <b>bold</b>"):
        assert needle in body, needle
    data = json.loads("".join(t for i, t in w.text if i == "scrub-data").replace("<\\/", "</"))
    assert data["frames"] == list(range(12)) and len(data["thumbs"]) == 12
    sig = {s["name"]: s for s in data["signals"]}
    assert sig["model_out.offset_m"]["run"]["8"] == pytest.approx(0.58)
    assert sig["model_out.offset_m"]["ref"]["8"] == pytest.approx(0.08)
    assert "3" not in sig["control_cmd.steer_rad"]["run"]     # skipped in the run
    assert int(w.ids["scrub"]["max"]) == 11
    # A failing run's error: escaped, and the verdict says FAILED with it.
    summary["error"] = "modeld exited; its last words: '</script><script>alert(1)</script>'"
    w = Walk()
    w.feed(render(collect(tmp_path / "run", ref, new, None, plan, summary, None, payloads)))
    assert w.tags.count("script") == 2                    # the page's own two, no third
    assert any("FAILED (exit 6)" in t and "alert(1)" in t for i, t in w.text if i == "verdict")


def test_the_default_verdict_leaves_research_and_shadow_channels_out(tmp_path):
    # the one-camera pipeline: a replay plays one camera (a replay of the default, the
    # car, is refused in one line: tests/test_vehicle_config.py)
    doc = minimal_doc()
    rdoc, _ = derive.replay_doc(doc, str(tmp_path / "log"), str(tmp_path / "run"),
                                str(tmp_path / "state"))
    cfg, _ = derive.write_config(rdoc, tmp_path, "p.toml")
    assert "shadow_out" in cfg.channels and derive.ACK in cfg.channels
    assert derive.verdict_channels(cfg) == {"road_frames", "model_out", "control_cmd"}


@pytest.mark.parametrize("spec", ["model_out", "x=-1", "=3", "a=b", "model_out.added=1.5",
                                  "added=1"])
def test_bad_tolerance_is_refused(spec):
    with pytest.raises(ValueError, match="CHANNEL"):
        parse_tolerances([spec])


def test_derived_configs_load_with_the_normal_loader(tmp_path):
    # the one-camera pipeline: a replay plays one camera (a replay of the default, the
    # car, is refused in one line: tests/test_vehicle_config.py)
    doc = minimal_doc()
    cfg, _ = derive.write_config(derive.record_doc(doc, str(tmp_path / "out")), tmp_path, "r.toml")
    rec = cfg.workers["recorder"]
    assert cfg.profile_of("recorder") == "research"
    assert cfg.domains["recorder"].extra_rw_binds == (str(tmp_path / "out"),)
    assert set(rec.reads) == set(cfg.channels)
    rdoc, plan = derive.replay_doc(doc, str(tmp_path / "log"), str(tmp_path / "run"),
                                   str(tmp_path / "state"))
    cfg2, _ = derive.write_config(rdoc, tmp_path, "p.toml")
    cam = cfg2.workers[plan.camera]
    assert "--lockstep" in cam.args and str(tmp_path / "log") in cam.args
    assert not any(w.warm_standby for w in cfg2.workers.values())
    assert "--log-clock" in cfg2.workers[plan.controls].args
    assert str(tmp_path / "log") in cfg2.domains["control"].extra_ro_binds
    # Lockstep: nothing refused as stale (a loaded machine is only slower); realtime
    # keeps the config's freshness limits, as the car would.
    assert all(c.spec.max_age_ms == 0 for c in cfg2.channels.values())
    rt, _ = derive.replay_doc(doc, str(tmp_path / "log"), str(tmp_path / "run"),
                              str(tmp_path / "state"), realtime=True)
    cfg3, _ = derive.write_config(rt, tmp_path, "rt.toml")
    assert cfg3.channels["road_frames"].spec.max_age_ms == 100
    assert "--realtime" in cfg3.workers[plan.camera].args
    assert "--log-clock" not in cfg3.workers[plan.controls].args


def test_replay_knobs_are_refused_in_a_vehicle_config(tmp_path):
    """Recorded frames or recorded time into control, or a camera paced by another
    domain, are simulation-only: the replay's derived config says so, and the same
    config as a vehicle config is refused naming each argument."""
    from supervisor.config import check_runtime, dumps, loads

    # the one-camera pipeline: a replay plays one camera (a replay of the default, the
    # car, is refused in one line: tests/test_vehicle_config.py)
    doc = minimal_doc()
    rdoc, plan = derive.replay_doc(doc, str(tmp_path / "log"), str(tmp_path / "run"),
                                   str(tmp_path / "state"))
    cfg, _ = derive.write_config(rdoc, tmp_path, "p.toml")
    assert cfg.supervisor.mode == "simulation"
    assert not [p for p in check_runtime(cfg, sandboxed=False) if "simulation" in p.reason]
    rdoc["supervisor"]["mode"] = "vehicle"
    # (lockstep's ages off: on the vehicle the loader refuses that for the actuation
    # channel itself, tests/test_config.py; given back here to reach the runtime checks)
    rdoc["channels"]["control_cmd"]["max_age_ms"] = 50
    bad = check_runtime(loads(dumps(rdoc), "vehicle.toml"), sandboxed=False)
    lines = [str(p) for p in bad if "simulation only" in p.reason]
    assert any(f"workers.{plan.controls}.args[" in ln and "'--log-clock'" in ln for ln in lines), lines
    assert any(f"workers.{plan.camera}.args[" in ln and "'--source log'" in ln for ln in lines), lines
    assert any("'--lockstep'" in ln for ln in lines), lines
    assert all("\n" not in ln for ln in lines)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args,needle", [
    (["replay", "nolog"], "no such directory"),
    (["replay", "{tmp}"], "neither a drive log"),
    (["replay", "{log}", "--tol", "model_out"], "--tol 'model_out'"),
    (["replay", "{log}", "--config", "{tmp}/missing.toml"], "cannot read the config"),
    # no source.toml beside the log: never the embedded default in its place
    (["replay", "{log}"], "source.toml: missing (the config this log was recorded with); "
                          "pass --config"),
    (["record", "{log}", "--seconds", "1"], "exists and is not an empty directory"),
    (["record", "{tmp}/new", "--seconds", "0"], "--seconds 0: must be > 0"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    write_log(tmp_path / "log", n=2)
    (tmp_path / "empty").mkdir()
    fill = {"tmp": str(tmp_path / "empty"), "log": str(tmp_path / "log")}
    r = _cli(*[a.format(**fill) for a in args], cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_progress_bar_follows_the_run_log_while_it_is_written(tmp_path):
    import io

    from supervisor.replay.run import _Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    w = write_log(tmp_path / "log", n=4, close=False)
    bar = _Progress(tmp_path / "log" / MESSAGES, 10, "model_out", out=out)
    bar.tick()
    assert "4/10 frames" in out.getvalue()
    w.message("model_out", 9, 1, 12, 8, 1, MODEL_OUT.encode(offset_m=1.0))
    bar.tick()
    assert out.getvalue().rstrip().endswith("fps") and "5/10 frames" in out.getvalue()
    assert "#" * 15 in out.getvalue()                 # half way
    quiet = io.StringIO()                             # not a terminal: no bar at all
    _Progress(tmp_path / "log" / MESSAGES, 10, "model_out", out=quiet).tick()
    assert quiet.getvalue() == ""


# `python -m supervisor.cli` as it runs where the 'replay' extra is not installed: the
# import system finds no `av` (PyAV), whatever site-packages holds.
_NO_AV = """
import runpy, sys
class NoAv:
    def find_spec(self, name, path=None, target=None):
        if name == "av" or name.startswith("av."):
            raise ModuleNotFoundError("No module named 'av'", name="av")
        return None
sys.meta_path.insert(0, NoAv())
sys.argv = ["supervisor"] + sys.argv[1:]
runpy.run_module("supervisor.cli", run_name="__main__")
"""


@pytest.mark.parametrize("args", [["replay", "{log}", "--out", "{tmp}/run"],
                                  ["record", "{tmp}/new", "--seconds", "1"]])
def test_without_the_replay_extra_is_one_line_naming_it(tmp_path, args):
    from supervisor.config import dumps, minimal_doc

    write_log(tmp_path / "log", n=2, video="h264")
    (tmp_path / "log" / "source.toml").write_text(dumps(minimal_doc()))
    (tmp_path / "empty").mkdir()
    fill = {"tmp": str(tmp_path / "empty"), "log": str(tmp_path / "log")}
    r = subprocess.run([sys.executable, "-c", _NO_AV, *[a.format(**fill) for a in args]],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "needs PyAV, which is not installed: pip install 'supervisor[replay]'" in r.stderr
    assert not (tmp_path / "empty" / "run").exists()


def test_record_and_fleet_progress_on_a_terminal_and_nothing_otherwise(tmp_path):
    import io
    import time

    from supervisor.events import EventLog
    from supervisor.replay.progress import FleetProgress, RecordProgress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    events = EventLog(stream=io.StringIO(), keep=True)
    events.emit("supervisor_start")
    events.emit("start", worker="camerad")
    events.emit("start", worker="recorder")
    events.emit("ready", worker="camerad")
    out = Tty()
    bar = RecordProgress(str(tmp_path / "log"), 30, out=out)
    bar.tick(events)
    assert "record: starting the pipeline: 1/2 workers ready" in out.getvalue()
    write_log(tmp_path / "log", n=5, close=False)
    events.emit("ready", worker="recorder")
    bar._next = 0
    bar.tick(events)
    assert out.getvalue().rstrip().endswith("s of 30 s, 5 frames, 10 messages, 0 dropped")
    bar.close()
    quiet = io.StringIO()
    RecordProgress(str(tmp_path / "log"), 30, out=quiet).tick(events)
    fp = FleetProgress(4, out=quiet)
    fp.update(1, 0, 2)
    assert quiet.getvalue() == ""
    fp = FleetProgress(4, out=out)
    fp.t0 = time.monotonic() - 10
    fp.update(2, 1, 2)
    assert "fleet: 2/4 logs done (1 failed), 2 running, 10 s, ETA 10 s" in out.getvalue()


def test_log_tool_info_cat_and_frames(tmp_path, capsys):
    """`supervisor log` (python -m supervisor.replay.logtool until the CLI has it): what a
    log holds and lost, a channel as CSV / JSON lines, frames as PNG; one line for a
    channel that is not there."""
    from supervisor.replay import logtool

    write_log(tmp_path / "log", n=6, skip=(2,), close=False)

    def tool(*args: str) -> subprocess.CompletedProcess:
        code = logtool.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    r = tool("info", str(tmp_path / "log"))
    assert r.returncode == 0, r.stderr
    assert "NOT closed" in r.stdout and "model_out: 5 messages (5 with a frame id, 5 receipts)" in r.stdout
    assert "road_frames: 6 frames 160x120 nv12, video raw 6 frames, ids 0..5" in r.stdout
    assert "loss: the log was never closed" in r.stdout
    d = json.loads(tool("info", str(tmp_path / "log"), "--format", "json").stdout)
    assert d["closed"] is False and d["channels"]["control_cmd"]["messages"] == 5
    r = tool("cat", str(tmp_path / "log"), "model_out", "--format", "csv")
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sequence,frame_id,publish_ts_ns,capture_ts_ns,offset_m,")
    assert len(lines) == 6 and lines[0].endswith("latency_ms")
    js = [json.loads(ln) for ln in tool("cat", str(tmp_path / "log"), "control_cmd").stdout.splitlines()]
    assert [j["frame_id"] for j in js] == [0, 1, 3, 4, 5] and js[3]["steer_rad"] == pytest.approx(-0.04)
    r = tool("frames", str(tmp_path / "log"), "--out", str(tmp_path / "png"), "--every", "2")
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "0.png", "2.png", "4.png"]
    r = tool("cat", str(tmp_path / "log"), "nope")
    assert r.returncode == 2 and "no channel 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_a_clip_absent_inside_a_sandbox_says_it_is_not_visible_there(tmp_path, monkeypatch):
    pytest.importorskip("av", reason="the 'replay' extra (PyAV) is not installed")
    from workers.camerad.video import SourceError, VideoFileSource

    clip = tmp_path / "dashcam.mp4"          # exists on the host, not bound into a sandbox
    monkeypatch.setenv("TRIO_SANDBOXED", "1")
    with pytest.raises(SourceError, match="not visible inside the sandbox .*extra_ro_binds"):
        VideoFileSource(clip)
    monkeypatch.setenv("TRIO_SANDBOXED", "0")  # outside a sandbox: the plain truth
    with pytest.raises(SourceError, match="not a playable video"):
        VideoFileSource(clip)


def test_an_internal_error_inside_a_nursery_names_the_exception_not_the_group(capsys):
    """trio wraps a failure in an ExceptionGroup ('Exceptions from Trio nursery'): the
    one line names what failed inside it and where, and a full disk inside one is
    still exit 8."""
    import errno

    from supervisor.replay.commands import _internal

    def fail(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as x:
            try:
                raise ExceptionGroup("Exceptions from Trio nursery", [x])
            except ExceptionGroup as g:
                return g

    assert _internal("replay", fail(KeyError("camerad"))) == 1
    err = capsys.readouterr().err
    assert "internal error: KeyError: 'camerad' (" in err and "ExceptionGroup" not in err
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x/log/messages.tlog")
    assert _internal("replay", fail(full)) == 8
    assert "disk full: /runs/x/log/messages.tlog" in capsys.readouterr().err


def test_a_video_index_or_description_that_lies_is_loss_never_a_traceback(tmp_path):
    """A log's video index and description are the log's word: an index record naming
    bytes already indexed (one record repeated: it would make a cut copy one frame many
    times), a raw frame that is not one frame of the described size, a size that is a
    string or negative: skipped and counted, or one LogError line."""
    from supervisor.replay.cut import cut
    from supervisor.replay.logfmt import VideoReader

    write_log(tmp_path / "log", n=4)
    vidx = tmp_path / "log" / "road_frames.vidx"
    raw = vidx.read_bytes()
    vidx.write_bytes(raw + raw[:40] * 50)             # frame 0's record, CRC and all, again
    v = VideoReader(tmp_path / "log", "road_frames")
    assert [e.frame_id for e in v.index] == [0, 1, 2, 3]
    assert v.loss.corrupt_records == 50 and "overlap an earlier frame's" in v.loss.problems[0]
    v.close()
    cut(tmp_path / "log", tmp_path / "cut", None, None)
    src_size = (tmp_path / "log" / "road_frames.nv12").stat().st_size
    assert (tmp_path / "cut" / "road_frames.nv12").stat().st_size == src_size
    assert len(DriveLog.open(tmp_path / "cut").video("road_frames")) == 4

    desc = tmp_path / "log" / "road_frames.video"
    good = json.loads(desc.read_text())
    for bad, needle in (({"width": "160"}, "width '160'"), ({"width": -160}, "width -160"),
                        ({"height": 121}, "height 121"), ({"codec": "av1"}, "codec 'av1'"),
                        ({"fps": 0}, "fps 0")):
        desc.write_text(json.dumps({**good, **bad}))
        with pytest.raises(LogError, match=f"no usable video description .*{needle}"):
            VideoReader(tmp_path / "log", "road_frames")
    desc.write_text(json.dumps({**good, "width": 80, "height": 60}))   # smaller than stored
    v = VideoReader(tmp_path / "log", "road_frames")
    assert v.index == [] and "not one 80x60 NV12 frame" in v.loss.problems[0]
    v.close()


def test_record_without_a_config_derives_from_the_one_camera_pipeline():
    """The embedded default is the car (three cameras), which a replay cannot play yet:
    `record` (live or --clip) without --config uses the one-camera pipeline, and says so
    in the source name; the car itself is refused in one line naming its cameras."""
    from supervisor.config import default_doc
    from supervisor.replay.derive import (MINIMAL_SOURCE, DeriveError, plan_of, read_doc,
                                          record_doc)

    doc, source = read_doc(None)
    assert source == MINIMAL_SOURCE
    assert plan_of(record_doc(doc, "/tmp/x")).camera == "camerad"
    with pytest.raises(DeriveError, match="camera workers"):
        plan_of(default_doc())


def test_a_log_is_read_in_chunks_with_the_same_records_and_loss(tmp_path, monkeypatch):
    """read_stream's memory is a chunk plus one record, never the file (red team round
    5 row 5): with 7-byte chunks every record, offset and loss count is the same as with
    the whole file in one read, across a corrupt run, a bad CRC and a cut last record."""
    from supervisor.replay import logfmt

    write_log(tmp_path / "log", n=3)
    p = tmp_path / "log" / logfmt.MESSAGES
    good = p.read_bytes()
    first = logfmt.REC.size + logfmt.REC.unpack_from(good, 0)[1]
    bad = bytearray(good)
    bad[first + logfmt.REC.size + 2] ^= 0xFF                  # the second record's CRC
    p.write_bytes(good[:first] + b"\0" * 37 + bytes(bad[first:]) + good[:first][:-3])

    def read(chunk: int):
        monkeypatch.setattr(logfmt, "READ_CHUNK", chunk)
        loss = logfmt.Loss()
        recs = list(logfmt.read_stream(p, loss=loss))
        return recs, (loss.corrupt_records, loss.corrupt_bytes, loss.truncated_records,
                      loss.truncated_bytes, loss.problems)

    whole = read(1 << 30)
    assert whole[1][0] == 2 and whole[1][2] == 1, whole[1]    # the run and the CRC; the cut
    assert read(7) == whole


def test_a_log_file_of_holes_is_one_line(tmp_path):
    """A recorder can ftruncate its files to any size without writing a block: such a
    file is refused before anything reads it (exit 2, one line), whatever its size."""
    write_log(tmp_path / "log", n=2)
    os.truncate(tmp_path / "log" / "messages.tlog", 256 << 20)
    with pytest.raises(LogError, match="a file of holes"):
        DriveLog.open(tmp_path / "log")
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "log", "info",
                        str(tmp_path / "log")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
