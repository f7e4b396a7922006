"""Research-domain shadow worker: runs a small real torch model on road frames and
publishes shadow outputs that are logged, never actuated.

    python -m supervisor.runner workers.research [--every N] [--seed S] [--threads T]

Channels (bound by the config): input role ``frames``, output role ``shadow``.

Reading. Frames come read-only from ``frames`` (an NV12 frame channel). Under the lease
the worker copies the Y and UV planes into buffers it owns (``np.copyto`` into
preallocated arrays that torch tensors alias via ``torch.from_numpy``), then releases the
message: the release re-checks the slot generation (the seqlock), so a copy the writer
raced is discarded as `LeaseLost` instead of being used. Inference runs on the private
copy with no lease held, so a slow model never makes the camera's ring wait and torch
never sees a non-writable (shared, read-only) buffer. One plane copy per processed frame
(1928x1208 NV12: 3.5 MB, well under a millisecond) is the whole cost.

Every ``--every`` N-th received frame is processed (the 1st, N+1-th, ...); the others
are released at once. Rejected messages (typed `Rejected` errors: bad format, reordered,
stale, CRC...) and lost leases are counted and skipped.

Output. ``shadow`` (a float32 tensor channel, ``shadow = true`` in the config: no control
or actuating worker may consume it except log-only ``shadow_subscribes``) gets one
float32[8] per processed frame, laid out as `SHADOW_LAYOUT`:

    0 lane_offset_m  1 heading_rad  2 left_line_prob  3 right_line_prob   (model outputs)
    4 frame_id mod 2**24 (exact in float32)
    5 latency_ms: frame received -> output ready (copy + inference)
    6 age_ms:     frame captured -> output ready
    7 pipeline_ms: frame published -> output ready

The exact frame id and capture time of the consumed frame also travel in the output's
SlotHeader FrameMeta (``msg.stamp.frame_id`` / ``capture_ts_ns`` on the reader side).

Torch is imported inside `main`, so ``workers.research.datasets`` stays torch-free.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import Counter

import numpy as np

from schemas.payloads import SHADOW_OUT
from supervisor.ipc import ChannelTimeout, LeaseLost, Rejected
from supervisor.worker import WorkerContext

# The roles this worker's code asks for; `supervisor check` verifies the config binds them.
ROLES = {"in": ("frames",), "out": ("shadow",)}

SHADOW_LAYOUT = SHADOW_OUT.fields   # declared once, in schemas/payloads.py
SHADOW_LEN = len(SHADOW_LAYOUT)
FRAME_ID_MOD = 1 << 24
WATCHDOG_S = 0.05
STATUS_S = 2.0


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.research")
    p.add_argument("--every", type=int, default=1, help="process every N-th frame")
    p.add_argument("--seed", type=int, default=0, help="weight seed of the shadow model")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args(argv)
    if a.every < 1:
        p.error("--every must be >= 1")
    if a.threads < 1:
        p.error("--threads must be >= 1")
    return a


class _PlaneCopy:
    """Owned Y/UV buffers, reused while the frame size stays the same; the torch
    tensors alias them (no second copy, no warning about non-writable arrays)."""

    def __init__(self, torch) -> None:
        self._torch = torch
        self._shape: tuple | None = None

    def fill(self, y: np.ndarray, uv: np.ndarray):
        shape = (y.shape, uv.shape)
        if shape != self._shape:
            self.y = np.empty(y.shape, np.uint8)
            self.uv = np.empty(uv.shape, np.uint8)
            self.y_t = self._torch.from_numpy(self.y)
            self.uv_t = self._torch.from_numpy(self.uv)
            self._shape = shape
        np.copyto(self.y, y)
        np.copyto(self.uv, uv)
        return self.y_t, self.uv_t


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    stop = False

    def on_term(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    reader = ctx.reader("frames")
    writer = ctx.writer("shadow")
    if writer.spec.dtype != "float32":
        ctx.log(f"role shadow (channel {ctx.channel_of('shadow')!r}) carries "
                f"{writer.spec.dtype}, needs float32")
        return 2

    t0 = time.monotonic()
    import torch

    from . import model as lane

    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (only possible once per process)
    net = lane.build_model(a.seed)
    # Warm-up: first-call allocations and kernel selection happen before READY.
    lane.infer(net, torch.zeros((64, 96), dtype=torch.uint8),
               torch.full((32, 48, 2), 128, dtype=torch.uint8))
    load_ms = (time.monotonic() - t0) * 1000
    ctx.ready(status=f"research pid {os.getpid()} torch {torch.__version__} "
                     f"seed {a.seed} load {load_ms:.0f} ms")
    ctx.log("research_ready", pid=os.getpid(), torch=torch.__version__,
            load_ms=round(load_ms, 1))

    planes = _PlaneCopy(torch)
    counts: Counter[str] = Counter()
    received = 0
    last_ping = last_status = 0.0
    while not stop:
        now = time.monotonic()
        if now - last_ping >= WATCHDOG_S:
            ctx.watchdog()
            last_ping = now
        if now - last_status >= STATUS_S:
            ctx.status(f"processed {counts['processed']} skipped {counts['skipped']} "
                       f"rejected {counts['rejected']} leases_lost {counts['lease_lost']}")
            last_status = now
        try:
            msg = reader.receive(timeout=WATCHDOG_S)
        except ChannelTimeout:
            continue
        except Rejected as e:          # already counted by the reader; skip it
            counts["rejected"] += 1
            counts[f"rejected:{e.reason}"] += 1
            continue
        t_rx = time.monotonic_ns()
        received += 1
        try:
            with msg:
                info = msg.frame
                if (received - 1) % a.every:
                    counts["skipped"] += 1
                    continue
                if info is None or info.pixel_format != "nv12":
                    counts["unsupported_format"] += 1
                    continue
                y, uv = msg.planes()
                y_t, uv_t = planes.fill(y, uv)
                del y, uv
            # Leaving `with msg` released the lease and re-checked the generation: the
            # copy is exactly what was published (LeaseLost otherwise).
        except LeaseLost:
            counts["lease_lost"] += 1
            continue
        out = lane.infer(net, y_t, uv_t)
        done = time.monotonic_ns()
        with writer.loan() as loan:
            v = loan.array((SHADOW_LEN,), "float32")
            v[:4] = out
            v[4] = info.frame_id % FRAME_ID_MOD
            v[5] = (done - t_rx) / 1e6
            v[6] = (done - info.capture_ts_ns) / 1e6
            v[7] = (done - info.publish_ts_ns) / 1e6
            loan.publish(frame_id=info.frame_id, capture_ts_ns=info.capture_ts_ns)
        counts["processed"] += 1

    st = reader.stats
    ctx.log("research_exit", received=received, processed=counts["processed"],
            skipped=counts["skipped"], unsupported_format=counts["unsupported_format"],
            rejected={k.split(":", 1)[1]: v for k, v in counts.items()
                      if k.startswith("rejected:")},
            leases_lost=counts["lease_lost"], dropped=st.dropped,
            published=writer.stats.published)
    reader.close()
    writer.close()
    return 0
