"""NextLoan: a stream's next slot loaned ahead of its data (modeld's and controlsd's
outputs). What its users rely on: every publish is what ``array`` held, in order; the
slot on loan is invisible to readers; a failed publish gives its slot back and the
stream goes on; the price is one slot of the ring."""
from __future__ import annotations

import capnp
import pytest

from supervisor.ipc import NextLoan, Reader, Receipt, Writer


def test_each_publish_is_what_array_held_in_order(make_channel):
    ch = make_channel(dtype="float32", slot_size=4096, slot_count=4, max_readers=1, crc=True)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    nxt = NextLoan(w, (4,), "float32")
    for i in range(12):                       # round the ring three times
        nxt.array[:] = (i, -i, 0.5, i * 2)
        assert nxt.publish(frame_id=i, capture_ts_ns=1000 + i) == i + 1
        with r.receive(timeout=1) as m:
            assert (m.sequence, m.stamp.frame_id) == (i + 1, i)
            assert m.array.tolist() == [i, -i, 0.5, i * 2]
        # The slot loaned for the next message is not a message: nothing to take.
        assert r.try_receive() is None
    assert w.stats.loans_discarded == 0


def test_readers_may_lag_one_message_less(make_channel):
    """The price: the slot on loan is not in the ring. A reader slot_count - 1 messages
    behind still gets every one of them, in order."""
    ch = make_channel(dtype="float32", slot_size=4096, slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    with NextLoan(w, 4, "float32") as nxt:
        for i in range(3):
            nxt.array[:] = i
            nxt.publish()
        got = []
        while (m := r.try_receive()) is not None:
            with m:
                got.append(m.array[0])
        assert got == [0, 1, 2] and r.stats.dropped == 0


def test_a_failed_publish_gives_its_slot_back_and_the_stream_goes_on(make_channel):
    ch = make_channel(dtype="float32", slot_size=4096, slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    nxt = NextLoan(w, (4,), "float32")
    bad = Receipt(1, 2, 3, 4, "CPU", -1, 16)       # bytes_in below its UInt64 field
    nxt.array[:] = 7
    with pytest.raises((capnp.KjException, OverflowError)):   # pycapnp's refusal
        nxt.publish(receipt=bad)
    assert w.stats.loans_discarded == 1 and r.try_receive() is None
    nxt.array[:] = 8
    nxt.publish()
    with r.receive(timeout=1) as m:
        assert m.array.tolist() == [8, 8, 8, 8] and m.sequence == 1
    nxt.discard()
    assert not w._loaned and w.stats.loans_discarded == 2
    assert r.try_receive() is None
