"""The privileged broker (issue 27, phase 1): the small root process of the split
supervisor, its client, and their fixed vocabulary (schemas/broker.capnp).

The request table (request, what it is checked against, the test that refuses it) is in
docs/broker.md. Phase 1 builds and tests the broker on its own; the lifecycle does not
use it yet (docs/broker.md, "Phase 2").
"""
from ._client import BrokerClient, BrokerProcOpener, ProcView, StartedSandbox
from ._errors import (BadFds, BrokerError, Failed, Malformed, NotOurs, Refused, TooLarge,
                      UnknownWorker)
from ._protocol import MAX_FDS, MAX_MESSAGE, PROC_FILES, SIGNALS, Reaped

__all__ = ["BadFds", "BrokerClient", "BrokerProcOpener", "BrokerError", "Failed", "MAX_FDS", "MAX_MESSAGE",
           "Malformed", "NotOurs", "PROC_FILES", "ProcView", "Reaped", "Refused", "SIGNALS",
           "StartedSandbox", "TooLarge", "UnknownWorker"]
