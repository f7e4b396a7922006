"""The inference path of modeld, callable in-process: frame checks, staging, run.

    verified = load_verified(bundle, pubkey, expect_abi=ENGINE_ABI)
    engine = Engine(verified, deadline_ms=50)
    out, receipt = engine.infer(y_plane, frame_id=7, capture_ts_ns=ts)

Input ABI 2 (``abi.version`` 2, ``abi.input.takes = "y_plane"``): the artifact takes the
NV12 Y plane itself, uint8 ``[height, row_stride]`` as it lies in memory, and runs crop,
area mean and normalisation as its own kernels (`workers.modelbuild.preprocess`). Per
frame the engine copies the plane once into the model's input buffer (`stage`: one
memcpy when the frame's row stride is the model's, else one row-wise copy) and runs; the
receipt says how many bytes were copied in and out. An artifact of another input ABI
(version 1 took a preprocessed float32 tensor) is refused at load with one line.

Input ABI 3 (``abi.version`` 3, ``abi.inputs``): several such Y planes, each with its own
frame geometry, preprocessing and ``role`` (the worker role its frames arrive on: the
driving model takes ``frames``, the road camera, and ``wide``, the wide road camera),
and ``abi.pairing``: the frames of one inference are of one instant (same frame id,
capture times at most ``max_skew_ms`` apart). The engine stages each plane into its own
input buffer (`stage(y, index)`) and runs once; modeld does the pairing.

`preprocess_y` below stays the numpy reference of that preprocessing (the build fits the
model's head on its output and checks the artifact's kernels against it bit for bit):

* crop: drop the top ``floor(h * crop_top_num / crop_top_den)`` rows (sky);
* area mean: split the remaining rows into ``out_height`` bands and the columns into
  ``out_width`` bands, band ``i`` of ``n`` items into ``N`` starting at
  ``(i*n + N//2) // N``; each output pixel is the mean of its band's uint8 pixels;
* normalise: ``x = (mean - 128) / 64`` as float32, laid out NCHW ``[1, 1, H, W]``.

Nothing here imports tinygrad at module import: `Engine` does, through
`supervisor.model.runtime`, after the artifact was verified.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np

from supervisor.model.artifact import VerifiedArtifact

from supervisor.ipc.receipt import Receipt

PREPROCESS_OP = "crop_area_mean"
PREPROCESS_VERSION = 1
# Version 2: the artifact takes the Y plane and preprocesses inside (version 1, the
# float32 tensor preprocessed here in numpy, is no longer run).
ABI_VERSION = 2
INPUT_TAKES = "y_plane"
# Output payloads an artifact may declare (schemas/payloads.py): modeld publishes the
# output under that payload's field order.
OUTPUT_PAYLOADS = ("model_out", "driver_state")

# What this engine can feed and read (checked by load_verified(expect_abi=...)).
# ENGINE_ABI: one Y plane (input ABI 2); ENGINE_ABI3: several (each input as ABI 2's);
# ENGINE_ABIS: either, what modeld accepts.
ENGINE_ABI = {
    "version": ABI_VERSION,
    "input": {
        "takes": INPUT_TAKES,
        "frame": {"pixel_format": "nv12", "plane": "y", "dtype": "uint8", "pixel_range": "full"},
        "preprocess": {"op": PREPROCESS_OP, "version": PREPROCESS_VERSION, "in_artifact": True},
        "tensor": {"dtype": "uint8", "layout": "HW", "byte_offset": 0},
    },
    "output": {"dtype": "float32", "shape": [4], "strides": [4], "byte_offset": 0},
}
ABI_VERSION_MULTI = 3
ENGINE_ABI3 = {
    "version": ABI_VERSION_MULTI,
    "each_input": ENGINE_ABI["input"],
    "output": ENGINE_ABI["output"],
}
ENGINE_ABIS = [ENGINE_ABI, ENGINE_ABI3]


def preprocess_spec(out_height: int = 64, out_width: int = 128, crop_top_num: int = 2,
                    crop_top_den: int = 5) -> dict:
    return {
        "op": PREPROCESS_OP, "version": PREPROCESS_VERSION,
        "crop_top_num": crop_top_num, "crop_top_den": crop_top_den,
        "out_height": out_height, "out_width": out_width,
        "band_start": "(i*n + N//2) // N",
        "normalise": {"mean": 128.0, "scale": 0.015625},
        "formula": "x = (area_mean(y[floor(h*num/den):, :]) - mean) * scale",
        "implementation": "workers.modeld.engine.preprocess_y",
    }


def check_output_payload(output_abi: dict) -> str:
    """The payload the artifact's output is (its fields in that payload's order), or
    AbiMismatch naming what disagrees."""
    from schemas.payloads import PAYLOADS
    from supervisor.model.errors import AbiMismatch

    name = output_abi.get("payload")
    if name not in OUTPUT_PAYLOADS:
        raise AbiMismatch(f"abi.output.payload is {name!r}, modeld publishes "
                          f"{', '.join(OUTPUT_PAYLOADS)}")
    if list(output_abi.get("fields", ())) != list(PAYLOADS[name].fields):
        raise AbiMismatch(f"abi.output.fields {output_abi.get('fields')} are not payload "
                          f"{name}'s {list(PAYLOADS[name].fields)}")
    return name


def min_frame(spec: dict) -> tuple[int, int]:
    """Smallest (height, width), both even, that gives every output band a pixel."""
    h = spec["out_height"]
    while h - (h * spec["crop_top_num"]) // spec["crop_top_den"] < spec["out_height"] or h % 2:
        h += 1
    w = spec["out_width"] + spec["out_width"] % 2
    return h, w


def _band_starts(n: int, N: int) -> np.ndarray:
    return ((np.arange(N, dtype=np.int64) * n + N // 2) // N).astype(np.intp)


def preprocess_y(y: np.ndarray, spec: dict, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 Y plane (h, w), any row stride -> float32 [1, 1, out_height, out_width]."""
    H, W = spec["out_height"], spec["out_width"]
    h, w = y.shape
    top = (h * spec["crop_top_num"]) // spec["crop_top_den"]
    crop = y[top:]
    hh = h - top
    rs, cs = _band_starts(hh, H), _band_starts(w, W)
    s = np.add.reduceat(crop, rs, axis=0, dtype=np.uint32)
    s = np.add.reduceat(s, cs, axis=1, dtype=np.uint32)
    cnt = (np.diff(np.append(rs, hh))[:, None] * np.diff(np.append(cs, w))[None, :])
    norm = spec["normalise"]
    x = (s / cnt - norm["mean"]) * norm["scale"]
    if out is None:
        out = np.empty((1, 1, H, W), np.float32)
    out[0, 0] = x
    return out


