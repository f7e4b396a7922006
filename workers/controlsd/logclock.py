"""controlsd on the log's clock (``--log-clock LOG``): what `supervisor replay` runs.

Live, controlsd judges model outputs against the wall clock and also publishes between
outputs (at least ``--hz``), so its commands depend on scheduling. In a replay they do
not: the law steps on the clock the log recorded, read before READY, and exactly one
command is published per model output, carrying the frame id in its header. Two
replays of one log therefore give bit-identical commands, and camerad's lockstep waits
for that frame id. Which clock:

* **The drive's** (a log whose commands carry frame ids: every live command is stamped
  with the frame id of the newest output it used and the time its law stepped at).
  The law steps exactly where the car's did: the car's steps between outputs are
  replayed without publishing (they move the rate-limited steer and can time out),
  and each output is stepped at the time the car first acted on it, with the frame's
  recorded capture time as its age reference. With the car's model outputs (a
  lossless log, the same model) the commands are the car's, bit for bit: `--ref self`
  compares them. An output the car never acted on (it took a newer one) still gets a
  command, from a copy of the law, so the car's own steps stay exact (status
  ``off_drive=``; a comparison shows it as added). The log begins mid-drive: the law
  resumes from the car's last command before the first output (`DriveClock`).
* **The frames'** (an older log): each output is stepped at the recorded capture time
  of its frame, which is also its age reference.

An output whose frame id is not in the log (it cannot be placed in time) gets no
command and is counted (status ``unplaced=``). On SIGTERM one last SHUTDOWN command
(at the last log time) is published, as live.
"""
from __future__ import annotations

import copy
import math
import signal
import time

import numpy as np

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import BridgeError, ChannelTimeout, LeaseLost, Rejected

from .law import Command, ControlLaw, ModelOutput, SafeReason

WAIT_S = 0.05


def load_clock(log_dir: str, channel: str) -> dict[int, int]:
    from supervisor.replay.logfmt import frame_times

    return frame_times(log_dir, channel)


def load_steps(log_dir: str, command_channel: str) -> list[tuple[int, int, tuple[float, ...]]]:
    """The car's control steps (time ns, frame id, command), empty for an older log."""
    from supervisor.replay.logfmt import command_steps

    return command_steps(log_dir, command_channel)


_STEER, _ENGAGED, _REASON = (CONTROL_CMD.index(f) for f in ("steer_rad", "engaged", "reason"))


class DriveClock:
    """Where the car's law stepped: replays its steps up to each output's own.

    The log begins mid-drive (the car's law ran before the recorder did): at the first
    output the law resumes from the car's command just before that output's step (its
    steer, engagement, and good outputs in a row: the distinct frames of the trailing
    RECOVERING commands), so the first commands compare too."""

    def __init__(self, steps: list[tuple[int, int, tuple[float, ...]]]) -> None:
        self.steps = steps
        self.first: dict[int, int] = {}
        for k, (_, fid, _) in enumerate(steps):
            self.first.setdefault(fid, k)
        self.next: int | None = None   # the first step not replayed yet (None: not begun)

    def _resume(self, law: ControlLaw, k: int) -> None:
        """Resume ``law`` from the car's command before step ``k`` (the first output's
        own), or from step ``k``'s itself when the log holds none before it (the
        recorder attached after the car acted on that output): a step at the same time
        then moves nothing, and the command is the car's."""
        j = max(k - 1, 0)
        t, _, cmd = self.steps[j]
        if len(cmd) != len(CONTROL_CMD.fields) or not all(map(math.isfinite, cmd)):
            return      # a bad record (a NaN steer: red team 17 row 15) resumes nothing
        first = self.steps[k][1]
        seen = set()
        for _, f, c in reversed(self.steps[:j + 1]):
            if len(c) != len(CONTROL_CMD.fields) or round(c[_REASON]) != SafeReason.RECOVERING:
                break
            if f != first:           # the output about to be stepped counts itself
                seen.add(f)
        law.resume(cmd[_STEER], cmd[_ENGAGED] >= 0.5, len(seen), t)

    def step(self, law: ControlLaw, out: ModelOutput, t_capture: int
             ) -> tuple[Command, int, bool]:
        """(command, step time, on the drive's clock) for output ``out`` of a frame
        captured at ``t_capture``."""
        out = out._replace(ts_ns=t_capture)
        k = self.first.get(out.frame_id)
        if k is None or (self.next is not None and k < self.next):
            # The car never acted on this output: a copy of the law answers for it.
            last = law.last_ns
            now = t_capture if last is None else max(t_capture, last)
            return copy.copy(law).step(out, now), now, False
        if self.next is None:
            self._resume(law, k)
        else:
            for t, _, _ in self.steps[self.next:k]:
                law.step(None, t)    # the car's steps between outputs: not published
        self.next = k + 1
        now = self.steps[k][0]
        return law.step(out, now), now, True


