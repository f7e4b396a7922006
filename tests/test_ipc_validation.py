"""Every kind of bad message is a typed, counted rejection; the reader keeps going."""
from __future__ import annotations

import time

import numpy as np
import pytest

from supervisor.ipc import (FUTURE_TOLERANCE_NS, BoundsError, ChannelSpec, CrcMismatch,
                            DTypeMismatch, FormatError, FrameFormat, FutureTimestamp,
                            MalformedHeader, PlaneInfo, Reader, Receipt, SequenceError,
                            StaleMessage, Writer, codec)
from supervisor.ipc._types import _DLPACK

from .forge import forge


def _header(w, seq, gen, **kw):
    kw.setdefault("crc32", None)
    return codec.encode_header(w.spec, sequence=seq, generation=gen, writer_pid=1,
                               domain="control", publish_ts_ns=kw.pop("ts", time.monotonic_ns()),
                               **kw)


def _next(w):
    """(seq, gen) the next forged message will carry: forge loans the slot the writer
    chooses (Writer._choose: the newest one every reader took, else the oldest)."""
    return w._last_seq + 1, w._gen[_oldest(w)] + 2


def _forge_tensor(w, shape, strides, offset=0, dtype=None, **hkw):
    dtype = np.dtype(dtype or w.spec.dtype)
    seq, slot_gen = _next(w)
    lay = _layout_bytes(dtype, shape, strides, offset)
    return forge(w, _header(w, seq, slot_gen, **hkw), lay)


def _oldest(w):
    """The slot the next loan takes (the name predates Writer._choose)."""
    return w._choose(w._protected(time.monotonic_ns()))


def _layout_bytes(dtype, shape, strides, offset, frame=None, nbytes=None):
    msg = codec.SlotLayout.new_message(schemaVersion=1)
    t = msg.init("tensor")
    code, bits = _DLPACK.get(np.dtype(dtype).name, (4, 16))
    t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
    t.shape, t.strides, t.byteOffset = list(shape), list(strides), offset
    lo, hi = codec.tensor_span(tuple(shape), tuple(strides), offset, np.dtype(dtype).itemsize)
    t.nbytes = hi - lo if nbytes is None else nbytes
    if frame is not None:
        return codec.encode_layout(np.dtype(dtype), tuple(shape), tuple(strides), offset, frame)
    return msg.to_bytes()


@pytest.fixture
def pair(make_channel):
    def make(**kw):
        kw.setdefault("max_readers", 1)
        kw.setdefault("slot_count", 4)
        ch = make_channel(**kw)
        w = Writer(ch.writer_handle(), domain="control")
        return w, Reader(ch.reader_handle(0))
    return make


def _expect_then_recover(w, r, exc, match):
    with pytest.raises(exc, match=match) as info:
        r.receive(timeout=1)
    assert info.value.reason in r.stats.rejected
    # ... and a good message right after is delivered normally.
    good = w.publish_array(np.ones(4, w.spec.np_dtype))
    with r.receive(timeout=1) as msg:
        assert msg.sequence == good
        assert msg.array.tolist() == [1, 1, 1, 1]
    return info.value


def test_strides_out_of_bounds(pair):
    w, r = pair(slot_size=4096)
    _forge_tensor(w, (64, 64), (4096, 1))
    err = _expect_then_recover(w, r, BoundsError, r"outside the slot payload")
    assert "strides=[4096, 1]" in str(err) and "'test'" in str(err)


def test_negative_stride_trick_below_the_slot(pair):
    w, r = pair(slot_size=4096)
    _forge_tensor(w, (16,), (-1,), offset=4)      # would read bytes -11..4
    _expect_then_recover(w, r, BoundsError, r"touches bytes \[-11, 5\)")


def test_huge_shape_overflow(pair):
    w, r = pair(slot_size=4096)
    _forge_tensor(w, (2**62, 2**62), (0, 0))
    _expect_then_recover(w, r, BoundsError, "exceed the slot capacity")


def test_wrong_dtype(pair):
    w, r = pair(dtype="float32")
    _forge_tensor(w, (4,), (8,), dtype="float64")
    _expect_then_recover(w, r, DTypeMismatch, "tensor is float64, channel contract is float32")


def test_unsupported_dlpack_dtype(pair):
    w, r = pair(dtype="float32")
    seq, _ = _next(w)
    msg = codec.SlotLayout.new_message(schemaVersion=1)
    t = msg.init("tensor")
    t.dtype.code, t.dtype.bits, t.dtype.lanes = "bfloat", 16, 1
    t.shape, t.strides, t.nbytes = [2], [2], 4
    forge(w, _header(w, seq, w._gen[_oldest(w)] + 2), msg.to_bytes())
    _expect_then_recover(w, r, DTypeMismatch, "bfloat16 is not supported")


