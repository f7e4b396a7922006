"""The compiled receipt paths read and write exactly what pycapnp does.

* A SlotHeader with a Receipt written by the compiled plan (one per device, sha256,
  crc?, frame?) is byte for byte pycapnp's encoding.
* The compiled Receipt decode gives pycapnp's answer (the same Receipt, None, or a
  MalformedHeader) for plain messages, mutated ones and unusual layouts, and hands what
  it does not handle plainly to pycapnp.
* Writer and Reader use them end to end; values the compiled writer cannot pack go to
  pycapnp, which raises what it always raised.
"""
from __future__ import annotations

import struct

import capnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from supervisor.ipc import ChannelSpec, Reader, Rejected, Writer, codec, layout as L
from supervisor.ipc import _atomics, _capnp_fast as cf, receipt as receipt_codec
from supervisor.ipc._message import UNREAD
from supervisor.ipc.receipt import COMPLETION_POINTS, Receipt

H = codec.HEADER
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
GAIN = st.floats(width=32, allow_nan=False)
DOMAINS = st.sampled_from(["unknown", "control", "research", "supervisor"])
SPEC = ChannelSpec(name="m", slot_size=64, crc=True, channel_id=3)
FAST = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

receipts = st.builds(
    Receipt, frame_id=U64, capture_ts_ns=U64, infer_start_ns=U64, infer_end_ns=U64,
    device=st.text(max_size=80), bytes_in=U64, bytes_out=U64,
    completion=st.sampled_from(COMPLETION_POINTS), latency_ns=U64, worst_case_ns=U64,
    deadline_ns=U64, deadline_misses=U64, artifact_sha256=st.binary(max_size=80),
    kernels_run=U32)

header_values = st.fixed_dictionaries({
    "sequence": U64, "generation": U64, "writer_pid": U32, "domain": DOMAINS,
    "publish_ts_ns": U64, "crc32": st.none() | U32, "frame_id": st.none() | U64,
    "capture_ts_ns": st.none() | U64, "exposure_us": st.none() | U32,
    "gain": st.none() | GAIN})


def _outcome(raw: bytes, *, fast: bool):
    try:
        return "ok", codec.decode_receipt(raw, SPEC, 1, fast=fast)
    except Rejected as e:
        return type(e).__name__, None


def _native(raw: bytes):
    """The native reading (the one the reader's take runs), or SLOW without it."""
    return codec.native_receipt(raw) if _atomics.NATIVE is not None else codec.SLOW


def _agree(raw: bytes):
    slow = _outcome(raw, fast=False)
    assert _outcome(raw, fast=True) == slow
    assert _outcome(raw, fast=True) == slow       # again, from the compiled structure
    n = _native(raw)
    if n is not codec.SLOW:                        # it answers only what pycapnp accepts
        assert slow == ("ok", n)
    return slow


def _encode(v: dict, r: Receipt) -> bytes:
    return codec.encode_header(SPEC, receipt=r, **v)


def _plan(v: dict, r: Receipt):
    return H.plan_receipt(SPEC, v["writer_pid"], v["domain"], v["crc32"] is not None,
                          v["frame_id"] is not None, r.device, r.artifact_sha256)


def _pack(plan, v: dict, r: Receipt) -> bytes:
    return plan.pack(v["sequence"], v["generation"], v["publish_ts_ns"], v["crc32"],
                     v["frame_id"], v["capture_ts_ns"], v["exposure_us"], v["gain"], r)


