"""``Reader.take_newest`` and ``receive(newest=True)``: the newest message, not the next;
the older unread ones skipped and counted as skipped (by choice), never as dropped
(lost to the writer). Real segments and sockets, both memory-ordering paths."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from supervisor.ipc import BridgeError, Reader, StaleMessage, Writer, _atomics

PATHS = [pytest.param(False, id="python")]
if _atomics.NATIVE is not None:
    PATHS.append(pytest.param(True, id="native"))


def _publish(w: Writer, values, **stamp) -> None:
    for v in values:
        w.publish_array(np.full(8, v, np.uint8), **stamp)


def _value(msg) -> int:
    with msg:
        return int(msg.array[0])


@pytest.mark.parametrize("native", PATHS)
def test_newest_skips_the_backlog_and_counts_it(make_channel, native):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=native)
    r = Reader(ch.reader_handle(0), native=native)
    assert r.take_newest() is None
    _publish(w, range(1, 11))               # 10 messages into 4 slots
    assert _value(r.take_newest()) == 10
    assert r.take_newest() is None           # nothing newer than what it took
    st = r.stats
    assert (st.received, st.skipped, st.dropped) == (1, 9, 0)
    _publish(w, [11])                        # nothing to skip: the next is the newest
    assert _value(r.take_newest()) == 11
    _publish(w, [12, 13])                    # in order again afterwards
    assert _value(r.try_receive()) == 12
    assert _value(r.try_receive()) == 13
    st = r.stats
    assert (st.received, st.skipped, st.dropped) == (4, 9, 0)
    r.close()
    w.close()


@pytest.mark.parametrize("native", PATHS)
def test_a_rejected_newest_is_counted_and_the_rest_still_skipped(make_channel, native):
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1, max_age_ms=100)
    w = Writer(ch.writer_handle(), native=native)
    r = Reader(ch.reader_handle(0), native=native)
    _publish(w, [1, 2])
    _publish(w, [3], publish_ts_ns=time.monotonic_ns() - 10**9)     # 1 s old: stale
    with pytest.raises(StaleMessage):
        r.take_newest()
    assert r.take_newest() is None           # the stale one was consumed, not retried
    st = r.stats
    assert (st.received, st.skipped, st.dropped, st.rejected) == (0, 2, 0, {"stale": 1})
    r.close()
    w.close()


def test_no_free_lease_skips_nothing(make_channel):
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    _publish(w, [1])
    held = r.try_receive()
    _publish(w, [2, 3, 4])
    with pytest.raises(BridgeError, match="leases are held"):
        r.take_newest()
    assert r.stats.skipped == 0              # nothing taken, nothing passed over
    held.release()
    assert _value(r.take_newest()) == 4
    assert (r.stats.skipped, r.stats.dropped) == (2, 0)
    r.close()
    w.close()


def test_receive_newest_waits_then_takes_the_newest(make_channel):
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    _publish(w, [1, 2, 3])
    assert _value(r.receive(timeout=1.0, newest=True)) == 3     # there already

    def later() -> None:
        time.sleep(0.05)
        _publish(w, [4, 5, 6])               # a burst while the reader sleeps
    t = threading.Thread(target=later, daemon=True)
    t.start()
    got = [_value(r.receive(timeout=2.0, newest=True))]
    t.join()
    while (m := r.take_newest()) is not None:
        got.append(_value(m))
    assert got[-1] == 6 and got == sorted(got)
    st = r.stats
    assert st.received + st.skipped == 6 and st.dropped == 0
    r.close()
    w.close()


@pytest.mark.parametrize("native", PATHS)
def test_a_latest_no_honest_writer_reaches_is_not_skipped_to(make_channel, native):
    """A writer that says its last message is numbered 2**62 (past layout.SEQ_HONEST)
    does not make take_newest jump there: the honest messages before it come in order."""
    from supervisor.ipc import layout as L

    ch = make_channel(slot_count=8, max_readers=1, max_leases=1)
    w = Writer(ch.writer_handle(), native=native)
    r = Reader(ch.reader_handle(0), native=native)
    _publish(w, [1, 2, 3])
    hint = L.LAST.unpack_from(w._buf, L.OFF_LAST_SEQ)[1]
    L.LAST.pack_into(w._buf, L.OFF_LAST_SEQ, 1 << 62, hint)
    got = []
    while (m := r.take_newest()) is not None:
        got.append(_value(m))
    assert got == [1, 2, 3] and r.stats.skipped == 0
    r.close()
    w.close()
