"""``supervisor replay LOG [--out RUN] [--config F] [--realtime] [--ref REF]``: one log.

The user's pipeline runs sandboxed as always, with camerad playing LOG's road video
and a recorder writing RUN/log (metadata and every small channel; no video). By
default the replay is lockstep: camerad publishes a frame only once the recorder has
written controlsd's command for the previous frame (or a step timeout, counted and
reported, passes), no message is refused as stale, and controlsd runs on the log's clock, so two replays of one log give bit-identical model
outputs and commands. ``--realtime`` paces frames at the recorded rate instead, to see
deadline misses as the car would.

RUN gets ``replay.toml`` (the derived config), ``log/`` (the run as a drive log),
``summary.json`` and ``plot.png``.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from supervisor.exits import Exit
from supervisor.outdir import OutDir, OutDirError

from .derive import DeriveError, parse_doc, plan_of, read_doc, replay_doc, write_config
from .drivelog import DriveLog, Msg
from .embed import RunOutcome, give_to_recorder, run_supervised
from .logfmt import MESSAGES, REC, LogError, Loss, open_regular, read_stream
from .progress import startup_text
from .record import SOURCE, WRITE_FAILED, _one_line, fault_line
from .seal import read_seal, sealed_here, shipped_as

# Exit codes of `supervisor replay` beyond the supervisor's own (supervisor/exits.py):
DIFFERS = int(Exit.DIFFERS)        # compared with --ref: outside tolerance
INCOMPLETE = int(Exit.INCOMPLETE)  # the replay did not get through the log


class ReplayError(Exception):
    """One line: why this log cannot be replayed."""


@dataclass
class ReplayResult:
    run_dir: str
    exit_code: int
    summary: dict[str, Any]
    outcome: RunOutcome | None = None
    notes: list[str] = field(default_factory=list)
    log: str = ""                   # the log that played (RUN/input for --start/--end)
    signals: list = field(default_factory=list)   # --plot's, resolved (signals.Sig)


def _kv(text: str) -> dict[str, str]:
    return dict(t.split("=", 1) for t in text.split() if "=" in t)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, float), q)) if values else None


class _Progress:
    """A one-line bar on a terminal, counting the run's commands as the recorder
    writes them (the log is read while it is written)."""

    def __init__(self, path: Path, total: int, channel: str | None, out=sys.stderr) -> None:
        self.path, self.total, self.channel, self.out = path, total, channel, out
        self.offset = 0
        self.done = 0
        self.t0: float | None = None        # the first frame through (not the start-up)
        self.enabled = channel is not None and hasattr(out, "isatty") and out.isatty()

    def tick(self, log=None) -> None:
        if not self.enabled:
            return
        if not self.path.is_file():
            if log is not None:             # the start-up phases: who is READY so far
                self.out.write("\r" + startup_text(log.events, "replay").ljust(60))
                self.out.flush()
            return
        from .logfmt import Entry

        last = self.offset
        for off, body in read_stream(self.path, start=self.offset, final=False):
            with Entry.from_bytes(body) as e:
                if e.which() == "message" and e.message.channel == self.channel:
                    self.done += 1
            last = off + REC.size + len(body)
        self.offset = last
        if self.done == 0:
            text = (startup_text(log.events, "replay") if log is not None
                    else "replay: starting the pipeline ...")
            self.out.write("\r" + text.ljust(60))
            self.out.flush()
            return
        if self.t0 is None:
            self.t0 = time.monotonic()
        n = min(self.done, self.total) if self.total else self.done
        frac = n / self.total if self.total else 0.0
        rate = (n - 1) / max(time.monotonic() - self.t0, 1e-3)
        bar = "#" * int(frac * 30)
        self.out.write(f"\rreplay [{bar:<30}] {n}/{self.total} frames {rate:6.1f} fps   ")
        self.out.flush()

    def close(self) -> None:
        if self.enabled:
            self.tick()
            self.out.write("\n")
            self.out.flush()


# Events that say something went wrong, in the order a failure unfolds (the first one
# in time is the cause; what follows is its consequence).
_BAD = ("refused", "start_failed", "ready_timeout", "protocol_error", "watchdog_missed",
        "exit", "gave_up", "start_failed_required", "fail_safe", "fail_safe_error",
        "config_problem")


def _describe(e: dict[str, Any]) -> str:
    ev = e.get("event")
    if ev == "exit":
        how = (f"was killed by signal {e['signal']}" if e.get("signal")
               else f"exited with code {e.get('code')}")
        up = e.get("uptime_ms")
        return (f"{how}" + (f" ({e['cause']})" if e.get("cause") else "")
                + (f" after {up / 1000:.1f} s" if isinstance(up, (int, float)) else ""))
    if ev == "start_failed":
        return f"failed to start: {e.get('error', '')}"
    if ev == "ready_timeout":
        return "was not READY in time (ready_timeout)"
    detail = e.get("reason") or e.get("error") or e.get("kind") or ""
    return f"{ev}" + (f": {detail}" if detail else "")


def _last_words(events: list[dict[str, Any]], worker: str, upto: int) -> str | None:
    """The worker's own last output or log line before event ``upto`` (a traceback's
    last line names the exception), or just after it (its pipe is read concurrently)."""
    said = [e for e in events[:upto + 20]
            if e.get("worker") == worker and e.get("event") in ("output", "log")]
    if not said:
        return None
    e = said[-1]
    return str(e.get("line") if e["event"] == "output" else e.get("msg", ""))[:300]


def interrupted_by(events: list[dict[str, Any]]) -> str | None:
    """The stop signal the replay's supervisor received (SIGINT: Ctrl-C; SIGTERM: a CI
    job cancelled), if any."""
    return next((str(e.get("signal")) for e in events if e.get("event") == "signal"), None)


def _interrupted_text(sig: str, replayed: int, total: int) -> str:
    return (f"interrupted by {sig} after {replayed} of {total} frames: this RUN is "
            f"incomplete (exit 7): never a pass, nor a REF")


def _stalled(summary: dict[str, Any] | None) -> str:
    """Why frames timed out when no worker failed: a worker that rejected what it was
    given, in its own status words (modeld's `rejected=frame:too_small=42`: a drive
    recorded at another frame size than the config's model takes)."""
    if not summary:
        return ""
    f = summary.get("frames") or {}
    if not f.get("step_timeouts"):
        return ""
    who = [f"{w} said {st!r}" for w, st in (summary.get("worker_status") or {}).items()
           if isinstance(st, str) and any(
               k.startswith("rejected=") and not k.endswith("=0") for k in st.split())]
    return (f"{f['step_timeouts']} of {f.get('in_log')} frames timed out waiting for the "
            f"pipeline ({f.get('model_outputs', 0)} model outputs, {f.get('commands', 0)} "
            f"commands)" + (f": {'; '.join(who[:2])}" if who else ""))


def failure_cause(events: list[dict[str, Any]], exit_code: int | None = None,
                  summary: dict[str, Any] | None = None) -> str:
    """One line: which worker failed first, how (the event), in its own last words,
    what followed, and how the supervisor ended; with no worker failed, frames that
    timed out and who rejected them (``summary``)."""
    bad = [(i, e) for i, e in enumerate(events) if e.get("event") in _BAD]
    end = next((e for e in reversed(events) if e.get("event") == "supervisor_exit"), None)
    tail = ""
    if end is not None:
        tail = f"supervisor exit {end.get('code')}" + (
            f" ({end['reason']})" if end.get("reason") else "")
    elif exit_code is not None:
        tail = f"supervisor exit {exit_code}"
    if not bad:
        stalled = _stalled(summary)
        if stalled:
            return stalled + (f"; {tail}" if tail else "")
        return tail or "no worker failed (see the lifecycle events with --events)"
    return _one_line(_cause(bad, events, tail))


def _one_line(text: str) -> str:
    """A refusal's detail lists its findings on lines of their own: one line on stderr
    (gate 9 finding 2), the lines joined with '; '."""
    return "; ".join(x.strip() for x in text.splitlines() if x.strip())


def _cause(bad: list, events: list[dict[str, Any]], tail: str) -> str:
    i, first = bad[0]
    who = first.get("worker")
    head = f"{who} {_describe(first)}" if who else _describe(first)
    words = _last_words(events, who, i) if who else None
    if words:
        head += f"; its last words: {words!r}"
    then = [f"{e['event']} {e.get('worker') or ''}".strip() for _, e in bad[1:4]]
    return "; ".join([f"event {first['event']!r}: {head}"]
                     + ([f"then {', '.join(then)}"] if then else []) + ([tail] if tail else []))


def _done_text(e: dict[str, Any]) -> str:
    return str(e.get("status") if e["event"] == "status" else e.get("msg", ""))


def camera_done(events: list[dict[str, Any]], camera: str) -> dict[str, Any] | None:
    """The camera's ``replay=done ...`` line: its `log` record (sent with the status;
    `status` events are rate limited and may come seconds later) or its status."""
    for e in events:
        if (e.get("worker") == camera and e.get("event") in ("log", "status")
                and "replay=done" in _done_text(e)):
            return e
    return None


def _default_out(log: str) -> str:
    """LOG.replay-STAMP-PID: two replays of one drive started in the same second (two CI
    jobs in one workspace) got one name, and the second failed 'exists and is not an
    empty directory' (exit 2), or both wrote into it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(f"{Path(log).name}.replay-{stamp}-{os.getpid()}")


def _claim(run_dir: str, held: list[int]) -> None:
    """An exclusive lock on RUN for this replay's life (released when `replay` returns,
    or with the process): two replays given one --out at once both found it empty and
    both wrote into it. ReplayError if another replay holds it."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ReplayError(f"{run_dir}: another replay is writing into it (one --out per "
                          f"replay)") from None
    held.append(fd)


