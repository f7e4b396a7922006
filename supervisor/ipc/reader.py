"""A reader of a channel: leases slots, hands out read-only zero-copy views."""
from __future__ import annotations

import os
import select
import time
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np

from . import codec, layout as L, shm
from .channel import ReaderHandle
from .codec import FrameFormat, Layout, Stamp
from .errors import (BridgeError, ChannelTimeout, CrcMismatch, LeaseLost, MalformedHeader,
                     Rejected, SequenceError, StaleMessage, TornRead)
from .spec import HEADER_AREA
from .writer import plane_view

# How long a reader waits for the writer to map and seal the segment on attach.
ATTACH_TIMEOUT_S = 5.0
_RETRIES = 8


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


@dataclass(frozen=True)
class ReaderStats:
    received: int
    dropped: int              # sequence gaps: messages the writer reused before we read them
    rejected: dict[str, int]  # per Rejected.reason
    leases_lost: int


class Message:
    """One received message. Holds a lease until released; the views are valid only
    while ``check()`` passes (the writer may reuse the slot once the lease expires)."""

    __slots__ = ("_reader", "_slot", "_gen", "_lease", "_layout", "stamp", "_array",
                 "_released", "_lost")

    def __init__(self, reader: Reader, slot: int, gen: int, lease: int, layout: Layout,
                 stamp: Stamp) -> None:
        self._reader, self._slot, self._gen, self._lease = reader, slot, gen, lease
        self._layout, self.stamp = layout, stamp
        self._array: np.ndarray | None = None
        self._released = False
        self._lost = False

    @property
    def sequence(self) -> int:
        return self.stamp.sequence

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
        if self._lost or self._reader._slot_gen(self._slot) != self._gen:
            if not self._lost:
                self._lost = self._released = True
                self._array = None
                self._reader._lost += 1
                self._reader._drop_lease(self._lease)
            raise LeaseLost(f"channel {self._reader.spec.name!r} seq {self.sequence}: slot "
                            f"{self._slot} was reused by the writer (lease expired or "
                            f"reader too slow); discard anything computed from it")

    @property
    def array(self) -> np.ndarray:
        """Read-only zero-copy view with the published shape, dtype and strides."""
        self.check()
        if self._array is None:
            lay = self._layout
            a = np.ndarray(lay.shape, lay.dtype, buffer=self._reader._payload(self._slot),
                           offset=lay.offset, strides=lay.strides)
            self._array = a
        return self._array

    def planes(self) -> tuple[np.ndarray, ...]:
        """Read-only per-plane views of a frame (NV12: Y (h,w), UV (h/2,w/2,2))."""
        self.check()
        fmt = self._layout.frame
        if fmt is None:
            raise BridgeError("not a frame message")
        buf = self._reader._payload(self._slot)
        return tuple(plane_view(buf, p, readonly=True) for p in fmt.planes)

    @property
    def frame(self) -> FrameInfo | None:
        fmt: FrameFormat | None = self._layout.frame
        s = self.stamp
        if fmt is None:
            return None
        return FrameInfo(s.frame_id, fmt.sensor, fmt.pixel_format, fmt.pixel_range,
                         fmt.width, fmt.height, tuple(p.row_stride for p in fmt.planes),
                         tuple(p.offset for p in fmt.planes), s.capture_ts_ns,
                         s.publish_ts_ns, s.exposure_us, s.gain)

    def __dlpack__(self, **kw):
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def release(self) -> None:
        """Give the lease back; raises LeaseLost if the data changed while held."""
        if self._released and not self._lost:
            return
        self.check()
        self._released = True
        self._array = None
        self._reader._drop_lease(self._lease)

    def __enter__(self) -> Message:
        return self

    def __exit__(self, exc_type, *rest: object) -> None:
        if exc_type is None:
            self.release()
        else:
            try:
                self.release()
            except LeaseLost:
                pass  # the body's own exception is the one to report


