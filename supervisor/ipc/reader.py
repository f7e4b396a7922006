"""A reader of a channel: leases slots, hands out read-only zero-copy views."""
from __future__ import annotations

import os
import select
import socket
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from . import _atomics, codec, layout as L, shm
from ._burst import MAX_SPIN_US, SPIN_US, Burst
from ._cadence import Cadence
from ._geometry import HEADER_MAX, LAYOUT_MAX, SlotGeometry
from ._message import UNREAD as _UNREAD, Message
from ._types import Layout
from .channel import ReaderHandle
from .errors import (BridgeError, ChannelTimeout, CrcMismatch, FutureTimestamp,
                     MalformedHeader, Rejected, SequenceError, SequenceJump, StaleMessage,
                     TornRead)

# Hot-path names, bound once.
_gen_of = L.U64.unpack_from
_gen_seq_of = L.GEN_SEQ.unpack_from
_last_of = L.LAST.unpack_from
_control_of = L.CONTROL.unpack_from
_lease_pack = L.LEASE_ENTRY.pack_into
_SLOW = codec.SLOW
_now = time.monotonic_ns
_cpu_ns = time.thread_time_ns      # CPU this thread spent: what the busy-poll bound counts
_MAX_SLEEP_MS = 1000     # one sleep before a busy-poll window, at most (then look again)
_FD_SETSIZE = 1024       # select() takes fds below this
# A wait of at least this long blocks in one read of the wake-up socket (wake-up and
# drain in one system call) instead of poll + read. SO_RCVTIMEO counts in jiffies
# (HZ=250 here) on the timer wheel: asked for 1 ms it slept 10 ms here, for 20 ms
# 24.6 ms. So the read's timeout is set short of the deadline (by _READ_MARGIN_MS,
# in _READ_QUANTUM_MS steps, so a caller's fixed timeout sets it once) and the rest
# of a wait that timed out goes to poll, which keeps its ms.
_READ_MIN_MS = 30
_READ_MARGIN_MS = 15
_READ_QUANTUM_MS = 10
_TIMEVAL = struct.Struct("@ll")
_new_message = Message.__new__   # no __init__: a call frame less per message
_OFF_LAST_SEQ = L.OFF_LAST_SEQ
_OFF_LAST_SLOT = L.OFF_LAST_SLOT
_OFF_TAKEN = L.OFF_TAKEN
_u64_pack = L.U64.pack_into
_MAX_SEQ = 2**64 - 1
_SEQ_HONEST = L.SEQ_HONEST

# How far a publish, frame capture or receipt capture timestamp may lie ahead of the
# reader's clock before the message is rejected as FutureTimestamp. Every timestamp on
# the bridge is CLOCK_MONOTONIC of this one machine, and an honest writer reads it
# before the store that publishes, which the reader sees before it reads its own clock:
# an honest stamp is never ahead, so only a lying (or broken) writer produces one. The
# tolerance is a margin, not a correction: 5 ms is a tenth of a 20 Hz frame period and
# a few % of any channel's or controlsd's age limit (100-200 ms), so the most a liar
# within it can gain is 5 ms of apparent freshness. No ChannelSpec field fits a
# per-channel override, so this is the one value for every channel.
FUTURE_TOLERANCE_NS = 5_000_000

# How long a reader waits for the writer to map and seal the segment on attach.
ATTACH_TIMEOUT_S = 5.0
# A CRC'd channel with slots bigger than this is not rehearsed (Reader.rehearse): the
# CRC of a message alone could outlast a busy-poll window (~80 us here at this size).
REHEARSE_CRC_MAX = 256 * 1024
_RETRIES = 8


def _cut(w: tuple[int, int] | None, end_ns: int | None, now: int) -> tuple[int, int] | None:
    """A busy-poll window cut to the caller's deadline; None if nothing of it is left."""
    if w is None or (end_ns is not None and w[0] >= end_ns):
        return None
    stop = w[1] if end_ns is None else min(w[1], end_ns)
    return None if now >= stop else (w[0], stop)


