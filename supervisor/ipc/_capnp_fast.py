"""Fixed-offset access to the per-message SlotHeader, derived from the loaded schema.

Cap'n Proto is built so that a reader finds a scalar at a fixed offset without a decode
step; pycapnp's dynamic API spends ~1 us per field getting there, which is most of a
20 us latency budget. This module reads and patches exactly the SlotHeader fields the
bridge uses at the offsets the schema gives (nothing is hard-coded), and only for the
plain case: one segment, in-bounds struct pointers. Anything else (far pointers, several
segments) goes back to pycapnp through ``Unusual``. Tests check both paths agree.

``gather`` and ``Patcher`` go one step further: once the words that place every struct
are known (segment table, root pointer, child pointers), every field is at a fixed
absolute position, so one ``struct.Struct`` call reads (or writes) all of them.
"""
from __future__ import annotations

import struct
from operator import itemgetter
from typing import Callable, NamedTuple

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

    def holds(self, s: Scalar) -> bool:
        """True if the field lies inside this struct's data section."""
        return s.offset + s.fmt.size <= self.dwords * 8

    def at(self, s: Scalar) -> int:
        """Absolute byte position of a field this struct ``holds``."""
        return self.data + s.offset


NULL = StructRef(0, 0, 0, 0)
WORD = Scalar(0, _U64)    # a whole 64-bit word (a pointer), for gather()


class Message:
    """A parsed single-segment message: bounds of its segment and its root struct."""

    __slots__ = ("buf", "end", "root")

    def __init__(self, buf) -> None:
        if len(buf) < 16:
            raise Broken(f"{len(buf)} bytes is shorter than a segment table and root")
        if len(buf) % 8:
            # pycapnp refuses a flat message that is not whole words: so must we.
            raise Broken(f"{len(buf)} bytes is not a whole number of 8-byte words")
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


# ------------------------------------------------ many fields in one struct call

def _char(s: Scalar) -> str:
    return s.fmt.format.lstrip("<")


def gather(fields: list[tuple[int, Scalar]]
           ) -> tuple[int, Callable, Callable] | None:
    """``(start, unpack_from, order)`` reading every ``(absolute position, scalar)`` at
    once: ``order(unpack_from(buf, start))`` is their values in the order given (order is
    None when that is already the order in which they lie). None if two fields overlap
    (a hostile message can make structs overlap): the caller then reads field by field."""
    if len(fields) < 2:
        return None
    placed = sorted(range(len(fields)), key=lambda i: fields[i][0])
    fmt, pos = ["<"], fields[placed[0]][0]
    start = pos
    for i in placed:
        at, s = fields[i]
        if at < pos:
            return None
        if at > pos:
            fmt.append(f"{at - pos}x")
        fmt.append(_char(s))
        pos = at + s.fmt.size
    rank = {i: r for r, i in enumerate(placed)}
    perm = [rank[i] for i in range(len(fields))]
    # Fields given in the order they lie (the usual case) need no reordering.
    order = None if perm == sorted(perm) else itemgetter(*perm)
    return start, struct.Struct("".join(fmt)).unpack_from, order


class Patcher:
    """Writes a whole message in one ``struct`` call: ``template``'s bytes, with the
    fields at the given absolute positions replaced by new values.

    ``pack_into(buf, pos, values)`` / ``pack(values)`` take one value per field, in the
    order the fields were given. The template's other bytes (segment table, pointers,
    constant fields) travel as constant byte strings of the same struct."""

    __slots__ = ("size", "_struct", "_order", "_consts")

    def __init__(self, template: bytes, fields: list[tuple[int, Scalar]]) -> None:
        placed = sorted(range(len(fields)), key=lambda i: fields[i][0])
        fmt, consts, order, pos = ["<"], [], [], 0
        for i in placed:
            at, s = fields[i]
            if at < pos or at + s.fmt.size > len(template):
                raise Broken("template fields overlap or lie outside the template")
            if at > pos:
                fmt.append(f"{at - pos}s")
                order.append(len(consts))
                consts.append(template[pos:at])
            fmt.append(_char(s))
            order.append(-1 - i)            # a value, resolved below
            pos = at + s.fmt.size
        if pos < len(template):
            fmt.append(f"{len(template) - pos}s")
            order.append(len(consts))
            consts.append(template[pos:])
        n = len(consts)
        if len(order) < 2:
            raise Broken("a template plan needs at least two parts")
        self.size = len(template)
        self._struct = struct.Struct("".join(fmt))
        self._order = itemgetter(*[o if o >= 0 else n + (-1 - o) for o in order])
        self._consts = tuple(consts)
        if self._struct.size != self.size:
            raise Broken("template plan does not cover the template")

    def pack(self, values: tuple) -> bytes:
        return self._struct.pack(*self._order(self._consts + values))

    def pack_into(self, buf, pos: int, values: tuple) -> None:
        self._struct.pack_into(buf, pos, *self._order(self._consts + values))