@FAST
@given(v=header_values, r=receipts)
def test_compiled_receipt_encode_equals_pycapnp(v, r):
    # Every value drawn lies in its field's range (a NUL inside the device text
    # included): pycapnp encodes it, and the compiled plan must exist and agree.
    ref = _encode(v, r)
    plan = _plan(v, r)
    got = _pack(plan, v, r)
    assert got == ref                                   # byte for byte
    assert struct.unpack_from("<Q", got, plan.ts_pos)[0] == v["publish_ts_ns"]
    buf = bytearray(len(ref) + 16)
    plan.pack_into(buf, 8, v["sequence"], v["generation"], v["publish_ts_ns"], v["crc32"],
                   v["frame_id"], v["capture_ts_ns"], v["exposure_us"], v["gain"], r)
    assert bytes(buf[8:8 + len(ref)]) == ref
    assert plan.native is not None                      # the native writer: the same bytes
    assert plan.pack_native_bytes(v["sequence"], v["generation"], v["publish_ts_ns"],
                                  v["crc32"], v["frame_id"], v["capture_ts_ns"],
                                  v["exposure_us"], v["gain"], r) == ref


# Receipt scalars and their capnp widths: a value outside them is refused.
_R_WIDTH = {"frame_id": 64, "capture_ts_ns": 64, "infer_start_ns": 64, "infer_end_ns": 64,
            "bytes_in": 64, "bytes_out": 64, "latency_ns": 64, "worst_case_ns": 64,
            "deadline_ns": 64, "deadline_misses": 64, "kernels_run": 32}


@FAST
@given(v=header_values, r=receipts, field=st.sampled_from(sorted(_R_WIDTH)), data=st.data())
def test_out_of_range_receipt_values_are_refused_by_both(v, r, field, data):
    """pycapnp refuses a receipt value outside its field's width; the compiled plan
    (made per device and sha256, so it exists) refuses it too, never writing bytes
    that wrapped around: the Writer then lets pycapnp raise (next test)."""
    top = 2 ** _R_WIDTH[field]
    bad = data.draw(st.integers(max_value=-1) | st.integers(min_value=top, max_value=top * 4))
    r = r._replace(**{field: bad})
    with pytest.raises((capnp.KjException, OverflowError)):
        _encode(v, r)
    plan = _plan(v, r)
    with pytest.raises((struct.error, OverflowError)):
        _pack(plan, v, r)
    # The native writer declines (None) and the Writer lets pycapnp raise.
    assert plan.pack_native_bytes(v["sequence"], v["generation"], v["publish_ts_ns"],
                                  v["crc32"], v["frame_id"], v["capture_ts_ns"],
                                  v["exposure_us"], v["gain"], r) is None


@FAST
@given(v=header_values, r=receipts)
def test_compiled_receipt_decode_equals_pycapnp(v, r):
    raw = _encode(v, r)                                 # in range: pycapnp encodes it
    kind, got = _agree(raw)
    assert kind == "ok"
    assert H.receipt(raw) is not codec.SLOW or "\0" in r.device   # the compiled path ran
    if _atomics.NATIVE is not None:                      # and so did the native one
        assert _native(raw) is not codec.SLOW or "\0" in r.device
    assert got == r._replace(device=r.device[:64], artifact_sha256=r.artifact_sha256[:64])


@FAST
@given(v=header_values, r=receipts, data=st.data())
def test_mutated_headers_decode_as_pycapnp(v, r, data):
    raw = bytearray(_encode(v, r))
    assert _agree(bytes(raw))[0] == "ok"                # compile the plain structure
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.none() | st.integers(0, len(raw)))
    _agree(bytes(raw[:cut]) if cut is not None else bytes(raw))


@FAST
@given(r=receipts, shrink=st.integers(1, 15), grow=st.integers(0, 2))
def test_other_receipt_struct_sizes_go_to_pycapnp(r, shrink, grow):
    """A receipt pointer announcing a shorter (older) or a different data section."""
    v = dict(sequence=1, generation=2, writer_pid=3, domain="control", publish_ts_ns=4,
             crc32=5, frame_id=None, capture_ts_ns=None)
    raw = bytearray(_encode(v, r))
    m = cf.Message(bytes(raw))
    pos = m.root.ptrs + H.receipt_ptr * 8
    word = struct.unpack_from("<Q", raw, pos)[0]
    dwords = (word >> 32) & 0xFFFF
    new = max(dwords - shrink, 0) + grow
    struct.pack_into("<Q", raw, pos, (word & ~(0xFFFF << 32)) | (new << 32))
    _agree(bytes(raw))