def trusted_source(log: str) -> bytes:
    """The config `record` saved beside the log, as bytes. The log directory belongs to
    the recorder's sandbox user, which can replace or delete any file in it: the config
    is used only if this (replaying) user still owns it and nobody else may write it, and
    it is read from the descriptor that was checked. A missing one is refused too (never
    the embedded default in its place: a recorder that deleted it would choose what the
    replay runs, and a user would compare against a pipeline that was never recorded).
    And a log handed over is made this user's by the copy: its config runs only if this
    machine sealed it, or it is a config this installation ships (seal.py)."""
    path = os.path.join(log, SOURCE)
    if not os.path.lexists(path):
        raise ReplayError(f"{path}: missing (the config this log was recorded with); "
                          "pass --config")
    try:
        fd = open_regular(path)
    except OSError as e:
        raise ReplayError(f"{path}: {e.strerror}; pass --config") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ReplayError(f"{path}: owned by uid {st.st_uid} with mode "
                              f"{st.st_mode & 0o777:o}, not written by the recording supervisor "
                              "(the recorder's sandbox could have replaced it); pass --config")
        data = f.read()
    if sealed_here(data, read_seal(log)):
        return data
    try:
        shipped = shipped_as(parse_doc(data, path))
    except DeriveError as e:
        raise ReplayError(f"{e}; pass --config") from None
    if shipped is None:
        raise ReplayError(f"{path}: not recorded on this machine (no seal of this user's "
                          f"replay key) and not a config this installation ships; a log's "
                          f"config chooses the code a replay runs: pass --config F to play "
                          f"its frames through your own pipeline")
    return data


