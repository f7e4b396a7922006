"""The ``record`` and ``replay`` subcommands (supervisor/cli.py parses, this runs).

Bad input (a missing log, an unusable config, a bad --tol) is one line on stderr and
exit 2, never a traceback. Exit status of both commands:

    0  done (replay: within tolerance of --ref, when given)
    1  internal error (a bug: one line naming the exception and where)
    2  bad input: the log, the config, an argument; a missing optional extra
    3-5  the supervisor's own (supervisor/exits.py): refused, fail-safe, start failed
    6  replay --ref: differs (outside tolerance)
    7  replay: incomplete (did not get through the log; the cause is named; with --ref,
       nothing is compared: outputs never waited for are no model change)
    8  a drive log could not be written (disk full, I/O error): one line says where
"""
from __future__ import annotations

import argparse
import contextvars
import json
import os
import sys
import traceback
from pathlib import Path

from supervisor.exits import Exit

# (the parser is built on every `supervisor` start: nothing heavy is imported up here)
MESSAGES = "messages.tlog"      # = logfmt.MESSAGES


def add_record_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("out", metavar="OUT", help="new log directory")
    s.add_argument("--seconds", type=float, default=None,
                   help="stop N seconds after the recorder is READY (default: until Ctrl-C)")
    s.add_argument("--video", choices=("h264", "raw"), default="h264",
                   help="road video: H.264 (default) or lossless raw NV12 (bit-exact replays)")
    s.add_argument("--quiet", action="store_true",
                   help="no lifecycle events on stderr (on a terminal: a progress line instead)")
    s.add_argument("--clip", default=None, metavar="FILE",
                   help="play a video file (MP4, MKV, ...) through the pipeline instead of the "
                        "camera: simulation mode, FILE bound read-only, playback from READY; "
                        "once through unless --seconds")
    s.add_argument("--loop", action="store_true", help="--clip: start over at its end")
    s.add_argument("--recorder-arg", action="append", default=[], metavar="ARG",
                   help="passed on to the recorder worker (e.g. --recorder-arg=--io-delay-ms"
                        " --recorder-arg=50 to see what a slow disk does)")


def add_replay_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("logs", metavar="LOG", nargs="+",
                   help="a drive log; several (or directories of logs) replay as a fleet")
    s.add_argument("--out", default=None, help="RUN directory (fleet: the directory of runs)")
    s.add_argument("--realtime", action="store_true",
                   help="pace frames at the recorded rate instead of lockstep")
    s.add_argument("--ref", default=None,
                   help="compare with REF: an earlier RUN, a LOG, or 'self' (the log replayed)")
    s.add_argument("--tol", action="append", default=[], metavar="CHANNEL[.FIELD]=X",
                   help="absolute tolerance (repeatable; default 0: bit-identical); "
                        "CHANNEL.added=N / CHANNEL.removed=N accept N messages more/fewer")
    s.add_argument("--ignore", action="append", default=[], metavar="CHANNEL[.FIELD]",
                   help="leave a channel (or one of its fields) out of the comparison "
                        "(repeatable)")
    s.add_argument("--gate", action="append", default=[], metavar="CHANNEL",
                   help="let CHANNEL decide the verdict too (repeatable; by default only "
                        "the control pipeline's channels do: research and shadow channels "
                        "are reported, never gated); --gate all: every channel")
    # Off by default: a replay's outputs are the product's behaviour (deterministic,
    # bit-compared); its timings are the runner's, and a loaded CI runner failed
    # unchanged code on them (docs/replay.md, "What decides the verdict").
    s.add_argument("--time-p99", type=float, default=None, metavar="R",
                   help="opt-in model time gate: p99 may be at most R x REF's (default: "
                        "reported, not gated; gate on a quiet, dedicated runner only)")
    s.add_argument("--time-max", type=float, default=None, metavar="R",
                   help="opt-in model time gate: max may be at most R x REF's (default: "
                        "reported, not gated)")
    s.add_argument("--time-floor-ms", type=float, default=5.0,
                   help="with --time-p99/--time-max: never fail for less than this many ms "
                        "over REF (scheduler noise; 0 on a quiet machine)")
    s.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    s.add_argument("--start", default=None, metavar="S",
                   help="replay from here: seconds of log time (12.5) or a frame id (f120); "
                        "the part is cut into RUN/input first")
    s.add_argument("--end", default=None, metavar="S",
                   help="replay up to here, not included (same units as --start)")
    s.add_argument("--plot", action="append", default=[], metavar="CHANNEL.FIELD",
                   help="a signal for plot.png and report.html (repeatable; e.g. "
                        "control_cmd.steer_rad, model_out.latency_ms); default: latency and "
                        "steer in plot.png, every command and model field in the report")
    s.add_argument("--report", default=None, metavar="FILE",
                   help="also write the run's report.html (self-contained: verdict, tables, "
                        "frames and signals; nothing fetched) to FILE, e.g. a CI artifact")
    s.add_argument("--step-timeout", type=float, default=5.0,
                   help="lockstep: seconds to wait for a frame's command before going on")
    s.add_argument("--jobs", type=int, default=1, help="fleet: replays at once on this machine")
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="fleet: run the replays on a Ray cluster ('local' starts one)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--events", action="store_true", help="lifecycle events on stderr")


