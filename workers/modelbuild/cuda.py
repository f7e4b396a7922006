"""The CUDA half of a build: the deployed function rendered by tinygrad's CUDA renderer,
compiled to cubin by NVRTC for named architectures, on a machine with no GPU.

    python -m workers.modelbuild --device cuda --arch sm_90,sm_89 --out DIR ...

How it works without a GPU (tinygrad 0.14): ``Device["CUDA"]`` opens libcuda and needs a
GPU, so the capture runs on tinygrad's NULL device with the CUDA renderer
(``DEV="CPU:...;NULL:CUDA:sm_90"``). There tinygrad renders CUDA C and compiles it with
``NVRTCCompiler(arch, ptx=False)``, i.e. to cubin: its CUDA device asks NVRTC for PTX
and lets the driver finish the job, which is exactly what control must not do. NULL's
allocator keeps no bytes, so for the build only it is given one that does (weights are
read back from it). The capture runs with ``JIT=2`` (no graph runner: plain kernel
calls) and ``NO_MEMORY_PLANNER=1`` (one buffer per intermediate, no views into an
arena), then becomes a launch plan: buffers (input, output, weight, scratch) and each
call's function, grid, block and buffer arguments, in order; each kernel's own launch size
(tinygrad's global/local size) goes into the signed manifest, and verification refuses a
call launched otherwise (the kernels have no bounds checks). Each further architecture
compiles the same CUDA source (TC=0: no tensor cores, so the source does not depend on
the architecture).

NVRTC comes from the pip wheel ``nvidia-cuda-nvrtc-cu12`` (extra ``cuda-build``), found
as ``NVRTC_PATH`` or the installed ``nvidia.cuda_nvrtc`` package; never in control.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from supervisor.model import cuda as C

# Knobs of the CUDA capture (ContextVars, set around it only: the CPU build is unchanged).
CAPTURE_CONTEXT = {"JIT": 2, "NO_MEMORY_PLANNER": 1, "TC": 0}


def find_nvrtc() -> str | None:
    """libnvrtc for the build: NVRTC_PATH, else the nvidia-cuda-nvrtc wheel's."""
    p = os.environ.get("NVRTC_PATH")
    if p:
        return p if os.path.isfile(p) else None
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc") if importlib.util.find_spec(
        "nvidia") else None
    for d in (spec.submodule_search_locations or []) if spec else []:
        libs = sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so.*[0-9]")))
        libs = [x for x in libs if "builtins" not in x and ".alt." not in x]
        if libs:
            return libs[0]
    return None


def nvrtc_version(path: str) -> str:
    lib = ctypes.CDLL(path)
    a, b = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b)) != 0:
        raise SystemExit(f"modelbuild: nvrtcVersion failed in {path}")
    return f"{a.value}.{b.value}"


def parse_archs(text: str) -> list[str]:
    archs = [a.strip() for a in text.split(",") if a.strip()]
    for a in archs:
        try:
            C.parse_arch(a)
        except ValueError as e:
            raise SystemExit(f"modelbuild: --arch: {e}") from None
    if not archs or len(set(archs)) != len(archs):
        raise SystemExit("modelbuild: --arch needs distinct architectures, e.g. sm_90,sm_89")
    return archs


def dev_string(cpu_target: str, archs: list[str]) -> str:
    """DEV for a CUDA build: the CPU target (training, reference) and NULL with the CUDA
    renderer for the first architecture."""
    return f"{cpu_target};NULL:CUDA:{archs[0]}"


def keep_null_bytes() -> None:
    """Make tinygrad's NULL allocator hold the bytes written to it (build process only):
    the weights are read back from the captured buffers."""
    from tinygrad.runtime import ops_null

    A = ops_null.NullAllocator
    if getattr(A, "_trio_keeps_bytes", False):
        return

    def _copyin(self: Any, dest: bytearray, src: memoryview) -> None:
        dest[:src.nbytes] = src.cast("B")

    def _copyout(self: Any, dest: memoryview, src: bytearray) -> None:
        dest.cast("B")[:] = src[:dest.nbytes]

    A._alloc = lambda self, size, options: bytearray(size)
    A._copyin, A._copyout = _copyin, _copyout
    A._trio_keeps_bytes = True


