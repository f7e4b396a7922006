"""Seeing that the machine was suspended: the one time the law's clock lies.

Message ages are on CLOCK_MONOTONIC, which stops while the machine is suspended: an
output from before a suspend looks as young after the resume as it was before it, and
would steer the car for up to ``max_age_ms`` on a world that is seconds old. The bridge,
the supervisor's watchdogs and every worker keep CLOCK_MONOTONIC on purpose (a resume
must not look like every worker missing its watchdog at once); controlsd, the last gate
before actuation, watches CLOCK_BOOTTIME - CLOCK_MONOTONIC instead, which grows by
exactly the time spent suspended, and tells the law (`ControlLaw.clock_stopped`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# A suspend shorter than this is invisible here: ages are then wrong by less than it,
# far inside the law's max_age. A preemption between the clock reads is not a suspend:
# a read whose two monotonic stamps are further apart than READ_NS is not judged.
THRESHOLD_NS = 10_000_000
READ_NS = 200_000

_BOOT, _MONO = time.CLOCK_BOOTTIME, time.CLOCK_MONOTONIC


def read() -> tuple[int, int, int]:
    """(monotonic, boottime, monotonic), read back to back."""
    g = time.clock_gettime_ns
    return g(_MONO), g(_BOOT), g(_MONO)


@dataclass
class SuspendWatch:
    """Tells, at each look, whether the machine was suspended since the last one."""

    threshold_ns: int = THRESHOLD_NS
    suspends: int = 0                     # seen so far (the status line shows it)
    _offset_ns: int | None = field(default=None, repr=False)

    def check(self, mono_a: int, boot: int, mono_b: int) -> bool:
        """True when boottime ran ahead of monotonic by more than the threshold since
        the last judged read: the clocks of ``read()``, clock passed in."""
        if mono_b - mono_a > READ_NS:
            return False                   # preempted between the reads: no verdict
        offset = boot - (mono_a + mono_b) // 2
        last, self._offset_ns = self._offset_ns, offset
        if last is not None and offset - last > self.threshold_ns:
            self.suspends += 1
            return True
        return False

    def look(self) -> bool:
        return self.check(*read())
