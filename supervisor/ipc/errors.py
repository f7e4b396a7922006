"""Typed errors of the bridge. Every rejection a reader can see is a ``Rejected``
subclass with a short ``reason`` used as its counter key."""
from __future__ import annotations


class BridgeError(Exception):
    """Base of every bridge error."""


class ConfigError(BridgeError, ValueError):
    """A channel spec or handle is not usable."""


class ChannelTimeout(BridgeError, TimeoutError):
    """No message arrived within the timeout."""


class Rejected(BridgeError):
    """A message was refused; the reader counts it under ``reason`` and carries on."""

    reason = "rejected"

    def __init__(self, channel: str, detail: str, sequence: int | None = None) -> None:
        self.channel = channel
        self.detail = detail
        self.sequence = sequence
        at = f" seq {sequence}" if sequence is not None else ""
        super().__init__(f"channel {channel!r}{at}: {self.reason}: {detail}")


class MalformedHeader(Rejected):
    reason = "malformed_header"


class BoundsError(Rejected):
    reason = "out_of_bounds"


class DTypeMismatch(Rejected):
    reason = "dtype_mismatch"


class FormatError(Rejected):
    reason = "bad_frame_format"


class SequenceError(Rejected):
    reason = "sequence_not_increasing"


class SequenceJump(Rejected):
    """A sequence number no honest writer reaches from the reader's position (layout
    SEQ_HONEST): refused without moving the reader, so the supervisor's last word,
    which continues above every reader's position, still comes after it."""

    reason = "sequence_jump"


class StaleMessage(Rejected):
    reason = "stale"


class FutureTimestamp(Rejected):
    """A publish, frame capture or receipt capture timestamp later than the reader's
    clock (beyond the bridge's tolerance): the writer lies about time, and a message
    with a negative age would otherwise pass every freshness check downstream."""

    reason = "future"

    def __init__(self, channel: str, which: str, ts_ns: int, now_ns: int,
                 tolerance_ns: int, sequence: int | None = None) -> None:
        self.which = which              # "publish", "frame capture" or "receipt capture"
        self.ts_ns = ts_ns
        self.ahead_ns = ts_ns - now_ns
        super().__init__(channel, f"{which} timestamp is {self.ahead_ns / 1e6:.1f} ms in "
                         f"the future (tolerance {tolerance_ns / 1e6:g} ms)", sequence)


class CrcMismatch(Rejected):
    reason = "crc_mismatch"


class TornRead(Rejected):
    """The writer reused the slot while it was being read; retrying is pointless."""

    reason = "overwritten_during_read"


class LeaseLost(BridgeError):
    """The slot behind a message was reused by the writer (the lease expired or the reader
    stalled). Any result computed from the view since the last check is invalid."""
