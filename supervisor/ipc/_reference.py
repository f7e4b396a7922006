"""The reference SlotHeader / SlotLayout codec: pycapnp's dynamic API, and every check.

This is the obvious, slow path and the judge: `decode_layout` is the only layout
decoder (a stream repeats its layout bytes, so readers cache its answer), and
`read_header` / `read_receipt` are what the compiled fast path (`_fast_header`,
`_fast_receipt`) must agree with, and fall back to for anything it does not handle
plainly. The tests compare both on valid, mutated and random bytes.
"""
from __future__ import annotations

import numpy as np

import schemas

from . import receipt as receipts
from ._types import (_CODE_NAMES, _FROM_DLPACK, _PLANES, MAX_FRAME_DIM, NESTING_LIMIT,
                     TRAVERSAL_LIMIT_WORDS, FrameFormat, Layout, PlaneInfo, Stamp,
                     dlpack_of, tensor_span)
from .errors import BoundsError, DTypeMismatch, FormatError, MalformedHeader
from .receipt import Receipt
from .spec import MAX_NDIM, ChannelSpec

_slot = schemas.load("slot")
SlotHeader = _slot.SlotHeader
SlotLayout = _slot.SlotLayout
SCHEMA_VERSION: int = _slot.schemaVersion
receipt_schema = schemas.load("receipt")


# ---------------------------------------------------------------- writer side


def encode_layout(dtype: np.dtype, shape: tuple[int, ...], strides: tuple[int, ...],
                  offset: int, frame: FrameFormat | None) -> bytes:
    code, bits = dlpack_of(dtype)
    msg = SlotLayout.new_message(schemaVersion=SCHEMA_VERSION)
    t = msg.init("tensor")
    t.dtype.code = code
    t.dtype.bits = bits
    t.dtype.lanes = 1
    t.shape = list(shape)
    t.strides = list(strides)
    t.byteOffset = offset
    lo, hi = tensor_span(shape, strides, offset, np.dtype(dtype).itemsize)
    t.nbytes = hi - lo
    t.device.type = "cpu"
    if frame is None:
        msg.frame.none = None
    else:
        f = msg.frame.init("format")
        f.sensor = frame.sensor
        f.pixelFormat = frame.pixel_format
        f.pixelRange = frame.pixel_range
        f.width = frame.width
        f.height = frame.height
        planes = f.init("planes", len(frame.planes))
        for dst, p in zip(planes, frame.planes):
            dst.offset, dst.rowStride, dst.width, dst.height = (
                p.offset, p.row_stride, p.width, p.height)
    return msg.to_bytes()


def encode_header(spec: ChannelSpec, *, sequence: int, generation: int, writer_pid: int,
                  domain: str, publish_ts_ns: int, crc32: int | None,
                  frame_id: int | None = None, capture_ts_ns: int | None = None,
                  exposure_us: int | None = None, gain: float | None = None,
                  receipt: Receipt | None = None) -> bytes:
    msg = SlotHeader.new_message(
        schemaVersion=SCHEMA_VERSION, channelId=spec.channel_id, sequence=sequence,
        generation=generation, writerPid=writer_pid, writerDomain=domain,
        publishTsNs=publish_ts_ns)
    if crc32 is not None:
        msg.payloadCrc.crc32 = crc32
    if frame_id is not None:
        m = msg.frame.init("meta")
        m.frameId = frame_id
        m.captureTsNs = capture_ts_ns or 0
        if exposure_us is not None:
            m.exposure.microseconds = exposure_us
        if gain is not None:
            m.gain.value = gain
    if receipt is not None:
        receipts.fill(msg.init("receipt"), receipt)
    return msg.to_bytes()


# ---------------------------------------------------------------- reader side


