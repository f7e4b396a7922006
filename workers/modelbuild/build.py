"""Build and sign a model artifact (build/R&D side: needs clang, never runs in a vehicle).

    python -m workers.modelbuild --out DIR [--key KEYFILE] [--seed N] [--pubkey-out FILE]

Steps, in one fresh process (tinygrad is configured before it is imported):

1. tinygrad for the target ``CPU:CLANG:<arch>,<x86-64 level>`` (a named ISA level, not
   ``native``, so the objects run on any CPU with that level; the manifest lists the CPU
   flags it needs), ``PARALLEL=0`` so every compile happens here and is recorded,
   ``CACHEDB`` in a fresh temp dir.
2. Open the CPU device: its four worker programs are compiled now (recorded as role
   "device-init").
3. Render synthetic frames, preprocess them with modeld's own `preprocess_y` (the numpy
   reference), run the fixed conv trunk (batched), fit the linear head by ridge least
   squares against the frames' truth, calibrate the confidence.
4. Capture the deployed function with TinyJit on sample Y planes (uint8
   [height, row_stride], input ABI 2): crop, area mean and normalisation as tinygrad
   kernels (`preprocess.Preprocess`), then the network. Every validation frame is run
   both ways, deployed (Y plane in) and reference (numpy preprocessing, the same
   network): the outputs must be bit-identical, and so must the preprocessed tensors
   (the manifest declares tolerance 0 and records what was checked). Strip the compiled
   objects out of the captured graph (jit.pkl keeps graph, C sources and weights) and put
   every object the runtime needs into kernels.db (tinygrad's cache table format).
5. golden.bin (a sample input and this build's output for it), manifest.json (canonical
   JSON, sha256 of every file, ABI, target, CPU flags, training record), manifest.sig.
6. Rehearsal: ``python -m workers.modeld.selftest`` in a fresh process loads the signed
   bundle exactly as modeld will (verify, no compile) and must reproduce golden.bin.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from supervisor.model import artifact as A
from supervisor.model import host as H
from supervisor.model import keys as K
from supervisor.model.runtime import PINNED_ENV, kernel_name, tinygrad_imported
from workers.modeld.engine import (ABI_VERSION, ABI_VERSION_MULTI, ENGINE_ABIS, INPUT_TAKES,
                                   preprocess_spec, preprocess_y)

from . import cuda as CU
from .model import LaneNet, conv_weights, fit_head
from .preprocess import Geometry, Preprocess
from .synthetic import driver_class, road_class

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_NAME = "lane-offset-demo"
DEFAULT_VERSION = "1.0.0"
DEVICE_INIT = ("signal_prog", "wait_prog", "timestamp_prog", "worker_prog")
ROW_ALIGN = 16      # default row stride: width rounded up to 16 (1928 -> 1936, as PyAV's)


@dataclass(frozen=True)
class ExtraInput:
    """A further camera a model of input ABI 3 takes (after the first, ``frames``)."""
    name: str                     # abi.inputs[i].name
    role: str                     # the worker role its frames arrive on (modeld: wide)
    sensor: str                   # workers.camerad.synthetic.scene(sensor): what it shows
    crop_top: tuple[int, int]


@dataclass(frozen=True)
class ModelKind:
    """What a kind of model sees, learns and says (the build is the same for each)."""
    scene: str                    # "road" or "driver": modelbuild.synthetic's class
    default_name: str
    input_name: str
    description: str
    targets: tuple[str, str]      # the two fitted outputs (the third is the confidence)
    payload: str                  # schemas/payloads.py name of the output
    units: list[str]
    conventions: str
    crop_top: tuple[int, int]     # crop_top_num, crop_top_den
    probabilities: bool           # head clipped to [0, 1]
    # Input ABI 3: more cameras of the same instant, each preprocessed in the artifact
    # and through the same trunk; the head sees every camera's features side by side.
    extra: tuple[ExtraInput, ...] = ()
    max_skew_ms: float = 25.0     # abi.pairing: capture times of one instant, at most

    @property
    def sensors(self) -> tuple[str, ...]:
        return (self.scene, *(e.sensor for e in self.extra))

    @property
    def crops(self) -> tuple[tuple[int, int], ...]:
        return (self.crop_top, *(e.crop_top for e in self.extra))


KINDS: dict[str, ModelKind] = {
    "lane": ModelKind(
        "road", DEFAULT_NAME, "road_y",
        "lane offset/heading regressor on the NV12 Y plane: crop + area mean in the "
        "artifact, fixed seeded conv trunk, ridge-fitted linear head (demo)",
        ("offset_m", "heading_rad"), "model_out", ["m", "rad", "1", ""],
        "offset_m + = car right of lane centre; heading_rad + = car pointing right of "
        "the lane; confidence in [0, 1]; reserved = 0", (2, 5), False),
    "driver": ModelKind(
        "driver", "driver-monitor-demo", "driver_y",
        "driver monitoring on the driver camera's NV12 Y plane: area mean in the "
        "artifact, fixed seeded conv trunk, ridge-fitted head clipped to [0, 1] (demo)",
        ("face_prob", "eyes_on_road_prob"), "driver_state", ["1", "1", "1", ""],
        "face_prob: a face is in view; eyes_on_road_prob: the driver looks at the road "
        "(0 when head down or no face); both in [0, 1]; confidence as the lane model's; "
        "reserved = 0", (0, 1), True),
    "lane_wide": ModelKind(
        "road", "lane-offset-wide-demo", "road_y",
        "lane offset/heading regressor on two NV12 Y planes of one instant, the road "
        "camera (40 deg) and the wide road camera (120 deg): crop + area mean of each in "
        "the artifact, the fixed seeded conv trunk on each, one ridge-fitted linear head "
        "on both cameras' features (demo; input ABI 3)",
        ("offset_m", "heading_rad"), "model_out", ["m", "rad", "1", ""],
        "offset_m + = car right of lane centre; heading_rad + = car pointing right of "
        "the lane; confidence (from the road camera's lane-edge energy) in [0, 1]; "
        "reserved = 0", (2, 5), False,
        extra=(ExtraInput("wide_y", "wide", "wide", (2, 5)),)),
}


def _truth(kind: ModelKind, truth) -> tuple[float, float]:
    if kind.scene == "driver":
        return float(truth.face_present), float(truth.eyes_on_road)
    return truth.offset_m, truth.heading_rad


def strided_plane(y: np.ndarray, row_stride: int, fill: int = 0) -> np.ndarray:
    """The Y plane as it lies in a frame with ``row_stride``: uint8 [h, row_stride],
    padding columns set to ``fill`` (never read by the model)."""
    h, w = y.shape
    buf = np.full((h, row_stride), fill, np.uint8)
    buf[:, :w] = y
    return buf


def default_key_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "trio-modelbuild" / "signing_ed25519.key"


def _inside(p: Path, root: Path) -> bool:
    try:
        p.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def signing_key(path: Path) -> tuple[object, bool]:
    """Load the private key at ``path`` or create it there; never inside the repository."""
    if _inside(path, PROJECT_ROOT):
        raise SystemExit(f"modelbuild: refusing a private key inside the repository ({path}); "
                         f"keep it outside, e.g. {default_key_path()}")
    if path.exists():
        return K.load_private_key(path), False
    return K.generate_private_key(path), True


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists():
        entries = list(out.iterdir())
        if entries and not force:
            raise SystemExit(f"modelbuild: {out} is not empty (use --force to replace the bundle)")
        for e in entries:
            if e.is_dir() and not e.is_symlink():
                raise SystemExit(f"modelbuild: {out} holds a directory {e.name}; not a bundle")
            e.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _frame_ids(seeds, n_per_seed, rng_seed):
    for s in seeds:
        for fid in np.random.default_rng([rng_seed, s]).integers(0, 200_000, n_per_seed):
            yield s, int(fid)


def _scene(kind: ModelKind, k: int, width: int, height: int, seed: int):
    """Input k's synthetic camera (k = 0: the kind's own scene class)."""
    if k == 0:
        cls, _ = road_class() if kind.scene == "road" else driver_class()
        return cls(width, height, seed=seed)
    from workers.camerad.synthetic import scene

    return scene(kind.sensors[k], width, height, seed)


def _frames(kind, width, height, seeds, n_per_seed, specs, rng_seed):
    """Preprocessed inputs (one float32 stack per input: the cameras of one instant,
    the same frame id of the same drive) and the truth of the first camera's scene."""
    Xs, T = [[] for _ in specs], []
    scenes = {s: [_scene(kind, k, width, height, s) for k in range(len(specs))] for s in seeds}
    for s, fid in _frame_ids(seeds, n_per_seed, rng_seed):
        for k, (sc, spec) in enumerate(zip(scenes[s], specs)):
            y, _uv, truth = sc.render(fid)
            Xs[k].append(preprocess_y(y, spec)[0].copy())
            if k == 0:
                T.append(_truth(kind, truth))
    return [np.stack(X).astype(np.float32) for X in Xs], np.asarray(T, np.float64)


