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

from supervisor.ipc import (BridgeError, CrcMismatch, LeaseLost, Reader, TornRead, Writer,
                            _atomics, layout as L)

from .conftest import PEER
from .forge import watch_crc_confirms

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


@pytest.mark.skipif(NATIVE is None, reason="no native module on this machine")
@pytest.mark.parametrize("size", [64, 256 * 1024])      # a frame's CRC lets go of the GIL
def test_the_native_take_checks_the_crc_itself_and_refuses_a_scribbled_payload(
        make_channel, size):
    """The CRC-32 of a message in the layout validated last is checked inside take
    (then the seqlock again); a payload changed after publish is still a counted,
    one-line CrcMismatch, and the next good message is delivered."""
    ch = make_channel(slot_size=size, slot_count=4, max_readers=1, crc=True)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    confirmed = watch_crc_confirms(r)

    def publish(v: int, scribble: bool = False) -> int:
        with w.loan() as loan:
            a = loan.array((size,), "uint8")
            a[...] = v
            seq = loan.publish()
            if scribble:
                a[size // 2] = v + 1      # a buggy writer scribbles after publishing
        return seq

    for i in range(3):
        seq = publish(i)
        with r.receive(timeout=1) as msg:
            assert msg.sequence == seq and int(msg.array[size - 1]) == i
    assert confirmed == [0, 1, 1]     # the first layout is validated by Python first
    publish(9, scribble=True)
    with pytest.raises(CrcMismatch, match="payload CRC") as info:
        r.receive(timeout=1)
    assert str(info.value).count("\n") == 0 and confirmed[-1] == 0
    assert r.stats.rejected == {"crc_mismatch": 1}
    seq = publish(4)
    with r.receive(timeout=1) as msg:
        assert msg.sequence == seq and confirmed[-1] == 1
    w.close()
    r.close()


_USE_AFTER_CLOSE = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from supervisor.ipc import Channel, ChannelSpec, NextLoan, Reader, Writer
    ch = Channel.create(ChannelSpec(name="x", dtype="float32", slot_size=4096,
                                    slot_count=4, max_readers=1))
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
    w.publish_array(np.arange(4, dtype=np.float32))
    m = r.receive(timeout=1)
    seen = m.array
    ahead = NextLoan(w, (4,), np.float32)
    held = w.loan().array((4,), np.float32)
    w.close()
    r.close()
    held[0] = 1.0                    # a loaned array, written after close()
    ahead.array[1] = 2.0             # the slot NextLoan holds
    print(seen.tolist())             # a message's array, read after close()
""")


@pytest.mark.parametrize("native", [True, False])
def test_arrays_used_after_close_do_not_crash_the_process(native):
    """numpy arrays keep no buffer export: close() used to unmap the segment under a
    loaned or received array, and the next access through it killed the process
    (SIGSEGV). The mapping now lives as long as something refers to it."""
    if native and NATIVE is None:
        pytest.skip("no native module on this machine")
    env = dict(os.environ, **{_atomics.ENV: "1" if native else "0"})
    p = subprocess.run([sys.executable, "-c", _USE_AFTER_CLOSE, REPO], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr[-500:])
    assert p.stdout.strip() == "[0.0, 1.0, 2.0, 3.0]"


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


def test_no_torn_payload_survives_the_seqlock_across_processes(make_channel):
    """A native writer in another process overwrites a 2-slot ring as fast as it can
    while this reader reads whole payloads; a read the seqlock lets through (release()
    passes) is never torn: every word is the message's own number."""
    ch = make_channel(slot_size=8 << 14, slot_count=2, max_readers=1, max_leases=1,
                      lease_ms=1, dtype="uint64")
    h = ch.writer_handle()
    p = subprocess.Popen([sys.executable, str(PEER), "flood", "1.5"], pass_fds=h.fds(),
                         env=dict(os.environ, PEER_HANDLE=h.to_json()),
                         stdout=subprocess.PIPE, text=True)
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


# ------------------------------------------------------------------ skipped wake-ups

def _pending(fd: int) -> int:
    import select as _select
    n = 0
    while _select.select([fd], [], [], 0)[0]:
        n += len(os.read(fd, 4096))
    return n


def test_writer_skips_wake_ups_only_for_a_reader_that_will_look(make_channel):
    ch = make_channel(slot_count=8, max_readers=2, max_leases=1)
    w = Writer(ch.writer_handle())
    awake = Reader(ch.reader_handle(0), native=True)
    plain = Reader(ch.reader_handle(1), native=False)   # never says it is awake
    for i in range(5):
        w.publish_array(np.full(4, i, np.uint8))
    assert _pending(ch.reader_handle(0).event_fd) == 0
    assert _pending(ch.reader_handle(1).event_fd) == 5
    for r in (awake, plain):
        got = []
        while (m := r.try_receive()) is not None:
            with m:
                got.append(int(m.array[0]))
        assert got == [0, 1, 2, 3, 4]     # woken or not, every message is there
    # A reader that timed out asleep is awake again afterwards, and one blocked in
    # receive() is woken: its flag was down while it slept.
    with pytest.raises(Exception, match="nothing within"):
        awake.receive(timeout=0.01)
    assert awake._lease_r.load(L.OFF_AWAKE) == L.READER_AWAKE
    w.close()
    awake.close()
    plain.close()


def test_the_race_a_skipped_wake_up_opens_is_closed(make_channel):
    """The interleaving that would lose a wake-up, step by step: the reader looked
    (nothing), the writer publishes while the reader still says it is awake (no byte),
    then the reader gets ready to block: its last look must find the message. Once it
    is down, the next publish sends the byte."""
    ch = make_channel(slot_count=4, max_readers=1)
    w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0), native=True)
    efd = ch.reader_handle(0).event_fd
    assert r.try_receive() is None                       # the reader's look: nothing
    seq = w.publish_array(np.full(4, 1, np.uint8))       # the writer: reader awake
    assert _pending(efd) == 0                            # ... so no wake-up byte
    msg = r._sleeping()                                  # flag down, fence, last look
    assert msg is not None and msg.sequence == seq
    msg.release()
    assert r._lease_r.load(L.OFF_AWAKE) == L.READER_AWAKE
    assert r._sleeping() is None                         # nothing more: it would block
    w.publish_array(np.full(4, 2, np.uint8))
    assert _pending(efd) == 1                            # and is woken
    w.close()
    r.close()


