"""The privileged broker (issue 27): the small root process of the split
supervisor, its client, and their fixed vocabulary (schemas/broker.capnp).

The request table (request, what it is checked against, the test that refuses it) is in
docs/broker.md. The lifecycle uses it through `supervisor.lifecycle.BrokerLauncher`
(`supervisor run --privsep`, `run --broker SOCKET`; docs/broker.md, "Phase 2").
"""
from ._client import BrokerClient, BrokerProcOpener, ProcView, StartedSandbox
from ._errors import (BadFds, BrokerError, Failed, Malformed, NotOurs, Refused, TooLarge,
                      UnknownWorker)
from ._protocol import MAX_FDS, MAX_MESSAGE, PROC_FILES, SIGNALS, Reaped

__all__ = ["BadFds", "BrokerClient", "BrokerProcOpener", "BrokerError", "Failed", "MAX_FDS", "MAX_MESSAGE",
           "Malformed", "NotOurs", "PROC_FILES", "ProcView", "Reaped", "Refused", "SIGNALS",
           "StartedSandbox", "TooLarge", "UnknownWorker"]
