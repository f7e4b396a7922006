"""The checked values the codec hands out, and the dtype and view arithmetic behind them.

Everything here is plain data: a reader gets these back from `codec.decode_layout` and
`codec.decode_header` only after every field was validated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

# Small messages: a generous but firm bound on what a hostile header may make us walk.
TRAVERSAL_LIMIT_WORDS = 4096
NESTING_LIMIT = 8
MAX_FRAME_DIM = 16384

# numpy dtype name <-> DLPack (code, bits). Lanes are always 1 on this bridge.
_DLPACK = {
    "bool": (6, 8), "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64),
}
_FROM_DLPACK = {v: k for k, v in _DLPACK.items()}
_CODE_NAMES = ["int", "uint", "float", "opaqueHandle", "bfloat", "complex", "bool"]

# Per format: bytes per sample of each plane, and the plane's (width, height) divisor.
_PLANES = {
    "nv12": ((1, 1, 1), (2, 2, 2)),   # Y: 1 B/px full size; UV: 2 B per pair, half size
    "rgb888": ((3, 1, 1),),
    "bgr888": ((3, 1, 1),),
    "gray8": ((1, 1, 1),),
}


@dataclass(frozen=True)
class PlaneInfo:
    offset: int
    row_stride: int
    width: int
    height: int
    bytes_per_sample: int


@dataclass(frozen=True)
class FrameFormat:
    sensor: str
    pixel_format: str
    pixel_range: str
    width: int
    height: int
    planes: tuple[PlaneInfo, ...]


@dataclass(frozen=True)
class Layout:
    """A validated tensor view description, relative to the slot payload."""

    dtype: np.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    nbytes: int
    span: tuple[int, int]          # [lo, hi) bytes of the payload the view touches
    frame: FrameFormat | None


class Stamp(NamedTuple):
    """The checked per-message fields of a SlotHeader (a tuple: built per message)."""

    sequence: int
    generation: int
    writer_pid: int
    publish_ts_ns: int
    crc32: int | None
    frame_id: int | None
    capture_ts_ns: int | None
    exposure_us: int | None
    gain: float | None


def dlpack_of(dtype: np.dtype) -> tuple[int, int]:
    try:
        return _DLPACK[np.dtype(dtype).name]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no DLPack mapping on this bridge") from None


def tensor_span(shape: tuple[int, ...], strides: tuple[int, ...], offset: int,
                itemsize: int) -> tuple[int, int]:
    """[lo, hi) of the bytes a strided view touches (negative strides included)."""
    if any(n == 0 for n in shape):
        return offset, offset
    lo = hi = offset
    for n, s in zip(shape, strides):
        reach = (n - 1) * s
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + itemsize


def plane_view(buf, p: PlaneInfo, *, readonly: bool = False) -> np.ndarray:
    """A uint8 view of one frame plane in a payload: (h, w), or (h, w, bytes per sample)."""
    if p.bytes_per_sample == 1:
        shape, strides = (p.height, p.width), (p.row_stride, 1)
    else:
        shape, strides = (p.height, p.width, p.bytes_per_sample), (p.row_stride,
                                                                   p.bytes_per_sample, 1)
    a = np.ndarray(shape, np.uint8, buffer=buf, offset=p.offset, strides=strides)
    if readonly:
        a.flags.writeable = False
    return a
