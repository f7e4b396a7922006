"""Schemas carry ids and versions; a reader built on v1 ignores fields a v2 writer adds."""
from __future__ import annotations

import functools
from pathlib import Path

import capnp
import numpy as np
import pytest

import schemas
from supervisor.ipc import ChannelSpec, codec


# The v2 copies need their own file ids: one process cannot load two files with one id.
_NEW_IDS = {"0xc312f74fa2c797a4": "0xd312f74fa2c797a4", "0xd4956f279458c639": "0xe4956f279458c639", "0xd10a9b86cc7d9501": "0xe10a9b86cc7d9501",
            "0xb35799bdb137f8a1": "0xc35799bdb137f8a1"}


def _copy(name: str, tmp_path: Path) -> str:
    text = (schemas.SCHEMA_DIR / name).read_text()
    for old, new in _NEW_IDS.items():
        text = text.replace(f"@{old};", f"@{new};")
    return text


@functools.cache
def _v2_cached(folder: str):
    return _v2(Path(folder))


def _v2(tmp_path: Path):
    for f in ("tensor.capnp", "frame.capnp", "receipt.capnp"):
        (tmp_path / f).write_text(_copy(f, tmp_path))
    text = _copy("slot.capnp", tmp_path)
    text = text.replace("const schemaVersion :UInt16 = 1;", "const schemaVersion :UInt16 = 2;")
    text = text.replace(
        "  receipt @11 :R.Receipt;\n}",
        "  receipt @11 :R.Receipt;\n  routeName @12 :Text;\n  tempC @13 :Float32;\n"
        "  extra @14 :List(UInt64);\n}")
    assert "routeName" in text
    text = text.replace(
        "    format @3 :F.FrameFormat;\n  }\n}",
        "    format @3 :F.FrameFormat;\n  }\n  colorMatrix @4 :List(Float32);\n}")
    (tmp_path / "slot.capnp").write_text(text)
    return capnp.load(str(tmp_path / "slot.capnp"), imports=[str(tmp_path)])


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return _v2_cached(str(tmp_path_factory.mktemp("v2")))


def test_schema_files_have_ids_and_version():
    for name in ("tensor", "frame", "slot"):
        first = (schemas.SCHEMA_DIR / f"{name}.capnp").read_text().splitlines()
        assert any(line.startswith("@0x") for line in first)
    assert codec.SCHEMA_VERSION == 1


def test_old_reader_ignores_new_fields(v2):
    spec = ChannelSpec(name="evo", slot_size=4096, kind="frame")
    h = v2.SlotHeader.new_message(schemaVersion=2, channelId=0, sequence=7, generation=4,
                                  writerPid=9, writerDomain="control", publishTsNs=1000,
                                  routeName="a" * 300, tempC=41.5, extra=list(range(50)))
    m = h.frame.init("meta")
    m.frameId, m.captureTsNs = 3, 900
    m.exposure.microseconds = 250
    raw_h = h.to_bytes()
    for fast in (True, False):
        stamp = codec.decode_header(raw_h, spec, fast=fast)
        assert (stamp.sequence, stamp.generation, stamp.frame_id, stamp.capture_ts_ns,
                stamp.exposure_us, stamp.gain) == (7, 4, 3, 900, 250, None)

    lay = v2.SlotLayout.new_message(schemaVersion=2, colorMatrix=[0.5] * 9)
    t = lay.init("tensor")
    t.dtype.code, t.dtype.bits = "uint", 8
    t.shape, t.strides, t.nbytes = [32, 32], [32, 1], 1024
    f = lay.frame.init("format")
    f.pixelFormat, f.width, f.height = "gray8", 32, 32
    p = f.init("planes", 1)[0]
    p.rowStride, p.width, p.height = 32, 32, 32
    got = codec.decode_layout(lay.to_bytes(), spec, 4096)
    assert got.shape == (32, 32) and got.frame.pixel_format == "gray8"


def test_new_reader_reads_old_short_structs(v2):
    """A v1 header is shorter than v2's struct: the added fields read as defaults."""
    spec = ChannelSpec(name="evo", slot_size=4096)
    raw = codec.encode_header(spec, sequence=1, generation=2, writer_pid=1, domain="control",
                              publish_ts_ns=5, crc32=None)
    with v2.SlotHeader.from_bytes(raw) as h:
        assert h.sequence == 1 and h.routeName == "" and h.tempC == 0.0
    assert np.dtype(codec.decode_layout(
        codec.encode_layout(np.dtype("uint8"), (4,), (1,), 0, None), spec, 4096).dtype) == np.uint8