_PACED_WRITER = textwrap.dedent("""
    import os, random, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from supervisor.ipc import Writer, WriterHandle
    w = Writer(WriterHandle.from_json(os.environ["H"]), native=True)
    rnd = random.Random(1)
    for i in range(1, int(sys.argv[2]) + 1):
        d = rnd.choice((0, 0, 0, 20e-6, 100e-6, 1e-3))
        end = time.perf_counter() + d
        while time.perf_counter() < end:
            pass                          # spin: hit the reader's sleep/wake edges
        w.publish_array(np.full(4, i % 256, np.uint8))
        if i % 150 == 0:
            time.sleep(0.2)               # a message followed by silence
    time.sleep(0.5)
""")


def test_no_wake_up_is_lost_when_they_are_skipped(make_channel):
    """A native writer in another process publishes with random gaps (none, tens of
    microseconds, a millisecond), so this reader keeps falling asleep and waking up:
    every message arrives, none late: a lost wake-up for a message followed by 200 ms
    of silence would deliver it only with the next one."""
    n = 1500
    ch = make_channel(slot_count=64, max_readers=1, max_leases=1)
    h = ch.writer_handle()
    p = subprocess.Popen([sys.executable, "-c", _PACED_WRITER, REPO, str(n)],
                         pass_fds=h.fds(), env=dict(os.environ, H=h.to_json()))
    r = Reader(ch.reader_handle(0), native=True)   # waits for the writer to attach
    seen = 0
    while seen < n:
        with r.receive(timeout=2.0) as m:    # a lost wake-up would time out here
            late_ms = (time.monotonic_ns() - m.publish_ts_ns) / 1e6
            assert m.sequence > seen and late_ms < 150, (m.sequence, late_ms)
            seen = m.sequence
    assert p.wait(timeout=10) == 0 and r.stats.received > n // 2
    r.close()
