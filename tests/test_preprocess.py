"""Preprocessing inside the artifact (input ABI 2): the signed artifact takes the Y plane
with its row stride and crops/resamples it in its own kernels, bit-identical to the numpy
path it replaced; an artifact of the old input ABI is refused in one line.

The reference is the old path itself: the last input-ABI-1 demo artifact (signed with the
old demo key, kept in models/demo/reference/) run on modeld's numpy `preprocess_y`. Real
tinygrad, real artifacts; the kernel test compiles in a subprocess (clang, small frames).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from supervisor.model import AbiMismatch, load_verified
from supervisor.model import artifact as A
from supervisor.model.runtime import load_model
from workers.camerad.synthetic import SyntheticRoad
from workers.modeld.engine import ENGINE_ABI, ENGINE_ABIS, Engine, preprocess_y

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo" / "lane-offset"
DEMO_PUB = ROOT / "models" / "demo" / "demo_ed25519.pub"
OLD = ROOT / "models" / "demo" / "reference" / "lane-offset-abi1"
OLD_PUB = ROOT / "models" / "demo" / "reference" / "lane-offset-abi1.pub"
W, H, STRIDE = 1928, 1208, 1936


@pytest.fixture(scope="module")
def both():
    old = load_verified(OLD, OLD_PUB)                       # no expect_abi: the reference
    new = load_verified(DEMO, DEMO_PUB, expect_abi=ENGINE_ABI)
    yield load_model(old), old.input_abi["preprocess"], Engine(new)
    old.close()
    new.close()


def _strided(y: np.ndarray, stride: int, fill: int) -> np.ndarray:
    buf = np.full((y.shape[0], stride), fill, np.uint8)
    buf[:, :y.shape[1]] = y
    return buf[:, :y.shape[1]]


def test_the_artifact_equals_the_old_numpy_path_bit_for_bit(both):
    """Frames at the model's stride (one memcpy, padding bytes that vary), packed (row by
    row) and at another stride: each output is the old path's, byte for byte."""
    old_model, old_spec, engine = both
    road = SyntheticRoad(W, H, seed=11)
    for i, stride in enumerate((STRIDE, W, STRIDE, 2048, STRIDE)):
        y = road.render(40 * i)[0]
        ref, _ = old_model.run(preprocess_y(y, old_spec))
        out, r = engine.infer(_strided(y, stride, fill=(91 * i) % 256), frame_id=i)
        assert out.tobytes() == ref.tobytes(), (stride, out, ref)
        assert r.bytes_in == ((H - 1) * STRIDE + W if stride == STRIDE else H * W)
        assert r.bytes_out == 16
    # the extremes of the normalisation (all 0, all 255) as well
    for v in (0, 255):
        y = np.full((H, W), v, np.uint8)
        ref, _ = old_model.run(preprocess_y(y, old_spec))
        assert engine.infer(y)[0].tobytes() == ref.tobytes()


def test_the_manifest_declares_what_the_artifact_takes():
    m = A.read_manifest_unverified(DEMO)
    abi = m["abi"]
    assert abi["version"] == 2 and abi["input"]["takes"] == "y_plane"
    assert abi["input"]["frame"]["row_stride"] == STRIDE and abi["input"]["tensor"]["dtype"] == "uint8"
    tol = abi["input"]["preprocess"]["tolerance"]
    assert tol["max_abs"] == 0.0 and tol["reference"] == "workers.modeld.engine.preprocess_y"
    assert tol["checked_frames"] >= 100 and tol["max_abs_seen_output"] == 0.0


def test_an_artifact_of_the_old_input_abi_is_refused_in_one_line():
    with pytest.raises(AbiMismatch) as e:
        load_verified(OLD, OLD_PUB, expect_abi=ENGINE_ABI)
    msg = str(e.value)
    assert "\n" not in msg and "input ABI is 1" in msg and "runs input ABI 2" in msg


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_modeld_refuses_an_old_abi_artifact_with_one_line():
    from supervisor.protocol import ENV_MODE, SIMULATION
    from supervisor.sandbox import policy_for_domain, run

    pol = policy_for_domain("control", extra_ro_binds=[str(OLD), str(OLD_PUB)])
    res = run(pol, [sys.executable, "-m", "supervisor.runner", "workers.modeld",
                    "--artifact", str(OLD), "--pubkey", str(OLD_PUB)], timeout=60,
              env_extra={"TRIO_WORKER": "modeld", "TRIO_DOMAIN": "control",
                         ENV_MODE: SIMULATION})
    assert res.returncode == 2
    lines = [ln for ln in res.stdout.splitlines() if "artifact refused" in ln]
    assert len(lines) == 1 and "AbiMismatch: abi.version" in lines[0], res.stdout
    assert "Traceback" not in res.stdout + res.stderr


