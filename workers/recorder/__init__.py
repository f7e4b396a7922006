"""recorder: writes every channel it reads into a drive log (supervisor/replay/logfmt.py).

    python -m supervisor.runner workers.recorder --out DIR [--channels a,b,...]
        [--video h264|raw] [--fps 20] [--status-s 1.0]

It runs in a domain of its own (research profile: never control, no torch needed) and
attaches to each channel as one more read-only reader (``shadow_subscribes`` in the
derived config, so it imposes no start order and never feeds actuation). Frames go to
the channel's video (H.264 by default; ``--video raw`` keeps the NV12 bytes for
bit-exact replays) with their metadata in the message stream; tensor messages are
stored whole with their receipts.

A recorder that cannot keep up (slow disk, slow encoder) is only a slow reader: the
writers never wait for it (leases are bounded by the channel's lease_ms), and what it
missed is counted per channel (sequence gaps, rejections, lost leases) and written to
the log as ``drops`` entries and in its status line. On SIGTERM it drains what is still
in the rings, writes a closing summary and exits 0.

A write that fails (the disk is full, or any other I/O error) stops the recording, not
the recorder: it says so in one `log` record (``fault = "disk_full"`` or
``"write_error"``, which `supervisor record`/`replay` wait for and turn into one line and
their exit code), leaves the log whole up to there (a short write is cut back off the
file, no temporary file stays) and waits, pinging its watchdog, for SIGTERM. It never
exits with a traceback, and nothing is restarted: the control domain never notices.
"""
from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from supervisor.ipc import BridgeError, LeaseLost, Reader, Rejected
from supervisor.worker import WorkerContext

IDLE_S = 0.002          # nothing new on any channel: sleep this long
ATTACH_EVERY_S = 0.1    # a shadow channel's writer not up yet: looked for this often
PING_S = 0.1
DROPS_EVERY_S = 1.0
FINAL_DRAIN_S = 1.0
# Frames waiting for the encoder thread (H.264 at 1928x1208 is ~17-40 fps on this kind of
# machine: a short burst is absorbed, a sustained overload drops pixels, counted).
ENCODE_QUEUE = 8


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.recorder")
    p.add_argument("--out", required=True, help="the log directory (writable here)")
    p.add_argument("--channels", default="", help="comma-separated; default: every channel given")
    p.add_argument("--video", choices=("h264", "raw", "none"), default="h264",
                   help="none: frame metadata only (a replay's own output log)")
    p.add_argument("--fps", type=float, default=20.0, help="nominal rate (video metadata)")
    p.add_argument("--status-s", type=float, default=1.0)
    p.add_argument("--ack", default=None, metavar="ROLE",
                   help="replay lockstep: publish the frame id of each --ack-on message "
                        "once it is written")
    p.add_argument("--ack-on", default=None, metavar="CHANNEL")
    p.add_argument("--io-delay-ms", type=float, default=0.0,
                   help="testing: stall this long per frame written, as a slow disk would")
    return p.parse_args(argv)


@dataclass
class Tap:
    """One channel being recorded, and what was reported of its losses so far."""

    name: str
    reader: Reader | None            # None: a shadow channel whose writer is not up yet
    video: bool = True               # store frame pixels (else metadata only)
    recorded: int = 0
    skipped: int = 0                 # our own failures (lost lease while copying)
    reported: tuple[int, int, int, int] = (0, 0, 0, 0)
    last: dict[str, int] = field(default_factory=dict)
    # A shadow channel's writer may be an optional worker starting after the recorder
    # (research), or never: its reader is opened when the writer is up, looked for at
    # most every ATTACH_EVERY_S.
    attach: Callable[[], Reader | None] | None = None
    looked_at: float = float("-inf")

    refused: str = ""                # why its writer's segment could not be attached
    say: Callable[[str], None] | None = None    # the worker's log (ctx.log)

    def attached(self) -> bool:
        if self.reader is None and self.attach is not None:
            now = time.monotonic()
            if now - self.looked_at >= ATTACH_EVERY_S:
                self.looked_at = now
                try:
                    self.reader = self.attach()
                except BridgeError as e:
                    # A shadow channel's writer (research) with a header that is not
                    # the spec's: that channel's loss, said once and looked at again,
                    # never the recording's end (red team 14 row 1: it had killed the
                    # recorder, whose every restart then failed at the same header).
                    if str(e) != self.refused and self.say is not None:
                        self.say(f"channel {self.name!r}: not recorded while its writer's "
                            f"segment is refused: {e}")
                    self.refused = str(e)
        return self.reader is not None

    def counts(self) -> tuple[int, int, int, int]:
        if self.reader is None:
            return 0, 0, 0, self.skipped
        s = self.reader.stats
        return s.dropped, sum(s.rejected.values()), s.leases_lost, self.skipped


