"""Compiled Receipt reading from an encoded SlotHeader, or ``SLOW``: pycapnp decides.

Compiled per structure: the first 16 bytes (segment table, root pointer) place the
receipt pointer; that word places the receipt's scalars and its two list pointers;
those two words place device and artifactSha256. Equal words, equal positions and
bounds checks, so the answer is pycapnp's (`_reference.read_receipt`; the tests compare).
"""
from __future__ import annotations

from . import _capnp_fast as cf
from ._fast_fields import _MAX_COMPILED
from .receipt import Receipt

SLOW = object()
"""The compiled receipt readers' answer when only pycapnp may decide."""
_ZERO_WORD = bytes(8)


class _ReceiptReading:
    """Receipt reading for `_HeaderFields` (mixed into `codec._HeaderAccess`)."""

    _rcompiled: dict[bytes, tuple]

    def receipt(self, raw: bytes):
        """The Receipt in an encoded SlotHeader, None if it has none, or ``SLOW`` when
        only pycapnp may answer (unusual layout, bad bytes, anything not plain)."""
        e = self._receipt_entry(raw)
        if e is None or e is SLOW:
            return e
        end, (start, unpack_from, order, lists, dpos, spos) = e
        v = unpack_from(raw, start)
        if order is not None:
            v = order(v)
        spans = lists.get(v[-2:])
        if spans is None:
            spans = _list_spans(lists, v[-2:], dpos, spos, end)
            if spans is None:
                return SLOW
        ds, de, ss, se = spans
        if de >= 0:
            if raw[de] != 0:                  # Text must end in NUL
                return SLOW
            dev = raw[ds:de]
            if b"\0" in dev:
                return SLOW
            try:
                device = dev.decode()
            except UnicodeDecodeError:
                return SLOW
        else:
            device = ""
        completion = self.r_completion_name.get(v[11])
        if completion is None:
            return SLOW
        return Receipt(v[0], v[1], v[2], v[3], device[:64], v[4], v[5], completion, v[6],
                       v[7], v[8], v[9], raw[ss:se][:64], v[10])

    def receipt_capture(self, raw: bytes):
        """Only the receipt's captureTsNs (an int), None if the header has no receipt,
        or ``SLOW`` when only pycapnp may answer: the first steps of ``receipt``, on the
        same compiled structures, without building the Receipt. The reader checks it on
        every message; the whole Receipt is still decoded on demand. Where both answer,
        it is the captureTsNs ``receipt`` (and so pycapnp) gives, since the receipt
        pointer word alone places the scalars; a receipt whose Text or Data is bad still
        raises MalformedHeader when decoded.

        The reader calls it on every message, so the steps of `_receipt_entry` are
        spelt out here rather than called (a call and a tuple less per message)."""
        c = self._rcompiled.get(raw[:16])
        if c is None:
            c = self._rcompile_root(raw)
            if c is None:
                return SLOW
        end, rpos, subs = c
        if len(raw) < end or len(raw) & 7:
            return SLOW
        if rpos < 0:
            return None
        rw = raw[rpos:rpos + 8]
        if rw == _ZERO_WORD:
            return None
        e = subs.get(rw)
        if e is None:
            e = self._rcompile_receipt(raw, rpos, end, subs)
            if e is None:
                return SLOW
        v = e[1](raw, e[0])                    # unpack_from(raw, start)
        if e[2] is not None:
            v = e[2](v)                        # order
        return v[1]                            # _R_SCALARS[1]: capture_ts_ns

    def _receipt_entry(self, raw: bytes):
        """(segment end, compiled receipt structure), None (no receipt) or SLOW."""
        c = self._rcompiled.get(raw[:16])
        if c is None:
            c = self._rcompile_root(raw)
            if c is None:
                return SLOW
        end, rpos, subs = c
        if len(raw) < end or len(raw) & 7:
            return SLOW
        if rpos < 0:
            return None
        rw = raw[rpos:rpos + 8]
        if rw == _ZERO_WORD:
            return None
        e = subs.get(rw)
        if e is None:
            e = self._rcompile_receipt(raw, rpos, end, subs)
            if e is None:
                return SLOW
        return end, e

    def _rcompile_root(self, raw: bytes):
        try:
            m = cf.Message(raw)
        except (cf.Broken, cf.Unusual):
            return None
        r = m.root
        rpos = r.ptrs + self.receipt_ptr * 8 if self.receipt_ptr < r.pcount else -1
        c = (m.end, rpos, {})
        if len(self._rcompiled) >= _MAX_COMPILED:
            self._rcompiled.clear()
        self._rcompiled[bytes(raw[:16])] = c
        return c

    def _rcompile_receipt(self, raw: bytes, rpos: int, end: int, subs: dict):
        m = _Bounds(raw, end)
        try:
            rc = cf.Message.struct_at(m, rpos)
        except (cf.Broken, cf.Unusual):
            return None
        if not all(rc.holds(s) for s in self.r_scalars):
            return None             # an older, shorter Receipt: pycapnp gives defaults
        if max(self.r_device_ptr, self.r_sha_ptr) >= rc.pcount:
            return None
        dpos = rc.ptrs + self.r_device_ptr * 8
        spos = rc.ptrs + self.r_sha_ptr * 8
        plan = cf.gather([(rc.at(s), s) for s in self.r_scalars]
                         + [(dpos, cf.WORD), (spos, cf.WORD)])
        if plan is None:
            return None
        e = (*plan, {}, dpos, spos)
        if len(subs) >= _MAX_COMPILED:
            subs.clear()
        subs[bytes(raw[rpos:rpos + 8])] = e
        return e


class _Bounds:
    """Just enough of _capnp_fast.Message for struct_at: a buffer and its segment end."""

    __slots__ = ("buf", "end")

    def __init__(self, buf, end: int) -> None:
        self.buf, self.end = buf, end


def _list_spans(lists: dict, words: tuple, dpos: int, spos: int, end: int):
    """(device start, device NUL position or -1 if null, sha start, sha end) for the
    receipt's two list pointer words (at dpos, spos); None: pycapnp decides."""
    d = _byte_list(words[0], dpos, end)
    s = _byte_list(words[1], spos, end)
    if d is None or s is None:
        return None
    ds, dn = d
    if words[0] == 0:
        spans = (0, -1, s[0], s[0] + s[1])
    elif dn < 1:
        return None                 # Text without its NUL: pycapnp's error
    else:
        spans = (ds, ds + dn - 1, s[0], s[0] + s[1])
    if len(lists) >= _MAX_COMPILED:
        lists.clear()
    lists[words] = spans
    return spans


def _byte_list(word: int, pos: int, end: int) -> tuple[int, int] | None:
    """(start, count) of the byte list whose pointer ``word`` sits at byte ``pos``;
    (0, 0) for a null pointer; None for anything else (pycapnp decides)."""
    if word == 0:
        return 0, 0
    if word & 3 != 1 or (word >> 32) & 7 != 2:
        return None                 # not a list pointer, or not a list of bytes
    off = (word & 0xFFFFFFFF) >> 2
    if off >= 1 << 29:
        off -= 1 << 30
    count = word >> 35
    start = pos + 8 + off * 8
    if start < 8 or start + (count + 7) // 8 * 8 > end:
        return None
    return start, count
