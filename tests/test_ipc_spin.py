"""Reader.receive's bounded look at shared memory before it blocks (``spin_us``): a
message published within the window is taken without waiting on the wake-up socket,
the window never outlasts the receive's own timeout, and ``spin_us=0`` blocks at once.
A message found while spinning is taken by ``try_receive``, the one receive path with
every check (the spin only decides when to look)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from supervisor.ipc import ChannelTimeout, Reader, Writer
from supervisor.ipc import reader as reader_mod


class _CountingPoller:
    """Stands in for the reader's poll object: counts waits on the wake-up socket."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def poll(self, timeout_ms):
        self.calls += 1
        return self.real.poll(timeout_ms)


def _publish_later(w: Writer, delay_s: float, value: int) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        w.publish_array(np.full(4, value, dtype=np.uint8))

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("native", [None, False])
def test_a_message_within_the_spin_is_taken_without_blocking(make_channel, native):
    ch = make_channel(slot_count=4, max_readers=1)
    w = Writer(ch.writer_handle(), native=native)
    # A long window so that the publish (~5 ms later) surely lands inside it.
    r = Reader(ch.reader_handle(0), native=native, spin_us=2_000_000)
    r._poller = counting = _CountingPoller(r._poller)
    t = _publish_later(w, 0.005, 7)
    with r.receive(timeout=5) as msg:
        assert msg.array.tolist() == [7] * 4
    t.join()
    assert counting.calls == 0
    r.close()
    w.close()


@pytest.mark.parametrize("native", [None, False])
def test_spin_zero_blocks_on_the_wake_up_socket(make_channel, native):
    ch = make_channel(slot_count=4, max_readers=1)
    w = Writer(ch.writer_handle(), native=native)
    r = Reader(ch.reader_handle(0), native=native, spin_us=0)
    r._poller = counting = _CountingPoller(r._poller)
    t = _publish_later(w, 0.005, 9)
    with r.receive(timeout=5) as msg:
        assert msg.array.tolist() == [9] * 4
    t.join()
    assert counting.calls >= 1
    r.close()
    w.close()


def test_the_spin_never_outlasts_the_timeout(make_channel):
    ch = make_channel(slot_count=4, max_readers=1)
    w = Writer(ch.writer_handle())
    r = Reader(ch.reader_handle(0), spin_us=30_000_000)     # 30 s window
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0.05)
    assert time.monotonic() - t0 < 10       # the 0.05 s deadline ended it, not 30 s
    r.close()
    w.close()


def test_negative_spin_is_refused(make_channel):
    ch = make_channel(slot_count=4, max_readers=1)
    w = Writer(ch.writer_handle())
    with pytest.raises(ValueError):
        Reader(ch.reader_handle(0), spin_us=-1)
    assert reader_mod.SPIN_US > 0
    w.close()