def _recorded_config(log: str) -> dict[str, Any]:
    return parse_doc(trusted_source(log), os.path.join(log, SOURCE))


def _loads_here(doc: dict[str, Any], config: str | None, log: str) -> None:
    """The config the replay derives from loads with this version's loader, or one
    line naming it: the derived RUN/replay.toml's error named a file the developer
    never wrote and no way on (review 7, finding 6). A drive recorded by an older
    version may hold a key since gone; --config plays its frames all the same."""
    from supervisor.config import ConfigError, dumps, loads
    from supervisor.protocol import printable

    try:
        loads(dumps(doc), "")
    except ConfigError as e:
        problems = getattr(e, "problems", None) or []
        what = "; ".join(printable(f"{p.key}: {p.reason}" if p.key else p.reason)
                         for p in problems) or " ".join(str(e).split())
        if config:
            raise ReplayError(f"{config}: {what}") from None
        raise ReplayError(f"{os.path.join(log, SOURCE)} (the config the drive was recorded "
                          f"with) does not load here: {what} (recorded by another "
                          f"version?); pass --config F to play its frames through your own "
                          f"pipeline") from None


def replay(log: str, **kw: Any) -> ReplayResult:
    """`_replay`, holding RUN's lock (`_claim`) until it returns."""
    held: list[int] = []
    try:
        return _replay(log, held=held, **kw)
    finally:
        for fd in held:
            os.close(fd)


