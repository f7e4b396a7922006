"""Training frames: the camera's own synthetic road (workers/camerad/synthetic.py) when it
exists, else a stand-in with the same interface and conventions.

    road_class() -> class with SyntheticRoad(width, height, seed).render(frame_id)
                    -> (y uint8[h, w], uv uint8[h/2, w/2, 2], truth)
    truth.offset_m    + = car right of the lane centre
    truth.heading_rad + = car pointing right of the lane direction
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import numpy as np


def driver_class() -> tuple[type, str]:
    """(SyntheticDriver class, its dotted name): the driver camera's cabin scene."""
    mod = importlib.import_module("workers.camerad.synthetic")
    return mod.SyntheticDriver, "workers.camerad.synthetic.SyntheticDriver"


def road_class() -> tuple[type, str]:
    """(SyntheticRoad class, its dotted name): the camera's, or the stand-in."""
    try:
        mod = importlib.import_module("workers.camerad.synthetic")
        return mod.SyntheticRoad, "workers.camerad.synthetic.SyntheticRoad"
    except (ImportError, AttributeError):
        return StandInRoad, f"{__name__}.StandInRoad"


@dataclass(frozen=True)
class StandInTruth:
    offset_m: float
    heading_rad: float
    curvature: float = 0.0


class StandInRoad:
    """Flat road, pinhole camera (1.22 m high, 40 deg HFOV, horizon at 0.45 h), two lane
    lines 3.7 m apart; offset and heading are smooth functions of the frame number."""

    def __init__(self, width: int = 1928, height: int = 1208, seed: int = 0) -> None:
        self.width, self.height, self.seed = width, height, seed
        rng = np.random.default_rng([seed, 7])
        self.phases = rng.uniform(0, 2 * math.pi, 2)
        self.focal = width / (2 * math.tan(math.radians(20)))
        self.horizon = 0.45 * height
        self.tex = np.clip(rng.normal(92, 9, (height, width)), 0, 255).astype(np.uint8)

    def render(self, frame_id: int):
        h, w = self.height, self.width
        off = 0.9 * math.sin(frame_id / 20 / 8.0 * 2 * math.pi + self.phases[0])
        hd = 0.04 * math.sin(frame_id / 20 / 5.5 * 2 * math.pi + self.phases[1])
        y = self.tex.copy()
        r0 = int(self.horizon) + 1
        y[:r0] = 180
        rows = np.arange(r0, h)
        z = self.focal * 1.22 / (rows - self.horizon + 0.5)
        cols = np.arange(w)[None, :]
        for x_lane, val in ((-1.85, 190), (1.85, 225)):
            c = (w - 1) / 2 + self.focal * (x_lane - off - hd * z) / z
            half = np.maximum(self.focal * 0.075 / z, 0.5)
            mask = np.abs(cols - c[:, None]) <= half[:, None]
            y[r0:][mask] = val
        uv = np.full((h // 2, w // 2, 2), 128, np.uint8)
        return y, uv, StandInTruth(off, hd)
