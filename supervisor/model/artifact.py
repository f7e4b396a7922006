"""Signed model artifacts: format, signing, and verification before anything is loaded.

A bundle is a directory::

    manifest.json   canonical JSON (sorted keys, no whitespace, ASCII), signed
    manifest.sig    64-byte raw ed25519 signature of the manifest.json bytes
    jit.pkl         pickled tinygrad CapturedJit: graph, C sources and weights, NO machine code
    kernels.db      tinygrad compile cache (sqlite, one table) holding every compiled object
                    the runtime needs: the model's kernels and the CPU device's own programs
    golden.bin      optional: a sample input and the output the build produced for it

`load_verified` checks, in this order and before anything is unpickled or mapped
executable: the signature over the exact manifest bytes, that the manifest is canonical
and well formed, the sha256 and size of every listed file (on private copies, so the
bundle cannot change under us), that no unlisted file is present, the model
name/version, the tinygrad version, device and renderer, the host architecture and CPU
features, the ABI (internally consistent, and against ``expect_abi``), and that
kernels.db holds exactly the kernels the manifest lists. Each failure is a typed
`ArtifactError` naming the file or field.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import pickle
import re
import shutil
import sqlite3
import stat
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cuda as _cuda
from . import host as _host
from .errors import (AbiMismatch, ArtifactError, HashMismatch, HostIncompatible, ManifestError,
                     MissingFile, RuntimeMismatch, UnlistedFile, UnsignedArtifact, WrongVersion)
from .keys import key_id, load_public_key, verify

FORMAT = "trio-model-artifact/1"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
JIT_FILE = "jit.pkl"
KERNELS_FILE = "kernels.db"
GOLDEN_FILE = "golden.bin"

MAX_MANIFEST_BYTES = 1 << 20
MAX_FILE_BYTES = 256 << 20
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

# What this loader can run: tinygrad's CPU device with clang-compiled objects.
SUPPORTED_DEVICES = {("CPU", "CLANG")}
_NP_DTYPES = {"uint8": 1, "float32": 4, "float16": 2, "int32": 4}


# ------------------------------------------------------------------ canonical JSON

def canonical_json(obj: Any) -> bytes:
    """The one byte form a manifest is signed in: sorted keys, no whitespace, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ManifestError(f"{MANIFEST}: duplicate key {k!r}")
        out[k] = v
    return out


def parse_manifest(data: bytes) -> dict:
    """Parse signed manifest bytes; they must be exactly the canonical form."""
    try:
        obj = json.loads(data.decode("ascii"), object_pairs_hook=_no_duplicates)
    except ManifestError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{MANIFEST}: not ASCII JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{MANIFEST}: top level is {type(obj).__name__}, not an object")
    if canonical_json(obj) != data:
        raise ManifestError(f"{MANIFEST}: not canonical JSON (sorted keys, no whitespace, "
                            f"ASCII); it must be byte-identical to its canonical form")
    return obj


# ------------------------------------------------------------------ field access

def _get(m: dict, dotted: str, typ: type | tuple[type, ...]) -> Any:
    cur: Any = m
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise ManifestError(f"{MANIFEST}: missing field {dotted!r}")
        cur = cur[part]
    if not isinstance(cur, typ) or (isinstance(cur, bool) and bool not in (
            typ if isinstance(typ, tuple) else (typ,))):
        raise ManifestError(f"{MANIFEST}: field {dotted!r} is {type(cur).__name__}, "
                            f"expected {getattr(typ, '__name__', typ)}")
    return cur


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------ verified result