def _replay(log: str, *, held: list[int], out: str | None = None, config: str | None = None,
           realtime: bool = False, step_timeout_s: float = 5.0, echo=None,
           progress_out=sys.stderr, start: str | None = None, end: str | None = None,
           plot_signals: list[str] | None = None,
           compare_names: tuple[list[str], list[str], list[str]] | None = None,
           verdict_pending: bool = False) -> ReplayResult:
    """Replay ``log`` into ``out`` and summarise it (no comparison: see `diff`).
    ``start``/``end`` (`cut` units: ``12.5`` seconds, ``f120`` a frame id) replay that
    part of the log only: it is cut into RUN/input first and that cut is what plays;
    ``plot_signals`` (CHANNEL.FIELD) choose plot.png's panels; ``compare_names``
    (--gate, --ignore, --tol's keys) are checked against the config. Every bad argument
    is a `ReplayError` before anything starts. ``verdict_pending`` (a --ref comparison
    follows): a whole replay's summary.json says ``"exit_code": null`` and why until
    the caller writes the verdict, so a run killed in between never reads as a pass."""
    from .cut import CutError, cut, parse_pos, resolve
    from .signals import SignalError, check_compare_names, parse_signals

    log = os.path.abspath(log)
    try:
        src = DriveLog.open(log)
    except LogError as e:
        raise ReplayError(str(e)) from None
    said = src.full_loss().contradictions
    if said:       # played, the pipeline started and ended too_small (exit 7): refuse now
        raise ReplayError(f"{log}: {said[0]}")
    try:
        doc = read_doc(config)[0] if config else _recorded_config(log)
    except DeriveError as e:
        raise ReplayError(str(e)) from None
    _loads_here(doc, config, log)           # before RUN is made: nothing left half-made
    try:
        bounds = (parse_pos(start, "--start"), parse_pos(end, "--end"))
        if start is not None or end is not None:
            resolve(src, *bounds)           # a range with no frame: refused before anything
    except CutError as e:
        raise ReplayError(str(e)) from None
    try:
        signals = parse_signals(plot_signals or [], doc, plan_of(doc))
        if compare_names is not None:
            check_compare_names(*compare_names, doc)
    except (SignalError, DeriveError) as e:
        raise ReplayError(str(e)) from None
    run_dir = os.path.abspath(out or _default_out(log))
    if os.path.exists(run_dir) and (not os.path.isdir(run_dir) or os.listdir(run_dir)):
        raise ReplayError(f"{out or run_dir}: exists and is not an empty directory")
    source_log = log
    cut_notes: list[str] = []
    run_out: OutDir | None = None

    def open_run() -> OutDir:
        """RUN by `supervisor.outdir`'s rule, made when first needed: one another user
        owns or links is refused, and what the replay writes in it goes through its fd
        (red team round 5 row 3)."""
        nonlocal run_out
        if run_out is None:
            try:
                run_out = OutDir.open(run_dir, what="replay --out", mode=0o755, parents=True)
            except OutDirError as e:
                raise ReplayError(str(e)) from None
            _claim(run_dir, held)
            if any(n != "." for n in os.listdir(run_dir)):   # (filled before the lock was ours)
                raise ReplayError(f"{out or run_dir}: exists and is not an empty directory")
        return run_out

    if start is not None or end is not None:
        # The part asked for becomes a log of its own (RUN/input) and is what plays, is
        # compared with --ref self and is shown in the report.
        open_run()
        try:
            cut_notes = cut(log, os.path.join(run_dir, "input"), *bounds).notes
        except CutError as e:
            raise ReplayError(str(e)) from None
        log = os.path.join(run_dir, "input")
        src = DriveLog.open(log)
    run_log = os.path.join(run_dir, "log")
    try:
        derived, plan = replay_doc(doc, log, run_log, os.path.join(run_dir, "state"),
                                   realtime=realtime, step_timeout_s=step_timeout_s)
    except DeriveError as e:
        raise ReplayError(str(e)) from None
    if plan.frames not in src.video_channels():
        raise ReplayError(f"{log}: has no video of {plan.frames!r} (was it recorded with "
                          f"--video none?)")
    try:
        video = src.video(plan.frames)        # (H.264 without PyAV: one line, the extra)
    except LogError as e:
        raise ReplayError(str(e)) from None
    total = len(video)
    if total == 0:
        raise ReplayError(f"{log}: the video of {plan.frames!r} has no whole frame")
    with open_run() as d:
        try:
            d.subdir("state", 0o755).close()
            with d.subdir("log", 0o755) as log_dir:
                give_to_recorder(log_dir)
        except (OSError, OutDirError) as e:
            raise ReplayError(f"{run_dir}: {getattr(e, 'strerror', None) or e}") from None
        try:
            cfg, _ = write_config(derived, d, "replay.toml")
        except Exception as e:              # the loader's ConfigError, one line per problem
            raise ReplayError(f"derived replay config: {_one_line(e)}") from None

    def camera_status(events) -> str:
        done = camera_done(events, plan.camera)
        if done is not None:
            return _done_text(done)
        st = [e for e in events if e.get("event") == "status" and e.get("worker") == plan.camera]
        return st[-1]["status"] if st else ""

    watch = _StallWatch(Path(run_log), plan.camera, plan.model_out)

    def finished(evlog) -> bool:
        if camera_done(evlog.events, plan.camera) is not None:
            return True
        if watch.stalled(evlog.events):
            return True
        # The camera died (it is never restarted in a replay): nothing more will come.
        return any(e["event"] in ("exit", "gave_up") and e.get("worker") == plan.camera
                   for e in evlog.events[-50:])

    bar = _Progress(Path(run_log) / MESSAGES, total, plan.model_out, out=progress_out)
    durations = [e.capture_ts_ns for e in video.index]
    log_s = (durations[-1] - durations[0]) / 1e9 if len(durations) > 1 else 0.0
    timeout = 120.0 + (log_s * 2 if realtime else total * (step_timeout_s + 0.5))
    outcome = run_supervised(cfg, run_log, until=finished, timeout_s=timeout,
                             echo=echo, tick=bar.tick, state_dir=os.path.join(run_dir, "state"))
    bar.close()
    cam = _kv(camera_status(outcome.events))
    fault = fault_line(outcome.fault) if outcome.fault is not None else None
    sig = interrupted_by(outcome.events)
    try:
        run = DriveLog.open(run_log)
    except LogError as e:
        # No run log: the supervisor ended before the recorder wrote one. Its own code
        # (3 admission refused, 4 fail-safe, 5 start failed) is the command's, as with
        # a run log (gate 9 finding 2: it was 7, "incomplete").
        code = WRITE_FAILED if fault else (outcome.exit_code or INCOMPLETE)
        summary = {"log": source_log, "run": run_dir, "exit_code": code,
                   "error": fault or (_interrupted_text(sig, 0, total) if sig else
                                      failure_cause(outcome.events, outcome.exit_code)),
                   "run_log": f"none: {e}"}
        if sig and not fault:
            summary["interrupted"] = sig
        _write_summary(run_dir, summary)
        return ReplayResult(run_dir, code, summary, outcome, log=log, signals=signals)
    summary = summarize(src, run, plan, cam, outcome, realtime=realtime, log_s=log_s,
                        total=total, input_loss=src.full_loss())
    summary.update(log=source_log, run=run_dir)
    if log != source_log:
        summary["range"] = {"start": start, "end": end, "input": log,
                            "frames": src.info.get("cut", {}).get("frames"),
                            "notes": cut_notes}     # e.g. an H.264 cut's earlier keyframe
    code = 0
    if fault:
        code = WRITE_FAILED
    elif outcome.reason != "until" or cam.get("stopped") == "error":
        code = outcome.exit_code or INCOMPLETE
    elif summary["frames"]["replayed"] < total or summary["frames"]["step_timeouts"]:
        code = INCOMPLETE
    if code:
        summary["error"] = fault or failure_cause(outcome.events, outcome.exit_code,
                                                  summary)
        if outcome.reason == "timeout" and not fault:
            summary["error"] = f"no end within {timeout:.0f} s; " + summary["error"]
        if watch.at is not None and not fault:
            summary["stalled"] = watch.at
            summary["error"] = (f"stopped early: {watch.at} frames timed out and no model "
                                f"output came; " + summary["error"])
        if sig and not fault and outcome.reason != "until":
            # Ctrl-C, or a CI job cancelled: a part of a run, which must never read as a
            # pass (nor serve as a REF: commands._ref_log refuses it).
            summary["interrupted"] = sig
            summary["error"] = _interrupted_text(sig, summary["frames"]["replayed"], total)
    summary["exit_code"] = code
    if code == 0 and verdict_pending:
        summary["exit_code"] = None
        summary["verdict"] = "pending: the --ref comparison has not finished"
    _write_summary(run_dir, summary)
    try:
        plot(src, run, plan, Path(run_dir, "plot.png"), signals=signals)
    except Exception as e:                  # a missing picture never fails a replay
        Path(run_dir, "plot.png").unlink(missing_ok=True)     # (no half-written picture)
        summary.setdefault("notes", []).append(f"plot.png not drawn: {type(e).__name__}: {e}")
        _write_summary(run_dir, summary)
    return ReplayResult(run_dir, code if summary["exit_code"] is None else summary["exit_code"],
                        summary, outcome, log=log, signals=signals)


