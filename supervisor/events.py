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


def render(rec: dict[str, Any], fmt: str = "json") -> str:
    """One event as a line: compact JSON, or text for a terminal."""
    if fmt == "json":
        return json.dumps(rec, default=str, separators=(",", ":"))
    ts = rec.get("ts", 0.0)
    clock = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
    # Values are quoted when they could pass for more keys or a new line (a worker's
    # output or status is text it chose).
    rest = " ".join(f"{k}={_text(v)}" for k, v in rec.items()
                    if k not in ("ts", "mono_ns", "source", "event"))
    return f"{clock} {_text(rec.get('source', '?'))} {_text(rec.get('event', '?'))} {rest}".rstrip()


@dataclass
class EventLog:
    """The one log format: every line is one event, the supervisor's own or a worker's.

    JSON (default): one object per line, always with ``ts`` (unix seconds), ``source``
    ("supervisor", or the worker whose output or log record it carries: set here from
    the pipe it came from, never from what the worker wrote), ``event`` and, for events
    about a worker, ``worker`` and ``domain``. ``--log-format text`` renders the same
    events for a terminal: ``HH:MM:SS.mmm SOURCE EVENT key=value ...``.
    """

    stream: TextIO = field(default_factory=lambda: sys.stderr)
    fmt: str = "json"
    keep: bool = True
    events: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, event: str, *, source: str = "supervisor", **fields: Any) -> dict[str, Any]:
        rec = {"ts": round(time.time(), 6), "mono_ns": time.monotonic_ns(), "source": source,
               "event": event, **fields}
        if self.keep:
            self.events.append(rec)
        try:
            self.stream.write(render(rec, self.fmt) + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed log stream must not take the supervisor down
        return rec

    def of(self, event: str, worker: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events
                if e["event"] == event and (worker is None or e.get("worker") == worker)]
