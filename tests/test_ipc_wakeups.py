"""Wake-ups per sleep, not per message (K6 in supervisor/ipc/_native.c), and a reader
staying awake through a burst (``spin_us``, supervisor/ipc/_burst.py).

Real segments, real sockets: the bytes counted are the ones on the reader's wake-up
socket, the messages the ones a reader takes.
"""
from __future__ import annotations

import os
import select
import threading
import time

import numpy as np
import pytest

from supervisor.ipc import ChannelTimeout, Reader, Writer, _atomics, layout as L
from supervisor.ipc._burst import Burst

pytestmark = pytest.mark.skipif(_atomics.NATIVE is None, reason="native module not built")


def _pending(fd: int) -> int:
    n = 0
    while select.select([fd], [], [], 0)[0]:
        n += len(os.read(fd, 4096))
    return n


def _publish(w: Writer, n: int, start: int = 0) -> None:
    for i in range(n):
        w.publish_array(np.full(4, (start + i) % 256, np.uint8))


def test_one_wake_up_per_sleep_not_per_message(make_channel):
    """A burst that finds the reader asleep costs the writer one byte; the reader's next
    sleep gets a byte of its own, and every message is there."""
    ch = make_channel(slot_count=16, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    efd = ch.reader_handle(0).event_fd
    assert r._sleeping() is None                 # flag down: about to block
    _publish(w, 5)
    assert _pending(efd) == 1
    got = []
    while (m := r.try_receive()) is not None:
        with m:
            got.append(int(m.array[0]))
    assert got == [0, 1, 2, 3, 4]
    assert r._sleeping() is None                 # the next sleep
    _publish(w, 3, 5)
    assert _pending(efd) == 1
    w.close()
    r.close()


def test_a_new_reader_at_the_same_index_is_woken(make_channel):
    """The writer remembers the sleep it woke last; a reader started afterwards at that
    index counts from elsewhere (random start), so its first sleep gets its byte."""
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle())
    efd = ch.reader_handle(0).event_fd
    old = Reader(ch.reader_handle(0))
    assert old._sleeping() is None
    _publish(w, 1)
    assert _pending(efd) == 1
    sleeps = old._sleeps
    old.close()
    new = Reader(ch.reader_handle(0))
    assert new._sleeps not in (0, sleeps)
    new.try_receive().release()                  # it starts at the newest message
    assert new._sleeping() is None
    _publish(w, 1, 1)
    assert _pending(efd) == 1
    w.close()
    new.close()


def test_a_reader_that_does_not_count_is_woken_every_time(make_channel):
    """A count of 0 (the pure-Python reader, the C++ client, or a table zeroed by a
    hostile reader) never has its wake-ups skipped."""
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    efd = ch.reader_handle(0).event_fd
    r._lease_r.store(L.OFF_AWAKE, 0)
    r._lease_r.store(L.OFF_SLEEPS, 0)
    _publish(w, 4)
    assert _pending(efd) == 4
    w.close()
    r.close()


def test_a_blocked_reader_takes_every_message_of_bursts_from_another_thread(make_channel):
    """The reader keeps going to sleep between bursts of 1-6 messages; every message
    arrives with one byte per sleep at most (none lost: receive would time out)."""
    ch = make_channel(slot_count=64, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0), spin_us=0)
    total = 0
    sizes = [1 + (k * 7) % 6 for k in range(40)]

    def write() -> None:
        seq = 0
        for n in sizes:
            time.sleep(0.002)
            _publish(w, n, seq)
            seq += n

    t = threading.Thread(target=write)
    t.start()
    try:
        seen = 0
        while seen < sum(sizes):
            with r.receive(timeout=2.0) as m:
                assert m.sequence == seen + 1
                seen = m.sequence
            total += 1
    finally:
        t.join()
    assert total == sum(sizes)
    w.close()
    r.close()


# ------------------------------------------------------------------------ the spin

def test_burst_spins_only_after_two_close_messages():
    b = Burst(spin_ns=50_000)
    assert b.until(None) == 0                     # nothing taken yet
    b.took(1_000_000)
    assert b.until(None) == 0                     # one message: no burst
    b.took(1_030_000)
    assert b.until(None) == 1_080_000             # 30 us apart: look until 50 us later
    assert b.until(1_050_000) == 1_050_000        # never past the caller's deadline
    b.took(1_200_000)
    assert b.until(None) == 0                     # 170 us apart: sleep at once


def test_a_spinning_reader_looks_on_only_in_a_burst(make_channel):
    """Two messages close together, then a third 20 ms later: with spin_us the reader
    looks on for at most spin_us after the second (a miss), then sleeps and is woken;
    after the long gap it does not spin at all. (A preemption between the two takes
    can end the burst early on a loaded machine: up to 3 tries to see the spin.)"""
    ch = make_channel(slot_count=16, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0), spin_us=1000)
    seq = 0
    for _ in range(3):
        _publish(w, 2, seq)
        for _ in range(2):
            r.receive(timeout=1).release()
        threading.Timer(0.02, _publish, (w, 1, seq + 2)).start()
        t0 = time.monotonic()
        r.receive(timeout=1).release()
        assert time.monotonic() - t0 > 0.01          # it slept until the third
        seq += 3
        if r.stats.spin_misses:
            break
    assert (r.stats.spin_hits, r.stats.spin_misses) == (0, 1)
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0.01)                      # the last gap was long: no spin
    assert r.stats.spin_misses == 1
    w.close()
    r.close()


def test_spin_us_is_bounded_on_by_default_and_never_in_a_realtime_class(make_channel):
    """On by default (SPIN_US, _burst.py's measurements), off with spin_us=0, bounded;
    a reader whose thread runs in a real-time class never spins (above its writer on a
    shared CPU it would take the CPU the writer needs)."""
    from supervisor.ipc._burst import SPIN_US

    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle())
    assert Reader(ch.reader_handle(0))._burst.spin_ns == SPIN_US * 1000
    assert Reader(ch.reader_handle(0), spin_us=0)._burst is None
    with pytest.raises(ValueError, match="spin_us"):
        Reader(ch.reader_handle(0), spin_us=5000)
    r = Reader(ch.reader_handle(0), spin_us=1000)
    for _ in range(2):                       # a burst: two messages close together
        w.publish_array(np.zeros(4, np.uint8))
        r.receive(timeout=1).release()
    old = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        pytest.skip("SCHED_FIFO not allowed here")
    try:
        t0 = time.monotonic()
        assert r._spin(None, r.try_receive) is None      # no look-on at all
        assert time.monotonic() - t0 < 0.0005 and r._burst.misses == 0
    finally:
        os.sched_setscheduler(0, old[0], old[1])
