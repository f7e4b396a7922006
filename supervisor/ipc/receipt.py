"""Execution receipts: what really ran for one inference (schemas/receipt.capnp)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

COMPLETION_POINTS = ("unknown", "hostVisible", "deviceQueued")


@dataclass(frozen=True)
class Receipt:
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

    def __post_init__(self) -> None:
        if self.completion not in COMPLETION_POINTS:
            raise ValueError(f"completion {self.completion!r} not in {COMPLETION_POINTS}")

    def as_dict(self) -> dict:
        d = asdict(self)
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
    """Copy ``r`` into a capnp Receipt builder."""
    for py, cp in _FIELDS.items():
        setattr(builder, cp, getattr(r, py))


def read(reader) -> Receipt:
    """A Receipt from a capnp Receipt reader (strings and bytes copied out)."""
    vals = {py: getattr(reader, cp) for py, cp in _FIELDS.items()}
    vals["completion"] = str(vals["completion"])
    vals["device"] = str(vals["device"])[:64]
    vals["artifact_sha256"] = bytes(vals["artifact_sha256"])[:64]
    return Receipt(**vals)
