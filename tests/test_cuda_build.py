"""The CUDA build on a machine with no GPU: tinygrad's CUDA renderer on the NULL device,
NVRTC to cubin, the capture turned into a launch plan, and the plan run on the CPU
(cuda_emulate) against numpy. Needs NVRTC (extra cuda-build, or NVRTC_PATH) and clang++;
skipped with the reason without them. The full demo build is docs/gpu.md's command."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_WHEEL = "/opt/nvrtc-build/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"   # where this machine has it


def _nvrtc() -> str | None:
    from workers.modelbuild.cuda import find_nvrtc

    return find_nvrtc() or (_WHEEL if os.path.isfile(_WHEEL) else None)


_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    os.environ.update(DEV="CPU;NULL:CUDA:sm_90", PARALLEL="0", CACHEDB=sys.argv[1])
    from workers.modelbuild import cuda as CU, cuda_emulate as EM
    from supervisor.model import cuda as C
    from tinygrad import Tensor
    CU.keep_null_bytes()
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    tw, tb = Tensor(w, device="NULL").realize(), Tensor(b, device="NULL").realize()
    x = rng.integers(0, 255, (16, 64), dtype=np.uint8)
    tx = Tensor(x, device="NULL").realize()
    # preprocessing-like cast and scale, a matmul, a long reduction (shared memory)
    f = lambda y: (((y.float() - 128) / 64) @ tw + tb).relu().sum(axis=0).contiguous().realize()
    cc = CU.capture(f, [tx], 8 * 4)
    CU.compile_all(cc, ["sm_90", "sm_86"])
    got = EM.run_plan(cc.plan, cc.weights, cc.sources, [x]).view(np.float32)
    want = np.maximum(((x.astype(np.float32) - 128) / 64) @ w + b, 0).sum(axis=0)
    weights = [bb for bb in cc.plan["buffers"] if bb["role"] == "weight"]
    blobs = sorted(cc.weights[bb["offset"]:bb["offset"] + bb["nbytes"]] for bb in weights)
    # every call's buffers are the sizes the kernel's parameters span
    fits = all(cc.plan["buffers"][a]["nbytes"] == p["nbytes"]
               for c in cc.plan["calls"]
               for a, p in zip(c["args"], CU.kernel_params(cc.sources[c["kernel"]], c["kernel"])))
    # each kernel's launch size is recorded, is every call's, and the verifier's check of
    # the plan passes with exactly those sizes (and refuses the plan once one call differs)
    specs = {n: C.KernelSpec(CU.kernel_params(s, n), cc.launch[n]["grid"], cc.launch[n]["block"])
             for n, s in cc.sources.items()}
    sized = all(cc.launch[c["kernel"]] == {"grid": c["grid"], "block": c["block"]}
                for c in cc.plan["calls"])
    C._check_plan(cc.plan, len(cc.weights), specs)
    bad = json.loads(json.dumps(cc.plan))
    bad["calls"][0]["grid"] = [bad["calls"][0]["grid"][0] + 1, *bad["calls"][0]["grid"][1:]]
    try:
        C._check_plan(bad, len(cc.weights), specs)
        grown = "verified"
    except Exception as e:
        grown = str(e)
    print(json.dumps({
        "sized": sized, "grown": grown,
        "fits": fits,
        "max_abs": float(np.abs(got - want).max()),
        "roles": sorted(bb["role"] for bb in cc.plan["buffers"]),
        "weights_are_ours": blobs == sorted([w.tobytes(), b.tobytes()]),
        "arches": {a: sorted({C.cubin_arch(o) for o in objs.values()}) for a, objs in cc.objects.items()},
        "calls": len(cc.plan["calls"]),
        "shared": any("__syncthreads" in s for s in cc.sources.values()),
    }))
""")


def test_capture_compile_and_emulate_a_small_function(tmp_path):
    nvrtc = _nvrtc()
    if nvrtc is None or shutil.which("clang++") is None:
        pytest.skip(f"needs NVRTC ({nvrtc}: pip install -e '.[cuda-build]') and clang++")
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "CACHEDB")}
    env.update(NVRTC_PATH=nvrtc, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "cache.db")],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["max_abs"] < 1e-3 and rep["fits"], rep
    assert rep["sized"] and "it was built for grid" in rep["grown"], rep
    assert rep["weights_are_ours"], rep           # read back from NULL, as given
    assert rep["roles"].count("input") == 1 and rep["roles"].count("output") == 1, rep
    assert rep["arches"] == {"sm_90": ["sm_90"], "sm_86": ["sm_86"]}, rep


def test_arch_list_is_checked():
    from workers.modelbuild.cuda import parse_archs

    assert parse_archs("sm_90, sm_89") == ["sm_90", "sm_89"]
    for bad in ("compute_90", "sm_90,sm_90", "", "sm_90a"):
        with pytest.raises(SystemExit, match="--arch"):
            parse_archs(bad)