@dataclass
class VerifiedArtifact:
    """A bundle whose every byte has been checked; its files are private copies.

    ``files`` point into ``workdir`` (0700 temp dir, files 0400); use only those, never
    the original bundle. ``close()`` removes the copies.
    """

    source: Path
    workdir: Path
    manifest: dict
    manifest_bytes: bytes
    manifest_sha256: bytes
    key_id: str
    files: dict[str, Path]
    jit_bytes: bytes
    kernels: dict[str, bytes]          # C source -> compiled object
    kernel_names: dict[str, str]       # C source -> function name
    golden: tuple[bytes, bytes] | None = None
    # A CUDA artifact's plan, weights and cubins (None: a CPU artifact).
    cuda: _cuda.CudaPayload | None = None
    _closed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        # the copies go when this object does, or at interpreter exit at the latest
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.workdir), True)

    @property
    def name(self) -> str:
        return self.manifest["model"]["name"]

    @property
    def version(self) -> str:
        return self.manifest["model"]["version"]

    @property
    def runtime(self) -> dict:
        return self.manifest["runtime"]

    @property
    def device(self) -> str:
        """The runtime.device the artifact runs on: CPU or CUDA."""
        return self.manifest["runtime"]["device"]

    @property
    def target(self) -> str:
        """tinygrad DEV string the objects were compiled for, e.g. CPU:CLANG:x86_64,x86-64-v3."""
        return self.manifest["runtime"]["target"]

    @property
    def input_abi(self) -> dict:
        """The first (for ABI 1-2 the only) input."""
        return input_abis(self.manifest["abi"])[0]

    @property
    def input_abis(self) -> list[dict]:
        """Every input, in the order the model takes them (input ABI 3: several)."""
        return input_abis(self.manifest["abi"])

    @property
    def output_abi(self) -> dict:
        return self.manifest["abi"]["output"]

    @property
    def kernels_db(self) -> Path:
        return self.files[KERNELS_FILE]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> VerifiedArtifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ verification

