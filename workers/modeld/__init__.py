"""modeld: the control-domain model worker (no compiler visible, exec denied).

    args: [--deadline-ms 50] [--status-ms 5000] [--expect-version V]
          (simulation only: --artifact DIR --pubkey FILE [--expect-name NAME])

What it loads is config, not code: the supervisor passes the worker's ``[models.NAME]``
trust record (artifact, public key, expected name, minimum version: an older signed
artifact is refused, no rollback) and binds both files read-only. ``--artifact`` etc.
are for running it by hand or in a simulation: they are `SIMULATION_ONLY`, refused by
`supervisor check`/`run` in a vehicle config and by the worker itself in a vehicle run
(one door for models: a car runs only what a ``[models]`` table trusts). With no model
at all it refuses to start; `NEEDS_MODEL` lets `supervisor check` say so first.

Start-up, all before ``ctx.ready()`` (which installs the seccomp filter that denies
exec): verify the signed artifact (`supervisor.model.load_verified`), configure tinygrad
for it and load it with compilation disabled (`supervisor.model.runtime`), and run the
signed golden input as a power-on self-test. A refused artifact ends the worker with exit
code 2 and one line on stderr naming the file/field.

Channels (bound by the config): input role ``frames``, output role ``model``.

Per frame on ``frames``: check it against the artifact's input ABI (NV12, Y plane, uint8,
full range, the artifact's size; a mismatch is counted by reason and skipped), copy the
Y plane into the model's input buffer (the one copy: preprocessing runs inside the
artifact, input ABI 2), release the frame, run, copy the output to host memory (the
next ``model`` slot, loaned ahead: ``NextLoan``) and publish float32[4] (the fields of
the artifact's payload: model_out or driver_state) on ``model`` with the frame's id and
capture time and an execution receipt (`supervisor.ipc.receipt.Receipt`: bytes copied
in and out). The frame's description is checked against the input ABI once per layout
the bridge validated. Once a frame is staged, it announces on ``model`` when the output
is due (the median of the last frames' time from there to the publish:
``Writer.announce``), for readers that busy-poll.

A model of input ABI 3 takes more cameras (the driving model: ``frames``, the road
camera, and ``wide``, the wide road camera; each input's ``role`` in the manifest is the
role this worker reads it on, so the config binds ``subscribes = { frames = ..., wide =
... }``; a role left unbound ends the worker at start with one line). The first input
drives: per road frame, the others are paired by frame id (cameras on one trigger,
``camerad --trigger clock``) with capture times at most the manifest's
``abi.pairing.max_skew_ms`` apart (`Pairer`). A frame of another input is copied into its
input buffer as it arrives (one copy, the frame released at once) and kept for the road
frame of its id; a road frame whose partner is missing ``--pair-wait-ms`` after the road
frame's capture (a frame taken later than that waits no more), came
with another capture time, or was skipped by its camera is not run: counted
(``unpaired=`` in the status line) and said in one ``log`` line (at most one a second per
reason, with the count since), never waited on longer. No output for that instant: a
camera that stops leaves model_out stale, and controlsd fails safe on staleness.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np

from supervisor.ipc import BridgeError, ChannelTimeout, LeaseLost, NextLoan, Rejected
from supervisor.model import ArtifactError, load_verified
from supervisor.protocol import SIMULATION, VEHICLE

from .engine import ENGINE_ABI, ENGINE_ABIS, Engine, FrameRejected

# The roles this worker's code asks for; `supervisor check` verifies the config binds them.
ROLES = {"in": ("frames",), "out": ("model",)}
# Arguments that point the worker at code or weights other than the config's [models.NAME]:
# refused in a vehicle config by `supervisor check`/`run` (supervisor/config/_runtime.py,
# also through a `command` worker that runs this module) and by main() in a vehicle run.
SIMULATION_ONLY = {
    "--artifact": "a model artifact no [models] table trusts",
    "--pubkey": "a signing key no [models] table names",
    "--expect-name": "names the model of a hand-given --artifact",
}
# Without `model = NAME` this worker exits 2 at every start (in control: a fail-safe after
# its restarts); `supervisor check` refuses such a config instead (_runtime.py).
NEEDS_MODEL = True

ROOT = Path(__file__).resolve().parents[2]
PING_S = 0.1
PAIR_WAIT_MS = 25.0    # partners due within this of the road frame's capture (half a 20 Hz period)
UNPAIRED_LOG_S = 1.0   # at most one log line a second per reason of an unpaired frame
ANNOUNCE_FROM = 16     # frames whose median time to publish is the next announcement
STATUS_S = 5.0


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.modeld", allow_abbrev=False)  # SIMULATION_ONLY matches exactly
    p.add_argument("--artifact", default=None, help="development: instead of the config's model")
    p.add_argument("--pubkey", default=None)
    p.add_argument("--deadline-ms", type=float, default=50.0)
    p.add_argument("--expect-name", default=None)
    p.add_argument("--expect-version", default=None)
    p.add_argument("--status-ms", type=float, default=STATUS_S * 1000,
                   help="how often to send a STATUS line with the counters")
    p.add_argument("--pair-wait-ms", type=float, default=PAIR_WAIT_MS,
                   help="input ABI 3: how long after a road frame's capture the frame of "
                        "the same instant from each other camera may come")
    return p.parse_args(argv)


class Pairer:
    """The frames of one instant from a further camera (input ABI 3), for the road
    frame that drives the model. Each frame is checked, copied into its input buffer and
    released as it is received; ``staged`` remembers whose frame the buffer holds. A
    partner is the frame of the road frame's id, captured at most ``max_skew_ns`` from
    it. ``pair`` never waits past ``deadline_ns`` and reports why a frame is unpaired:

    * ``missing``: nothing of that id arrived in time (the camera is late or stopped);
    * ``skipped``: that camera skipped the id (the next one came), or it came before the
      road frame did and was overwritten by a later one;
    * ``skew``: the id matched, the capture times did not (cameras not on one trigger);
    * ``rejected``: the frame failed the input's ABI or the bridge's checks.
    """

    def __init__(self, engine: Engine, index: int, reader: Any, max_skew_ns: int) -> None:
        self.engine, self.index, self.reader = engine, index, reader
        self.inp = engine.inputs[index]
        self.max_skew_ns = max_skew_ns
        self.staged_id: int | None = None      # frame id whose plane the buffer holds
        self.staged_capture = 0
        self.staged_bytes = 0
        self._layout_ok: Any = None
        self.errors: Counter[str] = Counter()

    def _take(self, timeout: float) -> bool:
        """Receive one frame (waiting at most ``timeout`` s) and stage it; False if none."""
        try:
            msg = self.reader.receive(timeout=timeout) if timeout > 0 else self.reader.try_receive()
        except ChannelTimeout:
            return False
        except Rejected as exc:
            self.errors[f"bridge:{exc.reason}"] += 1
            return True
        if msg is None:
            return False
        with msg:
            stamp, layout = msg.stamp, msg.layout
            try:
                if layout is not self._layout_ok:
                    info = msg.frame
                    if info is None:
                        self.errors["not_a_frame"] += 1
                        return True
                    _check_sensor(self.engine, info, self.index)
                    self.engine.check_frame(msg.planes()[0], pixel_format=info.pixel_format,
                                            pixel_range=info.pixel_range, width=info.width,
                                            height=info.height, index=self.index)
                    self._layout_ok = layout
                n = self.engine.stage(msg.planes()[0], self.index)
                msg.release()
            except FrameRejected as exc:
                self.errors[f"frame:{exc.reason}"] += 1
                return True
            except LeaseLost:
                self.errors["lease_lost"] += 1
                return True
        self.staged_id, self.staged_capture = stamp.frame_id, stamp.capture_ts_ns
        self.staged_bytes = n
        return True

    def pair(self, frame_id: int, capture_ns: int, deadline_ns: int) -> str | None:
        """None when the buffer holds this instant's frame; else why not (see above)."""
        while self.staged_id is None or self.staged_id < frame_id:
            # Take what is there first (older frames of this camera are skipped over).
            if self._take(0.0):
                continue
            left = (deadline_ns - time.monotonic_ns()) / 1e9
            if left <= 0 or not self._take(left):
                return "missing"
        if self.staged_id != frame_id:
            return "skipped"
        if abs(self.staged_capture - capture_ns) > self.max_skew_ns:
            return "skew"
        return None


