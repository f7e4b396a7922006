"""The native module (supervisor/ipc/_native.c): used when built, the pure-Python path
only where it is correct, ordered accesses that refuse what they must, and the two
paths writing the same bytes and reading each other's messages.

The machine check is asked through `_atomics.select`'s parameters (another machine, an
install without the module), not by patching the interpreter or the kernel.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from supervisor.ipc import (BridgeError, LeaseLost, Reader, TornRead, Writer, _atomics,
                            layout as L)

NATIVE = _atomics.NATIVE
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ which path runs

def test_the_extension_is_built_and_runs_the_bridge(make_channel, monkeypatch):
    monkeypatch.delenv(_atomics.ENV, raising=False)
    assert NATIVE is not None, "supervisor.ipc._native is not built: pip install -e ."
    ch = make_channel(slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    assert w.native and r.native
    seq = w.publish_array(np.arange(8, dtype=np.uint8))
    with r.receive(timeout=1) as msg:
        assert msg.sequence == seq and msg.array.tolist() == list(range(8))
    # The generation and last_seq the reader acquired were stored by the native path.
    assert w._seg.load(L.OFF_LAST_SEQ) == seq
    w.close()
    r.close()


def test_pure_python_path_is_selectable_on_x86(make_channel, monkeypatch):
    monkeypatch.setenv(_atomics.ENV, "0")
    ch = make_channel(slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    assert not w.native and not r.native and w._seg is None and r._seg is None
    w.publish_array(np.full(4, 7, np.uint8))
    with r.receive(timeout=1) as msg:
        assert msg.array.tolist() == [7] * 4
    w.close()
    r.close()


@pytest.mark.parametrize("machine", ["aarch64", "armv7l", "riscv64", "ppc64le"])
def test_without_the_extension_the_bridge_refuses_off_x86(machine):
    with pytest.raises(BridgeError) as e:
        _atomics.select(machine=machine, module=None)
    msg = str(e.value)
    assert "\n" not in msg and machine in msg and "pip install -e" in msg


def test_pure_python_path_only_on_x86_64():
    assert _atomics.select(machine="x86_64", module=None) is None
    assert _atomics.select(False, machine="x86_64", module=NATIVE) is None
    assert _atomics.select(machine="aarch64", module=NATIVE) is NATIVE
    # Forcing the pure-Python path where it is not correct is refused, extension or not.
    with pytest.raises(BridgeError, match="aarch64"):
        _atomics.select(False, machine="aarch64", module=NATIVE)
    with pytest.raises(BridgeError, match="not built"):
        _atomics.select(True, machine="x86_64", module=None)


def test_bad_switch_value_is_one_line(monkeypatch):
    monkeypatch.setenv(_atomics.ENV, "maybe")
    with pytest.raises(BridgeError) as e:
        _atomics.select()
    assert "\n" not in str(e.value) and "TRIO_BRIDGE_NATIVE='maybe'" in str(e.value)


# ------------------------------------------------------------------ ordered accesses

def test_region_on_a_read_only_mapping_loads_and_refuses_stores(make_channel):
    ch = make_channel(slot_count=4, max_readers=1)
    w = Writer(ch.writer_handle())
    fd = ch.reader_handle(0).data_fd
    mm = mmap.mmap(fd, ch.spec.segment_size, prot=mmap.PROT_READ)
    ro = NATIVE.Region(mm)
    assert ro.load(0) == L.MAGIC                    # acquire load from a read-only page
    assert ro.load_relaxed(L.OFF_LAST_SEQ) == 0
    with pytest.raises(ValueError, match="read-only"):
        ro.store(L.OFF_LAST_SEQ, 1)
    with pytest.raises(BufferError):                # no writable export of it either
        NATIVE.Region(mm, True)
    for off in (-8, 3, ch.spec.segment_size - 4, ch.spec.segment_size):
        with pytest.raises(ValueError, match="outside|aligned"):
            ro.load(off)
    ro.release()
    with pytest.raises(ValueError, match="released"):
        ro.load(0)
    mm.close()                                      # the export is gone: closes
    w.close()


def test_check_is_the_seqlock_end(make_channel):
    ch = make_channel(slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    w.publish_array(np.zeros(4, np.uint8))
    msg = r.receive(timeout=1)
    cb = r._ctl[msg._slot]
    assert r._seg.check(cb, msg._gen) and not r._seg.check(cb, msg._gen + 2)
    msg.release()
    w.close()
    r.close()


# ------------------------------------------------------------------ the two paths agree

def _drive(w: Writer) -> None:
    """The same publishes, discards and frames, with fixed stamps."""
    for i in range(11):
        with w.loan() as loan:
            if i % 3 == 2:
                y, uv = loan.frame("nv12", 16, 8)
                y[...] = i
                uv[...] = 255 - i
                loan.publish(frame_id=i, capture_ts_ns=1000 + i, exposure_us=i or None,
                             gain=None if i % 2 else 1.25, publish_ts_ns=2000 + i)
            elif i % 5 == 4:
                loan.array((4, 4), "uint8")[...] = 1   # never published: discarded
            else:
                loan.array((8, 4), "uint8")[...] = np.arange(32, dtype=np.uint8).reshape(8, 4) + i
                loan.publish(publish_ts_ns=5000 + i)


@pytest.mark.parametrize("crc", [False, True])
def test_native_and_python_writers_write_the_same_segment(make_channel, crc):
    kw = dict(slot_size=4096, slot_count=4, max_readers=1, kind="frame", crc=crc)
    a, b = make_channel(name="a", **kw), make_channel(name="b", **kw)
    wa = Writer(a.writer_handle(), domain="control", native=True)
    wb = Writer(b.writer_handle(), domain="control", native=False)
    _drive(wa)
    _drive(wb)
    assert bytes(wa._buf) == bytes(wb._buf)       # every header, layout, control block
    wa.close()
    wb.close()


@pytest.mark.parametrize("wn,rn", [(True, False), (False, True)])
def test_each_path_reads_the_others_messages(make_channel, wn, rn):
    ch = make_channel(slot_size=4096, slot_count=4, max_readers=1, crc=True)
    w = Writer(ch.writer_handle(), native=wn)
    r = Reader(ch.reader_handle(0), native=rn)
    for i in range(6):
        seq = w.publish_array(np.full((3, 5), i, np.int8).astype(np.uint8))
        with r.receive(timeout=1) as msg:
            assert (msg.sequence, msg.array.tolist()) == (seq, [[i] * 5] * 3)
    assert r.stats.received == 6 and r.stats.rejected == {}
    w.close()
    r.close()


_WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from supervisor.ipc import Writer, WriterHandle
    w = Writer(WriterHandle.from_json(os.environ["H"]), native=True)
    end = time.monotonic() + float(sys.argv[2])
    i = 0
    while time.monotonic() < end:
        i += 1
        with w.loan() as loan:
            a = loan.array((1 << 14,), "uint64")
            a[...] = i                    # every word of the payload says which message
            loan.publish()
    print(i, flush=True)
""")


