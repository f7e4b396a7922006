"""Fuzzing the reader's decoders: every input is a valid message or a typed rejection."""
from __future__ import annotations

import os

import time

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from supervisor.ipc import (ChannelSpec, FrameFormat, PlaneInfo, Reader, Rejected, Writer,
                            codec)

from .forge import forge

TENSOR = ChannelSpec(name="fuzz", slot_size=4096, dtype="float32", max_readers=1)
FRAME = ChannelSpec(name="fuzzf", slot_size=64 * 64 * 3, kind="frame", max_readers=1)
# FUZZ_EXAMPLES raises the count for the long run (bench/fuzz.sh: 100,000 each).
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "1500")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _valid_header(spec, **kw) -> bytes:
    return codec.encode_header(spec, sequence=kw.get("seq", 5), generation=8, writer_pid=3,
                               domain="control", publish_ts_ns=123, crc32=kw.get("crc"),
                               frame_id=kw.get("frame_id"), capture_ts_ns=100,
                               exposure_us=kw.get("exposure"), gain=kw.get("gain"))


HEADERS = [_valid_header(TENSOR), _valid_header(FRAME, frame_id=9, exposure=33, gain=1.5),
           _valid_header(TENSOR, crc=77)]
LAYOUTS = [codec.encode_layout(np.dtype("float32"), (16, 8), (32, 4), 0, None),
           codec.encode_layout(np.dtype("uint8"), (64, 64, 3), (192, 3, 1), 0,
                               FrameFormat("road", "rgb888", "full", 64, 64,
                                           (PlaneInfo(0, 192, 64, 64, 3),)))]


