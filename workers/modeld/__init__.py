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

from .engine import ENGINE_ABI, Engine, FrameRejected

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
    return p.parse_args(argv)


def _rehearse_frame(msg: Any) -> None:
    msg.planes()


class Modeld:
    def __init__(self, ctx: Any, a: argparse.Namespace, engine: Engine) -> None:
        self.ctx, self.a, self.engine = ctx, a, engine
        self.reader = ctx.reader("frames")
        # Busy-poll windows begin with the frame path up to the planes (read-only views),
        # run on the frame taken last, so that the next frame's runs warm (Reader.rehearse).
        self.reader.rehearse(_rehearse_frame)
        self.writer = ctx.writer("model")
        # The next output's slot, loaned ahead: the model copies its output straight
        # into it, and only the receipt and the publish follow the inference.
        self.out = NextLoan(self.writer, tuple(ENGINE_ABI["output"]["shape"]), np.float32)
        self.errors: Counter[str] = Counter()
        self.published = 0
        self.last_receipt: Any = None
        self._layout_ok: Any = None     # the frame Layout that last passed check_frame
        self._to_publish: deque[int] = deque(maxlen=ANNOUNCE_FROM)   # ns, for announce

    def step(self, timeout: float) -> bool:
        """Handle at most one frame; False if none arrived within ``timeout``."""
        eng = self.engine
        try:
            msg = self.reader.receive(timeout=timeout)
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

    def status_text(self) -> str:
        e = self.engine
        rej = ",".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "none"
        return (f"frames={self.published} worst_ms={e.worst_case_ns / 1e6:.2f} "
                f"deadline_misses={e.deadline_misses} rejected={rej}")

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
                                 min_version=m.get("min_version"), expect_abi=ENGINE_ABI)
        engine = Engine(verified, deadline_ms=a.deadline_ms, exclusive=True)
    except ArtifactError as exc:
        ctx.log(f"artifact refused: {type(exc).__name__}: {exc}")
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
