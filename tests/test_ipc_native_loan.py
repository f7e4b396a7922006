"""The writer's Loan on the native module (round 8, docs/ipc-wakeups.md): its fields are
the C LoanBase's, and ``__enter__``, ``__exit__``, ``array``'s cache hit and
``publish``'s fast path run in C; everything else is the Python it was. Real segments,
a real reader; each test asserts what a user of Loan relies on, or that the C path
(not the Python one) carried a stream's repeat message."""
from __future__ import annotations

import numpy as np
import pytest

from supervisor.ipc import BridgeError, NextLoan, Reader, Receipt, Writer, _atomics
from supervisor.ipc._loan import Loan

pytestmark = pytest.mark.skipif(
    _atomics.NATIVE is None or not hasattr(_atomics.NATIVE, "LoanBase"),
    reason="native module not built")
N = _atomics.NATIVE


def _counting(w: Writer, name: str) -> list[int]:
    """Counts the calls of the writer's method ``name`` from now on (instance attribute:
    the C path looks it up there too)."""
    calls, real = [], getattr(w, name)

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    setattr(w, name, counted)
    return calls


def test_a_streams_repeat_publish_runs_in_c(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, slot_size=64)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    assert Loan.publish is N.LoanBase.publish and Loan.array is N.LoanBase.array
    general, hot = _counting(w, "_publish"), _counting(w, "_nhot")
    got = []
    for i in range(6):
        with w.loan() as loan:
            assert isinstance(loan, Loan)
            loan.array((8,), "uint8")[...] = i
            assert loan.publish(publish_ts_ns=None) == i + 1
        with r.try_receive() as m:
            got.append(int(m.array[0]))
    assert got == list(range(6)) and w.stats.published == 6
    # The first two publishes go the general way (the writer keeps its one-call plan
    # from the second); the rest were the native one-call publish, called from C.
    assert len(general) == 2 and len(hot) == 4


def test_publish_twice_receipt_frame_and_nothing_to_publish_are_pythons(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, slot_size=64)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    loan = w.loan()
    with pytest.raises(BridgeError, match="nothing to publish"):
        loan.publish()
    loan.array((8,), "uint8")[...] = 1
    loan.publish()
    with pytest.raises(BridgeError, match="already published"):
        loan.publish()
    with pytest.raises(TypeError):
        w.loan().publish(frame_idd=3)               # a wrong keyword: Python's TypeError
    rc = Receipt(1, 0, 0, 0, "", 0, 0, "unknown")
    with w.loan() as loan:
        loan.array((8,), "uint8")[...] = 2
        loan.publish(receipt=rc)
    seen = []
    while (m := r.try_receive()) is not None:
        with m:
            seen.append((int(m.array[0]), m.receipt))
    assert seen == [(1, None), (2, rc)]


def test_exit_discards_an_unpublished_loan_and_keeps_the_bodys_exception(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, slot_size=64)
    w = Writer(ch.writer_handle(), native=True)
    with w.loan() as loan:
        loan.array((8,), "uint8")[...] = 1              # never published
    with pytest.raises(KeyError):
        with w.loan() as loan:
            raise KeyError("the body's")
    assert w.stats.loans_discarded == 2 and not w._loaned and w.stats.published == 0


def test_array_keywords_and_positional_share_one_checked_description(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1, slot_size=64)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    for i in range(4):
        with w.loan() as loan:
            a = (loan.array((2, 4), "uint8") if i % 2
                 else loan.array(shape=(2, 4), dtype="uint8"))
            assert a.shape == (2, 4) and a.flags.writeable
            a[...] = i
            loan.publish()
        with r.try_receive() as m:
            assert m.array.tolist() == [[i] * 4] * 2
    with w.loan() as loan:
        with pytest.raises(BridgeError, match="carries uint8"):
            loan.array((8,), "float32")
        with pytest.raises(BridgeError, match="slot holds"):
            loan.array((65,), "uint8")


def test_a_loan_made_directly_and_next_loan(make_channel):
    ch = make_channel(slot_count=6, max_readers=1, max_leases=1, slot_size=64)
    w = Writer(ch.writer_handle(), native=True)
    r = Reader(ch.reader_handle(0), native=True)
    loan = Loan(w, 2)
    assert (loan.slot, loan._desc, loan._frame, loan._lkey, loan._span, loan._done) == (
        2, None, None, None, None, False)
    assert loan.capacity == 64
    nxt = NextLoan(w, (4,), "uint8")
    for i in range(3):
        nxt.array[...] = i
        nxt.publish()
        with r.try_receive() as m:
            assert m.array.tolist() == [i] * 4
    nxt.discard()