STALL_STEPS = 3     # lockstep frames timed out, with no model output yet, that end a replay


class _StallWatch:
    """A pipeline that puts out nothing: lockstep waited --step-timeout on every frame
    of the log (a drive at another frame size than the config's model takes: 42 x 5 s,
    then exit 7). After `STALL_STEPS` step timeouts (the camera's status) with no model
    output in the run's log the replay ends there; its verdict (7, incomplete) is the
    one the whole wait would have given. A model that answers, however slowly, is never
    cut short: once it has, this stops looking."""

    def __init__(self, run_log: Path, camera: str, model_out: str | None) -> None:
        self.run_log, self.camera, self.model_out = run_log, camera, model_out
        self.seen_output = model_out is None
        self.at: int | None = None           # step timeouts when it was judged stalled
        self.checked = 0

    def stalled(self, events: list[dict[str, Any]]) -> bool:
        if self.seen_output:
            return False
        st = next((e for e in reversed(events[-200:]) if e.get("event") == "status"
                   and e.get("worker") == self.camera), None)
        timeouts = int(_kv(str(st.get("status", ""))).get("timeouts", 0) or 0) if st else 0
        if timeouts < STALL_STEPS or timeouts == self.checked:
            return False
        self.checked = timeouts               # (the log is read once per new status)
        try:
            run = DriveLog.open(self.run_log, final=False)
        except LogError:
            return False
        if run.messages.get(self.model_out or ""):
            self.seen_output = True
            return False
        self.at = timeouts
        return True


