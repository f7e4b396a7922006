"""The native publish's repeat path (Writer._publish_native, ``_fast``): a description
published again skips the layout and plan lookups, and the writer's bookkeeping follows
the wake-up. Whatever a stream alternates (shapes, a frame, a receipt, a CRC'd channel),
every message must read back with its own layout, frame, receipt and sequence."""
from __future__ import annotations

import numpy as np
import pytest

from supervisor.ipc import Reader, Writer, _atomics
from supervisor.ipc.receipt import Receipt

pytestmark = pytest.mark.skipif(_atomics.NATIVE is None, reason="native module not built")


def _receipt(n: int) -> Receipt:
    return Receipt(frame_id=n, capture_ts_ns=1000 + n, infer_start_ns=2000,
                   infer_end_ns=3000, device="CPU", bytes_in=n, bytes_out=4,
                   completion="hostVisible", latency_ns=10, worst_case_ns=20, deadline_ns=50,
                   deadline_misses=0, artifact_sha256=b"\x01" * 32, kernels_run=3)


@pytest.mark.parametrize("crc", [False, True])
def test_alternating_descriptions_read_back_as_published(make_channel, crc):
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1, slot_size=4096, crc=crc)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    plan = ["a", "a", "b", "a", "receipt", "a", "receipt", "receipt", "a", "b", "b", "a"]
    for i, kind in enumerate(plan):
        with w.loan() as loan:
            shape = (4,) if kind != "b" else (2, 3)
            loan.array(shape, "uint8")[...] = i
            loan.publish(receipt=_receipt(i) if kind == "receipt" else None)
        with r.try_receive() as m:
            assert m.stamp.sequence == i + 1
            assert int(m.array.reshape(-1)[0]) == i
            assert m.array.shape == shape and m.stamp.frame_id is None
            rc = m.receipt
            assert (rc is not None and rc.frame_id == i) if kind == "receipt" else rc is None
    assert w.stats.published == len(plan) and w.last_sequence == len(plan)
    assert r.stats.dropped == 0 and not r.stats.rejected
    r.close()
    w.close()


def test_alternating_frames_read_back_as_published(make_channel):
    ch = make_channel(slot_count=8, max_readers=1, max_leases=1, slot_size=4096,
                      kind="frame", pixel_formats=("nv12",))
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    widths = [16, 16, 32, 16, 32, 32, 16]
    for i, width in enumerate(widths):
        with w.loan() as loan:
            y, uv = loan.frame("nv12", width, 8)
            y[...] = i
            uv[...] = i
            loan.publish(frame_id=100 + i, capture_ts_ns=5000 + i)
        with r.try_receive() as m:
            assert m.stamp.sequence == i + 1 and m.stamp.frame_id == 100 + i
            assert m.frame.width == width and int(m.planes()[0][0, 0]) == i
    assert r.stats.dropped == 0 and not r.stats.rejected
    r.close()
    w.close()


def test_bookkeeping_is_done_even_if_the_wake_up_call_fails(make_channel):
    """The writer's own state (sequence, generation, loans) follows the native publish in
    a finally: a publish that raised there still counts, and the next one goes on."""
    ch = make_channel(slot_count=4, max_readers=1, max_leases=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    w.publish_array(np.zeros(4, np.uint8))
    real = w._npublish

    def broken(*args):
        real(*args)
        raise RuntimeError("after the stores")
    w._npublish = broken
    with pytest.raises(RuntimeError):
        w.publish_array(np.ones(4, np.uint8))
    w._npublish = real
    assert w.last_sequence == 2 and not w._loaned
    w.publish_array(np.full(4, 2, np.uint8))
    got = []
    while (m := r.try_receive()) is not None:
        with m:
            got.append((m.stamp.sequence, int(m.array[0])))
    assert got[-2:] == [(2, 1), (3, 2)]
    r.close()
    w.close()
