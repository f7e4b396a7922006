"""The native receive path (round 8, docs/ipc-wakeups.md): Reader.try_receive is the C
ReaderCore's, the Message it builds is the C MessageBase's storage with ``array`` and
``release`` in C. Real segments and a real writer; each test compares with what the
Python path does, or asserts what a user of Message relies on."""
from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest

from supervisor.ipc import (BridgeError, CrcMismatch, LeaseLost, Message, Reader, Receipt,
                            Writer, _atomics, layout as L)

pytestmark = pytest.mark.skipif(
    _atomics.NATIVE is None or not hasattr(_atomics.NATIVE, "ReaderCore"),
    reason="native module not built")
N = _atomics.NATIVE


def _send(w: Writer, value: int, n: int = 64, **stamp) -> int:
    with w.loan() as loan:
        loan.array((n,), "uint8")[...] = value
        return loan.publish(**stamp)


def _lease_gen(r: Reader, k: int) -> int:
    """The generation word of lease entry k in the reader's own lease table."""
    return L.U64.unpack_from(r._lease_mm, L.lease_offset(k) + 8)[0]


def _python_built(r: Reader) -> list[int]:
    """Counts the messages the reader's Python code builds (Reader._message) from now
    on: the core builds the stream's common case itself."""
    made, message = [], r._message

    def counted(*a):
        made.append(1)
        return message(*a)
    r._message = counted
    return made


def test_the_native_reader_takes_in_c_and_builds_the_message_there(make_channel):
    ch = make_channel(slot_count=4, max_readers=1)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    assert isinstance(r.try_receive.__self__, N.ReaderCore)
    made = _python_built(r)
    for i in range(3):                      # the first decodes the layout in Python
        _send(w, i)
        m = r.try_receive()
        assert isinstance(m, Message) and m._core is r._core
        assert m.array.tolist() == [i] * 64 and not m.array.flags.writeable
        m.release()
    assert made == [1]                       # the repeats were built in C
    assert Message.release is N.MessageBase.release
    assert r.stats.received == 3 and r.stats.dropped == 0


def test_native_and_python_readers_agree_on_a_stream_with_gaps(make_channel):
    """Values, stamps, dropped and received of the native path equal the pure-Python
    reader's, message by message, through a writer lapping both (drops)."""
    ch = make_channel(slot_count=4, max_readers=2, max_leases=1)
    w = Writer(ch.writer_handle(), native=True)
    rn = Reader(ch.reader_handle(0), native=True)
    rp = Reader(ch.reader_handle(1), native=False)
    got = {id(rn): [], id(rp): []}
    for burst in (1, 2, 1, 3, 1, 1):       # 3 in a row into 4 slots: the readers lag
        for _ in range(burst):
            _send(w, (w.stats.published if hasattr(w, "stats") else 0) % 256)
        for r in (rn, rp):
            while (m := r.try_receive()) is not None:
                with m:
                    got[id(r)].append((tuple(m.stamp)[:2], m.sequence, m.array.tobytes()))
    assert got[id(rn)] == got[id(rp)] and got[id(rn)]
    sn, sp = rn.stats, rp.stats
    assert (sn.received, sn.dropped, sn.rejected) == (sp.received, sp.dropped, sp.rejected)