def test_receipt_built_in_another_order_decodes_the_same():
    """pycapnp allocating the receipt before the FrameMeta (another layout)."""
    r = Receipt(1, 2, 3, 4, "GPU:0", 5, 6, "deviceQueued", 7, 8, 9, 10, b"\x01" * 32, 11)
    msg = codec.SlotHeader.new_message(schemaVersion=1, channelId=3, sequence=1,
                                       generation=2, writerPid=3, publishTsNs=4)
    receipt_codec.fill(msg.init("receipt"), r)
    msg.payloadCrc.crc32 = 5
    meta = msg.frame.init("meta")
    meta.frameId = 9
    raw = msg.to_bytes()
    assert raw != _encode(dict(sequence=1, generation=2, writer_pid=3, domain="unknown",
                               publish_ts_ns=4, crc32=5, frame_id=9, capture_ts_ns=0), r)
    assert _agree(raw) == ("ok", r)


def test_no_receipt_and_null_lists():
    v = dict(sequence=1, generation=2, writer_pid=3, domain="control", publish_ts_ns=4,
             crc32=5)
    assert _agree(codec.encode_header(SPEC, **v)) == ("ok", None)
    r = Receipt(1, 2, 3, 4, "", 5, 6, "unknown")
    msg = codec.SlotHeader.new_message(schemaVersion=1, channelId=3)
    rc = msg.init("receipt")
    rc.frameId = 1          # device and artifactSha256 never set: null pointers
    raw = msg.to_bytes()
    assert _agree(raw) == ("ok", Receipt(1, 0, 0, 0, "", 0, 0, "unknown"))
    assert H.receipt(raw) is not codec.SLOW
    assert _agree(_encode(dict(v, sequence=9), r))[0] == "ok"


def test_unusual_messages_fall_back_to_pycapnp():
    r = Receipt(1, 2, 3, 4, "CPU", 5, 6, "hostVisible", artifact_sha256=b"\xaa" * 32)
    raw = _encode(dict(sequence=1, generation=2, writer_pid=3, domain="control",
                       publish_ts_ns=4, crc32=5), r)
    # Two segments in the table: not handled here; pycapnp decides (and rejects).
    two = struct.pack("<II", 1, struct.unpack_from("<I", raw, 4)[0]) + raw[8:]
    assert H.receipt(two) is codec.SLOW
    assert _native(two) is codec.SLOW
    _agree(two)
    # An unknown completion value: pycapnp decides.
    m = cf.Message(raw)
    rc = m.struct_at(m.root.ptrs + H.receipt_ptr * 8)
    odd = bytearray(raw)
    struct.pack_into("<H", odd, rc.at(H.r_scalars[-1]), 7)
    assert H.receipt(bytes(odd)) is codec.SLOW
    assert _native(bytes(odd)) is codec.SLOW
    _agree(bytes(odd))
    # Text without its NUL, or invalid UTF-8: pycapnp decides.
    for patch in (b"CPU\x01", b"\xff\xfe\x00"[:3] + b"\x00"):
        bad = bytearray(raw)
        i = bytes(bad).index(b"CPU\x00")
        bad[i:i + 4] = patch
        assert H.receipt(bytes(bad)) is codec.SLOW
        assert _native(bytes(bad)) is codec.SLOW
        _agree(bytes(bad))


@pytest.fixture
def channel(make_channel):
    return make_channel(name="model_out", dtype="float32", slot_size=4096, slot_count=8,
                        crc=True)


