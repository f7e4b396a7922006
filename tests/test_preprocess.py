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
from workers.modeld.engine import ENGINE_ABI, Engine, preprocess_y

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
