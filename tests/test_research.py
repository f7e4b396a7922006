"""The research worker as a real separate process on real channels, running real torch.

The test plays the supervisor (creates the channels, spawns ``python -m
supervisor.runner workers.research`` with the environment and fds `lifecycle._spawn`
gives a worker) and the camera (publishes NV12 frames with a `Writer`), reads the
shadow outputs back, and recomputes them with the same model in this process."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (research extra)")

from supervisor.ipc import Channel, ChannelSpec, Reader, Writer  # noqa: E402
from supervisor.protocol import Endpoint, worker_env  # noqa: E402
from workers.research import FRAME_ID_MOD, SHADOW_LAYOUT, SHADOW_LEN  # noqa: E402
from workers.research import model as lane  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
W, H = 1928, 1208                  # the road camera's NV12 frame
SEED = 3


def nv12_frame(i: int) -> tuple[np.ndarray, np.ndarray]:
    """A road-like frame: sky/road gradient, two lane lines that move with i, noise."""
    rng = np.random.default_rng(100 + i)
    yy, xx = np.mgrid[0:H, 0:W]
    y = (60 + 120 * yy / H).astype(np.float32)
    for base in (0.3, 0.7):
        x_line = (base + 0.04 * (i - 3)) * W + (yy - H / 2) * (base - 0.5) * 0.8
        y[(np.abs(xx - x_line) < 12) & (yy > H * 0.45)] = 235
    y += rng.normal(0, 6, y.shape)
    uv = np.empty((H // 2, W // 2, 2), np.float32)
    uv[..., 0] = 128 + 20 * np.sin(i + np.arange(W // 2) / 97.0)
    uv[..., 1] = 128 - 15 * np.cos(i + np.arange(H // 2)[:, None] / 61.0)
    uv += rng.normal(0, 3, uv.shape)
    return (np.clip(y, 0, 255).astype(np.uint8),
            np.clip(uv, 0, 255).astype(np.uint8))


class ResearchProc:
    """workers.research started with the supervisor's own `protocol.worker_env` (no sandbox)."""

    def __init__(self, frames: Channel, shadow: Channel, *args: str) -> None:
        rh, wh = frames.reader_handle(0), shadow.writer_handle()
        r, wfd = os.pipe2(os.O_CLOEXEC)
        ep = Endpoint(name="research", domain="research",
                      roles=(("shadow", shadow.spec.name), ("frames", frames.spec.name)))
        extra, fds = worker_env(ep, wfd, {shadow.spec.name: wh, frames.spec.name: rh})
        env = dict(os.environ, **extra)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                          env.get("PYTHONPATH")]))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor.runner", "workers.research", *args],
                cwd=ROOT, env=env, pass_fds=[*fds, wfd],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, start_new_session=True)
        finally:
            os.close(wfd)
        self.status_r = r
        self._buf = b""
        self.status: list[str] = []

    def wait_status(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                self.status.append(line.decode())
                if line.decode().startswith(prefix):
                    return line.decode()
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"no {prefix!r} from research within {timeout}s "
                                     f"(exit {self.proc.poll()}): {self.stderr_tail()}")
            if select.select([self.status_r], [], [], left)[0]:
                chunk = os.read(self.status_r, 4096)
                if not chunk:
                    raise AssertionError(f"status pipe closed: {self.stderr_tail()}")
                self._buf += chunk

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return (self.proc.stderr.read() or "")[-2000:]

    def stop(self) -> tuple[int, list[dict], str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=15)
        while chunk := os.read(self.status_r, 65536):    # the child is gone: reads to EOF
            self._buf += chunk
        os.close(self.status_r)
        self.status_r = -1      # closed once: the number may be someone else's by now
        self.status += [x.decode() for x in self._buf.split(b"\n") if x]
        # Its log records (`ctx.log`): {"log": msg, "data": {...}} per line.
        recs = [json.loads(x) for x in out.splitlines() if x]
        return self.proc.returncode, [{"event": r["log"], **r.get("data", {})} for r in recs], err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        if self.status_r >= 0:
            os.close(self.status_r)
            self.status_r = -1


@pytest.fixture
def channels():
    frames = Channel.create(ChannelSpec(name="road_frames", kind="frame",
                                        pixel_formats=("nv12",), slot_size=W * H * 3 // 2,
                                        slot_count=4, max_readers=2))
    shadow = Channel.create(ChannelSpec(name="shadow_out", dtype="float32", slot_size=4096,
                                        slot_count=4, max_readers=2))
    yield frames, shadow
    frames.close()
    shadow.close()


def publish(cam: Writer, fid: int, y: np.ndarray, uv: np.ndarray, *,
            capture_ts_ns: int | None = None, fmt: str = "nv12") -> None:
    with cam.loan() as loan:
        planes = loan.frame(fmt, W, H)
        planes[0][...] = y
        if fmt == "nv12":
            planes[1][...] = uv
        loan.publish(frame_id=fid, capture_ts_ns=capture_ts_ns or time.monotonic_ns())


