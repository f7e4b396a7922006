"""Real-time scheduling of a READY control worker.

Why: on a shared machine a control worker woken by a frame waits in the run queue
behind whatever else runs (research, the operator's shell, other tenants); SCHED_FIFO
makes it run first, the way openpilot's control daemons do (`config_realtime_process`).

Who may: only the supervisor sets it, from outside, once the worker is READY (start-up
stays in the normal class). A sandbox has no CAP_SYS_NICE and RLIMIT_RTPRIO 0
(launch.py), so a worker may lower its priority or leave the class, never raise it.
Only the main thread gets it, with SCHED_RESET_ON_FORK: threads and children it starts
later are normal tasks, and only a privileged task can clear that flag.

Bound: one RT thread can hold at most one CPU. Where the kernel has RT group
scheduling (cgroup v1 ``cpu.rt_runtime_us``) each worker's cgroup also gets a budget,
``budget_pct`` of a CPU per ``RT_PERIOD_US``: a runaway is throttled and everything else
keeps the rest. Without it (cgroup v2) only the kernel's global sched_rt_runtime_us
(95 % by default) bounds it, and the event and the audit say so.
"""
from __future__ import annotations

import os
import select
from collections.abc import Callable
from dataclasses import dataclass

RT_PERIOD_US = 100_000
# 99 is the kernel's own (watchdog, migration threads): never above it.
MAX_PRIORITY = 98
MAX_BUDGET_PCT = 90      # of a CPU: the kernel keeps 5 % of each out of RT reach itself


@dataclass(frozen=True)
class Realtime:
    priority: int        # SCHED_FIFO 1..MAX_PRIORITY
    budget_pct: int      # of one CPU per RT_PERIOD_US (where RT group scheduling exists)

    def __post_init__(self) -> None:
        if type(self.priority) is not int or not 1 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"realtime priority must be 1..{MAX_PRIORITY}, got {self.priority!r}")
        if type(self.budget_pct) is not int or not 1 <= self.budget_pct <= MAX_BUDGET_PCT:
            raise ValueError(f"realtime budget must be 1..{MAX_BUDGET_PCT} %, "
                             f"got {self.budget_pct!r}")

    @property
    def runtime_us(self) -> int:
        return self.budget_pct * RT_PERIOD_US // 100


class RealtimeUnavailable(OSError):
    """The kernel refused: the worker keeps running in the normal class."""


def make_fifo(pid: int, priority: int, still_ours: Callable[[], bool]) -> None:
    """SCHED_FIFO ``priority`` with SCHED_RESET_ON_FORK for thread ``pid`` (a READY
    worker's main thread). ``still_ours()`` re-checks that ``pid`` is the worker after a
    pidfd pins it, so that a pid reused by another process is never made real-time."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise RealtimeUnavailable(f"pid {pid} is gone") from None
    try:
        if not still_ours():
            raise RealtimeUnavailable(f"pid {pid} is no longer the worker")
        try:
            os.sched_setscheduler(pid, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK,
                                  os.sched_param(priority))
        except PermissionError:
            raise RealtimeUnavailable(
                "sched_setscheduler: EPERM (the supervisor has no CAP_SYS_NICE, or the "
                "worker's cgroup has no RT runtime)") from None
        except ProcessLookupError:
            raise RealtimeUnavailable(f"pid {pid} is gone") from None
        # Dead before the set (a pid number is freed at reap, even with a pidfd open):
        # the set may have hit a reused pid. Nothing to undo by number; say so.
        if select.select([pidfd], [], [], 0)[0]:
            raise RealtimeUnavailable(f"pid {pid} exited while being made real-time")
    finally:
        os.close(pidfd)


def policy_of(pid: int) -> tuple[str, int, bool]:
    """(class, priority, reset_on_fork) of thread ``pid`` as the kernel has it."""
    pol = os.sched_getscheduler(pid)
    reset = bool(pol & os.SCHED_RESET_ON_FORK)
    pol &= ~os.SCHED_RESET_ON_FORK
    name = {os.SCHED_OTHER: "other", os.SCHED_FIFO: "fifo", os.SCHED_RR: "rr",
            os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle"}.get(pol, str(pol))
    return name, os.sched_getparam(pid).sched_priority, reset


# -- the OOM killer's choice -------------------------------------------------------
# The supervisor (and the broker) is the one process whose death ends every control
# worker unsaid: no SAFE, no latch. The kernel's OOM killer takes it last (red team 10
# row 11: it was the first choice of its own tree, oom_score 669 against its workers'
# 667). A per-process setting, not a kernel knob: `run` as root sets its own, the units
# say OOMScoreAdjust=; every sandbox ranks as any process again (`rank_ordinary`, in
# the child before exec: the setting is inherited).
OOM_SCORE_ADJ = -900


def _oom_score_adj(value: int) -> None:
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)
    except OSError:     # no /proc, or not root (lowering needs CAP_SYS_RESOURCE)
        pass


def rank_last() -> None:
    """This process, last for the OOM killer (root only)."""
    if os.geteuid() == 0:
        _oom_score_adj(OOM_SCORE_ADJ)


def rank_ordinary() -> None:
    """This process (a sandbox, between fork and exec), as any process."""
    _oom_score_adj(0)
