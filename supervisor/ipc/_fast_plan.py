"""Compiled SlotHeader writers: pycapnp's bytes, in one ``struct`` call per message.

A `HeaderPlan` is made once per header shape from pycapnp's own encoding of it (the
template) and checked against pycapnp byte for byte when it is made; the writer then
patches only the fields that vary per message.
"""
from __future__ import annotations

import mmap

from . import _atomics, _capnp_fast as cf
from ._reference import SlotHeader, encode_header
from .receipt import Receipt
from .spec import ChannelSpec

_MAX_PLANS = 64


class HeaderPlan:
    """A compiled SlotHeader writer for one (channel, pid, domain, crc?, frame?) shape:
    ``pack_into`` writes the whole message in one struct call. ``ts_pos`` is where
    publishTsNs sits, so a writer can stamp the time last."""

    __slots__ = ("size", "ts_pos", "has_crc", "has_frame", "has_receipt", "_patcher",
                 "_exp", "_gain", "_rvals", "template", "native")

    def __init__(self, access, template: bytes, has_crc: bool, has_frame: bool,
                 has_receipt: bool = False) -> None:
        a = access
        m = cf.Message(template)
        r = m.root
        meta = m.child(r, a.meta_ptr) if has_frame else cf.NULL
        # One value per field, in the order ``values`` gives them; a shape without a CRC
        # or a FrameMeta leaves those bytes as the template has them.
        fields = [(r, a.sequence), (r, a.generation), (r, a.ts)]
        if has_crc:
            fields.append((r, a.crc))
        if has_frame:
            fields += [(meta, s) for s in (a.frame_id, a.capture, a.exp_which, a.exp,
                                           a.gain_which, a.gain)]
        if has_receipt:
            # A receipt's Text and Data (device, artifactSha256) are in the template:
            # a plan is made per (device, sha256), so only its scalars vary.
            rc = m.child(r, a.receipt_ptr)
            if rc is cf.NULL or rc.dwords == 0:
                raise cf.Broken("template has no receipt struct")
            fields += [(rc, s) for s in a.r_scalars]
        placed = []
        for ref, sc in fields:
            if not ref.holds(sc):
                raise cf.Broken("field outside the template's data section")
            placed.append((ref.at(sc), sc))
        self._patcher = cf.Patcher(template, placed)
        self.size = len(template)
        self.ts_pos = r.at(a.ts)
        self.has_crc, self.has_frame, self.has_receipt = has_crc, has_frame, has_receipt
        self._exp = (a.exp_unknown, a.exp_is)
        self._gain = (a.gain_unknown, a.gain_is)
        self._rvals = a.receipt_values
        # The template's own values (what _HeaderWriting.plan built it from) must give
        # back its exact bytes, or this plan would not be pycapnp's encoding.
        zero = a.zero_receipt if has_receipt else None
        if self.pack(0, 0, 0, 0, 0, 0, 0, 0.0, zero) != template:
            raise cf.Broken("compiled SlotHeader writer does not reproduce its template")
        # The same patch for the native writer (`_native.pack_header`): the template and
        # (position, struct code) per patched field, in ``values`` order; a receipt's
        # scalars go as the call's ``extra`` values. Checked against the Python patcher
        # below, as the tests do at length.
        self.template = template
        self.native = None
        if _atomics.NATIVE is not None:
            self.native = (int(has_crc), int(has_frame), a.exp_unknown, a.exp_is,
                           a.gain_unknown, a.gain_is,
                           *(x for at, sc in placed for x in (at, ord(cf._char(sc)))))
            probe = (0x1111111111111111, 0x2222222222222222, 0x3333333333333333,
                     0x44444444, 0x5555555555555555, 0x6666666666666666, 0x77777777, 1.5)
            rprobe = Receipt(0x0101010101010101, 0x0202020202020202, 0x0303030303030303,
                             0x0404040404040404, "", 0x0505050505050505, 0x0606060606060606,
                             "deviceQueued", 0x0707070707070707, 0x0808080808080808,
                             0x0909090909090909, 0x0A0A0A0A0A0A0A0A, b"", 0x0B0B0B0B)
            for args in (probe, probe[:6] + (None, None)):
                args += (rprobe if has_receipt else None,)
                if self.pack_native_bytes(*args) != self.pack(*args):
                    raise cf.Broken("native SlotHeader writer differs from the compiled one")

    def pack_native_bytes(self, sequence, generation, ts, crc, frame_id, capture,
                          exposure, gain, receipt=None) -> bytes | None:
        """What ``native`` writes for these values (None: a value that does not fit,
        which the Python plan must judge). For checks, not for the hot path."""
        mm = mmap.mmap(-1, max(8, -(-self.size // 8) * 8))
        region = _atomics.NATIVE.Region(mm, True)
        try:
            if not _atomics.NATIVE.pack_header(
                    region, 0, self.template, self.native, sequence, generation, ts, crc,
                    frame_id, capture, exposure, gain,
                    self._rvals(receipt) if self.has_receipt else None):
                return None
            return bytes(mm[:self.size])
        finally:
            region.release()
            mm.close()

    def receipt_values(self, receipt) -> tuple:
        """The receipt's patched values, in the plan's order (``extra`` for the native
        writer). Raises what a receipt the plan cannot write raises."""
        return self._rvals(receipt)

    def values(self, sequence, generation, ts, crc, frame_id, capture, exposure, gain,
               receipt=None) -> tuple:
        out = (sequence, generation, ts)
        if self.has_crc:
            out += (crc,)
        if self.has_frame:
            out += (frame_id, capture or 0,
                    self._exp[0] if exposure is None else self._exp[1],
                    0 if exposure is None else exposure,
                    self._gain[0] if gain is None else self._gain[1],
                    0.0 if gain is None else gain)
        if self.has_receipt:
            out += self._rvals(receipt)
        return out

    def pack_into(self, buf, pos: int, *args) -> None:
        """``args``: sequence, generation, ts, crc, frame_id, capture, exposure, gain
        (and the Receipt, for a plan made with ``plan_receipt``)."""
        self._patcher.pack_into(buf, pos, self.values(*args))

    def pack(self, *args) -> bytes:
        return self._patcher.pack(self.values(*args))


class _HeaderWriting:
    """Compiled SlotHeader writers for `_HeaderFields` (mixed into `codec._HeaderAccess`)."""

    _plans: dict[tuple, HeaderPlan]

    def plan(self, spec: ChannelSpec, writer_pid: int, domain: str, has_crc: bool,
             has_frame: bool) -> HeaderPlan:
        key = (spec.channel_id, writer_pid, domain, has_crc, has_frame)
        plan = self._plans.get(key)
        if plan is None:
            template = encode_header(spec, sequence=0, generation=0, writer_pid=writer_pid,
                                     domain=domain, publish_ts_ns=0,
                                     crc32=0 if has_crc else None,
                                     frame_id=0 if has_frame else None, capture_ts_ns=0,
                                     exposure_us=0, gain=0.0)
            plan = HeaderPlan(self, template, has_crc, has_frame)
            self._keep(key, plan)
        return plan

    def plan_receipt(self, spec: ChannelSpec, writer_pid: int, domain: str, has_crc: bool,
                     has_frame: bool, device: str, sha256: bytes) -> HeaderPlan:
        """A compiled SlotHeader writer for headers that carry a Receipt with this
        ``device`` and ``artifactSha256`` (constant per stream): the template is pycapnp's
        encoding, and the plan is checked byte for byte against pycapnp twice, on the
        template's zeros and on a probe whose every patched field is non-zero."""
        key = (spec.channel_id, writer_pid, domain, has_crc, has_frame, device, sha256)
        plan = self._plans.get(key)
        if plan is None:
            zero = Receipt(0, 0, 0, 0, device, 0, 0, "unknown", artifact_sha256=sha256)
            template = encode_header(spec, sequence=0, generation=0, writer_pid=writer_pid,
                                     domain=domain, publish_ts_ns=0,
                                     crc32=0 if has_crc else None,
                                     frame_id=0 if has_frame else None, capture_ts_ns=0,
                                     exposure_us=0, gain=0.0, receipt=zero)
            plan = HeaderPlan(self, template, has_crc, has_frame, has_receipt=True)
            probe = Receipt(0x0101010101010101, 0x0202020202020202, 0x0303030303030303,
                            0x0404040404040404, device, 0x0505050505050505,
                            0x0606060606060606, "deviceQueued", 0x0707070707070707,
                            0x0808080808080808, 0x0909090909090909, 0x0A0A0A0A0A0A0A0A,
                            sha256, 0x0B0B0B0B)
            args = dict(sequence=0x1111111111111111, generation=0x2222222222222222,
                        publish_ts_ns=0x3333333333333333,
                        crc32=0x44444444 if has_crc else None,
                        frame_id=0x5555555555555555 if has_frame else None,
                        capture_ts_ns=0x6666666666666666 if has_frame else None,
                        exposure_us=0x77777777 if has_frame else None,
                        gain=1.5 if has_frame else None)
            want = encode_header(spec, writer_pid=writer_pid, domain=domain,
                                 receipt=probe, **args)
            got = plan.pack(args["sequence"], args["generation"], args["publish_ts_ns"],
                            args["crc32"], args["frame_id"], args["capture_ts_ns"],
                            args["exposure_us"], args["gain"], probe)
            if got != want:
                raise cf.Broken("compiled receipt header differs from pycapnp's")
            self._keep(key, plan)
        return plan

    def _keep(self, key: tuple, plan: HeaderPlan) -> None:
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan

    def encode(self, spec: ChannelSpec, sequence: int, generation: int, writer_pid: int,
               domain: str, publish_ts_ns: int, crc32: int | None, frame_id: int | None,
               capture_ts_ns: int | None, exposure_us: int | None,
               gain: float | None) -> bytes:
        plan = self.plan(spec, writer_pid, domain, crc32 is not None, frame_id is not None)
        return plan.pack(sequence, generation, publish_ts_ns, crc32, frame_id,
                         capture_ts_ns, exposure_us, gain)


def publish_ts_offset(raw: bytes) -> int:
    """Byte position of SlotHeader.publishTsNs in an encoded header (for late stamping)."""
    m = cf.Message(raw)
    return m.root.data + cf.scalar(SlotHeader.schema, "publishTsNs").offset
