"""Encode and validate the capnp SlotHeader / SlotLayout of a slot.

Everything a reader takes from shared memory passes through ``decode_layout`` and
``decode_header``: they either return plain, checked Python values or raise a typed
``Rejected``. Nothing here trusts the writer.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import numpy as np

import schemas

from .errors import BoundsError, DTypeMismatch, FormatError, MalformedHeader
from . import receipt as receipts
from .receipt import Receipt
from .spec import MAX_NDIM, ChannelSpec

_slot = schemas.load("slot")
SlotHeader = _slot.SlotHeader
SlotLayout = _slot.SlotLayout
SCHEMA_VERSION: int = _slot.schemaVersion
_receipt_schema = schemas.load("receipt")

# Receipt scalars as (python name, capnp name), in the order HeaderPlan patches them and
# _HeaderAccess.receipt reads them; completion (an enum) last.
_R_SCALARS = (("frame_id", "frameId"), ("capture_ts_ns", "captureTsNs"),
              ("infer_start_ns", "inferStartNs"), ("infer_end_ns", "inferEndNs"),
              ("bytes_in", "bytesIn"), ("bytes_out", "bytesOut"),
              ("latency_ns", "latencyNs"), ("worst_case_ns", "worstCaseNs"),
              ("deadline_ns", "deadlineNs"), ("deadline_misses", "deadlineMisses"),
              ("kernels_run", "kernelsRun"), ("completion", "completion"))

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


def publish_ts_offset(raw: bytes) -> int:
    """Byte position of SlotHeader.publishTsNs in an encoded header (for late stamping)."""
    from . import capnp_fast as cf

    m = cf.Message(raw)
    return m.root.data + cf.scalar(SlotHeader.schema, "publishTsNs").offset


def decode_receipt(raw: bytes, spec: ChannelSpec, sequence: int, *, fast: bool = True
                   ) -> Receipt | None:
    """The execution receipt in a SlotHeader, if it carries one (read on demand).
    ``fast=False`` forces pycapnp's dynamic reader (the reference the tests compare to);
    the compiled path hands anything it does not handle plainly to it."""
    if fast:
        r = HEADER.receipt(raw)
        if r is not SLOW:
            return r
    try:
        with SlotHeader.from_bytes(raw, traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS,
                                   nesting_limit=NESTING_LIMIT) as h:
            if not h._has("receipt"):
                return None
            return receipts.read(h.receipt)
    except Exception as e:  # pycapnp raises several types: all mean "bad bytes"
        raise MalformedHeader(spec.name, f"receipt does not decode: {_short(e)}",
                              sequence) from None


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
        raise MalformedHeader(name, f"SlotLayout does not decode: {_short(e)}") from None

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


def decode_header(raw: bytes, spec: ChannelSpec, *, fast: bool = True) -> Stamp:
    """Parse and structurally check a SlotHeader (the reader checks ordering and age).
    ``fast=False`` forces pycapnp's dynamic reader (the reference the tests compare to)."""
    if fast:
        return HEADER.decode(raw, spec)
    return _check_stamp(spec, *_decode_header_dynamic(raw, spec))


def _short(e: Exception) -> str:
    # KjException's str() ends with a native stack trace; its description is the reason.
    text = getattr(e, "description", None) or str(e)
    lines = [ln for ln in str(text).strip().splitlines() if not ln.startswith("stack:")]
    return (lines[0] if lines else type(e).__name__)[:200]


# ------------------------------------------------- fixed-offset SlotHeader fast path

_new_stamp = tuple.__new__
# Compiled decoders kept per distinct message structure (bounded: the bytes come from a
# possibly hostile writer, so they must not grow the cache without limit).
_MAX_COMPILED = 32


class _Structure(NamedTuple):
    """Where every SlotHeader field sits in messages whose first 16 bytes (segment
    table and root pointer) equal the ones compiled and, for FrameMeta's fields, whose
    FrameMeta pointer word equals ``meta_word``.

    Those words alone decide every struct position and bounds check of the per-field
    path, so for such a message one ``unpack_from`` reads exactly what it would read
    (the tests compare both, and both to pycapnp)."""

    end: int            # the segment's end: the message must be at least this long
    start: int
    unpack_from: object
    order: object       # None, or puts the values in _HeaderAccess's field order
    has_meta: bool      # FrameMeta resolved plainly: its pointer word and fields are read
    meta_word: int      # the FrameMeta pointer word these positions hold for