def test_misaligned_strides_refused_for_dlpack(pair):
    w, r = pair(dtype="float32")
    _forge_tensor(w, (4,), (6,))
    _expect_then_recover(w, r, BoundsError, "multiples of the item size 4")


def test_malformed_capnp_header(pair):
    w, r = pair()
    seq, _ = _next(w)
    forge(w, b"\x00\x00\x00\x00\xff\xff\x00\x00" + b"\x01" * 40,
          _layout_bytes(np.uint8, (4,), (1,), 0))
    _expect_then_recover(w, r, MalformedHeader, "SlotHeader does not decode")


def test_header_disagreeing_with_control_block(pair):
    w, r = pair()
    seq, _ = _next(w)
    forge(w, _header(w, seq + 5, 0), _layout_bytes(np.uint8, (4,), (1,), 0))
    _expect_then_recover(w, r, MalformedHeader, "control block says")


def test_stale_message(pair):
    w, r = pair(max_age_ms=5)
    w.publish_array(np.zeros(4, np.uint8), publish_ts_ns=time.monotonic_ns() - 50_000_000)
    err = _expect_then_recover(w, r, StaleMessage, r"ms old, channel max_age is 5 ms")
    assert err.sequence == 1


def test_crc_mismatch(pair):
    w, r = pair(crc=True)
    with w.loan() as loan:
        a = loan.array((64,), "uint8")
        a[...] = 7
        loan.publish()
        a[3] = 8          # a buggy writer scribbles after publishing
    _expect_then_recover(w, r, CrcMismatch, "payload CRC")


def test_reordered_frames_and_gaps(pair):
    w, r = pair(kind="frame", pixel_formats=("gray8",), slot_size=64 * 64, slot_count=6)
    now = time.monotonic_ns()

    def frame(fid, capture):
        with w.loan() as loan:
            loan.frame("gray8", 64, 64)[0][...] = fid
            return loan.publish(frame_id=fid, capture_ts_ns=capture)

    frame(1, now - 3000)
    with r.receive(timeout=1) as m:
        assert m.frame.frame_id == 1
    frame(2, now - 5000)      # captured before frame 1: reordered
    with pytest.raises(SequenceError, match="reordered"):
        r.receive(timeout=1)
    frame(3, now - 2000)
    frame(4, now - 1000)
    frame(5, now)
    # Overrun: 6 slots, publish 8 more; the reader then sees a gap counted as drops.
    for i in range(8):
        frame(6 + i, time.monotonic_ns())
    with r.receive(timeout=1) as m:
        assert m.frame.frame_id == 8
    assert r.stats.dropped == 5
    assert r.stats.rejected == {"sequence_not_increasing": 1}


