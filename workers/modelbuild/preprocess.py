"""Preprocessing as tinygrad kernels: crop + area mean + normalise of a strided Y plane,
bit-identical to modeld's numpy reference (`workers.modeld.engine.preprocess_y`).

Build side only: the graph is captured into the artifact's TinyJit with the model, so the
runtime (no compiler) runs it as signed kernels; nothing here is imported by modeld.

    y      uint8 [height, row_stride]   the Y plane as it lies in memory (columns >= width
                                        are the row padding, never read)
    crop   rows [top, height), columns [0, width)
    bands  band i of n items into N starts at (i*n + N//2) // N (the reference's rule)
    sums   int32, exact
    x      float32 [1, 1, H, W] = ((sum / count) - 128) * (1/64), the division and the
           arithmetic in float64 exactly as numpy does them, then rounded to float32

Why bit-exact and not "close": the band sums are integers (exact in int32); the rest is
the reference's own sequence of IEEE float64 operations (a true division: tinygrad's C
renderer turns ``a * reciprocal(b)`` back into ``a / b`` when ``b`` is a buffer), then one
rounding to float32. So the manifest declares a tolerance of 0 and tests hold it to that.

How a band sum is a view and not a gather: bands have lengths ``lo`` or ``lo+1`` and
irregular starts ``s_i``. Repeating every item N times (an expand, no copy) makes a fine
grid where item ``f // N`` sits at position ``f``; position ``i*n + N//2`` is then item
``s_i`` exactly, and those positions are evenly spaced (stride ``n``): a reshape picks
them. Band i's sum is the sum over t < lo+1 of the items at ``s_i + t`` (t == lo masked
for the short bands): lo+1 views added in one kernel per axis, with no index tensor, no
one-hot matrix and no scan.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def band_starts(n: int, N: int) -> list[int]:
    """Starts of the N bands of n items, and n at the end (the reference's rule)."""
    return [(i * n + N // 2) // N for i in range(N)] + [n]


def band_lengths(n: int, N: int) -> list[int]:
    s = band_starts(n, N)
    return [s[i + 1] - s[i] for i in range(N)]


@dataclass(frozen=True)
class Geometry:
    """The frame an artifact is built for and the crop/resample it applies."""
    height: int
    width: int
    row_stride: int
    out_height: int
    out_width: int
    crop_top: int

    @classmethod
    def of(cls, spec: dict, height: int, width: int, row_stride: int) -> Geometry:
        if row_stride < width:
            raise ValueError(f"row stride {row_stride} < width {width}")
        top = (height * spec["crop_top_num"]) // spec["crop_top_den"]
        g = cls(height, width, row_stride, spec["out_height"], spec["out_width"], top)
        if min(band_lengths(height - top, g.out_height) + band_lengths(width, g.out_width)) < 1:
            raise ValueError(f"{width}x{height} is too small for {g.out_width}x{g.out_height} bands")
        return g

    def counts(self) -> np.ndarray:
        """Pixels per output band, float64 [H, W] (the divisor of the mean)."""
        rl = np.array(band_lengths(self.height - self.crop_top, self.out_height), np.float64)
        cl = np.array(band_lengths(self.width, self.out_width), np.float64)
        return rl[:, None] * cl[None, :]


class Preprocess:
    """The constants of one geometry as realized tensors (made once, before capture: in a
    TinyJit they become weights of the artifact, not per-call copies)."""

    def __init__(self, geom: Geometry, spec: dict, device: str = "CPU") -> None:
        from tinygrad import Tensor

        self.geom, self.spec = geom, spec
        hh = geom.height - geom.crop_top
        self.row_masks = self._masks(hh, geom.out_height, device)
        self.col_masks = self._masks(geom.width, geom.out_width, device)
        self.count = Tensor(np.ascontiguousarray(geom.counts()), device=device).realize()

    @staticmethod
    def _masks(n: int, N: int, device: str) -> dict[int, object]:
        """t -> int32 [N] mask (1 where band i is longer than t), for t >= the shortest."""
        from tinygrad import Tensor

        L = band_lengths(n, N)
        return {t: Tensor(np.array([1 if l > t else 0 for l in L], np.int32),
                          device=device).realize()
                for t in range(min(L), max(L))}

    def __call__(self, y):
        """uint8 [height, row_stride] -> float32 [1, 1, H, W] (two kernels)."""
        from tinygrad import dtypes

        g = self.geom
        if tuple(y.shape) != (g.height, g.row_stride):
            raise ValueError(f"input {tuple(y.shape)}, built for {(g.height, g.row_stride)}")
        crop = y[g.crop_top:, :g.width].cast(dtypes.int32)
        # Column bands first, into their own buffer: fused with the row bands, every
        # output would redo 12 rows x 16 columns of loads in one huge unrolled kernel
        # (measured: 54 s to compile, a 580 KB object, slower); apart, two small kernels
        # (~0.7 ms + 0.03 ms here) and each pixel is loaded once.
        cols = _band_sum_last(crop, g.width, g.out_width, self.col_masks).contiguous()
        sums = _band_sum_last(cols.transpose(0, 1), g.height - g.crop_top, g.out_height,
                              self.row_masks).transpose(0, 1)                       # [H, W]
        norm = self.spec["normalise"]
        # numpy's order: (s / count) - mean, times scale, all float64; then float32.
        q = sums.cast(dtypes.float64) / self.count
        x = ((q - float(norm["mean"])) * float(norm["scale"])).cast(dtypes.float32)
        # Its own buffer: the model reads x many times (3x3 convs); fused into them, the
        # band sums would be recomputed per tap.
        return x.reshape(1, 1, g.out_height, g.out_width).contiguous()


def _band_sum_last(x, n: int, N: int, masks: dict):
    """Band sums along the last axis (length n) -> N, as lo+1 gathered views added."""
    lead = tuple(x.shape[:-1])
    pad_lead = ((0, 0),) * len(lead)
    L = band_lengths(n, N)
    total = None
    for t in range(max(L)):
        xt = x[..., t:].pad(pad_lead + ((0, t),)) if t else x          # item s + t at s
        fine = xt.reshape(*lead, n, 1).expand(*lead, n, N).reshape(*lead, n * N)
        picked = fine[..., N // 2:].pad(pad_lead + ((0, N // 2),)).reshape(*lead, N, n)[..., 0]
        if t in masks:
            picked = picked * masks[t]
        total = picked if total is None else total + picked
    return total


def reference_sums(y: np.ndarray, geom: Geometry) -> np.ndarray:
    """Numpy band sums (int64) for tests: the same bands, another computation."""
    crop = y[geom.crop_top:, :geom.width].astype(np.int64)
    rs = band_starts(geom.height - geom.crop_top, geom.out_height)
    cs = band_starts(geom.width, geom.out_width)
    s = np.add.reduceat(crop, rs[:-1], axis=0)
    return np.add.reduceat(s, cs[:-1], axis=1)
