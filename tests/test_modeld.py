"""modeld: the signed artifact runs in the control sandbox with no compiler, no exec and
an empty tinygrad cache, bit-identical to an in-process run; a missing kernel fails
naming it; the worker serves real bridge channels. Real tinygrad, real bubblewrap."""
from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from supervisor.ipc import Channel, ChannelSpec, Reader, Writer
from supervisor.protocol import ENV_MODE, SIMULATION, Endpoint, worker_env
from supervisor.model import load_verified
from supervisor.model import artifact as A
from tests.test_model_artifact import DEMO, DEMO_PUB, copy_bundle, drop_kernel, test_key  # noqa: F401
from workers.camerad.synthetic import SyntheticRoad
from workers.modeld.engine import ENGINE_ABI, ENGINE_ABI3, Engine, FrameRejected

W, H, SEED = 1928, 1208, 7
STRIDE = 1936          # the demo artifact's Y plane row stride (PyAV's for 1928)
FRAMES = range(0, 6)
MANIFEST = A.read_manifest_unverified(DEMO)
MODEL_KERNELS = [k["name"] for k in MANIFEST["kernels"] if k["role"] == "model"]
HAVE_BWRAP = shutil.which("bwrap") is not None
sandbox = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def engine():
    v = load_verified(DEMO, DEMO_PUB, expect_abi=ENGINE_ABI)
    e = Engine(v, deadline_ms=50)
    yield e
    v.close()


@pytest.fixture(scope="module")
def reference(engine):
    """In-process outputs (this process may well have clang; it is never used)."""
    road = SyntheticRoad(W, H, seed=SEED)
    outs, truths, receipts = [], [], []
    for i in FRAMES:
        y, _uv, truth = road.render(i)
        out, r = engine.infer(y, frame_id=i, capture_ts_ns=123)
        outs.append(out.tobytes().hex())
        truths.append(truth)
        receipts.append(r)
    return {"outputs": outs, "truth": truths, "receipts": receipts}


def sandbox_selftest(artifact: Path, pubkey: Path, *extra: str):
    from supervisor.sandbox import policy_for_domain, run

    pol = policy_for_domain("control", extra_ro_binds=[str(artifact), str(pubkey)])
    argv = [sys.executable, "-m", "supervisor.runner", "workers.modeld.selftest",
            "--artifact", str(artifact), "--pubkey", str(pubkey), "--frames", str(len(FRAMES)),
            "--seed", str(SEED), "--width", str(W), "--height", str(H), *extra]
    res = run(pol, argv, timeout=180, env_extra={"TRIO_WORKER": "modeld-selftest",
                                                 "TRIO_DOMAIN": "control"})
    lines = res.stdout.strip().splitlines()
    assert lines, f"no output (rc {res.returncode}): {res.stderr[-3000:]}"
    return res, json.loads(lines[-1])


# ------------------------------------------------------------------ in-process engine

def test_outputs_follow_the_lane_and_receipts_say_what_ran(engine, reference):
    for hexout, truth, r in zip(reference["outputs"], reference["truth"], reference["receipts"]):
        off, head, conf, reserved = np.frombuffer(bytes.fromhex(hexout), np.float32)
        assert abs(off - truth.offset_m) < 0.15 and abs(head - truth.heading_rad) < 0.02
        assert conf > 0.9 and reserved == 0.0
        assert r.device == "CPU" and r.completion == "hostVisible"
        # the one copy: the Y plane into the model's input buffer (rendered planes are
        # packed at 1928, the model's stride is 1936: row by row), 16 bytes out
        assert r.bytes_in == H * W and r.bytes_out == 4 * 4
        assert r.kernels_run == len(MODEL_KERNELS)
        assert r.artifact_sha256 == hashlib.sha256((DEMO / "manifest.json").read_bytes()).digest()
        assert r.latency_ns == r.infer_end_ns - r.infer_start_ns > 0
        assert r.deadline_ns == 50_000_000 and r.worst_case_ns >= r.latency_ns
        assert r.capture_ts_ns == 123
    blank, _ = engine.infer(np.full((H, W), 90, np.uint8))
    assert blank[2] < 0.2                       # no lane edges: low confidence
    assert engine.info["golden_ok"] and engine.info["runtime"]["device_class"] == "CPUDevice"


