"""Exit codes of `supervisor run`: what the process status tells systemd and operators.

Its own module, with no trio, so the unit generator and the CLI can name them cheaply.
"""
from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    """Process exit status of ``supervisor run``: it says why the supervisor stopped."""

    SHUTDOWN = 0          # SIGTERM/SIGINT: orderly shutdown
    ERROR = 1             # unexpected internal error
    CONFIG = 2            # the config did not load
    REFUSED = 3           # admission refused a required worker
    FAIL_SAFE = 4         # the control domain failed safe, or the fail-safe is latched
    START_FAILED = 5      # a required worker never became ready
    LOCKED = 9            # another supervisor holds the state dir (statelock.py)
    # Of the checking commands (`audit`, `replay --ref`), never of `run`:
    DIFFERS = 6           # the evidence differs from the promise / the reference
    INCOMPLETE = 7        # a replay did not get through its log
    WRITE_FAILED = 8      # record/replay: the log could not be written (disk full, I/O)
