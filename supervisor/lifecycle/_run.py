"""One run of a worker (its process, pipes, cgroup, standby) and the lifecycle's exceptions."""
from __future__ import annotations

import signal
import socket
import subprocess
from collections import deque
from dataclasses import dataclass, field

import trio

from supervisor.config import WorkerConfig
from supervisor.output import LineLimiter


@dataclass
class WorkerRun:
    cfg: WorkerConfig
    proc: subprocess.Popen | None = None
    status_r: int | None = None
    pid: int = 0                  # bwrap (or the worker itself when unsandboxed)
    started_ns: int = 0
    ready_ns: int = 0
    last_ping_ns: int = 0
    ready: trio.Event = field(default_factory=trio.Event)
    restarts: deque = field(default_factory=deque)
    refused: str | None = None
    status: str = ""
    exit_reason: str = ""
    status_buf: bytes = b""                  # an incomplete status line
    status_tokens: float = 1000.0            # status-line rate limit (token bucket)
    status_ts: float = 0.0
    status_logged: str = ""                  # the last status text that became an event
    status_ev_tokens: float = 0.0            # status-event bucket (filled at first use:
    status_ev_ts: float = 0.0                # the refill since ts 0 tops it up)
    status_held: int = 0                     # changes not logged since (rate limit)
    out_r: int | None = None                 # the worker's stdout+stderr (a pipe)
    output: LineLimiter = field(default_factory=LineLimiter)
    cgroup: object | None = None             # sandbox.cgroups.WorkerCgroup of this run
    oom_before: int = 0
    watch_sock: socket.socket | None = None  # receives the exec-watch listener (control)
    watch: object | None = None              # sandbox.execwatch.ExecWatch of this run
    exec_allowed: int = 0                    # executable mappings admitted before READY
    exec_snapshot: object | None = None      # maps.ExecSnapshot taken at READY
    kill_reason: str = ""                    # why the supervisor killed it, if it did
    ready_claimed: bool = False              # the worker said READY=1 (this run)
    realtime_pid: int = 0                    # the thread made SCHED_FIFO at READY
    # Warm standby: a second instance, waiting in its sandbox for the channels.
    is_standby: bool = False
    standby: "WorkerRun | None" = None
    ctl_sock: socket.socket | None = None    # (standby) the supervisor's end of hand-over
    adopted: bool = False
    warm: bool = False                       # (standby) said STANDBY=1: start-up done
    scope: trio.CancelScope | None = None
    handed_over: trio.Event = field(default_factory=trio.Event)
    nursery: trio.Nursery | None = None      # the run's own tasks (status, exec watch...)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"   # real-time signals have no name


class FailSafe(Exception):
    """The control domain must stop now."""


class StartFailed(Exception):
    """A required worker gave up before its first READY."""
