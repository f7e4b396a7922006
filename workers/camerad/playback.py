"""camerad playing recordings: a drive log (``--source log``) or a video file (``--source
video``). `workers.camerad.main` hands over to `run` for these sources.

Drive log, lockstep (``--lockstep ROLE``, what `supervisor replay` uses): frame n+1 is
published only once the channel bound to ROLE (in `supervisor replay`: the recorder's
acknowledgement that controlsd's command for the frame is written) carries a message for
frame n or later (its header's frame id), so every frame goes in only when the pipeline,
recorder included, is done with the one before: nothing is dropped, nothing races, and the run is
a function of the log. A frame whose command does not come within ``--step-timeout-s``
(the model refused the frame, a worker restarted) is counted as a step timeout and the
replay goes on. Without ``--lockstep``: ``--realtime`` paces frames at the recorded
capture times (``--wait-for ROLE``: not before ROLE's writer, the recorder, is attached);
otherwise at ``--fps``.

Every frame is stamped with this boot's clock when it is published (as a live camera
would: the bridge refuses stale and future timestamps); the recorded frame id and
exposure are kept, so consumers that need log time look the id up in the log's index
(controlsd ``--log-clock``).

At the end of the log the camera says ``replay=done frames=N timeouts=K log_lost=L`` in
its status and idles (watchdog pings) until it is stopped; the replay driver waits for
that line. A video file plays at its own frame rate and, with ``--loop``, starts over.
"""
from __future__ import annotations

import argparse
import signal
import time

import numpy as np

from supervisor.ipc import (
    BridgeError,
    ChannelTimeout,
    LeaseLost,
    Reader,
    ReaderHandle,
    Rejected,
)

from .video import LogSource, Recorded, SourceError, VideoFileSource

PING_S = 0.05          # watchdog pings at least this often (camerad's watchdog: 500 ms)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-channel", default="road_frames",
                   help="--source log: the frame channel of the log to play")
    p.add_argument("--video", default=None, help="--source video: a video file")
    p.add_argument("--lockstep", default=None, metavar="ROLE",
                   help="--source log: wait for ROLE's message for each frame before the next")
    p.add_argument("--step-timeout-s", type=float, default=5.0)
    p.add_argument("--realtime", action="store_true",
                   help="--source log: publish at the recorded capture times")
    p.add_argument("--wait-for", default=None, metavar="ROLE",
                   help="--source log: start once ROLE's writer (the recorder) is attached")


def open_source(a: argparse.Namespace):
    if a.source == "log":
        if not a.log:
            raise SourceError("--source log needs --log DIR")
        src = LogSource(a.log, a.log_channel)
    else:
        if not a.video:
            raise SourceError("--source video needs --video FILE")
        src = VideoFileSource(a.video, a.width, a.height)
    want = (a.width or src.width, a.height or src.height, a.format or "nv12")
    if isinstance(src, LogSource) and want != (src.width, src.height, "nv12"):
        raise SourceError(f"{a.log} holds {src.width}x{src.height} nv12, asked for "
                          f"{want[0]}x{want[1]} {want[2]}")
    if (a.format or "nv12") != "nv12":
        raise SourceError("recorded sources publish nv12 only")
    return src