def write_run_file(run_dir: str, name: str, text: str) -> None:
    """RUN/``name`` through RUN's fd (`supervisor.outdir`): never through a link planted
    under the name, never into a RUN another user could swap. OSError or OutDirError."""
    with OutDir.open(run_dir, what="replay --out", create=False, empty=False) as d:
        try:
            d.write_text(name, text)
        except OSError as e:               # name the file (a full disk said ': No space')
            if e.filename:
                raise
            raise OSError(e.errno, e.strerror, os.path.join(run_dir, name)) from None


def _write_summary(run_dir: str, summary: dict[str, Any]) -> None:
    """summary.json; on a full disk the replay still reports (exit `WRITE_FAILED`).
    Through RUN's fd, never through a link planted under the name (`supervisor.outdir`)."""
    try:
        with OutDir.open(run_dir, what="replay --out", create=False, empty=False) as d:
            try:
                d.write_text("summary.json", json.dumps(summary, indent=2))
            except OSError as e:
                d.unlink("summary.json")           # no stale summary beside the run
                raise OutDirError(e.strerror) from None
    except OutDirError as e:
        summary.setdefault("notes", []).append(f"summary.json not written: {e}")
        if summary.get("exit_code") in (0, None):
            summary["exit_code"] = WRITE_FAILED


