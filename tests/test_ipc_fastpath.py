"""The hot path's shortcuts read and write exactly what the slow, obvious paths do.

* SlotHeader decode compiled per message structure == pycapnp's dynamic decode.
* A header whose pointer words differ (larger v2 struct, a moved FrameMeta, overlapping
  structs) never takes a stale compiled plan: it goes back to the per-field path.
* The compiled SlotHeader writer produces pycapnp's bytes.
* The writer's last_slot hint is only a hint; the reader's cached views and deferred
  eventfd read change nothing a caller can see.
"""
from __future__ import annotations

import contextlib
import re
import struct
import time
from pathlib import Path

import capnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import schemas
from supervisor.ipc import (BridgeError, ChannelSpec, ChannelTimeout, Reader, Rejected,
                            Writer, codec, layout as L)
from supervisor.ipc._fast_fields import _MAX_COMPILED

from .forge import forge

H = codec.HEADER
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
GAIN = st.floats(width=32, allow_nan=False)
DOMAINS = st.sampled_from(["unknown", "control", "research", "supervisor"])
SPECS = [ChannelSpec(name="t", slot_size=64), ChannelSpec(name="f", slot_size=64, kind="frame"),
         ChannelSpec(name="c", slot_size=64, crc=True),
         ChannelSpec(name="i", slot_size=64, kind="frame", crc=True, channel_id=7)]
