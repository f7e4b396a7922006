"""The supervisor's open-file limit: raised to what the machine allows, and named when a
config needs more than that (`ulimit -n 128`: the car's standby failed with "[Errno 24]
Too many open files" and no word of the limit).

The supervisor holds every channel's memfds and wake-up ends, and for each worker its
pipes, control sockets, pidfd and cgroup files, for the active process and its warm
standby. Counted on the running car (7 workers, 7 channels): 162 fds; the one-camera
config (4 and 4): 117. `needed` is that count; a start holds a few more for a moment.
"""
from __future__ import annotations

import errno
import resource

_BASE = 24          # the interpreter, trio, the log, the state lock, the signal pipe
_PER_WORKER = 8     # its pipes, control socket, pidfd, cgroup files
_PER_STANDBY = 12   # a warm_standby worker's two standbys (the same, each)
_CEILING = 1 << 16  # never ask for more than this, whatever the hard limit
_MARGIN = 16        # what a start holds for a moment (pipes, a standby's hand-over):
                    # at exactly the count, a second standby's start failed (red team 12 row 11)


def _per_channel(max_readers: int) -> int:
    """The segment, and for each reader slot its lease table and both ends of its
    wake-up pair (red team 12 row 6: a 64-reader channel is 193, not 3)."""
    return 1 + 3 * max_readers


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


def needed(cfg) -> int:
    """The fds the supervisor holds for `cfg` running, fitted to the running car (7
    workers, 3 with standbys, channels of 1-3 readers: 162) and the one-camera config
    (117) exactly, and the margin a start needs beside them."""
    specs = cfg.channel_specs().values()
    standbys = sum(1 for w in cfg.workers.values() if w.warm_standby)
    return (_BASE + _PER_WORKER * len(cfg.workers) + _PER_STANDBY * standbys
            + sum(_per_channel(s.max_readers) for s in specs) + _MARGIN)


def shortfall(cfg) -> str | None:
    """Why this process cannot hold `cfg`'s channels and workers, or None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = needed(cfg)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    return (f"{len(cfg.workers)} workers and {len(cfg.channels)} channels need about {need} "
            f"open files; this process may open {soft} (ulimit -n; hard limit "
            f"{_shown(hard)}): raise it (ulimit -n 1024, or LimitNOFILE= in the unit)")


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
