"""Run a verified artifact with tinygrad, with no compiler and no compile.

Only call this with a `VerifiedArtifact` (every byte checked). What it guarantees:

* The process's tinygrad is configured for the artifact before it is imported (in a
  dedicated worker, ``exclusive=True``): ``CACHEDB`` is the verified private copy of
  kernels.db, opened read-only and immutable (tinygrad never writes it; a write would
  fail loudly), ``DEV`` is the artifact's target, ``PARALLEL=0`` (no compile worker
  processes), no BEAM, no HCQ2.
* Compilation is replaced, not just cached: ``Compiler.compile_cached`` serves objects
  only from the verified kernels (source text must match byte for byte, for the same
  compiler and target); a miss raises `KernelNotInArtifact` naming the kernel. Every
  loaded ``Compiler.compile`` and ``Renderer.asm`` raises too, so no path reaches clang,
  an assembler or an exec. In a dedicated worker the guard is armed for the life of the
  process; in-process library use (``exclusive=False``, e.g. a test) arms it only while
  the model loads and runs, leaving other tinygrad users in the process alone.
* jit.pkl is unpickled (after verification) with an allow-list of tinygrad classes, and
  must carry no machine code: all code comes from kernels.db.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib
import io
import mmap
import os
import pickle
import re
import sqlite3
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .artifact import VerifiedArtifact
from .errors import (AbiMismatch, ArtifactError, GoldenMismatch, KernelNotInArtifact,
                     RuntimeMismatch, UnsafePickle)

# tinygrad knobs pinned for an artifact run (env before import; ContextVars after).
PINNED_ENV = {
    "PARALLEL": "0", "CCACHE": "1", "CACHELEVEL": "2", "BEAM": "0", "JITBEAM": "0",
    "JIT": "1", "DEBUG": "0", "VIZ": "0", "PROFILE": "0", "HCQ2": "0",
    "VALIDATE_WITH_CPU": "0", "CAPTURE_PROCESS_REPLAY": "0", "TRACK_MATCH_STATS": "0",
}
_CONTEXT = {"PARALLEL": 0, "BEAM": 0, "DEBUG": 0, "JIT": 1}
# "0": run the captured JIT itself per inference instead of its recorded kernel calls
# (LoadedModel._record_plan), for comparison.
ENV_DIRECT = "TRIO_MODEL_DIRECT"

_FN_RE = re.compile(r"\b(?:void|int|float|double|unsigned|long|char)\b[\s*]+([A-Za-z_]\w*)\s*\(")


def kernel_name(src: str) -> str:
    """Function name of a C kernel source (the last top-level function defined)."""
    names = _FN_RE.findall(src)
    return names[-1] if names else f"<unnamed source sha256 {hashlib.sha256(src.encode()).hexdigest()[:16]}>"


def tinygrad_imported() -> bool:
    return "tinygrad" in sys.modules


# ------------------------------------------------------------------ compile guard

class _Guard:
    """Process-wide replacement of tinygrad's compile path (installed once)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed = False
        self.permanent = False
        self.depth = 0
        self.kernels: dict[str, bytes] = {}
        self.names: dict[str, str] = {}
        self.compiler_id: tuple | None = None
        self.hits: Counter[str] = Counter()
        self.refused: list[str] = []
        self._orig_cc: Any = None
        self._patched: set[tuple[type, str]] = set()

    @property
    def active(self) -> bool:
        return self.permanent or self.depth > 0

    def _refuse_compile(self, what: str, src: str | None = None) -> None:
        name = kernel_name(src) if isinstance(src, str) else "<unknown>"
        self.refused.append(name)
        raise KernelNotInArtifact(name, f"{what} is disabled while a signed model runs")

    def _patch_subclasses(self) -> None:
        from tinygrad.device import Compiler
        from tinygrad.renderer import Renderer

        guard = self

        def walk(c: type) -> Iterator[type]:
            yield c
            for s in c.__subclasses__():
                yield from walk(s)

        for base, meth in ((Compiler, "compile"), (Renderer, "asm")):
            for cls in walk(base):
                if meth not in cls.__dict__ or (cls, meth) in self._patched:
                    continue
                orig = cls.__dict__[meth]

                def refuse(self_: Any, *a: Any, __orig=orig, __meth=meth, __cls=cls, **kw: Any) -> Any:
                    if guard.active:
                        src = a[0] if a and isinstance(a[0], str) else None
                        guard._refuse_compile(f"{__cls.__name__}.{__meth}", src)
                    return __orig(self_, *a, **kw)

                refuse.__name__ = meth
                setattr(cls, meth, refuse)
                self._patched.add((cls, meth))

    def install(self) -> None:
        with self.lock:
            from tinygrad.device import Compiler

            if not self.installed:
                self._orig_cc = Compiler.__dict__["compile_cached"]
                guard = self

                def compile_cached(self_: Any, src: str) -> bytes:
                    if guard.active:
                        return guard.serve(self_, src)
                    return guard._orig_cc(self_, src)

                Compiler.compile_cached = compile_cached  # type: ignore[method-assign]
                self.installed = True
            self._patch_subclasses()

    def serve(self, compiler: Any, src: str) -> bytes:
        cid = (type(compiler).__module__, type(compiler).__qualname__,
               getattr(compiler, "arch", None), tuple(getattr(compiler, "args", ()) or ()))
        if cid != self.compiler_id:
            name = kernel_name(src)
            self.refused.append(name)
            raise KernelNotInArtifact(name, f"asked of compiler {cid}, the artifact's objects "
                                            f"are for {self.compiler_id}")
        obj = self.kernels.get(src)
        if obj is None:
            name = kernel_name(src)
            self.refused.append(name)
            raise KernelNotInArtifact(name)
        self.hits[self.names.get(src, kernel_name(src))] += 1
        return obj

    @contextmanager
    def armed(self) -> Iterator[None]:
        with self.lock:
            self._patch_subclasses()  # classes imported since the last arming
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1


