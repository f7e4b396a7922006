"""The supervisor's output (events, the live status line), written from a thread of its
own, never from the event loop.

A write to a terminal whose output is stopped (Ctrl-S), a pipe whose reader stalls
(`run | less`), or journald's stream socket while journald is busy blocks: done on the
loop, it held the watchdog, the ready deadlines, the restarts and the fail-safe with it
(red team 8 row 3: a control worker silent 4 s against a 500 ms watchdog while the
console was stopped). Making fds 1/2 non-blocking is no fix: O_NONBLOCK belongs to the
open file description, shared with the shell that owns the terminal.

So each real stream gets one `StreamWriter`: callers queue text and go on; its thread
writes. The queue is bounded, in lines and in bytes (encoded as the stream encodes: an
emoji is 4 of them, review 6 finding 1): when it is full lines are dropped and counted,
and the next line written says how many (the caller's `dropped` text). An error line
(VITAL: the fail-safe) is never dropped and never waits behind more than VITAL_AHEAD
bytes of others, besides the batch in flight: the oldest are dropped for it (red team 9 row 5:
10,000 lines of a research worker's 12 KiB `output` events, 124 MB, queued ahead of the
fail_safe line: minutes on an ssh console, hours on a serial one). A live line (the
console's status row) keeps only its newest version. One stream, one writer: stdout and
stderr of a systemd unit are one journald socket, and two threads writing it split
lines (row 7); the writer writes through a descriptor of its own (a dup), so a stream
object its other owner closes takes nothing with it (finding 2: lines went into the
file that next took the closed number). A stream without a file descriptor (io.StringIO in tests, embedded
users) is written directly: it cannot block. At exit every writer gets a bounded time
to drain (atexit), what is queued trimmed first so that the last error lines go out
(row 8)."""
from __future__ import annotations

import atexit
import io
import os
import stat
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TextIO

MAX_PENDING = 10_000          # lines queued while a stream is blocked; then dropped
MAX_URGENT = 2_000            # places beyond that for urgent lines (warnings)
MAX_PENDING_BYTES = 1 << 20   # and bytes: a second of a 1 MiB/s console
MAX_URGENT_BYTES = 1 << 18    # beyond that for urgent lines
VITAL_AHEAD = 64 << 10        # what a VITAL line may wait behind in the queue (bytes)
BATCH_BYTES = 64 << 10        # written per write: the rest stays queued (and droppable)
URGENT, VITAL = 1, 2          # put()'s ranks: a warning; an error (never dropped)
DRAIN_AT_EXIT_S = 2.0         # all streams together: a stopped console cannot hold exit
IDLE_S = 0.5                  # a writer thread with nothing to write for this long ends


