"""controlsd: turns model outputs into lateral control commands, failing safe.

    python -m supervisor.runner workers.controlsd [--hz 50] [--timeout-ms 150] [--max-age-ms 150] [--min-confidence 0.5]
        [--k-p 0.05] [--k-h 0.5] [--max-steer 0.3] [--max-rate 0.4] [--tau-ms 0]
        [--engage-count 3] [--status-s 1.0] [--driver-max-age-ms 500] [--min-face-prob 0.5]
        [--min-driver-confidence 0.5] [--min-eyes-on-road 0.5] [--driver-grace-ms 2000]

Channels (bound by the config): input role ``model`` (and optionally ``driver``),
output role ``command``.

Input: ``model`` (float32[4] = offset_m, heading_rad, confidence, reserved); research/
shadow channels are never read. Optional: the driver monitor's ``driver_state``
(`schemas.payloads.DRIVER_STATE`), bound as role ``driver`` (``subscribes = { model =
"model_out", driver = "driver_state" }``) or as a channel of that name: then the law
also watches the driver (``--driver-max-age-ms``, ``--min-face-prob``,
``--min-driver-confidence``, ``--min-eyes-on-road``, ``--driver-grace-ms``; reasons
DRIVER_STALE, DRIVER_ABSENT, DRIVER_DISTRACTED, see `law`); without it nothing changes.
Its newest state is taken without waiting, each loop; one refused or lost is counted
(status ``driver_*=``), never trusted. The age of an output is taken
from the capture time of the frame it came from: ``msg.receipt.capture_ts_ns`` when the
bridge carries an execution receipt, else the message's own capture timestamp, else its
publish time. A receipt whose completion point is ``deviceQueued`` is refused
(NOT_HOST_VISIBLE). An output whose publish, frame capture or receipt capture time lies
in the future (the bridge reader rejects it as ``FutureTimestamp``; the law checks the
age reference again) is a lie about time, never freshness: it counts as a new output
that puts the command in the safe state with reason FUTURE at once, and engagement
comes back only through the usual ``--engage-count`` good outputs in a row.

Output: ``command`` float32[4] = (steer_rad, engaged 0/1, safe_state reason code,
model_age_ms) — see `law.SafeReason` for the codes and `law` for the law itself. Each
command's header carries the frame id of the newest model output it was computed from
and, as its capture time, the time the law stepped at (none before the first output):
a recorded drive pairs commands with frames, and a replay steps where the car did. A
command is published on every new model output and at least every ``1/--hz`` s without
one, so the safe state (TIMEOUT after ``--timeout-ms`` of silence) shows up on the
output even when the model is gone. On SIGTERM one last command with engaged=0 and
reason SHUTDOWN is published, then it exits 0.
"""
from __future__ import annotations

import argparse
import copy
import signal
import sys
import time

import numpy as np

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import (BridgeError, ChannelTimeout, FutureTimestamp, LeaseLost, Message,
                            NextLoan, Rejected)
from supervisor.worker import WorkerContext

from . import suspend
from .law import Command, ControlLaw, DriverState, LawConfig, ModelOutput, SafeReason

__all__ = ["Command", "ControlLaw", "DriverState", "LawConfig", "ModelOutput", "SafeReason",
           "main", "model_output_of"]

MAX_WAIT_S = 0.05          # longest single wait: the watchdog needs regular pings
# Watchdog pings at most this often (each one is a write the supervisor must wake up
# for); with waits capped at MAX_WAIT_S, pings are never more than ~70 ms apart.
PING_NS = 20_000_000


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.controlsd", allow_abbrev=False)  # SIMULATION_ONLY matches exactly
    p.add_argument("--hz", type=float, default=50.0, help="minimum command rate")
    p.add_argument("--timeout-ms", type=float, default=150.0)
    p.add_argument("--max-age-ms", type=float, default=150.0)
    p.add_argument("--min-confidence", type=float, default=0.5)
    p.add_argument("--k-p", type=float, default=0.05)
    p.add_argument("--k-h", type=float, default=0.5)
    p.add_argument("--max-steer", type=float, default=0.3)
    p.add_argument("--max-rate", type=float, default=0.4)
    p.add_argument("--tau-ms", type=float, default=0.0)
    p.add_argument("--engage-count", type=int, default=3)
    # Driver monitoring: read only when a driver_state channel is bound (law.py).
    p.add_argument("--driver-max-age-ms", type=float, default=500.0)
    p.add_argument("--min-face-prob", type=float, default=0.5)
    p.add_argument("--min-driver-confidence", type=float, default=0.5)
    p.add_argument("--min-eyes-on-road", type=float, default=0.5)
    p.add_argument("--driver-grace-ms", type=float, default=2000.0)
    p.add_argument("--status-s", type=float, default=1.0)
    p.add_argument("--log-clock", default=None, metavar="LOG",
                   help="replay: run on the log's clock, one command per output "
                        "(workers/controlsd/logclock.py)")
    p.add_argument("--log-channel", default="road_frames",
                   help="--log-clock: the frame channel whose index gives log time")
    a = p.parse_args(argv)
    if not 0 < a.hz <= MAX_HZ:          # NaN and inf too (red team 17 row 8)
        p.error(f"--hz must be a number > 0 and <= {MAX_HZ:g}, not {a.hz!r}")
    return a