def test_writer_and_reader_use_the_compiled_receipt_paths(channel):
    w = Writer(channel.writer_handle())
    rd = Reader(channel.reader_handle(0))
    for i in range(1, 6):
        r = Receipt(i, 10 + i, 20 + i, 30 + i, "CPU", 4096, 16, "hostVisible", 10, 11,
                    50_000_000, 0, b"\x5a" * 32, 12)
        w.publish_array(np.arange(4, dtype=np.float32) + i, frame_id=i,
                        capture_ts_ns=5, receipt=r)
        with rd.receive(timeout=1) as m:
            # The native take read the Receipt with the header; else it is read on demand.
            assert (m._receipt is not UNREAD) == (rd.native and i > 1), (i, m._receipt)
            raw = m._raw_header
            ref = codec.encode_header(rd.spec, sequence=m.sequence,
                                      generation=m._gen, writer_pid=w._pid,
                                      domain="unknown", publish_ts_ns=m.publish_ts_ns,
                                      crc32=m.stamp.crc32, frame_id=i, capture_ts_ns=5,
                                      receipt=r)
            assert raw == ref                            # what pycapnp would have written
            assert m.receipt == r and m.receipt is m.receipt   # decoded once
            assert H.receipt(raw) == r
            assert list(m.array) == [i, i + 1, i + 2, i + 3]
    assert w._receipt_plans                               # the compiled writer ran


def test_the_native_writer_writes_receipt_headers_itself(channel, monkeypatch):
    """After the first publish of a stream (layout cached), a header with a receipt is
    written by the native plan: Python's encoder is not called, and the bytes are
    still pycapnp's."""
    w = Writer(channel.writer_handle())
    if not w.native:
        pytest.skip("no native module on this machine")
    rd = Reader(channel.reader_handle(0))
    r = Receipt(1, 2, 3, 4, "CPU", 4096, 16, "hostVisible", 10, 11, 50_000_000, 0,
                b"\x5a" * 32, 12)
    w.publish_array(np.zeros(4, np.float32), frame_id=1, capture_ts_ns=2, receipt=r)
    rd.receive(timeout=1).release()

    def encode(*a, **k):
        raise AssertionError("the Python encoder ran")

    monkeypatch.setattr(w, "_encode", encode)
    for i in range(2, 5):
        ri = r._replace(frame_id=i, latency_ns=i * 1000,
                                 completion="deviceQueued" if i % 2 else "hostVisible")
        w.publish_array(np.full(4, i, np.float32), frame_id=i, capture_ts_ns=2, receipt=ri)
        with rd.receive(timeout=1) as m:
            assert m.receipt == ri and list(m.array) == [i] * 4
            assert m._raw_header == codec.encode_header(
                rd.spec, sequence=m.sequence, generation=m._gen, writer_pid=w._pid,
                domain="unknown", publish_ts_ns=m.publish_ts_ns, crc32=m.stamp.crc32,
                frame_id=i, capture_ts_ns=2, receipt=ri)


def test_writer_falls_back_to_pycapnp_for_values_it_cannot_pack(channel):
    w = Writer(channel.writer_handle())
    bad = Receipt(-1, 0, 0, 0, "CPU", 0, 0)
    with pytest.raises(Exception) as want:
        codec.encode_header(w.spec, sequence=1, generation=1, writer_pid=1,
                            domain="unknown", publish_ts_ns=1, crc32=0, receipt=bad)
    with pytest.raises(want.type):
        w.publish_array(np.zeros(4, np.float32), receipt=bad)
    assert w.stats.loans_discarded == 1
    huge = Receipt(0, 0, 0, 0, "x" * 3000, 0, 0)          # header over HEADER_MAX
    with pytest.raises(Exception, match="bytes >"):
        w.publish_array(np.zeros(4, np.float32), receipt=huge)
    assert L.HEADER_MAX < 3000


def _reader_verdict(raw: bytes, spec: ChannelSpec, now: int):
    """What Reader._accept decides for a header whose sequence and generation match
    the control block, read at ``now`` (first capture, no age limit): the Stamp, or
    the Rejected it raises; and whether the compiled receipt path answered."""
    try:
        stamp = codec.decode_header(raw, spec)
        latest = now + 5_000_000
        if stamp.publish_ts_ns > latest:
            raise Rejected(spec.name, "future publish")
        if stamp.capture_ts_ns is not None and (stamp.capture_ts_ns > latest
                                                or stamp.capture_ts_ns > stamp.publish_ts_ns):
            raise Rejected(spec.name, "capture")
        rc = H.receipt_capture(raw)
        compiled = rc is not codec.SLOW
        if not compiled:
            try:
                r = codec.decode_receipt(raw, spec, stamp.sequence, fast=False)
                rc = None if r is None else r.capture_ts_ns
            except Rejected:
                rc = None
        if rc is not None and rc > latest:
            raise Rejected(spec.name, "future receipt capture")
        return stamp, compiled
    except Rejected as e:
        return e, True