def receipt_latencies(msgs: list[Msg]) -> tuple[list[float], int]:
    """(latency ms per model output, outputs over their deadline) from the receipts."""
    lat, misses = [], 0
    for m in msgs:
        r = m.receipt
        if r is None:
            continue
        lat.append(r.latency_ns / 1e6)
        misses += bool(r.deadline_ns and r.latency_ns > r.deadline_ns)
    return lat, misses


def summarize(src: DriveLog, run: DriveLog, plan, cam: dict[str, str], outcome: RunOutcome,
              *, realtime: bool, log_s: float, total: int, input_loss: Loss) -> dict[str, Any]:
    frames_run = run.frames.get(plan.frames, [])
    model = run.messages.get(plan.model_out or "", [])
    cmds = run.messages.get(plan.command or "", [])
    lat, misses = receipt_latencies(model)
    wall = outcome.wall_s
    replayed = int(cam.get("frames", len(frames_run)) or 0)
    # The replay proper: from the moment every worker is READY to the camera's last
    # frame done (the pipeline's start-up is the same for a log of any length).
    ready = next((e["mono_ns"] for e in outcome.events if e["event"] == "all_ready"), None)
    end = camera_done(outcome.events, plan.camera)
    done = end["mono_ns"] if end is not None else None
    replay_s = (done - ready) / 1e9 if ready and done and done > ready else None
    first = next((e["mono_ns"] for e in outcome.events if e["event"] == "supervisor_start"), None)
    start_s = (ready - first) / 1e9 if ready and first else None
    refused = [e for e in outcome.events if e["event"] == "refused"]
    exits = [e for e in outcome.events if e["event"] == "exit"]
    statuses: dict[str, str] = {}
    for e in outcome.events:
        if e["event"] == "status":
            statuses[e["worker"]] = e["status"]
    statuses.update(outcome.final_status)     # the final word, not the last logged one
    return {
        "mode": "realtime" if realtime else "lockstep",
        "frames": {"in_log": total, "replayed": replayed,
                   "step_timeouts": int(cam.get("timeouts", 0) or 0),
                   "model_outputs": len(model), "commands": len(cmds)},
        "input_log_loss": {"text": input_loss.text(),
                           "partial_records": input_loss.truncated_records,
                           "bytes": input_loss.truncated_bytes,
                           "corrupt_records": input_loss.corrupt_records,
                           "problems": input_loss.problems[:20]},
        "drops": {ch: {"dropped": d.dropped, "rejected": d.rejected,
                       "leases_lost": d.leases_lost, "recorder_skipped": d.skipped}
                  for ch, d in run.drops.items()},
        "rejections": {"admission_or_runtime": [e.get("reason", "") for e in refused][:20]},
        "model_latency_ms": {"p50": _pct(lat, 50), "p99": _pct(lat, 99),
                             "max": max(lat) if lat else None, "n": len(lat)},
        "deadline_misses": misses,
        "wall_s": round(wall, 3),
        "pipeline_start_s": None if start_s is None else round(start_s, 3),
        "replay_s": None if replay_s is None else round(replay_s, 3),
        "frames_per_s": round(replayed / replay_s, 2) if replay_s else None,
        "log_duration_s": round(log_s, 3),
        "speed_vs_realtime": round(log_s / replay_s, 3) if replay_s and log_s else None,
        "end": outcome.reason,
        "supervisor_exit": outcome.exit_code,
        "worker_exits": [{k: e.get(k) for k in ("worker", "code", "signal", "cause")}
                         for e in exits][:20],
        "worker_status": statuses,
    }


def commands_by_frame(msgs: list[Msg]) -> dict[int, Msg]:
    """The first message per frame id (live controlsd also publishes between frames)."""
    out: dict[int, Msg] = {}
    for m in msgs:
        if m.frame_id is not None and m.frame_id not in out:
            out[m.frame_id] = m
    return out


