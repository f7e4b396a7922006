"""Execution receipts: what really ran for one inference (schemas/receipt.capnp)."""
from __future__ import annotations

from typing import NamedTuple

COMPLETION_POINTS = ("unknown", "hostVisible", "deviceQueued")


class Receipt(NamedTuple):
    """One inference's receipt. A NamedTuple (like Stamp), not a dataclass: one is
    built per model output on each side of the control path, and cold (50 ms of other
    work between outputs) a frozen dataclass of 14 fields costs ~50 us to build against
    ~30 us for this. ``completion`` is one of COMPLETION_POINTS; the header encoder
    refuses anything else (pycapnp's enum), as it refuses a value outside its field."""

    frame_id: int
    capture_ts_ns: int
    infer_start_ns: int
    infer_end_ns: int
    device: str
    bytes_in: int
    bytes_out: int
    completion: str = "hostVisible"
    latency_ns: int = 0
    worst_case_ns: int = 0
    deadline_ns: int = 0
    deadline_misses: int = 0
    artifact_sha256: bytes = b""
    kernels_run: int = 0

    def as_dict(self) -> dict:
        d = self._asdict()
        d["artifact_sha256"] = self.artifact_sha256.hex()
        return d


_FIELDS = {  # python name -> capnp name
    "frame_id": "frameId", "capture_ts_ns": "captureTsNs", "infer_start_ns": "inferStartNs",
    "infer_end_ns": "inferEndNs", "device": "device", "bytes_in": "bytesIn",
    "bytes_out": "bytesOut", "completion": "completion", "latency_ns": "latencyNs",
    "worst_case_ns": "worstCaseNs", "deadline_ns": "deadlineNs",
    "deadline_misses": "deadlineMisses", "artifact_sha256": "artifactSha256",
    "kernels_run": "kernelsRun",
}


def fill(builder, r: Receipt) -> None:
    """Copy ``r`` into a capnp Receipt builder (ValueError for a completion point that
    is not one, in place of pycapnp's AttributeError)."""
    if r.completion not in COMPLETION_POINTS:
        raise ValueError(f"receipt completion {r.completion!r} not in {COMPLETION_POINTS}")
    for py, cp in _FIELDS.items():
        setattr(builder, cp, getattr(r, py))


def read(reader) -> Receipt:
    """A Receipt from a capnp Receipt reader (strings and bytes copied out)."""
    vals = {py: getattr(reader, cp) for py, cp in _FIELDS.items()}
    vals["completion"] = str(vals["completion"])
    vals["device"] = str(vals["device"])[:64]
    vals["artifact_sha256"] = bytes(vals["artifact_sha256"])[:64]
    return Receipt(**vals)
