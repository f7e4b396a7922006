"""Named-field tensor payloads: what the float32 arrays on the small channels mean.

A channel's `payload` key in the config names one of these; producers, consumers,
the monitor and the supervisor's fail-safe encode and decode through it, so field
positions live in exactly one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class Payload:
    name: str
    fields: tuple[str, ...]
    dtype: str = "float32"
    doc: str = ""
    # An actuation payload: what it says when nothing may act on it (the fail-safe's
    # last word). None for payloads that never reach actuators.
    safe: Mapping[str, float] | None = None
    # The same, said the moment its writer died (the supervisor's last word for a
    # crash): nothing may act on it either, but a standby or a restart may follow, so
    # it must not read as the domain failed safe. None: ``safe`` serves.
    lost: Mapping[str, float] | None = None
    # The same, said after its writer was stopped (the supervisor is stopping: a planned
    # stop, not a loss). None: ``lost`` (else ``safe``) serves.
    stopped: Mapping[str, float] | None = None

    @property
    def shape(self) -> tuple[int]:
        return (len(self.fields),)

    def index(self, field: str) -> int:
        return self.fields.index(field)

    def encode(self, out: np.ndarray | None = None, **values: float) -> np.ndarray:
        """Fields by name into `out` (a loaned slot view) or a new array; unnamed = 0."""
        unknown = set(values) - set(self.fields)
        if unknown:
            raise KeyError(f"payload {self.name} has no field(s) {sorted(unknown)}")
        arr = np.zeros(self.shape, self.dtype) if out is None else out
        arr[:] = [values.get(f, 0.0) for f in self.fields]
        return arr

    def decode(self, arr: np.ndarray) -> dict[str, float]:
        if arr.shape[-1:] != self.shape:
            raise ValueError(f"payload {self.name}: expected {self.shape[0]} values, "
                             f"got shape {arr.shape}")
        return {f: float(v) for f, v in zip(self.fields, arr)}


MODEL_OUT = Payload(
    "model_out", ("offset_m", "heading_rad", "confidence", "reserved"),
    doc="lane offset (m, left +), heading error (rad), confidence 0..1")
CONTROL_CMD = Payload(
    "control_cmd", ("steer_rad", "engaged", "reason", "model_age_ms"),
    doc="steering angle command, engaged 0/1, safe-state reason code "
        "(workers.controlsd.law.SafeReason), age of the model output it came from",
    safe={"steer_rad": 0.0, "engaged": 0.0, "reason": 10.0},   # 10 = FAIL_SAFE
    lost={"steer_rad": 0.0, "engaged": 0.0, "reason": 14.0},   # 14 = WRITER_LOST
    stopped={"steer_rad": 0.0, "engaged": 0.0, "reason": 8.0})  # 8 = SHUTDOWN
SHADOW_OUT = Payload(
    "shadow_out", ("lane_offset_m", "heading_rad", "left_line_prob", "right_line_prob",
                   "frame_id_mod_2_24", "latency_ms", "age_ms", "pipeline_ms"),
    doc="research's shadow estimate: logged, never actuated")

DRIVER_STATE = Payload(
    "driver_state", ("face_prob", "eyes_on_road_prob", "confidence", "reserved"),
    doc="driver monitoring: a face is in view (0..1), the driver looks at the road "
        "(0..1), confidence 0..1 (the driver-monitor model's output, never actuated)")

PAYLOADS: dict[str, Payload] = {p.name: p for p in (MODEL_OUT, CONTROL_CMD, SHADOW_OUT,
                                                    DRIVER_STATE)}
