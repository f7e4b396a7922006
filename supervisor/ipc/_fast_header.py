"""Compiled SlotHeader decode: one ``struct`` call per message, pycapnp's answer.

The first decode of a message structure goes field by field (`_decode_fields`) and
remembers where that structure puts every field (`_Structure`); later messages with
the same structure are read in one ``unpack_from``. Whatever is not plain (several
segments, far pointers, a union member this schema does not know) goes to the
reference reader (`_reference.read_header`), which decides.
"""
from __future__ import annotations

from typing import NamedTuple

from . import _capnp_fast as cf
from ._fast_fields import _MAX_COMPILED
from ._reference import check_stamp, read_header
from ._types import Stamp
from .spec import ChannelSpec

_new_stamp = tuple.__new__


class _Structure(NamedTuple):
    """Where every SlotHeader field sits in messages whose first 16 bytes (segment
    table and root pointer) equal the ones compiled and, for FrameMeta's fields, whose
    FrameMeta pointer word equals ``meta_word``.

    Those words alone decide every struct position and bounds check of the per-field
    path, so for such a message one ``unpack_from`` reads exactly what it would read
    (the tests compare both, and both to pycapnp)."""

    end: int            # the segment's end: the message must be at least this long
    start: int
    unpack_from: object
    order: object       # None, or puts the values in _HeaderFields' field order
    has_meta: bool      # FrameMeta resolved plainly: its pointer word and fields are read
    meta_word: int      # the FrameMeta pointer word these positions hold for
    # The same positions for the native reader (`_native.accept`): (end, receipt pointer
    # position or -1, has_meta, meta_word, then (position, struct code) per field in
    # decode()'s order); it accepts only what this path accepts, and defers the rest.
    native: tuple = ()


class _HeaderReading:
    """SlotHeader decode for `_HeaderFields` (mixed into `codec._HeaderAccess`)."""

    _compiled: dict[bytes, _Structure]

    def decode(self, raw: bytes, spec: ChannelSpec) -> Stamp:
        c = self._compiled.get(raw[:16])
        if c is None:
            return self._decode_fields(raw, spec)
        end, start, unpack_from, order, has_meta, meta_word, _ = c
        if len(raw) < end or len(raw) & 7:
            return self._decode_fields(raw, spec)          # rejects it
        v = unpack_from(raw, start)
        if order is not None:
            v = order(v)
        if has_meta:
            (version, channel, seq, gen, pid, crc_which, frame_which, ts, crc, word,
             frame_id, capture, exp_which, gain_which, exposure, gain) = v
            if crc_which >= self.crc_n or frame_which >= self.frame_n:
                return self._decode_fields(raw, spec)      # unknown union member
            if frame_which != self.frame_is:
                frame_id = capture = exposure = gain = None
            elif word != meta_word:
                return self._decode_fields(raw, spec)      # FrameMeta is elsewhere
            elif exp_which >= self.exp_n or gain_which >= self.gain_n:
                return self._decode_fields(raw, spec)      # unknown union member
            else:
                if exp_which != self.exp_is:
                    exposure = None
                if gain_which != self.gain_is:
                    gain = None
        else:
            version, channel, seq, gen, pid, crc_which, frame_which, ts, crc = v
            if frame_which == self.frame_is or crc_which >= self.crc_n or (
                    frame_which >= self.frame_n):
                return self._decode_fields(raw, spec)      # FrameMeta is not plain here
            frame_id = capture = exposure = gain = None
        if crc_which != self.crc_is:
            crc = None
        if (version >= 1 and channel == spec.channel_id
                and (crc is not None or not spec.crc)
                and (frame_id is not None or spec.kind != "frame")):
            return _new_stamp(Stamp, (seq, gen, pid, ts, crc, frame_id, capture, exposure,
                                      gain))
        return check_stamp(spec, version, channel, seq, gen, pid, ts, crc, frame_id,
                           capture, exposure, gain)        # raises the typed rejection

    def _decode_fields(self, raw: bytes, spec: ChannelSpec) -> Stamp:
        """Field by field; compiles the message's structure for the next time."""
        try:
            m = cf.Message(raw)
            r = m.root
            get = r.get
            crc_which, frame_which = get(raw, self.crc_which), get(raw, self.frame_which)
            if crc_which >= self.crc_n or frame_which >= self.frame_n:
                raise cf.Unusual("unknown union member: pycapnp decides")
            crc = get(raw, self.crc) if crc_which == self.crc_is else None
            frame_id = capture = exposure = gain = None
            if frame_which == self.frame_is:
                meta = m.child(r, self.meta_ptr)
                frame_id, capture = meta.get(raw, self.frame_id), meta.get(raw, self.capture)
                exp_which = meta.get(raw, self.exp_which)
                gain_which = meta.get(raw, self.gain_which)
                if exp_which >= self.exp_n or gain_which >= self.gain_n:
                    raise cf.Unusual("unknown union member: pycapnp decides")
                if exp_which == self.exp_is:
                    exposure = meta.get(raw, self.exp)
                if gain_which == self.gain_is:
                    gain = meta.get(raw, self.gain)
            values = (get(raw, self.version), get(raw, self.channel),
                      get(raw, self.sequence), get(raw, self.generation),
                      get(raw, self.pid), get(raw, self.ts), crc, frame_id, capture,
                      exposure, gain)
        except (cf.Unusual, cf.Broken):
            # Not plain to the compiled reader: pycapnp's reference is the judge (a
            # stricter fast path would drop messages the contract accepts).
            values = read_header(raw, spec)
        else:
            self._compile(m)
        return check_stamp(spec, *values)

    def _compile(self, m: cf.Message) -> None:
        """Remember where this message's structure puts every field (see _Structure)."""
        raw, r = m.buf, m.root
        if not all(r.holds(s) for s in self._root_fields):
            return          # a shorter (older) struct: fields read as defaults; no plan
        fields = [(r.at(s), s) for s in self._root_fields]
        plan, meta_word = None, 0
        if self.meta_ptr < r.pcount:
            pos = r.ptrs + self.meta_ptr * 8
            try:
                meta = m.struct_at(pos)
            except (cf.Broken, cf.Unusual):
                meta = cf.NULL
            if all(meta.holds(s) for s in self._meta_fields):
                meta_word = cf.WORD.fmt.unpack_from(raw, pos)[0]
                plan = cf.gather(fields + [(pos, cf.WORD)] +
                                 [(meta.at(s), s) for s in self._meta_fields])
        has_meta = plan is not None
        if plan is None:
            plan = cf.gather(fields)
            if plan is None:
                return
        else:
            fields = fields + [(pos, cf.WORD)] + [(meta.at(s), s) for s in self._meta_fields]
        rpos = r.ptrs + self.receipt_ptr * 8 if self.receipt_ptr < r.pcount else -1
        native = (m.end, rpos, int(has_meta), meta_word,
                  *(x for at, s in fields for x in (at, ord(cf._char(s)))))
        if len(self._compiled) >= _MAX_COMPILED:
            self._compiled.clear()
        self._compiled[bytes(raw[:16])] = _Structure(m.end, *plan, has_meta, meta_word,
                                                     native)
