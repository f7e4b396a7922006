"""CUDA artifacts: device code built on the build side, checked here before anything runs.

A CUDA bundle is the same signed directory as a CPU one (manifest.json, manifest.sig,
every file hashed), with other files::

    launch.json     the launch plan: buffers (input, output, weight, scratch: sizes) and
                    the kernel calls in order (function, grid, block, buffer arguments)
    weights.bin     the weight buffers' initial bytes, at the offsets launch.json gives
    cubin.sm_XX     one per architecture: every kernel's cubin (SASS) for sm_XX, at the
                    offsets the manifest's kernels[i].objects.sm_XX give
    golden.bin      a sample input and the CPU build's output for it (with a tolerance)

What runs in control is the CUDA driver alone (`supervisor.model.cuda_runtime`): no
tinygrad, no NVRTC, no PTX. Refused here, each with one line, before a byte of code is
given to the driver: PTX instead of cubin (the driver would compile it in control), a
cubin whose ELF says another architecture than the file it is filed under, a call
launched with another grid or block than its kernel's signed launch size (or a kernel
without one: tinygrad's kernels index with no bounds check), no cubin for
the GPU's architecture (``device_arch``), a toolkit or driver version this loader does
not know, a driver older than the manifest's minimum.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from .errors import HashMismatch, HostIncompatible, ManifestError, RuntimeMismatch

MANIFEST = "manifest.json"
LAUNCH_FILE = "launch.json"
WEIGHTS_FILE = "weights.bin"
CUBIN_PREFIX = "cubin."
DEVICE = "CUDA"
CODE = "cubin"
LOADER = "cuda-driver"

# The toolkits this loader knows, by major version, and the oldest driver that loads
# cubins they produce (CUDA minor-version compatibility: any 12.x cubin loads on a
# 525.60.13+ driver, 13.x on 580.65.06+). A toolkit outside this table is refused: we
# cannot say which driver its code needs.
TOOLKITS = ("nvrtc", "nvcc")
TOOLKIT_MIN_DRIVER: dict[int, str] = {12: "525.60.13", 13: "580.65.06"}

# SASS of sm_XY runs on sm_XZ for Z >= Y (same major); "a"/"f" variants only on their own.
_ARCH_RE = re.compile(r"^sm_([1-9][0-9]?)([0-9])$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

EM_CUDA = 190
ELFOSABI_CUDA = 0x33
MAX_CALLS = 4096
MAX_BUFFERS = 4096
ROLES = ("input", "output", "weight", "scratch")


def parse_arch(arch: str) -> tuple[int, int]:
    """"sm_90" -> (9, 0); anything else (PTX's compute_90, sm_90a) is not a cubin target
    we run."""
    m = _ARCH_RE.match(arch) if isinstance(arch, str) else None
    if m is None:
        raise ValueError(f"{arch!r} is not a cubin architecture such as sm_90")
    return int(m.group(1)), int(m.group(2))


def runs_on(built: str, device: str) -> bool:
    """A cubin for ``built`` runs on a GPU of ``device``: same major, minor not newer."""
    (bm, bn), (dm, dn) = parse_arch(built), parse_arch(device)
    return bm == dm and bn <= dn


def pick_arch(architectures: list[str], device_arch: str) -> str | None:
    """The artifact's best architecture for this GPU (exact, else the newest older minor)."""
    fit = [a for a in architectures if runs_on(a, device_arch)]
    return max(fit, key=parse_arch) if fit else None


def _version(v: Any, what: str) -> tuple[int, ...]:
    parts = v.split(".") if isinstance(v, str) else []
    if not 1 <= len(parts) <= 4 or not all(p.isdigit() and len(p) <= 6 for p in parts):
        raise ManifestError(f"{MANIFEST}: {what} {v!r} is not a version such as 12.9")
    return tuple(int(p) for p in parts)


def cubin_arch(obj: bytes) -> str:
    """The SM a cubin is for, from its ELF header; ValueError naming what it is instead.

    CUDA ELF: e_machine EM_CUDA (190), e_ident[EI_OSABI] 0x33. The SM sits in e_flags:
    its low byte up to ELF ABI version 7 (NVRTC 12.x: e_flags 0x5a055a for sm_90), bits
    8-15 from ABI version 8 (toolkits 12.8+/13 may write either)."""
    if obj[:4] != b"\x7fELF":
        head = obj[:4096].lstrip(b"\x00 \t\r\n")
        if head.startswith(b"//") or b".version" in head or b".target" in head:
            raise ValueError("is PTX (text), not a cubin: the driver would compile it")
        raise ValueError("is not an ELF object")
    if len(obj) < 0x34 or obj[4] != 2 or obj[5] != 1:
        raise ValueError("is not a 64-bit little-endian ELF object")
    machine = struct.unpack_from("<H", obj, 0x12)[0]
    if machine != EM_CUDA or obj[7] != ELFOSABI_CUDA:
        raise ValueError(f"is an ELF object for machine {machine}, not a CUDA cubin")
    flags = struct.unpack_from("<I", obj, 0x30)[0]
    sm = (flags >> 8) & 0xFF if obj[8] >= 8 else flags & 0xFF
    if not 10 <= sm <= 199:
        raise ValueError(f"has no SM in its ELF flags ({flags:#x})")
    return f"sm_{sm}"


@dataclass(frozen=True)
class CudaPayload:
    """What the driver loader needs, every byte verified: the plan, the weights, and
    each kernel's cubin for one architecture (or, with no GPU named, checked for all)."""

    arch: str | None                   # the architecture chosen for device_arch
    architectures: tuple[str, ...]
    plan: dict                         # launch.json, checked
    weights: bytes
    objects: dict[str, dict[str, bytes]]   # arch -> kernel name -> cubin (all checked)
    toolkit: str                       # e.g. "nvrtc 12.9"
    min_driver: str

    def cubins(self, arch: str) -> dict[str, bytes]:
        """Every kernel's cubin for ``arch`` (one of ``architectures``)."""
        return self.objects[arch]


def required_files(m: dict) -> tuple[str, ...]:
    archs = m.get("runtime", {}).get("architectures")
    archs = archs if isinstance(archs, list) else []     # check_runtime says what is wrong
    return (LAUNCH_FILE, WEIGHTS_FILE,
            *(CUBIN_PREFIX + a for a in archs if isinstance(a, str)))


def check_code(m: dict) -> None:
    """What kind of device code the manifest claims: cubin from the CUDA renderer only
    (checked first, before the files: a PTX artifact is refused whatever it holds)."""
    rt = m.get("runtime") if isinstance(m.get("runtime"), dict) else {}
    ren, code = rt.get("renderer"), rt.get("code")
    if ren != "CUDA" or code != CODE:
        raise RuntimeMismatch(f"{MANIFEST}: runtime.device/renderer {DEVICE}/{ren} with code "
                              f"{code!r} is not loaded here: only {CODE!r} (SASS) from the "
                              f"CUDA renderer; PTX would be compiled by the driver in control")


def check_runtime(m: dict, *, device_arch: str | None = None,
                  driver_version: str | None = None) -> tuple[list[str], str | None]:
    """The manifest's runtime section of a CUDA artifact; returns (architectures, the
    one for ``device_arch`` or None)."""
    rt = m.get("runtime")
    if not isinstance(rt, dict):
        raise ManifestError(f"{MANIFEST}: missing field 'runtime'")
    check_code(m)
    if rt.get("loader") != LOADER:
        raise RuntimeMismatch(f"{MANIFEST}: runtime.loader is {rt.get('loader')!r}, this "
                              f"loader is {LOADER!r}")
    archs = rt.get("architectures")
    if not isinstance(archs, list) or not archs or len(set(map(str, archs))) != len(archs):
        raise ManifestError(f"{MANIFEST}: runtime.architectures must list distinct "
                            f"architectures such as ['sm_90']")
    for a in archs:
        try:
            parse_arch(a)
        except ValueError as e:
            raise RuntimeMismatch(f"{MANIFEST}: runtime.architectures: {e}") from None
    if rt.get("target") != f"{DEVICE}:{','.join(archs)}":
        raise ManifestError(f"{MANIFEST}: runtime.target {rt.get('target')!r} disagrees with "
                            f"runtime.architectures ({DEVICE}:{','.join(archs)})")
    tk = rt.get("toolkit")
    if not isinstance(tk, dict) or tk.get("name") not in TOOLKITS:
        raise RuntimeMismatch(f"{MANIFEST}: runtime.toolkit.name "
                              f"{tk.get('name') if isinstance(tk, dict) else tk!r} is not a "
                              f"toolkit this loader knows ({', '.join(TOOLKITS)})")
    tver = _version(tk.get("version"), "runtime.toolkit.version")
    floor = TOOLKIT_MIN_DRIVER.get(tver[0])
    if floor is None:
        raise RuntimeMismatch(f"{MANIFEST}: runtime.toolkit {tk['name']} {tk['version']} is "
                              f"not a CUDA version this loader knows (majors "
                              f"{', '.join(map(str, sorted(TOOLKIT_MIN_DRIVER)))}); which "
                              f"driver its code needs is unknown")
    need = _version(rt.get("min_driver"), "runtime.min_driver")
    if need < _version(floor, "driver floor"):
        raise RuntimeMismatch(f"{MANIFEST}: runtime.min_driver {rt['min_driver']} is below "
                              f"{floor}, the oldest driver for CUDA {tver[0]}.x code")
    if driver_version is not None and _version(driver_version, "driver") < need:
        raise HostIncompatible(f"{MANIFEST}: the artifact needs NVIDIA driver >= "
                               f"{rt['min_driver']}, this machine has {driver_version}")
    chosen = None
    if device_arch is not None:
        chosen = pick_arch(archs, device_arch)
        if chosen is None:
            raise HostIncompatible(f"{MANIFEST}: cubins for {', '.join(archs)}, this GPU is "
                                   f"{device_arch}: no code for it (rebuild with --arch "
                                   f"{device_arch})")
    return archs, chosen


# CUDA's own launch limits: grid x up to 2^31-1, y and z up to 65535; block x, y up to
# 1024, z up to 64, at most 1024 threads in all.
GRID_LIMIT = (2**31 - 1, 65535, 65535)
BLOCK_LIMIT = (1024, 1024, 64)


def _dims(v: Any, lim: tuple[int, int, int]) -> bool:
    return isinstance(v, list) and len(v) == 3 and all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= m for x, m in zip(v, lim))


