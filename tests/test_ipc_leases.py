"""Readers can crash, stall or overstay their leases; the writer never blocks and a
stale reader gets an error, never torn data."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from supervisor.ipc import BridgeError, ChannelTimeout, LeaseLost, Reader, Writer, layout as L


def test_kill_9_reader_holding_leases(make_channel, peers):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=2, lease_ms=300)
    w = Writer(ch.writer_handle())
    holder = peers("holder", ch.reader_handle(0), "2")
    for i in range(2):
        w.publish_array(np.full(16, i, np.uint8))
    held = holder.read()["holding"]
    assert held == [1, 2]
    holder.proc.send_signal(signal.SIGKILL)
    assert holder.proc.wait() == -signal.SIGKILL

    # The dead reader's leases still protect slots 0 and 1 until they expire: the writer
    # goes round the two others and is never blocked.
    used = []
    for i in range(6):
        with w.loan() as loan:
            used.append(loan.slot)
            loan.array(16)[...] = 10 + i
            loan.publish()
    assert set(used) == {2, 3}
    assert w.stats.leases_honoured > 0
    time.sleep(0.35)   # past lease_ms: nothing protects those slots any more (no leak)
    used = []
    for i in range(4):
        with w.loan() as loan:
            used.append(loan.slot)
            loan.array(16)[...] = 20 + i
            loan.publish()
    assert set(used) == {0, 1, 2, 3}

    # A new reader on the same reader index attaches and gets fresh frames only: the
    # newest already published, then what follows, never older history.
    r = Reader(ch.reader_handle(0))
    with r.receive(timeout=2) as msg:
        assert msg.sequence == w.last_sequence and msg.array[0] == 23
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0.05)
    last = w.publish_array(np.full(16, 99, np.uint8))
    with r.receive(timeout=2) as msg:
        assert msg.sequence == last and msg.array[0] == 99
    assert r.stats.dropped == 0


def test_stalled_reader_gets_lease_lost_not_torn_data(make_channel):
    ch = make_channel(slot_count=3, max_readers=1, max_leases=1, lease_ms=20)
    w = Writer(ch.writer_handle())
    r = Reader(ch.reader_handle(0))
    w.publish_array(np.full(64, 1, np.uint8))
    msg = r.receive(timeout=1)
    assert msg.array[0] == 1
    time.sleep(0.03)                       # the reader stalls past its lease
    for i in range(5):                     # the writer reuses every slot, never blocks
        w.publish_array(np.full(64, 50 + i, np.uint8))
    with pytest.raises(LeaseLost, match="reused by the writer"):
        msg.array
    with pytest.raises(LeaseLost):
        msg.release()
    assert r.stats.leases_lost >= 1
    # The reader keeps working: the next receive gets the oldest message still in the
    # ring (seq 4); the two it never saw are counted as dropped.
    with r.receive(timeout=1) as m2:
        assert (m2.sequence, m2.array[0]) == (4, 52)
    assert r.stats.dropped == 2


def test_reader_cannot_exceed_its_lease_budget(make_channel):
    ch = make_channel(slot_count=3, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle())
    r = Reader(ch.reader_handle(0))
    w.publish_array(np.zeros(4, np.uint8))
    w.publish_array(np.ones(4, np.uint8))
    first = r.receive(timeout=1)
    with pytest.raises(BridgeError, match="leases are held"):
        r.receive(timeout=1)
    first.release()
    with r.receive(timeout=1) as second:
        assert second.array[0] == 1


def test_seqlock_never_lets_a_torn_copy_pass(make_channel, peers):
    """A writer in another process rewrites slots as fast as it can while this reader
    copies views with a tiny lease. Any copy that passes check() must be uniform."""
    n = 1 << 16
    ch = make_channel(slot_size=n, slot_count=3, max_readers=1, max_leases=1, lease_ms=1)
    writer = peers("writer", ch.writer_handle())
    r = Reader(ch.reader_handle(0))
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            writer.send(op="fill", n=n)

    t = threading.Thread(target=pump)
    t.start()
    passed = lost = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and passed < 300:
            try:
                msg = r.receive(timeout=1)
            except ChannelTimeout:
                continue
            try:
                copy = np.array(msg.array)
                if (passed + lost) % 2:
                    time.sleep(0.002)   # overstay the 1 ms lease: the writer may take the slot
                msg.release()
            except LeaseLost:
                lost += 1
                continue
            assert (copy == copy[0]).all(), "torn read passed the generation check"
            passed += 1
    finally:
        stop.set()
        t.join()
    assert passed > 0 and lost + passed > 20


def test_seqlock_words_never_pass_through_zero(make_channel):
    """The writer stores a generation and last_seq with one 8-byte store each. A
    struct.pack_into there zeroes its target before writing it, so a reader polling at
    that moment sees generation 0 (even: "stable", taken mid-write) or last_seq going
    back; this flaked test_seqlock_never_lets_a_torn_copy_pass as MalformedHeader."""
    ch = make_channel(slot_size=64, slot_count=3, max_readers=1)
    wh = ch.writer_handle()
    pid = os.fork()
    if pid == 0:                                    # the writer, publishing flat out
        try:
            w = Writer(wh)
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                w.publish_array(np.zeros(8, np.uint8))
        finally:
            os._exit(0)
    try:
        r = Reader(ch.reader_handle(0))
        ctl = [L.control_offset(i) for i in range(3)]
        gen_of = L.U64.unpack_from
        t_end = time.monotonic() + 5
        while min(gen_of(r._buf, c)[0] for c in ctl) < 2:   # every slot published once
            assert time.monotonic() < t_end, "the writer never published"
        zeros = back = reads = 0
        last = first = gen_of(r._buf, L.OFF_LAST_SEQ)[0]
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for c in ctl:
                zeros += gen_of(r._buf, c)[0] == 0
            seq = gen_of(r._buf, L.OFF_LAST_SEQ)[0]
            back += seq < last
            last = max(last, seq)
            reads += 1
        assert (zeros, back) == (0, 0)
        assert last - first > 100 and reads > 1000      # the two really raced
        r.close()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_blocking_receive_times_out_and_trio_receive_wakes(make_channel):
    import trio

    ch = make_channel(max_readers=1)
    w = Writer(ch.writer_handle())
    r = Reader(ch.reader_handle(0))
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0.1)
    assert 0.09 < time.monotonic() - t0 < 1.0

    async def main():
        async with trio.open_nursery() as nursery:
            async def publish_later():
                await trio.sleep(0.05)
                w.publish_array(np.arange(8, dtype=np.uint8))
            nursery.start_soon(publish_later)
            with trio.fail_after(2):
                msg = await r.receive_async()
            with msg:
                assert msg.array.tolist() == list(range(8))

    trio.run(main)


def test_writer_never_blocks_on_a_reader_that_never_reads(make_channel):
    ch = make_channel(slot_count=3, max_readers=2, max_leases=1)
    w = Writer(ch.writer_handle())
    Reader(ch.reader_handle(0))      # attached, never reads: its eventfd fills up
    t0 = time.monotonic()
    for i in range(2000):
        w.publish_array(np.full(8, i % 256, np.uint8))
    assert w.stats.published == 2000
    assert time.monotonic() - t0 < 10
