"""controlsd on the log's clock (``--log-clock LOG``): what `supervisor replay` runs.

Live, controlsd judges model outputs against the wall clock and also publishes between
outputs (at least ``--hz``), so its commands depend on scheduling. On log time they do
not: each model output is stepped through the same `ControlLaw` at the recorded capture
time of its frame (looked up by frame id in the log's video index, read before READY),
with that time as the output's age reference, and exactly one command is published per
output, carrying the frame id in its header. Two replays of one log therefore give
bit-identical commands, and camerad's lockstep waits for that frame id.

An output whose frame id is not in the log (it cannot be placed in time) gets no
command and is counted (status ``unplaced=``). On SIGTERM one last SHUTDOWN command
(at the last log time) is published, as live.
"""
from __future__ import annotations

import signal
import time

import numpy as np

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import BridgeError, ChannelTimeout, LeaseLost, Rejected

from .law import Command, ControlLaw, SafeReason

WAIT_S = 0.05


def load_clock(log_dir: str, channel: str) -> dict[int, int]:
    from supervisor.replay.logfmt import frame_times

    return frame_times(log_dir, channel)


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


def run(ctx, a, reader, writer, law: ControlLaw, times: dict[int, int], model_output_of) -> int:
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ctx.ready(status=f"{ctx.channel_of('model')} -> {ctx.channel_of('command')} on log time "
                     f"({len(times)} frames)")
    outputs = published = unplaced = rejected = lost = 0
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
        cmd = law.step(got._replace(ts_ns=t), t)
        publish(writer, cmd, got.frame_id)
        published += 1
        last_t = t
        if time.monotonic() - status_at >= a.status_s:
            status_at = time.monotonic()
            ctx.status(f"log_clock engaged={int(cmd.engaged)} reason={cmd.reason.name} "
                       f"frame={got.frame_id} outputs={outputs} commands={published} "
                       f"unplaced={unplaced} rejected={rejected} leases_lost={lost}")
    if last_t is not None:
        publish(writer, law.step(None, last_t, hold=SafeReason.SHUTDOWN), None)
    # The final word (a replay's summary shows it): what this run did in all.
    ctx.status(f"log_clock stopped outputs={outputs} commands={published} "
               f"unplaced={unplaced} rejected={rejected} leases_lost={lost}")
    return 0