class StreamWriter:
    """One stream's writer thread (see the module docstring)."""

    def __init__(self, stream: TextIO, dropped: Callable[[int], str], fd: int) -> None:
        self.stream = stream
        self._dropped_text = dropped
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._lines: deque[tuple[int, bytes]] = deque()   # (rank, encoded line)
        self._bytes = 0                        # of the queued lines
        self._latest: str | None = None        # the live row's newest version
        self._shown: str | None = None         # the live row on screen (writer thread's)
        self._end = False                      # end the live row with a newline
        self._dropped = 0
        self._busy = False
        self._cond = threading.Condition()
        self._running = False                  # a thread is serving (under _cond)
        self._fd = os.dup(fd)                  # ours: the stream's owner may close its own
        # Closed when the writer goes, but never by weakref's own exit hook: it runs
        # before the drain at exit (atexit is last in, first out).
        weakref.finalize(self, os.close, self._fd).atexit = False
        self._flushed = False                  # what others put in the stream (thread's)

    def put(self, text: str, rank: int = 0) -> None:
        """Queue a line. When the queue is full it is dropped (and counted), unless its
        `rank` says otherwise: URGENT (warnings: an exit, a refusal) has MAX_URGENT
        places more; VITAL (errors: the fail-safe) is never dropped, it takes the place
        of the oldest line that is not (red team 8 row 14: the fail_safe event was
        dropped behind 10,000 lines of a chatty worker while the console was stopped;
        review: a worker's warnings could fill the urgent places)."""
        data = self._encode(text)
        with self._cond:
            urgent = rank >= URGENT
            if rank < VITAL and (
                    len(self._lines) >= MAX_PENDING + (MAX_URGENT if urgent else 0)
                    or self._bytes + len(data) > MAX_PENDING_BYTES + (
                        MAX_URGENT_BYTES if urgent else 0)):
                self._dropped += 1
                return
            if rank >= VITAL:
                self._trim(VITAL_AHEAD)
            self._lines.append((rank, data))
            self._bytes += len(data)
            self._wake()

    def _encode(self, text: str) -> bytes:
        return text.encode(self._encoding, "replace")

    def _trim(self, keep: int) -> None:
        """(under _cond) Drop the oldest lines that are not VITAL until at most `keep`
        bytes of them stay queued (the newest: what led up to it)."""
        if self._bytes <= keep:
            return
        kept: deque[tuple[int, bytes]] = deque()
        others = 0
        for rank, data in reversed(self._lines):
            if rank < VITAL:
                if others + len(data) > keep:
                    self._dropped += 1
                    self._bytes -= len(data)
                    continue
                others += len(data)
            kept.appendleft((rank, data))
        self._lines = kept

    def put_latest(self, text: str) -> None:
        """A live row (it starts with "\\r\\x1b[2K"): it supersedes its own earlier
        versions not yet written, and lines put meanwhile are written above it (the
        row is cleared, the lines written, the row drawn again)."""
        with self._cond:
            self._latest = text
            self._wake()

    def end_latest(self) -> None:
        """The live row stays as it is, and what follows starts on a row of its own."""
        with self._cond:
            self._end = True
            self._wake()

    def _wake(self) -> None:
        """(under _cond) The thread, started if it had gone idle."""
        if self._running:
            self._cond.notify()
            return
        self._running = True
        try:
            threading.Thread(target=self._run, daemon=True,
                             name=f"outstream-{_fd(self.stream)}").start()
        except RuntimeError:             # the interpreter is ending: no new threads
            self._running = False
            try:
                while True:              # every batch, here and now
                    self._write(self._compose(*self._take()))
                    if not self._lines:
                        break
            except (OSError, ValueError):
                pass

    def _take(self) -> tuple[list[bytes], str | None, bool, int]:
        """(under _cond) What is pending, taken: up to BATCH_BYTES of lines (one at
        least), the live row, end, dropped. A blocked write holds only its batch: the
        rest stays queued, where a VITAL line can still drop it."""
        batch, size = [], 0
        while self._lines and (not batch or size + len(self._lines[0][1]) <= BATCH_BYTES):
            data = self._lines.popleft()[1]
            batch.append(data)
            size += len(data)
        self._bytes -= size
        latest, self._latest = self._latest, None
        end, self._end = self._end, False
        dropped, self._dropped = self._dropped, 0
        return batch, latest, end, dropped

    def shed(self) -> None:
        """At exit: no more than VITAL_AHEAD bytes of other lines left queued (the
        newest), so that the last error lines and the exit line are what the drain's
        bounded time is spent on."""
        with self._cond:
            self._trim(VITAL_AHEAD)

    def drain(self, timeout: float) -> bool:
        """Wait until everything queued is written; False if `timeout` ran out."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._lines and self._latest is None and not self._end
                and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                # Idle for a while: the thread goes (a new one starts at the next line),
                # so a quiet stream holds no thread.
                if not self._cond.wait_for(
                        lambda: self._lines or self._latest is not None or self._end, IDLE_S):
                    self._running = False
                    return
                pending = self._take()
                self._busy = True
            try:
                self._write(self._compose(*pending))
            except (OSError, ValueError):
                pass             # a closed stream must not take the supervisor down
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, data: bytes) -> None:
        """To our own fd, not through the text stream: blocked inside the stream's
        write, this thread held its buffer's lock, and the interpreter's final flush at
        exit waited for it for ever (review: `run` with stderr on a stalled pipe never
        exited after its ordered stop). What others put in the stream is flushed first."""
        if not self._flushed:
            self._flushed = True
            try:
                self.stream.flush()
            except (OSError, ValueError):        # closed by its owner: nothing to flush
                pass
        while data:
            data = data[os.write(self._fd, data):]

    def _compose(self, batch: list[bytes], latest: str | None, end: bool,
                 dropped: int) -> bytes:
        if dropped:
            batch.insert(0, self._encode(self._dropped_text(dropped)))
        out = []
        if batch:
            if self._shown is not None:
                out.append(b"\r\x1b[2K")        # the live row makes way for the lines
            out += batch
        row = latest if latest is not None else (self._shown if batch else None)
        if row is not None:
            out.append(self._encode(row))
            self._shown = row
        if end and self._shown is not None:
            out.append(b"\n")
            self._shown = None
        return b"".join(out)


_all: "weakref.WeakSet[StreamWriter]" = weakref.WeakSet()   # for the drain at exit


def _fd(stream: object) -> int | None:
    if isinstance(stream, (io.StringIO, io.BytesIO)):
        return None
    try:
        return stream.fileno()              # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


# One writer per stream: a terminal by its device (stdout and stderr on one console are
# two open files of it), anything else by its inode (a unit's stdout and stderr are one
# journald socket). Two writers of one stream interleave partial writes (row 7).
_writers: "weakref.WeakValueDictionary[tuple, StreamWriter]" = weakref.WeakValueDictionary()


def writer_for(stream: TextIO, dropped: Callable[[int], str] | None = None
               ) -> StreamWriter | None:
    """A writer for `stream`, or None for a stream without a file descriptor or that is
    a regular file (written directly: neither waits for a reader). One per stream: the
    event log (stderr) and the live row (stdout) on one terminal share one writer, so
    that events are written above the row instead of through it; on one socket or pipe,
    so that neither is written into the middle of the other's line.
    `dropped`: the text said for n dropped lines (None: an empty string)."""
    fd = _fd(stream)
    if fd is None:
        return None
    say = dropped or (lambda n: "")
    try:
        st = os.fstat(fd)
        tty = os.isatty(fd)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):          # a file has no reader to wait for: written
        return None                       # here, in order with everything else
    key = ("tty", st.st_rdev) if tty else ("inode", st.st_dev, st.st_ino)
    w = _writers.get(key)      # (its own dup keeps that pty or pipe, and its number, ours)
    if w is None:
        w = _writers[key] = StreamWriter(stream, say, fd)
    elif dropped is not None:
        w._dropped_text = dropped
    _all.add(w)
    return w


def drain_all(timeout: float = DRAIN_AT_EXIT_S) -> None:
    """Everything queued, written, within `timeout` for all streams together."""
    import time

    end = time.monotonic() + timeout
    writers = list(_all)
    for w in writers:            # half the time for everything, in order
        w.drain(max(0.0, end - timeout / 2 - time.monotonic()))
    for w in writers:            # then the last lines first: a slow console
        w.shed()
        w.drain(max(0.0, end - time.monotonic()))


atexit.register(drain_all)
