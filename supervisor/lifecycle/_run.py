"""One run of a worker (its process, pipes, cgroup, standby) and the lifecycle's exceptions."""
from __future__ import annotations

import signal
import socket
import subprocess
import threading
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
    status_skip: bool = False                # inside an over-long line: drop to its newline
    status_tokens: float = 1000.0            # status-line rate limit (token bucket)
    status_ts: float = 0.0
    status_logged: str = ""                  # the last status text that became an event
    status_ev_tokens: float = 0.0            # status-event bucket (filled at first use:
    status_ev_ts: float = 0.0                # the refill since ts 0 tops it up)
    status_held: int = 0                     # changes not logged since (rate limit)
    status_logged_at: float = float("-inf")  # when (monotonic s) it was logged
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
    # When the READY line was read (_io, this run): the ready deadline ends here, not at
    # `ready` (which waits for the supervisor's own checks of that READY).
    ready_said_ns: int = 0
    ready_said: trio.Event = field(default_factory=trio.Event)
    realtime_pid: int = 0                    # the thread made SCHED_FIFO at READY
    # The worker process itself (pid 2 of its sandbox) as a pidfd: readable the moment
    # it is dead, before bwrap has noticed (the writer of last resort waits on it).
    worker_pidfd: int | None = None
    last_word_said: bool = False             # SAFE published after this process died
    # Held while checking and setting last_word_said: the last-word thread and the event
    # loop may both come to say it (lifecycle/_lastword.py).
    last_word_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    exit_logged: bool = False                # its `exit` event is out (this process)
    # Warm standby: a second instance, waiting in its sandbox for the channels.
    is_standby: bool = False
    # (active run) its standbys, oldest first; at most _WarmStandby.STANDBY_DEPTH
    standbys: list["WorkerRun"] = field(default_factory=list)
    ctl_sock: socket.socket | None = None    # (standby) the supervisor's end of hand-over
    adopted: bool = False
    warm: bool = False                       # (standby) said STANDBY=1: start-up done
    warmed: trio.Event = field(default_factory=trio.Event)   # (standby) set with `warm`
    stopped: bool = False                    # (standby) stopped by the supervisor
    scope: trio.CancelScope | None = None
    handed_over: trio.Event = field(default_factory=trio.Event)
    nursery: trio.Nursery | None = None      # the run's own tasks (status, exec watch...)

    @property
    def standby(self) -> "WorkerRun | None":
        """The standby an adoption takes now: the oldest warm one, else the oldest."""
        return next((sb for sb in self.standbys if sb.warm),
                    self.standbys[0] if self.standbys else None)

    def begin(self, now_ns: int) -> None:
        """A new process is this run's (spawned, or a standby adopted): what was true of
        the last one's start-up and readiness is not of this one. One place, so that a
        new per-process field cannot be reset in one path and forgotten in the other."""
        self.started_ns = self.last_ping_ns = now_ns
        self.ready_ns = 0           # backoff resets only after a run that was ready
        self.ready = trio.Event()
        self.ready_claimed = False
        self.ready_said_ns = 0
        self.ready_said = trio.Event()
        self.exec_snapshot = None
        self.kill_reason = ""
        self.realtime_pid = 0       # granted again at this run's READY
        self.last_word_said = False
        self.exit_logged = False


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"   # real-time signals have no name


class FailSafe(Exception):
    """The control domain must stop now."""


class StartFailed(Exception):
    """A required worker gave up before its first READY."""
