"""Is a process on its way out? Read from /proc only (nothing is reaped or signalled).

A periodic maps scan can catch a control process in the middle of dying: after a
kill -9 the kernel tears the process down in do_exit(), and between releasing its
mount namespace (exit_task_namespaces) and becoming a zombie (exit_notify) a read of
/proc/PID/mountinfo fails with EINVAL. Such a read says nothing about what the process
ran; the process is an exit, not "unscannable" (issue 22: 5 of 176 kills at the
default interval, every run at 20 ms, each a refusal and, in control, a fail-safe).

"Exiting" must be a property of the whole process, never of one thread: a worker whose
main thread called exit(2) while other threads run on has a zombie main thread with
PF_EXITING set (red team, see admission.maps.live_task), and it is alive. A process is
exiting here only when every one of its threads is:
  - a zombie or dead (state Z or X), or
  - inside do_exit() (PF_EXITING in the flags field of its stat), or
  - holding SIGKILL pending (private or shared: SIGKILL cannot be blocked, caught or
    ignored by a process outside the pid namespace that sent it, so it will die;
    a group kill queues it on every thread before any of them runs).
"""
from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterable

PF_EXITING = 0x00000004            # include/linux/sched.h
_SIGKILL_MASK = 1 << (signal.SIGKILL - 1)
_GONE = (errno.ENOENT, errno.ESRCH)


def _read(path: str) -> bytes | None:
    """The file's bytes; None when the task is gone (ENOENT/ESRCH). Other errors raise:
    not being allowed to look proves nothing about dying."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise


def _task_exiting(task_dir: str, *, dying: bool) -> bool:
    """The task is gone or a zombie; with ``dying``, also one that is inside do_exit()
    or holds SIGKILL pending."""
    stat = _read(f"{task_dir}/stat")
    if stat is None:
        return True
    # comm may hold spaces and parentheses: fields resume after the last ")"
    rest = stat[stat.rindex(b")") + 2:].split()
    state, flags = rest[0], int(rest[6])       # fields 3 and 9 of stat(5)
    if state in (b"Z", b"X"):
        return True
    if not dying:
        return False
    if flags & PF_EXITING:
        return True
    status = _read(f"{task_dir}/status")
    if status is None:
        return True
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_MASK:
            return True
    return False


def _all_tasks(pid: int, *, dying: bool) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError as e:
        return e.errno in _GONE
    try:
        return all(_task_exiting(f"/proc/{pid}/task/{t}", dying=dying) for t in tids)
    except (OSError, ValueError, IndexError):
        return False


def process_exiting(pid: int) -> bool:
    """True if process ``pid`` is gone, a zombie, or every thread of it is on its way
    out (see the module doc). False when any thread may run on, or when /proc cannot
    tell (an error other than "gone")."""
    return _all_tasks(pid, dying=True)


def process_dead(pid: int) -> bool:
    """True if process ``pid`` is gone or every thread of it is a zombie: its memory is
    released. Stricter than process_exiting, and what a writer of last resort needs:
    inside do_exit() the kernel still writes the dying process's memory (exit_mm:
    clear_child_tid, the robust futex list), and a hostile writer may point those into
    a channel's segment."""
    return _all_tasks(pid, dying=False)


def nspid_depth(pid: int) -> tuple[int, ...] | None:
    """The NSpid line of ``pid`` (its pid in each pid namespace, outermost first); None
    when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        return None
    return None


def live_in_sandbox(pids: Iterable[int]) -> list[int]:
    """The processes among ``pids`` (a sandbox's, its bwrap left out) that are not dead
    (`process_dead`), less bwrap's own init in the sandbox (pid 1 of its pid namespace,
    one level below ours), which never maps a segment nor runs worker code. The one rule
    for "what of a sandbox still lives": the last word's and READY's."""
    inner = len(nspid_depth(os.getpid()) or (0,)) + 1      # the sandbox's level
    out = []
    for pid in pids:
        ns = nspid_depth(pid)
        if ns is not None and len(ns) == inner and ns[-1] == 1:
            continue                                       # bwrap's init in the sandbox
        if not process_dead(pid):
            out.append(pid)
    return out