@FAST
@given(v=header_values, r=receipts, early=st.booleans(), data=st.data())
def test_native_check_of_receipt_headers_agrees_with_the_reader(v, r, early, data):
    """The native reader's check (`_native.accept`) on headers with a Receipt: it never
    accepts what the reader's Python checks reject (a receipt captured in the future
    included), and it takes every plain one they accept."""
    spec = ChannelSpec(name="m", slot_size=64, crc=v["crc32"] is not None, channel_id=3,
                       kind="frame" if v["frame_id"] is not None else "tensor")
    if early:     # a receipt captured before publishing, as an honest writer's is
        r = r._replace(capture_ts_ns=data.draw(st.integers(0, v["publish_ts_ns"])))
    raw = _encode(v, r)
    want, compiled = _reader_verdict(raw, spec, v["publish_ts_ns"])     # compiles too
    got = codec.native_accept(raw, spec, v["sequence"], v["generation"],
                              v["publish_ts_ns"], 0, max_age_ns=0)
    if got is not None:
        assert got == want                      # accepted by both, the same Stamp
    elif not isinstance(want, Rejected) and compiled and v["publish_ts_ns"] < 2**63:
        raise AssertionError(f"native check deferred a header the reader accepts: {want}")


class _HashRaises(str):
    exc: type[BaseException] = ValueError

    def __hash__(self):
        raise self.exc("from device.__hash__")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_a_receipt_that_raises_gives_its_slot_back(channel, native, exc):
    """Review: the native writer looked up the receipt plan outside the discard guard;
    a receipt whose device raised there left its slot loaned (odd) for good, and after
    slot_count of them the channel refused every publish."""
    w = Writer(channel.writer_handle(), native=native)
    good = Receipt(1, 2, 3, 4, "CPU", 4096, 16, "hostVisible", 10, 11, 50_000_000, 0,
                   b"\x5a" * 32, 12)
    w.publish_array(np.zeros(4, np.float32), frame_id=1, capture_ts_ns=2, receipt=good)
    dev = type("Dev", (_HashRaises,), {"exc": exc})("CPU")
    bad = good._replace(device=dev)
    for i in range(channel.spec.slot_count + 1):
        with pytest.raises(exc):
            w.publish_array(np.zeros(4, np.float32), frame_id=2 + i, capture_ts_ns=3,
                            receipt=bad)
    assert w.stats.loans_discarded == channel.spec.slot_count + 1 and not w._loaned
    w.publish_array(np.zeros(4, np.float32), frame_id=99, capture_ts_ns=100, receipt=good)


@pytest.mark.parametrize("native", [True, False])
def test_a_receipt_with_no_such_completion_point_is_refused_in_one_line(channel, native):
    """Receipt is a NamedTuple (built per output, cold): its completion point is checked
    where it is encoded. The publish fails with a ValueError naming it, the slot goes
    back, and the writer publishes on."""
    w = Writer(channel.writer_handle(), native=native)
    bad = Receipt(1, 2, 3, 4, "CPU", 4096, 16, "done")
    with pytest.raises(ValueError, match=r"^receipt completion 'done' not in \(") as e:
        w.publish_array(np.zeros(4, np.float32), frame_id=1, capture_ts_ns=2, receipt=bad)
    assert "\n" not in str(e.value)
    assert w.stats.loans_discarded == 1 and not w._loaned
    w.publish_array(np.zeros(4, np.float32), frame_id=2, capture_ts_ns=3,
                    receipt=bad._replace(completion="hostVisible"))
    assert w.stats.published == 1
