"""Review round 6 (a hostile read of this session's changes since 978477c): each finding
proven on the real part (a real pipe, a real writer thread, real files), as a strict
xfail that the fix turns green. docs/review6.md has the table.

1. outstream bounds what a VITAL line waits behind in *characters*; what a console
   waits for is bytes. A research worker's `output` line of printable non-ASCII (an
   emoji is printable: `--log-format text` writes it raw, 4 bytes a character) makes
   VITAL_AHEAD + BATCH_CHARS = 128 Ki characters 512 KiB on the wire, 4x the bound.
2. outstream's one writer per stream (now also per pipe/socket inode) writes to the fd
   of the *first* stream object it was made for. Its owner closes that stream; the
   other owner's stream (still open) keeps the shared writer, and its lines go to
   whatever file next takes the freed descriptor number.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from supervisor import outstream
from supervisor.events import render


def _bytes_ahead_of_vital(line: str, lines: int) -> tuple[int, int]:
    """A writer on a real pipe nobody reads: `lines` copies of `line` queued (rank 0),
    the writer blocked, then one VITAL line. Returns (bytes read before the VITAL
    line, the pipe's own capacity)."""
    import fcntl

    r, w = os.pipe()
    cap = fcntl.fcntl(w, 1032)            # F_GETPIPE_SZ
    stream = os.fdopen(w, "w", encoding="utf-8")
    writer = outstream.writer_for(stream)
    assert writer is not None
    for _ in range(lines):
        writer.put(line)
    deadline = time.monotonic() + 5
    while not writer._busy and time.monotonic() < deadline:   # blocked in os.write
        time.sleep(0.01)
    time.sleep(0.1)
    writer.put("VITAL-MARK\n", outstream.VITAL)
    got = bytearray()
    try:
        while b"VITAL-MARK" not in got:
            chunk = os.read(r, 1 << 16)
            assert chunk, "pipe closed before the VITAL line"
            got += chunk
        assert writer.drain(5)
    finally:
        os.close(r)
        stream.close()
    return got.index(b"VITAL-MARK"), cap


@pytest.mark.xfail(strict=True, reason="review6 finding 1: VITAL_AHEAD/BATCH_CHARS count "
                   "characters; a text console's non-ASCII output lines are 4 bytes each")
def test_vital_wait_is_bounded_in_bytes():
    """What a fail_safe line waits behind on the wire, beyond what the kernel already
    held: at most the in-flight batch and VITAL_AHEAD, as bytes. A research worker
    prints 512 emoji a line (its 2048-byte max_line; printable, so the text render keeps
    them raw). On the current code: ~448 KiB beyond the pipe's 64 KiB (ASCII: 128 KiB)."""
    rec = {"ts": 0.0, "source": "research", "event": "output", "worker": "research",
           "domain": "research", "line": "\U0001F600" * 512}
    line = render(rec, "text") + "\n"
    assert len(line.encode()) > 3.5 * len(line)       # raw on the wire, 4 bytes a char
    ahead, cap = _bytes_ahead_of_vital(line, 1200)
    bound = outstream.VITAL_AHEAD + outstream.BATCH_CHARS + 8192
    assert ahead - cap <= bound, (
        f"{ahead} bytes written ahead of the VITAL line ({ahead - cap} beyond the pipe's "
        f"{cap}); bound {bound}")


def test_vital_wait_ascii_control():
    """The same with ASCII lines stays within the bound (the finding is the bytes)."""
    line = "x" * 600 + "\n"
    ahead, cap = _bytes_ahead_of_vital(line, 3000)
    assert ahead - cap <= outstream.VITAL_AHEAD + outstream.BATCH_CHARS + 8192, ahead


@pytest.mark.xfail(strict=True, reason="review6 finding 2: a writer shared by two stream "
                   "objects writes to the first one's fd; closed and reused, lines go astray")
def test_shared_writer_survives_the_other_streams_close(tmp_path):
    """Two stream objects on one pipe (stdout and stderr of one journald socket, or an
    embedding's log and monitor on dups of one fd) get one writer. The first is closed by
    its owner; a file opened next takes its descriptor number. The second stream's line
    must reach the pipe, never that file."""
    r, w = os.pipe()
    first = os.fdopen(os.dup(w), "w")
    second = os.fdopen(os.dup(w), "w")
    try:
        wa, wb = outstream.writer_for(first), outstream.writer_for(second)
        assert wa is wb                                   # the sharing under review
        wa.put("first\n")
        assert wa.drain(5)
        freed = first.fileno()
        first.close()
        victim = os.open(tmp_path / "latch", os.O_RDWR | os.O_CREAT, 0o600)
        if victim != freed:          # (usually the lowest free number already is)
            os.dup2(victim, freed)
            os.close(victim)
            victim = freed
        wb.put("second\n")
        assert wb.drain(5)
        os.close(victim)
        os.set_blocking(r, False)
        got = os.read(r, 4096)
        assert (tmp_path / "latch").read_bytes() == b"", "written into an unrelated file"
        assert got == b"first\nsecond\n", got
    finally:
        second.close()
        os.close(w)
        os.close(r)
