"""Turning a Config into supervised, sandboxed processes (trio).

One task per worker in a nursery. Start order follows channel dependencies: a worker
starts once every worker before it in ``Config.start_order()`` reported READY. Exits
are restarted per the worker's policy with exponential backoff and a rate limit; a
worker that stops pinging its watchdog is killed and restarted; a control worker that
runs out of restarts triggers the domain's failure policy ("fail_safe" stops the whole
control domain). Every decision is one structured log line.

When the writer of an actuation channel dies, whatever the cause, the supervisor
publishes the payload's safe value at once as the channel's writer of last resort, and
only then hands the channel to the next writer (standby or restart). A process caught
dying by a maps scan is an exit, not a refusal. Every death is an `exit` event, at
shutdown too.

The package in parts: `_supervisor` (Supervisor: start order, one task per worker,
restart policy, watchdog, fail-safe, shutdown, the main loop), `_lastword` (the writer of
last resort: a thread blocked on the actuation writers' pidfds says SAFE), `_io`
(status and output pipes; when READY was said), `_exec` (READY verification and the exec
watch), `_standby` (warm standbys, two deep), `_procstate` (is a process dying or dead,
from /proc), `_run` (WorkerRun: one worker's policy state, the exceptions),
`_incarnation` (one process of a worker; started in-process or by the privileged
broker) and `_privsep` (`run --privsep`/`--broker`: the supervisor proper unprivileged).
"""
from supervisor.exits import Exit
from supervisor.failsafe import FailSafeLatch

from ._incarnation import (BrokerIncarnation, BrokerLauncher, DirectLauncher, Incarnation,
                           PopenIncarnation)
from ._privsep import BrokerLatch, PrivsepError, connect_broker, start_privsep
from ._run import FailSafe, StartFailed, WorkerRun
from ._supervisor import Supervisor, run_config

__all__ = ["BrokerIncarnation", "BrokerLatch", "BrokerLauncher", "DirectLauncher", "Exit",
           "FailSafe", "FailSafeLatch", "Incarnation", "PopenIncarnation", "PrivsepError",
           "StartFailed", "Supervisor", "WorkerRun", "connect_broker", "run_config",
           "start_privsep"]
