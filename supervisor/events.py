"""One structured log line per lifecycle event (start, ready, exit, restart, refusal...)."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TextIO

from supervisor import outstream


class Level(IntEnum):
    """An event's level; the values are journald's (syslog) priorities, so a lower
    number matters more. Every event carries its level's name in ``level``."""

    ERROR = 3      # the system is not doing its job: fail-safe, latch errors, exit != 0
    WARNING = 4    # a worker failed or was refused; a limit is off; the system goes on
    INFO = 6       # lifecycle: start, ready, restart, a clean stop
    DEBUG = 7      # diagnostics an operator asks for (--log-level debug)


# The level of each event that is not INFO. A worker's own lines (output, log) are
# INFO whatever they say: a worker cannot raise an alarm in the supervisor's name,
# and what it printed before it died is what an operator reads first. Periodic status
# is INFO too: it comes at status_interval_s (news at once), not per frame.
_LEVELS: dict[str, Level] = {
    "fail_safe": Level.ERROR, "fail_safe_error": Level.ERROR,
    "last_word_error": Level.ERROR,      # SAFE not said: the readers' max age is all left
    "fail_safe_latch_error": Level.ERROR, "fail_safe_command": Level.WARNING,
    "start_failed_required": Level.ERROR, "gave_up": Level.ERROR,
    "refused": Level.WARNING, "ready_timeout": Level.WARNING, "watchdog_missed": Level.WARNING,
    "limits_not_enforced": Level.WARNING, "realtime_unavailable": Level.WARNING,
    "cgroup_error": Level.WARNING, "start_failed": Level.WARNING,
    "standby_failed": Level.WARNING, "protocol_error": Level.WARNING,
    "output_dropped": Level.WARNING, "output_throttled": Level.WARNING,
    "monitor_error": Level.WARNING,
    "config_problem": Level.WARNING, "restart": Level.WARNING, "cooldown": Level.WARNING,
    "broker_refused": Level.WARNING, "broker_error": Level.ERROR,   # supervisor/broker
}
LEVEL_NAMES = {"debug": Level.DEBUG, "info": Level.INFO, "warning": Level.WARNING,
               "error": Level.ERROR}


def level_of(event: str, fields: dict[str, Any]) -> Level:
    """The level of one event: by name, and by exit code for the events that carry one
    (an exit or a supervisor exit with code 0 is INFO, anything else matters)."""
    if event in ("exit", "supervisor_exit", "standby_exit"):
        code = fields.get("code")
        if code in (0, None) or fields.get("expected"):
            return Level.INFO
        return Level.ERROR if event == "supervisor_exit" else Level.WARNING
    if event == "gave_up" and fields.get("optional"):
        # an optional worker's crash loop (research): it cools down and is tried again,
        # the system goes on; `journalctl -p err` is for what stops it (red team 11 row 5)
        return Level.WARNING
    return _LEVELS.get(event, Level.INFO)


def _journal_stream(stream: TextIO) -> bool:
    """True when `stream` is systemd's journal stream ($JOURNAL_STREAM = dev:ino of it):
    then each line starts with <N>, which journald reads as the line's priority."""
    want = os.environ.get("JOURNAL_STREAM", "")
    if not want:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def _text(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str, separators=(",", ":"))
    if s and s.isprintable() and " " not in s and "=" not in s and '"' not in s:
        return s
    return json.dumps(s)


# How deep a value of an event may nest as written; deeper is cut to a marker.
MAX_DEPTH = 32