class HeaderPlan:
    """A compiled SlotHeader writer for one (channel, pid, domain, crc?, frame?) shape:
    ``pack_into`` writes the whole message in one struct call. ``ts_pos`` is where
    publishTsNs sits, so a writer can stamp the time last."""

    __slots__ = ("size", "ts_pos", "has_crc", "has_frame", "has_receipt", "_patcher",
                 "_exp", "_gain", "_rvals")

    def __init__(self, access: _HeaderAccess, template: bytes, has_crc: bool,
                 has_frame: bool, has_receipt: bool = False) -> None:
        from . import capnp_fast as cf

        a = access
        m = cf.Message(template)
        r = m.root
        meta = m.child(r, a.meta_ptr) if has_frame else cf.NULL
        # One value per field, in the order ``values`` gives them; a shape without a CRC
        # or a FrameMeta leaves those bytes as the template has them.
        fields = [(r, a.sequence), (r, a.generation), (r, a.ts)]
        if has_crc:
            fields.append((r, a.crc))
        if has_frame:
            fields += [(meta, s) for s in (a.frame_id, a.capture, a.exp_which, a.exp,
                                           a.gain_which, a.gain)]
        if has_receipt:
            # A receipt's Text and Data (device, artifactSha256) are in the template:
            # a plan is made per (device, sha256), so only its scalars vary.
            rc = m.child(r, a.receipt_ptr)
            if rc is cf.NULL or rc.dwords == 0:
                raise cf.Broken("template has no receipt struct")
            fields += [(rc, s) for s in a.r_scalars]
        placed = []
        for ref, sc in fields:
            if not ref.holds(sc):
                raise cf.Broken("field outside the template's data section")
            placed.append((ref.at(sc), sc))
        self._patcher = cf.Patcher(template, placed)
        self.size = len(template)
        self.ts_pos = r.at(a.ts)
        self.has_crc, self.has_frame, self.has_receipt = has_crc, has_frame, has_receipt
        self._exp = (a.exp_unknown, a.exp_is)
        self._gain = (a.gain_unknown, a.gain_is)
        self._rvals = a.receipt_values
        # The template's own values (what _HeaderAccess.plan built it from) must give
        # back its exact bytes, or this plan would not be pycapnp's encoding.
        zero = a.zero_receipt if has_receipt else None
        if self.pack(0, 0, 0, 0, 0, 0, 0, 0.0, zero) != template:
            raise cf.Broken("compiled SlotHeader writer does not reproduce its template")

    def values(self, sequence, generation, ts, crc, frame_id, capture, exposure, gain,
               receipt=None) -> tuple:
        out = (sequence, generation, ts)
        if self.has_crc:
            out += (crc,)
        if self.has_frame:
            out += (frame_id, capture or 0,
                    self._exp[0] if exposure is None else self._exp[1],
                    0 if exposure is None else exposure,
                    self._gain[0] if gain is None else self._gain[1],
                    0.0 if gain is None else gain)
        if self.has_receipt:
            out += self._rvals(receipt)
        return out

    def pack_into(self, buf, pos: int, *args) -> None:
        """``args``: sequence, generation, ts, crc, frame_id, capture, exposure, gain
        (and the Receipt, for a plan made with ``plan_receipt``)."""
        self._patcher.pack_into(buf, pos, self.values(*args))

    def pack(self, *args) -> bytes:
        return self._patcher.pack(self.values(*args))


