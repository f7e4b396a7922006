"""Where every SlotHeader field the bridge uses lies, from the loaded schema.

`_HeaderFields` is the state the compiled paths share: `_fast_header` reads a
SlotHeader with it, `_fast_plan` writes one, `_fast_receipt` reads the Receipt in one.
Nothing is hard-coded: offsets, pointer indexes and union discriminants all come from
the schema pycapnp loaded (see `_capnp_fast`).
"""
from __future__ import annotations

from operator import attrgetter

from . import _capnp_fast as cf
from . import receipt as receipts
from ._reference import SlotHeader, receipt_schema
from .receipt import Receipt

# Receipt scalars as (python name, capnp name), in the order HeaderPlan patches them and
# _ReceiptReading.receipt reads them; completion (an enum) last.
_R_SCALARS = (("frame_id", "frameId"), ("capture_ts_ns", "captureTsNs"),
              ("infer_start_ns", "inferStartNs"), ("infer_end_ns", "inferEndNs"),
              ("bytes_in", "bytesIn"), ("bytes_out", "bytesOut"),
              ("latency_ns", "latencyNs"), ("worst_case_ns", "worstCaseNs"),
              ("deadline_ns", "deadlineNs"), ("deadline_misses", "deadlineMisses"),
              ("kernels_run", "kernelsRun"), ("completion", "completion"))

# Compiled decoders kept per distinct message structure (bounded: the bytes come from a
# possibly hostile writer, so they must not grow the cache without limit).
_MAX_COMPILED = 32


class _HeaderFields:
    """SlotHeader fields at the offsets the loaded schema gives (see _capnp_fast).

    For each union, ``*_n`` is its member count: a discriminant at or above it names a
    member this schema does not know, which only pycapnp may judge (it rejects it)."""

    def __init__(self) -> None:
        hs = SlotHeader.schema
        self.version = cf.scalar(hs, "schemaVersion")
        self.channel = cf.scalar(hs, "channelId")
        self.sequence = cf.scalar(hs, "sequence")
        self.generation = cf.scalar(hs, "generation")
        self.pid = cf.scalar(hs, "writerPid")
        self.ts = cf.scalar(hs, "publishTsNs")
        g, self.crc_which, members = cf.union(hs, "payloadCrc")
        self.crc_is, self.crc_n = members["crc32"], len(members)
        self.crc = cf.scalar(g, "crc32")
        g, self.frame_which, members = cf.union(hs, "frame")
        self.frame_is, self.frame_n = members["meta"], len(members)
        self.meta_ptr = cf.pointer_index(g, "meta")
        ms = g.fields["meta"].schema
        self.frame_id = cf.scalar(ms, "frameId")
        self.capture = cf.scalar(ms, "captureTsNs")
        g, self.exp_which, members = cf.union(ms, "exposure")
        self.exp_is, self.exp_unknown = members["microseconds"], members["unknown"]
        self.exp_n = len(members)
        self.exp = cf.scalar(g, "microseconds")
        g, self.gain_which, members = cf.union(ms, "gain")
        self.gain_is, self.gain_unknown = members["value"], members["unknown"]
        self.gain_n = len(members)
        self.gain = cf.scalar(g, "value")
        # The order decode() names them in: the order they lie in a SlotHeader of this
        # schema, so the compiled read needs no reordering (any other order works too).
        self._root_fields = (self.version, self.channel, self.sequence, self.generation,
                             self.pid, self.crc_which, self.frame_which, self.ts, self.crc)
        self._meta_fields = (self.frame_id, self.capture, self.exp_which, self.gain_which,
                             self.exp, self.gain)
        # Receipt (schemas/receipt.capnp): its scalars, in the order receipt_values
        # gives them, and its two pointers (Text device, Data artifactSha256).
        self.receipt_ptr = cf.pointer_index(hs, "receipt")
        rs = hs.fields["receipt"].schema
        self.r_scalars = tuple(cf.scalar(rs, cp) for _, cp in _R_SCALARS)
        self.r_device_ptr = cf.pointer_index(rs, "device")
        self.r_sha_ptr = cf.pointer_index(rs, "artifactSha256")
        comp = receipt_schema.CompletionPoint.schema.enumerants
        self.r_completion = {n: comp[n] for n in receipts.COMPLETION_POINTS}
        self.r_completion_name = {v: n for n, v in self.r_completion.items()}
        get = attrgetter(*(py for py, _ in _R_SCALARS[:-1]))
        completion = self.r_completion

        def receipt_values(r: Receipt) -> tuple:
            return (*get(r), completion[r.completion])

        self.receipt_values = receipt_values
        self.zero_receipt = Receipt(0, 0, 0, 0, "", 0, 0, "unknown")
        # The native reading's table (_native.c receipt_core): the Receipt type, the
        # completion names by enumerant value, the two pointer indexes, then (offset,
        # struct code) per scalar in _R_SCALARS order.
        names = [None] * (max(self.r_completion_name) + 1)
        for v, n in self.r_completion_name.items():
            names[v] = n
        self.r_native = (Receipt, tuple(names), self.r_device_ptr, self.r_sha_ptr,
                         *(x for s in self.r_scalars
                           for x in (s.offset, ord(s.fmt.format.lstrip("<")))))
