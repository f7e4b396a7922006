"""Recorded camera frames: a simple, self-checking log format.

File layout (all integers little-endian)::

    file header, 32 bytes
      0  magic        8s   b"TRIOCAM\\x00"
      8  version      u16  1
     10  header_size  u16  32 (bytes from the start of the file to the first record)
     12  pixel_format u8   1 nv12, 2 rgb888, 3 gray8, 4 bgr888 (schemas/frame.capnp codes)
     13  pixel_range  u8   0 full, 1 limited
     14  reserved     u16  0
     16  width        u32
     20  height       u32
     24  reserved     u32  0
     28  header_crc   u32  CRC-32 of bytes 0..28

    then records, back to back, each:
      0  magic        4s   b"FRM1"
      4  frame_id     u64
     12  capture_ts   u64  ns, CLOCK_MONOTONIC of the recording machine
     20  exposure_us  u32  0xFFFFFFFF = unknown
     24  length       u32  payload bytes; must equal the frame size of the header's format
     28  payload_crc  u32  CRC-32 of the payload
     32  head_crc     u32  CRC-32 of record bytes 0..32
     36  payload      `length` bytes (tightly packed planes, e.g. NV12: Y then UV)

A bad file header raises `ReplayError` (nothing can be trusted). A bad record never
crashes the reader: it is counted by kind in `ReplayLog.errors` (with a message per
problem in `ReplayLog.problems`) and skipped; after a record whose header is corrupt the
reader resynchronises on the next record magic whose header CRC checks. A truncated
tail counts as one ``truncated`` error. ``strict=True`` raises `ReplayError` instead, at
the first bad record.
"""
from __future__ import annotations

import mmap
import os
import struct
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

MAGIC = b"TRIOCAM\x00"
VERSION = 1
FILE_HDR = struct.Struct("<8sHHBBHIII")          # up to, not including, header_crc
FILE_HDR_SIZE = FILE_HDR.size + 4                 # 32
REC_MAGIC = b"FRM1"
REC_HDR = struct.Struct("<4sQQIII")               # up to, not including, head_crc
REC_HDR_SIZE = REC_HDR.size + 4                   # 36
EXPOSURE_UNKNOWN = 0xFFFFFFFF
MAX_DIM = 16384

FORMAT_CODES = {"nv12": 1, "rgb888": 2, "gray8": 3, "bgr888": 4}
FORMAT_NAMES = {v: k for k, v in FORMAT_CODES.items()}
RANGE_CODES = {"full": 0, "limited": 1}
RANGE_NAMES = {v: k for k, v in RANGE_CODES.items()}

assert FILE_HDR_SIZE == 32 and REC_HDR_SIZE == 36


class ReplayError(Exception):
    """The log cannot be used (bad file header), or a bad record in strict mode."""


def frame_size(pixel_format: str, width: int, height: int) -> int:
    if pixel_format == "nv12":
        return width * height * 3 // 2
    if pixel_format in ("rgb888", "bgr888"):
        return width * height * 3
    if pixel_format == "gray8":
        return width * height
    raise ValueError(f"unknown pixel format {pixel_format!r}")


@dataclass(frozen=True)
class LogHeader:
    pixel_format: str
    width: int
    height: int
    pixel_range: str = "full"

    @property
    def frame_size(self) -> int:
        return frame_size(self.pixel_format, self.width, self.height)


@dataclass(frozen=True)
class ReplayFrame:
    frame_id: int
    capture_ts_ns: int
    exposure_us: int | None
    data: bytes | memoryview      # `frame_size` bytes, tightly packed planes


# ---------------------------------------------------------------- writing


def _file_header(h: LogHeader) -> bytes:
    if h.pixel_format not in FORMAT_CODES:
        raise ValueError(f"unknown pixel format {h.pixel_format!r}")
    if h.pixel_range not in RANGE_CODES:
        raise ValueError(f"unknown pixel range {h.pixel_range!r}")
    if not (0 < h.width <= MAX_DIM and 0 < h.height <= MAX_DIM):
        raise ValueError(f"bad frame size {h.width}x{h.height}")
    if h.pixel_format == "nv12" and (h.width % 2 or h.height % 2):
        raise ValueError("nv12 needs even width and height")
    raw = FILE_HDR.pack(MAGIC, VERSION, FILE_HDR_SIZE, FORMAT_CODES[h.pixel_format],
                        RANGE_CODES[h.pixel_range], 0, h.width, h.height, 0)
    return raw + struct.pack("<I", zlib.crc32(raw))