def _read_regular(path: Path, limit: int, *, what: str, missing: type[ArtifactError]) -> bytes:
    """Read a regular file without following a symlink, at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise missing(f"{what}: {path} does not exist") from None
    except OSError as exc:
        raise missing(f"{what}: cannot open {path}: {exc.strerror or exc} "
                      f"(symlinks are refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise missing(f"{what}: {path} is not a regular file")
        if st.st_size > limit:
            raise HashMismatch(f"{what}: {path} is {st.st_size} bytes, limit {limit}")
        chunks, n = [], 0
        while True:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:
                raise HashMismatch(f"{what}: {path} grew past {limit} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_private(workdir: Path, name: str, data: bytes) -> Path:
    p = workdir / name
    # Created 0400 (the fd is still writable): no chmod, which sandboxes deny.
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return p


def _check_files_section(m: dict) -> dict[str, dict]:
    files = _get(m, "files", dict)
    for name, ent in files.items():
        if not _NAME_RE.match(name) or name in (MANIFEST, SIGNATURE):
            raise ManifestError(f"{MANIFEST}: files: {name!r} is not an allowed file name")
        if not isinstance(ent, dict):
            raise ManifestError(f"{MANIFEST}: files.{name} is not an object")
        sha, size = ent.get("sha256"), ent.get("size")
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise ManifestError(f"{MANIFEST}: files.{name}.sha256 is not 64 lowercase hex digits")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES:
            raise ManifestError(f"{MANIFEST}: files.{name}.size is not a byte count")
    is_cuda = isinstance(m.get("runtime"), dict) and m["runtime"].get("device") == _cuda.DEVICE
    if is_cuda:
        _cuda.check_code(m)
    for required in _cuda.required_files(m) if is_cuda else (JIT_FILE, KERNELS_FILE):
        if required not in files:
            raise ManifestError(f"{MANIFEST}: files does not list {required!r}")
    return files


def parse_version(v: str) -> tuple[int, ...]:
    """"1.2.10" -> (1, 2, 10); anything else is not a version we can order."""
    parts = v.split(".")
    if not 1 <= len(parts) <= 4 or not all(p.isdigit() and len(p) <= 6 for p in parts):
        raise ValueError(f"{v!r} is not a version such as 1.2.0")
    return tuple(int(p) for p in parts)


def _check_model(m: dict, expect_name: str | None, expect_version: str | None,
                 min_version: str | None = None) -> None:
    fmt = _get(m, "format", str)
    if fmt != FORMAT:
        raise WrongVersion(f"{MANIFEST}: format {fmt!r}, this loader reads {FORMAT!r}")
    name = _get(m, "model.name", str)
    version = _get(m, "model.version", str)
    _get(m, "model.created_utc", str)
    if expect_name is not None and name != expect_name:
        raise WrongVersion(f"{MANIFEST}: model.name is {name!r}, expected {expect_name!r}")
    if expect_version is not None and version != expect_version:
        raise WrongVersion(f"{MANIFEST}: model.version of {name!r} is {version!r}, "
                           f"expected {expect_version!r}")
    if min_version is not None:
        # A signature proves who built it, not that it is current: an older signed
        # artifact must not be rolled back in.
        try:
            older = parse_version(version) < parse_version(min_version)
        except ValueError as e:
            raise WrongVersion(f"{MANIFEST}: model.version: {e}") from None
        if older:
            raise WrongVersion(f"{MANIFEST}: model.version of {name!r} is {version!r}, older "
                               f"than the minimum {min_version!r} (rollback refused)")


def _check_runtime(m: dict) -> None:
    want = _get(m, "runtime.tinygrad_version", str)
    try:
        have = importlib.metadata.version("tinygrad")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeMismatch("tinygrad is not installed; the artifact needs "
                              f"tinygrad {want}") from None
    if have != want:
        raise RuntimeMismatch(f"{MANIFEST}: runtime.tinygrad_version is {want!r}, this "
                              f"process has tinygrad {have!r}")
    dev = _get(m, "runtime.device", str)
    ren = _get(m, "runtime.renderer", str)
    if (dev, ren) not in SUPPORTED_DEVICES:
        raise RuntimeMismatch(f"{MANIFEST}: runtime.device/renderer {dev}/{ren} is not "
                              f"supported here (supported: "
                              f"{', '.join('/'.join(x) for x in sorted(SUPPORTED_DEVICES))})")
    target = _get(m, "runtime.target", str)
    arch = _get(m, "host.arch", str)
    cpu = _get(m, "host.cpu", str)
    if target != f"{dev}:{ren}:{arch},{cpu}":
        raise ManifestError(f"{MANIFEST}: runtime.target {target!r} disagrees with "
                            f"device/renderer/host ({dev}:{ren}:{arch},{cpu})")
    _get(m, "runtime.cache_table", str)


def _check_host_arch(m: dict) -> None:
    """The host side of a CUDA artifact: its pointer size and byte order (the launch
    arguments are 64-bit little-endian device pointers); CPU features do not matter."""
    for key, have in (("host.arch", _host.machine()), ("host.byteorder", sys.byteorder)):
        if _get(m, key, str) != have:
            raise HostIncompatible(f"{MANIFEST}: {key} is {m['host'][key.split('.')[1]]!r}, "
                                   f"this machine is {have!r}")


def _check_host(m: dict) -> None:
    arch = _get(m, "host.arch", str)
    if arch != _host.machine():
        raise HostIncompatible(f"{MANIFEST}: host.arch is {arch!r}, this machine is "
                               f"{_host.machine()!r}")
    order = _get(m, "host.byteorder", str)
    if order != sys.byteorder:
        raise HostIncompatible(f"{MANIFEST}: host.byteorder is {order!r}, this machine is "
                               f"{sys.byteorder!r}")
    need = _get(m, "host.required_cpu_flags", list)
    have = _host.cpu_flags()
    if not have:
        raise HostIncompatible("cannot read this CPU's flags from /proc/cpuinfo; refusing "
                               "to run objects compiled for "
                               f"{_get(m, 'host.cpu', str)} without knowing")
    missing = sorted(set(need) - have)
    if missing:
        raise HostIncompatible(f"{MANIFEST}: objects compiled for {_get(m, 'host.cpu', str)} "
                               f"need CPU features this host lacks: {', '.join(missing)}")


def _c_strides(shape: list[int], item: int) -> list[int]:
    out, acc = [], item
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _check_tensor(t: Any, where: str) -> None:
    if not isinstance(t, dict):
        raise AbiMismatch(f"{MANIFEST}: {where} is not an object")
    for k in ("dtype", "shape", "strides", "byte_offset", "layout"):
        if k not in t:
            raise AbiMismatch(f"{MANIFEST}: {where}.{k} is missing")
    dt, shape, strides = t["dtype"], t["shape"], t["strides"]
    if dt not in _NP_DTYPES:
        raise AbiMismatch(f"{MANIFEST}: {where}.dtype {dt!r} is not supported")
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
        raise AbiMismatch(f"{MANIFEST}: {where}.shape {shape!r} is not a list of positive ints")
    if strides != _c_strides(shape, _NP_DTYPES[dt]):
        raise AbiMismatch(f"{MANIFEST}: {where}.strides {strides!r} are not the C-contiguous "
                          f"byte strides {_c_strides(shape, _NP_DTYPES[dt])} of shape {shape}")
    if t["byte_offset"] != 0:
        raise AbiMismatch(f"{MANIFEST}: {where}.byte_offset must be 0")


# Input ABI 3: an artifact may take several frames (the driving model: road + wide).
MAX_INPUTS = 4
PAIRING_BY = ("frame_id",)


def _check_input(inp: Any, where: str, version: int) -> None:
    """One input's frame, preprocessing and tensor agree (``where``: its manifest path)."""
    if not isinstance(inp, dict):
        raise AbiMismatch(f"{MANIFEST}: {where} is not an object")
    _check_tensor(inp.get("tensor"), f"{where}.tensor")
    frame, pre = inp.get("frame"), inp.get("preprocess")
    if not isinstance(frame, dict) or not isinstance(pre, dict):
        raise AbiMismatch(f"{MANIFEST}: {where}.frame and {where}.preprocess are required")
    shape = inp["tensor"]["shape"]
    if version >= 2 and inp.get("takes") == "y_plane":
        # The Y plane as it lies in memory: [height, row_stride] uint8, width <= stride.
        dims = [frame.get(k) for k in ("height", "row_stride", "width")]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            raise AbiMismatch(f"{MANIFEST}: {where}.frame needs height, row_stride and "
                              f"width (positive ints)")
        if inp["tensor"]["dtype"] != "uint8" or shape != dims[:2] or dims[2] > dims[1]:
            raise AbiMismatch(f"{MANIFEST}: {where}.tensor {inp['tensor']['dtype']}{shape} "
                              f"is not the uint8 Y plane [height, row_stride] = {dims[:2]} "
                              f"with width {dims[2]} <= row_stride")
    elif shape[-2:] != [pre.get("out_height"), pre.get("out_width")]:
        raise AbiMismatch(f"{MANIFEST}: {where}.tensor.shape {shape} does not end in "
                          f"preprocess out_height x out_width "
                          f"({pre.get('out_height')}x{pre.get('out_width')})")