def test_no_torn_payload_survives_the_seqlock_across_processes(make_channel):
    """A native writer in another process overwrites a 2-slot ring as fast as it can
    while this reader reads whole payloads; a read the seqlock lets through (release()
    passes) is never torn: every word is the message's own number."""
    ch = make_channel(slot_size=8 << 14, slot_count=2, max_readers=1, max_leases=1,
                      lease_ms=1, dtype="uint64")
    h = ch.writer_handle()
    p = subprocess.Popen([sys.executable, "-c", _WRITER, REPO, "1.5"], pass_fds=h.fds(),
                         env=dict(os.environ, H=h.to_json()), stdout=subprocess.PIPE,
                         text=True)
    r = Reader(ch.reader_handle(0), native=True)
    good = torn_caught = 0
    end = time.monotonic() + 1.3
    while time.monotonic() < end:
        try:
            msg = r.receive(timeout=0.5)
        except TornRead:
            continue
        try:
            a = msg.array
            first, last, lo, hi = int(a[0]), int(a[-1]), int(a.min()), int(a.max())
            del a
            msg.release()
        except LeaseLost:        # the writer reused the slot: the data is discarded
            torn_caught += 1
            continue
        assert first == last == lo == hi, "a torn payload passed the seqlock check"
        good += 1
    r.close()
    sent = int(p.communicate(timeout=10)[0])
    assert p.returncode == 0 and good > 50 and sent > good
