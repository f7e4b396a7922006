"""``supervisor log cut LOG --start S --end S OUT`` and ``replay --start/--end``: a part
of a drive log as a new, whole log.

A position is written in one of two units:

    12.5    seconds of log time: from the log's first frame (its capture time)
    f120    a frame id (the ids `supervisor log info` prints: "ids 40..92")

The range is half-open, as a slice: ``--start`` is in, ``--end`` is not, so cutting
0..10 and 10..20 splits a log in two with no frame in both. Either bound may be left
out (the log's start, its end).

What the cut holds: every frame of the range (its metadata and its pixels, copied
byte for byte: no re-encoding), every message carrying a frame id in the range (model
outputs, and commands, whose frame id is the model output they used), messages without
a frame id published between the range's first frame and the frame after its last,
the drop counts and events the recorder wrote in that span, the lifecycle events of the
whole drive (who started, who was READY: context, not data) and the recorded config.
An H.264 video can only be decoded from a keyframe: a cut of one starts at the keyframe
at or before ``--start`` (the result says how many frames earlier); a raw log is cut
exactly. The cut is written by this process and closed in order; its start entry's
``info["cut"]`` and its closing summary say where it came from and what the source
had lost.

The recorded config is copied only if the replay would trust it (`run.trusted_source`):
a cut never turns a config the recorder's sandbox could have replaced into one this
user wrote.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.outdir import OutDir, OutDirError

from .drivelog import DriveLog
from .logfmt import (
    LIFECYCLE,
    MESSAGES,
    Entry,
    LogError,
    StreamWriter,
    VideoReader,
    _vix,
    read_entries,
    read_regular,
)


class CutError(Exception):
    """One line: why this range of this log cannot be cut (exit 2)."""


_POS = re.compile(r"^(?:f(?P<frame>\d+)|(?P<sec>\d+(?:\.\d*)?|\.\d+))$")


@dataclass(frozen=True)
class Pos:
    """One bound: a frame id (``f120``) or seconds of log time (``12.5``)."""

    text: str
    frame: int | None = None
    seconds: float | None = None


def parse_pos(text: str | None, what: str) -> Pos | None:
    if text is None:
        return None
    m = _POS.match(text.strip())
    if m is None:
        raise CutError(f"{what} {text!r}: expected seconds of log time (12.5) or a frame id "
                       f"(f120)")
    if m["frame"] is not None:
        return Pos(text, frame=int(m["frame"]))
    return Pos(text, seconds=float(m["sec"]))


@dataclass
class Range:
    """The frames a cut keeps, resolved against a log."""

    lo: int                     # first frame id kept
    hi: int                     # last frame id kept
    t_lo: int                   # its capture time (ns, the log's clock)
    t_next: int | None          # the capture time of the first frame after the range
    snapped: int = 0            # frames kept before --start (an H.264 keyframe)
    notes: list[str] = field(default_factory=list)


def _frame_times(log: DriveLog) -> list[tuple[int, int]]:
    """(capture ns, frame id) of every recorded frame, all frame channels, in time order."""
    return sorted({(f.capture_ts_ns, f.frame_id) for fs in log.frames.values() for f in fs})


def resolve(log: DriveLog, start: Pos | None, end: Pos | None) -> Range:
    """The frame ids [lo, hi] a range selects (H.264: lo moved back to a keyframe)."""
    frames = _frame_times(log)
    if not frames:
        raise CutError(f"{log.path}: no frames to cut (a log without a frame channel)")
    t0 = frames[0][0]
    first_id, last_id = frames[0][1], frames[-1][1]
    dur = (frames[-1][0] - t0) / 1e9

    def keep(t: int, fid: int) -> bool:
        for bound, inside in ((start, lambda b, v: v >= b), (end, lambda b, v: v < b)):
            if bound is None:
                continue
            if bound.frame is not None and not inside(bound.frame, fid):
                return False
            if bound.seconds is not None and not inside(bound.seconds, (t - t0) / 1e9):
                return False
        return True

    def show(p: Pos) -> str:
        return p.text if p.frame is None else f"f{p.frame}"

    if start is not None and end is not None:
        a = start.frame if start.frame is not None else None
        b = end.frame if end.frame is not None else None
        if (a is not None and b is not None and a >= b) or (
                start.seconds is not None and end.seconds is not None
                and start.seconds >= end.seconds):
            raise CutError(f"--start {show(start)} --end {show(end)}: the start must come "
                           f"before the end (the end is not included)")
    sel = [(t, fid) for t, fid in frames if keep(t, fid)]
    if not sel:
        raise CutError(f"--start {show(start) if start else '(log start)'} --end "
                       f"{show(end) if end else '(log end)'}: no frame of {log.path} in it "
                       f"(its frames: ids f{first_id}..f{last_id}, 0..{dur:.2f} s)")
    lo, hi = min(fid for _, fid in sel), max(fid for _, fid in sel)
    rng = Range(lo, hi, min(t for t, _ in sel), None)
    # An H.264 video decodes from a keyframe only: start at the one at or before lo.
    for ch in log.video_channels():
        try:
            v = VideoReader(log.path, ch)
        except LogError:
            continue                         # a broken video: the cut says so, below
        try:
            if v.info.codec != "h264":
                continue
            ids = [e for e in v.index if e.frame_id <= lo]
            key = next((e for e in reversed(ids) if e.keyframe), None)
            if key is not None and key.frame_id < rng.lo:
                rng.lo = key.frame_id
        finally:
            v.close()
    if rng.lo < lo:
        rng.snapped = sum(1 for _, fid in frames if rng.lo <= fid < lo)
        rng.t_lo = min(t for t, fid in frames if fid >= rng.lo)
        rng.notes.append(f"H.264: the cut starts at keyframe f{rng.lo}, {rng.snapped} "
                         f"frame(s) before f{lo} (a video decodes from a keyframe only; "
                         f"a --video raw log cuts exactly)")
    after = [t for t, fid in frames if fid > rng.hi]
    rng.t_next = min(after) if after else None
    return rng


@dataclass
class CutResult:
    out: Path
    range: Range
    frames: dict[str, int]          # frame channel -> frames kept
    messages: dict[str, int]        # tensor channel -> messages kept
    config_copied: bool
    notes: list[str]

    def text(self) -> str:
        msgs = ", ".join(f"{ch} {n}" for ch, n in sorted(self.messages.items())) or "none"
        frames = ", ".join(f"{ch} {n}" for ch, n in sorted(self.frames.items())) or "none"
        lines = [f"cut {self.out}: frames f{self.range.lo}..f{self.range.hi} ({frames}); "
                 f"messages: {msgs}"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes]) + "\n"


def _in_span(rng: Range, t: int) -> bool:
    return t >= rng.t_lo and (rng.t_next is None or t < rng.t_next)


def _mono_span(log_path: Path, rng: Range) -> tuple[int, int | None]:
    """The recorder's monotonic clock at the range's first frame entry and at the first
    frame entry after it: drops and events are kept by when they were written."""
    lo = hi = None
    for e in read_entries(log_path / MESSAGES):
        if e.which() != "frame":
            continue
        fid = e.frame.frameId
        if lo is None and fid >= rng.lo:
            lo = e.monoNs
        if hi is None and fid > rng.hi:
            hi = e.monoNs
            break
    return (lo or 0), hi


def _copy_video(src: Path, out: Path, ch: str, keep: set[int]) -> dict[int, int]:
    """The frames ``keep`` of one channel's video, bytes and index copied (offsets
    renumbered); frame id -> its position in the new video."""
    v = VideoReader(src, ch)
    try:
        ext = v.path.suffix
        (out / f"{ch}.video").write_bytes(read_regular(src / f"{ch}.video"))
        remap: dict[int, int] = {}          # frame id -> its position in the new video
        data = bytearray()
        index = bytearray()
        # The reader's own descriptor (opened as a regular file, never through a link
        # planted in the log): the path is not opened a second time.
        # (The reader has skipped records whose bytes overlap: each frame's bytes are
        # copied once at most. A frame id indexed twice keeps its first position.)
        count = 0
        for e in v.index:
            if e.frame_id not in keep:
                continue
            chunk = os.pread(v._fd, e.size, e.offset)
            index += _vix(e.frame_id, e.capture_ts_ns, len(data), len(chunk),
                          1 if e.keyframe else 0)
            remap.setdefault(e.frame_id, count)
            count += 1
            data += chunk
        (out / f"{ch}{ext}").write_bytes(bytes(data))
        (out / f"{ch}.vidx").write_bytes(bytes(index))
        return remap
    finally:
        v.close()


def cut(src_dir: str | os.PathLike, out_dir: str | os.PathLike, start: Pos | None,
        end: Pos | None) -> CutResult:
    """Write the range [start, end) of the log at ``src_dir`` into ``out_dir`` (new or
    empty), a log `DriveLog.open`, ``supervisor log info`` and ``replay`` accept."""
    from .record import SOURCE
    from .run import ReplayError, trusted_source
    from .seal import SEAL, SealError, seal

    src = Path(src_dir)
    out = Path(out_dir)
    try:
        log = DriveLog.open(src)
    except LogError as e:
        raise CutError(str(e)) from None
    if out.is_symlink():
        # written through, the cut would land wherever the link points (red team round 4)
        raise CutError(f"{out}: is a symbolic link; give a directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CutError(f"{out}: exists and is not an empty directory")
    if out.resolve() == src.resolve():
        raise CutError(f"{out}: the cut cannot overwrite its own source")
    rng = resolve(log, start, end)
    notes = list(rng.notes)
    mono_lo, mono_hi = _mono_span(src, rng)
    # OUT, and every directory on its way, only root's or yours and writable by no one
    # else (supervisor.outdir): then the paths below name what was checked, and no one
    # can swap OUT or OUT/.cut-PID for a link during the cut (red team round 5).
    try:
        with OutDir.open(str(out), what="log cut OUT", mode=0o755, parents=True) as d:
            # The cut is built in a hidden directory inside OUT and moved into place, its
            # messages last: an interrupted cut leaves no half log that reads as whole.
            d.subdir(f".cut-{os.getpid()}", 0o755).close()
        tmp = out / f".cut-{os.getpid()}"
    except OutDirError as e:
        raise CutError(str(e)) from None
    except OSError as e:
        raise CutError(f"{out}: cannot make the directory: {e.strerror}") from None
    try:
        remap: dict[str, dict[int, int]] = {}
        for ch in log.video_channels():
            keep = {f.frame_id for f in log.frames.get(ch, []) if rng.lo <= f.frame_id <= rng.hi}
            try:
                remap[ch] = _copy_video(src, tmp, ch, keep)
            except (LogError, OSError) as e:
                notes.append(f"{ch}: video not copied ({e}); its frames are kept without "
                             f"pixels")
                remap[ch] = {}
        frames: dict[str, int] = {}
        msgs: dict[str, int] = {}
        w = StreamWriter(tmp / MESSAGES)
        loss = log.full_loss()
        try:
            for e in read_entries(src / MESSAGES):
                which = e.which()
                b = e.as_builder()
                if which == "start":
                    if e.start.writer != "recorder":
                        continue
                    info = json.loads(e.start.info or "{}")
                    info = info if isinstance(info, dict) else {}
                    info["cut"] = {"from": str(src.resolve()), "start": start and start.text,
                                   "end": end and end.text, "frames": [rng.lo, rng.hi]}
                    b.start.info = json.dumps(info)
                elif which == "frame":
                    f = e.frame
                    if not rng.lo <= f.frameId <= rng.hi:
                        continue
                    if f.videoIndex >= 0:
                        # Pixels the source's video never got stay counted as such (a
                        # position past the new video's end), not as skipped (-1).
                        b.frame.videoIndex = remap.get(f.channel, {}).get(f.frameId, 1 << 40)
                    frames[f.channel] = frames.get(f.channel, 0) + 1
                elif which == "message":
                    m = e.message
                    if m.hasFrameId:
                        if not rng.lo <= m.frameId <= rng.hi:
                            continue
                    elif not _in_span(rng, m.publishTsNs):
                        continue
                    msgs[m.channel] = msgs.get(m.channel, 0) + 1
                elif which in ("drops", "event"):
                    if e.monoNs < mono_lo or (mono_hi is not None and e.monoNs >= mono_hi):
                        continue
                else:                        # the source's closing summary: ours below
                    continue
                w.write_entry(b)
            stop = Entry.new_message(monoNs=time.monotonic_ns())
            stop.stop = json.dumps({
                "cut_from": str(src.resolve()), "frames": [rng.lo, rng.hi],
                "frames_kept": frames, "messages_kept": msgs,
                "source_loss": loss.text(), "source_summary": log.summary})
            w.write_entry(stop)
        finally:
            w.close()
        if (src / LIFECYCLE).is_file():
            (tmp / LIFECYCLE).write_bytes(read_regular(src / LIFECYCLE))
        copied = False
        try:
            data = trusted_source(str(src))
            (tmp / SOURCE).write_bytes(data)
            os.chmod(tmp / SOURCE, 0o644)
            copied = True
            try:                                  # trusted here: the cut is sealed here
                (tmp / SEAL).write_bytes(seal(data))
                os.chmod(tmp / SEAL, 0o644)
            except SealError as e:
                notes.append(f"{SOURCE} not sealed: {e}")
        except ReplayError as e:
            notes.append(f"{SOURCE} not copied: {e}")
        if loss.any:
            notes.append(f"the source log lost: {loss.text()}")
        # messages.tlog last: until it is in place OUT is not a drive log at all.
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == MESSAGES):
            os.replace(p, out / p.name)
    finally:
        for p in tmp.iterdir() if tmp.exists() else ():
            p.unlink()
        if tmp.exists():
            tmp.rmdir()
    return CutResult(out, rng, frames, msgs, copied, notes)


def restrict(log: DriveLog, lo: int, hi: int) -> DriveLog:
    """``log`` with only the messages and frames whose frame id is in [lo, hi] (in
    memory): REF seen through a cut replay's range, so frames outside it are not
    counted as removed."""
    log.messages = {ch: [m for m in ms if m.frame_id is None or lo <= m.frame_id <= hi]
                    for ch, ms in log.messages.items()}
    log.frames = {ch: [f for f in fs if lo <= f.frame_id <= hi] for ch, fs in log.frames.items()}
    return log


def info_of(log: DriveLog) -> dict[str, Any] | None:
    """A cut's provenance (from its start entry), None for a recorded log."""
    c = log.info.get("cut")
    return c if isinstance(c, dict) else None


def title(log: DriveLog) -> str:
    """A log's name for titles: a cut is named after its source and range
    (``drive1 f142..f151``), not after its own directory (RUN/input)."""
    c = info_of(log)
    if c is None:
        return Path(str(log.path)).name
    fr = c.get("frames") or ["?", "?"]
    return f"{Path(str(c.get('from', log.path))).name} f{fr[0]}..f{fr[1]}"
