"""Run a verified CUDA artifact through the CUDA driver API alone (ctypes on libcuda).

No tinygrad, no NVRTC, no PTX: the artifact's cubins go to ``cuModuleLoadData`` as they
were signed, kernels are launched with ``cuLaunchKernel`` in the launch plan's order on
one stream, and an inference is complete when an event recorded after the output's
device-to-host copy has completed (``cuEventSynchronize``), not when a host clock says
so. Every run says where it ran (device name, UUID, driver), the bytes copied each way,
the device's own time between its start and end events, and fallbacks (0: there is no
other path to fall back to).

Before a byte of code reaches the driver, a control process (``refuse_compilers``)
checks that no device-code compiler is visible in its filesystem (`visible_compilers`):
the sandbox whites NVRTC, nvJitLink and the driver's PTX JIT out of control; seeing one
means the sandbox is not the one it should be, and the model is refused in one line.
"""
from __future__ import annotations

import ctypes
import glob
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import cuda as C
from .artifact import VerifiedArtifact
from .errors import (AbiMismatch, CompilerVisible, DeviceUnavailable,
                     GoldenMismatch)
from .runtime import RunStats

LIBCUDA = "libcuda.so.1"
CU_STREAM_NON_BLOCKING = 0x1
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
# cuLaunchKernel's ``extra``: a packed argument buffer and its size.
CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2

# Device-code compilers: none may be visible to a control process running device code.
# libnvidia-ptxjitcompiler is the driver's own PTX JIT: cubin never needs it.
COMPILER_LIBS = ("libnvrtc.so*", "libnvrtc-builtins*.so*", "libnvJitLink.so*",
                 "libnvptxcompiler*", "libnvidia-ptxjitcompiler.so*")
COMPILER_TOOLS = ("nvcc", "ptxas", "cicc", "nvlink", "fatbinary")
_SITE_COMPILER_DIRS = ("nvidia/cuda_nvrtc", "nvidia/nvjitlink", "nvidia/cuda_nvcc")


# ------------------------------------------------------------------ what may not be seen

def library_dirs() -> list[str]:
    """Where the dynamic loader and pip-installed CUDA wheels would find a library."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib",
             "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
             *glob.glob("/usr/local/cuda*/lib64"), *glob.glob("/usr/local/cuda*/targets/*/lib"),
             *glob.glob("/usr/local/cuda*/nvvm/lib64")]
    for sp in {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}:
        dirs += [os.path.join(sp, d, "lib") for d in _SITE_COMPILER_DIRS]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def visible_compilers(dirs: list[str] | None = None) -> list[str]:
    """Device-code compilers this process could open or run: libraries in the loader's
    and the CUDA wheels' directories, tools on PATH. A whiteout (the sandbox's) is not
    a file, so what the sandbox hides is not listed."""
    found: list[str] = []
    for d in library_dirs() if dirs is None else dirs:
        for pat in COMPILER_LIBS:
            found += [p for p in glob.glob(os.path.join(d, pat)) if os.path.isfile(p)]
    for d in os.environ.get("PATH", "").split(":") if dirs is None else []:
        for t in COMPILER_TOOLS:
            p = os.path.join(d, t)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                found.append(p)
    return sorted(set(found))


# ------------------------------------------------------------------ the driver

class CudaError(DeviceUnavailable):
    """A driver call failed (its name and the driver's error name)."""


class Driver:
    """libcuda through ctypes: only the calls this loader needs, each checked."""

    def __init__(self, path: str = LIBCUDA) -> None:
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise DeviceUnavailable(f"{path}: cannot be loaded ({e}); a CUDA artifact needs "
                                    f"the NVIDIA driver and its device nodes") from None
        self.path = path

    def __call__(self, fn: str, *args: Any) -> None:
        status = getattr(self.lib, fn)(*args)
        if status != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(status, ctypes.byref(name))
            raise CudaError(f"{fn}: {(name.value or b'?').decode()} ({status})")


def pack_args(pointers: list[int], vals: list[int]) -> bytes:
    """The kernel's parameter buffer as cuLaunchKernel's ``extra`` takes it: 64-bit device
    pointers in parameter order, then int32 values (tinygrad's CUDA kernels take buffers
    first, then variables)."""
    return struct.pack(f"<{len(pointers)}Q{len(vals)}i", *pointers, *vals)


def launch_extra(buf: ctypes.Array) -> tuple[ctypes.Array, ctypes.c_size_t]:
    """``extra`` for cuLaunchKernel pointing at ``buf`` (keep both alive while in use)."""
    size = ctypes.c_size_t(ctypes.sizeof(buf))
    extra = (ctypes.c_void_p * 5)(CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf),
                                  CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size),
                                  CU_LAUNCH_PARAM_END)
    return extra, size