def _fill(planes, data: bytes, w: int, h: int) -> None:
    flat = np.frombuffer(data, np.uint8)
    planes[0][...] = flat[:w * h].reshape(h, w)
    planes[1][...] = flat[w * h:].reshape(h // 2, w // 2, 2)


class Lockstep:
    """Waits for the downstream message of a frame on a read-only reader."""

    def __init__(self, ctx, role: str, timeout_s: float) -> None:
        self.ctx, self.role, self.timeout_s = ctx, role, timeout_s
        self.reader: Reader | None = None
        self.last_id = -1
        self.timeouts = 0

    def attach(self, ping) -> None:
        """The command's writer starts after the camera (it is downstream): attach
        once it is there, pinging the watchdog meanwhile."""
        # A reader of a channel whose writer is not up yet waits for it; short tries.
        handle = ReaderHandle.from_json(self.ctx._handle_json(self.role))
        while self.reader is None:
            try:
                self.reader = Reader(handle, attach_timeout_s=0.05)
            except BridgeError:
                ping()

    def wait_for(self, frame_id: int, ping, stopped) -> bool:
        """True once a message for ``frame_id`` (or later) was seen; False on timeout."""
        end = time.monotonic() + self.timeout_s
        while self.last_id < frame_id:
            if stopped():
                return False
            left = end - time.monotonic()
            if left <= 0:
                self.timeouts += 1
                return False
            ping()
            try:
                msg = self.reader.receive(timeout=min(left, PING_S))
            except ChannelTimeout:
                continue
            except Rejected:
                continue
            try:
                with msg:
                    fid = msg.stamp.frame_id
            except LeaseLost:
                continue
            if fid is not None:
                self.last_id = max(self.last_id, fid)
        return True


def run(ctx, a: argparse.Namespace) -> int:
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        src = open_source(a)
    except SourceError as e:
        ctx.log(f"source refused: {e}")
        return 2
    writer = ctx.writer("frames")
    w, h = src.width, src.height
    kind = "log" if isinstance(src, LogSource) else "video"
    fps = src.fps if (kind == "video" and not a.fps_given) else a.fps
    mode = ("lockstep" if a.lockstep else "realtime" if a.realtime else f"{fps:g} Hz")
    ctx.ready(status=f"source={kind} {w}x{h} nv12 {mode} -> {ctx.channel_of('frames')}")
    last_ping = [0.0]

    def ping() -> None:
        now = time.monotonic()
        if now - last_ping[0] >= PING_S:
            ctx.watchdog()
            last_ping[0] = now

    step = Lockstep(ctx, a.lockstep, a.step_timeout_s) if a.lockstep else None
    if step is not None:
        step.attach(ping)
    elif a.wait_for:
        Lockstep(ctx, a.wait_for, 0).attach(ping)   # (its writer is up: the log is whole)
    published = 0
    period = 1.0 / fps
    t0 = time.monotonic()
    rec0: int | None = None
    status_at = t0
    id_base = 0                          # a looping clip's ids continue where they were
    while not stop:
        for f in src:
            if stop:
                break
            if step is None:             # paced: recorded times, or the frame rate
                if a.realtime and kind == "log":
                    rec0 = f.capture_ts_ns if rec0 is None else rec0
                    due = t0 + (f.capture_ts_ns - rec0) / 1e9
                else:
                    due = t0 + published * period
                while not stop and (left := due - time.monotonic()) > 0:
                    ping()
                    # `left` read once: two reads of the clock raced under load (the
                    # second past `due` gave a negative sleep: ValueError).
                    time.sleep(min(left, PING_S))
            if id_base:
                f = Recorded(f.frame_id + id_base, f.capture_ts_ns, f.exposure_us, f.data)
            _publish(writer, f, w, h, a.sensor)
            last_id = f.frame_id
            published += 1
            if step is not None:
                step.wait_for(f.frame_id, ping, lambda: bool(stop))
            ping()
            if time.monotonic() - status_at >= a.status_s:
                status_at = time.monotonic()
                ctx.status(f"source={kind} frames={published}"
                           + (f" timeouts={step.timeouts}" if step else ""))
        if kind != "video" or not a.loop or published == 0:
            break
        src.loops += 1
        id_base = last_id + 1
    lost = src.lost_records if kind == "log" else 0
    timeouts = step.timeouts if step else 0
    done = (f"replay=done frames={published} timeouts={timeouts} log_lost={lost} "
            f"stopped={'sigterm' if stop else 'end'}")
    if kind == "log" and lost:
        ctx.log(f"{a.log}: {src.loss_text}")
    ctx.status(done)
    ctx.log(done)
    if kind == "video":
        return 0                        # a clip that ended: the restart policy decides
    while not stop:                     # the driver stops us once it has read the line
        ping()
        time.sleep(PING_S)
    return 0


def _publish(writer, f: Recorded, w: int, h: int, sensor: str) -> None:
    with writer.loan() as loan:
        planes = loan.frame("nv12", w, h, sensor=sensor)
        _fill(planes, f.data, w, h)
        loan.publish(frame_id=f.frame_id, capture_ts_ns=time.monotonic_ns(),
                     exposure_us=f.exposure_us)