FAST = settings(max_examples=400, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _outcome(fn, *args, **kw):
    try:
        return "ok", fn(*args, **kw)
    except Rejected as e:
        return type(e).__name__, str(e)


@contextlib.contextmanager
def _compiled_only():
    """Fail if decode falls back to the per-field path (proves the compiled one ran)."""
    def refuse(raw, spec):
        raise AssertionError("compiled decode fell back to the per-field path")

    H._decode_fields = refuse
    try:
        yield
    finally:
        del H._decode_fields


def _same(fast, slow) -> None:
    """Accepted: the same Stamp. Rejected: the same typed rejection (pycapnp words a
    malformed message differently from the fixed-offset reader)."""
    assert fast[0] == slow[0]
    if slow[0] == "ok" and isinstance(slow[1], tuple) and isinstance(fast[1], tuple):
        # A mutated float field (gain) can decode to a NaN, which never equals itself
        # (hypothesis found one): NaN on both sides is the same value.
        assert len(fast[1]) == len(slow[1]), (fast, slow)
        for x, y in zip(fast[1], slow[1]):
            assert x == y or (x != x and y != y), (fast, slow)
    elif slow[0] != "MalformedHeader":
        assert fast == slow


def native_verdict(raw: bytes, spec: ChannelSpec):
    """The native reader's check (`_native.accept`) on ``raw``, asked with the sequence,
    generation and clock that make every reader check pass if the bytes are right:
    the sequence and generation the header itself holds, "now" = its publish time.
    None: it defers (the Python path decides)."""
    c = H._compiled.get(raw[:16])
    if c is None or not c.native:
        return None
    pos = c.native[4::2]

    def u64(i: int) -> int:
        return int.from_bytes(raw[pos[i]:pos[i] + 8].ljust(8, b"\0"), "little")
    return codec.native_accept(raw, spec, u64(2), u64(3), u64(7), 0, max_age_ns=0)


def _all_decodes_agree(raw: bytes, spec: ChannelSpec, *, compiled: bool = True):
    slow = _outcome(codec.decode_header, raw, spec, fast=False)
    fields = _outcome(H._decode_fields, raw, spec)     # compiles the structure
    _same(fields, slow)
    _same(_outcome(codec.decode_header, raw, spec), fields)
    if compiled:
        assert raw[:16] in H._compiled
        with _compiled_only():
            assert _outcome(codec.decode_header, raw, spec) == fields
    native = native_verdict(raw, spec)
    if native is not None:                     # the native check accepts only what
        assert ("ok", native) == slow          # pycapnp accepts, with the same values
    return slow


header_values = st.fixed_dictionaries({
    "sequence": U64, "generation": U64, "writer_pid": U32, "domain": DOMAINS,
    "publish_ts_ns": U64, "crc32": st.none() | U32, "frame_id": st.none() | U64,
    "capture_ts_ns": st.none() | U64, "exposure_us": st.none() | U32,
    "gain": st.none() | GAIN})


@FAST
@given(v=header_values, channel_id=U32)
def test_compiled_encode_and_decode_equal_pycapnp(v, channel_id):
    spec = ChannelSpec(name="h", slot_size=64, channel_id=channel_id)
    ref = codec.encode_header(spec, **v)
    got = H.encode(spec, v["sequence"], v["generation"], v["writer_pid"], v["domain"],
                   v["publish_ts_ns"], v["crc32"], v["frame_id"], v["capture_ts_ns"],
                   v["exposure_us"], v["gain"])
    assert got == ref                          # byte for byte what pycapnp writes
    plan = H.plan(spec, v["writer_pid"], v["domain"], v["crc32"] is not None,
                  v["frame_id"] is not None)
    assert plan.native is not None             # the native writer: the same bytes
    assert plan.pack_native_bytes(v["sequence"], v["generation"], v["publish_ts_ns"],
                                  v["crc32"], v["frame_id"], v["capture_ts_ns"],
                                  v["exposure_us"], v["gain"]) == ref
    for s in SPECS + [spec]:
        kind, stamp = _all_decodes_agree(ref, s)
        if kind == "ok":
            assert stamp.sequence == v["sequence"] and stamp.crc32 == v["crc32"]
            assert stamp.frame_id == v["frame_id"]
            assert stamp.exposure_us == (v["exposure_us"] if v["frame_id"] is not None
                                         else None)
            # Every reader check passes (capture not after publish, no clock overflow):
            # the native check must take it, not defer.
            if ((v["frame_id"] is None or (v["capture_ts_ns"] or 0) <= v["publish_ts_ns"])
                    and v["publish_ts_ns"] + 5_000_000 < 2**64):
                assert native_verdict(ref, s) == stamp


def test_compiled_decode_each_optional_field_combination():
    for crc in (None, 5):
        for frame_id in (None, 9):
            for exposure in (None, 0, 250):
                for gain in (None, 0.0, 1.5):
                    raw = codec.encode_header(
                        SPECS[3], sequence=3, generation=4, writer_pid=5, domain="control",
                        publish_ts_ns=6, crc32=crc, frame_id=frame_id, capture_ts_ns=2,
                        exposure_us=exposure, gain=gain)
                    for s in SPECS:
                        _all_decodes_agree(raw, s)
                    kind, stamp = _outcome(codec.decode_header, raw, SPECS[3])
                    if kind == "ok":
                        assert (stamp.crc32, stamp.frame_id, stamp.exposure_us,
                                stamp.gain) == (crc, frame_id, exposure, gain)


# ------------------------------------------------------- structures that differ

def _with_fields(text: str, struct_name: str, fields: list[str]) -> str:
    """``text`` with ``fields`` ("name :Type") appended to ``struct_name`` at the next
    free ordinals, whatever the schema's current fields are."""
    start = text.index(f"struct {struct_name} {{")
    depth, i = 0, text.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            break
        i += 1
    n = max(int(x) for x in re.findall(r"@(\d+)", text[start:i])) + 1
    added = "".join(f"  {f.split()[0]} @{n + k} {' '.join(f.split()[1:])};\n"
                    for k, f in enumerate(fields))
    return text[:i] + added + text[i:]


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    """A v2 SlotHeader: more fields, so a larger root struct. Every schema file gets
    its own new file id (one process cannot load two files with one id)."""
    folder: Path = tmp_path_factory.mktemp("v2fast")
    for path in schemas.SCHEMA_DIR.glob("*.capnp"):
        text = re.sub(r"^@0x([0-9a-f]{16});",
                      lambda m: f"@0x{int(m.group(1), 16) ^ (0x0F << 56):016x};", path.read_text(),
                      flags=re.M)
        if path.name == "slot.capnp":
            text = _with_fields(text, "SlotHeader", [
                "routeName :Text", "tempC :Float64", "extra :List(UInt64)", "more :UInt64",
                "again :UInt64"])
            assert "again @" in text
        (folder / path.name).write_text(text)
    return capnp.load(str(folder / "slot.capnp"), imports=[str(folder)])


def _v2_header(v2, *, frame=True, exposure=250, seq=7, route="a" * 40):
    h = v2.SlotHeader.new_message(schemaVersion=2, channelId=0, sequence=seq, generation=4,
                                  writerPid=9, writerDomain="control", publishTsNs=1000,
                                  routeName=route, tempC=41.5, extra=list(range(5)),
                                  more=1, again=2)
    if frame:
        m = h.frame.init("meta")
        m.frameId, m.captureTsNs = 3, 900
        if exposure is not None:
            m.exposure.microseconds = exposure
        m.gain.value = 2.0
    return h.to_bytes()


def test_v2_larger_struct_and_v1_alternate_without_mixing(v2):
    spec = SPECS[1]
    v1 = codec.encode_header(spec, sequence=1, generation=2, writer_pid=1, domain="control",
                             publish_ts_ns=5, crc32=None, frame_id=11, capture_ts_ns=4,
                             exposure_us=None, gain=None)
    new = _v2_header(v2)
    assert v1[:16] != new[:16]                 # a different root pointer: another plan
    for _ in range(3):                         # each keeps its own compiled structure
        assert _all_decodes_agree(v1, spec)[1].frame_id == 11
        stamp = _all_decodes_agree(new, spec)[1]
        assert (stamp.sequence, stamp.frame_id, stamp.exposure_us, stamp.gain) == (7, 3, 250, 2.0)
    _all_decodes_agree(_v2_header(v2, frame=False), SPECS[0])
    _all_decodes_agree(_v2_header(v2, exposure=None, route=""), spec)


def _word(raw: bytes, pos: int) -> int:
    return int.from_bytes(raw[pos:pos + 8], "little")


def _put_word(buf: bytearray, pos: int, value: int) -> None:
    buf[pos:pos + 8] = value.to_bytes(8, "little")


def _moved_meta(raw: bytes, gap_before_meta: bool) -> bytes:
    """The same header one word longer: the extra zero word either sits just before
    FrameMeta (the FrameMeta pointer's offset grows by one) or at the end. Both have
    identical first 16 bytes; only the FrameMeta pointer word differs."""
    root = _word(raw, 8)
    dwords, pcount = (root >> 32) & 0xFFFF, root >> 48
    assert root & 0xFFFFFFFF == 0 and H.meta_ptr < pcount
    ptrs = 16 + dwords * 8
    meta_ptr = ptrs + H.meta_ptr * 8
    assert all(_word(raw, ptrs + 8 * i) == 0 for i in range(pcount) if i != H.meta_ptr)
    target = meta_ptr + 8 + ((_word(raw, meta_ptr) & 0xFFFFFFFF) >> 2) * 8
    out = bytearray(raw)
    out[4:8] = (int.from_bytes(raw[4:8], "little") + 1).to_bytes(4, "little")
    if gap_before_meta:
        out[target:target] = bytes(8)
        _put_word(out, meta_ptr, _word(raw, meta_ptr) + (1 << 2))
    else:
        out += bytes(8)
    return bytes(out)


def test_same_first_words_different_meta_pointer_uses_the_fallback():
    spec = SPECS[1]
    a = codec.encode_header(spec, sequence=1, generation=2, writer_pid=1, domain="control",
                            publish_ts_ns=5, crc32=None, frame_id=111, capture_ts_ns=4,
                            exposure_us=10, gain=None)
    b = codec.encode_header(spec, sequence=8, generation=9, writer_pid=1, domain="control",
                            publish_ts_ns=50, crc32=None, frame_id=222, capture_ts_ns=40,
                            exposure_us=None, gain=0.5)
    at_end, moved = _moved_meta(a, False), _moved_meta(b, True)
    assert at_end[:16] == moved[:16] and at_end != moved
    H._compiled.clear()
    assert _all_decodes_agree(at_end, spec)[1].frame_id == 111       # compiles at_end
    # moved has at_end's key but another FrameMeta pointer: no stale plan is used.
    stamp = codec.decode_header(moved, spec)
    assert (stamp.sequence, stamp.frame_id, stamp.exposure_us, stamp.gain) == (8, 222, None, 0.5)
    assert stamp == codec.decode_header(moved, spec, fast=False)
    for _ in range(2):
        assert _all_decodes_agree(moved, spec)[1].frame_id == 222
        assert _all_decodes_agree(at_end, spec)[1].frame_id == 111


def test_truncated_message_with_a_compiled_structure_is_rejected_as_before():
    spec = SPECS[1]
    raw = codec.encode_header(spec, sequence=1, generation=2, writer_pid=1, domain="control",
                              publish_ts_ns=5, crc32=None, frame_id=3, capture_ts_ns=4)
    _all_decodes_agree(raw, spec)
    for n in (len(raw) - 1, 40, 17, 16, 8):
        assert _all_decodes_agree(raw[:n], spec, compiled=False)[0] == "MalformedHeader"
    kind, _ = _outcome(codec.decode_header, raw + b"\x00" * 8, spec)   # longer: fine
    assert kind == "ok"


def test_overlapping_structs_are_never_compiled_into_one_read():
    """A hostile header whose FrameMeta pointer points back into the root struct."""
    spec = SPECS[1]
    raw = bytearray(codec.encode_header(spec, sequence=1, generation=2, writer_pid=1,
                                        domain="control", publish_ts_ns=5, crc32=None,
                                        frame_id=3, capture_ts_ns=4))
    root = _word(raw, 8)
    dwords = (root >> 32) & 0xFFFF
    meta_ptr = 16 + dwords * 8 + H.meta_ptr * 8
    # Back to the root's data section: FrameMeta's fields land on the root's.
    back = (meta_ptr + 8 - 16) // 8
    _put_word(raw, meta_ptr, (((-back) & 0x3FFFFFFF) << 2) | (4 << 32))
    raw = bytes(raw)
    H._compiled.clear()
    slow = _outcome(codec.decode_header, raw, spec, fast=False)
    fields = _outcome(H._decode_fields, raw, spec)
    for _ in range(3):
        fast = _outcome(codec.decode_header, raw, spec)
        _same(fast, fields)
        _same(fast, slow)                      # accepted or rejected: pycapnp's answer
    c = H._compiled.get(raw[:16])
    assert c is None or not c.has_meta       # overlap: the meta part was not compiled


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), frame=st.booleans())
def test_mutations_behind_a_compiled_structure(data, frame):
    """Random bytes past the first 16 (the compiled key) never make the compiled decode
    disagree with pycapnp's reading."""
    spec = SPECS[1] if frame else SPECS[0]
    raw = bytearray(codec.encode_header(spec, sequence=5, generation=8, writer_pid=3,
                                        domain="control", publish_ts_ns=123, crc32=9,
                                        frame_id=9 if frame else None, capture_ts_ns=100,
                                        exposure_us=33, gain=1.5))
    codec.decode_header(bytes(raw), spec)        # compiles this structure
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(16, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(16, len(raw)))]
    raw = bytes(raw)
    for s in SPECS:
        slow = _outcome(codec.decode_header, raw, s, fast=False)
        fields = _outcome(H._decode_fields, raw, s)
        fast = _outcome(codec.decode_header, raw, s)
        _same(fast, fields)                    # compiled or not: the per-field reading
        _same(fast, slow)                      # and pycapnp's: "fast accepts, pycapnp
                                               # rejects" (or the reverse) fails here
        native = native_verdict(raw, s)
        if native is not None:
            _same(("ok", native), slow)