def build(out: Path, key_path: Path, *, seed: int = 0, frames: int = 1600,
          val_frames: int = 300, width: int = 1928, height: int = 1208,
          row_stride: int | None = None, kind: str = "lane",
          cpu: str | None = None, name: str | None = None, version: str = DEFAULT_VERSION,
          pubkey_out: Path | None = None, force: bool = False, rehearse: bool = True,
          device: str = "cpu", archs: tuple[str, ...] = (),
          lams: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0, 1000.0), log=print) -> dict:
    t_start = time.monotonic()
    if kind not in KINDS:
        raise SystemExit(f"modelbuild: unknown model kind {kind!r} (known: {', '.join(KINDS)})")
    mk = KINDS[kind]
    name = name or mk.default_name
    row_stride = row_stride or -(-width // ROW_ALIGN) * ROW_ALIGN
    if row_stride < width:
        raise SystemExit(f"modelbuild: row stride {row_stride} < width {width}")
    if _inside(key_path, PROJECT_ROOT):
        raise SystemExit(f"modelbuild: refusing a private key inside the repository "
                         f"({key_path}); keep it outside, e.g. {default_key_path()}")
    if tinygrad_imported():
        raise SystemExit("modelbuild: tinygrad is already imported in this process; run the "
                         "build in a fresh process (python -m workers.modelbuild)")
    machine = H.machine()
    if machine != "x86_64":
        raise SystemExit(f"modelbuild: only x86_64 targets are supported so far ({machine})")
    level = cpu or H.best_level()
    need_flags = list(H.level_flags(level))
    missing = sorted(set(need_flags) - H.cpu_flags())
    if missing:
        raise SystemExit(f"modelbuild: this host cannot run {level} objects (lacks "
                         f"{', '.join(missing)}), so it cannot rehearse them")
    arch_string = f"{machine},{level}"
    target = f"CPU:CLANG:{arch_string}"
    if shutil.which(os.environ.get("CC", "clang")) is None:
        raise SystemExit("modelbuild: clang is needed to build (apt-get install -y clang)")

    cuda = None
    if device == "cuda":
        nvrtc = CU.find_nvrtc()
        if nvrtc is None:
            raise SystemExit("modelbuild: --device cuda needs NVRTC: pip install "
                             "'nvidia-cuda-nvrtc-cu12>=12.4,<13' (extra cuda-build) or set "
                             "NVRTC_PATH to libnvrtc.so")
        cuda = {"archs": list(archs) or ["sm_90"], "nvrtc": nvrtc,
                "toolkit": CU.nvrtc_version(nvrtc)}
    elif device != "cpu":
        raise SystemExit(f"modelbuild: --device {device!r}: cpu or cuda")
    key, created = signing_key(key_path)
    pub = key.public_key()
    if created:
        log(f"modelbuild: new signing key {key_path} (key id {K.key_id(pub)[:16]}...)")
    _prepare_out(out, force)
    tmp = Path(tempfile.mkdtemp(prefix="modelbuild-"))
    os.environ.update(PINNED_ENV, DEV=target, CACHEDB=str(tmp / "build-cache.db"))
    if cuda is not None:
        # The CPU build goes to a scratch bundle (its output is the CUDA golden's
        # reference); the CUDA bundle is what lands in ``out``.
        os.environ.update(DEV=CU.dev_string(target, cuda["archs"]), NVRTC_PATH=cuda["nvrtc"])
        cuda["out"], out = out, tmp / "cpu-bundle"
        out.mkdir()
        rehearse = False
    try:
        return _build(out, key, pub, tmp, cuda=cuda, target=target, arch_string=arch_string, level=level,
                      need_flags=need_flags, seed=seed, frames=frames, val_frames=val_frames,
                      width=width, height=height, row_stride=row_stride, kind=mk,
                      name=name, version=version,
                      pubkey_out=pubkey_out or key_path.with_suffix(".pub"),
                      rehearse=rehearse, lams=lams, log=log, t_start=t_start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build(out, key, pub, tmp, *, cuda=None, target, arch_string, level, need_flags, seed, frames,
           val_frames, width, height, row_stride, kind, name, version, pubkey_out, rehearse,
           lams, log, t_start):
    import tinygrad.helpers as TH
    from tinygrad import Device, Tensor, TinyJit
    from tinygrad.device import Compiler
    from tinygrad.uop.ops import Ops

    # Every compile of this process, in order, with what it was for.
    compiled: dict[str, dict] = {}
    phase = ["device-init"]
    orig_cc = Compiler.compile_cached

    def recording(self, src: str) -> bytes:
        lib = orig_cc(self, src)
        compiled.setdefault(src, {"cachekey": self.cachekey, "lib": lib, "phase": phase[0],
                                  "name": kernel_name(src)})
        return lib

    Compiler.compile_cached = recording
    dev = Device["CPU"]
    if type(dev.renderer).__name__ != "ClangRenderer":
        raise SystemExit(f"modelbuild: tinygrad picked {type(dev.renderer).__name__} for {target}")
    cachekey = dev.compiler.cachekey
    init_srcs = [s for s, c in compiled.items() if c["phase"] == "device-init"]
    if sorted(compiled[s]["name"] for s in init_srcs) != sorted(DEVICE_INIT):
        raise SystemExit(f"modelbuild: device init compiled {[compiled[s]['name'] for s in init_srcs]}"
                         f", expected {list(DEVICE_INIT)} (tinygrad changed?)")
    phase[0] = "build"

    specs = [preprocess_spec(crop_top_num=n, crop_top_den=d) for n, d in kind.crops]
    spec = specs[0]
    geoms = [Geometry.of(sp, height, width, row_stride) for sp in specs]
    n_in = len(specs)
    road_cls, road_name = road_class() if kind.scene == "road" else driver_class()
    if kind.extra:
        road_name += " + " + ", ".join(f"workers.camerad.synthetic.scene({e.sensor!r})"
                                       for e in kind.extra)
    weights = conv_weights(seed)
    net = LaneNet(weights)
    net.clip01 = kind.probabilities
    train_seeds = [seed * 1000 + i for i in range(4)]
    val_seed = seed * 1000 + 999
    per_seed = max(1, frames // len(train_seeds))
    t0 = time.monotonic()
    Xtrs, Ttr = _frames(kind, width, height, train_seeds, per_seed, specs, seed)
    Xvas, Tva = _frames(kind, width, height, [val_seed], val_frames, specs, seed)
    Xtr, Xva = Xtrs[0], Xvas[0]
    log(f"modelbuild: {len(Xtr)}+{len(Xva)} frames x {n_in} camera(s) from {road_name} "
        f"{width}x{height} in {time.monotonic() - t0:.1f}s")

    # Features of the training frames (batched; these kernels are not shipped).
    B = 32
    feat_jit = TinyJit(lambda x: [t.realize() for t in net.features(x)])

    def features(X):
        fs, es = [], []
        for i in range(0, len(X), B):
            xb = X[i:i + B]
            pad = B - len(xb)
            if pad:
                xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), np.float32)])
            f, e = feat_jit(Tensor(np.ascontiguousarray(xb), device="CPU").realize())
            fs.append(f.numpy()[:B - pad].copy())
            es.append(e.numpy()[:B - pad].copy())
        return np.concatenate(fs), np.concatenate(es)

    # Every camera through the same trunk; the head sees them side by side (the
    # confidence is the first camera's lane-edge energy, as the one-camera model's).
    fe = [features(X) for X in Xtrs]
    Ftr, Etr = np.concatenate([f for f, _ in fe], axis=1), fe[0][1]
    # Ridge strength: chosen on the last training seed held out, then refit on all.
    n_fit = per_seed * (len(train_seeds) - 1)
    scale = Ttr.std(0) + 1e-9
    lam_scores = {}
    for cand in lams:
        W_, b_ = fit_head(Ftr[:n_fit], Ttr[:n_fit], cand)
        err = ((Ftr[n_fit:] @ W_ + b_ - Ttr[n_fit:]) / scale) ** 2
        lam_scores[cand] = float(err.mean())
    lam = min(lam_scores, key=lam_scores.get)
    Wh, bh = fit_head(Ftr, Ttr, lam)
    log(f"modelbuild: ridge lambda {lam} (held-out normalised mse "
        f"{', '.join(f'{k:g}: {v:.4f}' for k, v in lam_scores.items())})")
    e_typ = float(np.median(Etr))
    conf_e0, conf_k = np.float32(0.5 * e_typ), np.float32(8.0 / max(e_typ, 1e-6))

    # The deployed function, captured on sample Y planes: preprocessing, then the net.
    net.t["head_w"] = Tensor(np.ascontiguousarray(Wh), device="CPU").realize()
    net.t["head_b"] = Tensor(bh, device="CPU").realize()
    net.t["conf_e0"] = Tensor(np.array([conf_e0], np.float32), device="CPU").realize()
    net.t["conf_k"] = Tensor(np.array([conf_k], np.float32), device="CPU").realize()
    pres = [Preprocess(g, sp) for g, sp in zip(geoms, specs)]
    val_scenes = [_scene(kind, k, width, height, val_seed) for k in range(n_in)]
    val_ids = [fid for _s, fid in _frame_ids([val_seed], val_frames, seed)]

    def val_planes(i: int) -> list[np.ndarray]:
        # padding bytes vary with the frame and the camera: they must never matter
        return [strided_plane(sc.render(val_ids[i])[0], row_stride, fill=(37 * i + 101 * k) % 256)
                for k, sc in enumerate(val_scenes)]

    def tensors(arrs):
        return [Tensor(np.ascontiguousarray(a), device="CPU").realize() for a in arrs]

    phase[0] = "model"
    # One camera: f(y); several: f(y0, y1, ...), in abi.inputs order.
    jit = TinyJit(lambda *ys: net.forward(*[p(y) for p, y in zip(pres, ys)]).realize())
    for i in range(3):
        jit(*tensors(val_planes(i)))
    cap = jit.captured
    if cap is None:
        raise SystemExit("modelbuild: TinyJit captured nothing")

    def run_deployed(yps):
        return jit(*tensors(yps)).numpy().copy()

    # The reference: numpy preprocessing, the same network (compiled here, not shipped).
    phase[0] = "check"
    ref_jit = TinyJit(lambda *xs: net.forward(*xs).realize())
    pre_jits = [TinyJit(lambda y, p=p: p(y).realize()) for p in pres]
    P = np.empty((len(Xva), 4), np.float32)
    out_diff = pre_diff = 0.0
    for i in range(len(Xva)):
        yps = val_planes(i)
        P[i] = run_deployed(yps)
        ref = ref_jit(*tensors([X[i:i + 1] for X in Xvas])).numpy()
        out_diff = max(out_diff, float(np.abs(P[i] - ref).max()))
        same = P[i].tobytes() == ref.tobytes()
        for k, (pj, yp) in enumerate(zip(pre_jits, yps)):
            xin = pj(Tensor(yp, device="CPU").realize()).numpy()
            pre_diff = max(pre_diff, float(np.abs(xin - Xvas[k][i:i + 1]).max()))
            same = same and xin.tobytes() == Xvas[k][i:i + 1].tobytes()
        if not same:
            raise SystemExit(f"modelbuild: validation frame {i}: the artifact's preprocessing "
                             f"differs from the numpy reference (input max |diff| {pre_diff}, "
                             f"output {out_diff}); tolerance 0 is declared")
    log(f"modelbuild: {len(Xva)} validation frames bit-identical to the numpy reference "
        f"(preprocessed input{'s' if n_in > 1 else ''} and output)")
    phase[0] = "model"
    rmse = np.sqrt(((P[:, :2] - Tva) ** 2).mean(0))
    blank = strided_plane(np.full((height, width), 100, np.uint8), row_stride)
    conf_blank = float(run_deployed([blank] * n_in)[2])
    log(f"modelbuild: validation rmse {kind.targets[0]} {rmse[0]:.4f} (std {Tva[:, 0].std():.3f}), "
        f"{kind.targets[1]} {rmse[1]:.5f} (std {Tva[:, 1].std():.4f}); confidence median "
        f"{float(np.median(P[:, 2])):.3f}, on a blank frame {conf_blank:.3f}")

    # Strip the objects out of the captured graph; collect them for kernels.db.
    progs = [u for u in cap._linear.toposort() if u.op is Ops.PROGRAM]
    model_kernels: dict[str, bytes] = {}
    model_names: dict[str, str] = {}
    for p in progs:
        if len(p.src) != 4 or p.src[2].op is not Ops.SOURCE or p.src[3].op is not Ops.BINARY:
            raise SystemExit(f"modelbuild: unexpected PROGRAM layout {[s.op for s in p.src]}")
        src, lib = p.src[2].arg, p.src[3].arg
        if compiled.get(src, {}).get("lib") not in (None, lib):
            raise SystemExit(f"modelbuild: object of {p.arg.function_name} differs from the compile log")
        model_kernels[src] = lib
        model_names[src] = p.arg.function_name
    stripped = cap._linear.substitute({p: p.replace(src=p.src[:3]) for p in progs}, walk=True,
                                      enter_calls=True)
    left = [u for u in stripped.toposort() if u.op is Ops.PROGRAM and len(u.src) != 3]
    if left:
        raise SystemExit(f"modelbuild: {len(left)} programs kept their objects after stripping")
    from tinygrad.engine.jit import CapturedJit

    # golden output first, then drop the intermediate buffers' contents (only the weights
    # need to travel in jit.pkl; intermediates are reallocated at load)
    gins = val_planes(0)
    gout = run_deployed(gins)
    (out / A.GOLDEN_FILE).write_bytes(b"".join(g.tobytes() for g in gins) + gout.tobytes())
    if cuda is not None:
        # The same function on NULL with the CUDA renderer: same weights, same
        # preprocessing constants, captured into a launch plan (see modelbuild.cuda).
        CU.keep_null_bytes()
        cnet = LaneNet({k: v for k, v in weights.items()}, device="NULL")
        cnet.clip01 = kind.probabilities
        for k, v in (("head_w", Wh), ("head_b", bh),
                     ("conf_e0", np.array([conf_e0], np.float32)),
                     ("conf_k", np.array([conf_k], np.float32))):
            cnet.t[k] = Tensor(np.ascontiguousarray(v), device="NULL").realize()
        cpres = [Preprocess(g, sp, device="NULL") for g, sp in zip(geoms, specs)]
        cin = [Tensor(np.ascontiguousarray(g), device="NULL").realize() for g in gins]
        cc = CU.capture(lambda *ys: cnet.forward(*[p(y) for p, y in zip(cpres, ys)]).realize(),
                        cin, int(gout.nbytes))
        CU.compile_all(cc, cuda["archs"])
        cuda["emulated"] = CU.emulate_check(cc, gins, gout, CU.golden_tolerance())
        cuda["capture"] = cc
        cuda["golden"] = (b"".join(g.tobytes() for g in gins) + gout.tobytes(),
                          (int(sum(g.nbytes for g in gins)), int(gout.nbytes)))
        log(f"modelbuild: CUDA: {len(cc.plan['calls'])} kernel calls, "
            f"{len(cc.plan['buffers'])} buffers, cubins for {', '.join(cuda['archs'])} "
            f"(NVRTC {cuda['toolkit']}); the plan emulated on the CPU matches the CPU "
            f"build within {cuda['emulated']['max_abs']:.3g}")
    cap.free_intermediates()
    jit_bytes = pickle.dumps(CapturedJit(cap.ret, stripped, cap.expected_names,
                                         cap.expected_input_info), protocol=5)
    if b"\x7fELF" in jit_bytes:
        raise SystemExit("modelbuild: jit.pkl still contains an ELF object")

    # kernels.db: tinygrad's cache table, exactly the objects the runtime needs.
    table = f"{cachekey}_{TH.VERSION}"
    rows: list[tuple[str, bytes, str, str]] = []
    for s in init_srcs:
        rows.append((s, compiled[s]["lib"], compiled[s]["name"], "device-init"))
    for s, lib in model_kernels.items():
        rows.append((s, lib, model_names[s], "model"))
    rows.sort(key=lambda r: (r[3], r[2]))
    kdb = out / A.KERNELS_FILE
    con = sqlite3.connect(kdb)
    con.execute(f"CREATE TABLE '{table}' (key text, val blob, PRIMARY KEY (key))")
    con.executemany(f"INSERT INTO '{table}' (key, val) VALUES (?, ?)",
                    [(s, pickle.dumps(lib)) for s, lib, _, _ in rows])
    con.commit()
    con.execute("VACUUM")
    con.close()
    for suffix in ("-journal", "-wal", "-shm"):
        if (out / (A.KERNELS_FILE + suffix)).exists():
            raise SystemExit(f"modelbuild: sqlite left {A.KERNELS_FILE}{suffix} behind")
    (out / A.JIT_FILE).write_bytes(jit_bytes)


    import hashlib

    in_shape = [height, row_stride]

    def input_abi(k: int, name: str) -> dict:
        return {
            "name": name,
            "takes": INPUT_TAKES,
            "frame": {"pixel_format": "nv12", "plane": "y", "dtype": "uint8",
                      "pixel_range": "full", "width": width, "height": height,
                      "row_stride": row_stride, "min_width": width, "min_height": height,
                      "channel_kind": "frame"},
            "preprocess": dict(specs[k], in_artifact=True, tolerance={
                "max_abs": 0.0, "reference": "workers.modeld.engine.preprocess_y",
                "checked_frames": int(len(Xva)), "max_abs_seen_input": pre_diff,
                "max_abs_seen_output": out_diff}),
            "tensor": {"dtype": "uint8", "shape": in_shape, "strides": [row_stride, 1],
                       "byte_offset": 0, "layout": "HW",
                       "meaning": "the Y plane as it lies in the frame: rows at "
                                  "row_stride, columns >= width are padding (never read)"},
        }

    output_abi = {"dtype": "float32", "shape": [4], "strides": [4], "byte_offset": 0,
                  "layout": "vector", "payload": kind.payload,
                  "fields": [*kind.targets, "confidence", "reserved"],
                  "units": kind.units, "conventions": kind.conventions}
    if kind.extra:
        # Input ABI 3: every camera, its role and sensor; frames of one instant.
        inputs = [dict(input_abi(0, kind.input_name), role="frames", sensor=kind.scene)]
        inputs += [dict(input_abi(k, e.name), role=e.role, sensor=e.sensor)
                   for k, e in enumerate(kind.extra, 1)]
        abi = {"version": ABI_VERSION_MULTI, "inputs": inputs, "output": output_abi,
               "pairing": {"by": "frame_id", "max_skew_ms": kind.max_skew_ms,
                           "meaning": "the frames of one inference carry one frame id "
                                      "(cameras on one trigger) and capture times at "
                                      "most max_skew_ms apart"}}
    else:
        abi = {"version": ABI_VERSION, "input": input_abi(0, kind.input_name),
               "output": output_abi}
    manifest = {
        "format": A.FORMAT,
        "model": {
            "name": name, "version": version,
            "created_utc": _created_utc(),
            "description": kind.description,
        },
        "runtime": {
            "framework": "tinygrad", "tinygrad_version": _tg_version(),
            "device": "CPU", "renderer": "CLANG", "target": target,
            "compiler": "clang", "compiler_version": _clang_version(),
            "cache_table": table, "cache_version": TH.VERSION,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        },
        "host": {
            "arch": H.machine(), "byteorder": sys.byteorder, "cpu": level,
            "required_cpu_flags": need_flags, "os": "linux",
        },
        "files": {
            A.JIT_FILE: A.file_entry(out / A.JIT_FILE, role="captured TinyJit: graph, C "
                                     "sources and weights; no machine code"),
            A.KERNELS_FILE: A.file_entry(kdb, role="tinygrad compile cache: every object "
                                         "the runtime loads"),
            A.GOLDEN_FILE: A.file_entry(out / A.GOLDEN_FILE, role="power-on self-test "
                                        "input and expected output"),
        },
        "kernels": [
            {"name": n, "role": role, "source_sha256": hashlib.sha256(s.encode()).hexdigest(),
             "object_sha256": hashlib.sha256(lib).hexdigest(), "object_size": len(lib)}
            for s, lib, n, role in rows
        ],
        "abi": abi,
        "golden": {"file": A.GOLDEN_FILE, "input_bytes": int(sum(g.nbytes for g in gins)),
                   "output_bytes": int(gout.nbytes)},
        "training": {
            "generator": road_name, "render_size": [width, height], "seed": seed,
            "kind": [k for k, v in KINDS.items() if v is kind][0], "targets": list(kind.targets),
            "train_seeds": train_seeds, "val_seed": val_seed,
            "train_frames": int(len(Xtr)), "val_frames": int(len(Xva)),
            "head": "ridge least squares on standardised features, folded", "ridge_lambda": lam,
            "ridge_lambda_scores": {f"{k:g}": round(v, 6) for k, v in lam_scores.items()},
            f"val_rmse_{kind.targets[0]}": round(float(rmse[0]), 6),
            f"val_rmse_{kind.targets[1]}": round(float(rmse[1]), 7),
            f"val_std_{kind.targets[0]}": round(float(Tva[:, 0].std()), 6),
            f"val_std_{kind.targets[1]}": round(float(Tva[:, 1].std()), 7),
            "confidence": {"edge_energy_median": round(e_typ, 6), "e0": float(conf_e0),
                           "k": float(conf_k), "median_val": round(float(np.median(P[:, 2])), 6),
                           "blank_frame": round(conf_blank, 6)},
        },
    }
    A._check_abi_consistency(manifest)
    A.match_abi(ENGINE_ABIS, manifest["abi"])  # the engine can run it
    from workers.modeld.engine import check_output_payload

    check_output_payload(manifest["abi"]["output"])
    if cuda is not None:
        out = cuda["out"]
        manifest = CU.write_bundle(out, cuda["capture"], cuda["archs"], cuda["toolkit"],
                                   manifest, *cuda["golden"], CU.golden_tolerance(),
                                   emulated=cuda["emulated"])
        rows = []
        target = manifest["runtime"]["target"]
    mbytes = A.write_signed(out, manifest, key)
    pubkey_out.parent.mkdir(parents=True, exist_ok=True)
    pubkey_out.write_text(K.public_key_text(pub))

    summary = {
        "out": str(out), "pubkey": str(pubkey_out), "key_id": K.key_id(pub),
        "manifest_sha256": hashlib.sha256(mbytes).hexdigest(), "target": target,
        "kernels": [r[2] for r in rows] or [k["name"] for k in manifest["kernels"]],
        "bytes": sum(f.stat().st_size for f in out.iterdir()),
        f"val_rmse_{kind.targets[0]}": float(rmse[0]),
        f"val_rmse_{kind.targets[1]}": float(rmse[1]), "generator": road_name,
        "preprocess_checked_frames": int(len(Xva)),
    }
    if rehearse:
        summary["rehearsal"] = rehearse_bundle(out, pubkey_out, width=width, height=height,
                                               scene=kind.scene)
    summary["seconds"] = round(time.monotonic() - t_start, 2)
    return summary


