"""Red team: the native take's CRC and Receipt reading (4da5439) and rehearsals (110ef8d,
3e8fd99), attacked as a hostile writer that knows the code would.

The holes it found are fixed; their tests (the first six, and the bad-receipt one) now
pass and fail again without the fix. Everything else here is an attack that was denied.
"""
from __future__ import annotations

import copy
import gc
import math
import os
import struct
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from supervisor.ipc import (ChannelSpec, ChannelTimeout, CrcMismatch, FutureTimestamp,
                            LeaseLost, NextLoan, Reader, Rejected, Writer,
                            _atomics, codec, layout as L)
from supervisor.ipc import _capnp_fast as cf
from supervisor.ipc.receipt import Receipt

from .conftest import PEER
from .forge import watch_crc_confirms

NATIVE = _atomics.NATIVE
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(NATIVE is None, reason="no native module")
H = codec.HEADER


def _pub(w: Writer, v: float, *, scribble: bool = False, **stamp) -> tuple[int, np.ndarray]:
    """Publish float32[4] = v; ``scribble``: change a payload byte after publishing (a
    buggy or hostile writer: the CRC no longer matches). Returns (seq, writable view)."""
    loan = w.loan()
    a = loan.array((4,), np.float32)
    a[...] = v
    seq = loan.publish(**stamp)
    if scribble:
        a[3] = v + 1000.0
    return seq, a


def _live_leases(r: Reader) -> int:
    return sum(L.U64.unpack_from(r._lease_mm, off + 8)[0] != 0 for off in r._lease_offsets)


# ====================================================================== rehearsal holes


def test_rehearsal_never_hands_fn_a_message_the_reader_rejected_as_future(make_channel):
    ch = make_channel(slot_count=8, max_readers=1, dtype="float32", slot_size=4096,
                      max_age_ms=1000, crc=True)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000)
    seen = []
    r.rehearse(lambda m: seen.append(m.sequence))
    _pub(w, 1.0)
    r.receive(timeout=1).release()
    bad, _ = _pub(w, 2.0, publish_ts_ns=time.monotonic_ns() + 60_000_000)  # a lie about time
    with pytest.raises(FutureTimestamp):
        r.receive(timeout=1)
    assert r.stats.rejected == {"future": 1}
    time.sleep(0.07)             # the lie is in the past now
    r._rehearse()
    try:
        assert bad not in seen, f"fn ran on rejected seq {bad}: {seen}"
    finally:
        w.close()
        r.close()


@pytest.mark.parametrize("native", [True, False])
def test_rehearsal_never_hands_fn_a_message_rejected_for_its_crc(make_channel, native):
    if native and NATIVE is None:
        pytest.skip("no native module")
    ch = make_channel(slot_count=8, max_readers=1, dtype="float32", slot_size=4096, crc=True)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000, native=native)
    seen = []
    r.rehearse(lambda m: seen.append((m.sequence, m.array.tolist())))
    _pub(w, 1.0)
    r.receive(timeout=1).release()
    bad, view = _pub(w, 2.0, scribble=True)
    with pytest.raises(CrcMismatch):
        r.receive(timeout=1)
    view[3] = 2.0                # the writer puts the bytes the CRC covers back
    r._rehearse()
    try:
        assert all(s != bad for s, _ in seen), f"fn ran on rejected seq {bad}: {seen}"
    finally:
        w.close()
        r.close()


def test_rehearsal_runs_fn_only_on_a_message_already_delivered(make_channel):
    ch = make_channel(slot_count=4, max_readers=1, dtype="float32", slot_size=4096)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000)
    seen = []
    r.rehearse(lambda m: seen.append(m.sequence))
    delivered = []
    _pub(w, 0.0)
    with r.receive(timeout=1) as m:
        delivered.append(m.sequence)
    for i in range(5):           # the ring turns over: seq 1's slot is reused
        _pub(w, float(i + 1))
    r._rehearse()
    rehearsed = list(seen)
    with r.receive(timeout=1) as m:
        delivered.append(m.sequence)
    w.close()
    r.close()
    assert set(rehearsed) <= set(delivered[:1]), (rehearsed, delivered)


