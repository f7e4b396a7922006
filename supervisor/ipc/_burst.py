"""Staying awake through a burst (a reader's ``spin_us``): look at shared memory a
little longer before sleeping, while messages are coming faster than a wake-up costs.

Why (measured, bench/ipc_latency.py --syscalls, 64 B stream): a reader that finds the
ring empty blocks on its wake-up socket, and every message after that costs the writer
a wake-up write (its ``sendto``), the reader a ``poll`` and a ``read`` that drains, and
the kernel a wake-up of the sleeping task, 50-200 us on a VM's idle vCPU; while it
sleeps the writer runs out of ring or credit and waits too. In a 64 B stream about
half the messages found the reader asleep (0.5 sleeps per message, untraced). Still
looking, the reader keeps its awake flag up, so the writer sends nothing (K5 in
_native.c): no system call on either side.

The rule: after a message, if it came within ``spin_ns`` of the one before (a burst),
a reader that finds nothing looks again until ``spin_ns`` after that message, then
sleeps as usual. So:
* a stream slower than one message per ``spin_ns`` (every camera, model and control
  stream of the car: 10-50 ms apart) never spins: no CPU at all;
* in a burst, the spin per message is at most ``spin_ns`` of wall time, counted from
  the message (the caller's own work between receives comes out of it), i.e. no more
  than the wake-up it replaces;
* a spin that ends empty means the next message comes more than ``spin_ns`` after the
  last one, so after it the reader does not spin again until two messages have come
  within ``spin_ns`` of each other: a writer that times its messages to just miss the
  spin gets at most one spin per two messages.
On by default (``SPIN_US``) since the native receive path (round 8) keeps a spinning
reader on its C take: a faster receiver caught up with its writer and slept on ~1 in 10
messages of a 64 KiB stream, and each wake-up cost the writer more than the receive
saved (bench/ipc_latency.py, quiet, throughput msgs/s, iceoryx2 / no spin / spin:
64 KiB 209,880 / 163,115 / 263,195; 64 B 296,100 / 397,355 / 399,660; with two CPU
hogs beside it 64 KiB 64,005 / 69,350 / 124,570, 64 B 132,865 / 179,510 / 181,660).
It had been off: on the Python path, loaded, a spinning 64 B stream ran at 0.3-1.1x.
``spin_us=0`` turns it off; ``--transports bridge,bridge-nospin`` compares. Never for
a reader in a real-time class (checked once a second in Reader._spin): above its writer on a shared CPU the
spin takes the CPU the writer needs (the rule config/_rules.check_busy_poll states for
busy_poll_us).
"""
from __future__ import annotations

from dataclasses import dataclass

SPIN_US = 50             # suggested: below a VM's wake-up, above a message's own cost
MAX_SPIN_US = 1000


@dataclass
class Burst:
    spin_ns: int
    last_ns: int = 0        # when the reader took its last message (monotonic ns)
    prev_ns: int = 0        # ... and the one before it
    hits: int = 0           # spins that found a message
    misses: int = 0         # spins that ended empty

    def took(self, now_ns: int) -> None:
        self.prev_ns, self.last_ns = self.last_ns, now_ns

    def until(self, end_ns: int | None) -> int:
        """Monotonic ns to look until before sleeping; 0: not in a burst, sleep now."""
        if not self.prev_ns or self.last_ns - self.prev_ns > self.spin_ns:
            return 0
        stop = self.last_ns + self.spin_ns
        return stop if end_ns is None else min(stop, end_ns)