class FrameRejected(Exception):
    """A frame that does not match the artifact's input ABI (counted, not fatal)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class InputStage:
    """One input of the model: its frame geometry and its buffer, seen as the Y plane."""

    def __init__(self, abi: dict, view: np.ndarray, index: int) -> None:
        self.index = index
        self.name = abi.get("name", "y")
        self.role = abi.get("role", "frames")
        self.sensor: str | None = abi.get("sensor")    # ABI 3: the camera it was fitted on
        self.frame_abi = fa = abi["frame"]
        self.spec = abi["preprocess"]
        # The one frame geometry the artifact's kernels were captured for.
        self.height, self.width, self.row_stride = fa["height"], fa["width"], fa["row_stride"]
        # Parsed once, like the sizes above: np.dtype(name) per frame is a cold numpy path.
        self.y_dtype = np.dtype(fa["dtype"])
        self.view = view
        self.cols = view[:, :self.width]
        self.flat = view.reshape(-1)
        self.span = (self.height - 1) * self.row_stride + self.width

    def stage(self, y: np.ndarray) -> int:
        if y.strides[0] == self.row_stride:
            flat = np.lib.stride_tricks.as_strided(y, (self.span,), (1,), writeable=False)
            self.flat[:self.span] = flat
            return self.span
        self.cols[...] = y
        return self.height * self.width


class Engine:
    """One verified model, its input staging, and the running latency/deadline record."""

    def __init__(self, verified: VerifiedArtifact, *, deadline_ms: float = 50.0,
                 exclusive: bool = False) -> None:
        from supervisor.model import runtime

        self.verified = verified
        self.payload = check_output_payload(verified.output_abi)
        # ABI 3: how frames of one instant are paired (None for a one-input model).
        self.pairing: dict | None = verified.manifest["abi"].get("pairing")
        self.deadline_ns = int(deadline_ms * 1e6)
        self.worst_case_ns = 0
        self.deadline_misses = 0
        self.inferences = 0
        self.rejected: Counter[str] = Counter()
        t0 = time.monotonic_ns()
        self.model = runtime.load_model(verified, exclusive=exclusive)
        self.load_ns = time.monotonic_ns() - t0
        # The model's input buffers, seen as Y planes: frames are copied straight in.
        self.inputs = [InputStage(ia, self.model.input_view(k), k)
                       for k, ia in enumerate(verified.input_abis)]
        first = self.inputs[0]
        self.frame_abi, self.spec = first.frame_abi, first.spec
        self.height, self.width, self.row_stride = first.height, first.width, first.row_stride
        self.min_height, self.min_width = self.height, self.width
        self.y_dtype = first.y_dtype
        self._in = first.view
        self.artifact_sha256 = verified.manifest_sha256

    @property
    def info(self) -> dict:
        return {"model": self.verified.name, "version": self.verified.version,
                "artifact_sha256": self.artifact_sha256.hex(), "key_id": self.verified.key_id,
                "runtime": self.model.runtime_info, "golden_ok": self.model.golden_ok,
                "kernels_in_program": self.model.kernels_in_program,
                "payload": self.payload,
                "input": ", ".join(f"{i.name if len(self.inputs) > 1 else 'y_plane'} "
                                   f"{i.width}x{i.height} stride {i.row_stride}"
                                   for i in self.inputs),
                "load_ms": round(self.load_ns / 1e6, 3)}

    def check_frame(self, y: Any, *, pixel_format: str = "nv12", pixel_range: str = "full",
                    plane: str = "y", width: int | None = None, height: int | None = None,
                    index: int = 0) -> None:
        """Raise FrameRejected (counted by reason) unless ``y`` fits input ``index``'s ABI."""
        inp = self.inputs[index]
        fa = inp.frame_abi
        if pixel_format != fa["pixel_format"]:
            self._reject("pixel_format", f"pixel format {pixel_format!r}, the model takes "
                                         f"{fa['pixel_format']!r}")
        if plane != fa["plane"]:
            self._reject("plane", f"plane {plane!r}, the model takes {fa['plane']!r}")
        if pixel_range != fa["pixel_range"]:
            self._reject("pixel_range", f"pixel range {pixel_range!r}, the model takes "
                                        f"{fa['pixel_range']!r}")
        if not isinstance(y, np.ndarray) or y.dtype != inp.y_dtype or y.ndim != 2:
            desc = f"{y.dtype}{list(y.shape)}" if isinstance(y, np.ndarray) else type(y).__name__
            self._reject("dtype", f"Y plane is {desc}, the model takes a 2-D {fa['dtype']} plane")
        h, w = y.shape
        if (height is not None and h != height) or (width is not None and w != width):
            self._reject("shape", f"Y plane is {w}x{h}, the frame says {width}x{height}")
        if h < inp.height or w < inp.width:
            self._reject("too_small", f"frame {w}x{h} is smaller than the model's "
                                      f"{inp.width}x{inp.height}")
        if (h, w) != (inp.height, inp.width):
            self._reject("shape", f"frame {w}x{h}, the model's kernels are for "
                                  f"{inp.width}x{inp.height}")
        if y.strides[1] != 1:
            self._reject("layout", f"Y plane column stride {y.strides[1]}, the model takes "
                                   f"packed rows")

    def _reject(self, reason: str, msg: str) -> None:
        self.rejected[reason] += 1
        raise FrameRejected(reason, msg)

    def stage(self, y: np.ndarray, index: int = 0) -> int:
        """Copy a checked Y plane into input ``index``'s buffer (the one copy); returns
        the bytes copied. Rows at the model's stride: one memcpy of the plane's span
        (row padding included, it is never read); any other stride: row by row."""
        return self.inputs[index].stage(y)

    def preprocess(self, y: np.ndarray, index: int = 0) -> np.ndarray:
        """The numpy reference of what the artifact's kernels do (tests, the build)."""
        return preprocess_y(y, self.inputs[index].spec)

    def infer(self, y: np.ndarray, *more: np.ndarray, frame_id: int = 0,
              capture_ts_ns: int = 0, pixel_format: str = "nv12", pixel_range: str = "full",
              out: np.ndarray | None = None) -> tuple[np.ndarray, Receipt]:
        """Check, stage and run one Y plane per input (``more``: the second and later, in
        ABI order); returns float32[4] and its receipt."""
        planes = (y, *more)
        if len(planes) != len(self.inputs):
            raise ValueError(f"{len(planes)} planes given, the model takes {len(self.inputs)}")
        for k, p in enumerate(planes):
            self.check_frame(p, pixel_format=pixel_format, pixel_range=pixel_range, index=k)
        t0 = time.monotonic_ns()
        staged = sum(self.stage(p, k) for k, p in enumerate(planes))
        return self.run_staged(frame_id=frame_id, capture_ts_ns=capture_ts_ns, start_ns=t0,
                               bytes_in=staged, out=out)

    def run_staged(self, *, frame_id: int = 0, capture_ts_ns: int = 0,
                   start_ns: int | None = None, bytes_in: int = 0,
                   out: np.ndarray | None = None) -> tuple[np.ndarray, Receipt]:
        """Run on what `stage` copied in. ``start_ns``: when this inference began (e.g.
        before staging), for the receipt's latency; ``bytes_in``: what staging copied;
        ``out``: where to copy the output (LoadedModel.run_staged)."""
        t0 = time.monotonic_ns() if start_ns is None else start_ns
        out, st = self.model.run_staged(out=out)
        t1 = time.monotonic_ns()
        return out, self._receipt(frame_id, capture_ts_ns, t0, t1, st, bytes_in)

    def _receipt(self, frame_id: int, capture_ts_ns: int, t0: int, t1: int, st: Any,
                 bytes_in: int) -> Receipt:
        lat = t1 - t0
        self.inferences += 1
        self.worst_case_ns = max(self.worst_case_ns, lat)
        if self.deadline_ns and lat > self.deadline_ns:
            self.deadline_misses += 1
        # Positional, in Receipt's field order (named alongside): 14 keywords cost a
        # name match each in the dataclass __init__'s argument parsing.
        return Receipt(int(frame_id), int(capture_ts_ns), t0, t1,    # frame, capture, start, end
                       st.device, bytes_in + st.bytes_in, st.bytes_out, st.completion,
                       lat, self.worst_case_ns, self.deadline_ns,   # latency, worst, deadline
                       self.deadline_misses, self.artifact_sha256, st.kernels_run)
