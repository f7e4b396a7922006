"""One structured log line per lifecycle event (start, ready, exit, restart, refusal...)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO


def _text(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str, separators=(",", ":"))
    if s and s.isprintable() and " " not in s and "=" not in s and '"' not in s:
        return s
    return json.dumps(s)


@dataclass
class EventLog:
    """Writes events as JSON lines (or ``key=value`` text) and keeps them for callers."""

    stream: TextIO = field(default_factory=lambda: sys.stderr)
    fmt: str = "json"
    keep: bool = True
    events: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"ts": round(time.time(), 6), "mono_ns": time.monotonic_ns(), "event": event,
               **fields}
        if self.keep:
            self.events.append(rec)
        if self.fmt == "json":
            line = json.dumps(rec, default=str, separators=(",", ":"))
        else:
            # Values are quoted when they could pass for more keys or a new line (a
            # worker's output or status is text it chose).
            line = " ".join(f"{k}={_text(v)}" for k, v in rec.items() if k != "mono_ns")
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed log stream must not take the supervisor down
        return rec

    def of(self, event: str, worker: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events
                if e["event"] == event and (worker is None or e.get("worker") == worker)]
