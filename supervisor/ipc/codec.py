"""Encode and validate the capnp SlotHeader / SlotLayout of a slot.

Everything a reader takes from shared memory passes through ``decode_layout`` and
``decode_header``: they either return plain, checked Python values or raise a typed
``Rejected``. Nothing here trusts the writer.

The codec in parts:

* `_types`          the checked values handed out (Layout, FrameFormat, Stamp, ...);
* `_reference`      pycapnp's encode and decode with every check: the judge;
* the compiled fast path, which answers exactly what the reference answers and hands
  it anything it does not handle plainly: `_fast_fields` (where each SlotHeader field
  lies, from the loaded schema), `_fast_header` (decode), `_fast_plan` (encode),
  `_fast_receipt` (the Receipt), over `_capnp_fast` (wire-format reading);
* `_geometry`       where the control block, header, layout and payload of a slot lie.

This module picks the path; ``fast=False`` forces the reference (what the tests compare
the fast path to).
"""
from __future__ import annotations

import copy

from ._fast_fields import _HeaderFields
from ._fast_header import _HeaderReading
from ._fast_plan import HeaderPlan, _HeaderWriting, publish_ts_offset
from ._fast_receipt import SLOW, _ReceiptReading
from ._reference import (SCHEMA_VERSION, SlotHeader, SlotLayout, check_stamp, decode_layout,
                         encode_header, encode_layout, read_header, read_receipt)
from ._types import FrameFormat, Layout, PlaneInfo, Stamp, dlpack_of, tensor_span
from .receipt import Receipt
from .spec import ChannelSpec

__all__ = [
    "HEADER", "SCHEMA_VERSION", "SLOW", "FrameFormat", "HeaderPlan", "Layout", "PlaneInfo",
    "SlotHeader", "SlotLayout", "Stamp", "decode_header", "decode_layout", "decode_receipt",
    "dlpack_of", "encode_header", "encode_layout", "publish_ts_offset", "tensor_span",
]


class _HeaderAccess(_HeaderReading, _HeaderWriting, _ReceiptReading, _HeaderFields):
    """The compiled SlotHeader paths over one set of field positions, with their
    (bounded) caches: decoders per message structure, writers per header shape."""

    def __init__(self) -> None:
        super().__init__()
        self._compiled = {}
        self._plans = {}
        self._rcompiled = {}

    def own(self) -> _HeaderAccess:
        """The same field positions with caches of its own: one per Reader. One table
        per process, cleared whole at its 33rd structure, let a research writer rotating
        33 valid header shapes make another channel's take ~36x slower in a process that
        reads both (red team 15 row 15)."""
        h = copy.copy(self)
        h._compiled, h._plans, h._rcompiled = {}, {}, {}
        return h


HEADER = _HeaderAccess()


def decode_header(raw: bytes, spec: ChannelSpec, *, fast: bool = True) -> Stamp:
    """Parse and structurally check a SlotHeader (the reader checks ordering and age).
    ``fast=False`` forces pycapnp's dynamic reader (the reference the tests compare to)."""
    if fast:
        return HEADER.decode(raw, spec)
    return check_stamp(spec, *read_header(raw, spec))


def decode_receipt(raw: bytes, spec: ChannelSpec, sequence: int, *, fast: bool = True
                   ) -> Receipt | None:
    """The execution receipt in a SlotHeader, if it carries one (read on demand).
    ``fast=False`` forces pycapnp's dynamic reader (the reference the tests compare to);
    the compiled path hands anything it does not handle plainly to it."""
    if fast:
        r = HEADER.receipt(raw)
        if r is not SLOW:
            return r
    return read_receipt(raw, spec, sequence)


def native_ctx(spec: ChannelSpec, slow: object, tolerance_ns: int, max_age_ns: int) -> tuple:
    """The native reader's context for one channel (`_native.c`: accept_core's ``ctx``):
    the header's union layouts, the channel's requirements and limits, the Stamp type,
    the sentinel take() gives for a receipt it left to Python, and the receipt table."""
    H = HEADER
    return (H.crc_n, H.crc_is, H.frame_n, H.frame_is, H.exp_n, H.exp_is, H.gain_n,
            H.gain_is, spec.channel_id, int(spec.crc), int(spec.kind == "frame"),
            tolerance_ns, max_age_ns, H.r_scalars[1].offset,   # the receipt's captureTsNs
            Stamp, slow, H.r_native)


def native_accept(raw: bytes, spec: ChannelSpec, sequence: int, generation: int,
                  now_ns: int, last_capture_ns: int = 0, max_age_ns: int | None = None,
                  tolerance_ns: int = 5_000_000) -> Stamp | None:
    """The native reader's verdict on a SlotHeader (`_native.accept`): the Stamp when
    every check the reader makes passes for a structure the compiled path has seen,
    else None (the Python path then decides). Raises BridgeError without the module.
    The reader calls `_native.accept` directly; this is its one-call form for tests."""
    from . import _atomics
    from .errors import BridgeError

    if _atomics.NATIVE is None:
        raise BridgeError("supervisor.ipc._native is not built")
    age = spec.max_age_ms * 1_000_000 if max_age_ns is None else max_age_ns
    ctx = native_ctx(spec, SLOW, tolerance_ns, age)
    return _atomics.NATIVE.accept(raw, HEADER._compiled, ctx, sequence, generation, now_ns,
                                  last_capture_ns)


def native_receipt(raw: bytes):
    """The native reading of the Receipt in an encoded SlotHeader (`_native.receipt`,
    the one take() runs on every accepted model output): a Receipt, None (it has none)
    or SLOW (pycapnp decides). For tests; BridgeError without the module."""
    from . import _atomics
    from ._capnp_fast import Broken, Message, Unusual
    from .errors import BridgeError

    if _atomics.NATIVE is None:
        raise BridgeError("supervisor.ipc._native is not built")
    try:
        m = Message(raw)
    except (Broken, Unusual):
        return SLOW
    r = m.root
    if HEADER.receipt_ptr >= r.pcount:
        return None
    return _atomics.NATIVE.receipt(bytes(raw), r.ptrs + HEADER.receipt_ptr * 8, m.end,
                                   HEADER.r_native, SLOW)