def rehearse_bundle(out: Path, pubkey: Path, *, width: int, height: int,
                    scene: str = "road") -> dict:
    """Load the signed bundle in a fresh process the way modeld does; golden must match."""
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV and k not in ("DEV", "CACHEDB")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-m", "workers.modeld.selftest", "--artifact", str(out),
                          "--pubkey", str(pubkey), "--frames", "2", "--width", str(width),
                          "--height", str(height), "--scene", scene],
                         capture_output=True, text=True, env=env, timeout=300)
    try:
        rep = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        rep = {"ok": False}
    if res.returncode != 0 or not rep.get("ok") or rep.get("compile", {}).get("refused"):
        raise SystemExit(f"modelbuild: rehearsal failed (rc {res.returncode}):\n{res.stdout}\n{res.stderr}")
    return {"ok": True, "golden_ok": rep["info"]["golden_ok"],
            "served": rep["compile"]["served_total"]}


def _created_utc() -> str:
    sde = os.environ.get("SOURCE_DATE_EPOCH")
    t = _dt.datetime.fromtimestamp(int(sde), _dt.timezone.utc) if sde else _dt.datetime.now(_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _tg_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("tinygrad")


def _clang_version() -> str:
    try:
        r = subprocess.run([os.environ.get("CC", "clang"), "--version"], capture_output=True,
                           text=True, timeout=30)
        return r.stdout.splitlines()[0].strip() if r.stdout else "unknown"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.modelbuild",
                                description="build and sign a tinygrad model artifact")
    p.add_argument("--out", required=True, type=Path, help="bundle directory to write")
    p.add_argument("--key", type=Path, default=None,
                   help=f"ed25519 private key (PEM); created if absent (default {default_key_path()})")
    p.add_argument("--pubkey-out", type=Path, default=None,
                   help="where to write the public key (hex); default KEY.pub")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=1600, help="training frames")
    p.add_argument("--val-frames", type=int, default=300)
    p.add_argument("--width", type=int, default=1928)
    p.add_argument("--height", type=int, default=1208)
    p.add_argument("--cpu", default=None, help="x86-64 level to compile for (default: best <= v3)")
    p.add_argument("--row-stride", type=int, default=None,
                   help=f"Y plane row stride the artifact takes (default: width rounded up "
                        f"to {ROW_ALIGN}, e.g. 1936 for 1928)")
    p.add_argument("--kind", choices=sorted(KINDS), default="lane",
                   help="lane: road camera -> model_out; lane_wide: road + wide road "
                        "cameras -> model_out (input ABI 3); driver: driver camera -> "
                        "driver_state")
    p.add_argument("--name", default=None, help="model name (default per --kind)")
    p.add_argument("--version", default=DEFAULT_VERSION)
    p.add_argument("--ridge", type=float, action="append", default=None,
                   help="ridge strength candidates (repeatable; default 0.1 1 10 100 1000)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: cubins for --arch, built with NVRTC on this machine (no GPU "
                        "needed); the CPU build is the golden's reference")
    p.add_argument("--arch", default="sm_90",
                   help="CUDA architectures, comma-separated (default sm_90)")
    p.add_argument("--no-rehearsal", action="store_true")
    a = p.parse_args(argv)
    summary = build(a.out, a.key or default_key_path(), seed=a.seed, frames=a.frames,
                    val_frames=a.val_frames, width=a.width, height=a.height,
                    row_stride=a.row_stride, kind=a.kind, cpu=a.cpu,
                    name=a.name, version=a.version, pubkey_out=a.pubkey_out, force=a.force,
                    rehearse=not a.no_rehearsal, device=a.device,
                    archs=tuple(CU.parse_archs(a.arch)) if a.device == "cuda" else (),
                    lams=tuple(a.ridge) if a.ridge else (0.1, 1.0, 10.0, 100.0, 1000.0),
                    log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps(summary, sort_keys=True))
    return 0
