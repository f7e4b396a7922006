"""Binary formats of a channel segment's header and control blocks, and of a reader's
lease table. Where a slot's parts lie (control block, SlotHeader, SlotLayout, payload)
is `_geometry`'s; its offsets are re-exported here for the tools that forge slots.

Lease table (one per reader, written only by that reader, mapped read-only by the writer):
    [0, 64)                     lease header
    64 + 32 * k                 lease entry k < max_leases

Each control block's ``gen`` is a seqlock: odd while the writer fills the slot, even
when stable. Every 8-byte field is 8-byte aligned, so a load or store of it is single-copy
atomic. Their order between processes comes from the native module's acquire loads,
release stores and fences (the argument, store by store, is at the top of `_native.c`;
`_atomics` picks the path). The pure-Python path relies on x86-64's TSO instead and is
allowed only there.

On that path the writer stores a word readers race on (``gen``, ``last_seq``) with one
8-byte store, through a memoryview cast to "Q" (``words[offset // 8] = value``), never
with ``struct.pack_into``: that zeroes its whole target before writing it, so a reader
could see generation 0, an even ("stable") value, in the middle of a write. What it
stores while the generation is odd (CONTROL_TAIL) may go through ``struct``.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

from ._geometry import (CONTROL_SIZE, HEADER_MAX, LAYOUT_MAX, LAYOUT_OFFSET,  # noqa: F401
                        control_offset)

MAGIC = 0x31475242_4F495254  # b"TRIOBRG1" little-endian
LEASE_MAGIC = 0x31455341_454C4254  # b"TBLEASE1"
LAYOUT_VERSION = 1

# Channel header: magic, version, slot_count, slot_size, slot_stride, control_size,
# channel_id, writer_pid, last_seq, last_slot, writer_epoch.
CHANNEL_HDR = struct.Struct("<QIIQQQIIQIxxxxQ")
OFF_LAST_SEQ = 48  # offset of last_seq inside the channel header
OFF_LAST_SLOT = 56
# last_seq and last_slot read together. The writer stores last_slot before last_seq, so
# a reader that sees a new last_seq sees its slot too; last_slot is only ever a hint: a
# reader checks the control block it names before trusting it.
LAST = struct.Struct("<QI")
# The writer's announcement of its next publish (Writer.announce): the sequence number
# it will carry, then when it is due (CLOCK_MONOTONIC ns); 0: nothing announced. Its
# own cache line, away from last_seq, which readers spin on. Only ever a hint for a
# busy-polling reader's window (_cadence), never trusted for delivery: the due is stored
# first, then the sequence number with a release store; a reader acquires the sequence
# number, then loads the due: that one or a later one (a misplaced window at worst).
OFF_NEXT_SEQ = 128
OFF_NEXT_DUE = 136

# Control block: gen, seq, publish_ts_ns, header_len, layout_len.
CONTROL = struct.Struct("<QQQII")
# The same without gen, at OFF_SEQ: what the writer stores while gen is odd.
CONTROL_TAIL = struct.Struct("<QQII")
OFF_GEN = 0
OFF_SEQ = 8
OFF_TS = 16

# Lease header: magic, pid, max_leases. Lease entry: slot, gen, deadline_ns.
LEASE_HDR = struct.Struct("<QII")
LEASE_ENTRY = struct.Struct("<IxxxxQQ")
LEASE_BASE = 64
# In the lease header: READER_AWAKE while a (native) reader will look at shared memory
# before it next blocks, so the writer may skip its wake-up byte (see _native.c).
OFF_AWAKE = 16
READER_AWAKE = 1
# In the lease header: READER_POLLS while the reader busy-polls (busy_poll_us), so that
# Writer.announce wakes it to read an announcement; other readers are not woken for one.
OFF_POLLS = 24
READER_POLLS = 1
# In the lease header: how many times the (native) reader has put its awake flag down
# to sleep, stored before the flag; the writer sends one wake-up byte per sleep, not
# one per message (K6 in _native.c). 0: a reader that does not count (always woken).
OFF_SLEEPS = 32
# In the lease header: the sequence number this reader consumed last (see below). A slot whose
# message every reader has taken is the writer's first choice to reuse (the newest
# such: still in the caches), before the oldest (Writer.loan; loan in _native.c).
# 0: nothing (a reader that does not say: C++, or one just attached). A table without
# LEASE_MAGIC (no reader ever attached: the config's spare index) does not count.
OFF_TAKEN = 40
LEASE_STRIDE = 32

# Sequence numbers. An honest writer counts from 1, at most ~10 million a second: it
# never reaches SEQ_HONEST (2**61: 7,000 centuries). A reader refuses a message at or
# above it unless it is close behind the reader's own position (within 2 rings: a
# hostile writer walks readers up one ring at a time, never to overflow), so there is
# always room above every reader for the supervisor's last word. What a dead writer left
# at or above PLAUSIBLE (2**62) in its header or control blocks was not reached by
# counting: the next writer empties those words instead of continuing them.
#
# OFF_TAKEN is also each reader's *position*: the highest sequence it consumed,
# delivered or rejected (a rejected message's number is used up too), stored at attach
# and at every step. It lives in the reader's own table, which no writer can write: the
# supervisor's last word continues above it whatever the dead writer did to its own
# segment (failsafe.publish_safe; red team round 3).
SEQ_HONEST = 1 << 61
PLAUSIBLE = 1 << 62


def resume_point(segment: int, positions: Sequence[int], anchor: int | None,
                 span: int) -> int:
    """Where a (re)started writer numbers from: above the segment's words it continued
    (``segment``, below SEQ_HONEST) and above a trusted reader's position where readers
    then hear it: readers a hostile predecessor walked up past SEQ_HONEST (red team
    round 4) must hear the next writer. A reader at q hears x + 1 if it is below
    SEQ_HONEST or within ``span`` of q (the readers' jump rule: 2 rings), and then
    follows. A position is taken only if the supervisor's own monitor reader (``anchor``)
    would hear the writer numbered from it, or, with no monitor attached, if most of the
    trusted readers would: one lying reader cannot number the writer out of the others'
    reach."""
    ps = [p for p in positions if p < PLAUSIBLE]

    def heard(x: int, q: int) -> bool:
        return x + 1 < SEQ_HONEST or abs(x + 1 - q) <= span

    if anchor is not None and anchor < PLAUSIBLE:
        ok = [p for p in (*ps, anchor) if heard(p, anchor)]
    else:
        ok = [p for p in ps if 2 * sum(heard(p, q) for q in ps) > len(ps)]
    return max((segment, *ok))


U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
GEN_SEQ = struct.Struct("<QQ")


def lease_offset(k: int) -> int:
    return LEASE_BASE + LEASE_STRIDE * k


def writer_attached(data_fd: int) -> bool:
    """The channel's writer has set its segment up (the magic is its "ready"): what a
    reader waits for before it attaches. One 8-byte read."""
    import os

    return os.pread(data_fd, 8, 0) == U64.pack(MAGIC)