def publish(writer, cmd: Command, frame_id: int | None) -> None:
    with writer.loan() as loan:
        CONTROL_CMD.encode(loan.array(CONTROL_CMD.shape, np.float32),
                           steer_rad=cmd.steer_rad, engaged=1.0 if cmd.engaged else 0.0,
                           reason=float(cmd.reason), model_age_ms=cmd.model_age_ms)
        if frame_id is None:
            loan.publish()
        else:
            # The header's capture time is the command's own (this boot's clock: the
            # bridge judges freshness by it); log time is in the payload's age.
            loan.publish(frame_id=frame_id, capture_ts_ns=time.monotonic_ns())


def run(ctx, a, reader, writer, law: ControlLaw, times: dict[int, int], model_output_of,
        steps: list[tuple[int, int, tuple[float, ...]]] | None = None) -> int:
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    drive = DriveClock(steps) if steps else None
    which = "drive" if drive else "frames"
    ctx.ready(status=f"{ctx.channel_of('model')} -> {ctx.channel_of('command')} on log time "
                     f"({len(times)} frames, clock={which}"
                     f"{f', {len(steps)} steps' if steps else ''})")
    outputs = published = unplaced = rejected = lost = off_drive = 0
    last_t = None
    last_ping = status_at = 0.0
    while not stop:
        now = time.monotonic()
        if now - last_ping >= 0.02:
            ctx.watchdog()
            last_ping = now
        try:
            msg = reader.receive(timeout=WAIT_S)
        except ChannelTimeout:
            continue
        except Rejected:
            rejected += 1
            continue
        except BridgeError as e:
            ctx.log(f"bridge error: {e}")
            continue
        try:
            with msg:
                got = model_output_of(msg)
        except LeaseLost:
            lost += 1
            continue
        outputs += 1
        t = times.get(got.frame_id) if got.frame_id is not None else None
        if t is None:
            unplaced += 1
            continue
        if drive is None:
            cmd, now = law.step(got._replace(ts_ns=t), t), t
        else:
            cmd, now, on_drive = drive.step(law, got, t)
            off_drive += not on_drive
        publish(writer, cmd, got.frame_id)
        published += 1
        last_t = now
        if time.monotonic() - status_at >= a.status_s:
            status_at = time.monotonic()
            ctx.status(f"log_clock engaged={int(cmd.engaged)} reason={cmd.reason.name} "
                       f"frame={got.frame_id} outputs={outputs} commands={published} "
                       f"unplaced={unplaced} off_drive={off_drive} rejected={rejected} "
                       f"leases_lost={lost}")
    if last_t is not None:
        publish(writer, law.step(None, last_t, hold=SafeReason.SHUTDOWN), None)
    # The final word (a replay's summary shows it): what this run did in all.
    ctx.status(f"log_clock stopped clock={which} outputs={outputs} commands={published} "
               f"unplaced={unplaced} off_drive={off_drive} rejected={rejected} "
               f"leases_lost={lost}")
    return 0