@needs_native
def test_the_readers_part_of_a_rehearsal_stays_within_the_busy_poll_bound(make_channel):
    size = 8 << 20                       # a big frame-sized slot, CRC'd
    busy_poll_us = 500                   # window 1 ms, bound 2 x 500 us a message
    ch = make_channel(slot_size=size, slot_count=2, max_readers=1, crc=True)
    w = Writer(ch.writer_handle())
    r = Reader(ch.reader_handle(0), busy_poll_us=busy_poll_us)
    for v in (1, 2):                     # the second in the layout validated last
        w.publish_array(np.full(size, v, np.uint8))
        r.receive(timeout=2).release()
    assert r._rehearsal is None          # no worker rehearsal at all (modeld's case)
    t0 = time.thread_time_ns()
    r._rehearse()
    cpu = time.thread_time_ns() - t0
    w.close()
    r.close()
    assert r.stats.rehearsals == 0       # fixed: a CRC'd channel of big slots is not rehearsed
    assert cpu <= 2 * busy_poll_us * 1000, f"{cpu / 1e6:.2f} ms of CPU before the window's spin"


def test_controlsd_rehearsal_never_withdraws_a_published_command(make_channel):
    from schemas.payloads import CONTROL_CMD
    from workers.controlsd import ControlLaw, LawConfig, _publish, rehearsal

    mo = make_channel(name="model_out", dtype="float32", slot_size=4096, crc=True)
    cc = make_channel(name="control_cmd", dtype="float32", slot_size=4096, crc=True,
                      slot_count=3, max_readers=2, max_leases=1)
    mw, mr = Writer(mo.writer_handle()), Reader(mo.reader_handle(0))
    cw = Writer(cc.writer_handle())
    a, b = Reader(cc.reader_handle(0)), Reader(cc.reader_handle(1))
    law = ControlLaw(LawConfig(engage_count=1))
    out = NextLoan(cw, CONTROL_CMD.shape, np.float32)
    assert not out._ahead                # slot_count - readers x leases < 2
    now = time.monotonic_ns()
    _publish(out, law.step(None, now))   # command 1
    _publish(out, law.step(None, now))   # command 2
    ma = a.receive(timeout=1)            # the actuator side is slow: holds 1
    b.receive(timeout=1).release()
    mb = b.receive(timeout=1)            # holds 2
    _publish(out, law.step(None, now))   # command 3: the newest
    mw.publish_array(np.array([0.1, 0.0, 0.9, 0.0], np.float32))
    with mr.receive(timeout=1) as m:
        rehearsal(law, out)(m)           # "without effect"
    ma.release()
    mb.release()
    got = []
    while (m := a.try_receive()) is not None:
        got.append(m.sequence)
        m.release()
    for x in (mw, mr, cw, a, b):
        x.close()
    assert got == [2, 3], f"reader saw {got}: command 3 was taken back by the rehearsal"


# ====================================================================== rehearsal: denied


@pytest.mark.parametrize("native", [True, False])
def test_rehearsals_change_nothing_the_reader_delivers_or_counts(make_channel, native):
    """Hostile stream (future, CRC-scribbled, stale, good), a rehearsal after every
    receive: delivered sequence, dropped, received, rejected, leases_lost equal a twin
    reader's without rehearsals; no lease is left behind."""
    if native and NATIVE is None:
        pytest.skip("no native module")
    ch = make_channel(slot_count=16, max_readers=2, dtype="float32", slot_size=4096,
                      crc=True, max_age_ms=500)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000, native=native)
    twin = Reader(ch.reader_handle(1), native=native)
    fn_calls = []
    r.rehearse(lambda m: fn_calls.append(m.sequence))
    plan = ["good", "future", "good", "crc", "good", "stale", "good", "good", "crc", "good"]

    def step(rd: Reader, rehearse: bool) -> object:
        try:
            with rd.receive(timeout=1) as m:
                got = (m.sequence, m.array.tolist())
        except Rejected as e:
            got = e.reason
        if rehearse:
            rd._rehearse()
            rd._rehearse()
        return got

    log_r, log_t = [], []
    for i, kind in enumerate(plan):
        now = time.monotonic_ns()
        if kind == "future":
            _pub(w, i, publish_ts_ns=now + 50_000_000)
        elif kind == "stale":
            _pub(w, i, publish_ts_ns=now - 2_000_000_000)
        else:
            _pub(w, i, scribble=kind == "crc")
        log_r.append(step(r, True))
        log_t.append(step(twin, False))
    assert log_r == log_t
    s, t = r.stats, twin.stats
    assert (s.received, s.dropped, s.rejected, s.leases_lost) == (
        t.received, t.dropped, t.rejected, t.leases_lost)
    assert s.rejected == {"future": 1, "crc_mismatch": 2, "stale": 1}
    assert s.rehearsals == 2 * len(plan) and not s.rehearsal_error
    assert _live_leases(r) == 0 and len(r._free_leases) == ch.spec.max_leases
    assert r.try_receive() is None       # nothing left over, nothing delivered twice
    w.close()
    r.close()
    twin.close()


