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
    """The price: the slot on loan is not in the ring. A reader slot_count messages
    behind gets the last slot_count - 1 of them, in order, and one counted as dropped
    (with Writer.loan it would get all slot_count)."""
    ch = make_channel(dtype="float32", slot_size=4096, slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    with NextLoan(w, 4, "float32") as nxt:
        for i in range(5):
            nxt.array[:] = i
            nxt.publish()
            if i == 0:
                r.receive(timeout=1).release()     # then 4 behind
        got = []
        while (m := r.try_receive()) is not None:
            with m:
                got.append(m.array[0])
        assert got == [2, 3, 4] and r.stats.dropped == 1


@pytest.mark.parametrize("native", [True, False])
def test_a_ring_without_a_slot_to_spare_is_not_loaned_ahead(make_channel, native):
    """Review: in a ring of max_readers x max_leases + 1 slots (the legal minimum) a
    reader holding one message left only the slot just published to loan, so every
    newer message was taken back as it was published. There the slot is loaned when the
    data comes (as Writer.loan), and the reader holding its message sees every newer one."""
    ch = make_channel(dtype="float32", slot_size=4096, slot_count=2, max_readers=1,
                      max_leases=1)
    w = Writer(ch.writer_handle(), native=native)
    r = Reader(ch.reader_handle(0), native=native)
    nxt = NextLoan(w, 4, "float32")
    assert not w._loaned
    nxt.array[:] = 1
    nxt.publish()
    held = r.try_receive()
    for v in (2, 3, 4):
        nxt.array[:] = v
        nxt.publish()                 # while the reader still holds the previous one
        held.release()
        held = r.try_receive()
        assert held is not None and held.array[0] == v
    held.release()


def test_a_writer_restarted_while_a_slot_was_on_loan_leaves_it_invalid(make_channel):
    """NextLoan holds a slot whenever its process dies; the restarted writer abandons
    it (seq 0, even generation): a lagging reader takes every published message after
    it, and nothing is rejected."""
    ch = make_channel(dtype="float32", slot_size=4096, slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle(), seal=False), Reader(ch.reader_handle(0))
    nxt = NextLoan(w, 4, "float32")
    for v in range(1, 5):
        nxt.array[:] = v
        nxt.publish()
    nxt.array[:] = 999                   # the next output, filled, never published
    Writer(ch.writer_handle(), seal=False)      # the restart
    got = []
    while (m := r.try_receive()) is not None:
        with m:
            got.append(m.array[0])
    assert got == [2, 3, 4] and not r.stats.rejected


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
    with pytest.raises(TypeError):
        nxt.publish(frameid=9)           # review: a bad keyword left its slot loaned
    assert len(w._loaned) == 1 and w.stats.loans_discarded == 2
    nxt.discard()
    assert not w._loaned and w.stats.loans_discarded == 3
    assert r.try_receive() is None
