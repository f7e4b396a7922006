"""A worker's watchdog: its pings, and on the car its actuation channels' publishes.

A worker that says WATCHDOG=1 at least every ``watchdog_ms`` is alive. On the car an
actuation writer must also write: pings from a thread while its loop is wedged are not
control (red team 16 row 5), so its channels' sequence (the header's last_seq) must move
within the same bound. Not in a simulation: a replay's commands follow the log's steps,
not the clock. Silence while the supervisor itself was stopped counts for no worker
(`OwnPause`), and a ping already in the status pipe is read before any verdict.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from supervisor.ipc import Channel

from ._ownpause import OwnPause
from ._run import WorkerRun


@dataclass
class Watchdog:
    """One run's watchdog; `watch()` returns the reason when it has found the worker
    dead to the world (the caller kills it), never while it lives."""

    run: WorkerRun
    limit_ns: int
    outs: Mapping[str, Channel]          # the actuation channels judged (empty: pings only)
    own: OwnPause
    poll_status: Callable[[WorkerRun], bool]   # reads one waiting status line; False: none
    emit: Callable[..., object]

    def _late(self) -> int:
        return time.monotonic_ns() - self.own.silent_since(self.run.last_ping_ns)

    async def watch(self) -> str:
        run, limit = self.run, self.limit_ns
        # Each channel on its own: one that moves never covers another that is silent.
        seqs = {name: ch.last_sequence() for name, ch in self.outs.items()}
        wrote = dict.fromkeys(self.outs, time.monotonic_ns())
        while True:
            late = self._late()
            if late > limit:
                # Our own lag must never be blamed on the worker: read what it sent.
                for _ in range(64):
                    if not self.poll_status(run) or self._late() <= limit:
                        break
                late = self._late()
            quiet, silent = 0, ""
            for name, ch in self.outs.items():
                seq, now = ch.last_sequence(), time.monotonic_ns()
                if seq != seqs[name]:
                    seqs[name], wrote[name] = seq, now
                q = now - self.own.silent_since(wrote[name], now)
                if q > quiet:
                    quiet, silent = q, name
            if late > limit:
                self.emit("watchdog_missed", worker=run.cfg.name, pid=run.pid,
                          silent_ms=round(late / 1e6, 1))
                return f"watchdog: no ping for {late / 1e6:.0f} ms"
            if quiet > limit:
                self.emit("watchdog_missed", worker=run.cfg.name, pid=run.pid,
                          silent_ms=round(quiet / 1e6, 1), channel=silent,
                          note="its actuation channel is silent: its pings are not control")
                return f"watchdog: pings, but nothing published on {silent} for {quiet / 1e6:.0f} ms"
            wait = (limit - max(late, quiet)) / 1e9 + 0.001
            # A change is seen when looked for: looking 3 times a period finds a silent
            # channel within 1.33 periods of its last publish.
            await trio.sleep(min(wait, limit / 3e9) if self.outs else wait)