def test_rehearsal_with_leases_held_by_the_worker(make_channel):
    """The worker holds messages while receive() rehearses: the rehearsal uses a free
    lease only, returns it, skips when none is free, and the held views stay valid."""
    ch = make_channel(slot_count=8, max_readers=1, max_leases=2, dtype="float32",
                      slot_size=4096)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000)
    seen = []
    r.rehearse(lambda m: seen.append((m.sequence, m.array.tolist())))
    _pub(w, 1.0)
    held = r.receive(timeout=1)          # held across the rehearsal
    r._rehearse()
    assert seen == [(1, [1.0] * 4)] and held.array.tolist() == [1.0] * 4
    assert _live_leases(r) == 1 and len(r._free_leases) == 1
    _pub(w, 2.0)
    held2 = r.receive(timeout=1)         # both leases held now
    r._rehearse()                        # none free: skipped, nothing raised
    assert len(seen) == 1 and r.stats.rehearsals == 1
    held.release()
    held2.release()
    assert _live_leases(r) == 0
    w.close()
    r.close()


def test_rehearsal_that_keeps_the_message_or_loses_its_lease(make_channel):
    """fn keeps the Message (a leak of a lease?) or the writer reuses the slot during fn
    (LeaseLost): the lease is returned either way and nothing is counted."""
    ch = make_channel(slot_count=2, max_readers=1, dtype="float32", slot_size=4096,
                      lease_ms=1)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000)
    kept = []

    def fn(m):
        kept.append(m)
        time.sleep(0.003)                # the lease (1 ms) expires
        _pub(w, 7.0)
        _pub(w, 8.0)                     # both slots reused: ours too
    r.rehearse(fn)
    _pub(w, 1.0)
    r.receive(timeout=1).release()
    r._rehearse()
    assert len(kept) == 1 and _live_leases(r) == 0
    with pytest.raises(LeaseLost):
        kept[0].array                    # the kept message is dead, not silently reused
    st_ = r.stats
    assert (st_.leases_lost, st_.rejected, st_.received) == (0, {}, 1)
    assert not st_.rehearsal_error      # the reader's release, not fn, saw the loss
    w.close()
    r.close()


def test_a_bad_receipt_skips_one_rehearsal_and_does_not_turn_them_off(make_channel):
    """Weakness (performance only), fixed: a receipt that only pycapnp can judge, and
    rejects, made the worker's rehearsal raise and turned it off for good. A BridgeError
    from the worker's rehearsal now skips that rehearsal only; the rejection is never
    counted by the rehearsal."""
    from workers.controlsd import model_output_of

    ch = make_channel(slot_count=8, max_readers=1, dtype="float32", slot_size=4096,
                      crc=True)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000)
    r.rehearse(model_output_of)
    rc = Receipt(1, time.monotonic_ns(), 0, 0, "CPU", 1, 1)
    seq = w.publish_array(np.ones(4, np.float32), receipt=rc)
    m = r.receive(timeout=1)
    slot = m._slot
    m.release()
    base = ch.spec.control_size + slot * ch.spec.slot_stride
    hdr = bytes(w._buf[base:base + 2048])   # the writer owns these bytes
    i = hdr.index(b"CPU\x00")
    w._buf[base + i + 3] = 1             # Text without its NUL: pycapnp rejects it
    r._rehearse()
    assert r.stats.rehearsal_error == "" and r._rehearsal is model_output_of
    assert r.stats.rejected == {}        # the rehearsal's rejection is not counted
    assert _live_leases(r) == 0 and seq == 1
    w.close()
    r.close()


def test_controlsd_law_copy_shares_no_state_with_the_law_even_on_hostile_outputs():
    from workers.controlsd import ControlLaw, LawConfig, ModelOutput, SafeReason

    law = ControlLaw(LawConfig(engage_count=1, tau_s=0.05))
    now = time.monotonic_ns()
    law.step(ModelOutput(0.5, 0.01, 0.9, now), now)
    before = copy.deepcopy(vars(law))
    for out in (ModelOutput(math.nan, math.inf, -1.0, now), ModelOutput(1e30, -1e30, 2.0, 0),
                ModelOutput(0.2, 0.0, 0.9, now + 10**12),
                ModelOutput.refused_by(SafeReason.FUTURE, now + 10**9)):
        twin = copy.copy(law)
        for k in range(3):
            twin.step(out, now + k * 10_000_000)
        assert vars(law) == before


