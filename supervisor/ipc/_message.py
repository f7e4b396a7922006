"""One received message: a lease on a slot, its checked stamp and layout, and
read-only zero-copy views of the payload (built only by `reader.Reader`)."""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from . import _atomics, codec, layout as L
from ._types import FrameFormat, Layout, plane_view
from .errors import BridgeError, LeaseLost, Rejected
from .receipt import Receipt

_gen_of = L.U64.unpack_from
_SLOW = codec.SLOW
UNREAD = object()           # Message._receipt before the first decode
# map() with these builds FrameInfo's tuples in C (a generator is a frame per plane).
_row_stride, _plane_offset = attrgetter("row_stride"), attrgetter("offset")


@dataclass(frozen=True)
class FrameInfo:
    """Everything FrameMeta and FrameFormat say about one frame."""

    frame_id: int
    sensor: str
    pixel_format: str
    pixel_range: str
    width: int
    height: int
    row_strides: tuple[int, ...]
    plane_offsets: tuple[int, ...]
    capture_ts_ns: int
    publish_ts_ns: int
    exposure_us: int | None
    gain: float | None


# A message's fields. With the native module built they live in its C type, whose
# ``array`` and ``release`` run in C for a message of a native reader (`_core` set) and
# call ``_py_array`` / ``_py_release`` below for any other; ``check()`` is Python's
# either way, and the C methods call it for anything but a held, stable slot.
_MessageBase = getattr(_atomics.NATIVE, "MessageBase", None)
if _MessageBase is None:
    class _MessageBase:               # noqa: N801 - the native type's stand-in
        __slots__ = ("_reader", "_core", "_slot", "_gen", "_lease", "_layout", "stamp",
                     "_array", "_released", "_lost", "_raw_header", "_receipt")


class Message(_MessageBase):
    """One received message, built only by `Reader` (see ``Reader._accept``). Holds a
    lease until released; the views are valid only while ``check()`` passes (the writer
    may reuse the slot once the lease expires)."""

    __slots__ = ()

    @property
    def sequence(self) -> int:
        return self.stamp.sequence

    @property
    def receipt(self) -> Receipt | None:
        """The execution receipt in the header (model outputs), decoded on demand from
        the private copy taken at receive time (where its capture time was checked); a
        bad one raises MalformedHeader."""
        r = self._receipt
        if r is not UNREAD:
            return r           # decoded before from the same private bytes
        try:
            # codec.decode_receipt's two steps, without its call: the compiled reading,
            # else pycapnp's (which decides anything unusual).
            r = self._reader._hdr.receipt(self._raw_header)
            if r is _SLOW:
                r = codec.decode_receipt(self._raw_header, self._reader.spec,
                                         self.stamp.sequence, fast=False)
            self._receipt = r
        except Rejected as e:
            self._reader._rejected[e.reason] += 1
            raise
        return r

    @property
    def publish_ts_ns(self) -> int:
        return self.stamp.publish_ts_ns

    @property
    def layout(self) -> Layout:
        return self._layout

    def check(self) -> None:
        """Raise LeaseLost if the writer has reused the slot since we received it
        (the lease is then given back: the message is dead)."""
        if self._released and not self._lost:
            raise BridgeError("message already released")
        r = self._reader
        if r._closed:
            # Its mappings are gone: a BridgeError naming the channel, never numpy's
            # or the region's ValueError (red team 15 row 3).
            raise BridgeError(f"channel {r.spec.name!r}: its reader was closed; message "
                              f"seq {self.sequence} is gone with it")
        if self._lost or not r._stable(r._ctl[self._slot], self._gen):
            if not self._lost:
                self._lost = self._released = True
                self._array = None
                self._reader._lost += 1
                self._reader._drop_lease(self._lease)
            raise LeaseLost(f"channel {self._reader.spec.name!r} seq {self.sequence}: slot "
                            f"{self._slot} was reused by the writer (lease expired or "
                            f"reader too slow); discard anything computed from it")

    def _py_array(self) -> np.ndarray:
        """``array`` of a message the native type does not hold (or without it)."""
        a = self._array
        if a is None:
            a = self._array = self._kept_array().view()
        else:
            self._kept_array()          # the same seqlock check as the first time
        return a

    def tolist(self) -> list:
        """``array.tolist()`` without building the view (one numpy call): the payload
        as Python values. Like the view, they count only if ``release()`` passes."""
        return self._kept_array().tolist()

    def _kept_array(self) -> np.ndarray:
        """The reader's array for this slot and layout, after checking the slot is
        still ours (LeaseLost if not). ``array`` hands out fresh views of it."""
        r, slot = self._reader, self._slot
        seg = r._seg
        if (self._released or self._lost or r._closed
                or (_gen_of(r._buf, r._ctl[slot])[0] if seg is None
                    else seg.load(r._ctl[slot])) != self._gen):   # acquire (R2)
            self.check()
        lay = self._layout
        # Kept per slot and layout: a view of an array is built much faster than an
        # array from a buffer. The cache holds the Layout itself: identity is exact.
        kept = r._views[slot]
        if kept is None or kept[0] is not lay:
            kept = r._views[slot] = (lay, np.ndarray(
                lay.shape, lay.dtype, buffer=r._payloads[slot], offset=lay.offset,
                strides=lay.strides))
        return kept[1]

    def planes(self) -> tuple[np.ndarray, ...]:
        """Read-only per-plane views of a frame (NV12: Y (h,w), UV (h/2,w/2,2))."""
        self.check()
        fmt = self._layout.frame
        if fmt is None:
            raise BridgeError("not a frame message")
        # Fresh views of plane arrays kept per slot and layout (as ``array`` does):
        # same memory, shapes, strides and read-only flag, without numpy re-parsing
        # the buffer per frame. The cache holds the Layout itself: identity is exact.
        r, slot, lay = self._reader, self._slot, self._layout
        kept = r._plane_views[slot]
        if kept is None or kept[0] is not lay:
            buf = r._payloads[slot]
            kept = r._plane_views[slot] = (lay, tuple(plane_view(buf, p, readonly=True)
                                                      for p in fmt.planes))
        return tuple([p.view() for p in kept[1]])

    @property
    def frame(self) -> FrameInfo | None:
        fmt: FrameFormat | None = self._layout.frame
        s = self.stamp
        if fmt is None:
            return None
        return FrameInfo(s.frame_id, fmt.sensor, fmt.pixel_format, fmt.pixel_range,
                         fmt.width, fmt.height, tuple(map(_row_stride, fmt.planes)),
                         tuple(map(_plane_offset, fmt.planes)), s.capture_ts_ns,
                         s.publish_ts_ns, s.exposure_us, s.gain)

    def __dlpack__(self, **kw):
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def _py_release(self) -> None:
        """``release`` of a message the native type does not hold (or without it)."""
        if self._released and not self._lost:
            return
        self.check()
        self._released = True
        self._array = None
        self._reader._drop_lease(self._lease)

    if not hasattr(_MessageBase, "release"):     # no native module: Python's own
        array = property(_py_array, doc="Read-only zero-copy view with the published "
                         "shape, dtype and strides.")
        release = _py_release

    def _py_enter(self) -> Message:
        return self

    def _py_exit(self, exc_type, *rest: object) -> None:
        if exc_type is None:
            self.release()
        else:
            try:
                self.release()
            except LeaseLost:
                pass  # the body's own exception is the one to report

    if not hasattr(_MessageBase, "__exit__"):    # no native module: Python's own
        __enter__, __exit__ = _py_enter, _py_exit