def _completion_queued(completion) -> bool:
    if completion is None or completion == "hostVisible":   # the usual answer, no str work
        return False
    if isinstance(completion, int) and not isinstance(completion, bool):
        return completion == 2          # CompletionPoint.deviceQueued
    return "devicequeued" in str(completion).lower().replace("_", "")


_F32 = np.dtype(np.float32)


def model_output_of(msg: Message) -> ModelOutput:
    """Copy what the law needs out of a received message (before releasing it)."""
    stamp = msg.stamp
    receipt = getattr(msg, "receipt", None)
    if receipt is None:
        capture, frame_id, latency, completion = stamp.capture_ts_ns, stamp.frame_id, None, None
    else:
        capture = getattr(receipt, "capture_ts_ns", None) or stamp.capture_ts_ns
        frame_id = getattr(receipt, "frame_id", None)
        if frame_id is None:
            frame_id = stamp.frame_id
        latency = getattr(receipt, "latency_ns", None)
        completion = getattr(receipt, "completion", None)
    ts = int(capture) if capture else stamp.publish_ts_ns
    visible = not _completion_queued(completion)
    layout = msg.layout
    if layout.dtype is _F32 and len(layout.shape) == 1:
        # float32[n]: tolist() gives the very floats from_array's float64 copy gives,
        # in one numpy call instead of five (each a cold path at 20 Hz).
        return ModelOutput.from_floats(msg.tolist(), ts, frame_id, latency, visible)
    return ModelOutput.from_array(msg.array, ts, frame_id=frame_id, latency_ns=latency,
                                  host_visible=visible)


# CONTROL_CMD positions, from the payload (the one place they live); _publish writes
# every one of them, so nothing of the slot's previous message survives.
_STEER, _ENGAGED, _REASON, _AGE = (CONTROL_CMD.index(f) for f in (
    "steer_rad", "engaged", "reason", "model_age_ms"))
if sorted((_STEER, _ENGAGED, _REASON, _AGE)) != list(range(len(CONTROL_CMD.fields))):
    raise ImportError("controlsd._publish must write every CONTROL_CMD field")


def _fill(out: NextLoan, cmd: Command) -> None:
    """One CONTROL_CMD payload (schemas/payloads.py), written straight into the slot
    loaned ahead (NextLoan: the loan is off the output -> command path): element by
    element, numpy's cheapest path for four scalars (``encode`` assigns a list, which
    numpy first turns into an array: several times the cold cost). Not published."""
    a = out.array
    a[_STEER] = cmd.steer_rad
    a[_ENGAGED] = 1.0 if cmd.engaged else 0.0
    a[_REASON] = float(cmd.reason)
    a[_AGE] = cmd.model_age_ms


def _publish(out: NextLoan, cmd: Command, now_ns: int | None = None) -> None:
    """The command, stamped with the frame id of the newest model output it used and
    the time its law stepped at (header capture time): a log of the drive then pairs
    commands with frames, and a replay steps its law where this one did
    (workers/controlsd/logclock.py). None before the first output: nothing to name."""
    _fill(out, cmd)
    if cmd.frame_id is None:
        out.publish()
    else:
        out.publish(frame_id=cmd.frame_id,
                    capture_ts_ns=time.monotonic_ns() if now_ns is None else now_ns)


