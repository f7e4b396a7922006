"""Signals as bytes on a pipe, from the first instruction to the last.

trio's signal receiver restores the default handlers when it closes and re-delivers
what was pending, so a second signal during the ordered stop (or a Ctrl-C before trio
started) used to kill the supervisor mid-stop or end in a KeyboardInterrupt traceback.
These handlers never raise and are never removed: a signal is a byte on a pipe, the
supervisor reads the first one as "stop in order" and every later one changes nothing;
at exit they become SIG_IGN, never the defaults.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading

# An ordered stop: Ctrl-C, systemd's stop, a hang-up of the terminal or session it
# was started from (an ssh session dropped), Ctrl-\ (SIGQUIT). By their default
# actions they ended the process at once: no worker stopped in order, no SAFE as the
# actuation writer's last word, no `supervisor_exit` (red team 8 row 4: SIGHUP).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Every other signal whose default action ends or stops the process means nothing to
# us: it is recorded and logged (`signal_ignored`), never obeyed. A handler, not
# SIG_IGN: a handled signal is reset to its default in every worker at exec, an ignored
# one would stay ignored there. (SIGPIPE is Python's own: ignored, reset for children.)
# Ctrl-Z (SIGTSTP) and a background job's terminal I/O (SIGTTIN, SIGTTOU under `stty
# tostop`) stopped every thread, the last-word thread too, while the workers (sessions
# of their own) ran on unsupervised (red team 8 row 11).
IGNORED_SIGNALS = tuple(getattr(signal, n) for n in (
    "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGIO", "SIGPWR",
    "SIGXFSZ", "SIGXCPU", "SIGSTKFLT", "SIGTSTP", "SIGTTIN")
    if hasattr(signal, n))
# SIGTTOU alone is SIG_IGN: a handled one makes the kernel restart the background write
# and signal again, for ever (the output thread spinning); ignored, the write goes
# through. (Inherited by the workers at exec: their output is a pipe, never a tty.)
SIG_IGNORED = tuple(getattr(signal, n) for n in ("SIGTTOU",) if hasattr(signal, n))


class SignalPipe:
    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._held = b""          # read by `stop_pending`, not yet drained

    def _handler(self, signum: int, frame: object) -> None:
        try:
            os.write(self.w, bytes([signum]))
        except OSError:      # pipe full: enough signals are already recorded
            pass

    def drain(self) -> list[int]:
        """Signals received since the last drain (in order)."""
        out, self._held = self._read(self._held), b""
        return list(out)

    def peek(self) -> list[int]:
        """The same, left to be drained."""
        self._held = self._read(self._held)
        return list(self._held)

    def _read(self, out: bytes) -> bytes:
        while True:
            try:
                chunk = os.read(self.r, 256)
            except BlockingIOError:
                return out
            if not chunk:
                return out
            out += chunk


_pipe: SignalPipe | None = None
_previous: dict[int, object] = {}


def install() -> SignalPipe | None:
    """Install the handlers (main thread only; idempotent). None elsewhere: a supervisor
    embedded in another program's thread leaves signals to that program."""
    global _pipe
    if threading.current_thread() is not threading.main_thread():
        return _pipe
    if _pipe is None:
        _pipe = SignalPipe()
        for s in (*STOP_SIGNALS, *IGNORED_SIGNALS):
            _previous[s] = signal.signal(s, _pipe._handler)
        for s in SIG_IGNORED:
            _previous[s] = signal.signal(s, signal.SIG_IGN)
        atexit.register(_ignore_at_exit)
    return _pipe


def _ignore_at_exit() -> None:
    """The process is ending, its exit code decided: from here on a signal is ignored.
    Past atexit, Python resets every handled signal to its default, so a second SIGTERM
    in the last milliseconds of the interpreter's teardown killed the process and lost
    that code (CI: `check --start` ended -15, not 5). SIG_IGN is left alone there."""
    if _pipe is None or threading.current_thread() is not threading.main_thread():
        return
    for s in (*STOP_SIGNALS, *IGNORED_SIGNALS):
        signal.signal(s, signal.SIG_IGN)


def stop_pending() -> bool:
    """Whether a stop signal has come and not been taken yet: for work that runs before
    the loop does (admission: seconds on the car), to end early. Never consumes it."""
    return _pipe is not None and any(s in STOP_SIGNALS for s in _pipe.peek())


def uninstall() -> None:
    """Give the signals back (a supervisor embedded in a program that has its own
    handling, e.g. a test runner). The CLI never calls this: its process ends."""
    global _pipe
    if _pipe is None or threading.current_thread() is not threading.main_thread():
        return
    for s, h in _previous.items():
        signal.signal(s, h)
    _previous.clear()
    atexit.unregister(_ignore_at_exit)
    _pipe = None
