"""camerad: the synthetic road scene, the replay log, and the worker itself publishing
into a real shared-memory channel from a real process (started the way the supervisor
starts it, minus the sandbox)."""
from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from supervisor.ipc import Channel, ChannelSpec, Reader, Writer
from workers.camerad import replay, synthetic
from workers.camerad.replay import (FILE_HDR_SIZE, REC_HDR_SIZE, ReplayError, ReplayLog,
                                    read_all, record)
from workers.camerad.synthetic import LaneTruth, SyntheticRoad, nv12_to_gray, nv12_to_rgb

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- a worker process


def frame_channel(name: str, fmt: str, width: int, height: int, slot_count: int = 6
                  ) -> tuple[Channel, Reader]:
    """A frame channel and a reader attached from sequence 0 (the writer's header is
    initialised here first, as a restarted writer finds it, so no frame is missed)."""
    bpp = {"nv12": 1.5, "gray8": 1, "rgb888": 3}[fmt]
    ch = Channel.create(ChannelSpec(name=name, kind="frame", pixel_formats=(fmt,),
                                    slot_size=int(width * height * bpp),
                                    slot_count=slot_count, max_readers=2, max_age_ms=0))
    Writer(ch.writer_handle(), seal=False).close()
    return ch, Reader(ch.reader_handle(0))


# ---------------------------------------------------------------- synthetic scene


def test_synthetic_is_deterministic_per_seed_and_frame():
    a, b = SyntheticRoad(640, 480, seed=3), SyntheticRoad(640, 480, seed=3)
    b.render(99)                                          # order does not matter
    for fid in (0, 7, 123, 10_000):
        ya, uva, ta = a.render(fid)
        yb, uvb, tb = b.render(fid)
        assert ya.tobytes() == yb.tobytes() and uva.tobytes() == uvb.tobytes()
        assert ta == tb
    other = SyntheticRoad(640, 480, seed=4)
    assert other.truth(7) != a.truth(7)
    assert other.render(7)[0].tobytes() != a.render(7)[0].tobytes()


def test_render_into_strided_planes_matches_render():
    road = SyntheticRoad(320, 240, seed=1)
    y, uv, truth = road.render(42)
    ybuf = np.zeros((240, 384), np.uint8)
    uvbuf = np.zeros((120, 384), np.uint8)
    got = road.render_into(42, ybuf[:, :320], uvbuf[:, :320].reshape(120, 160, 2))
    assert got == truth
    assert np.array_equal(ybuf[:, :320], y) and not ybuf[:, 320:].any()
    assert np.array_equal(uvbuf[:, :320].reshape(120, 160, 2), uv)
    with pytest.raises(ValueError):
        road.render_into(0, y[:-2], uv)


def test_truth_varies_smoothly():
    road = SyntheticRoad(640, 480, seed=0)
    t = [road.truth(i) for i in range(0, 400)]          # 20 s at 20 Hz
    off = np.array([x.offset_m for x in t])
    head = np.array([x.heading_rad for x in t])
    curv = np.array([x.curvature for x in t])
    assert off.max() - off.min() > 0.4 and np.abs(off).max() < 1.5
    assert head.max() - head.min() > 0.02 and np.abs(head).max() < 0.1
    assert curv.max() - curv.min() > 2e-4 and np.abs(curv).max() < 0.005
    assert off.min() < 0 < off.max() and head.min() < 0 < head.max()
    # smooth: 50 ms steps change little
    assert np.abs(np.diff(off)).max() < 0.05 and np.abs(np.diff(head)).max() < 0.01
    assert isinstance(t[0], LaneTruth) and isinstance(t[0].offset_m, float)


def test_lane_lines_move_and_scene_changes():
    road = SyntheticRoad(640, 480, seed=0)
    y0, uv0, _ = road.render(0)
    y1, uv1, _ = road.render(1)
    assert not np.array_equal(y0, y1)
    white0, white1 = y0 == synthetic.Y_WHITE, y1 == synthetic.Y_WHITE
    assert white0.sum() > 100 and white1.sum() > 100
    assert (white0 != white1).sum() > 50                 # the dashes moved
    # sky on top, road below, yellow line in the chroma of the lower half
    assert y0[:50].mean() > 150 and y0[-50:].mean() < 150
    assert (uv0[..., 0] == synthetic.U_YELLOW).sum() > 50