def test_bad_frame_format(pair):
    w, r = pair(kind="frame", pixel_formats=("nv12",), slot_size=64 * 48 * 3 // 2)
    seq, _ = _next(w)
    fmt = FrameFormat("road", "nv12", "full", 64, 48,
                      (PlaneInfo(0, 64, 64, 48, 1), PlaneInfo(64 * 48, 64, 64, 24, 2)))
    lay = codec.encode_layout(np.dtype(np.uint8), (72, 64), (64, 1), 0, fmt)
    forge(w, _header(w, seq, w._gen[_oldest(w)] + 2, frame_id=1,
                     capture_ts_ns=time.monotonic_ns()), lay)
    with pytest.raises(FormatError, match=r"nv12 plane 1 is 64x24, expected 32x24"):
        r.receive(timeout=1)
    with w.loan() as loan:
        y, uv = loan.frame("nv12", 64, 48)
        y[...] = 1
        loan.publish(frame_id=2, capture_ts_ns=time.monotonic_ns())
    with r.receive(timeout=1) as m:
        assert m.planes()[0][0, 0] == 1
    assert r.stats.rejected == {"bad_frame_format": 1}


def test_pixel_format_outside_contract(pair):
    w, r = pair(kind="frame", pixel_formats=("nv12",), slot_size=64 * 64 * 3)
    with w.loan() as loan:
        loan.frame("rgb888", 64, 64)
        loan.publish(frame_id=1, capture_ts_ns=time.monotonic_ns())
    with pytest.raises(FormatError, match=r"rgb888 not in the channel contract \['nv12'\]"):
        r.receive(timeout=1)


def test_receipt_round_trip_and_absent(pair):
    from supervisor.ipc import Receipt

    w, r = pair(dtype="float32", crc=True)
    rc = Receipt(frame_id=42, capture_ts_ns=10, infer_start_ns=20, infer_end_ns=30,
                 device="CPU", bytes_in=32768, bytes_out=16, completion="hostVisible",
                 latency_ns=10, worst_case_ns=12, deadline_ns=50_000_000, deadline_misses=1,
                 artifact_sha256=bytes(range(32)), kernels_run=5)
    with w.loan() as loan:
        loan.array((4,))[...] = [0.5, 0.1, 0.9, 0.0]
        seq = loan.publish(receipt=rc)
    w.publish_array(np.ones(4, np.float32))
    with r.receive(timeout=1) as m:
        assert m.sequence == seq and m.receipt == rc
        assert m.array.tolist() == [0.5, 0.10000000149011612, 0.8999999761581421, 0.0]
    with r.receive(timeout=1) as m:
        assert m.receipt is None


def test_malformed_receipt_is_a_counted_typed_error(pair):
    w, r = pair(dtype="float32")
    seq, gen = _next(w)
    h = codec.SlotHeader.new_message(schemaVersion=1, channelId=0, sequence=seq,
                                     generation=gen, writerPid=1, writerDomain="control",
                                     publishTsNs=time.monotonic_ns())
    h.init("receipt").device = "CPU"
    raw = bytearray(h.to_bytes())
    raw[-20:] = b"\xff" * 20          # corrupt the receipt's text/data pointers
    forge(w, bytes(raw), _layout_bytes(np.float32, (4,), (4,), 0))
    with r.receive(timeout=1) as m:
        with pytest.raises(MalformedHeader, match="receipt does not decode") as info:
            m.receipt
        assert "stack:" not in str(info.value)
        assert m.array.shape == (4,)       # the rest of the message is still usable
    assert r.stats.rejected == {"malformed_header": 1}


def test_zero_stride_and_overlapping_giant_views_refused(pair):
    w, r = pair(slot_size=4096)
    _forge_tensor(w, (4096, 4096, 4096), (0, 0, 0))
    _expect_then_recover(w, r, BoundsError, "zero stride")
    _forge_tensor(w, (1000, 1000), (1, 1))          # 2 KB span, 1 M elements
    _expect_then_recover(w, r, BoundsError, "more than the slot capacity")


# ------------------------------------------------- timestamps from the future

HOUR_NS = 3600 * 1_000_000_000


def _receipt(capture_ts_ns, frame_id=7):
    return Receipt(frame_id=frame_id, capture_ts_ns=capture_ts_ns,
                   infer_start_ns=capture_ts_ns + 1, infer_end_ns=capture_ts_ns + 2,
                   device="CPU", bytes_in=64, bytes_out=16)


def test_frame_captured_an_hour_in_the_future_is_rejected(pair):
    w, r = pair(kind="frame", pixel_formats=("gray8",), slot_size=64 * 64, max_age_ms=100)

    def frame(fid, capture):
        with w.loan() as loan:
            loan.frame("gray8", 64, 64)[0][...] = fid
            return loan.publish(frame_id=fid, capture_ts_ns=capture)

    frame(1, time.monotonic_ns())
    with r.receive(timeout=1) as m:
        assert m.frame.frame_id == 1
    bad = frame(2, time.monotonic_ns() + HOUR_NS)
    with pytest.raises(FutureTimestamp, match=r"^channel 'test' seq \d+: future: frame "
                       r"capture timestamp is 3599\d{3}\.\d ms in the future "
                       r"\(tolerance 5 ms\)$") as info:
        r.receive(timeout=1)
    err = info.value
    assert (err.sequence, err.which, err.reason) == (bad, "frame capture", "future")
    assert HOUR_NS - 1_000_000_000 < err.ahead_ns <= HOUR_NS
    assert r.stats.rejected == {"future": 1}
    # The lie did not move the reader's reordering watermark: an honest frame follows.
    good = frame(3, time.monotonic_ns())
    with r.receive(timeout=1) as m:
        assert (m.sequence, m.frame.frame_id) == (good, 3)
        assert m.planes()[0][0, 0] == 3
    assert r.stats.rejected == {"future": 1} and r.stats.received == 2


def test_publish_timestamp_in_the_future_is_rejected_beyond_the_tolerance(pair):
    w, r = pair()
    w.publish_array(np.zeros(4, np.uint8), publish_ts_ns=time.monotonic_ns() + HOUR_NS)
    err = _expect_then_recover(w, r, FutureTimestamp, r"publish timestamp is 3599\d{3}\.\d "
                               r"ms in the future \(tolerance 5 ms\)")
    assert err.which == "publish" and r.stats.rejected == {"future": 1}
    # Within the tolerance (same machine, same clock): accepted.
    assert FUTURE_TOLERANCE_NS == 5_000_000
    seq = w.publish_array(np.zeros(4, np.uint8), publish_ts_ns=time.monotonic_ns() + 1_000_000)
    with r.receive(timeout=1) as msg:
        assert msg.sequence == seq
    assert r.stats.rejected == {"future": 1}


def test_receipt_captured_an_hour_in_the_future_is_rejected(pair):
    w, r = pair(dtype="float32", crc=True, max_age_ms=100)
    with w.loan() as loan:
        loan.array((4,))[...] = [0.5, 0.1, 0.9, 0.0]
        bad = loan.publish(receipt=_receipt(time.monotonic_ns() + HOUR_NS))
    with pytest.raises(FutureTimestamp, match=r"^channel 'test' seq \d+: future: receipt "
                       r"capture timestamp is 3599\d{3}\.\d ms in the future") as info:
        r.receive(timeout=1)
    assert (info.value.sequence, info.value.which) == (bad, "receipt capture")
    assert r.stats.rejected == {"future": 1}
    # The next, honest model output is delivered with its receipt.
    rc = _receipt(time.monotonic_ns() - 2_000_000, frame_id=8)
    with w.loan() as loan:
        loan.array((4,))[...] = [0.25, 0.0, 0.9, 0.0]
        good = loan.publish(receipt=rc)
    with r.receive(timeout=1) as m:
        assert m.sequence == good and m.receipt == rc
        assert m.array.tolist() == [0.25, 0.0, 0.8999999761581421, 0.0]
    assert r.stats.rejected == {"future": 1} and r.stats.received == 1


def test_receipt_through_the_pycapnp_fallback_is_checked_too(pair):
    """A receipt the compiled reader hands to pycapnp (here: a valid header split over
    several segments) is checked all the same."""
    import struct

    import capnp

    w, r = pair(dtype="float32")
    seq, gen = _next(w)
    b = capnp._MallocMessageBuilder(2)           # tiny first segment: 4 segments
    h = b.init_root(codec.SlotHeader)
    h.schemaVersion, h.channelId, h.sequence, h.generation = 1, 0, seq, gen
    h.writerPid, h.writerDomain, h.publishTsNs = 1, "control", time.monotonic_ns()
    rb = h.init("receipt")
    rb.captureTsNs, rb.frameId, rb.device = time.monotonic_ns() + HOUR_NS, 3, "CPU"
    segs = [bytes(x) for x in b.get_segments_for_output()]
    table = struct.pack(f"<{len(segs) + 1}I", len(segs) - 1, *(len(x) // 8 for x in segs))
    raw = table + bytes(-len(table) % 8) + b"".join(segs)
    assert len(segs) > 1 and codec.HEADER.receipt(raw) is codec.SLOW
    forge(w, raw, _layout_bytes(np.float32, (4,), (4,), 0))
    err = _expect_then_recover(w, r, FutureTimestamp, "receipt capture timestamp")
    assert r.stats.rejected == {"future": 1} and err.sequence == seq


def test_receipt_capture_read_agrees_with_the_full_decode():
    """The reader's capture-only read of a receipt gives the captureTsNs that the whole
    decode (and so pycapnp) gives, for the plain encoding and every single-byte change
    of it; where it cannot tell it says SLOW (pycapnp decides then)."""
    spec = ChannelSpec(name="m", dtype="float32", slot_size=64, crc=True)
    raw = codec.encode_header(spec, sequence=1, generation=2, writer_pid=3, domain="control",
                              publish_ts_ns=4, crc32=5, receipt=_receipt(123_456_789))
    none = codec.encode_header(spec, sequence=1, generation=2, writer_pid=3,
                               domain="control", publish_ts_ns=4, crc32=5)
    assert codec.HEADER.receipt_capture(raw) == 123_456_789
    assert codec.HEADER.receipt_capture(none) is None
    checked = 0
    for i in range(len(raw)):
        for flip in (0x01, 0x80, 0xff):
            bad = bytearray(raw)
            bad[i] ^= flip
            bad = bytes(bad)
            got = codec.HEADER.receipt_capture(bad)
            if got is codec.SLOW:
                continue
            try:
                full = codec.decode_receipt(bad, spec, 1, fast=False)
            except MalformedHeader:
                continue        # the whole decode refuses it: msg.receipt raises
            assert got == (None if full is None else full.capture_ts_ns), (i, flip)
            checked += 1
    assert checked > len(raw)
