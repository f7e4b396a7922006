"""A sleeping reader waits in one blocking read of its wake-up socket (Reader._wait):
the wake-up and the drain in one system call where poll + read were two.

Real segments, real socketpairs, a real second thread as the writer. What is checked is
what a caller and the writer can see: every message arrives, the socket is empty after
each woken receive (nothing left to drain, no extra wake-up), a timeout is still kept
to the millisecond, and a reader whose end is non-blocking (not made by Channel.create)
keeps poll + read.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from supervisor.ipc import ChannelTimeout, Reader, Writer, _atomics

pytestmark = pytest.mark.skipif(_atomics.NATIVE is None, reason="native module not built")


class _CountingPoll:
    """Stands in for the reader's poll object: counts the calls, then polls for real."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def poll(self, timeout=None):
        self.calls += 1
        return self.real.poll(timeout)


def _empty(fd: int) -> bool:
    s = socket.socket(fileno=os.dup(fd))
    try:
        s.recv(64, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    finally:
        s.close()
    return False


def _publish_later(w: Writer, values: list[int], gap_s: float) -> threading.Thread:
    def run() -> None:
        for v in values:
            time.sleep(gap_s)
            w.publish_array(np.full(8, v, np.uint8))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_channel_ends_reader_blocks_writer_does_not(make_channel):
    """The reader's end blocks (so it can sleep in a read); the writer's never does (a
    reader that stops reading must not stall the writer)."""
    ch = make_channel(slot_count=4, max_readers=2, max_leases=1)
    assert os.get_blocking(ch.reader_handle(0).event_fd)
    assert os.get_blocking(ch.reader_handle(1).event_fd)
    assert not any(os.get_blocking(fd) for fd in ch.writer_handle().event_fds)


@pytest.mark.parametrize("timeout", [None, 2.0])
def test_woken_receives_read_once_and_leave_nothing_to_drain(make_channel, timeout):
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    assert r._wake is not None
    r._poller = counting = _CountingPoll(r._poller)
    efd = ch.reader_handle(0).event_fd
    t = _publish_later(w, [1, 2, 3, 4, 5], 0.03)
    got = []
    for _ in range(5):
        with r.receive(timeout=timeout) as m:
            got.append(int(m.array[0]))
        assert not r._undrained and _empty(efd)
    t.join()
    assert got == [1, 2, 3, 4, 5]
    assert counting.calls == 0            # slept in read, never in poll
    assert r.stats.dropped == 0
    r.close()
    w.close()


def test_timeout_is_kept_and_the_rest_of_it_polled(make_channel):
    """SO_RCVTIMEO counts in jiffies: the read's part ends short of the deadline and poll
    waits out the rest, so the timeout is neither cut short nor stretched by a jiffy."""
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    r._poller = counting = _CountingPoll(r._poller)
    for timeout in (0.08, 0.01):
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout):
            r.receive(timeout=timeout)
        took = time.monotonic() - t0
        assert timeout <= took < timeout + 0.05, (timeout, took)
    assert counting.calls >= 2            # the remainder of 80 ms, and all of 10 ms
    # A message after timeouts still wakes it, in a read.
    before = counting.calls
    t = _publish_later(w, [7], 0.05)
    with r.receive(timeout=1.0) as m:
        assert int(m.array[0]) == 7
    t.join()
    assert counting.calls == before
    r.close()
    w.close()


def test_a_non_blocking_end_keeps_poll_and_read(make_channel):
    """A reader handed a non-blocking end (not from Channel.create) never changes its
    mode (the description may be shared): it polls and drains as before."""
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1)
    efd = ch.reader_handle(0).event_fd
    os.set_blocking(efd, False)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    assert r._wake is None
    r._poller = counting = _CountingPoll(r._poller)
    t = _publish_later(w, [1, 2, 3], 0.03)
    got = []
    for _ in range(3):
        with r.receive(timeout=2.0) as m:
            got.append(int(m.array[0]))
    t.join()
    assert got == [1, 2, 3] and counting.calls >= 1
    assert not os.get_blocking(efd)
    r.close()
    w.close()


def test_close_leaves_the_handle_fd_open(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle())
    rh = ch.reader_handle(0)
    r = Reader(rh)
    r.close()
    os.fstat(rh.event_fd)                 # still open: the reader closed its duplicate
    r2 = Reader(rh)                       # and a new reader at the index works
    w.publish_array(np.full(8, 9, np.uint8))
    with r2.receive(timeout=1.0) as m:
        assert int(m.array[0]) == 9
    r2.close()
    w.close()


def test_a_reset_wake_up_socket_is_a_timeout_not_an_oserror(make_channel):
    """A wake-up socket whose other end closed with bytes unread in it (ECONNRESET on
    the reader's next read: here the reader wrote them itself) wakes the reader like
    POLLERR did; receive ends in ChannelTimeout, never ConnectionResetError."""
    from supervisor.ipc.channel import ReaderHandle

    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle())
    rh = ch.reader_handle(0)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    r = Reader(ReaderHandle(rh.spec, rh.index, rh.data_fd, rh.lease_fd, b.fileno()))
    assert r._wake is not None
    b.send(b"x")              # lands in a's receive queue, never read
    a.close()
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0.1)
    r.close()
    b.close()
    w.close()
