"""The supervisor's own pauses: silence it could not have seen is nobody's fault.

A freezer's thaw (`systemctl freeze`/`thaw`), a VM its host paused, a SIGSTOP of the
whole unit: every process stopped alike, and which runs first again is the scheduler's
choice. A supervisor that runs 200 ms before its workers saw each silent for the whole
pause and killed every control worker by watchdog, discarding their still-stopped
standbys on the way (red team 16 row 16). Its heartbeat runs every TICK_S; any judge
that finds the last beat older than GAP_NS knows the supervisor itself was not
running, takes now as the end of a pause, and measures silence from there: a worker
has a whole watchdog period after the resume, as after its READY.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

TICK_S = 0.05
# More than a loaded loop's ordinary lag (tens of ms on 2 cores beside two CPU hogs),
# less than the car's watchdogs (controlsd 200 ms, the others 500 ms): a pause this long
# is past a scheduling hiccup.
GAP_NS = 150_000_000


@dataclass
class OwnPause:
    """When the supervisor last resumed from a pause of its own (monotonic ns, 0:
    never). `check()` before any judgement of a worker's silence."""

    emit: Callable[..., object]
    gap_ns: int = GAP_NS
    resumed_ns: int = 0
    pauses: int = 0
    _beat_ns: int = field(default_factory=time.monotonic_ns)

    def check(self, now_ns: int | None = None) -> int:
        """The end of the supervisor's last pause (the pause just found, if any)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        gap = now - self._beat_ns
        self._beat_ns = max(self._beat_ns, now)
        if gap > self.gap_ns:
            self.resumed_ns = now
            self.pauses += 1
            self.emit("supervisor_paused", worker=None, paused_ms=round(gap / 1e6, 1),
                      note="silence during it is not held against any worker")
        return self.resumed_ns

    def silent_since(self, last_ns: int, now_ns: int | None = None) -> int:
        """When a worker last spoke (``last_ns``), as its judges may count it."""
        return max(last_ns, self.check(now_ns))

    async def run(self) -> None:
        while True:
            self.check()
            await trio.sleep(TICK_S)
