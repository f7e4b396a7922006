"""The supervisor's own pauses: silence it could not have seen is nobody's fault.

A freezer's thaw (`systemctl freeze`/`thaw`), a VM its host paused, a SIGSTOP of the
whole unit: every process stopped alike, and which runs first again is the scheduler's
choice. A supervisor that runs 200 ms before its workers saw each silent for the whole
pause and killed every control worker by watchdog, discarding their still-stopped
standbys on the way (red team 16 row 16).

Its heartbeat runs every TICK_S. A judge that finds the last beat older than GAP_NS asks
the kernel what happened meanwhile (/proc/PID/schedstat: each thread's time on a CPU and
how many times it was put there): a pause stopped the workers it judges too, so none of
them ran, or woke, for most of the gap at its usual rate (STILL_NS and STILL, plus half
its usual rate over the gap: a worker runs on for a few ms between the supervisor's stop
and its own; a busy one shows in its time, one that wakes to ping in its count). A loop
that was merely slow (runnable, red team 16 row 28) or blocked in a syscall while its
workers ran on (a fat worker's teardown, a sleep: red team 17 rows 7, 14) is no pause:
their silence was real, and the judges read what they sent before any verdict as always.
After a pause the judges count a worker's silence from its end: a whole watchdog, as
after READY.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

# A beat costs the loop a wake-up and one /proc read per judged worker (~40 us with 7):
# 10 a second, so a gap is a beat missed by more than the loaded loop's lag.
TICK_S = 0.1
# More than a beat plus a loaded loop's ordinary lag (tens of ms on 2 cores beside two
# CPU hogs), less than the car's watchdogs (controlsd 200 ms, the others 500 ms).
GAP_NS = 180_000_000
# What a stopped worker may still show around a gap (its last ms before its own stop,
# taking the SIGSTOP, resuming): more, and it ran meanwhile.
STILL = 2
STILL_NS = 5_000_000


def _sched(pid: int | str) -> tuple[int, int] | None:
    """(ns on a CPU, times put on one) of the process's main thread; None if gone."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran, _, slices = f.read().split()[:3]
        return int(ran), int(slices)
    except (OSError, ValueError):
        return None


@dataclass
class OwnPause:
    """When the supervisor last resumed from a pause of its own (monotonic ns, 0:
    never). `check()` before any judgement of a worker's silence, from the loop's
    thread. ``fleet``: the pids of the workers whose silence is judged (none: nothing
    to forgive, never a pause)."""

    emit: Callable[..., object]
    fleet: Callable[[], Iterable[int]] = lambda: ()
    gap_ns: int = GAP_NS
    resumed_ns: int = 0
    pauses: int = 0
    _beat_ns: int = field(default_factory=time.monotonic_ns)
    _seen: dict = field(default_factory=dict)      # fleet pid -> (ns, slices) at the last beat
    _rate: dict = field(default_factory=dict)      # fleet pid -> (ns, slices) per ns, usually

    def _look(self) -> dict:
        return {pid: got for pid in self.fleet() if (got := _sched(pid)) is not None}

    def _stood_still(self, now: dict, gap: int) -> bool:
        """Every worker seen at both looks ran and woke far less than usual over the
        gap (and there was such a worker)."""
        both = [pid for pid in now if pid in self._seen]
        for pid in both:
            (ran, woke), (ran0, woke0) = now[pid], self._seen[pid]
            r_ns, r_woke = self._rate.get(pid, (0.0, 0.0))
            if ran - ran0 > STILL_NS + 0.5 * r_ns * gap or woke - woke0 > STILL + 0.5 * r_woke * gap:
                return False
        return bool(both)

    def _learn(self, now: dict, gap: int) -> None:
        for pid, (ran, woke) in now.items():
            if pid in self._seen and gap > 0:
                ran0, woke0 = self._seen[pid]
                r = ((ran - ran0) / gap, (woke - woke0) / gap)
                old = self._rate.get(pid)
                self._rate[pid] = r if old is None else (0.8 * old[0] + 0.2 * r[0],
                                                         0.8 * old[1] + 0.2 * r[1])
        for pid in [p for p in self._rate if p not in now]:
            del self._rate[pid]

    def check(self, now_ns: int | None = None) -> int:
        """The end of the supervisor's last pause (the pause just found, if any)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        if now - self._beat_ns < TICK_S * 5e8:
            return self.resumed_ns         # looked within half a beat: nothing new to see
        gap = now - self._beat_ns
        seen = self._look()
        paused = gap > self.gap_ns and self._stood_still(seen, gap)
        if gap <= self.gap_ns:
            self._learn(seen, gap)            # a usual interval: what "usual" is
        self._beat_ns, self._seen = now, seen
        if paused:
            self.resumed_ns = now
            self.pauses += 1
            self.emit("supervisor_paused", worker=None, paused_ms=round(gap / 1e6, 1),
                      note="it and its workers were stopped: silence during it is not "
                           "held against any worker")
        return self.resumed_ns

    def silent_since(self, last_ns: int, now_ns: int | None = None) -> int:
        """When a worker last spoke (``last_ns``), as its judges may count it."""
        return max(last_ns, self.check(now_ns))

    async def run(self) -> None:
        self._beat_ns, self._seen = time.monotonic_ns(), self._look()    # from now
        while True:
            self.check()
            await trio.sleep(TICK_S)
