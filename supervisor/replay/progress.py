"""Progress on a terminal for ``record``, ``replay`` and fleets: one line rewritten in
place, nothing at all when the stream is not a terminal (CI logs stay clean).

    record: 12.4 s of 30 s, 245 frames, 0 dropped
    replay: starting the pipeline: 3/5 workers ready (8.1 s)
    replay [##########          ] 40/120 frames  11.2 fps
    fleet: 3/10 logs done (1 failed), 41 s, ETA 95 s

The counts come from the log being written (read as it grows: whole records only) and
from the lifecycle events, never from the workers' status lines (rate limited).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .logfmt import REC, Entry, read_stream


def is_terminal(out: Any) -> bool:
    return out is not None and hasattr(out, "isatty") and out.isatty()


class Line:
    """One status line rewritten in place (``\\r``), padded over the previous one."""

    def __init__(self, out: TextIO | None) -> None:
        self.out = out if is_terminal(out) else None
        self._width = 0

    @property
    def enabled(self) -> bool:
        return self.out is not None

    def show(self, text: str) -> None:
        if self.out is None:
            return
        self.out.write("\r" + text.ljust(self._width))
        self.out.flush()
        self._width = len(text)

    def close(self) -> None:
        if self.out is not None and self._width:
            self.out.write("\n")
            self.out.flush()


class LogCounter:
    """Counts what a recorder has written to a growing ``messages.tlog``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.frames = 0
        self.messages: dict[str, int] = {}
        self.dropped = 0

    def poll(self) -> None:
        if not self.path.is_file():
            return
        last = self.offset
        for off, body in read_stream(self.path, start=self.offset, final=False):
            with Entry.from_bytes(body) as e:
                which = e.which()
                if which == "frame":
                    self.frames += 1
                elif which == "message":
                    ch = e.message.channel
                    self.messages[ch] = self.messages.get(ch, 0) + 1
                elif which == "drops":
                    d = e.drops
                    self.dropped += d.dropped + d.rejected + d.leasesLost + d.skipped
            last = off + REC.size + len(body)
        self.offset = last


def startup_text(events: list[dict[str, Any]], what: str) -> str:
    """``starting the pipeline: k/n workers ready (t s)`` from the lifecycle events."""
    started = {e.get("worker") for e in events if e.get("event") == "start"}
    ready = {e.get("worker") for e in events if e.get("event") == "ready"}
    t0 = next((e["mono_ns"] for e in events if e.get("event") == "supervisor_start"), None)
    el = f" ({(time.monotonic_ns() - t0) / 1e9:.1f} s)" if t0 else ""
    if not started:
        return f"{what}: starting the supervisor{el}"
    return f"{what}: starting the pipeline: {len(ready & started)}/{len(started)} workers ready{el}"


class RecordProgress:
    """``record``: seconds recorded (of --seconds), frames, drops."""

    def __init__(self, out_dir: str, seconds: float | None, out: TextIO | None = sys.stderr,
                 recorder: str = "recorder") -> None:
        self.line = Line(out)
        self.counter = LogCounter(Path(out_dir) / "messages.tlog")
        self.seconds = seconds
        self.recorder = recorder
        self._next = 0.0

    def tick(self, log) -> None:
        if not self.line.enabled or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + 0.25
        ready = next((e["mono_ns"] for e in log.events if e.get("event") == "ready"
                      and e.get("worker") == self.recorder), None)
        if ready is None:
            self.line.show(startup_text(log.events, "record"))
            return
        self.counter.poll()
        el = (time.monotonic_ns() - ready) / 1e9
        of = f" of {self.seconds:g} s" if self.seconds else " (Ctrl-C stops)"
        self.line.show(f"record: {el:.1f} s{of}, {self.counter.frames} frames, "
                       f"{sum(self.counter.messages.values())} messages, "
                       f"{self.counter.dropped} dropped")

    def close(self) -> None:
        self.line.close()


class FleetProgress:
    """A fleet: logs done of total, failures, elapsed and a naive ETA."""

    def __init__(self, total: int, out: TextIO | None = sys.stderr) -> None:
        self.line = Line(out)
        self.total = total
        self.t0 = time.monotonic()

    def update(self, done: int, failed: int, running: int) -> None:
        el = time.monotonic() - self.t0
        eta = f", ETA {el / done * (self.total - done):.0f} s" if done else ""
        self.line.show(f"fleet: {done}/{self.total} logs done"
                       + (f" ({failed} failed)" if failed else "")
                       + f", {running} running, {el:.0f} s{eta}")

    def close(self) -> None:
        self.line.close()
