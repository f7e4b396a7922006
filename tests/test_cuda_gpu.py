"""What needs an NVIDIA GPU (marker ``gpu``; skipped, with the reason, without one):
load the signed CUDA demo through the driver alone, infer, compare with the CPU
artifact's outputs, receipts, the refusal when NVRTC is visible, no compiler mapped,
a control sandbox with the GPU's nodes (where bubblewrap runs), CPU vs CUDA latency.

scripts/gpu_suite.sh runs these on a GPU machine (no network, maybe no bubblewrap) and
keeps what they measure: set TRIO_GPU_OUT to a directory and each test that measures
writes a JSON file there.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from supervisor.model import cuda_runtime as R
from supervisor.model import load_verified
from supervisor.model.errors import CompilerVisible

ROOT = Path(__file__).resolve().parents[1]
CUDA_DEMO = ROOT / "models" / "demo" / "lane-offset-cuda"
CPU_DEMO = ROOT / "models" / "demo" / "lane-offset"
DEMO_PUB = ROOT / "models" / "demo" / "demo_ed25519.pub"
RUNS = int(os.environ.get("TRIO_GPU_RUNS", "100"))


def no_gpu() -> str | None:
    """None when libcuda loads and sees a GPU, else why not."""
    try:
        lib = ctypes.CDLL(R.LIBCUDA)
    except OSError as e:
        return f"no NVIDIA driver here ({R.LIBCUDA}: {e})"
    n = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
        return "libcuda loads but reports no usable GPU"
    return None


_why = no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why is not None, reason=_why or "")]


def _out(name: str, data: dict) -> None:
    d = os.environ.get("TRIO_GPU_OUT")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / name).write_text(json.dumps(data, indent=1, sort_keys=True, default=str))


def _frames(n: int, engine) -> list[np.ndarray]:
    from workers.modelbuild.synthetic import road_class

    cls, _ = road_class()
    road = cls(engine.width, engine.height, seed=5)
    out = []
    for i in range(n):
        y = road.render(1000 + i)[0]
        buf = np.zeros((engine.height, engine.row_stride), np.uint8)
        buf[:, :engine.width] = y
        out.append(buf[:, :engine.width])
    return out


@pytest.fixture(scope="module")
def cuda_engine():
    from workers.modeld.engine import ENGINE_ABIS, Engine

    v = load_verified(CUDA_DEMO, DEMO_PUB, expect_abi=ENGINE_ABIS)
    # No sandbox here: NVRTC may lie in /usr/local/cuda; the refusal has its own test.
    from supervisor.model import runtime

    orig = runtime.load_model
    runtime.load_model = lambda verified, exclusive=False: R.CudaModel(verified,
                                                                      refuse_compilers=False)
    try:
        e = Engine(v, deadline_ms=50.0)
    finally:
        runtime.load_model = orig
    yield e
    v.close()


@pytest.fixture(scope="module")
def cpu_engine():
    from workers.modeld.engine import ENGINE_ABIS, Engine

    v = load_verified(CPU_DEMO, DEMO_PUB, expect_abi=ENGINE_ABIS)
    yield Engine(v, deadline_ms=50.0)
    v.close()


def test_loads_through_the_driver_and_passes_its_golden(cuda_engine):
    m = cuda_engine.model
    info = m.runtime_info
    assert m.golden_ok is True and m.golden_max_abs <= 1e-3
    assert info["device_class"] == "cuda-driver" and info["uuid"].startswith("GPU-")
    maps = Path("/proc/self/maps").read_text()
    mapped = sorted({line.split()[-1] for line in maps.splitlines()
                     if any(s in line for s in ("nvrtc", "nvJitLink", "ptxjitcompiler"))})
    # What the driver maps, for the exec watch and the maps scan to declare: device
    # files, executable mappings that are not a file, anything writable and executable.
    rows = [line.split(maxsplit=5) for line in maps.splitlines()]
    driver_maps = {
        "device_files": sorted({r[5] for r in rows if len(r) > 5 and r[5].startswith("/dev/")}),
        "anon_exec": [" ".join(r) for r in rows if "x" in r[1] and (len(r) < 6 or
                                                                     not r[5].startswith("/"))],
        "write_exec": [" ".join(r) for r in rows if "w" in r[1] and "x" in r[1]],
        "nvidia_libs": sorted({r[5] for r in rows if len(r) > 5 and "nvidia" in r[5]
                               or len(r) > 5 and "libcuda" in r[5]}),
    }
    _out("load.json", {"runtime_info": info, "golden_max_abs": m.golden_max_abs,
                       "compiler_libraries_mapped": mapped, "driver_maps": driver_maps,
                       "manifest_runtime": cuda_engine.verified.manifest["runtime"]})
    assert not [p for p in mapped if "nvrtc" in p or "nvJitLink" in p], mapped


def test_outputs_match_the_cpu_artifact_and_receipts_say_where(cuda_engine, cpu_engine):
    frames = _frames(20, cuda_engine)
    worst, receipts = 0.0, []
    for i, y in enumerate(frames):
        oc, rc = cuda_engine.infer(y, frame_id=i, capture_ts_ns=time.monotonic_ns())
        op, _ = cpu_engine.infer(y, frame_id=i, capture_ts_ns=time.monotonic_ns())
        worst = max(worst, float(np.abs(oc.astype(np.float64) - op).max()))
        receipts.append(rc.as_dict())
    r = receipts[-1]
    plane = cuda_engine.height * cuda_engine.row_stride
    assert r["device"].startswith("CUDA:0 ") and "GPU-" in r["device"]
    assert r["completion"] == "hostVisible" and r["bytes_out"] == 16
    assert r["bytes_in"] >= plane and r["kernels_run"] == cuda_engine.model.kernels_in_program
    _, st = cuda_engine.model.run_staged()
    assert st.fallbacks == 0 and st.device_ms is not None and st.device_ms > 0
    _out("compare.json", {"max_abs_vs_cpu": worst, "frames": len(frames),
                          "receipt": r, "device_ms": st.device_ms})
    assert worst <= 1e-3


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def test_latency_cpu_vs_cuda(cuda_engine, cpu_engine):
    y = _frames(1, cuda_engine)[0]
    res = {}
    for name, e in (("cpu", cpu_engine), ("cuda", cuda_engine)):
        for _ in range(5):
            e.infer(y)
        lat, dev = [], []
        for i in range(RUNS):
            _, r = e.infer(y, frame_id=i)
            lat.append(r.latency_ns / 1e6)
        if name == "cuda":
            for _ in range(RUNS):
                dev.append(e.model.run_staged()[1].device_ms)
        res[name] = {"p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99), "max_ms": max(lat),
                     "runs": RUNS, "worst_case_ms": e.worst_case_ns / 1e6}
        if dev:
            res[name]["device_p50_ms"] = _pct(dev, 0.5)
            res[name]["device_p99_ms"] = _pct(dev, 0.99)
    _out("latency.json", res)
    print(json.dumps(res))


def test_a_visible_nvrtc_is_refused_on_the_gpu_machine(tmp_path, monkeypatch):
    """As a control process would (refuse_compilers): the toolkit's NVRTC, or a planted
    one where the machine has none, refuses the model in one line before libcuda."""
    if not R.visible_compilers():
        lib = tmp_path / "lib"
        lib.mkdir()
        (lib / "libnvrtc.so.13").write_bytes(b"\x7fELF fake")
        monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    with load_verified(CUDA_DEMO, DEMO_PUB) as v, pytest.raises(CompilerVisible) as ei:
        R.CudaModel(v, refuse_compilers=True)
    assert "\n" not in str(ei.value)
    _out("refusal_nvrtc.json", {"line": f"{type(ei.value).__name__}: {ei.value}"})


_IN_SANDBOX = textwrap.dedent("""
    import json, os, sys
    from supervisor.model import ArtifactError, load_verified
    from supervisor.model.cuda_runtime import CudaModel, visible_compilers
    v = load_verified(sys.argv[1], sys.argv[2])
    nodes = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    try:
        m = CudaModel(v, refuse_compilers=True)
    except ArtifactError as e:
        print(json.dumps({"refused": f"{type(e).__name__}: {e}", "nodes": nodes}))
        sys.exit(0)
    out, st = m.run(m.golden_inputs())
    print(json.dumps({"golden_ok": m.golden_ok, "info": m.runtime_info, "device_ms": st.device_ms,
                      "visible_compilers": visible_compilers(), "nodes": nodes}))