class Ack:
    """Tells the replaying camera which frame's command is on disk (lockstep).

    Before it acknowledges a frame, every other channel is drained: at that moment the
    pipeline is stalled (the camera waits for this very acknowledgement) and everything
    the command came from (the frame, the model output) is already published, so
    taking it now means nothing published before the command can be lost, whatever the
    writers do with their slots once the next frame goes in. (Without this, under load,
    a model output published just before its command could be missed: 1 in 77 here.)"""

    def __init__(self, writer, channel: str) -> None:
        self.writer, self.channel = writer, channel
        self.others: list[Tap] = []        # every tap but the acknowledged channel's

    def send(self, frame_id: int) -> None:
        with self.writer.loan() as loan:
            loan.array((1,), np.float32)[0] = float(frame_id % (1 << 24))
            loan.publish(frame_id=frame_id, capture_ts_ns=time.monotonic_ns())


IO_DELAY_S = 0.0      # --io-delay-ms: a slow disk, for tests of what a slow recorder does


def record_one(tap: Tap, log, msg, ack: Ack | None = None) -> None:
    """Copy one message out under its lease, release it, then write it (the lease is
    never held across the encoder or the disk)."""
    info = msg.frame
    stamp = msg.stamp
    if info is not None:
        keep = tap.video and info.pixel_format == "nv12"
        planes = tuple(np.array(p) for p in msg.planes()) if keep else None
        msg.release()                # raises LeaseLost if the camera overwrote it meanwhile
        n = log.frame(tap.name, stamp.sequence, stamp.publish_ts_ns, stamp.writer_pid,
                      info.frame_id, info.capture_ts_ns, info.exposure_us, info.width,
                      info.height, info.pixel_format, info.sensor, planes)
        if planes is not None and n < 0:
            tap.skipped += 1               # the encoder's queue was full: pixels dropped
        if IO_DELAY_S:
            time.sleep(IO_DELAY_S)
    else:
        arr = np.array(msg.array)
        receipt = msg.receipt
        msg.release()
        log.message(tap.name, stamp.sequence, stamp.publish_ts_ns, stamp.writer_pid,
                    stamp.frame_id, stamp.capture_ts_ns, arr, receipt)
        if ack is not None and tap.name == ack.channel and stamp.frame_id is not None:
            catch_up(ack.others, log)      # everything upstream of it, before the next frame
            ack.send(stamp.frame_id)       # written (one write(2)) before it is acknowledged
    tap.recorded += 1


CATCH_UP_LIMIT = 256      # per channel: more than any ring holds


def catch_up(taps: list[Tap], log) -> None:
    """Take everything the rings of ``taps`` hold now (no time slice: lockstep waits)."""
    for tap in taps:
        drain([tap], log, limit=CATCH_UP_LIMIT, slice_s=float("inf"))


def drain(taps: list[Tap], log, limit: int = 16, ack: Ack | None = None,
          slice_s: float = 0.05) -> int:
    """Up to ``limit`` messages per channel, each channel for at most about
    ``slice_s`` (a slow write on one channel must not starve the others); returns how
    many were taken."""
    got = 0
    for tap in taps:
        if not tap.attached():
            continue
        until = time.monotonic() + slice_s
        for _ in range(limit):
            if time.monotonic() > until:
                break
            try:
                msg = tap.reader.try_receive()
            except Rejected:
                continue             # counted by the reader (reported as drops)
            if msg is None:
                break
            try:
                record_one(tap, log, msg, ack)
            except LeaseLost:
                tap.skipped += 1
            got += 1
    return got


def report_drops(taps: list[Tap], log) -> None:
    for tap in taps:
        now = tap.counts()
        if now != tap.reported:
            d = [a - b for a, b in zip(now, tap.reported)]
            log.drops(tap.name, *d)
            tap.reported = now


def _tap(ctx: WorkerContext, name: str, *, video: bool) -> Tap:
    if name not in ctx.shadow_roles:
        return Tap(name, ctx.reader(name), video=video)
    tap = Tap(name, None, video=video, say=ctx.log,
              attach=functools.partial(ctx.shadow_reader, name, wait=False))
    tap.attached()
    return tap