def test_compiled_cache_is_bounded():
    spec = SPECS[0]
    raw = bytearray(codec.encode_header(spec, sequence=5, generation=8, writer_pid=3,
                                        domain="control", publish_ts_ns=123, crc32=None))
    for extra in range(100):   # a longer segment each time: a new structure key
        longer = bytearray(raw) + bytes(8 * extra)
        longer[4:8] = (int.from_bytes(raw[4:8], "little") + extra).to_bytes(4, "little")
        codec.decode_header(bytes(longer), spec)
        assert len(H._compiled) <= _MAX_COMPILED


# ------------------------------------------------------- writer and reader


@pytest.fixture
def pair(make_channel):
    def make(**kw):
        kw.setdefault("max_readers", 1)
        ch = make_channel(**kw)
        return Writer(ch.writer_handle(), domain="control"), Reader(ch.reader_handle(0))
    return make


def test_writer_stores_last_slot_and_header_matches_pycapnp(pair):
    w, r = pair(kind="frame", slot_size=64 * 64, slot_count=3)
    for i in range(7):
        stamp = dict(frame_id=i + 1, capture_ts_ns=time.monotonic_ns(),
                     exposure_us=i or None, gain=0.25 if i % 2 else None)
        with w.loan() as loan:
            loan.frame("gray8", 64, 64)[0][...] = i
            slot = loan.slot
            seq = loan.publish(**stamp)
        last_seq, last_slot = L.LAST.unpack_from(w._buf, L.OFF_LAST_SEQ)
        assert (last_seq, last_slot) == (seq, slot)
        gen, cseq, ts, hlen, llen = L.CONTROL.unpack_from(w._buf, L.control_offset(slot))
        assert cseq == seq and not gen & 1
        base = w._geo.header[slot]
        assert bytes(w._buf[base:base + hlen]) == codec.encode_header(
            w.spec, sequence=seq, generation=gen, writer_pid=w._pid, domain="control",
            publish_ts_ns=ts, crc32=None, **stamp)
        with r.receive(timeout=1) as msg:
            assert msg.sequence == seq and msg.frame.frame_id == i + 1
            assert msg.publish_ts_ns == ts and msg.array[0, 0] == i