_KERNEL_CHECK = r"""
import json, os, sys
import numpy as np
from tinygrad import Tensor, TinyJit
from workers.modeld.engine import preprocess_spec, preprocess_y
from workers.modelbuild.preprocess import Geometry, Preprocess, reference_sums
report = []
for (h, w, stride, oh, ow, num, den) in json.loads(sys.argv[1]):
    spec = preprocess_spec(out_height=oh, out_width=ow, crop_top_num=num, crop_top_den=den)
    g = Geometry.of(spec, h, w, stride)
    pre = Preprocess(g, spec)
    jit = TinyJit(lambda y: pre(y).realize())
    rng = np.random.default_rng(h * w)
    frames = [rng.integers(0, 256, (h, stride), dtype=np.uint8) for _ in range(4)]
    frames += [np.full((h, stride), v, np.uint8) for v in (0, 255, 128)]
    frames[-1][:, w:] = 7                     # padding never read
    ok = 0
    for f in frames:
        got = jit(Tensor(f).realize()).numpy()
        ref = preprocess_y(f[:, :w], spec)
        ok += got.tobytes() == ref.tobytes()
        x64 = (reference_sums(f, g) / g.counts() - 128.0) * 0.015625
        ok += np.array_equal(x64.astype(np.float32), got[0, 0])
    report.append(ok == 2 * len(frames))
print(json.dumps(report))
"""


@pytest.mark.skipif(shutil.which("clang") is None, reason="compiling the kernels needs clang")
def test_the_kernels_equal_numpy_on_other_geometries(tmp_path):
    """Odd sizes, strides, crops and band counts (short and long bands, no period):
    every output pixel equals the reference's, on random and extreme frames."""
    geoms = [(74, 150, 160, 16, 32, 2, 5), (50, 90, 96, 13, 21, 1, 3), (40, 64, 64, 40, 64, 0, 1)]
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "CACHEDB", "BEAM")}
    env.update(DEV="CPU:CLANG", CACHEDB=str(tmp_path / "cache.db"), PARALLEL="0",
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _KERNEL_CHECK, json.dumps(geoms)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True] * len(geoms)


# ------------------------------------------------------------------ two cameras (input ABI 3)

WIDE = ROOT / "models" / "demo" / "lane-offset-wide"


def test_the_two_camera_manifest_declares_both_inputs_and_their_pairing():
    abi = A.read_manifest_unverified(WIDE)["abi"]
    assert abi["version"] == 3 and "input" not in abi
    assert [(i["name"], i["role"], i["sensor"]) for i in abi["inputs"]] == \
        [("road_y", "frames", "road"), ("wide_y", "wide", "wide")]
    for i in abi["inputs"]:
        assert i["takes"] == "y_plane" and i["frame"]["row_stride"] == STRIDE
        tol = i["preprocess"]["tolerance"]
        assert tol["max_abs"] == 0.0 and tol["checked_frames"] >= 100
        assert tol["max_abs_seen_input"] == 0.0 and tol["max_abs_seen_output"] == 0.0
    assert abi["pairing"]["by"] == "frame_id" and 0 < abi["pairing"]["max_skew_ms"] <= 50


def test_a_one_camera_engine_refuses_the_two_camera_artifact_in_one_line():
    with pytest.raises(AbiMismatch) as e:
        load_verified(WIDE, DEMO_PUB, expect_abi=ENGINE_ABI)
    msg = str(e.value)
    assert "\n" not in msg and "input ABI is 3 (it takes 2 Y planes: road_y, wide_y)" in msg


@pytest.fixture(scope="module")
def wide_engine():
    v = load_verified(WIDE, DEMO_PUB, expect_abi=ENGINE_ABIS)
    yield Engine(v)
    v.close()


def test_the_two_camera_artifact_sees_each_plane_only_through_its_preprocessing(wide_engine):
    """The kernels equal numpy's preprocess_y for each plane (the build checked every
    validation frame bit for bit; here, at run time): planes whose preprocessed tensors
    are equal give the same output bit for bit (pixels swapped inside a band, other row
    padding, another stride), and a change that moves one band's mean, in either camera,
    changes it. Which plane is which matters: swapped, the output differs."""
    from workers.camerad.synthetic import scene

    eng = wide_engine
    road, wide = (scene(s, W, H, seed=4).render(33)[0] for s in ("road", "wide"))
    out, r = eng.infer(_strided(road, STRIDE, 0), _strided(wide, STRIDE, 0), frame_id=33)
    assert r.bytes_in == 2 * ((H - 1) * STRIDE + W) and r.bytes_out == 16
    assert abs(out[0] - scene("road", W, H, seed=4).truth(33).offset_m) < 0.2

    def same_bands(y: np.ndarray) -> np.ndarray:
        # swap two pixels of one band (rows and columns of band 0 past the crop)
        z = y.copy()
        top = (H * 2) // 5
        z[top, 0], z[top + 1, 1] = y[top + 1, 1], y[top, 0]
        return z

    for k in (0, 1):
        planes = [road, wide]
        planes[k] = same_bands(planes[k])
        assert np.array_equal(eng.preprocess(planes[k], k), eng.preprocess((road, wide)[k], k))
        again, _ = eng.infer(_strided(planes[0], 2048, 255), _strided(planes[1], W, 0))
        assert again.tobytes() == out.tobytes(), k
        moved = [road.copy(), wide.copy()]
        moved[k][H - 20:, :40] = 255 - moved[k][H - 20:, :40]
        assert not np.array_equal(eng.preprocess(moved[k], k), eng.preprocess((road, wide)[k], k))
        assert eng.infer(*moved)[0].tobytes() != out.tobytes(), k
    assert eng.infer(wide, road)[0].tobytes() != out.tobytes()
