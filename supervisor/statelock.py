"""One supervisor per state directory: an flock on ``STATE_DIR/supervisor.lock``.

Two vehicle-mode `supervisor run` on one state dir would share its fail-safe latch (one
clears or overwrites what the other latched; each refuses to start on the other's) and
both drive the same car's channels. `run` therefore takes this lock before it touches
anything else (cli.cmd_run: after the config is read, before the event log, the broker,
the latch or a cgroup) and holds it for the process's life:

- ``flock(LOCK_EX | LOCK_NB)`` on an ``O_CLOEXEC`` fd. The kernel drops it when the last
  fd of that open file goes, so at any death of ours (SIGKILL, OOM kill, a crash): no
  pid file to judge stale, nothing to clean up. ``O_CLOEXEC`` because a child that
  kept the fd across exec (the broker, bwrap, a tool) would keep the lock after us.
- The holder writes its pid into the file once it holds the lock, so that a second run
  can name it: ``another supervisor (pid N) holds STATE_DIR; ...``, exit
  `Exit.LOCKED` (9). The file is never removed: an unlink would let a third run lock a
  new file while the holder still holds the old one.

Not locked: a simulation run (replay, record, ``mode = "simulation"``) latches in a
directory made for that run (failsafe.FailSafeLatch.per_run) and its cgroups and
channels are per process, so simulations may run side by side; and `run --broker`, whose
state dir is the broker's (root, 0700, unreachable from the unprivileged proper): the
broker is the one process there to hold it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.exits import Exit

LOCK_NAME = "supervisor.lock"


class Held(Exception):
    """Another process holds the state dir's lock."""

    def __init__(self, state_dir: Path, pid: int | None) -> None:
        self.state_dir, self.pid = state_dir, pid
        who = f"pid {pid}" if pid else "pid unknown"
        super().__init__(f"another supervisor ({who}) holds {state_dir}; stop it first, "
                         f"or give this run a state dir of its own (TRIO_STATE_DIR)")


@dataclass
class StateLock:
    """A held lock: its fd stays open for as long as the lock is to be held."""

    path: Path
    fd: int

    def release(self) -> None:
        """Let go before the process ends (tests); a run never calls this."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# The locks `hold` took: referenced here so that no garbage collection closes them.
_held: list[StateLock] = []


def holder(state_dir: str | os.PathLike) -> int | None:
    """The pid the current holder wrote into the lock file (None: none readable)."""
    try:
        text = (Path(state_dir) / LOCK_NAME).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def acquire(state_dir: str | os.PathLike) -> StateLock:
    """Take the lock of `state_dir` (created 0700 if missing, as the latch would be).
    Raises `Held` if another process holds it, OSError if it cannot be taken at all."""
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / LOCK_NAME
    # 0600, and made so if it was not: anyone who can open the file can flock it, and
    # held by another user it kept the car from starting ("another supervisor holds",
    # exit 9; red team round 7 row 2: a state dir others could cross, the file 0644).
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Held(d, _holder_pid(d)) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        os.close(fd)
        raise
    return StateLock(path, fd)


def _holder_pid(d: Path) -> int | None:
    """The holder's pid, allowing it the moment between its flock and its write."""
    for _ in range(20):
        pid = holder(d)
        if pid is not None:
            return pid
        time.sleep(0.005)
    return None


def hold(state_dir: str | os.PathLike) -> StateLock:
    """`acquire`, held until this process ends."""
    lock = acquire(state_dir)
    _held.append(lock)
    return lock


@dataclass(frozen=True)
class Refusal:
    """Why `run` must not start: one line for stderr and the exit status."""

    line: str
    code: Exit


def held_fds() -> list[int]:
    """The fds of the locks this process holds: a broker we start gets them too, so
    the state dir stays held until it is gone as well (a SIGKILLed proper's broker
    still ran its sandboxes for ~1 s with the lock free: review)."""
    return [lock.fd for lock in _held if lock.fd >= 0]


def hold_for_run(cfg: Any) -> Refusal | None:
    """For `supervisor run` of config `cfg`: hold its state dir's lock (vehicle mode; see
    the module doc for what is not locked), or say in one line why the run must stop."""
    from supervisor.config._runtime import state_dir_in_use
    from supervisor.protocol import SIMULATION

    if cfg.supervisor.mode == SIMULATION:
        return None
    state = state_dir_in_use(cfg)
    try:
        hold(state)
    except Held as e:
        return Refusal(f"supervisor run: {e}", Exit.LOCKED)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.ELOOP:
            why = f"{LOCK_NAME} is a symbolic link"
        hint = ("; as a user other than root give a state dir of your own: "
                "TRIO_STATE_DIR=~/.trio-state" if os.geteuid() != 0 else "")
        return Refusal(f"supervisor run: cannot lock the state dir {state}: {why} "
                       f"(the fail-safe latch lives there too){hint}", Exit.CONFIG)
    return None