def rehearsal(law: ControlLaw, out: NextLoan):
    """The model reader's rehearsal (Reader.rehearse): one output's path, without
    effect, at the start of each busy-poll window, so that the real one runs warm:
    decode, the law on a copy of itself, the command written into the slot loaned ahead
    but never published (the next publish writes every field first: _fill). Never a
    loan of its own: in a ring too tight to loan ahead, an early loan could take back
    the command published last (red team)."""
    def rehearse(msg: Message) -> None:
        cmd = copy.copy(law).step(model_output_of(msg), time.monotonic_ns())
        if out.on_loan:
            _fill(out, cmd)
    return rehearse


# The roles this worker's code asks for; `supervisor check` verifies the config binds them.
ROLES = {"in": ("model",), "out": ("command",)}
# Optional: the driver monitor's output, bound as role "driver" or as a channel named
# driver_state; then the law watches the driver (law.py, DRIVER_*).
DRIVER_ROLES = ("driver", "driver_state")


def driver_role(ctx: WorkerContext) -> str | None:
    return next((r for r in DRIVER_ROLES if ctx.has(r)), None)


def driver_state_of(msg: Message) -> DriverState:
    """Copy a driver_state message out (before releasing it): its values and the
    capture time of the driver frame it came from (receipt, header, else publish)."""
    stamp = msg.stamp
    receipt = getattr(msg, "receipt", None)
    capture = (getattr(receipt, "capture_ts_ns", None) if receipt is not None else None) \
        or stamp.capture_ts_ns
    return DriverState.from_floats(msg.tolist() if len(msg.layout.shape) == 1
                                   else list(msg.array.reshape(-1).tolist()),
                                   int(capture) if capture else stamp.publish_ts_ns)


def newest_driver_state(reader, counts: dict[str, int]) -> DriverState | None:
    """Everything queued on the driver channel, the newest kept (never blocks): a
    refused or lost one is counted, never trusted."""
    got = None
    while True:
        try:
            msg = reader.try_receive()
        except Rejected as e:        # FutureTimestamp among them: never fresh
            counts[getattr(e, "reason", "rejected")] = counts.get(
                getattr(e, "reason", "rejected"), 0) + 1
            continue
        except BridgeError:
            counts["error"] = counts.get("error", 0) + 1
            return got
        if msg is None:
            return got
        try:
            with msg:
                state = driver_state_of(msg)
            got = state
        except LeaseLost:
            counts["leases_lost"] = counts.get("leases_lost", 0) + 1
# The argument that sets the least command rate (per second) and its default: `supervisor
# check` refuses a car whose rate its watchdog or its channel's max_age cannot hold.
RATE_ARG = ("--hz", 50.0)
MAX_HZ = 1000.0       # a command every ms at most: more is a busy loop, not a rate
# Refused by `supervisor check` in a vehicle config (supervisor/config/_runtime.py).
SIMULATION_ONLY = {"--log-clock": "the control law steps on recorded time, not the clock"}


