"""The single writer of a channel: loans a free slot, fills it in place, publishes."""
from __future__ import annotations

import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from . import _atomics, codec, layout as L, shm
from ._geometry import HEADER_MAX, LAYOUT_MAX, SlotGeometry
from ._loan import Loan
from .channel import WriterHandle
from .errors import BridgeError
from .receipt import Receipt

_LAST_SEQ_WORD = L.OFF_LAST_SEQ // 8
_OFF_LAST_SLOT, _OFF_LAST_SEQ = L.OFF_LAST_SLOT, L.OFF_LAST_SEQ
# Above this a sequence or generation was not reached by counting (layout.PLAUSIBLE).
PLAUSIBLE = L.PLAUSIBLE


@dataclass(frozen=True)
class WriterStats:
    published: int
    leases_honoured: int    # times a slot was skipped because a live lease protected it
    loans_discarded: int


class Writer:
    """The one process allowed to write a channel's segment."""

    def __init__(self, handle: WriterHandle, *, domain: str = "unknown",
                 seal: bool = True, native: bool | None = None,
                 above_readers: Iterable[int] = ()) -> None:
        """``above_readers``: reader indexes whose positions (layout OFF_TAKEN) are
        read at attach into ``reader_positions``, for
        the supervisor's last word after a writer it cannot trust died: it publishes
        above each (``continue_from``; failsafe.publish_safe). ``segment_sequence`` is
        what the segment's own words gave, where the next publish continues."""
        self.spec = spec = handle.spec
        # The memory-ordering path (see _atomics): refuses to start where none is correct.
        self._native = nat = _atomics.select(native)
        self._handle = handle
        # The capnp Domain enum names the domains the schema knows.
        self._domain = domain if domain in ("control", "research", "supervisor") else "unknown"
        self._pid = os.getpid()
        try:
            self._mm = shm.map_segment(handle.data_fd, spec.segment_size, writable=True)
        except PermissionError:
            raise BridgeError(f"channel {spec.name!r}: segment is sealed by a previous "
                              f"writer; the supervisor must re-create the channel") from None
        if seal:
            shm.seal_writes(handle.data_fd)
        self._buf = memoryview(self._mm)
        # The seqlock words (generations, last_seq) as 8-byte words: one store each
        # (see layout: struct.pack_into would pass through 0).
        self._words = self._buf.cast("Q")
        self._leases = [shm.map_segment(fd, spec.lease_size, writable=False)
                        for fd in handle.lease_fds]
        # One lease entry with its padding to the next: iter_unpack walks a table.
        self._lease_entry = struct.Struct(
            L.LEASE_ENTRY.format + f"{L.LEASE_STRIDE - L.LEASE_ENTRY.size}x")
        self._lease_span = slice(L.LEASE_BASE, L.lease_offset(spec.max_leases))
        self._events = tuple(handle.event_fds)
        self._gen = [0] * spec.slot_count
        self._seq = [0] * spec.slot_count
        self._last_seq = 0
        self._loaned: set[int] = set()
        self._layout_cache: dict[tuple, bytes] = {}
        self._frame_cache: dict[tuple, tuple] = {}
        # Compiled SlotHeader writers, by (has_crc, has_frame).
        self._header_plans: dict[tuple, codec.HeaderPlan] = {}
        # ... and for receipts, by (has_crc, has_frame, device, artifact_sha256).
        self._receipt_plans: dict[tuple, codec.HeaderPlan] = {}
        self._geo = geo = SlotGeometry(spec)
        self._ctl = geo.control
        self._ctl_word = tuple(cb // 8 for cb in geo.control)
        self._payloads = geo.payload_views(self._buf)
        self._plane_cache: list[dict[tuple, tuple]] = [{} for _ in self._payloads]
        self._published = self._honoured = self._discarded = 0
        self._lease_ns = spec.lease_ms * 1_000_000
        self._seg = None
        # Native path: tensors described per (shape, dtype, strides, offset) once, and
        # fresh views of arrays kept per slot (numpy builds a view of an array much
        # faster than an array from a buffer).
        self._array_cache: dict[tuple, tuple] = {}
        self._array_views: list[dict[tuple, np.ndarray]] = [{} for _ in self._payloads]
        # (layout key, no frame, layout bytes, header plan) of the description published
        # last without a receipt on a channel without CRC: the next publish of it needs
        # no lookup (_publish_native).
        self._fast: tuple | None = None
        if nat is not None:
            self._seg = nat.Region(self._mm, True)
            self._lease_regions = tuple(nat.Region(mm) for mm in self._leases)
            self._nloan, self._npublish, self._npack = nat.loan, nat.publish, nat.pack_header
            # A stream's repeat publish in one call (Loan.publish; self._hot is made
            # with self._fast in _publish_native).
            self._nhot = nat.publish_hot
            self._hot: tuple | None = None
            self._fence = nat.fence_full
            # Per reader, the sleep it was last sent a wake-up for (K6 in _native.c):
            # the writer's own memory, one 8-byte word each.
            self._sent_mm = mmap.mmap(-1, max(8, 8 * len(self._events)))
            self._sent = nat.Region(self._sent_mm, True)
            # The SlotLayout bytes object each slot holds (as this writer wrote it last).
            self._slot_layout: list[bytes | None] = [None] * spec.slot_count
            self._slot_layout_gen = [0] * spec.slot_count
            # Instance attributes: the native hot path replaces the pure-Python one.
            self.loan = self._loan_native
            self._publish = self._publish_native
            self._discard = self._discard_native
        self._attach(tuple(above_readers))

    def continue_from(self, seq: int) -> None:
        """Number the next publish ``seq + 1`` (never backwards): the supervisor's last
        word, published once above each reader's position (failsafe.publish_safe)."""
        if seq > self._last_seq:
            self._last_seq = seq

    @property
    def native(self) -> bool:
        """True when this writer runs on the native atomics (supervisor.ipc._native)."""
        return self._native is not None

    # A restarted writer continues the sequence and generations it finds, so readers
    # never see a sequence go backwards.
    def _attach(self, above_readers: tuple[int, ...] = ()) -> None:
        spec, buf = self.spec, self._buf
        magic, version, count, size, stride, ctl, *_ = L.CHANNEL_HDR.unpack_from(buf, 0)
        if magic == L.MAGIC and (version, count, size, stride, ctl) != (
                L.LAYOUT_VERSION, spec.slot_count, spec.slot_size, spec.slot_stride,
                spec.control_size):
            raise BridgeError(f"channel {spec.name!r}: segment layout does not match spec")
        # What a previous (perhaps compromised) writer left is continued only where a
        # writer could have reached it by counting: a word at or above PLAUSIBLE is
        # emptied, never continued (near 2**64 the next increments would overflow), and
        # a header without the magic (zeroed by the dead writer) does not make the slots
        # new: their generations go on, so no reader's lease or seqlock goes backwards.
        # The segment's own words are continued only below SEQ_HONEST - 1, so that the
        # next number is one every reader takes (any below SEQ_HONEST): readers refuse a
        # far jump above it, and continuing from there would leave this writer unheard
        # (red team round 3: a dead writer left last_seq at 2**62 - 1; round 5: at
        # SEQ_HONEST - 1, which numbered the SAFE SEQ_HONEST, refused by every reader).
        # Readers that did consume such a number get their own SAFE (publish_safe) or
        # are continued above (resume_point).
        bound = L.SEQ_HONEST - 1
        last = L.U64.unpack_from(buf, L.OFF_LAST_SEQ)[0] if magic == L.MAGIC else 0
        last = last if last < bound else 0
        for i, cb in enumerate(self._ctl):
            gen, seq = L.GEN_SEQ.unpack_from(buf, cb)
            # The supervisor's last word also empties what no honest writer numbered:
            # a reader close below it would take such a message after the SAFE.
            empty = gen & 1 or gen >= PLAUSIBLE or seq >= (
                bound if above_readers else PLAUSIBLE)
            self._gen[i] = 0 if gen >= PLAUSIBLE else gen + (gen & 1)
            self._seq[i] = 0 if empty else seq
            if self._seq[i] < bound:
                last = max(last, self._seq[i])
            # An abandoned slot (a loan held at exit: NextLoan always holds one), or one
            # with words no writer reached, is left invalid: seq 0 stored first, then an
            # even generation (review: its old seq made a lagging reader read a
            # half-written header).
            if self._seg is not None:
                if empty:
                    self._seg.store(cb + L.OFF_SEQ, 0)
                self._seg.store(cb, self._gen[i])
            else:
                if empty:
                    self._words[cb // 8 + 1] = 0
                self._words[cb // 8] = self._gen[i]
        # Above every named reader's position (its own table: the dead writer could not
        # touch it): a reader that consumed a number the segment no longer shows (rolled
        # back, or a rejected message's) must still receive what comes next.
        self.segment_sequence = last
        positions = (self._position(k) for k in above_readers)
        self.reader_positions: tuple[int, ...] = tuple(sorted(
            p for p in positions if p is not None and p < PLAUSIBLE))
        if above_readers:
            self._last_seq = last   # the caller numbers above the positions it trusts
        else:
            # A worker's writer, perhaps restarted after a hostile one walked its readers
            # past SEQ_HONEST: above the positions of the readers the supervisor trusts,
            # as far as its monitor corroborates them (red team round 4).
            h = self._handle
            held = (self._position(k) for k in h.resume_above)
            self._last_seq = L.resume_point(
                last, [p for p in held if p is not None],
                None if h.anchor is None else self._position(h.anchor),
                2 * spec.slot_count)
        if self._seg is None:
            L.CHANNEL_HDR.pack_into(buf, 0, L.MAGIC, L.LAYOUT_VERSION, spec.slot_count,
                                    spec.slot_size, spec.slot_stride, spec.control_size,
                                    spec.channel_id, self._pid, self._last_seq, 0, 0)
            return
        # Every header field first, the magic last with a release store: a reader that
        # sees the magic (acquire) sees the header it guards.
        magic = L.U64.unpack_from(buf, 0)[0]
        L.CHANNEL_HDR.pack_into(buf, 0, magic, L.LAYOUT_VERSION, spec.slot_count,
                                spec.slot_size, spec.slot_stride, spec.control_size,
                                spec.channel_id, self._pid, self._last_seq, 0, 0)
        self._seg.store(0, L.MAGIC)

    def _position(self, k: int) -> int | None:
        """Reader ``k``'s position (layout OFF_TAKEN), None where no reader attached."""
        if not 0 <= k < len(self._leases):
            return None
        mm = self._leases[k]
        if L.U64.unpack_from(mm, 0)[0] != L.LEASE_MAGIC:
            return None
        return L.U64.unpack_from(mm, L.OFF_TAKEN)[0]

    def _protected(self, now: int, lapsed: set[int] | None = None) -> set[int]:
        """Slots a live lease protects; a lease counts only for the slot's current
        generation and within the channel's lease bound, whatever the reader wrote.
        ``lapsed`` gets the slots still named by a lease past that bound."""
        limit = now + self.spec.lease_ms * 1_000_000
        count, gens, entries, span = (self.spec.slot_count, self._gen,
                                      self._lease_entry.iter_unpack, self._lease_span)
        out = set()
        for mm in self._leases:
            for slot, gen, deadline in entries(mm[span]):
                if gen and slot < count and gen == gens[slot]:
                    if now < deadline <= limit:
                        out.add(slot)
                    elif lapsed is not None:
                        lapsed.add(slot)
        return out

    def _taken(self) -> int:
        """The sequence number every reader has taken (layout OFF_TAKEN, the smallest
        over the lease tables of readers that attached; 0: none, or no reader)."""
        return min((L.U64.unpack_from(mm, L.OFF_TAKEN)[0] for mm in self._leases
                    if L.U64.unpack_from(mm, 0)[0] == L.LEASE_MAGIC), default=0)

    def _choose(self, protected: set[int], lapsed: frozenset[int] | set[int] = frozenset()
                ) -> int:
        """The slot a loan takes, of those not ``protected`` nor on loan (-1: none): the
        newest one every reader has taken already (nobody's message to lose, and still
        in the caches; not one still held on a ``lapsed`` lease: that goes in its
        oldest-first turn), else the oldest. The native loan makes the same choice
        (_native.c; tests/test_ipc_slot_reuse.py holds them to it)."""
        loaned, seqs = self._loaned, self._seq
        taken = self._taken()
        slot = done = -1
        for i in range(self.spec.slot_count):
            if i in protected or i in loaned:
                continue
            if slot < 0 or seqs[i] < seqs[slot]:
                slot = i
            if (0 < seqs[i] <= taken and i not in lapsed
                    and (done < 0 or seqs[i] > seqs[done])):
                done = i
        return done if done >= 0 else slot

    def loan(self) -> Loan:
        """Claim a slot no live lease protects (``_choose``). Never blocks."""
        lapsed: set[int] = set()
        protected = self._protected(time.monotonic_ns(), lapsed)
        loaned = self._loaned
        slot = self._choose(protected, lapsed)
        if slot < 0:
            if len(loaned) >= self.spec.slot_count - self.spec.max_readers * self.spec.max_leases:
                raise BridgeError(f"channel {self.spec.name!r}: too many open loans")
            raise BridgeError(f"channel {self.spec.name!r}: no free slot (leases exceed bound)")
        if protected:
            self._honoured += len(protected - loaned)
        # Odd generation: readers that look now see "being written" and keep off.
        self._gen[slot] += 1
        self._words[self._ctl_word[slot]] = self._gen[slot]
        loaned.add(slot)
        return Loan(self, slot)

    def _discard(self, loan: Loan) -> None:
        # The slot's old contents may be half overwritten: leave it invalid (seq 0).
        slot = loan.slot
        self._gen[slot] += 1
        self._seq[slot] = 0
        at = self._ctl_word[slot]
        self._words[at + 1] = 0               # seq, while the generation is still odd
        self._words[at] = self._gen[slot]
        self._loaned.discard(slot)
        self._discarded += 1

    def _loan_native(self) -> Loan:
        """``loan`` on the native atomics: the same choice, one call (see _native.c)."""
        now = time.monotonic_ns()
        slot, honoured = self._nloan(self._seg, self._lease_regions, self._ctl, self._gen,
                                     self._seq, self._loaned, now, now + self._lease_ns,
                                     self.spec.max_leases)
        if slot < 0:
            if len(self._loaned) >= (self.spec.slot_count
                                     - self.spec.max_readers * self.spec.max_leases):
                raise BridgeError(f"channel {self.spec.name!r}: too many open loans")
            raise BridgeError(f"channel {self.spec.name!r}: no free slot (leases exceed bound)")
        self._honoured += honoured
        return Loan(self, slot)

    def _discard_native(self, loan: Loan) -> None:
        slot = loan.slot
        self._gen[slot] += 1
        self._seq[slot] = 0
        cb = self._ctl[slot]
        self._seg.store(cb + L.OFF_SEQ, 0)          # seq 0 (invalid), then
        self._seg.store(cb, self._gen[slot])        # the even generation (release)
        self._loaned.discard(slot)
        self._discarded += 1

    def _header_plan(self, has_crc: bool, has_frame: bool) -> codec.HeaderPlan:
        plan = codec.HEADER.plan(self.spec, self._pid, self._domain, has_crc, has_frame)
        if plan.size > HEADER_MAX:
            raise BridgeError(f"header needs {plan.size} bytes > {HEADER_MAX}")
        self._header_plans[has_crc, has_frame] = plan
        return plan

    def _receipt_plan(self, has_crc: bool, has_frame: bool, receipt: Receipt
                      ) -> codec.HeaderPlan | None:
        """The compiled header writer for this receipt's (device, sha256), or None when
        there is none (pycapnp then encodes: its errors are the ones a caller sees)."""
        try:
            key = (has_crc, has_frame, receipt.device, receipt.artifact_sha256)
            plan = self._receipt_plans.get(key)
        except (AttributeError, TypeError):
            return None
        if plan is None:
            try:
                plan = codec.HEADER.plan_receipt(self.spec, self._pid, self._domain, has_crc,
                                                 has_frame, *key[2:])
            except Exception:
                return None
            if plan.size > HEADER_MAX:
                return None           # the pycapnp path raises the BridgeError
            if len(self._receipt_plans) >= 16:
                self._receipt_plans.clear()
            self._receipt_plans[key] = plan
        return plan

    def _encode(self, loan: Loan, frame_id, capture_ts_ns, exposure_us, gain,
                publish_ts_ns, receipt: Receipt | None) -> tuple:
        """SlotHeader and SlotLayout into the loaned slot (generation still odd).
        Returns (slot, seq, gen, header position, header size, publishTsNs offset in it,
        layout size); on any failure the slot goes back, invalid, and the error rises."""
        spec, buf, slot = self.spec, self._buf, loan.slot
        try:
            # Everything that can fail, and everything that does not need the time,
            # comes first: the slot is still odd (being written), readers keep off.
            raw_layout = self._layout_cache.get(loan._lkey)
            if raw_layout is None:
                dt, shape, strides, offset = loan._desc
                raw_layout = codec.encode_layout(dt, shape, strides, offset, loan._frame)
                if len(raw_layout) > LAYOUT_MAX:
                    raise BridgeError(f"layout needs {len(raw_layout)} bytes > {LAYOUT_MAX}")
                if len(self._layout_cache) > 64:
                    self._layout_cache.clear()
                self._layout_cache[loan._lkey] = raw_layout
            crc = None
            if spec.crc:
                lo, hi = loan._span          # tensor_span of loan._desc, from the loan
                crc = zlib.crc32(loan._payload[lo:hi])
            seq = self._last_seq + 1
            gen = self._gen[slot] + 1
            base = self._geo.header[slot]
            if receipt is None:
                plan = (self._header_plans.get((crc is not None, frame_id is not None))
                        or self._header_plan(crc is not None, frame_id is not None))
                # The whole header, with publishTsNs as given or 0 until stamped below.
                plan.pack_into(buf, base, seq, gen, publish_ts_ns or 0, crc, frame_id,
                               capture_ts_ns, exposure_us, gain)
                size, ts_off = plan.size, plan.ts_pos
            else:
                plan = self._receipt_plan(crc is not None, frame_id is not None, receipt)
                if plan is not None:
                    try:
                        plan.pack_into(buf, base, seq, gen, publish_ts_ns or 0, crc,
                                       frame_id, capture_ts_ns, exposure_us, gain, receipt)
                        size, ts_off = plan.size, plan.ts_pos
                    except Exception:
                        plan = None   # values pycapnp must judge (it raises or encodes)
            if receipt is not None and plan is None:
                # pycapnp builds what no compiled plan covers (it is also the reference
                # every plan is checked against when it is made).
                raw = codec.encode_header(
                    spec, sequence=seq, generation=gen, writer_pid=self._pid,
                    domain=self._domain, publish_ts_ns=publish_ts_ns or 0, crc32=crc,
                    frame_id=frame_id, capture_ts_ns=capture_ts_ns,
                    exposure_us=exposure_us, gain=gain, receipt=receipt)
                if len(raw) > HEADER_MAX:
                    raise BridgeError(f"header needs {len(raw)} bytes > {HEADER_MAX}")
                buf[base:base + len(raw)] = raw
                size, ts_off = len(raw), codec.publish_ts_offset(raw)
            nl = len(raw_layout)
            lpos = self._geo.layout[slot]
            buf[lpos:lpos + nl] = raw_layout
        except BaseException:
            self._discard(loan)   # nothing was published: the slot goes back, invalid
            raise
        return slot, seq, gen, base, size, ts_off, nl

    def _hot_failed(self, loan: Loan, seq: int) -> None:
        """``Loan.publish``'s one call (``_native.publish_hot``) raised, or something
        raised right after it (a signal lands between two calls): a slot no longer on
        loan went out (the call books it last, once every store is done): its sequence
        is counted here; one still on loan was not published and goes back, invalid."""
        if loan.slot in self._loaned:
            self._discard(loan)
        elif self._last_seq < seq:
            self._last_seq = seq
            self._published += 1

    def _publish_native(self, loan: Loan, frame_id, capture_ts_ns, exposure_us, gain,
                        publish_ts_ns, receipt: Receipt | None = None) -> int:
        """Publish on the native atomics: control block, time stamp, the release stores
        of the generation and last_seq, and the wake-ups in one call (see _native.c).
        A header of a compiled shape (with or without a receipt) is written by the
        native plan, and a layout the slot already holds (this writer wrote it there
        last) is not written again; everything else goes through ``_encode``."""
        slot = loan.slot
        plan = crc = extra = None
        fast = self._fast
        if (fast is not None and fast[0] is loan._lkey and receipt is None
                and (frame_id is None) is fast[1]):
            # The description published last, again (a stream): its layout bytes and
            # header plan by the identity of its cached key, without hashing it or
            # looking up a plan. Between the publish stamp and the wake-up every object
            # touched is a cache miss when the writer ran cold (a frame copied just
            # before evicts them): with 16 MB touched between publishes, publish() ->
            # the native call took 14.7 us at 64 B before this path, 12.2 after (1.5 warm).
            raw_layout, plan = fast[2], fast[3]
        elif (raw_layout := self._layout_cache.get(loan._lkey)) is not None:
            if self.spec.crc:
                lo, hi = loan._span          # tensor_span of loan._desc, from the loan
                crc = zlib.crc32(loan._payload[lo:hi])
            if receipt is None:
                plan = self._header_plans.get((crc is not None, frame_id is not None))
            else:
                try:
                    plan = self._receipt_plan(crc is not None, frame_id is not None, receipt)
                    extra = plan.receipt_values(receipt) if plan is not None else None
                except Exception:
                    plan = None          # values pycapnp must judge (_encode discards)
                except BaseException:
                    self._discard(loan)  # nothing was published: the slot goes back
                    raise
        if plan is not None and plan.native is not None:
            if fast is None or fast[0] is not loan._lkey:
                if receipt is None and crc is None and not self.spec.crc:
                    self._fast = (loan._lkey, frame_id is None, raw_layout, plan,
                                  (plan.template, plan.native, plan.ts_pos, raw_layout))
                    # publish_hot's constants and the writer's own lists (it books the
                    # slot once the wake-ups are sent), one tuple; made here, after
                    # _attach, so that it holds the lists the writer holds now.
                    self._hot = (self._seg, self._ctl, self._geo.header, self._geo.layout,
                                 self._events, self._lease_regions, self._sent,
                                 _OFF_LAST_SLOT, _OFF_LAST_SEQ, self._gen, self._seq,
                                 self._loaned, self._slot_layout, self._slot_layout_gen)
            seq = self._last_seq + 1
            gen = self._gen[slot] + 1
            base = self._geo.header[slot]
            try:
                ok = self._npack(self._seg, base, plan.template, plan.native, seq, gen,
                                 publish_ts_ns or 0, crc, frame_id, capture_ts_ns,
                                 exposure_us, gain, extra)
            except BaseException:
                self._discard(loan)
                raise
            if ok:
                size, ts_off, nl = plan.size, plan.ts_pos, len(raw_layout)
                # Written unless this writer wrote these very bytes there at the slot's
                # last publish and nothing has touched the slot since (the generation
                # moved by exactly this loan).
                if (self._slot_layout[slot] is not raw_layout
                        or self._slot_layout_gen[slot] != gen - 2):
                    lpos = self._geo.layout[slot]
                    self._buf[lpos:lpos + nl] = raw_layout
                    self._slot_layout[slot] = raw_layout
                self._slot_layout_gen[slot] = gen
            else:       # a value outside its field: the Python plan raises what it raises
                slot, seq, gen, base, size, ts_off, nl = self._encode(
                    loan, frame_id, capture_ts_ns, exposure_us, gain, publish_ts_ns, receipt)
        else:
            slot, seq, gen, base, size, ts_off, nl = self._encode(
                loan, frame_id, capture_ts_ns, exposure_us, gain, publish_ts_ns, receipt)
            self._slot_layout[slot] = None
        try:
            self._npublish(self._seg, self._ctl[slot], seq, gen, publish_ts_ns,
                           base + ts_off, size, nl, _OFF_LAST_SLOT, _OFF_LAST_SEQ, slot,
                           self._events, self._lease_regions, self._sent)
        finally:
            # The writer's own bookkeeping after the wake-up, not before it: readers
            # never see it, and cold it is a few us of the publish -> reader latency.
            self._gen[slot], self._seq[slot], self._last_seq = gen, seq, seq
            self._loaned.discard(slot)
            self._published += 1
        return seq

    def _publish(self, loan: Loan, frame_id, capture_ts_ns, exposure_us, gain,
                 publish_ts_ns, receipt: Receipt | None = None) -> int:
        """The pure-Python publish (x86-64 only: its stores rely on TSO's order)."""
        slot, seq, gen, base, size, ts_off, nl = self._encode(
            loan, frame_id, capture_ts_ns, exposure_us, gain, publish_ts_ns, receipt)
        buf = self._buf
        cb, ts_pos = self._ctl[slot], base + ts_off
        # Still before the clock reading: the control block (generation still odd) and
        # the last_slot hint, so their cache lines are this core's when the stamp and
        # the stores that publish follow.
        L.CONTROL_TAIL.pack_into(buf, cb + L.OFF_SEQ, seq, publish_ts_ns or 0, size, nl)
        L.U32.pack_into(buf, L.OFF_LAST_SLOT, slot)
        self._gen[slot], self._seq[slot], self._last_seq = gen, seq, seq
        self._loaned.discard(slot)
        self._published += 1
        pack_u64, words = L.U64.pack_into, self._words
        events, write = self._events, os.write
        # From the clock reading to the wake-up: four stores and the wake-up writes.
        ts = time.monotonic_ns() if publish_ts_ns is None else publish_ts_ns
        pack_u64(buf, ts_pos, ts)             # SlotHeader.publishTsNs
        pack_u64(buf, cb + L.OFF_TS, ts)
        # Fields first, generation last (even = stable), then the channel's latest:
        # single 8-byte stores (readers race on these two).
        words[self._ctl_word[slot]] = gen
        words[_LAST_SEQ_WORD] = seq
        for fd in events:
            try:
                write(fd, b"\x01")
            except OSError:
                pass  # full (that reader is asleep or gone: it will see it) or closed
        return seq

    # Conveniences that copy (the camera path fills a loan directly instead).
    def publish_array(self, array: np.ndarray, **stamp) -> int:
        with self.loan() as loan:
            loan.array(array.shape, array.dtype)[...] = array
            return loan.publish(**stamp)

    def announce(self, due_ns: int) -> None:
        """Say when the next publish is due (CLOCK_MONOTONIC ns), for a stream whose
        period does not predict it (a model's output follows its inference, not a
        clock). A reader with ``busy_poll_us`` then sleeps until just before ``due_ns``
        and watches shared memory from there instead of waiting to be woken (_cadence).
        The busy-polling readers (lease header OFF_POLLS) asleep on their socket are
        woken to read it, as by a publish (the awake flag, K4/K5 in _native.c); the
        others are not woken for it.
        A hint, never a promise: nothing waits for it, and a wrong one costs a busy-
        polling reader at most one window per message."""
        due = int(due_ns)
        if due <= 0 or due >= PLAUSIBLE:
            raise ValueError(f"announce(): due_ns {due_ns!r} is not a monotonic clock time")
        nxt = self._last_seq + 1
        events, write = self._events, os.write
        if self._seg is not None:
            self._seg.store_relaxed(L.OFF_NEXT_DUE, due)
            self._seg.store(L.OFF_NEXT_SEQ, nxt)      # release: the due before it
            self._fence()                                   # K4
            wake = [r.load_relaxed(L.OFF_POLLS) == L.READER_POLLS
                    and r.load_relaxed(L.OFF_AWAKE) != L.READER_AWAKE     # K5
                    for r in self._lease_regions]
        else:
            self._words[L.OFF_NEXT_DUE // 8] = due
            self._words[L.OFF_NEXT_SEQ // 8] = nxt
            wake = [L.U64.unpack_from(mm, L.OFF_POLLS)[0] == L.READER_POLLS
                    for mm in self._leases]
        for fd, w in zip(events, wake):
            if not w:
                continue
            try:
                write(fd, b"\x01")
            except OSError:
                pass  # full or closed, as in publish

    @property
    def stats(self) -> WriterStats:
        return WriterStats(self._published, self._honoured, self._discarded)

    @property
    def last_sequence(self) -> int:
        return self._last_seq

    def close(self) -> None:
        if self._seg is not None:
            # The regions hold buffer exports of the mappings: drop them first.
            for r in (self._seg, *self._lease_regions, self._sent):
                r.release()
            self._sent_mm.close()
        for mm in self._leases:
            mm.close()
        self._plane_cache = [{} for _ in self._payloads]
        self._array_views = [{} for _ in self._payloads]
        for view in self._payloads:
            try:
                view.release()
            except BufferError:
                pass  # a loaned array still uses it
        try:
            self._words.release()
            self._buf.release()
        except BufferError:
            pass  # a caller still holds a loaned array
        # Never mmap.close(): numpy arrays of a loan keep no buffer export, so it would
        # unmap under them and a write through one would crash the process. The mapping
        # goes when the last reference to it does (this writer's, or an array's).

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
