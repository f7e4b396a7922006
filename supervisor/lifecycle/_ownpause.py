"""The supervisor's own pauses: silence it could not have seen is nobody's fault.

A freezer's thaw (`systemctl freeze`/`thaw`), a VM its host paused, a SIGSTOP of the
whole unit: every process stopped alike, and which runs first again is the scheduler's
choice. A supervisor that runs 200 ms before its workers saw each silent for the whole
pause and killed every control worker by watchdog, discarding their still-stopped
standbys on the way (red team 16 row 16). Its heartbeat runs every TICK_S; any judge
that finds the last beat older than GAP_NS asks the kernel whether the loop's thread was
stopped or merely slow: a stopped thread neither ran nor waited on a run queue
(/proc/thread-self/schedstat), a slow one (a loaded machine) did, and a slow supervisor
still judges its workers as it always has (red team 16 row 28). After a real pause the
judges count a worker's silence from its end: a whole watchdog period, as after READY.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

TICK_S = 0.05
# More than a loaded loop's ordinary lag (tens of ms on 2 cores beside two CPU hogs),
# less than the car's watchdogs (controlsd 200 ms, the others 500 ms).
GAP_NS = 150_000_000


def _scheduled_ns() -> int:
    """Time this thread ran plus time it waited runnable (ns), or -1 where the kernel
    keeps no schedstat (then every long gap counts as a pause)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) + int(waited)
    except (OSError, ValueError):
        return -1


@dataclass
class OwnPause:
    """When the supervisor last resumed from a pause of its own (monotonic ns, 0:
    never). `check()` before any judgement of a worker's silence, from the loop's thread."""

    emit: Callable[..., object]
    gap_ns: int = GAP_NS
    resumed_ns: int = 0
    pauses: int = 0
    _beat_ns: int = field(default_factory=time.monotonic_ns)
    _sched_ns: int = field(default_factory=_scheduled_ns)

    def check(self, now_ns: int | None = None) -> int:
        """The end of the supervisor's last pause (the pause just found, if any)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        gap = now - self._beat_ns
        if gap <= self.gap_ns:
            if now > self._beat_ns:
                self._beat_ns, self._sched_ns = now, _scheduled_ns()
            return self.resumed_ns
        sched = _scheduled_ns()
        ran = sched - self._sched_ns if sched >= 0 and self._sched_ns >= 0 else 0
        self._beat_ns, self._sched_ns = now, sched
        if ran < gap // 2:                # neither running nor queued: stopped
            self.resumed_ns = now
            self.pauses += 1
            self.emit("supervisor_paused", worker=None, paused_ms=round(gap / 1e6, 1),
                      note="silence during it is not held against any worker")
        return self.resumed_ns

    def silent_since(self, last_ns: int, now_ns: int | None = None) -> int:
        """When a worker last spoke (``last_ns``), as its judges may count it."""
        return max(last_ns, self.check(now_ns))

    async def run(self) -> None:
        self._beat_ns, self._sched_ns = time.monotonic_ns(), _scheduled_ns()   # from now
        while True:
            self.check()
            await trio.sleep(TICK_S)