def _yellow_column(uv: np.ndarray, j: int) -> float:
    cols = np.nonzero(uv[j, :, 0] == synthetic.U_YELLOW)[0]
    assert cols.size, f"no yellow on chroma row {j}"
    return cols.mean() * 2 + 0.5


def test_truth_is_what_is_drawn():
    """The left (yellow) line lands where the documented pinhole geometry puts it for
    the truth returned, and moves left when the car moves right (+offset)."""
    w, h = 1928, 1208
    road = SyntheticRoad(w, h, seed=5)
    f = w / (2 * math.tan(math.radians(synthetic.HFOV_DEG / 2)))
    horizon = synthetic.HORIZON * h
    cols, offs = [], []
    for fid in range(0, 400, 10):
        y, uv, tr = road.render(fid)
        checked = 0
        for j in (h // 2 - 4, h // 2 - 60, h // 2 - 150, h // 2 - 250):
            row = 2 * j
            z = f * synthetic.CAM_HEIGHT_M / (row - horizon + 0.5)
            x = (-synthetic.LANE_WIDTH_M / 2 + tr.curvature * z * z / 2 - tr.offset_m
                 - tr.heading_rad * z)
            want = (w - 1) / 2 + f * x / z
            if 40 < want < w - 40:       # the line is wholly in the image on this row
                assert abs(_yellow_column(uv, j) - want) < 2.0, (fid, j)
                checked += 1
        assert checked >= 2
        cols.append(_yellow_column(uv, h // 2 - 150))
        offs.append(tr.offset_m)
    assert np.corrcoef(cols, offs)[0, 1] < -0.9


@pytest.mark.parametrize("size", [(1928, 1208), (640, 480)])
def test_render_speed(size):
    road = SyntheticRoad(*size, seed=0)
    y, uv, _ = road.render(0)
    times = []
    for fid in range(1, 31):
        t = time.perf_counter()
        road.render_into(fid, y, uv)
        times.append(time.perf_counter() - t)
    ms = float(np.median(times) * 1e3)
    print(f"\nrender_into {size[0]}x{size[1]}: median {ms:.2f} ms, max "
          f"{max(times) * 1e3:.2f} ms")
    assert ms < 50


def test_conversions():
    road = SyntheticRoad(64, 48, seed=0)
    y, uv, _ = road.render(3)
    assert np.array_equal(nv12_to_gray(y, uv), y)
    rgb = nv12_to_rgb(y, uv)
    assert rgb.shape == (48, 64, 3) and rgb.dtype == np.uint8
    # neutral chroma (road) gives R = G = B = Y
    j = 47
    neutral = (uv[j // 2, :, 0] == 128) & (uv[j // 2, :, 1] == 128)
    cols = np.nonzero(np.repeat(neutral, 2))[0]
    assert cols.size and np.array_equal(rgb[j, cols, 0], y[j, cols])
    assert np.array_equal(rgb[j, cols, 1], y[j, cols])
    sky = rgb[2, 32]
    assert sky[2] > sky[0]                                   # the sky is blue


# ---------------------------------------------------------------- replay log


def _frames(n: int, w: int = 64, h: int = 48, first: int = 10):
    road = SyntheticRoad(w, h, seed=2)
    out = []
    for i in range(n):
        y, uv, _ = road.render(first + i)
        out.append((first + i, 1_000_000 * (first + i), None if i == 1 else 500 + i,
                    np.concatenate([y.reshape(-1), uv.reshape(-1)])))
    return out


def _record_offsets(n: int, w: int = 64, h: int = 48) -> list[int]:
    size = REC_HDR_SIZE + w * h * 3 // 2
    return [FILE_HDR_SIZE + i * size for i in range(n)]


def test_replay_round_trip_bit_exact(tmp_path):
    frames = _frames(5)
    path = tmp_path / "a.camlog"
    assert record(path, frames, width=64, height=48) == 5
    header, got, log = read_all(path, strict=True)
    assert (header.pixel_format, header.width, header.height) == ("nv12", 64, 48)
    assert [(f.frame_id, f.capture_ts_ns, f.exposure_us) for f in got] == \
        [(fid, ts, exp) for fid, ts, exp, _ in frames]
    for f, (_, _, _, data) in zip(got, frames):
        assert f.data == data.tobytes()
    assert log.error_count == 0 and log.good == 5
    # planes as a (y, uv) pair and ReplayFrame objects record the same bytes
    road = SyntheticRoad(64, 48, seed=2)
    y, uv, _ = road.render(10)
    record(tmp_path / "b.camlog", [(10, 10_000_000, 500, (y, uv))], width=64, height=48)
    record(tmp_path / "c.camlog", got[:1], width=64, height=48)
    assert (tmp_path / "b.camlog").read_bytes() == (tmp_path / "c.camlog").read_bytes()
    with pytest.raises(ValueError, match="bytes"):
        record(tmp_path / "d.camlog", [(1, 1, 1, b"short")], width=64, height=48)


def _corrupt(path: Path, offset: int, xor: int = 0xFF) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= xor
    path.write_bytes(bytes(raw))


def test_replay_corrupt_payload_is_counted_and_skipped(tmp_path):
    path = tmp_path / "x.camlog"
    record(path, _frames(5), width=64, height=48)
    _corrupt(path, _record_offsets(5)[2] + REC_HDR_SIZE + 100)
    log = ReplayLog(path)
    ids = [f.frame_id for f in log]
    assert ids == [10, 11, 13, 14]
    assert dict(log.errors) == {"bad_crc": 1}
    assert "frame 12" in log.problems[0] and "CRC" in log.problems[0]
    assert "bad_crc=1" in log.summary()
    with pytest.raises(ReplayError, match="CRC"):
        list(ReplayLog(path, strict=True))


def test_replay_corrupt_record_header_resyncs(tmp_path):
    path = tmp_path / "x.camlog"
    record(path, _frames(5), width=64, height=48)
    offs = _record_offsets(5)
    _corrupt(path, offs[1] + 24)               # the length field of record 1
    _corrupt(path, offs[3] + 0)                # the magic of record 3
    log = ReplayLog(path)
    frames = [(f.frame_id, bytes(f.data)) for f in log]
    assert [fid for fid, _ in frames] == [10, 12, 14]
    assert dict(log.errors) == {"bad_header": 2}
    want = {fid: data.tobytes() for fid, _, _, data in _frames(5)}
    assert all(data == want[fid] for fid, data in frames)
    assert log.skipped_bytes == 2 * (offs[1] - offs[0])


def test_replay_garbage_between_records(tmp_path):
    path = tmp_path / "x.camlog"
    record(path, _frames(3), width=64, height=48)
    raw = path.read_bytes()
    cut = _record_offsets(3)[1]
    path.write_bytes(raw[:cut] + b"FRM1 garbage, not a record" * 3 + raw[cut:])
    log = ReplayLog(path)
    assert [f.frame_id for f in log] == [10, 11, 12]
    assert dict(log.errors) == {"bad_header": 1}


def test_replay_truncated_log(tmp_path):
    path = tmp_path / "x.camlog"
    record(path, _frames(4), width=64, height=48)
    raw = path.read_bytes()
    path.write_bytes(raw[:-1000])                       # mid-payload of the last record
    log = ReplayLog(path)
    assert [f.frame_id for f in log] == [10, 11, 12]
    assert dict(log.errors) == {"truncated": 1}
    assert "truncated" in log.problems[0] and "frame 13" in log.problems[0]
    path.write_bytes(raw[:_record_offsets(4)[3] + 10])  # mid-header of the last record
    log = ReplayLog(path)
    assert [f.frame_id for f in log] == [10, 11, 12] and dict(log.errors) == {"truncated": 1}
    # iterating again counts afresh
    assert len(list(log)) == 3 and log.error_count == 1


def test_replay_bad_length_record(tmp_path):
    path = tmp_path / "x.camlog"
    record(path, _frames(2), width=64, height=48)
    with open(path, "ab") as f:
        f.write(replay.record_bytes(99, 5, None, b"\x01" * 100))
        f.write(replay.record_bytes(*_frames(1, first=100)[0]))
    log = ReplayLog(path)
    assert [f.frame_id for f in log] == [10, 11, 100]
    assert dict(log.errors) == {"bad_length": 1} and "frame 99" in log.problems[0]


@pytest.mark.parametrize("damage,match", [
    (lambda raw: raw[:20], "shorter than the 32-byte file header"),
    (lambda raw: b"NOTALOG!" + raw[8:], "not a camera log"),
    (lambda raw: raw[:8] + b"\x02\x00" + raw[10:], "version 2"),
    (lambda raw: raw[:16] + b"\x00\x00\x00\x01" + raw[20:], "header CRC"),
    (lambda raw: b"", "0 bytes"),
])
def test_replay_bad_file_header_raises_clearly(tmp_path, damage, match):
    path = tmp_path / "x.camlog"
    record(path, _frames(1), width=64, height=48)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ReplayError, match=match):
        ReplayLog(path)


# ---------------------------------------------------------------- the worker


def test_camerad_publishes_synthetic_frames_zero_copy(workers):
    """Default size (1928x1208 NV12), control domain (seccomp after ready)."""
    w, h, fps = 1928, 1208, 20.0
    ch, reader = frame_channel("road_frames", "nv12", w, h)
    with ch, reader:
        proc = workers("workers.camerad", ["--frames", "5", "--seed", "7", "--fps", str(fps),
                                           "--exposure-us", "8000"],
                       writes={"frames": ch})
        road = SyntheticRoad(w, h, seed=7, fps=fps)
        got = []
        for _ in range(5):
            with reader.receive(timeout=15) as msg:
                info = msg.frame
                y, uv = msg.planes()
                want_y, want_uv, _ = road.render(info.frame_id)
                assert np.array_equal(y, want_y) and np.array_equal(uv, want_uv)
                got.append(info)
        rc, out, err = proc.wait()
        assert rc == 0, err
        ids = [i.frame_id for i in got]
        assert ids == sorted(set(ids)) and ids[0] == 0
        for i in got:
            assert (i.sensor, i.pixel_format, i.pixel_range, i.width, i.height) == \
                ("road", "nv12", "full", w, h)
            assert i.exposure_us == 8000 and i.gain is None
            assert i.row_strides == (w, w) and i.plane_offsets == (0, w * h)
            assert 0 < i.capture_ts_ns <= i.publish_ts_ns
        # paced on a monotonic schedule: capture times follow frame_id / fps
        period = 1e9 / fps
        for i in got[1:]:
            drift = (i.capture_ts_ns - got[0].capture_ts_ns) - (i.frame_id - ids[0]) * period
            assert abs(drift) < 40e6, drift
        assert reader.stats.rejected == {}
        assert proc.lines[0].startswith("READY=1")
        assert "frames=5" in proc.statuses()[-1] and "stopped=done" in proc.statuses()[-1]
        assert "frames=5" in out


@pytest.mark.parametrize("fmt", ["gray8", "rgb888"])
def test_camerad_converts_formats(workers, fmt):
    w, h = 320, 240
    ch, reader = frame_channel("cam", fmt, w, h)
    with ch, reader:
        proc = workers("workers.camerad", ["--frames", "3", "--format", fmt, "--width", str(w),
                                           "--height", str(h), "--fps", "40",
                                           "--sensor", "wide"],
                       writes={"frames": ch})
        road = synthetic.scene("wide", w, h, seed=0, fps=40)     # the wide lens's view
        for _ in range(3):
            with reader.receive(timeout=15) as msg:
                info = msg.frame
                assert (info.pixel_format, info.sensor) == (fmt, "wide")
                y, uv, _ = road.render(info.frame_id)
                want = nv12_to_gray(y, uv) if fmt == "gray8" else nv12_to_rgb(y, uv)
                assert np.array_equal(msg.planes()[0], want)
        assert proc.wait()[0] == 0


def test_camerad_replays_a_log_with_loop_and_bad_records(workers, tmp_path):
    w, h = 64, 48
    frames = _frames(4, w, h, first=10)
    path = tmp_path / "drive.camlog"
    record(path, frames, width=w, height=h)
    _corrupt(path, _record_offsets(4)[1] + REC_HDR_SIZE + 7)     # frame 11: bad CRC
    ch, reader = frame_channel("road_frames", "nv12", w, h, slot_count=8)
    with ch, reader:
        proc = workers("workers.camerad", ["--source", "replay", "--log", str(path), "--loop",
                                           "--frames", "6", "--fps", "50"],
                       writes={"frames": ch}, mode="simulation")
        data = {fid: d.tobytes() for fid, _, _, d in frames}
        exp = {fid: e for fid, _, e, _ in frames}
        got = []
        for _ in range(6):
            with reader.receive(timeout=15) as msg:
                info = msg.frame
                got.append(info.frame_id)
                recorded = [10, 12, 13][(len(got) - 1) % 3]
                assert msg.array.tobytes() == data[recorded]
                assert info.exposure_us == exp[recorded]
        rc, out, err = proc.wait()
        assert rc == 0, err
        # recorded ids 10, 12, 13, then the loop continues the ids: 14, 16, 17
        assert got == [10, 12, 13, 14, 16, 17]
        last = proc.statuses()[-1]
        assert "loops=1" in last and "log_errors=2" in last
        assert "bad_crc" in out and "CRC mismatch" in out   # its log record


def test_camerad_refuses_a_bad_log_before_ready(workers, tmp_path):
    path = tmp_path / "bad.camlog"
    path.write_bytes(b"garbage" * 10)
    ch, reader = frame_channel("road_frames", "nv12", 64, 48)
    with ch, reader:
        proc = workers("workers.camerad", ["--source", "replay", "--log", str(path)],
                       writes={"frames": ch}, mode="simulation")
        rc, out, err = proc.wait()
        assert rc == 2 and "not a camera log" in out   # its log record
        assert not any(ln.startswith("READY") for ln in proc.lines)


@pytest.mark.parametrize("args", [["--source", "log", "--log", "/nonexistent"],
                                  ["--source=video", "--video", "/x.mp4"],
                                  ["--lockstep", "ack"]])
def test_a_vehicle_camera_refuses_recorded_frames_itself(workers, args):
    """However it was started (a `command` worker is not read by `supervisor check`),
    camerad in a vehicle run refuses its simulation-only arguments before READY."""
    ch, reader = frame_channel("road_frames", "nv12", 64, 48)
    with ch, reader:
        proc = workers("workers.camerad", args, writes={"frames": ch})
        rc, out, err = proc.wait()
        assert rc == 2 and "is for simulation only" in out and "'vehicle' run" in out, out
        assert not any(ln.startswith("READY") for ln in proc.lines)


def test_simulation_only_flags_cannot_be_abbreviated():
    """The check matches exact names, so the parsers must refuse prefixes."""
    from workers.camerad import parse_args as cam
    from workers.controlsd import parse_args as ctl
    for parse, argv in ((cam, ["--sourc", "log"]), (cam, ["--lock", "x"]),
                        (ctl, ["--log-c", "/x"])):
        with pytest.raises(SystemExit):
            parse(argv)


def test_camerad_stops_cleanly_on_sigterm(workers):
    ch, reader = frame_channel("road_frames", "nv12", 320, 240)
    with ch, reader:
        proc = workers("workers.camerad", ["--width", "320", "--height", "240",
                                           "--fps", "30", "--status-s", "0.1"],
                       writes={"frames": ch})
        with reader.receive(timeout=15):
            pass
        time.sleep(0.3)
        proc.proc.send_signal(signal.SIGTERM)
        rc, out, err = proc.wait()
        assert rc == 0, err
        statuses = proc.statuses()
        assert "stopped=sigterm" in statuses[-1]
        assert any("fps=" in s and "overruns=" in s for s in statuses)


def test_cameras_on_the_clock_trigger_give_one_instant_one_id(workers):
    """--trigger clock: two cameras started apart expose on the shared k/fps grid of the
    monotonic clock, so the frames of one instant carry one id and one capture time
    (what the driving model pairs road and wide frames by)."""
    w, h, fps = 320, 240, 20.0
    period = 1e9 / fps
    n = 40                          # 2 s each: the two starts overlap by most of it
    # (read one after the other: the ring holds them all)
    chans = [frame_channel(f"cam{i}", "nv12", w, h, slot_count=n + 8) for i in range(2)]
    procs = []
    for i, (sensor, (ch, _r)) in enumerate(zip(("road", "wide"), chans)):
        procs.append(workers("workers.camerad", ["--frames", str(n), "--fps", str(fps),
                                                 "--width", str(w), "--height", str(h),
                                                 "--sensor", sensor, "--trigger", "clock"],
                             writes={"frames": ch}))
        if not i:
            time.sleep(0.13)          # not in phase with a start-relative schedule
    got: list[dict[int, int]] = []
    for ch, reader in chans:
        with ch, reader:
            seen = {}
            for _ in range(n):
                with reader.receive(timeout=30) as msg:
                    seen[msg.frame.frame_id] = msg.frame.capture_ts_ns
            got.append(seen)
    for p in procs:
        assert p.wait()[0] == 0
    common = sorted(set(got[0]) & set(got[1]))
    assert len(common) >= 4, [(len(g), min(g), max(g)) for g in got]   # the same instants
    # Stamped with the trigger's instant k * period, however late the process woke:
    # one instant, one id, one capture time.
    for fid in common:
        assert got[0][fid] == got[1][fid] == fid * int(round(period))
    for g in got:
        assert all(ts == fid * int(round(period)) for fid, ts in g.items()), g
