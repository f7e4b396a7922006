"""systemd notify protocol (sd_notify): READY=1, WATCHDOG=1, STATUS=, STOPPING=1,
EXTEND_TIMEOUT_USEC=."""
from __future__ import annotations

import os
import socket


class Notifier:
    """Sends datagrams to $NOTIFY_SOCKET; does nothing when it is not set."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if addr.startswith("@"):
            self._addr = "\0" + addr[1:]          # abstract namespace
        elif addr.startswith("/"):
            self._addr = addr
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_s: float | None = None
        if usec.isdigit() and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._sock: socket.socket | None = None
        if self._addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str | int) -> None:
        if self._sock is None:
            return
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items())
        try:
            self._sock.sendto(msg.encode(), self._addr)
        except OSError:
            pass  # systemd gone or socket full: never fatal for the supervisor

    def ready(self, status: str = "") -> None:
        self.send(ready=1, **({"status": status} if status else {}))

    def watchdog(self) -> None:
        self.send(watchdog=1)

    def status(self, text: str) -> None:
        self.send(status=text)

    def stopping(self) -> None:
        self.send(stopping=1)

    def extend(self, seconds: float) -> None:
        """systemd's start or stop timeout, whichever runs now, becomes "another message
        within `seconds`": a start or stop that makes progress is never cut off by the
        unit's fixed TimeoutStartSec=/TimeoutStopSec=, one that hangs still is."""
        self.send(extend_timeout_usec=max(1, round(seconds * 1e6)))