def plot(src: DriveLog, run: DriveLog, plan, path: Path, ref: DriveLog | None = None,
         signals: list | None = None) -> None:
    """Model latency over log time, and the replay's steering command against the
    recorded one (and REF's); with ``signals`` (`signals.Sig`, from --plot) one panel
    per signal instead, each with the recorded drive, the replay and REF overlaid. Log
    time: the recorded capture time of each frame (the replay's messages are placed by
    their frame id; a live recording's commands, which carry no frame id, by their
    publish time on the recording's clock)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .cut import title

    times = {e.frame_id: e.capture_ts_ns for e in src.video(plan.frames).index}
    t0 = min(times.values()) if times else 0

    def at(m: Msg) -> float | None:
        t = times.get(m.frame_id) if m.frame_id is not None else None
        if t is None and m.frame_id is None:
            t = m.publish_ts_ns          # live: same clock as the recorded captures
        return None if t is None else (t - t0) / 1e9

    if signals:
        _plot_signals(plt, src, run, ref, signals, path, at, t0, bool(times))
        return
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    model = run.messages.get(plan.model_out or "", [])
    pts = [(at(m), m.receipt.latency_ns / 1e6) for m in model if m.receipt is not None]
    pts = [p for p in pts if p[0] is not None]
    if ref is not None:                      # --ref: REF's model latency under the run's
        rpts = [(at(m), m.receipt.latency_ns / 1e6) for m in
                ref.messages.get(plan.model_out or "", []) if m.receipt is not None]
        rpts = [p for p in rpts if p[0] is not None]
        if rpts:
            ax1.plot(*zip(*rpts), ".-", ms=2, lw=0.6, color="0.6", label="REF latency")
    if pts:
        ax1.plot(*zip(*pts), ".-", ms=3, lw=0.8, label="model latency (receipt)")
        dl = [m.receipt.deadline_ns / 1e6 for m in model if m.receipt and m.receipt.deadline_ns]
        if dl:
            ax1.axhline(dl[0], color="r", ls="--", lw=0.8, label=f"deadline {dl[0]:g} ms")
    ax1.set_ylabel("ms")
    if pts:
        ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(f"replay of {title(src)}")
    logs = [(src, "recorded", "-"), (run, "replay", "--")]
    if ref is not None and ref.path != src.path:
        logs.append((ref, "REF", ":"))
    def at_step(m: Msg) -> float | None:
        # The car's own commands: at the time its law stepped (their header's capture
        # time, the recording's clock; several per frame), not stacked on the frame's.
        if m.frame_id is not None and m.capture_ts_ns and times:
            return (m.capture_ts_ns - t0) / 1e9
        return at(m)

    for log, label, style in logs:
        place = at_step if log is src else at
        pts = [(place(m), float(m.array.ravel()[0]))
               for m in log.messages.get(plan.command or "", [])]
        pts = sorted(p for p in pts if p[0] is not None)
        if pts:
            ax2.plot(*zip(*pts), style, lw=1, label=label)
    ax2.set_xlabel("log time (s)")
    ax2.set_ylabel("steer command (rad)")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _plot_signals(plt, src: DriveLog, run: DriveLog, ref: DriveLog | None, signals: list,
                  path: Path, at, t0: int, have_times: bool) -> None:
    """One panel per --plot signal: recorded (solid), replay (dashed), REF (dotted)."""
    from .cut import title
    from .signals import value

    logs = [(src, "recorded", "-"), (run, "replay", "--")]
    if ref is not None and ref.path != src.path:
        logs.append((ref, "REF", ":"))
    fig, axes = plt.subplots(len(signals), 1, figsize=(9, 1.2 + 2.0 * len(signals)),
                             sharex=True, squeeze=False)
    for ax, sig in zip(axes[:, 0], signals):
        for log, label, style in logs:
            def place(m: Msg) -> float | None:
                # The car's own commands: where its law stepped (see the default plot).
                if (log is src and m.frame_id is not None and m.capture_ts_ns
                        and have_times and sig.index is not None):
                    return (m.capture_ts_ns - t0) / 1e9
                return at(m)

            pts = [(place(m), value(m, sig)) for m in log.messages.get(sig.channel, [])]
            pts = sorted(p for p in pts if p[0] is not None and p[1] is not None)
            if pts:
                ax.plot(*zip(*pts), style, lw=1, label=label)
        ax.set_ylabel(sig.field, fontsize=8)
        ax.set_title(sig.name, fontsize=9, loc="left")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("log time (s)")
    fig.suptitle(f"replay of {title(src)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def remove_run(run_dir: str) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