def main(ctx: WorkerContext) -> int:
    refused = ctx.simulation_only_problem(SIMULATION_ONLY, sys.argv[1:])
    if refused:
        ctx.log(refused)
        return 2
    a = parse_args(sys.argv[1:])
    droles = driver_role(ctx)
    cfg = LawConfig(k_p=a.k_p, k_h=a.k_h, max_steer=a.max_steer, max_rate=a.max_rate,
                    tau_s=a.tau_ms / 1000, timeout_ms=a.timeout_ms, max_age_ms=a.max_age_ms,
                    min_confidence=a.min_confidence, engage_count=a.engage_count,
                    # A replay (--log-clock) does not replay the driver monitor: its
                    # law runs without it (docs/replay.md).
                    watch_driver=droles is not None and not a.log_clock,
                    driver_max_age_ms=a.driver_max_age_ms, min_face_prob=a.min_face_prob,
                    min_driver_confidence=a.min_driver_confidence,
                    min_eyes_on_road=a.min_eyes_on_road, driver_grace_ms=a.driver_grace_ms)
    stop = False

    def on_term(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    reader = ctx.reader("model")
    poll = getattr(ctx, "busy_poll_us", 0)   # then the status line says how it went
    writer = ctx.writer("command")
    law = ControlLaw(cfg)
    if a.log_clock:           # a replay: log time, one command per output
        from . import logclock

        try:
            times = logclock.load_clock(a.log_clock, a.log_channel)
            steps = logclock.load_steps(a.log_clock, ctx.channel_of("command"))
        except Exception as e:   # LogError: the log cannot place outputs in time
            ctx.log(f"--log-clock: {e}")
            return 2
        return logclock.run(ctx, a, reader, writer, law, times, model_output_of, steps)
    out = NextLoan(writer, CONTROL_CMD.shape, np.float32)
    if poll:
        reader.rehearse(rehearsal(law, out))
    driver = ctx.reader(droles) if droles is not None else None
    driver_counts: dict[str, int] = {}
    ctx.ready(status=f"{ctx.channel_of('model')} -> {ctx.channel_of('command')} @ >= {a.hz:g} Hz, timeout {a.timeout_ms:g} ms"
                     + (f", driver {ctx.channel_of(droles)}" if droles else ""))

    tick = int(1e9 / a.hz)
    status_ns = int(a.status_s * 1e9)
    now = time.monotonic_ns()
    next_tick = now
    next_status = now + status_ns
    outputs = lost = receipts = published = future = drivers = 0
    driver_state: DriverState | None = None      # taken, not yet given to the law
    last: Command | None = None
    last_latency_ns = None
    next_ping = now
    watch = suspend.SuspendWatch()
    while not stop:
        now = time.monotonic_ns()
        if now >= next_ping:
            ctx.watchdog()
            next_ping = now + PING_NS
        new: ModelOutput | None = None
        wait = min(max(next_tick - now, 0) / 1e9, MAX_WAIT_S)
        try:
            msg = reader.receive(timeout=wait) if wait > 0 else reader.try_receive()
            # Several queued (we were slow): act on the newest, count the rest.
            while msg is not None:
                try:
                    with msg:
                        got = model_output_of(msg)
                        # Decoded once above (the message keeps it): no second decode.
                        has_receipt = getattr(msg, "receipt", None) is not None
                    # Only once the release proved the slot was not reused meanwhile.
                    new = got
                    outputs += 1
                    receipts += has_receipt
                except LeaseLost:
                    lost += 1
                msg = reader.try_receive()
        except ChannelTimeout:
            pass
        except FutureTimestamp as e:
            # Newer than anything taken before it in this batch: the law goes safe now
            # (the reader counted it too, under reason "future").
            new = ModelOutput.refused_by(SafeReason.FUTURE, e.ts_ns)
        except Rejected:
            pass            # counted in reader.stats.rejected; the law sees nothing new
        except BridgeError as e:
            ctx.log(f"bridge error: {e}")
        if driver is not None:
            d = newest_driver_state(driver, driver_counts)
            if d is not None:
                driver_state, drivers = d, drivers + 1
        mono_a, boot, now = suspend.read()
        if watch.check(mono_a, boot, now):
            law.clock_stopped(now)
            ctx.log("the machine was suspended: model outputs and driver states captured "
                    "before the resume are stale", suspends=watch.suspends)
        if new is None and now < next_tick:
            continue
        if new is not None and new.latency_ns is not None:
            last_latency_ns = new.latency_ns
        last = law.step(new, now, driver=driver_state)
        driver_state = None
        if new is not None and last.reason == SafeReason.FUTURE:
            future += 1         # refused by the bridge, or caught by the law itself
        _publish(out, last, now)
        published += 1
        next_tick = now + tick
        if now >= next_status:
            next_status = now + status_ns
            st = reader.stats
            rej = st.rejected
            ctx.status(
                f"engaged={int(last.engaged)} reason={last.reason.name} "
                f"steer={last.steer_rad:+.4f} model_age_ms={last.model_age_ms:.1f} "
                f"frame={last.frame_id} outputs={outputs} receipts={receipts} "
                f"latency_ms={'-' if last_latency_ns is None else f'{last_latency_ns / 1e6:.2f}'} "
                f"commands={published} rejected={sum(rej.values())}"
                f"{'' if not rej else ' ' + ','.join(f'{k}:{v}' for k, v in sorted(rej.items()))} "
                f"future={future} leases_lost={lost} suspends={watch.suspends}"
                f"{f' driver_states={drivers}' if driver is not None else ''}"
                f"{''.join(f' driver_{k}={v}' for k, v in sorted(driver_counts.items()))}"
                f"{f' busy_poll={st.busy_poll_hits}/{st.busy_poll_misses}' if poll else ''}"
                f"{f' rehearsals={st.rehearsals}' if poll else ''}"
                f"{f' rehearsal_off={st.rehearsal_error!r}' if st.rehearsal_error else ''}")
    now = time.monotonic_ns()
    final = law.step(None, now, hold=SafeReason.SHUTDOWN)
    _publish(out, final, now)
    ctx.status(f"stopped: engaged=0 reason=SHUTDOWN commands={published + 1}")
    return 0