def test_a_wrong_last_slot_hint_only_costs_a_scan(pair):
    w, r = pair(slot_count=4)
    # Forged messages do not update last_slot, so the hint names an older slot.
    w.publish_array(np.full(4, 1, np.uint8))
    with r.receive(timeout=1) as msg:
        assert msg.array[0] == 1
    good = codec.encode_layout(np.dtype("uint8"), (4,), (1,), 0, None)
    for k in range(3):
        seq = w._last_seq + 1
        slot = w._choose(w._protected(time.monotonic_ns()))     # the one forge loans
        hdr = codec.encode_header(w.spec, sequence=seq, generation=w._gen[slot] + 2,
                                  writer_pid=1, domain="control",
                                  publish_ts_ns=time.monotonic_ns(), crc32=None)
        forge(w, hdr, good, payload=bytes([10 + k] * 4))
        with r.receive(timeout=1) as msg:
            assert (msg.sequence, msg.array[0]) == (seq, 10 + k)
    # A hint out of range, or naming a slot that holds another sequence, is ignored.
    for bogus in (999, 2**32 - 1):
        w.publish_array(np.full(4, 5, np.uint8))
        w._buf[L.OFF_LAST_SLOT:L.OFF_LAST_SLOT + 4] = bogus.to_bytes(4, "little")
        with r.receive(timeout=1) as msg:
            assert msg.array[0] == 5
    a = w.publish_array(np.full(4, 6, np.uint8))
    b = w.publish_array(np.full(4, 7, np.uint8))      # hint: b's slot; a comes first
    with r.receive(timeout=1) as msg:
        assert (msg.sequence, msg.array[0]) == (a, 6)
    with r.receive(timeout=1) as msg:
        assert (msg.sequence, msg.array[0]) == (b, 7)
    assert r.stats.dropped == 0 and r.stats.rejected == {}