class _HeaderAccess:
    """SlotHeader fields at the offsets the loaded schema gives (see capnp_fast)."""

    def __init__(self) -> None:
        from . import capnp_fast as cf

        hs = SlotHeader.schema
        self.version = cf.scalar(hs, "schemaVersion")
        self.channel = cf.scalar(hs, "channelId")
        self.sequence = cf.scalar(hs, "sequence")
        self.generation = cf.scalar(hs, "generation")
        self.pid = cf.scalar(hs, "writerPid")
        self.ts = cf.scalar(hs, "publishTsNs")
        g, self.crc_which, members = cf.union(hs, "payloadCrc")
        self.crc_is, self.crc_n = members["crc32"], len(members)
        self.crc = cf.scalar(g, "crc32")
        g, self.frame_which, members = cf.union(hs, "frame")
        self.frame_is, self.frame_n = members["meta"], len(members)
        self.meta_ptr = cf.pointer_index(g, "meta")
        ms = g.fields["meta"].schema
        self.frame_id = cf.scalar(ms, "frameId")
        self.capture = cf.scalar(ms, "captureTsNs")
        g, self.exp_which, members = cf.union(ms, "exposure")
        self.exp_is, self.exp_unknown = members["microseconds"], members["unknown"]
        self.exp_n = len(members)
        self.exp = cf.scalar(g, "microseconds")
        g, self.gain_which, members = cf.union(ms, "gain")
        self.gain_is, self.gain_unknown = members["value"], members["unknown"]
        self.gain_n = len(members)
        self.gain = cf.scalar(g, "value")
        # The order decode() names them in: the order they lie in a SlotHeader of this
        # schema, so the compiled read needs no reordering (any other order works too).
        self._root_fields = (self.version, self.channel, self.sequence, self.generation,
                             self.pid, self.crc_which, self.frame_which, self.ts, self.crc)
        self._meta_fields = (self.frame_id, self.capture, self.exp_which, self.gain_which,
                             self.exp, self.gain)
        # Receipt (schemas/receipt.capnp): its scalars, in the order receipt_values
        # gives them, and its two pointers (Text device, Data artifactSha256).
        self.receipt_ptr = cf.pointer_index(hs, "receipt")
        rs = hs.fields["receipt"].schema
        self.r_scalars = tuple(cf.scalar(rs, cp) for _, cp in _R_SCALARS)
        self.r_device_ptr = cf.pointer_index(rs, "device")
        self.r_sha_ptr = cf.pointer_index(rs, "artifactSha256")
        comp = _receipt_schema.CompletionPoint.schema.enumerants
        self.r_completion = {n: comp[n] for n in receipts.COMPLETION_POINTS}
        self.r_completion_name = {v: n for n, v in self.r_completion.items()}
        get = attrgetter(*(py for py, _ in _R_SCALARS[:-1]))
        completion = self.r_completion

        def receipt_values(r: Receipt) -> tuple:
            return (*get(r), completion[r.completion])

        self.receipt_values = receipt_values
        self.zero_receipt = Receipt(0, 0, 0, 0, "", 0, 0, "unknown")
        self._plans: dict[tuple, HeaderPlan] = {}
        self._compiled: dict[bytes, _Structure] = {}
        self._rcompiled: dict[bytes, list] = {}

    # ------------------------------------------------------------------ reading

    def decode(self, raw: bytes, spec: ChannelSpec) -> Stamp:
        c = self._compiled.get(raw[:16])
        if c is None:
            return self._decode_fields(raw, spec)
        end, start, unpack_from, order, has_meta, meta_word = c
        if len(raw) < end:
            return self._decode_fields(raw, spec)          # rejects it
        v = unpack_from(raw, start)
        if order is not None:
            v = order(v)
        if has_meta:
            (version, channel, seq, gen, pid, crc_which, frame_which, ts, crc, word,
             frame_id, capture, exp_which, gain_which, exposure, gain) = v
            if crc_which >= self.crc_n or frame_which >= self.frame_n:
                return self._decode_fields(raw, spec)      # unknown union member
            if frame_which != self.frame_is:
                frame_id = capture = exposure = gain = None
            elif word != meta_word:
                return self._decode_fields(raw, spec)      # FrameMeta is elsewhere
            elif exp_which >= self.exp_n or gain_which >= self.gain_n:
                return self._decode_fields(raw, spec)      # unknown union member
            else:
                if exp_which != self.exp_is:
                    exposure = None
                if gain_which != self.gain_is:
                    gain = None
        else:
            version, channel, seq, gen, pid, crc_which, frame_which, ts, crc = v
            if frame_which == self.frame_is or crc_which >= self.crc_n or (
                    frame_which >= self.frame_n):
                return self._decode_fields(raw, spec)      # FrameMeta is not plain here
            frame_id = capture = exposure = gain = None
        if crc_which != self.crc_is:
            crc = None
        if (version >= 1 and channel == spec.channel_id
                and (crc is not None or not spec.crc)
                and (frame_id is not None or spec.kind != "frame")):
            return _new_stamp(Stamp, (seq, gen, pid, ts, crc, frame_id, capture, exposure,
                                      gain))
        return _check_stamp(spec, version, channel, seq, gen, pid, ts, crc, frame_id,
                            capture, exposure, gain)       # raises the typed rejection

    def _decode_fields(self, raw: bytes, spec: ChannelSpec) -> Stamp:
        """Field by field; compiles the message's structure for the next time."""
        from . import capnp_fast as cf

        try:
            m = cf.Message(raw)
            r = m.root
            get = r.get
            crc_which, frame_which = get(raw, self.crc_which), get(raw, self.frame_which)
            if crc_which >= self.crc_n or frame_which >= self.frame_n:
                raise cf.Unusual("unknown union member: pycapnp decides")
            crc = get(raw, self.crc) if crc_which == self.crc_is else None
            frame_id = capture = exposure = gain = None
            if frame_which == self.frame_is:
                meta = m.child(r, self.meta_ptr)
                frame_id, capture = meta.get(raw, self.frame_id), meta.get(raw, self.capture)
                exp_which, gain_which = meta.get(raw, self.exp_which), meta.get(raw, self.gain_which)
                if exp_which >= self.exp_n or gain_which >= self.gain_n:
                    raise cf.Unusual("unknown union member: pycapnp decides")
                if exp_which == self.exp_is:
                    exposure = meta.get(raw, self.exp)
                if gain_which == self.gain_is:
                    gain = meta.get(raw, self.gain)
            values = (get(raw, self.version), get(raw, self.channel),
                      get(raw, self.sequence), get(raw, self.generation),
                      get(raw, self.pid), get(raw, self.ts), crc, frame_id, capture,
                      exposure, gain)
        except cf.Unusual:
            values = _decode_header_dynamic(raw, spec)
        except cf.Broken as e:
            raise MalformedHeader(spec.name, f"SlotHeader does not decode: {e}") from None
        else:
            self._compile(m)
        return _check_stamp(spec, *values)

    def _compile(self, m) -> None:
        """Remember where this message's structure puts every field (see _Structure)."""
        from . import capnp_fast as cf

        raw, r = m.buf, m.root
        if not all(r.holds(s) for s in self._root_fields):
            return          # a shorter (older) struct: fields read as defaults; no plan
        fields = [(r.at(s), s) for s in self._root_fields]
        plan, meta_word = None, 0
        if self.meta_ptr < r.pcount:
            pos = r.ptrs + self.meta_ptr * 8
            try:
                meta = m.struct_at(pos)
            except (cf.Broken, cf.Unusual):
                meta = cf.NULL
            if all(meta.holds(s) for s in self._meta_fields):
                meta_word = cf.WORD.fmt.unpack_from(raw, pos)[0]
                plan = cf.gather(fields + [(pos, cf.WORD)] +
                                 [(meta.at(s), s) for s in self._meta_fields])
        has_meta = plan is not None
        if plan is None:
            plan = cf.gather(fields)
            if plan is None:
                return
        if len(self._compiled) >= _MAX_COMPILED:
            self._compiled.clear()
        self._compiled[bytes(raw[:16])] = _Structure(m.end, *plan, has_meta, meta_word)

    # ------------------------------------------------------------------ writing

    def plan(self, spec: ChannelSpec, writer_pid: int, domain: str, has_crc: bool,
             has_frame: bool) -> HeaderPlan:
        key = (spec.channel_id, writer_pid, domain, has_crc, has_frame)
        plan = self._plans.get(key)
        if plan is None:
            template = encode_header(spec, sequence=0, generation=0, writer_pid=writer_pid,
                                     domain=domain, publish_ts_ns=0,
                                     crc32=0 if has_crc else None,
                                     frame_id=0 if has_frame else None, capture_ts_ns=0,
                                     exposure_us=0, gain=0.0)
            plan = HeaderPlan(self, template, has_crc, has_frame)
            if len(self._plans) >= 64:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def plan_receipt(self, spec: ChannelSpec, writer_pid: int, domain: str, has_crc: bool,
                     has_frame: bool, device: str, sha256: bytes) -> HeaderPlan:
        """A compiled SlotHeader writer for headers that carry a Receipt with this
        ``device`` and ``artifactSha256`` (constant per stream): the template is pycapnp's
        encoding, and the plan is checked byte for byte against pycapnp twice, on the
        template's zeros and on a probe whose every patched field is non-zero."""
        key = (spec.channel_id, writer_pid, domain, has_crc, has_frame, device, sha256)
        plan = self._plans.get(key)
        if plan is None:
            zero = Receipt(0, 0, 0, 0, device, 0, 0, "unknown", artifact_sha256=sha256)
            template = encode_header(spec, sequence=0, generation=0, writer_pid=writer_pid,
                                     domain=domain, publish_ts_ns=0,
                                     crc32=0 if has_crc else None,
                                     frame_id=0 if has_frame else None, capture_ts_ns=0,
                                     exposure_us=0, gain=0.0, receipt=zero)
            plan = HeaderPlan(self, template, has_crc, has_frame, has_receipt=True)
            probe = Receipt(0x0101010101010101, 0x0202020202020202, 0x0303030303030303,
                            0x0404040404040404, device, 0x0505050505050505,
                            0x0606060606060606, "deviceQueued", 0x0707070707070707,
                            0x0808080808080808, 0x0909090909090909, 0x0A0A0A0A0A0A0A0A,
                            sha256, 0x0B0B0B0B)
            args = dict(sequence=0x1111111111111111, generation=0x2222222222222222,
                        publish_ts_ns=0x3333333333333333,
                        crc32=0x44444444 if has_crc else None,
                        frame_id=0x5555555555555555 if has_frame else None,
                        capture_ts_ns=0x6666666666666666 if has_frame else None,
                        exposure_us=0x77777777 if has_frame else None,
                        gain=1.5 if has_frame else None)
            want = encode_header(spec, writer_pid=writer_pid, domain=domain,
                                 receipt=probe, **args)
            got = plan.pack(args["sequence"], args["generation"], args["publish_ts_ns"],
                            args["crc32"], args["frame_id"], args["capture_ts_ns"],
                            args["exposure_us"], args["gain"], probe)
            if got != want:
                from . import capnp_fast as cf

                raise cf.Broken("compiled receipt header differs from pycapnp's")
            if len(self._plans) >= 64:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    # ------------------------------------------------------------ receipt reading

    def receipt(self, raw: bytes):
        """The Receipt in an encoded SlotHeader, None if it has none, or ``SLOW`` when
        only pycapnp may answer (unusual layout, bad bytes, anything not plain).

        Compiled per structure: the first 16 bytes (segment table, root pointer) place
        the receipt pointer; that word places the receipt's scalars and its two list
        pointers; those two words place device and artifactSha256. Equal words, equal
        positions and bounds checks, so the answer is pycapnp's (the tests compare)."""
        c = self._rcompiled.get(raw[:16])
        if c is None:
            c = self._rcompile_root(raw)
            if c is None:
                return SLOW
        end, rpos, subs = c
        if len(raw) < end:
            return SLOW
        if rpos < 0:
            return None
        rw = raw[rpos:rpos + 8]
        if rw == _ZERO_WORD:
            return None
        e = subs.get(rw)
        if e is None:
            e = self._rcompile_receipt(raw, rpos, end, subs)
            if e is None:
                return SLOW
        start, unpack_from, order, lists, dpos, spos = e
        v = unpack_from(raw, start)
        if order is not None:
            v = order(v)
        spans = lists.get(v[-2:])
        if spans is None:
            spans = _list_spans(lists, v[-2:], dpos, spos, end)
            if spans is None:
                return SLOW
        ds, de, ss, se = spans
        if de >= 0:
            if raw[de] != 0:                  # Text must end in NUL
                return SLOW
            dev = raw[ds:de]
            if b"\0" in dev:
                return SLOW
            try:
                device = dev.decode()
            except UnicodeDecodeError:
                return SLOW
        else:
            device = ""
        completion = self.r_completion_name.get(v[11])
        if completion is None:
            return SLOW
        return Receipt(v[0], v[1], v[2], v[3], device[:64], v[4], v[5], completion, v[6],
                       v[7], v[8], v[9], raw[ss:se][:64], v[10])

    def receipt_capture(self, raw: bytes):
        """Only the receipt's captureTsNs (an int), None if the header has no receipt,
        or ``SLOW`` when only pycapnp may answer: the first steps of ``receipt``, on the
        same compiled structures, without building the Receipt. The reader checks it on
        every message; the whole Receipt is still decoded on demand. Where both answer,
        it is the captureTsNs ``receipt`` (and so pycapnp) gives, since the receipt
        pointer word alone places the scalars; a receipt whose Text or Data is bad still
        raises MalformedHeader when decoded."""
        c = self._rcompiled.get(raw[:16])
        if c is None:
            c = self._rcompile_root(raw)
            if c is None:
                return SLOW
        end, rpos, subs = c
        if len(raw) < end:
            return SLOW
        if rpos < 0:
            return None
        rw = raw[rpos:rpos + 8]
        if rw == _ZERO_WORD:
            return None
        e = subs.get(rw)
        if e is None:
            e = self._rcompile_receipt(raw, rpos, end, subs)
            if e is None:
                return SLOW
        v = e[1](raw, e[0])                    # unpack_from(raw, start)
        if e[2] is not None:
            v = e[2](v)                        # order
        return v[1]                            # _R_SCALARS[1]: capture_ts_ns

    def _rcompile_root(self, raw: bytes):
        from . import capnp_fast as cf

        try:
            m = cf.Message(raw)
        except (cf.Broken, cf.Unusual):
            return None
        r = m.root
        rpos = r.ptrs + self.receipt_ptr * 8 if self.receipt_ptr < r.pcount else -1
        c = (m.end, rpos, {})
        if len(self._rcompiled) >= _MAX_COMPILED:
            self._rcompiled.clear()
        self._rcompiled[bytes(raw[:16])] = c
        return c

    def _rcompile_receipt(self, raw: bytes, rpos: int, end: int, subs: dict):
        from . import capnp_fast as cf

        m = _Bounds(raw, end)
        try:
            rc = cf.Message.struct_at(m, rpos)
        except (cf.Broken, cf.Unusual):
            return None
        if not all(rc.holds(s) for s in self.r_scalars):
            return None             # an older, shorter Receipt: pycapnp gives defaults
        if max(self.r_device_ptr, self.r_sha_ptr) >= rc.pcount:
            return None
        dpos = rc.ptrs + self.r_device_ptr * 8
        spos = rc.ptrs + self.r_sha_ptr * 8
        plan = cf.gather([(rc.at(s), s) for s in self.r_scalars]
                         + [(dpos, cf.WORD), (spos, cf.WORD)])
        if plan is None:
            return None
        e = (*plan, {}, dpos, spos)
        if len(subs) >= _MAX_COMPILED:
            subs.clear()
        subs[bytes(raw[rpos:rpos + 8])] = e
        return e

    def encode(self, spec: ChannelSpec, sequence: int, generation: int, writer_pid: int,
               domain: str, publish_ts_ns: int, crc32: int | None, frame_id: int | None,
               capture_ts_ns: int | None, exposure_us: int | None,
               gain: float | None) -> bytes:
        plan = self.plan(spec, writer_pid, domain, crc32 is not None, frame_id is not None)
        return plan.pack(sequence, generation, publish_ts_ns, crc32, frame_id,
                         capture_ts_ns, exposure_us, gain)