def _check_inputs(abi: dict) -> None:
    """Input ABI 3: ``abi.inputs``, a list of ABI-2 inputs each with a distinct ``name``
    and ``role`` (the worker role its frames come from; the first drives the model),
    and ``abi.pairing``: how frames of one instant are matched (by frame id, capture
    times at most ``max_skew_ms`` apart)."""
    inputs = abi.get("inputs")
    if "input" in abi:
        raise AbiMismatch(f"{MANIFEST}: abi.input is for input ABI 1-2; version 3 lists "
                          f"abi.inputs")
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise AbiMismatch(f"{MANIFEST}: abi.inputs must list 1 to {MAX_INPUTS} inputs")
    for key in ("name", "role"):
        vals = [i.get(key) if isinstance(i, dict) else None for i in inputs]
        if not all(isinstance(v, str) and _NAME_RE.match(v) for v in vals) or \
                len(set(vals)) != len(vals):
            raise AbiMismatch(f"{MANIFEST}: abi.inputs[*].{key} must be distinct names "
                              f"({vals})")
    for i, inp in enumerate(inputs):
        _check_input(inp, f"abi.inputs[{i}]", 3)
    pairing = abi.get("pairing")
    skew = pairing.get("max_skew_ms") if isinstance(pairing, dict) else None
    if (not isinstance(pairing, dict) or pairing.get("by") not in PAIRING_BY
            or not isinstance(skew, (int, float)) or isinstance(skew, bool)
            or not 0 < skew <= 1000):
        raise AbiMismatch(f"{MANIFEST}: abi.pairing needs by in {list(PAIRING_BY)} and "
                          f"max_skew_ms in (0, 1000]")


def _check_abi_consistency(m: dict) -> None:
    abi = _get(m, "abi", dict)
    version = abi.get("version", 1)
    out = abi.get("output")
    if isinstance(version, int) and not isinstance(version, bool) and version >= 3:
        _check_inputs(abi)
        if not isinstance(out, dict):
            raise AbiMismatch(f"{MANIFEST}: abi.output must be an object")
    else:
        if not isinstance(abi.get("input"), dict) or not isinstance(out, dict):
            raise AbiMismatch(f"{MANIFEST}: abi.input and abi.output must both be objects")
        _check_input(abi["input"], "abi.input", version)
    _check_tensor(out, "abi.output")
    fields = out.get("fields")
    if not isinstance(fields, list) or len(fields) != out["shape"][-1]:
        raise AbiMismatch(f"{MANIFEST}: abi.output.fields must name each of the "
                          f"{out['shape'][-1]} outputs")


