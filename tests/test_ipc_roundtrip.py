"""Bit-exact round trips across real processes: frames of every format, strided tensors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from supervisor.ipc import Reader

from .ipc_peer import frame_pattern, pattern

FORMATS = [("nv12", 64, 48, None), ("nv12", 1928, 1208, None), ("nv12", 320, 240, 384),
           ("rgb888", 160, 120, None), ("rgb888", 100, 50, 320), ("bgr888", 64, 32, None),
           ("gray8", 200, 100, 256)]


@pytest.mark.parametrize("fmt,width,height,row_stride", FORMATS)
def test_frame_round_trip_each_pixel_format(make_channel, peers, fmt, width, height,
                                            row_stride):
    ch = make_channel(name="frames", slot_size=1928 * 1208 * 3 // 2, slot_count=3,
                      kind="frame", pixel_formats=(fmt,), max_readers=1)
    writer = peers("writer", ch.writer_handle())
    reader = Reader(ch.reader_handle(0))
    for seed in (1, 2):
        seq = writer.send(op="frame", format=fmt, width=width, height=height,
                          row_stride=row_stride, seed=seed, exposure_us=900 + seed)["seq"]
        with reader.receive(timeout=5) as msg:
            assert msg.sequence == seq
            info = msg.frame
            assert (info.pixel_format, info.width, info.height) == (fmt, width, height)
            assert info.frame_id == seed and info.exposure_us == 900 + seed
            assert info.row_strides[0] == (row_stride or width * (3 if "888" in fmt else 1))
            assert info.capture_ts_ns <= info.publish_ts_ns
            for got, want in zip(msg.planes(), frame_pattern(seed, fmt, width, height)):
                assert got.shape == want.shape
                assert np.array_equal(got, want)
                assert not got.flags.writeable
            # The whole-frame tensor is the same bytes: Y rows then UV rows for NV12.
            if fmt == "nv12" and row_stride is None:
                want = frame_pattern(seed, fmt, width, height)
                flat = np.concatenate([want[0], want[1].reshape(height // 2, width)])
                assert np.array_equal(msg.array, flat)
    assert reader.stats.rejected == {} and reader.stats.dropped == 0


DTYPES = ["uint8", "int16", "float32", "float64", "int64", "bool"]


@st.composite
def strided_views(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(1, 4))
    base = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    slices = []
    for n in base:
        step = draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
        start = draw(st.integers(0, n - 1))
        if step > 0:
            stop = draw(st.integers(start + 1, n))
        else:
            stop = draw(st.one_of(st.none(), st.integers(-1, start - 1))) if start else None
            if stop == -1:
                stop = None
        slices.append((start, stop, step))
    return dtype, base, slices, draw(st.booleans())


@pytest.fixture(scope="module")
def tensor_pipe(request):
    from supervisor.ipc import Channel, ChannelSpec

    from .conftest import Peer

    chans = {}
    peers = {}
    for dt in DTYPES:
        chans[dt] = Channel.create(ChannelSpec(name=f"t_{dt}", slot_size=1 << 16,
                                               slot_count=3, dtype=dt, max_readers=1))
        peers[dt] = Peer("writer", chans[dt].writer_handle())
    readers = {dt: Reader(chans[dt].reader_handle(0)) for dt in DTYPES}
    yield peers, readers
    for dt in DTYPES:
        peers[dt].close()
        chans[dt].close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=strided_views(), seed=st.integers(0, 2**31))
def test_strided_tensor_round_trip(tensor_pipe, case, seed):
    peers, readers = tensor_pipe
    dtype, base, slices, transpose = case
    expected_view = np.zeros(base, dtype)[tuple(slice(*s) for s in slices)]
    if transpose:
        expected_view = expected_view.T
    want = pattern(seed, expected_view.shape, dtype)
    seq = peers[dtype].send(op="tensor", dtype=dtype, base_shape=list(base), slices=slices,
                            transpose=transpose, seed=seed)["seq"]
    with readers[dtype].receive(timeout=5) as msg:
        assert msg.sequence == seq
        got = msg.array
        assert got.dtype == np.dtype(dtype)
        assert got.shape == want.shape
        assert got.strides == expected_view.strides      # the published strides, not a copy
        assert np.array_equal(got, want)
        # DLPack export of the read-only zero-copy view, where numpy allows it.
        try:
            via = np.from_dlpack(msg)
        except (BufferError, TypeError):
            pass
        else:
            assert np.array_equal(via, want)
