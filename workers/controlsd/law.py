"""The lateral control law of controlsd: pure, clock injected, no I/O.

    law = ControlLaw(LawConfig())
    cmd = law.step(ModelOutput(offset_m, heading_rad, confidence, ts_ns), now_ns)
    cmd = law.step(None, now_ns)          # no new model output since the last step

Sign conventions follow `workers.camerad.synthetic.LaneTruth`: + = to the right.
``offset_m`` > 0 means the car is right of the lane centre, ``heading_rad`` > 0 that it
points right of the lane; ``steer_rad`` > 0 steers right. So

    target = clamp(-(k_p * offset_m + k_h * heading_rad), -max_steer, +max_steer)

optionally low-passed (first order, ``tau_s``), then rate-limited: the output moves
towards the target by at most ``max_rate * dt`` per step, with ``dt`` capped at
``max_dt_s`` so a stalled caller can never make it jump.

Safe state. Each step judges the newest model output; the first failing check is the
reason (`SafeReason`), in this order:

  NO_INPUT        no model output received yet
  TIMEOUT         no new output for more than ``timeout_ms``
  (refused)       the bridge refused the newest output: its reason (FUTURE for a
                  `supervisor.ipc.FutureTimestamp`), see `ModelOutput.refused_by`
  INVALID         non-finite values, or too few of them
  NOT_HOST_VISIBLE the receipt says the output was only queued on the device
  FUTURE          the output's age reference (capture, else publish time) is more than
                  ``future_tolerance_ms`` ahead of now: a negative age is a lie, never
                  freshness
  STALE           the output is older than ``max_age_ms`` (age from the frame's capture
                  time when known, else from the output's publish time), or its age
                  reference is before the clock last stopped (a suspend: `clock_stopped`)
  LOW_CONFIDENCE  confidence < ``min_confidence``

With a driver monitor (``LawConfig.watch_driver``: controlsd reads a ``driver_state``
channel, `schemas.payloads.DRIVER_STATE`), an output that passes every check above is
then judged with the newest driver state (`DriverState`, passed to ``step``):

  DRIVER_STALE      no driver state yet, or the newest is older than
                    ``driver_max_age_ms`` (age from its frame's capture time): a driver
                    monitor that stopped is no driver monitor
  DRIVER_ABSENT     ``face_prob`` < ``min_face_prob``, or the monitor is unsure
                    (``confidence`` < ``min_driver_confidence``: it cannot see the
                    driver), in every driver state for ``driver_grace_ms``
  DRIVER_DISTRACTED a face, but ``eyes_on_road_prob`` < ``min_eyes_on_road`` in every
                    driver state for ``driver_grace_ms`` (a glance at a mirror is not)

The grace runs on the driver states' capture times, from the first bad one; one good
state ends it. Without a driver monitor none of this applies and the law is unchanged.

Any failing check disengages at once (``engaged = False``) and the target becomes 0: the
steer ramps to 0 at the rate limit. Re-engaging (also the first engagement) needs
``engage_count`` consecutive new outputs that pass every check; until then the reason is
RECOVERING. ``SHUTDOWN`` is the reason of a step called with ``hold=SafeReason.SHUTDOWN``
(the worker is stopping), and of the supervisor's last word after it stopped controlsd.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import FUTURE_TOLERANCE_NS


class SafeReason(IntEnum):
    OK = 0
    NO_INPUT = 1
    TIMEOUT = 2
    STALE = 3
    LOW_CONFIDENCE = 4
    INVALID = 5
    NOT_HOST_VISIBLE = 6
    RECOVERING = 7
    SHUTDOWN = 8
    FUTURE = 9
    FAIL_SAFE = 10   # published by the supervisor when the control domain failed safe
    DRIVER_ABSENT = 11      # driver monitor: no face (or unsure) for the grace time
    DRIVER_DISTRACTED = 12  # driver monitor: eyes off the road for the grace time
    DRIVER_STALE = 13       # driver monitor: no driver state, or too old
    WRITER_LOST = 14  # published by the supervisor the moment controlsd died (its last
    #                   word: a standby or a restart may follow; FAIL_SAFE is the latch's)


# The members the law names on every step, as module globals: ``SafeReason.OK`` is a class
# attribute lookup through the Enum metaclass (several dicts), a global is one lookup.
_OK, _NO_INPUT, _TIMEOUT, _STALE = (SafeReason.OK, SafeReason.NO_INPUT, SafeReason.TIMEOUT,
                                    SafeReason.STALE)
_LOW_CONFIDENCE, _INVALID, _NOT_HOST_VISIBLE, _RECOVERING, _FUTURE = (
    SafeReason.LOW_CONFIDENCE, SafeReason.INVALID, SafeReason.NOT_HOST_VISIBLE,
    SafeReason.RECOVERING, SafeReason.FUTURE)
_DRIVER_ABSENT, _DRIVER_DISTRACTED, _DRIVER_STALE = (
    SafeReason.DRIVER_ABSENT, SafeReason.DRIVER_DISTRACTED, SafeReason.DRIVER_STALE)
_isfinite = math.isfinite


class ModelOutput(NamedTuple):
    """One model output, as the law needs it. NamedTuples (this and Command), not
    frozen dataclasses: one of each is built per output, after 50 ms of other work,
    where a NamedTuple costs about half as much to build."""

    offset_m: float
    heading_rad: float
    confidence: float
    ts_ns: int                       # age reference: frame capture time, else publish time
    frame_id: int | None = None
    latency_ns: int | None = None    # inference latency from the receipt, if any
    host_visible: bool = True        # False: receipt says only queued on the device
    refused: SafeReason | None = None  # the bridge refused the message, for this reason

    @classmethod
    def refused_by(cls, reason: SafeReason, ts_ns: int, **kw) -> ModelOutput:
        """A model output the bridge refused (e.g. FUTURE for a future timestamp): it
        counts as a new output, so the law goes safe with ``reason`` at once, and stays
        there until a good output follows; its values are not known (NaN). ``ts_ns`` is
        the timestamp the message claimed, so the command's model_age_ms shows it."""
        if reason == SafeReason.OK:
            raise ValueError("a refused output needs a reason other than OK")
        return cls(math.nan, math.nan, math.nan, ts_ns, refused=reason, **kw)

    @classmethod
    def from_array(cls, values: np.ndarray, ts_ns: int, **kw) -> ModelOutput:
        """float32[4] = (offset_m, heading_rad, confidence, reserved); fewer than 3
        values give an output that the law judges INVALID."""
        flat = np.asarray(values).reshape(-1)
        if flat.size < 3:
            return cls(math.nan, math.nan, math.nan, ts_ns, **kw)
        # tolist(): Python floats in one call (NaN and inf kept), not three numpy scalars.
        v = flat[:3].astype(np.float64, copy=False).tolist()
        return cls(v[0], v[1], v[2], ts_ns, **kw)

    @classmethod
    def from_floats(cls, v: list[float], ts_ns: int, frame_id: int | None = None,
                    latency_ns: int | None = None, host_visible: bool = True) -> ModelOutput:
        """``from_array`` for values already read out as Python floats (e.g. a float32[n]
        payload's ``tolist()``: the same floats, without numpy's reshape and cast)."""
        if len(v) < 3:
            return cls(math.nan, math.nan, math.nan, ts_ns, frame_id, latency_ns, host_visible)
        return cls(v[0], v[1], v[2], ts_ns, frame_id, latency_ns, host_visible)


