"""Busy-polling a periodic stream around its next message (a reader's ``busy_poll_us``).

Why: a reader asleep on the wake-up socket pays for waking up on every message: the
kernel's wake-up of an idle CPU (100-200 us on a VM's idle vCPU; deep C-states cost as
much on bare metal) and then caches gone cold in 50 ms of sleep. A camera publishes on
a fixed period, so the reader can sleep until shortly before the next frame is due and
watch shared memory until it arrives; the writer then skips the wake-up too (the
reader's awake flag). Linux's SO_BUSY_POLL makes the same trade for sockets.

A window begins with a rehearsal (``Reader.rehearse``): the message taken last is taken
again and the worker's path run on it without effect, so that the next one runs on warm
caches; it spends the window's own time.

Cost: at most ``2 * busy_poll_us`` of CPU per message and about half of one CPU in all
(a window opens at least ``2 * busy_poll_us`` after the last one closed, on this
reader's clock; plus the calls around them), and
none unless the stream is regular: the last intervals agree to within the window. The publish stamps it learns
from are the writer's (a lying writer only moves the window: the message itself is
still checked in full, and a window missed just means the usual blocking wait).

A stream whose period does not predict it (a model's output: it follows the inference,
which jitters by milliseconds) is predicted by its writer instead: ``Writer.announce``
names the next sequence number and when it is due, and the window is centred there; a
later announcement (the writer knows better once part of its work is done) moves a
window that has not opened yet (the reader is woken for it).
Whatever a writer announces, a reader spins through at most one window per message it
takes, announced or predicted (``spent``; a window cut short by the caller's timeout
may be resumed, never moved), so the bound above holds against a lying writer too.
Announcements are believed while ``trust`` is _SETTLE or more: each announced message,
polled for or not, counts +1 if it came within its window and -1 if not, kept between 0
and _TRUST_MAX; and only once the stream's period is known, for a due after the last
message and at most _HORIZON_NS ahead. A writer right 60 % of the time is believed for
~89 % of its messages, one right half the time for ~55 %, one right 40 % of the time for
~18 % (simulated). (A model's inference time varies: on a shared 2-CPU machine 40-60 % of
outputs came within 1 ms of their announcement, and "4 in a row, a miss halves" opened a
window for ~26 % of them at 60 %.) Trust only spends this reader's CPU, within the bound
above.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_BUSY_POLL_US = 100_000   # a window of 0.2 s: anything longer is not busy-polling
_SETTLE = 4          # intervals within the window in a row before the first window
_GAP = 4             # an interval this many periods long: the stream paused; start over
_DUTY = 4            # never poll more than 2 windows in this many: a stream faster than
                     # 4 x busy_poll_us (a camera gone wild) is waited for as usual
_HORIZON_NS = 5_000_000_000   # an announced due further ahead is not believed
_TRUST_MAX = 2 * _SETTLE      # so a writer right for long loses belief in 5 misses


@dataclass
class Cadence:
    lead_ns: int            # the window: due - lead .. due + lead
    period_ns: int = 0      # smoothed interval between publishes (0: not known yet)
    jitter_ns: int = 0      # smoothed |interval - period|
    last_pub_ns: int = 0
    regular: int = 0        # consecutive intervals within the window
    hits: int = 0           # messages taken while busy-polling
    misses: int = 0         # windows that ended without one
    spent: tuple[int, int, int] = (0, 0, 0)   # (sequence number, start, stop) of the
                                              # window polled last: one per message
    heard: tuple[int, int] = (0, 0)   # the announcement read while waiting: (seq, due)
    trust: int = 0          # announced messages within their window, minus those not

    def seen(self, publish_ts_ns: int, sequence: int = 0, announced: tuple[int, int] = (0, 0)
             ) -> None:
        """Message ``sequence``, published at ``publish_ts_ns``, was taken; ``announced``:
        the writer's announcement as it stands now, (sequence, due): it or the one
        read while waiting (a writer may announce the next before this one is taken)."""
        if announced[0] != sequence:
            announced = self.heard
        if announced[0] == sequence and sequence:
            # Was it announced right (would its window have held it)? Judged on every
            # announced message, polled for or not, so a writer whose announcements
            # miss (a loaded machine: inference times all over) is waited for as
            # usual, and earns windows back by announcing right again.
            ok = abs(publish_ts_ns - announced[1]) < self.lead_ns
            self.trust = min(self.trust + 1, _TRUST_MAX) if ok else max(self.trust - 1, 0)
        last, self.last_pub_ns = self.last_pub_ns, publish_ts_ns
        if not last or publish_ts_ns <= last:
            return
        iv = publish_ts_ns - last
        p = self.period_ns
        if not p or iv > _GAP * p:
            self.period_ns, self.jitter_ns, self.regular = iv, 0, 0
            return
        dev = abs(iv - p)
        self.period_ns = p + (iv - p) // 8
        self.jitter_ns += (dev - self.jitter_ns) // 8
        # One late frame (and the short interval after it) halves the confidence
        # instead of wiping it: a camera keeps its schedule through a hiccup.
        self.regular = self.regular + 1 if dev < self.lead_ns else self.regular // 2

    def window(self) -> tuple[int, int] | None:
        """[start, stop) of monotonic ns to busy-poll for the next message, or None."""
        if (self.regular < _SETTLE or self.jitter_ns > self.lead_ns
                or self.period_ns < _DUTY * self.lead_ns):
            return None
        due = self.last_pub_ns + self.period_ns
        return due - self.lead_ns, due + self.lead_ns

    def next_window(self, nxt: int, seq: int, due_ns: int, now_ns: int
                    ) -> tuple[int, int] | None:
        """[start, stop) to busy-poll for message ``nxt``, or None: around the time the
        writer announced (``seq``, ``due_ns``: Writer.announce) if that names ``nxt``
        and is plausible, else from the period (``window``). One window per message,
        whatever its source: once one was polled for ``nxt`` (``spent``), only it may
        be resumed (the caller's timeout may have cut it short)."""
        if seq == nxt:
            self.heard = (seq, due_ns)
        if self.spent[0] == nxt:
            return self.spent[1], self.spent[2]
        if (seq == nxt and self.trust >= _SETTLE
                and self.last_pub_ns < due_ns <= now_ns + _HORIZON_NS
                and self.period_ns >= _DUTY * self.lead_ns):
            w = due_ns - self.lead_ns, due_ns + self.lead_ns
        else:
            w = self.window()
        if w is None:
            return None
        # The duty bound on this reader's own clock (review: a writer that froze its
        # publish stamps kept an old period, and announced windows back to back spun a
        # reader at 86 % of a CPU): a window opens 2 x lead after the last one closed.
        start = max(w[0], self.spent[2] + 2 * self.lead_ns)
        return (start, w[1]) if start < w[1] else None
