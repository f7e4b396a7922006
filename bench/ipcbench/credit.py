"""The sender's wait for credit (the receiver's progress word in the control block),
woken by the receiver's progress rather than by a timer.

Why: a timed sleep (``time.sleep(20e-6)``: 70 us and more with the default 50 us timer
slack) after the spin let a sender faster than its receiver fall into a cycle of
mutual sleeps: asleep on its timer while the receiver drained the window and went to
sleep itself, then a wake-up of the receiver for every window of 4 messages (64 B,
untraced, loaded 2-core VM: the sender waited 60 % of the stream, 0.2 waits > 30 us
per message). That cycle hit whichever transport's sender outran its receiver (the
bridge's: its receiver was the slower end), a cost of the harness, not of the
transport. Now the sender raises ``C_TX_WAITING`` and sleeps on a futex on the low
half of ``C_LAST_SEQ``; a receiver that sees the flag after storing its progress wakes
it (one load a message on every transport; a FUTEX_WAKE only when the sender sleeps).
A wake-up lost to store/load reordering costs at most ``WAIT_NS`` (the wait's timeout).

How long the sender looks before it sleeps: a sleeping sender is woken by a receiver
that then drains the window (4 x ~6 us at 64 B) and sleeps on an empty ring before the
sender is back (a VM's wake-up of an idle vCPU: 50-200 us), and that cycle, once begun,
repeats every window. A streaming sender therefore looks for SPIN_NS_STREAM (longer
than such a wake-up) before sleeping: while the receiver is awake, credit comes within
one message's time and the sender never sleeps. Paced sends (latency, warm-up) keep
the short look they had (~30 us, then sleep). Same for every transport.
"""
from __future__ import annotations

import ctypes
import os
import platform

import numpy as np

# x86-64 and aarch64 syscall numbers; elsewhere the sender falls back to a short sleep.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1      # shared (not _PRIVATE): the block is MAP_SHARED
WAIT_NS = 200_000                    # a lost wake-up costs at most this
SPIN_NS_STREAM = 300_000             # throughput: look this long before sleeping
SPIN_NS_PACED = 30_000               # latency and warm-up (was 200 looks, ~20-40 us)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None
_TIMEOUT = _Timespec(0, WAIT_NS)


def word_address(ctrl: np.ndarray, word: int) -> int:
    """Address of the low 32 bits of int64 ``ctrl[word]`` (little-endian)."""
    return ctrl.ctypes.data + 8 * word


def wait(addr: int, seen: int) -> None:
    """Sleep while the 32-bit word at ``addr`` still holds ``seen`` (low 32 bits), at
    most WAIT_NS; returns at once if it changed meanwhile."""
    if _libc is None:
        os.sched_yield()
        return
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT,
                  ctypes.c_int((seen & 0xFFFFFFFF) - ((seen & 0x80000000) << 1)),
                  ctypes.byref(_TIMEOUT), None, 0)


def wake(addr: int) -> None:
    if _libc is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 1, None, None, 0)