def decode_layout(raw: bytes, spec: ChannelSpec, capacity: int) -> Layout:
    """Parse and check a SlotLayout against the channel contract and slot capacity."""
    name = spec.name
    try:
        with SlotLayout.from_bytes(raw, traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS,
                                   nesting_limit=NESTING_LIMIT) as msg:
            t = msg.tensor
            dt = t.dtype
            code, bits, lanes = dt.code.raw, dt.bits, dt.lanes
            shape = tuple(t.shape)
            strides = tuple(t.strides)
            offset, nbytes = t.byteOffset, t.nbytes
            device = t.device.type.raw
            which = msg.frame.which()
            fmt = None
            if which == "format":
                f = msg.frame.format
                fmt = (str(f.sensor), str(f.pixelFormat), str(f.pixelRange), f.width,
                       f.height, [(p.offset, p.rowStride, p.width, p.height)
                                  for p in f.planes])
    except Exception as e:  # pycapnp raises KjException, RuntimeError, ValueError, ...: all mean "bad bytes"
        raise MalformedHeader(name, f"SlotLayout does not decode: {short(e)}") from None

    key = (code, bits)
    if lanes != 1:
        raise DTypeMismatch(name, f"lanes={lanes}; only scalar lanes=1 is supported")
    if key not in _FROM_DLPACK:
        label = _CODE_NAMES[code] if code < len(_CODE_NAMES) else str(code)
        raise DTypeMismatch(name, f"DLPack dtype {label}{bits} is not supported")
    dtype = np.dtype(_FROM_DLPACK[key])
    if dtype != spec.np_dtype:
        raise DTypeMismatch(name, f"tensor is {dtype.name}, channel contract is {spec.dtype}")
    if device != 1:
        raise MalformedHeader(name, f"device type {device} is not CPU shared memory")
    if not 0 < len(shape) <= MAX_NDIM or len(strides) != len(shape):
        raise BoundsError(name, f"ndim {len(shape)} with {len(strides)} strides "
                                f"(need 1..{MAX_NDIM}, one stride per dim)")
    item = dtype.itemsize
    if offset % item or any(s % item for s in strides):
        raise BoundsError(name, f"offset {offset} / strides {list(strides)} are not "
                                f"multiples of the item size {item} (DLPack needs it)")
    if any(n > capacity for n in shape) or offset > capacity:
        raise BoundsError(name, f"shape {list(shape)} / offset {offset} exceed the slot "
                                f"capacity {capacity}")
    if any(s == 0 and n > 1 for n, s in zip(shape, strides)):
        raise BoundsError(name, f"zero stride in strides {list(strides)}: broadcast views "
                                f"are not accepted on the bridge")
    count = 1
    for n in shape:
        count *= n
    if count * item > capacity:
        raise BoundsError(name, f"shape {list(shape)} holds {count * item} bytes, more than "
                                f"the slot capacity {capacity}")
    lo, hi = tensor_span(shape, strides, offset, item)
    if lo < 0 or hi > capacity:
        raise BoundsError(name, f"view shape={list(shape)} strides={list(strides)} "
                                f"offset={offset} touches bytes [{lo}, {hi}) outside the "
                                f"slot payload [0, {capacity})")
    if nbytes != hi - lo:
        raise BoundsError(name, f"nbytes {nbytes} disagrees with the span {hi - lo} "
                                f"of shape/strides")
    frame = None
    if spec.kind == "frame":
        if fmt is None:
            raise FormatError(name, "frame channel message carries no FrameFormat")
        frame = _check_frame(name, spec, capacity, *fmt)
    elif fmt is not None:
        raise FormatError(name, "tensor channel message carries a FrameFormat")
    return Layout(dtype, shape, strides, offset, nbytes, (lo, hi), frame)