def input_abis(abi: dict) -> list[dict]:
    """Every input of a checked ABI, in the order the model takes them."""
    return list(abi["inputs"]) if abi.get("version", 1) >= 3 else [abi["input"]]


def _match_subset(expected: Any, actual: Any, path: str) -> None:
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            raise AbiMismatch(f"{path}: artifact has {actual!r}, expected an object")
        for k, v in expected.items():
            if k not in actual:
                raise AbiMismatch(f"{path}.{k}: missing in the artifact, expected {v!r}")
            _match_subset(v, actual[k], f"{path}.{k}")
    elif expected != actual:
        raise AbiMismatch(f"{path}: artifact says {actual!r}, expected {expected!r}")


def _check_abi_version(expected: dict | list[dict], abi: dict) -> dict | None:
    """What input the artifact takes is its ABI version: say so in one line when it is
    not one the caller runs (e.g. a version 1 artifact, which took a float32 tensor
    preprocessed outside it, under a runtime that feeds the Y plane). Returns the
    expectation of the artifact's version (None: the caller named none)."""
    options = expected if isinstance(expected, list) else [expected]
    have = abi.get("version", 1)
    for e in options:
        if e.get("version") in (None, have):
            return e
    takes = (abi.get("input") or {}).get("takes", "a preprocessed float32 tensor")
    if isinstance(abi.get("inputs"), list):
        names = [i.get("name", "?") if isinstance(i, dict) else "?" for i in abi["inputs"]]
        takes = f"{len(names)} Y planes: {', '.join(map(str, names))}"
    wants = " or ".join(str(e.get("version")) for e in options)
    feeds = " or ".join(dict.fromkeys(
        (e.get("input") or e.get("each_input") or {}).get("takes", "?") for e in options))
    raise AbiMismatch(f"abi.version: the artifact's input ABI is {have} (it takes "
                      f"{takes}), this engine runs input ABI {wants} (it feeds "
                      f"{feeds}); rebuild it with workers.modelbuild")


def match_abi(expected: dict | list[dict], abi: dict) -> None:
    """``abi`` is one the caller runs: its version is among ``expected``'s, and every
    key that expectation gives has its value (``each_input``: every input of an ABI-3
    artifact has these)."""
    e = _check_abi_version(expected, abi)
    if e is None:
        return
    e = dict(e)
    each = e.pop("each_input", None)
    _match_subset(e, abi, "abi")
    if each is not None:
        for i, inp in enumerate(input_abis(abi)):
            _match_subset(each, inp, f"abi.inputs[{i}]")


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise HashMismatch(f"{KERNELS_FILE}: a cached object references {module}.{name}; "
                           f"only plain bytes are allowed")