# ====================================================================== native take: CRC


@needs_native
def test_native_crc_under_a_writer_rewriting_the_ring_across_processes(make_channel):
    """A seqlock-following writer in another process turns a 2-slot CRC'd ring over as
    fast as it can (256 KiB payloads: the CRC lets go of the GIL). Every message the
    native take confirmed (crc_ok) and whose release passed is whole and matches."""
    ch = make_channel(slot_size=8 << 15, slot_count=2, max_readers=1, max_leases=1,
                      lease_ms=1, dtype="uint64", crc=True)
    h = ch.writer_handle()
    p = subprocess.Popen([sys.executable, str(PEER), "flood", "1.2"], pass_fds=h.fds(),
                         env=dict(os.environ, PEER_HANDLE=h.to_json()),
                         stdout=subprocess.PIPE, text=True)
    # The writer is a new interpreter: under load it took over the default 5 s to attach.
    r = Reader(ch.reader_handle(0), native=True, attach_timeout_s=60)
    confirmed = watch_crc_confirms(r)
    good = 0
    # The whole flood, however long the loaded machine makes it (a fixed 1 s from attach
    # saw too few messages to prove anything when the writer was slow to get going).
    while p.poll() is None:
        try:
            msg = r.receive(timeout=0.5)
        except (Rejected, ChannelTimeout):
            continue
        try:
            a = msg.array.copy()
            crc = msg.stamp.crc32
            msg.release()
        except LeaseLost:
            continue
        assert a.min() == a.max(), "torn payload accepted"
        assert zlib.crc32(a.tobytes()) == crc
        good += 1
    r.close()
    p.communicate(timeout=10)
    assert p.returncode == 0 and good > 20 and sum(confirmed) > 10


_CLOSE_RACE = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from supervisor.ipc import Channel, ChannelSpec, Reader, Writer
    size = 24 << 20
    ch = Channel.create(ChannelSpec(name="big", slot_size=size, slot_count=2,
                                    max_readers=1, crc=True))
    w = Writer(ch.writer_handle())
    r = Reader(ch.reader_handle(0))
    for v in (0, 1):                   # the second: layout validated, CRC in take
        w.publish_array(np.full(size, v, np.uint8))
        r.receive(timeout=2).release()
    stop = False
    def spin():
        while not stop:
            r._last_seq -= 1           # take the same message again and again
            try:
                m = r.try_receive()
                if m is not None:
                    m.release()
            except Exception:
                return                 # a clean error after close: fine
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.3)
    r.close()                          # misuse, but must not crash the process
    time.sleep(0.2)
    stop = True
    t.join()
    print("survived", flush=True)
