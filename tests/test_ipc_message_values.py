"""Message.tolist (the payload as Python values without a view) and the loan's cached
tensor span: the same answers as the paths they shortcut."""
from __future__ import annotations

import time

import numpy as np
import pytest

from supervisor.ipc import LeaseLost, Reader, Writer
from supervisor.ipc._types import tensor_span


@pytest.mark.parametrize("shape,strides", [((4,), None), ((3, 5), None), ((4,), (8,)),
                                           ((2, 3), (4, 12))])
def test_tolist_is_array_tolist(make_channel, shape, strides):
    ch = make_channel(dtype="float32", slot_size=4096, crc=True)
    with Writer(ch.writer_handle()) as w, Reader(ch.reader_handle(0)) as r:
        for rep in range(3):              # a fresh message, then kept arrays per slot
            with w.loan() as loan:
                a = loan.array(shape, np.float32, strides=strides)
                a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape) + rep
                a.flat[0] = np.nan
                loan.publish()
            with r.receive(timeout=2) as msg:
                got, want = msg.tolist(), msg.array.tolist()
                assert repr(got) == repr(want)     # NaN kept (NaN != NaN)


def test_tolist_of_a_reused_slot_raises_lease_lost(make_channel):
    ch = make_channel(slot_count=3, max_readers=1, max_leases=1, lease_ms=20)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    w.publish_array(np.full(64, 1, np.uint8))
    msg = r.receive(timeout=1)
    assert msg.tolist()[0] == 1
    time.sleep(0.03)                       # past the lease: the writer reuses every slot
    for i in range(5):
        w.publish_array(np.full(64, 50 + i, np.uint8))
    with pytest.raises(LeaseLost, match="reused by the writer"):
        msg.tolist()
    with pytest.raises(LeaseLost):
        msg.array


@pytest.mark.parametrize("native", [True, False])
def test_loan_span_is_the_tensor_span(make_channel, native):
    ch = make_channel(dtype="uint8", slot_size=1 << 16, kind="frame", pixel_formats=("nv12",))
    from supervisor.ipc import _atomics
    if native and _atomics.NATIVE is None:
        pytest.skip("native path not built")
    with Writer(ch.writer_handle(), native=native) as w:
        for _ in range(2):                 # computed, then from the writer's caches
            with w.loan() as loan:
                loan.frame("nv12", 64, 48)
                dt, shape, strides, offset = loan._desc
                assert loan._span == tensor_span(shape, strides, offset, dt.itemsize)
    ch2 = make_channel(name="t2", dtype="float32", slot_size=4096, crc=True)
    with Writer(ch2.writer_handle(), native=native) as w:
        for shape, strides, offset in (((4,), None, 0), ((2, 3), (4, 12), 8),
                                       ((3,), (-4,), 8)) * 2:
            with w.loan() as loan:
                loan.array(shape, np.float32, strides=strides, offset=offset)
                dt, shp, st, off = loan._desc
                assert loan._span == tensor_span(shp, st, off, dt.itemsize)
