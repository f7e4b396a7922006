"""The whole vehicle pipeline under the real supervisor: camerad -> modeld -> controlsd,
every worker in its bubblewrap sandbox, checked against the same signed artifact run
in this process."""
from __future__ import annotations

import io
import os
import shutil
import threading

import numpy as np
import pytest
import trio

from supervisor.config import loads
from supervisor.events import EventLog
from supervisor.ipc import Reader
from supervisor.lifecycle import Supervisor

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

N = 40

# Channel names of its own (none of the default config's): workers ask for roles, the
# config binds them, so nothing in a worker names a channel.
CONFIG = """
[domains.control]
failure_policy = "fail_safe"
actuates = true

[channels.cam_road]
kind = "frame"
pixel_formats = ["nv12"]
slot_size = "3.5MiB"
slot_count = 6
max_age_ms = 100

[channels.lanes]
dtype = "float32"
slot_size = "4KiB"
slot_count = 8
max_age_ms = 200
crc = true
max_readers = 3

[channels.steer]
dtype = "float32"
slot_size = "4KiB"
slot_count = 16
max_age_ms = 100
crc = true
max_readers = 2

[workers.camerad]
domain = "control"
module = "workers.camerad"
publishes = { frames = "cam_road" }
args = ["--fps", "15"]
# A start is not what this test measures: under load (two CPU hogs on a shared 2-core
# machine) camerad took over the default 5 s to be READY and the run ended before it began.
ready_timeout_ms = 30000

[models.lane-offset]
artifact = "models/demo/lane-offset"          # relative to the project root
public_key = "models/demo/demo_ed25519.pub"
expect_name = "lane-offset-demo"
min_version = "1.0.0"

[workers.modeld]
domain = "control"
module = "workers.modeld"
model = "lane-offset"
subscribes = { frames = "cam_road" }
publishes = { model = "lanes" }
ready_timeout_ms = 30000
jit_kernels = true

[workers.controlsd]
domain = "control"
module = "workers.controlsd"
subscribes = { model = "lanes" }
publishes = { command = "steer" }
ready_timeout_ms = 30000
"""


def test_camera_model_control_end_to_end():
    cfg = loads(CONFIG, "e2e.toml")
    log = EventLog(stream=io.StringIO())
    outputs: list[tuple[np.ndarray, object]] = []
    out_ts: list[int] = []
    commands: list[tuple[int, np.ndarray]] = []

    async def main():
        sup = Supervisor(cfg, log=log, status_out=io.StringIO(), status_interval_s=0.5)
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(sup.run)
            except RuntimeError:          # it ended before all were READY: say why
                raise AssertionError([e for e in log.events if e.get("level") != "debug"]
                                     [-8:]) from None
            # Test readers on the indices after the workers' and the monitor's.
            r_out = Reader(sup.channels["lanes"].reader_handle(2))
            r_cmd = Reader(sup.channels["steer"].reader_handle(1))

            async def commands_task():
                while True:
                    with await r_cmd.receive_async() as m:
                        commands.append((m.publish_ts_ns, np.array(m.array)))

            nursery.start_soon(commands_task)
            with trio.fail_after(60):
                while len(outputs) < N:
                    with await r_out.receive_async() as m:
                        outputs.append((np.array(m.array), m.receipt))
                        out_ts.append(m.publish_ts_ns)
            assert sup.monitor is not None and "lanes" in sup.monitor.line()
            # the workers' own status reaches the event log and the live line
            with trio.fail_after(10):
                while not (log.of("status", "camerad") and log.of("status", "controlsd")
                           and "engaged=" in sup.monitor.statuses.get("controlsd", "")):
                    await trio.sleep(0.1)
            line = sup.monitor.line()
            assert "camerad: " in line and "controlsd: engaged=" in line, line
            nursery.cancel_scope.cancel()
        return sup

    # The test's readers stand in for the car's consumers of lanes and steer, which run
    # at priority: at nice 0 under two CPU hogs they fell 300 ms behind (steer: stale at
    # 316 ms, max_age 100; lanes: the slot reused under the reader), which tests the
    # machine, not the pipeline. The workers inherit it from this (spawning) thread.
    tid = threading.get_native_id()
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, -20)
    except OSError:
        pass                                   # unprivileged: as it is
    try:
        sup = trio.run(main)
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass
    assert sup.exit_code == 0
    assert [e["worker"] for e in log.of("ready")] == ["camerad", "modeld", "controlsd"]

    # N frames in, N outputs out, each with a receipt, no frame skipped by modeld.
    receipts = [r for _, r in outputs]
    assert all(r is not None for r in receipts)
    ids = [r.frame_id for r in receipts]
    assert ids == list(range(ids[0], ids[0] + N))
    for r in receipts:
        assert r.device == "CPU" and r.completion == "hostVisible"
        assert r.bytes_in > 0 and r.bytes_out == 16 and r.kernels_run > 0
        assert r.infer_start_ns >= r.capture_ts_ns and r.infer_end_ns > r.infer_start_ns
        assert r.latency_ns == r.infer_end_ns - r.infer_start_ns <= r.worst_case_ns
        assert len(r.artifact_sha256) == 32

    # Bit-identical to the same signed artifact run here, on the same synthetic frames.
    import models
    from supervisor.model import load_verified
    from workers.camerad.synthetic import SyntheticRoad
    from workers.modeld.engine import Engine

    eng = Engine(load_verified(models.DEMO_ARTIFACT, models.DEMO_PUBKEY))
    road = SyntheticRoad(1928, 1208, seed=0, fps=15.0)
    truths = []
    for out, r in outputs:
        y, _, truth = road.render(r.frame_id)
        want, _ = eng.infer(y, frame_id=r.frame_id, capture_ts_ns=r.capture_ts_ns)
        assert out.tobytes() == np.asarray(want, np.float32).tobytes(), r.frame_id
        truths.append(truth)
    # ... and the model does follow the lane: its offset tracks the scene's truth.
    offs = np.array([o[0] for o, _ in outputs])
    true = np.array([t.offset_m for t in truths])
    assert np.mean(np.abs(offs - true)) < 0.05 and np.corrcoef(offs, true)[0, 1] > 0.9

    # Control commands follow the model: each engaged command steers towards
    # -(k_p * offset + k_h * heading) of the latest model output published before it.
    engaged = [(t, c) for t, c in commands if c[1] == 1 and t >= out_ts[0] and t <= out_ts[-1]]
    assert len(engaged) >= N // 2
    assert all(abs(c[0]) <= 0.3 + 1e-6 for _, c in commands)
    close = 0
    for t, c in engaged:
        i = int(np.searchsorted(out_ts, t, side="right")) - 1
        o = outputs[i][0]
        target = float(np.clip(-(0.05 * o[0] + 0.5 * o[1]), -0.3, 0.3))
        close += abs(float(c[0]) - target) <= 0.02
    assert close >= 0.9 * len(engaged), (close, len(engaged))
