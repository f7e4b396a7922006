"""systemd notify protocol (sd_notify): READY=1, WATCHDOG=1, STATUS=, STOPPING=1,
EXTEND_TIMEOUT_USEC=."""
from __future__ import annotations

import os
import socket


# Fields whose message is said late rather than never: systemd acts on them once.
_KEPT = ("ready", "stopping", "extend_timeout_usec")
MAX_HELD = 32


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
        # What systemd has not taken yet (its socket full): READY=1, STOPPING=1 and the
        # timeouts are said again, in order, before anything newer; pings and status
        # texts are only news while they are new.
        self._held: list[bytes] = []
        if self._addr is not None:
            # Non-blocking: PID 1 reading its notify socket late (a daemon-reload, a
            # reexec, memory pressure) filled the queue (net.unix.max_dgram_qlen) and
            # the supervisor's event loop blocked in sendto: no last word, no exit, no
            # watchdog for as long (red team 14 row 6).
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                                       | socket.SOCK_NONBLOCK)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str | int) -> None:
        if self._sock is None:
            return
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        keep = any(k in _KEPT for k in fields)
        if self._held and not self._flush():
            if keep:
                self._hold(msg)
            return
        try:
            self._sock.sendto(msg, self._addr)
        except BlockingIOError:
            if keep:
                self._hold(msg)
        except OSError:
            pass  # systemd gone: never fatal for the supervisor

    def _flush(self) -> bool:
        """Send what was held, oldest first; True once nothing is held."""
        while self._held:
            try:
                self._sock.sendto(self._held[0], self._addr)
            except BlockingIOError:
                return False
            except OSError:
                self._held.clear()          # systemd gone: nobody to tell
                return True
            self._held.pop(0)
        return True

    def _hold(self, msg: bytes) -> None:
        if len(self._held) < MAX_HELD:
            self._held.append(msg)

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
