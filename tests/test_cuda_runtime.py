"""The CUDA driver loader on a machine with no GPU: argument packing, the refusal when
libcuda is missing, the refusal when a device-code compiler is visible (before libcuda is
even opened), and that loading a CUDA artifact imports neither tinygrad nor NVRTC.
What needs a GPU is in tests/test_cuda_gpu.py (marker ``gpu``)."""
from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.model import cuda_runtime as R
from supervisor.model import load_verified
from supervisor.model.errors import CompilerVisible, DeviceUnavailable

ROOT = Path(__file__).resolve().parents[1]
CUDA_DEMO = ROOT / "models" / "demo" / "lane-offset-cuda"
DEMO_PUB = ROOT / "models" / "demo" / "demo_ed25519.pub"


def test_kernel_arguments_are_packed_as_cuLaunchKernel_takes_them():
    raw = R.pack_args([0x7F00_0000_1000, 0x7F00_0000_2000], [3, -1])
    assert len(raw) == 2 * 8 + 2 * 4
    assert struct.unpack("<QQii", raw) == (0x7F00_0000_1000, 0x7F00_0000_2000, 3, -1)
    buf = ctypes.create_string_buffer(raw, len(raw))
    extra, size = R.launch_extra(buf)
    assert extra[0] == R.CU_LAUNCH_PARAM_BUFFER_POINTER and extra[1] == ctypes.addressof(buf)
    assert extra[2] == R.CU_LAUNCH_PARAM_BUFFER_SIZE and extra[3] == ctypes.addressof(size)
    assert size.value == 24 and extra[4] is None            # CU_LAUNCH_PARAM_END (NULL)


def test_missing_libcuda_is_one_line():
    with pytest.raises(DeviceUnavailable) as ei:
        R.Driver("libcuda-not-here.so.1")
    assert "\n" not in str(ei.value) and "cannot be loaded" in str(ei.value)


@pytest.fixture
def verified():
    with load_verified(CUDA_DEMO, DEMO_PUB) as v:
        yield v


def test_a_cuda_artifact_without_libcuda_is_refused_in_one_line(verified):
    with pytest.raises(DeviceUnavailable) as ei:
        R.CudaModel(verified, refuse_compilers=False, libcuda="libcuda-not-here.so.1")
    assert "\n" not in str(ei.value)


def _plant(d: Path, names: list[str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"\x7fELF fake")


def test_a_visible_nvrtc_is_refused_before_libcuda_is_opened(verified, tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    _plant(lib, ["libnvrtc.so.12", "libnvJitLink.so.12"])
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    seen = R.visible_compilers()
    assert str(lib / "libnvrtc.so.12") in seen and str(lib / "libnvJitLink.so.12") in seen
    with pytest.raises(CompilerVisible) as ei:
        # libcuda is missing too: the compiler check comes first
        R.CudaModel(verified, refuse_compilers=True, libcuda="libcuda-not-here.so.1")
    assert "\n" not in str(ei.value) and "libnvrtc.so.12" in str(ei.value)
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert str(lib / "libnvrtc.so.12") not in R.visible_compilers()


def test_pip_nvrtc_wheel_dirs_and_tools_on_path_are_seen(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    _plant(site / "nvidia" / "cuda_nvrtc" / "lib", ["libnvrtc.so.12"])
    bin_ = tmp_path / "bin"
    _plant(bin_, ["ptxas"])
    os.chmod(bin_ / "ptxas", 0o755)
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    seen = R.visible_compilers()
    assert str(site / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12") in seen
    assert str(bin_ / "ptxas") in seen


_NO_TINYGRAD = textwrap.dedent("""
    import json, sys
    from supervisor.model import load_verified, runtime
    from supervisor.model.errors import DeviceUnavailable
    from workers.modeld.engine import Engine, ENGINE_ABIS
    v = load_verified(sys.argv[1], sys.argv[2], expect_abi=ENGINE_ABIS)
    rep = {"refused": None}
    try:
        rep["golden_ok"] = Engine(v, exclusive=False).model.golden_ok
    except DeviceUnavailable as e:
        rep["refused"] = str(e)
    rep["tinygrad"] = "tinygrad" in sys.modules
    rep["nvrtc"] = sorted(m for m in sys.modules if "nvrtc" in m)
    print(json.dumps(rep))
""")


def test_modelds_engine_loads_a_cuda_artifact_without_tinygrad(tmp_path):
    """modeld's Engine on a CUDA artifact goes to the driver loader: no tinygrad, no
    NVRTC module imported (here it stops at the missing libcuda, in one line)."""
    r = subprocess.run([sys.executable, "-c", _NO_TINYGRAD, str(CUDA_DEMO), str(DEMO_PUB)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["tinygrad"] is False and rep["nvrtc"] == [], rep
    try:
        ctypes.CDLL(R.LIBCUDA)
    except OSError:        # no driver here: one line, at the driver
        assert rep["refused"].startswith("libcuda.so.1: cannot be loaded"), rep
    else:                  # a GPU machine: loaded, golden passed
        assert rep["refused"] is None and rep["golden_ok"] is True, rep
