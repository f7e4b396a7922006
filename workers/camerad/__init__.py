"""camerad: the camera worker. Publishes road frames zero-copy into a frame channel.

    python -m supervisor.runner workers.camerad [--source synthetic|replay|log|video]
        [--log FILE|DIR] [--video FILE] [--lockstep ROLE] [--realtime]
        [--loop] [--width 1928] [--height 1208] [--fps 20] [--format nv12|rgb888|gray8]
        [--seed 0] [--frames N] [--sensor road] [--exposure-us 10000]
        [--trigger start|clock] [--status-s 1.0]

Sources:

* ``synthetic`` (default): `synthetic.scene(--sensor)` (road: `SyntheticRoad`; wide: the
  same drive through a 120 degree lens; driver: `SyntheticDriver`'s cabin; seeded by
  ``--seed``, scene time = frame_id / fps) renders NV12 straight into the loaned slot; ``rgb888`` / ``gray8``
  render into a scratch NV12 frame and convert into the slot.
* ``log`` / ``video``: a drive log (supervisor/replay) or a plain video file, played by
  `playback` (lockstep for `supervisor replay`, recorded pace, or the file's rate).
* ``replay``: frames of a recorded log (`replay.py` documents the format), published
  in the log's own format and size (``--width/--height/--format`` must agree if given;
  the log file must be visible inside the sandbox). Bad records are skipped and counted
  (status ``log_errors=``); ``--loop`` starts over at the end, with frame ids continued
  so they keep increasing. Frames are paced at ``--fps`` and stamped with this boot's
  clock like live frames (the recorded capture time belongs to another boot); the
  recorded frame id and exposure are kept.

Timing: frames follow a monotonic schedule ``t0 + k/fps`` (no drift). Frame k's
exposure is taken to end at the moment its slot comes up (``capture_ts_ns`` is read
just before the pixels are rendered/copied); ``frame_id = k``. A frame that starts
more than one period late counts as an overrun, and like a real camera we skip the
slots already missed (counted as ``dropped``, the frame ids skip too) rather than
bursting to catch up. ``--trigger clock``: the schedule is the grid ``k/fps`` of
CLOCK_MONOTONIC itself (k counted from boot), ``frame_id = k`` and ``capture_ts_ns =
k / fps`` (the trigger's instant, as a hardware-triggered sensor stamps it, however late
this process woke to render it), so cameras started with it give the frames of one
instant one id and one capture time (the driving model pairs the road and wide cameras
by them); the default ``start`` counts from this camera's own start. Status line (every ``--status-s``): fps over the window, frames,
overruns, dropped, mean/max publish time.

Channels (bound by the config, never named here): output role ``frames``.

Stops after ``--frames N`` (0 = forever) or on SIGTERM, exiting 0.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

import numpy as np

from supervisor.worker import WorkerContext

from . import playback
from .replay import ReplayError, ReplayLog
from .synthetic import nv12_to_gray, nv12_to_rgb, scene

# The roles this worker's code asks for; `supervisor check` verifies the config binds them.
ROLES = {"out": ("frames",)}
# Refused by `supervisor check` in a vehicle config (supervisor/config/_runtime.py): in a
# car, recorded pixels must never reach control, nor may another domain pace the camera.
SIMULATION_ONLY = {
    "--source": ("recorded or file frames instead of the camera", ("replay", "log", "video")),
    "--lockstep": "the camera waits for another worker before each frame",
    "--wait-for": "the camera waits for another worker before its first frame",
}

FORMATS = ("nv12", "rgb888", "gray8")
SENSORS = ("road", "wide", "driver", "unknown")
# The longest one sleep may last: the watchdog needs a ping at least every 100 ms.
MAX_SLEEP_S = 0.05


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.camerad", allow_abbrev=False)  # SIMULATION_ONLY matches exactly
    p.add_argument("--source", choices=("synthetic", "replay", "log", "video"),
                   default="synthetic")
    p.add_argument("--log", default=None, help="recorded log (--source replay)")
    p.add_argument("--loop", action="store_true", help="replay: start over at the end")
    p.add_argument("--width", type=int, default=None, help="default 1928 (replay: the log's)")
    p.add_argument("--height", type=int, default=None, help="default 1208 (replay: the log's)")
    p.add_argument("--fps", type=float, default=None, help="default 20 (video: the file's)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="default nv12 (replay: the log's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=0, help="stop after N frames (0 = forever)")
    p.add_argument("--sensor", choices=SENSORS, default="road")
    p.add_argument("--exposure-us", type=int, default=10_000,
                   help="synthetic exposure time reported in FrameMeta")
    p.add_argument("--trigger", choices=("start", "clock"), default="start",
                   help="clock: frames on the shared k/fps grid of CLOCK_MONOTONIC, frame "
                        "id k (cameras of one instant share ids); start: from 0 at start")
    p.add_argument("--status-s", type=float, default=1.0)
    playback.add_args(p)      # --source log / video (workers/camerad/playback.py)
    a = p.parse_args(argv)
    a.fps_given = a.fps is not None
    a.fps = 20.0 if a.fps is None else a.fps
    if a.fps <= 0:
        p.error("--fps must be > 0")
    if a.frames < 0:
        p.error("--frames must be >= 0")
    if a.source == "replay" and not a.log:
        p.error("--source replay needs --log FILE")
    return a


class _Synthetic:
    def __init__(self, a: argparse.Namespace) -> None:
        self.width = a.width or 1928
        self.height = a.height or 1208
        self.format = a.format or "nv12"
        self.road = scene(a.sensor, self.width, self.height, a.seed, fps=a.fps)  # per --sensor
        self.exposure_us = a.exposure_us
        if self.format != "nv12":
            self._y, self._uv, _ = self.road.render(0)

    def fill(self, k: int, planes: tuple[np.ndarray, ...]) -> tuple[int, int | None]:
        """Render frame k into the loan's planes; returns (frame_id, exposure_us)."""
        if self.format == "nv12":
            self.road.render_into(k, planes[0], planes[1])
        else:
            self.road.render_into(k, self._y, self._uv)
            if self.format == "gray8":
                nv12_to_gray(self._y, self._uv, out=planes[0])
            else:
                nv12_to_rgb(self._y, self._uv, out=planes[0])
        return k, self.exposure_us

    def status(self) -> str:
        return f"source=synthetic seed={self.road.seed}"


