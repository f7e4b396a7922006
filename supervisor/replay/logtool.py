"""``supervisor log``: look into a drive log (or a RUN's ``log/``) without replaying it.

    supervisor log info LOG                       channels, counts, duration, losses, closed?
    supervisor log cat LOG CHANNEL [--format jsonl|csv]   one line per message
    supervisor log frames LOG --out DIR [--every N] [--channel C]   frames as PNG
    supervisor log cut LOG [--start S] [--end S] OUT      a part as a new log (see `cut`)

Reading only: nothing here starts a worker or writes into the log (``cut`` writes a
new one). Losses are reported
as `DriveLog.full_loss` counts them (partial or corrupt records, a log never closed,
frames without video, messages the recorder dropped).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

from supervisor.outdir import OutDir, OutDirError
from supervisor.protocol import printable

from .drivelog import DriveLog, Msg
from .logfmt import MESSAGES, LogError


class LogToolError(Exception):
    """One line: why the log cannot be shown as asked."""


def open_log(path: str) -> DriveLog:
    p = Path(path)
    if not (p / MESSAGES).is_file() and (p / "log" / MESSAGES).is_file():
        p = p / "log"                      # a RUN directory: its log
    try:
        return DriveLog.open(p)
    except LogError as e:
        raise LogToolError(str(e)) from None


def _payload_fields(log: DriveLog, channel: str, width: int) -> list[str]:
    from schemas.payloads import PAYLOADS

    p = PAYLOADS.get(channel)              # the default configs name channels after them
    if p is not None and len(p.fields) == width:
        return list(p.fields)
    return [f"v{i}" for i in range(width)]


def info(log: DriveLog) -> dict[str, Any]:
    """What a log holds, and what it lost."""
    chans: dict[str, Any] = {}
    times: list[int] = []
    for ch, msgs in sorted(log.messages.items()):
        chans[ch] = {"kind": "tensor", "messages": len(msgs),
                     "with_frame_id": sum(m.frame_id is not None for m in msgs),
                     "receipts": sum(m.receipt is not None for m in msgs)}
        times += [m.publish_ts_ns for m in msgs]
    videos = set(log.video_channels())
    for ch, frames in sorted(log.frames.items()):
        entry: dict[str, Any] = {"kind": "frame", "frames": len(frames)}
        if frames:
            entry["size"] = f"{frames[0].width}x{frames[0].height} {frames[0].pixel_format}"
            entry["frame_ids"] = [frames[0].frame_id, frames[-1].frame_id]
            times += [f.capture_ts_ns for f in frames]
        if ch in videos:
            try:
                v = log.video(ch)
                entry["video"] = {"codec": v.info.codec, "frames": len(v), "fps": v.info.fps}
                v.close()
            except LogError as e:
                entry["video"] = {"error": str(e)}
        chans[ch] = entry
    for ch, d in log.drops.items():
        chans.setdefault(ch, {})["recorder_drops"] = d.total
    loss = log.full_loss()
    return {"log": str(log.path), "closed": log.closed, "recorder": log.info,
            "cut": log.info.get("cut") if isinstance(log.info.get("cut"), dict) else None,
            "duration_s": round((max(times) - min(times)) / 1e9, 3) if len(times) > 1 else 0.0,
            "channels": chans, "lifecycle_events": len(log.events),
            "loss": {"text": loss.text(), "partial_records": loss.truncated_records,
                     "corrupt_records": loss.corrupt_records, "not_closed": loss.not_closed,
                     "frames_without_video": loss.frames_without_video,
                     "recorder_drops": sum(loss.recorder_drops.values()),
                     "problems": loss.problems[:20]}}


def render_info(d: dict[str, Any]) -> str:
    lines = [f"log {d['log']}: {'closed' if d['closed'] else 'NOT closed'}, "
             f"{d['duration_s']:.2f} s, {d['lifecycle_events']} lifecycle events"]
    c = d.get("cut")
    if c:
        fr = c.get("frames") or ["?", "?"]
        lines.append(f"  cut from {c.get('from')}: frames f{fr[0]}..f{fr[1]} (--start "
                     f"{c.get('start')} --end {c.get('end')})")
    for ch, c in d["channels"].items():
        if c.get("kind") == "frame":
            v = c.get("video") or {}
            vid = (f"video {v['codec']} {v['frames']} frames" if "codec" in v
                   else f"video: {v['error']}" if "error" in v else "no video")
            lines.append(f"  {ch}: {c['frames']} frames {c.get('size', '')}, {vid}"
                         + (f", ids {c['frame_ids'][0]}..{c['frame_ids'][1]}"
                            if "frame_ids" in c else ""))
        elif c.get("kind") == "tensor":
            lines.append(f"  {ch}: {c['messages']} messages ({c['with_frame_id']} with a "
                         f"frame id, {c['receipts']} receipts)")
        if c.get("recorder_drops"):
            lines.append(f"    recorder dropped {c['recorder_drops']}")
    lines.append(f"  loss: {d['loss']['text']}")
    # Names and texts come from the log (someone's laptop): nothing in them may act on
    # the developer's terminal (red team: a channel name set the window title).
    return "\n".join(printable(ln) for ln in lines) + "\n"


def rows(log: DriveLog, channel: str):
    """(header, row dicts) of a tensor channel or of a frame channel's metadata."""
    if channel in log.messages:
        msgs: list[Msg] = log.messages[channel]
        width = msgs[0].array.size if msgs else 0
        names = _payload_fields(log, channel, width)
        head = ["sequence", "frame_id", "publish_ts_ns", "capture_ts_ns", *names]
        if any(m.receipt is not None for m in msgs):
            head += ["latency_ms"]
        for m in msgs:
            r = {"sequence": m.sequence, "frame_id": m.frame_id,
                 "publish_ts_ns": m.publish_ts_ns, "capture_ts_ns": m.capture_ts_ns}
            r.update(zip(names, (float(v) for v in m.array.ravel())))
            if m.receipt is not None:
                r["latency_ms"] = m.receipt.latency_ns / 1e6
            yield head, r
        return
    if channel in log.frames:
        head = ["sequence", "frame_id", "publish_ts_ns", "capture_ts_ns", "exposure_us",
                "width", "height", "pixel_format", "video_index"]
        for f in log.frames[channel]:
            yield head, {k: getattr(f, k) for k in head}
        return
    have = ", ".join(sorted({*log.messages, *log.frames})) or "none"
    raise LogToolError(f"{log.path}: no channel {channel!r} (channels: {have})")