class Reader:
    """Reader ``handle.index`` of a channel. In-order delivery: every receive returns
    the oldest message newer than the last one still in the ring; what the writer
    reused before we got to it counts as dropped. A new reader starts at the newest
    message already published (subject to max_age), never at older history."""

    def __init__(self, handle: ReaderHandle, *, attach_timeout_s: float = ATTACH_TIMEOUT_S
                 ) -> None:
        self.spec = spec = handle.spec
        self._wait_for_writer(handle.data_fd, attach_timeout_s)
        self._mm = shm.map_segment(handle.data_fd, spec.segment_size, writable=False)
        self._buf = memoryview(self._mm)
        self._lease_mm = shm.map_segment(handle.lease_fd, spec.lease_size, writable=True)
        self._efd = handle.event_fd
        self._check_channel_header()
        # This reader is the only writer of its lease table: start it clean (a reader
        # that held this index before us may have died holding leases).
        self._lease_mm[:] = bytes(spec.lease_size)
        L.LEASE_HDR.pack_into(self._lease_mm, 0, L.LEASE_MAGIC, os.getpid(), spec.max_leases)
        self._free_leases = list(range(spec.max_leases))
        self._layouts: dict[bytes, Layout] = {}
        # Start at the newest message already published (if any): fresh, not history.
        self._last_seq = max(self._latest_seq() - 1, 0)
        self._last_capture = 0
        self._received = self._dropped = self._lost = 0
        self._rejected: Counter[str] = Counter()
        self._base = [spec.control_size + i * spec.slot_stride
                      for i in range(spec.slot_count)]
        self._max_age_ns = spec.max_age_ms * 1_000_000
        self._lease_ns = spec.lease_ms * 1_000_000

    def _wait_for_writer(self, fd: int, timeout: float) -> None:
        # The supervisor starts writers first; the magic is the writer's "ready".
        end = time.monotonic() + timeout
        while True:
            if os.pread(fd, 8, 0) == L.U64.pack(L.MAGIC):
                return
            if time.monotonic() > end:
                raise BridgeError(f"channel {self.spec.name!r}: no writer attached within "
                                  f"{timeout:.1f}s")
            time.sleep(0.005)

    def _check_channel_header(self) -> None:
        s = self.spec
        magic, version, count, size, stride, ctl, chan, *_ = L.CHANNEL_HDR.unpack_from(
            self._buf, 0)
        if (magic, version, count, size, stride, ctl, chan) != (
                L.MAGIC, L.LAYOUT_VERSION, s.slot_count, s.slot_size, s.slot_stride,
                s.control_size, s.channel_id):
            raise BridgeError(f"channel {s.name!r}: segment header does not match the spec")

    def _latest_seq(self) -> int:
        return L.U64.unpack_from(self._buf, L.OFF_LAST_SEQ)[0]

    def _slot_gen(self, slot: int) -> int:
        return L.U64.unpack_from(self._buf, L.control_offset(slot))[0]

    def _payload(self, slot: int) -> memoryview:
        base = self._base[slot] + HEADER_AREA
        return self._buf[base:base + self.spec.slot_size]

    def _drop_lease(self, k: int) -> None:
        L.LEASE_ENTRY.pack_into(self._lease_mm, L.lease_offset(k), 0, 0, 0)
        self._free_leases.append(k)

    # ------------------------------------------------------------ receiving

    def try_receive(self) -> Message | None:
        """The next message, or None if there is none yet. Raises a Rejected subclass
        (already counted, the message skipped) for a message that fails validation."""
        for _ in range(_RETRIES):
            if self._latest_seq() <= self._last_seq:
                return None
            msg = self._take_next()
            if msg is not None:
                return msg
        return None

    def _take_next(self) -> Message | None:
        buf, spec = self._buf, self.spec
        best = None
        for i in range(spec.slot_count):
            gen, seq = L.GEN_SEQ.unpack_from(buf, L.control_offset(i))
            if not gen & 1 and seq > self._last_seq and (best is None or seq < best[2]):
                best = (i, gen, seq)
        if best is None:
            return None
        slot, gen, seq = best
        if not self._free_leases:
            raise BridgeError(f"channel {spec.name!r}: all {spec.max_leases} leases are "
                              f"held; release a message before receiving another")
        k = self._free_leases.pop()
        L.LEASE_ENTRY.pack_into(self._lease_mm, L.lease_offset(k), slot, gen,
                                time.monotonic_ns() + self._lease_ns)
        try:
            _, _, ts, hlen, llen = L.CONTROL.unpack_from(buf, L.control_offset(slot))
            base = self._base[slot]
            raw_h = bytes(buf[base:base + min(hlen, L.HEADER_MAX)])
            raw_l = bytes(buf[base + L.LAYOUT_OFFSET:base + L.LAYOUT_OFFSET +
                              min(llen, L.LAYOUT_MAX)])
            if self._slot_gen(slot) != gen:
                self._drop_lease(k)
                return None  # the writer took the slot while we leased it: look again
            return self._accept(slot, gen, seq, k, raw_h, raw_l)
        except BaseException:
            if k not in self._free_leases:
                self._drop_lease(k)
            raise

    def _accept(self, slot: int, gen: int, seq: int, k: int, raw_h: bytes,
                raw_l: bytes) -> Message:
        spec = self.spec
        if self._received or self._rejected:
            self._dropped += seq - self._last_seq - 1
        self._last_seq = seq   # accepted or rejected, this sequence is consumed
        try:
            layout = self._layouts.get(raw_l)
            if layout is None:
                layout = codec.decode_layout(raw_l, spec, spec.slot_size)
                if len(self._layouts) >= 16:
                    self._layouts.clear()
                self._layouts[raw_l] = layout
            stamp = codec.decode_header(raw_h, spec)
            if stamp.sequence != seq or stamp.generation != gen:
                raise MalformedHeader(spec.name, f"header says seq {stamp.sequence} gen "
                                      f"{stamp.generation}, control block says seq {seq} "
                                      f"gen {gen}", seq)
            now = time.monotonic_ns()
            if stamp.publish_ts_ns > now:
                raise MalformedHeader(spec.name, "publish timestamp is in the future", seq)
            ts = stamp.capture_ts_ns if stamp.capture_ts_ns is not None else stamp.publish_ts_ns
            if stamp.capture_ts_ns is not None:
                if stamp.capture_ts_ns > stamp.publish_ts_ns:
                    raise MalformedHeader(spec.name, "frame captured after it was published",
                                          seq)
                if stamp.capture_ts_ns < self._last_capture:
                    raise SequenceError(spec.name, f"frame {stamp.frame_id} captured at "
                                        f"{stamp.capture_ts_ns} ns, before the previous "
                                        f"frame ({self._last_capture} ns): reordered", seq)
            if self._max_age_ns and now - ts > self._max_age_ns:
                raise StaleMessage(spec.name, f"{(now - ts) / 1e6:.1f} ms old, channel "
                                   f"max_age is {spec.max_age_ms} ms", seq)
            if stamp.crc32 is not None and spec.crc:
                lo, hi = layout.span
                got = zlib.crc32(self._payload(slot)[lo:hi])
                if self._slot_gen(slot) != gen:
                    raise TornRead(spec.name, "slot reused during the CRC check", seq)
                if got != stamp.crc32:
                    raise CrcMismatch(spec.name, f"payload CRC {got:#010x} != header "
                                      f"{stamp.crc32:#010x}", seq)
        except Rejected as e:
            self._rejected[e.reason] += 1
            self._drop_lease(k)
            raise
        if stamp.capture_ts_ns is not None:
            self._last_capture = stamp.capture_ts_ns
        self._received += 1
        return Message(self, slot, gen, k, layout, stamp)

    def receive(self, timeout: float | None = None) -> Message:
        """Block (on the eventfd, no polling) until a message arrives."""
        end = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(self._efd, select.POLLIN)
        while True:
            msg = self.try_receive()
            if msg is not None:
                return msg
            wait_ms = -1
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise ChannelTimeout(f"channel {self.spec.name!r}: nothing within "
                                         f"{timeout:.3f}s")
                wait_ms = max(1, int(left * 1000 + 0.999))
            if poller.poll(wait_ms):
                self._drain()

    async def receive_async(self) -> Message:
        """trio: wait for the eventfd to become readable without blocking the loop."""
        import trio

        while True:
            msg = self.try_receive()
            if msg is not None:
                return msg
            await trio.lowlevel.wait_readable(self._efd)
            self._drain()

    def _drain(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass

    @property
    def stats(self) -> ReaderStats:
        return ReaderStats(self._received, self._dropped, dict(self._rejected), self._lost)

    def close(self) -> None:
        for k in range(self.spec.max_leases):
            L.LEASE_ENTRY.pack_into(self._lease_mm, L.lease_offset(k), 0, 0, 0)
        self._lease_mm.close()
        try:
            self._buf.release()
            self._mm.close()
        except BufferError:
            pass  # views still alive; the mapping goes with them

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