def test_deferred_eventfd_read_loses_no_wakeup_and_does_not_spin(pair):
    w, r = pair()
    for i in range(5):
        w.publish_array(np.full(4, i, np.uint8))
        with r.receive(timeout=1) as msg:
            assert msg.array[0] == i
    t0, cpu0 = time.monotonic(), time.process_time()
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    assert time.process_time() - cpu0 < 0.025     # it slept on the eventfd, no spinning
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0)
    # Two published while not receiving: both delivered, in order, then nothing.
    x, y = (w.publish_array(np.full(4, v, np.uint8)) for v in (8, 9))
    for want in (x, y):
        with r.receive(timeout=1) as msg:
            assert msg.sequence == want
    with pytest.raises(ChannelTimeout):
        r.receive(timeout=0.02)
    # A message published while the reader sleeps wakes it.
    import threading

    t = threading.Timer(0.05, lambda: w.publish_array(np.full(4, 1, np.uint8)))
    t.start()
    with r.receive(timeout=2) as msg:
        assert msg.array[0] == 1
    t.join()


def test_cached_views_are_fresh_read_only_arrays(pair):
    w, r = pair(slot_count=3, slot_size=256)
    seen = []
    for i, shape in enumerate([(16,), (16,), (4, 4), (16,), (2, 8), (16,), (16,)]):
        with w.loan() as loan:
            loan.array(shape, "uint8")[...] = i
            loan.publish()
        with r.receive(timeout=1) as msg:
            a = msg.array
            assert a is msg.array                      # one view per message
            assert a.shape == shape and (a == i).all() and not a.flags.writeable
            with pytest.raises(ValueError):
                a.flags.writeable = True
            with pytest.raises(ValueError):
                a[...] = 0
            a.shape = (a.size,)                        # the caller's own view only
            seen.append(a)
    assert all(v.shape == (16,) for v in seen)


