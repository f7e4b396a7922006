"""Which slot a loan takes: the newest one every reader has taken already (nobody's
message to lose, still in the caches), else the oldest (layout OFF_TAKEN; loan in
supervisor/ipc/_native.c and Writer.loan). Real segments, both paths."""
from __future__ import annotations

import numpy as np
import pytest

from supervisor.ipc import Reader, Writer, _atomics, layout as L

PATHS = [True, False] if _atomics.NATIVE is not None else [False]


def _send(w: Writer, value: int) -> int:
    with w.loan() as loan:
        loan.array((4,), "uint8")[...] = value
        slot = loan.slot
        loan.publish()
    return slot


def _drain(r: Reader) -> list[int]:
    got = []
    while (m := r.try_receive()) is not None:
        with m:
            got.append(int(m.array[0]))
    return got


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("spare", [0, 1])
def test_a_reader_that_keeps_up_gets_the_slot_it_released_back(make_channel, native, spare):
    """Taken and released before the next publish: the writer reuses that slot, not the
    next of eight (measured: a 3.5 MB frame copied in 162 us instead of 375 us). A
    reader index nobody attached to (the config's spare) does not count."""
    ch = make_channel(slot_count=8, max_readers=1 + spare, max_leases=1)
    w = Writer(ch.writer_handle(), native=native)
    r = Reader(ch.reader_handle(0), native=native)
    slots = []
    for i in range(20):
        slots.append(_send(w, i))
        assert _drain(r) == [i]
    assert len(set(slots[1:])) == 1, slots


@pytest.mark.parametrize("native", PATHS)
def test_a_lagging_reader_keeps_the_oldest_first_ring(make_channel, native):
    """Two readers, one keeping up, one taking nothing: nothing the lagging one has not
    taken is reused while older slots are free, so it gets all 7 in order."""
    ch = make_channel(slot_count=8, max_readers=2, max_leases=1)
    w = Writer(ch.writer_handle(), native=native)
    fast = Reader(ch.reader_handle(0), native=native)
    slow = Reader(ch.reader_handle(1), native=native)
    slots = []
    for i in range(7):
        slots.append(_send(w, i))
        assert _drain(fast) == [i]
    assert len(set(slots)) == 7
    assert _drain(slow) == list(range(7)) and slow.stats.dropped == 0


@pytest.mark.parametrize("native", PATHS)
def test_a_reader_that_overstates_what_it_took_costs_only_itself(make_channel, native):
    """Reader 0 claims it took everything (2**62); the honest reader 1, lagging, still
    gets every message: the smallest claim counts."""
    ch = make_channel(slot_count=8, max_readers=2, max_leases=1)
    w = Writer(ch.writer_handle(), native=native)
    liar = Reader(ch.reader_handle(0), native=native)
    honest = Reader(ch.reader_handle(1), native=native)
    for i in range(7):
        _send(w, i)
        L.U64.pack_into(liar._lease_mm, L.OFF_TAKEN, 1 << 62)
    assert _drain(honest) == list(range(7)) and honest.stats.dropped == 0


@pytest.mark.parametrize("native", PATHS)
def test_without_readers_the_ring_goes_oldest_first(make_channel, native):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=native)
    assert [_send(w, i) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_both_paths_choose_the_same_slots(make_channel):
    """The native loan and the pure-Python one, on the same history (readers keeping up,
    lagging, catching up), pick the same slot every time."""
    if _atomics.NATIVE is None:
        pytest.skip("native module not built")
    runs = []
    for native in (True, False):
        ch = make_channel(slot_count=6, max_readers=2, max_leases=1)
        w = Writer(ch.writer_handle(), native=native)
        a = Reader(ch.reader_handle(0), native=native)
        b = Reader(ch.reader_handle(1), native=native)
        slots = []
        for i in range(40):
            slots.append(_send(w, i))
            _drain(a)
            if i % 7 in (0, 3):
                _drain(b)
        runs.append(slots)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("native", PATHS)
def test_a_message_held_past_its_lease_waits_its_oldest_first_turn(make_channel, native):
    """A reader that holds a message past lease_ms has lapsed, but the writer still
    reuses that slot only in its oldest-first turn, not first (as before OFF_TAKEN):
    with 4 slots the held message survives the next 2 publishes."""
    import time

    ch = make_channel(slot_count=4, max_readers=1, max_leases=2, lease_ms=20)
    w = Writer(ch.writer_handle(), native=native)
    r = Reader(ch.reader_handle(0), native=native)
    for i in range(2):
        _send(w, i)
    assert _drain(r) == [0, 1]
    _send(w, 2)
    held = r.try_receive()                      # message 2, kept
    time.sleep(0.05)                            # its lease lapses
    for i in (3, 4):
        _send(w, i)
    held.check()                                # not reused: no LeaseLost
    assert int(held.array[0]) == 2
    held.release()
