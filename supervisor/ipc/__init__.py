"""The IPC tensor bridge: single-writer shared-memory channels described by Cap'n Proto.

    chan = Channel.create(ChannelSpec(name="road", slot_size=4 << 20))   # supervisor
    w = Writer(chan.writer_handle(), domain="control")                   # the one writer
    with w.loan() as loan:
        loan.array((1208, 1928), "uint8")[...] = pixels
        loan.publish()
    nxt = NextLoan(w, (1208, 1928), "uint8")  # or the next slot loaned ahead of its data
    nxt.array[...] = pixels
    nxt.publish()                             # ... and the one after loaned at once
    r = Reader(chan.reader_handle(0))                                     # a reader
    with r.receive(timeout=1.0) as msg:
        use(msg.array)                                                    # read-only view
"""
from ._loan import NextLoan
from ._message import FrameInfo, Message
from ._types import FrameFormat, Layout, PlaneInfo, Stamp
from .channel import Channel, ReaderHandle, WriterHandle, env_name
from .errors import (BoundsError, BridgeError, ChannelTimeout, ConfigError, CrcMismatch,
                     DTypeMismatch, FormatError, FutureTimestamp, LeaseLost, MalformedHeader,
                     Rejected, SequenceError, SequenceJump, StaleMessage, TornRead)
from .reader import FUTURE_TOLERANCE_NS, Reader, ReaderStats
from .receipt import Receipt
from .spec import ChannelSpec
from .writer import Loan, Writer, WriterStats

__all__ = [
    "FUTURE_TOLERANCE_NS", "BoundsError", "BridgeError", "Channel", "ChannelSpec",
    "ChannelTimeout", "ConfigError", "CrcMismatch", "DTypeMismatch", "FormatError",
    "FrameFormat", "FrameInfo", "FutureTimestamp", "Layout", "LeaseLost", "Loan",
    "MalformedHeader", "Message", "NextLoan", "PlaneInfo", "Reader", "ReaderHandle",
    "ReaderStats", "Receipt", "Rejected", "SequenceError", "SequenceJump", "Stamp", "StaleMessage",
    "TornRead", "Writer", "WriterHandle", "WriterStats", "env_name",
]