def _check_frame(name: str, spec: ChannelSpec, capacity: int, sensor: str, pix: str,
                 rng: str, width: int, height: int, planes: list) -> FrameFormat:
    if pix not in _PLANES:
        raise FormatError(name, f"pixel format {pix!r} is not supported")
    if spec.pixel_formats and pix not in spec.pixel_formats:
        raise FormatError(name, f"pixel format {pix} not in the channel contract "
                                f"{list(spec.pixel_formats)}")
    if not (0 < width <= MAX_FRAME_DIM and 0 < height <= MAX_FRAME_DIM):
        raise FormatError(name, f"frame size {width}x{height} out of 1..{MAX_FRAME_DIM}")
    expect = _PLANES[pix]
    if len(planes) != len(expect):
        raise FormatError(name, f"{pix} needs {len(expect)} planes, got {len(planes)}")
    if pix == "nv12" and (width % 2 or height % 2):
        raise FormatError(name, f"nv12 needs even width and height, got {width}x{height}")
    out = []
    for i, ((off, stride, pw, ph), (bps, dx, dy)) in enumerate(zip(planes, expect)):
        want = (width // dx, height // dy)
        if (pw, ph) != want:
            raise FormatError(name, f"{pix} plane {i} is {pw}x{ph}, expected {want[0]}x{want[1]}")
        if stride < pw * bps:
            raise FormatError(name, f"plane {i} row stride {stride} < {pw} samples x {bps} B")
        end = off + stride * (ph - 1) + pw * bps
        if end > capacity:
            raise BoundsError(name, f"plane {i} spans [{off}, {end}) beyond slot capacity "
                                    f"{capacity}")
        out.append(PlaneInfo(off, stride, pw, ph, bps))
    return FrameFormat(sensor, pix, rng, width, height, tuple(out))


def read_header(raw: bytes, spec: ChannelSpec) -> tuple:
    """pycapnp's reading of a SlotHeader, as the values `check_stamp` takes."""
    try:
        with SlotHeader.from_bytes(raw, traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS,
                                   nesting_limit=NESTING_LIMIT) as h:
            crc = h.payloadCrc.crc32 if h.payloadCrc.which() == "crc32" else None
            frame_id = capture = exposure = gain = None
            if h.frame.which() == "meta":
                m = h.frame.meta
                frame_id, capture = m.frameId, m.captureTsNs
                if m.exposure.which() == "microseconds":
                    exposure = m.exposure.microseconds
                if m.gain.which() == "value":
                    gain = m.gain.value
            return (h.schemaVersion, h.channelId, h.sequence, h.generation, h.writerPid,
                    h.publishTsNs, crc, frame_id, capture, exposure, gain)
    except Exception as e:  # pycapnp raises KjException, RuntimeError, ValueError, ...: all mean "bad bytes"
        raise MalformedHeader(spec.name, f"SlotHeader does not decode: {short(e)}") from None


def check_stamp(spec: ChannelSpec, version, channel, seq, gen, pid, ts, crc, frame_id,
                capture, exposure, gain) -> Stamp:
    """The SlotHeader rules of the channel contract (the reader checks order and age)."""
    name = spec.name
    if version < 1:
        raise MalformedHeader(name, f"schema version {version} is not a valid version")
    if channel != spec.channel_id:
        raise MalformedHeader(name, f"header names channel id {channel}, expected "
                                    f"{spec.channel_id}", seq)
    if spec.crc and crc is None:
        raise MalformedHeader(name, "channel requires a payload CRC; header has none", seq)
    if spec.kind == "frame" and frame_id is None:
        raise FormatError(name, "frame channel message carries no FrameMeta", seq)
    return Stamp(seq, gen, pid, ts, crc, frame_id, capture, exposure, gain)


def read_receipt(raw: bytes, spec: ChannelSpec, sequence: int) -> Receipt | None:
    """pycapnp's reading of the Receipt in a SlotHeader, None if it carries none."""
    try:
        with SlotHeader.from_bytes(raw, traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS,
                                   nesting_limit=NESTING_LIMIT) as h:
            if not h._has("receipt"):
                return None
            return receipts.read(h.receipt)
    except Exception as e:  # pycapnp raises several types: all mean "bad bytes"
        raise MalformedHeader(spec.name, f"receipt does not decode: {short(e)}",
                              sequence) from None


def short(e: Exception) -> str:
    # KjException's str() ends with a native stack trace; its description is the reason.
    text = getattr(e, "description", None) or str(e)
    lines = [ln for ln in str(text).strip().splitlines() if not ln.startswith("stack:")]
    return (lines[0] if lines else type(e).__name__)[:200]