def _mutate(data: st.DataObject, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        b = b[:data.draw(st.integers(0, len(b)))]
    return bytes(b)


def _check_layout(raw: bytes, spec: ChannelSpec) -> None:
    try:
        lay = codec.decode_layout(raw, spec, spec.slot_size)
    except Rejected:
        return
    # Accepted: a view with these parameters must fit in the slot, so numpy agrees.
    buf = bytearray(spec.slot_size)
    a = np.ndarray(lay.shape, lay.dtype, buffer=buf, offset=lay.offset, strides=lay.strides)
    assert a.nbytes <= spec.slot_size        # no view larger than the slot, ever


def _header_outcome(raw: bytes, spec: ChannelSpec, *, fast: bool):
    try:
        return "ok", codec.decode_header(raw, spec, fast=fast)
    except Rejected as e:
        return type(e).__name__, None


def _check_header(raw: bytes, spec: ChannelSpec) -> None:
    """The compiled decoder is a shortcut, never a different judge: it rejects whatever
    pycapnp's reference rejects (with the same typed rejection), and when the reference
    accepts, it accepts with the same values. Asked twice, so the second answer comes
    from the structure the first one compiled."""
    slow = _header_outcome(raw, spec, fast=False)
    for _ in range(2):
        fast = _header_outcome(raw, spec, fast=True)
        assert _same(fast, slow), f"fast {fast} != reference {slow} for {raw.hex()}"
    native = _native_verdict(raw, spec)
    if native is not None:    # the native reader's check never accepts more, or otherwise
        assert _same(("ok", native), slow), f"native {native} != reference {slow} for {raw.hex()}"


def _same(a, b) -> bool:
    """Equal, a NaN equal to a NaN (a header's gain may be one: a tuple holding two
    NaNs that are not the same object compared unequal)."""
    return repr(a) == repr(b)


def _native_verdict(raw: bytes, spec: ChannelSpec):
    """`_native.accept` asked with the sequence, generation and clock the header itself
    holds (what makes every reader check pass if the bytes are right); None: defers."""
    c = codec.HEADER._compiled.get(raw[:16])
    if c is None or not c.native:
        return None
    pos = c.native[4::2]

    def u64(i: int) -> int:
        return int.from_bytes(raw[pos[i]:pos[i] + 8].ljust(8, b"\0"), "little")
    return codec.native_accept(raw, spec, u64(2), u64(3), u64(7), 0, max_age_ns=0)


@FUZZ
@given(raw=st.binary(max_size=400))
def test_random_bytes(raw):
    _check_layout(raw, TENSOR)
    _check_layout(raw, FRAME)
    _check_header(raw, TENSOR)
    _check_header(raw, FRAME)


@FUZZ
@given(data=st.data(), which=st.integers(0, 5))
def test_mutated_valid_messages(data, which):
    if which < 3:
        raw = _mutate(data, HEADERS[which])
        _check_header(raw, TENSOR)
        _check_header(raw, FRAME)
    else:
        raw = _mutate(data, LAYOUTS[which % 2])
        _check_layout(raw, TENSOR)
        _check_layout(raw, FRAME)


I64 = st.integers(-(2**63), 2**63 - 1)
U64 = st.integers(0, 2**64 - 1)


@FUZZ
@given(code=st.integers(0, 6), bits=st.sampled_from([0, 1, 8, 16, 32, 64, 128, 255]),
       lanes=st.integers(0, 4), shape=st.lists(U64 | st.integers(0, 70), max_size=10),
       strides=st.lists(I64 | st.integers(-70, 70), max_size=10), offset=U64 | st.integers(0, 5000),
       nbytes=U64 | st.integers(0, 5000), device=st.integers(0, 8))
def test_structured_descriptors(code, bits, lanes, shape, strides, offset, nbytes, device):
    msg = codec.SlotLayout.new_message(schemaVersion=1)
    t = msg.init("tensor")
    t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, lanes
    t.shape, t.strides, t.byteOffset, t.nbytes = shape, strides, offset, nbytes
    t.device.type = device
    _check_layout(msg.to_bytes(), TENSOR)


@FUZZ
@given(pix=st.integers(0, 4), width=st.integers(0, 20000), height=st.integers(0, 100),
       planes=st.lists(st.tuples(U64 | st.integers(0, 20000), st.integers(0, 2**32 - 1),
                                 st.integers(0, 200), st.integers(0, 200)), max_size=3))
def test_structured_frame_formats(pix, width, height, planes):
    msg = codec.SlotLayout.new_message(schemaVersion=1)
    t = msg.init("tensor")
    t.dtype.code, t.dtype.bits = "uint", 8
    t.shape, t.strides, t.nbytes = [16], [1], 16
    f = msg.frame.init("format")
    f.pixelFormat, f.width, f.height = pix, width, height
    pl = f.init("planes", len(planes))
    for dst, (o, s, w, h) in zip(pl, planes):
        dst.offset, dst.rowStride, dst.width, dst.height = o, s, w, h
    try:
        lay = codec.decode_layout(msg.to_bytes(), FRAME, FRAME.slot_size)
    except Rejected:
        return
    for p in lay.frame.planes:    # accepted planes lie inside the slot
        assert p.offset + p.row_stride * (p.height - 1) + p.width * p.bytes_per_sample <= FRAME.slot_size


@settings(max_examples=300, deadline=None)
@given(raw_h=st.binary(max_size=300), raw_l=st.binary(max_size=300), data=st.data())
def test_shared_memory_level_garbage_never_kills_the_reader(raw_h, raw_l, data):
    """Garbage straight into a live slot: the reader raises a typed rejection or
    returns a message, and then still receives the next good one."""
    from supervisor.ipc import Channel

    spec = ChannelSpec(name="garbage", slot_size=4096, slot_count=3, max_readers=1)
    with Channel.create(spec) as ch:
        w = Writer(ch.writer_handle())
        r = Reader(ch.reader_handle(0))
        if data.draw(st.booleans()):
            raw_h = _mutate(data, _valid_header(spec, seq=1))
        forge(w, raw_h, raw_l, ts=time.monotonic_ns())
        try:
            msg = r.try_receive()
            if msg is not None:
                msg.array
                msg.release()
        except Rejected:
            pass
        good = w.publish_array(np.arange(4, dtype=np.uint8))
        with r.receive(timeout=1) as msg:
            assert msg.sequence == good and msg.array.tolist() == [0, 1, 2, 3]
        w.close()
        r.close()