# The one-line errors said during a command whose stdout is one JSON document
# (`--format json`): a script that parses stdout gets the error too (review 8: exit 2
# printed nothing there).
_SAID: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("said", default=None)


def _fail(prog: str, msg: str, code: int = int(Exit.CONFIG)) -> int:
    print(f"supervisor {prog}: {msg}", file=sys.stderr)
    said = _SAID.get()
    if said is not None:
        said.append(msg)
    return code


def _internal(prog: str, e: BaseException) -> int:
    """One line for what was not foreseen: a missing optional module names its extra, a
    full disk says so (exit 8), anything else is a bug and says where."""
    from .logfmt import REPLAY_EXTRA, is_no_space
    from .record import WRITE_FAILED

    # A trio nursery wraps what failed in an ExceptionGroup whose own line names only
    # trio's internals: judge and name the first exception inside it, where it was raised.
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, ModuleNotFoundError) and e.name in ("av", "matplotlib"):
        return _fail(prog, f"needs {e.name}, which is not installed: {REPLAY_EXTRA}")
    if is_no_space(e):
        return _fail(prog, f"disk full: {getattr(e, 'filename', None) or ''}: {e.strerror}",
                     WRITE_FAILED)
    where = traceback.extract_tb(e.__traceback__)[-1]
    print(f"supervisor {prog}: internal error: {type(e).__name__}: {e} "
          f"({where.filename}:{where.lineno})", file=sys.stderr)
    return int(Exit.ERROR)


def cmd_record(args: argparse.Namespace) -> int:
    from .record import RecordError, record

    try:
        rec = record(args.out, config=args.config, seconds=args.seconds, video=args.video,
                     echo=None if args.quiet else sys.stderr, recorder_args=args.recorder_arg,
                     progress_out=sys.stderr if args.quiet else None,
                     clip=args.clip, loop=args.loop)
    except RecordError as e:
        return _fail("record", str(e), e.code)
    except Exception as e:
        return _internal("record", e)
    print(rec.text())
    if rec.fault:
        _fail("record", rec.fault)
    return rec.exit_code


def _ref_log(ref: str, log: str):
    """REF as a log: 'self', a RUN (its log/), a file of a RUN (its summary.json, as a
    CI job keeps it beside the run: that RUN), or a LOG. A RUN that did not finish (no
    summary.json: interrupted, or still running) or failed (its summary's error) is
    refused: compared against, its missing tail read as "added" in every run, exit 6,
    a model regression that never was. LogError, one line."""
    from .drivelog import DriveLog
    from .logfmt import LogError

    path = Path(log if ref == "self" else ref)
    def is_run(d: Path) -> bool:
        return (d / "replay.toml").is_file() or (d / "log" / MESSAGES).is_file()

    if ref != "self" and path.is_file():
        if not is_run(path.parent):
            raise LogError(f"{path}: a file, not a RUN directory or a drive log (REF's "
                           f"messages are compared: a summary.json alone holds none)")
        path = path.parent                 # run1/summary.json: run1
    if ref == "self":
        return DriveLog.open(path)
    source: DriveLog | None = None
    if is_run(path):
        why = _unfinished(path)
        if why:
            raise LogError(f"{path}: {why}; not a REF (replay the drive again into a new RUN)")
        source = _run_source(path)
        path = path / "log"
    out = DriveLog.open(path)
    try:
        ours = DriveLog.open(log)
    except LogError:
        return out          # the log's own error is the replay's to say, not REF's
    _same_drive(ref, source or out, ours)
    return out