SLOW = object()
"""_HeaderAccess.receipt's answer when only pycapnp may decide."""
_ZERO_WORD = bytes(8)


class _Bounds:
    """Just enough of capnp_fast.Message for struct_at: a buffer and its segment end."""

    __slots__ = ("buf", "end")

    def __init__(self, buf, end: int) -> None:
        self.buf, self.end = buf, end


def _list_spans(lists: dict, words: tuple, dpos: int, spos: int, end: int):
    """(device start, device NUL position or -1 if null, sha start, sha end) for the
    receipt's two list pointer words (at dpos, spos); None: pycapnp decides."""
    d = _byte_list(words[0], dpos, end)
    s = _byte_list(words[1], spos, end)
    if d is None or s is None:
        return None
    ds, dn = d
    if words[0] == 0:
        spans = (0, -1, s[0], s[0] + s[1])
    elif dn < 1:
        return None                 # Text without its NUL: pycapnp's error
    else:
        spans = (ds, ds + dn - 1, s[0], s[0] + s[1])
    if len(lists) >= _MAX_COMPILED:
        lists.clear()
    lists[words] = spans
    return spans


def _byte_list(word: int, pos: int, end: int) -> tuple[int, int] | None:
    """(start, count) of the byte list whose pointer ``word`` sits at byte ``pos``;
    (0, 0) for a null pointer; None for anything else (pycapnp decides)."""
    if word == 0:
        return 0, 0
    if word & 3 != 1 or (word >> 32) & 7 != 2:
        return None                 # not a list pointer, or not a list of bytes
    off = (word & 0xFFFFFFFF) >> 2
    if off >= 1 << 29:
        off -= 1 << 30
    count = word >> 35
    start = pos + 8 + off * 8
    if start < 8 or start + (count + 7) // 8 * 8 > end:
        return None
    return start, count


def _decode_header_dynamic(raw: bytes, spec: ChannelSpec) -> tuple:
    """pycapnp's reading of a SlotHeader (reference and fallback path)."""
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
        raise MalformedHeader(spec.name, f"SlotHeader does not decode: {_short(e)}") from None


def _check_stamp(spec: ChannelSpec, version, channel, seq, gen, pid, ts, crc, frame_id,
                 capture, exposure, gain) -> Stamp:
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


HEADER = _HeaderAccess()
