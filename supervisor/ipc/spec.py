"""The contract of one channel: what the supervisor creates and every endpoint checks."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from . import _geometry
from ._geometry import PAGE
from .errors import ConfigError

MAX_NDIM = 8

KINDS = ("tensor", "frame")
PIXEL_FORMATS = ("nv12", "rgb888", "gray8", "bgr888")
DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
)
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


@dataclass(frozen=True)
class ChannelSpec:
    """One single-writer ring of fixed-size slots.

    ``slot_count`` must exceed ``max_readers * max_leases`` so that the writer can
    always find a slot no live lease protects: a reader can slow the writer's ring
    down, never block it.
    """

    name: str
    slot_size: int                       # payload bytes per slot
    slot_count: int = 4
    dtype: str = "uint8"                 # every tensor on the channel has this dtype
    kind: str = "tensor"                 # "frame" requires FrameMeta/format on every message
    pixel_formats: tuple[str, ...] = ()  # frame channels: accepted formats (empty = any known)
    max_readers: int = 2
    max_leases: int = 1                  # leases one reader may hold at once
    lease_ms: int = 100                  # how long the writer honours a lease
    max_age_ms: int = 0                  # 0: no age limit; else older messages are rejected
    crc: bool = False                    # writer stores CRC-32 of the payload, readers verify
    channel_id: int = 0
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if not _NAME.match(self.name):
            problems.append(f"name {self.name!r} must match {_NAME.pattern}")
        if not 0 < self.slot_size <= 1 << 30:
            problems.append(f"slot_size {self.slot_size} must be in 1..1 GiB")
        if not 2 <= self.slot_count <= 1024:
            problems.append(f"slot_count {self.slot_count} must be in 2..1024")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        bad = [f for f in self.pixel_formats if f not in PIXEL_FORMATS]
        if bad:
            problems.append(f"pixel_formats {bad} not among {', '.join(PIXEL_FORMATS)}")
        if self.pixel_formats and self.kind != "frame":
            problems.append("pixel_formats only apply to kind = 'frame'")
        if not 1 <= self.max_readers <= 64:
            problems.append(f"max_readers {self.max_readers} must be in 1..64")
        if not 1 <= self.max_leases <= 16:
            problems.append(f"max_leases {self.max_leases} must be in 1..16")
        if self.slot_count <= self.max_readers * self.max_leases:
            problems.append(
                f"slot_count {self.slot_count} must exceed max_readers*max_leases "
                f"= {self.max_readers * self.max_leases}, or readers could block the writer")
        if self.lease_ms <= 0 or self.max_age_ms < 0:
            problems.append("lease_ms must be > 0 and max_age_ms >= 0")
        if not 0 <= self.channel_id < 1 << 32:
            problems.append("channel_id must fit in 32 bits")
        if problems:
            raise ConfigError(f"channel {self.name!r}: " + "; ".join(problems))

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def slot_stride(self) -> int:
        """Bytes from one slot to the next: header area plus page-aligned payload."""
        return _geometry.slot_stride(self.slot_size)

    @property
    def control_size(self) -> int:
        """Channel header page plus one 64-byte control block per slot, page-aligned."""
        return _geometry.control_size(self.slot_count)

    @property
    def segment_size(self) -> int:
        return self.control_size + self.slot_count * self.slot_stride

    @property
    def lease_size(self) -> int:
        return PAGE