def _run_source(run: Path):
    """The drive log a RUN played (its summary's range input, else its log), when it
    is still here; None otherwise. A RUN's own frames carry the replay's capture times,
    not the recording's: only its source says which drive it is."""
    from .drivelog import DriveLog
    from .logfmt import LogError

    try:
        s = json.loads((run / "summary.json").read_text())
        src = (s.get("range") or {}).get("input") or s.get("log")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(src, str) or not (Path(src) / MESSAGES).is_file():
        return None
    try:
        return DriveLog.open(src)
    except LogError:
        return None


def _same_drive(ref: str, theirs, ours) -> None:
    """LogError unless REF records the drive this replay plays (gate 9 finding 10): the
    frames both have by id must have been captured at the same times, and one frame at
    least must be shared. Messages are matched by frame id, so another drive's golden
    (ids 0..N again after a camera restart) read as 'every output changed', exit 6, a
    model regression that never was. A --start/--end part keeps its ids and times."""
    from .logfmt import LogError

    def times(log) -> dict[tuple[str, int], set[int]]:
        out: dict[tuple[str, int], set[int]] = {}
        for ch, frames in log.frames.items():
            for f in frames:
                out.setdefault((ch, f.frame_id), set()).add(f.capture_ts_ns)
        return out

    a, b = times(theirs), times(ours)
    if not a or not b or not {k[0] for k in a} & {k[0] for k in b}:
        return                          # no frames to tell by: nothing to judge
    shared = sorted(a.keys() & b.keys(), key=lambda k: (k[1], k[0]))
    for k in shared:
        if not a[k] & b[k]:
            raise LogError(f"{ref}: a recording of another drive (frame {k[1]} captured at "
                           f"{min(a[k]) / 1e9:.3f} s there, {min(b[k]) / 1e9:.3f} s here)")
    if not shared:
        ids = sorted(k[1] for k in a)
        raise LogError(f"{ref}: a recording of another drive (no frame in common with "
                       f"{ours.path}: its frame ids {ids[0]}..{ids[-1]})")


def _unfinished(run: Path) -> str:
    """Why RUN is no whole replay to compare with ('' if it is one)."""
    try:
        s = json.loads((run / "summary.json").read_text())
    except FileNotFoundError:
        return "a replay that never finished (no summary.json: interrupted, or still running)"
    except (OSError, ValueError) as e:
        return f"summary.json unreadable ({getattr(e, 'strerror', None) or e})"
    if not isinstance(s, dict):
        return "summary.json is not a replay's summary"
    code = s.get("exit_code")
    if code is None and s.get("verdict") and not s.get("error"):
        return ""                 # a whole replay whose own --ref verdict never came
    if s.get("error") or code not in (0, int(Exit.DIFFERS)):
        return (f"a replay that did not get through its log (exit {code}: "
                f"{str(s.get('error') or '')[:200]})")
    return ""