""")


def test_in_a_control_sandbox_with_the_gpu_nodes():
    """A control sandbox (device = "cuda"): the three nodes, NVRTC whited out, the
    launch seccomp filter: the model loads through the driver and passes its golden. The
    same worker undeclared (device = "cpu"): no node, refused in one line."""
    from supervisor.sandbox import launch
    from supervisor.sandbox.policy import policy_for_domain

    from .conftest import bwrap_unusable

    why = bwrap_unusable()
    if why:
        pytest.skip(why)
    reps = {}
    for device in ("cuda", "cpu"):
        pol = policy_for_domain("control", device=device,
                                extra_ro_binds=[str(CUDA_DEMO), str(DEMO_PUB)])
        r = launch.run(pol, [sys.executable, "-c", _IN_SANDBOX, str(CUDA_DEMO), str(DEMO_PUB)],
                       timeout=120)
        reps[device] = {"rc": r.returncode, "stdout": r.stdout[-4000:],
                        "stderr": r.stderr[-4000:], "dev_binds": pol.dev_binds,
                        "hidden": pol.hidden}
        _out("sandbox.json", reps)
        assert r.returncode == 0, r.stderr[-2000:]
        reps[device]["report"] = json.loads(r.stdout.strip().splitlines()[-1])
    _out("sandbox.json", reps)
    ok, undeclared = reps["cuda"]["report"], reps["cpu"]["report"]
    assert ok.get("golden_ok") is True and ok["visible_compilers"] == [], ok
    assert undeclared["nodes"] == [] and "\n" not in undeclared["refused"], undeclared


def test_building_here_matches_the_driver(tmp_path):
    """The build with this machine's NVRTC (toolkit or wheel) for this GPU's arch, then
    loaded: the cubin the build made is what the driver runs. Skipped without NVRTC or
    clang (the CPU half of the build needs clang)."""
    import shutil as sh

    from workers.modelbuild.cuda import find_nvrtc

    nvrtc = find_nvrtc() or next(iter(sorted(
        p for p in __import__("glob").glob("/usr/local/cuda*/lib64/libnvrtc.so.*[0-9]")
        if "builtins" not in p)), None)
    if nvrtc is None or sh.which("clang") is None:
        pytest.skip(f"needs NVRTC ({nvrtc}) and clang ({sh.which('clang')})")
    drv = R.Driver()
    info, _ = R.probe_device(drv)
    out = tmp_path / "b"
    env = {**os.environ, "NVRTC_PATH": nvrtc, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "workers.modelbuild", "--device", "cuda",
                        "--arch", info.arch, "--out", str(out), "--key", str(tmp_path / "k.key"),
                        "--seed", "3", "--frames", "160", "--val-frames", "24",
                        "--width", "256", "--height", "160"],
                       capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    with load_verified(out, tmp_path / "k.pub", device_arch=info.arch,
                       driver_version=info.driver) as v:
        m = R.CudaModel(v, refuse_compilers=False)
        _out("build_here.json", {"manifest_runtime": v.manifest["runtime"],
                                 "golden_max_abs": m.golden_max_abs})
        assert m.golden_ok is True