class DriverState(NamedTuple):
    """One driver-monitor output (`schemas.payloads.DRIVER_STATE`), as the law needs it."""

    face_prob: float                 # a face is in view, 0..1
    eyes_on_road_prob: float         # the driver looks at the road, 0..1
    confidence: float                # the monitor's own confidence, 0..1
    ts_ns: int                       # age reference: the driver frame's capture time

    @classmethod
    def from_floats(cls, v: list[float], ts_ns: int) -> DriverState:
        """The payload's values (face_prob, eyes_on_road_prob, confidence, reserved);
        fewer than 3 read as an unsure monitor (NaN: never a present, attentive driver)."""
        if len(v) < 3:
            return cls(math.nan, math.nan, math.nan, ts_ns)
        return cls(v[0], v[1], v[2], ts_ns)


@dataclass(frozen=True)
class LawConfig:
    k_p: float = 0.05                # rad of steer per metre of offset
    k_h: float = 0.5                 # rad of steer per rad of heading
    max_steer: float = 0.3           # |steer| limit, rad
    max_rate: float = 0.4            # rad/s
    tau_s: float = 0.0               # low-pass time constant (0 = off)
    timeout_ms: float = 150.0
    max_age_ms: float = 150.0
    min_confidence: float = 0.5
    engage_count: int = 3
    max_dt_s: float = 0.1
    # How far ahead of now an output's timestamp may be (same clock, same margin as the
    # bridge reader's FutureTimestamp check).
    future_tolerance_ms: float = FUTURE_TOLERANCE_NS / 1e6
    # Driver monitoring (only with watch_driver: controlsd reads a driver_state channel).
    watch_driver: bool = False
    driver_max_age_ms: float = 500.0     # newest driver state older: DRIVER_STALE
    min_face_prob: float = 0.5           # below (or NaN): no driver in the seat
    min_driver_confidence: float = 0.5   # below: the monitor cannot tell (as absent)
    min_eyes_on_road: float = 0.5        # below, with a face: looking elsewhere
    driver_grace_ms: float = 2000.0      # how long absent / distracted is tolerated

    def __post_init__(self) -> None:
        if self.max_steer <= 0 or self.max_rate <= 0 or self.max_dt_s <= 0:
            raise ValueError("max_steer, max_rate and max_dt_s must be > 0")
        if self.tau_s < 0 or self.timeout_ms <= 0 or self.max_age_ms <= 0:
            raise ValueError("tau_s must be >= 0, timeout_ms and max_age_ms > 0")
        if self.future_tolerance_ms < 0:
            raise ValueError("future_tolerance_ms must be >= 0")
        if self.engage_count < 1:
            raise ValueError("engage_count must be >= 1")
        if self.driver_max_age_ms <= 0 or self.driver_grace_ms < 0:
            raise ValueError("driver_max_age_ms must be > 0, driver_grace_ms >= 0")