def _read_kernels(db: Path, m: dict) -> tuple[dict[str, bytes], dict[str, str]]:
    """kernels.db must hold exactly the kernels the manifest lists, as plain bytes."""
    table = _get(m, "runtime.cache_table", str)
    listed = _get(m, "kernels", list)
    by_src_hash: dict[str, dict] = {}
    for i, k in enumerate(listed):
        if (not isinstance(k, dict) or not isinstance(k.get("name"), str)
                or not _HEX64.match(str(k.get("source_sha256")))
                or not _HEX64.match(str(k.get("object_sha256")))):
            raise ManifestError(f"{MANIFEST}: kernels[{i}] needs name, source_sha256, object_sha256")
        by_src_hash[k["source_sha256"]] = k
    uri = "file:" + str(db) + "?mode=ro&immutable=1"
    try:
        con = sqlite3.connect(uri, uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise HashMismatch(f"{KERNELS_FILE}: cannot open: {exc}") from None
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        if tables != [table]:
            raise HashMismatch(f"{KERNELS_FILE}: tables {tables}, the manifest says "
                               f"exactly [{table!r}]")
        rows = con.execute(f"SELECT key, val FROM '{table}'").fetchall()
    except sqlite3.Error as exc:
        raise HashMismatch(f"{KERNELS_FILE}: unreadable: {exc}") from None
    finally:
        con.close()
    kernels: dict[str, bytes] = {}
    names: dict[str, str] = {}
    for key, val in rows:
        if not isinstance(key, str) or not isinstance(val, bytes):
            raise HashMismatch(f"{KERNELS_FILE}: a row is not (text source, blob object)")
        sh = hashlib.sha256(key.encode()).hexdigest()
        ent = by_src_hash.get(sh)
        if ent is None:
            raise HashMismatch(f"{KERNELS_FILE}: holds a kernel (source sha256 {sh[:16]}...) "
                               f"that the manifest does not list")
        try:
            obj = _NoGlobals(io.BytesIO(val)).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise HashMismatch(f"{KERNELS_FILE}: kernel {ent['name']!r}: object is not a "
                               f"pickled bytes value: {exc}") from None
        if not isinstance(obj, bytes):
            raise HashMismatch(f"{KERNELS_FILE}: kernel {ent['name']!r}: object is "
                               f"{type(obj).__name__}, not bytes")
        if hashlib.sha256(obj).hexdigest() != ent["object_sha256"]:
            raise HashMismatch(f"{KERNELS_FILE}: kernel {ent['name']!r}: object sha256 "
                               f"differs from the manifest")
        kernels[key] = obj
        names[key] = ent["name"]
    if len(kernels) != len(by_src_hash):
        have = {hashlib.sha256(s.encode()).hexdigest() for s in kernels}
        lost = sorted(k["name"] for h, k in by_src_hash.items() if h not in have)
        raise HashMismatch(f"{KERNELS_FILE}: lacks kernels the manifest lists: {', '.join(lost)}")
    return kernels, names


def load_verified(path: str | os.PathLike, public_key: Any, *, expect_name: str | None = None,
                  expect_version: str | None = None,
                  expect_abi: dict | list[dict] | None = None,
                  min_version: str | None = None,
                  tmp_root: str | os.PathLike | None = None,
                  device_arch: str | None = None,
                  driver_version: str | None = None) -> VerifiedArtifact:
    """Verify the bundle at ``path`` against ``public_key`` (object, bytes or key file).

    A CUDA artifact (runtime.device "CUDA", see `supervisor.model.cuda`): ``device_arch``
    (the GPU's, e.g. "sm_90") picks the cubins handed on and refuses an artifact with
    none for it; ``driver_version`` refuses a driver older than the manifest's minimum.
    Without them (``supervisor check``, no GPU) every architecture's cubins are checked.

    Nothing from the bundle is unpickled, imported or mapped executable here; the
    returned object holds private, verified copies for the runtime to use.
    """
    src = Path(path)
    key = load_public_key(public_key)
    if not src.is_dir():
        raise MissingFile(f"artifact {src} is not a directory")

    # 1. signature over the exact manifest bytes, before the manifest is even parsed
    sig = _read_regular(src / SIGNATURE, 4096, what=SIGNATURE, missing=UnsignedArtifact)
    if not sig:
        raise UnsignedArtifact(f"{SIGNATURE}: empty; the artifact is unsigned")
    mbytes = _read_regular(src / MANIFEST, MAX_MANIFEST_BYTES, what=MANIFEST,
                           missing=UnsignedArtifact)
    verify(key, sig, mbytes, what=f"{src / SIGNATURE}")
    m = parse_manifest(mbytes)
    files = _check_files_section(m)
    if m.get("signing", {}).get("key_id") not in (None, key_id(key)):
        raise ManifestError(f"{MANIFEST}: signing.key_id does not name the key it verified with")

    # 2. every listed file copied privately and hashed; nothing unlisted
    try:
        present = sorted(os.listdir(src))
    except OSError as exc:
        raise MissingFile(f"artifact {src}: {exc.strerror or exc}") from None
    extra = [n for n in present if n not in files and n not in (MANIFEST, SIGNATURE)]
    if extra:
        raise UnlistedFile(f"artifact {src}: {', '.join(extra)} not listed in {MANIFEST} "
                           f"(unverified files are refused)")
    workdir = Path(tempfile.mkdtemp(prefix="model-artifact-", dir=tmp_root))  # 0700
    try:
        copies: dict[str, Path] = {}
        blobs: dict[str, bytes] = {}
        for name, ent in sorted(files.items()):
            data = _read_regular(src / name, MAX_FILE_BYTES, what=name, missing=MissingFile)
            if len(data) != ent["size"]:
                raise HashMismatch(f"{name}: {len(data)} bytes, the manifest says {ent['size']}")
            digest = hashlib.sha256(data).hexdigest()
            if digest != ent["sha256"]:
                raise HashMismatch(f"{name}: sha256 {digest[:16]}... differs from the "
                                   f"manifest's {ent['sha256'][:16]}...")
            copies[name] = _write_private(workdir, name, data)
            if _sha256_file(copies[name]) != digest:  # the copy is what will be used
                raise HashMismatch(f"{name}: private copy does not hash like what was read")
            blobs[name] = data

        # 3. what, for which runtime and host, with which ABI
        _check_model(m, expect_name, expect_version, min_version)
        payload = None
        if _get(m, "runtime.device", str) == _cuda.DEVICE:
            archs, arch = _cuda.check_runtime(m, device_arch=device_arch,
                                              driver_version=driver_version)
            _check_host_arch(m)
        else:
            _check_runtime(m)
            _check_host(m)
        _check_abi_consistency(m)
        if expect_abi is not None:
            match_abi(expect_abi, m["abi"])

        # 4. the objects are exactly the listed ones (read-only, no tinygrad involved)
        if m["runtime"]["device"] == _cuda.DEVICE:
            payload = _cuda.read_payload(m, blobs, arch, archs)
            _cuda.check_abi(payload.plan, input_abis(m["abi"]), m["abi"]["output"])
            kernels, names = {}, {}
        else:
            kernels, names = _read_kernels(copies[KERNELS_FILE], m)

        golden = None
        g = m.get("golden")
        if g is not None:
            gname = _get(m, "golden.file", str)
            if gname not in blobs:
                raise ManifestError(f"{MANIFEST}: golden.file {gname!r} is not a listed file")
            gi, go = _get(m, "golden.input_bytes", int), _get(m, "golden.output_bytes", int)
            gb = blobs[gname]
            if gi + go != len(gb):
                raise ManifestError(f"{MANIFEST}: golden input+output bytes {gi}+{go} != "
                                    f"{gname} size {len(gb)}")
            golden = (gb[:gi], gb[gi:])
        return VerifiedArtifact(
            source=src, workdir=workdir, manifest=m, manifest_bytes=mbytes,
            manifest_sha256=hashlib.sha256(mbytes).digest(), key_id=key_id(key),
            files=copies, jit_bytes=blobs.get(JIT_FILE, b""), kernels=kernels,
            kernel_names=names, golden=golden, cuda=payload)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


# ------------------------------------------------------------------ build side

def file_entry(path: str | os.PathLike, **extra: Any) -> dict:
    p = Path(path)
    return {"sha256": _sha256_file(p), "size": p.stat().st_size, **extra}


def write_signed(bundle: str | os.PathLike, manifest: dict, private_key: Any) -> bytes:
    """Write ``manifest`` canonically and its signature into ``bundle``; returns the bytes.

    ``private_key``: an Ed25519PrivateKey. The caller lists the files (see `file_entry`).
    """
    from .keys import key_id as _kid

    d = Path(bundle)
    manifest = dict(manifest)
    manifest["signing"] = {"algorithm": "ed25519", "key_id": _kid(private_key.public_key()),
                           "signed": MANIFEST, "signature": SIGNATURE}
    data = canonical_json(manifest)
    (d / MANIFEST).write_bytes(data)
    (d / SIGNATURE).write_bytes(private_key.sign(data))
    return data


def refresh_file_entries(bundle: str | os.PathLike, manifest: dict) -> dict:
    """Re-hash every listed file (after editing one); keeps each entry's other keys."""
    d = Path(bundle)
    m = json.loads(json.dumps(manifest))
    for name, ent in m["files"].items():
        ent.update(file_entry(d / name))
    return m


def read_manifest_unverified(bundle: str | os.PathLike) -> dict:
    """For build tools and tests only: the manifest as stored, with no checks."""
    return json.loads((Path(bundle) / MANIFEST).read_bytes())