""")


@needs_native
def test_close_from_another_thread_during_a_frame_crc_does_not_crash():
    p = subprocess.run([sys.executable, "-c", _CLOSE_RACE, REPO], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "survived" in p.stdout, (p.returncode, p.stderr[-500:])


# ====================================================================== native receipt

SPEC = ChannelSpec(name="m", slot_size=64, crc=True, channel_id=3)
_BASE_RECEIPT = Receipt(7, 123, 4, 5, "CPU-device", 6, 8, "hostVisible", 9, 10, 11, 12,
                        bytes(range(32)), 13)


def _base_raw() -> bytes:
    return codec.encode_header(SPEC, sequence=1, generation=2, writer_pid=3,
                               domain="control", publish_ts_ns=4, crc32=5, frame_id=None,
                               capture_ts_ns=None, exposure_us=None, gain=None,
                               receipt=_BASE_RECEIPT)


def _positions(raw: bytes) -> dict[str, int]:
    m = cf.Message(raw)
    rpos = m.root.ptrs + H.receipt_ptr * 8
    rc = m.struct_at(rpos)
    return {"seg": 0, "receipt": rpos, "device": rc.ptrs + H.r_device_ptr * 8,
            "sha": rc.ptrs + H.r_sha_ptr * 8, "data0": rc.data}


def _pycapnp(raw: bytes):
    try:
        return "ok", codec.decode_receipt(raw, SPEC, 1, fast=False)
    except Rejected as e:
        return type(e).__name__, None


_OFF = st.one_of(st.integers(-8, 40), st.integers(-(1 << 29), (1 << 29) - 1))
_struct_word = st.builds(lambda o, d, p: ((o << 2) & 0xFFFFFFFC) | (d << 32) | (p << 48),
                         _OFF, st.integers(0, 0xFFFF) | st.integers(0, 8),
                         st.integers(0, 0xFFFF) | st.integers(0, 4))
_list_word = st.builds(lambda o, e, n: 1 | ((o << 2) & 0xFFFFFFFC) | (e << 32) | (n << 35),
                       _OFF, st.sampled_from([2, 2, 2, 0, 1, 3, 7]),
                       st.integers(0, (1 << 29) - 1) | st.integers(0, 300))
_any_word = st.one_of(_struct_word, _list_word, st.integers(0, 2**64 - 1),
                      st.builds(lambda o: 2 | ((o << 2) & 0xFFFFFFFC), _OFF))


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(["receipt", "device", "sha", "data0", "any"]),
                                st.integers(0, 200), _any_word), min_size=1, max_size=3),
       cut=st.integers(0, 40))
def test_native_receipt_on_crafted_pointer_words_answers_only_what_pycapnp_answers(edits, cut):
    raw = bytearray(_base_raw())
    pos = _positions(bytes(raw))
    for where, k, word in edits:
        at = pos[where] if where != "any" else 8 * (k % (len(raw) // 8))
        struct.pack_into("<Q", raw, at, word & (2**64 - 1))
    if cut:                              # a shorter segment (the table says so)
        words = struct.unpack_from("<I", raw, 4)[0]
        struct.pack_into("<I", raw, 4, max(0, words - cut))
    raw = bytes(raw)
    got = codec.native_receipt(raw)
    if got is not codec.SLOW:
        assert _pycapnp(raw) == ("ok", got)
    fast = H.receipt(raw)
    if fast is not codec.SLOW:
        assert fast == got or got is codec.SLOW


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=st.binary(min_size=0, max_size=600), rpos=st.integers(-64, 700),
       end=st.integers(0, 700))
def test_native_receipt_on_arbitrary_bytes_never_reads_outside(blob, rpos, end):
    """The raw entry point with any rpos/end: None, SLOW, a Receipt or ValueError."""
    end = min(end, len(blob))
    try:
        got = NATIVE.receipt(blob, rpos, end, H.r_native, codec.SLOW)
    except ValueError:
        return
    assert got is None or got is codec.SLOW or isinstance(got, Receipt)


@needs_native
def test_the_reader_delivers_the_receipt_pycapnp_reads_for_hostile_headers(make_channel):
    """Through the real take: receipts with a NUL, a bad Text, an overlapping/self
    pointing struct. What msg.receipt gives (native or decoded on demand) equals
    pycapnp's reading of the same header bytes, or both reject."""
    ch = make_channel(slot_count=8, max_readers=1, dtype="float32", slot_size=4096)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0))
    now = time.monotonic_ns()
    rc = Receipt(1, now, 0, 0, "CPU", 1, 1, "hostVisible", 0, 0, 0, 0, b"\x01" * 32, 3)
    outcomes = []
    for variant in range(6):
        seq = w.publish_array(np.ones(4, np.float32), receipt=rc)
        m0 = r._last_seq
        base = ch.spec.control_size + w._seq.index(seq) * ch.spec.slot_stride
        hdr = bytearray(w._buf[base:base + 2048])
        p = _positions(bytes(hdr))
        if variant == 1:                 # device Text without NUL
            i = bytes(hdr).index(b"CPU\x00")
            w._buf[base + i + 3] = ord("x")
        elif variant == 2:               # invalid UTF-8 in device
            i = bytes(hdr).index(b"CPU\x00")
            w._buf[base + i:base + i + 3] = b"\xff\xfe\xfd"
        elif variant == 3:               # the device pointer points at the sha bytes
            d = struct.unpack_from("<Q", hdr, p["sha"])[0]
            off = ((d & 0xFFFFFFFF) >> 2) + (p["sha"] - p["device"]) // 8
            word = 1 | ((off << 2) & 0xFFFFFFFC) | (2 << 32) | (32 << 35)
            struct.pack_into("<Q", w._buf, base + p["device"], word)
        elif variant == 4:               # sha as a list of words (not bytes)
            d = struct.unpack_from("<Q", hdr, p["sha"])[0]
            struct.pack_into("<Q", w._buf, base + p["sha"], (d & ~(7 << 32)) | (5 << 32))
        elif variant == 5:               # unknown completion enumerant
            struct.pack_into("<H", w._buf, base + p["data0"] + H.r_scalars[-1].offset, 9)
        with r.receive(timeout=1) as m:
            raw = m._raw_header
            want = _pycapnp(raw)
            try:
                got = ("ok", m.receipt)
            except Rejected as e:
                got = (type(e).__name__, None)
            outcomes.append(got[0])
            assert got == want, (variant, got, want)
        assert m0 + 1 == seq
    assert outcomes[0] == "ok" and "MalformedHeader" in outcomes
    w.close()
    r.close()