def _same(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _payloads(run_dir: str) -> dict[str, str]:
    from .derive import read_doc

    doc, _ = read_doc(os.path.join(run_dir, "replay.toml"))
    return {n: c["payload"] for n, c in (doc.get("channels") or {}).items()
            if isinstance(c, dict) and c.get("payload")}


def _gated(run_dir: str, extra: list[str]) -> set[str] | None:
    """The channels that decide the verdict: the control pipeline's, plus --gate's."""
    from supervisor.config import load

    from .derive import verdict_channels

    if "all" in extra:
        return None
    return verdict_channels(load(os.path.join(run_dir, "replay.toml"))) | set(extra)


class UsageParser(argparse.ArgumentParser):
    """argparse, whose usage errors under ``--format json`` are the JSON document every
    other bad input gives (gate 9 finding 3: a mistyped option printed argparse's usage
    on stderr and nothing on stdout, and a CI script's json.loads('') crashed): one
    line on stderr, ``{"error": ..., "exit_code": 2}`` on stdout, exit 2. Subparsers
    are made of the parser's own class, so the top parser is the one to swap; its
    ``argv`` (main's, else sys.argv's) is what is looked at, by the subparsers too."""

    ARGV: list[str] | None = None        # the command line being parsed (set by the top)

    def __init__(self, *args, argv: list[str] | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        if argv is not None:
            UsageParser.ARGV = list(argv)

    def error(self, message: str):  # type: ignore[override]
        argv = UsageParser.ARGV if UsageParser.ARGV is not None else sys.argv[1:]
        wants_json = any(a == "--format=json" for a in argv) or any(
            a == "--format" and b == "json" for a, b in zip(argv, argv[1:]))
        if not wants_json:
            super().error(message)
        line = f"{self.prog}: {' '.join(message.split())}"
        print(line, file=sys.stderr)
        print(json.dumps({"error": line, "exit_code": int(Exit.CONFIG)}, indent=2))
        raise SystemExit(int(Exit.CONFIG))


def cmd_replay(args: argparse.Namespace) -> int:
    if args.format != "json":
        return _cmd_replay(args)
    said: list[str] = []
    token = _SAID.set(said)
    try:
        code = _cmd_replay(args)
    finally:
        _SAID.reset(token)
    if code == int(Exit.CONFIG) and said:     # refused before anything ran: no document yet
        print(json.dumps({"error": said[-1], "exit_code": code}, indent=2))
    return code


def _cmd_replay(args: argparse.Namespace) -> int:
    from .diff import ToleranceError, parse_tolerances

    try:
        tols = parse_tolerances(args.tol)
    except ToleranceError as e:
        return _fail("replay", str(e))
    if args.jobs < 1:
        return _fail("replay", f"--jobs {args.jobs}: must be >= 1")
    run_dir = Path(args.logs[0])
    if len(args.logs) == 1 and (run_dir / "log" / MESSAGES).is_file() and (
            run_dir / "replay.toml").is_file():
        # A RUN directory given as the log: it has one log inside, so it read as a fleet
        # of one, failed twice ("source.toml: missing") and exited 7, "incomplete".
        try:
            came_from = json.loads((run_dir / "summary.json").read_text()).get("log")
        except (OSError, ValueError, AttributeError):
            came_from = None
        return _fail("replay", f"{run_dir} is a replay's RUN directory, not a drive log (its "
                     f"log/ has no video): replay the drive it played"
                     + (f" ({came_from})" if came_from else "")
                     + ", or give it as --ref")
    if len(args.logs) > 1 or args.ray or args.jobs > 1 or not (
            Path(args.logs[0]) / MESSAGES).is_file() and Path(args.logs[0]).is_dir():
        if args.start is not None or args.end is not None:
            return _fail("replay", "--start/--end replay a part of one log, not a fleet "
                                   "(cut each with `supervisor log cut`)")
        return _fleet(args)
    try:
        return _replay_one(args, tols)
    except Exception as e:
        return _internal("replay", e)


def _replay_one(args: argparse.Namespace, tols: dict[str, float]) -> int:
    from .derive import plan_of, read_doc
    from .diff import compare, edge_windows, render_json, render_markdown, render_text
    from .drivelog import DriveLog
    from .logfmt import LogError
    from .record import WRITE_FAILED
    from .run import DIFFERS, ReplayError, replay, write_run_file

    ref = None
    if args.ref is not None and args.ref != "self":    # (self: the log that played, below)
        try:
            ref = _ref_log(args.ref, args.logs[0])
        except LogError as e:
            return _fail("replay", f"--ref: {e}")
    try:
        res = replay(args.logs[0], out=args.out, config=args.config, realtime=args.realtime,
                     step_timeout_s=args.step_timeout, echo=sys.stderr if args.events else None,
                     progress_out=None if args.no_progress else sys.stderr,
                     start=args.start, end=args.end, plot_signals=args.plot,
                     compare_names=(args.gate, args.ignore, list(tols))
                     if args.ref is not None else None,
                     verdict_pending=args.ref is not None)
    except ReplayError as e:
        return _fail("replay", str(e))
    s = res.summary
    code = res.exit_code
    if args.ref == "self":
        ref = DriveLog.open(res.log)         # with --start/--end: the cut that played
    elif ref is not None and s.get("range", {}).get("frames"):
        from .cut import restrict

        ref = restrict(ref, *s["range"]["frames"])   # frames outside it are not "removed"
    if s.get("error"):               # why it failed, in one line, where errors go
        _fail("replay", s["error"])
    if s.get("interrupted") or code == WRITE_FAILED:
        # Stopped (Ctrl-C, a cancelled CI job) or a full disk: a part of a run. Compared,
        # its missing tail reads as a regression; the user asked to stop, or there is
        # no room for the diff and the report. summary.json and the one line say so.
        if args.format == "json":
            print(json.dumps({"summary": s, "exit_code": code}, indent=2))
        else:
            print_summary(s)
        return code
    if code and args.ref is not None:
        # It did not get through the log (step timeouts on a slow runner, a worker that
        # failed): the outputs never waited for would read as "removed" and the run as
        # "DIFFERS", a model regression that never was, in diff.md (what CI posts) too.
        # Nothing is compared; the exit code (7) and the line on stderr say why.
        _write_report(res, args, None, None, code)
        if args.format == "json":
            print(json.dumps({"summary": s, "exit_code": code}, indent=2))
        else:
            print_summary(s)
            print(f"result: INCOMPLETE (exit {code}): "
                  f"{_short(s.get('error') or 'the replay did not get through the log')}"
                  f"; not compared with {'the log' if args.ref == 'self' else args.ref}")
        return code
    if ref is not None and s.get("frames"):
        run = DriveLog.open(Path(res.run_dir) / "log")
        payloads = _payloads(res.run_dir)
        plan = plan_of(read_doc(os.path.join(res.run_dir, "replay.toml"))[0])
        chans = [c for c in payloads if c in run.messages or c in ref.messages]
        # The recorded drive itself as REF: only where its recording was there
        # (`edge_windows`); an earlier RUN played the same frames, edges and all.
        windows = (edge_windows(ref, plan.frames, chans)
                   if args.ref == "self" or _same(ref.path, res.log) else None)
        report = compare(run, ref, channels=chans, payloads=payloads, windows=windows,
                         model_channel=plan.model_out, tolerances=tols,
                         p99_ratio=args.time_p99, max_ratio=args.time_max,
                         floor_ms=args.time_floor_ms,
                         gated=_gated(res.run_dir, args.gate), ignore=args.ignore)
        write_run_file(res.run_dir, "diff.md", render_markdown(report))
        _plot_with_ref(res.run_dir, plan, run, ref, res.log, res.signals)
        write_run_file(res.run_dir, "diff.json", render_json(report))
        s["diff"] = {"ref": str(ref.path), "ok": report.ok,
                     "first_divergent_frame": report.first_divergent_frame}
        if code == 0 and not report.ok:
            code = DIFFERS
        # summary.json is what a CI step reads after the fact: its exit code is the
        # command's, the comparison's verdict included (it said 0 for a run that exited 6;
        # and it is null, "verdict: pending", until here: a run killed during the
        # comparison never reads as a pass).
        s["exit_code"] = code
        s.pop("verdict", None)
        write_run_file(res.run_dir, "summary.json", json.dumps(s, indent=2))
        _write_report(res, args, ref, report, code)
        if args.format == "json":       # one JSON document on stdout, nothing else
            print(json.dumps({"summary": s, "diff": report.as_dict(), "exit_code": code},
                             indent=2))
            return code
        out = {"text": render_text, "markdown": render_markdown}[args.format]
        print_summary(s)
        sys.stdout.write(out(report))
        hint = _lossy_hint(ref, report, windows is not None)
        if hint:
            print(hint)
        return code
    _write_report(res, args, None, None, code)
    if args.format == "json":
        print(json.dumps({"summary": s, "exit_code": code}, indent=2))
    else:
        print_summary(s)
    return code


def _lossy_hint(ref, report, own_log: bool) -> str | None:
    """A drive replayed against itself whose video is lossy (h264, `record`'s default)
    differs by what the codec changed: the car's model saw the camera's frames, the
    replay's the decoded ones. Said, with the way to a bit-exact gate, so a first
    `record` + `replay --ref self` is not read as a model regression."""
    codec = (getattr(ref, "info", None) or {}).get("video")
    if not own_log or report.ok or codec in (None, "raw", "none"):
        return None
    return (f"note: this log's video is {codec} (lossy): the car's model saw the camera's "
            f"frames, this replay's the decoded ones, so outputs differ by the codec; for a "
            f"bit-exact gate record with --video raw, or gate with --tol CHANNEL.FIELD=X")


def _short(line: str, n: int = 160) -> str:
    return line if len(line) <= n else line[:n - 3] + "..."


def _write_report(res, args: argparse.Namespace, ref, report, code: int) -> None:
    """RUN/report.html (and --report FILE): a page that cannot be drawn in full says
    what is missing in its notes; one that cannot be written never fails the replay
    (summary.json's notes say why)."""
    from .derive import plan_of, read_doc
    from .drivelog import DriveLog
    from supervisor.outdir import OutDirError

    from .report import Page, collect, write

    summary = {**res.summary, "exit_code": code}
    try:
        run = DriveLog.open(Path(res.run_dir) / "log")
        src = DriveLog.open(res.log or args.logs[0])
        plan = plan_of(read_doc(os.path.join(res.run_dir, "replay.toml"))[0])
        page = collect(res.run_dir, src, run, ref, plan, summary, report,
                       _payloads(res.run_dir), signals=res.signals)
    except Exception as e:           # a failed replay: what there is, and why not more
        page = Page(f"replay of {Path(args.logs[0]).name}", summary, report,
                    notes=[f"signals and frames not shown: {type(e).__name__}: {e}"])
    missing = []
    for dest in [Path(res.run_dir, "report.html"), *([Path(args.report)] if args.report else [])]:
        try:
            write(dest, page)
        except (OSError, OutDirError) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            missing.append(f"{dest} not written: {why}")
    if missing:
        # Said where a CI log shows it (a --report artifact missing is otherwise found
        # only by its absence) and kept in summary.json, written before the report.
        from .run import write_run_file

        for m in missing:
            _fail("replay", m)
        res.summary.setdefault("notes", []).extend(missing)
        try:
            write_run_file(res.run_dir, "summary.json", json.dumps(res.summary, indent=2))
        except (OSError, OutDirError):
            pass                            # (the disk is full: the line above says so)


def _plot_with_ref(run_dir: str, plan, run, ref, log: str, signals: list) -> None:
    """plot.png again, with REF overlaid (a missing picture never fails a replay)."""
    from .drivelog import DriveLog
    from .run import plot

    try:
        plot(DriveLog.open(log), run, plan, Path(run_dir, "plot.png"), ref=ref,
             signals=signals)
    except Exception:
        pass


def _rate(s: dict) -> str:
    """'; N frames/s = Mx real time (after T s of pipeline start-up)', each part only
    when the run has it (a run that stopped early printed 'None frames/s = Nonex')."""
    fps, speed, start = (s.get(k) for k in ("frames_per_s", "speed_vs_realtime",
                                             "pipeline_start_s"))
    out = ""
    if fps is not None:
        out += f"; {fps} frames/s" + (f" = {speed}x real time" if speed is not None else "")
    if start is not None:
        out += f"{'' if out else ';'} (after {start} s of pipeline start-up)"
    return out


def print_summary(s: dict) -> None:
    if "frames" not in s:            # it never got to replay a frame (the error says why)
        print(_run_line(s))
        return
    f = s.get("frames", {})
    lat = s.get("model_latency_ms", {})
    fmt = (lambda v: "-" if v is None else f"{v:.2f}")
    drops = sum(sum(v.values()) for v in s.get("drops", {}).values())
    print(f"replay ({s.get('mode')}): {f.get('replayed', 0)}/{f.get('in_log', 0)} frames, "
          f"{f.get('model_outputs', 0)} model outputs, {f.get('commands', 0)} commands, "
          f"{f.get('step_timeouts', 0)} step timeouts, {drops} drops; model latency p50 "
          f"{fmt(lat.get('p50'))} p99 {fmt(lat.get('p99'))} max {fmt(lat.get('max'))} ms, "
          f"{s.get('deadline_misses', 0)} deadline misses{_rate(s)}")
    rng = s.get("range")
    if rng:
        fr = rng.get("frames") or ["?", "?"]
        print(f"range: --start {rng.get('start')} --end {rng.get('end')}: frames "
              f"f{fr[0]}..f{fr[1]} (played from {rng.get('input')})")
        for n in rng.get("notes") or []:
            print(f"  note: {n}")
    loss = (s.get("input_log_loss") or {}).get("text")
    if loss and loss != "nothing lost":
        print(f"input log: {loss}")
    print(_run_line(s))


def _run_line(s: dict) -> str:
    """The run directory and what it holds (a full disk may have kept some out)."""
    run = s.get("run") or ""
    have = [f for f in ("summary.json", "plot.png", "report.html", "diff.md", "diff.json")
            if run and os.path.isfile(os.path.join(run, f))]
    return f"run: {run} ({', '.join(have) or 'nothing written'})"


def _fleet(args: argparse.Namespace) -> int:
    from .fleet import FleetError, replay_fleet

    if args.report is not None:
        # Each job writes its own RUN/report.html; FILE was dropped without a word, and
        # a CI job then uploaded a missing artifact after a "passed" fleet.
        return _fail("replay", f"--report {args.report}: writes one log's report; a fleet "
                               f"writes OUT/LOG/report.html for each log (and OUT/fleet.md): "
                               f"drop --report, or replay one log")
    extra: list[str] = []
    if args.config:
        extra += ["--config", os.path.abspath(args.config)]
    if args.realtime:
        extra.append("--realtime")
    if args.ref is not None:
        if args.ref != "self":
            return _fail("replay", "a fleet compares each log with itself only: --ref self")
        extra += ["--ref", "self"]
    for t in args.tol:
        extra += ["--tol", t]
    for i in args.ignore:
        extra += ["--ignore", i]
    for g in args.gate:
        extra += ["--gate", g]
    for p in args.plot:
        extra += ["--plot", p]
    for opt, v in (("--time-p99", args.time_p99), ("--time-max", args.time_max)):
        if v is not None:                   # (opt-in: each job gates on time only if asked)
            extra += [opt, str(v)]
    extra += ["--time-floor-ms", str(args.time_floor_ms), "--step-timeout",
              str(args.step_timeout)]
    out = args.out or os.path.abspath("fleet-replay")
    try:
        rep = replay_fleet(args.logs, out, jobs=args.jobs, ray=args.ray, extra=extra,
                           progress_out=None if args.no_progress else sys.stderr)
    except FleetError as e:
        return _fail("replay", str(e))
    except Exception as e:
        return _internal("replay", e)
    # One line per log without a verdict, where a CI log shows errors: which log, and
    # whether it could not run (bad input, never retried) or failed (after its retry).
    for j in rep.jobs:
        if j.status in ("failed", "bad_input"):
            _fail("replay", j.line())
    if rep.interrupted:
        _fail("replay", f"interrupted by {rep.interrupted}: "
                        f"{sum(j.status == 'interrupted' for j in rep.jobs)} of {len(rep.jobs)} "
                        f"logs not judged (fleet.json lists them); exit {rep.exit_code}")
    if args.format == "json":
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        sys.stdout.write(rep.markdown())
    return rep.exit_code


def add_log_args(s: argparse.ArgumentParser) -> None:
    from .logtool import add_log_args as add

    add(s)


def cmd_log(args: argparse.Namespace) -> int:
    from .logtool import cmd_log as run

    return run(args)


# The subcommands this package serves: name -> (add its arguments, run it). The CLI
# (supervisor/cli.py) needs only these names.
SUBCOMMANDS = {"record": (add_record_args, cmd_record),
               "replay": (add_replay_args, cmd_replay),
               "log": (add_log_args, cmd_log)}