@dataclass(frozen=True)
class KernelSpec:
    """What the signed manifest says of one kernel: its buffer parameters and the launch
    it was rendered for (tinygrad's global_size = grid, local_size = block). The kernel's
    indexing is computed from blockIdx/threadIdx with no bounds check, so the launch size
    is part of its memory safety, not a tuning knob."""

    params: list[dict]
    grid: list[int]
    block: list[int]


def _check_plan(plan: Any, weights_len: int, kernels: dict[str, KernelSpec]) -> dict:
    """launch.json: buffers with sizes and roles, calls naming listed kernels and buffers,
    each call launched with exactly its kernel's grid and block, each buffer at least as
    large as the kernel's parameter (the manifest's ``params``)."""
    names = set(kernels)
    if not isinstance(plan, dict):
        raise ManifestError(f"{LAUNCH_FILE}: not an object")
    bufs, calls = plan.get("buffers"), plan.get("calls")
    if not isinstance(bufs, list) or not 1 <= len(bufs) <= MAX_BUFFERS:
        raise ManifestError(f"{LAUNCH_FILE}: buffers must list 1 to {MAX_BUFFERS} buffers")
    if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_CALLS:
        raise ManifestError(f"{LAUNCH_FILE}: calls must list 1 to {MAX_CALLS} kernel calls")
    inputs: list[int] = []
    outputs = 0
    for i, b in enumerate(bufs):
        if not isinstance(b, dict) or b.get("id") != i or b.get("role") not in ROLES:
            raise ManifestError(f"{LAUNCH_FILE}: buffers[{i}] needs id {i} and a role in "
                                f"{list(ROLES)}")
        n = b.get("nbytes")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= 1 << 31:
            raise ManifestError(f"{LAUNCH_FILE}: buffers[{i}].nbytes is not a byte count")
        if b["role"] == "weight":
            off = b.get("offset")
            if not isinstance(off, int) or isinstance(off, bool) or off < 0 \
                    or off + n > weights_len:
                raise ManifestError(f"{LAUNCH_FILE}: buffers[{i}] (weight) lies outside "
                                    f"{WEIGHTS_FILE} ({weights_len} bytes)")
        elif b["role"] == "input":
            k = b.get("input")
            if not isinstance(k, int) or isinstance(k, bool):
                raise ManifestError(f"{LAUNCH_FILE}: buffers[{i}] (input) needs its input "
                                    f"number")
            inputs.append(k)
        elif b["role"] == "output":
            outputs += 1
    if sorted(inputs) != list(range(len(inputs))) or not inputs or outputs != 1:
        raise ManifestError(f"{LAUNCH_FILE}: needs inputs numbered 0..n-1 (has {inputs}) and "
                            f"exactly one output (has {outputs})")
    for k, c in enumerate(calls):
        where = f"{LAUNCH_FILE}: calls[{k}]"
        if not isinstance(c, dict) or c.get("kernel") not in names:
            raise ManifestError(f"{where}: kernel {c.get('kernel') if isinstance(c, dict) else c!r} "
                                f"is not one the manifest lists")
        for key, lim in (("grid", GRID_LIMIT), ("block", BLOCK_LIMIT)):
            if not _dims(c.get(key), lim):
                raise ManifestError(f"{where}.{key} must be 3 positive ints within {list(lim)}")
        if c["block"][0] * c["block"][1] * c["block"][2] > 1024:
            raise ManifestError(f"{where}.block has more than 1024 threads")
        ks = kernels[c["kernel"]]
        if c["grid"] != ks.grid or c["block"] != ks.block:
            raise ManifestError(f"{where}: kernel {c['kernel']!r} launched with grid "
                                f"{c['grid']} block {c['block']}, it was built for grid "
                                f"{ks.grid} block {ks.block}: its indexing has no bounds "
                                f"check, another launch reads or writes past its buffers")
        args = c.get("args")
        if not isinstance(args, list) or not all(
                isinstance(a, int) and not isinstance(a, bool) and 0 <= a < len(bufs) for a in args):
            raise ManifestError(f"{where}.args must be buffer ids")
        vals = c.get("vals", [])
        if not isinstance(vals, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and -2**31 <= v < 2**31 for v in vals):
            raise ManifestError(f"{where}.vals must be int32 values")
        ps = ks.params
        if len(args) != len(ps) or vals:
            raise ManifestError(f"{where}: {len(args)} buffers and {len(vals)} values for "
                                f"kernel {c['kernel']!r}, which takes {len(ps)} buffers")
        for j, (a, p) in enumerate(zip(args, ps)):
            if bufs[a]["nbytes"] < p["nbytes"]:
                raise ManifestError(f"{where}.args[{j}]: buffer {a} has {bufs[a]['nbytes']} "
                                    f"bytes, kernel {c['kernel']!r} spans {p['nbytes']}")
    return plan