def test_research_worker_runs_torch_on_shared_frames(channels) -> None:
    frames, shadow = channels
    cam = Writer(frames.writer_handle(), domain="control")    # the camera's end
    proc = ResearchProc(frames, shadow, "--every", "2", "--seed", str(SEED))
    try:
        t0 = time.monotonic()
        proc.wait_status("READY=1", timeout=30)
        ready_s = time.monotonic() - t0
        # Torch really runs there: its shared library is mapped into the worker.
        maps = Path(f"/proc/{proc.proc.pid}/maps").read_text()
        assert "libtorch" in maps, "research worker has no libtorch mapped"
        out_r = Reader(shadow.reader_handle(0))

        sent = [nv12_frame(i) for i in range(6)]
        got: list[tuple[int, int, np.ndarray]] = []
        capture = {}
        for i, (y, uv) in enumerate(sent):
            fid = 1000 + i
            capture[fid] = time.monotonic_ns()
            publish(cam, fid, y, uv, capture_ts_ns=capture[fid])
            if i % 2 == 0:                     # --every 2: frames 0, 2, 4 are processed
                with out_r.receive(timeout=10) as m:
                    got.append((m.stamp.frame_id, m.stamp.capture_ts_ns,
                                np.array(m.array)))
        # Hostile/odd traffic the worker must count and survive: a frame in a format the
        # channel contract forbids, then one captured before its predecessor.
        publish(cam, 2000, sent[0][0], None, fmt="gray8")
        publish(cam, 2001, *sent[1], capture_ts_ns=capture[1000] - 1)
        # ...and it carries on: the next good frame (7th received -> processed).
        publish(cam, 2002, *sent[5])
        with out_r.receive(timeout=10) as m:
            got.append((m.stamp.frame_id, m.stamp.capture_ts_ns, np.array(m.array)))
        time.sleep(0.2)
        rc, lines, err = proc.stop()
    finally:
        proc.kill()

    assert rc == 0, err[-2000:]
    assert "Warning" not in err, err[-2000:]      # e.g. torch on a non-writable array
    assert [g[0] for g in got] == [1000, 1002, 1004, 2002]
    ref_model = lane.build_model(SEED)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expect = [lane.infer_numpy(ref_model, *sent[k]) for k in (0, 2, 4, 5)]
    finally:
        torch.set_num_threads(prev)
    for (fid, cap, v), e in zip(got, expect):
        assert v.shape == (SHADOW_LEN,) and v.dtype == np.float32
        np.testing.assert_allclose(v[:4], e, rtol=1e-5, atol=1e-6)
        assert v[4] == fid % FRAME_ID_MOD                      # consumed frame id
        assert 0 < v[5] < 2000                                  # latency_ms
        assert v[6] >= v[5] and v[7] >= 0                       # age >= latency
        if fid != 2002:
            assert cap == capture[fid]                          # lineage in the header
    assert -2 <= got[0][2][0] <= 2 and 0 <= got[0][2][2] <= 1  # output ranges
    assert len({tuple(g[2][:4]) for g in got}) == 4              # frame-dependent outputs

    ready, exit_ = lines[0], lines[-1]
    assert ready["event"] == "research_ready" and ready["torch"] == torch.__version__
    assert exit_["event"] == "research_exit"
    assert exit_["processed"] == 4 and exit_["published"] == 4
    assert exit_["skipped"] == 3                                 # frames 1, 3, 5
    assert exit_["rejected"] == {"bad_frame_format": 1, "sequence_not_increasing": 1}
    assert exit_["leases_lost"] == 0 and exit_["dropped"] == 0
    assert any(s.startswith("WATCHDOG=1") for s in proc.status)
    print(f"research ready in {ready_s:.2f}s (torch load {ready['load_ms']} ms); "
          f"bitwise equal: {all(np.array_equal(g[2][:4], e) for g, e in zip(got, expect))}; "
          f"latency ms: {[round(float(g[2][5]), 2) for g in got]}")


def test_research_worker_refuses_non_float_output(channels) -> None:
    frames, _ = channels
    bad = Channel.create(ChannelSpec(name="shadow_out", dtype="uint8", slot_size=4096))
    cam = Writer(frames.writer_handle(), domain="control")
    proc = ResearchProc(frames, bad)
    try:
        proc.proc.wait(timeout=30)
        rc, logs, _ = proc.stop()
    finally:
        proc.kill()
        bad.close()
        cam.close()
    assert rc == 2 and any("needs float32" in r["event"] for r in logs), logs


def test_model_is_deterministic_and_torch_free_modules_stay_so() -> None:
    y, uv = nv12_frame(0)
    a = lane.infer_numpy(lane.build_model(7), y, uv)
    b = lane.infer_numpy(lane.build_model(7), y, uv)
    c = lane.infer_numpy(lane.build_model(8), y, uv)
    assert a.shape == (4,) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert SHADOW_LAYOUT[:4] == lane.OUTPUTS


def test_admission_keeps_the_research_package_out_of_control() -> None:
    from supervisor.admission.check import check_worker

    as_control = check_worker("research", "control", "workers.research", None, sys.path)
    assert not as_control.ok
    assert any("imports torch" in f.message for f in as_control.findings)
    assert check_worker("research", "research", "workers.research", None, sys.path).ok
