"""A slot on loan from the channel's single writer: filled in place, then published."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _atomics
from ._types import FrameFormat, PlaneInfo, plane_view, tensor_span
from .errors import BridgeError
from .receipt import Receipt

if TYPE_CHECKING:
    from .writer import Writer


# A loan's fields. With the native module built they live in its C type, which makes a
# Loan (``Loan(writer, slot)``) and runs ``__enter__``, ``__exit__`` and ``array``'s cache
# hit (a stream's repeat description) in C; everything else is the Python below.
_LoanBase = getattr(_atomics.NATIVE, "LoanBase", None)
if _LoanBase is None:
    class _LoanBase:                  # noqa: N801 - the native type's stand-in
        __slots__ = ("_w", "slot", "_payload", "_desc", "_frame", "_lkey", "_span",
                     "_done")

        def __init__(self, writer: Writer, slot: int) -> None:
            self._w = writer
            self.slot = slot
            self._payload = writer._payloads[slot]
            self._desc: tuple | None = None
            self._frame: FrameFormat | None = None
            self._lkey: tuple | None = None  # what the slot's SlotLayout is encoded from
            self._span: tuple[int, int] | None = None  # tensor_span of _desc (the CRC's)
            self._done = False


class Loan(_LoanBase):
    """A slot the writer owns until ``publish`` or ``discard``. Fill it through the
    writable arrays it hands out; they must not be used after publish."""

    __slots__ = ()

    @property
    def capacity(self) -> int:
        return len(self._payload)

    def _py_array(self, shape: tuple[int, ...] | int, dtype: str | np.dtype | None = None,
                  strides: tuple[int, ...] | None = None, offset: int = 0) -> np.ndarray:
        """A writable view that becomes the published tensor (C-contiguous by default)."""
        w = self._w
        key = None
        if w._native is not None and self._frame is None:
            # The native path's cache: a stream repeats one description, so it is
            # checked once per (shape, dtype, strides, offset) and, per slot, kept with
            # its array: (desc, lkey, span, array), one lookup for a repeat (the C
            # LoanBase.array reads the same entry); a fresh view is what the caller gets.
            key = (shape, dtype, strides, offset)
            try:
                kept = w._array_views[self.slot].get(key)
            except TypeError:
                kept = key = None       # unhashable (a list shape): the general path
            if kept is not None:
                self._desc, self._lkey, self._span, a = kept
                return a.view()
        made = None if key is None else w._array_cache.get(key)
        if made is not None:            # checked already, for another slot
            self._desc, self._lkey, self._span = made
            dt, shp, strd, off = made[0]
            a = np.ndarray(shp, dt, buffer=self._payload, offset=off, strides=strd)
        else:
            a = self._array(shape, dtype, strides, offset)
            if key is not None:
                if len(w._array_cache) >= 64:
                    w._array_cache.clear()
                made = w._array_cache[key] = (self._desc, self._lkey, self._span)
        if key is not None:
            views = w._array_views[self.slot]
            if len(views) >= 8:
                views.clear()
            views[key] = (*made, a)
            return a.view()
        return a

    if not hasattr(_LoanBase, "array"):          # no native module: Python's own
        array = _py_array

    def _array(self, shape, dtype, strides, offset) -> np.ndarray:
        shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        dt = np.dtype(dtype) if dtype is not None else self._w.spec.np_dtype
        if dt != self._w.spec.np_dtype:
            raise BridgeError(f"channel {self._w.spec.name!r} carries {self._w.spec.dtype}, "
                              f"not {dt}")
        if strides is None:
            strides = _c_strides(shape, dt.itemsize)
        lo, hi = tensor_span(shape, tuple(strides), offset, dt.itemsize)
        if lo < 0 or hi > self.capacity:
            raise BridgeError(f"tensor spans [{lo}, {hi}), slot holds {self.capacity} bytes")
        self._desc = desc = (dt, shape, tuple(strides), offset)
        self._span = (lo, hi)
        # A frame() before this array() still describes the slot (as it always has).
        self._lkey = (dt.str, *desc[1:], self._frame)
        return np.ndarray(shape, dt, buffer=self._payload, offset=offset,
                          strides=strides)

    def frame(self, pixel_format: str, width: int, height: int, *,
              row_stride: int | None = None, sensor: str = "road",
              pixel_range: str = "full") -> tuple[np.ndarray, ...]:
        """Writable plane views for a frame; the tensor published is the whole frame."""
        key = (pixel_format, width, height, row_stride, sensor, pixel_range)
        w = self._w
        made = w._frame_cache.get(key)
        if made is None:
            fmt, tensor = _frame_layout(*key)
            self._array(*tensor, 0)          # checks the frame fits the slot
            if len(w._frame_cache) >= 64:
                w._frame_cache.clear()
            # The layout cache key of a frame is its frame() arguments: hashing those
            # is cheap, hashing the FrameFormat dataclass per message is not.
            made = w._frame_cache[key] = (fmt, self._desc, ("frame", *key), self._span)
        fmt, self._desc, self._lkey, self._span = made
        self._frame = fmt
        # Fresh views of plane arrays kept per slot and format: numpy builds an array
        # from a buffer slowly, a view of one quickly (same memory, shape and strides).
        kept = w._plane_cache[self.slot]
        planes = kept.get(key)
        if planes is None:
            if len(kept) >= 8:
                kept.clear()
            planes = kept[key] = tuple(plane_view(self._payload, p) for p in fmt.planes)
        return tuple([p.view() for p in planes])

    def _py_publish(self, *, frame_id: int | None = None, capture_ts_ns: int | None = None,
                    exposure_us: int | None = None, gain: float | None = None,
                    publish_ts_ns: int | None = None, receipt: Receipt | None = None) -> int:
        """Make the slot visible to readers and wake them. Returns the sequence number.
        ``receipt``: the execution receipt of the inference that produced this output.
        (The native LoanBase.publish runs the fast path below in C, step for step, and
        calls this for everything else.)"""
        w = self._w
        fast = w._fast
        if (fast is not None and fast[0] is self._lkey and receipt is None
                and (frame_id is None) is fast[1] and not self._done):
            # A stream's repeat publish on the native path: the description the writer
            # published last (its cached key, by identity: array() checked it), no CRC,
            # no receipt. Header, layout (unless the slot holds these very bytes),
            # stamp, release stores, wake-ups and the writer's slot bookkeeping in one
            # native call, from here: between the publish stamp and the wake-up, cold,
            # every Python frame and attribute is a cache miss (ipc_latency --cold,
            # docs/ipc-wakeups.md). False: a value outside its field; the general path
            # below judges it (and raises, or encodes).
            self._done = True
            seq = w._last_seq + 1
            try:
                ts = w._nhot(w._hot, fast[4], self.slot, seq, publish_ts_ns, frame_id,
                             capture_ts_ns, exposure_us, gain)
                if ts is not False:
                    w._last_seq = seq
                    w._published += 1
                    return seq
            except BaseException:
                w._hot_failed(self, seq)   # went out: counted; else the slot goes back
                raise
            return w._publish(self, frame_id, capture_ts_ns, exposure_us, gain,
                              publish_ts_ns, receipt)
        if self._done:
            raise BridgeError("loan already published or discarded")
        if self._desc is None:
            raise BridgeError("nothing to publish: call array() or frame() first")
        if self._frame is not None and frame_id is None:
            raise BridgeError("a frame needs frame_id and capture_ts_ns")
        self._done = True
        return self._w._publish(self, frame_id, capture_ts_ns, exposure_us, gain,
                                publish_ts_ns, receipt)

    if not hasattr(_LoanBase, "publish"):        # no native module: Python's own
        publish = _py_publish

    def discard(self) -> None:
        if not self._done:
            self._done = True
            self._w._discard(self)

    if not hasattr(_LoanBase, "__exit__"):       # no native module: Python's own
        def __enter__(self) -> Loan:
            return self

        def __exit__(self, exc_type, *rest: object) -> None:
            if not self._done:
                self.discard()   # an unpublished loan (or an exception) returns the slot


class NextLoan:
    """A stream's next message on loan before its data exists (iceoryx2's loan ahead):
    the slot is claimed and its array made right after each publish, while the caches
    still hold that path, so that new data costs only filling ``array`` and ``publish``
    (cold, at 20 Hz, a loan and its array cost as much as the publish). For streams whose
    every message has one description (a model's output, a command).

    It holds one slot between publishes (odd: readers keep off it), so readers can lag
    one message less behind this writer; ``discard`` gives it back. Only where the ring
    has a slot to spare beyond all that leases may protect (slot_count - max_readers x
    max_leases >= 2): in a tighter ring the next loan, taken at publish time, could be the
    slot just published (every other one held), taking that message back before any
    reader saw it. There the slot is loaned when ``array`` is first used, as
    ``Writer.loan`` would."""

    __slots__ = ("_w", "_shape", "_dtype", "_loan", "_array", "_ahead")

    def __init__(self, writer: Writer, shape: tuple[int, ...] | int,
                 dtype: str | np.dtype | None = None) -> None:
        spec = writer.spec
        self._w, self._shape, self._dtype = writer, shape, dtype
        self._ahead = spec.slot_count - spec.max_readers * spec.max_leases >= 2
        self._loan: Loan | None = None
        self._array: np.ndarray | None = None
        if self._ahead:
            self._renew()

    def _renew(self) -> None:
        loan = self._loan = self._w.loan()
        try:
            self._array = loan.array(self._shape, self._dtype)
        except BaseException:
            self._loan = None
            loan.discard()
            raise

    @property
    def on_loan(self) -> bool:
        """A slot is on loan now (``array`` would not take one)."""
        return self._loan is not None

    @property
    def array(self) -> np.ndarray:
        """The next message's writable tensor (loaned here if it is not on loan yet:
        BridgeError then, as ``Writer.loan`` raises it)."""
        if self._loan is None:
            self._renew()
        return self._array

    def publish(self, **stamp) -> int:
        """``Loan.publish`` of what ``array`` holds, then the next loan. Returns the
        sequence number. Whatever fails, the slot goes back and the next is loaned."""
        loan = self._loan
        if loan is None:
            raise BridgeError(f"channel {self._w.spec.name!r}: nothing on loan to publish; "
                              f"fill array first")
        self._loan = self._array = None
        try:
            return loan.publish(**stamp)
        except BaseException:
            loan.discard()    # review: a bad keyword left it loaned; no-op once published
            raise
        finally:
            if self._ahead:
                try:
                    self._renew()
                except BridgeError:
                    pass      # no free slot now: ``array`` tries again, and raises

    def discard(self) -> None:
        """Give the slot back (unpublished, invalid)."""
        loan, self._loan, self._array = self._loan, None, None
        if loan is not None:
            loan.discard()

    def __enter__(self) -> NextLoan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


def _frame_layout(pixel_format: str, width: int, height: int, row_stride: int | None,
                  sensor: str, pixel_range: str) -> tuple[FrameFormat, tuple]:
    """Plane layout and whole-frame tensor of a tightly packed (or row-padded) frame."""
    bpp = {"nv12": 1, "rgb888": 3, "bgr888": 3, "gray8": 1}.get(pixel_format)
    if bpp is None:
        raise BridgeError(f"unsupported pixel format {pixel_format!r}")
    rs = row_stride or width * bpp
    if pixel_format == "nv12":
        if width % 2 or height % 2:
            raise BridgeError(f"nv12 needs even width and height, got {width}x{height}")
        planes = (PlaneInfo(0, rs, width, height, 1),
                  PlaneInfo(rs * height, rs, width // 2, height // 2, 2))
        tensor = ((height * 3 // 2, width), "uint8", (rs, 1))
    elif bpp == 3:
        planes = (PlaneInfo(0, rs, width, height, 3),)
        tensor = ((height, width, 3), "uint8", (rs, 3, 1))
    else:
        planes = (PlaneInfo(0, rs, width, height, 1),)
        tensor = ((height, width), "uint8", (rs, 1))
    return FrameFormat(sensor, pixel_format, pixel_range, width, height, planes), tensor


def _c_strides(shape: tuple[int, ...], item: int) -> tuple[int, ...]:
    strides, acc = [], item
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
