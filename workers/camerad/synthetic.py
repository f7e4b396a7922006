"""A synthetic forward-camera road scene, rendered straight into NV12 planes.

    road = SyntheticRoad(1928, 1208, seed=0)
    y, uv, truth = road.render(frame_id)          # new arrays
    truth = road.render_into(frame_id, y, uv)     # into caller-owned planes (a bridge loan)

Everything is a deterministic function of ``(width, height, seed, fps, frame_id)``: the
same arguments give the same bytes, in any order and in any process.

Scene and geometry (a pinhole camera over a flat road):

* camera height ``CAM_HEIGHT_M`` (1.22 m), horizontal field of view 40 degrees
  (focal length ``f = width / (2 tan 20deg)`` pixels), principal point at the image
  centre column, horizon (zero pitch) at row ``HORIZON * height``.
* sky above the horizon (gradient, bluish chroma), asphalt below it with a noise texture
  that scrolls with the car's motion, a solid yellow line on the left and a dashed white
  line on the right of the car's lane (``LANE_WIDTH_M`` apart, 0.15 m wide). The dashes
  move towards the camera at ``speed_mps``, so consecutive frames differ.
* the car's lateral offset, heading and the lane's curvature vary smoothly with time
  ``t = frame_id / fps`` (sums of sinusoids whose periods/phases come from the seed).

`LaneTruth` is exactly what was drawn; sign conventions (all "+ = to the right"):

* ``offset_m``: the camera's lateral position in metres relative to the lane centre,
  + = car right of the centre.
* ``heading_rad``: the car's yaw relative to the lane direction, + = pointing right of
  the lane direction (the lane then appears to run off to the left).
* ``curvature``: lane curvature in 1/m at the car, + = the lane bends to the right.

A lane point at distance ``Z`` ahead and lateral ``x`` (lane frame, metres) is at
camera-lateral ``X = x + curvature*Z**2/2 - offset_m - heading_rad*Z`` (small-angle). In
image coordinates where pixel ``k`` spans ``[k, k+1)`` and the principal point is
``(width/2, HORIZON*height)``, pixel row ``r`` (centre ``r + 0.5``) shows the ground at
``Z = f*CAM_HEIGHT_M / (r + 0.5 - HORIZON*height)`` and the point lands on pixel column
``(width - 1)/2 + f*X/Z``. Rows at or above the horizon are sky; lines are drawn up to
``MAX_DRAW_M``.

Speed: the per-row geometry, sky, texture and chroma are precomputed; a frame is one row
gather of the texture, one copy of the sky and chroma, and fancy-indexed writes of the
lane-line pixels only (a few ms at 1928x1208 on one core).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CAM_HEIGHT_M = 1.22
HFOV_DEG = 40.0
HORIZON = 0.45             # horizon row as a fraction of the height
LANE_WIDTH_M = 3.7
LINE_WIDTH_M = 0.15
DASH_LEN_M = 3.0
DASH_PERIOD_M = 12.0
MAX_DRAW_M = 150.0         # lane lines are not drawn beyond this distance
TEX_ROWS_PER_M = 16        # texture resolution along the road
TEX_ROWS = 2048            # texture period: TEX_ROWS / TEX_ROWS_PER_M = 128 m

# Colours (full-range BT.601 YUV).
Y_WHITE = 225
Y_YELLOW, U_YELLOW, V_YELLOW = 190, 60, 150
Y_ROAD = 92
HAZE_Y = 60                # luma added to the road at the horizon


@dataclass(frozen=True)
class LaneTruth:
    offset_m: float       # + = car right of the lane centre
    heading_rad: float    # + = car pointing right of the lane direction
    curvature: float      # 1/m, + = lane bends right


class SyntheticRoad:
    """Deterministic road scene in NV12 (full range). ``width`` and ``height`` even."""

    def __init__(self, width: int = 1928, height: int = 1208, seed: int = 0, *,
                 fps: float = 20.0, speed_mps: float = 25.0, hfov_deg: float = HFOV_DEG) -> None:
        if width < 16 or height < 16 or width % 2 or height % 2:
            raise ValueError(f"width and height must be even and >= 16, got {width}x{height}")
        if fps <= 0:
            raise ValueError("fps must be > 0")
        self.width, self.height, self.seed = width, height, seed
        self.fps, self.speed_mps = float(fps), float(speed_mps)
        rng = np.random.default_rng([seed, 0x5EED])
        self.hfov_deg = float(hfov_deg)
        self.focal = width / (2 * math.tan(math.radians(self.hfov_deg / 2)))
        self.cx = (width - 1) / 2
        self.horizon = HORIZON * height
        self.first_row = int(math.floor(self.horizon)) + 1      # first ground row
        h, w, r0 = height, width, self.first_row

        # Motion: (amplitude, period s, phase) triples, all from the seed.
        def waves(amp: float, periods: tuple[float, float]) -> list[tuple[float, float, float]]:
            out = []
            for k, (lo, hi) in enumerate((periods, (periods[0] / 2.7, periods[1] / 2.7))):
                out.append((amp / (1 + 2 * k), float(rng.uniform(lo, hi)),
                            float(rng.uniform(0, 2 * math.pi))))
            return out

        self._offset_w = waves(0.7, (6.0, 11.0))        # metres
        self._heading_w = waves(0.035, (4.0, 9.0))      # radians
        self._curv_w = waves(1 / 900, (15.0, 30.0))     # 1/m

        # Per-row geometry of the ground rows.
        rows = np.arange(r0, h, dtype=np.float64)
        self._dist = self.focal * CAM_HEIGHT_M / (rows - self.horizon + 0.5)   # Z per row
        self._line_half_px = self.focal * (LINE_WIDTH_M / 2) / self._dist
        near = self._dist <= MAX_DRAW_M
        self._line_rows = np.nonzero(near)[0]                                  # ground-row idx
        # Chroma rows (half resolution): the Y row 2*j carries each chroma row j.
        crow = np.arange(0, h // 2) * 2
        cground = crow >= r0
        self._c_rows = np.nonzero(cground)[0]
        self._c_y_index = crow[cground] - r0                                   # ground-row idx
        self._c_rows = self._c_rows[self._dist[self._c_y_index] <= MAX_DRAW_M]
        self._c_y_index = self._c_y_index[self._dist[self._c_y_index] <= MAX_DRAW_M]

        # Sky: vertical gradient plus a faint horizontal haze, precomputed.
        sky_rows = np.arange(r0, dtype=np.float64) / max(r0, 1)
        sky = 150 + 70 * sky_rows[:, None] + 6 * np.cos(np.linspace(0, math.pi, w))[None, :]
        self._sky = np.clip(sky, 0, 255).astype(np.uint8)
        # Asphalt texture along the road: row k is 1/TEX_ROWS_PER_M metres of road.
        tex = rng.normal(Y_ROAD, 9.0, size=(TEX_ROWS, w))
        tex += rng.normal(0, 3.0, size=(TEX_ROWS, 1))           # transverse streaks
        self._tex = np.clip(tex, 0, 255 - HAZE_Y).astype(np.uint8)
        # Aerial perspective: the road lightens towards the horizon (added per row).
        self._haze = np.rint(HAZE_Y * (1 - np.exp(-self._dist / 90.0))).astype(np.uint8)
        self._tex_base = self._dist * TEX_ROWS_PER_M
        # Chroma: sky bluish, ground neutral.
        uv = np.full((h // 2, w // 2, 2), 128, np.uint8)
        sky_c = (np.arange(h // 2) * 2) < r0
        uv[sky_c, :, 0] = 150
        uv[sky_c, :, 1] = 112
        self._uv = uv

    # ------------------------------------------------------------ truth

    @staticmethod
    def _eval(w: list[tuple[float, float, float]], t: float) -> float:
        return float(sum(a * math.sin(2 * math.pi * t / p + ph) for a, p, ph in w))

    def truth(self, frame_id: int) -> LaneTruth:
        t = frame_id / self.fps
        return LaneTruth(self._eval(self._offset_w, t), self._eval(self._heading_w, t),
                         self._eval(self._curv_w, t))

    # ------------------------------------------------------------ rendering

    def render(self, frame_id: int) -> tuple[np.ndarray, np.ndarray, LaneTruth]:
        y = np.empty((self.height, self.width), np.uint8)
        uv = np.empty((self.height // 2, self.width // 2, 2), np.uint8)
        truth = self.render_into(frame_id, y, uv)
        return y, uv, truth

    def _line_columns(self, truth: LaneTruth, x_lane: float, dist: np.ndarray
                      ) -> np.ndarray:
        """Image column of the lane line at lane-lateral ``x_lane`` for each distance."""
        x_cam = (x_lane + 0.5 * truth.curvature * dist * dist - truth.offset_m
                 - truth.heading_rad * dist)
        return self.cx + self.focal * x_cam / dist

    @staticmethod
    def _spans(rows: np.ndarray, centre: np.ndarray, half: np.ndarray, width: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """Row and column index arrays of every pixel of [centre-half, centre+half]."""
        half = np.maximum(half, 0.5)                          # at least one pixel
        a = np.clip(np.ceil(centre - half).astype(np.int64), 0, width)
        b = np.clip(np.floor(centre + half).astype(np.int64) + 1, 0, width)
        n = np.maximum(b - a, 0)
        total = int(n.sum())
        if total == 0:
            e = np.empty(0, np.int64)
            return e, e
        rr = np.repeat(rows, n)
        starts = np.cumsum(n) - n
        cc = np.arange(total, dtype=np.int64) - np.repeat(starts - a, n)
        return rr, cc

    def render_into(self, frame_id: int, y_out: np.ndarray, uv_out: np.ndarray
                    ) -> LaneTruth:
        """Render frame ``frame_id`` into ``y_out`` (h, w) and ``uv_out`` (h/2, w/2, 2),
        uint8 arrays of any row stride (e.g. the planes of a bridge loan)."""
        h, w, r0 = self.height, self.width, self.first_row
        if y_out.shape != (h, w) or uv_out.shape != (h // 2, w // 2, 2):
            raise ValueError(f"planes must be {(h, w)} and {(h // 2, w // 2, 2)}, got "
                             f"{y_out.shape} and {uv_out.shape}")
        truth = self.truth(frame_id)
        travelled = self.speed_mps * frame_id / self.fps

        # Sky, then the asphalt: each ground row samples the texture row at its distance.
        y_out[:r0] = self._sky
        tex_idx = (self._tex_base + travelled * TEX_ROWS_PER_M).astype(np.int64) % TEX_ROWS
        ground = y_out[r0:]
        np.take(self._tex, tex_idx, axis=0, out=ground, mode="clip")
        np.add(ground, self._haze[:, None], out=ground)
        np.copyto(uv_out, self._uv)

        # Lane lines (Y), only the rows where they are drawn.
        li = self._line_rows
        dist = self._dist[li]
        half = self._line_half_px[li]
        left = self._line_columns(truth, -LANE_WIDTH_M / 2, dist)
        right = self._line_columns(truth, LANE_WIDTH_M / 2, dist)
        dash = np.mod(dist + travelled, DASH_PERIOD_M) < DASH_LEN_M
        rr, cc = self._spans(li + r0, left, half, w)
        y_out[rr, cc] = Y_YELLOW
        rr, cc = self._spans(li[dash] + r0, right[dash], half[dash], w)
        y_out[rr, cc] = Y_WHITE

        # Chroma of the yellow line (the white line is neutral like the road).
        ci = self._c_y_index
        cdist = self._dist[ci]
        cl = (self._line_columns(truth, -LANE_WIDTH_M / 2, cdist) - 0.5) / 2
        rr, cc = self._spans(self._c_rows, cl, self._line_half_px[ci] / 2, w // 2)
        uv_out[rr, cc, 0] = U_YELLOW
        uv_out[rr, cc, 1] = V_YELLOW
        return truth


# ---------------------------------------------------------------- driver camera

WIDE_HFOV_DEG = 120.0      # the wide road camera: the same drive, a wider lens
DM_SEGMENT_S = 4.0         # the driver's state holds for this long, then is drawn again
Y_CABIN, Y_FACE, Y_EYE, Y_HAIR = 45, 170, 30, 25


@dataclass(frozen=True)
class DriverTruth:
    face_present: bool
    eyes_on_road: bool    # False while the head is down (or no face)
    face_x: float         # face centre, fraction of the width
    face_y: float         # face centre, fraction of the height


class SyntheticDriver:
    """Deterministic driver-camera scene in NV12: a dark cabin, and (most of the time) a
    face whose eyes look at the road or, head down, away. The state changes every
    `DM_SEGMENT_S` seconds (drawn from the seed: 60 % attentive, 25 % head down, 15 %
    no face); the face drifts slowly. Same interface as `SyntheticRoad`."""

    def __init__(self, width: int = 1928, height: int = 1208, seed: int = 0, *,
                 fps: float = 20.0) -> None:
        if width < 64 or height < 64 or width % 2 or height % 2:
            raise ValueError(f"width and height must be even and >= 64, got {width}x{height}")
        if fps <= 0:
            raise ValueError("fps must be > 0")
        self.width, self.height, self.seed, self.fps = width, height, seed, float(fps)
        rng = np.random.default_rng([seed, 0xD71])
        rows = np.linspace(0, 1, height)[:, None]
        bg = Y_CABIN + 25 * rows + rng.normal(0, 6.0, (height, width))
        self._bg = np.clip(bg, 0, 255).astype(np.uint8)
        self._uv = np.full((height // 2, width // 2, 2), 128, np.uint8)
        # The face: an ellipse mask in its own box (axes 0.09 w by 0.2 h).
        self.ax, self.ay = int(0.09 * width), int(0.2 * height)
        yy, xx = np.mgrid[-self.ay:self.ay + 1, -self.ax:self.ax + 1]
        self._face = (xx / self.ax) ** 2 + (yy / self.ay) ** 2 <= 1.0
        self._hair = self._face & (yy < -0.45 * self.ay)
        er = max(2, int(0.012 * width))
        ey, ex = np.mgrid[-er:er + 1, -er:er + 1]
        self._eye = ex ** 2 + ey ** 2 <= er * er
        self._phase = rng.uniform(0, 2 * math.pi, 2)

    def truth(self, frame_id: int) -> DriverTruth:
        t = frame_id / self.fps
        u = np.random.default_rng([self.seed, int(t // DM_SEGMENT_S)]).random()
        present = u >= 0.15
        on_road = present and u >= 0.40
        fx = 0.5 + 0.08 * math.sin(2 * math.pi * t / 13.0 + self._phase[0])
        fy = 0.45 + 0.04 * math.sin(2 * math.pi * t / 9.0 + self._phase[1])
        if present and not on_road:
            fy += 0.12                                  # head down: the face drops
        return DriverTruth(bool(present), bool(on_road), fx, fy)

    def render(self, frame_id: int) -> tuple[np.ndarray, np.ndarray, DriverTruth]:
        y = np.empty((self.height, self.width), np.uint8)
        uv = np.empty((self.height // 2, self.width // 2, 2), np.uint8)
        return y, uv, self.render_into(frame_id, y, uv)

    def _stamp(self, y_out: np.ndarray, cx: int, cy: int, mask: np.ndarray, value: int) -> None:
        """Set ``mask``'s pixels (centred at cx, cy) to ``value``, clipped to the frame."""
        hy, hx = mask.shape[0] // 2, mask.shape[1] // 2
        y0, y1 = max(cy - hy, 0), min(cy + hy + 1, self.height)
        x0, x1 = max(cx - hx, 0), min(cx + hx + 1, self.width)
        if y0 >= y1 or x0 >= x1:
            return
        m = mask[y0 - (cy - hy):y1 - (cy - hy), x0 - (cx - hx):x1 - (cx - hx)]
        np.copyto(y_out[y0:y1, x0:x1], np.uint8(value), where=m)

    def render_into(self, frame_id: int, y_out: np.ndarray, uv_out: np.ndarray
                    ) -> DriverTruth:
        """Render into caller-owned planes of any row stride (e.g. a bridge loan)."""
        h, w = self.height, self.width
        if y_out.shape != (h, w) or uv_out.shape != (h // 2, w // 2, 2):
            raise ValueError(f"planes must be {(h, w)} and {(h // 2, w // 2, 2)}, got "
                             f"{y_out.shape} and {uv_out.shape}")
        truth = self.truth(frame_id)
        np.copyto(y_out, self._bg)
        np.copyto(uv_out, self._uv)
        if truth.face_present:
            cx, cy = int(truth.face_x * w), int(truth.face_y * h)
            self._stamp(y_out, cx, cy, self._face, Y_FACE)
            self._stamp(y_out, cx, cy, self._hair, Y_HAIR)
            if truth.eyes_on_road:
                dx, ey = int(0.35 * self.ax), cy - int(0.15 * self.ay)
                self._stamp(y_out, cx - dx, ey, self._eye, Y_EYE)
                self._stamp(y_out, cx + dx, ey, self._eye, Y_EYE)
            else:                                       # head down: the crown of the head
                self._stamp(y_out, cx, cy - int(0.2 * self.ay), self._hair, Y_HAIR)
        return truth


def scene(sensor: str, width: int = 1928, height: int = 1208, seed: int = 0, *,
          fps: float = 20.0):
    """The synthetic scene a camera of ``sensor`` sees: road (40 deg), wide (the same
    drive through a 120 deg lens) or driver (the cabin)."""
    if sensor == "driver":
        return SyntheticDriver(width, height, seed, fps=fps)
    if sensor == "wide":
        return SyntheticRoad(width, height, seed, fps=fps, hfov_deg=WIDE_HFOV_DEG)
    return SyntheticRoad(width, height, seed, fps=fps)


# ---------------------------------------------------------------- conversions


def nv12_to_gray(y: np.ndarray, uv: np.ndarray, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """gray8 is the luma plane."""
    if out is None:
        return y.copy()
    np.copyto(out, y)
    return out


def nv12_to_rgb(y: np.ndarray, uv: np.ndarray, out: np.ndarray | None = None
                ) -> np.ndarray:
    """Full-range BT.601 NV12 -> RGB888 (h, w, 3), chroma upsampled by replication."""
    h, w = y.shape
    if out is None:
        out = np.empty((h, w, 3), np.uint8)
    u = uv[..., 0].astype(np.float32) - 128.0
    v = uv[..., 1].astype(np.float32) - 128.0
    # Chroma contributions at half resolution, then replicated 2x2.
    cr = 1.402 * v
    cg = -0.344136 * u - 0.714136 * v
    cb = 1.772 * u
    yf = y.astype(np.float32)
    for k, c in enumerate((cr, cg, cb)):
        full = np.repeat(np.repeat(c, 2, axis=0), 2, axis=1)
        np.clip(yf + full, 0, 255, out=full)
        np.rint(full, out=full)
        out[..., k] = full
    return out