class _Replay:
    def __init__(self, a: argparse.Namespace) -> None:
        self.log = ReplayLog(a.log)
        h = self.log.header
        want = (a.width or h.width, a.height or h.height, a.format or h.pixel_format)
        if want != (h.width, h.height, h.pixel_format):
            raise ReplayError(f"{a.log} holds {h.width}x{h.height} {h.pixel_format}, "
                              f"asked for {want[0]}x{want[1]} {want[2]}")
        if h.pixel_format not in FORMATS:
            raise ReplayError(f"{a.log}: camerad does not publish {h.pixel_format}")
        self.width, self.height, self.format = h.width, h.height, h.pixel_format
        self.loop = a.loop
        self.loops = 0
        self._it = iter(self.log)
        self._id_base = 0          # added to recorded ids after each loop
        self._last_id = -1
        self._past_errors = 0      # bad records counted in finished passes
        self.exhausted = False

    def next_frame(self):
        """The next good recorded frame and the frame id to publish it under, or
        (None, None) at the end of the log (never with --loop unless it has no good
        frame at all)."""
        f = next(self._it, None)
        if f is None:
            if not self.loop or self.log.good == 0:
                self.exhausted = True
                return None, None
            self.loops += 1
            self._past_errors += self.log.error_count
            self._it = iter(self.log)
            f = next(self._it, None)
            if f is None:
                self.exhausted = True
                return None, None
            # Recorded ids start over: shift them to continue after the last one.
            self._id_base = self._last_id + 1 - f.frame_id
        fid = f.frame_id + self._id_base
        self._last_id = fid
        return f, fid

    def status(self) -> str:
        errs = self._past_errors + self.log.error_count
        return f"source=replay loops={self.loops} log_errors={errs}"


