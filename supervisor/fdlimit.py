"""The supervisor's open-file limit: raised to what the machine allows, and named when a
config needs more than that (`ulimit -n 128`: the car's standby failed with "[Errno 24]
Too many open files" and no word of the limit).

The supervisor holds every channel's memfds and wake-up ends, and for each worker its
pipes, control sockets, pidfd and cgroup files, for the active process and its warm
standby. Counted on the running car (7 workers, 7 channels): 162 fds; the one-camera
config (4 and 4): 117. `needed` is that fit; a start holds a few more for a moment.
"""
from __future__ import annotations

import errno
import resource

_BASE = 60          # the interpreter, trio, the log, the state lock, the heartbeat
_PER_WORKER = 12    # active + standby: pipes, control sockets, pidfd, cgroup files
_PER_CHANNEL = 3    # segment, leases, the writer's wake-up end
_CEILING = 1 << 16  # never ask for more than this, whatever the hard limit


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (at most 65536), as daemons do: a
    shell's 1024 soft limit under a hard one of 1M is a default, not a decision. The
    soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _CEILING if hard == resource.RLIM_INFINITY else min(hard, _CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def needed(workers: int, channels: int) -> int:
    return _BASE + _PER_WORKER * workers + _PER_CHANNEL * channels


def shortfall(workers: int, channels: int) -> str | None:
    """Why this process cannot hold a config of this size, or None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = needed(workers, channels)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    return (f"{workers} workers and {channels} channels need about {need} open files; this "
            f"process may open {soft} (ulimit -n; hard limit {_shown(hard)}): raise it "
            f"(ulimit -n 1024, or LimitNOFILE= in the unit)")


def hint(e: BaseException) -> str:
    """What to add to an error's text when it is the file limit's doing."""
    if isinstance(e, OSError) and e.errno == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return f" (this process's open-file limit is {_shown(soft)}: raise ulimit -n, or LimitNOFILE= in the unit)"
    if isinstance(e, OSError) and e.errno == errno.ENFILE:
        return " (the system's open-file table is full: fs.file-max)"
    return ""


def _shown(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)
