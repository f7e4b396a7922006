"""The supervisor's own stall is never charged to a worker.

An event loop held for seconds (a loaded machine, a blocked write before outstream.py,
a slow fail-safe) finds a worker's honest backlog in its status pipe: a worker pinging
at 1000 lines/s (the rate limit) leaves ~3000 lines in 3 s. Read in one burst against a
one-second bucket it was `protocol_flood` (red team 8 row 5), and a refused required
control worker fails the car safe. The bucket's depth now covers a pipeful; a flood
beyond the rate is still refused (test_attacks' r-flood, round 2)."""
from __future__ import annotations

import io
import time

import pytest
import trio

from supervisor.config import loads
from supervisor.events import EventLog
from supervisor.lifecycle import Supervisor
from tests.conftest import bwrap_unusable

pytestmark = pytest.mark.sandbox
_why = bwrap_unusable()
if _why:
    pytest.skip(_why, allow_module_level=True)

CONFIG = """
[domains.control]
[workers.fast]
domain = "control"
module = "workers.probe"
args = ["--ping-ms", "1"]
watchdog_ms = 500
"""


def test_a_stall_of_the_loop_is_not_a_flood_of_the_worker() -> None:
    log = EventLog(stream=io.StringIO())
    sup = Supervisor(loads(CONFIG), log=log)

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await trio.sleep(0.3)
            time.sleep(3.0)                      # the loop held: nothing is read
            await trio.sleep(1.0)                # then the backlog, in one burst
            n.cancel_scope.cancel()

    trio.run(main)
    refused = log.of("refused", "fast")
    assert not refused, refused
    assert not log.of("exit", "fast"), log.of("exit", "fast")
    assert [e["worker"] for e in log.of("stopped")] == ["fast"]