def test_writer_plane_views_are_fresh_each_loan(pair):
    w, r = pair(kind="frame", slot_size=64 * 48 * 3 // 2, slot_count=3)
    for i in range(8):
        with w.loan() as loan:
            y, uv = loan.frame("nv12", 64, 48)
            assert y.shape == (48, 64) and uv.shape == (24, 32, 2)
            assert y.flags.writeable and uv.strides == (64, 2, 1)
            y[...], uv[...] = i, 100 + i
            y.shape = (y.size,)          # the caller's own view: the next loan's is fresh
            loan.publish(frame_id=i + 1, capture_ts_ns=time.monotonic_ns())
        with r.receive(timeout=1) as msg:
            py, puv = msg.planes()
            assert (py == i).all() and (puv == 100 + i).all()


def test_failed_publish_returns_the_slot(pair):
    w, r = pair(kind="frame", slot_size=64 * 64, slot_count=3)
    with w.loan() as loan:
        loan.frame("gray8", 64, 64)
        with pytest.raises(struct.error):
            loan.publish(frame_id=1, capture_ts_ns=1, exposure_us=-5)   # not a UInt32
    assert not w._loaned and w.last_sequence == 0
    with w.loan() as loan:
        loan.frame("gray8", 64, 64)[0][...] = 3
        seq = loan.publish(frame_id=2, capture_ts_ns=time.monotonic_ns())
    with r.receive(timeout=1) as msg:
        assert msg.sequence == seq == 1 and msg.array[0, 0] == 3
    with pytest.raises(BridgeError):
        loan.publish(frame_id=3, capture_ts_ns=1)


@pytest.mark.parametrize("extra", [1, 3, 7, 9])
def test_header_of_partial_words_is_refused_as_by_pycapnp(extra):
    """pycapnp refuses a flat message that is not whole 8-byte words; the compiled
    decode (first and compiled reading), the receipt reading and the native check must
    not accept it either (a writer sets the header length in the control block)."""
    for spec, frame in ((SPECS[0], None), (SPECS[1], 9)):
        good = codec.encode_header(spec, sequence=5, generation=8, writer_pid=3,
                                   domain="control", publish_ts_ns=123, crc32=None,
                                   frame_id=frame, capture_ts_ns=100, exposure_us=None,
                                   gain=None)
        raw = good + bytes(extra)
        H._compiled.clear()
        slow = _outcome(codec.decode_header, raw, spec, fast=False)
        assert slow[0] == "MalformedHeader"
        assert _outcome(codec.decode_header, raw, spec)[0] == "MalformedHeader"   # first
        codec.decode_header(good, spec)                          # compile the structure
        assert _outcome(codec.decode_header, raw, spec)[0] == "MalformedHeader"   # compiled
        assert native_verdict(raw, spec) is None and native_verdict(good, spec) is not None
        assert H.receipt_capture(raw) is codec.SLOW