def cat(log: DriveLog, channel: str, fmt: str, out: Any = None) -> int:
    out = out if out is not None else sys.stdout   # at call time: stdout may be replaced
    n = 0
    writer = None
    for head, r in rows(log, channel):
        if fmt == "csv":
            # csv quotes, it does not escape: every string from the log (a frame's
            # pixel_format, a payload's field names) goes through printable() as in
            # `log info` (red team round 5: ESC ]0;...BEL set the window title).
            head = [printable(h) for h in head]
            r = {printable(k): printable(v) if isinstance(v, str) else v for k, v in r.items()}
            if writer is None:
                writer = csv.DictWriter(out, fieldnames=head, extrasaction="ignore")
                writer.writeheader()
            writer.writerow(r)
        else:
            out.write(json.dumps(r) + "\n")
        n += 1
    return n


def frames(log: DriveLog, channel: str | None, out_dir: str, every: int) -> int:
    """Every ``every``-th frame of the video as ``<frame_id>.png`` (RGB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from workers.camerad.synthetic import nv12_to_rgb

    chans = log.video_channels()
    ch = channel or (chans[0] if chans else None)
    if ch is None or ch not in chans:
        raise LogToolError(f"{log.path}: no video{'' if ch is None else f' of {ch!r}'} "
                           f"(videos: {', '.join(chans) or 'none'})")
    try:
        v = log.video(ch)
    except LogError as e:
        raise LogToolError(str(e)) from None
    # DIR by supervisor.outdir's rule (root may run this): each picture through DIR's
    # fd, never through a link planted under its name (red team round 5, same class).
    try:
        out = OutDir.open(out_dir, what="log frames --out", empty=False, mode=0o755,
                          parents=True)
    except OutDirError as e:
        raise LogToolError(str(e)) from None
    w, h = v.info.width, v.info.height
    n = 0
    with out:
        for e, data in v.frames():
            if e.n % max(1, every):
                continue
            flat = np.frombuffer(data, np.uint8)
            rgb = nv12_to_rgb(flat[:w * h].reshape(h, w),
                              flat[w * h:].reshape(h // 2, w // 2, 2))
            png = io.BytesIO()
            plt.imsave(png, rgb, format="png")
            try:
                out.write_bytes(f"{e.frame_id}.png", png.getvalue())
            except OSError as err:
                raise LogToolError(f"{out.join(f'{e.frame_id}.png')}: {err.strerror}") from None
            n += 1
    return n


def add_log_args(s: argparse.ArgumentParser) -> None:
    sub = s.add_subparsers(dest="log_cmd", required=True)
    i = sub.add_parser("info", help="channels, counts, duration, losses, closed or not")
    i.add_argument("log", metavar="LOG")
    i.add_argument("--format", choices=("text", "json"), default="text")
    c = sub.add_parser("cat", help="a channel's messages as JSON lines or CSV")
    c.add_argument("log", metavar="LOG")
    c.add_argument("channel", metavar="CHANNEL")
    c.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    f = sub.add_parser("frames", help="the road video's frames as PNG files")
    f.add_argument("log", metavar="LOG")
    f.add_argument("--out", required=True, metavar="DIR")
    f.add_argument("--channel", default=None, help="a frame channel (default: the first video)")
    f.add_argument("--every", type=int, default=1, help="every Nth frame")
    k = sub.add_parser("cut", help="a part of the log as a new log (replay, info accept it)")
    k.add_argument("log", metavar="LOG")
    k.add_argument("out", metavar="OUT", help="new log directory (new or empty)")
    k.add_argument("--start", default=None, metavar="S",
                   help="first frame kept: seconds of log time (12.5) or a frame id (f120); "
                        "default: the log's start")
    k.add_argument("--end", default=None, metavar="S",
                   help="first frame no longer kept (same units); default: the log's end")


def cmd_log(args: argparse.Namespace) -> int:
    """Exit 0, or 2 with one line (no such log or channel, a missing extra)."""
    from .logfmt import REPLAY_EXTRA

    from .cut import CutError, cut, parse_pos

    try:
        log = open_log(args.log)
        if args.log_cmd == "cut":
            res = cut(log.path, args.out, parse_pos(args.start, "--start"),
                      parse_pos(args.end, "--end"))
            sys.stdout.write("".join(printable(ln) + "\n" for ln in res.text().splitlines()))
        elif args.log_cmd == "info":
            d = info(log)
            sys.stdout.write(json.dumps(d, indent=2) + "\n" if args.format == "json"
                             else render_info(d))
        elif args.log_cmd == "cat":
            cat(log, args.channel, args.format)
        else:
            n = frames(log, args.channel, args.out, args.every)
            print(f"{n} frames written to {args.out}")
    except (LogToolError, CutError) as e:
        print(printable(f"supervisor log: {e}"), file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        print(f"supervisor log: needs {e.name}, which is not installed: {REPLAY_EXTRA}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:                 # `supervisor log cat ... | head`
        return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m supervisor.replay.logtool``: the same, until the CLI has ``log``."""
    p = argparse.ArgumentParser(prog="supervisor log")
    add_log_args(p)
    return cmd_log(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
