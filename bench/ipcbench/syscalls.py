"""System calls per message: ``strace -f -c`` attached to each child for the measured
phase only (``ipc_latency.py --syscalls``).

Why strace and not a counter: Linux keeps no per-process count of system calls, and
the question is *which* calls a message costs (a wake-up write, a poll, a read that
drains), not only how many. The tracer is attached after the warm-up and detached
before anything is closed (the handshake is in children.py: C_TX_ARMED, C_TRACE,
C_RX_END), and inside that window the harness's own waits spin, so every call counted
is the transport's (plus whatever Python itself does per message).

ptrace makes every system call several microseconds dearer, which shifts the timing:
a transport that skips a wake-up while its reader is awake (the bridge) skips more of
them when the reader is slowed down. The counts are what each transport does in *this*
run; the voluntary context switches (sleeps) are counted alongside from getrusage.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

ATTACH_TIMEOUT_S = 10.0


class TracerError(Exception):
    """strace is missing, refused to attach, or wrote nothing."""


@dataclass
class Counts:
    """One process's system calls over the traced window, by name."""

    calls: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def available() -> str | None:
    """None when strace can be used here, else why not."""
    if shutil.which("strace") is None:
        return "strace not installed (apt-get install strace)"
    return None


def parse_summary(text: str) -> Counts:
    """The table ``strace -c`` writes: '% time seconds usecs/call calls errors syscall',
    the errors column blank when zero, a 'total' line last."""
    out = Counts()
    for line in text.splitlines():
        tok = line.split()
        if len(tok) < 5 or tok[-1] == "total" or not tok[3].isdigit():
            continue
        try:
            float(tok[0])
        except ValueError:
            continue                  # the header or the dashes
        name = tok[-1]
        out.calls[name] = out.calls.get(name, 0) + int(tok[3])
        if len(tok) >= 6 and tok[4].isdigit():
            out.errors[name] = out.errors.get(name, 0) + int(tok[4])
    return out


class Tracer:
    """``strace -f -c -p PID`` on one process, from ``attach`` until ``detach``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        fd, self._path = tempfile.mkstemp(prefix=f"ipcbench-strace-{pid}-", suffix=".txt")
        os.close(fd)
        self._proc: subprocess.Popen | None = None

    def attach(self) -> None:
        """Start strace and return once it has attached to every thread of the pid."""
        self._proc = subprocess.Popen(
            ["strace", "-f", "-c", "-o", self._path, "-p", str(self.pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        err = self._proc.stderr
        end = time.monotonic() + ATTACH_TIMEOUT_S
        seen = b""
        while b"attached" not in seen:
            left = end - time.monotonic()
            if left <= 0 or self._proc.poll() is not None:
                self._abandon()
                raise TracerError(f"strace -p {self.pid} did not attach: "
                                  f"{seen.decode(errors='replace').strip()[:200] or 'timeout'}")
            if select.select([err], [], [], min(left, 0.1))[0]:
                chunk = os.read(err.fileno(), 4096)
                if not chunk:
                    continue
                seen += chunk

    def _abandon(self) -> None:
        """strace never attached: stop it, no summary to read."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
            proc.stderr.close()
        try:
            os.unlink(self._path)
        except OSError:
            pass

    def detach(self) -> Counts:
        """Stop strace (SIGINT: it detaches and writes its summary) and read it."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
                    raise TracerError(f"strace -p {self.pid} did not stop") from None
                finally:
                    proc.stderr.close()
            with open(self._path) as f:
                text = f.read()
        finally:
            try:
                os.unlink(self._path)
            except OSError:
                pass
        counts = parse_summary(text)
        if proc is not None and not counts.calls and "total" not in text:
            raise TracerError(f"strace -p {self.pid} wrote no summary")
        return counts


def per_message(counts: Counts, messages: int) -> dict:
    """The row the report prints: calls per message in all and by name (those that
    come at least once in 100 messages), errors likewise."""
    if messages <= 0:
        return {"messages": messages}
    by = {k: round(v / messages, 3) for k, v in sorted(counts.calls.items(),
                                                          key=lambda kv: -kv[1])
          if v / messages >= 0.01}
    errs = {k: round(v / messages, 3) for k, v in counts.errors.items()
            if v / messages >= 0.01}
    return {"messages": messages, "total": counts.total, "per_msg": counts.total / messages,
            "by_name": by, "errors": errs}
