"""What every transport implements, and the payload stamp they all share.

The sender writes ``time.monotonic_ns()`` (CLOCK_MONOTONIC, system-wide) and the
sequence number into the payload's first 16 bytes immediately before send/publish; the
receiver reads ``time.monotonic_ns()`` as soon as it holds a numpy array of the payload.
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

HDR_BYTES = 16  # int64 send timestamp, int64 sequence number


class Skip(Exception):
    """The transport is not available in this environment."""


def now_ns() -> int:
    return time.monotonic_ns()


def u8_view(address: int, nbytes: int, _types: dict[int, type] = {}) -> np.ndarray:
    """Writable numpy uint8 view of raw memory (no copy)."""
    t = _types.get(nbytes)
    if t is None:
        t = _types[nbytes] = ctypes.c_uint8 * nbytes
    return np.frombuffer(t.from_address(address), dtype=np.uint8)


def stamp(buf: np.ndarray, seq: int) -> int:
    """Write seq and the send timestamp into the payload header; the stamp goes last."""
    hdr = buf[:HDR_BYTES].view(np.int64)
    hdr[1] = seq
    t = now_ns()
    hdr[0] = t
    return t


def read_stamp(arr: np.ndarray) -> tuple[int, int]:
    hdr = arr.reshape(-1).view(np.uint8)[:HDR_BYTES].view(np.int64)
    return int(hdr[0]), int(hdr[1])


class SenderEnd:
    def send(self, seq: int, src: np.ndarray, fill: bool) -> None:
        """Put ``src`` (with seq and timestamp in its first 16 bytes) on the wire.

        Copy-based transports stamp ``src`` in place and send it.  Loan-based ones
        loan a buffer, copy ``src`` into it when ``fill`` (outside the measured
        interval), then stamp and publish.
        """
        raise NotImplementedError

    def close(self) -> None:
        pass


class ReceiverEnd:
    def recv(self, timeout_s: float) -> tuple[int, int, int, int] | None:
        """Wait up to ``timeout_s`` for one message.

        Returns ``(t_send_ns, seq, t_recv_ns, nbytes)`` where ``t_recv_ns`` is taken as
        soon as a numpy array of the payload is held, or None on timeout.  The message
        is released before returning.
        """
        raise NotImplementedError

    def close(self) -> None:
        pass


class Transport:
    key = "?"
    label = "?"
    blocking = True   # False: the receiver busy-polls a core
    # Which endpoint must exist first: "receiver" (it creates the service, e.g. iceoryx2),
    # "sender" (the reader attaches to a live writer, e.g. the bridge) or "any".
    open_first = "any"
    note = ""

    def check(self) -> None:
        """Raise Skip if unusable here.  Runs in the parent."""

    def setup(self, nbytes: int, run_id: str) -> None:
        """Parent, before fork: create whatever both children inherit."""
        self.nbytes = nbytes
        self.run_id = run_id

    def teardown(self) -> None:
        """Parent, after both children are gone."""

    def open_sender(self) -> SenderEnd:
        raise NotImplementedError

    def open_receiver(self) -> ReceiverEnd:
        raise NotImplementedError
