"""The car-shaped config, the embedded default (supervisor/default.toml): three cameras
with distinct synthetic scenes, the driving model on road + wide (input ABI 3), the
driver-monitoring model in its own modeld instance with its own signed artifact and
payload, controls at 100 Hz; and the one-camera config (configs/minimal.toml) that
tests of the mechanics run, checked to be the car's own tables. Real artifacts, real
tinygrad, the real CLI; timings are bench/vehicle_load.py's, not these tests'."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas.payloads import DRIVER_STATE, PAYLOADS
from supervisor.config import DEFAULT_SOURCE, default_doc, load, minimal_doc
from supervisor.model import AbiMismatch, load_verified
from workers.camerad.synthetic import SyntheticDriver, SyntheticRoad, scene
from workers.modeld.engine import ENGINE_ABI, Engine, check_output_payload

ROOT = Path(__file__).resolve().parents[1]
CAR = ROOT / "supervisor" / "default.toml"
DM = ROOT / "models" / "demo" / "driver-monitor"
PUB = ROOT / "models" / "demo" / "demo_ed25519.pub"
W, H = 1928, 1208


def test_the_default_is_the_car_checked_and_trusting_both_models(tmp_path):
    """`supervisor check` with no --config (the README's and the unit's): the car."""
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "check"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)   # 7 sandboxes, 2 loaded cores
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Traceback" not in out and DEFAULT_SOURCE in r.stdout
    assert "trusts model 'driver-monitor': driver-monitor-demo 1.0.0" in out
    assert "for dmonitoringd" in out and "7 workers, 7 channels: all admitted" in out
    cfg = load()
    assert cfg.source == DEFAULT_SOURCE and load(CAR).channel_specs() == cfg.channel_specs()
    sensors = {w: cfg.workers[w].args[cfg.workers[w].args.index("--sensor") + 1]
               for w in ("camerad", "camerad_wide", "camerad_driver")}
    assert sensors == {"camerad": "road", "camerad_wide": "wide", "camerad_driver": "driver"}
    # the driving model takes road + wide, paired by frame id: both on the clock trigger
    md = cfg.workers["modeld"]
    assert md.model == "lane-offset-wide"
    assert dict(md.roles) == {"frames": "road_frames", "wide": "wide_frames", "model": "model_out"}
    for w in ("camerad", "camerad_wide"):
        args = cfg.workers[w].args
        assert args[args.index("--trigger") + 1] == "clock"
    assert "trusts model 'lane-offset-wide': lane-offset-wide-demo 1.0.0" in out
    dm = cfg.workers["dmonitoringd"]
    assert dm.module == "workers.modeld" and dm.model == "driver-monitor"
    assert dict(dm.roles) == {"frames": "driver_frames", "model": "driver_state"}
    assert cfg.channels["driver_state"].payload == "driver_state"
    assert "--hz" in cfg.workers["controlsd"].args
    # controlsd also watches the driver: dmonitoringd's driver_state as its role `driver`
    assert dict(cfg.workers["controlsd"].roles) == {"model": "model_out",
                                                    "driver": "driver_state",
                                                    "command": "control_cmd"}


def test_the_three_cameras_see_distinct_deterministic_scenes():
    road, wide, drv = (scene(s, 256, 160, seed=3) for s in ("road", "wide", "driver"))
    assert isinstance(road, SyntheticRoad) and isinstance(drv, SyntheticDriver)
    assert wide.hfov_deg > road.hfov_deg and wide.truth(9) == road.truth(9)   # same drive
    ys = [s.render(9)[0] for s in (road, wide, drv)]
    assert not np.array_equal(ys[0], ys[1]) and not np.array_equal(ys[0], ys[2])
    again = scene("driver", 256, 160, seed=3).render(9)[0]
    assert np.array_equal(again, ys[2])
    # any row stride, as a bridge loan gives
    buf = np.zeros((160, 272), np.uint8)
    uv = np.zeros((80, 128, 2), np.uint8)
    drv.render_into(9, buf[:, :256], uv)
    assert np.array_equal(buf[:, :256], ys[2]) and not buf[:, 256:].any()


def test_driver_monitor_artifact_says_what_the_driver_does():
    v = load_verified(DM, PUB, expect_name="driver-monitor-demo", expect_abi=ENGINE_ABI)
    try:
        eng = Engine(v)
        assert eng.payload == "driver_state" and PAYLOADS["driver_state"] is DRIVER_STATE
        d = SyntheticDriver(W, H, seed=5)
        states = {}
        for fid in range(0, 4000, 40):               # every 2 s of scene time
            t = d.truth(fid)
            key = (t.face_present, t.eyes_on_road)
            if key in states:
                continue
            out, r = eng.infer(d.render(fid)[0], frame_id=fid)
            states[key] = DRIVER_STATE.decode(out)
            assert r.bytes_out == 16 and r.bytes_in == H * W
        assert set(states) == {(True, True), (True, False), (False, False)}
        for (face, eyes), o in states.items():
            assert abs(o["face_prob"] - face) < 0.3 and abs(o["eyes_on_road_prob"] - eyes) < 0.3
            assert 0.0 <= o["face_prob"] <= 1.0 and o["reserved"] == 0.0
    finally:
        v.close()


def test_an_output_payload_modeld_does_not_publish_is_refused():
    out = {"payload": "shadow_out", "fields": list(PAYLOADS["shadow_out"].fields)}
    with pytest.raises(AbiMismatch, match="abi.output.payload is 'shadow_out'"):
        check_output_payload(out)
    with pytest.raises(AbiMismatch, match="are not payload driver_state"):
        check_output_payload({"payload": "driver_state", "fields": ["a", "b", "c", "d"]})
    assert check_output_payload({"payload": "model_out",
                                 "fields": list(PAYLOADS["model_out"].fields)}) == "model_out"


def test_check_names_a_camera_input_the_config_leaves_unbound(tmp_path):
    """The driving model takes the wide camera on role 'wide' (its manifest says so): a
    config that runs it without binding that role is a config problem `supervisor check`
    names, not a worker that refuses at every start and fails the control domain safe."""
    from supervisor.model.trust import verify_models

    text = CAR.read_text().replace('"models/demo/', f'"{ROOT}/models/demo/')
    assert 'wide = "wide_frames"' in text
    bad = tmp_path / "car.toml"
    bad.write_text(text.replace(', wide = "wide_frames"', ""))
    trusted, problems = verify_models(load(bad))
    assert {t.model for t in trusted} == {"lane-offset-wide", "driver-monitor"}
    assert problems == [("workers.modeld.subscribes",
                         "model 'lane-offset-wide' takes input 'wide_y' (wide camera) on role "
                         "'wide': bind it, e.g. subscribes = { wide = \"CHANNEL\" }")]
    assert verify_models(load())[1] == []


# What the one-camera config (configs/minimal.toml, for tests of the mechanics) may differ
# from the car in, per worker: the car's second camera (modeld's model and inputs), its
# driver monitor and 100 Hz in SCHED_FIFO (controlsd's), the clock trigger that pairs
# road and wide (camerad's args), and the start-up deadlines of seven sandboxes on 2 cores.
MINIMAL_DIFFERS = {
    "camerad": {"args", "ready_timeout_ms"},
    "modeld": {"model", "subscribes", "ready_timeout_ms"},
    "controlsd": {"args", "subscribes", "busy_poll_us", "realtime_priority",
                  "realtime_budget_pct", "ready_timeout_ms"},
    "research": {"ready_timeout_ms"},
}


def test_the_minimal_config_is_the_car_without_its_extra_load():
    """A test on the one-camera config exercises the car's own settings: its supervisor,
    domain and channel tables are the car's, its workers the car's but for the keys the
    extra cameras, the driver monitor and 100 Hz change, its model the road-only build
    of the car's driving model, signed by the same key."""
    car, one = default_doc(), minimal_doc()
    assert one["supervisor"] == car["supervisor"] and one["domains"] == car["domains"]
    assert {n: car["channels"][n] for n in one["channels"]} == one["channels"]
    assert set(one["workers"]) == set(MINIMAL_DIFFERS) and set(one["workers"]) < set(car["workers"])
    for name, w in one["workers"].items():
        theirs = car["workers"][name]
        differ = {k for k in w.keys() | theirs.keys() if w.get(k) != theirs.get(k)}
        assert differ <= MINIMAL_DIFFERS[name], (name, differ - MINIMAL_DIFFERS[name])
    (model,) = one["models"].values()
    drive = car["models"]["lane-offset-wide"]
    assert model["public_key"] == drive["public_key"] and model["min_version"] == drive["min_version"]
    assert one["workers"]["modeld"]["model"] == "lane-offset"


def test_a_replay_or_clip_into_the_car_is_refused_in_one_line(tmp_path):
    """A drive log or a clip feeds one camera; in the car the others would keep rendering
    live and the driving model would pair nothing: refused before anything starts."""
    from supervisor.replay.derive import DeriveError, clip_doc, plan_of, replay_doc

    why = r"3 camera workers \(camerad, camerad_wide, camerad_driver\): a replay or a clip"
    with pytest.raises(DeriveError, match=why):
        plan_of(default_doc())
    with pytest.raises(DeriveError, match=why):
        replay_doc(default_doc(), str(tmp_path / "log"), str(tmp_path / "run"), str(tmp_path))
    with pytest.raises(DeriveError, match=why):
        clip_doc(default_doc(), str(tmp_path / "a.mp4"), str(tmp_path / "out"))
    assert plan_of(minimal_doc()).camera == "camerad"