class Command(NamedTuple):
    steer_rad: float
    engaged: bool
    reason: SafeReason
    model_age_ms: float              # age of the newest model output; -1 if none yet
    target_rad: float = 0.0          # before the rate limit
    frame_id: int | None = None      # frame the newest model output came from

    def to_array(self) -> np.ndarray:
        """The control_cmd tensor (schemas.payloads.CONTROL_CMD: steer_rad, engaged 0/1,
        reason code, model_age_ms)."""
        return CONTROL_CMD.encode(steer_rad=self.steer_rad, engaged=1.0 if self.engaged else 0.0,
                                  reason=float(self.reason), model_age_ms=self.model_age_ms)

    @classmethod
    def from_array(cls, a: np.ndarray) -> Command:
        d = CONTROL_CMD.decode(np.asarray(a, np.float32).reshape(-1))
        return cls(d["steer_rad"], d["engaged"] >= 0.5, SafeReason(int(round(d["reason"]))),
                   d["model_age_ms"])


class ControlLaw:
    def __init__(self, config: LawConfig | None = None) -> None:
        self.cfg = config or LawConfig()
        self.steer = 0.0
        self.engaged = False
        self._filtered = 0.0
        self._last_ns: int | None = None
        self._latest: ModelOutput | None = None
        self._latest_rx_ns: int | None = None
        self._streak = 0
        self._driver: DriverState | None = None
        self._absent_since: int | None = None      # capture time of the first bad state
        self._distracted_since: int | None = None
        # Nothing captured before this can be aged (the clock stopped: a suspend).
        self._floor_ns = -(1 << 63)

    def resume(self, steer_rad: float, engaged: bool, streak: int, at_ns: int) -> None:
        """Start from where another law was (a replay that begins mid-drive: the car's
        law had been running before the log did): its steer, engagement and count of
        good outputs in a row, as of its step at ``at_ns``. The newest output is not
        carried over: the next step must bring one. A steer that is not a finite number
        (a hostile or broken log) resumes nothing: it would steer every step after it."""
        if not math.isfinite(steer_rad):
            return
        self.steer = self._filtered = float(steer_rad)
        self.engaged = bool(engaged)
        self._streak = max(int(streak), 0)
        self._last_ns = at_ns

    def clock_stopped(self, now_ns: int) -> None:
        """The clock did not run for a while before ``now_ns`` (the machine was
        suspended: workers/controlsd/suspend.py): every output and driver state
        captured before now is of unknown age, so each is STALE (DRIVER_STALE), and
        engaging again needs ``engage_count`` outputs captured after now."""
        self._floor_ns = now_ns

    @property
    def last_ns(self) -> int | None:
        """The time of the last step (None before the first)."""
        return self._last_ns

    def judge(self, out: ModelOutput | None, rx_ns: int | None, now_ns: int) -> SafeReason:
        """Why ``out`` (received at ``rx_ns``) may not drive the car now, or OK."""
        c = self.cfg
        if out is None or rx_ns is None:
            return _NO_INPUT
        if now_ns - rx_ns > c.timeout_ms * 1e6:
            return _TIMEOUT
        if out.refused is not None:
            return out.refused
        if not (_isfinite(out.offset_m) and _isfinite(out.heading_rad)
                and _isfinite(out.confidence)):
            return _INVALID
        if not out.host_visible:
            return _NOT_HOST_VISIBLE
        if out.ts_ns - now_ns > c.future_tolerance_ms * 1e6:
            return _FUTURE
        if now_ns - out.ts_ns > c.max_age_ms * 1e6 or out.ts_ns < self._floor_ns:
            return _STALE
        if out.confidence < c.min_confidence:
            return _LOW_CONFIDENCE
        return _OK

    def see_driver(self, state: DriverState) -> None:
        """Take a new driver state (in capture order): starts or ends the grace."""
        c = self.cfg
        self._driver = state
        absent = not (state.face_prob >= c.min_face_prob
                      and state.confidence >= c.min_driver_confidence)   # NaN: absent
        if absent:
            if self._absent_since is None:
                self._absent_since = state.ts_ns
            self._distracted_since = None
            return
        self._absent_since = None
        if state.eyes_on_road_prob >= c.min_eyes_on_road:
            self._distracted_since = None
        elif self._distracted_since is None:
            self._distracted_since = state.ts_ns

    def judge_driver(self, now_ns: int) -> SafeReason:
        """Why the driver may not be trusted with an engaged system now, or OK."""
        c = self.cfg
        d = self._driver
        if d is None or now_ns - d.ts_ns > c.driver_max_age_ms * 1e6 \
                or d.ts_ns < self._floor_ns:
            return _DRIVER_STALE
        grace = c.driver_grace_ms * 1e6
        if self._absent_since is not None and now_ns - self._absent_since >= grace:
            return _DRIVER_ABSENT
        if self._distracted_since is not None and now_ns - self._distracted_since >= grace:
            return _DRIVER_DISTRACTED
        return _OK

    def step(self, model_out: ModelOutput | None, now_ns: int, *,
             hold: SafeReason | None = None, driver: DriverState | None = None) -> Command:
        """Advance to ``now_ns`` with ``model_out`` (None: nothing new) and ``driver``
        (the newest driver state, None: nothing new; read only with watch_driver) and
        return the command. ``hold`` forces the safe state with that reason."""
        c = self.cfg
        dt = 0.0 if self._last_ns is None else min(max((now_ns - self._last_ns) / 1e9, 0.0),
                                                   c.max_dt_s)
        self._last_ns = now_ns
        if model_out is not None:
            self._latest, self._latest_rx_ns = model_out, now_ns
        reason = self.judge(self._latest, self._latest_rx_ns, now_ns)
        if c.watch_driver:
            if driver is not None:
                self.see_driver(driver)
            if reason == _OK:
                reason = self.judge_driver(now_ns)
        if hold is not None and hold != _OK:
            reason = hold
        if reason != _OK:
            self.engaged = False
            self._streak = 0
        elif not self.engaged:
            if model_out is not None:
                self._streak += 1
            if self._streak >= c.engage_count:
                self.engaged = True
            else:
                reason = _RECOVERING

        if self.engaged:
            out = self._latest
            target = -(c.k_p * out.offset_m + c.k_h * out.heading_rad)
            target = min(max(target, -c.max_steer), c.max_steer)
            if c.tau_s > 0:
                alpha = 1.0 - math.exp(-dt / c.tau_s) if dt > 0 else 0.0
                self._filtered += alpha * (target - self._filtered)
                target = self._filtered
        else:
            target = 0.0
            self._filtered = self.steer      # the filter restarts from where we are
        step = c.max_rate * dt
        self.steer += min(max(target - self.steer, -step), step)
        self.steer = min(max(self.steer, -c.max_steer), c.max_steer)
        if not self.engaged:
            self._filtered = self.steer
        age = -1.0 if self._latest is None else (now_ns - self._latest.ts_ns) / 1e6
        return Command(self.steer, self.engaged, reason, age, target,
                       None if self._latest is None else self._latest.frame_id)
