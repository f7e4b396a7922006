"""Run a CUDA launch plan on the CPU, to check the plan before it is signed (build side).

No GPU is needed to build a CUDA artifact, and none checks it there; the riskiest part is
then the conversion of tinygrad's capture into a launch plan (which buffer is which, the
argument order, grid and block, the weights read back from the NULL device). This runs
the plan as written, with the CUDA C sources compiled by clang++ as C++ (a small prelude
maps blockIdx/threadIdx/__syncthreads/__shared__/float4 onto plain C++), blocks one after
another, a block's threads as OS threads meeting at a std::barrier where the kernel has
__syncthreads (sequentially where it has none). Its output on the golden input must be
the CPU build's within the artifact's tolerance. It says nothing about NVRTC's code or
the driver: the gpu suite does.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>
struct uint3 { unsigned x, y, z; };
static thread_local uint3 threadIdx;
static uint3 blockIdx, blockDim, gridDim;
static std::barrier<>* tg_bar = nullptr;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n)
#define __syncthreads() tg_bar->arrive_and_wait()
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
#define TG_VEC(T, N) \
  struct N##2 { T x, y; }; struct N##4 { T x, y, z, w; }; \
  static inline N##2 make_##N##2(T x, T y) { return {x, y}; } \
  static inline N##4 make_##N##4(T x, T y, T z, T w) { return {x, y, z, w}; }
TG_VEC(float, float) TG_VEC(double, double) TG_VEC(int, int) TG_VEC(unsigned, uint)
TG_VEC(unsigned char, uchar) TG_VEC(signed char, char) TG_VEC(short, short)
template <class A, class B> static inline auto max(A a, B b) { return a > b ? a : b; }
template <class A, class B> static inline auto min(A a, B b) { return a < b ? a : b; }
using std::exp2; using std::log2; using std::sqrt; using std::sin; using std::trunc;
template <class... T, size_t... I>
static void tg_call(void (*f)(T...), void** a, std::index_sequence<I...>) { f(((T)a[I])...); }
"""

RUNNER = r"""
extern "C" void trio_run_%(name)s(unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                  unsigned by, unsigned bz, void** a) {
  gridDim = {gx, gy, gz}; blockDim = {bx, by, bz};
  for (unsigned z = 0; z < gz; z++) for (unsigned y = 0; y < gy; y++) for (unsigned x = 0; x < gx; x++) {
    blockIdx = {x, y, z};
    if (%(threaded)d) {
      std::barrier<> bar(bx * by * bz); tg_bar = &bar;
      std::vector<std::thread> ts;
      for (unsigned k = 0; k < bz; k++) for (unsigned j = 0; j < by; j++) for (unsigned i = 0; i < bx; i++)
        ts.emplace_back([=] { threadIdx = {i, j, k};
          tg_call(%(name)s, a, std::make_index_sequence<%(nargs)d>{}); });
      for (auto& t : ts) t.join();
    } else {
      for (unsigned k = 0; k < bz; k++) for (unsigned j = 0; j < by; j++) for (unsigned i = 0; i < bx; i++) {
        threadIdx = {i, j, k};
        tg_call(%(name)s, a, std::make_index_sequence<%(nargs)d>{});
      }
    }
  }
}
"""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "clang++")) or shutil.which("clang++")


def _nargs(src: str, name: str) -> int:
    m = re.search(rf"\b{re.escape(name)}\(([^)]*)\)", src)
    if m is None:
        raise ValueError(f"kernel {name}: no parameter list in its source")
    return len([p for p in m.group(1).split(",") if p.strip()])


def build_library(sources: dict[str, str], workdir: Path) -> ctypes.CDLL:
    """One shared library with ``trio_run_<name>`` for every kernel."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("clang++ is needed to emulate the launch plan")
    parts = [PRELUDE]
    for name, src in sorted(sources.items()):
        # each source repeats tinygrad's header lines (typedef, tg_bitcast): one namespace each
        body = src.replace("typedef unsigned int uint;", "")
        parts.append(f"namespace k_{name} {{\ntypedef unsigned int uint;\n{body}\n}}\n"
                     f"using k_{name}::{name};\n")
        parts.append(RUNNER % {"name": name, "nargs": _nargs(src, name),
                               "threaded": int("__syncthreads" in src)})
    cpp, so = workdir / "plan.cpp", workdir / "plan.so"
    cpp.write_text("\n".join(parts))
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-pthread",
                        "-ffp-contract=off", "-o", str(so), str(cpp)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"clang++ failed on the launch plan's sources: {r.stderr[-2000:]}")
    return ctypes.CDLL(str(so))


def run_plan(plan: dict, weights: bytes, sources: dict[str, str],
             inputs: list[np.ndarray]) -> np.ndarray:
    """The plan's output bytes (uint8) for ``inputs`` (in plan input order)."""
    with tempfile.TemporaryDirectory(prefix="cuda-emulate-") as d:
        lib = build_library(sources, Path(d))
        mem: list[np.ndarray] = []
        out_id = None
        for b in plan["buffers"]:
            a = np.zeros(b["nbytes"] + 64, np.uint8)[:b["nbytes"]]   # room for float4 reads
            if b["role"] == "weight":
                a[:] = np.frombuffer(weights, np.uint8, b["nbytes"], b["offset"])
            elif b["role"] == "input":
                a[:] = np.ascontiguousarray(inputs[b["input"]]).view(np.uint8).reshape(-1)
            elif b["role"] == "output":
                out_id = b["id"]
            mem.append(a)
        for c in plan["calls"]:
            argv = (ctypes.c_void_p * len(c["args"]))(*[mem[i].ctypes.data for i in c["args"]])
            getattr(lib, f"trio_run_{c['kernel']}")(*[ctypes.c_uint(v) for v in c["grid"]],
                                                    *[ctypes.c_uint(v) for v in c["block"]],
                                                    argv)
        return mem[out_id].copy()
