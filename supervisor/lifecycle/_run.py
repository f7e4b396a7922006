"""One worker's run (its policy state and its current Incarnation) and the lifecycle's exceptions."""
from __future__ import annotations

import signal
import threading
from collections import deque
from dataclasses import dataclass, field

import trio

from supervisor.config import WorkerConfig
from supervisor.ratelimit import TokenBucket

from ._incarnation import Incarnation


@dataclass
class WorkerRun:
    """One worker's policy state: its config, restart budget and standbys, and
    `current`, the Incarnation (one process: sandbox, pipes, cgroup, exec watch, status
    counters) it runs now. A new process is a new Incarnation, made by the launcher in
    `Supervisor._spawn`; adopting a standby is `run.current = sb.current`. The fields
    below `current` describe the current process in this run's role and are reset
    together by `begin()` (a standby's warm-up is not its READY as the active run)."""

    cfg: WorkerConfig
    current: Incarnation | None = None       # its process now (None before the first)
    restarts: deque = field(default_factory=deque)
    refused: str | None = None               # set once: a refused run is never restarted
    status: str = ""
    exit_reason: str = ""                    # why its last process ended (audit --live)
    started_ns: int = 0
    ready_ns: int = 0
    last_ping_ns: int = 0
    ready: trio.Event = field(default_factory=trio.Event)
    status_logged: str = ""                  # the last status text that became an event
    status_events: TokenBucket | None = None  # status events let through at once (_io)
    status_held: int = 0                     # changes not logged since (rate limit)
    status_logged_at: float = float("-inf")  # when (monotonic s) it was logged
    exec_snapshot: object | None = None      # maps.ExecSnapshot taken at READY
    kill_reason: str = ""                    # why the supervisor killed it, if it did
    ready_claimed: bool = False              # the worker said READY=1 (this run)
    # When the READY line was read (_io, this run): the ready deadline ends here, not at
    # `ready` (which waits for the supervisor's own checks of that READY).
    ready_said_ns: int = 0
    ready_said: trio.Event = field(default_factory=trio.Event)
    realtime_pid: int = 0                    # the thread made SCHED_FIFO at READY
    last_word_said: bool = False             # SAFE published after this process died
    # Held while checking and setting last_word_said: the last-word thread and the event
    # loop may both come to say it (lifecycle/_lastword.py).
    last_word_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    exit_logged: bool = False                # its `exit` event is out (this process)
    # Warm standby: a second instance, waiting in its sandbox for the channels.
    is_standby: bool = False
    # (active run) its standbys, oldest first; at most _WarmStandby.STANDBY_DEPTH
    standbys: list["WorkerRun"] = field(default_factory=list)
    adopted: bool = False
    # (active run) its current process is an adopted standby's: warm already, so its
    # READY is due within ADOPTED_READY_S, not the cold start's ready timeout.
    took_over: bool = False
    # (active run) the pause before a standby that died waiting is replaced (doubling
    # from backoff_initial_ms to backoff_max_ms, back to 0 when one is warm).
    standby_backoff_s: float = 0.0
    standby_deaths: int = 0                  # standbys dead in a row, none warm for long
    # (standby) its channels are on their way through the broker (an `adopt` round trip,
    # awaited off the loop): what it says meanwhile (READY, as soon as it has them) is
    # held, never judged as a standby's, and said to the run that adopts it.
    activating: bool = False
    held_status: list = field(default_factory=list)
    # (active run) the standby being handed the channels: between the send of its fds
    # and `current = its process`, it is listed by _all_runs() through this.
    adopting: "WorkerRun | None" = None
    warm: bool = False                       # (standby) said STANDBY=1: start-up done
    warm_ns: int = 0                         # (standby) when (monotonic ns)
    warmed: trio.Event = field(default_factory=trio.Event)   # (standby) set with `warm`
    stopped: bool = False                    # (standby) stopped by the supervisor
    scope: trio.CancelScope | None = None
    handed_over: trio.Event = field(default_factory=trio.Event)
    nursery: trio.Nursery | None = None      # the run's own tasks (status, exec watch...)

    # Read-only views of the current process, for readers outside the lifecycle (audit,
    # benches, tests): the Incarnation is the one place these live.
    @property
    def pid(self) -> int:
        """bwrap's host pid (the worker itself when unsandboxed); 0 before the first."""
        return self.current.pid if self.current is not None else 0

    @property
    def proc(self) -> Incarnation | None:
        """The current process, Popen-like (poll, wait, pid, returncode)."""
        return self.current

    @property
    def alive(self) -> bool:
        """Its current process runs (bwrap not exited): the one liveness test."""
        return self.current is not None and self.current.alive

    @property
    def cgroup(self) -> object | None:
        return getattr(self.current, "cgroup", None)

    @property
    def watch(self) -> object | None:
        """The exec watch of the current process (audit --live reads it)."""
        return self.current.watch if self.current is not None else None

    @property
    def standby(self) -> "WorkerRun | None":
        """The standby an adoption takes now: the oldest warm one, else the oldest."""
        return next((sb for sb in self.standbys if sb.warm),
                    self.standbys[0] if self.standbys else None)

    def end_activation(self) -> list:
        """(standby) Its hand-over is over, either way: what it said meanwhile."""
        held, self.held_status, self.activating = self.held_status, [], False
        return held

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
        self.exit_reason = ""


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"   # real-time signals have no name


class FailSafe(Exception):
    """The control domain must stop now."""


class StartFailed(Exception):
    """A required worker gave up before its first READY."""