_GUARD = _Guard()


def compile_stats() -> dict:
    """Objects served from the artifact and compiles refused, for this process."""
    return {"served": dict(_GUARD.hits), "served_total": sum(_GUARD.hits.values()),
            "refused": list(_GUARD.refused), "guard_permanent": _GUARD.permanent}


# ------------------------------------------------------------------ W^X for kernels

_PROT_READ, _PROT_EXEC = 0x1, 0x4


def _seal_cpu_programs() -> None:
    """Make each loaded CPU kernel read+execute, never writable again.

    tinygrad maps kernel code read-write-execute and keeps it so. A control worker
    may not hold writable code: the supervisor refuses writable executable memory at
    READY, and refuses any new executable mapping after it, so code written later
    could never run. Sealing right after the kernel is copied in keeps W^X.
    """
    try:
        from tinygrad.runtime import ops_cpu
    except ImportError:
        return
    cls = ops_cpu.CPUProgram
    if getattr(cls, "_trio_sealed", False):
        return
    orig = cls.__init__
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE

    def __init__(self: Any, *a: Any, **kw: Any) -> None:
        orig(self, *a, **kw)
        mem = getattr(self, "mem", None)
        if mem is not None:
            size = (len(mem) + page - 1) // page * page
            if libc.mprotect(self.addr, size, _PROT_READ | _PROT_EXEC) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"sealing kernel {self.name} read+execute: {os.strerror(e)}")

    cls.__init__ = __init__
    cls._trio_sealed = True


# ------------------------------------------------------------------ tinygrad set-up

def _import_tinygrad(verified: VerifiedArtifact, exclusive: bool) -> None:
    env = dict(PINNED_ENV, DEV=verified.target, CACHEDB=str(verified.kernels_db))
    if exclusive:
        if tinygrad_imported():
            raise RuntimeMismatch("tinygrad was imported before the artifact was verified; a "
                                  "dedicated model process must configure it first "
                                  "(CACHEDB, DEV, no compile workers)")
        os.environ.update(env)  # for the life of this process: tinygrad reads env at import
        importlib.import_module("tinygrad")
        import tinygrad.helpers as H

        # Read-only, immutable connection to the verified copy: tinygrad's own cache
        # reads go there, and any write fails instead of touching a file.
        H._db_connection = sqlite3.connect(f"file:{verified.kernels_db}?mode=ro&immutable=1",
                                           uri=True, isolation_level=None,
                                           check_same_thread=False)
        _seal_cpu_programs()
        return
    if not tinygrad_imported():
        # Import with the artifact's knobs, then restore the environment so that child
        # processes of this one do not inherit them. CACHEDB is left alone here: other
        # tinygrad users of this process keep their own cache.
        saved = {k: os.environ.get(k) for k in env if k != "CACHEDB"}
        try:
            os.environ.update({k: v for k, v in env.items() if k != "CACHEDB"})
            importlib.import_module("tinygrad")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    _seal_cpu_programs()