def main(ctx: WorkerContext) -> int:
    from supervisor.replay.drivelog import LogWriter  # (PyAV loads here, before READY)
    from supervisor.replay.logfmt import is_no_space

    global IO_DELAY_S
    a = parse_args(sys.argv[1:])
    IO_DELAY_S = a.io_delay_ms / 1000
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    names = [c for c in a.channels.split(",") if c] or list(ctx.channels)
    try:
        taps = [_tap(ctx, n, video=a.video != "none") for n in names]
        ack = Ack(ctx.writer(a.ack), a.ack_on) if a.ack else None
        if ack is not None:
            ack.others = [t for t in taps if t.name != a.ack_on]
        log = LogWriter(a.out, names, info={"worker": ctx.name, "video": a.video,
                                            "fps": a.fps, "channels": names},
                        video_codec="h264" if a.video == "none" else a.video, fps=a.fps,
                        encode_queue=ENCODE_QUEUE)
    except OSError as e:
        if not is_no_space(e):
            ctx.log(f"cannot record: {e}")
            return 2
        ctx.ready(status="disk full")       # (not a start failure: nothing to restart)
        return write_failed(ctx, [], None, e, stop)
    except (KeyError, BridgeError) as e:
        ctx.log(f"cannot record: {e}")
        return 2
    ctx.ready(status=f"recording {', '.join(names)} -> {a.out} ({a.video})")
    try:
        record_until_stopped(ctx, taps, log, ack, stop, a.status_s)
        # Stopping: what is still in the rings was published before the stop; keep it
        # (for at most a second: writers still publishing must not keep a slow recorder
        # here until the supervisor's SIGKILL, which would cost the closing summary).
        end = time.monotonic() + FINAL_DRAIN_S
        while drain(taps, log, ack=ack) and time.monotonic() < end:
            pass
        report_drops(taps, log)
        log.close(closing_summary(taps))
    except OSError as e:
        return write_failed(ctx, taps, log, e, stop)
    ctx.status("stopped: " + status_text(taps))
    return 0


def record_until_stopped(ctx: WorkerContext, taps: list[Tap], log, ack: Ack | None,
                         stop: list[int], status_s: float) -> None:
    last_ping = last_drops = last_status = time.monotonic()
    while not stop:
        # Bounded batches: a SIGTERM is seen soon even when writing is slow.
        if drain(taps, log, ack=ack) == 0:
            time.sleep(IDLE_S)
        now = time.monotonic()
        if now - last_ping >= PING_S:
            ctx.watchdog()
            last_ping = now
        if now - last_drops >= DROPS_EVERY_S:
            report_drops(taps, log)
            last_drops = now
        if now - last_status >= status_s:
            ctx.status(status_text(taps))
            last_status = now


def closing_summary(taps: list[Tap]) -> dict[str, dict[str, int]]:
    return {t.name: {"recorded": t.recorded, "dropped": t.counts()[0],
                     "rejected": t.counts()[1], "leases_lost": t.counts()[2],
                     "skipped": t.skipped} for t in taps}


def write_failed(ctx: WorkerContext, taps: list[Tap], log, e: OSError,
                 stop: list[int]) -> int:
    """The log cannot be written any more: one record that says so, the log closed as
    far as the disk allows, then idle until SIGTERM (exiting would be a restart, and a
    restarted recorder would hit the same full disk)."""
    from supervisor.replay.logfmt import is_no_space

    fault = "disk_full" if is_no_space(e) else "write_error"
    where = e.filename or "the log"
    ctx.log(f"{'disk full' if fault == 'disk_full' else 'cannot write'}: {where}: "
            f"{e.strerror or e}; recording stopped (the log is whole up to here)",
            fault=fault, path=str(where), errno=e.errno,
            recorded={t.name: t.recorded for t in taps})
    try:
        if log is not None:
            log.close({**closing_summary(taps), "fault": fault})
    except OSError:
        pass                  # no room for the closing summary: the log reads as not closed
    ctx.status(f"stopped: {fault}: " + status_text(taps))
    while not stop:
        ctx.watchdog()
        time.sleep(PING_S)
    return 0


def status_text(taps: list[Tap]) -> str:
    parts = []
    for t in taps:
        dropped, rejected, lost, skipped = t.counts()
        parts.append(f"{t.name}={t.recorded}" + (f"(dropped={dropped},rejected={rejected},"
                                                 f"lost={lost + skipped})"
                                                 if dropped or rejected or lost or skipped else ""))
    return "recorded " + " ".join(parts)