def _wake_socket(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of wake-up fd ``fd``, if that is a socket in
    blocking mode (Channel.create makes the reader's end so); else None: poll + read
    (an eventfd or a pipe in tests, a non-blocking end). The mode is never changed here:
    the open file description may be shared with whoever handed us the fd."""
    if socket.getdefaulttimeout() is not None:
        return None      # socket() would make the (shared) description non-blocking
    try:
        if not os.get_blocking(fd):
            return None
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)                 # not a socket
        return None


@dataclass(frozen=True)
class ReaderStats:
    received: int
    dropped: int              # sequence gaps: messages the writer reused before we read them
    rejected: dict[str, int]  # per Rejected.reason
    leases_lost: int
    busy_poll_hits: int = 0   # messages taken while busy-polling (busy_poll_us)
    busy_poll_misses: int = 0  # busy-poll windows that ended without one
    rehearsals: int = 0       # windows that began with a rehearsal (Reader.rehearse)
    rehearsal_error: str = ""  # why the worker's rehearsal was turned off, if it was
    spin_hits: int = 0        # messages taken by looking on before sleeping (spin_us)
    spin_misses: int = 0      # such spins that ended empty (then the reader slept)
    skipped: int = 0          # older messages passed over by take_newest (by choice)


class Reader:
    """Reader ``handle.index`` of a channel. In-order delivery: every receive returns
    the oldest message newer than the last one still in the ring; what the writer
    reused before we got to it counts as dropped. A new reader starts at the newest
    message already published (subject to max_age), never at older history.

    Two paths, chosen once in ``__init__`` (STYLE.md's "make the swap visible"):
    with the native module, ``try_receive`` is the C ``ReaderCore``'s take (the common
    message in the layout validated last, taken, checked and built as a Message in C)
    falling back to ``_try_receive_native`` and ``_accept`` for anything unusual;
    without it (``native=False``, x86-64 only), the pure-Python ``try_receive`` below.
    Both give the same verdict on the same bytes (tests/test_ipc_native_message.py)."""

    def __init__(self, handle: ReaderHandle, *, attach_timeout_s: float = ATTACH_TIMEOUT_S,
                 native: bool | None = None, busy_poll_us: int = 0,
                 spin_us: int = SPIN_US) -> None:
        self.spec = spec = handle.spec
        # Stay awake through a burst before sleeping (_burst); 0: sleep at once.
        if not 0 <= spin_us <= MAX_SPIN_US:
            raise ValueError(f"spin_us must be 0..{MAX_SPIN_US}, not {spin_us!r}")
        # The memory-ordering path (see _atomics): refuses to start where none is correct.
        self._native = nat = _atomics.select(native)
        self._wait_for_writer(handle.data_fd, attach_timeout_s)
        self._mm = shm.map_segment(handle.data_fd, spec.segment_size, writable=False)
        self._buf = memoryview(self._mm)
        self._lease_mm = shm.map_segment(handle.lease_fd, spec.lease_size, writable=True)
        self._efd = handle.event_fd
        self._seg = self._lease_r = None
        if nat is not None:
            # Loads from the read-only mapping, stores into our own lease table.
            self._seg = nat.Region(self._mm)
            self._lease_r = nat.Region(self._lease_mm, True)
            self._ntake = nat.take
            # The native header check. take() runs it itself; a replaced one (tests
            # count its verdicts) is called from here instead, on the same bytes.
            self._naccept = nat.accept
            self._fence = nat.fence_full
            self._seg.load(0)     # acquire the magic: the header it guards is visible
        self._check_channel_header()
        # This reader is the only writer of its lease table: start it clean (a reader
        # that held this index before us may have died holding leases).
        self._lease_mm[:] = bytes(spec.lease_size)
        L.LEASE_HDR.pack_into(self._lease_mm, 0, L.LEASE_MAGIC, os.getpid(), spec.max_leases)
        # Its sleeps, counted from a random start: a writer that remembers sending a
        # wake-up for a previous reader's sleep of this index never takes one of ours
        # for it (K6 in _native.c). Never 0 (0: a reader that does not count).
        self._sleeps = (int.from_bytes(os.urandom(8), "little") >> 4) | 1
        if self._lease_r is not None:
            self._lease_r.store_relaxed(L.OFF_SLEEPS, self._sleeps)
            # Awake: this reader looks at shared memory before it blocks (receive), so
            # the writer may skip wake-ups until it says otherwise (_sleeping).
            self._lease_r.store(L.OFF_AWAKE, L.READER_AWAKE)
        self._free_leases = list(range(spec.max_leases))
        self._layouts: dict[bytes, Layout] = {}
        # Compiled header and receipt readers of this reader's own (a writer's header
        # shapes never evict another channel's: red team 15 row 15).
        self._hdr = codec.HEADER.own()
        self._closed = False
        self._last_layout_raw: bytes | None = None
        self._last_layout: Layout | None = None
        # What the native take needs of it: (bytes, payload span lo, hi).
        self._last_take: tuple[bytes, int, int] | None = None
        # Start at the newest message already published (if any): fresh, not history;
        # from nothing if the header's number is one no honest writer reaches.
        start = self._latest_seq()
        self._last_seq = max(start - 1, 0) if start < _SEQ_HONEST else 0
        # The highest sequence consumed (delivered or rejected), told to the supervisor
        # in the lease table (layout OFF_TAKEN); _last_seq moves below it only for a
        # rehearsal. _jumped: the (slot, gen) refused last as a SequenceJump, not counted
        # again each time it is the only candidate.
        self._pos = 0
        self._jumped: tuple[int, int] | None = None
        self._jump_max = 2 * spec.slot_count
        self._moved(self._last_seq)
        self._last_capture = 0
        self._received = self._dropped = self._lost = 0
        self._skipped = 0      # older messages passed over by take_newest
        self._rejected: Counter[str] = Counter()
        geo = SlotGeometry(spec)
        self._count = spec.slot_count
        self._ctl, self._hdr_at, self._lay_at = geo.control, geo.header, geo.layout
        self._payloads = geo.payload_views(self._buf)
        self._views: list[tuple | None] = [None] * spec.slot_count
        self._plane_views: list[tuple | None] = [None] * spec.slot_count
        self._lease_offsets = [L.lease_offset(k) for k in range(spec.max_leases)]
        self._max_age_ns = spec.max_age_ms * 1_000_000
        self._lease_ns = spec.lease_ms * 1_000_000
        # One poll object for every receive(); not for concurrent use from two threads
        # (nor is the rest of a Reader).
        self._poller = select.poll()
        self._poller.register(self._efd, select.POLLIN)
        self._undrained = False   # the wake-up socket woke us and was not drained yet
        # A blocking wake-up socket (Channel.create) is slept on in one read, which also
        # drains it (_wait); the socket object is a duplicate fd of our end, for
        # SO_RCVTIMEO and the non-blocking drain (MSG_DONTWAIT).
        self._wake = _wake_socket(self._efd)
        # The SO_RCVTIMEO this reader set last (ms, -1: none); None: not set yet (an
        # earlier reader of this socket may have left one).
        self._rcvtimeo_ms: int | None = None
        # Busy-poll around the predicted next message of a periodic stream (_cadence).
        self._cadence = Cadence(busy_poll_us * 1000) if busy_poll_us > 0 else None
        self._rehearsal: Callable[[Message], object] | None = None
        # Off where the reader's own part (a full take) could outlast a window: a CRC'd
        # channel of big slots (~1 ms of CRC per 3 MB); and once one overran its window.
        self._rehearsing = not (spec.crc and spec.slot_size > REHEARSE_CRC_MAX)
        self._rehearsals = 0
        self._rehearsal_error = ""
        self._delivered: tuple[int, int, int] | None = None   # (seq, slot, gen) last
        self._burst = Burst(spin_us * 1000) if spin_us else None
        self._class_seen, self._realtime = -(1 << 62), False   # (_spin: never in RT)
        if self._cadence is not None:        # wake me for announcements (Writer.announce)
            L.U64.pack_into(self._lease_mm, L.OFF_POLLS, L.READER_POLLS)
        self._core = None
        if nat is not None:
            self.try_receive = self._try_receive_native   # the native hot path
            self._stable = self._seg.check
            self._compiled = self._hdr._compiled
            self._actx = codec.native_ctx(spec, _UNREAD, FUTURE_TOLERANCE_NS,
                                          self._max_age_ns)
            self._pay_at = geo.payload
            if hasattr(nat, "ReaderCore"):     # a module built before it: the above
                # The receive path with this reader's constants bound once, its Message
                # built in C (_native.c, native receive); it hands what it does not
                # decide itself to _try_receive_native and _took.
                self._core = nat.ReaderCore(
                    self, self._seg, self._lease_r, self._ctl, self._hdr_at, self._lay_at,
                    self._pay_at, HEADER_MAX, LAYOUT_MAX, _OFF_LAST_SEQ, _OFF_LAST_SLOT,
                    _RETRIES, self._lease_ns, _SEQ_HONEST, self._compiled, self._actx,
                    nat.take, nat.accept, Message)
                self.try_receive = self._core.try_receive

    @property
    def native(self) -> bool:
        """True when this reader runs on the native atomics (supervisor.ipc._native)."""
        return self._native is not None

    def _stable(self, cb: int, gen: int) -> bool:
        """Everything read from slot ``cb``'s data so far was stable iff its generation
        is still ``gen`` (pure Python: x86-64 keeps loads in order by itself)."""
        return _gen_of(self._buf, cb)[0] == gen

    def _wait_for_writer(self, fd: int, timeout: float) -> None:
        # The supervisor starts writers first; the magic is the writer's "ready".
        end = time.monotonic() + timeout
        while True:
            if os.pread(fd, 8, 0) == L.U64.pack(L.MAGIC):
                return
            if time.monotonic() > end:
                raise BridgeError(f"channel {self.spec.name!r}: no writer attached within "
                                  f"{timeout:.1f}s")
            time.sleep(0.005)

    def _check_channel_header(self) -> None:
        s = self.spec
        magic, version, count, size, stride, ctl, chan, *_ = L.CHANNEL_HDR.unpack_from(
            self._buf, 0)
        if (magic, version, count, size, stride, ctl, chan) != (
                L.MAGIC, L.LAYOUT_VERSION, s.slot_count, s.slot_size, s.slot_stride,
                s.control_size, s.channel_id):
            raise BridgeError(f"channel {s.name!r}: segment header does not match the spec")

    def _moved(self, seq: int) -> None:
        """The reader has consumed ``seq``: its position, in its own lease table."""
        if seq > self._pos:
            self._pos = seq
            if self._lease_r is not None:
                self._lease_r.store_relaxed(_OFF_TAKEN, seq)
            else:
                _u64_pack(self._lease_mm, _OFF_TAKEN, seq)

    def _refuse_jump(self, slot: int, gen: int, seq: int, k: int) -> None:
        """A message numbered past any an honest writer reaches from our position: its
        lease is returned and the reader does not move (see SequenceJump). None, not
        counted, when that very message was refused already."""
        self._drop_lease(k)
        if self._jumped == (slot, gen):
            return None
        self._jumped = (slot, gen)
        e = SequenceJump(self.spec.name, f"sequence {seq:#x} is past any an honest "
                         f"writer reaches from {self._pos}", seq)
        self._rejected[e.reason] += 1
        raise e

    def _latest_seq(self) -> int:
        if self._seg is not None:
            return self._seg.load(L.OFF_LAST_SEQ)      # acquire (R1)
        return L.U64.unpack_from(self._buf, L.OFF_LAST_SEQ)[0]

    def _slot_gen(self, slot: int) -> int:
        return _gen_of(self._buf, self._ctl[slot])[0]

    def _drop_lease(self, k: int) -> None:
        if self._lease_r is not None:
            # Generation 0 (release store): the writer reads the entry as empty.
            self._lease_r.store(self._lease_offsets[k] + 8, 0)
        else:
            L.LEASE_ENTRY.pack_into(self._lease_mm, self._lease_offsets[k], 0, 0, 0)
        self._free_leases.append(k)

    def _try_receive_native(self) -> Message | None:
        """``try_receive`` on the native atomics: the slot search, lease, seqlock read
        (with its retries) and, for a message in the layout validated last, every
        header check, the CRC check and the Receipt's reading, in one call (see
        _native.c). Anything the native check does not accept goes to ``_accept``,
        which decides; a CRC it did not confirm is checked again here (and raises)."""
        if self._last_seq >= _MAX_SEQ:
            return None      # nothing can be newer (a hostile writer's last word); as in
                             # the pure-Python path, which compares before it looks
        if self._seg.load(_OFF_LAST_SEQ) <= self._last_seq:
            # Nothing new: the take's own first look (R1, the same acquire load of the
            # writer's last_seq, the same comparison), without the take's 18 arguments.
            # A sleeping receive looks 2-3 times for nothing (before and after the awake
            # flag goes down); one such look cost 2.5 us after a 3.5 MB copy had
            # evicted the caches, this one 1.2 (warm 1.8 vs 0.3).
            return None
        free = self._free_leases
        k = free[-1] if free else -1
        inline = self._naccept is self._native.accept
        got = self._ntake(self._seg, self._lease_r, self._ctl, self._hdr_at, self._lay_at,
                          self._last_seq + 1, k, _now() + self._lease_ns, HEADER_MAX,
                          LAYOUT_MAX, _OFF_LAST_SEQ, _OFF_LAST_SLOT, _RETRIES,
                          self._compiled, self._actx, self._last_capture,
                          self._last_take if inline else None, self._pay_at)
        if got is None:
            return None
        if got is False:
            raise BridgeError(f"channel {self.spec.name!r}: all {self.spec.max_leases} "
                              f"leases are held; release a message before receiving another")
        free.pop()
        return self._took(*got, k, inline)

    def _took(self, slot: int, gen: int, seq: int, raw_h: bytes, raw_l: bytes, stamp,
              receipt, crc_ok: int, k: int, inline: bool = True) -> Message | None:
        """The rest of a native take whose lease ``k`` is held: what the take did not
        accept itself goes to ``_accept``, a CRC it did not confirm is checked here;
        the lease goes back on any exception. (The native core's take calls this for
        every message it does not build itself.)"""
        free = self._free_leases
        try:
            if not inline and raw_l == self._last_layout_raw:
                stamp = self._naccept(raw_h, self._compiled, self._actx, seq, gen, _now(),
                                      self._last_capture)
            if stamp is None or seq >= _SEQ_HONEST:
                return self._accept(slot, gen, seq, k, raw_h, raw_l)
            if self._received or self._rejected:
                self._dropped += seq - self._last_seq - 1
            self._last_seq = seq
            layout = self._last_layout
            if not crc_ok and stamp[4] is not None and self.spec.crc:       # crc32
                try:
                    self._check_crc(slot, gen, seq, layout, stamp[4])
                except Rejected as e:
                    self._rejected[e.reason] += 1
                    raise
        except BaseException:
            if k not in free:
                self._drop_lease(k)
            raise
        return self._message(slot, gen, k, layout, stamp, raw_h, receipt, stamp[6])

    def _check_crc(self, slot: int, gen: int, seq: int, layout: Layout, crc: int) -> None:
        """The payload against the header's CRC-32, then the seqlock again."""
        lo, hi = layout.span
        got = zlib.crc32(self._payloads[slot][lo:hi])
        if not self._stable(self._ctl[slot], gen):
            raise TornRead(self.spec.name, "slot reused during the CRC check", seq)
        if got != crc:
            raise CrcMismatch(self.spec.name, f"payload CRC {got:#010x} != header "
                              f"{crc:#010x}", seq)

    def _message(self, slot: int, gen: int, k: int, layout: Layout, stamp, raw_h: bytes,
                 receipt, capture_ts: int | None) -> Message:
        """The one place a Message is built, for either path (no __init__: a call
        frame less per message)."""
        if capture_ts is not None:
            self._last_capture = capture_ts
        if self._cadence is not None:
            self._cadence.seen(stamp[3], stamp[0], self._announced())
        if self._burst is not None:
            self._burst.took(_now())
        # Taken: the writer may reuse this message's slot first once every reader has
        # (layout OFF_TAKEN). The lease keeps it meanwhile.
        if stamp[0] > self._pos:        # not for a rehearsal's second take
            self._pos = stamp[0]
            if self._lease_r is not None:
                self._lease_r.store_relaxed(_OFF_TAKEN, stamp[0])
            else:
                _u64_pack(self._lease_mm, _OFF_TAKEN, stamp[0])
        self._received += 1
        self._delivered = (stamp[0], slot, gen)
        msg = _new_message(Message)
        msg._reader = self
        msg._core = self._core
        msg._slot = slot
        msg._gen = gen
        msg._lease = k
        msg._layout = layout
        msg.stamp = stamp
        msg._raw_header = raw_h
        msg._receipt = receipt
        msg._array = None
        msg._released = msg._lost = False
        return msg

    # ------------------------------------------------------------ receiving

    def try_receive(self) -> Message | None:
        """The next message, or None if there is none yet. Raises a Rejected subclass
        (already counted, the message skipped) for a message that fails validation."""
        latest, hint = _last_of(self._buf, _OFF_LAST_SEQ)
        if latest <= self._last_seq:
            return None
        msg = self._take_next(hint)
        if msg is not None:
            return msg
        for _ in range(_RETRIES - 1):   # the writer took the slot meanwhile: look again
            latest, hint = _last_of(self._buf, _OFF_LAST_SEQ)
            if latest <= self._last_seq:
                return None
            msg = self._take_next(hint)
            if msg is not None:
                return msg
        return None

    def _take_next(self, hint: int = -1) -> Message | None:
        buf, ctl = self._buf, self._ctl
        want = self._last_seq + 1
        slot = -1
        if 0 <= hint < self._count:
            # The writer's last_slot: the message after ours is usually there. Only a
            # hint; the control block itself must say so.
            gen, seq, _, hlen, llen = _control_of(buf, ctl[hint])
            if seq == want and not gen & 1:
                slot = hint
        if slot < 0:
            best = None
            for i in range(self._count):
                gen, seq = _gen_seq_of(buf, ctl[i])
                if not gen & 1 and seq >= want and (best is None or seq < best[2]):
                    best = (i, gen, seq)
            if best is None:
                return None
            slot, gen, seq = best
            hlen, llen = _control_of(buf, ctl[slot])[3:]
        # hlen/llen, like the bytes they bound, count only if gen is unchanged below.
        free = self._free_leases
        if not free:
            raise BridgeError(f"channel {self.spec.name!r}: all {self.spec.max_leases} "
                              f"leases are held; release a message before receiving another")
        k = free.pop()
        _lease_pack(self._lease_mm, self._lease_offsets[k], slot, gen,
                    _now() + self._lease_ns)
        try:
            mm = self._mm
            at = self._hdr_at[slot]
            raw_h = mm[at:at + (hlen if hlen < HEADER_MAX else HEADER_MAX)]
            at = self._lay_at[slot]
            raw_l = mm[at:at + (llen if llen < LAYOUT_MAX else LAYOUT_MAX)]
            if _gen_of(buf, ctl[slot])[0] != gen:
                self._drop_lease(k)
                return None  # the writer took the slot while we leased it: look again
            return self._accept(slot, gen, seq, k, raw_h, raw_l)
        except BaseException:
            if k not in free:
                self._drop_lease(k)
            raise

    def _accept(self, slot: int, gen: int, seq: int, k: int, raw_h: bytes,
                raw_l: bytes) -> Message | None:
        spec = self.spec
        if seq >= _SEQ_HONEST and seq - self._pos > self._jump_max:
            return self._refuse_jump(slot, gen, seq, k)
        if self._received or self._rejected:
            self._dropped += seq - self._last_seq - 1
        self._last_seq = seq   # accepted or rejected, this sequence is consumed
        self._moved(seq)       # ... and said so before a check can refuse it
        try:
            # A stream repeats one layout: compare with the last bytes first (a memcmp),
            # then the cache of validated layouts keyed by their exact bytes.
            if raw_l == self._last_layout_raw:
                layout = self._last_layout
            else:
                layout = self._layouts.get(raw_l)
                if layout is None:
                    layout = codec.decode_layout(raw_l, spec, spec.slot_size)
                    if len(self._layouts) >= 16:
                        self._layouts.clear()
                    self._layouts[raw_l] = layout
                self._last_layout_raw, self._last_layout = raw_l, layout
                self._last_take = (raw_l, *layout.span)
            stamp = self._hdr.decode(raw_h, spec)
            if stamp[0] != seq or stamp[1] != gen:        # sequence, generation
                raise MalformedHeader(spec.name, f"header says seq {stamp.sequence} gen "
                                      f"{stamp.generation}, control block says seq {seq} "
                                      f"gen {gen}", seq)
            now = _now()
            latest = now + FUTURE_TOLERANCE_NS
            publish_ts, capture_ts = stamp[3], stamp[6]   # publish_ts_ns, capture_ts_ns
            if publish_ts > latest:
                raise FutureTimestamp(spec.name, "publish", publish_ts, now,
                                      FUTURE_TOLERANCE_NS, seq)
            ts = publish_ts
            if capture_ts is not None:
                ts = capture_ts
                if capture_ts > latest:
                    raise FutureTimestamp(spec.name, "frame capture", capture_ts, now,
                                          FUTURE_TOLERANCE_NS, seq)
                if capture_ts > publish_ts:
                    raise MalformedHeader(spec.name, "frame captured after it was published",
                                          seq)
                if capture_ts < self._last_capture:
                    raise SequenceError(spec.name, f"frame {stamp.frame_id} captured at "
                                        f"{capture_ts} ns, before the previous "
                                        f"frame ({self._last_capture} ns): reordered", seq)
            # A receipt's capture time (model outputs) is checked here too, so that no
            # message whose receipt claims a future capture is ever delivered. Only that
            # field is read; the Receipt itself is decoded on demand (msg.receipt).
            receipt = _UNREAD
            r_capture = self._hdr.receipt_capture(raw_h)
            if r_capture is _SLOW:      # an unusual encoding: pycapnp reads it now
                try:
                    receipt = codec.decode_receipt(raw_h, spec, seq, fast=False)
                except Rejected:
                    r_capture = None    # msg.receipt raises (and counts) it on access
                else:
                    r_capture = None if receipt is None else receipt.capture_ts_ns
            if r_capture is not None and r_capture > latest:
                raise FutureTimestamp(spec.name, "receipt capture", r_capture, now,
                                      FUTURE_TOLERANCE_NS, seq)
            if self._max_age_ns and now - ts > self._max_age_ns:
                raise StaleMessage(spec.name, f"{(now - ts) / 1e6:.1f} ms old, channel "
                                   f"max_age is {spec.max_age_ms} ms", seq)
            if stamp[4] is not None and spec.crc:          # crc32
                self._check_crc(slot, gen, seq, layout, stamp[4])
        except Rejected as e:
            self._rejected[e.reason] += 1
            self._drop_lease(k)
            raise
        return self._message(slot, gen, k, layout, stamp, raw_h, receipt, capture_ts)

    def receive(self, timeout: float | None = None, *, newest: bool = False) -> Message:
        """Block on the wake-up socket until a message arrives; with ``busy_poll_us``,
        a regular stream's next message is busy-polled for instead (_busy_poll).
        ``newest``: the newest message instead of the next (``take_newest``), at every
        look, so one published while this reader was waking up skips the older ones."""
        end = None if timeout is None else time.monotonic() + timeout
        take = self.take_newest if newest else self.try_receive
        while True:
            if self._undrained:
                self._drain()
            # Always a look at shared memory after the last wake-up drain and before
            # sleeping again: no wake-up is lost.
            msg = take()
            if msg is not None:
                return msg
            if self._burst is not None:
                msg = self._spin(end, take)
                if msg is not None:
                    return msg
            if self._cadence is not None:
                msg = self._busy_poll(end, take)
                if msg is not None:
                    return msg
            wait_ms = -1
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise ChannelTimeout(f"channel {self.spec.name!r}: nothing within "
                                         f"{timeout:.3f}s")
                wait_ms = max(1, int(left * 1000 + 0.999))
            msg = self._block(wait_ms, None, take)
            if msg is not None:
                return msg

    def take_newest(self) -> Message | None:
        """The newest message published, not the next: every older one not received yet
        is skipped, and counted in ``stats.skipped`` (left by choice, not lost to the
        writer: ``stats.dropped`` stays for those). None if there is nothing newer than
        the message received last. For a consumer that wants the present, not a backlog:
        modeld under overload, where a frame it cannot get to before the next one is of
        no use. Raises what ``try_receive`` raises for that message (counted, consumed;
        the older ones skipped all the same)."""
        last = self._last_seq
        latest = self._latest_seq()
        if latest <= last + 1 or latest >= _SEQ_HONEST:
            # Nothing to skip over; or a number no honest writer reaches (SequenceJump):
            # in order then, so that what the jump rule refuses never hides the honest
            # messages before it from this reader.
            return self.try_receive()
        self._last_seq = latest - 1
        try:
            msg = self.try_receive()
        finally:
            if self._last_seq == latest - 1:
                self._last_seq = last       # nothing consumed (raced, no lease): as before
            else:
                self._skipped += latest - 1 - last
        if msg is None and self._last_seq == last:
            # Nothing at or after the number the header claims: the writer took that
            # slot meanwhile, or the header lies (red team round 4: a header held at a
            # low number starved this path forever). The next message in order, then.
            return self.try_receive()
        return msg

    def _busy_poll(self, end: float | None, take: Callable[[], Message | None]
                   ) -> Message | None:
        """``receive``, on a stream regular enough to predict, or whose writer announced
        its next message (Writer.announce): sleep (on the wake-up socket, so an early
        message still wakes us) until the window before the next message opens, then
        watch shared memory until it comes or the window closes. None: nothing in the
        window (or no window); the caller blocks as usual."""
        cad = self._cadence
        nxt = self._last_seq + 1
        heard = self._announced()
        end_ns = None if end is None else int(end * 1e9)
        now = _now()
        w = cad.next_window(nxt, *heard, now)
        if (cut := _cut(w, end_ns, now)) is None:
            return None
        start, stop = cut
        while now < start:
            # Never spin before the window opens (red team: sleeping rounded down to
            # poll's whole ms cost up to 1 ms more than 2 x busy_poll_us). A message
            # that comes while we sleep still wakes us; a wake-up byte without one
            # (the writer holds the socket's other end) only means sleeping on
            # (review: spinning from there cost 180 ms of CPU in a 200 ms period).
            if self._undrained:
                self._drain()
            msg = self._block(min(-(-(start - now) // 1_000_000), _MAX_SLEEP_MS),
                              (start - now) / 1e9, take)
            if msg is not None:
                return msg
            # Woken without a message: perhaps by an announcement (the writer wakes
            # a busy-polling reader for one), made or moved since the window was
            # chosen: a writer that knows better later (modeld, once preprocessing is
            # done) moves a window not yet opened. Still one window per message
            # (``spent`` is set only once one opens).
            now = _now()
            if (a := self._announced()) != heard:
                heard = a
                w = cad.next_window(nxt, *heard, now)
                if (cut := _cut(w, end_ns, now)) is None:
                    return None
                start, stop = cut
        cad.spent = (nxt, *w)
        if self._rehearsing:
            cpu = _cpu_ns()
            self._rehearse()
            if _cpu_ns() - cpu > 2 * cad.lead_ns:
                # More CPU than a whole window: it would break the CPU bound (2 x lead);
                # the reader's part too (a big CRC'd frame). CPU, not wall time: a worker
                # in the normal class preempted meanwhile has not spent it (README run:
                # one preemption turned controlsd's rehearsal off for good).
                self._rehearsing, self._rehearsal = False, None
                self._rehearsal_error = "longer than the busy-poll window"
        msg = self._watch_until(stop, take)
        if msg is None:
            cad.misses += 1
        else:
            cad.hits += 1
        return msg

    def _watch_until(self, stop: int, take: Callable[[], Message | None]
                     ) -> Message | None:
        """Look at shared memory, without sleeping, until a message or ``stop`` (ns)."""
        while _now() < stop:
            msg = take()
            if msg is not None:
                return msg
        return None

    def _spin(self, end: float | None, take: Callable[[], Message | None]
              ) -> Message | None:
        """In a burst, look on until ``spin_us`` after the last message before sleeping
        (_burst): the awake flag stays up, so the writer sends no wake-up meanwhile."""
        burst = self._burst
        stop = burst.until(None if end is None else int(end * 1e9))
        now = _now()
        if stop <= now:
            return None             # not in a burst, or its spin is over already
        if now - self._class_seen > 1_000_000_000:
            # A reader in a real-time class never spins: above its writer on a shared
            # CPU it would take the CPU the writer needs to publish (_burst). Its class
            # is given from outside (the supervisor, at READY): looked at once a second.
            self._class_seen = now
            self._realtime = os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR)
        if self._realtime:
            return None
        msg = self._watch_until(stop, take)
        if msg is None:
            burst.misses += 1
        else:
            burst.hits += 1
        return msg

    def rehearse(self, fn: Callable[[Message], object] | None) -> None:
        """Rehearse the worker's per-message work at the start of each busy-poll window.

        Why: after the 50 ms between two messages, everything a message's path runs is
        cold (a VM's host reuses the CPU's caches meanwhile): here, a cold take,
        decode and control law cost ~2.3x what they cost warm. A window is CPU spent
        waiting anyway, so it begins by running that path once on the message delivered
        last: the reader takes it again in full (every check, lease, Message) with its
        own state put back afterwards, calls ``fn(msg)`` (None: the reader's part only)
        and releases it. ``fn`` only ever sees that very message (sequence, slot and
        generation), never one the reader rejected or has not delivered yet.

        ``fn`` must have no effect: compute and throw away; whatever it returns is
        dropped. A BridgeError from it (hostile bytes it refuses) skips that rehearsal;
        any other exception turns it off (``stats.rehearsal_error``). A rehearsal that
        spends more CPU than a whole window (the CPU bound of busy-polling) turns all of
        rehearsing off. Receiving goes on either way. Without busy_poll_us there are no
        windows and no rehearsals; the reader's own part runs in every window, except on
        a CRC'd channel of slots over REHEARSE_CRC_MAX bytes (its CRC alone could
        outlast a window)."""
        self._rehearsal = fn
        self._rehearsal_error = ""

    def _rehearse(self) -> None:
        """One rehearsal (see ``rehearse``): the message delivered last, taken again,
        given to the worker's rehearsal, released; the reader's state as it was."""
        last = self._delivered
        if last is None or not self._free_leases or not self._rehearsing:
            return
        saved = (self._last_seq, self._dropped, self._received, self._last_capture,
                 self._lost, self._rejected, self._cadence, self._delivered, self._burst)
        self._last_seq = last[0] - 1
        self._rejected, self._cadence, self._burst = Counter(), None, None
        try:
            try:
                msg = self.try_receive()
            except BridgeError:
                msg = None      # that message is gone or no longer acceptable
            if msg is not None:
                try:
                    fn = self._rehearsal
                    # Only the very message delivered last (red team: a reused slot
                    # gave the next one, not delivered yet; a rejected one came back).
                    if fn is not None and (msg.stamp[0], msg._slot, msg._gen) == last:
                        fn(msg)
                except BridgeError:
                    pass            # the worker refused hostile bytes: this time only
                except Exception as e:   # the worker's rehearsal: never the real path
                    self._rehearsal = None
                    self._rehearsal_error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                finally:
                    try:
                        msg.release()
                    except BridgeError:
                        pass    # LeaseLost: the writer reused the slot meanwhile
        finally:
            (self._last_seq, self._dropped, self._received, self._last_capture,
             self._lost, self._rejected, self._cadence, self._delivered,
             self._burst) = saved
        self._rehearsals += 1

    def _announced(self) -> tuple[int, int]:
        """(sequence number, due ns) of the writer's announced next publish (layout
        OFF_NEXT_SEQ): the sequence number acquired first, so the due read after it is
        the one stored for it or a later one (Writer.announce stores the due first)."""
        if self._seg is not None:
            return self._seg.load(L.OFF_NEXT_SEQ), self._seg.load_relaxed(L.OFF_NEXT_DUE)
        return L.U64.unpack_from(self._buf, L.OFF_NEXT_SEQ)[0], \
            L.U64.unpack_from(self._buf, L.OFF_NEXT_DUE)[0]

    def _block(self, wait_ms: int, precise_s: float | None = None,
               take: Callable[[], Message | None] | None = None) -> Message | None:
        """One wait on the wake-up socket (the awake flag down meanwhile, native path);
        the message it woke us for, if any. ``precise_s``: wait that long instead, to
        the microsecond (select; poll counts whole ms), where the fd allows it.
        ``take``: how to look (try_receive, or take_newest)."""
        take = take or self.try_receive
        if self._lease_r is not None:
            msg = self._sleeping(take)
            if msg is not None:
                return msg
            try:
                woke = self._wait(wait_ms, precise_s)
            finally:
                self._lease_r.store(L.OFF_AWAKE, L.READER_AWAKE)
        else:
            woke = self._wait(wait_ms, precise_s)
        if woke:
            # Woken: take the message first (a socket only polled is drained on the
            # next call: a system call fewer between the wake-up and the message).
            return take()
        return None

    def _wait(self, wait_ms: int, precise_s: float | None) -> bool:
        """Sleep until a wake-up byte (True) or ``wait_ms`` (-1: no limit) has passed.
        A byte read here leaves the socket drained; one only polled for is drained
        on the next receive (_undrained)."""
        if precise_s is None and self._wake is not None and (
                wait_ms < 0 or wait_ms >= _READ_MIN_MS):
            return self._read_wait(wait_ms)
        if (precise_s is not None and self._efd < _FD_SETSIZE
                and precise_s <= _MAX_SLEEP_MS / 1000):
            woke = bool(select.select((self._efd,), (), (), precise_s)[0])
        else:
            woke = bool(self._poller.poll(wait_ms))
        self._undrained |= woke
        return woke

    def _read_wait(self, wait_ms: int) -> bool:
        """One blocking read of the wake-up socket: the wake-up and the drain in one
        system call (poll + read were two). Its timeout ends short of ``wait_ms`` (see
        _READ_MIN_MS); False then, and the caller's next wait polls for the rest."""
        ms = -1 if wait_ms < 0 else (
            (wait_ms - _READ_MARGIN_MS) // _READ_QUANTUM_MS * _READ_QUANTUM_MS)
        if ms != self._rcvtimeo_ms:
            sec, ms_left = divmod(max(ms, 0), 1000)
            self._wake.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                  _TIMEVAL.pack(sec, ms_left * 1000))
            self._rcvtimeo_ms = ms
        try:
            os.read(self._efd, 256)   # b"": the writer's end is closed (as POLLHUP)
        except (BlockingIOError, InterruptedError):
            return False              # SO_RCVTIMEO ran out
        except OSError:
            pass     # a socket error (ECONNRESET) wakes us, as POLLERR would; not raised
        return True

    def _sleeping(self, take: Callable[[], Message | None] | None = None
                  ) -> Message | None:
        """Native path, before blocking on the wake-up socket: count the sleep (K0),
        say so (the writer then sends one wake-up for it), fence, look once more (K1-K3
        in _native.c). A message found means awake again; an exception leaves the flag
        down (only more wake-ups)."""
        self._sleeps += 1
        self._lease_r.store_relaxed(L.OFF_SLEEPS, self._sleeps)        # K0
        self._lease_r.store(L.OFF_AWAKE, 0)                            # K1 (release)
        self._fence()
        msg = (take or self.try_receive)()
        if msg is not None:
            self._lease_r.store(L.OFF_AWAKE, L.READER_AWAKE)
        return msg

    async def receive_async(self, *, min_wake_s: float = 0.0) -> Message:
        """trio: wait for the wake-up socket to become readable without blocking the loop.
        ``min_wake_s``: look at shared memory at most once per that interval when woken
        for nothing (the supervisor's monitor: a writer ringing its wake-up socket
        without publishing cost the supervisor ~0.5 s of CPU a second; red team round 3)."""
        import trio

        woken = 0.0
        while True:
            if self._undrained:
                self._drain()
            msg = self.try_receive()
            if msg is not None:
                # Yield (uncancellably: the message holds a lease) so that a writer
                # faster than this reader cannot starve the rest of the trio loop.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return msg
            if min_wake_s and (left := woken + min_wake_s - time.monotonic()) > 0:
                await trio.sleep(left)
                continue
            if self._lease_r is not None:
                msg = self._sleeping()
                if msg is not None:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return msg
                try:
                    await trio.lowlevel.wait_readable(self._efd)
                finally:
                    self._lease_r.store(L.OFF_AWAKE, L.READER_AWAKE)
            else:
                await trio.lowlevel.wait_readable(self._efd)
            woken = time.monotonic()
            self._drain()

    def _drain(self) -> None:
        self._undrained = False
        try:
            # Every wake-up byte so far (a stream socket), without blocking.
            if self._wake is not None:
                self._wake.recv(65536, socket.MSG_DONTWAIT)
            else:
                os.read(self._efd, 65536)
        except OSError:
            pass

    @property
    def stats(self) -> ReaderStats:
        cad, burst = self._cadence, self._burst
        return ReaderStats(self._received, self._dropped, dict(self._rejected), self._lost,
                           cad.hits if cad else 0, cad.misses if cad else 0,
                           self._rehearsals, self._rehearsal_error,
                           burst.hits if burst else 0, burst.misses if burst else 0,
                           self._skipped)

    def close(self) -> None:
        self._closed = True               # its messages say so (Message.check)
        if self._wake is not None:
            self._wake.close()            # our duplicate only; the handle's fd stays
            self._wake = None
        if self._lease_r is not None:
            for off in self._lease_offsets:
                self._lease_r.store(off + 8, 0)
            # The regions hold buffer exports of the mappings: drop them first.
            self._seg.release()
            self._lease_r.release()
        for off in self._lease_offsets:
            L.LEASE_ENTRY.pack_into(self._lease_mm, off, 0, 0, 0)
        self._lease_mm.close()
        self._views = [None] * self.spec.slot_count
        self._plane_views = [None] * self.spec.slot_count
        for view in self._payloads:
            try:
                view.release()
            except BufferError:
                pass  # a message's array still uses it
        try:
            self._buf.release()
        except BufferError:
            pass  # views still alive
        # Never mmap.close(): a message's numpy array keeps no buffer export, so it would
        # unmap under it and a read through it would crash the process. The mapping goes
        # when the last reference to it does (this reader's, or an array's).

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
