"""supervisor record / replay end to end, every worker in its real sandbox: a recorded
drive replays bit-identically twice, a different model version gives a readable diff
and exit 6, a truncated log replays with its loss reported, --realtime keeps the
recorded pace, camerad plays a plain video file, and a fleet replays in parallel with a
failed job retried once and reported (and on a local Ray cluster)."""
from __future__ import annotations

import dataclasses

import atexit
import functools
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from supervisor.config import derive, dumps, minimal_doc
from supervisor.replay.drivelog import DriveLog
from supervisor.replay.logfmt import MESSAGES

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("record/replay run the sandboxed pipeline as root does", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
W, H = 320, 240

PIPE = ("camerad", "modeld", "controlsd")


@functools.lru_cache(maxsize=1)
def small_demo() -> dict[str, str]:
    """The demo model built for this module's small frames, once per test process: the
    shipped artifact's kernels take a 1928x1208 Y plane as it is (input ABI 2) and reject
    a 320x240 frame (`too_small`), as a car's model should. Signed with a test key.
    No build-time rehearsal (a fresh process loading the bundle, golden compared: what
    modeld does at every start of it in this module's sandboxes, and what
    test_model_artifact checks of the build tool)."""
    if shutil.which("clang") is None:
        pytest.skip("building the small demo model needs clang (scripts/install.sh --dev)")
    out = Path(tempfile.mkdtemp(prefix="small-demo-"))
    # Gone with the test process (88 of these were left in /tmp here): the sandboxes
    # that load it are all stopped by then.
    atexit.register(shutil.rmtree, out, True)
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEDB", "DEV", "PARALLEL")}
    b = subprocess.run([sys.executable, "-m", "workers.modelbuild", "--out", str(out / "m"),
                        "--key", str(out / "k.key"), "--seed", "0", "--frames", "40",
                        "--val-frames", "8", "--width", str(W), "--height", str(H),
                        "--no-rehearsal"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    name = json.loads((out / "m" / "manifest.json").read_text())["model"]["name"]
    return dict(artifact=str(out / "m"), pubkey=str(out / "k.pub"), name=name)


def config(path: Path, *, camera_args=("--width", str(W), "--height", str(H), "--fps", "20"),
           control_binds: tuple[str, ...] = (), mode: str = "vehicle", **model) -> Path:
    """The vehicle's own pipeline (the one-camera config without research), small frames
    and the demo model built for them (`small_demo`), no standbys; `model` overrides the
    trusted artifact, key and name."""
    m = {**(model if "artifact" in model else small_demo()), **model}
    path.write_text(dumps(derive(minimal_doc(), drop=("workers.research", "channels.shadow_out"),
                                 set={"workers.camerad.args": list(camera_args),
                                      "channels.road_frames.slot_size": "256KiB",
                                      "channels.model_out.slot_count": 8,
                                      "channels.control_cmd.slot_count": 16,
                                      "domains.control.extra_ro_binds": list(control_binds),
                                      "supervisor.mode": mode,
                                      "models.lane-offset.artifact": m["artifact"],
                                      "models.lane-offset.public_key": m["pubkey"],
                                      "models.lane-offset.expect_name": m["name"],
                                      **{f"workers.{w}.warm_standby": False for w in PIPE}})))
    return path


def cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRIO_STATE_DIR": str(cwd / "state")}  # never the machine's latch
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replay")


@pytest.fixture(scope="module")
def recorded(work) -> Path:
    """Two seconds of the synthetic camera, lossless (raw NV12)."""
    cfg = config(work / "drive.toml")
    r = cli("record", str(work / "drive"), "--config", str(cfg), "--seconds", "2",
            "--video", "raw", "--quiet", cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    return work / "drive"


# --ref self on a lossless log: the model sees the recorded pixels and controlsd steps
# where the car's law did, so both compare (the steer up to float32's last bit while a
# ramp the log began in lasts: docs/replay.md); a log cut while the pipeline ran has
# outputs and commands at its ends whose frames it lacks, or frames whose outputs it
# lacks (added/removed at the ends). Model time is reported, not gated, by default.
SELF = ("--ref", "self", *(f"--tol={c}.{k}=2" for c in ("model_out", "control_cmd")
                            for k in ("added", "removed")),
        "--tol", "control_cmd.steer_rad=1e-6")


@pytest.fixture(scope="module")
def first_run(work, recorded) -> Path:
    r = cli("replay", str(recorded), "--out", str(work / "run1"), "--no-progress", *SELF,
            cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return work / "run1"


def test_ref_self_compares_the_cars_commands_and_fails_when_the_law_changes(
        work, recorded, first_run):
    """The drive's commands carry the frame id of the output they used and when the
    law stepped: the replay pairs them by frame and steps where the car did, so its
    commands are the car's bit for bit; the same replay with one gain changed in the
    config exits 6 on control_cmd and says where (model outputs still equal)."""
    live = DriveLog.open(recorded).messages["control_cmd"]
    assert all(m.frame_id is not None for m in live[-10:])
    engaged = [m for m in live if m.array[1] == 1.0 and abs(m.array[0]) > 1e-4]
    assert engaged, "the car never steered: a gain change could not show"
    d = json.loads((first_run / "diff.json").read_text())
    cmd = {c["channel"]: c for c in d["channels"]}["control_cmd"]
    n = len(DriveLog.open(recorded).video("road_frames"))
    assert not cmd["note"] and cmd["compared"] >= n - 2, cmd
    assert cmd["changed"] == [] and len(cmd["removed"]) <= 2 and d["ok"]

    doc = __import__("tomllib").loads((work / "drive.toml").read_text())
    doc["workers"]["controlsd"]["args"] = [*doc["workers"]["controlsd"].get("args", []),
                                           "--k-p", "0.2", "--k-h", "2.0"]   # 0.05, 0.5 in the car
    (work / "gain.toml").write_text(dumps(doc))
    r = cli("replay", str(recorded), "--out", str(work / "run-gain"), "--config",
            str(work / "gain.toml"), "--no-progress", "--format", "json",
            "--report", str(work / "gain.html"), *SELF, cwd=work)
    assert r.returncode == 6, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(r.stdout)["diff"]
    by = {c["channel"]: c for c in d["channels"]}
    assert by["model_out"]["changed"] == [] and by["model_out"]["ok"]
    assert by["control_cmd"]["changed"] and not by["control_cmd"]["ok"]
    steer = {f["name"]: f for f in by["control_cmd"]["fields"]}["steer_rad"]
    assert steer["changed"] > 0 and steer["examples"][0]["ref"] != steer["examples"][0]["run"]
    # (an output at the log's start without its frame counts as divergent too)
    assert d["first_divergent_frame"] <= by["control_cmd"]["changed"][0]
    # The page for the CI job: the same in the run and at --report, self-contained,
    # with the verdict, the channels and a frame per scrubber position.
    page = (work / "gain.html").read_text()
    assert page == (work / "run-gain" / "report.html").read_text()
    assert f"DIFFERS (exit 6), first divergent frame {d['first_divergent_frame']}" in page
    assert "<td>control_cmd</td>" in page and "<td>model_out</td>" in page
    assert page.count("data:image/png;base64,") >= n and "https:" not in page
    assert "within tolerance (exit 0)" in (first_run / "report.html").read_text()
    s = json.loads((first_run / "summary.json").read_text())
    assert s["exit_code"] == 0 and "verdict" not in s        # (null, pending, until the diff)


def test_record_writes_every_channel_with_receipts_and_lifecycle(recorded):
    log = DriveLog.open(recorded)
    # (the recorder's own drops, on a loaded runner, are the log's: said, not lost here)
    assert log.closed and not dataclasses.replace(log.full_loss(), recorder_drops={}).any
    assert set(log.channels) == {"road_frames", "model_out", "control_cmd"}
    frames = log.frames["road_frames"]
    assert len(frames) >= 30                       # ~40 at 20 fps; the recorder may start late
    assert len(log.video("road_frames")) == len(frames)
    outs = log.messages["model_out"]
    assert len(outs) >= len(frames) - 2 and all(m.receipt is not None for m in outs)
    assert {m.receipt.frame_id for m in outs} <= {f.frame_id for f in frames} | {
        frames[0].frame_id - 1, frames[0].frame_id - 2}
    assert len(log.messages["control_cmd"]) > len(outs)   # live: also between frames
    events = {e["event"] for e in log.events}
    assert {"supervisor_start", "ready", "all_ready", "supervisor_exit"} <= events
    assert (recorded / "source.toml").is_file()
    # The recorder wrote as its own domain's host user, not as root.
    assert pwd.getpwuid((recorded / MESSAGES).stat().st_uid).pw_name == "trio-research"
    # Its pixels are the camera's own (raw): frame k of the synthetic scene.
    from workers.camerad.synthetic import SyntheticRoad

    road = SyntheticRoad(W, H, 0, fps=20.0)
    e, data = next(iter(log.video("road_frames").frames()))
    y, uv, _ = road.render(e.frame_id)
    assert data == y.tobytes() + uv.tobytes()


def test_two_replays_are_bit_identical_under_load_and_match_the_recorded_model_outputs(
        work, recorded, first_run):
    # The CI gate, with its defaults: the second replay runs while two CPU hogs keep
    # both cores busy, and must still compare equal (lockstep: a loaded machine is only
    # slower). Before, the default model time gate failed it (p99 6.56 ms > 1.5 x REF
    # 0.90 ms, exit 6, "model time only"): timings are reported, gated only when asked
    # (test_journey_replay).
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        r = cli("replay", str(recorded), "--out", str(work / "run2"), "--ref", str(first_run),
                "--no-progress", cwd=work)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "result: within tolerance" in r.stdout
    assert "model time (reported, not gated" in r.stdout
    s2 = json.loads((work / "run2" / "summary.json").read_text())
    assert s2["drops"] == {}, s2["drops"]            # lockstep: the recorder missed nothing
    a, b = DriveLog.open(first_run / "log"), DriveLog.open(work / "run2" / "log")
    src = DriveLog.open(recorded)
    n = len(src.video("road_frames"))
    for ch in ("model_out", "control_cmd"):
        # (a command without a frame id is the supervisor's SAFE last word at the stop,
        # reason 10: the recorder, still attached under load, sometimes has it; it is no
        # output of the pipeline's and the gate, keyed by frame id, never compares it)
        last = [m for m in a.messages[ch] + b.messages[ch] if m.frame_id is None]
        assert all(ch == "control_cmd" and m.array[2] == 10.0 for m in last), last
        x = {m.frame_id: m.array.tobytes() for m in a.messages[ch] if m.frame_id is not None}
        y = {m.frame_id: m.array.tobytes() for m in b.messages[ch] if m.frame_id is not None}
        assert len(x) == n and x == y                     # every frame, byte for byte
    # Lossless video: the replayed model saw the recorded pixels, so its outputs are
    # the ones the car computed live, bit for bit.
    live = {m.frame_id: m.array.tobytes() for m in src.messages["model_out"]}
    replayed = {m.frame_id: m.array.tobytes() for m in a.messages["model_out"]}
    common = set(live) & set(replayed)
    assert len(common) >= n - 2
    assert all(live[f] == replayed[f] for f in common)
    s = json.loads((first_run / "summary.json").read_text())
    assert s["mode"] == "lockstep" and s["frames"]["replayed"] == n
    assert s["frames"]["step_timeouts"] == 0 and s["exit_code"] == 0
    assert s["model_latency_ms"]["n"] == n and s["model_latency_ms"]["p99"] > 0
    assert s["frames_per_s"] > 0 and s["speed_vs_realtime"] > 0
    assert (first_run / "plot.png").stat().st_size > 10_000


def test_a_cut_of_the_drive_replays_its_part_with_the_chosen_signals(work, recorded, first_run):
    """`log cut` writes a part of the drive as a log of its own (frames, their pixels
    byte for byte, their outputs and commands, the recorded config) that `log info`
    reads; `replay --start/--end` plays that part only (cut into RUN/input), compares
    it with the whole drive's run on those frames, and plots and shows the --plot
    signals."""
    src = DriveLog.open(recorded)
    ids = [e.frame_id for e in src.video("road_frames").index]
    a, b = ids[5], ids[15]                                # f<a> in, f<b> out: 10 frames
    r = cli("log", "cut", str(recorded), str(work / "part"), "--start", f"f{a}", "--end",
            f"f{b}", cwd=work)
    assert r.returncode == 0, r.stderr
    part = DriveLog.open(work / "part")
    assert part.closed and not dataclasses.replace(part.full_loss(), recorder_drops={}).any
    assert [f.frame_id for f in part.frames["road_frames"]] == ids[5:15]
    whole_px = dict(src.video("road_frames").frames())
    for e, px in part.video("road_frames").frames():   # raw: the recorded bytes
        assert px == next(v for k, v in whole_px.items() if k.frame_id == e.frame_id)
    assert {m.frame_id for m in part.messages["model_out"]} <= set(ids[5:15])
    assert (work / "part" / "source.toml").read_bytes() == (recorded / "source.toml").read_bytes()
    r = cli("log", "info", str(work / "part"), cwd=work)
    assert r.returncode == 0 and f"frames f{a}..f{b - 1}" in r.stdout, r.stdout + r.stderr
    assert "road_frames: 10 frames" in r.stdout and ("loss: nothing lost" in r.stdout
                                                      or "loss: the recorder dropped" in r.stdout)

    # (bad ranges and unknown --plot names, one line and exit 2: tests/test_replay_cut.py)

    # The whole drive's run (REF) seen on the part's frames only: nothing removed.
    r = cli("replay", str(recorded), "--out", str(work / "run-part"), "--start", f"f{a}",
            "--end", f"f{b}", "--ref", str(first_run), "--no-progress", "--format", "json",
            "--plot", "control_cmd.steer_rad", "--plot", "model_out.latency_ms",
            *SELF[2:], cwd=work)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)
    s = out["summary"]
    assert s["frames"]["in_log"] == s["frames"]["replayed"] == 10
    assert s["range"]["frames"] == [a, b - 1] and s["log"] == str(recorded)
    by = {c["channel"]: c for c in out["diff"]["channels"]}
    assert by["model_out"]["compared"] >= 9 and by["model_out"]["changed"] == []
    assert by["model_out"]["removed"] == [], by["model_out"]
    run = DriveLog.open(work / "run-part" / "log")
    assert {m.frame_id for m in run.messages["model_out"]} == set(ids[5:15])
    page = (work / "run-part" / "report.html").read_text()
    assert f"<h1>replay of drive f{a}..f{b - 1}</h1>" in page       # the source, not input/
    blob = json.loads(page.split('id="scrub-data">')[1].split("</script>")[0])
    assert [x["name"] for x in blob["signals"]] == ["control_cmd.steer_rad",
                                                    "model_out.latency_ms"]
    assert blob["frames"] == ids[5:15]
    png = (work / "run-part" / "plot.png").read_bytes()
    # Two panels, one per --plot signal (9 x (1.2 + 2 x 2) inches at 80 dpi).
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[20:24], "big") == 416


def test_a_different_model_version_gives_a_readable_diff_and_exit_6(work, recorded, first_run):
    if shutil.which("clang") is None:
        pytest.skip("building a second model needs clang (scripts/install.sh --dev)")
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEDB", "DEV", "PARALLEL")}
    b = subprocess.run([sys.executable, "-m", "workers.modelbuild", "--out",
                        str(work / "model2"), "--key", str(work / "keys" / "m2.key"),
                        "--seed", "3", "--frames", "40", "--val-frames", "8", "--width",
                        str(W), "--height", str(H), "--version", "2.0.0",
                        "--no-rehearsal"],                 # (as small_demo: modeld loads it)
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    name = json.loads((work / "model2" / "manifest.json").read_text())["model"]["name"]
    cfg = config(work / "model2.toml", artifact=str(work / "model2"),
                 pubkey=str(work / "keys" / "m2.pub"), name=name)
    r = cli("replay", str(recorded), "--out", str(work / "run-m2"), "--config", str(cfg),
            "--ref", str(first_run), "--format", "markdown", "--no-progress", cwd=work)
    assert r.returncode == 6, r.stdout + r.stderr[-3000:]
    md = r.stdout
    first = DriveLog.open(recorded).video("road_frames").index[0].frame_id
    assert "### Replay comparison: ❌ **differs**" in md
    assert f"first divergent frame: **{first}**" in md
    assert "| `model_out.offset_m` |" in md and "| `control_cmd` |" in md
    assert (work / "run-m2" / "diff.md").read_text() in md
    s = json.loads((work / "run-m2" / "summary.json").read_text())
    assert s["diff"]["ok"] is False and s["diff"]["first_divergent_frame"] == first
    assert s["exit_code"] == 6, s.get("exit_code")     # what the command exited with


def test_a_truncated_log_replays_in_real_time_with_the_loss_reported(work, recorded):
    cut = work / "cut"
    shutil.copytree(recorded, cut)
    vid, idx = cut / "road_frames.nv12", cut / "road_frames.vidx"
    whole = len(DriveLog.open(recorded).video("road_frames"))
    # What a crash while writing leaves: the last index record half written, the video
    # cut inside the frame before it, the message stream cut inside its last record.
    os.truncate(idx, idx.stat().st_size - 15)
    os.truncate(vid, vid.stat().st_size - W * H * 3 // 2 - 1000)
    os.truncate(cut / MESSAGES, (cut / MESSAGES).stat().st_size - 7)
    r = cli("replay", str(cut), "--out", str(work / "run-cut"), "--realtime", "--no-progress",
            cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "input log: dropped 3 partial record(s) at the end" in r.stdout
    # The cut took the closing summary, and two frames' pixels: both are loss.
    assert "the log was never closed" in r.stdout
    assert f"2 of {whole} frames have no video" in r.stdout
    s = json.loads((work / "run-cut" / "summary.json").read_text())
    assert s["frames"]["in_log"] == whole - 2 == s["frames"]["replayed"]
    assert s["input_log_loss"]["partial_records"] == 3
    assert any("never indexed" in p for p in s["input_log_loss"]["problems"])
    # --realtime: paced at the recorded capture times, not as fast as it can.
    assert s["mode"] == "realtime"
    assert 0.8 < s["speed_vs_realtime"] < 1.1, s
    assert s["model_latency_ms"]["n"] >= whole - 4


CLIP_FRAMES = 30


@pytest.fixture(scope="module")
def clip_log(work) -> Path:
    """A drive recorded (H.264, the default) from a dashcam-style MP4 in one command
    (`record --clip`: the clip once through, from the pipeline's READY), by a recorder
    made slow (150 ms per frame written, as a slow disk would) so that it has to
    drop."""
    import av

    from workers.camerad.synthetic import SyntheticRoad

    clips = work / "clips"
    clips.mkdir()
    clip = clips / "dashcam.mp4"
    road = SyntheticRoad(W, H, 5, fps=10.0)
    with av.open(str(clip), "w") as c:
        st = c.add_stream("libx264", rate=10)
        st.width, st.height, st.pix_fmt = W, H, "yuv420p"
        for k in range(CLIP_FRAMES):
            y, uv, _ = road.render(k)
            fr = av.VideoFrame.from_ndarray(np.concatenate([y, uv.reshape(H // 2, W)]),
                                            format="nv12")
            for p in st.encode(fr):
                c.mux(p)
        for p in st.encode(None):
            c.mux(p)
    os.chmod(clips, 0o755)
    cfg = config(work / "clip.toml")           # the car's config: record --clip derives
    r = cli("record", str(work / "from-clip"), "--config", str(cfg), "--clip", str(clip),
            "--quiet", "--recorder-arg=--io-delay-ms", "--recorder-arg=150", cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "recorder drops: " in r.stdout and "road_frames" in r.stdout.split("drops:")[1]
    return work / "from-clip"


def test_a_clip_records_in_one_command_from_its_first_frame_to_its_last(clip_log):
    """`record --clip`: the clip starts once the pipeline is READY (its first frame
    reaches the model and controlsd, whose command names it), plays once through and
    the recording ends by itself; the log replays with the clip's pipeline."""
    log = DriveLog.open(clip_log)
    assert log.frames["road_frames"][0].frame_id == 0        # the recorder saw frame 0

    def said(worker: str, text: str) -> list[str]:
        return [str(e.get("msg", e.get("status", ""))) for e in log.events
                if e.get("worker") == worker and text in str(e.get("msg", e.get("status", "")))]

    assert f"frames={CLIP_FRAMES} " in said("camerad", "replay=done")[0]
    # The clip's first frame was captured after modeld and controlsd were READY (one
    # clock: the supervisor's events and the frames' capture times are CLOCK_MONOTONIC).
    ready = {e["worker"]: e["mono_ns"] for e in log.events if e["event"] == "ready"}
    assert log.frames["road_frames"][0].capture_ts_ns > max(ready["modeld"],
                                                            ready["controlsd"])
    # (and the record, given no --seconds, ended by itself: the fixture's exit 0)
    src = __import__("tomllib").loads((clip_log / "source.toml").read_text())
    assert src["supervisor"]["mode"] == "simulation" and "recorder" not in src["workers"]


def test_camerad_plays_a_plain_video_file(clip_log):
    from workers.camerad.synthetic import SyntheticRoad

    log = DriveLog.open(clip_log)
    outs = log.messages["model_out"]
    # The clip's 10 fps, not camerad's default 20 (frame ids continue across loops).
    span_s = (outs[-1].capture_ts_ns - outs[0].capture_ts_ns) / 1e9
    assert 8 < (outs[-1].frame_id - outs[0].frame_id) / span_s < 12
    road = SyntheticRoad(W, H, 5, fps=10.0)
    e, data = next(iter(log.video("road_frames").frames()))
    y, _, _ = road.render(e.frame_id % CLIP_FRAMES)
    got = np.frombuffer(data, np.uint8)[:W * H].astype(int)
    assert np.abs(got - y.ravel().astype(int)).mean() < 8  # the clip's pictures (twice lossy)


def test_a_slow_recorder_drops_and_counts_never_the_control_domain(clip_log):
    log = DriveLog.open(clip_log)
    drops = log.drops["road_frames"]
    assert drops.dropped + drops.rejected >= 3             # it could not keep up: counted
    outs = log.messages["model_out"]
    published = outs[-1].frame_id - outs[0].frame_id + 1
    assert log.summary["road_frames"]["recorded"] < 0.85 * published
    # The pipeline did not wait for it: modeld took every frame (sequence and frame id
    # advance together), and nothing in the control domain restarted or missed a ping.
    # (Allowing two frames a loaded machine's modeld refused as stale on its own: the
    # recorder, dropping 20 and more, would show as many.)
    outs = log.messages["model_out"]
    lost = (outs[-1].frame_id - outs[0].frame_id) - (outs[-1].sequence - outs[0].sequence)
    assert 0 <= lost <= 2, lost
    # (camerad's own end is not the pipeline's: the clip played once through, camerad
    # exits, and its restart waits longer than the recording lasts: `record --clip`.
    # Under load its PyAV teardown can outlast its watchdog: killed then, after the end.)
    end = next(e["mono_ns"] for e in log.events if e.get("worker") == "camerad"
               and "replay=done" in str(e.get("msg", e.get("status", ""))))
    bad = [e for e in log.events if e["event"] in ("restart", "watchdog_missed", "fail_safe")
           and not (e.get("worker") == "camerad" and e["mono_ns"] > end)]
    assert bad == []


def test_fleet_replays_in_parallel_and_reports_a_bad_log_once(work, recorded, clip_log):
    """A log the fleet cannot read is one line naming it, never retried (it would fail
    the same way: before, it was tried twice and the fleet exited 7, "incomplete"), and
    the other log is replayed and judged all the same; the fleet exits 2, "could not
    run". (A failed job's retry: test_journey_replay's fleet test.)"""
    logs = work / "fleet-logs"
    logs.mkdir()
    shutil.copytree(clip_log, logs / "drive1")            # H.264, decoded by camerad
    broken = logs / "drive9"
    shutil.copytree(recorded, broken)
    os.truncate(broken / "road_frames.vidx", 10)          # no whole frame left: fails
    r = cli("replay", str(logs), "--jobs", "2", "--out", str(work / "fleet"), cwd=work)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"supervisor replay: {broken}: could not run (bad input, exit 2, not retried): "
        f"{broken}: the video of 'road_frames' has no whole frame"], r.stderr
    rep = json.loads((work / "fleet" / "fleet.json").read_text())
    by = {Path(j["log"]).name: j for j in rep["jobs"]}
    assert set(by) == {"drive1", "drive9"}                 # none missing
    assert by["drive1"]["status"] == "ok" and len(by["drive1"]["attempts"]) == 1
    assert by["drive1"]["frames"] == len(DriveLog.open(clip_log).video("road_frames"))
    assert by["drive9"]["status"] == "bad_input" and len(by["drive9"]["attempts"]) == 1
    assert "no whole frame" in by["drive9"]["attempts"][-1]["error"]
    assert rep["bad_input"] == 1 and rep["failed"] == rep["retried"] == 0
    assert rep["exit_code"] == 2 and not (work / "fleet" / "drive9.retry1").exists()
    assert "| `drive9` | could not run (bad input) (" in r.stdout


def test_a_stopped_fleet_stops_its_replays_and_passes_nothing(work, recorded):
    """SIGTERM (a CI job cancelled) to a fleet: before, the fleet only recorded it, ran
    every replay to the end and exited 0. Now the running replay is stopped in order and
    says it was interrupted, the next log is never started, the fleet exits 7 in one
    line, and the interrupted RUN is refused as a REF (its summary.json given, as a CI
    job keeps it)."""
    import signal
    import time

    logs = work / "stop-logs"
    logs.mkdir()
    for name in ("a", "b"):
        shutil.copytree(recorded, logs / name)
    out = work / "stopped"
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "replay", str(logs), "--jobs",
                          "1", "--out", str(out), "--realtime", "--no-progress"], cwd=work,
                         env={**os.environ, "TRIO_STATE_DIR": str(work / "state")},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "a" / "replay.toml").exists():     # a's pipeline is starting
            assert p.poll() is None and time.monotonic() < deadline, p.poll()
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 7, stdout + stderr[-3000:]
    assert stderr.strip().splitlines() == [
        "supervisor replay: interrupted by SIGTERM: 2 of 2 logs not judged (fleet.json lists "
        "them); exit 7"], stderr
    rep = json.loads((out / "fleet.json").read_text())
    assert rep["interrupted"] == "SIGTERM" and rep["retried"] == 0
    assert [(j["status"], len(j["attempts"])) for j in rep["jobs"]] == [("interrupted", 1)] * 2
    assert rep["jobs"][1]["attempts"][0]["error"] == "not run: the fleet was stopped"
    s = json.loads((out / "a" / "summary.json").read_text())
    assert s["exit_code"] == 7 and s["interrupted"] == "SIGTERM", s
    assert s["error"].startswith("interrupted by SIGTERM after "), s["error"]
    assert not (out / "a" / "diff.md").exists() and not (out / "b").exists()
    r = cli("replay", str(recorded), "--out", str(work / "vs-stopped"), "--ref",
            str(out / "a" / "summary.json"), "--no-progress", cwd=work, timeout=60)
    assert r.returncode == 2 and "not a REF" in r.stderr, r.stderr
    assert "interrupted by SIGTERM" in r.stderr and not (work / "vs-stopped").exists()


def test_fleet_on_a_local_ray_cluster(work, recorded):
    pytest.importorskip("ray", reason="the 'fleet' extra (ray) is not installed")
    logs = work / "ray-logs"
    logs.mkdir()
    shutil.copytree(recorded, logs / "drive0")
    r = cli("replay", str(logs), "--ray", "local", "--out", str(work / "ray-fleet"),
            "--format", "json", cwd=work, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["mode"] == "ray local" and rep["ok"] == 1 and rep["failed"] == 0
    # The Ray task ran a whole replay: its summary is there, with every frame.
    n = len(DriveLog.open(recorded).video("road_frames"))
    assert [j["frames"] for j in rep["jobs"]] == [n]


def test_a_recorders_tampering_with_its_log_is_refused_in_one_line(work, recorded):
    """The log directory belongs to the recorder's sandbox user. What it could plant
    there after a compromise: its own config (the replay would run it as root), a symlink
    to a host file, a FIFO. The replay refuses each with one line, before it starts."""
    import pwd
    import shutil

    def tampered(name: str, how) -> Path:
        d = work / f"tamper-{name}"
        shutil.copytree(recorded, d, symlinks=True)
        how(d)
        return d

    def own_config(d: Path) -> None:          # replaced by the recorder: its own file
        u = pwd.getpwnam("trio-research")
        (d / "source.toml").unlink()
        (d / "source.toml").write_text('[workers.x]\ndomain = "research"\ncommand = ["/bin/sh"]\n')
        os.chown(d / "source.toml", u.pw_uid, u.pw_gid)

    def symlink(d: Path) -> None:
        (d / "messages.tlog").unlink()
        (d / "messages.tlog").symlink_to("/etc/shadow")

    def fifo(d: Path) -> None:
        (d / "road_frames.vidx").unlink()
        os.mkfifo(d / "road_frames.vidx")

    def deleted(d: Path) -> None:            # removed: the replay must not guess
        (d / "source.toml").unlink()

    for name, how, says in [("config", own_config, "not written by the recording supervisor"),
                            ("deleted", deleted, "source.toml: missing"),
                            ("symlink", symlink, "a symbolic link"),
                            ("fifo", fifo, "not a regular file")]:
        r = cli("replay", str(tampered(name, how)), "--out", str(work / f"run-{name}"),
                "--no-progress", cwd=work, timeout=60)
        err = r.stderr.strip().splitlines()
        assert r.returncode not in (0, 6) and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert any(says in line for line in err), (name, err)
        assert not (work / f"run-{name}" / "summary.json").exists()


def test_a_failed_replay_names_the_worker_and_the_event(work, recorded):
    """A config whose frame slots are too small for the log's frames: camerad fails on
    its first frame. The replay says which worker, which event and the worker's own last
    words, in one line on stderr (and in summary.json), not just "no run log"."""
    import tomllib

    doc = tomllib.loads(config(work / "small-slots.toml").read_text())
    doc["channels"]["road_frames"]["slot_size"] = "64KiB"
    (work / "small-slots.toml").write_text(dumps(doc))
    r = cli("replay", str(recorded), "--config", str(work / "small-slots.toml"), "--out",
            str(work / "run-small-slots"), "--no-progress", cwd=work)
    assert r.returncode == 7, r.stdout + r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("supervisor replay: event 'exit': camerad exited with code 1"), line
    assert "slot holds 65536 bytes" in line and "fail_safe" in line, line
    assert "Traceback" not in line
    s = json.loads((work / "run-small-slots" / "summary.json").read_text())
    assert s["exit_code"] == 7 and s["error"] == line.removeprefix("supervisor replay: ")
