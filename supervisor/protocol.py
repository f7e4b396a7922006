"""The worker <-> supervisor contract: environment names and status lines.

Stdlib only: the runner reads it before anything that could start a thread (numpy
starts its BLAS pool at import), because Landlock restricts only the calling thread.

Status lines (worker -> supervisor, one per line on the status fd, like sd_notify):
    READY=1 [STATUS=text]   start-up is over
    WATCHDOG=1              still alive
    STATUS=text             free-form status for the event log and the live line
    REFUSED=<kind> <detail> the import guard refused something (reported even when the
                            worker swallows the exception)
    STANDBY=1               a warm standby finished its start-up and waits for channels
"""
from __future__ import annotations

ENV_NAME = "TRIO_WORKER"
ENV_DOMAIN = "TRIO_DOMAIN"
ENV_PROFILE = "TRIO_PROFILE"      # the domain's profile: which rules the runner applies
ENV_STATUS_FD = "TRIO_STATUS_FD"
ENV_CHANNELS = "TRIO_CHANNELS"
ENV_NETWORK = "TRIO_NETWORK"
# A unix socket (control-grade sandboxes): the runner sends its exec-watch listener fd.
ENV_EXECWATCH_FD = "TRIO_EXECWATCH_FD"
# A warm standby: a unix socket on which the supervisor hands over the channels when it
# activates this instance (JSON {"channels": {name: handle}, "fds": [numbers]} + fds).
ENV_STANDBY_FD = "TRIO_STANDBY_FD"
# "1" when the supervisor started the worker in a sandbox (Landlock applies then).
ENV_SANDBOXED = "TRIO_SANDBOXED"
