"""A developer's first contact with the replay gate (docs/replay.md), the gaps it found:
a REF (or run) with a model output written twice for one frame passed the gate (only
the first per frame was compared); a log of another schema version was read as if it
were this one; a run whose outputs all matched but whose model time failed read
"DIFFERS" with nothing changed, the same as a model regression.

Then the gate as a CI merge gate on shared 2-core runners: the model time gate was on by
default (p99 <= 1.5 x REF's) and failed unchanged code on a loaded runner (two CPU
hogs: p99 6.56 ms against REF's 0.90, exit 6, "model time only"); it is opt-in now,
and what a regression changes (the model, the law, dropped frames, a shorter run) still
fails. A fleet retried a log it could not read (exit 2) and ended "incomplete" (7).

The comparison and the log reader are the parts under test, so the logs are written
by the recorder's own writer (`LogWriter`), not recorded by a pipeline: a recording and
two replays cost a minute here, and tests/test_replay.py already runs those end to end.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from supervisor.config import PROJECT_ROOT
from supervisor.replay.diff import TimeGate, compare, render_markdown, render_text
from supervisor.replay.drivelog import DriveLog, LogWriter
from supervisor.replay.logfmt import MESSAGES, Entry, frame_record, read_stream

PAYLOADS = {"model_out": "model_out", "control_cmd": "control_cmd"}
CHANNELS = ["model_out", "control_cmd"]


def _write(d: Path, extra: list[tuple[str, int, float]] = ()) -> Path:
    """Ten frames: a model output and a command each; ``extra``: (channel, frame id,
    value) written after them (a second message for a frame that has one)."""
    w = LogWriter(d, CHANNELS, info={"test": "journey"})
    for i in range(10):
        w.message("model_out", i, 1000 + i, 1, i, 1000 + i,
                  np.array([0.1 * i, 0.9, 1.0], np.float32))
        w.message("control_cmd", i, 1001 + i, 2, i, 1001 + i,
                  np.array([0.01 * i, 1.0, 0.0], np.float32))
    for seq, (ch, fid, v) in enumerate(extra, start=100):
        w.message(ch, seq, 2000 + seq, 1, fid, 1000 + fid, np.array([v, 0.9, 1.0], np.float32))
    w.close({"frames": 10})
    return d


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> DriveLog:
    return DriveLog.open(_write(tmp_path_factory.mktemp("journey_replay") / "ref"))


def _cmp(run: DriveLog, ref: DriveLog):
    return compare(run, ref, channels=CHANNELS, payloads=PAYLOADS, model_channel="model_out",
                   gated=set(CHANNELS))


def test_a_frame_written_twice_fails_the_gate(ref, tmp_path):
    same = _cmp(DriveLog.open(_write(tmp_path / "same")), ref)
    assert same.ok
    # modeld ran twice on frame 3 (or a record was written twice): before, the second
    # output was never looked at and the gate passed
    run = DriveLog.open(_write(tmp_path / "dup", [("model_out", 3, 42.0)]))
    r = _cmp(run, ref)
    mo = {c.channel: c for c in r.channels}["model_out"]
    assert not r.ok and mo.duplicated == {"run": [3]} and not mo.changed
    assert "duplicated frames (the run" in render_text(r)
    assert "Duplicated frames" in render_markdown(r)
    assert r.as_dict()["channels"][0]["duplicated"] == {"run": [3]}
    from supervisor.replay.report import _diff_html

    assert "duplicated frames" in _diff_html(r)                # report.html
    back = _cmp(ref, run)                          # the same, REF's side
    assert not back.ok and back.channels[0].duplicated == {"ref": [3]}
    # A live controlsd publishes between frames: several commands per frame are the
    # rule there, and the first is compared (docs/replay.md)
    live = DriveLog.open(_write(tmp_path / "cmd", [("control_cmd", 3, 0.03)]))
    assert _cmp(live, ref).ok


def test_nan_on_both_sides_is_never_a_pass(ref, tmp_path):
    nan = float("nan")
    a = DriveLog.open(_write(tmp_path / "a", [("model_out", 10, nan)]))
    b = DriveLog.open(_write(tmp_path / "b", [("model_out", 10, nan)]))
    r = _cmp(a, b)           # frame 10: NaN in both, equal as values (before: a pass)
    mo = r.channels[0]
    assert not r.ok and not mo.changed and mo.nonfinite == {"run": [10], "ref": [10]}
    assert "NaN or infinity in the run: frames 10" in render_text(r)
    assert "NaN or infinity in" in render_markdown(r)


def test_model_time_alone_says_so(ref, tmp_path):
    r = _cmp(DriveLog.open(_write(tmp_path / "slow")), ref)
    # what a loaded runner gives (REF's receipts made elsewhere): the outputs all match
    r.gate = TimeGate(30.0, 6.0, 40.0, 7.0, 1.5, 2.0, 5.0, False, "p99 30.00 ms > 1.5 x REF")
    r.ok = False
    text = render_text(r)
    assert "result: DIFFERS: model time only" in text and "--time-p99" in text
    assert "model time only" in render_markdown(r)


def _timed(d: Path, n: int = 12, *, latency_ms: float = 1.0, offset: float = 0.0,
           steer: float = 0.0, skip: tuple[int, ...] = ()) -> DriveLog:
    """Model outputs with execution receipts, and commands, one per frame."""
    from tests.test_replay_format import _receipt

    w = LogWriter(d, CHANNELS, info={"test": "journey"})
    for i in range(n):
        if i in skip:
            continue
        w.message("model_out", i, 1000 + i, 1, i, 1000 + i,
                  np.array([0.1 * i + offset, 0.9, 1.0], np.float32), _receipt(i, latency_ms))
        w.message("control_cmd", i, 1001 + i, 2, i, 1001 + i,
                  np.array([0.01 * i + steer, 1.0, 0.0], np.float32))
    w.close({"frames": n})
    return DriveLog.open(d)


def test_timings_are_reported_not_gated_by_default_and_regressions_still_fail(tmp_path):
    """The CLI's defaults (no --time-*): what a loaded runner does to the model's time
    (here 10x REF's) passes, labelled as reported only; what a regression does to the
    outputs fails. `--time-p99` gates on time when asked, and says it was asked."""
    ref = _timed(tmp_path / "ref")
    cli = dict(p99_ratio=None, max_ratio=None)           # commands.py's defaults
    busy = _cmp_t(_timed(tmp_path / "busy", latency_ms=10.0), ref, **cli)
    assert busy.ok and not busy.gate.gated, busy.gate
    assert "model time (reported, not gated" in render_text(busy)
    assert "| p99 | 10.00 ms | 1.00 ms | not gated |" in render_markdown(busy)
    for name, kw in [("model", dict(offset=0.01)), ("law", dict(steer=0.001)),
                     ("dropped", dict(skip=(5,))), ("shorter", dict(n=9))]:
        r = _cmp_t(_timed(tmp_path / name, **kw), ref, **cli)
        assert not r.ok and r.gate.ok, name                # the outputs decide, not time
    asked = _cmp_t(_timed(tmp_path / "busy2", latency_ms=10.0), ref, p99_ratio=2.0,
                   max_ratio=None)
    assert not asked.ok and asked.gate.gated and "p99 10.00 ms > 2 x REF" in asked.gate.why
    text = render_text(asked)
    assert "model time gate (opt-in: --time-p99 2" in text and "model time only" in text
    # Receipts gone where REF has them: a lost part of the output, gated without asking.
    w = LogWriter(tmp_path / "noreceipt", CHANNELS)
    for i in range(12):
        w.message("model_out", i, 1000 + i, 1, i, 1000 + i,
                  np.array([0.1 * i, 0.9, 1.0], np.float32))
        w.message("control_cmd", i, 1001 + i, 2, i, 1001 + i,
                  np.array([0.01 * i, 1.0, 0.0], np.float32))
    w.close({"frames": 12})
    gone = _cmp_t(DriveLog.open(tmp_path / "noreceipt"), ref, **cli)
    assert not gone.ok and "carries no receipts" in render_text(gone)


def _cmp_t(run: DriveLog, ref: DriveLog, **kw):
    return compare(run, ref, channels=CHANNELS, payloads=PAYLOADS, model_channel="model_out",
                   gated=set(CHANNELS), **kw)


def test_a_fleet_reports_bad_input_once_and_judges_the_other_logs():
    """A fleet's scheduling and verdict (fleet._execute with outcomes given: the
    replays themselves run in test_replay's fleet test). Before: a log that could not
    be read (exit 2) was retried, shown twice, and the fleet exited 7 (incomplete)."""
    from supervisor.replay.fleet import FleetReport, _execute

    outcomes = {"bad": [2, 2], "flaky": [7, 0], "fine": [0], "changed": [6]}
    tried: list[str] = []

    def submit(log: str, run_dir: str):
        code = outcomes[log][sum(t == log for t in tried)]
        tried.append(log)
        return lambda: {"exit_code": code, "wall_s": 0.1, "summary": None, "run_dir": run_dir,
                        "error": "supervisor replay: bad: schema version 9" if code == 2 else ""}

    def fleet(logs: list[str]) -> FleetReport:
        tried.clear()
        return FleetReport("out", "jobs 2", 1.0, _execute(logs, "out", [], submit, 60.0))

    rep = fleet(["bad", "flaky", "fine"])
    by = {j.log: j for j in rep.jobs}
    assert tried.count("bad") == 1 and by["bad"].status == "bad_input"   # never retried
    assert tried.count("flaky") == 2 and by["flaky"].status == "ok"      # a crash: once more
    assert rep.exit_code == 2                      # could not run: not "incomplete" (7)
    assert by["bad"].line() == ("bad: could not run (bad input, exit 2, not retried): bad: "
                                "schema version 9")
    assert "| `bad` | could not run (bad input) (bad: schema version 9) | 1 |" in rep.markdown()
    assert rep.as_dict()["bad_input"] == 1 and rep.as_dict()["failed"] == 0
    assert fleet(["bad", "changed"]).exit_code == 6    # a bad log never hides a regression
    assert fleet(["fine"]).exit_code == 0


def test_a_ref_is_a_whole_run_a_runs_summary_or_a_log_never_a_part(ref, tmp_path):
    """--ref: a RUN's summary.json (what a CI job keeps) means that RUN; a RUN that was
    interrupted, failed or never finished is refused in one line (compared, its missing
    tail read as a model regression); a lone file is named as such."""
    import json

    from supervisor.replay.commands import _ref_log
    from supervisor.replay.logfmt import LogError

    def run(name: str, summary: dict | None) -> Path:
        d = tmp_path / name
        _write(d / "log")
        (d / "replay.toml").write_text("# the derived config\n")
        if summary is not None:
            (d / "summary.json").write_text(json.dumps(summary))
        return d

    whole = run("whole", {"exit_code": 0})
    assert _ref_log(str(whole / "summary.json"), "drive").path == whole / "log"
    assert _ref_log(str(run("differed", {"exit_code": 6})), "drive").path.name == "log"
    pending = run("pending", {"exit_code": None, "verdict": "pending: ..."})
    assert _ref_log(str(pending), "drive").path == pending / "log"   # the replay was whole
    for name, summary, says in [
            ("stopped", {"exit_code": 7, "interrupted": "SIGINT",
                         "error": "interrupted by SIGINT after 12 of 42 frames"},
             "interrupted by SIGINT after 12 of 42"),
            ("killed", None, "never finished (no summary.json"),
            ("crashed", {"exit_code": 7, "error": "modeld exited"}, "modeld exited")]:
        with pytest.raises(LogError, match="not a REF") as e:
            _ref_log(str(run(name, summary)), "drive")
        assert says in str(e.value), e.value
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(LogError, match="a file, not a RUN directory"):
        _ref_log(str(tmp_path / "summary.json"), "drive")


def test_two_replays_never_share_a_run_directory(tmp_path, monkeypatch):
    """Two replays of one drive at once: the default RUN names differ (before: one
    name per second, so the second failed 'exists and is not an empty directory'), and
    one --out given to both is held by the first (before: both could write into it)."""
    from supervisor.replay import run as run_mod

    monkeypatch.chdir(tmp_path)
    a = run_mod._default_out("drive1")
    assert a.endswith(f"-{os.getpid()}") and Path(a).name.startswith("drive1.replay-")
    held: list[int] = []
    (tmp_path / "out").mkdir()
    run_mod._claim(str(tmp_path / "out"), held)
    # (flock is per open file: a second open of RUN, as another replay's, is refused)
    with pytest.raises(run_mod.ReplayError, match="another replay is writing into it"):
        run_mod._claim(str(tmp_path / "out"), [])
    for fd in held:
        os.close(fd)
    second: list[int] = []
    run_mod._claim(str(tmp_path / "out"), second)          # released: free again
    os.close(second[0])


def test_frames_that_time_out_name_who_rejected_them():
    """A drive recorded at another frame size than the config's model takes: every
    frame timed out (42 x 5 s) and the one line said only 'supervisor exit 0
    (shutdown)'."""
    from supervisor.replay.run import failure_cause

    events = [{"event": "supervisor_exit", "code": 0, "reason": "shutdown"}]
    summary = {"frames": {"in_log": 42, "step_timeouts": 42, "model_outputs": 0,
                          "commands": 0},
               "worker_status": {"camerad": "replay=done frames=42 timeouts=42",
                                 "modeld": "frames=0 rejected=frame:too_small=42 skipped=0"}}
    line = failure_cause(events, 0, summary)
    assert line.startswith("42 of 42 frames timed out waiting for the pipeline (0 model "
                           "outputs, 0 commands): modeld said 'frames=0 rejected=frame:"
                           "too_small=42 skipped=0'"), line
    assert failure_cause(events, 0) == "supervisor exit 0 (shutdown)"


def test_a_pipeline_that_puts_out_nothing_ends_the_replay_early(ref, tmp_path):
    """Before: every frame of the log waited --step-timeout (42 x 5 s), then exit 7.
    Now three step timeouts with no model output in the run's log end it (still 7); a
    model that has answered once is never cut short."""
    from supervisor.replay.run import STALL_STEPS, _StallWatch

    def status(timeouts: int) -> list[dict]:
        return [{"event": "status", "worker": "camerad",
                 "status": f"source=log frames={timeouts + 1} timeouts={timeouts}"}]

    empty = tmp_path / "empty"
    LogWriter(empty, CHANNELS).close({"frames": 0})
    w = _StallWatch(empty, "camerad", "model_out")
    assert not w.stalled(status(STALL_STEPS - 1)) and w.stalled(status(STALL_STEPS))
    assert w.at == STALL_STEPS
    slow = _StallWatch(ref.path, "camerad", "model_out")       # outputs in its log
    assert not slow.stalled(status(STALL_STEPS)) and slow.seen_output
    assert not slow.stalled(status(40)) and slow.at is None


def test_ref_self_compares_where_the_recording_was_there(tmp_path):
    """A fresh recording replayed against itself failed (exit 6) on one output at its
    first frame, which modeld published before the recorder attached ('added'), unless
    four --tol options were given. Now the recorded drive as REF is compared, per
    channel, only between the frames its recording of that channel began and ended;
    what is left out is shown, and a frame dropped inside, or a shorter run, still
    fails."""
    from supervisor.replay.diff import edge_windows
    from tests.test_replay_format import write_log

    write_log(tmp_path / "drive", n=12, skip=(0,))     # frame 0: no output recorded
    drive = DriveLog.open(tmp_path / "drive")
    win = edge_windows(drive, "road_frames", CHANNELS)
    assert win == {"model_out": (1, 11), "control_cmd": (1, 11)}

    def vs_drive(name: str, **kw):
        write_log(tmp_path / name, **kw)
        return compare(DriveLog.open(tmp_path / name), drive, channels=CHANNELS,
                       payloads=PAYLOADS, model_channel="model_out", gated=set(CHANNELS),
                       windows=win, p99_ratio=None, max_ratio=None)

    r = vs_drive("replayed", n=12)
    assert r.ok and r.channels[0].edges == {"run": 1}, r.channels[0]
    assert "at the log's edges, not compared" in render_text(r)
    assert "At the log's edges, not compared" in render_markdown(r)
    assert not compare(DriveLog.open(tmp_path / "replayed"), drive, channels=CHANNELS,
                       payloads=PAYLOADS, model_channel="model_out").ok   # (before)
    assert vs_drive("dropped", n=12, skip=(5,)).channels[0].removed == [5]
    assert not vs_drive("shorter", n=9).ok


def test_another_schema_version_is_one_line(tmp_path):
    d = _write(tmp_path / "v9")
    recs = [body for _, body in read_stream(d / MESSAGES)]
    with Entry.from_bytes(recs[0]) as e:
        b = e.as_builder()
    b.start.version = 9
    recs[0] = b.to_bytes()
    (d / MESSAGES).write_bytes(b"".join(frame_record(x) for x in recs))
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "log", "info", str(d)],
                       capture_output=True, text=True, timeout=60, env=env,
                       stdin=subprocess.DEVNULL)
    # before: read as this version, exit 0
    assert p.returncode == 2 and "schema version 9" in p.stderr, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_a_run_directory_given_as_the_log_is_one_line(tmp_path):
    run = tmp_path / "run1"                  # what `replay --out run1` leaves
    _write(run / "log")
    (run / "replay.toml").write_text("# the derived config\n")
    (run / "summary.json").write_text('{"log": "/data/drive1"}')
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "replay", str(run), "--out",
                        str(tmp_path / "again"), "--no-progress"], capture_output=True,
                       text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    # before: read as a fleet of one log, failed twice ("source.toml: missing"), exit 7
    assert p.returncode == 2 and "RUN directory" in p.stderr and "/data/drive1" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "again").exists()


@pytest.mark.parametrize("opt,needle", [
    (["--gate", "shadow_ou"], "no channel 'shadow_ou'"),
    (["--ignore", "model_out.offst_m"], "has no field 'offst_m'"),
    (["--tol", "control_cmd.steer_radd=1e-6"], "has no field 'steer_radd'"),
])
def test_a_misspelt_gate_ignore_or_tolerance_is_one_line_before_the_replay(
        ref, tmp_path, opt, needle):
    """Before: accepted and ignored after a whole replay: `--gate shadow_ou` gated
    nothing (a changed shadow_out passed); a misspelt tolerance tolerated nothing."""
    log = _write(tmp_path / "drive")
    cfg = Path(PROJECT_ROOT) / "supervisor" / "configs" / "minimal.toml"
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "replay", str(log), "--config",
                        str(cfg), "--out", str(tmp_path / "run"), "--ref", str(ref.path),
                        "--no-progress", *opt], capture_output=True, text=True, timeout=60,
                       env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 2 and needle in p.stderr, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
