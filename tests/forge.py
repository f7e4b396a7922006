"""Publish arbitrary header/layout bytes through a real Writer's slot protocol, as a
buggy or hostile writer would: the reader must judge every byte itself."""
from __future__ import annotations

import time

from supervisor.ipc import Writer, layout as L


def forge(w: Writer, raw_header: bytes, raw_layout: bytes, *, seq: int | None = None,
          ts: int | None = None, payload: bytes = b"") -> int:
    loan = w.loan()
    slot = loan.slot
    spec = w.spec
    base = spec.control_size + slot * spec.slot_stride
    buf = w._buf
    raw_header, raw_layout = raw_header[:L.HEADER_MAX], raw_layout[:L.LAYOUT_MAX]
    buf[base:base + len(raw_header)] = raw_header
    buf[base + L.LAYOUT_OFFSET:base + L.LAYOUT_OFFSET + len(raw_layout)] = raw_layout
    if payload:
        loan._payload[:len(payload)] = payload
    seq = w._last_seq + 1 if seq is None else seq
    gen = w._gen[slot] + 1
    L.CONTROL.pack_into(buf, L.control_offset(slot), w._gen[slot], seq,
                        ts or time.monotonic_ns(), len(raw_header), len(raw_layout))
    L.U64.pack_into(buf, L.control_offset(slot), gen)
    L.U64.pack_into(buf, L.OFF_LAST_SEQ, max(seq, w._last_seq))
    w._gen[slot], w._seq[slot] = gen, seq
    w._last_seq = max(seq, w._last_seq)
    w._loaned.discard(slot)
    loan._done = True
    return gen


def watch_crc_confirms(r) -> list[int]:
    """What the native take of Reader ``r`` said of each CRC it checked from now on
    (its ``crc_ok``: 1 confirmed, 0 left to Python), in order."""
    take, confirmed = r._ntake, []

    def watching(*a):
        got = take(*a)
        if isinstance(got, tuple):
            confirmed.append(got[7])
        return got

    r._ntake = watching
    return confirmed
