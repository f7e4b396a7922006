"""The inference path of modeld, callable in-process: frame checks, preprocessing, run.

    verified = load_verified(bundle, pubkey, expect_abi=ENGINE_ABI)
    engine = Engine(verified, deadline_ms=50)
    out, receipt = engine.infer(y_plane, frame_id=7, capture_ts_ns=ts)

Preprocessing (recorded in the artifact's ABI as ``abi.input.preprocess``; the build
uses this same function on its training frames):

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

# What this engine can feed and read (checked by load_verified(expect_abi=...)).
ENGINE_ABI = {
    "input": {
        "frame": {"pixel_format": "nv12", "plane": "y", "dtype": "uint8", "pixel_range": "full"},
        "preprocess": {"op": PREPROCESS_OP, "version": PREPROCESS_VERSION},
        "tensor": {"dtype": "float32", "layout": "NCHW", "byte_offset": 0},
    },
    "output": {"dtype": "float32", "shape": [4], "strides": [4], "byte_offset": 0,
               "fields": ["offset_m", "heading_rad", "confidence", "reserved"]},
}


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


class Engine:
    """One verified model, its preprocessing, and the running latency/deadline record."""

    def __init__(self, verified: VerifiedArtifact, *, deadline_ms: float = 50.0,
                 exclusive: bool = False) -> None:
        from supervisor.model import runtime

        self.verified = verified
        abi = verified.input_abi
        self.frame_abi = abi["frame"]
        self.spec = abi["preprocess"]
        self.min_height, self.min_width = abi["frame"]["min_height"], abi["frame"]["min_width"]
        # Parsed once, like the sizes above: np.dtype(name) per frame is a cold numpy path.
        self.y_dtype = np.dtype(abi["frame"]["dtype"])
        self.deadline_ns = int(deadline_ms * 1e6)
        self.worst_case_ns = 0
        self.deadline_misses = 0
        self.inferences = 0
        self.rejected: Counter[str] = Counter()
        t0 = time.monotonic_ns()
        self.model = runtime.load_model(verified, exclusive=exclusive)
        self.load_ns = time.monotonic_ns() - t0
        self._x = np.empty(abi["tensor"]["shape"], np.float32)
        self.artifact_sha256 = verified.manifest_sha256

    @property
    def info(self) -> dict:
        return {"model": self.verified.name, "version": self.verified.version,
                "artifact_sha256": self.artifact_sha256.hex(), "key_id": self.verified.key_id,
                "runtime": self.model.runtime_info, "golden_ok": self.model.golden_ok,
                "kernels_in_program": self.model.kernels_in_program,
                "load_ms": round(self.load_ns / 1e6, 3)}

    def check_frame(self, y: Any, *, pixel_format: str = "nv12", pixel_range: str = "full",
                    plane: str = "y", width: int | None = None, height: int | None = None) -> None:
        """Raise FrameRejected (counted by reason) unless ``y`` fits the input ABI."""
        fa = self.frame_abi
        if pixel_format != fa["pixel_format"]:
            self._reject("pixel_format", f"pixel format {pixel_format!r}, the model takes "
                                         f"{fa['pixel_format']!r}")
        if plane != fa["plane"]:
            self._reject("plane", f"plane {plane!r}, the model takes {fa['plane']!r}")
        if pixel_range != fa["pixel_range"]:
            self._reject("pixel_range", f"pixel range {pixel_range!r}, the model takes "
                                        f"{fa['pixel_range']!r}")
        if not isinstance(y, np.ndarray) or y.dtype != self.y_dtype or y.ndim != 2:
            desc = f"{y.dtype}{list(y.shape)}" if isinstance(y, np.ndarray) else type(y).__name__
            self._reject("dtype", f"Y plane is {desc}, the model takes a 2-D {fa['dtype']} plane")
        h, w = y.shape
        if (height is not None and h != height) or (width is not None and w != width):
            self._reject("shape", f"Y plane is {w}x{h}, the frame says {width}x{height}")
        if h < self.min_height or w < self.min_width:
            self._reject("too_small", f"frame {w}x{h} is smaller than the model's minimum "
                                      f"{self.min_width}x{self.min_height}")

    def _reject(self, reason: str, msg: str) -> None:
        self.rejected[reason] += 1
        raise FrameRejected(reason, msg)

    def preprocess(self, y: np.ndarray) -> np.ndarray:
        return preprocess_y(y, self.spec, self._x)

    def infer(self, y: np.ndarray, *, frame_id: int = 0, capture_ts_ns: int = 0,
              pixel_format: str = "nv12", pixel_range: str = "full") -> tuple[np.ndarray, Receipt]:
        """Check, preprocess and run one Y plane; returns float32[4] and its receipt."""
        self.check_frame(y, pixel_format=pixel_format, pixel_range=pixel_range)
        t0 = time.monotonic_ns()
        x = self.preprocess(y)
        out, st = self.model.run(x)
        t1 = time.monotonic_ns()
        return out, self._receipt(frame_id, capture_ts_ns, t0, t1, st)

    def infer_tensor(self, x: np.ndarray, *, frame_id: int = 0, capture_ts_ns: int = 0,
                     start_ns: int | None = None, out: np.ndarray | None = None
                     ) -> tuple[np.ndarray, Receipt]:
        """Run an already preprocessed input (float32 [1, 1, H, W]). ``start_ns``: when
        this inference began (e.g. before preprocessing), for the receipt's latency;
        ``out``: where to copy the output (LoadedModel.run)."""
        t0 = time.monotonic_ns() if start_ns is None else start_ns
        out, st = self.model.run(x, out=out)
        t1 = time.monotonic_ns()
        return out, self._receipt(frame_id, capture_ts_ns, t0, t1, st)

    def _receipt(self, frame_id: int, capture_ts_ns: int, t0: int, t1: int, st: Any) -> Receipt:
        lat = t1 - t0
        self.inferences += 1
        self.worst_case_ns = max(self.worst_case_ns, lat)
        if self.deadline_ns and lat > self.deadline_ns:
            self.deadline_misses += 1
        # Positional, in Receipt's field order (named alongside): 14 keywords cost a
        # name match each in the dataclass __init__'s argument parsing.
        return Receipt(int(frame_id), int(capture_ts_ns), t0, t1,    # frame, capture, start, end
                       st.device, st.bytes_in, st.bytes_out, "hostVisible",   # completion
                       lat, self.worst_case_ns, self.deadline_ns,   # latency, worst, deadline
                       self.deadline_misses, self.artifact_sha256, st.kernels_run)