LEAK_ROUNDS = 1000       # messages between the two snapshots


@needs_native
def test_native_take_with_receipts_and_rejections_does_not_leak(make_channel):
    """Receipts read in take, CRC rejections after take gave one, SLOW receipts, and
    rehearsals, a thousand times: pymalloc's block count stays flat.

    The bound is 0.1 block a message (LEAK_ROUNDS // 10), what 3000 rounds and 300
    allowed before: a block leaked per message (1000) or per CRC rejection (every 5th:
    200) still fails it; with nothing leaking the count grows by ~11 whatever the
    rounds (measured at 1000 and 3000), far under it. 3000 rounds cost 11 s of the
    suite's 15 min on 2 cores for no more sensitivity to a rate."""
    ch = make_channel(slot_count=8, max_readers=1, dtype="float32", slot_size=4096,
                      crc=True)
    w = Writer(ch.writer_handle(), domain="control")
    r = Reader(ch.reader_handle(0), busy_poll_us=1000)
    r.rehearse(lambda m: m.receipt)

    def round_(i: int) -> None:
        rc = Receipt(i, time.monotonic_ns(), 0, 0, "CPU" * (i % 3), 1, 1,
                     artifact_sha256=b"\x02" * (i % 40))
        loan = w.loan()
        a = loan.array((4,), np.float32)
        a[...] = i
        loan.publish(receipt=rc)
        if i % 5 == 0:
            a[0] = -1.0                    # CrcMismatch after take read the receipt
        try:
            with r.receive(timeout=1) as m:
                m.receipt
        except CrcMismatch:
            pass
        r._rehearse()

    # The bridge's compiled-plan and layout caches are bounded by clearing when full, so
    # what they hold at a snapshot depends on where in that cycle the snapshot falls, and
    # that depends on what earlier tests left in the process-wide ones: 50 entries left
    # there gave +331 blocks in CI with no leak. Each is checked against its bound, then
    # emptied, so both snapshots see them at the same point and only growth is counted.
    bounded = [(codec.HEADER._plans, 64), (codec.HEADER._compiled, 32),
               (codec.HEADER._rcompiled, 32), (w._receipt_plans, 16), (r._layouts, 16),
               (r._hdr._compiled, 32), (r._hdr._rcompiled, 32)]     # the reader's own

    def settle():
        for cache, bound in bounded:
            assert len(cache) <= bound, f"a cache grew past its bound: {len(cache)}"
            cache.clear()
        gc.collect()

    # Blocks allocated with this test in their traceback (tracemalloc attributes the
    # native path's allocations to the Python line that called it), not process-wide and
    # not the bridge's code in general: in CI a thread an earlier test left running bridge
    # code grew the bridge's count by 843.
    import tracemalloc

    mine = [tracemalloc.Filter(True, __file__, all_frames=True)]
    tracemalloc.start(6)
    try:
        for i in range(400):
            round_(i)
        settle()
        before = tracemalloc.take_snapshot().filter_traces(mine)
        for i in range(400, 400 + LEAK_ROUNDS):
            round_(i)
        settle()
        after = tracemalloc.take_snapshot().filter_traces(mine)
    finally:
        tracemalloc.stop()
    grown = sum(d.count_diff for d in after.compare_to(before, "filename"))
    st_ = r.stats
    w.close()
    r.close()
    total = 400 + LEAK_ROUNDS
    assert st_.rejected == {"crc_mismatch": total // 5} and st_.received == total - total // 5
    assert grown < LEAK_ROUNDS // 10, f"{grown} blocks more after {LEAK_ROUNDS} messages"