def _plain(v: Any, depth: int = 0) -> Any:
    """`v` as strict JSON can carry it: non-finite floats as strings, anything nested
    deeper than MAX_DEPTH as "...", keys as strings. Only for an event json.dumps
    refused: the common case never walks."""
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if depth >= MAX_DEPTH:
        return "..."
    if isinstance(v, dict):
        return {str(k): _plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    return str(v)


def render(rec: dict[str, Any], fmt: str = "json") -> str:
    """One event as a line: strict JSON (RFC 8259: no NaN, bounded depth, whatever a
    worker's record held: red team round 6 rows 1 and 6), or text for a terminal."""
    if fmt == "json":
        try:
            return json.dumps(rec, default=str, separators=(",", ":"), allow_nan=False)
        except (ValueError, RecursionError):
            return json.dumps(_plain(rec), default=str, separators=(",", ":"))
    ts = rec.get("ts", 0.0)
    clock = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
    # Values are quoted when they could pass for more keys or a new line (a worker's
    # output or status is text it chose).
    rest = " ".join(f"{k}={_text(v)}" for k, v in rec.items()
                    if k not in ("ts", "mono_ns", "source", "event", "level"))
    return f"{clock} {_text(rec.get('source', '?'))} {_text(rec.get('event', '?'))} {rest}".rstrip()


@dataclass
class EventLog:
    """The one log format: every line is one event, the supervisor's own or a worker's.

    JSON (default): one object per line, always with ``ts`` (unix seconds), ``source``
    ("supervisor", or the worker whose output or log record it carries: set here from
    the pipe it came from, never from what the worker wrote), ``event`` and, for events
    about a worker, ``worker`` and ``domain``. ``--log-format text`` renders the same
    events for a terminal: ``HH:MM:SS.mmm SOURCE EVENT key=value ...``.

    Every event has a ``level`` (`Level`, journald's priorities); events below
    ``min_level`` are kept (``events``) but not written (``--log-level``). Under systemd
    each line is prefixed with journald's ``<N>`` priority.
    """

    stream: TextIO = field(default_factory=lambda: sys.stderr)
    fmt: str = "json"
    keep: bool = True
    events: list[dict[str, Any]] = field(default_factory=list)
    min_level: Level = Level.DEBUG
    journal: bool | None = None      # None: detect from $JOURNAL_STREAM
    # Lines go out through a thread of their own (supervisor/outstream.py): a blocked
    # console or journald never holds the caller. None: written here (no fd: StringIO).
    _writer: outstream.StreamWriter | None = field(default=None, init=False, repr=False)
    _writer_made: bool = field(default=False, init=False, repr=False)

    def emit(self, event: str, *, source: str = "supervisor", **fields: Any) -> dict[str, Any]:
        level = level_of(event, fields)
        rec = {"ts": round(time.time(), 6), "mono_ns": time.monotonic_ns(), "source": source,
               "event": event, "level": level.name.lower(), **fields}
        if self.keep:
            self.events.append(rec)
        if level > self.min_level:
            return rec
        self._write(rec, level)
        return rec

    def _write(self, rec: dict[str, Any], level: Level) -> None:
        if self.journal is None:
            self.journal = _journal_stream(self.stream)
        if not self._writer_made:
            self._writer_made = True
            self._writer = outstream.writer_for(self.stream, self._dropped_line)
        line = self._line(rec, level)
        if self._writer is not None:
            self._writer.put(line, outstream.VITAL if level <= Level.ERROR
                             else outstream.URGENT if level <= Level.WARNING else 0)
            return
        try:
            self.stream.write(line)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed log stream must not take the supervisor down

    def _line(self, rec: dict[str, Any], level: Level) -> str:
        """One event as written: journald's priority prefix under systemd, the render."""
        return (f"<{int(level)}>" if self.journal else "") + render(rec, self.fmt) + "\n"

    def _dropped_line(self, n: int) -> str:
        """Said in place of the lines a blocked stream could not take (queue full)."""
        rec = {"ts": round(time.time(), 6), "mono_ns": time.monotonic_ns(),
               "source": "supervisor", "event": "log_dropped", "level": "warning",
               "lines": n, "reason": "the log stream was blocked (a stopped console, a "
               "stalled pipe or journald); the events are still counted and kept"}
        return self._line(rec, Level.WARNING)

    def drain(self, timeout: float = outstream.DRAIN_AT_EXIT_S) -> bool:
        """Every line emitted so far, written (False: the stream stayed blocked)."""
        return self._writer.drain(timeout) if self._writer is not None else True

    def of(self, event: str, worker: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events
                if e["event"] == event and (worker is None or e.get("worker") == worker)]