def record_bytes(frame_id: int, capture_ts_ns: int, exposure_us: int | None,
                 payload) -> bytes:
    """One record (header + payload) as bytes."""
    data = memoryview(payload).cast("B")
    exp = EXPOSURE_UNKNOWN if exposure_us is None else int(exposure_us)
    if not 0 <= exp <= EXPOSURE_UNKNOWN:
        raise ValueError(f"exposure_us {exposure_us} out of range")
    head = REC_HDR.pack(REC_MAGIC, frame_id, capture_ts_ns, exp, len(data),
                        zlib.crc32(data))
    return head + struct.pack("<I", zlib.crc32(head)) + bytes(data)


class LogWriter:
    """Append frames to a new log: ``with LogWriter(path, header) as w: w.write(...)``."""

    def __init__(self, path: str | os.PathLike, header: LogHeader) -> None:
        self.header = header
        self._f = open(path, "wb")
        self._f.write(_file_header(header))
        self.count = 0

    def write(self, frame_id: int, capture_ts_ns: int, exposure_us: int | None,
              payload) -> None:
        """``payload``: any C-contiguous buffer (bytes, numpy array) of the frame size."""
        n = memoryview(payload).nbytes
        if n != self.header.frame_size:
            raise ValueError(f"frame {frame_id}: {n} bytes, a {self.header.width}x"
                             f"{self.header.height} {self.header.pixel_format} frame is "
                             f"{self.header.frame_size}")
        self._f.write(record_bytes(frame_id, capture_ts_ns, exposure_us, payload))
        self.count += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record(path: str | os.PathLike, frames: Iterable, *, width: int, height: int,
           pixel_format: str = "nv12", pixel_range: str = "full") -> int:
    """Write ``frames`` to a new log at ``path``; returns the number written.

    Each frame is a `ReplayFrame` or a tuple ``(frame_id, capture_ts_ns, exposure_us,
    payload)``; for NV12 the payload may also be a ``(y, uv)`` pair of planes.
    """
    with LogWriter(path, LogHeader(pixel_format, width, height, pixel_range)) as w:
        for f in frames:
            if isinstance(f, ReplayFrame):
                fid, ts, exp, data = f.frame_id, f.capture_ts_ns, f.exposure_us, f.data
            else:
                fid, ts, exp, data = f
            if isinstance(data, tuple):
                data = b"".join(memoryview(p).cast("B") if p.flags.c_contiguous
                                else p.tobytes() for p in data)
            w.write(fid, ts, exp, data)
        return w.count


# ---------------------------------------------------------------- reading