def test_frames_outside_the_input_abi_are_rejected_and_counted(engine):
    y = np.zeros((H, W), np.uint8)
    cases = [({"pixel_format": "rgb888"}, y, "pixel_format"),
             ({"pixel_range": "limited"}, y, "pixel_range"),
             ({}, y.astype(np.float32), "dtype"),
             ({}, np.zeros((H, W, 3), np.uint8), "dtype"),
             ({}, np.zeros((60, 100), np.uint8), "too_small")]
    before = dict(engine.rejected)
    for kw, plane, reason in cases:
        with pytest.raises(FrameRejected) as ei:
            engine.infer(plane, **kw)
        assert ei.value.reason == reason
    with pytest.raises(FrameRejected, match="frame says"):
        engine.check_frame(y, width=W + 2, height=H)
    got = {k: engine.rejected[k] - before.get(k, 0) for k in engine.rejected}
    assert got == {"pixel_format": 1, "pixel_range": 1, "dtype": 2, "too_small": 1, "shape": 1}
    out, _ = engine.infer(SyntheticRoad(W, H, seed=SEED).render(0)[0])   # still runs
    assert out.shape == (4,)


# ------------------------------------------------------------------ control sandbox

@sandbox
def test_control_sandbox_runs_the_artifact_bit_identically_without_a_compiler(reference):
    res, rep = sandbox_selftest(DEMO, DEMO_PUB, "--probe-compilers", "--lock-down")
    assert res.returncode == 0 and rep["ok"], res.stderr[-3000:]
    # bit-identical to the in-process run
    assert rep["outputs"] == reference["outputs"]
    # no compiler was needed: every object came from the signed kernels.db
    assert rep["compile"]["refused"] == []
    assert rep["compile"]["served_total"] == len(MANIFEST["kernels"])
    assert set(rep["compile"]["served"]) == {k["name"] for k in MANIFEST["kernels"]}
    assert rep["tinygrad_imported_before_load"] is False
    assert rep["cachedb_is_verified_copy"] is True
    assert rep["home_cache_before"] is None and rep["home_cache_after"] is None   # empty cache
    assert rep["kernels_db_unchanged"] is True                # read, never written
    assert rep["workdir_files"] == ["golden.bin", "jit.pkl", "kernels.db"]
    # and none was there to use: the control sandbox masks the compilers, and the
    # process ran locked down (no exec, no new process: tests/test_sandbox.py)
    assert set(rep["compilers"].values()) <= {"char-device", "missing"}, rep["compilers"]
    assert rep["locked_down"] == ["control"]
    assert rep["worker"]["domain"] == "control"
    assert rep["info"]["golden_ok"] is True
    sha = hashlib.sha256((DEMO / "manifest.json").read_bytes()).hexdigest()
    for r in rep["receipts"]:
        assert r["device"] == "CPU" and r["completion"] == "hostVisible"
        # the selftest's frames have the model's row stride: one memcpy of the plane's span
        assert (r["bytes_in"], r["bytes_out"]) == ((H - 1) * STRIDE + W, 16)
        assert r["artifact_sha256"] == sha and r["kernels_run"] == len(MODEL_KERNELS)
        assert r["deadline_misses"] == 0


@sandbox
@pytest.mark.parametrize("victim", [MODEL_KERNELS[0], "worker_prog"])
def test_a_kernel_missing_from_the_artifact_fails_naming_it(tmp_path, test_key, victim):  # noqa: F811
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")
    drop_kernel(b, victim, key)
    load_verified(b, pub).close()                    # a well-signed, consistent bundle
    res, rep = sandbox_selftest(b, pub)
    assert res.returncode == 3 and rep["ok"] is False
    assert rep["error"] == "KernelNotInArtifact"
    assert f"kernel {victim!r} is not in the signed artifact" in rep["message"]
    assert rep["compile"]["refused"] == [victim]
    text = res.stdout + res.stderr
    assert "PermissionError" not in text and "'clang'" not in text