# ------------------------------------------------------------------ jit.pkl

_ALLOWED_BUILTINS = frozenset({"bytearray", "bytes", "tuple", "list", "dict", "set",
                               "frozenset", "slice", "complex", "range"})


class _JitUnpickler(pickle.Unpickler):
    """Allow-list: classes (not functions) from tinygrad, a few builtins."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins":
            if name in _ALLOWED_BUILTINS:
                return super().find_class(module, name)
            raise UnsafePickle(f"jit.pkl: builtins.{name} is not allowed")
        if module == "tinygrad" or module.startswith("tinygrad."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
            raise UnsafePickle(f"jit.pkl: {module}.{name} is a {type(obj).__name__}, only "
                               f"tinygrad classes may be referenced")
        raise UnsafePickle(f"jit.pkl: {module}.{name} is outside the allow-list")


def _np_dtype(dt: Any) -> str:
    return {"float": "float32", "float32": "float32", "half": "float16", "float16": "float16",
            "uchar": "uint8", "unsigned char": "uint8", "uint8": "uint8", "int": "int32", "int32": "int32"}.get(dt.name, dt.name)


# ------------------------------------------------------------------ the loaded model

@dataclass(frozen=True)
class RunStats:
    bytes_in: int
    bytes_out: int
    kernels_run: int
    device: str
    # How completion was established: "hostVisible" = the output copy has returned
    # (CPU: _copyout synchronises; CUDA: an event recorded after the device-to-host copy
    # has completed). device_ms: the device's own time between its start and end events
    # (CUDA only). fallbacks: kernels not run on the artifact's device (always 0: a
    # fallback is refused, not counted).
    completion: str = "hostVisible"
    device_ms: float | None = None
    fallbacks: int = 0


class LoadedModel:
    """The artifact's captured JIT, ready to run. Not thread-safe (one caller)."""

    def __init__(self, verified: VerifiedArtifact, *, exclusive: bool = False) -> None:
        self.verified = verified
        self.exclusive = exclusive
        _import_tinygrad(verified, exclusive)
        _GUARD.install()
        with _GUARD.lock:
            if _GUARD.compiler_id is not None and _GUARD.kernels is not verified.kernels:
                # a second artifact in one process: objects of both are servable
                _GUARD.kernels = {**_GUARD.kernels, **verified.kernels}
                _GUARD.names = {**_GUARD.names, **verified.kernel_names}
            else:
                _GUARD.kernels, _GUARD.names = verified.kernels, verified.kernel_names
            from tinygrad.runtime.support.compiler_cpu import ClangCompiler

            ref = ClangCompiler(verified.target.split(":", 2)[2].split(","))
            _GUARD.compiler_id = (type(ref).__module__, type(ref).__qualname__, ref.arch,
                                  tuple(ref.args))
            if exclusive:
                _GUARD.permanent = True
        with self.session():
            self._load()

    @contextmanager
    def session(self) -> Iterator[None]:
        """Guard armed and the artifact's tinygrad context, for loading and each run."""
        from tinygrad.helpers import Context

        with _GUARD.armed(), Context(DEV=self.verified.target, **_CONTEXT):
            yield

    def _load(self) -> None:
        from tinygrad import Device, Tensor, dtypes
        from tinygrad.engine.jit import CapturedJit, _TinyJit
        from tinygrad.engine.realize import lower_and_compile
        from tinygrad.uop.ops import Ops

        v = self.verified
        try:
            cap = _JitUnpickler(io.BytesIO(v.jit_bytes)).load()
        except ArtifactError:
            raise
        except Exception as exc:
            raise AbiMismatch(f"jit.pkl does not load with tinygrad "
                              f"{v.runtime['tinygrad_version']}: {type(exc).__name__}: {exc}") from None
        if not isinstance(cap, CapturedJit):
            raise AbiMismatch(f"jit.pkl holds a {type(cap).__name__}, not a CapturedJit")
        progs = [u for u in cap._linear.toposort() if u.op is Ops.PROGRAM]
        if any(len(p.src) != 3 or p.src[-1].op is not Ops.SOURCE for p in progs):
            raise AbiMismatch("jit.pkl carries compiled code or unrendered kernels; every "
                              "object must come from kernels.db")

        # ABI of the captured program itself must be the manifest's: as many inputs, in
        # the same order, each of its shape and dtype.
        ias, oa = [i["tensor"] for i in v.input_abis], v.output_abi
        if len(cap.expected_input_info) != len(ias):
            raise AbiMismatch(f"jit.pkl: captured JIT takes {len(cap.expected_input_info)} "
                              f"inputs, the ABI describes {len(ias)}")
        for k, (ia, info) in enumerate(zip(ias, cap.expected_input_info)):
            view, _vars, dt, _dev = info
            where = "abi.input.tensor" if len(ias) == 1 else f"abi.inputs[{k}].tensor"
            if list(view.shape) != ia["shape"] or _np_dtype(dt) != ia["dtype"]:
                raise AbiMismatch(f"jit.pkl: captured input {k} is {_np_dtype(dt)}"
                                  f"{list(view.shape)}, {where} says {ia['dtype']}{ia['shape']}")
        ret = cap.ret
        if not isinstance(ret, Tensor):
            raise AbiMismatch("jit.pkl: captured JIT does not return one tensor")
        if list(ret.shape) != oa["shape"] or _np_dtype(ret.dtype) != oa["dtype"]:
            raise AbiMismatch(f"jit.pkl: captured output is {_np_dtype(ret.dtype)}"
                              f"{list(ret.shape)}, abi.output says {oa['dtype']}{oa['shape']}")

        # Objects for every kernel, from kernels.db only (a miss raises, naming it).
        linear = lower_and_compile(cap._linear)
        names = sorted({p.arg.function_name for p in linear.toposort() if p.op is Ops.PROGRAM})
        listed = sorted(k["name"] for k in v.manifest["kernels"] if k.get("role") == "model")
        if names != listed:
            raise AbiMismatch(f"jit.pkl runs kernels {names}, the manifest lists {listed}")
        self.kernels_in_program = sum(1 for c in linear.src if c.op is Ops.CALL)
        self._jit = _TinyJit(None, CapturedJit(cap.ret, linear, cap.expected_names,
                                                cap.expected_input_info))
        dev = v.runtime["device"]
        # One input tensor per ABI input, allocated once: the JIT runs on these buffers.
        self._xs = [Tensor.empty(*ia["shape"], dtype=dtypes.float32 if ia["dtype"] == "float32"
                                 else getattr(dtypes, ia["dtype"]), device=dev).realize()
                    for ia in ias]
        self._xbufs = [x.uop.buffer.ensure_allocated() for x in self._xs]
        self._x, self._xbuf = self._xs[0], self._xbufs[0]
        self._device = Device[self._xbuf.device]
        self._alloc = self._device.allocator
        self._out = np.empty(oa["shape"], dtype=oa["dtype"])
        self._stages = [np.empty(ia["shape"], dtype=ia["dtype"]) for ia in ias]
        self._in_sizes = [int(np.prod(ia["shape"])) * np.dtype(ia["dtype"]).itemsize
                          for ia in ias]
        self._count_copies()
        self.runtime_info = {
            "device": self._xbuf.device,
            "device_class": type(self._device).__name__,
            "program_class": getattr(self._device.runtime_t, "__name__", "?"),
            "renderer": type(self._device.renderer).__name__,
            "compiler": type(self._device.compiler).__name__,
            "target": v.target,
        }
        self.golden_ok: bool | None = None
        self._plan: list[tuple[Any, list[tuple]]] | None = None
        if v.golden is not None and os.environ.get(ENV_DIRECT, "1") != "0":
            self._plan = self._record_plan()
        if v.golden is not None:
            gin, gout = v.golden
            # Through the plan where there is one: the signed golden output is what
            # proves the plan runs the artifact's program.
            out, _ = self.run(self.golden_inputs(), _session=False)
            if out.tobytes() != gout:
                raise GoldenMismatch(f"golden.bin: output {out.tolist()} differs from the "
                                     f"signed golden output "
                                     f"{np.frombuffer(gout, oa['dtype']).tolist()} on this host")
            self.golden_ok = True

    def _record_plan(self) -> list[tuple[Any, list[tuple]]] | None:
        """The artifact's kernels as direct calls: one run of the captured JIT (on the
        golden input) with each CPUProgram call recorded (program, buffer addresses,
        launch size, values), so that later runs call the same loaded, sealed programs
        on the same buffers without tinygrad's per-call Python (its JIT walks the graph,
        resolves buffers and builds argument lists per kernel: measured ~1-1.5 ms a frame
        of modeld's ~4 ms CPU). Only when every call of the program was such a kernel (no
        copy, no graph runner) and none uses the LVP calling convention; else None and
        the JIT runs as before. The plan's output is checked against the signed golden
        output at load (below), like the JIT's."""
        from tinygrad.runtime.ops_cpu import CPUProgram

        calls: list[tuple[Any, tuple[int, ...], int]] = []
        orig = CPUProgram.__call__

        def record(prg: Any, *bufs: Any, global_size: tuple = (1, 1, 1), **kw: Any) -> Any:
            # a None value is a runtime variable (core_id): set per launch below
            args = (*[int(b.va_addr) for b in bufs], *[int(x or 0) for x in kw.get("vals", ())])
            calls.append((prg, args, int(global_size[0])))
            return orig(prg, *bufs, global_size=global_size, **kw)

        for k, x in enumerate(self.golden_inputs()):
            self.input_view(k)[...] = x
        CPUProgram.__call__ = record        # type: ignore[method-assign]
        try:
            self._jit(*self._xs)
        finally:
            CPUProgram.__call__ = orig      # type: ignore[method-assign]
        if len(calls) != self.kernels_in_program or any(p.lvp for p, _, _ in calls):
            return None
        plan = []
        for prg, args, n in calls:
            core = prg.runtimevars.get("core_id")
            sets = []
            for tid in range(n):
                a = list(args)
                if core is not None:
                    a[core] = tid
                sets.append(tuple(ctypes.c_uint64(v) for v in a))
            plan.append((prg.fxn, sets))
        self._plan_out = self._jit.captured.ret.uop.buffer if hasattr(self._jit, "captured") \
            else None
        return plan

    @property
    def n_inputs(self) -> int:
        return len(self._xs)

    def golden_inputs(self) -> list[np.ndarray]:
        """The signed golden input(s): golden.bin holds each input's bytes in ABI order,
        then the output."""
        gin = self.verified.golden[0]
        if len(gin) != sum(self._in_sizes):
            raise AbiMismatch(f"golden.bin: {len(gin)} input bytes, the inputs take "
                              f"{sum(self._in_sizes)}")
        out, at = [], 0
        for ia, n in zip(self.verified.input_abis, self._in_sizes):
            t = ia["tensor"]
            out.append(np.frombuffer(gin[at:at + n], dtype=t["dtype"]).reshape(t["shape"]))
            at += n
        return out

    def _count_copies(self) -> None:
        """Count bytes through the allocator's host<->device copies (every copy path)."""
        alloc = self._alloc
        if getattr(alloc, "_model_counted", False):
            return
        counts = {"in": 0, "out": 0}
        cin, cout = alloc._copyin, alloc._copyout

        def _copyin(dest: Any, src: memoryview) -> Any:
            counts["in"] += src.nbytes
            return cin(dest, src)

        def _copyout(dest: memoryview, src: Any) -> Any:
            counts["out"] += dest.nbytes
            return cout(dest, src)

        alloc._copyin, alloc._copyout = _copyin, _copyout
        alloc._model_counted = True
        alloc._model_counts = counts

    def run(self, x: np.ndarray | list[np.ndarray], *, out: np.ndarray | None = None,
            _session: bool = True) -> tuple[np.ndarray, RunStats]:
        """Copy ``x`` in (a list: one array per input, in ABI order), run the captured
        program, copy the output back to host memory.

        Returns the output array (host memory, device synchronised) and what crossed:
        a fresh one, or ``out`` (C-contiguous, writable, the output's dtype and shape:
        e.g. a loaned slot's array, so the output lands where it is published)."""
        if out is not None and (out.dtype != self._out.dtype or out.shape != self._out.shape
                                or not (out.flags.c_contiguous and out.flags.writeable)):
            raise AbiMismatch(f"out is {out.dtype}{list(out.shape)}, the model writes "
                              f"{self._out.dtype}{list(self._out.shape)} (C-contiguous, "
                              f"writable)")
        xs = list(x) if isinstance(x, (list, tuple)) else [x]
        if len(xs) != len(self._xs):
            raise AbiMismatch(f"{len(xs)} inputs given, the model takes {len(self._xs)}")
        for k, (ia_, xk) in enumerate(zip(self.verified.input_abis, xs)):
            ia = ia_["tensor"]
            if xk.dtype != np.dtype(ia["dtype"]) or list(xk.shape) != ia["shape"]:
                raise AbiMismatch(f"input {k} is {xk.dtype}{list(xk.shape)}, the model takes "
                                  f"{ia['dtype']}{ia['shape']}")
            if not (xk.flags.c_contiguous and xk.flags.writeable):
                # from_mv wants a writable buffer; stage read-only/strided inputs
                np.copyto(self._stages[k], xk)
                xs[k] = self._stages[k]
        if _session:
            with self.session():
                return self._run(xs, out)
        return self._run(xs, out)

    def input_view(self, index: int = 0) -> np.ndarray:
        """Input ``index``'s buffer as a writable host array (the ABI's dtype and shape):
        a caller that fills it in place (modeld copying a frame's Y plane straight in)
        then calls `run_staged`, with no copy through the allocator. Host memory on the
        CPU device; the device is idle whenever a run has returned (its output copy
        synchronises)."""
        ia = self.verified.input_abis[index]["tensor"]
        mv = self._alloc._as_buffer(self._xbufs[index]._buf)
        return np.frombuffer(mv, dtype=ia["dtype"], count=int(np.prod(ia["shape"]))
                             ).reshape(ia["shape"])

    def run_staged(self, *, out: np.ndarray | None = None) -> tuple[np.ndarray, RunStats]:
        """Run on what `input_view` holds now; otherwise as `run` (``bytes_in`` counts
        only the allocator's copies: 0 here, the caller knows what it staged)."""
        if out is not None and (out.dtype != self._out.dtype or out.shape != self._out.shape
                                or not (out.flags.c_contiguous and out.flags.writeable)):
            raise AbiMismatch(f"out is {out.dtype}{list(out.shape)}, the model writes "
                              f"{self._out.dtype}{list(self._out.shape)} (C-contiguous, "
                              f"writable)")
        with self.session():
            return self._run(None, out)

    def _run(self, xs: list[np.ndarray] | None, out: np.ndarray | None = None
             ) -> tuple[np.ndarray, RunStats]:
        from tinygrad.helpers import GlobalCounters

        counts = self._alloc._model_counts
        b_in, b_out, k0 = counts["in"], counts["out"], GlobalCounters.kernel_count
        if xs is not None:
            for buf, xk in zip(self._xbufs, xs):
                self._alloc._copyin(buf._buf, memoryview(xk).cast("B"))
        if self._plan is not None and self._plan_out is not None:
            for fxn, sets in self._plan:
                for a in sets:
                    fxn(*a)
            obuf = self._plan_out
            k0 -= len(self._plan)        # the receipt's kernels_run: these ran
        else:
            obuf = self._jit(*self._xs).uop.buffer
        if out is None:
            out = np.empty_like(self._out)
        # _copyout synchronises the device first: the bytes are final when it returns.
        self._alloc._copyout(memoryview(out).cast("B"), obuf._buf)
        return out, RunStats(counts["in"] - b_in, counts["out"] - b_out,
                             GlobalCounters.kernel_count - k0, obuf.device)


def load_model(verified: VerifiedArtifact, *, exclusive: bool = False) -> Any:
    """The runner of ``verified``: tinygrad for a CPU artifact, the CUDA driver alone for a
    CUDA one (`supervisor.model.cuda_runtime`, no tinygrad imported)."""
    if verified.cuda is not None:
        from .cuda_runtime import CudaModel

        return CudaModel(verified, refuse_compilers=exclusive)
    return LoadedModel(verified, exclusive=exclusive)

