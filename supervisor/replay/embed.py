"""Running a derived config under the normal Supervisor, from record and replay.

Lifecycle events go to stderr (or nowhere) as usual and, one entry each, into the
log's ``lifecycle.tlog``; a ``until`` callback decides when the run has what it came
for, after which the supervisor stops in order (SIGTERM in reverse start order: the
recorder first, which drains the rings before it closes the log).
"""
from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from supervisor.events import EventLog
from supervisor.outdir import OutDir

from .drivelog import LogWriter


class _Tee(io.TextIOBase):
    """The EventLog's stream: each JSON line to ``echo`` and into the lifecycle log."""

    def __init__(self, echo, lifecycle: LogWriter | None) -> None:
        self.echo = echo
        self.lifecycle = lifecycle

    def write(self, s: str) -> int:
        if self.echo is not None:
            self.echo.write(s)
        if self.lifecycle is not None:
            for line in s.splitlines():
                try:
                    self.lifecycle.event(json.loads(line))
                except (ValueError, OSError):
                    pass     # the run goes on without a lifecycle entry it cannot write
        return len(s)

    def flush(self) -> None:
        if self.echo is not None:
            self.echo.flush()


@dataclass
class RunOutcome:
    exit_code: int
    # "until" (got what it came for), "timeout", "supervisor" (it ended by itself),
    # "recorder_fault" (the recorder could not write its log: `fault`)
    reason: str
    wall_s: float
    events: list[dict[str, Any]] = field(default_factory=list)
    fault: dict[str, Any] | None = None     # the recorder's `log` event with its fault
    # Each worker's last status line as the supervisor received it (status *events* are
    # rate limited: the last event can be seconds older than the worker's final word).
    final_status: dict[str, str] = field(default_factory=dict)


def recorder_fault(events: list[dict[str, Any]], start: int = 0) -> dict[str, Any] | None:
    """The recorder's record that it stopped writing (a full disk, an I/O error), if any
    (see workers/recorder: ``fault`` in the record's data)."""
    from .derive import RECORDER

    for e in events[start:]:
        if (e.get("event") == "log" and e.get("worker") == RECORDER
                and isinstance(e.get("data"), dict) and e["data"].get("fault")):
            return e
    return None


def host_user_of_research() -> tuple[int, int] | None:
    from supervisor.sandbox.policy import host_ids

    uid, gid = host_ids("research", None)
    return None if uid is None else (uid, gid)


def give_to_recorder(d: OutDir) -> None:
    """The recorder runs as the research host user: its output directory is its own.
    By the fd of the directory that was made or checked (`supervisor.outdir`): never a
    path another user could have pointed elsewhere (red team round 5 row 4)."""
    ids = host_user_of_research()
    if ids is not None:
        d.chown(*ids)


def run_supervised(cfg, lifecycle_dir: str | None, *, until: Callable[[EventLog], bool] | None,
                   timeout_s: float | None, echo=sys.stderr,
                   tick: Callable[[EventLog], None] | None = None,
                   state_dir: str | None = None) -> RunOutcome:
    """``state_dir``: the run's own fail-safe state (a replay's), which then wins over
    TRIO_STATE_DIR too: a replay that fails safe latches nothing outside its run."""
    saved = os.environ.get("TRIO_STATE_DIR")
    if state_dir is not None:
        os.environ["TRIO_STATE_DIR"] = state_dir
    try:
        return _run_supervised(cfg, lifecycle_dir, until=until, timeout_s=timeout_s,
                               echo=echo, tick=tick)
    finally:
        if state_dir is not None:
            if saved is None:
                os.environ.pop("TRIO_STATE_DIR", None)
            else:
                os.environ["TRIO_STATE_DIR"] = saved


def _run_supervised(cfg, lifecycle_dir: str | None, *, until, timeout_s: float | None,
                    echo, tick) -> RunOutcome:
    from supervisor.lifecycle import Supervisor

    lifecycle = None
    if lifecycle_dir is not None:
        try:
            lifecycle = LogWriter(lifecycle_dir, [], writer="supervisor")
        except OSError:
            pass    # (a full disk) the run goes on without its lifecycle log; the recorder says why
    log = EventLog(stream=_Tee(echo, lifecycle), keep=True)
    sup = Supervisor(cfg, log=log, status_out=None)
    reason = "timeout"
    fault: dict[str, Any] | None = None
    seen = 0

    async def main() -> float:
        nonlocal reason, fault, seen
        start = trio.current_time()
        async with trio.open_nursery() as n:
            async def run_it() -> None:
                nonlocal reason
                await sup.run()
                if reason == "timeout":
                    reason = "supervisor"    # it ended by itself (failure or a signal)
                n.cancel_scope.cancel()

            n.start_soon(run_it)
            with trio.move_on_after(timeout_s if timeout_s is not None else float("inf")):
                while True:
                    await trio.sleep(0.05)
                    if tick is not None:
                        tick(log)
                    if until is not None and until(log):
                        reason = "until"
                        break
                    # The recorder cannot write: nothing more will be recorded, stop now
                    # (in order, the control domain untouched) and say why.
                    fault = recorder_fault(log.events, seen)
                    seen = len(log.events)
                    if fault is not None:
                        reason = "recorder_fault"
                        break
            n.cancel_scope.cancel()
        return trio.current_time() - start

    wall = trio.run(main)
    if lifecycle is not None:
        try:
            lifecycle.close({"exit_code": int(sup.exit_code)})
        except OSError:
            pass            # a full disk: the lifecycle log reads as not closed
    return RunOutcome(int(sup.exit_code), reason, wall, log.events, fault, _final_status(sup))


def _final_status(sup) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, run in dict(getattr(sup, "runs", {}) or {}).items():
        text = getattr(run, "status", None)
        if text is None:                      # (per-process state split off the run)
            text = getattr(getattr(run, "current", None), "status", None)
        if isinstance(text, str) and text:
            out[name] = text
    return out