def _planes_fill(planes: tuple[np.ndarray, ...], data: memoryview, fmt: str,
                 w: int, h: int) -> None:
    flat = np.frombuffer(data, np.uint8)
    if fmt == "nv12":
        planes[0][...] = flat[:w * h].reshape(h, w)
        planes[1][...] = flat[w * h:].reshape(h // 2, w // 2, 2)
    elif fmt == "gray8":
        planes[0][...] = flat.reshape(h, w)
    else:
        planes[0][...] = flat.reshape(h, w, 3)


def main(ctx: WorkerContext) -> int:
    refused = ctx.simulation_only_problem(SIMULATION_ONLY, sys.argv[1:])
    if refused:
        ctx.log(refused)
        return 2
    a = parse_args(sys.argv[1:])
    if a.source in ("log", "video"):
        return playback.run(ctx, a)
    stop = False

    def on_term(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    # Start-up (before ready: after it, no more files or exec): the source, the writer.
    try:
        src = _Synthetic(a) if a.source == "synthetic" else _Replay(a)
    except (ReplayError, OSError, ValueError) as e:
        ctx.log(f"source refused: {e}")
        return 2
    writer = ctx.writer("frames")
    w, h, fmt = src.width, src.height, src.format
    ctx.ready(status=f"{src.status()} {w}x{h} {fmt} @ {a.fps:g} Hz -> {ctx.channel_of('frames')}")

    period = int(round(1e9 / a.fps))
    status_ns = int(a.status_s * 1e9)
    t0 = time.monotonic_ns()
    k = 0                     # schedule slot (= synthetic frame id)
    if a.trigger == "clock":
        # The shared grid: slot k is due at k * period on the monotonic clock (the first
        # one not yet past), for every camera started so.
        k, t0 = -(-t0 // period), 0
    published = overruns = dropped = 0
    win_start, win_frames, pub_sum, pub_max = t0, 0, 0, 0
    while not stop and (a.frames == 0 or published < a.frames):
        due = t0 + k * period
        while True:
            now = time.monotonic_ns()
            ctx.watchdog()
            if now >= due or stop:
                break
            time.sleep(min((due - now) / 1e9, MAX_SLEEP_S))
        if stop:
            break
        late = now - due
        if late > period:
            overruns += 1
            missed = late // period
            dropped += missed
            k += missed
        # On the shared trigger the exposure is the slot's instant, whenever this
        # process got the CPU to render it (a sensor stamps its trigger, not its
        # driver's wake-up): frames of one id from two cameras carry one capture time,
        # and a late wake-up shows as capture -> publish time, where it belongs.
        capture_ts = k * period if a.trigger == "clock" else time.monotonic_ns()
        with writer.loan() as loan:
            planes = loan.frame(fmt, w, h, sensor=a.sensor)
            if isinstance(src, _Synthetic):
                frame_id, exposure = src.fill(k, planes)
            else:
                f, frame_id = src.next_frame()
                if f is None:
                    break         # log over (the loan is discarded)
                _planes_fill(planes, f.data, fmt, w, h)
                exposure = f.exposure_us
            loan.publish(frame_id=frame_id, capture_ts_ns=capture_ts, exposure_us=exposure)
        done = time.monotonic_ns()
        published += 1
        win_frames += 1
        pub_sum += done - capture_ts
        pub_max = max(pub_max, done - capture_ts)
        k += 1
        if done - win_start >= status_ns:
            fps = win_frames * 1e9 / (done - win_start)
            ctx.status(f"{src.status()} fps={fps:.2f} frames={published} overruns={overruns} "
                       f"dropped={dropped} publish_ms_mean={pub_sum / win_frames / 1e6:.2f} "
                       f"publish_ms_max={pub_max / 1e6:.2f}")
            win_start, win_frames, pub_sum, pub_max = done, 0, 0, 0
    line = (f"{src.status()} frames={published} overruns={overruns} dropped={dropped} "
            f"stopped={'sigterm' if stop else 'done'}")
    ctx.status(line)
    if isinstance(src, _Replay) and src.log.error_count:
        ctx.log(f"{a.log}: {src.log.summary()}", problems=src.log.problems[:10])
    ctx.log(line)
    return 0
