"""The native reader's look for nothing: one acquire load of the writer's last_seq
(Reader._try_receive_native) instead of the 18-argument take, exactly where the take
would have found nothing (its own first look, R1 in supervisor/ipc/_native.c). Real
segments; the take is wrapped only to count its calls."""
from __future__ import annotations

import pytest

from supervisor.ipc import Reader, Writer, _atomics, layout as L

pytestmark = pytest.mark.skipif(_atomics.NATIVE is None, reason="native module not built")


def _send(w: Writer, value: int) -> None:
    with w.loan() as loan:
        loan.array((4,), "uint8")[...] = value
        loan.publish()


def _counting_take(r: Reader) -> list[int]:
    calls = [0]
    take = r._ntake

    def counted(*a):
        calls[0] += 1
        return take(*a)
    r._ntake = counted
    return calls


def test_nothing_new_skips_the_take_and_anything_new_reaches_it(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    calls = _counting_take(r)
    assert r.try_receive() is None and calls[0] == 0      # nothing published yet
    for i in range(3):
        _send(w, 10 + i)
        with r.try_receive() as m:                          # published: the take runs
            assert int(m.array[0]) == 10 + i
        assert calls[0] == i + 1
        assert r.try_receive() is None and calls[0] == i + 1   # consumed: no take
    _send(w, 20)
    _send(w, 21)                                            # two behind: both, in order
    got = []
    while (m := r.try_receive()) is not None:
        with m:
            got.append(int(m.array[0]))
    assert got == [20, 21] and r.stats.dropped == 0


def test_a_writer_word_moved_backwards_reads_as_nothing_new(make_channel):
    """A hostile (or restarted) writer's last_seq below what the reader took: nothing,
    as the take itself answers (latest < want), and no message is invented."""
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    for i in range(3):
        _send(w, i)
    while (m := r.try_receive()) is not None:
        m.release()
    calls = _counting_take(r)
    w._seg.store(L.OFF_LAST_SEQ, 1)
    assert r.try_receive() is None and calls[0] == 0
    w._seg.store(L.OFF_LAST_SEQ, 3)                     # back where it was: still nothing
    assert r.try_receive() is None and calls[0] == 0
    _send(w, 7)
    with r.try_receive() as m:
        assert int(m.array[0]) == 7
    assert calls[0] == 1
