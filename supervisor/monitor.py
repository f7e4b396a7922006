"""The supervisor's own read-only view of the pipeline: a live one-line status.

It attaches to channels as one more reader (the spare reader index every channel has)
and only counts: frames per second and drops, model-output receipts (latency p50/p99,
worst case, deadline misses) and the latest control command. It never writes a channel.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import trio

from supervisor.ipc import BridgeError, Channel, LeaseLost, Reader, Rejected


@dataclass
class ChannelView:
    name: str
    reader: Reader | None
    times: deque = field(default_factory=lambda: deque(maxlen=200))
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=500))
    receipts: int = 0
    worst_ms: float = 0.0
    deadline_misses: int = 0
    device: str = ""
    last: np.ndarray | None = None
    errors: int = 0

    def rate(self) -> float:
        now = time.monotonic()
        recent = [t for t in self.times if now - t <= 2.0]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / max(recent[-1] - recent[0], 1e-9)


class Monitor:
    def __init__(self, channels: dict[str, Channel], reader_index: dict[str, int],
                 out=None, interval_s: float = 1.0) -> None:
        self.views: dict[str, ChannelView] = {}
        self._handles = {}
        for name, ch in channels.items():
            idx = reader_index.get(name)
            if idx is not None and idx < ch.spec.max_readers:
                self._handles[name] = ch.reader_handle(idx)
                self.views[name] = ChannelView(name, None)
        self.out = out or sys.stdout
        self.interval_s = interval_s
        self.lines = 0

    async def _follow(self, v: ChannelView) -> None:
        # A channel whose writer has not started (or was skipped) is attached later.
        while v.reader is None:
            try:
                v.reader = Reader(self._handles[v.name], attach_timeout_s=0.0)
            except BridgeError:
                await trio.sleep(0.5)
        while True:
            try:
                msg = await v.reader.receive_async()
            except (Rejected, BridgeError):
                v.errors += 1
                continue
            try:
                with msg:
                    v.times.append(time.monotonic())
                    if msg.layout.frame is None and msg.array.size <= 64:
                        v.last = np.array(msg.array)
                    r = msg.receipt
                    if r is not None:
                        v.receipts += 1
                        v.latencies_ms.append(r.latency_ns / 1e6)
                        v.worst_ms = r.worst_case_ns / 1e6
                        v.deadline_misses = r.deadline_misses
                        v.device = r.device
            except (LeaseLost, Rejected):
                v.errors += 1

    def line(self) -> str:
        parts = []
        for v in self.views.values():
            if v.reader is None:
                parts.append(f"{v.name} (no writer)")
                continue
            s = v.reader.stats
            text = f"{v.name} {v.rate():5.1f}/s drop {s.dropped}"
            if v.latencies_ms:
                lat = np.percentile(np.array(v.latencies_ms), [50, 99])
                text += (f" | model {v.device} p50 {lat[0]:.1f} ms p99 {lat[1]:.1f} ms "
                         f"worst {v.worst_ms:.1f} ms miss {v.deadline_misses} "
                         f"receipts {v.receipts}")
            if v.name == "control_cmd" and v.last is not None and v.last.size >= 2:
                text += f" | steer {v.last[0]:+.3f} rad {'engaged' if v.last[1] else 'SAFE'}"
            parts.append(text)
        return " || ".join(parts)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for v in self.views.values():
                nursery.start_soon(self._follow, v)
            while True:
                await trio.sleep(self.interval_s)
                try:
                    # On a terminal the status is one line rewritten in place.
                    live = getattr(self.out, "isatty", lambda: False)()
                    self.out.write(("\r\x1b[2K" if live else "") + self.line()
                                   + ("" if live else "\n"))
                    self.out.flush()
                except (OSError, ValueError):
                    pass
                self.lines += 1