def test_lease_is_held_until_release_and_release_twice_is_a_no_op(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    _send(w, 1)
    r.try_receive().release()                # the layout is the validated one now
    _send(w, 2)
    _send(w, 3)
    m = r.try_receive()
    assert _lease_gen(r, 0) == m._gen != 0 and r._free_leases == []
    with pytest.raises(BridgeError, match="leases are held"):
        r.try_receive()                      # the only lease is m's
    m.release()
    assert _lease_gen(r, 0) == 0 and r._free_leases == [0]
    m.release()                              # twice: nothing more
    assert r._free_leases == [0]
    with pytest.raises(BridgeError, match="already released"):
        m.array                              # use after release
    with r.try_receive() as m3:
        assert m3.array[0] == 3
    assert _lease_gen(r, 0) == 0


def test_slot_reused_while_held_is_lease_lost_counted_and_freed(make_channel):
    ch = make_channel(slot_count=3, max_readers=1, max_leases=1, lease_ms=20)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    _send(w, 1)
    r.try_receive().release()
    _send(w, 2)
    m = r.try_receive()
    view = m.array
    assert view[0] == 2 and m._core is r._core
    time.sleep(0.03)                         # past the lease
    for i in range(4):
        _send(w, 50 + i)                     # every slot reused, m's too
    with pytest.raises(LeaseLost, match="reused by the writer"):
        m.release()
    with pytest.raises(LeaseLost):
        m.array
    assert r.stats.leases_lost == 1 and r._free_leases == [0]
    with r.try_receive() as m2:              # the reader goes on
        assert m2.array[0] >= 50


def test_context_manager_releases_and_keeps_the_bodys_exception(make_channel):
    ch = make_channel(slot_count=3, max_readers=1, max_leases=1, lease_ms=20)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    for v in (1, 2):
        _send(w, v)
        with r.try_receive() as m:
            assert m.array[0] == v
        assert m._released and r._free_leases == [0]
    _send(w, 3)
    with pytest.raises(KeyError):
        with r.try_receive() as m:
            time.sleep(0.03)
            for i in range(4):
                _send(w, 60 + i)             # reused under the body: LeaseLost at exit
            raise KeyError("the body's own")
    assert r.stats.leases_lost == 1 and r._free_leases == [0]


def test_crc_channel_confirms_in_c_and_refuses_a_corrupt_payload(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, crc=True)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    made = _python_built(r)
    for v in (5, 6):
        _send(w, v)
        with r.try_receive() as m:
            assert m.stamp.crc32 is not None and m.array[0] == v
    assert made == [1]                       # the second's CRC was confirmed in C
    # The writer's own mapping corrupts the payload after publish: the CRC refuses it.
    seq = _send(w, 7)
    slot = seq_slot = None
    for i in range(ch.spec.slot_count):
        if L.U64.unpack_from(w._buf, L.control_offset(i) + 8)[0] == seq:
            seq_slot = i
    slot = seq_slot
    pay = r._pay_at[slot] + r._last_layout.span[0]
    w._buf[pay] ^= 0xFF
    with pytest.raises(CrcMismatch):
        r.try_receive()
    assert r.stats.rejected == {"crc_mismatch": 1} and r._free_leases == [0]


def test_receipt_and_tolist_and_dlpack_on_the_native_message(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    t = time.monotonic_ns() - 10_000
    rc = Receipt(1, t, t + 1, t + 2, "GPU:0", 5, 6, "deviceQueued", 7, 8, 9, 10,
                 b"\x01" * 32, 11)
    made = _python_built(r)
    for v in (1, 2):
        _send(w, v, receipt=rc)
        m = r.try_receive()
        assert m.receipt == rc and m.receipt is m.receipt      # decoded once
        assert m.tolist() == [v] * 64
        assert np.from_dlpack(m).tolist() == [v] * 64
        assert m.frame is None and m.layout.shape == (64,)
        m.release()
        with pytest.raises(BridgeError):
            m.tolist()
    assert made == [1]


def test_frames_and_planes_on_the_native_message(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, kind="frame",
                      slot_size=64 * 48 * 3 // 2)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    made = _python_built(r)
    for fid in (1, 2, 3):
        with w.loan() as loan:
            y, uv = loan.frame("nv12", 64, 48)
            y[...] = fid
            uv[...] = 100 + fid
            loan.publish(frame_id=fid, capture_ts_ns=time.monotonic_ns())
        with r.try_receive() as m:
            assert m._core is r._core
            y, uv = m.planes()
            assert (int(y[0, 0]), int(uv[0, 0, 0])) == (fid, 100 + fid)
            assert m.frame.frame_id == fid and m.frame.width == 64
            assert m.array.shape == (72, 64)
    assert made == [1]


def test_hooks_cadence_and_burst_go_to_the_python_path(make_channel):
    """What the core does not decide itself (a replaced take, a cadence) is the Python
    path's, which still delivers every message in order."""
    ch = make_channel(slot_count=4, max_readers=2, max_leases=1)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    rb = Reader(ch.reader_handle(1), native=True, spin_us=50)
    calls = []
    take = r._ntake

    def counted(*a):
        calls.append(1)
        return take(*a)
    r._ntake = counted
    for v in range(3):
        _send(w, v)
        for rd in (r, rb):
            with rd.try_receive() as m:
                assert m.array[0] == v
    assert len(calls) == 3                   # the hook saw every take
    assert rb.stats.received == 3


def test_a_dropped_reader_is_collected(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    _send(w, 1)
    r.try_receive().release()
    ref = weakref.ref(r)
    r.close()
    del r
    gc.collect()
    assert ref() is None


def test_the_reader_cannot_write_its_segment(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    with pytest.raises(ValueError, match="read-only"):
        r._seg.store(L.OFF_LAST_SEQ, 1)
    with pytest.raises(TypeError):
        r._buf[0] = 0