# ------------------------------------------------------------------ the worker itself

def _read_status(fd: int, want: str, timeout: float, seen: list[str]) -> bool:
    end = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], 0.2)
        if not r:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        buf += chunk
        *lines, buf = buf.split(b"\n")
        seen += [ln.decode() for ln in lines]
        if any(want in ln for ln in seen):
            return True
    return False


@sandbox
def test_modeld_worker_in_the_control_sandbox_over_the_bridge(reference):
    from supervisor.sandbox import policy_for_domain, spawn

    road_ch = Channel.create(ChannelSpec(name="road_frames", kind="frame", slot_size=W * H * 3,
                                         slot_count=6, pixel_formats=("nv12", "rgb888")))
    out_ch = Channel.create(ChannelSpec(name="model_out", dtype="float32", slot_size=4096,
                                        slot_count=8))
    camera = Writer(road_ch.writer_handle(), domain="control")
    rh, ow = road_ch.reader_handle(0), out_ch.writer_handle()
    r, wfd = os.pipe2(os.O_CLOEXEC)
    # --artifact is simulation-only: a vehicle run refuses it (test_config_models.py)
    ep = Endpoint(name="modeld", domain="control", sandboxed=True, mode=SIMULATION,
                  roles=(("model", "model_out"), ("frames", "road_frames")))
    env, fds = worker_env(ep, wfd, {"model_out": ow, "road_frames": rh})
    pol = policy_for_domain("control", extra_ro_binds=[str(DEMO), str(DEMO_PUB)])
    proc = spawn(pol, [sys.executable, "-m", "supervisor.runner", "workers.modeld",
                       "--artifact", str(DEMO), "--pubkey", str(DEMO_PUB), "--status-ms", "200"],
                 [*fds, wfd], env_extra=env, stdin=subprocess.DEVNULL,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(wfd)
    seen: list[str] = []
    try:
        assert _read_status(r, "READY=1", 90, seen), (seen, proc.poll())
        results = Reader(out_ch.reader_handle(0))
        road = SyntheticRoad(W, H, seed=SEED)
        got = []
        for fid in FRAMES:
            if fid == 2:     # a frame in a format the model does not take: skipped, counted
                with camera.loan() as loan:
                    loan.frame("rgb888", W, H)[0][...] = 0
                    loan.publish(frame_id=1000, capture_ts_ns=time.monotonic_ns())
            with camera.loan() as loan:      # a real camera's row stride
                y, uv = loan.frame("nv12", W, H, row_stride=STRIDE)
                road.render_into(fid, y, uv)
                loan.publish(frame_id=fid, capture_ts_ns=time.monotonic_ns())
            with results.receive(timeout=20) as msg:
                got.append((msg.stamp.frame_id, msg.array.tobytes().hex()))
        assert got == list(zip(FRAMES, reference["outputs"]))     # bit-identical, in order
        assert _read_status(r, "frame:pixel_format=1", 10, seen), seen
        assert proc.poll() is None                                 # still serving
        assert any(ln.startswith("READY=1") and "golden ok" in ln for ln in seen)
        assert any(ln.startswith("WATCHDOG=1") for ln in seen)
    finally:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        os.close(r)
        camera.close()
        road_ch.close()
        out_ch.close()
    assert b'{"log":"ready: lane-offset-demo' in out


@sandbox
def test_modeld_refuses_an_artifact_it_cannot_verify(test_key):  # noqa: F811
    from supervisor.sandbox import policy_for_domain, run

    _key, pub = test_key
    pol = policy_for_domain("control", extra_ro_binds=[str(DEMO), str(pub)])
    res = run(pol, [sys.executable, "-m", "supervisor.runner", "workers.modeld",
                    "--artifact", str(DEMO), "--pubkey", str(pub)], timeout=60,
              env_extra={"TRIO_WORKER": "modeld", "TRIO_DOMAIN": "control",
                         ENV_MODE: SIMULATION})
    assert res.returncode == 2
    assert '{"log":"artifact refused: BadSignature' in res.stdout


def test_receipt_fields_are_the_named_ones(engine):
    """_receipt builds the Receipt positionally: every value lands in its named field."""
    from supervisor.ipc import Receipt
    from supervisor.model.runtime import RunStats

    st = RunStats(bytes_in=11, bytes_out=16, kernels_run=5, device="CPU")
    r = engine._receipt(7, 123, 1_000, 3_000, st, 0)
    assert r == Receipt(frame_id=7, capture_ts_ns=123, infer_start_ns=1_000, infer_end_ns=3_000,
                        device="CPU", bytes_in=11, bytes_out=16, completion="hostVisible",
                        latency_ns=2_000, worst_case_ns=engine.worst_case_ns,
                        deadline_ns=engine.deadline_ns,
                        deadline_misses=engine.deadline_misses,
                        artifact_sha256=engine.artifact_sha256, kernels_run=5)


def test_the_output_lands_in_the_array_given_bit_identically(engine, reference):
    """modeld hands the model the next model_out slot's array (NextLoan): the output is
    copied there, the very bytes of a fresh output; an array the output does not fit is
    refused in one line naming both, before anything runs."""
    from supervisor.model import AbiMismatch

    y = SyntheticRoad(W, H, seed=SEED).render(FRAMES[0])[0]
    into = np.full(4, np.nan, np.float32)
    out, r = engine.infer(y, frame_id=FRAMES[0], capture_ts_ns=123, out=into)
    assert out is into and into.tobytes().hex() == reference["outputs"][0]
    runs = engine.inferences
    read_only = np.empty(4, np.float32)
    read_only.flags.writeable = False              # a reader's view
    for bad in (np.empty(4, np.float64), np.empty(5, np.float32),
                np.empty(8, np.float32)[::2], read_only):
        with pytest.raises(AbiMismatch, match=r"the model writes float32\[4\]") as e:
            engine.infer(y, out=bad)
        assert "\n" not in str(e.value)
    assert engine.inferences == runs


# ------------------------------------------------------------------ road + wide (input ABI 3)

WIDE_MODEL = DEMO.parent / "lane-offset-wide"


@sandbox
def test_modeld_pairs_road_and_wide_frames_and_counts_the_unpaired():
    """The driving model of input ABI 3 in the control sandbox: per road frame the wide
    frame of the same id and capture time is paired, and the output is the in-process
    engine's on that pair, bit for bit; a road frame whose wide frame never comes, or
    came from another instant, is not run: counted by reason, one log line each, and
    the worker is not held up (the next pair still gets its output)."""
    from supervisor.sandbox import policy_for_domain, spawn
    from workers.camerad.synthetic import scene

    v = load_verified(WIDE_MODEL, DEMO_PUB, expect_abi=[ENGINE_ABI, ENGINE_ABI3])
    try:
        eng = Engine(v)
        assert [(i.role, i.sensor) for i in eng.inputs] == [("frames", "road"), ("wide", "wide")]
        road, wide = scene("road", W, H, seed=SEED), scene("wide", W, H, seed=SEED)
        want = {fid: eng.infer(road.render(fid)[0], wide.render(fid)[0])[0].tobytes().hex()
                for fid in (0, 1, 4)}
    finally:
        v.close()
    spec = dict(kind="frame", slot_size=STRIDE * H * 3 // 2, slot_count=6, pixel_formats=("nv12",))
    road_ch = Channel.create(ChannelSpec(name="road_frames", **spec))
    wide_ch = Channel.create(ChannelSpec(name="wide_frames", **spec))
    out_ch = Channel.create(ChannelSpec(name="model_out", dtype="float32", slot_size=4096,
                                        slot_count=8))
    cams = {"road": Writer(road_ch.writer_handle(), domain="control"),
            "wide": Writer(wide_ch.writer_handle(), domain="control")}
    r, wfd = os.pipe2(os.O_CLOEXEC)
    ep = Endpoint(name="modeld", domain="control", sandboxed=True, mode=SIMULATION,
                  roles=(("model", "model_out"), ("frames", "road_frames"),
                         ("wide", "wide_frames")))
    env, fds = worker_env(ep, wfd, {"model_out": out_ch.writer_handle(),
                                    "road_frames": road_ch.reader_handle(0),
                                    "wide_frames": wide_ch.reader_handle(0)})
    pol = policy_for_domain("control", extra_ro_binds=[str(WIDE_MODEL), str(DEMO_PUB)])
    proc = spawn(pol, [sys.executable, "-m", "supervisor.runner", "workers.modeld",
                       "--artifact", str(WIDE_MODEL), "--pubkey", str(DEMO_PUB),
                       "--status-ms", "200", "--pair-wait-ms", "30"],
                 [*fds, wfd], env_extra=env, stdin=subprocess.DEVNULL,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(wfd)
    scenes = {"road": road, "wide": wide}

    def publish(cam: str, fid: int, capture: int) -> None:
        with cams[cam].loan() as loan:
            y, uv = loan.frame("nv12", W, H, row_stride=STRIDE, sensor=cam)
            scenes[cam].render_into(fid, y, uv)
            loan.publish(frame_id=fid, capture_ts_ns=capture)

    seen: list[str] = []
    try:
        assert _read_status(r, "READY=1", 120, seen), (seen, proc.poll())
        results = Reader(out_ch.reader_handle(0))
        got = []
        # frame 3's wide frame is of another instant (40 ms earlier: the bridge takes it,
        # captures are in order and none is in the future; the pairing does not)
        for fid, wide_off_ns in ((0, 0), (1, 0), (2, None), (3, -40_000_000), (4, 0)):
            time.sleep(0.1)
            t = time.monotonic_ns()
            if wide_off_ns is not None:          # the wide camera first: it is kept
                publish("wide", fid, t + wide_off_ns)
            publish("road", fid, t)
            if fid in want:
                with results.receive(timeout=30) as msg:
                    got.append((msg.stamp.frame_id, msg.array.tobytes().hex()))
        assert got == [(fid, want[fid]) for fid in (0, 1, 4)]       # bit-identical, in order
        assert _read_status(r, "unpaired=missing=1,skew=1", 10, seen), seen
        assert proc.poll() is None
    finally:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        os.close(r)
        for c in (*cams.values(), road_ch, wide_ch, out_ch):
            c.close()
    logs = [json.loads(ln)["log"] for ln in out.decode().splitlines()
            if ln.startswith('{"log":"unpaired')]
    assert len(logs) == 2, out[-3000:]
    assert "unpaired frame 2: wide (wide_y) missing" in logs[0]
    assert "unpaired frame 3: wide (wide_y) skew" in logs[1] and "-40.0 ms" in logs[1]


@sandbox
def test_a_model_of_two_cameras_without_its_wide_channel_refuses_to_start():
    from supervisor.sandbox import policy_for_domain, run

    road_ch = Channel.create(ChannelSpec(name="road_frames", kind="frame", slot_size=4096,
                                         slot_count=4, pixel_formats=("nv12",)))
    out_ch = Channel.create(ChannelSpec(name="model_out", dtype="float32", slot_size=4096,
                                        slot_count=8))
    ep = Endpoint(name="modeld", domain="control", sandboxed=True, mode=SIMULATION,
                  roles=(("model", "model_out"), ("frames", "road_frames")))
    try:
        rfd, wfd = os.pipe2(os.O_CLOEXEC)
        env, fds = worker_env(ep, wfd, {"model_out": out_ch.writer_handle(),
                                        "road_frames": road_ch.reader_handle(0)})
        pol = policy_for_domain("control", extra_ro_binds=[str(WIDE_MODEL), str(DEMO_PUB)])
        res = run(pol, [sys.executable, "-m", "supervisor.runner", "workers.modeld",
                        "--artifact", str(WIDE_MODEL), "--pubkey", str(DEMO_PUB)],
                  timeout=120, env_extra=env, pass_fds=[*fds, wfd])
        os.close(wfd)
        os.close(rfd)
    finally:
        road_ch.close()
        out_ch.close()
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if '"log":"channels:' in ln]
    assert len(lines) == 1 and "role 'wide'" in lines[0], res.stdout[-2000:]
    assert "Traceback" not in res.stdout + res.stderr


def test_the_recorded_kernel_calls_equal_the_captured_jit(engine):
    """LoadedModel runs the artifact's kernels as the calls recorded from one run of its
    captured JIT (no tinygrad Python per frame): on other frames too, the outputs are the
    JIT's bit for bit, and the receipt counts every kernel."""
    model = engine.model
    assert model._plan is not None and len(model._plan) == len(MODEL_KERNELS)
    road = SyntheticRoad(W, H, seed=SEED + 1)
    try:
        for fid in (3, 50, 91):
            y = road.render(fid)[0]
            direct, r = engine.infer(y)
            plan, model._plan = model._plan, None
            try:
                jit, r2 = engine.infer(y)
            finally:
                model._plan = plan
            assert direct.tobytes() == jit.tobytes(), fid
            assert r.kernels_run == r2.kernels_run == len(MODEL_KERNELS)
    finally:
        assert model._plan is not None


@pytest.mark.parametrize("mode", ["vehicle", SIMULATION])
def test_on_the_car_modeld_takes_the_newest_frame_in_a_simulation_every_one(engine, reference,
                                                                           mode):
    """Behind by four frames: on the car modeld skips to the newest (the backlog is of no
    use; counted as skipped in its status, not as dropped); a simulation (replay) takes
    every frame in order, which equal-twice replays rely on."""
    import argparse
    from types import SimpleNamespace

    from workers.modeld import Modeld

    road_ch = Channel.create(ChannelSpec(name="road_frames", kind="frame", slot_size=W * H * 3,
                                         slot_count=6, pixel_formats=("nv12",)))
    out_ch = Channel.create(ChannelSpec(name="model_out", dtype="float32", slot_size=4096,
                                        slot_count=8))
    camera = Writer(road_ch.writer_handle(), domain="control", seal=False)
    readers = {"frames": Reader(road_ch.reader_handle(0))}
    writers = {"model": Writer(out_ch.writer_handle(), domain="control", seal=False)}
    ctx = SimpleNamespace(mode=mode, reader=readers.__getitem__, writer=writers.__getitem__)
    results = Reader(out_ch.reader_handle(0))
    try:
        m = Modeld(ctx, argparse.Namespace(pair_wait_ms=0), engine)
        road = SyntheticRoad(W, H, seed=SEED)
        for fid in range(1, 5):
            with camera.loan() as loan:
                y, uv = loan.frame("nv12", W, H, row_stride=STRIDE)
                road.render_into(fid, y, uv)
                loan.publish(frame_id=fid, capture_ts_ns=time.monotonic_ns())
        assert m.step(timeout=5)
        with results.receive(timeout=5) as msg:
            took = msg.stamp.frame_id
        status = m.status_text()
        if mode == SIMULATION:
            assert took == 1 and "skipped=0" in status, (took, status)
        else:
            assert took == 4 and "skipped=3" in status, (took, status)
            assert readers["frames"].stats.dropped == 0
        assert results.try_receive() is None        # one frame, one output
    finally:
        for x in (camera, *readers.values(), *writers.values(), results):
            x.close()
        road_ch.close()
        out_ch.close()
