"""The transports bench/ipc_latency.py compares, and the harness that runs them.

* `transport`  the interface every transport implements, the payload stamp
* `pipe`, `zmq_ipc`, `iox2`, `bridge`  one module per transport
* `cost`       the bridge's per-message CPU cost, pure-Python path vs native, in-process
* `children`   the sender and receiver processes (pacing, credit, statistics)
* `harness`    one (transport, size, mode) case under supervision of the parent
* `report`     merging repeats, the tables
"""
from __future__ import annotations

from .bridge import (BridgeSpinTransport, BridgePollTransport, BridgePyTransport,
                     BridgeTransport)
from .iox2 import Iox2PollTransport, Iox2Transport, Iox2WaitSetTransport
from .pipe import PipeTransport
from .transport import Skip, Transport
from .zmq_ipc import ZmqTransport

TRANSPORTS: dict[str, type[Transport]] = {
    t.key: t for t in (PipeTransport, ZmqTransport, Iox2Transport, Iox2PollTransport,
                       Iox2WaitSetTransport, BridgeTransport, BridgePyTransport,
                       BridgePollTransport, BridgeSpinTransport)
}
DEFAULT_TRANSPORTS = ["pipe", "zmq", "iox2", "iox2-poll", "bridge-py", "bridge"]

__all__ = ["DEFAULT_TRANSPORTS", "TRANSPORTS", "BridgePollTransport", "BridgePyTransport",
           "BridgeSpinTransport",
           "BridgeTransport",
           "Iox2PollTransport", "Iox2Transport", "Iox2WaitSetTransport", "PipeTransport",
           "Skip", "Transport", "ZmqTransport"]