def kernel_driver_version() -> str | None:
    """The NVIDIA kernel module's version (e.g. 580.65.06), from /proc; None if unread."""
    try:
        with open("/proc/driver/nvidia/version", encoding="ascii", errors="replace") as f:
            head = f.readline()
    except OSError:
        return None
    for tok in head.split():
        if tok.count(".") >= 1 and tok.replace(".", "").isdigit():
            return tok
    return None


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    uuid: str
    arch: str
    driver: str | None          # the kernel module's version
    cuda_api: int               # cuDriverGetVersion, e.g. 13000

    def label(self) -> str:
        """Where a run happened, as the receipt's device: ordinal, name, UUID, driver."""
        return (f"CUDA:{self.ordinal} {self.name} {self.uuid} "
                f"driver {self.driver or 'unknown'}")


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def probe_device(drv: Driver, ordinal: int = 0) -> tuple[DeviceInfo, ctypes.c_int]:
    drv("cuInit", 0)
    dev = ctypes.c_int()
    drv("cuDeviceGet", ctypes.byref(dev), ordinal)
    name = ctypes.create_string_buffer(256)
    drv("cuDeviceGetName", name, 256, dev)
    raw = ctypes.create_string_buffer(16)
    try:
        drv("cuDeviceGetUuid_v2", raw, dev)
    except AttributeError:
        drv("cuDeviceGetUuid", raw, dev)
    major, minor, api = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    drv("cuDeviceGetAttribute", ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    drv("cuDeviceGetAttribute", ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    drv("cuDriverGetVersion", ctypes.byref(api))
    return DeviceInfo(ordinal, name.value.decode(errors="replace"), _uuid(raw.raw),
                      f"sm_{major.value}{minor.value}", kernel_driver_version(), api.value), dev


# ------------------------------------------------------------------ the loaded model

class CudaModel:
    """A verified CUDA artifact loaded on GPU ``ordinal``; same interface as the CPU
    runner (`runtime.LoadedModel`): input_view/run_staged/run, golden_ok, runtime_info.
    Not thread-safe (one caller)."""

    def __init__(self, verified: VerifiedArtifact, *, ordinal: int = 0,
                 refuse_compilers: bool = True, libcuda: str = LIBCUDA) -> None:
        if verified.cuda is None:
            raise AbiMismatch("not a CUDA artifact")
        if refuse_compilers:
            seen = visible_compilers()
            if seen:
                raise CompilerVisible(f"device-code compilers are visible to this control "
                                      f"process ({', '.join(seen[:3])}"
                                      f"{', ...' if len(seen) > 3 else ''}): cubin is loaded "
                                      f"through the driver alone; the sandbox must hide them")
        self.verified = verified
        p = verified.cuda
        self.drv = drv = Driver(libcuda)
        self.device, dev = probe_device(drv, ordinal)
        # the GPU decides which cubins: its architecture and driver against the manifest
        C.check_runtime(verified.manifest, device_arch=self.device.arch,
                        driver_version=self.device.driver)
        if self.device.driver is None and self.device.cuda_api // 1000 < int(
                verified.manifest["runtime"]["toolkit"]["version"].split(".")[0]):
            raise DeviceUnavailable(f"the driver speaks CUDA {self.device.cuda_api}, the "
                                    f"artifact's code is from CUDA "
                                    f"{verified.manifest['runtime']['toolkit']['version']}")
        self.arch = C.pick_arch(list(p.architectures), self.device.arch)
        self.ctx = ctypes.c_void_p()
        drv("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        drv("cuCtxSetCurrent", self.ctx)
        self._dev = dev
        self._modules: list[ctypes.c_void_p] = []
        self._funcs: dict[str, ctypes.c_void_p] = {}
        for name, obj in sorted(p.cubins(self.arch).items()):
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            drv("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(obj))
            self._modules.append(mod)
            drv("cuModuleGetFunction", ctypes.byref(fn), mod, name.encode())
            self._funcs[name] = fn
        self._dptr: list[int] = []
        for b in p.plan["buffers"]:
            d = ctypes.c_uint64()
            drv("cuMemAlloc_v2", ctypes.byref(d), ctypes.c_size_t(b["nbytes"]))
            self._dptr.append(d.value)
            if b["role"] == "weight":
                w = p.weights[b["offset"]:b["offset"] + b["nbytes"]]
                drv("cuMemcpyHtoD_v2", ctypes.c_uint64(d.value), ctypes.c_char_p(w),
                    ctypes.c_size_t(b["nbytes"]))
        # Pinned host staging: frames are copied straight in (input_view), the output
        # lands here before it is copied to the caller's array.
        ins = sorted((b for b in p.plan["buffers"] if b["role"] == "input"),
                     key=lambda b: b["input"])
        outb = next(b for b in p.plan["buffers"] if b["role"] == "output")
        self._in = [(b["id"], self._host_alloc(b["nbytes"]), b["nbytes"]) for b in ins]
        self._out_id, self._out_n = outb["id"], outb["nbytes"]
        self._out_host = self._host_alloc(self._out_n)
        oa = verified.output_abi
        self._out = np.empty(oa["shape"], dtype=oa["dtype"])
        self._calls = []
        for c in p.plan["calls"]:
            raw = pack_args([self._dptr[a] for a in c["args"]], c.get("vals", []))
            buf = ctypes.create_string_buffer(raw, len(raw))
            extra, size = launch_extra(buf)
            self._calls.append((self._funcs[c["kernel"]], tuple(c["grid"]), tuple(c["block"]),
                                extra, (buf, size)))
        self.stream = ctypes.c_void_p()
        drv("cuStreamCreate", ctypes.byref(self.stream), CU_STREAM_NON_BLOCKING)
        self.ev_start, self.ev_done = ctypes.c_void_p(), ctypes.c_void_p()
        drv("cuEventCreate", ctypes.byref(self.ev_start), 0)
        drv("cuEventCreate", ctypes.byref(self.ev_done), 0)
        self.kernels_in_program = len(self._calls)
        # The receipt's device: where it ran, not a label the artifact gave itself.
        self._label = self.device.label()[:160]
        self.runtime_info = {
            "device": f"CUDA:{ordinal}", "device_class": "cuda-driver",
            "program_class": "cuModuleLoadData(cubin)", "renderer": "CUDA (build side)",
            "compiler": "none: cubin from the signed artifact", "target": verified.target,
            "arch": self.arch, "name": self.device.name, "uuid": self.device.uuid,
            "driver": self.device.driver or "unknown", "cuda_api": self.device.cuda_api,
            "libcuda": drv.path, "fallbacks": 0,
        }
        self.golden_ok: bool | None = None
        self.golden_max_abs: float | None = None
        if verified.golden is not None:
            self._check_golden()

    def _host_alloc(self, n: int) -> np.ndarray:
        p = ctypes.c_void_p()
        self.drv("cuMemHostAlloc", ctypes.byref(p), ctypes.c_size_t(n), 0)
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p.value))

    def golden_inputs(self) -> list[np.ndarray]:
        gin = self.verified.golden[0]
        out, at = [], 0
        for ia in self.verified.input_abis:
            t = ia["tensor"]
            n = int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize
            out.append(np.frombuffer(gin[at:at + n], dtype=t["dtype"]).reshape(t["shape"]))
            at += n
        if at != len(gin):
            raise AbiMismatch(f"golden.bin: {len(gin)} input bytes, the inputs take {at}")
        return out

    def _check_golden(self) -> None:
        tol = float(self.verified.manifest["golden"].get("tolerance", {}).get("max_abs", 0.0))
        want = np.frombuffer(self.verified.golden[1], dtype=self._out.dtype).reshape(self._out.shape)
        got, _ = self.run(self.golden_inputs())
        diff = float(np.abs(got.astype(np.float64) - want).max())
        self.golden_max_abs = diff
        if not np.isfinite(got).all() or diff > tol:
            raise GoldenMismatch(f"golden.bin: output {got.tolist()} differs from the signed "
                                 f"golden output {want.tolist()} by {diff:g} > {tol:g} on "
                                 f"{self.device.label()}")
        self.golden_ok = True

    def input_view(self, index: int = 0) -> np.ndarray:
        ia = self.verified.input_abis[index]["tensor"]
        return self._in[index][1].view(ia["dtype"]).reshape(ia["shape"])

    def run(self, x: np.ndarray | list[np.ndarray], *, out: np.ndarray | None = None
            ) -> tuple[np.ndarray, RunStats]:
        xs = list(x) if isinstance(x, (list, tuple)) else [x]
        if len(xs) != len(self._in):
            raise AbiMismatch(f"{len(xs)} inputs given, the model takes {len(self._in)}")
        for k, xk in enumerate(xs):
            view = self.input_view(k)
            if xk.dtype != view.dtype or xk.shape != view.shape:
                raise AbiMismatch(f"input {k} is {xk.dtype}{list(xk.shape)}, the model takes "
                                  f"{view.dtype}{list(view.shape)}")
            np.copyto(view, xk)
        return self.run_staged(out=out)

    def run_staged(self, *, out: np.ndarray | None = None) -> tuple[np.ndarray, RunStats]:
        """Copy the staged inputs in, run every call, copy the output out; complete when
        the event recorded after that copy has completed."""
        if out is not None and (out.dtype != self._out.dtype or out.shape != self._out.shape
                                or not (out.flags.c_contiguous and out.flags.writeable)):
            raise AbiMismatch(f"out is {out.dtype}{list(out.shape)}, the model writes "
                              f"{self._out.dtype}{list(self._out.shape)} (C-contiguous, writable)")
        drv, s = self.drv, self.stream
        drv("cuCtxSetCurrent", self.ctx)
        drv("cuEventRecord", self.ev_start, s)
        bytes_in = 0
        for bid, host, n in self._in:
            drv("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(self._dptr[bid]),
                ctypes.c_void_p(host.ctypes.data), ctypes.c_size_t(n), s)
            bytes_in += n
        for fn, g, b, extra, _keep in self._calls:
            drv("cuLaunchKernel", fn, g[0], g[1], g[2], b[0], b[1], b[2], 0, s, None, extra)
        drv("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(self._out_host.ctypes.data),
            ctypes.c_uint64(self._dptr[self._out_id]), ctypes.c_size_t(self._out_n), s)
        drv("cuEventRecord", self.ev_done, s)
        drv("cuEventSynchronize", self.ev_done)
        ms = ctypes.c_float()
        drv("cuEventElapsedTime", ctypes.byref(ms), self.ev_start, self.ev_done)
        if out is None:
            out = np.empty_like(self._out)
        out.reshape(-1).view(np.uint8)[:] = self._out_host
        return out, RunStats(bytes_in, self._out_n, len(self._calls), self._label,
                             completion="hostVisible", device_ms=float(ms.value), fallbacks=0)