def read_payload(m: dict, blobs: dict[str, bytes], arch: str | None,
                 archs: list[str]) -> CudaPayload:
    """Every kernel's object for every architecture: listed, hashed, a cubin of the
    architecture its file names. Only ``arch``'s are handed on."""
    listed = m.get("kernels")
    if not isinstance(listed, list) or not listed:
        raise ManifestError(f"{MANIFEST}: kernels must list the artifact's kernels")
    objects: dict[str, dict[str, bytes]] = {a: {} for a in archs}
    names: set[str] = set()
    specs: dict[str, KernelSpec] = {}
    for i, k in enumerate(listed):
        objs = k.get("objects") if isinstance(k, dict) else None
        if (not isinstance(k, dict) or not isinstance(k.get("name"), str)
                or not _NAME_RE.match(k["name"]) or k["name"] in names
                or not _HEX64.match(str(k.get("source_sha256"))) or not isinstance(objs, dict)
                or sorted(objs) != sorted(archs)):
            raise ManifestError(f"{MANIFEST}: kernels[{i}] needs a distinct name, "
                                f"source_sha256 and objects for each of {archs}")
        names.add(k["name"])
        ps = k.get("params")
        if not isinstance(ps, list) or not all(
                isinstance(p, dict) and isinstance(p.get("nbytes"), int)
                and not isinstance(p.get("nbytes"), bool) and p["nbytes"] > 0 for p in ps):
            raise ManifestError(f"{MANIFEST}: kernels[{i}].params must list each buffer "
                                f"parameter's nbytes")
        grid, block = k.get("grid"), k.get("block")
        if not _dims(grid, GRID_LIMIT) or not _dims(block, BLOCK_LIMIT) \
                or block[0] * block[1] * block[2] > 1024:
            # An artifact built before launch sizes were signed (or with them stripped):
            # nothing bounds its calls' grid/block, so it is refused, not trusted.
            raise ManifestError(f"{MANIFEST}: kernels[{i}] ({k['name']!r}) has no valid "
                                f"grid/block (its launch size, signed at build: got grid "
                                f"{grid!r} block {block!r}); rebuild the artifact")
        specs[k["name"]] = KernelSpec(ps, grid, block)
        for a in archs:
            o, blob = objs[a], blobs[CUBIN_PREFIX + a]
            off, size = (o.get("offset"), o.get("size")) if isinstance(o, dict) else (None, None)
            if (not isinstance(off, int) or not isinstance(size, int) or off < 0 or size <= 0
                    or off + size > len(blob) or not _HEX64.match(str(o.get("sha256")))):
                raise ManifestError(f"{MANIFEST}: kernels[{i}].objects.{a} lies outside "
                                    f"{CUBIN_PREFIX}{a}")
            obj = blob[off:off + size]
            if hashlib.sha256(obj).hexdigest() != o["sha256"]:
                raise HashMismatch(f"{CUBIN_PREFIX}{a}: kernel {k['name']!r}: object sha256 "
                                   f"differs from the manifest")
            try:
                got = cubin_arch(obj)
            except ValueError as e:
                raise RuntimeMismatch(f"{CUBIN_PREFIX}{a}: kernel {k['name']!r} {e}; only "
                                      f"cubin is loaded in control") from None
            if got != a:
                raise HostIncompatible(f"{CUBIN_PREFIX}{a}: kernel {k['name']!r} is a cubin for "
                                       f"{got}, filed as {a}")
            objects[a][k["name"]] = obj
    try:
        plan = json.loads(blobs[LAUNCH_FILE].decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ManifestError(f"{LAUNCH_FILE}: not ASCII JSON: {e}") from None
    weights = blobs[WEIGHTS_FILE]
    _check_plan(plan, len(weights), specs)
    rt = m["runtime"]
    return CudaPayload(arch, tuple(archs), plan, weights, objects,
                       f"{rt['toolkit']['name']} {rt['toolkit']['version']}", rt["min_driver"])


def check_abi(plan: dict, input_abis: list[dict], output_abi: dict) -> None:
    """The plan's input and output buffers are the ABI's sizes (the manifest's tensors)."""
    import numpy as np

    want = {("input", k): int(np.prod(i["tensor"]["shape"])) * np.dtype(i["tensor"]["dtype"]).itemsize
            for k, i in enumerate(input_abis)}
    want[("output", 0)] = int(np.prod(output_abi["shape"])) * np.dtype(output_abi["dtype"]).itemsize
    have = {(b["role"], b.get("input", 0)): b["nbytes"] for b in plan["buffers"]
            if b["role"] in ("input", "output")}
    if have != want:
        raise ManifestError(f"{LAUNCH_FILE}: input/output buffers {sorted(have.items())} are "
                            f"not the ABI's {sorted(want.items())}")