class ReplayLog:
    """A recorded log, memory-mapped read-only; iterate it for `ReplayFrame`s whose
    ``data`` are zero-copy views of the file (valid while the log is open)."""

    def __init__(self, path: str | os.PathLike, *, strict: bool = False) -> None:
        self.path = os.fspath(path)
        self.strict = strict
        self.errors: Counter[str] = Counter()
        self.problems: list[str] = []        # first MAX_PROBLEMS messages
        self.good = 0
        self.skipped_bytes = 0
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < FILE_HDR_SIZE:
                raise ReplayError(f"{self.path}: {size} bytes, shorter than the "
                                  f"{FILE_HDR_SIZE}-byte file header (truncated or not a log)")
            self._mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        self._buf = memoryview(self._mm)
        self.header = self._read_header()

    MAX_PROBLEMS = 100

    def _read_header(self) -> LogHeader:
        raw = self._buf[:FILE_HDR_SIZE]
        magic, version, hsize, fmt, rng, _, w, h, _ = FILE_HDR.unpack_from(raw)
        if magic != MAGIC:
            raise ReplayError(f"{self.path}: bad magic {bytes(magic)!r} (expected {MAGIC!r}):"
                              f" not a camera log")
        if version != VERSION:
            raise ReplayError(f"{self.path}: log version {version}, this reader knows "
                              f"{VERSION}")
        (crc,) = struct.unpack_from("<I", raw, FILE_HDR.size)
        if crc != zlib.crc32(raw[:FILE_HDR.size]):
            raise ReplayError(f"{self.path}: file header CRC mismatch (corrupt header)")
        if hsize != FILE_HDR_SIZE:
            raise ReplayError(f"{self.path}: header size {hsize} != {FILE_HDR_SIZE}")
        if fmt not in FORMAT_NAMES or rng not in RANGE_NAMES:
            raise ReplayError(f"{self.path}: unknown pixel format {fmt} or range {rng}")
        if not (0 < w <= MAX_DIM and 0 < h <= MAX_DIM) or (
                FORMAT_NAMES[fmt] == "nv12" and (w % 2 or h % 2)):
            raise ReplayError(f"{self.path}: bad frame size {w}x{h}")
        return LogHeader(FORMAT_NAMES[fmt], w, h, RANGE_NAMES[rng])

    def _bad(self, kind: str, offset: int, text: str) -> None:
        msg = f"{self.path}@{offset}: {text}"
        if self.strict:
            raise ReplayError(msg)
        self.errors[kind] += 1
        if len(self.problems) < self.MAX_PROBLEMS:
            self.problems.append(msg)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def summary(self) -> str:
        errs = ", ".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "none"
        return f"{self.good} good records, errors: {errs}, {self.skipped_bytes} bytes skipped"

    def _resync(self, pos: int) -> int:
        """Offset of the next record magic after ``pos`` whose header CRC checks (or
        the end of the file)."""
        end = len(self._mm)
        p = pos + 1
        while True:
            p = self._mm.find(REC_MAGIC, p)
            if p < 0 or p + REC_HDR_SIZE > end:
                return end
            if self._head_ok(p):
                return p
            p += 1

    def _head_ok(self, p: int) -> bool:
        (crc,) = struct.unpack_from("<I", self._buf, p + REC_HDR.size)
        return crc == zlib.crc32(self._buf[p:p + REC_HDR.size])

    def __iter__(self) -> Iterator[ReplayFrame]:
        """One pass over the records (each pass re-counts its errors from zero)."""
        self.errors.clear()
        self.problems.clear()
        self.good = self.skipped_bytes = 0
        buf, end, want = self._buf, len(self._mm), self.header.frame_size
        pos = FILE_HDR_SIZE
        while pos < end:
            if end - pos < REC_HDR_SIZE:
                self._bad("truncated", pos, f"{end - pos} trailing bytes, shorter than a "
                          f"record header (truncated log)")
                self.skipped_bytes += end - pos
                return
            magic, fid, ts, exp, length, pcrc = REC_HDR.unpack_from(buf, pos)
            if magic != REC_MAGIC or not self._head_ok(pos):
                what = "bad record magic" if magic != REC_MAGIC else "record header CRC mismatch"
                nxt = self._resync(pos)
                self._bad("bad_header", pos, f"{what}; skipped {nxt - pos} bytes to the "
                          f"next good record header")
                self.skipped_bytes += nxt - pos
                pos = nxt
                continue
            body = pos + REC_HDR_SIZE
            if body + length > end:
                self._bad("truncated", pos, f"frame {fid}: payload of {length} bytes runs "
                          f"past the end of the file ({end - body} left; truncated log)")
                nxt = self._resync(pos)       # a later record may still be whole
                self.skipped_bytes += nxt - pos
                pos = nxt
                continue
            nxt = body + length
            if length != want:
                self._bad("bad_length", pos, f"frame {fid}: {length} payload bytes, a "
                          f"{self.header.width}x{self.header.height} "
                          f"{self.header.pixel_format} frame is {want}")
                self.skipped_bytes += nxt - pos
                pos = nxt
                continue
            data = buf[body:nxt]
            if zlib.crc32(data) != pcrc:
                self._bad("bad_crc", pos, f"frame {fid}: payload CRC mismatch (corrupt "
                          f"pixels), record skipped")
                self.skipped_bytes += nxt - pos
                pos = nxt
                continue
            self.good += 1
            yield ReplayFrame(fid, ts, None if exp == EXPOSURE_UNKNOWN else exp, data)
            pos = nxt

    def close(self) -> None:
        try:
            self._buf.release()
            self._mm.close()
        except BufferError:
            pass   # a caller still holds a frame view; the mapping goes with it

    def __enter__(self) -> ReplayLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_all(path: str | os.PathLike, *, strict: bool = False
             ) -> tuple[LogHeader, list[ReplayFrame], ReplayLog]:
    """Every good frame, copied out (convenience for tools and tests)."""
    log = ReplayLog(path, strict=strict)
    frames = [ReplayFrame(f.frame_id, f.capture_ts_ns, f.exposure_us, bytes(f.data))
              for f in log]
    return log.header, frames, log