def _check_sensor(engine: Engine, info: Any, index: int) -> None:
    """A frame from another camera than the input was fitted on (a wiring mistake: the
    wide camera's channel bound to ``frames``) is refused like any frame off the ABI."""
    want = engine.inputs[index].sensor
    if want is not None and info.sensor != want:
        engine._reject("sensor", f"frame from sensor {info.sensor!r}, input "
                                 f"{engine.inputs[index].name!r} takes {want!r}")


def _rehearse_frame(msg: Any) -> None:
    msg.planes()


class Modeld:
    def __init__(self, ctx: Any, a: argparse.Namespace, engine: Engine) -> None:
        self.ctx, self.a, self.engine = ctx, a, engine
        # On the car, a frame modeld could not get to before the next one is of no use:
        # take the newest, skipping a backlog (counted as skipped, not dropped). A
        # simulation replays every frame in order: equal twice, in lockstep.
        self.newest = getattr(ctx, "mode", VEHICLE) != SIMULATION
        self.reader = ctx.reader("frames")
        # Busy-poll windows begin with the frame path up to the planes (read-only views),
        # run on the frame taken last, so that the next frame's runs warm (Reader.rehearse).
        self.reader.rehearse(_rehearse_frame)
        self.writer = ctx.writer("model")
        # The next output's slot, loaned ahead: the model copies its output straight
        # into it, and only the receipt and the publish follow the inference.
        self.out = NextLoan(self.writer, tuple(ENGINE_ABI["output"]["shape"]), np.float32)
        self.errors: Counter[str] = Counter()
        # Input ABI 3: the further cameras, paired with each road frame.
        pairing = engine.pairing or {}
        skew = int(float(pairing.get("max_skew_ms", 0)) * 1e6)
        self.pairers = [Pairer(engine, k, ctx.reader(inp.role), skew)
                        for k, inp in enumerate(engine.inputs) if k]
        self.pair_wait_ns = int(a.pair_wait_ms * 1e6)
        self.unpaired: Counter[str] = Counter()
        self._unpaired_logged: dict[str, tuple[float, int]] = {}   # reason -> (when, count)
        self.published = 0
        self.last_receipt: Any = None
        self._layout_ok: Any = None     # the frame Layout that last passed check_frame
        self._to_publish: deque[int] = deque(maxlen=ANNOUNCE_FROM)   # ns, for announce

    def step(self, timeout: float) -> bool:
        """Handle at most one frame; False if none arrived within ``timeout``."""
        eng = self.engine
        try:
            msg = self.reader.receive(timeout=timeout, newest=self.newest)
        except ChannelTimeout:
            return False
        except Rejected as exc:            # counted by the reader too
            self.errors[f"bridge:{exc.reason}"] += 1
            return True
        with msg:
            stamp, layout = msg.stamp, msg.layout
            try:
                if layout is not self._layout_ok:
                    # Checked against the input ABI per layout: the reader hands out
                    # one Layout object for the same validated layout bytes, so an
                    # unchanged one needs no second look (cold, the FrameInfo and the
                    # checks cost ~60 us a frame on the camera -> model path).
                    info = msg.frame
                    if info is None:
                        self.errors["not_a_frame"] += 1
                        return True
                    if self.pairers:
                        _check_sensor(eng, info, 0)
                    eng.check_frame(msg.planes()[0], pixel_format=info.pixel_format,
                                    pixel_range=info.pixel_range, width=info.width,
                                    height=info.height)
                    self._layout_ok = layout
                y = msg.planes()[0]
                t0 = time.monotonic_ns()
                staged = eng.stage(y)
                msg.release()              # input copied: give the camera its slot back
            except FrameRejected as exc:
                self.errors[f"frame:{exc.reason}"] += 1
                return True
            except LeaseLost:
                self.errors["lease_lost"] += 1
                return True
        frame_id, capture = stamp.frame_id, stamp.capture_ts_ns
        if self.pairers:
            # The partners are due within --pair-wait-ms of the road frame's capture (one
            # trigger, one capture time): a road frame taken late waits only for what is
            # left of that, not for a frame that would come later still (under overload,
            # a full wait per frame put modeld further behind).
            deadline = max(capture + self.pair_wait_ns, time.monotonic_ns())
            for p in self.pairers:
                why = p.pair(frame_id, capture, deadline)
                if why is not None:
                    self._unpaired(p, why, frame_id, capture)
                    return True
                staged += p.staged_bytes
            # The receipt times the inference from here: the wait for partners is the
            # frame -> inference hop's, not the model's (nor its deadline's).
            t0 = time.monotonic_ns()
        # When model_out's next message is due (the median time from here to the
        # publish, of the last frames), so that a busy-polling reader (controlsd)
        # watches for it then instead of being woken. Announced after the input copy:
        # what is left is the artifact's kernels (preprocessing included) and the
        # publish, and the wake-up this announcement costs controlsd is over before
        # its window opens.
        announced = time.monotonic_ns()
        if self._to_publish:
            ahead = sorted(self._to_publish)
            self.writer.announce(announced + ahead[len(ahead) // 2])
        _, receipt = eng.run_staged(frame_id=frame_id, capture_ts_ns=capture, start_ns=t0,
                                    bytes_in=staged, out=self.out.array)
        self.out.publish(frame_id=frame_id, capture_ts_ns=capture, receipt=receipt)
        self._to_publish.append(time.monotonic_ns() - announced)
        self.published += 1
        self.last_receipt = receipt
        return True

    def _unpaired(self, p: Pairer, why: str, frame_id: int, capture_ns: int) -> None:
        """Count an unpaired road frame; one log line per reason at most every
        UNPAIRED_LOG_S (with how many there were since the last)."""
        self.unpaired[why] += 1
        now = time.monotonic()
        last, count_then = self._unpaired_logged.get(why, (-UNPAIRED_LOG_S, 0))
        if now - last < UNPAIRED_LOG_S:
            return
        since = self.unpaired[why] - count_then
        self._unpaired_logged[why] = (now, self.unpaired[why])
        has = ("nothing" if p.staged_id is None
               else f"frame {p.staged_id}, captured {(p.staged_capture - capture_ns) / 1e6:+.1f} "
                    f"ms from it")
        self.ctx.log(f"unpaired frame {frame_id}: {p.inp.role} ({p.inp.name}) {why} "
                     f"(waited at most {self.pair_wait_ns / 1e6:.0f} ms; it holds {has}); "
                     f"{since} {why} since the last line, not run",
                     unpaired=why, frame_id=frame_id, role=p.inp.role, count=self.unpaired[why])

    def status_text(self) -> str:
        e = self.engine
        errors = Counter(self.errors)
        for p in self.pairers:
            errors.update({f"{p.inp.role}:{k}": v for k, v in p.errors.items()})
        rej = ",".join(f"{k}={v}" for k, v in sorted(errors.items())) or "none"
        text = (f"frames={self.published} worst_ms={e.worst_case_ns / 1e6:.2f} "
                f"deadline_misses={e.deadline_misses} rejected={rej} "
                f"skipped={self.reader.stats.skipped}")
        if self.pairers:
            text += " unpaired=" + (",".join(f"{k}={v}" for k, v in
                                             sorted(self.unpaired.items())) or "0")
        return text

    def run(self) -> int:
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        last_ping = last_status = time.monotonic()
        while not stop:
            self.step(PING_S)
            now = time.monotonic()
            if now - last_ping >= PING_S:
                self.ctx.watchdog()
                last_ping = now
            if now - last_status >= self.a.status_ms / 1000:
                self.ctx.status(self.status_text())
                last_status = now
        self.ctx.log(f"stopping: {self.status_text()}")
        return 0


def main(ctx: Any) -> int:
    # Before parsing: in a vehicle run, an argument that names other code or weights is
    # refused, whatever started the worker (a module or a `command` worker).
    refused = ctx.simulation_only_problem(SIMULATION_ONLY, sys.argv[1:])
    if refused:
        ctx.log(refused)
        return 2
    a = _args(sys.argv[1:])
    m = getattr(ctx, "model", None) or {}
    if a.artifact:     # by hand: the command line names what to trust
        m = {"artifact": a.artifact, "public_key": a.pubkey, "expect_name": a.expect_name,
             "min_version": None}
    if not m.get("artifact") or not m.get("public_key"):
        ctx.log("no model: give the worker `model = NAME` and a [models.NAME] table")
        return 2
    try:
        verified = load_verified(m["artifact"], m["public_key"],
                                 expect_name=m.get("expect_name") or None,
                                 expect_version=a.expect_version,
                                 min_version=m.get("min_version"), expect_abi=ENGINE_ABIS)
        engine = Engine(verified, deadline_ms=a.deadline_ms, exclusive=True)
    except ArtifactError as exc:
        ctx.log(f"artifact refused: {type(exc).__name__}: {exc}")
        return 2
    # A model of several cameras names the role of each (input ABI 3): all bound, or one
    # line saying which is not, before any channel is opened.
    unbound = [i for i in engine.inputs if not ctx.has(i.role)]
    if unbound:
        ctx.log("channels: the model takes " + ", ".join(
            f"{i.name} ({i.sensor or 'a'} camera) on role {i.role!r}" for i in unbound)
            + "; bind it in the config's subscribes, e.g. subscribes = { "
            + ", ".join(f'{i.role} = "CHANNEL"' for i in unbound) + " }")
        return 2
    try:
        worker = Modeld(ctx, a, engine)
    except (KeyError, BridgeError) as exc:
        ctx.log(f"channels: {exc}")
        return 2
    i = engine.info
    ctx.ready(status=f"{i['model']} {i['version']} sha256:{i['artifact_sha256'][:16]} "
                     f"on {i['runtime']['device']} ({i['runtime']['target']}), golden ok, "
                     f"load {i['load_ms']:.0f} ms")
    ctx.log(f"ready: {i['model']} {i['version']} manifest sha256 {i['artifact_sha256']}",
            model=i['model'], version=i['version'], artifact_sha256=i['artifact_sha256'])
    return worker.run()