@dataclass
class CudaCapture:
    """The launch plan of a captured function and what its kernels are."""
    plan: dict
    weights: bytes
    sources: dict[str, str] = field(default_factory=dict)       # kernel name -> CUDA C
    objects: dict[str, dict[str, bytes]] = field(default_factory=dict)  # arch -> name -> cubin
    # kernel name -> {"grid": [x,y,z], "block": [x,y,z]}: tinygrad's Program.global_size and
    # local_size, the launch the kernel was rendered for. Its indexing has no bounds checks
    # (it writes data0[f(blockIdx, threadIdx)]), so any other launch reads or writes past a
    # buffer; the manifest signs these and verification refuses a call that differs.
    launch: dict[str, dict[str, list[int]]] = field(default_factory=dict)


def capture(fn, inputs: list, out_nbytes: int) -> CudaCapture:
    """Capture ``fn(*inputs)`` (tinygrad Tensors on NULL) with TinyJit and turn it into a
    launch plan; the first architecture's cubins come with it."""
    from tinygrad import TinyJit
    from tinygrad.helpers import Context
    from tinygrad.uop.ops import Ops

    with Context(**CAPTURE_CONTEXT):
        jit = TinyJit(fn)
        for _ in range(3):
            jit(*inputs)
    cap = jit.captured
    if cap is None:
        raise SystemExit("modelbuild: the CUDA capture captured nothing")
    out_buf = cap.ret.uop.buffer
    ids: dict[Any, int] = {}
    buffers: list[dict] = []
    blobs: list[bytes] = []
    woff = 0
    written: set[int] = set()
    calls: list[dict] = []
    cap_sources: dict[str, str] = {}
    cubins: dict[str, bytes] = {}
    launch: dict[str, dict[str, list[int]]] = {}

    def buf_id(u: Any, writes: bool) -> int:
        nonlocal woff
        if u.op is Ops.PARAM:
            k = int(u.arg.slot)        # the JIT's k-th input
            if not 0 <= k < len(inputs):
                raise SystemExit(f"modelbuild: a kernel reads JIT input {k} of {len(inputs)}")
            if ("in", k) not in ids:
                ids[("in", k)] = len(buffers)
                buffers.append({"id": len(buffers), "role": "input", "input": k,
                                "nbytes": int(inputs[k].nbytes())})
            return ids[("in", k)]
        if u.op is not Ops.BUFFER:
            raise SystemExit(f"modelbuild: a kernel argument is {u.op}, not a buffer "
                             f"(memory planner or views in the capture?)")
        b = u.buffer
        if id(b) not in ids:
            ids[id(b)] = len(buffers)
            ent = {"id": len(buffers), "nbytes": int(b.nbytes)}
            if b is out_buf:
                ent["role"] = "output"
            elif writes:
                ent["role"] = "scratch"
            else:
                # read before any kernel wrote it: a weight, its bytes ship in weights.bin
                data = bytes(b._buf) if b.is_allocated() else None
                if data is None or len(data) < b.nbytes:
                    raise SystemExit(f"modelbuild: weight buffer of {b.nbytes} bytes has no "
                                     f"contents on NULL")
                woff = -(-woff // 256) * 256
                ent.update(role="weight", offset=woff)
                blobs.append(b"\0" * (woff - sum(map(len, blobs))) + data[:b.nbytes])
                woff += b.nbytes
            buffers.append(ent)
        return ids[id(b)]

    for call in cap._linear.src:
        p = call.src[0]
        if call.op is not Ops.CALL or p.op is not Ops.PROGRAM:
            raise SystemExit(f"modelbuild: the CUDA capture holds a {p.op} call, only kernels "
                             f"are supported (JIT=2 should leave no graph runner)")
        info = p.arg
        if info.vars or info.runtimevars or info.local_size is None:
            raise SystemExit(f"modelbuild: kernel {info.function_name} has runtime variables "
                             f"or no fixed block size")
        src, lib = p.src[2].arg, p.src[3].arg
        params = list(call.src[1:])
        args = []
        for gi in info.globals:
            args.append(buf_id(params[gi], gi in info.outs and gi not in info.ins))
        for gi in info.outs:
            written.add(buf_id(params[gi], True))
        name = info.function_name
        if cap_sources.get(name, src) != src:
            raise SystemExit(f"modelbuild: two kernels named {name} differ")
        cap_sources[name] = src
        cubins[name] = lib
        size = {"grid": [int(x) for x in info.global_size],
                "block": [int(x) for x in info.local_size]}
        if launch.setdefault(name, size) != size:
            raise SystemExit(f"modelbuild: kernel {name} is called with grid/block {size} and "
                             f"{launch[name]}: one kernel, one launch size")
        calls.append({"kernel": name, **size, "args": args, "vals": []})
    outs = [b for b in buffers if b["role"] == "output"]
    if len(outs) != 1 or outs[0]["nbytes"] != out_nbytes:
        raise SystemExit(f"modelbuild: the CUDA capture's output is {outs}, expected one of "
                         f"{out_nbytes} bytes")
    plan = {"format": "trio-cuda-launch/1", "buffers": buffers, "calls": calls,
            "meaning": "calls run in order on one stream; args are buffer ids (64-bit "
                       "device pointers, in kernel parameter order); grid/block as "
                       "cuLaunchKernel takes them"}
    return CudaCapture(plan, b"".join(blobs), cap_sources, {}, launch)


# Element sizes of the C types tinygrad's CUDA renderer gives buffer parameters.
_CTYPE_BYTES = {"float": 4, "double": 8, "int": 4, "unsigned int": 4, "uint": 4,
                "unsigned char": 1, "signed char": 1, "char": 1, "bool": 1, "half": 2,
                "nv_bfloat16": 2, "short": 2, "unsigned short": 2, "long": 8,
                "unsigned long": 8, "long long": 8, "unsigned long long": 8}
_PARAM_RE = re.compile(r"^(?:const\s+)?([A-Za-z_][A-Za-z0-9_ ]*?)\s*\*\s*(?:__restrict__\s*)?"
                       r"data\d+_(\d+)$")


def kernel_params(src: str, name: str) -> list[dict]:
    """The kernel's parameters from its CUDA source: each a buffer (tinygrad names them
    data<i>_<elements>) with its element type and the bytes it spans. The manifest lists
    them; verification checks every call's buffers are at least that large."""
    m = re.search(rf"\b{re.escape(name)}\(([^)]*)\)", src)
    if m is None:
        raise SystemExit(f"modelbuild: kernel {name}: no parameter list in its source")
    out = []
    for p in (x.strip() for x in m.group(1).split(",") if x.strip()):
        pm = _PARAM_RE.match(p)
        if pm is None or pm.group(1).strip() not in _CTYPE_BYTES:
            raise SystemExit(f"modelbuild: kernel {name}: parameter {p!r} is not a buffer of "
                             f"a known type (runtime values are not supported)")
        n, t = int(pm.group(2)), pm.group(1).strip()
        out.append({"ctype": t, "elements": n, "nbytes": n * _CTYPE_BYTES[t]})
    return out


def compile_all(cc: CudaCapture, archs: list[str]) -> None:
    """Every kernel's CUDA source to cubin for every architecture (NVRTC, never PTX)."""
    from tinygrad.runtime.support.compiler_cuda import NVRTCCompiler

    for a in archs:
        comp = NVRTCCompiler(a, ptx=False, cache_key="trio-cubin")
        objs = {}
        for name, src in cc.sources.items():
            obj = comp.compile(src)
            got = C.cubin_arch(obj)
            if got != a:
                raise SystemExit(f"modelbuild: NVRTC gave a {got} cubin for {a} ({name})")
            objs[name] = obj
        cc.objects[a] = objs


def write_bundle(out: Path, cc: CudaCapture, archs: list[str], toolkit_version: str,
                 base_manifest: dict, golden: bytes, golden_sizes: tuple[int, int],
                 tolerance: float, emulated: dict | None = None) -> dict:
    """Write launch.json, weights.bin, cubin.<arch>, golden.bin; return the manifest
    (unsigned; the caller signs it)."""
    from supervisor.model import artifact as A

    (out / C.LAUNCH_FILE).write_bytes(json.dumps(cc.plan, sort_keys=True, indent=1).encode("ascii"))
    (out / C.WEIGHTS_FILE).write_bytes(cc.weights)
    (out / A.GOLDEN_FILE).write_bytes(golden)
    missing = sorted(set(cc.sources) - set(cc.launch))
    if missing:
        raise SystemExit(f"modelbuild: no launch size recorded for kernel(s) {missing}")
    kernels = [{"name": n, "source_sha256": hashlib.sha256(s.encode()).hexdigest(),
                "params": kernel_params(s, n), "objects": {},
                "grid": cc.launch[n]["grid"], "block": cc.launch[n]["block"]}
               for n, s in sorted(cc.sources.items())]
    for a in archs:
        blob = bytearray()
        for k in kernels:
            obj = cc.objects[a][k["name"]]
            blob += b"\0" * (-len(blob) % 128)
            k["objects"][a] = {"offset": len(blob), "size": len(obj),
                               "sha256": hashlib.sha256(obj).hexdigest()}
            blob += obj
        (out / (C.CUBIN_PREFIX + a)).write_bytes(bytes(blob))
    major = int(toolkit_version.split(".")[0])
    if major not in C.TOOLKIT_MIN_DRIVER:
        raise SystemExit(f"modelbuild: NVRTC {toolkit_version}: no known minimum driver for "
                         f"CUDA {major}.x")
    m = json.loads(json.dumps(base_manifest))
    m["runtime"] = {
        "framework": "tinygrad", "tinygrad_version": base_manifest["runtime"]["tinygrad_version"],
        "device": C.DEVICE, "renderer": "CUDA", "code": C.CODE, "loader": C.LOADER,
        "architectures": archs, "target": f"{C.DEVICE}:{','.join(archs)}",
        "toolkit": {"name": "nvrtc", "version": toolkit_version},
        "min_driver": C.TOOLKIT_MIN_DRIVER[major],
        "python": base_manifest["runtime"]["python"],
    }
    m["host"] = {"arch": base_manifest["host"]["arch"], "byteorder": "little", "os": "linux"}
    m["files"] = {
        C.LAUNCH_FILE: A.file_entry(out / C.LAUNCH_FILE, role="launch plan: buffers and "
                                    "kernel calls in order"),
        C.WEIGHTS_FILE: A.file_entry(out / C.WEIGHTS_FILE, role="weight buffers' bytes"),
        A.GOLDEN_FILE: A.file_entry(out / A.GOLDEN_FILE, role="power-on self-test input and "
                                    "the CPU build's output"),
        **{C.CUBIN_PREFIX + a: A.file_entry(out / (C.CUBIN_PREFIX + a),
                                            role=f"every kernel's cubin (SASS) for {a}")
           for a in archs},
    }
    m["kernels"] = kernels
    if emulated is not None:
        m["checks"] = {"launch_plan_emulated": emulated}
    gi, go = golden_sizes
    m["golden"] = {"file": A.GOLDEN_FILE, "input_bytes": gi, "output_bytes": go,
                   "tolerance": {"max_abs": tolerance,
                                 "reference": "the CPU (clang) build's output: GPU float "
                                              "arithmetic (fused multiply-add, reduction "
                                              "order) need not be bit-identical"}}
    return m


def golden_tolerance() -> float:
    return 1e-3


def emulate_check(cc: CudaCapture, inputs: list[np.ndarray], expected: np.ndarray,
                  tolerance: float) -> dict:
    """Run the launch plan as written on the CPU (`cuda_emulate`: the CUDA sources as C++)
    on ``inputs``; its output must be ``expected`` (the CPU build's) within
    ``tolerance``, else the build stops: a plan that computes something else is never
    signed."""
    from . import cuda_emulate as EM

    raw = EM.run_plan(cc.plan, cc.weights, cc.sources, inputs)
    out = raw.view(expected.dtype).reshape(expected.shape)
    diff = float(np.abs(out.astype(np.float64) - expected.astype(np.float64)).max())
    if not np.isfinite(out).all() or diff > tolerance:
        raise SystemExit(f"modelbuild: the CUDA launch plan, emulated on the CPU, gives "
                         f"{out.tolist()}, the CPU build {expected.tolist()} (max |diff| "
                         f"{diff:g} > {tolerance:g}): not signed")
    return {"max_abs": diff, "tolerance": tolerance,
            "how": "launch.json run on the CPU: the kernels' CUDA C compiled as C++ by "
                   "clang++, blocks in order, a block's threads at a barrier; checks the "
                   "plan (buffers, argument order, grid/block, weights), not NVRTC's code"}


def np_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()
