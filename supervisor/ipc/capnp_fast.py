"""Fixed-offset access to the per-message SlotHeader, derived from the loaded schema.

Cap'n Proto is built so that a reader finds a scalar at a fixed offset without a decode
step; pycapnp's dynamic API spends ~1 us per field getting there, which is most of a
20 us latency budget. This module reads and patches exactly the SlotHeader fields the
bridge uses at the offsets the schema gives (nothing is hard-coded), and only for the
plain case: one segment, in-bounds struct pointers. Anything else (far pointers, several
segments) goes back to pycapnp through ``Unusual``. Tests check both paths agree.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

_FMT = {"int8": "b", "int16": "h", "int32": "i", "int64": "q", "uint8": "B",
        "uint16": "H", "uint32": "I", "uint64": "Q", "float32": "f", "float64": "d",
        "enum": "H"}
_U64 = struct.Struct("<Q")
_SEG = struct.Struct("<II")


class Unusual(Exception):
    """Valid-looking capnp this fast path does not handle; use pycapnp instead."""


class Broken(Exception):
    """Bytes that are not a well-formed single-segment message."""


class Scalar(NamedTuple):
    offset: int          # bytes into the data section
    fmt: struct.Struct


def scalar(schema, name: str) -> Scalar:
    f = schema.fields[name].proto
    kind = f.slot.type.which()
    if kind not in _FMT:
        raise TypeError(f"{name} is {kind}, not a plain scalar")
    fmt = struct.Struct("<" + _FMT[kind])
    if f.slot.defaultValue.which() != "void" and getattr(f.slot.defaultValue, kind, 0):
        raise TypeError(f"{name} has a non-zero default; XOR it before use")
    return Scalar(f.slot.offset * fmt.size, fmt)


def union(schema, group: str) -> tuple[object, Scalar, dict[str, int]]:
    """(group schema, discriminant accessor, member name -> discriminant value)."""
    g = schema.fields[group].schema
    disc = Scalar(g.node.struct.discriminantOffset * 2, struct.Struct("<H"))
    return g, disc, {f.name: f.discriminantValue for f in g.node.struct.fields}


def pointer_index(schema, name: str) -> int:
    return schema.fields[name].proto.slot.offset


class StructRef(NamedTuple):
    data: int      # byte position of the data section in the buffer
    dwords: int
    ptrs: int      # byte position of the pointer section
    pcount: int

    def get(self, buf, s: Scalar):
        off, fmt = s
        # Fields past a (shorter, older) struct's data section read as their default.
        if off + fmt.size > self[1] * 8:
            return 0
        return fmt.unpack_from(buf, self[0] + off)[0]

    def put(self, buf, s: Scalar, value) -> None:
        if s.offset + s.fmt.size > self.dwords * 8:
            raise Broken("field outside the template's data section")
        s.fmt.pack_into(buf, self.data + s.offset, value)


NULL = StructRef(0, 0, 0, 0)


class Message:
    """A parsed single-segment message: bounds of its segment and its root struct."""

    __slots__ = ("buf", "end", "root")

    def __init__(self, buf) -> None:
        if len(buf) < 16:
            raise Broken(f"{len(buf)} bytes is shorter than a segment table and root")
        count_minus_one, words = _SEG.unpack_from(buf, 0)
        if count_minus_one != 0:
            raise Unusual("multi-segment message")
        self.buf = buf
        self.end = 8 + words * 8
        if self.end > len(buf):
            raise Broken(f"segment of {words} words overruns the {len(buf)}-byte buffer")
        self.root = self.struct_at(8)

    def struct_at(self, pos: int) -> StructRef:
        """Follow the struct pointer stored at byte ``pos``."""
        if pos < 8 or pos + 8 > self.end:
            raise Broken("pointer outside the segment")
        v = _U64.unpack_from(self.buf, pos)[0]
        if v == 0:
            return NULL
        if v & 3 != 0:
            raise Unusual("non-struct pointer where a struct is expected")
        off = (v & 0xFFFFFFFF) >> 2
        if off >= 1 << 29:
            off -= 1 << 30
        dwords, pcount = (v >> 32) & 0xFFFF, v >> 48
        start = pos + 8 + off * 8
        if start < 8 or start + (dwords + pcount) * 8 > self.end:
            raise Broken("struct pointer out of the segment")
        return StructRef(start, dwords, start + dwords * 8, pcount)

    def child(self, parent: StructRef, index: int) -> StructRef:
        if index >= parent.pcount:
            return NULL
        return self.struct_at(parent.ptrs + index * 8)
