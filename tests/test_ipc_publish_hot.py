"""A stream's repeat publish in one native call (``Loan.publish`` -> ``_native.
publish_hot``): the segment must hold, byte for byte, what the pure-Python writer
writes for the same messages; a value outside its field must be refused as before;
and whatever raises around the call, a message the segment shows is kept and booked,
one it does not show goes back invalid."""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from supervisor.ipc import Reader, Writer, _atomics
from supervisor.ipc._native import publish_hot

pytestmark = pytest.mark.skipif(_atomics.NATIVE is None, reason="native module not built")


def _counting(w: Writer) -> list[int]:
    """Count the writer's one-call publishes (the hot path must really be taken)."""
    calls, real = [], w._nhot

    def counted(*a):
        calls.append(a[2])
        return real(*a)
    w._nhot = counted
    return calls


def _stream(w: Writer, r: Reader, n: int, frame: bool) -> list[tuple]:
    got = []
    for i in range(n):
        with w.loan() as loan:
            if frame:
                y, uv = loan.frame("nv12", 32, 16)
                y[...], uv[...] = i, 200 - i
                loan.publish(frame_id=10 + i, capture_ts_ns=1000 + i, publish_ts_ns=5000 + i,
                             exposure_us=None if i % 3 else 40 + i,
                             gain=None if i % 2 else 1.5 + i)
            else:
                loan.array((3, 5), "uint8")[...] = i
                loan.publish(publish_ts_ns=5000 + i)
        with r.try_receive() as m:
            s = m.stamp
            got.append((s.sequence, s.publish_ts_ns, s.frame_id, s.capture_ts_ns,
                        s.exposure_us, s.gain, int(m.array.reshape(-1)[0]), m.array.shape))
    return got


@pytest.mark.parametrize("frame", [False, True])
def test_segment_bytes_equal_the_pure_python_writers(make_channel, frame):
    kw = dict(slot_count=4, max_readers=1, max_leases=1, slot_size=4096)
    if frame:
        kw.update(kind="frame", pixel_formats=("nv12",))
    chans = [make_channel(name=f"hot_{int(native)}", **kw) for native in (True, False)]
    ends = [(Writer(ch.writer_handle(), native=native),
             Reader(ch.reader_handle(0), native=native))
            for ch, native in zip(chans, (True, False))]
    calls = _counting(ends[0][0])
    got = [_stream(w, r, 14, frame) for w, r in ends]
    assert len(calls) >= 8           # every slot once through the general path, then hot
    assert got[0] == got[1]
    assert [g[0] for g in got[0]] == list(range(1, 15))
    (wn, rn), (wp, rp) = ends
    assert bytes(wn._buf) == bytes(wp._buf)
    assert wn.stats == wp.stats and not wn._loaned
    assert rn.stats.dropped == 0 and not rn.stats.rejected
    for w, r in ends:
        r.close()
        w.close()


def test_value_outside_its_field_is_refused_as_before(make_channel):
    ch = make_channel(slot_count=3, max_readers=1, max_leases=1, slot_size=64 * 64,
                      kind="frame")
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    calls = _counting(w)
    for i in range(6):           # every slot's views cached: the hot path from here
        with w.loan() as loan:
            loan.frame("gray8", 64, 64)[0][...] = i
            loan.publish(frame_id=i + 1, capture_ts_ns=time.monotonic_ns())
        r.try_receive().release()
    n = len(calls)
    with w.loan() as loan:
        loan.frame("gray8", 64, 64)
        with pytest.raises(struct.error):
            loan.publish(frame_id=9, capture_ts_ns=1, exposure_us=-5)   # not a UInt32
    assert len(calls) == n + 1       # the one call said no; the general path raised
    assert not w._loaned and w.last_sequence == 6
    assert r.try_receive() is None   # nothing of it published
    with w.loan() as loan:
        loan.frame("gray8", 64, 64)[0][...] = 7
        seq = loan.publish(frame_id=10, capture_ts_ns=time.monotonic_ns())
    with r.try_receive() as m:
        assert m.sequence == seq == 7 and m.array[0, 0] == 7
    r.close()
    w.close()


@pytest.mark.parametrize("after", [False, True])
def test_an_exception_around_the_call_keeps_only_what_was_published(make_channel, after):
    """``after``: the call published, then something raised (a signal between the call
    and the bookkeeping): the message stays, booked. Before it: the slot goes back."""
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, slot_size=64)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    for i in range(8):
        w.publish_array(np.full(4, i, np.uint8))
        r.try_receive().release()
    real = w._nhot

    def broken(*a):
        if after:
            real(*a)
        raise KeyboardInterrupt
    w._nhot = broken
    with pytest.raises(KeyboardInterrupt):
        w.publish_array(np.full(4, 8, np.uint8))
    w._nhot = real
    assert not w._loaned and w.last_sequence == (9 if after else 8)
    assert w.stats.published == (9 if after else 8)
    w.publish_array(np.full(4, 9, np.uint8))
    got = []
    while (m := r.try_receive()) is not None:
        with m:
            got.append((m.sequence, int(m.array[0])))
    assert got == ([(9, 8), (10, 9)] if after else [(9, 9)])
    assert r.stats.dropped == 0 and not r.stats.rejected
    r.close()
    w.close()


def test_bad_arguments_are_refused_before_any_store(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, slot_size=64)
    w = Writer(ch.writer_handle())
    w.publish_array(np.zeros(4, np.uint8))
    w.publish_array(np.zeros(4, np.uint8))
    plan, hot = w._fast[4], w._hot
    loan = w.loan()
    slot, other = loan.slot, (loan.slot + 1) % 4
    before, tables = bytes(w._buf), repr((w._gen, w._seq, w._loaned, w._slot_layout_gen))

    def hot_with(i, v):
        return hot[:i] + (v,) + hot[i + 1:]
    bad = [
        ((hot[:13], plan, slot, 9, None, None, None, None, None), TypeError),
        ((hot, plan[:3], slot, 9, None, None, None, None, None), TypeError),
        ((hot, plan, 4, 9, None, None, None, None, None), ValueError),
        ((hot, plan, -1, 9, None, None, None, None, None), ValueError),
        ((hot, plan, other, 9, None, None, None, None, None), ValueError),   # not on loan
        ((hot, plan, slot, -9, None, None, None, None, None), OverflowError),
        ((hot_with(4, ("x",)), plan, slot, 9, None, None, None, None, None), TypeError),
        ((hot_with(4, (-1,)), plan, slot, 9, None, None, None, None, None), ValueError),
        ((hot_with(9, tuple(w._gen)), plan, slot, 9, None, None, None, None, None),
         TypeError),
        ((hot_with(8, 7), plan, slot, 9, None, None, None, None, None), ValueError),
        ((hot, (plan[0], plan[1], 10 ** 6, plan[3]), slot, 9, None, None, None, None,
          None), ValueError),
    ]
    for args, exc in bad:
        with pytest.raises(exc):
            publish_hot(*args)
        assert bytes(w._buf) == before, args
        assert repr((w._gen, w._seq, w._loaned, w._slot_layout_gen)) == tables
    with pytest.raises(TypeError):
        publish_hot(hot, plan)
    loan.discard()
    w.close()
